"""The ``vcga`` torch.distributed backend: one process group for every vendor.

``torch.distributed.init_process_group(backend="vcga")`` (after ``import vcga``) reaches
:func:`create_process_group`, which

1. reads the unified config (:func:`vcga.config.load_config`, or a :class:`VcgaOptions` passed as
   ``pg_options``) and picks this rank's backend through the plugin manager;
2. publishes that choice through the group's store and builds the :mod:`transport <vcga.pg.transport>`
   (:func:`vcga.pg.transport.make_transport`): the backend's native group over a prefixed store when every rank runs
   the same backend;
3. returns a :class:`VcgaProcessGroup`, a Python ``torch.distributed.ProcessGroup`` that implements
   every collective by dispatching through the transport's capability table
   (:mod:`vcga.pg.dispatch`): native, emulated, or refused with a typed error.

Every collective has the configured timeout; a failure or timeout in the native library surfaces
as :class:`~vcga.errors.VcgaTimeoutError` / :class:`~vcga.errors.VcgaCollectiveError` on the rank
that waited. In debug mode (``VCGA_DEBUG=1``) ranks compare fingerprints first (:mod:`vcga.pg.debug`).

Each group owns a :class:`~vcga.pg.calls.CallPath` (how a call reaches the library: numbering,
the hot path, dispatch, typed failures) and a :class:`~vcga.pg.collectives.Collectives` on it
(reductions, data movement, their argument checks; ``all_reduce`` in :mod:`vcga.pg.allreduce`,
the others made at the first call of one); this module keeps creation, torch's c10d
methods, barriers and coalescing (point to point in :mod:`vcga.pg.p2p`, ``monitored_barrier`` in
:mod:`vcga.pg.monitored`, each loaded at its first call).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from vcga import pypg
from vcga._values import FrozenValue
from vcga.config import Config, load_config
from vcga.errors import (
    VcgaTimeoutError,
)
from vcga.pg.allreduce import all_reduce
from vcga.pg.calls import CallPath
from vcga.pg.dispatch import Dispatcher
from vcga.pg.transport import ClosedGroup, StartupClock, Transport, make_transport
from vcga.pypg import PyWork, options

if TYPE_CHECKING:
    from vcga.pg.collectives import Collectives
    from vcga.pg.monitored import MonitoredBarrier
    from vcga.pg.p2p import PointToPoint

__all__ = [
    "BACKEND_NAME",
    "DEVICES",
    "VcgaOptions",
    "VcgaProcessGroup",
    "create_process_group",
    "make_transport",
    "register",
]

log = logging.getLogger(__name__)

#: The name users pass to ``init_process_group``.
BACKEND_NAME = "vcga"
#: Device types the backend accepts tensors of (each through its vendor's plugin).
DEVICES = ["cpu", "cuda", "npu", "mlu"]

# -- leaving without destroy_process_group() ------------------------------------------------------
#
# A script that returns without destroy_process_group() leaves its groups to the interpreter's
# finalization, and with them the native groups' worker threads (gloo's pt_gloo_runloop). A worker
# that just completed a work drops it a moment later; once the script's own references are gone
# (finalization clears the modules) that drop can release a tensor's Python object, which takes
# the GIL, and Python ends a thread that asks for the GIL during finalization inside a noexcept
# destructor: SIGABRT ("terminate called without an active exception"), at random, after correct
# results. So at exit -- atexit runs before finalization, after every non-daemon thread ended --
# every group still open is shut down as destroy_process_group() would: its workers are joined
# while the interpreter still runs. It runs in vcga.pypg's exit hook, right after the drain: what
# was in flight has completed (or the drain gave up on it) before its group goes.

_OPEN: weakref.WeakSet[VcgaProcessGroup] = weakref.WeakSet()


def _shutdown_at_exit() -> None:
    for pg in list(_OPEN):
        try:
            pg.shutdown()
        except Exception:  # at exit: the next group still gets its shutdown
            log.warning("vcga: shutting down %r at exit failed", pg, exc_info=True)


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: its copies of the parent's groups are not
    its own to shut down (joining threads that do not exist there would fail)."""
    _OPEN.clear()


pypg._AFTER_DRAIN.append(_shutdown_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

class VcgaOptions(FrozenValue):
    """``pg_options`` for ``init_process_group(backend="vcga", pg_options=...)`` / ``new_group``.

    :param config: the unified config to use instead of reading files and environment.
    :param backend: shorthand for ``replace(config, backend=...)``.

    Frozen and compared by value, as ``@dataclass(frozen=True)`` would make it; defined without
    dataclasses, which would cost each rank 0.5 ms at every start (:mod:`vcga._values`).
    """

    __slots__ = ("config", "backend")
    config: Config | None
    backend: str | None

    def __init__(self, config: Config | None = None, backend: str | None = None) -> None:
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "backend", backend)

    def resolve(self) -> Config:
        cfg = self.config or load_config()
        return replace(cfg, backend=self.backend) if self.backend else cfg


