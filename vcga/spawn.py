"""Start local rank processes cheaply, and run a small world of them: the gloo plugin's capability
measurement, ``vcga verify``'s worlds, ``vcga bench --nranks N``, the multi-process benchmarks and
the tests share this.

:func:`get_context` is the multiprocessing context for rank processes. A fresh interpreter
(``spawn``) spends about 2 s of CPU in ``import torch`` before doing anything, and ``vcga verify``
starts a dozen ranks; so on Linux it is a *forkserver* that has imported torch once: each rank is
forked from it, with torch already loaded. What a rank sees is
kept equal to ``spawn`` (see :class:`_Process`): the parent's environment and stdout/stderr at
``start()``, its ``sys.path``, working directory and ``__main__``.

Why this is safe on accelerator machines: a forked child must not inherit an initialised device
runtime (CUDA, CANN, CNRT), and torch starts no threads at import. The server imports torch with
device extensions turned off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so torch_npu / torch_mlu are
not loaded) and never touches ``torch.cuda``; each child then loads the device extensions itself,
after the fork, exactly as its own ``import torch`` would have. Only the variables ``import torch``
reads (``TORCH_*``, ``OMP_*``, ...; :data:`IMPORT_ENV_PREFIXES`) are those of the moment the server
started; when the parent has changed one of them since, the server is started again (or, while
ranks of the old one still run, ranks are spawned instead).

``VCGA_START_METHOD=spawn`` turns the forkserver off (a fresh interpreter per rank).

:func:`run_ranks` spawns ``world`` ranks with a free TCP port (:func:`free_port`) for their
rendezvous and returns what rank 0 reports; :func:`stream_ranks` yields everything the ranks report;
:func:`run_world` returns every rank's return value, with the traceback of a rank that raised. A
rank that exits non-zero ends the wait at once instead of leaving the caller waiting for the whole
timeout. (:func:`vcga.testing.run_world` is :func:`run_world` with a test's defaults.)
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.context as mp_context
import os
import queue as queue_mod
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vcga.errors import VcgaConfigError

__all__ = ["run_ranks", "run_world", "stream_ranks", "RanksFailed", "get_context", "add_preload", "free_port",
           "START_METHOD_ENV", "IMPORT_ENV_PREFIXES"]

#: The environment variable that chooses how rank processes start: ``forkserver`` (the default
#: where the platform has it) or ``spawn``.
START_METHOD_ENV = "VCGA_START_METHOD"

#: Environment variables that ``import torch`` (or the interpreter and the libraries it loads)
#: read once, at import: a forkserver child keeps the values the server saw.
IMPORT_ENV_PREFIXES = ("TORCH_", "PYTORCH_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON",
                       "CUDA_", "ASCEND_", "NEUWARE_", "MLU_")
#: Variables under those prefixes that are read when used, not at import: a child has the parent's
#: environment at ``start()``, so a change needs no new server. Lightning sets the first one in
#: ``os.environ`` when it is imported (torch reads it in ``torch.cuda.is_available()``).
CALL_TIME_ENV = frozenset({"PYTORCH_NVML_BASED_CUDA_CHECK"})

#: What the forkserver imports before it forks anything (see :mod:`vcga._preload`).
_PRELOAD = "vcga._preload"

#: Carries this process's ``sys.path`` to the server's preload imports (read by :mod:`vcga._preload`):
#: multiprocessing hands it over but ignores it before Python 3.12.8 and 3.13.1 (CPython
#: gh-117378), so a preloaded module found only through the parent's path failed to import there,
#: silently, and every rank imported it itself.
SERVER_SYS_PATH_ENV = "VCGA_SPAWN_SERVER_SYS_PATH"

_lock = threading.Lock()
_server: dict[str, Any] = {}  # pid: the process that started it; env, preload: what it imported under
_always: set[str] = set()  # what add_preload() asked every server of this process to import


class RanksFailed(RuntimeError):
    """A rank exited with an error, or no result came within the timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the kernel found free a moment ago: for a rendezvous of local
    ranks (another process may take it before the ranks bind it; the window is short)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_ENV_PREFIXES) and k not in CALL_TIME_ENV}


