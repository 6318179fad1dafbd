"""Creating a bridge: discovery of the vendors, each rank's native vendor group, the host bridge.

:func:`create_bridge_transport` is what :func:`vcga.pg.transport.make_transport` calls when the
ranks of a ``vcga`` group run different backends (steps 1, 3 and 4 of :mod:`vcga.bridge`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from vcga.bridge.cost import LinkFigures
from vcga.bridge.group import BridgeGroup
from vcga.bridge.host import SharedMemoryBridge, every_rank
from vcga.bridge.plan import Plan, combined_table, link_classes, make_plan, pipelines
from vcga.contract import Backend, CapabilityTable
from vcga.errors import VcgaBackendUnavailable, VcgaError, VcgaTimeoutError
from vcga.pg.discovery import Layout, table_from_wire, table_to_wire
from vcga.pg.dispatch import Dispatcher
from vcga.pg.transport import ClosedGroup, NativeTransport, StartupClock, Transport, abort_now, release_later, shut_down
from vcga.pg.workqueue import WorkQueue

__all__ = ["BridgeTransport", "create_bridge_transport"]

log = logging.getLogger("vcga.bridge")


class BridgeTransport(Transport):
    """A mixed-vendor group: native vendor groups plus the host bridge (see the module docstring)."""

    def __init__(self, plan: Plan, rank: int, backend: Backend, table: CapabilityTable, group: BridgeGroup,
                 closables: Sequence[Any], timeout: timedelta = timedelta(minutes=30)) -> None:
        self.plan, self.rank, self.backend = plan, rank, backend
        self.timeout = timeout
        self.table = table
        self.group = group
        self.backend_name = table.backend
        self.device_type = backend.device_type
        self._closables = list(closables)
        #: what discovery found (node names, for describe)
        self.layout: Layout | None = None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["vendor"] = self.backend.vendor
        d["local_backend"] = self.backend.name
        d["plan"] = self.plan.describe(tables=self.group.tables)
        if self.layout is not None:  # the plan knows nodes by index; their names are read now
            names = self.layout.node_names()
            for g in d["plan"]["groups"]:
                g["nodes"] = [names[n] if isinstance(n, int) and n < len(names) else n for n in g["nodes"]]
        d["calibration"] = self.group.reducer.calibration
        d["verification"] = self.group.reducer.verification
        d["shard_exchange"] = self.group.shard_exchange
        d["pipeline"] = self.group.pipelined
        return d

    def close(self) -> None:
        """Shut every group down and drop every reference to them: a native group stops its threads
        only in its destructor (see :meth:`vcga.pg.transport.NativeTransport.close`)."""
        if isinstance(self.group, BridgeGroup) and self.group.queue is not None:
            self.group.queue.close()  # fails what is still queued; the thread ends
        for pg in self._closables:
            shut_down(pg)
        self._closables = []
        group, self.group = self.group, ClosedGroup(self.backend_name)
        _drop_groups(group)

    def abort(self) -> None:
        """Abort every group and return at once; they are shut down and released in the background
        (see :meth:`vcga.pg.transport.NativeTransport.abort`)."""
        queue = self.group.queue if isinstance(self.group, BridgeGroup) else None
        if queue is not None:
            queue.close(wait_s=0)  # fails what is still queued; never waits for its thread here
        closables, self._closables = self._closables, []
        box, self.group = [self.group], ClosedGroup(self.backend_name, "aborted")
        for i in range(len(closables)):  # no loop variable left holding a group (see release_later)
            abort_now(closables[i])
        wait_s = self.timeout.total_seconds() + WorkQueue.MARGIN_S

        def teardown() -> None:
            # in the releasing thread: the collective the queue's thread is in ends (or fails) on its
            # own before the groups it runs on go
            if queue is not None:
                queue.close(wait_s=wait_s)
            _drop_groups(box.pop())

        release_later(closables, teardown)


def _drop_groups(group: Any) -> None:
    """Drop a closed bridge's references to its native groups (their destructors join their threads)."""
    if isinstance(group, BridgeGroup):
        group.comms.drop()


def _wait(store: Any, keys: list[str], timeout: timedelta, what: str, rank: int, owners: Sequence[int]) -> None:
    try:
        store.wait(keys, timeout)
    except Exception as e:  # DistStoreError on timeout
        missing = [owners[i] for i, k in enumerate(keys) if not store.check([k])]
        raise VcgaTimeoutError("process group creation", timeout.total_seconds(), rank=rank, missing_ranks=missing,
                               detail=f"mixed-vendor bridge: {what}") from e


