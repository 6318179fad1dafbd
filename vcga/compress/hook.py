"""``vcga.compress.ddp_hook(spec) -> (state, hook)``: compressed gradient reduction for DDP.

::

    from vcga.compress import ddp_hook
    state, hook = ddp_hook("powersgd:rank=4")          # or None: the configured `compression`
    model.register_comm_hook(state, hook)

Works on any backend and any world (``vcga`` with one vendor or several, gloo, nccl, ...). Every
rank of the default group must call it (it gathers the layout and, for scope ``bridge``, creates
subgroups). The hook returns at once: the bucket is reduced on one worker thread per state, in the
order DDP hands buckets over (the same order on every rank): each bucket's exact stage inside its
island while backward keeps computing, and the compressed exchange of all of a step's buckets at
once after its last bucket (one collective per round across the slow hop per step) -- on any
backend, whether or not its collectives are asynchronous.
The result is the average over the group, bitwise identical on every rank.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vcga.compress.auto import AutoChoice
from vcga.compress.cost import (
    CompressCost,
    LinkCost,
    link_from_transport,
    measure_compressor,
    measure_link,
    should_compress,
)
from vcga.compress.engine import Pending, Reducer
from vcga.compress.meter import WireMeter, sent_bytes
from vcga.compress.spec import CompressionSpec, configured_spec, parse_spec
from vcga.compress.topology import Topology
from vcga.contract import Combine
from vcga.errors import VcgaCheckpointError, VcgaError

__all__ = ["ddp_hook", "CompressionState", "STATE_KEY_PREFIX"]

log = logging.getLogger(__name__)

_STOP = object()

#: A rank's entry in a checkpoint (:meth:`CompressionState.state_dict`): the prefix and the rank.
STATE_KEY_PREFIX = "vcga-compression-rank"
#: The layout of that entry's value; a change that older readers cannot follow changes it.
STATE_FORMAT = "vcga.compression/1"


class CompressionState:
    """The state :func:`ddp_hook` hands DDP: the reducer, the step count, the auto policy, stats.

    :ivar step: DDP iterations completed through the hook.
    :ivar stats: buckets reduced compressed / plainly.
    """

    def __init__(self, spec: CompressionSpec, group: Any = None, *, meter: WireMeter | None = None,
                 overlap: bool = True, record: bool = False,
                 data_parallel_groups: Sequence[Sequence[int]] | None = None) -> None:
        self.spec = spec
        if group is None:
            group = dist.group.WORLD
        self.group = group
        self.world = self.group.size()
        self.meter = meter
        self.overlap = overlap
        # With overlap, the worker thread's collectives must not interleave with what DDP itself
        # issues on its group from the autograd thread (the unused-parameter map, a static graph's
        # checks): they run on a group of their own over the same ranks (every rank of the job
        # creates it: on a subgroup, only when the job creates every data-parallel group's at once).
        self.comm = self.group
        topology = None
        if data_parallel_groups is not None and spec.enabled:
            topology = Topology.build_job_wide(self.group, data_parallel_groups, duplicate=overlap)
            self.comm = topology.group
        elif overlap and dist.get_world_size() == self.world:
            self.comm = dist.new_group(list(range(self.world)))
        self.reducer = (Reducer(spec, self.comm, meter=meter, record=record, topology=topology)
                        if spec.enabled else None)
        self.step = 0
        self.stats = {"compressed": 0, "plain": 0}
        self.link: LinkCost | None = None
        self.cost: CompressCost | None = None
        self._decisions: dict[Any, bool] = {}
        self._keys: set[Any] = set()  # bucket keys of the step in progress
        self._last_keys: set[Any] = set()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._held: list[tuple[torch.Tensor, Pending | None, bool, torch.futures.Future]] = []  # begun, this step
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._offered: bytes | None = None  # the value state_dict() last handed out
        #: when=auto: each bucket's mode checked against what its reductions really cost
        self.auto: AutoChoice | None = None
        self._step_cost: dict[Any, list[Any]] = {}  # auto key -> [compressed?, seconds] this step
        self._pending_key: dict[int, Any] = {}  # id(Pending) -> its auto key (this step)
        self._flush: set[Any] = set()  # auto keys gone plain: their buckets' residuals go with them next step
        if self.reducer is not None and spec.when == "auto":
            self._measure()
            self.auto = AutoChoice()

    # -- the auto policy -----------------------------------------------------------------------------

    def _measure(self) -> None:
        """Agree on the hop's α–β and the compressor's cost (collective: max over every rank)."""
        r = self.reducer
        assert r is not None
        ex = r.exchange
        hop = r.layout.hop or "all"
        link = link_from_transport(self.comm, hop, equal=r.layout.equal, peers=max(len(r.layout.islands), 2))
        mine = torch.zeros(4, dtype=torch.float64)
        if link is None and ex.group is not None and ex.peers > 1:
            link = measure_link(ex.group, hop)
        if link is not None:
            mine[0], mine[1] = link.alpha_s, 1.0 / link.beta_Bps
        cost = measure_compressor(r.compressor, peers=max(ex.peers, 2))
        mine[2], mine[3] = cost.fixed_s, cost.per_byte_s
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.comm)  # the same figures on every rank
        a, inv_b, c0, c1 = mine.tolist()
        self.link = LinkCost(hop, a, 1.0 / inv_b if inv_b > 0 else math.inf,
                             link.source if link is not None else "none")
        self.cost = CompressCost(c0, c1)

    def _collectives(self) -> int:
        c = self.reducer.compressor  # type: ignore[union-attr]
        if c.combine is Combine.SUM:
            return c.rounds
        return 2 if c.server else 1

    def decide(self, n: int, shapes: list[tuple[int, ...]] | None, dtype: str, itemsize: int) -> bool:
        """Compress a bucket of ``n`` elements? (``when=always``: yes; ``auto``: the cost model, from
        figures every rank agreed on and the bucket's layout, so every rank decides alike)."""
        r = self.reducer
        if r is None or not r.crosses:  # nothing would cross a link: reduce exactly, lose nothing
            return False
        if self.spec.when != "auto":
            return True
        key = (n, tuple(shapes or ()), dtype)
        assert self.auto is not None
        if self.auto.known(key):
            return self.auto.compress(key)
        got = self._decisions.get(key)  # a resumed job's (load_state_dict), else the cost model's
        predicted: dict[str, float] = {}
        if got is None:
            assert self.link is not None and self.cost is not None
            k = len(r.island) if r.scope == "bridge" and r.layout.equal else 1
            peers = r.exchange.peers
            got = False
            if peers > 1 and math.isfinite(self.link.beta_Bps):
                worst_c = max(r.declared_cross_sent(n, shapes, dtype, local=i) for i in range(k))
                part = math.ceil(n / k) * itemsize
                plain = sent_bytes("all_reduce", part, peers)
                got = should_compress(part, plain, worst_c, self._collectives(), self.link, self.cost)
                predicted = {"plain": self.link.time(plain, 1),
                             "compressed": self.cost.time(part) + self.link.time(worst_c, self._collectives())}
            # Ranks outside every peer set cannot evaluate the exchange: agree (all compress or none)
            flag = torch.tensor([1 if got or peers <= 1 else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.comm)
            got = bool(flag.item()) and self.link is not None and math.isfinite(self.link.beta_Bps)
        self._decisions[key] = got
        self.auto.add(key, got, predicted)
        return got

    def _observed(self, key: Any, compress: bool, seconds: float) -> None:
        """A bucket of auto key ``key`` took ``seconds`` of reduction this step (summed per key)."""
        if key is not None:
            cost = self._step_cost.setdefault(key, [compress, 0.0])
            cost[1] += seconds

    def _check(self) -> None:
        """The step boundary after a step, with when=auto: its costs to the policy and, on a check
        step, the agreement: every rank's medians summed in one all_reduce, every rank the same
        changes (module :mod:`vcga.compress.auto`)."""
        auto = self.auto
        if auto is None:
            return
        for key, (compress, seconds) in self._step_cost.items():
            auto.observe(key, compress, seconds)
        self._step_cost.clear()
        self._flush.clear()
        if auto.due(self.step):
            table = torch.tensor(auto.table(), dtype=torch.float64)
            dist.all_reduce(table, group=self.comm)
            for key, compress in auto.agree(table.tolist(), self.world, self.step):
                self._decisions[key] = compress
                if not compress:
                    self._flush.add(key)
                log.info("vcga compression: when=auto settled a bucket of %s %s at step %d", key[0],
                         "compressed" if compress else "plain", self.step)
        auto.advance()

    # -- the work ------------------------------------------------------------------------------------

    def reduce(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]], index: int, last: bool) -> torch.Tensor:
        """Average ``buffer`` (a DDP bucket) over the group, in place, and return it."""
        self._end([(buffer, self._start(buffer, shapes, index), last)])
        return buffer

    def _start(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]], index: int) -> Pending | None:
        """A bucket's first stage: a plain all_reduce (returns None), or the reducer's
        :meth:`~vcga.compress.engine.Reducer.begin` (the exact reduction inside the island)."""
        from vcga import dtypes as _dtypes

        r = self.reducer
        key = (index, tuple(shapes))
        akey = None
        if r is None or self.step < self.spec.start:
            compress = False
        else:
            compress = self.decide(buffer.numel(), shapes, _dtypes.from_torch(buffer.dtype), buffer.element_size())
            if self.auto is not None and r.crosses:
                akey = (buffer.numel(), tuple(shapes), _dtypes.from_torch(buffer.dtype))
        self._keys.add(key)
        self.stats["compressed" if compress else "plain"] += 1
        t0 = time.perf_counter()
        if r is None or not compress:
            if akey in self._flush and r is not None:
                r.release_residuals(buffer, shapes, key)  # what compression held back goes with the sum
            dist.all_reduce(buffer, group=self.comm)
            self._observed(akey, False, time.perf_counter() - t0)
            return None
        r.step = self.step
        p = r.begin(buffer, shapes, key=key)
        self._observed(akey, True, time.perf_counter() - t0)
        if akey is not None:
            self._pending_key[id(p)] = akey
        return p

    def _end(self, items: list[tuple[torch.Tensor, Pending | None, bool]]) -> None:
        """The compressed exchange of every begun bucket in ``items`` at once, the averages, and
        the step's bookkeeping after its last bucket."""
        pending = [p for _, p, _ in items if p is not None]
        if pending:
            assert self.reducer is not None
            t0 = time.perf_counter()
            with _traced(self.step, [b for b, _, _ in items]):
                self.reducer.finish(pending, divisor=self.world)
            took = time.perf_counter() - t0
            total = sum(p.flat.numel() for p in pending) or 1
            for q in pending:  # the step's one exchange, shared by the buckets in it by their elements
                self._observed(self._pending_key.pop(id(q), None), True, took * q.flat.numel() / total)
        for buffer, p, last in items:
            if p is None or not p.averaged:  # a plain all_reduce's sum (the exchange averaged the rest)
                buffer.div_(self.world)
            if last:
                r = self.reducer
                if r is not None and self._last_keys and self._keys != self._last_keys:
                    # DDP rebuilt its buckets (after the first iteration): residuals and warm starts of
                    # the old layout belong to no bucket any more
                    keep = set(self._keys)
                    r.exchange.forget(lambda k: k[0] in keep)  # noqa: B023 - called before the loop moves on
                    if self.auto is not None:
                        layouts = {k[1] for k in keep}
                        self.auto.forget(lambda k: k[1] in layouts)  # noqa: B023 - called at once
                self._last_keys, self._keys = self._keys, set()
                self.step += 1
                self._pending_key.clear()
                self._check()

    def _worker(self) -> None:
        """What runs beside backward: each bucket but a step's last one, in the order DDP hands them
        over (the same on every rank), its exact island stage at once (:meth:`_start`); the stage
        then waits here for the step's last bucket (:meth:`submit`)."""
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                buffer, shapes, index, fut = item
                if self._error is not None:
                    fut.set_exception(self._error)
                    continue
                try:
                    self._held.append((buffer, self._start(buffer, shapes, index), False, fut))
                except BaseException as e:  # noqa: BLE001 - handed to DDP through the futures
                    self._fail(e, fut)
            finally:
                self._queue.task_done()

    def _fail(self, e: BaseException, fut: torch.futures.Future | None = None) -> None:
        self._error = _failure(e)
        for _, _, _, f in self._held:
            if not f.done():
                f.set_exception(self._error)
        self._held = []
        if fut is not None and not fut.done():
            fut.set_exception(self._error)

    def _drain(self) -> None:
        """Wait until the worker has done everything handed to it (bounded by its own collectives'
        timeouts: each of its items ends or fails)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def submit(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]], index: int,
               last: bool) -> torch.futures.Future:
        """Take one of DDP's buckets. With ``overlap``, every bucket but the step's last begins on the
        worker thread (its island stage runs while backward goes on); the last one, once the worker
        has begun every earlier one, is begun here and the step's compressed exchange of all of them
        runs here too, in DDP's thread, whose backward has nothing left to compute -- each of its
        collectives issued and waited for in this thread (no hand-over to another thread and back
        per collective, which on a busy machine costs a scheduling delay each)."""
        fut: torch.futures.Future = torch.futures.Future()
        if not self.overlap:
            try:
                fut.set_result(self.reduce(buffer, shapes, index, last))
            except BaseException as e:  # noqa: BLE001
                fut.set_exception(_failure(e))
            return fut.then(_value)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="vcga-compress", daemon=True)
            self._thread.start()
        if not last:
            self._queue.put((buffer, shapes, index, fut))
            return fut.then(_value)
        self._drain()
        if self._error is not None:
            self._fail(self._error, fut)
            return fut.then(_value)
        held, self._held = self._held, []
        try:
            if self.reducer is not None:
                self.reducer.exchange.sync = True
            held.append((buffer, self._start(buffer, shapes, index), True, fut))
            self._end([(b, p, la) for b, p, la, _ in held])
            for b, _, _, f in held:
                f.set_result(b)
        except BaseException as e:  # noqa: BLE001 - handed to DDP through the futures
            self._held = held
            self._fail(e, fut)
        return fut.then(_value)

    # -- checkpointing -------------------------------------------------------------------------------

    def _entry(self) -> str:
        # the job's rank, not the group's: on data-parallel subgroups, rank 0 of one group and rank 0
        # of another keep different states, and one checkpoint holds both
        return f"{STATE_KEY_PREFIX}{dist.get_rank()}"

    def _identity(self) -> dict[str, Any]:
        """What a saved state must match to be carried on: the compression and the layout it was
        kept for (a residual is this rank's share of its island's sum in the exchange among peers)."""
        r = self.reducer
        mine = {"spec": self.spec.canonical(), "world": self.world, "rank": dist.get_rank(self.group),
                "islands": [list(i) for i in r.layout.islands] if r is not None else None,
                "scope": r.scope if r is not None else None}
        if dist.get_world_size() != self.world:  # a subgroup: which of the job's ranks it holds
            mine["group"] = list(dist.get_process_group_ranks(self.group))
        return mine

    def state_dict(self) -> dict[str, bytes]:
        """This rank's compression state, to resume a job where it stopped, bit for bit.

        ``{"vcga-compression-rank<r>": bytes}``: every rank's state differs (its error-feedback
        residuals, its share of PowerSGD's warm start), so each sits under a key of its own, as one
        opaque value: ``vcga.checkpoint.save`` / ``torch.distributed.checkpoint`` keep every
        rank's entry (a tensor under the same key on every rank would be kept once, as replicated),
        and ``torch.save`` takes it as it is. Take it between steps (after ``loss.backward()``)."""
        if self._keys:
            raise VcgaError("the compression state was asked for in the middle of a step (some of DDP's "
                            "buckets are reduced, others not): take it between steps, after loss.backward()")
        r = self.reducer
        payload = {"format": STATE_FORMAT, **self._identity(), "step": self.step, "stats": dict(self.stats),
                   "decisions": dict(self._decisions),
                   "link": [self.link.name, self.link.alpha_s, self.link.beta_Bps, self.link.source]
                   if self.link is not None else None,
                   "cost": [self.cost.fixed_s, self.cost.per_byte_s, self.cost.source]
                   if self.cost is not None else None,
                   "slots": r.exchange.saved() if r is not None else {}}
        buf = io.BytesIO()
        torch.save(payload, buf)
        self._offered = buf.getvalue()
        return {self._entry(): self._offered}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = False) -> None:
        """Carry on from :meth:`state_dict`'s value saved by the same rank of an earlier run.

        Bit for bit when DDP's buckets at the resumed step are those the state was saved with: DDP
        in a new process reduces its first step in one bucket of all parameters and rebuilds its
        buckets after it -- unless ``find_unused_parameters=True``, which keeps one layout from the
        first step. Otherwise that first step's bucket starts without a residual, and the loaded
        residuals carry on from DDP's rebuild (docs/compression.md, "Checkpoints").

        A state kept for another compression spec or another layout (the job resumed on another
        world: elastic) cannot be carried on -- a residual is this rank's share in *that* layout's
        exchange: the residuals then start at zero, as at a job's first step, with a warning (with
        ``strict``: :class:`~vcga.errors.VcgaCheckpointError`). So does a rank the checkpoint has no
        entry for (it was saved by a smaller world).

        :raises VcgaCheckpointError: the entry is not a compression state this version can read.
        """
        rank = dist.get_rank(self.group)
        value = state_dict.get(self._entry())
        if value is None or value is self._offered:  # absent, or left as the template we handed a loader
            self._start_afresh(f"the checkpoint holds no compression state for rank {rank} (it was saved by "
                               "a smaller world, or without it)", strict)
            return
        if not isinstance(value, (bytes, bytearray)):
            raise VcgaCheckpointError(f"the compression state of rank {rank} is a {type(value).__name__}, not the "
                                      "bytes CompressionState.state_dict() gives: save what it returns, as it is")
        try:
            # onto the host: a state saved on one vendor's device is read where that device does not
            # exist (resumed on another vendor's chips, or on CPU); each tensor goes to the
            # gradients' device at the next step (ErrorFeedback.input, the compressors' state)
            payload = torch.load(io.BytesIO(bytes(value)), weights_only=True, map_location="cpu")
        except Exception as e:  # whatever the unpickler says, as the reason
            raise VcgaCheckpointError(f"the compression state of rank {rank} could not be read: {e}") from e
        if not isinstance(payload, dict) or payload.get("format") != STATE_FORMAT:
            got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise VcgaCheckpointError(f"the compression state of rank {rank} has format {got!r}; this version of "
                                      f"vcga reads {STATE_FORMAT!r}")
        mine = self._identity()
        differ = [f"{k} {payload.get(k)!r} (now {v!r})" for k, v in mine.items() if payload.get(k) != v]
        if differ:
            self._start_afresh(f"the compression state of rank {rank} was kept for another compression or layout: "
                               + "; ".join(differ), strict)
            return
        self.step = int(payload["step"])
        self.stats = dict(payload["stats"])
        # DDP in a new process runs its first step with all parameters in one bucket and rebuilds
        # its buckets after it (unless find_unused_parameters): that step's bucket starts afresh,
        # and the loaded ones must outlive it to carry on from the rebuild (see _end).
        self._last_keys = set()
        self._decisions = dict(payload["decisions"])
        if payload["link"] is not None:
            self.link = LinkCost(*payload["link"])
        if payload["cost"] is not None:
            self.cost = CompressCost(*payload["cost"])
        if self.reducer is not None:
            self.reducer.exchange.restore(payload["slots"])

    def _start_afresh(self, reason: str, strict: bool) -> None:
        if strict:
            raise VcgaCheckpointError(reason + ". Resume with the spec and world it was saved with, or load "
                                      "it with strict=False to start the residuals at zero")
        log.warning("%s: error-feedback residuals and warm starts start afresh (at zero)", reason)

    def close(self) -> None:
        """Stop the worker thread and the meter."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
        if self.reducer is not None:
            self.reducer.close()

    def describe(self) -> dict[str, Any]:
        r = self.reducer
        d: dict[str, Any] = {"spec": self.spec.canonical(), "step": self.step, "stats": dict(self.stats)}
        if r is not None:
            d.update({"scope": r.scope, "layout": r.layout.describe(), "compressor": r.compressor.describe(),
                      "restarted": r.restarted})
        if self.link is not None:
            d["link"] = self.link.to_json()
        if self.cost is not None:
            d["compress_cost"] = self.cost.to_json()
        if self.auto is not None:  # per bucket: its mode, the model's prediction, what was observed
            d["auto"] = {"buckets": self.auto.describe(), "checks": self.auto.checks}
        return d


