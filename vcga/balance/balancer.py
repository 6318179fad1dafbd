"""The balancer: a seeded sequence of global batches, split across ranks by shares (docs/balance.md)."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from vcga.balance.shares import AutoPolicy, Decision, counts_from_weights, for_backend, micro_sizes, split_counts
from vcga.balance.timing import ComputeClock
from vcga.errors import VcgaCheckpointError, VcgaConfigError, VcgaError

__all__ = ["Balancer", "BatchSampler", "Step", "STATE_FORMAT", "samples_in"]

log = logging.getLogger(__name__)

#: The layout of :meth:`Balancer.state_dict`; a change older readers cannot follow changes it.
STATE_FORMAT = "vcga.balance/1"

Shares = str | Sequence[int] | Mapping[str, float]
Caps = int | Sequence[int] | Mapping[str, int] | None


def _bad(key: str, value: Any, allowed: str) -> VcgaConfigError:
    return VcgaConfigError(key, value, allowed, "vcga.balance.Balancer")


@dataclass(frozen=True)
class Step:
    """A step the balancer handed out: where it is in the sequence and how it was split."""

    epoch: int
    index: int  #: the step's position in its epoch
    size: int  #: samples in the global batch (the global batch, or an epoch's shorter tail)
    shares: tuple[int, ...]


def _backend_facts(group: Any) -> tuple[str, str | None]:
    """This rank's backend name, and the library a simulated backend stands for (or None)."""
    backend = getattr(getattr(group, "transport", None), "backend", None)
    if backend is not None and hasattr(backend, "describe"):
        d = backend.describe()
        return str(d["name"]), d.get("stands_for")
    return str(dist.get_backend(group)), None


def _is_indices(batch: Any) -> bool:
    return isinstance(batch, list) and all(isinstance(i, int) for i in batch)


def samples_in(batch: Any) -> int | None:
    """The samples in ``batch``: its length for a list of indices, else its first tensor's first dimension."""
    if _is_indices(batch):
        return len(batch)
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = samples_in(item)
            if n is not None:
                return n
    return None


def _split_batch(batch: Any, sizes: list[int]) -> list[Any]:
    """``batch`` (a list of indices, a tensor, or a tuple / list / dict of tensors) cut along the samples."""
    if _is_indices(batch):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [batch[a:a + n] for a, n in zip(starts, sizes, strict=True)]
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, sizes))
    if isinstance(batch, Mapping):
        parts = {k: _split_batch(v, sizes) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(len(sizes))]
    if isinstance(batch, (list, tuple)):
        cols = [_split_batch(x, sizes) for x in batch]
        rows = [[c[i] for c in cols] for i in range(len(sizes))]
        return [type(batch)(*r) if hasattr(batch, "_fields") else type(batch)(r) for r in rows]
    raise _bad("batch", type(batch).__name__, "sample indices, a tensor, or a tuple / list / dict of "
               "tensors whose first dimension is the samples")


