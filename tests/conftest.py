"""Shared fixtures: every test starts with no VCGA_* variables and a fresh plugin manager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vcga.spawn import add_preload

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# One intra-op thread in every process of the suite -- this worker, the ranks it forks, the
# processes it starts -- unless the caller set another. A test's ranks are several processes on
# two cores: with torch's default (a thread per core) each small op (a max over a dimension, a
# rank's reference sum) wakes a second OpenMP thread that spins for a core another rank needs.
# Measured on tests/test_pg_collectives.py::test_matrix[2]: 14.1 CPU-s with two threads, 8.9 with one.
# Set before anything imports torch, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Property tests (Hypothesis) draw new examples on every run here, to find what no one wrote down;
# CI (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples every run, as Hypothesis advises
# for CI, so an unrelated change never fails there on a newly drawn example. A failing example is
# printed with its reproduction blob either way.
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the property tests skip themselves
    pass
else:
    _hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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


@pytest.fixture(autouse=True, scope="session")
def private_temp_dir(tmp_path_factory: pytest.TempPathFactory):
    """One temporary folder per session, removed at its end: what the suite's processes leave in
    the temporary directory (torchrun's ``torchelastic_*`` log folders, Ray's session, a default
    flight-recorder dump) goes there instead of the machine's /tmp. Short, under the real one: Ray
    puts Unix sockets in it, whose paths may not exceed 107 bytes. pytest's own folders (tmp_path)
    are made before and stay where they were."""
    import multiprocessing.util
    import shutil
    import tempfile

    tmp_path_factory.getbasetemp()
    multiprocessing.util.get_temp_dir()  # made now, in the real one: multiprocessing removes it at exit
    old = os.environ.get("TMPDIR")
    path = tempfile.mkdtemp(prefix="vcga-tests-")
    os.environ["TMPDIR"] = path
    tempfile.tempdir = None  # read TMPDIR anew
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None
    shutil.rmtree(path, ignore_errors=True)


# What the rank processes of many tests would each import or prepare after they start, done once
# by the rank server they fork from (tests/rank_preload.py; docs/testing.md). Nothing starts here:
# the first test that starts ranks starts the server. rank_preload imports the other two; they are
# named because `vcga verify`'s runner asks for them (its checks' preloads), and a server restarts
# for a name it was not started with.
add_preload(["rank_preload", "torch._dynamo", "vcga.compress.preload"])


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
    "test_benchmarks_smoke.py", "test_startup.py", "test_hostbridge.py", "test_killed_writes.py",
    "test_fuzz_readers.py",
)


#: Before the long modules: test_spawn.py's tests start and stop rank servers of their own (with the
#: library's preload, not the suite's), and a worker's server that ran before them is stopped
#: first. First on its worker, it stops none, and the worker starts the suite's server (about 4
#: CPU-s: torch, dynamo, the fused loops) once, after it, instead of twice.
FIRST_MODULES = ("test_spawn.py",)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST_MODULES + LONG_MODULES)}
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


@pytest.fixture
def own_exit_count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """This test's own count of what the exit drain waits for (``vcga.pypg._LIVE``): the callbacks
    and watcher threads of collectives in flight.

    First waits until what earlier tests in this process left in flight has ended (a pytest worker
    runs many modules; a late callback of theirs, released into this test's count, would make it
    wrong -- and the process's count one too high once the test restores it)."""
    from vcga import pypg

    assert pypg._drain_at_exit(30), "collectives of an earlier test are still in flight after 30 s"
    monkeypatch.setattr(pypg, "_LIVE", [0])
    return pypg._LIVE


def run_vcga(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``vcga ARGS`` in this process, as the console script would in a process of its own.

    The command sees what a fresh process would: this environment without ``VCGA_*``, plus ``env``;
    ``env``'s ``PYTHONPATH`` first on ``sys.path`` (not in the environment: an import-time variable
    would restart the rank server, and ranks and plugin vetting take ``sys.path`` from here);
    ``TMPDIR`` read anew; a fresh plugin manager; no module from those ``PYTHONPATH`` folders imported yet
    (they are set aside for the run and put back after). Its stdout and stderr come back as text; an
    exception that escapes is printed to stderr as the interpreter would, exit status 1. The rank
    processes of ``vcga verify`` and ``vcga bench`` fork from this worker's rank server, which has
    imported torch, instead of a server of the command's own: that start-up, and the command's own
    interpreter, are what running it here saves (about 2 CPU-s each). ``timeout`` is the pytest
    timeout's job here; the commands bound their own waits.

    Three things need the real process, and keep it: the console script and ``python -m vcga``
    (tests/test_cli.py), what ``--help`` imports (tests/test_pg_registration.py), and killing the
    runner (tests/test_verify.py): :func:`run_vcga_process`."""
    import signal
    import tempfile
    import traceback

    from click.testing import CliRunner

    from vcga.cli import main
    from vcga.plugin_manager import reset_plugin_manager

    env = dict(env or {})
    paths = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
    saved_env, saved_path = dict(os.environ), list(sys.path)
    saved_modules = _modules_under(paths)  # a fresh process has imported none of them
    for name in saved_modules:
        del sys.modules[name]
    saved_tmp, saved_term = tempfile.tempdir, signal.getsignal(signal.SIGTERM)
    runner = CliRunner()
    try:
        for k in [k for k in os.environ if k.startswith("VCGA_")]:
            del os.environ[k]
        os.environ.update(env)
        sys.path[:0] = [p for p in paths if p not in sys.path]
        tempfile.tempdir = None
        reset_plugin_manager()
        with runner.isolation() as (out, err, _):
            try:
                main(list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - what the interpreter would print, and its status
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        for name in _modules_under(paths):
            del sys.modules[name]
        sys.modules.update(saved_modules)
        tempfile.tempdir = saved_tmp
        signal.signal(signal.SIGTERM, saved_term)
        reset_plugin_manager()
    return subprocess.CompletedProcess(["vcga", *args], code, stdout, stderr)


def _modules_under(paths: list[str]) -> dict:
    """The imported modules whose file lies under one of ``paths`` (plugins a test puts there)."""
    roots = tuple(os.path.join(os.path.realpath(p), "") for p in paths)
    if not roots:
        return {}
    return {name: m for name, m in list(sys.modules.items())
            if isinstance(getattr(m, "__file__", None), str) and os.path.realpath(m.__file__).startswith(roots)}


def run_vcga_process(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed ``vcga`` console script in a process of its own, exactly as a user would."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full_env.update(env or {})
    return subprocess.run([str(VENV_BIN / "vcga"), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL)