def _failure(e: BaseException) -> VcgaError:
    """A VCGA error as it is, anything else wrapped in one (its cause kept)."""
    if isinstance(e, VcgaError):
        return e
    err = VcgaError(f"compressed reduction failed: {e!r}")
    err.__cause__ = e
    return err


def _value(fut: torch.futures.Future) -> torch.Tensor:
    """The reduced bucket, or the failure raised. torch's ``Future.set_exception`` stores the
    exception as the future's *value* (Python's ``wait()`` raises it; DDP's C++ reducer reads the
    value and fails with "Unable to cast <message> to Tensor", which ``vcga.errors.typed`` cannot
    trace back). A ``then()`` callback that raises marks the chained future failed in C++, so
    ``loss.backward()`` raises torch's callback wrapper around the VCGA error, which ``typed`` finds."""
    return fut.wait()


@contextlib.contextmanager
def _traced(step: int, buffers: list[torch.Tensor]) -> Iterator[None]:
    """While a torch profiler runs: the compressed exchange of a step's buckets as one span,
    ``vcga:compressed_all_reduce``, with its encode, exchange and decode steps inside
    (:mod:`vcga.pg.spans`); the collectives it issues have spans of their own."""
    from vcga.pg import recorder, spans

    if not spans.recording():
        yield
        return
    shapes = recorder.described(buffers)
    call = recorder.new_call(None, step, "compressed_all_reduce", shapes, shapes)
    call.span = spans.open_span(call, buffers)
    call.start()
    try:
        with recorder.running(call):
            yield
    except BaseException as e:
        call.end(e)
        raise
    call.end()


