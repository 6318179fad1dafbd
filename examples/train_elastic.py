"""Training that survives lost ranks: DDP (or FSDP2) on backend vcga, resuming from vcga.checkpoint.

    VCGA_SIM_VENDORS=nccl:2,hccl:2 torchrun --nproc-per-node 4 --max-restarts 3 \\
        examples/train_elastic.py --root ckpt --steps 12 --save-every 2
    VCGA_FAULT=kill:rank=1:step=7:at=mid ...     # the same job, with rank 1 SIGKILLed inside step 7

Every attempt (torchrun restarts the workers after a rank dies) starts by loading the newest
complete checkpoint under ``--root`` (``vcga.checkpoint.load_latest``: resharded if the world
size or vendor mix changed) and checkpoints every ``--save-every`` steps (``--async``: in the
background). The data of step ``s`` is a fixed global batch of ``--global-batch`` samples, sample
``j`` drawn from a generator seeded by ``(s, j)``; rank ``r`` of ``W`` takes samples
``[r·G/W, (r+1)·G/W)``. So a resumed run computes exactly what the uninterrupted one did: it ends
with bitwise identical parameters (``--out`` reports their digest).

On another world size the same global batch is split differently, so only the order of the
additions changes. Each sample's gradient (of its loss divided by G) is computed alone, so it has
the same bits on any rank; the ranks sum theirs locally, then all-reduce the sums (a SUM comm hook:
no division; with ``--parallel fsdp`` FSDP2's reduce-scatter averages, so its loss is scaled by W).
Both ways sum the same G terms in some order, each within γ_{G−1}·Σⱼ|gⱼ| of the
exact sum (Higham), so the two averaged gradients differ by at most Δg = 2γ_{G−1}·Σⱼ|gⱼ| per
step. Through SGD with momentum (m ← μm + g, p ← p − ηm in fp32) that grows, to first order, as
Δm ← μΔm + Δg + 2u(μ|m_prev| + |m|) and Δp ← Δp + ηΔm + 2u(η|m| + |p|), u = 2⁻²⁴ -- the bound of
examples/train_mixed.py with the summation depth G−1. ``--record-bound F`` makes a run save its
final parameters and, per step, Σⱼ|gⱼ|, |m| and |p|; ``--compare-with F`` makes a run that resumed
on another world size check max|p − p_ref| ≤ max Δp over the steps it ran (exit status 1 if not).

``--compression SPEC`` (DDP; e.g. ``powersgd:rank=4``, docs/compression.md) reduces through
:func:`vcga.compress.ddp_hook` instead of the sum hook (it averages, so the loss is scaled by W)
and checkpoints the hook's state (error-feedback residuals, PowerSGD's warm start) with the model:
a run resumed on the same world carries on bit for bit, as the uninterrupted run. DDP is then
built with ``find_unused_parameters=True``: without it, DDP's first step in a new process reduces
all parameters in one bucket, whose compression differs from the uninterrupted run's.

Fault injection (documented in vcga/testing/fault.py): ``VCGA_FAULT=kill:rank=R:step=S[:at=mid|save]``,
``hang:rank=R:step=S``; off when unset.
"""

from __future__ import annotations

import time

T_PROCESS = time.time()  # before torch is imported: when this worker process began

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import vcga  # registers backend "vcga"
import vcga.checkpoint as ckpt
import vcga.errors
from vcga.testing import fault