class Balancer:
    """This rank's part of every global batch, with the shares of a job whose ranks differ in speed.

    The global batches are a seeded permutation of ``range(num_samples)`` (reshuffled per epoch,
    :meth:`set_epoch`), ``global_batch`` indices per step, cut into consecutive parts by the
    current :attr:`shares`: rank 0 takes the first ``shares[0]``, rank 1 the next, and so on. So the
    samples of a step never depend on the mix of hardware -- only who computes which.
    Nothing is padded or repeated: with ``drop_last`` (the default) an epoch's tail shorter than a
    global batch is left out of that epoch (each epoch reshuffles, so other samples fall in the
    tail next time); with ``drop_last=False`` it is one shorter last step, split in proportion to
    the shares (a tail smaller than the world size cannot give every rank a sample and is left out).

    Iterating yields this rank's sample indices for each optimizer step (a list). A micro-batch cap
    (``micro_batch``) does not change that: :meth:`accumulate` cuts a step's part into
    micro-batches and runs all but the last without gradient synchronisation.

    :param num_samples: the dataset's length.
    :param global_batch: samples per optimizer step over all ranks.
    :param shares: ``"auto"`` (measure, then re-balance; :meth:`measure`), a list with one count
        per rank (summing to ``global_batch``), or a dict of weights keyed by backend name
        (``{"nccl": 2.5, "hccl": 1}``; a simulated backend answers to the name of the library it
        simulates as well). Weights become counts by largest remainder, at least one per rank.
    :param seed: the permutation's seed (epoch ``e`` uses ``seed + e``, as ``DistributedSampler``).
    :param micro_batch: the most samples one forward may take on a rank: one cap for all, a list per
        rank, or a dict keyed by backend name (ranks whose backend it does not name: no cap).
    :param group: the data-parallel group (default: the default group; without an initialised
        default group, a world of one).
    :param warmup: with ``"auto"``, steps whose measurements are discarded (allocation, DDP's
        bucket rebuild after its first iteration).
    :param window: with ``"auto"``, steps between two re-balancing decisions.
    :param smoothing: with ``"auto"``, the weight of the previous speed estimate (:class:`AutoPolicy`).
    :param hysteresis: with ``"auto"``, the predicted gain below which the shares stay.
    """

    def __init__(self, num_samples: int, global_batch: int, shares: Shares = "auto", *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, micro_batch: Caps = None, group: Any = None,
                 warmup: int = 2, window: int = 5, smoothing: float = 0.3, hysteresis: float = 0.03) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise _bad("num_samples", num_samples, "the dataset's length, an integer >= 1")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise _bad("global_batch", global_batch, "an integer >= 1")
        if not isinstance(warmup, int) or warmup < 0 or not isinstance(window, int) or window < 1:
            raise _bad("window", (warmup, window), "warmup >= 0 and window >= 1 steps")
        self.policy = AutoPolicy(smoothing, hysteresis)
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        if global_batch < self.world_size:
            raise _bad("global_batch", global_batch, f"at least one sample per rank: >= {self.world_size}")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.warmup, self.window = warmup, window
        if self.steps_per_epoch < 1:
            raise _bad("global_batch", global_batch, f"at most num_samples ({num_samples}) with drop_last")
        self.epoch = 0
        self.cursor = 0  # steps of this epoch handed out
        self._perm: tuple[int, torch.Tensor] | None = None
        self._backends: list[tuple[str, str | None]] | None = None
        self._clock = ComputeClock()
        self._seen = 0  # steps handed out since the shares mode was set or the state loaded
        self._speeds: list[float] | None = None
        self.last_decision: Decision | None = None
        self._current: Step | None = None
        self._part: int | None = None  # samples of the micro-batch :meth:`accumulate` is in
        self._auto = False
        self._shares: list[int] = []
        self._set(shares, check=False)
        self.caps = self._caps(micro_batch)
        self.cap = self.caps[self.rank]

    # -- shares --------------------------------------------------------------------------------------

    def backends(self) -> list[tuple[str, str | None]]:
        """Every rank's (backend, library it simulates or None), gathered once (collective the first time)."""
        if self._backends is None:
            mine = _backend_facts(self.group) if self.group is not None else ("local", None)
            if self.group is None:
                self._backends = [mine]
            else:
                got: list[Any] = [None] * self.world_size
                dist.all_gather_object(got, mine, group=self.group)
                self._backends = [tuple(x) for x in got]
        return self._backends

    def _set(self, shares: Shares, check: bool) -> None:
        auto = isinstance(shares, str)
        if isinstance(shares, str):
            if shares != "auto":
                raise _bad("shares", shares, '"auto", a list of counts per rank, or a dict of weights keyed by '
                           "backend name")
            counts = self._shares if self._shares else split_counts(self.global_batch, [1.0] * self.world_size)
        elif isinstance(shares, Mapping):
            counts = counts_from_weights(self.global_batch, shares, self.backends())
        else:
            counts = list(shares)
            if (len(counts) != self.world_size or sum(counts) != self.global_batch
                    or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) and c >= 1 for c in counts)):
                raise _bad("shares", counts, f"{self.world_size} integer counts >= 1 that sum to the global batch "
                           f"({self.global_batch})")
            counts = [int(c) for c in counts]
        if check and self.group is not None:  # a forced re-balance must be the same on every rank
            got: list[Any] = [None] * self.world_size
            dist.all_gather_object(got, (counts, auto), group=self.group)
            if any(g != got[0] for g in got):
                raise _bad("shares", shares, f"the same shares on every rank (set_shares is collective); ranks gave "
                           f"{got}")
        self._auto = auto
        self._shares = list(counts)
        self._seen, self._speeds = 0, None
        self._clock.take()

    def set_shares(self, shares: Shares) -> None:
        """Change the shares from the next step (collective: every rank passes the same value).
        ``"auto"`` measures afresh from the current shares."""
        self._set(shares, check=True)
        log.info("vcga.balance: shares set to %s%s", self._shares, " (auto from here)" if self._auto else "")

    @property
    def shares(self) -> list[int]:
        """The count per rank of the current step (after :meth:`set_shares`: of the next one) --
        the same list on every rank."""
        return list(self._shares)

    @property
    def auto(self) -> bool:
        """Whether the shares follow measured speeds (``shares="auto"``)."""
        return self._auto

    @property
    def current(self) -> Step | None:
        """The step most recently handed out (None before the first, and after a state load)."""
        return self._current

    def _caps(self, micro_batch: Caps) -> list[int | None]:
        """Every rank's micro-batch cap (each rank can tell how many micro-steps every other takes)."""
        if micro_batch is None:
            return [None] * self.world_size
        if isinstance(micro_batch, Mapping):
            caps: list[int | None] = [for_backend(micro_batch, b, s) for b, s in self.backends()]
        elif isinstance(micro_batch, int):
            caps = [micro_batch] * self.world_size
        else:
            caps = list(micro_batch)
            if len(caps) != self.world_size:
                raise _bad("micro_batch", caps, f"one cap per rank ({self.world_size})")
        if any(c is not None and (not isinstance(c, int) or c < 1) for c in caps):
            raise _bad("micro_batch", micro_batch, "integer caps >= 1 sample (None: no cap)")
        return caps

    def micro_steps(self) -> list[int]:
        """How many micro-batches each rank's part of the current step takes (its share over its cap)."""
        shares = self._current.shares if self._current is not None else tuple(self._shares)
        return [len(micro_sizes(s, c)) for s, c in zip(shares, self.caps, strict=True)]

    # -- the sequence of global batches --------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        full, tail = divmod(self.num_samples, self.global_batch)
        return full + (1 if not self.drop_last and tail >= self.world_size else 0)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _step_size(self, index: int) -> int:
        return min(self.global_batch, self.num_samples - index * self.global_batch)

    def _permutation(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = (self.epoch, torch.randperm(self.num_samples, generator=g))
            else:
                self._perm = (self.epoch, torch.arange(self.num_samples))
        return self._perm[1]

    def global_indices(self, index: int) -> list[int]:
        """The global batch of step ``index`` of the current epoch: the same on every rank, for any shares."""
        if not 0 <= index < self.steps_per_epoch:
            raise IndexError(f"step {index} of an epoch of {self.steps_per_epoch} steps")
        at = index * self.global_batch
        return self._permutation()[at:at + self._step_size(index)].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` and start it from its first step; the epoch in progress (a
        resumed job calling ``set_epoch`` with the epoch it saved) keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.cursor = int(epoch), 0

    def __iter__(self) -> Iterator[list[int]]:
        if self.cursor >= self.steps_per_epoch:  # a new pass over a finished epoch (no set_epoch: same order)
            self.cursor = 0
        while self.cursor < self.steps_per_epoch:
            yield self._next()

    def _next(self) -> list[int]:
        if self._auto:
            self._decide()
        index = self.cursor
        size = self._step_size(index)
        shares = self._shares if size == self.global_batch else split_counts(size, self._shares)
        start = sum(shares[:self.rank])
        at = index * self.global_batch + start
        mine = self._permutation()[at:at + shares[self.rank]].tolist()
        self._current = Step(self.epoch, index, size, tuple(shares))
        self.cursor += 1
        self._seen += 1
        return mine

    def _decide(self) -> None:
        """At a window's end (every rank at the same step): gather the figures, decide alike."""
        k = self._seen
        if k == self.warmup:
            self._clock.take()
            return
        if k < self.warmup or (k - self.warmup) % self.window:
            return
        got = self._gather(self._clock.take())
        d = self.policy.decide(self.global_batch, self._shares, got, self._speeds)
        self.last_decision = d
        self._speeds = d.speeds
        log.debug("vcga.balance: measured (s, samples) per rank %s; smoothed samples/s %s", got, d.speeds)
        if d.changed:
            log.info("vcga.balance: shares %s -> %s (%s)", self._shares, d.shares, d.reason)
            self._shares = d.shares
        elif d.speeds is None:
            log.warning("vcga.balance: shares='auto' learns speeds from measure(); %s", d.reason)

    def _gather(self, mine: tuple[float, int]) -> list[tuple[float, int]]:
        """Every rank's (seconds, samples): one all_reduce of a small tensor, each rank filling its own
        row (a sum with zeros is exact: every rank receives the same bits). Where the rank computes
        (the measured module's device): a vendor's group takes only its device's tensors."""
        if self.group is None:
            return [mine]
        t = torch.zeros(self.world_size, 2, dtype=torch.float32, device=self._clock.device or "cpu")
        t[self.rank, 0], t[self.rank, 1] = mine
        dist.all_reduce(t, group=self.group)
        return [(float(a), int(b)) for a, b in t.tolist()]

    # -- the loss scale ------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The factor that turns this rank's *sum* of per-sample losses into its part of the mean
        over the global batch, under DDP's (and FSDP's) division of the summed gradient by the
        world size: ``world_size / samples in the global batch``. (A loss that is the mean over this
        rank's batch: multiply by ``loss_scale * len(batch)``.)"""
        size = self._current.size if self._current is not None else self.global_batch
        return self.world_size / size

    def loss_scale_for(self, count: int | torch.Tensor) -> float:
        """The loss scale for a count known only at run time -- the tokens that carry a loss on this
        rank: ``world_size / (that count summed over every rank)``, the factor that turns this rank's
        sum of per-token losses into its part of the mean over every token of the global batch.
        Collective (one all_reduce of the count, where ``count`` is, or on the CPU)."""
        t = (count.detach().reshape(1).to(torch.int64) if isinstance(count, torch.Tensor)
             else torch.tensor([int(count)], dtype=torch.int64))
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        total = int(t.item())
        if total <= 0:
            raise VcgaError(f"loss_scale_for: the count summed over the {self.world_size} ranks is {total}; a "
                            "global batch with nothing to average has no mean (skip the step)")
        return self.world_size / total

    # -- compute: measure, accumulate ----------------------------------------------------------------

    def measure(self, module: torch.nn.Module | None = None, samples: int | None = None) -> Any:
        """A context around this rank's compute for a step (or a micro-batch of it): the balancer
        learns the rank's time per sample from it (with ``shares="auto"``).

        With ``module`` (the DDP/FSDP model or the module inside), the time ends at the last
        gradient the rank computes itself -- before DDP's backward waits for the slowest rank's
        gradients (:mod:`vcga.balance.timing`); without one, the whole block is timed.
        ``samples``: how many samples the block computed (default: this rank's part of the current
        micro-batch or step; pass it when a DataLoader takes batches ahead of training)."""
        if samples is None:
            if self._part is not None:
                samples = self._part
            elif self._current is not None:
                samples = self._current.shares[self.rank]
            else:
                raise VcgaError("measure() before the balancer handed out a step: iterate it first, or pass samples=")
        return self._clock.measure(module, int(samples))

    def micro_batches(self, batch: Any) -> list[Any]:
        """``batch`` (this rank's indices for a step, or the loaded tensors) cut into micro-batches of
        at most this rank's cap (one when it has none)."""
        n = samples_in(batch)
        if n is None:
            raise _bad("batch", type(batch).__name__, "sample indices, or tensors whose first "
                       "dimension is the samples")
        return _split_batch(batch, micro_sizes(n, self.cap))

    def accumulate(self, model: Any, batch: Any) -> Iterator[Any]:
        """Yield ``batch``'s micro-batches (:meth:`micro_batches`); every one but the last runs
        without gradient synchronisation (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``), so
        each optimizer step has one synchronised backward on every rank, however many micro-steps
        each takes. Scale each micro-batch's summed loss by :attr:`loss_scale`.

        FSDP2 gathers parameters inside forward and backward: ranks with different numbers of
        micro-steps stay in step only when no micro-step gathers again, so the model must keep its
        parameters after forward (``fully_shard(..., reshard_after_forward=False)``), and the micro-steps
        before the last keep them after backward too (``set_reshard_after_backward``)."""
        parts = self.micro_batches(batch)
        fsdp = not hasattr(model, "no_sync") and hasattr(model, "set_requires_gradient_sync")
        if fsdp and len(set(self.micro_steps())) > 1 and _reshards_after_forward(model):
            raise _bad("micro_batch", self.caps, "with FSDP2, a model that keeps its parameters between "
                       "micro-steps: fully_shard(..., reshard_after_forward=False) on every sharded "
                       f"module (this step takes {self.micro_steps()} micro-steps per rank; resharding "
                       "after forward would gather a different number of times on each)")
        try:
            for i, part in enumerate(parts):
                self._part = samples_in(part)
                last = i == len(parts) - 1
                with nullcontext() if last else _no_sync(model, fsdp):
                    yield part
        finally:
            self._part = None

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global position: epoch, steps of it handed out, seed -- the same on every rank, and
        meaningful on any other mix (no per-rank offsets: a resumed job splits the next global
        batch by its own shares)."""
        return {"format": STATE_FORMAT, "num_samples": self.num_samples, "global_batch": self.global_batch,
                "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last, "epoch": self.epoch,
                "cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the sequence of global batches ``state`` was saved at (on any mix of ranks)."""
        if state.get("format") != STATE_FORMAT:
            raise VcgaCheckpointError(f"balancer state of format {state.get('format')!r}; this VCGA reads "
                                      f"{STATE_FORMAT!r}")
        for key in ("num_samples", "global_batch", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise VcgaCheckpointError(f"balancer state saved with {key}={state[key]!r}, this balancer has "
                                          f"{getattr(self, key)!r}: the global batches would differ from the saved "
                                          f"job's; create the Balancer with {key}={state[key]!r}")
        self.seed, self.epoch, self.cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])
        self._perm = None
        self._current = None
        self._seen, self._speeds = 0, None
        self._clock.take()

    def describe(self) -> dict[str, Any]:
        """What the balancer is doing, JSON-ready (for logs)."""
        return {"shares": self.shares, "auto": self._auto, "epoch": self.epoch, "cursor": self.cursor,
                "steps_per_epoch": self.steps_per_epoch, "caps": self.caps, "speeds": self._speeds,
                "last_decision": self.last_decision.to_json() if self.last_decision else None}

    def batch_sampler(self) -> BatchSampler:
        """A ``torch.utils.data`` batch sampler over this balancer: ``DataLoader(ds, batch_sampler=...)``."""
        return BatchSampler(self)


def _no_sync(model: Any, fsdp: bool) -> Any:
    if fsdp:
        return _fsdp_no_sync(model)
    if hasattr(model, "no_sync"):
        return model.no_sync()
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    """No reduce-scatter, and the parameters kept gathered for the next micro-step (FSDP2's defaults after)."""
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def _reshards_after_forward(model: Any) -> bool:
    """Whether an FSDP2 module of ``model`` frees its gathered parameters after forward. FSDP2 has
    no public getter: its parameter groups' ``post_forward_mesh_info`` (None: kept); the root, when
    left to FSDP2 (``_auto_reshard_after_forward``), keeps them from its first forward on."""
    for i, m in enumerate(model.modules()):
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        if state is None:
            continue
        root_auto = i == 0 and getattr(state, "_auto_reshard_after_forward", False)
        for group in getattr(state, "_fsdp_param_groups", ()):
            if getattr(group, "post_forward_mesh_info", None) is not None and not root_auto:
                return True
    return False


class BatchSampler(Sampler[list[int]]):
    """``DataLoader(dataset, batch_sampler=balancer.batch_sampler())``: one batch per optimizer step,
    this rank's part of the global batch. ``sampler`` is the balancer, so frameworks that call
    ``set_epoch`` on a loader's ``batch_sampler.sampler`` (Lightning) reshuffle it per epoch.

    A loader with worker processes takes ``prefetch_factor * num_workers`` batches ahead of
    training; the balancer's position (:meth:`Balancer.state_dict`) is what it has handed out."""

    def __init__(self, balancer: Balancer) -> None:
        self.sampler = balancer

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
