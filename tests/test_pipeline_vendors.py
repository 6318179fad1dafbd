"""examples/pipeline_vendors.py: one pipeline stage per vendor with torch.distributed.pipelining on
backend vcga (fake-backed: three simulated vendors, one stage each), 1F1B and GPipe, every stage
bitwise equal to the same training over a gloo group of the same ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vcga.testing import run_world

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_vendors.py"


def _rank(rank: int, world: int, init_method: str) -> list[dict]:
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("pipeline_vendors", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world)
    try:
        return [example.compare(schedule, steps=4) for schedule in ("1f1b", "gpipe")]
    finally:
        dist.destroy_process_group()


def test_one_stage_per_vendor_trains_bitwise_equal_to_gloo_with_1f1b_and_gpipe():
    reports = run_world(_rank, 3, env={"VCGA_SIM_VENDORS": "nccl:1,hccl:1,cncl:1"})[0]
    assert [r["schedule"] for r in reports] == ["1f1b", "gpipe"]
    for r in reports:
        assert r["vendors"] == "bridge(sim-nccl:1,sim-hccl:1,sim-cncl:1)" and r["stages"] == 3, r
        assert r["bitwise_equal_to_gloo"], r
        assert r["last_loss"] < r["first_loss"], r  # it trained
