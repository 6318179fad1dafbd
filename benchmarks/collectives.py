"""``vcga`` against a raw gloo process group, in the same run, interleaved.

Two ranks (spawned here, or under torchrun) each hold two groups over the same ranks: the default
group with backend ``vcga`` (on gloo: the comparison isolates what VCGA adds) and a plain
``new_group(backend="gloo")``. For every collective and size, single calls alternate between the
two groups, so machine noise hits both alike; each call is timed on rank 0. Reported per size,
nccl-tests style:

- ``size``: bytes of the largest buffer (all_gather: output, reduce_scatter: input), as nccl-tests;
- ``time``: median time per call;
- ``algbw`` = size / time; ``busbw`` = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
  reduce_scatter), 1 (broadcast) -- nccl-tests' doc/PERFORMANCE.md;
- ``ratio``: the median over call pairs of (vcga call time / the adjacent gloo call time).

Usage::

    python benchmarks/collectives.py                      # 4 B .. 64 MiB, all four collectives
    python benchmarks/collectives.py --min-bytes 4096 --max-bytes 1048576 --ops all_reduce
    python benchmarks/collectives.py --markdown           # the table for docs/benchmarks.md
    python benchmarks/collectives.py --aa                 # gloo vs gloo: how far from 1.0 noise alone gets
    python benchmarks/collectives.py --hooks-off --vendors nccl:1,hccl:1 --ops all_reduce
        # the bridged all_reduce against itself with the flight recorder and span hooks off
        # (with --aa: off on both sides, how far from 1.0 noise alone gets there)
    python benchmarks/collectives.py --torch-recorder off --min-bytes 4096 --max-bytes 4096
        # torch's own flight recorder off: gloo records nothing, vcga each call once, in its ring

``--hooks-off`` replaces the gloo group by the ``vcga`` group itself with its flight recorder and
profiler-span hooks switched off for each such call (the "gloo" columns), so the ratio is what
the hooks cost; ``--vendors`` runs the ranks as simulated vendors (a mixed-vendor group: the bridge).

torch's own flight recorder (one per process, on by default in torch 2.13) records every call of a
gloo group: the plain gloo group's, and the native gloo call under each vcga call, which VCGA's
ring records as well. By default, then, gloo records each call once and vcga twice.
``--torch-recorder off`` switches torch's off for both (``TORCH_FR_BUFFER_SIZE=0``) and keeps
VCGA's (``VCGA_FR_BUFFER_SIZE``): gloo records nothing and vcga each call once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from typing import Any

from vcga.pg.comm import all_gather_single, reduce_scatter_single  # torch 2.13's names (no FutureWarning)

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
        all_gather_single(a, b, group=group)
    else:
        reduce_scatter_single(a, b, group=group)


def bench(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Alternate single calls -- gloo, vcga, vcga, gloo, gloo, vcga, ... -- timing each one.

    Per-call alternation puts the two groups under the same machine noise (this is a shared
    2-core machine); the first call of each pair alternates so neither side always runs right
    after the other. Each size gets about ``--seconds`` of calls (at least 10 pairs).
    """
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation of *_tensor names
    torch.set_num_threads(1)
    vcga_group = dist.group.WORLD
    if args.vendors and not getattr(type(vcga_group._calls.native), "records_steps", False):
        raise SystemExit(f"--vendors {args.vendors}: rank {rank}'s group is not bridged "
                         f"({type(vcga_group._calls.native).__name__})")
    gloo_group = dist.new_group(backend="gloo")
    if args.aa and not args.hooks_off:  # A/A: the "vcga" column is a second raw gloo group -- the method's noise floor
        vcga_group = dist.new_group(backend="gloo")
    clock = time.perf_counter
    before = {"gloo": _nothing, "vcga": _nothing}
    if args.hooks_off:
        gloo_group = vcga_group
        # with --aa the hooks stay off on both sides: the noise floor of this comparison
        before = {"gloo": partial(_hooks, vcga_group, False), "vcga": partial(_hooks, vcga_group, not args.aa)}
    cells = [(op, nbytes) for op in args.ops for nbytes in sizes(args.min_bytes, args.max_bytes)
             if _buffers(op, nbytes, world) is not None]
    times: dict[tuple[str, int], dict[str, list[float]]] = {c: {"gloo": [], "vcga": []} for c in cells}
    ratios: dict[tuple[str, int], list[float]] = {c: [] for c in cells}
    pair = (("gloo", gloo_group), ("vcga", vcga_group))
    # --rounds R sweeps every (op, size) R times with 1/R of its budget each: a burst of machine
    # noise then lands on a slice of every size instead of on all of one size's samples.
    for _ in range(args.rounds):
        for op, nbytes in cells:
            bufs = _buffers(op, nbytes, world)
            t0 = clock()
            for g in (gloo_group, vcga_group, gloo_group, vcga_group):  # warm up (and fill vcga's route cache)
                _call(op, bufs, g)
            est = (clock() - t0) / 4
            # every rank must run the same number of pairs: rank 0 decides
            budget = args.seconds / args.rounds
            n = torch.tensor([max(10 // args.rounds or 1, min(args.max_pairs, int(budget / (2 * est))))],
                             dtype=torch.int64)
            dist.broadcast(n, 0, group=gloo_group)
            for i in range(int(n.item())):
                one = {}
                for name, g in (pair if i % 2 == 0 else pair[::-1]):
                    before[name]()
                    t = clock()
                    _call(op, bufs, g)
                    one[name] = clock() - t
                    times[(op, nbytes)][name].append(one[name])
                ratios[(op, nbytes)].append(one["vcga"] / one["gloo"])
            del bufs
    before["vcga"]()
    rows = []
    if rank == 0:
        for op, nbytes in cells:
            tg, tv = statistics.median(times[(op, nbytes)]["gloo"]), statistics.median(times[(op, nbytes)]["vcga"])
            f = BUS_FACTOR[op](world)
            rows.append({"op": op, "bytes": nbytes, "pairs": len(ratios[(op, nbytes)]),
                         "gloo_us": tg * 1e6, "vcga_us": tv * 1e6,
                         "gloo_algbw": nbytes / tg / 1e9, "vcga_algbw": nbytes / tv / 1e9,
                         "gloo_busbw": nbytes / tg / 1e9 * f, "vcga_busbw": nbytes / tv / 1e9 * f,
                         "ratio": statistics.median(ratios[(op, nbytes)]),
                         "ratio_quartiles": _quartiles(ratios[(op, nbytes)])})
            if not args.quiet:
                print(_row(rows[-1]), flush=True)
    return rows


def _quartiles(xs: list[float]) -> list[float]:
    """The first and third quartiles of the per-pair ratios (the spread within a run)."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return [q[0], q[2]]


def _nothing() -> None:
    pass


_SAVED: dict[int, Any] = {}


def _hooks(group: Any, on: bool) -> None:
    """Switch the ``vcga`` group's flight recorder and span hooks on or off: off, its call path
    records nothing and checks for no profiler (vcga.pg.calls.CallPath.record returns None)."""
    calls = group._calls
    if id(calls) not in _SAVED:
        _SAVED[id(calls)] = calls.recorder
    if on:
        calls.recorder = _SAVED[id(calls)]
        calls.__dict__.pop("record", None)
    else:
        calls.recorder = None
        calls.record = _no_record


def _no_record(*args: Any, **kwargs: Any) -> None:
    return None


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


def _pin(rank: int, args: argparse.Namespace) -> None:
    """Keep each rank (main and gloo threads) on its own core: fewer migrations, less noise."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and len(cores) > rank:
        os.sched_setaffinity(0, {cores[rank]})


def _backend(args: argparse.Namespace) -> None:
    """One vendor: gloo, unless VCGA_BACKEND says otherwise. With ``--vendors`` the simulated
    vendors choose each rank's backend, which a configured backend would override (every rank
    would run it, and nothing would be bridged)."""
    if not args.vendors:
        os.environ.setdefault("VCGA_BACKEND", "gloo")
    elif os.environ.get("VCGA_BACKEND"):
        raise SystemExit(f"--vendors {args.vendors}: unset VCGA_BACKEND ({os.environ['VCGA_BACKEND']}), which "
                         "would give every rank that backend instead of a mixed-vendor group")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    _pin(rank, args)
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers backend "vcga"

    _backend(args)
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
    p.add_argument("--seconds", type=float, default=2.0, help="time budget per size (both groups)")
    p.add_argument("--max-pairs", type=int, default=3000, help="most gloo/vcga call pairs per size and round")
    p.add_argument("--rounds", type=int, default=1,
                   help="sweep all sizes this many times, each with 1/rounds of the budget (spreads noise bursts)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", help="also write the rows as JSON to this file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--pin", action="store_true", help="pin rank r to the r-th allowed CPU core")
    p.add_argument("--aa", action="store_true",
                   help="A/A check: compare gloo with a second gloo group (the ratio's noise floor); with "
                        "--hooks-off, the vcga group with its hooks off on both sides")
    p.add_argument("--hooks-off", action="store_true",
                   help="compare vcga with itself, the flight recorder and span hooks off (the 'gloo' columns)")
    p.add_argument("--vendors", metavar="SPEC", help="simulated vendors per rank, e.g. nccl:1,hccl:1 (the bridge)")
    p.add_argument("--torch-recorder", choices=("on", "off"), default="on",
                   help="off: torch's own flight recorder off (TORCH_FR_BUFFER_SIZE=0), VCGA's kept "
                        "(VCGA_FR_BUFFER_SIZE): gloo records nothing, vcga each call once (in its own ring)")
    args = p.parse_args(argv)
    if args.vendors:
        os.environ["VCGA_SIM_VENDORS"] = args.vendors
    if args.torch_recorder == "off":
        # torch's recorder is one per process and records every gloo call: the plain gloo group's
        # and the native gloo call under every vcga call alike (so by default vcga records twice)
        from vcga.pg.recorder import OWN_SIZE_VAR, buffer_size

        os.environ[OWN_SIZE_VAR] = str(buffer_size())
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"

    if not args.quiet:
        other = ("a second gloo group (A/A)" if args.aa else "itself with the recorder and span hooks off"
                 if args.hooks_off else "gloo")
        print(f"vcga{' (' + args.vendors + ')' if args.vendors else ''} vs {other}, {args.world_size} ranks, float32, "
              f"alternating single calls, ~{args.seconds:g} s per size")
        print(HEADER, flush=True)
    if "RANK" in os.environ:  # under torchrun
        import torch.distributed as dist

        import vcga  # noqa: F401

        _backend(args)
        dist.init_process_group("vcga")
        rows = bench(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        from _ranks import run_ranks

        rows = run_ranks(_worker, args.world_size, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print()
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
