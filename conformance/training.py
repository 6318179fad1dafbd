"""Check 12: DDP gradients against a float64 reference, per backend and backend against backend.

The model and data are chosen so that the *local* computation is exact: weights, inputs and targets
are small dyadic numbers (multiples of 1/4, 1/2, 1/32), the loss is a power-of-two multiple of a sum
of squares, and every intermediate value is a multiple of a fixed power of two below a magnitude that
float32 represents exactly (at most 22 significant bits for a batch of 48; see docs/conformance.md).
So each rank's float32 gradient equals its float64 gradient bit for bit, in any summation order, and
the only rounding left in a DDP step is the backend's averaging -- which the AVG bound covers:

    |G_i − (1/n)·Σ_r g_{r,i}| ≤ γ_{n+1}(u_fp32) · Σ_r |g_{r,i}| / n  (+ n·tiny)

At step 1 the reference ``(1/n)·Σ_r g_r`` is also what a single process computes in float64 on the
whole batch, so the DDP gradient is compared with that single-process reference. At later steps the
parameters are no longer dyadic, so each step is compared with the float64 average of the ranks'
float32 gradients (swapped through the store), which isolates the backend from the model's own
rounding. After every step all ranks must hold bitwise identical parameters.

Backend against backend: each world exports ``n·G`` of step 1 and its bound; the runner checks every
pair of worlds agrees within the sum of their bounds (both approximate the same exact gradient).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from vcga.contract import CheckResult, Collective, ReduceOp

from . import bounds, data
from .base import Check, needs
from .context import Context, Verdict

if TYPE_CHECKING:
    import torch

__all__ = ["Gradients", "GLOBAL_BATCH"]

#: Global batch, split evenly over 1, 2, 3, 4, 6, 8, 12, 16 ... ranks (48 = 2^4 · 3).
GLOBAL_BATCH = 48
IN, HIDDEN, OUT = 8, 16, 4
LOSS_SCALE = 2.0**-6  # loss = LOSS_SCALE · Σ (y − t)²: dL/dy = 2^-5 (y − t), exact
LR = 2.0**-6

#: The cells DDP (torch 2.13) uses on a float32 model: the parameter-shape check all-gathers int64
#: metadata, construction broadcasts the float32 parameters, the bucket rebuild after step 1
#: broadcasts int32 bucket indices and int64 sizes, and every backward all-reduces float32 buckets
#: with SUM (after dividing by the world size). A table with any natively moved dtype gets every
#: moving cell derived (docs/emulation.md); the all_reduce must be stated or derivable.
DDP_CELLS = [(Collective.ALL_GATHER, "int64", None), (Collective.BROADCAST, "float32", None),
             (Collective.BROADCAST, "int32", None), (Collective.BROADCAST, "int64", None),
             (Collective.ALL_REDUCE, "float32", ReduceOp.SUM)]


def _model(dtype: Any) -> torch.nn.Module:
    import torch

    g = data.generator("gradients-model")
    m = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in m.parameters():  # multiples of 1/4 in [-1/2, 1/2]
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).to(torch.float64) / 4)
    return m.to(dtype)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: inputs are multiples of 1/2 in [-1, 1], targets multiples of 1/32."""
    import torch

    g = data.generator("gradients-data")
    x = torch.randint(-2, 3, (GLOBAL_BATCH, IN), generator=g).to(torch.float64) / 2
    t = torch.randint(-64, 65, (GLOBAL_BATCH, OUT), generator=g).to(torch.float64) / 32
    return x, t


