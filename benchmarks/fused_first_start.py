"""The fused host loops at a fresh install's first start: what the ranks of one node pay in CPU.

numba compiles the loops of vcga/compress/fused.py and of the compressor plugins at their first
use and keeps them in its on-disk cache; a process that finds them there loads them. The ranks of
a job start together, so on a fresh install (an empty cache) each of them would compile the same
loops; vcga.compress.fused lets one process of the machine compile at a time, and the others then
load what it wrote.

Each repetition, with an empty numba cache and an empty VCGA cache each time:

- ``cold``: one process compiles and checks every loop (the anchor: what each rank paid when every
  rank compiled);
- ``warm``: one process loads them from the cache ``cold`` wrote;
- ``together``: ``--ranks`` processes ask for every loop at the same moment (each imports first,
  then waits for the others), as the ranks of a first job do.

CPU-s are the processes' own (``RUSAGE_CHILDREN``), each started as a fresh interpreter as torchrun
starts ranks. Reported: medians over ``--reps``, and ``together`` against ``--ranks`` x ``cold``.

Usage::

    python benchmarks/fused_first_start.py                 # 4 ranks, 3 repetitions
    python benchmarks/fused_first_start.py --ranks 8 --reps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

#: One rank: import what a compressing rank imports, wait for "go", then compile (or load) and
#: check every loop; print how many signatures numba compiled.
RANK = """
import json, sys
import vcga.compress.fused as f, vcga.plugins.compressors as c, vcga.plugins.compressors.qsgd as q
print("ready", flush=True)
sys.stdin.readline()
loops = [*f.kernels(), *f.factored(), c._select_loop(), *q._loops()]
assert all(loops), "a loop was not usable here"
print(json.dumps(sum(sum(k.stats.cache_misses.values()) for k in loops)))
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(n: int, env: dict[str, str]) -> tuple[float, list[int]]:
    """``n`` processes, released at once; their CPU-s and how many signatures each compiled."""
    before = _children_cpu()
    procs = [subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(n)]
    try:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise SystemExit("a rank did not start; run it alone to see why")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return _children_cpu() - before, [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="processes that start together (default 4)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "together": []}
    compiled: list[list[int]] = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="vcga-fused-bench-") as tmp:
            env = {**os.environ, "VCGA_FUSED": "1", "OMP_NUM_THREADS": "1",
                   "NUMBA_CACHE_DIR": os.path.join(tmp, "numba-1"), "VCGA_CACHE_DIR": os.path.join(tmp, "vcga-1")}
            rows["cold"].append(run(1, env)[0])
            rows["warm"].append(run(1, env)[0])
            env.update(NUMBA_CACHE_DIR=os.path.join(tmp, "numba-2"), VCGA_CACHE_DIR=os.path.join(tmp, "vcga-2"))
            cpu, counts = run(args.ranks, env)
            rows["together"].append(cpu)
            compiled.append(sorted(counts))
    med = {k: statistics.median(v) for k, v in rows.items()}
    anchor = args.ranks * med["cold"]
    print(f"{'':34} {'CPU-s (median of ' + str(args.reps) + ')':>22}")
    print(f"{'one process, empty cache (cold)':34} {med['cold']:22.2f}")
    print(f"{'one process, cache written (warm)':34} {med['warm']:22.2f}")
    print(f"{f'{args.ranks} processes together, empty cache':34} {med['together']:22.2f}")
    print(f"{f'{args.ranks} x cold (every rank compiling)':34} {anchor:22.2f}")
    print(f"together / ({args.ranks} x cold): {med['together'] / anchor:.2f}")
    print(f"signatures compiled per process, per repetition: {compiled}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "reps": args.reps, "cpu_s": rows, "median": med,
                       "ratio_together_to_all_cold": med["together"] / anchor, "compiled": compiled}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
