"""The mixed-vendor bridge: one ``vcga`` process group over ranks of several vendors.

When the ranks of a ``vcga`` group run different backends (NVIDIA next to Ascend next to MLU, or
their simulated stand-ins), :func:`vcga.process_group.make_transport` hands over to
:func:`create_bridge_transport`, which

1. **discovers** the vendors: every rank has published its backend, vendor, device type and node
   (``vcga/discovery/<rank>``); the first rank of each vendor group publishes its backend's
   capability table and every rank publishes a digest of its own, so all ranks hold the same facts;
2. **plans** (:func:`make_plan`): vendor groups (ranks of one backend), members ordered by node
   then rank, groups ordered by node then first rank, the first member of each group its leader,
   and the all_reduce algorithm per message size -- the same plan on every rank, because it is a
   pure function of the published facts;
3. **creates** each rank's native vendor group (its plugin's ``create_process_group`` over the
   prefixed store ``vcga/bridge/native/<group>``) and the host bridge: gloo groups among the shard
   peers (local rank i of every vendor group; peers of local rank 0 are the leaders) and one over
   the whole group for data movement and point-to-point; shard peers that share a node also share
   a memory segment for their reductions (:mod:`vcga.hostbridge`). A rank whose native group cannot be
   created makes every rank raise the same :class:`~vcga.errors.VcgaBackendUnavailable` naming it,
   within the timeout;
4. presents it all as a :class:`~vcga.transport.Transport` (:class:`BridgeTransport`): ``table``
   says what the hierarchical group does correctly (:func:`combined_table`), ``group`` is a
   :class:`BridgeGroup` with the c10d methods the dispatcher drives.

Inside a vendor group every step goes through that vendor's own :class:`~vcga.dispatch.Dispatcher`
(its capability table, its emulations: CNCL's fp64 is reduced on the host in fp64, not by CNCL as
fp32). Across vendor groups bytes travel through gloo on the host (or shared memory, for shard
peers on one node) and reductions are computed on the host in the tensor's dtype, in plan order; each cross-vendor result is computed from the same
bytes by the same operations in the same order on every peer and then copied, so every rank ends
with the same bits. Algorithms and error bounds: ``docs/bridge.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vcga import dtypes as _dtypes
from vcga.contract import Backend, CapabilityTable, Cell, Collective, ReduceOp, Support
from vcga.dispatch import Dispatcher, Steps
from vcga.errors import VcgaBackendUnavailable, VcgaConfigError, VcgaError, VcgaTimeoutError
from vcga.hostbridge import SharedMemoryBridge, combine_rows, combiner, every_rank
from vcga.pypg import PyWork, reduce_op_of
from vcga.transport import NativeTransport, Transport

__all__ = [
    "ALGORITHMS",
    "BANDWIDTH_MIN_BYTES",
    "BridgeGroup",
    "BridgeTransport",
    "Plan",
    "VendorGroup",
    "combined_table",
    "create_bridge_transport",
    "make_plan",
    "node_name",
    "plan_for_layout",
    "reduction_routes",
    "table_from_json",
]

log = logging.getLogger(__name__)

#: The all_reduce algorithms across vendors (config ``bridge_algorithm``; "auto" chooses).
ALGORITHMS = ("leader", "bandwidth", "replicated")
#: From this message size on, "auto" picks the measured large-message algorithm (bandwidth or
#: replicated) when every vendor group has the same size >= 2; below it, leader. Measured crossover
#: (benchmarks/hybrid.py, docs/benchmarks.md): at 256 KiB leader and replicated are level and the
#: bandwidth algorithm 1.7x flat; at 1 MiB bandwidth (p2p) is the best, 1.2x against leader's 1.6x.
BANDWIDTH_MIN_BYTES = 1 << 20

#: What "auto" picks at and above BANDWIDTH_MIN_BYTES on equal vendor groups when nothing was
#: measured (a group created with bridge_algorithm "leader" or "replicated" never uses it; every
#: other equal-group bridge replaces it by its measurement, :meth:`BridgeGroup.calibrate`).
AUTO_LARGE = "replicated"
#: How the plan (a pure function of the published facts) names auto's large-message choice, which
#: each running group measures at creation (:meth:`BridgeGroup.calibrate`).
AUTO_LARGE_MEASURED = "bandwidth|replicated (measured)"
#: The bandwidth algorithm pipelines a message in segments of at least this size (at most
#: PIPELINE_MAX_SEGMENTS of them): one segment crosses the bridge while the next is reduce-scattered
#: and the previous all-gathered inside the vendor group.
PIPELINE_SEGMENT_BYTES = 8 << 20
PIPELINE_MAX_SEGMENTS = 8
#: From this size on (two pipeline segments or more), "auto" runs "bandwidth" on equal vendor groups
#: whatever the 2 MiB measurement preferred: the measurement, one segment, cannot see the
#: pipelining, and in every run on this machine the pipelined bandwidth algorithm (p2p in-group
#: steps) beat replicated at 16 and 64 MiB (e.g. 1.07x and 0.92x flat against 1.35x and 1.06x, in
#: a run where the 2 MiB measurement preferred replicated; docs/benchmarks.md).
PIPELINED_MIN_BYTES = 2 * PIPELINE_SEGMENT_BYTES
#: Message size of the creation-time measurement (large enough to be bandwidth-bound).
CALIBRATION_BYTES = 2 << 20

#: Dtypes the host bridge reduces itself (torch CPU kernels for add/mul/min/max/bitwise exist and
#: are exact IEEE/modular operations). fp16/bf16/fp8 are deliberately absent: the combined table
#: then routes them through ``upcast:float32`` so they are accumulated across vendors in fp32.
HOST_REDUCIBLE = ("bool", "uint8", "int8", "int16", "int32", "int64", "float32", "float64")

AR, RD, RS = Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER
BC, AG, GA = Collective.BROADCAST, Collective.ALL_GATHER, Collective.GATHER
#: Reduce ops the bridge itself implements; AVG and PREMUL_SUM are derived from SUM by the
#: dispatcher (sum_then_divide / mul_then_sum) so they see the whole group, not one vendor group.
_HOST_ROUTE_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
_BRIDGE_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR,
               ReduceOp.BXOR)


#: The message sizes ``vcga info --plan`` and the plan's description show the algorithm for.
PLAN_SIZES = tuple(4 << (10 + 2 * i) for i in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB

#: The reductions whose route ``vcga info --plan`` shows (SUM: what DDP and most training runs use).
ROUTE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "bool")


def node_name() -> str:
    """This process's node, as the plan groups ranks (the host name)."""
    return socket.gethostname()


