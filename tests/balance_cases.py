"""Rank bodies for tests/test_balance_world.py: training with uneven shares, checked step by step.

One world runs every framework in turn -- plain DDP, DDP with a ``vcga.compress`` hook, FSDP2, a
Lightning Trainer -- each 10 steps of plain SGD on a linear model, with a re-balance forced at a
chosen step, then saved through ``vcga.checkpoint``; a second world of another vendor mix and size
loads each and trains 10 more steps. At every step rank 0 computes, in one process, the gradient of
the mean loss over the step's global batch at the current weights, and compares the averaged
gradient the ranks hold with it against the bound derived below. Each rank also reports its
sample indices, so the test can check that the global batches are the seeded sequence's,
whatever the mix.

**The bound.** The model is ``out = W x + b`` per token (rows of ``D_IN`` features; a sample has
``T`` tokens, some masked). Two losses:

- ``regression``: ``0.5 ||out - y||²`` per valid token; the gradient of a row is ``r xᵀ`` (and
  ``r`` for ``b``) with ``r = out - y``. Each path computes ``r`` with its own kernels: by Higham's
  inner-product bound each differs from the exact ``r`` by at most
  ``e = γ_{D_IN+2} (|W||x| + |b| + |y|)``.
- ``linear``: ``Σ c · out`` per valid token, with small integers ``x`` and ``c``: the gradient of a
  row is ``c xᵀ``, independent of the weights and exactly representable in fp16 (``e = 0``).

A gradient element is ``(1/Z) Σ_rows r x`` (``Z``: samples of the global batch, or its valid
tokens). One process sums ``R`` rows after one scaling: at most ``R + 4`` roundings deep. A rank
sums its ``R_r`` rows after scaling (the loss scale, Lightning's mean and gradient hook), then DDP
(or FSDP's reduce-scatter) sums ``n`` ranks and divides by ``n``: at most ``max R_r + n + 6``. So
``|g_ranks - g_one| <= [2 Σ e|x| + (γ_{R+4} + γ_{max R_r + n + 6}) Σ (|r| + e)|x|] / Z``
(Higham, Accuracy and Stability, 2nd ed., §3.1 and Lemma 3.1). With the fp16 hook on ``regression``
rows (lossy), each rank's part is also rounded to fp16 once and the island sums added in fp16:
``+ γ16_{k+1} Σ (|r| + e)|x| / Z`` for ``k`` islands (unit roundoff ``2⁻¹¹``), which a wrong weight
(a rank's share instead of the mean's) exceeds by orders of magnitude.
"""

from __future__ import annotations

import os
from typing import Any

import torch

D_IN, D_OUT, T = 8, 4, 3
N, B = 192, 16  # 12 steps per epoch: the 20 steps cross into epoch 1
SEED = 7
LR = 0.05
U32, U16 = 2.0 ** -24, 2.0 ** -11


def gamma(k: int, u: float = U32) -> float:
    return k * u / (1 - k * u)


def data() -> dict[str, torch.Tensor]:
    """The data set: every rank makes the same tensors."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    return {"x": torch.randn(N, T, D_IN, generator=g), "y": torch.randn(N, T, D_OUT, generator=g),
            "m": (torch.arange(T) < lengths[:, None]).float(),
            "xi": torch.randint(-3, 4, (N, T, D_IN), generator=g).float(),
            "c": torch.randint(-2, 3, (N, T, D_OUT), generator=g).float(),
            "id": torch.arange(N)}


def summed_loss(net: Any, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """The sum over the batch's valid tokens of the per-token loss."""
    per = 0.5 * (net(batch["x"]) - batch["y"]).square() if task == "regression" else batch["c"] * net(batch["xi"])
    return (per.sum(-1) * batch["m"]).sum()


def make_net() -> torch.nn.Linear:
    torch.manual_seed(0)  # the same initial weights on every rank and in every world
    return torch.nn.Linear(D_IN, D_OUT)