class _Stdio:
    """The parent's stdout and stderr at ``start()``, carried to a forkserver child as file
    descriptors (a spawned child inherits them; a forked one would have the server's)."""

    def __init__(self, fds: list[Any] | None = None) -> None:
        self.fds = fds or []

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        # Pickled inside Popen._launch, which sends every DupFd's descriptor to the child.
        fds: list[Any] = []  # a DupFd (one of multiprocessing's private classes) or None per stream
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed in the parent: the child keeps the server's
                fds.append(None)
                continue
            fds.append(reduction.DupFd(fd))
        return (_Stdio, (fds,))

    def install(self) -> None:
        for target, dup in zip((1, 2), self.fds, strict=False):  # made in the parent: no descriptors
            if dup is None:
                continue
            fd = dup.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


class _Process(mp_context.ForkServerProcess):
    """A forkserver process that starts and ends as a spawned one would: the parent's environment
    and stdout/stderr at ``start()``, the device extensions loaded after the fork, no hold on the
    server's lifetime, and its atexit hooks run at the end. (Python's ``random`` reseeds itself
    after a fork; the server imports nothing else with a global random state.) Torch's intra-op
    thread count is set once at the start, to the count the child inherited: that replaces the
    thread pool a fork leaves behind before the child has a second thread."""

    def start(self) -> None:
        self._vcga_env = dict(os.environ)
        self._vcga_stdio = _Stdio()
        super().start()

    def run(self) -> None:
        _like_a_spawned_child(self._vcga_env, self._vcga_stdio)
        _leave_the_servers_exit_finalizers()
        try:
            super().run()
        finally:
            # A spawned child runs its atexit hooks (sys.exit); a forked one ends in os._exit and
            # would skip them: an async checkpoint save still writing, a group's threads to wait for.
            atexit._run_exitfuncs()


def _leave_the_servers_exit_finalizers() -> None:
    """The exit-time finalizers (``weakref.finalize``, ``atexit=True``) of objects the server made
    while it imported torch and the preloads are taken off this child's exit, before the child runs
    any code of its own. They only undo the server's state in this process's copy: torch
    deregisters each of its ~180 operator libraries, numba frees its compiled code. Run at a rank's
    exit they cost about 0.03 CPU-s, half of a small rank's CPU (docs/testing.md, "Running the
    tests"), for nothing: the child ends in ``os._exit`` and its memory goes with it. Nor is a
    child's exit the place for the parent's cleanup (a ``TemporaryDirectory`` the server made would
    be removed by its first child's exit). What the child makes itself, and every ``atexit`` hook,
    runs at its exit; a finalizer of the server's object runs when the child drops the
    object."""
    for fin in list(weakref.finalize._registry):  # type: ignore[attr-defined]  # CPython private: the live finalizers
        fin.atexit = False


def _like_a_spawned_child(env: dict[str, str], stdio: _Stdio) -> None:
    os.environ.clear()
    os.environ.update(env)
    stdio.install()
    # The server's copy of the "alive" pipe makes it live until every child has exited; without it
    # the server exits with the parent, and a child that asked to die with its parent
    # (PR_SET_PDEATHSIG, as vcga verify's ranks do) dies with it. A process forked here that
    # starts ranks of its own gets a server of its own (multiprocessing starts one on first use).
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        try:
            os.close(alive)
        except OSError:
            pass
        forkserver._forkserver._forkserver_alive_fd = None  # type: ignore[attr-defined]  # CPython private
    from vcga import _autoload

    torch = sys.modules.get("torch")
    if torch is not None:
        # A server that set torch's thread count (the compressors' preload does) made torch's
        # intra-op pthreadpool, which a forked child must replace: torch does that at the child's
        # first call that asks for the pool, without a lock (caffe2's pthreadpool(): release the
        # old pool, make a new one). Every thread's first parallel operation asks for it, so two
        # threads of a rank (gloo's workers, the bridge's) could ask at once, and one got no pool:
        # "Invalid thread pool!" in a bridge rank's all_gather. Asked here, while the child has one
        # thread, the replacement is done before any other thread exists.
        torch.set_num_threads(torch.get_num_threads())
    # What the server's `import torch` left out: the torch.backends entry points (device extensions
    # and VCGA's own registration), under this child's environment.
    autoload = getattr(torch, "_is_device_backend_autoload_enabled", None)
    if torch is not None and autoload is not None and autoload():
        torch._import_device_backends()
    _autoload.install()  # a spawned child imports vcga (this module) and so runs it too


class _ForkServerContext(mp_context.ForkServerContext):
    Process = _Process


_FORKSERVER = _ForkServerContext()