def _new_recorder(transport: Transport, config: Config, group_name: str, global_ranks: Sequence[int], rank: int,
                  timeout_s: float) -> Any:
    """This group's flight recorder (:mod:`vcga.pg.recorder`), or None where its size is 0
    (``VCGA_FR_BUFFER_SIZE``, else ``TORCH_FR_BUFFER_SIZE``).

    Entries are named after the library this rank's calls run on (torch's analyzer knows nccl, hccl,
    gloo, ...): a vendor's own, the one a simulated vendor stands for."""
    from vcga.pg import recorder

    recorder.configure(config.trace_dir, _dump_on_signal)  # an on-demand dump goes there even with no recorder
    recorder.on_failure = _dump_on_failure
    entries = recorder.buffer_size()
    if entries <= 0:
        return None
    backend = getattr(transport, "backend", None)
    library = (getattr(backend, "stands_for", None) or getattr(backend, "dist_backend", None)
               or transport.backend_name)
    facts = {"backend": getattr(backend, "name", transport.backend_name), "vendor": getattr(backend, "vendor", ""),
             "transport": transport.backend_name, "library": library}
    return recorder.FlightRecorder(entries, group_name, "undefined", global_ranks, rank, str(library), facts, timeout_s)


def _dump_on_failure(call: Any, error: BaseException) -> None:
    """A recorded collective failed: a timeout dumps every group's recorder, and so does the first
    other collective failure of a group (a peer's process gone, a connection reset: the peers that
    do not time out leave a dump too). Argument errors and refusals do not."""
    from vcga.errors import VcgaCollectiveError, VcgaPeerLostError

    first = not call.recorder.failed
    timeout = isinstance(error, VcgaTimeoutError) and not isinstance(error, VcgaPeerLostError)
    if not timeout and not (isinstance(error, VcgaCollectiveError) and first):
        return
    call.recorder.failed = True
    from vcga.pg.frdump import dump_on_failure

    dump_on_failure(error)


def _dump_on_signal(signum: int, frame: Any) -> None:
    from vcga.pg import frdump, recorder

    frdump.dump_quietly(f"signal {recorder.DUMP_SIGNAL}")