def reference(W: torch.Tensor, b: torch.Tensor, batch: dict[str, torch.Tensor], task: str, norm: str,
              got: list[torch.Tensor], n: int, rows_max: int, islands: int = 0) -> float:
    """max |got - one process| / bound over every element of (W's, b's) gradient (module docstring);
    ``norm``: "samples" or "tokens"; ``islands`` > 0: add the fp16 term of a lossy hook."""
    net = torch.nn.Linear(D_IN, D_OUT)
    with torch.no_grad():
        net.weight.copy_(W)
        net.bias.copy_(b)
    m = batch["m"]
    z = float(m.shape[0]) if norm == "samples" else float(m.sum())
    (summed_loss(net, batch, task) / z).backward()
    want = [net.weight.grad, net.bias.grad]
    x = (batch["x"] if task == "regression" else batch["xi"]).double().reshape(-1, D_IN)
    mask = m.double().reshape(-1, 1)
    if task == "regression":
        W64, b64, y = W.double(), b.double(), batch["y"].double().reshape(-1, D_OUT)
        r = (x @ W64.T + b64 - y).abs() * mask
        e = gamma(D_IN + 2) * (x.abs() @ W64.abs().T + b64.abs() + y.abs()) * mask
    else:
        r, e = batch["c"].double().reshape(-1, D_OUT).abs() * mask, torch.zeros(1, dtype=torch.float64)
    e = e.expand_as(r)
    xa = torch.cat([x.abs(), torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)  # the bias's "feature" 1
    size = (r + e).T @ xa
    err = e.T @ xa
    k = gamma(x.shape[0] + 4) + gamma(rows_max + n + 6) + (gamma(islands + 1, U16) if islands else 0.0)
    bound = (2 * err + k * size) / z
    worst = 0.0
    for g, w, bd in zip(got, want, (bound[:, :D_IN], bound[:, D_IN]), strict=False):
        diff = (g.double() - w.double()).abs()
        if bool((diff[bd == 0] > 0).any()):
            return float("inf")
        worst = max(worst, float((diff / bd.clamp_min(1e-300)).max()))
    return worst


# ---------------------------------------------------------------------------------------------------
# The plain loops: DDP, DDP with a compression hook, FSDP2
# ---------------------------------------------------------------------------------------------------


def _wrap(kind: str, net: torch.nn.Module, keep: bool = True) -> tuple[Any, Any]:
    """The model as the framework holds it, and the compression state (or None). FSDP2 keeps its
    gathered parameters after forward (``keep``): its ranks take different numbers of micro-steps."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(net, reshard_after_forward=not keep), None
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    if kind == "compress":
        from vcga.compress import ddp_hook

        state, hook = ddp_hook("fp16:scope=bridge")
        ddp.register_comm_hook(state, hook)
        return ddp, state
    return ddp, None


def _refuses_resharding_fsdp(balancer: Any) -> str | None:
    """The error accumulate() raises, before any collective, for an FSDP2 model that frees its
    gathered parameters after forward when the ranks take different numbers of micro-steps."""
    from torch.distributed.fsdp import fully_shard

    from vcga.errors import VcgaConfigError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, D_OUT), torch.nn.Linear(D_OUT, D_OUT))
    fully_shard(net[0])
    fully_shard(net)
    probe = type(balancer)(N, B, balancer.shares, seed=SEED, micro_batch=balancer.caps)
    idx = next(iter(probe))
    if len(set(probe.micro_steps())) == 1:
        return None
    try:
        next(probe.accumulate(net, idx))
    except VcgaConfigError as e:
        return str(e)
    return None


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _steps(balancer: Any):
    """This rank's indices for each step, across epoch boundaries (set_epoch at each new epoch)."""
    it = iter(balancer)
    while True:
        try:
            yield next(it)
        except StopIteration:
            balancer.set_epoch(balancer.epoch + 1)
            it = iter(balancer)


def _record(balancer: Any, idx: list[int], group: Any = None) -> dict[str, Any]:
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, idx, group=group)
    step = balancer.current
    return {"epoch": step.epoch, "index": step.index, "shares": list(step.shares), "parts": parts}


