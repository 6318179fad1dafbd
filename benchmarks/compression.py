"""Gradient compression on the slow hop: bytes across it, step time and loss, against torch's hooks.

The model is our own teacher–student regression: a fixed random teacher (two tanh layers) maps
Gaussian inputs to targets; the student is an MLP of ``depth`` square ``width × width`` layers
(ReLU), trained with DDP and SGD with momentum 0.9 (``--optim adam`` for Adam) on a fresh batch per
rank and step (``--features V --active a``: sparse inputs, ``a`` of ``V`` features on, the
student's first layer ``V`` wide -- gradients in few columns per step). ``--task lm`` trains a
small causal transformer on a Markov source of tokens with cross-entropy instead
(benchmarks/compression_lm.py): the kind of model and loss the field measures compression on; its
table adds each variant's loss above the source's own (the floor), over exact's. ``--schedule cosine``
warms the learning rate up linearly and decays it to 10% (what language models train with). Every variant
starts from the same student, sees the same batches in the same order, and runs the same number of
steps on the same ranks, in one job:

- ``exact``: DDP's own all_reduce (no hook) -- the baseline;
- ``vcga:<spec>``: ``vcga.compress.ddp_hook(spec)``, e.g. ``vcga:powersgd:rank=4``;
- ``torch-fp16``, ``torch-powersgd:<rank>[:<seed>]``: torch's ``fp16_compress_hook`` and
  ``powerSGD_hook`` (``PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=2,
  random_seed=seed)``: torch's smallest start with error feedback; seed 0 by default) on the same
  ranks -- the anchors;
- ``ref-topk:<ratio>``: a textbook top-k hook (error feedback, the bucket's largest magnitudes,
  all-gathered; GRACE's TopKCompressor with ResidualMemory) -- no library ships one, so this is
  the field's top-k for comparison with vcga's;
- ``ref-dgc:<ratio>[:<warmup>]``: Deep Gradient Compression's top-k (Lin et al., 2018; GRACE's
  DgcMemory): the hook keeps SGD's momentum per rank (momentum correction: the velocity, not the
  gradient, is accumulated and sparsified), clears the sent entries' momentum (factor masking)
  and, over the first ``warmup`` steps, sends 25%, 6.25%, 1.6%, ... of the entries before
  settling at ``ratio`` (DGC's exponential warm-up, four stages); the optimizer then runs without
  momentum, since the hook applies it -- the field's recipe for top-k at 99%+ sparsity;
- ``ref-ef21:<ratio>[:dense]``, ``ref-ef21m:<ratio>``: EF21's top-k (Richtarik et al., 2021: each
  rank sends the top-k of its gradient minus its running estimate; the optimizer gets the sum of
  the estimates), and EF21-SGDM (Fatkhullin et al., 2023: the same on a momentum average, the
  optimizer without momentum) -- the newer error feedback, against the classic residual kind;
- ``compute``: the same steps without DDP, every rank at once (no communication: the floor of
  every step); ``compute+<spec>``: plus the compressor's work on this rank's share of the
  parameters (error feedback, both rounds, what was sent), still sending nothing -- the floor of a
  compressed step (equal work, no link).

Reported per variant: the loss on a fixed held-out batch after the last step (the same on every
rank: the check that every rank holds bitwise identical parameters runs too, over the store), its
ratio to ``exact``'s, the median step time and its ratio to ``exact``'s, the CPU time per step of all
ranks together (every thread of every rank's process: on a shared machine, a figure that others'
load does not inflate the way it inflates wall time), and bytes across the slow
hop per step: counted at the transport by ``vcga.compress.WireMeter`` for vcga's hooks, and -- in
``nodes`` mode -- at the network interface between the namespace nodes for every variant.

Usage::

    python benchmarks/compression.py converge --vendors nccl:2,hccl:2 --steps 200   # one node, sim vendors
    python benchmarks/compression.py nodes --rate 1gbit --steps 30                    # 2 namespace nodes (root)
    python benchmarks/compression.py nodes --per-node 1 --width 640 --depth 3 --interleave --repeat 7 \
        --variants "exact;vcga:powersgd:rank=4;torch-powersgd:4" --ratio "vcga:powersgd:rank=4/torch-powersgd:4"
        # vcga's PowerSGD against torch's hook: step k of each variant back to back, 7 runs, median and IQR
    python benchmarks/compression.py converge --markdown                              # table for docs/benchmarks.md
    python benchmarks/compression.py converge --steps 12000 --curve 100 --target-step 2000
        # time to accuracy: the steps each variant takes to reach exact's loss at step 2000
    python benchmarks/compression.py converge --task lm --width 64 --batch 16 --optim adam --lr 1e-2 \
        --schedule cosine --steps 2000    # the language model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: The teacher maps inputs through this many tanh units (``--teacher-rank``): a structured target a
#: student learns in a few hundred steps; the smaller, the closer to low rank the gradients are.
TEACHER_RANK = 32

#: The batch every variant's final loss is taken on: (size, seed), a seed no training batch has.
HELD_OUT = (512, -1 & 0x7FFFFFFF)

DEFAULT_VARIANTS = ("exact", "vcga:powersgd:rank=4", "vcga:topk:ratio=0.01", "torch-powersgd:4", "torch-fp16",
                    "vcga:fp16", "vcga:bf16", "vcga:sign", "vcga:qsgd:levels=16", "vcga:powersgd:rank=4,scope=all",
                    "vcga:topk:ratio=0.01,scope=all")


# -- the task ----------------------------------------------------------------------------------------


def build(width: int, depth: int, teacher_rank: int = TEACHER_RANK, features: int = 0, active: int = 16,
          seed: int = 0) -> tuple[Any, Any]:
    """(teacher, student), the same on every rank (fixed seeds; ``seed`` changes the student's
    initialisation only); inputs as :func:`inputs`."""
    import torch
    import torch.nn as nn

    inp = features or width
    torch.manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(inp, teacher_rank), nn.Tanh(), nn.Linear(teacher_rank, width))
    with torch.no_grad():  # targets of unit variance: the loss starts near 1
        for p in teacher.parameters():
            p.requires_grad_(False)
        x = inputs(1024, width, torch.Generator().manual_seed(7), features, active)
        teacher[2].weight.mul_(1 / float(teacher(x).std()))
        teacher[2].bias.zero_()
    torch.manual_seed(42 + seed)
    layers: list[Any] = []
    for i in range(depth):
        lin = nn.Linear(inp if i == 0 else width, width)
        if i < depth - 1:  # He initialisation keeps the signal's scale through the ReLUs
            nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
        nn.init.zeros_(lin.bias)
        layers.append(lin)
        if i < depth - 1:
            layers.append(nn.ReLU())
    return teacher, nn.Sequential(*layers)


def inputs(n: int, width: int, g: Any, features: int = 0, active: int = 16) -> Any:
    """``n`` Gaussian inputs of ``width``; with ``features`` > 0 (``--features``), sparse ones
    instead -- ``active`` of ``features`` entries on, as a bag of words or a recommender's
    categorical fields, each sqrt(features / active) so that |x|² = features as for Gaussian ones.
    The student's first layer then gets gradients in few columns per step."""
    import torch

    if not features:
        return torch.randn(n, width, generator=g)
    x = torch.zeros(n, features)
    idx = torch.randint(0, features, (n, active), generator=g)
    x.scatter_(1, idx, (features / active) ** 0.5)
    return x