# ===================================================================================================
# The plan
# ===================================================================================================


@dataclass(frozen=True)
class VendorGroup:
    """The ranks of one backend, in plan order (``ranks[0]`` is the leader)."""

    index: int
    backend: str
    vendor: str
    device_type: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class Plan:
    """Vendor groups, leaders and algorithm choice; identical on every rank of the group.

    :param size: ranks in the ``vcga`` group.
    :param groups: vendor groups in bridge order.
    :param algorithm: the configured all_reduce algorithm ("auto", "leader" or "bandwidth").
    :param global_ranks: global rank of each group rank (for messages).
    """

    size: int
    groups: tuple[VendorGroup, ...]
    algorithm: str = "auto"
    global_ranks: tuple[int, ...] = ()

    def group_of(self, rank: int) -> VendorGroup:
        for g in self.groups:
            if rank in g.ranks:
                return g
        raise ValueError(f"rank {rank} is not in the plan")

    def local_rank(self, rank: int) -> int:
        return self.group_of(rank).ranks.index(rank)

    @property
    def equal_groups(self) -> bool:
        """Every vendor group has the same size >= 2: the shape the bandwidth-optimal algorithm needs."""
        sizes = {g.size for g in self.groups}
        return len(sizes) == 1 and min(sizes) >= 2

    @property
    def contiguous(self) -> bool:
        """Each vendor group is one run of consecutive ranks."""
        return all(sorted(g.ranks) == list(range(min(g.ranks), max(g.ranks) + 1)) for g in self.groups)

    def shard_peers(self, local_rank: int) -> tuple[int, ...]:
        """Group ranks of local rank ``local_rank`` in every vendor group that has one (bridge order)."""
        return tuple(g.ranks[local_rank] for g in self.groups if local_rank < g.size)

    def all_reduce_algorithm(self, nbytes: int, large: str = AUTO_LARGE) -> str:
        """The algorithm for an all_reduce of ``nbytes`` bytes; ``large`` is what "auto" uses from
        :data:`BANDWIDTH_MIN_BYTES` on (a running group passes its measured choice, see
        :meth:`BridgeGroup.calibrate`)."""
        if not self.equal_groups:
            return "leader"  # shards must line up across vendor groups
        if self.algorithm == "auto":
            if nbytes >= PIPELINED_MIN_BYTES:
                return "bandwidth"
            return large if nbytes >= BANDWIDTH_MIN_BYTES else "leader"
        return self.algorithm

    def describe(self, sizes: Sequence[int] = PLAN_SIZES,
                 tables: Sequence[CapabilityTable] | None = None) -> dict[str, Any]:
        """Groups, leaders, shard peers and the algorithm per collective and size (``vcga info --plan``).

        With the vendor groups' ``tables`` (in plan order) it adds ``routes``: how the reductions
        that matter cross the vendors (:func:`reduction_routes`).
        """
        def g_rank(r: int) -> int:
            return self.global_ranks[r] if self.global_ranks else r

        lead = {s: self.all_reduce_algorithm(s, large=AUTO_LARGE_MEASURED) for s in sizes}
        out = {
            "size": self.size,
            "algorithm": self.algorithm,
            "contiguous": self.contiguous,
            "groups": [{"index": g.index, "backend": g.backend, "vendor": g.vendor, "device_type": g.device_type,
                        "ranks": [g_rank(r) for r in g.ranks], "leader": g_rank(g.leader), "nodes": list(g.nodes)}
                       for g in self.groups],
            "leaders": [g_rank(g.leader) for g in self.groups],
            "shard_peers": [[g_rank(r) for r in self.shard_peers(i)]
                            for i in range(max(g.size for g in self.groups)) if self.equal_groups or i == 0],
            "collectives": {
                "all_reduce": {_size_name(s): a for s, a in lead.items()},
                "reduce": {_size_name(s): a + " (all_reduce, result kept at the root)" for s, a in lead.items()},
                "reduce_scatter": {_size_name(s): a + " (all_reduce, each rank keeps its chunk)" for s, a in lead.items()},
                "broadcast": "in root's vendor group, leaders over the bridge, then in every other vendor group",
                "all_gather": "host bridge (gloo, whole group, bytes)",
                "gather": "host bridge (gloo, whole group, bytes)",
                "scatter": "host bridge (gloo, whole group, bytes)",
                "all_to_all": "host bridge (gloo, whole group, bytes; uneven splits)",
                "send_recv": "host bridge (gloo, whole group, bytes)",
                "barrier": "host bridge (gloo, whole group)",
            },
        }
        if tables is not None:
            out["routes"] = reduction_routes(self, tables)
        return out