def _loss(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((model(x) - t) ** 2).sum() * LOSS_SCALE


def _grads(model: torch.nn.Module) -> torch.Tensor:
    import torch

    grads = []
    for p in model.parameters():
        if p.grad is None:
            raise ValueError("a parameter has no gradient after the backward pass")
        grads.append(p.grad.reshape(-1))
    return torch.cat(grads)


class Gradients(Check):
    """Check 12: DDP steps of a small MLP against a float64 reference."""

    name = "gradients"
    description = ("DDP gradients of a small MLP within the derived bound of a single-process float64 "
                   "reference, per step, with identical parameters on every rank; worlds agree pairwise")
    defaults = {"steps": 3, "bucket_cap_mb": 0.0005}
    #: DDP's constructor imports torch._dynamo: about 1.2 CPU-s in each rank, once in the server
    preload = ("torch._dynamo",)

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        why = needs(ctx, ctx.capabilities(), DDP_CELLS, "DDP")
        steps = int(self.opt(ctx, "steps"))
        if GLOBAL_BATCH % ctx.world_size:
            why = why or f"the global batch of {GLOBAL_BATCH} does not split over {ctx.world_size} ranks"
        state: dict[str, Any] = {}
        for step in range(1, steps + 1):
            case = f"DDP step {step}: gradient vs float64 reference" + (" (single process)" if step == 1 else "")
            yield ctx.run_unless(case, why, partial(self._step, ctx, step, state), dtype="float32")
            if state.get("broken"):
                break

    def _setup(self, ctx: Context, state: dict[str, Any]) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        acc = ctx.backend.accelerator()
        device = acc.device(ctx.rank % max(acc.device_count(), 1)) if acc.device_type != "cpu" else torch.device("cpu")
        model = _model(torch.float32).to(device)
        # the model has no buffers: no broadcast_buffers=False (deprecated since torch 2.13, a FutureWarning)
        kwargs: dict[str, Any] = {"bucket_cap_mb": float(self.opt(ctx, "bucket_cap_mb"))}
        if device.type != "cpu":
            kwargs["device_ids"] = [device]
        state["ddp"] = DistributedDataParallel(model, **kwargs)
        state["replica"] = _model(torch.float32).to(device)
        state["opt"] = torch.optim.SGD(state["ddp"].parameters(), lr=LR)
        x, t = _batch()
        per = GLOBAL_BATCH // ctx.world_size
        sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
        state["x"], state["t"] = x[sl].to(torch.float32).to(device), t[sl].to(torch.float32).to(device)
        state["device"] = device

    def _step(self, ctx: Context, step: int, state: dict[str, Any]) -> Verdict:
        import torch

        if "ddp" not in state:
            self._setup(ctx, state)
        ddp, replica, opt = state["ddp"], state["replica"], state["opt"]
        x, t = state["x"], state["t"]
        n = ctx.world_size
        # the rank's own float32 gradient, from a plain replica holding the same parameters
        with torch.no_grad():
            for p, q in zip(replica.parameters(), ddp.module.parameters(), strict=True):
                p.copy_(q)
        replica.zero_grad(set_to_none=True)
        _loss(replica, x, t).backward()
        local = _grads(replica).detach().to("cpu", torch.float64)
        # the DDP step (its backward all-reduces the gradient buckets)
        opt.zero_grad(set_to_none=True)
        _loss(ddp, x, t).backward()
        got = _grads(ddp.module).detach().to("cpu", torch.float64)
        everyone = ctx.exchange(f"grad{step}", local.numpy().tobytes())
        locals_ = torch.stack([torch.frombuffer(bytearray(b), dtype=torch.float64) for b in everyone])
        ref = locals_.sum(0) / n
        abs_sum = locals_.abs().sum(0)
        bound = bounds.gamma(n + 1, bounds.unit_roundoff("float32")) * abs_sum / n + n * bounds.tiny("float32")
        bound = bound + 2 * bounds.U_FP64 * ref.abs()  # the float64 average's own rounding
        premise = ""
        if step == 1:
            # the single-process float64 reference on the whole batch
            xg, tg = _batch()
            full = _model(torch.float64)
            _loss(full, xg, tg).backward()
            single = _grads(full).detach() / n
            mine64 = _model(torch.float64)
            per = GLOBAL_BATCH // n
            _loss(mine64, xg[ctx.rank * per:(ctx.rank + 1) * per], tg[ctx.rank * per:(ctx.rank + 1) * per]).backward()
            if not torch.equal(_grads(mine64).detach(), local):
                premise = ("the rank's float32 gradient differs from float64 on exact data: the device computes "
                           "below float32 precision (TF32 or similar?)")
            ref = single
            ctx.export("step1", {"world_size": n, "grad_times_n": (got * n).tolist(),
                                 "bound_times_n": (bound * n).tolist()})
        err = (got - ref).abs()
        ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, float("inf"), 0.0))
        i = int(ratio.argmax()) if ratio.numel() else 0
        worst, b = float(err[i]), float(bound[i])
        opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).to("cpu")
        digests = ctx.exchange(f"params{step}", data.digest(params).encode())
        if premise:
            state["broken"] = True
            return Verdict.fail(premise, worst, b)
        if not bool((err <= bound).all()):
            bad = int((err > bound).sum())
            return Verdict.fail(f"{bad} of {err.numel()} gradient elements beyond the bound; worst [{i}]: "
                                f"got {got[i].item()!r}, reference {ref[i].item()!r}", worst, b)
        if len(set(digests)) != 1:
            groups: dict[bytes, list[int]] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            return Verdict.fail("parameters differ across ranks after the step: " + "; ".join(
                f"rank(s) {','.join(map(str, rs))}: {d.decode()}" for d, rs in groups.items()), worst, b)
        return Verdict.ok(worst, b)

    # -- backend against backend (the runner calls this with every world's exports) ----------------

    def compare(self, exports: Mapping[str, Mapping[str, Any]]) -> Iterator[CheckResult]:
        """Every pair of worlds: step-1 gradients (times the world size) agree within the sum of the
        two worlds' bounds, since both bound their distance to the same exact full-batch gradient."""
        import torch

        worlds = [(w, e["step1"]) for w, e in exports.items() if "step1" in e]
        for (wa, a), (wb, b) in itertools.combinations(worlds, 2):
            f64 = torch.float64  # the exports are float64 values; torch.tensor would default to float32
            ga = torch.tensor(a["grad_times_n"], dtype=f64)
            gb = torch.tensor(b["grad_times_n"], dtype=f64)
            bound = torch.tensor(a["bound_times_n"], dtype=f64) + torch.tensor(b["bound_times_n"], dtype=f64)
            case = f"DDP step-1 gradient: {wa} vs {wb}"
            if ga.shape != gb.shape:
                yield CheckResult(self.name, f"{wa} vs {wb}", case, False, detail="gradients of different sizes")
                continue
            err = (ga - gb).abs()
            ok = bool((err <= bound * data.EVAL_SLACK).all())
            ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, float("inf"), 0.0))
            i = int(ratio.argmax())
            yield CheckResult(self.name, f"{wa} vs {wb}", case, ok, dtype="float32", worst_error=float(err[i]),
                              bound=float(bound[i]),
                              detail="" if ok else f"element [{i}]: {ga[i].item()!r} vs {gb[i].item()!r}")