def batch(teacher: Any, width: int, n: int, seed: int, noise: float = 0.0, features: int = 0,
          active: int = 16) -> tuple[Any, Any]:
    """A batch of inputs and the teacher's targets, plus label noise of standard deviation ``noise``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = inputs(n, width, g, features, active)
    with torch.no_grad():
        y = teacher(x)
        if noise:
            y = y + noise * torch.randn(y.shape, generator=g)
    return x, y


def mse(out: Any, y: Any) -> Any:
    return ((out - y) ** 2).mean()


def task(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(student, draw, loss) of ``--task``: ``draw(n, seed, held_out=False)`` gives a batch of
    ``n`` from ``seed`` alone (the held-out batch without label noise). ``--seed`` changes the
    student's initialisation and the training batches, never the task or the held-out batch."""
    if args.task == "lm":
        import compression_lm as lm

        table = lm.source()
        return lm.build(args.width, args.seed), lambda n, seed, held_out=False: lm.batch(table, n, seed), lm.loss_fn
    teacher, student = build(args.width, args.depth, args.teacher_rank, args.features, args.active, args.seed)

    def draw(n: int, seed: int, held_out: bool = False) -> tuple[Any, Any]:
        return batch(teacher, args.width, n, seed, noise=0.0 if held_out else args.noise, features=args.features,
                     active=args.active)

    return student, draw, mse


def _floor(args: argparse.Namespace) -> float | None:
    """The loss no model beats in expectation on the held-out batch: for the LM, the source's own
    probabilities' loss on it; None for mlp (clean targets: 0)."""
    if args.task != "lm":
        return None
    import compression_lm as lm

    return lm.floor(lm.source(), *HELD_OUT)


