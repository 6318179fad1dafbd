"""What the multi-process benchmarks share: spawning their ranks, printing their tables.

Not a benchmark (the leading underscore keeps it out of the list of scripts to run); imported by
``collectives.py``, ``hybrid.py`` and ``host_exchange.py``, which run as scripts with this folder
first on ``sys.path``.
"""

from __future__ import annotations

import queue as queue_mod
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> Any:
    """Spawn ``world`` processes running ``target(rank, world, port, *args, queue)`` with a free TCP
    port for their rendezvous; return the first thing a rank puts on ``queue`` (rank 0's results)."""
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
                got = queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise SystemExit(f"benchmark ranks {failed} failed (see their tracebacks above)" if failed
                                     else f"no result within {timeout:g} s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got


def table(head: Sequence[str], lines: Sequence[Sequence[str]], markdown: bool) -> str:
    """``lines`` under ``head``: a markdown table, or right-aligned plain columns."""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines])
