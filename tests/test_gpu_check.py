"""scripts/gpu_check.sh on this CPU machine: exits 0, every step that needs a GPU is skipped.

Two tests also run the script's multi-process worlds (steps 7 and 8's machinery) against a
STAND-IN for the `vcga` process group of issue #3, installed through a ``sitecustomize`` module:
a gloo group registered under the name "vcga" -- so the check's spawning, result collection and
skip rule are tested before the real group lands. They say "stand-in" in their names.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run_check(tmp_path: Path, extra_pythonpath: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env["PYTHON"] = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").exists() else "python3"
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([extra_pythonpath, env.get("PYTHONPATH", "")])
    out = tmp_path / "results.json"
    proc = subprocess.run(["bash", str(SCRIPT), "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    steps = {s["name"].split(" ", 1)[1]: s for s in json.loads(out.read_text())} if out.exists() else {}
    return proc, steps


def test_gpu_check_exits_0_here_with_hardware_steps_skipped(tmp_path):
    proc, steps = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result" in proc.stdout and "skipped" in proc.stdout  # the table is printed
    hardware = ["nccl probe", "nccl topology", "Accelerator calls", "ProcessGroupNCCL ws=1 vs table",
                "vcga group ws=1 on NCCL", "mixed world, 1 CUDA + 3 sims"]
    for name in hardware:
        assert steps[name]["result"] == "SKIP", steps[name]
        assert "no NVIDIA GPU" in steps[name]["detail"]
    assert steps["nccl capability table"]["result"] == "PASS"
    assert steps["mixed world, CPU sims only"]["result"] in ("PASS", "SKIP")


STAND_IN = '''
import torch.distributed as dist

def _create(store, rank, size, timeout):
    {body}

if "vcga" not in dist.Backend.backend_list:
    dist.Backend.register_backend("vcga", _create, devices=["cpu"])
'''


@pytest.mark.slow
def test_gpu_check_runs_the_cpu_mixed_world_on_a_stand_in_vcga_group(tmp_path):
    """Stand-in `vcga` group (gloo under the name vcga): step 7 spawns 4 sim ranks and passes."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STAND_IN.format(body="return dist.ProcessGroupGloo(store, rank, size, timeout)"))
    proc, steps = run_check(tmp_path, str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = steps["mixed world, CPU sims only"]
    assert step["result"] == "PASS", step
    assert "0:sim-nccl@cpu, 1:sim-hccl@cpu, 2:sim-cncl@cpu, 3:sim-hccl@cpu" in step["detail"]
    assert steps["mixed world, 1 CUDA + 3 sims"]["result"] == "SKIP"


@pytest.mark.slow
def test_gpu_check_skips_when_the_stand_in_group_refuses_mixed_vendors(tmp_path):
    """Stand-in `vcga` group that refuses to be created with a typed VCGA error (as a group without
    the bridge would): a missing prerequisite, so SKIP with its message, exit 0."""
    site = tmp_path / "site"
    site.mkdir()
    body = ("from vcga.errors import VcgaUnsupportedError\n"
            "    raise VcgaUnsupportedError('vcga', 'init', '-', None, 'mixed vendors need the bridge (issue #4)')")
    (site / "sitecustomize.py").write_text(STAND_IN.format(body=body))
    proc, steps = run_check(tmp_path, str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = steps["mixed world, CPU sims only"]
    assert step["result"] == "SKIP" and "mixed vendors need the bridge" in step["detail"], step
