"""Creating a bridge: discovery of the vendors, each rank's native vendor group, the host bridge.

:func:`create_bridge_transport` is what :func:`vcga.transport.make_transport` calls when the
ranks of a ``vcga`` group run different backends (steps 1, 3 and 4 of :mod:`vcga.bridge`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from vcga.bridge.group import BridgeGroup
from vcga.bridge.plan import Plan, combined_table, link_classes, make_plan, table_digest, table_from_json
from vcga.contract import Backend, CapabilityTable
from vcga.dispatch import Dispatcher
from vcga.errors import VcgaBackendUnavailable, VcgaConfigError, VcgaError, VcgaTimeoutError
from vcga.hostbridge import SharedMemoryBridge, every_rank
from vcga.transport import ClosedGroup, NativeTransport, Transport, abort_now, release_later, shut_down
from vcga.workqueue import WorkQueue

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

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["vendor"] = self.backend.vendor
        d["local_backend"] = self.backend.name
        d["plan"] = self.plan.describe(tables=self.group.tables)
        d["calibration"] = self.group.calibration
        d["shard_exchange"] = self.group.shard_exchange
        return d

    def close(self) -> None:
        """Shut every group down and drop every reference to them: a native group stops its threads
        only in its destructor (see :meth:`vcga.transport.NativeTransport.close`)."""
        if isinstance(self.group, BridgeGroup) and self.group.queue is not None:
            self.group.queue.close()  # fails what is still queued; the thread ends
        for pg in self._closables:
            shut_down(pg)
        self._closables = []
        group, self.group = self.group, ClosedGroup(self.backend_name)
        _drop_groups(group)

    def abort(self) -> None:
        """Abort every group and return at once; they are shut down and released in the background
        (see :meth:`vcga.transport.NativeTransport.abort`)."""
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
        group.inner = group.shard = group.world = group.shm = None


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
                            shared_memory: bool = True, async_ops: bool = True) -> BridgeTransport:
    """Build the mixed-vendor transport (called by :func:`vcga.transport.make_transport`).

    :param store: the group's store; :param rank: / :param size: this rank and the group size.
    :param backend: this rank's backend; :param peers: every rank's published facts, in rank order.
    :param timeout: the collective timeout (also bounds every wait here).
    :param algorithm: config ``bridge_algorithm``.
    :param apply_env: sets the vendor's environment before its native group is created.
    :param shared_memory: config ``bridge_shm``: shard peers on one node may reduce through shared
        memory (:class:`~vcga.hostbridge.SharedMemoryBridge`) instead of gloo.
    :param async_ops: config ``bridge_async``: collectives run on the group's communication thread
        (:class:`~vcga.workqueue.WorkQueue`) and return at once; False: in the calling thread.
    :raises VcgaBackendUnavailable: on every rank, naming each rank whose native group failed.
    :raises VcgaTimeoutError: naming the ranks that never arrived.
    """
    plan = make_plan(peers, algorithm)
    gr = [int(p.get("global_rank", r)) for r, p in enumerate(peers)]
    me = plan.group_of(rank)
    local = me.ranks.index(rank)
    bstore = dist.PrefixStore("vcga/bridge", store)
    log.debug("vcga bridge plan (rank %d): %s", gr[rank], json.dumps(plan.describe()))

    # 1. Capability tables: each leader publishes its backend's; everyone checks its own digest.
    mine = backend.capabilities()
    if rank == me.leader:
        bstore.set(f"table/{me.index}", json.dumps(mine.to_json()))
    keys = [f"table/{g.index}" for g in plan.groups]
    _wait(bstore, keys, timeout, "vendor-group leaders never published their capability tables", gr[rank],
          [gr[g.leader] for g in plan.groups])
    tables = [table_from_json(g.backend, json.loads(v)) for g, v in zip(plan.groups, bstore.multi_get(keys))]
    if table_digest(mine) != table_digest(tables[me.index]):
        raise VcgaConfigError("backend", backend.name,
                              f"the same capability table on every rank of backend {backend.name!r}; rank {gr[rank]}'s "
                              f"differs from rank {gr[me.leader]}'s (different plugin versions?). Install the same vcga "
                              "and plugin versions on every node")
    name = "bridge(" + ",".join(f"{g.backend}:{g.size}" for g in plan.groups) + ")"
    table = combined_table(name, tables)

    # 2. This rank's native vendor group; any failure stops every rank with one error.
    if apply_env is not None:
        apply_env(backend)
    native = _create_native(bstore, store, plan, rank, backend, timeout, gr)

    # 3. The host bridge: shard peers (leaders for local rank 0) and the whole group, on gloo.
    try:
        shard, shm = None, None
        if local == 0 or plan.equal_groups:
            peers_i = plan.shard_peers(local)
            if len(peers_i) > 1:
                shard = dist.ProcessGroupGloo(dist.PrefixStore(f"vcga/bridge/shard/{local}", store),
                                              peers_i.index(rank), len(peers_i), timeout)
                same_node = all(peers[r].get("node") == peers[rank].get("node") for r in peers_i)
                shm = SharedMemoryBridge.open(shard, shared_memory and same_node, timeout.total_seconds(),
                                              names=[f"rank {gr[r]}" for r in peers_i])
        world = dist.ProcessGroupGloo(dist.PrefixStore("vcga/bridge/world", store), rank, size, timeout)
    except VcgaError:
        raise
    except Exception as e:
        raise VcgaBackendUnavailable("vcga", f"rank {gr[rank]}: creating the mixed-vendor host bridge (gloo) failed: "
                                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    inner = Dispatcher(NativeTransport(backend, native), local, me.size) if me.size > 1 else None
    group = BridgeGroup(plan, rank, inner, shard, world, tables, shm)
    group.link_classes = link_classes(plan, peers)
    log.debug("vcga bridge (rank %d): shard peers reduce through %s", gr[rank], group.shard_exchange)
    if plan.equal_groups and plan.algorithm in ("auto", "bandwidth"):
        try:
            device = backend.accelerator().device()
        except Exception as e:  # noqa: BLE001 - an accelerator that cannot name its device: measure nothing
            log.warning("vcga bridge: rank %d cannot name its %s device (%s); the creation-time measurement "
                        "is skipped on every rank", gr[rank], backend.name, e)
            device = None
        # The measurement is collective: run it only if every rank can (else ranks that can would
        # wait in it for ranks that skipped it, until the timeout). auto then keeps the plan's rule.
        if every_rank(world, device is not None):
            group.measure_links(device)
    if async_ops:
        group.queue = WorkQueue(f"{name} rank {gr[rank]}", timeout)
    closables = [native, *([shm] if shm is not None else []), *([shard] if shard is not None else []), world]
    return BridgeTransport(plan, rank, backend, table, group, closables, timeout)


#: How often a rank waiting for its native group looks for another rank's failure (seconds).
_ABORT_POLL_S = 0.05


def _create_native(bstore: Any, store: Any, plan: Plan, rank: int, backend: Backend, timeout: timedelta,
                   gr: Sequence[int]) -> Any:
    """Create this rank's native vendor group; publish ok / failed / aborted; fail together.

    The native creation runs in a helper thread, because a vendor library blocks while it waits
    for peers: if a peer's plugin failed, this rank sees the failure flag and stops waiting at once
    instead of after the library's own timeout. Every rank then reads every rank's status and, if
    any failed, raises the same error naming the failing ranks and their reasons.
    """
    me = plan.group_of(rank)
    result: dict[str, Any] = {}
    # A store client is one connection: while the library waits on it for a peer that will never
    # come, every other call on it queues behind. Watch for failures over a connection of our own.
    try:
        watch = dist.PrefixStore("vcga/bridge", store.clone())
    except Exception:  # noqa: BLE001 - a store without clone(): failures are then seen at the library's timeout
        watch = bstore

    def create() -> None:
        try:
            result["pg"] = backend.create_process_group(
                dist.PrefixStore(f"vcga/bridge/native/{me.index}", store), me.ranks.index(rank), me.size, timeout)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            result["error"] = e

    th = threading.Thread(target=create, name="vcga-native-group", daemon=True)
    th.start()
    deadline = time.monotonic() + timeout.total_seconds()
    status: dict[str, Any]
    while True:
        th.join(_ABORT_POLL_S)
        if not th.is_alive():
            if "error" in result:
                e = result["error"]
                status = {"state": "failed", "backend": backend.name,
                          "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                watch.set("failed", "1")
            else:
                status = {"state": "ok"}
            break
        if watch.check(["failed"]):
            status = {"state": "aborted"}
            break
        if time.monotonic() > deadline:
            status = {"state": "failed", "backend": backend.name,
                      "reason": f"creating the native group did not finish within {timeout.total_seconds():g} s"}
            watch.set("failed", "1")
            break
    watch.set(f"status/{rank}", json.dumps(status))
    keys = [f"status/{r}" for r in range(plan.size)]
    _wait(watch, keys, timeout, "ranks never reported their native vendor group", gr[rank], list(gr))
    statuses = [json.loads(v) for v in watch.multi_get(keys)]
    failed = [(gr[r], s) for r, s in enumerate(statuses) if s["state"] == "failed"]
    if failed:
        if status["state"] == "ok":
            _shutdown(result.get("pg"))
        who = "; ".join(f"rank {g} ({s['backend']}): {s['reason']}" for g, s in failed)
        err = VcgaBackendUnavailable(
            "vcga", f"mixed-vendor group: the native process group could not be created on {who}. Fix or exclude "
                    "those ranks (see `vcga info` on their nodes), or give them another backend (VCGA_BACKEND)")
        own = result.get("error")
        raise err from own if isinstance(own, BaseException) else None
    return result["pg"]


def _shutdown(pg: Any) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # noqa: BLE001
            pass