def _training_title(args: argparse.Namespace) -> str:
    """The model, batch, optimizer and schedule, for a table's title."""
    if args.task == "lm":
        import compression_lm as lm

        model = (f"causal LM width {args.width} ({lm.LAYERS} layers, context {lm.CONTEXT}, vocabulary {lm.VOCAB}; "
                 f"cross-entropy in nats; the source's own loss on the held-out batch {_floor(args):.5f})")
    else:
        model = f"width {args.width} x depth {args.depth}, teacher rank {args.teacher_rank}"
    return (f"{model}, batch {args.batch}/rank, {args.optim} lr {args.lr}"
            + (f" ({args.lr_warmup} steps warm-up, cosine to 10%)" if args.schedule == "cosine" else "")
            + (f", seed {args.seed}" if args.seed else ""))


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """The learning rate's factor after ``step`` optimizer steps: 1 throughout (``--schedule
    const``), or ``cosine``: a linear warm-up over ``--lr-warmup`` steps, then a cosine decay to
    10% at the last step -- the schedule language models train with."""
    if args.schedule == "const":
        return 1.0
    if step < args.lr_warmup:
        return (step + 1) / args.lr_warmup
    t = (step - args.lr_warmup) / max(args.steps - args.lr_warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


# -- one rank ------------------------------------------------------------------------------------------


def _hook_for(variant: str, meter: Any, momentum: float = 0.0) -> tuple[Any, Any, Any]:
    """(state, hook, closer) for a variant; (None, None, None) for exact. ``momentum``: SGD's, for
    the hooks that apply it themselves (``ref-dgc``)."""
    import torch.distributed as dist

    if variant == "exact":
        return None, None, None
    if variant == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        return None, fp16_compress_hook, None
    if variant.startswith("torch-powersgd:"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        rank, _, seed = variant.split(":", 1)[1].partition(":")
        state = ps.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=int(rank), start_powerSGD_iter=2,
                                 random_seed=int(seed or 0))
        return state, ps.powerSGD_hook, None
    if variant.startswith("ref-topk:"):
        return None, _reference_topk(float(variant.split(":", 1)[1])), None
    if variant.startswith("ref-dgc:"):
        ratio, _, warmup = variant.split(":", 1)[1].partition(":")
        return None, _reference_topk(float(ratio), momentum=momentum, warmup=int(warmup or 0)), None
    if variant.startswith("ref-ef21:"):
        ratio, _, dense = variant.split(":", 1)[1].partition(":")
        return None, _reference_ef21(float(ratio), dense_first=dense == "dense"), None
    if variant.startswith("ref-ef21m:"):
        return None, _reference_ef21(float(variant.split(":", 1)[1]), momentum=momentum), None
    if variant.startswith("vcga:"):
        from vcga.compress import ddp_hook

        state, hook = ddp_hook(variant[5:], meter=meter)
        return state, hook, state.close
    raise SystemExit(f"unknown variant {variant!r}")


def _reference_topk(ratio: float, momentum: float = 0.0, warmup: int = 0) -> Any:
    """A textbook top-k DDP hook, for comparison (no library ships one: torch's hooks stop at
    PowerSGD, DeepSpeed and Horovod have none): per bucket, error feedback in one float tensor, the
    ``ratio`` largest magnitudes of the whole bucket (GRACE's ``TopKCompressor`` with
    ``ResidualMemory``), all-gathered from every rank and summed in rank order. Scope ``all``:
    every rank's values cross every link.

    With ``momentum`` > 0, Deep Gradient Compression's top-k (Lin et al., 2018, section 3; GRACE's
    ``DgcMemory``): the velocity ``u = momentum * u + g`` is accumulated (``v += u``) and ``v``'s
    largest entries are sent; the sent entries of ``u`` and ``v`` are cleared (momentum factor
    masking). The optimizer must then run without momentum. ``warmup`` > 0: DGC's warm-up, the
    share sent falls 25%, 6.25%, 1.5625%, 0.39% over four equal stages of that many steps, never
    below ``ratio``."""
    import torch
    import torch.distributed as dist

    residual: dict[int, Any] = {}
    velocity: dict[int, Any] = {}
    calls: dict[int, int] = {}

    def hook(state, bucket):  # type: ignore[no-untyped-def] # no annotations: DDP checks them against GradBucket
        i = bucket.index()
        step = calls[i] = calls.get(i, -1) + 1
        g = bucket.buffer()
        if momentum:  # DGC: the velocity is what accumulates and is sent
            g = velocity[i] = velocity[i].mul_(momentum).add_(g) if i in velocity else g.clone()
        x = g + residual[i] if i in residual else g.clone()
        share = ratio
        if warmup and step < warmup:
            share = max(ratio, 0.25 ** (1 + 4 * step // warmup))
        k = max(1, math.ceil(share * x.numel()))
        idx = torch.topk(x.abs(), k, sorted=False).indices
        val = x[idx]
        x[idx] = 0  # what was not sent: the residual
        residual[i] = x
        if momentum:
            g[idx] = 0  # momentum factor masking
        world = dist.get_world_size()
        idxs = [torch.empty_like(idx) for _ in range(world)]
        vals = [torch.empty_like(val) for _ in range(world)]
        dist.all_gather(idxs, idx)
        dist.all_gather(vals, val)
        out = torch.zeros_like(g)
        for j, v in zip(idxs, vals, strict=False):  # rank order: every rank adds the same values in the same order
            out.index_add_(0, j, v)
        fut: Any = torch.futures.Future()
        fut.set_result(out.div_(world))
        return fut

    return hook


def _reference_ef21(ratio: float, dense_first: bool = False, momentum: float = 0.0) -> Any:
    """EF21's top-k DDP hook (Richtarik, Sokolov, Fatkhullin 2021, Algorithm 1), for comparison:
    the newer error feedback that claims to beat the classic residual kind. Each rank keeps an
    estimate ``e`` of its gradient and sends the top-k of ``g - e`` (the innovation), adding what it
    sent to ``e``; every rank adds the peers' sent values, in rank order, to the shared sum ``E`` (the
    sum of all estimates) and the optimizer gets ``E / world``: a dense, lagging estimate of the
    gradient, where the classic kind delivers each coordinate's accumulated residual in a burst.

    ``dense_first``: the first step sends the whole gradient (EF21's ``g_i^0 = grad f_i(x^0)``).
    ``momentum`` > 0: EF21-SGDM (Fatkhullin, Tyurin, Richtarik 2023, "Momentum provably improves
    error feedback!"): the top-k is of ``v - e`` with ``v = momentum * v + (1 - momentum) * g``, and
    the hook hands on ``E / (world * (1 - momentum))``, so that the optimizer, run without momentum,
    steps as far as SGD with heavy-ball momentum does on a steady gradient."""
    import torch
    import torch.distributed as dist

    estimate: dict[int, Any] = {}  # this rank's e, per bucket
    shared: dict[int, Any] = {}  # E: the sum of every rank's e, the same bits on every rank
    velocity: dict[int, Any] = {}

    def done(t: Any) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_result(t)
        return fut

    def hook(state, bucket):  # type: ignore[no-untyped-def] # no annotations: DDP checks them against GradBucket
        i = bucket.index()
        g = bucket.buffer()
        world = dist.get_world_size()
        scale = world * (1 - momentum)
        if momentum:
            g = velocity[i] = (velocity[i].mul_(momentum).add_(g, alpha=1 - momentum) if i in velocity
                               else g.mul(1 - momentum))
        if i not in estimate:
            estimate[i], shared[i] = torch.zeros_like(g), torch.zeros_like(g)
            if dense_first:
                estimate[i].copy_(g)
                shared[i].copy_(g)
                dist.all_reduce(shared[i])
                return done(shared[i].div(scale))
        d = g - estimate[i]
        k = max(1, math.ceil(ratio * d.numel()))
        idx = torch.topk(d.abs(), k, sorted=False).indices
        val = d[idx]
        estimate[i].index_add_(0, idx, val)
        idxs = [torch.empty_like(idx) for _ in range(world)]
        vals = [torch.empty_like(val) for _ in range(world)]
        dist.all_gather(idxs, idx)
        dist.all_gather(vals, val)
        for j, v in zip(idxs, vals, strict=False):  # rank order: every rank adds the same values in the same order
            shared[i].index_add_(0, j, v)
        return done(shared[i].div(scale))

    return hook


def _link_bytes() -> int:
    """Bytes sent plus received on this node's inter-node interfaces (``eth*`` of the namespace
    node, read from /proc/self/net/dev: this process's network namespace), else -1."""
    if not os.environ.get("VCGA_BENCH_NODES"):
        return -1
    total, found = 0, False
    try:
        with open("/proc/self/net/dev") as f:
            lines = f.read().splitlines()[2:]
    except OSError:
        return -1
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip().startswith("eth"):
            fields = rest.split()
            total += int(fields[0]) + int(fields[8])  # received + sent bytes
            found = True
    return total if found else -1


def _local_work(spec_text: str, model: Any, rank: int, world: int) -> Any:
    """The compression work one rank does per step under scope ``bridge`` on two islands of
    ``world // 2`` ranks, without any communication: error feedback in and out, both rounds of
    compress and decode (payloads summed by doubling), and what was sent, on this rank's share of
    the parameters (its rows of every matrix, or its range of every tensor, as the reducer cuts
    them). An equal-work floor: the step can be no faster than compute plus this."""
    from vcga.compress import Reducer, parse_spec
    from vcga.compress.ef import ErrorFeedback
    from vcga.compress.engine import create_compressor
    from vcga.contract import Combine, CompressContext

    comp = create_compressor(parse_spec(spec_text))
    k = max(world // 2, 1)
    local = rank % k
    # this rank's share as the reducer cuts it: a compressor that needs shapes gets its rows of
    # every matrix (Reducer.pieces), an element-wise one its range of every parameter
    params = []
    for p in model.parameters():
        n, shape = p.numel(), tuple(p.shape)
        if comp.elementwise:
            cuts = Reducer.cuts(n, k, None)
            params.append((p, None, cuts[local], cuts[local + 1]))
        else:
            cuts = Reducer.cuts(n, k, None)
            for _, start, s in Reducer.pieces([shape], [0], cuts[local], cuts[local + 1]):
                params.append((p, s, start, start + math.prod(s)))
    params = [q for q in params if q[3] > q[2]]
    efs = [ErrorFeedback() for _ in params]
    states: list[dict[str, Any]] = [{} for _ in params]

    def run(step: int) -> None:
        for (p, shape, a, b), ef, st in zip(params, efs, states, strict=False):
            g = p.grad.reshape(-1)[a:b]
            g = g.view(shape) if shape is not None else g
            x = ef.input(g) if comp.error_feedback else g
            ctx = CompressContext(2, 0, step, 0)
            out, pl = None, []
            rounds = comp.rounds if comp.combine is Combine.SUM else 1
            for rnd in range(rounds):
                pl = comp.compress(x, st, ctx, rnd)
                if comp.combine is Combine.SUM:
                    out = comp.decompress([q + q for q in pl], st, ctx, rnd)
                else:  # each of the two peers' payloads decodes on its own
                    out = comp.decompress(pl, st, ctx, rnd)
                    out = comp.decompress(pl, st, ctx, rnd)
                if out is not None:
                    break
            if comp.error_feedback:
                ef.update(x, comp.sent(x, pl, st, ctx))

    return run


class Variant:
    """One variant's training on this rank: built (model, DDP, hook, optimizer), stepped one step at
    a time (:meth:`step`), and summed up (:meth:`result`, collective: every rank in the same
    order). ``run_variant`` steps one variant to its end; ``--interleave`` steps every variant's
    step k before any variant's step k + 1, in rotating order (the same on every rank), so that the
    machine's load falls on all of them alike."""

    def __init__(self, variant: str, args: argparse.Namespace, rank: int, world: int) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from vcga.compress import WireMeter

        self.variant, self.args, self.rank, self.world = variant, args, rank, world
        self.student, self.draw, self.loss_fn = task(args)
        student = self.student
        self.work = (_local_work(variant[len("compute+"):], student, rank, world) if variant.startswith("compute+")
                     else None)
        self.compute_only = variant == "compute" or self.work is not None
        # "compute": the same steps without DDP (no communication), every rank at once -- the floor of
        # every variant's step (its loss is one rank's own training: not compared); "compute+SPEC": plus
        # the compressor's work on this rank's share, without sending anything -- a compressed step's floor
        self.ddp = student if self.compute_only else DDP(student, bucket_cap_mb=args.bucket_mb)  # no buffers to sync
        self.meter = WireMeter()
        # ref-dgc and ref-ef21m apply SGD's momentum inside their hooks: their optimizer has none
        in_hook = variant.startswith(("ref-dgc:", "ref-ef21m:"))
        if in_hook and args.optim != "sgd":
            raise SystemExit(f"{variant.split(':')[0]} applies SGD's momentum in its hook: use --optim sgd")
        self.state, hook, self.closer = _hook_for("exact" if self.compute_only else variant, self.meter, args.momentum)
        if hook is not None:
            self.ddp.register_comm_hook(self.state, hook)
        self.opt = (torch.optim.Adam(self.ddp.parameters(), lr=args.lr) if args.optim == "adam"
                    else torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=0.0 if in_hook else args.momentum))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, args))
        self.times: list[float] = []
        # --curve K: the held-out loss every K steps (the same batch as the final loss)
        self.xe, self.ye = self.draw(*HELD_OUT, held_out=True)
        self.curve: list[tuple[int, float]] = []
        self.cpu = 0.0  # CPU seconds of the timed steps (every thread of this rank)
        self.link = 0  # bytes on this node's link during the timed steps (-1: not counted)

    def step(self, step: int, fenced: bool = False) -> None:
        """One training step (``fenced``: between barriers, its link bytes and CPU its own)."""
        import torch
        import torch.distributed as dist

        args = self.args
        x, y = self.draw(args.batch, 1_000_003 * step + self.rank + 7_919 * args.seed)
        timed = step >= args.warmup
        if step == args.warmup:
            self.meter.reset()
        if fenced or step == args.warmup:
            dist.barrier()
        if fenced or step == args.warmup:
            link0, cpu0 = _link_bytes(), time.process_time()
        t0 = time.perf_counter()
        loss = self.loss_fn(self.ddp(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.work is not None:
            self.work(step)
        self.opt.step()
        self.sched.step()
        self.times.append(time.perf_counter() - t0)
        if fenced:
            cpu1 = time.process_time()
            dist.barrier()
            link1 = _link_bytes()
            if timed:
                self.cpu += cpu1 - cpu0
                self.link = -1 if link0 < 0 or self.link < 0 else self.link + link1 - link0
        elif step == args.warmup:
            self._link0, self._cpu0 = link0, cpu0
        if args.curve and (step + 1) % args.curve == 0 and not self.compute_only:  # untimed
            with torch.no_grad():
                self.curve.append((step + 1, float(self.loss_fn(self.student(self.xe), self.ye))))

    def result(self, fenced: bool = False) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        args, world, student = self.args, self.world, self.student
        if not fenced:  # the timed steps ran back to back: their CPU and link bytes since the warm-up
            cpu1 = time.process_time()  # every thread of this rank: training, hook, library, bridge
            dist.barrier()
            link1 = _link_bytes()
            link0, cpu0 = getattr(self, "_link0", -1), getattr(self, "_cpu0", cpu1)
            self.cpu = cpu1 - cpu0
            self.link = link1 - link0 if link0 >= 0 else -1
        timed = max(args.steps - args.warmup, 1)
        with torch.no_grad():
            final = float(self.loss_fn(student(self.xe), self.ye))
        flat = torch.cat([p.detach().reshape(-1) for p in student.parameters()])
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, digest)
        # step time: the slowest rank's median
        med = torch.tensor([statistics.median(self.times[args.warmup:]) if args.steps > args.warmup else 0.0],
                           dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        cross = torch.tensor([self.meter.total_sent("cross") / timed], dtype=torch.float64)
        dist.all_reduce(cross)  # every rank's bytes across the hop
        cpu = torch.tensor([self.cpu / timed], dtype=torch.float64)
        dist.all_reduce(cpu)  # CPU seconds per step, all ranks together
        lb = torch.tensor([self.link / timed if self.link >= 0 else -1.0], dtype=torch.float64)
        dist.all_reduce(lb, op=dist.ReduceOp.MAX)
        described = self.state.describe() if hasattr(self.state, "describe") else None
        if self.closer is not None:
            self.closer()
        grad_bytes = sum(p.numel() * p.element_size() for p in student.parameters())
        return {"variant": self.variant, "loss": final, "identical": len(set(digests)) == 1, "step_s": float(med),
                "curve": self.curve, "cpu_s": float(cpu), "grad_bytes": grad_bytes,
                "meter_cross_bytes_per_step": float(cross) if self.variant.startswith("vcga:") else None,
                # tx+rx of one node's link = bytes crossing it in both directions
                "link_bytes_per_step": float(lb) if float(lb) >= 0 else None,
                "auto": (described or {}).get("auto")}


def run_variant(variant: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    v = Variant(variant, args, rank, world)
    for step in range(args.steps):
        v.step(step)
    return v.result()


def run_interleaved(args: argparse.Namespace, rank: int, world: int) -> list[dict[str, Any]]:
    """Every variant built first; then step k of each, in an order that rotates with k (the same on
    every rank), between barriers; then each one's result, in the order given."""
    vs = [Variant(v, args, rank, world) for v in args.variants]
    for step in range(args.steps):
        r = step % len(vs)
        for v in vs[r:] + vs[:r]:
            v.step(step, fenced=True)
    return [v.result(fenced=True) for v in vs]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any = None) -> None:
    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers the vcga backend

    torch.set_num_threads(1)
    if port:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("vcga")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = (run_interleaved(args, rank, world) if args.interleave
               else [run_variant(v, args, rank, world) for v in args.variants])
    dist.destroy_process_group()
    if rank == 0:
        if queue is not None:
            queue.put(results)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f)


# -- the two modes -------------------------------------------------------------------------------------


def _steps_to_target(results: list[dict[str, Any]], base: dict[str, Any], target_step: int, markdown: bool) -> str:
    """Time to accuracy in steps: the first step (of those ``--curve`` evaluated) at which each
    variant's held-out loss is at most exact's at ``target_step``, and its ratio to ``target_step``;
    with the step times, the wall time to that loss against exact's."""
    from _ranks import table

    want = dict(base["curve"]).get(target_step)
    if want is None:
        raise SystemExit(f"--target-step {target_step} is not a step --curve evaluated (a multiple of it, <= --steps)")
    rows = []
    for r in results:
        if r["variant"].startswith("compute"):
            continue
        hit = next((st for st, loss in r["curve"] if loss <= want), None)
        rows.append([r["variant"], "not within " + str(r["curve"][-1][0]) if hit is None else str(hit),
                     "–" if hit is None else f"{hit / target_step:.2f}",
                     "–" if hit is None else f"{hit * r['step_s'] / (target_step * base['step_s']):.2f}"])
    head = [f"variant (exact's loss at step {target_step}: {want:.5f})", "steps to it", "steps / exact's",
            "time / exact's (steps x this run's step times)"]
    return table(head, rows, markdown)


def report(results: list[dict[str, Any]], markdown: bool, title: str, rate_bps: float = 0.0,
           target_step: int = 0, loss_floor: float | None = None) -> str:
    """The table; with ``loss_floor`` (the LM source's own loss on the held-out batch), a column of each variant's
    loss above the floor over exact's: the share of what exact learned that the variant missed."""
    from _ranks import table

    base = next(r for r in results if r["variant"] == "exact")
    lines = []
    for r in results:
        def b(v: float | None) -> str:
            return "–" if v is None else f"{v / 1e6:.3f} MB"
        own = r["variant"].startswith("compute")  # every rank trains alone: loss and identity do not apply
        lines.append([r["variant"], "–" if own else f"{r['loss']:.5f}", "–" if own else f"{r['loss'] / base['loss']:.3f}",
                      f"{r['step_s'] * 1e3:.0f} ms", f"{r['step_s'] / base['step_s']:.2f}",
                      f"{r['cpu_s'] * 1e3:.0f} ms" if "cpu_s" in r else "–",
                      b(r["link_bytes_per_step"]), b(r["meter_cross_bytes_per_step"]),
                      "–" if own else ("yes" if r["identical"] else "NO")])
        if loss_floor is not None:
            lines[-1].insert(3, "–" if own else f"{(r['loss'] - loss_floor) / (base['loss'] - loss_floor):.3f}")
    head = ["variant", "loss", "loss / exact", "step", "step / exact", "CPU/step", "link bytes/step", "metered cross/step",
            "ranks identical"]
    if loss_floor is not None:
        head.insert(3, "above floor / exact's")
    out = title + "\n" + table(head, lines, markdown)
    if target_step and base["curve"]:
        out += "\n\n" + _steps_to_target(results, base, target_step, markdown)
    comp = next((r for r in results if r["variant"] == "compute"), None)
    if rate_bps and comp is not None:
        # The floors: exact DDP moves every gradient byte across the link each way at least once
        # (bridge: each node's shard peers exchange halves), so its step is at least
        # max(compute, bytes / rate); a compressed step is at least compute + compression.
        link_s = base["grad_bytes"] / (rate_bps / 8)
        floor = max(comp["step_s"], link_s)
        out += (f"\nfloors: compute only {comp['step_s'] * 1e3:.0f} ms; gradient bytes / link = "
                f"{base['grad_bytes'] / 1e6:.1f} MB / {rate_bps / 1e6:.0f} Mbit/s = {link_s * 1e3:.0f} ms; exact's "
                f"floor max(compute, link) = {floor * 1e3:.0f} ms (exact measured at {base['step_s'] / floor:.2f}x it)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("converge", "nodes", "rank"))
    ap.add_argument("--vendors", default="nccl:2,hccl:2")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS).replace(",vcga:", ";vcga:").replace(",torch", ";torch").replace(",exact", ";exact"),
                    help="variants separated by ';'")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--optim", choices=("adam", "sgd"), default="sgd")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    ap.add_argument("--noise", type=float, default=0.0, help="label noise (standard deviation)")
    ap.add_argument("--teacher-rank", type=int, default=TEACHER_RANK, help="the teacher's tanh units")
    ap.add_argument("--features", type=int, default=0, help="sparse inputs: this many features, --active on")
    ap.add_argument("--active", type=int, default=16, help="features on per example (with --features)")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--per-node", type=int, default=2, choices=(1, 2),
                    help="nodes mode: ranks per node (1: each node's rank has a core of this host to itself)")
    ap.add_argument("--curve", type=int, default=0, metavar="K",
                    help="evaluate the held-out loss every K steps (for --target-step)")
    ap.add_argument("--target-step", type=int, default=0, metavar="T",
                    help="with --curve: report the steps each variant takes to reach exact's loss at step T")
    ap.add_argument("--task", choices=("mlp", "lm"), default="mlp",
                    help="mlp: the teacher-student regression; lm: a small causal transformer on a Markov source "
                         "(benchmarks/compression_lm.py; --width is its model width, 64 for ~106 k parameters)")
    ap.add_argument("--schedule", choices=("const", "cosine"), default="const",
                    help="the learning rate: constant, or --lr-warmup steps of linear warm-up and a cosine decay to 10%%")
    ap.add_argument("--lr-warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0,
                    help="another student initialisation and other training batches (the task and held-out batch stay)")
    ap.add_argument("--out", default="")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--interleave", action="store_true",
                    help="build every variant first, then run step k of each (rotating order, between barriers) "
                         "before step k + 1: the machine's load falls on all alike")
    ap.add_argument("--repeat", type=int, default=1, help="nodes mode: this many runs, a fresh cluster each")
    ap.add_argument("--ratio", action="append", default=[], metavar="A/B[,C]",
                    help="nodes mode: report A's step over B's (or over the faster of B and C) in every run, "
                         "with the median and interquartile range (repeatable)")
    ap.add_argument("--bucket-ms", type=float, default=1.0, help="nodes mode: tbf's bucket in ms at the link's rate")
    ap.add_argument("--json", default="", help="nodes mode: every run's figures")
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if "exact" not in args.variants:
        args.variants.insert(0, "exact")
    if args.mode == "rank":  # one rank under torchrun (nodes mode)
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args)
        return
    if args.mode == "converge":
        from _ranks import run_ranks

        os.environ["VCGA_SIM_VENDORS"] = args.vendors
        world = sum(int(p.split(":")[1]) for p in args.vendors.split(","))
        results = run_ranks(rank_main, world, args)
        title = (f"{world} ranks ({args.vendors}, one node), {_training_title(args)}, {args.steps} steps"
                 + (f", label noise {args.noise}" if args.noise else "")
                 + (f", sparse inputs ({args.active} of {args.features} features on)" if args.features else ""))
        print(report(results, args.markdown, title, target_step=args.target_step, loss_floor=_floor(args)))
        return
    run_nodes(args)


