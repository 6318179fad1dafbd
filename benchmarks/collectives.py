"""``vcga`` against a raw gloo process group, in the same run, interleaved.

Two ranks (spawned here, or under torchrun) each hold two groups over the same ranks: the default
group with backend ``vcga`` (on gloo: the comparison isolates what VCGA adds) and a plain
``new_group(backend="gloo")``. For every collective and size, blocks of iterations alternate between
the two groups -- gloo, vcga, gloo, vcga, ... -- so machine noise hits both alike; each block is
timed on rank 0 after a barrier. Reported per size, nccl-tests style:

- ``size``: bytes of the largest buffer (all_gather: output, reduce_scatter: input), as nccl-tests;
- ``time``: median time per call of each group's blocks;
- ``algbw`` = size / time; ``busbw`` = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
  reduce_scatter), 1 (broadcast) -- nccl-tests' doc/PERFORMANCE.md;
- ``ratio``: the median over repetitions of (vcga block time / the adjacent gloo block time).

Usage::

    python benchmarks/collectives.py                      # 4 B .. 64 MiB, all four collectives
    python benchmarks/collectives.py --min-bytes 4096 --max-bytes 1048576 --ops all_reduce
    python benchmarks/collectives.py --markdown           # the table for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _buffers(op: str, nbytes: int, n: int) -> tuple[Any, Any] | None:
    import torch

    elems = nbytes // 4  # float32
    if op in ("all_gather", "reduce_scatter"):
        if elems % n or elems == 0:
            return None
        big, small = torch.ones(elems), torch.ones(elems // n)
        return (big, small) if op == "all_gather" else (small, big)
    if elems == 0:
        return None
    return torch.ones(elems), None


def _call(op: str, bufs: tuple[Any, Any], group: Any) -> None:
    import torch.distributed as dist

    a, b = bufs
    if op == "all_reduce":
        dist.all_reduce(a, group=group)
    elif op == "broadcast":
        dist.broadcast(a, 0, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(a, b, group=group)
    else:
        dist.reduce_scatter_tensor(a, b, group=group)


def _iters(nbytes: int, budget_s: float) -> int:
    """Iterations per block: about ``budget_s`` seconds at ~1 GB/s, at least 2, at most 200."""
    return max(2, min(200, int(budget_s / (20e-6 + nbytes / 1e9))))


def bench(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation of *_tensor names
    torch.set_num_threads(1)
    vcga_group = dist.group.WORLD
    gloo_group = dist.new_group(backend="gloo")
    rows = []
    for op in args.ops:
        for nbytes in sizes(args.min_bytes, args.max_bytes):
            bufs = _buffers(op, nbytes, world)
            if bufs is None:
                continue
            k = _iters(nbytes, args.block_s)
            for g in (gloo_group, vcga_group):  # warm up both paths (and vcga's route cache)
                for _ in range(2):
                    _call(op, bufs, g)
            times: dict[str, list[float]] = {"gloo": [], "vcga": []}
            ratios = []
            for rep in range(args.reps):
                order = (("gloo", gloo_group), ("vcga", vcga_group))
                if rep % 2:  # alternate who goes first, so neither always follows the barrier
                    order = order[::-1]
                block = {}
                for name, g in order:
                    dist.barrier(group=gloo_group)
                    t0 = time.perf_counter()
                    for _ in range(k):
                        _call(op, bufs, g)
                    block[name] = (time.perf_counter() - t0) / k
                    times[name].append(block[name])
                ratios.append(block["vcga"] / block["gloo"])
            if rank == 0:
                tg, tv = statistics.median(times["gloo"]), statistics.median(times["vcga"])
                f = BUS_FACTOR[op](world)
                rows.append({"op": op, "bytes": nbytes, "iters": k, "reps": args.reps,
                             "gloo_us": tg * 1e6, "vcga_us": tv * 1e6,
                             "gloo_algbw": nbytes / tg / 1e9, "vcga_algbw": nbytes / tv / 1e9,
                             "gloo_busbw": nbytes / tg / 1e9 * f, "vcga_busbw": nbytes / tv / 1e9 * f,
                             "ratio": statistics.median(ratios)})
                if not args.quiet:
                    print(_row(rows[-1]), flush=True)
    return rows


def _fmt_size(n: int) -> str:
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n // s} {unit}"
    return f"{n} B"


HEADER = (f"{'op':<15}{'size':>9}{'gloo us':>11}{'vcga us':>11}{'gloo algbw':>11}{'vcga algbw':>11}"
          f"{'gloo busbw':>11}{'vcga busbw':>11}{'vcga/gloo':>10}")


def _row(r: dict[str, Any]) -> str:
    return (f"{r['op']:<15}{_fmt_size(r['bytes']):>9}{r['gloo_us']:>11.1f}{r['vcga_us']:>11.1f}"
            f"{r['gloo_algbw']:>11.3f}{r['vcga_algbw']:>11.3f}{r['gloo_busbw']:>11.3f}{r['vcga_busbw']:>11.3f}"
            f"{r['ratio']:>10.3f}")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| op | size | gloo time (us) | vcga time (us) | gloo algbw (GB/s) | vcga algbw (GB/s) | "
             "gloo busbw (GB/s) | vcga busbw (GB/s) | median vcga/gloo |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {_fmt_size(r['bytes'])} | {r['gloo_us']:.1f} | {r['vcga_us']:.1f} | "
                     f"{r['gloo_algbw']:.3f} | {r['vcga_algbw']:.3f} | {r['gloo_busbw']:.3f} | "
                     f"{r['vcga_busbw']:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers backend "vcga"

    os.environ.setdefault("VCGA_BACKEND", "gloo")
    dist.init_process_group("vcga", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = bench(rank, world, args)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vcga vs raw gloo, interleaved (nccl-tests style output)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--min-bytes", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--reps", type=int, default=15, help="interleaved gloo/vcga block pairs per size")
    p.add_argument("--block-s", type=float, default=0.02, help="target seconds per timed block")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", help="also write the rows as JSON to this file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    if not args.quiet:
        print(f"vcga vs gloo, {args.world_size} ranks, float32, {args.reps} interleaved block pairs per size")
        print(HEADER, flush=True)
    if "RANK" in os.environ:  # under torchrun
        import torch.distributed as dist

        import vcga  # noqa: F401

        os.environ.setdefault("VCGA_BACKEND", "gloo")
        dist.init_process_group("vcga")
        rows = bench(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        import multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, queue))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        rows = queue.get(timeout=3600)
        for proc in procs:
            proc.join(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print()
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