def _hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future:
    buffer = bucket.buffer()
    shapes = [tuple(g.shape) for g in bucket.gradients()]
    if sum(math.prod(s) for s in shapes) != buffer.numel():
        shapes = [(buffer.numel(),)]
    return state.submit(buffer, shapes, bucket.index(), bucket.is_last())


# DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
_hook.__annotations__ = {"state": CompressionState, "bucket": dist.GradBucket,
                         "return": torch.futures.Future[torch.Tensor]}


def ddp_hook(spec: str | CompressionSpec | None = None, process_group: Any = None, *,
             meter: WireMeter | None = None, overlap: bool = True, record: bool = False,
             data_parallel_groups: Sequence[Sequence[int]] | None = None,
             ) -> tuple[CompressionState, Callable[[CompressionState, dist.GradBucket], torch.futures.Future]]:
    """A DDP communication hook that averages gradients, compressed as ``spec`` says.

    :param spec: ``name[:key=value,...]`` (see :mod:`vcga.compress.spec`), a parsed spec, or None for
        the configured one (config ``compression`` / ``VCGA_COMPRESSION``; "none": exact averaging).
    :param process_group: the group DDP reduces over (default: the default group).
    :param meter: count bytes at the transport (labels "island" and "cross").
    :param overlap: reduce on a worker thread so backward overlaps communication (default True).
    :param data_parallel_groups: with ``process_group`` one data-parallel group of a job that also
        splits its model: every such group, as lists of global ranks (the same on every rank, every
        rank in one; ``[[0, 2], [1, 3]]``). Every rank of the job then calls ``ddp_hook`` together,
        and scope ``bridge`` (the default where a group spans islands) works on each group. Without
        it, scope ``bridge`` needs the default group, and a subgroup's default scope is ``all``.
    :raises vcga.errors.VcgaConfigError: a bad spec, naming the key and what is allowed; groups that
        overlap, leave a rank out, differ between ranks, or do not hold ``process_group``.
    :returns: ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.
    """
    spec = configured_spec() if spec is None else parse_spec(spec)
    state = CompressionState(spec, process_group, meter=meter, overlap=overlap, record=record,
                             data_parallel_groups=data_parallel_groups)
    return state, _hook
