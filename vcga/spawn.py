"""Run a small world of local processes and collect a result: the gloo plugin's capability
measurement, the multi-process benchmarks and ``vcga bench --nranks N`` share this.

Spawned, not forked (torch and gloo threads do not survive a fork); each rank gets a free TCP port
for its rendezvous. A rank that exits non-zero ends the wait at once instead of leaving the caller
waiting for the whole timeout.
"""

from __future__ import annotations

import queue as queue_mod
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["run_ranks", "stream_ranks", "RanksFailed"]


class RanksFailed(RuntimeError):
    """A rank exited with an error, or no result came within the timeout."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> Any:
    """Spawn ``world`` processes running ``target(rank, world, port, *args, queue)`` with a free TCP
    port for their rendezvous; return the first thing a rank puts on ``queue`` (rank 0's results).

    :raises RanksFailed: a rank exited non-zero first (its traceback is on stderr), or ``timeout``
        seconds passed without a result."""
    import multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return queue.get(timeout=1.0)
            except queue_mod.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RanksFailed(f"ranks {failed} failed (see their tracebacks above)" if failed
                                      else f"no result within {timeout:g} s") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


#: What a rank puts on the queue of :func:`stream_ranks` when it has nothing more to say.
END = "__vcga_stream_end__"


def stream_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600,
                 env: dict[str, str] | None = None) -> Iterator[Any]:
    """Like :func:`run_ranks`, but yield everything the ranks put on ``queue``, as it arrives, until
    rank 0 puts :data:`END` (then wait for every rank to exit).

    ``timeout`` bounds the wait for each next item, not the whole run (a long benchmark keeps
    reporting). ``env`` is set in this process while the ranks start (spawned children inherit it)
    and restored after.

    :raises RanksFailed: a rank exited non-zero (its traceback is on stderr), or nothing came
        within ``timeout`` seconds."""
    import multiprocessing as mp
    import os

    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    saved = {k: os.environ.get(k) for k in (env or {})}
    try:
        os.environ.update(env or {})
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    clean = False
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = queue.get(timeout=1.0)
            except queue_mod.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RanksFailed(f"ranks {failed} failed (see their tracebacks above)" if failed
                                      else f"nothing from the ranks within {timeout:g} s") from None
                continue
            if isinstance(item, str) and item == END:
                clean = True
                break
            deadline = time.monotonic() + timeout
            yield item
        for p in procs:
            p.join(timeout=60)
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            raise RanksFailed(f"ranks {failed} failed (see their tracebacks above)")
    finally:
        for p in procs:
            if not clean:
                p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
