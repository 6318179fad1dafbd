"""Data parallelism on chips of different speeds: each rank takes the share of every global batch its speed earns.

    VCGA_SIM_VENDORS=nccl:1,hccl:1 torchrun --nproc-per-node 2 examples/train_balanced.py
    VCGA_SIM_VENDORS=nccl:1,hccl:1 torchrun --nproc-per-node 2 examples/train_balanced.py --shares nccl=2,hccl=1
    torchrun --nproc-per-node 2 examples/train_balanced.py --ckpt ckpt/ --micro-batch hccl=32

Every step trains on the same global batch whatever the mix of chips; the loss scale keeps the
gradient the mean over it; ``--ckpt`` saves (and resumes from) model, optimizer and the balancer's
position, on any other mix. docs/balance.md explains each line.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, TensorDataset

import vcga.checkpoint as ckpt
from vcga.balance import Balancer, parse_weights


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 64, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(64, 8, generator=g) / 8))  # a teacher to learn


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--shares", default="auto", help='"auto", or vendor weights: nccl=2,hccl=1')
    ap.add_argument("--micro-batch", help="a cap per vendor on one forward's samples: hccl=32")
    ap.add_argument("--ckpt", help="checkpoint directory (resumed from when it holds one)")
    ap.add_argument("--save-every", type=int, default=50)
    args = ap.parse_args(argv)

    dist.init_process_group("vcga")
    dataset = data()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shares = args.shares if args.shares == "auto" else parse_weights(args.shares, "--shares")
    caps = parse_weights(args.micro_batch, "--micro-batch") if args.micro_batch else None
    caps = {k: int(v) for k, v in caps.items()} if caps else None
    balancer = Balancer(len(dataset), args.global_batch, shares, seed=0, micro_batch=caps)
    loader = DataLoader(dataset, batch_sampler=balancer.batch_sampler())

    step = 0
    if args.ckpt:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "balancer": balancer}
        step = ckpt.load_latest(state, args.ckpt) or 0
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    for epoch in itertools.count(balancer.epoch):
        if step >= args.steps:
            break
        balancer.set_epoch(epoch)  # a resumed job keeps its place in the epoch it saved
        for batch in loader:
            for x, y in balancer.accumulate(model, batch):  # micro-batches under the cap; one synchronised backward
                with balancer.measure(model):  # this rank's compute, without waiting for the others
                    loss = nn.functional.mse_loss(model(x), y, reduction="sum") * balancer.loss_scale
                    loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if args.ckpt and step % args.save_every == 0:
                msd, osd = get_state_dict(model, opt)
                ckpt.save({"model": msd, "optim": osd, "balancer": balancer}, args.ckpt, step=step)
            if step >= args.steps:
                break

    x, y = dataset[:1024]
    with torch.no_grad():
        report = {"steps": step, "shares": balancer.shares, "loss": float(nn.functional.mse_loss(model(x), y)),
                  "balancer": balancer.describe()}
    if dist.get_rank() == 0:
        print(f"step {step}: shares {report['shares']}, loss {report['loss']:.6f}", flush=True)
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
