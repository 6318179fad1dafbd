"""vcga.spawn.run_ranks: the local world behind the gloo capability measurement and the benchmarks."""

from __future__ import annotations

import os
import uuid

import pytest

from vcga.spawn import RanksFailed, run_ranks


@pytest.fixture(scope="module", autouse=True)
def plain_server() -> None:
    """This worker's rank server, if one runs, is stopped first: it holds what the suite asks every
    server to import (tests/conftest.py) and what earlier test modules asked for, and the server
    keeps what it has, so every restart these tests provoke would import all of it again (torch,
    dynamo, the fused loops: about 3.5 CPU-s a start, against 1.5 for torch alone)."""
    from multiprocessing import forkserver

    from vcga import spawn

    if forkserver._forkserver._forkserver_pid is not None and not spawn._ranks_alive():
        forkserver._forkserver._stop()  # the one way to end the server (CPython private)
        spawn._server.clear()


@pytest.fixture(autouse=True)
def library_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server as the library starts it: without what the suite asks every server to import
    (tests/conftest.py), which the restarts these tests provoke would otherwise import each time."""
    from vcga import spawn

    monkeypatch.setattr(spawn, "_always", set())


def _reports(rank: int, world: int, port: int, salt: int, queue) -> None:
    if rank == 0:
        queue.put((world, salt, isinstance(port, int) and port > 0))


def _rank_one_dies(rank: int, world: int, port: int, queue) -> None:
    if rank == 1:
        raise SystemExit(3)
    # rank 0 reports nothing: only rank 1's exit can end the wait before the timeout


def _world_rank(rank: int, world: int, init_method: str, fail_on: int) -> tuple:
    if rank == fail_on:
        raise ValueError(f"rank {rank} was told to fail")
    return rank, world, init_method.startswith("tcp://127.0.0.1:"), os.environ.get("VCGA_TIMEOUT"), os.getpid()


def test_run_world_returns_every_ranks_value_in_rank_order_or_each_failure_with_its_traceback() -> None:
    from vcga.spawn import run_world
    from vcga.testing import WORLD_ENV, WorldFailed
    from vcga.testing import run_world as test_world

    got = run_world(_world_rank, 3, -1, env={"VCGA_TIMEOUT": "7"}, timeout=120)
    assert [g[:4] for g in got] == [(r, 3, True, "7") for r in range(3)] and len({g[4] for g in got}) == 3
    assert [g[3] for g in test_world(_world_rank, 2, -1)] == [WORLD_ENV["VCGA_TIMEOUT"]] * 2  # the test defaults
    with pytest.raises(RanksFailed, match=r"ranks \[1\] failed") as info:
        run_world(_world_rank, 2, 1, timeout=120)
    assert "ValueError: rank 1 was told to fail" in str(info.value) and "Traceback" in str(info.value)
    with pytest.raises(WorldFailed, match="--- rank 0:\nValueError: rank 0 was told to fail"):
        test_world(_world_rank, 2, 0)
    assert issubclass(WorldFailed, AssertionError)


def test_returns_what_rank_0_puts() -> None:
    assert run_ranks(_reports, 2, 7, timeout=120) == (2, 7, True)


def test_a_dead_rank_ends_the_wait_at_once_naming_it() -> None:
    with pytest.raises(RanksFailed, match=r"ranks \[1\] failed"):
        run_ranks(_rank_one_dies, 2, timeout=600)  # waiting for the timeout would exceed pytest-timeout (300 s)


# ---------------------------------------------------------------------------------------------------
# get_context: ranks forked from a server that has imported torch, started as spawned ones would be
# ---------------------------------------------------------------------------------------------------

def _describe(queue) -> None:
    """Runs in the rank, first thing: what it inherited."""
    import os
    import sys

    torch_there = "torch" in sys.modules  # before this function imports anything
    import torch
    import torch.distributed as dist

    queue.put({"pid": os.getpid(), "ppid": os.getppid(), "torch_preloaded": torch_there,
               "cuda_initialized": torch.cuda.is_initialized(), "vcga_backend": "vcga" in dist.Backend.backend_list,
               "marker": os.environ.get("VCGA_TEST_MARKER"), "gone": os.environ.get("VCGA_TEST_GONE")})


def _say(text: str) -> None:
    import os

    os.write(1, f"out:{text}\n".encode())
    os.write(2, f"err:{text}\n".encode())


def _one(ctx, target, *args, timeout: float = 120):
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, queue))
    p.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        p.join(timeout=30)
        assert p.exitcode == 0


def test_ranks_are_forked_from_a_server_that_imported_torch_and_no_device(monkeypatch) -> None:
    import os

    from vcga.spawn import get_context

    ctx = get_context()
    assert ctx.get_start_method() == "forkserver"
    monkeypatch.setenv("VCGA_TEST_GONE", "set while the server may start")
    ctx = get_context()
    # the environment a spawned rank would see: the parent's at start(), not the server's
    monkeypatch.setenv("VCGA_TEST_MARKER", "set after the server started")
    monkeypatch.delenv("VCGA_TEST_GONE")
    a = _one(ctx, _describe)
    b = _one(ctx, _describe)
    assert a["torch_preloaded"] and b["torch_preloaded"]
    assert a["ppid"] == b["ppid"] != os.getpid()  # both forked by the one server
    assert not a["cuda_initialized"]
    assert a["vcga_backend"]  # torch.backends entry points ran in the child
    assert a["marker"] == "set after the server started" and a["gone"] is None


def _register_at_exit(path: str, queue) -> None:
    import atexit
    from pathlib import Path

    atexit.register(lambda: Path(path).write_text("ran"))
    queue.put("registered")


def test_a_forked_rank_runs_its_atexit_hooks_as_a_spawned_one_does(tmp_path) -> None:
    from vcga.spawn import get_context

    ctx = get_context()
    assert ctx.get_start_method() == "forkserver"
    assert _one(ctx, _register_at_exit, str(tmp_path / "hook")) == "registered"
    assert (tmp_path / "hook").read_text() == "ran"


#: A module the server preloads (test below): it makes an object with an exit-time finalizer, as
#: torch makes its operator libraries, and the finalizer notes the pid of the process it ran in.
_SERVER_FINALIZER = """
import contextlib, os, weakref

