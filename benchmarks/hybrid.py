"""Hybrid (mixed-vendor) all_reduce against flat gloo on the same ranks, same run, interleaved.

Four ranks are spawned with ``VCGA_SIM_VENDORS=nccl:2,hccl:2`` (two simulated vendors x two
ranks; the simulated vendors run their collectives on gloo, so the comparison isolates what the
bridge adds). Each rank holds three groups over the same four ranks:

- ``flat``: ``new_group(backend="gloo")`` -- the anchor, one ring over everyone;
- ``leader``: ``vcga``, bridge forced to the leader algorithm (reduce in the vendor group, reduce
  among the leaders on the host, broadcast in the vendor group);
- ``bandwidth``: ``vcga``, bridge forced to the bandwidth-optimal algorithm (reduce-scatter in the
  vendor group, reduce each shard among its shard peers on the host, all-gather in the group),
  in-group steps through the library's reduce_scatter / all_gather;
- ``p2p``: the same algorithm with the in-group reduce-scatter / all-gather as rings over the
  library's send/recv;
- ``replicated``: all-reduce in the vendor group, then among the shard peers.

For each size (fp32, 4 KiB .. 64 MiB) the three are called in rotating order, one call each per
repetition, after a barrier; a call's time is the slowest rank's. Reported: median time per call
and, per hybrid algorithm, the median over repetitions of (hybrid time / the same repetition's
flat time) with its range, plus the algorithm "auto" would pick.

Usage::

    python benchmarks/hybrid.py                  # 4 KiB .. 64 MiB
    python benchmarks/hybrid.py --markdown       # the table for docs/benchmarks.md
    python benchmarks/hybrid.py --max-bytes 1048576 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from _ranks import run_ranks, table

VARIANTS = ("flat", "leader", "bandwidth", "p2p", "replicated")
#: variant -> (bridge_algorithm, in-group method of the bandwidth algorithm or None for the default, bridge_shm)
HYBRID = {"leader": ("leader", None, True), "bandwidth": ("bandwidth", "collective", True),
          "p2p": ("bandwidth", "p2p", True), "replicated": ("replicated", None, True),
          "p2p-1seg": ("bandwidth", "p2p", True), "p2p-gloo": ("bandwidth", "p2p", False),
          "p2p-ar": ("bandwidth", "p2p", True)}
#: not run by default: "p2p" without pipelining (one segment), for --variants flat,p2p-1seg,p2p; "p2p" with the
#: shard peers reducing through gloo instead of shared memory (bridge_shm false), for --variants flat,p2p-gloo,p2p;
#: "p2p" with reduce_scatter as an all_reduce of the whole buffer (not hierarchical), for --collective reduce_scatter


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def reps_for(nbytes: int, base: int) -> int:
    """More repetitions for smaller messages (cheaper, and noisier on a shared machine): ``base`` at
    64 MiB, 4x at 4 MiB (where the target is closest), at most 50."""
    return max(base, min(50, (64 << 20) // max(nbytes, 1) * base // 4))


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    os.environ.update({"VCGA_SIM_VENDORS": "nccl:2,hccl:2", "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1",
                       "VCGA_TIMEOUT": "300", "OMP_NUM_THREADS": "1"})
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers backend "vcga"
    from vcga.bridge.cost import LinkFigures, choose
    from vcga.config import load_config
    from vcga.process_group import VcgaOptions

    torch.set_num_threads(1)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.13
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = {"flat": dist.new_group(backend="gloo")}
    variants = args["variants"]
    for v in variants[1:]:
        alg, method, shm = HYBRID[v]
        groups[v] = dist.new_group(backend="vcga", pg_options=VcgaOptions(
            config=replace(load_config(), bridge_algorithm=alg, bridge_shm=shm)))
        if method is not None:
            groups[v].transport.group.reducer.group_method = method
        if v == "p2p-ar":
            groups[v].transport.group.hierarchical_reduce_scatter = False
        if v == "p2p-1seg":
            groups[v].transport.group.reducer.max_segments = 1
    auto_plan = groups[variants[1]].transport.plan
    calibrated = [groups[v].transport.group.reducer.calibration for v in variants[1:]]
    measured = next((c for c in calibrated if c is not None), None)  # what "auto" measured at creation
    sync = dist.group.WORLD
    rows = []
    for nbytes in sizes(args["min_bytes"], args["max_bytes"]):
        n = nbytes // 4
        bufs = {v: torch.ones(n) for v in variants}
        outs = {v: torch.empty(n // world) for v in variants}

        def call(v: str) -> None:
            if args["collective"] == "reduce_scatter":
                reduce_scatter(outs[v], bufs[v], group=groups[v])
            else:
                dist.all_reduce(bufs[v], group=groups[v])

        for v in variants:  # warm-up: connections, buffers
            call(v)
        times: dict[str, list[float]] = {v: [] for v in variants}
        reps = reps_for(nbytes, args["reps"])
        for i in range(reps):
            order = variants[i % len(variants):] + variants[:i % len(variants)]  # rotate: no variant always runs first
            for v in order:
                dist.barrier(group=sync)
                t0 = time.perf_counter()
                call(v)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=sync)
                times[v].append(float(dt))
        if rank == 0:
            row: dict[str, Any] = {"bytes": nbytes, "reps": reps,
                                   "auto": choose(LinkFigures.from_json(measured["figures"]), nbytes)[0] if measured
                                   else replace(auto_plan, algorithm="auto").all_reduce_algorithm(nbytes)}
            for v in variants:
                row[f"{v}_ms"] = statistics.median(times[v]) * 1e3
            for v in variants[1:]:
                ratios = [h / f for h, f in zip(times[v], times["flat"], strict=False)]
                row[f"{v}_ratio"] = statistics.median(ratios)
                row[f"{v}_range"] = (min(ratios), max(ratios))
            rows.append(row)
            if args["progress"]:
                print(json.dumps(row), file=sys.stderr, flush=True)
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"rows": rows, "calibration": measured})


def render(rows: list[dict[str, Any]], markdown: bool, variants: tuple[str, ...] = VARIANTS) -> str:
    algs = variants[1:]
    head = ["size", "reps", "flat gloo ms", *[f"{a} ms" for a in algs], *[f"{a}/flat" for a in algs], "auto"]
    lines = []
    for r in rows:
        lines.append([human(r["bytes"]), str(r["reps"]), f"{r['flat_ms']:.2f}", *[f"{r[a + '_ms']:.2f}" for a in algs],
                      *[f"{r[a + '_ratio']:.2f} ({r[a + '_range'][0]:.2f}–{r[a + '_range'][1]:.2f})" for a in algs],
                      r["auto"]])
    return table(head, lines, markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=4 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--reps", type=int, default=7, help="repetitions at the largest sizes (more when small)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, flat first (default {','.join(VARIANTS)}; also p2p-1seg)")
    parser.add_argument("--progress", action="store_true", help="print each row to stderr as it is measured")
    parser.add_argument("--collective", choices=("all_reduce", "reduce_scatter"), default="all_reduce",
                        help="reduce_scatter: reduce_scatter_tensor (gloo's own for flat; the bridge's "
                             "hierarchical one, or under leader an all_reduce, for the vcga groups)")
    a = parser.parse_args()
    variants = tuple(a.variants.split(","))
    if variants[0] != "flat" or len(variants) < 2 or any(v not in HYBRID for v in variants[1:]):
        parser.error(f"--variants: flat first, then some of {', '.join(HYBRID)}")
    args = {"variants": variants, "min_bytes": a.min_bytes, "max_bytes": a.max_bytes, "reps": a.reps, "progress": a.progress,
            "collective": a.collective}
    got = run_ranks(rank_main, 4, args)
    rows = got["rows"]
    print(render(rows, a.markdown, variants))
    cal = got["calibration"]
    if cal:
        print(f"\ncreation-time measurement: in-group method per vendor group {cal['group_methods']}; "
              "auto's choice per size (predicted ms): "
              + "; ".join(f"{size} {c['algorithm']} (" + ", ".join(f"{a} {t * 1e3:.2f}" for a, t in
                                                                   c["predicted_s"].items()) + ")"
                          for size, c in cal["choice"].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