VOCAB, DIM, SEQ = 64, 32, 16


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def sample(step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``j`` of step ``step``'s global batch: a noisy counting sequence (depends on nothing else)."""
    g = torch.Generator().manual_seed(1_000_003 * step + j)
    start = torch.randint(0, VOCAB, (1, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.randint(0, VOCAB, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def sum_hook(state, bucket):  # no annotations: DDP inspects them
    """DDP's gradient all-reduce without its division by the world size (see the docstring)."""
    return dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def event(path: str | None, *, every_rank: bool = False, **fields) -> None:
    """One JSON line (with the wall-clock time) appended to ``path``, by rank 0 unless ``every_rank``."""
    if path and (every_rank or dist.get_rank() == 0):
        with open(path, "a") as f:  # O_APPEND: lines from several ranks do not interleave
            f.write(json.dumps({**fields, "rank": dist.get_rank(), "time": time.time()}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint root (shared by every rank)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--async", dest="use_async", action="store_true", help="checkpoint with async_save")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--backend", default="vcga")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--stop-after", type=int, default=None, help="exit after the checkpoint of this step")
    p.add_argument("--out", help="rank 0 writes the result here (JSON)")
    p.add_argument("--events", help="append JSON lines (start, first step, failure, done; with times) here")
    p.add_argument("--record-bound", help="save final parameters and per-step magnitudes here (DDP)")
    p.add_argument("--compare-with", help="check the final parameters against a --record-bound file")
    p.add_argument("--compression", help="DDP: compress the gradient reduction, e.g. powersgd:rank=4 (checkpointed)")
    args = p.parse_args()
    if args.compression and args.parallel != "ddp":
        raise SystemExit("--compression needs --parallel ddp (it is a DDP communication hook)")
    if args.compression and args.record_bound:
        raise SystemExit("--record-bound bounds exact sums: not with --compression")

    dist.init_process_group(backend=args.backend)
    world = dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the world size {world}")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)  # the same initial weights everywhere; the checkpoint replaces them on resume
    module = TinyTransformer()
    compression = None
    if args.parallel == "ddp" and args.compression:
        from vcga.compress import ddp_hook

        # one bucket layout from the first step on, also in a resumed process (see the docstring)
        model: nn.Module = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
        compression, hook = ddp_hook(args.compression)
        model.register_comm_hook(compression, hook)
    elif args.parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(module)
        model.register_comm_hook(dist.group.WORLD, sum_hook)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in module.layers:
            fully_shard(layer)
        model = fully_shard(module)  # its reduce-scatter averages: the loss is scaled by W (train())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        # the hook's state is torch's Stateful: one entry per rank, its residuals are this rank's
        return {"model": msd, "optim": osd, **({"compression": compression} if compression is not None else {})}

    sd = state()
    resumed = ckpt.load_latest(sd, args.root)
    if resumed is not None:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    start = resumed or 0
    event(args.events, event="start", attempt=attempt, world=world, resumed_from=resumed,
          backend=describe_backend(), process_start=T_PROCESS)
    try:
        final_step, history = train(args, model, module, opt, state, start, attempt)
    except Exception as e:
        # The typed error a lost peer causes here (VcgaCollectiveError, VcgaTimeoutError) and when.
        # DDP and FSDP wait on torch futures, which hand back a RuntimeError wrapping the error a
        # failed collective raised: vcga.errors.typed finds the VCGA error behind it.
        err = vcga.errors.typed(e)
        event(args.events, every_rank=True, event="failed", attempt=attempt, error=type(err).__name__,
              message=str(err)[:500])
        raise
    finish(args, model, resumed, start, final_step, history, attempt, compression)


def train(args, model, module, opt, state, start: int, attempt: int) -> tuple[int, list[dict]]:
    """Steps ``start`` .. ``--steps`` (or ``--stop-after``); returns the last step done and, with
    ``--record-bound``, each step's magnitudes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    G = args.global_batch
    record = args.record_bound is not None
    if record and args.parallel != "ddp":
        raise SystemExit("--record-bound needs --parallel ddp")
    params = list(module.parameters())
    history: list[dict[str, torch.Tensor]] = []
    done = start
    lo, hi = rank * G // world, (rank + 1) * G // world
    # DDP's hook sums the ranks' gradients; FSDP2's reduce-scatter and the compression hook average
    # them (a sum with a divide factor, which needs PREMUL_SUM, is not on every backend): scale
    # their loss by W.
    scale = 1.0 if args.parallel == "ddp" and not args.compression else float(world)
    for step in range(start, args.steps):
        fault.point("step", step)
        opt.zero_grad(set_to_none=True)
        abs_local = [torch.zeros_like(q) for q in params] if record else None
        for j in range(lo, hi):
            last = j == hi - 1
            if args.parallel == "ddp":
                sync = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            x, y = sample(step, j)
            with sync:
                out = model(x)
                if j == lo:
                    fault.point("mid", step)
                loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)) * (scale / G)
                loss.backward()
            if record:  # the same sample's gradient once more, alone, for Σⱼ|gⱼ|
                lj = nn.functional.cross_entropy(module(x).reshape(-1, VOCAB), y.reshape(-1)) / G
                for a, g in zip(abs_local, torch.autograd.grad(lj, params), strict=False):
                    a.add_(g.abs())
        opt.step()
        if step == start:
            event(args.events, event="first_step", attempt=attempt, step=step)
        if record:
            flat = torch.cat([a.reshape(-1) for a in abs_local])
            dist.all_reduce(flat)
            history.append({"g": flat.double(),
                            "m": torch.cat([opt.state[q]["momentum_buffer"].reshape(-1)
                                            for q in params]).abs().double(),
                            "p": torch.cat([q.detach().reshape(-1) for q in params]).abs().double()})
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            if args.use_async:
                ckpt.async_save(state(), args.root, step=done, keep_last=args.keep_last)
            else:
                ckpt.save(state(), args.root, step=done, keep_last=args.keep_last)
        if args.stop_after is not None and done >= args.stop_after:
            break
    ckpt.wait()
    return done, history


def finish(args, model, resumed, start: int, final_step: int, history: list[dict], attempt: int,
           compression=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    record = args.record_bound is not None

    full = full_params(model, args.parallel)
    digest = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in full)).hexdigest()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    result = {"world": world, "attempt": attempt, "resumed_from": resumed, "start_step": start,
              "final_step": final_step, "digest": digest,
              "identical_on_every_rank": len(set(digests)) == 1,
              "backend": describe_backend()}
    if compression is not None:  # this attempt's share: its steps and buckets, compressed or not
        result["compression"] = {k: v for k, v in compression.describe().items()
                                 if k in ("spec", "scope", "step", "stats")}
        compression.close()
    ok = result["identical_on_every_rank"]
    if rank == 0:
        flat = torch.cat([t.reshape(-1) for t in full])
        if record:
            torch.save({"params": flat, "history": history, "start": start, "lr": args.lr,
                        "momentum": args.momentum, "G": args.global_batch}, args.record_bound)
        if args.compare_with:
            result["bound"] = compare(flat, torch.load(args.compare_with), start)
            ok = ok and result["bound"]["within_bound"]
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    event(args.events, event="done", attempt=attempt, world=world, final_step=result["final_step"],
          digest=digest)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def full_params(model: nn.Module, parallel: str) -> list[torch.Tensor]:
    ps = [q.detach() for q in (model.module if parallel == "ddp" else model).parameters()]
    return [q.full_tensor() if hasattr(q, "full_tensor") else q for q in ps]


def compare(flat: torch.Tensor, ref: dict, start: int) -> dict:
    """max|p − p_ref| against the first-order bound over the steps this run took (docstring)."""
    u = 2.0 ** -24
    G = ref["G"]
    gamma = (G - 1) * u / (1 - (G - 1) * u)
    lr, mu = ref["lr"], ref["momentum"]
    hist = ref["history"][start - ref["start"]:]
    n = flat.numel()
    d_m = torch.zeros(n, dtype=torch.float64)
    d_p = torch.zeros(n, dtype=torch.float64)
    m_prev = ref["history"][start - ref["start"] - 1]["m"] if start > ref["start"] else d_m
    for rec in hist:
        d_m = mu * d_m + 2 * gamma * rec["g"] + 2 * u * (mu * m_prev + rec["m"])
        d_p = d_p + lr * d_m + 2 * u * (lr * rec["m"] + rec["p"])
        m_prev = rec["m"]
    diff = (flat.double() - ref["params"].double()).abs()
    bound = float(d_p.max())
    return {"steps_compared": len(hist), "max_abs_diff": float(diff.max()), "max_bound": bound,
            "ratio": float(diff.max()) / bound if bound else math.inf,
            "within_bound": bool(diff.max() <= bound), "bitwise_equal": bool(diff.max() == 0)}


def describe_backend() -> str:
    pg = dist.group.WORLD
    return getattr(getattr(pg, "transport", None), "backend_name", dist.get_backend())


if __name__ == "__main__":
    sys.exit(main())
