#!/usr/bin/env python
"""Throughput of ``vcga convert`` against each format's anchor, in the same run, as ratios.

    .venv/bin/python benchmarks/convert.py [--size-mib 1024] [--repeats 3] [--dir /dev/shm] [--rss-gib 2]

For each (source, target) pair of this branch's formats, on the same checkpoint (a mix of many
4 MiB fp32 tensors, some 256 KiB fp16 and a few tiny int64), each in a fresh process:

- **vcga**: ``vcga.convert.convert(src, dst)`` -- streaming, checksummed, atomic (fsync + rename);
- **anchor**: what one writes with the libraries alone, all tensors in memory, no fsync:
  safetensors -> ``safetensors.numpy.load_file`` / ``save_file``; hdf5 -> an h5py loop
  (``ds[()]`` per dataset, ``create_dataset`` per tensor); torch -> ``torch.load`` / ``torch.save``.

Reported: median seconds of ``--repeats`` runs, GB/s (checkpoint bytes / seconds), the ratio
vcga / anchor (>1: vcga faster), and each side's peak RSS growth over its process's baseline
after imports. Then the peak RSS of a ``--rss-gib`` checkpoint converted along ``--chain``
(default hdf5 -> safetensors -> torch -> hdf5) with vcga (the bound is 2 x largest tensor + 150 MiB).

The default directory is tmpfs when there is one, so the disk's speed does not hide the code's;
pass ``--dir`` to measure on a disk (vcga's fsyncs then cost what durability costs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20

MAKE = r"""
import sys, numpy as np
from vcga.contract import TensorEntry
from vcga.plugin_manager import get_plugin_manager
path, fmt, size_mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
big_mib = int(sys.argv[4]) if len(sys.argv) > 4 else 4
spec = next(s for s in get_plugin_manager().formats() if s.name == fmt)
rng = np.random.default_rng(0)
big = rng.standard_normal(big_mib << 18).astype(np.float32)    # 4 MiB by default
mid = rng.standard_normal(1 << 17).astype(np.float16)          # 256 KiB
tiny = np.arange(16, dtype=np.int64)
budget, i = size_mib * (1 << 20), 0
with spec.open_writer(path) as w:
    w.set_metadata({"bench": "convert"})
    while budget > 0:
        if i % 10 == 9:
            arr, name = mid, f"blocks.{i}.norm"
        elif i % 25 == 24:
            arr, name = tiny, f"blocks.{i}.index"
        else:
            arr, name = big + i, f"blocks.{i}.weight"
        w.write(TensorEntry(name, str(arr.dtype), arr.shape, np.ascontiguousarray(arr)))
        budget -= arr.nbytes
        i += 1
"""

RUN = r"""
import json, resource, sys, time
kind, src, dst, sfmt, dfmt = sys.argv[1:6]
import numpy, h5py, safetensors, xxhash
if "torch" in (sfmt, dfmt):
    import torch
import safetensors.numpy
from vcga.convert import convert
from vcga.plugin_manager import get_plugin_manager
get_plugin_manager().formats()
def peak():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
def read_anchor(fmt, path):
    if fmt == "safetensors":
        from safetensors.numpy import load_file
        return load_file(path)
    if fmt == "hdf5":
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
        return out
    return {k: v for k, v in torch.load(path, weights_only=True).items()}
def write_anchor(fmt, path, tensors):
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        save_file({k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in tensors.items()}, path)
    elif fmt == "hdf5":
        with h5py.File(path, "w") as f:
            for k, v in tensors.items():
                f.create_dataset(k, data=v.numpy() if hasattr(v, "numpy") else v)
    else:
        torch.save({k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(v)) for k, v in tensors.items()}, path)
base = peak()
t0 = time.perf_counter()
if kind == "vcga":
    convert(src, dst, src_format=sfmt, dst_format=dfmt)
else:
    write_anchor(dfmt, dst, read_anchor(sfmt, src))
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "rss_growth": peak() - base, "peak": peak()}))
"""

RSS_CHAIN = r"""
import json, resource, sys
paths = sys.argv[1:]
import numpy, h5py, safetensors, xxhash
if any(p.endswith(".pt") for p in paths):
    import torch