def reduction_routes(plan: Plan, tables: Sequence[CapabilityTable], dtypes: Sequence[str] = ROUTE_DTYPES,
                     op: ReduceOp = ReduceOp.SUM) -> list[dict[str, Any]]:
    """How an all_reduce of each dtype in ``dtypes`` crosses the vendor groups.

    Per dtype: the combined table's cell (native, or the emulation the dispatcher applies first,
    e.g. ``upcast:float32`` for fp16), the dtype the bridge then reduces in, each vendor group's
    route for it (:func:`group_route`, with the group's own recipe when its table emulates, e.g.
    CNCL's fp64 ``gather_then_reduce``), and whether a host route pins the leader algorithm.
    """
    combined = combined_table("bridge", tables)
    rows = []
    for dt in dtypes:
        cell = combined.lookup(AR, dt, op)
        reduced = cell.via.split(":", 1)[1] if cell.via and cell.via.startswith("upcast:") else dt
        row: dict[str, Any] = {"dtype": dt, "op": op.value, "support": cell.support.value, "via": cell.via,
                               "reduced_as": reduced, "groups": []}
        if cell.support is Support.REFUSED:
            row["note"] = cell.note
        else:
            for g, t in zip(plan.groups, tables):
                own = t.lookup(AR, reduced, op)
                row["groups"].append({"backend": g.backend, "route": group_route(t, reduced, op),
                                      "library_cell": own.support.value, "library_via": own.via})
            row["leader_only"] = any(x["route"] == "host" for x in row["groups"])
        rows.append(row)
    return rows


