"""The all_reduce algorithms of the bridge (leader, bandwidth, replicated) and their choice.

:class:`AllReducer` is the half of a :class:`~vcga.bridge.group.BridgeGroup` that reduces:
the building blocks (a step in the vendor group, a reduction among shard peers on the host), the
three algorithms, the creation-time measurement of their steps' α–β figures per link class
(:mod:`vcga.bridge.cost`) and the choice "auto" makes from them. Algorithms and error bounds are in
``docs/bridge.md``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vcga import dtypes as _dtypes
from vcga.bridge.comms import Communicators
from vcga.bridge.cost import (
    BRIDGE_KINDS,
    GROUP_KINDS,
    LARGE_SIZE,
    SIZES,
    LinkFigures,
    choices,
    choose,
    fit,
    fit_past_knee,
    predict,
    segments,
)
from vcga.bridge.host import as_bytes, combine_rows, combiner, on_host, put_back
from vcga.bridge.plan import (
    ALGORITHMS,
    AUTO_LARGE,
    MODEL_MAX_SEGMENTS,
    MODEL_MIN_SEGMENT_BYTES,
    PIPELINE_MAX_SEGMENTS,
    PIPELINE_SEGMENT_BYTES,
    PLAN_SIZES,
    Plan,
    VendorGroup,
    group_route,
    size_name,
)
from vcga.bridge.verify import VERIFY_MIN_BYTES, PlanCheck
from vcga.contract import CapabilityTable, ReduceOp
from vcga.pg.dispatch import Steps
from vcga.pg.recorder import stage

__all__ = ["AllReducer"]

log = logging.getLogger("vcga.bridge")


def _run(steps: Steps) -> None:
    """Complete what a vendor dispatcher issued: wait for its native works, then its local steps."""
    for w in steps.works:
        w.wait()
    for f in steps.finish:
        f()


#: The dtypes whose all_reduces are checked online (:mod:`vcga.bridge.verify`): SUM in them carries
#: a watched call's report (seconds, a decision code) exactly.
_CHECKED_DTYPES = (torch.float32, torch.float64)

#: (dtype, op) gloo reduces exactly as the host would (measured table, plugins/gloo/gloo_capabilities.json).
_GLOO_REDUCES = {(dt, op) for dt in (torch.float32, torch.float64, torch.int32, torch.int64)
                 for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)}


class AllReducer:
    """All-reduce by the plan's algorithms, and choose among them (the reducing half of a
    :class:`~vcga.bridge.group.BridgeGroup`, which owns one).

    :param plan: the plan (same on every rank).
    :param rank: this rank in the ``vcga`` group.
    :param comms: the communicators it runs on, shared with its group (per lane).
    :param tables: every vendor group's capability table, in plan order.
    """

    def __init__(self, plan: Plan, rank: int, comms: Communicators, tables: Sequence[CapabilityTable]) -> None:
        self.plan, self.rank, self.comms = plan, rank, comms
        self.tables = list(tables)
        self.vgroup: VendorGroup = plan.group_of(rank)
        self.local_rank = self.vgroup.ranks.index(rank)
        self._routes: dict[tuple[torch.dtype, ReduceOp], tuple[str | None, ...]] = {}
        #: how often each algorithm ran (tests and benchmarks read it)
        self.counts = dict.fromkeys(ALGORITHMS, 0)
        #: how the bandwidth algorithm reduce-scatters and all-gathers inside this vendor group:
        #: "collective" (the library's reduce_scatter / all_gather) or "p2p" (rings over its
        #: send/recv). Chosen per vendor group by measured cost (:meth:`measure_links`); every rank of
        #: a vendor group must hold the same value (other groups may differ).
        self.group_method = "collective"
        #: pipeline segments at most (1: no pipelining); the same on every rank of the group
        self.max_segments = MODEL_MAX_SEGMENTS
        #: every pipelined all_reduce in exactly this many segments instead of the figures' choice
        #: (benchmarks compare; None: chosen); the same on every rank of the group
        self.fixed_segments: int | None = None
        self._segment_counts: dict[int, int] = {}
        self._padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> (padded copy, shard)
        #: what "auto" runs from BANDWIDTH_MIN_BYTES on when nothing was measured (the plan's rule)
        self.auto_large = AUTO_LARGE
        #: the α–β figures "auto" chooses from (:meth:`measure_links`; None: not measured)
        self.figures: LinkFigures | None = None
        self._choices: dict[int, str] = {}
        #: the link class of each kind of step this rank's plan uses (set at creation)
        self.link_classes: dict[str, str] = {}
        #: the figures, their classes and the choice per size, for describe() (None: not measured)
        self.calibration: dict[str, Any] | None = None
        #: choose by the per-all_reduce cost of a pipelined stream (the group pipelines across collectives)
        self.stream_choice = False
        #: config ``bridge_verify``: check "auto"'s choice online (:mod:`vcga.bridge.verify`); set at creation
        self.verify = True
        #: the online check of the choice (None: no figures, a pinned algorithm, or verify off)
        self.check: PlanCheck | None = None
        #: rank 0: (cache directory, topology) where corrected figures are stored, or None
        self.cache_entry: tuple[Any, Any] | None = None
        self._debug = log.isEnabledFor(logging.DEBUG)

    def pipeline_across_collectives(self, on: bool) -> None:
        """Choose for a pipelined stream of all_reduces (the group has a second lane) or not: the
        choices are made again, by the new measure."""
        self.stream_choice = on
        self._choices.clear()
        self._segment_counts.clear()
        if self.figures is not None:
            self.apply_figures(self.figures)  # describe()'s choice table, by the new measure

    # -- building blocks -------------------------------------------------------------------------

    def in_group(self, issue: Callable[[Steps], None], what: str = "step") -> None:
        """Issue a step in this rank's vendor group and wait for it (``what`` names it: the
        flight recorder's stage, the profiler's span)."""
        if self.comms.inner is not None:
            with stage(what, "in-vendor", self.vgroup.backend):
                s = Steps()
                issue(s)
                _run(s)

    def exchange_library(self) -> str:
        """What carries this rank's cross-vendor exchange on this thread's lane."""
        return "shared memory" if self.comms.shm is not None else "gloo"

    def bridge_reduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        """Reduce ``t`` across this rank's shard peers (one per vendor group) on the host, in place."""
        with stage("exchange", "cross-vendor", self.exchange_library()):
            self._bridge_reduce(t, op)

    def _bridge_wait(self, work: Any) -> None:
        """Wait for an exchange :meth:`_bridge_start` started."""
        with stage("exchange", "cross-vendor", "gloo"):
            work.wait()

    def _bridge_reduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        peers = len(self.plan.shard_peers(self.local_rank))
        h = on_host(t)
        if self.comms.shm is not None:
            # Same node: through the shared segment, every dtype and op (combine_rows in peer order).
            self.comms.shm.all_reduce(h, op)
        elif peers > 1 and (h.dtype, op) in _GLOO_REDUCES:
            # gloo's ring reduces each segment once and copies it to every peer: identical bits everywhere,
            # summation depth <= peers - 1 (the bound of docs/bridge.md), and no gathered copy.
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, op.value)
            self.comms.shard.allreduce([h], o).wait()
        elif peers > 1:
            src = as_bytes(h)
            rows = torch.empty(peers * src.numel(), dtype=torch.uint8)
            self.comms.shard._allgather_base(rows, src).wait()
            combine_rows(rows.view(peers, -1).view(h.dtype), op, h.reshape(-1))
        put_back(t, h)

    def routes(self, dtype: torch.dtype, op: ReduceOp) -> tuple[str | None, ...]:
        """:func:`group_route` of every vendor group for one reduction (same on every rank)."""
        key = (dtype, op)
        r = self._routes.get(key)
        if r is None:
            name = _dtypes.from_torch(dtype)
            r = self._routes[key] = tuple(group_route(t, name, op) for t in self.tables)
        return r

    def algorithm(self, t: torch.Tensor, op: ReduceOp) -> str:
        """The all_reduce algorithm for ``t`` and ``op`` (every rank decides the same): the online
        check's current one where it applies (:meth:`checked`: read in the group's issue order, it
        is what the next such call runs), else the figures' choice."""
        if self.checked(t, op):
            assert self.check is not None
            return self.check.algorithm(t.numel() * t.element_size())
        alg = self.auto_choice(t.numel() * t.element_size())
        if alg != "leader" and any(r != "library" for r in self.routes(t.dtype, op)):
            alg = "leader"  # a vendor group reducing on its host has no reduce-scatter to offer
        return alg

    def checked(self, t: torch.Tensor, op: ReduceOp) -> bool:
        """Whether an all_reduce of ``t`` is checked online (:meth:`checks`)."""
        return self.checks(t.numel() * t.element_size(), t.dtype, op)

    def checks(self, nbytes: int, dtype: torch.dtype, op: ReduceOp) -> bool:
        """Whether an all_reduce of ``nbytes`` in ``dtype`` is checked online: a check runs, SUM in
        float32/64 on equal groups whose every route is the library's, from :data:`VERIFY_MIN_BYTES`
        (the same on every rank)."""
        return (self.check is not None and op is ReduceOp.SUM and dtype in _CHECKED_DTYPES
                and nbytes >= VERIFY_MIN_BYTES and self.plan.equal_groups
                and all(r == "library" for r in self.routes(dtype, op)))

    def all_reduce(self, t: torch.Tensor, op: ReduceOp, algorithm: str | None = None) -> str:
        """All-reduce ``t`` (contiguous) in place; returns the algorithm used."""
        return self.run_call(t, op, algorithm)[0]

    def run_call(self, t: torch.Tensor, op: ReduceOp, algorithm: str | None = None,
                 pipelined: bool = False) -> tuple[str, Callable[[], None] | None]:
        """One all_reduce call, in the group's issue order: the algorithm (checked online where it
        applies, :meth:`checked`) and, where ``pipelined`` and it runs the bandwidth algorithm unwatched,
        its first stage only -- then the second stage is returned (:meth:`bandwidth_started`), else
        None (the call is done)."""
        watched = False
        if algorithm is None and self.checked(t, op):
            assert self.check is not None
            alg, watched = self.check.begin(t.numel() * t.element_size())
        else:
            alg = algorithm or self.algorithm(t, op)
        if alg != "leader" and (not self.plan.equal_groups or any(r != "library" for r in self.routes(t.dtype, op))):
            alg = "leader"
        if self._debug:
            log.debug("bridge all_reduce %s %s x%d (%d B): %s%s", op.value, t.dtype, t.numel(),
                      t.numel() * t.element_size(), alg, " (watched)" if watched else "")
        self.counts[alg] += 1
        if t.numel() == 0:
            return alg, None
        if watched:
            self._run_watched(t, op, alg)
            return alg, None
        if pipelined and alg == "bandwidth":
            return alg, self.bandwidth_started(t, op)
        self._run_algorithm(t, op, alg)
        return alg, None

    def _run_algorithm(self, t: torch.Tensor, op: ReduceOp, alg: str) -> None:
        if alg == "bandwidth":
            self._all_reduce_bandwidth(t, op)
        elif alg == "replicated":
            self._all_reduce_replicated(t, op)
        else:
            self._all_reduce_leader(t, op)

    def _run_watched(self, t: torch.Tensor, op: ReduceOp, alg: str) -> None:
        """A watched call (:mod:`vcga.bridge.verify`): ``t`` and the check's report travel in one
        buffer, ``t``'s elements first; this rank times the algorithm alone (not the copies)."""
        check = self.check
        assert check is not None
        flat = t.view(-1)
        n = flat.numel()
        report = check.outgoing()
        buf = torch.empty(n + len(report), dtype=t.dtype, device=t.device)
        buf[:n].copy_(flat)
        buf[n:].copy_(torch.tensor(report, dtype=torch.float64))
        t0 = time.perf_counter()
        self._run_algorithm(buf, op, alg)
        seconds = time.perf_counter() - t0
        flat.copy_(buf[:n])
        check.incoming(buf[n:].tolist(), n * t.element_size(), alg, seconds)

    def _all_reduce_leader(self, t: torch.Tensor, op: ReduceOp) -> None:
        """Reduce to the leader in the vendor group, reduce among leaders on the host, broadcast back."""
        if self.routes(t.dtype, op)[self.vgroup.index] == "library":
            self.in_group(lambda s: self.comms.inner.reduce(t, 0, op, None, None, s), "reduce")  # type: ignore[union-attr]
        elif self.comms.inner is not None:
            # The library cannot reduce this dtype: gather the raw bytes, reduce on the host in the dtype.
            rows = torch.empty((self.vgroup.size, *t.shape), dtype=t.dtype, device=t.device)
            self.in_group(lambda s: self.comms.inner.gather(  # type: ignore[union-attr]
                list(rows.unbind(0)) if self.local_rank == 0 else [], t, 0, None, s), "gather")
            if self.local_rank == 0:
                h = on_host(t)
                combine_rows(on_host(rows).view(self.vgroup.size, -1), op, h.reshape(-1))
                put_back(t, h)
        if self.local_rank == 0:
            self.bridge_reduce(t, op)
        self.in_group(lambda s: self.comms.inner.broadcast(t, 0, None, s), "broadcast")  # type: ignore[union-attr]

    def _segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The pipeline segments of a bandwidth all_reduce: a function of the size and of the figures
        every rank holds, so every vendor group cuts the same boundaries (shard peers must bridge
        the same elements)."""
        n = flat.numel()
        count = max(1, min(self.max_segments, self.segment_count(n * flat.element_size()), n))
        edges = [n * j // count for j in range(count + 1)]
        return [flat[edges[j]:edges[j + 1]] for j in range(count)]

    def _bridge_start(self, t: torch.Tensor, op: ReduceOp) -> Any:
        """Start reducing ``t`` across the shard peers; a work to wait for, or None when done already
        (dtypes gloo does not reduce, device tensors, and shared memory go the synchronous way)."""
        if (self.comms.shm is None and (t.dtype, op) in _GLOO_REDUCES and t.device.type == "cpu"
                and len(self.plan.shard_peers(self.local_rank)) > 1):
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, op.value)
            return self.comms.shard.allreduce([t], o)
        self.bridge_reduce(t, op)
        return None

    def _all_reduce_bandwidth(self, t: torch.Tensor, op: ReduceOp, method: str | None = None,
                              bridge: bool = True) -> None:
        """Reduce-scatter in the vendor group, reduce each shard among its peers, all-gather back.

        The tensor is cut into pipeline segments (:meth:`_segments`); shard j of a segment is its
        elements [j*c, min((j+1)*c, m)) with c = ceil(m/k), in every vendor group, so shard peers
        line up whichever in-group method (:attr:`group_method`) each group uses. While one
        segment's shard crosses the bridge (gloo, asynchronous) the next is reduce-scattered and
        the previous all-gathered.
        """
        use_p2p = (method or self.group_method) == "p2p"
        step = self.segment_p2p if use_p2p else self._segment_collective
        pending: tuple[Any, torch.Tensor] | None = None
        for seg in self._segments(t.view(-1)):
            mine = step(seg, op, "reduce_scatter")
            work = self._bridge_start(mine, op) if bridge and mine.numel() else None
            if pending is not None:
                if pending[0] is not None:
                    self._bridge_wait(pending[0])
                step(pending[1], op, "all_gather")
            pending = (work, seg)
        if pending is not None:
            if pending[0] is not None:
                self._bridge_wait(pending[0])
            step(pending[1], op, "all_gather")

    def bandwidth_started(self, t: torch.Tensor, op: ReduceOp) -> Callable[[], None]:
        """The first stage of a pipelined bandwidth all_reduce (``BridgeGroup.allreduce``): every
        segment reduce-scattered in the vendor group and its exchange among the shard peers
        started, on this thread's lane. Returns the second stage -- wait for each exchange and
        all-gather its segment, in segment order -- which the caller runs on lane 1. The same steps
        on the same data as :meth:`_all_reduce_bandwidth`, each communicator's in the same order:
        the same bits."""
        step = self.segment_p2p if self.group_method == "p2p" else self._segment_collective
        started: list[tuple[Any, torch.Tensor]] = []
        for seg in self._segments(t.view(-1)):
            mine = step(seg, op, "reduce_scatter")
            started.append((self._bridge_start(mine, op) if mine.numel() else None, seg))

        def finish() -> None:
            for work, seg in started:
                if work is not None:
                    self._bridge_wait(work)
                step(seg, op, "all_gather")
        return finish

    def _segment_collective(self, seg: torch.Tensor, op: ReduceOp, phase: str) -> torch.Tensor:
        """One phase of one segment through the library's reduce_scatter / all_gather; returns this
        rank's shard (a view of ``seg``, or of a padded copy whose result is copied back)."""
        k, i = self.vgroup.size, self.local_rank
        n = seg.numel()
        c = -(-n // k)
        if phase == "reduce_scatter":
            buf = seg if c * k == n else torch.cat([seg, seg.new_zeros(c * k - n)])
            chunks = list(buf.view(k, c).unbind(0))
            shard = torch.empty(c, dtype=seg.dtype, device=seg.device)
            self.in_group(lambda s: self.comms.inner.reduce_scatter(  # type: ignore[union-attr]
                shard, chunks, op, None, None, s), "reduce_scatter")
            self._padded[seg.data_ptr()] = (buf, shard)
            return shard[:max(0, min(c, n - i * c))]  # the padding is not bridged
        buf, shard = self._padded.pop(seg.data_ptr())
        chunks = list(buf.view(k, c).unbind(0))
        self.in_group(lambda s: self.comms.inner.all_gather(chunks, shard, None, s), "all_gather")  # type: ignore[union-attr]
        if buf is not seg:
            seg.copy_(buf[:n])
        return shard

    def segment_p2p(self, seg: torch.Tensor, op: ReduceOp, phase: str) -> torch.Tensor:
        """:meth:`_ring`, as the flight recorder's and the profiler's step ``phase``."""
        with stage(phase, "in-vendor", f"{self.vgroup.backend} send/recv"):
            return self._ring(seg, op, phase)

    def _ring(self, seg: torch.Tensor, op: ReduceOp, phase: str) -> torch.Tensor:
        """One phase of one segment as a ring over the vendor library's own send/recv, in place on
        ``seg`` (no padding, no staging copy); returns this rank's chunk.

        Reduce-scatter: at step s (0..k-2) local rank i sends its partial of chunk (i-s-1) mod k to
        rank i+1 and adds what rank i-1 sends of chunk (i-s-2) mod k into its own; after k-1 steps
        rank i holds chunk i reduced once, along one chain (k-1 additions, in the dtype itself).
        All-gather: the same ring copies the chunks.
        """
        k, i = self.vgroup.size, self.local_rank
        n = seg.numel()
        c = -(-n // k)

        def chunk(j: int) -> torch.Tensor:
            j %= k
            return seg[min(j * c, n):min((j + 1) * c, n)]

        nxt, prv = (i + 1) % k, (i - 1) % k
        inner = self.comms.inner
        assert inner is not None

        def swap(out_t: torch.Tensor, in_t: torch.Tensor, tag: int) -> None:
            """One ring step: send ``out_t`` to the next rank, receive ``in_t`` from the previous one."""
            s = Steps()
            if out_t.numel():
                inner.send(out_t, nxt, tag, s)
            if in_t.numel():
                inner.recv(in_t, prv, tag, s)
            _run(s)

        if phase == "reduce_scatter":
            fn = combiner(seg.dtype, op)
            tmp = torch.empty(c, dtype=seg.dtype, device=seg.device)
            for step in range(k - 1):
                out_c, in_c = chunk(i - step - 1), chunk(i - step - 2)
                got = tmp[:in_c.numel()]
                swap(out_c, got, 1)
                if in_c.numel():
                    fn(in_c, got, out=in_c)
            return chunk(i)
        for step in range(k - 1):
            swap(chunk(i - step), chunk(i - step - 1), 2)
        return chunk(i)

    def _all_reduce_replicated(self, t: torch.Tensor, op: ReduceOp) -> None:
        """All-reduce in the vendor group; then every rank reduces the group's result with its shard
        peers, all shard groups at once. Each vendor group's partial is the same bits on all its
        ranks, so every shard group reduces the same inputs in the same order: the same result."""
        self.in_group(lambda s: self.comms.inner.all_reduce(t, op, None, None, s), "all_reduce")  # type: ignore[union-attr]
        self.bridge_reduce(t, op)

    def measure_links(self, device: torch.device, reps: int = 3) -> LinkFigures:
        """Measure, once at creation, the α–β figures of every step the algorithms take here
        (:mod:`vcga.bridge.cost`): collective over the group; every rank gets the same figures.

        Every rank times each step at the two sizes of :data:`~vcga.bridge.cost.SIZES` (fp32 SUM,
        best of ``reps``, the kinds interleaved, each after a barrier over the whole group;
        "all_sets" until a barrier after it, less an empty step's time), and the host steps also at
        :data:`~vcga.bridge.cost.LARGE_SIZE` (best of ``reps - 1``), past the burst of a token
        bucket (:func:`~vcga.bridge.cost.fit_past_knee`):

        - in its vendor group: reduce to the leader + broadcast ("reduce_bcast"), all-reduce,
          and reduce-scatter + all-gather through the library's collectives ("rsag_collective")
          and through rings of its send/recv ("rsag_p2p");
        - on the host: the leaders' set alone ("leaders"; other ranks wait), and every set of
          shard peers at once ("all_sets": they share whatever link they cross, as the bandwidth
          and replicated algorithms do).

        The slowest rank of each vendor group in each repetition counts, the best repetition of that
        (a MAX all-reduce of one table over the whole group), so the fits and every choice made from
        them agree on every rank. Needs equal vendor groups of size >= 2 (the only shape on which
        there is a choice).
        """
        inner = self.comms.inner
        assert inner is not None and self.plan.equal_groups
        groups = self.plan.groups
        kinds = GROUP_KINDS + BRIDGE_KINDS
        xs = {n: torch.ones(max(n // 4, 1), dtype=torch.float32, device=device) for n in SIZES}

        def reduce_bcast(x: torch.Tensor) -> None:
            def build(s: Steps) -> None:
                inner.reduce(x, 0, ReduceOp.SUM, None, None, s)
                inner.broadcast(x, 0, None, s)

            self.in_group(build)

        steps: dict[str, Callable[[torch.Tensor], None]] = {
            "reduce_bcast": reduce_bcast,
            "all_reduce": lambda x: self.in_group(lambda s: inner.all_reduce(x, ReduceOp.SUM, None, None, s)),
            "rsag_collective": lambda x: self._all_reduce_bandwidth(x, ReduceOp.SUM, "collective", bridge=False),
            "rsag_p2p": lambda x: self._all_reduce_bandwidth(x, ReduceOp.SUM, "p2p", bridge=False),
            "leaders": lambda x: self.bridge_reduce(x, ReduceOp.SUM) if self.local_rank == 0 else None,
            "all_sets": lambda x: self.bridge_reduce(x, ReduceOp.SUM),
        }

        def timed(step: Callable[[], None], closing: bool) -> float:
            self.comms.world.barrier().wait()
            t0 = time.perf_counter()
            step()
            if closing:
                self.comms.world.barrier().wait()
            return time.perf_counter() - t0

        # "all_sets" is timed until a barrier after it: its sets are independent collectives, and a
        # rank that left the first barrier late (a busy machine deschedules ranks for milliseconds)
        # would otherwise let the sets cross a shared link one after the other and each look as if
        # it had the link to itself. (Every other step is one collective of its ranks: its slowest
        # rank measures it whole.) The closing barrier's own cost, an empty step's, is taken off.
        closing = [kind == "all_sets" for kind in kinds]
        took = torch.zeros(reps, len(kinds), len(SIZES), dtype=torch.float64)
        # The host steps between vendor groups also at LARGE_SIZE (fewer repetitions: the link is
        # the slow part there), past the burst a token bucket lets through (fit_past_knee).
        large_reps = max(1, reps - 1)
        x_large = torch.ones(LARGE_SIZE // 4, dtype=torch.float32, device=device)
        took_large = torch.zeros(reps, len(BRIDGE_KINDS), dtype=torch.float64)
        empty = float("inf")
        for r in range(reps):
            empty = min(empty, timed(lambda: None, True))
            for j, n in enumerate(SIZES):
                for i, kind in enumerate(kinds):
                    took[r, i, j] = timed(lambda: steps[kind](xs[n]), closing[i])  # noqa: B023 - called at once
            for i, kind in enumerate(BRIDGE_KINDS):
                took_large[r, i] = (timed(lambda: steps[kind](x_large), kind == "all_sets")  # noqa: B023
                                    if r < large_reps else float("inf"))
        # The fastest empty step of all repetitions, taken off once they are all done: a first empty
        # step slowed by the machine, taken off its own repetition, could leave nothing of a 2 MiB step.
        took[:, closing] = (took[:, closing] - empty).clamp_(min=0.0)
        took_large[:large_reps, BRIDGE_KINDS.index("all_sets")] -= empty
        # Per repetition, rows 0..G-1: each vendor group's in-group steps (each rank fills its
        # group's row); row G: the host steps, and whether this rank's set reduces through shared
        # memory (0 if not: a MAX of "not shm" over the group says whether any set goes through gloo).
        # The MAX over ranks comes before the best over repetitions: a step took as long as its
        # slowest rank in that repetition (the best of each rank on its own could combine
        # repetitions where the shard-peer sets happened not to share the link).
        g_n, k_n = len(groups), len(GROUP_KINDS)
        table = torch.zeros(reps, g_n + 2, len(kinds) + 1, len(SIZES), dtype=torch.float64)
        table[:, self.vgroup.index, :k_n] = took[:, :k_n]
        table[:, g_n, k_n:len(kinds)] = took[:, k_n:]
        table[:, g_n, len(kinds)] = 0.0 if self.comms.shm is not None else 1.0
        table[:, g_n + 1, :len(BRIDGE_KINDS), 0] = took_large  # row G+1: the host steps at LARGE_SIZE
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.comms.world.allreduce([table], o).wait()
        table = table.amin(dim=0)
        t = table.tolist()
        large = {kind: max(t[g_n + 1][i][0], 0.0) for i, kind in enumerate(BRIDGE_KINDS)}
        fig = LinkFigures(
            groups=[{kind: fit(SIZES, t[g][i]) for i, kind in enumerate(GROUP_KINDS)} for g in range(g_n)],
            bridge={kind: fit_past_knee((*SIZES, LARGE_SIZE), (*t[g_n][k_n + i], large[kind]))
                    for i, kind in enumerate(BRIDGE_KINDS)},
            classes=dict(self.link_classes),
            exchange="gloo" if t[g_n][len(kinds)][0] > 0 else "shared memory",
            group_size=self.vgroup.size, equal_groups=True, min_segment_bytes=MODEL_MIN_SEGMENT_BYTES,
            max_segments=MODEL_MAX_SEGMENTS,
            seconds={"groups": {g.backend: {kind: t[i][j] for j, kind in enumerate(GROUP_KINDS)}
                                for i, g in enumerate(groups)},
                     "bridge": {kind: [*t[g_n][k_n + j], large[kind]] for j, kind in enumerate(BRIDGE_KINDS)},
                     "bridge_sizes": [*SIZES, LARGE_SIZE]})
        self.apply_figures(fig)
        return fig

    def apply_figures(self, fig: LinkFigures) -> None:
        """Use ``fig`` (measured here, or the same figures from elsewhere -- rank 0's, a cache's:
        every rank must apply the same): each vendor group's in-group method, and "auto"'s choice
        at each size (the cheapest prediction of :func:`~vcga.bridge.cost.choose`)."""
        self.figures = fig
        self.group_method = fig.group_method(self.vgroup.index)
        self._choices.clear()
        self._segment_counts.clear()
        table = choices(fig, PLAN_SIZES, size_name, self.stream_choice)
        self.calibration = {"figures": fig.to_json(), "classes": fig.classes, "exchange": fig.exchange,
                            "group_methods": {g.backend: fig.group_method(i) for i, g in enumerate(self.plan.groups)},
                            "choice": table}
        self.check = None
        if self.verify and self.plan.algorithm == "auto" and self.plan.equal_groups:
            self.check = PlanCheck(lambda n: predict(fig, n), lambda n: choose(fig, n, self.stream_choice)[0],
                                   self._stream_credit, self.rank, self.plan.size, observed=fig.observed,
                                   on_settle=self._settled)
        log.debug("vcga bridge link figures (rank %d): %s", self.rank, json.dumps(self.calibration))

    def _stream_credit(self, nbytes: int) -> dict[str, float]:
        """Per algorithm, what one all_reduce of a pipelined stream costs against one alone (the
        figures' prediction; 1 where the group does not pipeline): a watched call runs alone."""
        if not self.stream_choice or self.figures is None:
            return {}
        alone, streamed = predict(self.figures, nbytes), predict(self.figures, nbytes, True)
        return {a: streamed[a] / alone[a] for a in alone if alone[a] > 0}

    def _settled(self, check: PlanCheck) -> None:
        """Rank 0, a class settled: the corrected figures into the cache (describe()'s record of the
        check is :attr:`verification`; its calibration stays what every rank applied)."""
        if self.figures is None:
            return
        self.figures.observed = {k: dict(v) for k, v in check.observed.items()}
        if self.cache_entry is not None:
            from vcga.bridge import figcache

            figcache.store(*self.cache_entry, self.figures)

    @property
    def verification(self) -> dict[str, Any] | None:
        """The online check per size class (predicted against observed; rank 0 judges, every rank
        knows the current choice), or None where nothing is checked."""
        if self.check is None:
            return None
        return {"classes": self.check.describe(), "log": list(self.check.log[-32:])}

    def segment_count(self, nbytes: int) -> int:
        """Pipeline segments of a bandwidth all_reduce of ``nbytes``: what the figures predict fastest
        (:func:`~vcga.bridge.cost.segments`), or without figures one per 8 MiB (at most 8), or
        :attr:`fixed_segments` where set."""
        if self.fixed_segments is not None:
            return self.fixed_segments
        if self.figures is None:
            return max(1, min(PIPELINE_MAX_SEGMENTS, nbytes // PIPELINE_SEGMENT_BYTES))
        m = self._segment_counts.get(nbytes)
        if m is None:
            if len(self._segment_counts) > 4096:
                self._segment_counts.clear()
            m = self._segment_counts[nbytes] = segments(self.figures, nbytes)
        return m

    def auto_choice(self, nbytes: int) -> str:
        """What "auto" predicts for ``nbytes`` on equal groups: the figures' cheapest prediction, or
        without figures the plan's size rule (before any online check: :meth:`algorithm`)."""
        if self.figures is None or self.plan.algorithm != "auto":
            return self.plan.all_reduce_algorithm(nbytes, self.auto_large)
        alg = self._choices.get(nbytes)
        if alg is None:
            if len(self._choices) > 4096:  # many distinct sizes (varying buckets): keep it bounded
                self._choices.clear()
            alg = self._choices[nbytes] = choose(self.figures, nbytes, self.stream_choice)[0]
        return alg
