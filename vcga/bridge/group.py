"""The bridge's hierarchical collectives: :class:`BridgeGroup`, the group the dispatcher drives.

Inside a vendor group through that vendor's own dispatcher, across vendor groups on the host (gloo,
or shared memory between shard peers on one node); the algorithms (leader, bandwidth, replicated)
and their error bounds are in ``docs/bridge.md``, the overview in :mod:`vcga.bridge`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vcga import dtypes as _dtypes
from vcga.bridge.cost import BRIDGE_KINDS, GROUP_KINDS, SIZES, LinkFigures, choices, choose, fit, segments
from vcga.bridge.plan import (
    ALGORITHMS,
    AUTO_LARGE,
    MODEL_MAX_SEGMENTS,
    MODEL_MIN_SEGMENT_BYTES,
    PIPELINE_MAX_SEGMENTS,
    PIPELINE_SEGMENT_BYTES,
    PLAN_SIZES,
    Plan,
    size_name,
    group_route,
)
from vcga.contract import CapabilityTable, ReduceOp
from vcga.dispatch import Dispatcher, Steps
from vcga.hostbridge import SharedMemoryBridge, combine_rows, combiner
from vcga.pypg import PyWork, reduce_op_of
from vcga.workqueue import WorkQueue

__all__ = ["BridgeGroup"]

log = logging.getLogger("vcga.bridge")


# ===================================================================================================
# Host-side pieces
# ===================================================================================================


def _run(steps: Steps) -> None:
    """Complete what a vendor dispatcher issued: wait for its native works, then its local steps."""
    for w in steps.works:
        w.wait()
    for f in steps.finish:
        f()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous host tensor ``t`` as a 1-D uint8 tensor (no copy)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, contiguous (itself when it already is)."""
    if t.device.type != "cpu":
        return t.detach().to("cpu", memory_format=torch.contiguous_format)
    return t if t.is_contiguous() else t.contiguous()


def _put(t: torch.Tensor, h: torch.Tensor) -> None:
    if h is not t:
        t.copy_(h.view(t.shape) if h.shape != t.shape else h)


#: (dtype, op) gloo reduces exactly as the host would (measured table, plugins/gloo_capabilities.json).
_GLOO_REDUCES = {(dt, op) for dt in (torch.float32, torch.float64, torch.int32, torch.int64)
                 for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)}