def create_bridge_transport(store: Any, rank: int, size: int, backend: Backend, peers: Sequence[dict[str, Any]],
                            timeout: timedelta, algorithm: str = "auto",
                            apply_env: Callable[[Backend], None] | None = None,
                            shared_memory: bool = True, async_ops: bool = True, clock: StartupClock | None = None,
                            layout: Layout | None = None, calibration: str = "cached",
                            figures_cache: str | None = None, pipeline: str = "auto",
                            verify: bool = True) -> BridgeTransport:
    """Build the mixed-vendor transport (called by :func:`vcga.pg.transport.make_transport`).

    :param store: the group's store; :param rank: / :param size: this rank and the group size.
    :param backend: this rank's backend; :param peers: every rank's published facts, in rank order.
    :param timeout: the collective timeout (also bounds every wait here).
    :param algorithm: config ``bridge_algorithm``.
    :param apply_env: sets the vendor's environment before its native group is created.
    :param shared_memory: config ``bridge_shm``: shard peers on one node may reduce through shared
        memory (:class:`~vcga.bridge.host.SharedMemoryBridge`) instead of gloo.
    :param async_ops: config ``bridge_async``: collectives run on the group's communication thread
        (:class:`~vcga.pg.workqueue.WorkQueue`) and return at once; False: in the calling thread.
    :param clock: where the phases of creation are timed (``describe()["startup"]``).
    :param layout: what discovery found (:func:`vcga.pg.discovery.discover`; ``peers`` is its
        :meth:`~vcga.pg.discovery.Layout.peers`): the capability-table digests of the backends.
    :param calibration: / :param figures_cache: config ``bridge_calibration`` and
        ``bridge_figures_cache``: where the α–β link figures come from (:func:`_calibrate`).
    :param pipeline: config ``bridge_pipeline`` (:func:`pipelines`).
    :param verify: config ``bridge_verify``: "auto" checks its choice against the observed times of
        the all_reduces it runs (:mod:`vcga.bridge.verify`).
    :raises VcgaBackendUnavailable: on every rank, naming each rank whose native group failed.
    :raises VcgaTimeoutError: naming the ranks that never arrived.
    """
    clock = clock or StartupClock()
    t_disc, c_disc = time.perf_counter(), time.process_time()
    plan = make_plan(peers, algorithm)
    gr = [int(p.get("global_rank", r)) for r, p in enumerate(peers)]
    me = plan.group_of(rank)
    local = me.ranks.index(rank)
    bstore = dist.PrefixStore("vcga/bridge", store)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("vcga bridge plan (rank %d): %s", gr[rank], json.dumps(plan.describe()))

    # 1. Capability tables: the first rank of each backend publishes its table under its digest
    #    (discovery checked that the digests agree); rank 0 publishes where the link figures come
    #    from. Both are read after the native groups (below): by then every rank has published.
    _publish_table(bstore, layout, rank, backend)
    calibrate = plan.equal_groups and plan.algorithm in ("auto", "bandwidth") and calibration != "off"
    topo = directory = None
    if calibrate and rank == 0:
        directory, topo = _publish_figures(bstore, layout, plan, peers, calibration, figures_cache, shared_memory)
    clock.add("discovery", time.perf_counter() - t_disc, time.process_time() - c_disc)

    # 2. This rank's native vendor group (two where all_reduces are pipelined: one per stage); any
    #    failure stops every rank with one error.
    piped = pipelines(plan, peers, pipeline, async_ops, shared_memory)
    if apply_env is not None:
        apply_env(backend)
    with clock.phase("native groups"):
        native, native2 = _create_native(bstore, store, plan, rank, backend, timeout, gr, second=piped)

    # 3. The host bridge: shard peers (leaders for local rank 0) and the whole group, on gloo. Both
    #    connect lazily (see _lazy_gloo): creating them is a constant number of store requests per
    #    rank and waits for nobody; the first collective that uses a pair of ranks connects it.
    try:
        shard, shm, shard2 = None, None, None
        with clock.phase("bridge sub-groups"):
            if local == 0 or plan.equal_groups:
                peers_i = plan.shard_peers(local)
                if len(peers_i) > 1:
                    shard = _lazy_gloo(dist.PrefixStore(f"vcga/bridge/shard/{local}", store), peers_i.index(rank),
                                       len(peers_i), timeout)
                    if piped:  # the exchanges of what runs on lane 1 (see BridgeGroup.set_lane_b)
                        shard2 = _lazy_gloo(dist.PrefixStore(f"vcga/bridge/shard2/{local}", store),
                                            peers_i.index(rank), len(peers_i), timeout)
                    same_node = all(peers[r].get("node") == peers[rank].get("node") for r in peers_i)
                    shm = SharedMemoryBridge.open(shard, shared_memory and same_node, timeout.total_seconds(),
                                                  names=[f"rank {gr[r]}" for r in peers_i])
        with clock.phase("whole-group gloo"):
            world = _lazy_gloo(dist.PrefixStore("vcga/bridge/world", store), rank, size, timeout)
    except VcgaError:
        raise
    except Exception as e:
        raise VcgaBackendUnavailable("vcga", f"rank {gr[rank]}: creating the mixed-vendor host bridge (gloo) failed: "
                                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    with clock.phase("discovery"):
        tables, decided = _read_published(bstore, layout, plan, backend, calibrate)
        name = "bridge(" + ",".join(f"{g.backend}:{g.size}" for g in plan.groups) + ")"
        table = combined_table(name, tables)  # its cells are worked out as they are asked for
    inner = Dispatcher(NativeTransport(backend, native), local, me.size) if me.size > 1 else None
    group = BridgeGroup(plan, rank, inner, shard, world, tables, shm)
    if piped and native2 is not None:
        group.set_lane_b(Dispatcher(NativeTransport(backend, native2), local, me.size), shard2)
    group.reducer.link_classes = link_classes(plan, peers)
    group.reducer.verify = verify
    log.debug("vcga bridge (rank %d): shard peers reduce through %s", gr[rank], group.shard_exchange)
    if calibrate:
        with clock.phase("calibration"):
            _calibrate(group, decided, backend, directory, topo)
    if async_ops:
        group.queue = WorkQueue(f"{name} rank {gr[rank]}", timeout, stage2_init=group.enter_lane_b)
    closables = [native, *([native2] if native2 is not None else []), *([shm] if shm is not None else []),
                 *([shard] if shard is not None else []), *([shard2] if shard2 is not None else []), world]
    transport = BridgeTransport(plan, rank, backend, table, group, closables, timeout)
    transport.startup = clock
    transport.layout = layout
    return transport


_LAZY_LOCK = threading.Lock()


def _lazy_gloo(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A gloo group whose pairs connect on first use (torch's ``TORCH_GLOO_LAZY_INIT``, read when
    the group is made: set for this group only, and put back). Creating it publishes this rank's
    address and returns at once; a pair of ranks connects, through the store, the first time a
    collective or a send/recv needs it -- so a group that never runs a collective between vendors
    costs nothing more, and the order in which ranks create such groups cannot deadlock them.
    On a torch without lazy init the group connects eagerly."""
    with _LAZY_LOCK:
        was = os.environ.get("TORCH_GLOO_LAZY_INIT")
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        try:
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        finally:
            if was is None:
                del os.environ["TORCH_GLOO_LAZY_INIT"]
            else:
                os.environ["TORCH_GLOO_LAZY_INIT"] = was


def _publish_figures(bstore: Any, layout: Layout | None, plan: Plan, peers: Sequence[dict[str, Any]], mode: str,
                     cache: str | None, shared_memory: bool) -> tuple[Any, Any]:
    """Rank 0: decide where the group's α–β figures come from and publish it under ``figures``
    (read by every rank with the capability tables, :func:`_read_published`): the figures its
    cache holds for this topology (mode "cached", :mod:`vcga.bridge.figcache`), or "measure".
    Done right after discovery, so no rank waits for it later. Returns the cache directory and the
    topology (where a measurement is stored)."""
    from vcga.bridge import figcache

    directory = figcache.cache_dir(cache)
    topo = figcache.topology(layout, plan, link_classes(plan, peers), "shm" if shared_memory else "gloo")
    fig = figcache.load(directory, topo) if mode == "cached" else None
    bstore.set("figures", json.dumps({"figures": fig.to_json()} if fig is not None else {"measure": True}))
    return directory, topo


def _calibrate(group: BridgeGroup, decided: dict[str, Any], backend: Backend, directory: Any, topo: Any) -> None:
    """Give the group its α–β figures, the same on every rank (collective over the group).

    Rank 0 decided (:func:`_publish_figures`) and every rank does what it decided (``decided``:
    what rank 0 published). Figures found: every rank applies rank 0's (its own cache is never
    read, so ranks with other caches still agree). Otherwise the group measures
    (:meth:`~vcga.bridge.allreduce.AllReducer.measure_links`, over the whole group) and rank 0 stores
    the result. Without a cache hit, a rank that cannot name its device makes every rank skip the
    measurement: "auto" then keeps the plan's rule."""
    rank = group.rank
    if rank == 0 and directory is not None and topo is not None:
        group.reducer.cache_entry = (directory, topo)  # where corrected figures go (rank 0 writes them)
    if "figures" in decided:
        group.reducer.apply_figures(LinkFigures.from_json(decided["figures"]))
        assert group.reducer.calibration is not None
        group.reducer.calibration["source"] = "cache"
        return
    try:
        device = backend.accelerator().device()
    except Exception as e:  # noqa: BLE001 - an accelerator that cannot name its device: measure nothing
        log.warning("vcga bridge: rank %d cannot name its %s device (%s); the creation-time measurement "
                    "is skipped on every rank", (group.plan.global_ranks or range(rank + 1))[rank], backend.name, e)
        device = None
    # The measurement is collective: run it only if every rank can (else ranks that can would
    # wait in it for ranks that skipped it, until the timeout). auto then keeps the plan's rule.
    if every_rank(group.world, device is not None) and device is not None:  # every rank calls every_rank
        fig = group.reducer.measure_links(device)
        assert group.reducer.calibration is not None
        group.reducer.calibration["source"] = "measured"
        if rank == 0 and directory is not None and topo is not None:
            from vcga.bridge import figcache  # only where figures were measured: a cache hit needs none of it

            path = figcache.store(directory, topo, fig)
            log.debug("vcga bridge: link figures stored in %s", path)


#: Capability tables by digest: a table is a pure function of its digest, so a process that
#: creates several groups reads each once.
_TABLES: dict[str, CapabilityTable] = {}


def _publish_table(bstore: Any, layout: Layout | None, rank: int, backend: Backend) -> None:
    """The lowest rank of each backend publishes its capability table under ``table/<digest>``
    (:func:`vcga.pg.discovery.table_to_wire`, compressed: about 3 KB; the same bytes its digest is of)."""
    if layout is None:
        raise TypeError("create_bridge_transport needs the layout discovery found (vcga.pg.discovery.discover)")
    i = next(i for i, f in enumerate(layout.backends) if f.name == backend.name)
    if rank == layout.first_rank_of(i):
        bstore.set(f"table/{layout.backends[i].digest}", zlib.compress(table_to_wire(backend.capabilities()), 1))


def _read_published(bstore: Any, layout: Layout | None, plan: Plan, backend: Backend, figures: bool,
                    ) -> tuple[list[CapabilityTable], dict[str, Any]]:
    """Every vendor group's capability table, in plan order, and (``figures``)
    what rank 0 decided about the link figures: one ``multi_get`` of what this rank has not read
    before in this process (a table is a pure function of its digest).

    Called after the native groups' outcome is agreed: every rank published what it publishes
    (:func:`_publish_table`, :func:`_publish_figures`) before it counted itself there, so every
    key is in the store and nothing here waits."""
    assert layout is not None
    digests = {f.name: f.digest for f in layout.backends}
    wanted = [digests[g.backend] for g in plan.groups
              if g.backend != backend.name and digests[g.backend] not in _TABLES]
    wanted = list(dict.fromkeys(wanted))
    keys = [f"table/{d}" for d in wanted] + (["figures"] if figures else [])
    values = bstore.multi_get(keys) if keys else []
    for d, v in zip(wanted, values, strict=False):  # values ends with the figures when they were asked for
        name = next(f.name for f in layout.backends if f.digest == d)
        _TABLES[d] = table_from_wire(name, zlib.decompress(v))
    decided = json.loads(values[-1]) if figures else {}
    tables = [backend.capabilities() if g.backend == backend.name else _TABLES[digests[g.backend]] for g in plan.groups]
    return tables, decided


#: A native group not created within this many seconds makes the rank start watching for
#: another rank's failure (over a connection of its own); most are created sooner, and need none.
_WATCH_AFTER_S = 0.5
#: How often a watching rank looks for another rank's failure: from the first to the last
#: interval, doubling (a failure is seen within about a second; the store sees a few requests
#: per rank, not one per 50 ms of a long creation).
_WATCH_POLL_S = (0.05, 1.0)


def _create_native(bstore: Any, store: Any, plan: Plan, rank: int, backend: Backend, timeout: timedelta,
                   gr: Sequence[int], second: bool = False) -> tuple[Any, Any]:
    """Create this rank's native vendor group (and, ``second``, another one over the same ranks:
    the pipeline's lane 1); report ok / failed / aborted; fail together. Returns both (None for a
    second one not asked for).

    The native creation runs in a helper thread, because a vendor library blocks while it waits
    for peers. When it takes longer than :data:`_WATCH_AFTER_S`, a watcher opens a connection of
    its own (a store client is one connection, and the library may be waiting on ours) and looks
    for another rank's failure flag, so a rank whose peer's plugin failed stops waiting within a
    second instead of after the library's own timeout.

    Then the ranks agree on the outcome with a constant number of requests each: a failing rank
    records its reason (``failed/<rank>``, ``failed_ranks``) before it counts itself in
    ``finished``; the rank that completes the count sets ``finished_all``; if anything failed,
    every rank raises the same error naming the failing ranks and their reasons.
    """
    me = plan.group_of(rank)
    result: dict[str, Any] = {}
    done = threading.Event()
    aborted = threading.Event()
    watcher: dict[str, Any] = {}

    def create() -> None:
        try:
            result["pg"] = backend.create_process_group(
                dist.PrefixStore(f"vcga/bridge/native/{me.index}", store), me.ranks.index(rank), me.size, timeout)
            if second:
                result["pg2"] = backend.create_process_group(
                    dist.PrefixStore(f"vcga/bridge/native2/{me.index}", store), me.ranks.index(rank), me.size, timeout)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            result["error"] = e
            _shutdown(result.pop("pg", None))  # the second one failed: the first is not used either
        finally:
            done.set()

    def watch() -> None:
        try:
            own = dist.PrefixStore("vcga/bridge", store.clone())
        except Exception:  # noqa: BLE001 - a store without clone(): failures are then seen at the library's timeout
            return
        watcher["store"] = own
        pause = _WATCH_POLL_S[0]
        while not done.is_set():
            if own.check(["failed"]):
                aborted.set()
                return
            done.wait(pause)
            pause = min(pause * 2, _WATCH_POLL_S[1])

    threading.Thread(target=create, name="vcga-native-group", daemon=True).start()
    deadline = time.monotonic() + timeout.total_seconds()
    if not done.wait(_WATCH_AFTER_S):
        threading.Thread(target=watch, name="vcga-native-watch", daemon=True).start()
    while not done.is_set() and not aborted.is_set() and time.monotonic() < deadline:
        done.wait(0.02)
    status: dict[str, Any]
    if done.is_set():
        if "error" in result:
            e = result["error"]
            status = {"state": "failed", "backend": backend.name,
                      "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        else:
            status = {"state": "ok"}
    elif aborted.is_set():
        status = {"state": "aborted"}
    else:
        status = {"state": "failed", "backend": backend.name,
                  "reason": f"creating the native group did not finish within {timeout.total_seconds():g} s"}
    # Our own connection may still be busy inside the library (aborted, timed out): report through
    # the watcher's then.
    st = bstore if done.is_set() else watcher.get("store", bstore)
    if status["state"] == "failed":
        st.set(f"failed/{rank}", json.dumps(status))
        st.append("failed_ranks", f"{rank},")
        st.set("failed", "1")
    st.set(f"done/{rank}", "1")
    if st.add("finished", 1) == plan.size:
        st.set("finished_all", "1")
    try:
        st.wait(["finished_all"], timeout)
    except Exception as e:  # DistStoreError on timeout
        missing = [gr[r] for r in range(plan.size) if not st.check([f"done/{r}"])]
        raise VcgaTimeoutError("process group creation", timeout.total_seconds(), rank=gr[rank], missing_ranks=missing,
                               detail="mixed-vendor bridge: ranks never reported their native vendor group") from e
    if st.check(["failed"]):
        ranks = sorted({int(x) for x in st.get("failed_ranks").decode().split(",") if x})
        statuses = [json.loads(v) for v in st.multi_get([f"failed/{r}" for r in ranks])]
        if status["state"] == "ok":
            _shutdown(result.get("pg"))
            _shutdown(result.get("pg2"))
        who = "; ".join(f"rank {gr[r]} ({s['backend']}): {s['reason']}" for r, s in zip(ranks, statuses, strict=True))
        err = VcgaBackendUnavailable(
            "vcga", f"mixed-vendor group: the native process group could not be created on {who}. Fix or exclude "
                    "those ranks (see `vcga info` on their nodes), or give them another backend (VCGA_BACKEND)")
        own = result.get("error")
        raise err from own if isinstance(own, BaseException) else None
    return result["pg"], result.get("pg2")


def _shutdown(pg: Any) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # noqa: BLE001
            pass