def plan_for_layout(backends: Sequence[Backend], nodes: Sequence[str], algorithm: str = "auto") -> tuple[Plan, list[CapabilityTable]]:
    """The plan and vendor-group tables that ranks running ``backends`` (one per rank) on ``nodes``
    would compute -- the same facts :func:`vcga.process_group.make_transport` publishes, without
    creating any group (``vcga info --plan``)."""
    peers = [{"backend": b.name, "vendor": b.vendor, "device_type": b.device_type, "global_rank": r,
              "node": n} for r, (b, n) in enumerate(zip(backends, nodes, strict=True))]
    plan = make_plan(peers, algorithm)
    by_name = {b.name: b for b in backends}
    return plan, [by_name[g.backend].capabilities() for g in plan.groups]


def _size_name(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def make_plan(peers: Sequence[dict[str, Any]], algorithm: str = "auto") -> Plan:
    """The plan for the published facts ``peers`` (one dict per group rank, in rank order).

    Nodes are ordered by their lowest rank; a vendor group's members by (node, rank), so a group
    spanning nodes is walked node by node; groups by (node of their first member, lowest rank), so
    vendor groups on one node sit next to each other on the bridge. Pure: every rank computes the
    same plan from the same facts.
    """
    if algorithm not in ("auto", *ALGORITHMS):
        raise VcgaConfigError("bridge_algorithm", algorithm, "one of auto, leader, bandwidth, replicated")
    node_order: dict[str, int] = {}
    for p in peers:
        node_order.setdefault(p.get("node", ""), len(node_order))
    by_backend: dict[str, list[int]] = {}
    for r, p in enumerate(peers):
        by_backend.setdefault(p["backend"], []).append(r)
    for name, ranks in by_backend.items():
        kinds = {(peers[r]["vendor"], peers[r]["device_type"]) for r in ranks}
        if len(kinds) > 1:
            raise VcgaConfigError("backend", name, f"one vendor and device type per backend name; ranks report {sorted(kinds)}")
    groups = []
    for name, ranks in by_backend.items():
        ordered = sorted(ranks, key=lambda r: (node_order[peers[r].get("node", "")], r))
        groups.append((name, tuple(ordered)))
    groups.sort(key=lambda item: (node_order[peers[item[1][0]].get("node", "")], min(item[1])))
    out = []
    for i, (name, ranks) in enumerate(groups):
        p = peers[ranks[0]]
        nodes = tuple(dict.fromkeys(peers[r].get("node", "") for r in ranks))
        out.append(VendorGroup(i, name, p["vendor"], p["device_type"], ranks, nodes))
    global_ranks = tuple(int(p.get("global_rank", r)) for r, p in enumerate(peers))
    return Plan(len(peers), tuple(out), algorithm, global_ranks)


# ===================================================================================================
# The combined capability table
# ===================================================================================================


def table_from_json(backend: str, rows: Sequence[dict[str, Any]]) -> CapabilityTable:
    """Rebuild a table from :meth:`CapabilityTable.to_json` rows (as published through the store)."""
    cells = {}
    for row in rows:
        coll = Collective(row["collective"])
        op = ReduceOp(row["op"]) if row["op"] is not None else None
        cells[(coll, row["dtype"], op)] = Cell(Support(row["support"]), via=row["via"], note=row["note"])
    return CapabilityTable(backend, cells)


def table_digest(table: CapabilityTable) -> str:
    rows = sorted(json.dumps(r, sort_keys=True) for r in table.to_json())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def combined_table(name: str, tables: Sequence[CapabilityTable]) -> CapabilityTable:
    """What the hierarchical group does correctly, given each vendor group's table.

    A reducing cell (all_reduce, reduce, reduce_scatter) is native when the host can reduce the
    dtype exactly (:data:`HOST_REDUCIBLE`), the op is one the bridge implements, and every vendor
    group has a route for it (:func:`group_route`: its library reduces it, or it can at least move
    it and its leader reduces the raw bytes on the host). A broadcast is native when every vendor group can broadcast the dtype;
    the other data movement goes through the host bridge as bytes and is native for every dtype.
    Every other cell is refused with the refusing vendors' reasons, non-final, so the standard
    emulations are derived on top: AVG = SUM then divide, PREMUL_SUM = scale then SUM, fp16/bf16/fp8
    through fp32 (accumulated across vendors in fp32), complex as real pairs.
    """
    b = CapabilityTable.builder(name)
    backends = ", ".join(t.backend for t in tables)
    for coll in Collective:
        for dt in _dtypes.ALL:
            ops: Sequence[ReduceOp | None] = list(ReduceOp) if coll.reduces else [None]
            for op in ops:
                reason = _bridge_refusal(coll, dt, op, tables)
                if reason is None:
                    note = (f"hierarchical over {backends}: in each vendor group by its own library, across "
                            f"vendors on the host" if coll.reduces or coll is BC else
                            f"host bridge (gloo) across {backends}, as bytes")
                    b.native([coll], [dt], [op] if op is not None else None, note=note)
                else:
                    b.refuse([coll], [dt], [op] if op is not None else None, note=reason, final=False)
    return b.build(derive=True)


def group_route(table: CapabilityTable, dt: str, op: ReduceOp) -> str | None:
    """How one vendor group takes part in a bridged reduction of ``dt`` with ``op``.

    "library": its library (or its own emulation) reduces and reduce-scatters, broadcasts and
    all-gathers it. "host": it cannot reduce it but can move it -- the leader gathers the raw
    bytes and reduces them on the host in the dtype itself (fp64 on HCCL, which has no fp64).
    None: it cannot even move the dtype.
    """
    ok = [table.lookup(c, dt, op if c.reduces else None).support is not Support.REFUSED
          for c in (RD, RS, BC, AG, GA, AR)]
    if all(ok[:4]) and ok[5]:
        return "library"
    if ok[2] and ok[4] and op in _HOST_ROUTE_OPS:
        return "host"
    return None


def _bridge_refusal(coll: Collective, dt: str, op: ReduceOp | None, tables: Sequence[CapabilityTable]) -> str | None:
    """Why the bridge cannot run this cell itself (None: it can)."""
    if coll.reduces:
        assert op is not None
        if op not in _BRIDGE_OPS:
            return f"mixed-vendor bridge composes {op.value} from SUM"
        if dt not in HOST_REDUCIBLE:
            return f"mixed-vendor bridge reduces {dt} in a wider dtype"
        if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and _dtypes.get(dt).kind not in "iub":
            return f"bitwise ops need an integer or bool dtype, not {dt}"
        for t in tables:
            if group_route(t, dt, op) is None:
                for c in (RD, RS, BC, AG, GA):
                    cell = t.lookup(c, dt, op if c.reduces else None)
                    if cell.support is Support.REFUSED:
                        return f"{t.backend} cannot run {c.value} on {dt}: {cell.note or 'refused'}"
        return None
    if coll is BC:
        for t in tables:
            cell = t.lookup(BC, dt, None)
            if cell.support is Support.REFUSED:
                return f"{t.backend}: {cell.note or 'refused'}"
    return None


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


# ===================================================================================================
# The group the dispatcher drives
# ===================================================================================================


class BridgeGroup:
    """The hierarchical collectives, with the c10d methods of :data:`vcga.transport.TRANSPORT_METHODS`.

    Each collective runs to completion in the calling thread and returns a completed
    :class:`~vcga.pypg.PyWork` (point-to-point returns gloo's own asynchronous work). Tensors arrive
    contiguous, in dtypes and ops the combined table calls native.

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
        #: send/recv). Chosen per vendor group by measured cost (:meth:`calibrate`); every rank of
        #: a vendor group must hold the same value (other groups may differ).
        self.group_method = "collective"
        #: pipeline segments at most (1: no pipelining); the same on every rank of the group
        self.max_segments = PIPELINE_MAX_SEGMENTS
        self._padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> (padded copy, shard)
        #: what "auto" runs from BANDWIDTH_MIN_BYTES on (measured by :meth:`calibrate`)
        self.auto_large = AUTO_LARGE
        #: the measurements behind both choices (None: not measured)
        self.calibration: dict[str, Any] | None = None
        self._debug = log.isEnabledFor(logging.DEBUG)

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
        alg = self.plan.all_reduce_algorithm(t.numel() * t.element_size(), self.auto_large)
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
        """The pipeline segments of a bandwidth all_reduce: a function of the size only, so every
        vendor group cuts the same boundaries (shard peers must bridge the same elements)."""
        n = flat.numel()
        count = max(1, min(self.max_segments, n * flat.element_size() // PIPELINE_SEGMENT_BYTES))
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

    def calibrate(self, device: torch.device, nbytes: int = CALIBRATION_BYTES, reps: int = 3) -> dict[str, Any]:
        """Measure, once at creation, what the bandwidth algorithm's choices cost here; choose.

        Every rank times (fp32 SUM of ``nbytes``, best of ``reps``, interleaved, after a barrier) its vendor
        group's reduce-scatter + all-gather through the library's collectives and through rings of
        its send/recv, the library's all-reduce, and the shard peers' bridge all-reduce. The
        slowest rank's time of each group counts (max over the whole group, exchanged over the
        host bridge), so every rank derives the same choices:

        - each vendor group's :attr:`group_method`: the cheaper of "collective" and "p2p";
        - :attr:`auto_large` (what auto runs from :data:`BANDWIDTH_MIN_BYTES` up to
          :data:`PIPELINED_MIN_BYTES`): the cheaper prediction of "bandwidth", max over groups of
          (reduce-scatter + all-gather) + bridge(N)/k, and "replicated", max over groups of
          all-reduce + bridge(N) (the bridge moves N/k per rank instead of N).

        Needs equal vendor groups of size >= 2 (the only shape these algorithms run on).
        """
        n = max(nbytes // 4, 1)
        x = torch.ones(n, dtype=torch.float32, device=device)
        inner = self.inner
        assert inner is not None and self.plan.equal_groups
        runs: dict[str, Callable[[], None]] = {
            "collective": lambda: self._all_reduce_bandwidth(x, ReduceOp.SUM, "collective", bridge=False),
            "p2p": lambda: self._all_reduce_bandwidth(x, ReduceOp.SUM, "p2p", bridge=False),
            "all_reduce": lambda: self._in_group(lambda s: inner.all_reduce(x, ReduceOp.SUM, None, None, s)),
            "bridge": lambda: self._bridge_reduce(x, ReduceOp.SUM),
        }
        best = {k: float("inf") for k in runs}
        for _ in range(reps):
            for what, run in runs.items():
                self.world.barrier().wait()
                t0 = time.perf_counter()
                run()
                best[what] = min(best[what], time.perf_counter() - t0)
        # Row g of the table: vendor group g's times; max over all ranks (each rank fills its row).
        kinds = list(runs)
        table = torch.zeros(len(self.plan.groups), len(kinds), dtype=torch.float64)
        table[self.vgroup.index] = torch.tensor([best[k] for k in kinds], dtype=torch.float64)
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.MAX
        self.world.allreduce([table], o).wait()
        rows = [dict(zip(kinds, row)) for row in table.tolist()]
        methods = ["p2p" if r["p2p"] < r["collective"] else "collective" for r in rows]
        k = self.vgroup.size
        rsag = max(min(r["p2p"], r["collective"]) for r in rows)
        bridge_n = max(r["bridge"] for r in rows)
        predicted = {"bandwidth": rsag + bridge_n / k, "replicated": max(r["all_reduce"] for r in rows) + bridge_n}
        self.group_method = methods[self.vgroup.index]
        self.auto_large = min(predicted, key=lambda a: (predicted[a], a))
        self.calibration = {"bytes": n * 4, "seconds": {g.backend: r for g, r in zip(self.plan.groups, rows)},
                            "group_methods": {g.backend: m for g, m in zip(self.plan.groups, methods)},
                            "predicted_seconds": predicted, "auto_large": self.auto_large}
        log.debug("vcga bridge calibration (rank %d): %s", self.rank, json.dumps(self.calibration))
        return self.calibration

    # -- reductions (c10d signatures) ------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PyWork:
        (t,) = tensors
        op, _ = reduce_op_of(opts.reduceOp) if opts is not None else (ReduceOp.SUM, None)
        self.all_reduce(t, op)
        return PyWork(result=tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PyWork:
        op, _ = reduce_op_of(opts.reduceOp) if opts is not None else (ReduceOp.SUM, None)
        for t in tensors:
            self.all_reduce(t, op)
        return PyWork(result=tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> PyWork:
        """All-reduce a copy; only the root keeps the result (other ranks' tensors are unchanged)."""
        (t,) = tensors
        op, _ = reduce_op_of(opts.reduceOp)
        w = t.clone()
        self.all_reduce(w, op)
        if self.rank == opts.rootRank:
            t.copy_(w)
        return PyWork(result=tensors)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> PyWork:
        (out,), (ins,) = outputs, inputs
        op, _ = reduce_op_of(opts.reduceOp)
        self._reduce_scatter(out, [x.reshape(-1) for x in ins], op)
        return PyWork(result=outputs)

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
                or self.plan.all_reduce_algorithm(nbytes, self.auto_large) == "leader" or out.numel() == 0):
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

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PyWork:  # noqa: A002
        rows = self._gather_bytes(input)
        if input.numel():
            output.copy_(rows.view(-1).view(input.dtype).view(output.shape))
        return PyWork(result=[output])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> PyWork:
        for i, inp in enumerate(inputs):
            self.allgather([[outs[i] for outs in output_lists]], [inp], opts)
        return PyWork(result=[t for outs in output_lists for t in outs])

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

    def barrier(self, opts: Any = None) -> Any:
        return self.world.barrier(opts) if opts is not None else self.world.barrier()


