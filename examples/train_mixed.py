"""Train a small transformer with DDP on ranks of different vendors: one job, one backend string.

    VCGA_SIM_VENDORS=nccl:2,hccl:2 torchrun --nproc-per-node 4 examples/train_mixed.py
    VCGA_SIM_VENDORS=nccl:1,hccl:2,cncl:1 torchrun --nproc-per-node 4 examples/train_mixed.py

``VCGA_SIM_VENDORS`` gives ranks 0-1 simulated NCCL and ranks 2-3 simulated HCCL (CPU stand-ins
that follow each library's rules); on real hardware each rank simply runs on its own vendor's
chip and the variable is not needed. The ``vcga`` process group discovers the vendors and bridges
them (docs/bridge.md): native collectives inside each vendor group, a host bridge between them.

The script then checks what the bridge promises, in the same job:

1. every rank ends with bitwise identical parameters;
2. they agree with the same training run over a single-vendor gloo group on the same ranks
   (``torch.distributed.new_group(backend="gloo")``, same seeds, same data) within the derived
   bound: each step's averaged gradient from either group is within γ₃·Σᵢ|gᵢ|/n of the exact
   average (Higham, n = 4 ranks: summation depth ≤ n-1 on both paths, docs/bridge.md), so the two
   differ by at most Δg = 2γ₃·Σᵢ|gᵢ|/n per step. SGD with momentum computes m ← μm + g and
   p ← p − ηm in fp32; with different inputs each of those roundings may land on different
   neighbours, so per step Δm ← μΔm + Δg + 2u(μ|m_prev| + |m|) and Δp ← Δp + ηΔm + 2u(η|m| + |p|)
   (u = 2⁻²⁴, magnitudes from the gloo run). The check is normwise, max|p_mixed − p_gloo| ≤
   max Δp: the bound is first order, and a difference in one weight reaches the others' gradients
   through the loss curvature (attention couples them), which moves error between elements; the
   run prints the measured/bound ratio.

Exit status 0 when both hold; ``--out`` writes the figures as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import vcga  # noqa: F401 - registers backend "vcga"

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 8


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm encoder layers, a tied-free output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own data: predict the next token of a noisy counting sequence."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.randint(0, VOCAB, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def train(group: dist.ProcessGroup, steps: int, lr: float, momentum: float,
          record_abs: dist.ProcessGroup | None = None, make_model=TinyTransformer, make_batch=batch,
          loss=loss_of, times: list[float] | None = None, cpu_times: list[float] | None = None,
          **ddp_kwargs) -> tuple[nn.Module, list[dict[str, list[torch.Tensor]]]]:
    """DDP training over ``group``; with ``record_abs`` also record Σᵢ|gᵢ|/n of every parameter at
    every step (one extra all_reduce over ``record_abs`` in a comm hook that otherwise does what
    DDP's default hook does: divide by n, all_reduce SUM over ``group``). ``make_model``,
    ``make_batch(rank, step)``, ``loss`` and DDP's keyword arguments default to this example's
    (benchmarks/multinode.py trains other models with the same checks); ``times`` receives each
    step's seconds, measured from a barrier over ``group`` to the end of the optimizer step, and
    ``cpu_times`` (with ``times``) the CPU seconds this process (every thread) spent in that span."""
    torch.manual_seed(0)  # identical initial weights on every rank and in both runs
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **ddp_kwargs)
    abs_sums: list[dict[str, list[torch.Tensor]]] = []
    step_abs: dict[int, torch.Tensor] = {}
    if record_abs is not None:
        n = dist.get_world_size(group)

        def hook(state, bucket):  # no annotations: DDP inspects them, and they are strings here
            grads = bucket.buffer()
            a = grads.abs() / n
            dist.all_reduce(a, group=record_abs)
            offset = 0
            for p in bucket.parameters():
                step_abs[id(p)] = a[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
            grads.div_(n)
            return dist.all_reduce(grads, group=group, async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    rank = dist.get_rank()
    for step in range(steps):
        step_abs.clear()
        x, y = make_batch(rank, step)
        if times is not None:
            dist.barrier(group=group)
            c0 = time.process_time()
            t0 = time.perf_counter()
        opt.zero_grad()
        loss(ddp(x), y).backward()
        opt.step()
        if times is not None:
            times.append(time.perf_counter() - t0)
            if cpu_times is not None:
                cpu_times.append(time.process_time() - c0)
        if record_abs is not None:
            params = list(model.parameters())
            abs_sums.append({"g": [step_abs[id(p)] for p in params],
                             "m": [opt.state[p]["momentum_buffer"].abs().clone() for p in params],
                             "p": [p.detach().abs().clone() for p in params]})
    return model, abs_sums


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--out", help="write the figures as JSON here (rank 0)")
    args = parser.parse_args()

    dist.init_process_group(backend="vcga")
    gloo = dist.new_group(backend="gloo")
    mixed, _ = train(dist.group.WORLD, args.steps, args.lr, args.momentum)
    ref, abs_sums = train(gloo, args.steps, args.lr, args.momentum, record_abs=gloo)
    report = compare(mixed, ref, abs_sums, args.lr, args.momentum, gloo)
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)
    dist.destroy_process_group()
    if not (report["identical_on_every_rank"] and report["within_bound"]
            and math.isfinite(report["max_diff_over_bound"])):
        raise SystemExit(1)


def compare(mixed: nn.Module, ref: nn.Module, abs_sums: list[dict[str, list[torch.Tensor]]], lr: float,
            momentum: float, gloo: dist.ProcessGroup) -> dict:
    """The two checks of the module docstring (collective over ``gloo``): whether ``mixed`` is
    bitwise identical on every rank, and how far it is from ``ref`` against the derived bound."""
    n = dist.get_world_size()
    digests = [None] * n
    dist.all_gather_object(digests, digest(mixed), group=gloo)
    identical = len(set(digests)) == 1

    # The bound per parameter element (see the module docstring).
    u = 2.0 ** -24
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in ts]).double()

    d_m = d_p = m_prev = torch.zeros(sum(p.numel() for p in mixed.parameters()), dtype=torch.float64)
    for rec in abs_sums:
        m, p = cat(rec["m"]), cat(rec["p"])
        d_m = momentum * d_m + 2 * gamma * cat(rec["g"]) + 2 * u * (momentum * m_prev + m)
        d_p = d_p + lr * d_m + 2 * u * (lr * m + p)
        m_prev = m
    flat_bound = d_p
    diff = torch.cat([(a.detach() - b.detach()).abs().reshape(-1)
                      for a, b in zip(mixed.parameters(), ref.parameters(), strict=False)]).double()
    within = bool(diff.max() <= flat_bound.max())
    ratio = float(diff.max() / flat_bound.max())
    return {"ranks": n, "vendors": mixed_layout(), "steps": len(abs_sums), "identical_on_every_rank": identical,
            "max_abs_diff_vs_gloo": float(diff.max()), "max_bound": float(flat_bound.max()),
            "max_diff_over_bound": ratio, "within_bound": within, "bitwise_equal_to_gloo": bool(diff.max() == 0),
            "mixed_digest": digests[0], "digests": digests}


def mixed_layout() -> str:
    pg = dist.group.WORLD
    return getattr(getattr(pg, "transport", None), "backend_name", dist.get_backend())


if __name__ == "__main__":
    main()