def loop_phase(kind: str, plan: dict[str, Any], root: str) -> list[dict[str, Any]] | None:
    """10 steps of ``kind`` ("ddp", "compress", "fsdp2") under ``plan``; resume from / save to ``root``.

    plan: ``shares`` (initial), ``force`` (step, shares), ``micro_batch``, ``resume`` (bool),
    ``save`` (bool), ``warmup``/``window`` (auto)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import vcga.checkpoint as ckpt
    from vcga.balance import Balancer

    rank, n = dist.get_rank(), dist.get_world_size()
    d = data()
    model, cstate = _wrap(kind, make_net())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    balancer = Balancer(N, B, plan["shares"], seed=SEED, micro_batch=plan.get("micro_batch"),
                        warmup=plan.get("warmup", 2), window=plan.get("window", 5))
    first = 0
    if plan.get("resume"):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "balancer": balancer}
        first = ckpt.load_latest(state, root)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    records = []
    steps = _steps(balancer)
    refused = _refuses_resharding_fsdp(balancer) if kind == "fsdp2" and plan.get("micro_batch") else None
    for step in range(first, first + 10):
        if plan.get("force") and step == plan["force"][0]:
            balancer.set_shares(plan["force"][1])
        idx = next(steps)
        batch = {k: v[idx] for k, v in d.items()}
        tokens = kind == "ddp" and step % 2 == 1  # the run-time count: odd DDP steps average over tokens
        task = "linear" if kind == "compress" and step % 2 == 0 else "regression"
        scale = balancer.loss_scale_for(int(batch["m"].sum())) if tokens else balancer.loss_scale
        for part in balancer.accumulate(model, batch):
            with balancer.measure(model):
                (summed_loss(model, part, task) * scale).backward()
        rec = _record(balancer, idx)
        net = getattr(model, "module", model)
        W, b = (_full(p.detach()) for p in net.parameters())
        grads = [_full(p.grad) for p in net.parameters()]
        rows_all: list[Any] = [None] * n
        dist.all_gather_object(rows_all, batch["m"].numel())
        if rank == 0:
            glob = {k: v[balancer.global_indices(rec["index"])] for k, v in d.items()}
            lossy = kind == "compress" and task == "regression"
            islands = len(set(cstate.reducer.layout.islands)) if lossy else 0
            rec["ratio"] = reference(W, b, glob, task, "tokens" if tokens else "samples", grads, n, max(rows_all),
                                     islands)
            rec["task"], rec["norm"] = task, "tokens" if tokens else "samples"
        records.append(rec)
        opt.step()
        opt.zero_grad()
    if plan.get("save"):
        msd, osd = get_state_dict(model, opt)
        ckpt.save({"model": msd, "optim": osd, "balancer": balancer}, root, step=first + 10)
    out = {"records": records, "auto": balancer.describe(), "refused": refused}
    if cstate is not None:
        out["compression"] = dict(cstate.stats)
        cstate.close()
    return out if rank == 0 else {"shares": balancer.shares, "auto": balancer.describe()}


# ---------------------------------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------------------------------


def lightning_phase(plan: dict[str, Any], root: str) -> dict[str, Any] | None:
    """The same 10 steps in a ``pytorch_lightning`` Trainer (DDPStrategy on backend vcga) with
    vcga's Balance callback: the module returns the mean over its batch, as Lightning users write it."""
    import pytorch_lightning as pl
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.utils.data import DataLoader, TensorDataset

    import vcga.checkpoint as ckpt
    from vcga.balance import Balancer
    from vcga.integrations.lightning import Balance

    rank, n = dist.get_rank(), dist.get_world_size()
    d = data()
    balancer = Balancer(N, B, plan["shares"], seed=SEED)
    records: list[dict[str, Any]] = []
    first = [0]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            x, y, m, ids = batch
            self._ids = ids.tolist()
            return summed_loss(self.net, {"x": x, "y": y, "m": m}, "regression") / x.shape[0]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> Any:
            ds = TensorDataset(d["x"], d["y"], d["m"], d["id"])
            return DataLoader(ds, batch_sampler=balancer.batch_sampler())

    class Check(pl.Callback):
        def _state(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
            msd, osd = get_state_dict(pl_module, trainer.optimizers[0])
            return {"model": msd, "optim": osd, "balancer": balancer}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if plan.get("resume"):
                state = self._state(trainer, pl_module)
                first[0] = ckpt.load_latest(state, root)
                set_state_dict(pl_module, trainer.optimizers[0], model_state_dict=state["model"],
                               optim_state_dict=state["optim"])

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            rec = _record(balancer, pl_module._ids)
            if rank == 0:
                W, b = (p.detach() for p in pl_module.net.parameters())
                grads = [p.grad for p in pl_module.net.parameters()]
                glob = {k: v[balancer.global_indices(rec["index"])] for k, v in d.items()}
                rec["ratio"] = reference(W, b, glob, "regression", "samples", grads, n, max(rec["shares"]) * T)
            records.append(rec)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            step = first[0] + trainer.global_step  # the step that comes next
            if plan.get("force") and step == plan["force"][0]:
                balancer.set_shares(plan["force"][1])

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if plan.get("save"):
                ckpt.save(self._state(trainer, pl_module), root, step=first[0] + trainer.global_step)

    os.environ.update({"TORCHELASTIC_RUN_ID": "balance", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    from pytorch_lightning.strategies import DDPStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=n, strategy=DDPStrategy(process_group_backend="vcga"),
                         max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[Balance(balancer), Check()])
    trainer.fit(Module())
    return {"records": records, "steps": trainer.global_step} if rank == 0 else None


# ---------------------------------------------------------------------------------------------------
# A world
# ---------------------------------------------------------------------------------------------------


def world(rank: int, size: int, init_method: str, plans: dict[str, dict[str, Any]], root: str) -> dict[str, Any]:
    """Every phase of ``plans`` in turn on one ``vcga`` world (phase name -> its plan)."""
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=size)
    out: dict[str, Any] = {"transport": dist.group.WORLD.transport.backend_name}
    try:
        for name, plan in plans.items():
            where = os.path.join(root, name)
            out[name] = lightning_phase(plan, where) if name == "lightning" else loop_phase(name, plan, where)
    finally:
        dist.destroy_process_group()
    return out