# ===================================================================================================
# The transport and its creation
# ===================================================================================================


class BridgeTransport(Transport):
    """A mixed-vendor group: native vendor groups plus the host bridge (see the module docstring)."""

    def __init__(self, plan: Plan, rank: int, backend: Backend, table: CapabilityTable, group: BridgeGroup,
                 closables: Sequence[Any]) -> None:
        self.plan, self.rank, self.backend = plan, rank, backend
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
        for pg in self._closables:
            shutdown = getattr(pg, "shutdown", None) or getattr(pg, "close", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - best effort at teardown
                    pass
        self._closables = []


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
                            shared_memory: bool = True) -> BridgeTransport:
    """Build the mixed-vendor transport (called by :func:`vcga.process_group.make_transport`).

    :param store: the group's store; :param rank: / :param size: this rank and the group size.
    :param backend: this rank's backend; :param peers: every rank's published facts, in rank order.
    :param timeout: the collective timeout (also bounds every wait here).
    :param algorithm: config ``bridge_algorithm``.
    :param apply_env: sets the vendor's environment before its native group is created.
    :param shared_memory: config ``bridge_shm``: shard peers on one node may reduce through shared
        memory (:class:`~vcga.hostbridge.SharedMemoryBridge`) instead of gloo.
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
    log.debug("vcga bridge (rank %d): shard peers reduce through %s", gr[rank], group.shard_exchange)
    if plan.equal_groups and plan.algorithm in ("auto", "bandwidth"):
        try:
            device = backend.accelerator().device()
        except Exception as e:  # noqa: BLE001 - an accelerator that cannot name its device: measure nothing
            log.warning("vcga bridge: rank %d cannot name its %s device (%s); the creation-time measurement "
                        "is skipped on every rank", gr[rank], backend.name, e)
            device = None
        # The measurement is collective: run it only if every rank can (else ranks that can would
        # wait in it for ranks that skipped it, until the timeout). auto then keeps AUTO_LARGE.
        if every_rank(world, device is not None):
            group.calibrate(device)
    closables = [native, *([shm] if shm is not None else []), *([shard] if shard is not None else []), world]
    return BridgeTransport(plan, rank, backend, table, group, closables)


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