def _on_queue(result: Callable[..., Sequence[torch.Tensor]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated c10d method on the group's :class:`~vcga.workqueue.WorkQueue`, in issue order:
    it returns at once with a work completed on the communication thread, unless its options say
    ``asyncOp=False`` (then it runs in the caller's thread when nothing is queued, else waits its
    turn). Without a queue (config ``bridge_async: false``) it runs in the caller's thread.
    ``result(*args)`` names the output tensors (the value of the work's future)."""
    def deco(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: BridgeGroup, *args: Any) -> Any:
            if self.queue is None:
                return method(self, *args)
            opts = next((a for a in args if hasattr(a, "asyncOp")), None)
            return self.queue.run(functools.partial(method, self, *args), result(*args), opts is None or bool(opts.asyncOp))
        return run
    return deco


def _first(*args: Any) -> Sequence[torch.Tensor]:
    return args[0]


def _first_of_first(*args: Any) -> Sequence[torch.Tensor]:
    return args[0][0] if args[0] else []


def _first_as_list(*args: Any) -> Sequence[torch.Tensor]:
    return [args[0]]


def _flattened(*args: Any) -> Sequence[torch.Tensor]:
    return [t for outs in args[0] for t in outs]


def _nothing(*args: Any) -> Sequence[torch.Tensor]:
    return []


# ===================================================================================================
# The group the dispatcher drives
# ===================================================================================================


class BridgeGroup:
    """The hierarchical collectives, with the c10d methods of :data:`vcga.transport.TRANSPORT_METHODS`.

    Each collective goes on the group's :class:`~vcga.workqueue.WorkQueue` (:attr:`queue`) and
    returns at once with a work its communication thread completes, in issue order (``asyncOp``
    false: it completes before returning); with no queue (``bridge_async: false``) each runs to
    completion in the calling thread. Point-to-point returns gloo's own asynchronous work. Tensors
    arrive contiguous, in dtypes and ops the combined table calls native.

    :param plan: the plan (same on every rank).
    :param rank: this rank in the ``vcga`` group.
    :param inner: this rank's vendor-group dispatcher (None when the vendor group has one rank).
    :param shard: gloo group of this rank's shard peers (leaders for local rank 0), or None.
    :param world: gloo group over the whole ``vcga`` group.
    :param shm: the shard peers' shared segment (:class:`~vcga.hostbridge.SharedMemoryBridge`, all
        peers on this node), or None: they reduce through ``shard``.
    """

    def __init__(self, plan: Plan, rank: int, inner: Dispatcher | None, shard: Any, world: Any,
                 tables: Sequence[CapabilityTable], shm: SharedMemoryBridge | None = None) -> None:
        self.plan, self.rank, self.size = plan, rank, plan.size
        self.tables = list(tables)
        self._routes: dict[tuple[torch.dtype, ReduceOp], tuple[str | None, ...]] = {}
        self.vgroup = plan.group_of(rank)
        self.local_rank = self.vgroup.ranks.index(rank)
        self.inner, self.shard, self.world, self.shm = inner, shard, world, shm
        #: how often each algorithm ran (tests and benchmarks read it)
        self.counts = {a: 0 for a in ALGORITHMS}
        #: reduce_scatter hierarchically where the bandwidth algorithm would run (see _reduce_scatter);
        #: False: always as an all_reduce of the whole buffer (the same on every rank; benchmarks compare)
        self.hierarchical_reduce_scatter = True
        #: reduce_scatters that ran hierarchically (the rest ran as an all_reduce, see _reduce_scatter)
        self.hierarchical_reduce_scatters = 0
        #: how the bandwidth algorithm reduce-scatters and all-gathers inside this vendor group:
        #: "collective" (the library's reduce_scatter / all_gather) or "p2p" (rings over its
        #: send/recv). Chosen per vendor group by measured cost (:meth:`measure_links`); every rank of
        #: a vendor group must hold the same value (other groups may differ).
        self.group_method = "collective"
        #: pipeline segments at most (1: no pipelining); the same on every rank of the group
        self.max_segments = MODEL_MAX_SEGMENTS
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
        self._debug = log.isEnabledFor(logging.DEBUG)
        #: the ordered queue and communication thread of asynchronous collectives (None: every
        #: collective runs in the calling thread); set at creation
        self.queue: WorkQueue | None = None

    @property
    def shard_exchange(self) -> str | None:
        """How this rank's shard peers reduce on the host: "shared memory", "gloo", or None (it has none)."""
        return "shared memory" if self.shm is not None else "gloo" if self.shard is not None else None

    # -- building blocks -------------------------------------------------------------------------

    def _in_group(self, issue: Callable[[Steps], None]) -> None:
        if self.inner is not None:
            s = Steps()
            issue(s)
            _run(s)

    def _bridge_reduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        """Reduce ``t`` across this rank's shard peers (one per vendor group) on the host, in place."""
        peers = len(self.plan.shard_peers(self.local_rank))
        h = _host(t)
        if self.shm is not None:
            # Same node: through the shared segment, every dtype and op (combine_rows in peer order).
            self.shm.all_reduce(h, op)
        elif peers > 1 and (h.dtype, op) in _GLOO_REDUCES:
            # gloo's ring reduces each segment once and copies it to every peer: identical bits everywhere,
            # summation depth <= peers - 1 (the bound of docs/bridge.md), and no gathered copy.
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, op.value)
            self.shard.allreduce([h], o).wait()
        elif peers > 1:
            src = _bytes(h)
            rows = torch.empty(peers * src.numel(), dtype=torch.uint8)
            self.shard._allgather_base(rows, src).wait()
            combine_rows(rows.view(peers, -1).view(h.dtype), op, h.reshape(-1))
        _put(t, h)

    def routes(self, dtype: torch.dtype, op: ReduceOp) -> tuple[str | None, ...]:
        """:func:`group_route` of every vendor group for one reduction (same on every rank)."""
        key = (dtype, op)
        r = self._routes.get(key)
        if r is None:
            name = _dtypes.from_torch(dtype)
            r = self._routes[key] = tuple(group_route(t, name, op) for t in self.tables)
        return r

    def algorithm(self, t: torch.Tensor, op: ReduceOp) -> str:
        """The all_reduce algorithm for ``t`` and ``op`` (every rank decides the same)."""
        alg = self._auto(t.numel() * t.element_size())
        if alg != "leader" and any(r != "library" for r in self.routes(t.dtype, op)):
            alg = "leader"  # a vendor group reducing on its host has no reduce-scatter to offer
        return alg

    def all_reduce(self, t: torch.Tensor, op: ReduceOp, algorithm: str | None = None) -> str:
        """All-reduce ``t`` (contiguous) in place; returns the algorithm used."""
        alg = algorithm or self.algorithm(t, op)
        if alg != "leader" and (not self.plan.equal_groups or any(r != "library" for r in self.routes(t.dtype, op))):
            alg = "leader"
        if self._debug:
            log.debug("bridge all_reduce %s %s x%d (%d B): %s", op.value, t.dtype, t.numel(),
                      t.numel() * t.element_size(), alg)
        self.counts[alg] += 1
        if t.numel() == 0:
            return alg
        if alg == "bandwidth":
            self._all_reduce_bandwidth(t, op)
        elif alg == "replicated":
            self._all_reduce_replicated(t, op)
        else:
            self._all_reduce_leader(t, op)
        return alg

    def _all_reduce_leader(self, t: torch.Tensor, op: ReduceOp) -> None:
        """Reduce to the leader in the vendor group, reduce among leaders on the host, broadcast back."""
        if self.routes(t.dtype, op)[self.vgroup.index] == "library":
            self._in_group(lambda s: self.inner.reduce(t, 0, op, None, None, s))  # type: ignore[union-attr]
        elif self.inner is not None:
            # The library cannot reduce this dtype: gather the raw bytes, reduce on the host in the dtype.
            rows = torch.empty((self.vgroup.size, *t.shape), dtype=t.dtype, device=t.device)
            self._in_group(lambda s: self.inner.gather(  # type: ignore[union-attr]
                list(rows.unbind(0)) if self.local_rank == 0 else [], t, 0, None, s))
            if self.local_rank == 0:
                h = _host(t)
                combine_rows(_host(rows).view(self.vgroup.size, -1), op, h.reshape(-1))
                _put(t, h)
        if self.local_rank == 0:
            self._bridge_reduce(t, op)
        self._in_group(lambda s: self.inner.broadcast(t, 0, None, s))  # type: ignore[union-attr]

    def _segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The pipeline segments of a bandwidth all_reduce: a function of the size and of the figures
        every rank holds, so every vendor group cuts the same boundaries (shard peers must bridge
        the same elements)."""
        n = flat.numel()
        count = min(self.max_segments, self._segment_count(n * flat.element_size()))
        edges = [n * j // count for j in range(count + 1)]
        return [flat[edges[j]:edges[j + 1]] for j in range(count)]

    def _bridge_start(self, t: torch.Tensor, op: ReduceOp) -> Any:
        """Start reducing ``t`` across the shard peers; a work to wait for, or None when done already
        (dtypes gloo does not reduce, device tensors, and shared memory go the synchronous way)."""
        if (self.shm is None and (t.dtype, op) in _GLOO_REDUCES and t.device.type == "cpu"
                and len(self.plan.shard_peers(self.local_rank)) > 1):
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, op.value)
            return self.shard.allreduce([t], o)
        self._bridge_reduce(t, op)
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
        step = self._segment_p2p if use_p2p else self._segment_collective
        pending: tuple[Any, torch.Tensor] | None = None
        for seg in self._segments(t.view(-1)):
            mine = step(seg, op, "reduce_scatter")
            work = self._bridge_start(mine, op) if bridge and mine.numel() else None
            if pending is not None:
                if pending[0] is not None:
                    pending[0].wait()
                step(pending[1], op, "all_gather")
            pending = (work, seg)
        if pending is not None:
            if pending[0] is not None:
                pending[0].wait()
            step(pending[1], op, "all_gather")

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
            self._in_group(lambda s: self.inner.reduce_scatter(shard, chunks, op, None, None, s))  # type: ignore[union-attr]
            self._padded[seg.data_ptr()] = (buf, shard)
            return shard[:max(0, min(c, n - i * c))]  # the padding is not bridged
        buf, shard = self._padded.pop(seg.data_ptr())
        chunks = list(buf.view(k, c).unbind(0))
        self._in_group(lambda s: self.inner.all_gather(chunks, shard, None, s))  # type: ignore[union-attr]
        if buf is not seg:
            seg.copy_(buf[:n])
        return shard

    def _segment_p2p(self, seg: torch.Tensor, op: ReduceOp, phase: str) -> torch.Tensor:
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
        inner = self.inner
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
        self._in_group(lambda s: self.inner.all_reduce(t, op, None, None, s))  # type: ignore[union-attr]
        self._bridge_reduce(t, op)

    def measure_links(self, device: torch.device, reps: int = 3) -> LinkFigures:
        """Measure, once at creation, the α–β figures of every step the algorithms take here
        (:mod:`vcga.bridge.cost`): collective over the group; every rank gets the same figures.

        Every rank times each step at the two sizes of :data:`~vcga.bridge.cost.SIZES` (fp32 SUM,
        best of ``reps``, the kinds interleaved, each after a barrier over the whole group):

        - in its vendor group: reduce to the leader + broadcast ("reduce_bcast"), all-reduce,
          and reduce-scatter + all-gather through the library's collectives ("rsag_collective")
          and through rings of its send/recv ("rsag_p2p");
        - on the host: the leaders' set alone ("leaders"; other ranks wait), and every set of
          shard peers at once ("all_sets": they share whatever link they cross, as the bandwidth
          and replicated algorithms do).

        The slowest rank of each vendor group counts (a MAX all-reduce of one table over the whole
        group), so the fits and every choice made from them agree on every rank. Needs equal vendor
        groups of size >= 2 (the only shape on which there is a choice).
        """
        inner = self.inner
        assert inner is not None and self.plan.equal_groups
        groups = self.plan.groups
        kinds = GROUP_KINDS + BRIDGE_KINDS
        xs = {n: torch.ones(max(n // 4, 1), dtype=torch.float32, device=device) for n in SIZES}
        steps: dict[str, Callable[[torch.Tensor], None]] = {
            "reduce_bcast": lambda x: self._in_group(lambda s: (inner.reduce(x, 0, ReduceOp.SUM, None, None, s),
                                                                 inner.broadcast(x, 0, None, s))),
            "all_reduce": lambda x: self._in_group(lambda s: inner.all_reduce(x, ReduceOp.SUM, None, None, s)),
            "rsag_collective": lambda x: self._all_reduce_bandwidth(x, ReduceOp.SUM, "collective", bridge=False),
            "rsag_p2p": lambda x: self._all_reduce_bandwidth(x, ReduceOp.SUM, "p2p", bridge=False),
            "leaders": lambda x: self._bridge_reduce(x, ReduceOp.SUM) if self.local_rank == 0 else None,
            "all_sets": lambda x: self._bridge_reduce(x, ReduceOp.SUM),
        }
        best = torch.full((len(kinds), len(SIZES)), float("inf"), dtype=torch.float64)
        for _ in range(reps):
            for j, n in enumerate(SIZES):
                for i, kind in enumerate(kinds):
                    self.world.barrier().wait()
                    t0 = time.perf_counter()
                    steps[kind](xs[n])
                    best[i, j] = min(float(best[i, j]), time.perf_counter() - t0)
        # Rows 0..G-1: each vendor group's in-group steps (each rank fills its group's row); row G:
        # the host steps, and whether this rank's set reduces through shared memory (0 if not: a MAX
        # of "not shm" over the group says whether any set goes through gloo).
        g_n, k_n = len(groups), len(GROUP_KINDS)
        table = torch.zeros(g_n + 1, len(kinds) + 1, len(SIZES), dtype=torch.float64)
        table[self.vgroup.index, :k_n] = best[:k_n]
        table[g_n, k_n:len(kinds)] = best[k_n:]
        table[g_n, len(kinds)] = 0.0 if self.shm is not None else 1.0
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.MAX
        self.world.allreduce([table], o).wait()
        t = table.tolist()
        fig = LinkFigures(
            groups=[{kind: fit(SIZES, t[g][i]) for i, kind in enumerate(GROUP_KINDS)} for g in range(g_n)],
            bridge={kind: fit(SIZES, t[g_n][k_n + i]) for i, kind in enumerate(BRIDGE_KINDS)},
            classes=dict(self.link_classes),
            exchange="gloo" if t[g_n][len(kinds)][0] > 0 else "shared memory",
            group_size=self.vgroup.size, equal_groups=True, min_segment_bytes=MODEL_MIN_SEGMENT_BYTES,
            max_segments=MODEL_MAX_SEGMENTS,
            seconds={"groups": {g.backend: {kind: t[i][j] for j, kind in enumerate(GROUP_KINDS)}
                                for i, g in enumerate(groups)},
                     "bridge": {kind: t[g_n][k_n + j] for j, kind in enumerate(BRIDGE_KINDS)}})
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
        table = choices(fig, PLAN_SIZES, size_name)
        self.calibration = {"figures": fig.to_json(), "classes": fig.classes, "exchange": fig.exchange,
                            "group_methods": {g.backend: fig.group_method(i) for i, g in enumerate(self.plan.groups)},
                            "choice": table}
        log.debug("vcga bridge link figures (rank %d): %s", self.rank, json.dumps(self.calibration))

    def _segment_count(self, nbytes: int) -> int:
        """Pipeline segments of a bandwidth all_reduce of ``nbytes``: what the figures predict fastest
        (:func:`~vcga.bridge.cost.segments`), or without figures one per 8 MiB (at most 8)."""
        if self.figures is None:
            return max(1, min(PIPELINE_MAX_SEGMENTS, nbytes // PIPELINE_SEGMENT_BYTES))
        m = self._segment_counts.get(nbytes)
        if m is None:
            if len(self._segment_counts) > 4096:
                self._segment_counts.clear()
            m = self._segment_counts[nbytes] = segments(self.figures, nbytes)
        return m

    def _auto(self, nbytes: int) -> str:
        """What "auto" runs for ``nbytes`` on equal groups: the figures' cheapest prediction, or
        without figures the plan's size rule."""
        if self.figures is None or self.plan.algorithm != "auto":
            return self.plan.all_reduce_algorithm(nbytes, self.auto_large)
        alg = self._choices.get(nbytes)
        if alg is None:
            if len(self._choices) > 4096:  # many distinct sizes (varying buckets): keep it bounded
                self._choices.clear()
            alg = self._choices[nbytes] = choose(self.figures, nbytes)[0]
        return alg

    # -- reductions (c10d signatures) ------------------------------------------------------------

    @_on_queue(_first)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PyWork:
        (t,) = tensors
        op, _ = reduce_op_of(opts.reduceOp) if opts is not None else (ReduceOp.SUM, None)
        self.all_reduce(t, op)
        return PyWork(result=tensors)

    @_on_queue(_first)
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PyWork:
        op, _ = reduce_op_of(opts.reduceOp) if opts is not None else (ReduceOp.SUM, None)
        for t in tensors:
            self.all_reduce(t, op)
        return PyWork(result=tensors)

    @_on_queue(_first)
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> PyWork:
        """All-reduce a copy; only the root keeps the result (other ranks' tensors are unchanged)."""
        (t,) = tensors
        op, _ = reduce_op_of(opts.reduceOp)
        w = t.clone()
        self.all_reduce(w, op)
        if self.rank == opts.rootRank:
            t.copy_(w)
        return PyWork(result=tensors)

    @_on_queue(_first)
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> PyWork:
        (out,), (ins,) = outputs, inputs
        op, _ = reduce_op_of(opts.reduceOp)
        self._reduce_scatter(out, [x.reshape(-1) for x in ins], op)
        return PyWork(result=outputs)

    @_on_queue(_first_as_list)
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> PyWork:  # noqa: A002
        op, _ = reduce_op_of(opts.reduceOp)
        self._reduce_scatter(output, list(input.reshape(self.size, -1).unbind(0)), op)
        return PyWork(result=[output])

    def _reduce_scatter(self, out: torch.Tensor, chunks: list[torch.Tensor], op: ReduceOp) -> None:
        """Reduce ``chunks[r]`` of every rank into ``out`` of rank r (chunks: equal, flat).

        Hierarchical when the bandwidth algorithm would run at this size: reduce-scatter in the
        vendor group, then among the shard peers -- each rank moves about half of what an all_reduce
        of the whole buffer would. Otherwise (and for unequal groups, host routes, or a forced
        leader algorithm) an all_reduce of the whole buffer, keeping this rank's chunk.
        """
        nbytes = sum(c.numel() for c in chunks) * out.element_size()
        if (not self.hierarchical_reduce_scatter or not self.plan.equal_groups
                or any(r != "library" for r in self.routes(out.dtype, op))
                or self._auto(nbytes) == "leader" or out.numel() == 0):
            buf = torch.cat(chunks)
            self.all_reduce(buf, op)
            out.copy_(buf.view(self.size, -1)[self.rank].view(out.shape))
            return
        self.hierarchical_reduce_scatters += 1
        k, groups = self.vgroup.size, self.plan.groups
        # Row-major (local rank i, vendor group g): after the in-group reduce-scatter, local rank i
        # holds its vendor group's partial of the chunks of ranks (g, i) for every g, in bridge order.
        buf = torch.cat([chunks[g.ranks[i]] for i in range(k) for g in groups])
        c = out.numel()
        if self.group_method == "p2p":
            mine = self._segment_p2p(buf, op, "reduce_scatter")
        else:
            mine = torch.empty(len(groups) * c, dtype=buf.dtype, device=buf.device)
            self._in_group(lambda s: self.inner.reduce_scatter(  # type: ignore[union-attr]
                mine, list(buf.view(k, -1).unbind(0)), op, None, None, s))
        rows = _host(mine).view(len(groups), c)
        g = self.vgroup.index
        if self.shm is not None:
            flat = out.view(-1)
            h = _host(flat)
            self.shm.reduce_scatter(rows, op, h)
            _put(flat, h)
        else:
            self._bridge_reduce(rows, op)
            out.copy_(rows[g].view(out.shape))

    # -- data movement ---------------------------------------------------------------------------

    @_on_queue(_first)
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> PyWork:
        """In the root's vendor group, then among the leaders on the host, then in every other group."""
        (t,) = tensors
        root = opts.rootRank
        rg = self.plan.group_of(root)
        mine = rg is self.vgroup or rg.index == self.vgroup.index
        if mine and rg.size > 1:
            self._in_group(lambda s: self.inner.broadcast(t, rg.ranks.index(root), None, s))  # type: ignore[union-attr]
        if self.local_rank == 0 and t.numel():
            h = _host(t)
            o = dist.BroadcastOptions()
            o.rootRank = rg.index
            self.shard.broadcast([_bytes(h)], o).wait()
            _put(t, h)
        if not mine:
            self._in_group(lambda s: self.inner.broadcast(t, 0, None, s))  # type: ignore[union-attr]
        return PyWork(result=tensors)

    def _gather_bytes(self, inp: torch.Tensor) -> torch.Tensor:
        src = _bytes(_host(inp))
        rows = torch.empty(self.size * src.numel(), dtype=torch.uint8)
        if src.numel():
            self.world._allgather_base(rows, src).wait()
        return rows.view(self.size, -1)

    @_on_queue(_first_of_first)
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PyWork:
        (outs,), (inp,) = outputs, inputs
        if len({o.numel() for o in outs}) > 1:
            return self._allgather_uneven(outs, inp)
        rows = self._gather_bytes(inp)
        if inp.numel():
            for r, o in enumerate(outs):
                o.copy_(rows[r].view(inp.dtype).view(inp.shape))
        return PyWork(result=outs)

    def _allgather_uneven(self, outs: list[torch.Tensor], inp: torch.Tensor) -> PyWork:
        """all_gather whose ranks contribute different sizes (torch's list form allows it; NCCL runs
        it as broadcasts). Every rank knows every size from its output list, so each pads its bytes to
        the largest, one byte all_gather moves them, and each output takes its prefix: no extra round
        trip to agree on sizes, and gloo never sees unequal buffers (it aborts the process on those)."""
        if inp.numel() != outs[self.rank].numel():
            raise ValueError(f"all_gather: this rank's input has {inp.numel()} elements but output[{self.rank}] "
                             f"has {outs[self.rank].numel()}")
        nbytes = [o.numel() * o.element_size() for o in outs]
        width = max(nbytes)
        src = torch.zeros(width, dtype=torch.uint8)
        mine = _bytes(_host(inp))
        src[: mine.numel()] = mine
        rows = torch.empty(self.size * width, dtype=torch.uint8)
        self.world._allgather_base(rows, src).wait()
        for r, o in enumerate(outs):
            if nbytes[r]:
                o.copy_(rows[r * width: r * width + nbytes[r]].view(o.dtype).view(o.shape))
        return PyWork(result=outs)

    @_on_queue(_first_as_list)
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PyWork:  # noqa: A002
        rows = self._gather_bytes(input)
        if input.numel():
            output.copy_(rows.view(-1).view(input.dtype).view(output.shape))
        return PyWork(result=[output])

    @_on_queue(_flattened)
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> PyWork:
        for i, inp in enumerate(inputs):
            self.allgather([[outs[i] for outs in output_lists]], [inp], opts)
        return PyWork(result=[t for outs in output_lists for t in outs])

    @_on_queue(_first_of_first)
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> PyWork:
        (inp,) = inputs
        root = opts.rootRank
        src = _bytes(_host(inp))
        o = dist.GatherOptions()
        o.rootRank = root
        if self.rank == root:
            outs = outputs[0]
            rows = torch.empty(self.size, src.numel(), dtype=torch.uint8)
            if src.numel():
                self.world.gather([list(rows.unbind(0))], [src], o).wait()
                for r, out in enumerate(outs):
                    out.copy_(rows[r].view(inp.dtype).view(out.shape))
            return PyWork(result=outs)
        if src.numel():
            self.world.gather([], [src], o).wait()
        return PyWork(result=[])

    @_on_queue(_first)
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> PyWork:
        (out,) = outputs
        root = opts.rootRank
        h = _host(out)
        dst = _bytes(h)
        o = dist.ScatterOptions()
        o.rootRank = root
        if dst.numel():
            ins = [[_bytes(_host(x)) for x in inputs[0]]] if self.rank == root else []
            self.world.scatter([dst], ins, o).wait()
        _put(out, h)
        return PyWork(result=outputs)

    @_on_queue(_first_as_list)
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int],  # noqa: A002
                      in_splits: list[int], opts: Any = None) -> PyWork:
        """``all_to_all_single`` as bytes; splits count rows of dim 0, scaled to bytes per row."""
        hi, ho = _host(input), _host(output)

        def in_bytes(splits: list[int], t: torch.Tensor) -> list[int]:
            if not splits:
                return []
            row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else 1) * t.element_size()
            return [s * row for s in splits]

        src, dst = _bytes(hi), _bytes(ho)
        if src.numel() or dst.numel() or out_splits or in_splits:
            self.world.alltoall_base(dst, src, in_bytes(out_splits, output), in_bytes(in_splits, input),
                                     dist.AllToAllOptions()).wait()
        _put(output, ho)
        return PyWork(result=[output])

    @_on_queue(_first)
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PyWork:
        dt = inputs[0].dtype
        send = torch.cat([_host(x).reshape(-1) for x in inputs])
        recv = torch.empty(sum(o.numel() for o in outputs), dtype=dt)
        self.alltoall_base(recv, send, [o.numel() for o in outputs], [x.numel() for x in inputs])
        offset = 0
        for o in outputs:
            o.copy_(recv[offset:offset + o.numel()].view(o.shape))
            offset += o.numel()
        return PyWork(result=outputs)

    # -- point to point: always over the host bridge, so a receive from any source can match any sender

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        (t,) = tensors
        return self.world.send([_bytes(_host(t))], dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        (t,) = tensors
        h = _host(t)
        work = self.world.recv([_bytes(h)], src, tag)
        if h is t:
            return work
        return PyWork([work], [lambda: _put(t, h)], tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        (t,) = tensors
        h = _host(t)
        work = self.world.recv_anysource([_bytes(h)], tag)
        if h is t:
            return work
        return PyWork([work], [lambda: _put(t, h)], tensors, source_rank=work._source_rank)

    @_on_queue(_nothing)
    def barrier(self, opts: Any = None) -> Any:
        # On the queue it must also wait for every collective issued before it (gloo's barrier does)
        (self.world.barrier(opts) if opts is not None else self.world.barrier()).wait()
        return PyWork()


# ===================================================================================================
# The transport and its creation
# ===================================================================================================
