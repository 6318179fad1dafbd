"""Shared fixtures: every test starts with no VCGA_* variables and a fresh plugin manager."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True, scope="session")
def private_user_cache(tmp_path_factory: pytest.TempPathFactory):
    """VCGA's user cache (plugin verdicts, vcga.usercache) in a folder of this session, never the
    user's: XDG_CACHE_HOME, not VCGA_CACHE_DIR, so it reaches every subprocess (tests strip VCGA_*)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_vcga(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed `vcga` console script in a subprocess, as a user would."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full_env.update(env or {})
    return subprocess.run([str(VENV_BIN / "vcga"), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL)
