"""Shared fixtures: every test starts with no VCGA_* variables and a fresh plugin manager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True, scope="session")
def private_user_cache(tmp_path_factory: pytest.TempPathFactory):
    """VCGA's user cache (plugin verdicts, vcga._usercache) in a folder of this session, never the
    user's: XDG_CACHE_HOME, not VCGA_CACHE_DIR, so it reaches every subprocess (tests strip VCGA_*)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


#: The modules that take longest in a two-worker run, longest first (wall seconds measured with
#: `pytest -n 2 --dist loadfile --durations=0`, summed per module; docs/testing.md). `make test`
#: hands whole modules to its workers in collection order (`--no-loadscope-reorder`; xdist's own
#: order is "most tests first", which left these few-test, long modules for the end: the last 6 %
#: of the tests took 5 of the 11 minutes). Longest first, the short modules fill the gaps at the
#: end. Unlisted modules follow in their usual order; a stale entry costs speed, never a test.
LONG_MODULES = (
    "test_integrations.py", "test_elastic.py", "test_verify.py", "test_example_plugin.py", "test_cli.py",
    "test_torch_suite.py", "test_compression.py", "test_bridge.py", "test_elastic_multinode.py",
    "test_pg_collectives.py", "test_plugin_vetting.py", "test_pg_ddp.py", "test_bench.py", "test_multinode.py",
    "test_exit_soak.py", "test_checkpoint_world.py", "test_convert_memory.py", "test_cli_convert.py",
    "test_pg_registration.py", "test_pg_units.py", "test_gloo_capabilities.py", "test_train_mixed.py",
    "test_benchmarks_smoke.py", "test_startup.py", "test_hostbridge.py", "test_spawn.py", "test_killed_writes.py",
    "test_fuzz_readers.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order is kept


#: VCGA_* variables that steer the test suite itself, not VCGA: kept by clean_vcga_env.
HARNESS_ENV = frozenset({"VCGA_MULTINODE_REQUIRED"})
#: The harness switches as the session started with them (tests/test_multinode.py checks they reach tests).
SESSION_HARNESS_ENV = {k: os.environ[k] for k in HARNESS_ENV if k in os.environ}


@pytest.fixture(autouse=True)
def clean_vcga_env(monkeypatch: pytest.MonkeyPatch):
    for k in list(os.environ):
        # VCGA_MULTINODE_REQUIRED is the test harness's own switch (CI sets it so that the namespace
        # multi-node tests fail instead of skipping): it configures no VCGA code, so it stays.
        if k.startswith("VCGA_") and k not in HARNESS_ENV:
            monkeypatch.delenv(k)
    from vcga.plugin_manager import reset_plugin_manager

    reset_plugin_manager()
    yield
    reset_plugin_manager()


def run_vcga(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed `vcga` console script in a subprocess, as a user would."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full_env.update(env or {})
    return subprocess.run([str(VENV_BIN / "vcga"), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL)
