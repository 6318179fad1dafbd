"""A small DDP training script whose only vendor-specific line is the backend string.

Run it twice and compare: the ``vcga`` run ends with bitwise the same parameters as the gloo run::

    torchrun --nproc-per-node 2 examples/train_ddp.py --backend gloo --out /tmp/gloo.pt
    torchrun --nproc-per-node 2 examples/train_ddp.py --backend vcga --out /tmp/vcga.pt

(``import vcga`` is what makes ``backend="vcga"`` known to torch; with vcga installed, torch's
own plugin autoload does it too.) ``--parallel fsdp`` wraps the model with FSDP2 ``fully_shard``
instead of DDP; ``--parallel both`` trains twice (DDP, then FSDP2) and saves both results.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import vcga  # noqa: F401 - registers backend "vcga"


def build_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank and in every run
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank sees its own data
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    return x, y


def train(parallel: str, steps: int) -> dict[str, torch.Tensor]:
    """Train a fresh model for ``steps`` steps; return its full parameters (every rank)."""
    rank = dist.get_rank()
    model = build_model()
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        opt.step()
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vcga")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--parallel", choices=["ddp", "fsdp", "both"], default="ddp")
    parser.add_argument("--out", help="save the final parameters (rank 0) to this file")
    args = parser.parse_args()

    dist.init_process_group(backend=args.backend)
    modes = ["ddp", "fsdp"] if args.parallel == "both" else [args.parallel]
    result = {mode: train(mode, args.steps) for mode in modes}
    if dist.get_rank() == 0 and args.out:
        torch.save(result, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
