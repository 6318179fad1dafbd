"""Run a small world of local processes and collect a result: the gloo plugin's capability
measurement and the multi-process benchmarks share this.

Spawned, not forked (torch and gloo threads do not survive a fork); each rank gets a free TCP port
for its rendezvous. A rank that exits non-zero ends the wait at once instead of leaving the caller
waiting for the whole timeout.
"""

from __future__ import annotations

import queue as queue_mod
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["run_ranks", "RanksFailed"]


class RanksFailed(RuntimeError):
    """A rank exited with an error, or no result came within the timeout."""


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> Any:
    """Spawn ``world`` processes running ``target(rank, world, port, *args, queue)`` with a free TCP
    port for their rendezvous; return the first thing a rank puts on ``queue`` (rank 0's results).

    :raises RanksFailed: a rank exited non-zero first (its traceback is on stderr), or ``timeout``
        seconds passed without a result."""
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
