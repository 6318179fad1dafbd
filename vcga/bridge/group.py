"""The bridge's hierarchical collectives: :class:`BridgeGroup`, the group the dispatcher drives.

Inside a vendor group through that vendor's own dispatcher, across vendor groups on the host (gloo,
or shared memory between shard peers on one node); the algorithms (leader, bandwidth, replicated)
and their error bounds are in ``docs/bridge.md``, the overview in :mod:`vcga.bridge`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from vcga.bridge.allreduce import AllReducer
from vcga.bridge.comms import Communicators
from vcga.bridge.host import SharedMemoryBridge, as_bytes, on_host, put_back
from vcga.bridge.plan import Plan
from vcga.contract import CapabilityTable, ReduceOp
from vcga.pg.dispatch import Dispatcher
from vcga.pg.recorder import current, stage
from vcga.pg.workqueue import Continuation, WorkQueue
from vcga.pypg import PyWork, reduce_op_of

__all__ = ["BridgeGroup"]

log = logging.getLogger("vcga.bridge")


# ===================================================================================================
# Host-side pieces
# ===================================================================================================

#: An all_gather of more bytes per rank than two pieces of this size travels as several all_gathers
#: in flight at once (at most :data:`GATHER_MAX_PIECES`). gloo moves one large message per pair of
#: ranks at ~0.6 of a shaped link's rate, and pieces in flight keep the link busy (8 MiB per rank
#: between two nodes at 1 Gbit/s: gloo 110 ms against the link's 67, 16 pieces 80 ms; docs/benchmarks.md,
#: "all_gather across nodes").
GATHER_PIECE_BYTES = 512 * 1024
GATHER_MAX_PIECES = 16


def pipelined_allgather(pg: Any, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``pg._allgather_base(rows, src)`` (bytes: ``rows`` is the group's ``src`` one after another),
    as pieces in flight at once when ``src`` is large; the same bytes either way."""
    n = src.numel()
    pieces = min(GATHER_MAX_PIECES, n // GATHER_PIECE_BYTES)
    if pieces < 2:
        pg._allgather_base(rows, src).wait()
        return
    size = rows.numel() // n
    edges = [n * i // pieces for i in range(pieces + 1)]
    outs = [torch.empty(size * (b - a), dtype=torch.uint8) for a, b in pairwise(edges)]
    works = [pg._allgather_base(o, src[a:b]) for o, (a, b) in zip(outs, pairwise(edges), strict=True)]
    table = rows.view(size, n)
    for w, o, (a, b) in zip(works, outs, pairwise(edges), strict=True):
        w.wait()  # in order: later pieces travel while this one is copied into place
        table[:, a:b].copy_(o.view(size, b - a))


def _on_queue(result: Callable[..., Sequence[torch.Tensor]],
              two_stage: Callable[..., tuple[list[tuple[int, int]], Callable[[], Any]] | None] | None = None,
              ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated c10d method on the group's :class:`~vcga.pg.workqueue.WorkQueue`, in issue order:
    it returns at once with a work completed on the communication thread, unless its options say
    ``asyncOp=False`` (then it runs in the caller's thread when nothing is queued, else waits its
    turn). Without a queue (config ``bridge_async: false``) it runs in the caller's thread.
    ``result(*args)`` names the output tensors (the value of the work's future). ``two_stage(self,
    *args)``, where given, says at issue time whether the call runs in two stages (pipelined, see
    :meth:`BridgeGroup.pipelinable`): None, or the byte ranges it touches and what the queue runs
    instead (its first stage, which returns a :class:`~vcga.pg.workqueue.Continuation`)."""
    def deco(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: BridgeGroup, *args: Any) -> Any:
            if self.queue is None:
                return method(self, *args)
            opts = next((a for a in args if hasattr(a, "asyncOp")), None)
            staged = two_stage(self, *args) if two_stage is not None else None
            fn = staged[1] if staged is not None else functools.partial(method, self, *args)
            return self.queue.run(fn, result(*args), opts is None or bool(opts.asyncOp),
                                  staged[0] if staged is not None else None, current())
        return run
    return deco


def _allreduce_two_stage(self: BridgeGroup, tensors: list[torch.Tensor], opts: Any = None,
                         ) -> tuple[list[tuple[int, int]], Callable[[], Any]] | None:
    (t,) = tensors
    op = _op_of(opts)
    if not self.pipelinable(t, op, issue=True):
        return None
    start = t.data_ptr()
    return [(start, start + t.numel() * t.element_size())], functools.partial(self._allreduce_started, tensors, op)


def _op_of(opts: Any) -> ReduceOp:
    return reduce_op_of(opts.reduceOp)[0] if opts is not None else ReduceOp.SUM


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
    """The hierarchical collectives, with the c10d methods of :data:`vcga.pg.transport.TRANSPORT_METHODS`.

    Each collective goes on the group's :class:`~vcga.pg.workqueue.WorkQueue` (:attr:`queue`) and
    returns at once with a work its communication thread completes, in issue order (``asyncOp``
    false: it completes before returning); with no queue (``bridge_async: false``) each runs to
    completion in the calling thread. Point-to-point returns gloo's own asynchronous work. Tensors
    arrive contiguous, in dtypes and ops the combined table calls native. All-reduces, and the
    choice among their algorithms, are its :attr:`reducer`'s.

    :param plan: the plan (same on every rank).
    :param rank: this rank in the ``vcga`` group.
    :param inner: this rank's vendor-group dispatcher (None when the vendor group has one rank).
    :param shard: gloo group of this rank's shard peers (leaders for local rank 0), or None.
    :param world: gloo group over the whole ``vcga`` group.
    :param shm: the shard peers' shared segment (:class:`~vcga.bridge.host.SharedMemoryBridge`, all
        peers on this node), or None: they reduce through ``shard``.
    """

    #: its collectives run steps the flight recorder and the profiler note (vcga.pg.recorder.stage):
    #: the call path makes each call this thread's current call while it issues it
    records_steps = True

    def __init__(self, plan: Plan, rank: int, inner: Dispatcher | None, shard: Any, world: Any,
                 tables: Sequence[CapabilityTable], shm: SharedMemoryBridge | None = None) -> None:
        self.plan, self.rank, self.size = plan, rank, plan.size
        self.tables = list(tables)
        self.vgroup = plan.group_of(rank)
        self.local_rank = self.vgroup.ranks.index(rank)
        #: the communicators, per lane: lane 0 runs everything, except the second stage of pipelined
        #: all_reduces and what runs on the queue's second thread (lane 1, :meth:`set_lane_b`)
        self.comms = Communicators(inner, shard, world, shm)
        #: the all_reduce algorithms and their choice
        self.reducer = AllReducer(plan, rank, self.comms, tables)
        #: all_reduces that ran in two stages (tests and benchmarks read it)
        self.pipelined_all_reduces = 0
        #: reduce_scatter hierarchically where the bandwidth algorithm would run (see _reduce_scatter);
        #: False: always as an all_reduce of the whole buffer (the same on every rank; benchmarks compare)
        self.hierarchical_reduce_scatter = True
        #: reduce_scatters that ran hierarchically (the rest ran as an all_reduce, see _reduce_scatter)
        self.hierarchical_reduce_scatters = 0
        #: the ordered queue and communication thread of asynchronous collectives (None: every
        #: collective runs in the calling thread); set at creation
        self.queue: WorkQueue | None = None

    # -- lanes: communicators per pipeline stage ------------------------------------------------

    @property
    def inner(self) -> Dispatcher | None:
        return self.comms.inner

    @property
    def shard(self) -> Any:
        return self.comms.shard

    @property
    def shm(self) -> SharedMemoryBridge | None:
        return self.comms.shm

    @property
    def world(self) -> Any:
        return self.comms.world

    def set_lane_b(self, inner: Dispatcher | None, shard: Any) -> None:
        """Give the group its second lane -- a second native group of this rank's vendor group and a
        second gloo group of its shard peers -- and so pipeline its bandwidth all_reduces (the same
        on every rank of the group; None drops it). Only where every set of shard peers exchanges
        through gloo: lane 1 has no shared segment."""
        self.comms.set_lane_b(inner, shard)
        self.reducer.pipeline_across_collectives(self.comms.two_lanes)

    def enter_lane_b(self) -> None:
        """Make this thread use lane 1 (the queue's second thread calls it when it starts)."""
        self.comms.enter_lane_b()

    @property
    def pipelined(self) -> bool:
        """Whether consecutive bandwidth all_reduces run pipelined (:meth:`pipelinable`)."""
        return self.comms.two_lanes and self.queue is not None

    def pipelinable(self, t: torch.Tensor, op: ReduceOp, issue: bool = False) -> bool:
        """Whether an all_reduce of ``t`` runs in two stages (docs/bridge.md, 'Pipelining across
        collectives'): the group pipelines and ``t`` goes the bandwidth way. The same on every rank
        (the algorithm is), so each lane's communicators see the same operations in the same order
        everywhere. ``issue``: asked when the call is issued, ahead of the calls still queued; a call
        the online check covers (:meth:`~vcga.bridge.allreduce.AllReducer.checked`) may then run in
        two stages -- its algorithm, and whether it is watched (then it runs alone), are known only
        when it runs, in issue order, where the decisions of the calls before it have been applied."""
        if not self.pipelined or t.numel() == 0:
            return False
        if issue and self.reducer.checked(t, op):
            return True
        return self.reducer.algorithm(t, op) == "bandwidth"

    @property
    def shard_exchange(self) -> str | None:
        """How this rank's shard peers reduce on the host: "shared memory", "gloo", or None (it has none)."""
        return "shared memory" if self.shm is not None else "gloo" if self.shard is not None else None

    # -- reductions (c10d signatures) ------------------------------------------------------------

    @_on_queue(_first, _allreduce_two_stage)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PyWork:
        (t,) = tensors
        self.reducer.all_reduce(t, _op_of(opts))
        return PyWork(result=tensors)

    def _allreduce_started(self, tensors: list[torch.Tensor], op: ReduceOp) -> Continuation | PyWork:
        """The first stage of a pipelined all_reduce (the queue runs the second on its second
        thread): reduce-scatter every segment and start its exchange, on this thread's lane; the
        second waits for the exchanges and all-gathers on lane 1 (docs/bridge.md, 'Pipelining
        across collectives'). A call the online check runs another way, or watches, runs whole here."""
        (t,) = tensors
        _, finish = self.reducer.run_call(t, op, pipelined=True)
        if finish is None:
            return PyWork(result=tensors)
        self.pipelined_all_reduces += 1

        def complete() -> PyWork:
            with self.comms.on_lane_b():
                finish()
            return PyWork(result=tensors)
        return Continuation(complete)

    @_on_queue(_first)
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PyWork:
        op, _ = reduce_op_of(opts.reduceOp) if opts is not None else (ReduceOp.SUM, None)
        for t in tensors:
            self.reducer.all_reduce(t, op)
        return PyWork(result=tensors)

    @_on_queue(_first)
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> PyWork:
        """All-reduce a copy; only the root keeps the result (other ranks' tensors are unchanged)."""
        (t,) = tensors
        op, _ = reduce_op_of(opts.reduceOp)
        w = t.clone()
        self.reducer.all_reduce(w, op)
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

    def _reduce_scatter_choice(self, out: torch.Tensor, nbytes: int, op: ReduceOp) -> str:
        """The all_reduce algorithm a reduce_scatter of ``nbytes`` follows: the online check's
        current choice for an all_reduce of that size where it applies, else the figures'."""
        if self.reducer.check is not None and self.reducer.checks(nbytes, out.dtype, op):
            return self.reducer.check.algorithm(nbytes)
        return self.reducer.auto_choice(nbytes)

    def _reduce_scatter(self, out: torch.Tensor, chunks: list[torch.Tensor], op: ReduceOp) -> None:
        """Reduce ``chunks[r]`` of every rank into ``out`` of rank r (chunks: equal, flat).

        Hierarchical when the bandwidth algorithm would run at this size: reduce-scatter in the
        vendor group, then among the shard peers -- each rank moves about half of what an all_reduce
        of the whole buffer would. Otherwise (and for unequal groups, host routes, or a forced
        leader algorithm) an all_reduce of the whole buffer, keeping this rank's chunk.
        """
        nbytes = sum(c.numel() for c in chunks) * out.element_size()
        if (not self.hierarchical_reduce_scatter or not self.plan.equal_groups
                or any(r != "library" for r in self.reducer.routes(out.dtype, op))
                or self._reduce_scatter_choice(out, nbytes, op) == "leader" or out.numel() == 0):
            buf = torch.cat(chunks)
            self.reducer.all_reduce(buf, op)
            out.copy_(buf.view(self.size, -1)[self.rank].view(out.shape))
            return
        self.hierarchical_reduce_scatters += 1
        k, groups = self.vgroup.size, self.plan.groups
        # Row-major (local rank i, vendor group g): after the in-group reduce-scatter, local rank i
        # holds its vendor group's partial of the chunks of ranks (g, i) for every g, in bridge order.
        buf = torch.cat([chunks[g.ranks[i]] for i in range(k) for g in groups])
        c = out.numel()
        if self.reducer.group_method == "p2p":
            mine = self.reducer.segment_p2p(buf, op, "reduce_scatter")
        else:
            mine = torch.empty(len(groups) * c, dtype=buf.dtype, device=buf.device)
            self.reducer.in_group(lambda s: self.inner.reduce_scatter(  # type: ignore[union-attr]
                mine, list(buf.view(k, -1).unbind(0)), op, None, None, s), "reduce_scatter")
        rows = on_host(mine).view(len(groups), c)
        g = self.vgroup.index
        if self.shm is not None:
            flat = out.view(-1)
            h = on_host(flat)
            self.shm.reduce_scatter(rows, op, h)
            put_back(flat, h)
        else:
            self.reducer.bridge_reduce(rows, op)
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
            self.reducer.in_group(lambda s: self.inner.broadcast(  # type: ignore[union-attr]
                t, rg.ranks.index(root), None, s), "broadcast")
        if self.local_rank == 0 and t.numel():
            h = on_host(t)
            o = dist.BroadcastOptions()
            o.rootRank = rg.index
            with stage("broadcast", "cross-vendor", "gloo"):
                self.shard.broadcast([as_bytes(h)], o).wait()
            put_back(t, h)
        if not mine:
            self.reducer.in_group(lambda s: self.inner.broadcast(t, 0, None, s), "broadcast")  # type: ignore[union-attr]
        return PyWork(result=tensors)

    def _gather_bytes(self, inp: torch.Tensor) -> torch.Tensor:
        src = as_bytes(on_host(inp))
        rows = torch.empty(self.size * src.numel(), dtype=torch.uint8)
        if src.numel():
            with stage("all_gather", "cross-vendor", "gloo"):
                pipelined_allgather(self.world, rows, src)
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
        mine = as_bytes(on_host(inp))
        src[: mine.numel()] = mine
        rows = torch.empty(self.size * width, dtype=torch.uint8)
        pipelined_allgather(self.world, rows, src)
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
        src = as_bytes(on_host(inp))
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
        h = on_host(out)
        dst = as_bytes(h)
        o = dist.ScatterOptions()
        o.rootRank = root
        if dst.numel():
            ins = [[as_bytes(on_host(x)) for x in inputs[0]]] if self.rank == root else []
            self.world.scatter([dst], ins, o).wait()
        put_back(out, h)
        return PyWork(result=outputs)

    @_on_queue(_first_as_list)
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int],  # noqa: A002
                      in_splits: list[int], opts: Any = None) -> PyWork:
        """``all_to_all_single`` as bytes; splits count rows of dim 0, scaled to bytes per row."""
        hi, ho = on_host(input), on_host(output)

        def in_bytes(splits: list[int], t: torch.Tensor) -> list[int]:
            if not splits:
                return []
            row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else 1) * t.element_size()
            return [s * row for s in splits]

        src, dst = as_bytes(hi), as_bytes(ho)
        if src.numel() or dst.numel() or out_splits or in_splits:
            self.world.alltoall_base(dst, src, in_bytes(out_splits, output), in_bytes(in_splits, input),
                                     dist.AllToAllOptions()).wait()
        put_back(output, ho)
        return PyWork(result=[output])

    @_on_queue(_first)
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PyWork:
        dt = inputs[0].dtype
        send = torch.cat([on_host(x).reshape(-1) for x in inputs])
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
        return self.world.send([as_bytes(on_host(t))], dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        (t,) = tensors
        h = on_host(t)
        work = self.world.recv([as_bytes(h)], src, tag)
        if h is t:
            return work
        return PyWork([work], [lambda: put_back(t, h)], tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        (t,) = tensors
        h = on_host(t)
        work = self.world.recv_anysource([as_bytes(h)], tag)
        if h is t:
            return work
        return PyWork([work], [lambda: put_back(t, h)], tensors, source_rank=work._source_rank)

    @_on_queue(_nothing)
    def barrier(self, opts: Any = None) -> Any:
        # On the queue it must also wait for every collective issued before it (gloo's barrier does)
        with stage("barrier", "cross-vendor", "gloo"):
            (self.world.barrier(opts) if opts is not None else self.world.barrier()).wait()
        return PyWork()


# ===================================================================================================
# The transport and its creation
# ===================================================================================================