def add_preload(modules: Sequence[str]) -> None:
    """Have every rank server of this process import ``modules`` too (what many of its ranks would
    each import after they start). Starts nothing: a running server takes them when
    :func:`get_context` next finds none of its ranks running. A module that fails to import with
    ImportError is left to the ranks; any other error in one would stop the server."""
    with _lock:
        _always.update(modules)


def get_context(preload: Sequence[str] = ()) -> mp_context.ForkServerContext | mp_context.SpawnContext:
    """The multiprocessing context for rank processes: a forkserver with torch imported where the
    platform has one (see the module's docstring), else ``spawn``.

    ``preload`` names more modules for the server to import (a test's heavy imports, e.g.
    ``torch.distributed.checkpoint``). The server of this process is started by the first call;
    a later call that needs more modules, or finds changed import-time variables
    (:data:`IMPORT_ENV_PREFIXES`), starts it again when none of its ranks is running. While ranks
    of the running server are alive (stopping it would lose their exit codes), missing modules are
    imported by each rank itself, and changed import-time variables make the ranks spawned ones.

    :raises VcgaConfigError: ``VCGA_START_METHOD`` is neither ``forkserver`` nor ``spawn``."""
    method = os.environ.get(START_METHOD_ENV, "").strip().lower() or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise VcgaConfigError("start_method", os.environ[START_METHOD_ENV],
                              "'forkserver' (the default where available) or 'spawn'", f"env {START_METHOD_ENV}")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    env = _import_env()
    with _lock:
        ours = _server.get("pid") == os.getpid()  # a forked child has no server of its own yet
        modules = (_server["preload"] if ours else set()) | set(preload) | _always
        running = ours and forkserver._forkserver._forkserver_pid is not None  # type: ignore[attr-defined]
        if running and (_server["env"] != env or modules != _server["preload"]):
            if _ranks_alive():
                if _server["env"] != env:
                    return mp.get_context("spawn")
                return _FORKSERVER  # the ranks import what the server lacks
            forkserver._forkserver._stop()  # type: ignore[attr-defined]  # the one way to end the server
            running = False
        if not running:
            forkserver.set_forkserver_preload([_PRELOAD, *sorted(modules)])
            _start_server(forkserver)
            _server.update(pid=os.getpid(), env=env, preload=modules)
    return _FORKSERVER


def _start_server(forkserver: Any) -> None:
    """Start the forkserver with this process's ``sys.path`` for its preload imports (``""``, the
    working directory, as the directory multiprocessing recorded at import, as spawn does)."""
    import json

    paths = [p or mp.process.ORIGINAL_DIR for p in sys.path]  # type: ignore[attr-defined]
    before = os.environ.get(SERVER_SYS_PATH_ENV)
    os.environ[SERVER_SYS_PATH_ENV] = json.dumps(paths)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop(SERVER_SYS_PATH_ENV, None)
        else:
            os.environ[SERVER_SYS_PATH_ENV] = before


def _ranks_alive() -> bool:
    """Whether a process started from this process's forkserver is still running."""
    return any(isinstance(p, _Process) for p in mp.active_children())