class Held:
    pass

held = Held()

def _note(path):
    with contextlib.suppress(OSError):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\\n")

weakref.finalize(held, _note, PATH)
"""


def _finalizers_at_exit(module: str, path: str, queue) -> None:
    import os
    import sys
    import weakref
    from pathlib import Path

    class Mine:
        pass

    mine = Mine()
    weakref.finalize(mine, Path(path).write_text, "ran")
    queue.put((os.getpid(), module in sys.modules))  # the server's import, inherited


def test_a_forked_rank_leaves_the_servers_exit_finalizers_and_runs_its_own(tmp_path, monkeypatch) -> None:
    """What the server made at import has exit-time finalizers (torch: one per operator library);
    a child skips them at its exit (they would only undo its own copy, which os._exit discards),
    and still runs those of what it made itself."""
    from vcga.spawn import get_context

    name = f"vcga_finalizer_probe_{uuid.uuid4().hex}"
    noted = tmp_path / "server_finalizer"
    (tmp_path / f"{name}.py").write_text(_SERVER_FINALIZER.replace("PATH", repr(str(noted))))
    monkeypatch.syspath_prepend(str(tmp_path))
    pid, preloaded = _one(get_context([name]), _finalizers_at_exit, name, str(tmp_path / "own"))
    assert preloaded
    assert (tmp_path / "own").read_text() == "ran"
    assert not noted.exists() or str(pid) not in noted.read_text().split()


def test_a_forked_rank_writes_to_the_parents_stdout_and_stderr_at_start(tmp_path) -> None:
    import os

    from vcga.spawn import get_context

    ctx = get_context()
    saved = [os.dup(1), os.dup(2)]
    out, err = tmp_path / "out", tmp_path / "err"
    try:
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT)
            os.dup2(f, fd)
            os.close(f)
        p = ctx.Process(target=_say, args=("hello",))
        p.start()
        p.join(timeout=120)
    finally:
        for fd, old in zip((1, 2), saved, strict=False):
            os.dup2(old, fd)
            os.close(old)
    assert p.exitcode == 0
    assert out.read_text() == "out:hello\n" and err.read_text() == "err:hello\n"


def _threads(queue) -> None:
    import os

    import torch

    queue.put((os.getppid(), torch.get_num_threads()))


def _hold(event, queue) -> None:
    queue.put("up")
    event.wait(120)


def test_start_method_switch(monkeypatch) -> None:
    from vcga.errors import VcgaConfigError
    from vcga.spawn import START_METHOD_ENV, get_context

    assert get_context().get_start_method() == "forkserver"
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert get_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(VcgaConfigError, match=START_METHOD_ENV):
        get_context()
    monkeypatch.delenv(START_METHOD_ENV)
    assert get_context().get_start_method() == "forkserver"


def test_a_changed_import_time_variable_restarts_the_server_or_spawns(monkeypatch) -> None:
    """OMP_NUM_THREADS is read once, by `import torch`: a rank must see the value the parent has at
    start(), as a spawned one would -- from a new server, or spawned while the old one has ranks."""
    from vcga.spawn import get_context

    ctx = get_context()
    server, _ = _one(ctx, _threads)
    default = torch_threads_default()
    want = 1 if default != 1 else 2
    monkeypatch.setenv("OMP_NUM_THREADS", str(want))
    ctx = get_context()
    assert ctx.get_start_method() == "forkserver"
    new_server, threads = _one(ctx, _threads)
    assert threads == want and new_server != server

    event = ctx.Event()
    queue = ctx.Queue()
    holder = ctx.Process(target=_hold, args=(event, queue))
    holder.start()
    try:
        assert queue.get(timeout=120) == "up"
        monkeypatch.setenv("OMP_NUM_THREADS", str(default))
        spawned = get_context()  # the server cannot stop while its rank runs: stopping loses the exit code
        assert spawned.get_start_method() == "spawn"
        assert _one(spawned, _threads)[1] == default
    finally:
        event.set()
        holder.join(timeout=60)
    assert holder.exitcode == 0


def _nvml_check(queue) -> None:
    import os

    queue.put((os.getppid(), os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")))


def test_a_variable_read_when_used_reaches_the_rank_without_a_new_server(monkeypatch) -> None:
    """PYTORCH_NVML_BASED_CUDA_CHECK (set by importing Lightning) is read by torch.cuda when called,
    not at import: the rank gets the parent's value from the same server."""
    from vcga.spawn import get_context

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    server, seen = _one(get_context(), _nvml_check)
    assert seen is None
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    again, seen = _one(get_context(), _nvml_check)
    assert (again, seen) == (server, "1")  # (a variable read at import: the test above)


