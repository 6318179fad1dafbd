"""What vetting third-party plugins in a child costs a process that loads them (vcga/plugin_manager/vetting.py).

Each sample is a fresh interpreter (an imported plugin stays in ``sys.modules``, and vetting skips
it) that times ``VcgaPluginManager.load()`` with the built-ins off and the example plugin
(examples/vcga-example-plugin) named in ``VCGA_PLUGINS``, three ways, interleaved so that a noisy
machine hits them alike:

- ``in-process``: ``VCGA_PLUGIN_VETTING=0``, the plain import (the anchor: what loading cost before);
- ``cached``: the verdict is in the cache (every start after the first);
- ``vetted``: an empty cache, so a child imports it first (the first start of a plugin version).

And, in this process, the cached path by itself: ``vetting.vet()`` answering from the cache
(key from the module's file, one JSON read and check), median of 200 calls -- the whole of what a
cached verdict adds to a start, too small for the fresh-interpreter samples to resolve.

And ``vcga info --json`` as a user runs it (a fresh interpreter, wall time from outside), the same
three ways.

Also timed in the same run, for scale: creating a one-rank ``vcga`` group
(``init_process_group("vcga")`` with gloo, then one all_reduce), in a fresh interpreter.

    python benchmarks/plugin_vetting.py --reps 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vcga-example-plugin"

LOAD = """
import time
from vcga.plugin_manager import VcgaPluginManager
pm = VcgaPluginManager(builtins=())
t = time.perf_counter()
pm.load()
dt = time.perf_counter() - t
assert [p.status for p in pm.plugins()] == ["loaded"], [p.to_json() for p in pm.plugins()]
print(dt)
"""

GROUP = """
import tempfile, time
t = time.perf_counter()
import torch, torch.distributed as dist
t1 = time.perf_counter()
dist.init_process_group("vcga", init_method="file://" + tempfile.mkdtemp() + "/s", rank=0, world_size=1)
x = torch.ones(4)
dist.all_reduce(x)
print(time.perf_counter() - t1)
dist.destroy_process_group()
"""


def _info(env: dict[str, str]) -> float:
    """Wall time of ``vcga info --json`` (a fresh interpreter, as a user runs it)."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "vcga", "info", "--json"], capture_output=True, text=True,
                       env=env, timeout=300)
    dt = time.perf_counter() - t
    plugins = {p["name"]: p for p in json.loads(r.stdout)["plugins"]} if r.returncode == 0 else {}
    if plugins.get("vcga_example_plugin.plugin", {}).get("status") != "loaded":
        raise SystemExit(f"vcga info: {r.returncode} {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return dt


def _sample(code: str, env: dict[str, str]) -> float:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return float(r.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None, help="write the medians here")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    base.update(PYTHONPATH=os.pathsep.join([str(EXAMPLE), str(ROOT)]), VCGA_PLUGINS="vcga_example_plugin.plugin")
    times: dict[str, list[float]] = {"in-process": [], "cached": [], "vetted": [], "group": [],
                                     "info in-process": [], "info cached": [], "info vetted": []}
    with tempfile.TemporaryDirectory(prefix="vcga-bench-vet-") as tmp:
        warm = os.path.join(tmp, "warm")
        _sample(LOAD, {**base, "VCGA_CACHE_DIR": warm})  # fills the cache for "cached"; warms .pyc files
        for i in range(args.reps):
            times["in-process"].append(_sample(LOAD, {**base, "VCGA_PLUGIN_VETTING": "0"}))
            times["cached"].append(_sample(LOAD, {**base, "VCGA_CACHE_DIR": warm}))
            times["vetted"].append(_sample(LOAD, {**base, "VCGA_CACHE_DIR": os.path.join(tmp, f"cold{i}")}))
            times["group"].append(_sample(GROUP, {**base, "VCGA_CACHE_DIR": warm, "VCGA_BACKEND": "gloo"}))
            times["info in-process"].append(_info({**base, "VCGA_PLUGIN_VETTING": "0"}))
            times["info cached"].append(_info({**base, "VCGA_CACHE_DIR": warm}))
            times["info vetted"].append(_info({**base, "VCGA_CACHE_DIR": os.path.join(tmp, f"info-cold{i}")}))
        sys.path.insert(0, str(EXAMPLE))
        from vcga.plugin_manager import vetting

        env = {"VCGA_CACHE_DIR": warm}
        lookups = []
        for _ in range(200):
            t = time.perf_counter()
            cand = vetting.Candidate("module", "vcga_example_plugin.plugin",
                                     vetting.module_key("vcga_example_plugin.plugin"))
            (v,) = vetting.vet([cand], env=env)
            lookups.append(time.perf_counter() - t)
            assert v.cached and v.outcome == "ok", v
        times["lookup"] = lookups
    med = {k: statistics.median(v) for k, v in times.items()}
    anchor = med["in-process"]
    print(f"{'load() of one plugin':<44} {'median ms':>10} {'x in-process':>13}")
    for k in ("in-process", "cached", "vetted"):
        print(f"{k:<44} {med[k] * 1e3:>10.1f} {med[k] / anchor:>13.2f}")
    print(f"{'cached verdict alone (vet() from the cache)':<44} {med['lookup'] * 1e3:>10.3f} "
          f"{med['lookup'] / anchor:>13.4f}")
    print(f"{'one-rank vcga group + all_reduce (scale)':<44} {med['group'] * 1e3:>10.1f}")
    info = med["info in-process"]
    print(f"{'vcga info --json, wall (fresh interpreter)':<44} {'median ms':>10} {'x in-process':>13}")
    for k in ("info in-process", "info cached", "info vetted"):
        print(f"{k:<44} {med[k] * 1e3:>10.1f} {med[k] / info:>13.2f}")
    print(f"a cached verdict adds {med['lookup'] * 1e3:.2f} ms per plugin "
          f"({med['lookup'] / med['group'] * 100:.3f}% of creating a one-rank group); "
          f"a first vetting adds {(med['vetted'] - anchor) * 1e3:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians_s": med, "reps": args.reps}, indent=1))


if __name__ == "__main__":
    main()
