"""DDP and FSDP2 run unchanged on ``backend="vcga"`` and end bitwise equal to their gloo twin.

examples/train_ddp.py is launched with torchrun exactly as a user would, twice, differing only in
``--backend``; each run trains with DDP and then with FSDP2 (fully_shard on CPU), 2 ranks, 8 steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# torch's own gloo aborts now and then as a process exits, after training and after
# destroy_process_group(): "terminate called without an active exception", SIGABRT, with no Python
# frame left (the family of pytorch/pytorch PR 179291). Measured under load with train_ddp.py:
# 1 of 60 runs on plain torch (vcga never imported, TORCH_DEVICE_BACKEND_AUTOLOAD=0), 1 of 40
# with vcga imported. The gloo twin is only the reference, so that one signature reruns it once;
# the vcga run gets no second chance.
_TORCH_GLOO_EXIT_ABORT = "terminate called without an active exception"


def _torchrun(backend: str, out: Path) -> None:
    env = {**os.environ, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "VCGA_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_ddp.py"), "--backend", backend, "--parallel", "both", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if backend == "gloo" and proc.returncode != 0 and _TORCH_GLOO_EXIT_ABORT in proc.stderr:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun --backend {backend} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    import torch

    d = tmp_path_factory.mktemp("ddp")
    out = {}
    for backend in ("gloo", "vcga"):
        _torchrun(backend, d / f"{backend}.pt")
        out[backend] = torch.load(d / f"{backend}.pt")
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_bitwise_equal_to_gloo_twin(twins: dict[str, dict], parallel: str) -> None:
    import torch

    a, b = twins["gloo"][parallel], twins["vcga"][parallel]
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), f"{parallel}: {k} differs"
    # and training did something: the parameters moved away from their initial values
    torch.manual_seed(0)
    init = torch.nn.Linear(32, 64).weight
    assert not torch.equal(a["0.weight"], init)