def run_nodes(args: argparse.Namespace) -> None:
    """2 namespace nodes x ``--per-node`` ranks, nccl ranks on node 0 and hccl ranks on node 1, link
    at ``--rate``; ``--repeat`` times (a fresh cluster each), then the ``--ratio`` summary."""
    from vcga.testing.multinode import parse_rate

    title = (f"2 nodes x {args.per_node} rank{'s' if args.per_node > 1 else ''} (sim-nccl on node0, sim-hccl on "
             f"node1), link {args.rate} (tbf bucket {args.bucket_ms:g} ms), {_training_title(args)}, {args.steps} steps "
             f"({args.warmup} untimed){', variants interleaved step by step' if args.interleave else ''}")
    runs = []
    for i in range(args.repeat):
        results = _nodes_once(args)
        runs.append(results)
        print(report(results, args.markdown, title + (f", run {i + 1} of {args.repeat}" if args.repeat > 1 else ""),
                     parse_rate(args.rate), target_step=args.target_step, loss_floor=_floor(args)), flush=True)
        for r in results:
            if r.get("auto"):
                print(f"  {r['variant']} when=auto: " + "; ".join(
                    f"{b['bucket']}: {'compressed' if b['compress'] else 'plain'} (model: "
                    f"{'compressed' if b['model_chose'] else 'plain'}; observed ms "
                    + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b["observed_s"].items()) + ")"
                    for b in r["auto"]["buckets"]), flush=True)
    if args.ratio:
        print("\n" + ratio_summary(runs, args.ratio, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "runs": runs}, f)


