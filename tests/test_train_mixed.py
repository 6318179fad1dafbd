"""examples/train_mixed.py under torchrun, exactly as the README shows (fake-backed: the vendors are
simulated, VCGA_SIM_VENDORS=nccl:2,hccl:2): a small transformer trained with DDP on backend vcga
across two vendors ends with bitwise identical parameters on every rank, within the script's derived
bound of the same training on a gloo group of the same ranks (the script checks and exits 1 otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_mixed_two_vendors(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "VCGA_SIM_VENDORS": "nccl:2,hccl:2", "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1",
           "VCGA_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_mixed.py"), "--steps", "6", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["vendors"] == "bridge(sim-nccl:2,sim-hccl:2)"
    assert report["identical_on_every_rank"] and report["within_bound"]
    assert report["max_bound"] > 0 and report["max_abs_diff_vs_gloo"] <= report["max_bound"]
