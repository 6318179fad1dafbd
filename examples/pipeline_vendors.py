"""One pipeline stage per vendor: torch.distributed.pipelining on backend vcga, checked against gloo.

    VCGA_SIM_VENDORS=nccl:1,hccl:1 torchrun --nproc-per-node 2 examples/pipeline_vendors.py
    VCGA_SIM_VENDORS=nccl:1,hccl:1,cncl:1 torchrun --nproc-per-node 3 examples/pipeline_vendors.py --schedule gpipe

The other way to mix vendors than data parallelism (docs/balance.md): rank r holds stage r of the
model, on its own vendor's chip, and only activations (forward) and their gradients (backward)
cross between vendors -- point-to-point, through the vcga bridge. Every stage keeps its own
parameters, so there is no gradient reduction at all.

The script trains a small MLP cut into one stage per rank with a pipeline schedule (``1f1b``:
Schedule1F1B, ``gpipe``: ScheduleGPipe; 4 micro-batches of a batch of 16), then trains it again,
from the same weights on the same batches, with the stages talking over a gloo group of the same
ranks (``torch.distributed.new_group(backend="gloo")``). Nothing is reduced, so every rank's
stage must end **bitwise** equal to its gloo twin, and the last stage's losses too. Exit status 0
when they are; ``--out`` writes the figures as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import vcga  # noqa: F401 - registers backend "vcga"

WIDTH, BATCH, MICRO = 32, 16, 4
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def stage_module(index: int, stages: int) -> nn.Module:
    """Stage ``index`` of the model: two layers each; the last ends in the output head."""
    torch.manual_seed(100 + index)  # each stage's own initial weights, the same in both runs
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    if index == stages - 1:
        layers.append(nn.Linear(WIDTH, 1))
    return nn.Sequential(*layers)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, x.sum(1, keepdim=True).sin()  # a target the model can learn


def train(group: Any, schedule: str, steps: int) -> tuple[nn.Module, list[float]]:
    """Train this rank's stage over ``group``'s point-to-point links; the last stage returns its losses."""
    rank, stages = dist.get_rank(group), dist.get_world_size(group)
    module = stage_module(rank, stages)
    stage = PipelineStage(module, rank, stages, torch.device("cpu"), group=group)
    pipe = SCHEDULES[schedule](stage, n_microbatches=MICRO, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    losses: list[float] = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        if rank == 0:
            pipe.step(x)
        elif rank == stages - 1:
            got: list[torch.Tensor] = []
            pipe.step(target=y, losses=got)
            losses.append(float(torch.stack([loss.detach() for loss in got]).mean()))
        else:
            pipe.step()
        opt.step()
    return module, losses


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compare(schedule: str, steps: int) -> dict[str, Any]:
    """Train over the default group (vcga) and over gloo; every rank's verdict, gathered over gloo."""
    gloo = dist.new_group(backend="gloo")
    mixed, mixed_losses = train(dist.group.WORLD, schedule, steps)
    ref, ref_losses = train(gloo, schedule, steps)
    mine = {"rank": dist.get_rank(), "equal": digest(mixed) == digest(ref) and mixed_losses == ref_losses,
            "losses": mixed_losses}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=gloo)
    transport = getattr(getattr(dist.group.WORLD, "transport", None), "backend_name", dist.get_backend())
    last = every[-1]["losses"]
    return {"schedule": schedule, "stages": len(every), "steps": steps, "vendors": transport,
            "bitwise_equal_to_gloo": all(e["equal"] for e in every), "first_loss": last[0], "last_loss": last[-1]}


def dist_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="write the figures as JSON here (rank 0)")
    args = parser.parse_args(argv)
    dist.init_process_group(backend="vcga")
    try:
        report = compare(args.schedule, args.steps)
    finally:
        dist.destroy_process_group()
    if args.out and dist_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    result = main()
    if dist_rank() == 0:
        print(json.dumps(result), flush=True)
    if not result["bitwise_equal_to_gloo"]:
        raise SystemExit(1)