def ratio_summary(runs: list[list[dict[str, Any]]], ratios: list[str], markdown: bool) -> str:
    """Per ``A/B[,C]``: A's step over min(B's, C's) in each run (the same run's figures), their
    median and interquartile range."""
    from _ranks import table

    rows = []
    for spec in ratios:
        a, _, rest = spec.partition("/")
        per = []
        for results in runs:
            step = {r["variant"]: r["step_s"] for r in results}
            missing = [v for v in (a, *rest.split(",")) if v not in step]
            if missing:
                raise SystemExit(f"--ratio {spec}: no variant {missing[0]!r} in this run")
            per.append(step[a] / min(step[b] for b in rest.split(",")))
        q = statistics.quantiles(per, n=4) if len(per) >= 2 else [per[0]] * 3
        rows.append([f"{a} / {'min(' + rest + ')' if ',' in rest else rest}", ", ".join(f"{v:.3f}" for v in per),
                     f"{statistics.median(per):.3f}", f"{q[0]:.3f}-{q[2]:.3f}", str(len(per))])
    return table(["ratio (step)", "per run", "median", "IQR", "runs"], rows, markdown)


def _nodes_once(args: argparse.Namespace) -> list[dict[str, Any]]:
    import shutil
    import tempfile
    import threading

    try:
        from vcga.testing.multinode import Cluster, NodesUnavailable
    except ImportError:
        raise SystemExit("nodes mode needs vcga.testing.multinode (the multi-node harness)") from None
    out = tempfile.mkdtemp(prefix="vcga-compress-bench-")
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            with Cluster(nodes=2, rate=args.rate, bucket_s=args.bucket_ms / 1e3) as cluster:
                argv = [os.path.abspath(__file__), "rank", "--variants", ";".join(args.variants),
                        "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
                        "--depth", str(args.depth), "--batch", str(args.batch), "--lr", str(args.lr),
                        "--bucket-mb", str(args.bucket_mb), "--optim", args.optim, "--momentum", str(args.momentum),
                        "--noise", str(args.noise), "--teacher-rank", str(args.teacher_rank),
                        "--features", str(args.features), "--active", str(args.active), "--curve", str(args.curve),
                        "--task", args.task, "--schedule", args.schedule, "--lr-warmup", str(args.lr_warmup),
                        "--seed", str(args.seed), "--out", os.path.join(out, "r.json"),
                        *(["--interleave"] if args.interleave else [])]
                env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
                env.update(VCGA_TIMEOUT="600", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
                launch = cluster.torchrun(argv, nproc_per_node=args.per_node, env=env,
                                          node_env=[{"VCGA_BACKEND": "sim-nccl", "VCGA_BENCH_NODES": "1"},
                                                    {"VCGA_BACKEND": "sim-hccl", "VCGA_BENCH_NODES": "1"}])
                result["nodes"] = launch.wait(timeout=3000)
        except NodesUnavailable as e:
            result["error"] = str(e)

    t = threading.Thread(target=go)  # the cluster's holders die with the thread that made them
    t.start()
    t.join()
    try:
        if "error" in result:
            raise SystemExit(result["error"])
        bad = [r for r in result["nodes"] if r.returncode != 0]
        if bad:
            raise SystemExit("a node failed:\n" + bad[0].output[-4000:])
        with open(os.path.join(out, "r.json")) as f:
            return json.load(f)  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
