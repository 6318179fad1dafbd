"""The bridge's host exchange between two shard peers on one node: shared memory against gloo.

Two spawned processes hold a gloo group and a :class:`vcga.bridge.host.SharedMemoryBridge` over
it (the same objects the mixed-vendor bridge uses), and time, interleaved in the same run:

- the barrier alone: gloo's ``barrier()`` against the bridge's named-pipe barrier;
- an fp32 SUM all-reduce per size: gloo's ``allreduce`` (a two-peer ring over TCP loopback)
  against ``SharedMemoryBridge.all_reduce`` (copy into the slot, barrier, combine in peer order).

A repetition times a loop of back-to-back calls (200 for the barrier and up to 4 KiB, fewer for
larger sizes: a single small call would measure how unevenly the preceding barrier released the
two ranks) and divides; a time is the slower rank's; the ratio is the median over repetitions of
(shared memory / gloo) in the same repetition (< 1: shared memory is faster).

    .venv/bin/python benchmarks/host_exchange.py               # the table in docs/benchmarks.md
    .venv/bin/python benchmarks/host_exchange.py --reps 50 --markdown
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

from _ranks import run_ranks, table

SIZES = (4, 4 << 10, 256 << 10, 2 << 20, 8 << 20)


def human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def rank_main(rank: int, world: int, port: int, reps: int, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from vcga.bridge.host import SharedMemoryBridge
    from vcga.contract import ReduceOp

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    shm = SharedMemoryBridge.open(pg, True, 60.0)
    assert shm is not None, "no shared memory here (see the INFO log of vcga.bridge)"
    slower = torch.zeros(2, dtype=torch.float64)
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX

    def timed(fn: Any, loop: int) -> float:
        pg.barrier().wait()
        t0 = time.perf_counter()
        for _ in range(loop):
            fn()
        slower[0] = (time.perf_counter() - t0) / loop
        pg.allreduce([slower], o).wait()
        return float(slower[0])

    rows = []
    cases: list[tuple[str, int, Any, Any]] = [("barrier", 200, lambda: pg.barrier().wait(), shm._barrier)]
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        cases.append((f"all_reduce {human(nbytes)}", max(1, min(200, (1 << 20) // nbytes * 4)),
                       lambda x=x: pg.allreduce([x]).wait(), lambda x=x: shm.all_reduce(x, ReduceOp.SUM)))
    for what, loop, gloo, shared in cases:
        for _ in range(3):  # warm-up
            gloo()
            shared()
        g, s = [], []
        for i in range(reps):
            pair = [(g, gloo), (s, shared)]
            for out, fn in (pair if i % 2 == 0 else pair[::-1]):
                out.append(timed(fn, loop))
        ratios = [b / a for a, b in zip(g, s, strict=False)]
        rows.append({"what": what, "gloo_us": statistics.median(g) * 1e6, "shm_us": statistics.median(s) * 1e6,
                     "ratio": statistics.median(ratios), "range": (min(ratios), max(ratios))})
    shm.close()
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--markdown", action="store_true")
    a = parser.parse_args()
    rows = run_ranks(rank_main, 2, a.reps, timeout=600)
    head = ["what", "gloo µs", "shared memory µs", "shared memory / gloo"]
    lines = [[r["what"], f"{r['gloo_us']:.0f}", f"{r['shm_us']:.0f}",
              f"{r['ratio']:.2f} ({r['range'][0]:.2f}–{r['range'][1]:.2f})"] for r in rows]
    print(table(head, lines, a.markdown))

if __name__ == "__main__":
    main()