def torch_threads_default() -> int:
    import torch

    return torch.get_num_threads()


def _modules(names, queue) -> None:
    import sys

    queue.put([n in sys.modules for n in names])


def test_preload_asks_the_server_for_more_modules() -> None:
    from vcga.spawn import get_context

    names = ["email.mime.text"]  # nothing the server imports brings it (the suite's server imports a lot)
    assert _one(get_context(), _modules, names) == [False]
    assert _one(get_context(names), _modules, names) == [True]


def test_preload_finds_a_module_on_the_parents_sys_path(tmp_path, monkeypatch) -> None:
    """A module found only through this process's ``sys.path`` (a test folder's, as
    tests/rank_preload.py) is imported by the server as well: before Python 3.12.8 multiprocessing
    hands the server that path and ignores it, and the import failed there without a word."""
    from vcga.spawn import get_context

    name = f"vcga_preload_probe_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _one(get_context([name]), _modules, [name]) == [True]


def test_add_preload_reaches_every_later_server_and_starts_none(monkeypatch) -> None:
    from vcga import spawn

    # (library_server: the session's own list is set aside, and comes back after)
    names = ["wsgiref.validate"]  # neither the server nor coverage.py (when measuring) imports it
    assert _one(spawn.get_context(), _modules, names) == [False]
    server = spawn._server.get("pid"), _forkserver_pid()
    spawn.add_preload(names)
    assert (spawn._server.get("pid"), _forkserver_pid()) == server  # nothing started or stopped
    assert _one(spawn.get_context(), _modules, names) == [True]  # get_context() alone: the server has it now


def _forkserver_pid():
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


_EXTENSION_SCRIPT = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
from vcga.spawn import get_context

def rank(queue):
    queue.put(os.getpid())

if __name__ == "__main__":
    ctx = get_context()
    queue = ctx.Queue()
    p = ctx.Process(target=rank, args=(queue,))
    p.start()
    print(queue.get(timeout=120))
    p.join(timeout=30)
'''


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_device_extensions_load_in_each_rank_never_in_the_server(tmp_path, autoload: str) -> None:
    """A torch.backends entry point (how torch_npu and torch_mlu load at `import torch`) records
    which process called it: the rank, after the fork -- never the server, whose children would
    inherit an opened device runtime -- and nobody when TORCH_DEVICE_BACKEND_AUTOLOAD=0."""
    import subprocess
    import sys

    dist_info = tmp_path / "fake_device_ext-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-device-ext\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[torch.backends]\nfake_device = fake_device_ext:load\n")
    (tmp_path / "fake_device_ext.py").write_text(
        "import os\n"
        "def load():\n"
        "    with open(os.environ['FAKE_EXT_LOG'], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n")
    log = tmp_path / "calls"
    log.touch()
    script = tmp_path / "start_one.py"
    script.write_text(_EXTENSION_SCRIPT)
    env = {**os.environ, "FAKE_EXT_LOG": str(log), "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=240, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    rank_pid = int(r.stdout.split()[-1])
    assert log.read_text().split() == ([str(rank_pid)] if autoload == "1" else [])
