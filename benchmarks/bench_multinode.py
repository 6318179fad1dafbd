"""`vcga bench` on two nodes of the namespace harness (vcga.testing.multinode, docs/multinode.md).

Two nodes joined by one link shaped to ``--rate``; on each node two ranks, one per simulated vendor
(``VCGA_SIM_VENDORS=nccl:1,hccl:1,nccl:1,hccl:1``: node 0 holds ranks 0-1, node 1 ranks 2-3), so
`vcga bench` measures the whole world and each tier of the bridge: cross-vendor (the two vendors on
one node) and cross-node (over the link). Prints rank 0's table (and its CSV with ``--csv``).

Usage (root; under the heavy lock when the figures go into docs)::

    python benchmarks/bench_multinode.py --rate 1gbit -- all_reduce -b 1M -e 16M -f 4
"""

from __future__ import annotations

import argparse
import shutil
import sys

from vcga.testing.multinode import Cluster


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of the link between the nodes")
    p.add_argument("bench_args", nargs="*", help="arguments of `vcga bench` (after --)")
    args = p.parse_args()
    vcga = shutil.which("vcga") or sys.exit("the vcga console script is not on PATH")
    env = {"VCGA_SIM_VENDORS": "nccl:1,hccl:1,nccl:1,hccl:1", "PYTHONWARNINGS": "ignore"}
    with Cluster(nodes=2, rate=args.rate) as cluster:
        import os

        launch = cluster.torchrun([vcga, "bench", *args.bench_args], nproc_per_node=2, env={**os.environ, **env})
        results = launch.wait(timeout=1200)
    for r in results:
        if r.returncode != 0:
            print(f"node {r.node} failed ({r.returncode}):\n{r.output[-4000:]}", file=sys.stderr)
            return 1
    out = results[0].output
    print("\n".join(line for line in out.splitlines() if not line.startswith(("W", "I")) or line.startswith("#")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