from vcga.convert import convert
from vcga.plugin_manager import get_plugin_manager
get_plugin_manager().formats()
base = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
largest = 0
for s, t in zip(paths, paths[1:]):
    largest = max(largest, convert(s, t).largest_tensor_bytes)
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
print(json.dumps({"base": base, "peak": peak, "largest": largest}))
"""

EXT_OF = r"""
import json
from vcga.plugin_manager import get_plugin_manager
print(json.dumps({s.name: s.extensions[0] for s in get_plugin_manager().formats()}))
"""


def _py(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    out = r.stdout.strip().splitlines()
    return json.loads(out[-1]) if out else {}


def _clear(path: Path) -> None:
    """Remove an output and its siblings (shards, .db files, indexes)."""
    for p in path.parent.glob(path.name + "*"):
        p.unlink()
    stem = path.name.split(".")[0]
    for p in path.parent.glob(stem + "-0*"):  # Hugging Face shard names
        p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rss-gib", type=float, default=2.0, help="checkpoint size for the peak-RSS chain (0: skip)")
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    ap.add_argument("--chain", default="hdf5,safetensors,torch,hdf5",
                    help="formats the --rss-gib checkpoint passes through, in order (any registered formats)")
    ap.add_argument("--rss-tensor-mib", type=int, default=4,
                    help="size of the chain checkpoint's big tensors (the bound is 2 x this + 150 MiB)")
    ap.add_argument("--pairs", help="source:target pairs to time against the anchors ('' for none)", default="safetensors:safetensors,hdf5:hdf5,torch:torch,hdf5:safetensors,"
                                       "safetensors:torch,torch:hdf5")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vcga-bench-", dir=args.dir))
    rows = []
    try:
        exts = _py(EXT_OF)  # every registered format's first extension
        sources = {}
        for pair in filter(None, args.pairs.split(",")):
            sfmt, dfmt = pair.split(":")
            if not {sfmt, dfmt} <= {"safetensors", "hdf5", "torch"}:
                raise SystemExit(f"no anchor for {pair}: throughput pairs are among safetensors, hdf5 and torch "
                                 "(the MindSpore and vendor-bin benchmarks have their own anchors)")
            if sfmt not in sources:
                sources[sfmt] = work / f"src{exts[sfmt]}"
                _py(MAKE, str(sources[sfmt]), sfmt, str(args.size_mib))
            size = sources[sfmt].stat().st_size
            res: dict[str, list[dict]] = {"vcga": [], "anchor": []}
            for _ in range(args.repeats):
                for kind in ("anchor", "vcga"):
                    dst = work / f"dst{exts[dfmt]}"
                    _clear(dst)
                    res[kind].append(_py(RUN, kind, str(sources[sfmt]), str(dst), sfmt, dfmt))
                    _clear(dst)
            med = {k: statistics.median(r["seconds"] for r in v) for k, v in res.items()}
            rss = {k: max(r["rss_growth"] for r in v) for k, v in res.items()}
            rows.append((sfmt, dfmt, size, med, rss))
            print(f"{sfmt:>11} -> {dfmt:<11} vcga {size / med['vcga'] / 1e9:5.2f} GB/s  anchor "
                  f"{size / med['anchor'] / 1e9:5.2f} GB/s  ratio {med['anchor'] / med['vcga']:.2f}x  "
                  f"RSS growth vcga {rss['vcga'] / MiB:.0f} MiB anchor {rss['anchor'] / MiB:.0f} MiB", flush=True)
        for p in sources.values():
            _clear(p)
        chain = None
        if args.rss_gib > 0:
            fmts = args.chain.split(",")
            paths = [work / f"chain{i}{exts[f]}" for i, f in enumerate(fmts)]
            _py(MAKE, str(paths[0]), fmts[0], str(int(args.rss_gib * 1024)), str(args.rss_tensor_mib))
            chain = _py(RSS_CHAIN, *map(str, paths))
            chain["size"] = paths[0].stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"Checkpoint: {args.size_mib} MiB mix (4 MiB fp32, 256 KiB fp16, tiny int64), median of {args.repeats}, "
          f"dir {args.dir or tempfile.gettempdir()}")
    print()
    print("| source -> target | vcga GB/s | anchor GB/s | ratio (vcga/anchor) | vcga RSS growth | anchor RSS growth |")
    print("|---|---:|---:|---:|---:|---:|")
    for sfmt, dfmt, size, med, rss in rows:
        print(f"| {sfmt} -> {dfmt} | {size / med['vcga'] / 1e9:.2f} | {size / med['anchor'] / 1e9:.2f} | "
              f"{med['anchor'] / med['vcga']:.2f}x | {rss['vcga'] / MiB:.0f} MiB | {rss['anchor'] / MiB:.0f} MiB |")
    if chain:
        growth = chain["peak"] - chain["base"]
        bound = 2 * chain["largest"] + 150 * MiB
        print()
        print(f"Peak RSS, {' -> '.join(args.chain.split(','))} on {chain['size'] / 2**30:.2f} GiB (largest tensor "
              f"{chain['largest'] / MiB:.0f} MiB): grew {growth / MiB:.0f} MiB over the {chain['base'] / MiB:.0f} MiB "
              f"baseline after imports (absolute peak {chain['peak'] / MiB:.0f} MiB); bound 2 x largest + 150 MiB = "
              f"{bound / MiB:.0f} MiB -> {'within' if growth <= bound else 'EXCEEDED'}")


if __name__ == "__main__":
    main()