class _Ranks:
    """``world`` processes of :func:`get_context` running ``target(rank, world, port, *args, queue)``
    with a free TCP port for their rendezvous and one queue to report on: what :func:`run_ranks`,
    :func:`stream_ranks` and :func:`vcga.testing.run_world` share. ``env`` is set in this process
    while the ranks start (each rank starts with the parent's environment of that moment)."""

    def __init__(self, target: Callable[..., Any], world: int, args: tuple[Any, ...], *,
                 env: dict[str, str] | None = None, preload: Sequence[str] = (), daemon: bool = False) -> None:
        self.port = free_port()
        ctx = get_context(preload)
        self.queue = ctx.Queue()
        self.procs = [ctx.Process(target=target, args=(r, world, self.port, *args, self.queue), daemon=daemon)
                      for r in range(world)]
        saved = {k: os.environ.get(k) for k in (env or {})}
        try:
            os.environ.update(env or {})
            for p in self.procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def get(self, timeout: float) -> Any:
        """The next thing a rank put on the queue; :data:`_NOTHING` after ``timeout`` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue_mod.Empty:
            return _NOTHING

    def failed(self) -> list[int]:
        """The ranks that exited with an error (non-zero)."""
        return [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]

    def stop(self, join_s: float) -> None:
        """Wait up to ``join_s`` for each rank to exit; kill the ones still running."""
        for p in self.procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


_NOTHING = object()


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> Any:
    """Start ``world`` processes (:func:`get_context`) running ``target(rank, world, port, *args,
    queue)`` with a free TCP port for their rendezvous; return the first thing a rank puts on
    ``queue`` (rank 0's results).

    :raises RanksFailed: a rank exited non-zero first (its traceback is on stderr), or ``timeout``
        seconds passed without a result."""
    ranks = _Ranks(target, world, args)
    deadline = time.monotonic() + timeout
    try:
        while True:
            item = ranks.get(1.0)
            if item is not _NOTHING:
                return item
            failed = ranks.failed()
            if failed or time.monotonic() > deadline:
                raise RanksFailed(f"ranks {failed} failed (see their tracebacks above)" if failed
                                  else f"no result within {timeout:g} s")
    finally:
        ranks.stop(60)


def _world_rank(rank: int, world: int, port: int, target: Callable[..., Any], args: tuple[Any, ...],
                env: dict[str, str], results: Any) -> None:
    try:
        os.environ.update(env)
        value = target(rank, world, f"tcp://127.0.0.1:{port}", *args)
        results.put(("ok", rank, value))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, with its traceback
        results.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_world(target: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
              timeout: float = 3600, preload: Sequence[str] = ()) -> list[Any]:
    """Run ``target(rank, world, init_method, *args)`` on ``world`` processes (:func:`get_context`,
    with ``preload``) and return their return values in rank order. ``init_method`` is
    ``tcp://127.0.0.1:PORT`` on a free port; ``env`` is set in each rank before ``target`` runs.
    Leftover ranks are killed: a hang in ``target`` ends as an error, never a hung caller.

    :raises RanksFailed: a rank raised (its traceback is in the message), died without reporting,
        or had not finished after ``timeout`` seconds; the message has a section per failed rank."""
    ranks = _Ranks(_world_rank, world, (target, args, dict(env or {})), preload=preload, daemon=True)
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(out) - set(errors))
                errors.update(dict.fromkeys(missing, f"did not finish within {timeout:g} s"))
                break
            item = ranks.get(min(left, 1.0))
            if item is _NOTHING:
                dead = [r for r, p in enumerate(ranks.procs) if not p.is_alive() and r not in out and r not in errors]
                if not dead:
                    continue
                item = ranks.get(2.0)  # a rank that just exited may still have its last message in flight
                if item is _NOTHING:
                    errors.update({r: f"exited with code {ranks.procs[r].exitcode} without reporting" for r in dead})
                    continue
            kind, rank, value = item
            if kind == "ok":
                out[rank] = value
            else:
                errors[rank] = value
    finally:
        ranks.stop(10)
    if errors:
        raise RanksFailed(f"ranks {sorted(errors)} failed:\n"
                          + "\n".join(f"--- rank {r}:\n{msg}" for r, msg in sorted(errors.items())))
    return [out[r] for r in range(world)]


#: What a rank puts on the queue of :func:`stream_ranks` when it has nothing more to say.
END = "__vcga_stream_end__"


def stream_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600,
                 env: dict[str, str] | None = None) -> Iterator[Any]:
    """Like :func:`run_ranks`, but yield everything the ranks put on ``queue``, as it arrives, until
    rank 0 puts :data:`END` (then wait for every rank to exit).

    ``timeout`` bounds the wait for each next item, not the whole run (a long benchmark keeps
    reporting). ``env`` is set in this process while the ranks start (the ranks see it) and
    restored after.

    :raises RanksFailed: a rank exited non-zero (its traceback is on stderr), or nothing came
        within ``timeout`` seconds."""
    ranks = _Ranks(target, world, args, env=env)
    clean = False
    try:
        deadline = time.monotonic() + timeout
        while True:
            item = ranks.get(1.0)
            if item is _NOTHING:
                failed = ranks.failed()
                if failed or time.monotonic() > deadline:
                    raise RanksFailed(f"ranks {failed} failed (see their tracebacks above)" if failed
                                      else f"nothing from the ranks within {timeout:g} s")
                continue
            if isinstance(item, str) and item == END:
                clean = True
                break
            deadline = time.monotonic() + timeout
            yield item
        ranks.stop(60)
        failed = ranks.failed()
        if failed:
            raise RanksFailed(f"ranks {failed} failed (see their tracebacks above)")
    finally:
        ranks.stop(60 if clean else 1)
