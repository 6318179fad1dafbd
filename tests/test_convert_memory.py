"""Conversion streams: peak resident memory grows by at most 2 x the largest tensor + 150 MiB, on a
checkpoint much larger than that bound (so a converter that held the checkpoint would fail).

The conversion runs in a fresh interpreter (its peak is what is measured); the source is written
by a process forked from the rank server (:func:`_make`), where torch is already imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

MiB = 1 << 20
TENSOR = 16 * MiB
COUNT = 16  # 256 MiB checkpoint; the bound is 2 * 16 + 150 = 182 MiB

CHILD = r"""
import json, resource, sys
src, dst = sys.argv[1], sys.argv[2]
import numpy, h5py, safetensors, xxhash  # the libraries every conversion loads, before the baseline
from vcga.convert import convert, detect_source, detect_target
from vcga.plugin_manager import get_plugin_manager
get_plugin_manager().formats()
if src.endswith(".pt") or dst.endswith(".pt"):
    import torch
def peak():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
base = peak()
rep = convert(src, dst)
print(json.dumps({"base": base, "peak": peak(), "largest": rep.largest_tensor_bytes, "bytes": rep.bytes}))
"""

MAKE = r"""
import sys, numpy as np
from vcga.contract import TensorEntry
from vcga.plugin_manager import get_plugin_manager
path, fmt, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spec = next(s for s in get_plugin_manager().formats() if s.name == fmt)
with spec.open_writer(path) as w:
    w.set_metadata({})
    for i in range(count):
        data = np.full(size // 4, i, dtype=np.float32)
        w.write(TensorEntry(f"layer{i}.weight", "float32", (size // 4,), data))
"""

def _make_rank(rank: int, world_size: int, init_method: str, code: str, argv: list[str]) -> None:
    sys.argv = ["-c", *argv]
    exec(compile(code, "<make>", "exec"), {"__name__": "__main__"})  # the test's own code


def _make(code: str, *argv: str) -> None:
    """``python -c CODE ARGV``, in a process forked from the rank server."""
    from vcga.testing import run_world

    run_world(_make_rank, 1, code, list(argv), timeout=300)


PAIRS = [("safetensors", ".safetensors", ".h5"), ("hdf5", ".h5", ".pt"), ("torch", ".pt", ".safetensors"),
         ("vendor-bin", ".vbin", ".h5")]


@pytest.mark.parametrize("fmt,src_ext,dst_ext", PAIRS, ids=[f"{a}{b}->{c}" for a, b, c in PAIRS])
def test_peak_rss_is_bounded_by_the_largest_tensor(tmp_path, fmt, src_ext, dst_ext):
    # On tmpfs when there is one: the test measures memory, not the disk's fsync speed.
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        _measure(work, fmt, src_ext, dst_ext)
    finally:
        if work != tmp_path:
            shutil.rmtree(work, ignore_errors=True)


def _measure(work, fmt, src_ext, dst_ext):
    src, dst = work / f"src{src_ext}", work / f"dst{dst_ext}"
    _make(MAKE, str(src), fmt, str(COUNT), str(TENSOR))
    r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["largest"] == TENSOR and m["bytes"] == COUNT * TENSOR
    growth = m["peak"] - m["base"]
    bound = 2 * m["largest"] + 150 * MiB
    print(f"{fmt}{src_ext}->{dst_ext}: peak RSS grew by {growth / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)")
    assert growth <= bound, f"peak RSS grew by {growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"


MAKE_DCP = r"""
import sys, warnings, torch
path, layout, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
state = {f"layer{i}.weight": torch.full((size // 4,), float(i)) for i in range(count)}
warnings.simplefilter("ignore")
if layout == "torch":
    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
else:
    import vcga.checkpoint as ckpt
    ckpt.save(state, path, step=1)
"""


@pytest.mark.parametrize("layout", ["torch", "vcga"])
def test_dcp_directories_convert_with_bounded_memory(tmp_path, layout):
    """A DCP directory (torch's FileSystemWriter layout, or VCGA's) streams like a file does."""
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        root = work / "ckpt"
        _make(MAKE_DCP, str(root), layout, str(COUNT), str(TENSOR))
        src = root if layout == "torch" else root / "step-1"
        r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(work / "dst.safetensors")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        m = json.loads(r.stdout.strip().splitlines()[-1])
        assert m["largest"] == TENSOR and m["bytes"] == COUNT * TENSOR
        growth = m["peak"] - m["base"]
        bound = 2 * m["largest"] + 150 * MiB
        print(f"dcp ({layout}) -> safetensors: peak RSS grew by {growth / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)")
        assert growth <= bound, f"peak RSS grew by {growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
    finally:
        if work != tmp_path:
            shutil.rmtree(work, ignore_errors=True)
