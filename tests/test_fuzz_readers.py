"""Fuzz every reader on this branch: mutated fixtures give VcgaFormatError or read cleanly -- never
another exception, a crash or a hang. CI-sized by default; VCGA_FUZZ_N=10000 for a long run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import FIXTURES

N = int(os.environ.get("VCGA_FUZZ_N", "150"))
CASES = [("hdf5", "keras3_legacy.h5"), ("hdf5", "h5py_tree.h5"), ("safetensors", "library.safetensors"),
         ("torch", "state_dict.pt"), ("torch", "legacy.pt")]


@pytest.mark.parametrize("fmt,fixture", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_mutated_files_only_raise_format_errors(tmp_path, fmt, fixture):
    worker = Path(__file__).with_name("fuzz_readers_worker.py")
    seed = 1234 + sum(map(ord, fixture))
    try:
        r = subprocess.run([sys.executable, str(worker), fmt, str(FIXTURES / fixture), str(N), str(seed),
                            str(tmp_path)], capture_output=True, text=True, timeout=60 + N)
    except subprocess.TimeoutExpired:
        it = (tmp_path / "current").read_text() if (tmp_path / "current").exists() else "?"
        pytest.fail(f"reader hung on mutant {it} (seed {seed})")
    if r.returncode != 0:
        it = (tmp_path / "current").read_text() if (tmp_path / "current").exists() else "?"
        pytest.fail(f"worker died (exit {r.returncode}) on mutant {it} (seed {seed}):\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert "unexpected" not in result, result
    assert result["ok"] + result["format_error"] == N
    assert result["format_error"] > 0  # the mutations do damage: the test can fail
