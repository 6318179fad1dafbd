"""all_gather across two nodes over a shaped link: vcga's bridge against plain gloo, in the same run.

Two namespace nodes (vcga.testing.multinode; needs root), one rank each -- sim-nccl on node 0,
sim-hccl on node 1 -- joined by a veth pair shaped with ``tc tbf`` at ``--rate``. Per size, a
rank's bytes gathered by the ``vcga`` group (the bridge: pieces in flight, ``pipelined_allgather``
in vcga/bridge/group.py) and by a plain gloo group over the same two ranks, each after a barrier;
median over ``--reps``; gloo's all_reduce of the same bytes beside them (its ring keeps pieces in
flight too). The link floor: each node must send its S bytes to the other, S / rate, both
directions at once.

    python benchmarks/allgather_nodes.py                      # 1 Gbit/s; 1, 8 and 32 MiB
    python benchmarks/allgather_nodes.py --rate 4gbit --sizes-mib 8,64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time


def rank_main(sizes_mib: list[int], reps: int) -> None:
    import torch
    import torch.distributed as dist

    from vcga.pg.comm import all_gather_single

    dist.init_process_group("vcga")
    torch.set_num_threads(1)
    gloo = dist.new_group([0, 1], backend="gloo")
    rows = []
    for mib in sizes_mib:
        src = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
        out = torch.empty(2 * src.numel(), dtype=torch.uint8)
        floats = src.view(torch.float32)
        calls = {"vcga all_gather": lambda: all_gather_single(out, src),
                 "gloo all_gather": lambda: all_gather_single(out, src, group=gloo),
                 "gloo all_reduce": lambda: dist.all_reduce(floats, group=gloo)}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for f in calls.values():
            f()  # warm: connections, buffers
        for _ in range(reps):
            for name, f in calls.items():  # rotate: the machine's noise hits every call alike
                dist.barrier()
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        check = torch.empty_like(out)
        all_gather_single(check, src, group=gloo)
        all_gather_single(out, src)
        rows.append({"mib": mib, "same_bytes": bool(torch.equal(out, check)),
                     **{k: statistics.median(v) for k, v in times.items()}})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--sizes-mib", default="1,8,32")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("rank", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    if args.rank == "rank":
        rank_main(sizes, args.reps)
        return
    from vcga.testing.multinode import Cluster, parse_rate

    result: dict = {}

    def go() -> None:  # the cluster's holders die with the thread that made them
        with Cluster(nodes=2, rate=args.rate) as cluster:
            env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
            env.update(VCGA_TIMEOUT="600", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            launch = cluster.torchrun([os.path.abspath(__file__), "--sizes-mib", args.sizes_mib,
                                       "--reps", str(args.reps), "rank"], nproc_per_node=1, env=env,
                                      node_env=[{"VCGA_BACKEND": "sim-nccl"}, {"VCGA_BACKEND": "sim-hccl"}])
            result["nodes"] = launch.wait(timeout=1200)

    t = threading.Thread(target=go)
    t.start()
    t.join()
    lines = [ln for r in result["nodes"] for ln in r.output.splitlines() if ln.startswith("RESULT ")]
    if not lines or any(r.returncode for r in result["nodes"]):
        raise SystemExit("a node failed:\n" + "\n".join(r.output[-3000:] for r in result["nodes"]))
    rate = parse_rate(args.rate)
    print(f"2 nodes x 1 rank (sim-nccl, sim-hccl), link {args.rate}, median of {args.reps}")
    print("| bytes per rank | link floor | vcga all_gather | gloo all_gather | vcga / gloo | vcga / floor "
          "| gloo all_reduce (same bytes) | same bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for row in json.loads(lines[0][len("RESULT "):]):
        floor = (row["mib"] << 20) * 8 / rate
        v, g, a = row["vcga all_gather"], row["gloo all_gather"], row["gloo all_reduce"]
        print(f"| {row['mib']} MiB | {floor * 1e3:.1f} ms | {v * 1e3:.1f} ms | {g * 1e3:.1f} ms | {v / g:.2f} | "
              f"{v / floor:.2f} | {a * 1e3:.1f} ms | {'yes' if row['same_bytes'] else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