def register() -> None:
    """Register ``vcga`` with ``torch.distributed.Backend`` (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=DEVICES)


# ===================================================================================================
# Creation
# ===================================================================================================


def _effective_timeout(given: timedelta | None, config: Config) -> timedelta:
    """One timeout governs every collective: an explicit ``init_process_group(timeout=...)`` /
    ``new_group(timeout=...)`` wins; otherwise the config's ``collective_timeout_s`` (default,
    file, ``VCGA_TIMEOUT`` or :class:`VcgaOptions`). torch passes its 30-minute default when the
    caller gave none, which therefore counts as "not given"."""
    if given is not None and given != c10d.default_pg_timeout and given > timedelta(0):
        return given
    return timedelta(seconds=config.collective_timeout_s)


def _attempt_store(store: Any) -> Any:
    """The group's store, with a key space of its own per torchrun attempt.

    torchrun's agent keeps one TCP store for the whole job, across restarts: the keys an earlier
    attempt wrote -- the dead workers' addresses among them -- are still there, and a rank of the
    new attempt reading a peer's key before that peer rewrote it would connect to a dead address.
    ``TORCHELASTIC_RESTART_COUNT`` is the same on every worker of an attempt and new each restart."""
    import os

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return store if attempt is None else dist.PrefixStore(f"vcga/attempt-{attempt}", store)


@contextmanager
def _collection_deferred() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a group is created (restored after).

    A process that has imported torch holds some 170,000 objects, and the first few thousand
    allocations after the import -- creating a group makes that many -- trigger a full collection
    that scans all of them: tens of milliseconds of one rank's CPU (``gc_s`` in the JSON of
    benchmarks/startup.py), while every other rank waits for that rank. Nothing is skipped: the
    collection runs at the next allocation after creation, outside the ranks' rendezvous.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def create_process_group(dist_opts: Any, pg_options: Any = None) -> VcgaProcessGroup:
    """The creator torch calls for ``backend="vcga"`` (``extended_api=True``).

    :param dist_opts: torch's ``_DistributedBackendOptions`` (store, group rank/size, timeout,
        group name, global ranks).
    :param pg_options: a :class:`VcgaOptions`, or None.
    """
    store, rank, size = _attempt_store(dist_opts.store), dist_opts.group_rank, dist_opts.group_size
    global_ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
    group_name = str(dist_opts.group_id)
    if isinstance(pg_options, VcgaOptions):
        config = pg_options.resolve()
    elif pg_options is None:
        config = load_config()
    else:
        raise TypeError(f"pg_options for backend 'vcga' must be vcga.process_group.VcgaOptions, "
                        f"not {type(pg_options).__name__}")
    timeout = _effective_timeout(dist_opts.timeout, config)
    clock = StartupClock()
    # The simulated vendor layout (and any per-rank choice) is by global rank in the whole job.
    world = dist.get_world_size() if dist.is_initialized() else size
    with _collection_deferred():
        with clock.phase("backend selection"):
            from vcga.plugin_manager import get_plugin_manager

            backend = get_plugin_manager().select_backend(config, rank=global_ranks[rank], world_size=world)
        transport = make_transport(store, rank, size, backend, timeout, config, global_ranks, clock)
    return VcgaProcessGroup(store, rank, size, transport=transport, config=config, timeout=timeout,
                            group_name=group_name, global_ranks=global_ranks)


# ===================================================================================================
# The process group
# ===================================================================================================


class VcgaProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` that dispatches every collective through a transport.

    Created by :func:`create_process_group`; use it through ``torch.distributed`` as any group.
    """

    def __init__(self, store: Any, rank: int, size: int, *, transport: Transport, config: Config,
                 timeout: timedelta, group_name: str = "", global_ranks: Sequence[int] = ()) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub omits the (rank, size) form
        self._rank, self._size = rank, size
        self._group_name, self._group_desc = group_name, "undefined"
        self.transport = transport
        self.config = config
        self.timeout = timeout
        self._backend = transport.backend_name
        self._store = store
        self._global_ranks = list(global_ranks) or list(range(size))
        debug = None
        if config.debug:  # VCGA_DEBUG only: a job's start does not import the fingerprints' module
            from vcga.pg.debug import FingerprintCheck

            debug = FingerprintCheck(dist.PrefixStore("vcga/debug", store), rank, size, timeout)
        #: what this group's last collectives were (None: TORCH_FR_BUFFER_SIZE=0)
        self.flight_recorder = _new_recorder(transport, config, group_name, self._global_ranks, rank,
                                             timeout.total_seconds())
        #: how every call reaches the library (numbering, hot path, dispatch, typed failures)
        self._calls = CallPath(rank, size, transport.group, Dispatcher(transport, rank, size), self._backend,
                               timeout.total_seconds(), debug, self.flight_recorder)
        self._collectives: Collectives | None = None  # made at the first call besides all_reduce
        self._p2p: PointToPoint | None = None  # made at the first point-to-point call
        self._monitored: MonitoredBarrier | None = None  # made at the first monitored barrier
        if log.isEnabledFor(logging.DEBUG):
            log.debug("vcga group %s rank %d/%d on %s", group_name, rank, size, transport.describe())
        _OPEN.add(self)  # shut down at exit if the script does not (see _shutdown_at_exit)

    # -- identity --------------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    # torch keeps a C++ group's name on its backends; a Python group has none, so keep it here
    # (DeviceMesh, FSDP2 and functional collectives look groups up by name).
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name
        if self.flight_recorder is not None:
            self.flight_recorder.group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc
        if self.flight_recorder is not None:
            self.flight_recorder.group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"VcgaProcessGroup(rank={self._rank}, size={self._size}, transport={self._backend})"

    @property
    def capabilities(self) -> Any:
        """The capability table dispatch consults (the transport's)."""
        return self.transport.table

    def shutdown(self) -> None:
        """``destroy_process_group`` calls this: the native groups stop their threads before it
        returns (see :meth:`vcga.pg.transport.NativeTransport.close`); calls made later raise
        :class:`~vcga.errors.VcgaCollectiveError`."""
        _OPEN.discard(self)
        self.transport.close()
        # The transport dropped its reference; these are the others (the hot path's and the
        # dispatcher's), so the native group's destructor runs now, not at interpreter exit.
        self._calls.use_native(self.transport.group)

    def abort(self) -> None:
        """``torch.distributed.distributed_c10d._abort_process_group`` (torchft, elastic recovery)
        calls this. As torch's own backends do, it returns at once: the native groups are aborted
        (what is in flight fails where the library can abort; gloo cannot) and released in a
        background thread, never joined here (see :meth:`vcga.pg.transport.NativeTransport.abort`);
        calls made later raise :class:`~vcga.errors.VcgaCollectiveError`. Every group's flight
        recorder is dumped first (:mod:`vcga.flight_recorder`)."""
        _OPEN.discard(self)
        if self.flight_recorder is not None:
            from vcga.pg.frdump import dump_quietly

            dump_quietly(f"group {self._group_name or '?'} aborted")
        # Drop the hot path's and the dispatcher's references first: the transport hands its own
        # to the releasing thread, and the last one must go there, not here.
        self._calls.use_native(ClosedGroup(self._backend, "aborted"))
        self.transport.abort()
        self._calls.use_native(self.transport.group)

    # ===========================================================================================
    # Collectives (torch's c10d signatures; vcga.pg.allreduce and vcga.pg.collectives implement them)
    # ===========================================================================================

    def _others(self) -> Collectives:
        """The collectives besides all_reduce (:mod:`vcga.pg.collectives`), made at the first call
        of one: a job's start, whose first calls are all-reduces, does not load them."""
        if self._collectives is None:
            from vcga.pg.collectives import Collectives

            self._collectives = Collectives(self._calls)
        return self._collectives
    # c10d calls them as (tensors, opts); torch's type stub also declares the other forms of its
    # Python helpers as overloads, so these overrides name [override] (the aliases [assignment]).

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return all_reduce(self._calls, tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._others().allreduce_coalesced(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self._others().reduce(tensors, opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> Any:
        return self._others().reduce_scatter(output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self._others().reduce_scatter_tensor(output, input, opts)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self._others().reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self._others().broadcast(tensors, opts)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Any:
        return self._others().allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self._others().allgather_into_tensor(output, input, opts)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> Any:
        return self._others().allgather_coalesced(output_lists, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self._others().allgather_into_tensor_coalesced(outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> Any:
        return self._others().gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> Any:
        return self._others().scatter(output_tensors, input_tensors, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        return self._others().alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._others().alltoall(output_tensors, input_tensors, opts)

    @contextmanager
    def native_replaced(self, group: Any) -> Iterator[None]:
        """Route every call through ``group`` (wrapping the native group: the wire meter of
        :mod:`vcga.compress.meter` counts bytes this way) while inside; the native group after."""
        saved = self._calls.native
        self._calls.use_native(group)
        try:
            yield
        finally:
            self._calls.use_native(saved)

    # ===========================================================================================
    # Point to point
    # ===========================================================================================

    def _point_to_point(self) -> PointToPoint:
        """This group's point-to-point calls (:mod:`vcga.pg.p2p`), made at the first one."""
        if self._p2p is None:
            from vcga.pg.p2p import PointToPoint

            self._p2p = PointToPoint(self._calls, self._rank, self.timeout)
        return self._p2p

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Any:  # noqa: N803 - torch's names
        return self._point_to_point().send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Any:  # noqa: N803
        return self._point_to_point().recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        return self._point_to_point().recv_anysource(tensors, tag)

    # ===========================================================================================
    # Barriers and coalescing
    # ===========================================================================================

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else options("barrier")
        seq = self._calls.next("barrier")
        return self._calls.native_call("barrier", seq, self._calls.native.barrier, opts, async_op=opts.asyncOp,
                                       result=[], call=self._calls.record(seq, "barrier", ()))

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier through the store that names the ranks that did not arrive
        (:class:`vcga.pg.monitored.MonitoredBarrier`).

        Rank 0 waits for each other rank's arrival (within ``timeout``, default the collective
        timeout), then releases everyone with a verdict; a missing rank makes rank 0 raise
        :class:`~vcga.errors.VcgaTimeoutError` naming it (all missing ones with ``wait_all_ranks``),
        and the other ranks raise the same verdict.
        """
        if self._monitored is None:
            from vcga.pg.monitored import MonitoredBarrier

            self._monitored = MonitoredBarrier(self._store, self._rank, self._size, self._global_ranks, self.timeout,
                                               self._calls)
        self._monitored.run(timeout, wait_all_ranks)

    def start_coalescing(self, device: Any = None) -> None:
        """Collect the works issued until :meth:`end_coalescing` (torch's ``_coalescing_manager``)."""
        self._calls.coalescing = []

    def end_coalescing(self, device: Any = None) -> Any:
        works, self._calls.coalescing = self._calls.coalescing or [], None
        return PyWork(works, (), [], translate=partial(self._calls.translate, name="coalesced collectives", seq=None))
