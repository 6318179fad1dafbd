"""The bridge's plan: vendor groups, leaders, algorithm choice and the combined capability table.

Pure functions of the facts every rank publishes (backend, vendor, device type, node, capability
tables), so every rank computes the same plan; nothing here imports torch, so ``vcga info --plan``
can show a layout's plan without it. The package docstring (:mod:`vcga.bridge`) tells the whole story.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from vcga import dtypes as _dtypes
from vcga._values import FrozenValue
from vcga.capabilities import LazyCapabilityTable
from vcga.contract import Backend, CapabilityTable, Cell, CellKey, Collective, ReduceOp, Support
from vcga.errors import VcgaConfigError
from vcga.pg.discovery import table_digest, table_from_wire, table_to_wire  # noqa: F401 - re-exported by vcga.bridge

__all__ = [
    "ALGORITHMS",
    "BANDWIDTH_MIN_BYTES",
    "Plan",
    "pipelines",
    "VendorGroup",
    "combined_table",
    "make_plan",
    "node_name",
    "plan_for_layout",
    "reduction_routes",
    "table_from_json",
    "table_from_wire",
    "table_to_wire",
]

#: The all_reduce algorithms across vendors (config ``bridge_algorithm``; "auto" chooses).
ALGORITHMS = ("leader", "bandwidth", "replicated")
#: "auto" on equal vendor groups chooses at each message size the algorithm the group's measured
#: α–β figures predict fastest (:mod:`vcga.bridge.cost`,
#: :meth:`AllReducer.measure_links <vcga.bridge.allreduce.AllReducer.measure_links>`). The
#: rule below is what it runs when the group has measured nothing (a rank that cannot name its
#: device): leader below BANDWIDTH_MIN_BYTES, AUTO_LARGE up to PIPELINED_MIN_BYTES, bandwidth above
#: (the crossovers of the one-node measurements: docs/benchmarks.md, "Mixed-vendor all_reduce on
#: one node").
BANDWIDTH_MIN_BYTES = 1 << 20
AUTO_LARGE = "replicated"
#: The bandwidth algorithm pipelines a message in segments of at least this size (at most
#: PIPELINE_MAX_SEGMENTS of them): one segment crosses the bridge while the next is reduce-scattered
#: and the previous all-gathered inside the vendor group.
PIPELINE_SEGMENT_BYTES = 8 << 20
PIPELINE_MAX_SEGMENTS = 8
PIPELINED_MIN_BYTES = 2 * PIPELINE_SEGMENT_BYTES
#: With measured figures the pipeline's segment count is the one they predict fastest
#: (:func:`vcga.bridge.cost.segments`): a power of two up to this many, segments of at least this size.
MODEL_MAX_SEGMENTS = 16
MODEL_MIN_SEGMENT_BYTES = 256 << 10

#: Dtypes the host bridge reduces itself (torch CPU kernels for add/mul/min/max/bitwise exist and
#: are exact IEEE/modular operations). fp16/bf16/fp8 are deliberately absent: the combined table
#: then routes them through ``upcast:float32`` so they are accumulated across vendors in fp32.
HOST_REDUCIBLE = ("bool", "uint8", "int8", "int16", "int32", "int64", "float32", "float64")

#: What a vendor group runs in a bridged reduction (:func:`group_route` checks each in its table).
_GROUP_STEPS = (Collective.REDUCE, Collective.REDUCE_SCATTER, Collective.BROADCAST, Collective.ALL_GATHER,
                Collective.GATHER)
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


class VendorGroup(FrozenValue):
    """The ranks of one backend, in plan order (``ranks[0]`` is the leader). Frozen, compared by value."""

    __slots__ = ("index", "backend", "vendor", "device_type", "ranks", "nodes")

    index: int
    backend: str
    vendor: str
    device_type: str
    ranks: tuple[int, ...]
    #: the nodes its ranks are on: host names, or in a running group node indices (describe() names them)
    nodes: tuple[str | int, ...]

    def __init__(self, index: int, backend: str, vendor: str, device_type: str, ranks: tuple[int, ...],
                 nodes: tuple[str | int, ...]) -> None:
        self._set(index, backend, vendor, device_type, ranks, nodes)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        return self.ranks[0]


class Plan(FrozenValue):
    """Vendor groups, leaders and algorithm choice; identical on every rank of the group. Frozen,
    compared by value (a :class:`~vcga._values.FrozenValue`: defining a frozen dataclass compiles
    its methods, at every mixed-vendor start).

    :param size: ranks in the ``vcga`` group.
    :param groups: vendor groups in bridge order.
    :param algorithm: the configured all_reduce algorithm ("auto", "leader" or "bandwidth").
    :param global_ranks: global rank of each group rank (for messages).
    """

    __slots__ = ("size", "groups", "algorithm", "global_ranks")

    size: int
    groups: tuple[VendorGroup, ...]
    algorithm: str
    global_ranks: tuple[int, ...]

    def __init__(self, size: int, groups: tuple[VendorGroup, ...], algorithm: str = "auto",
                 global_ranks: tuple[int, ...] = ()) -> None:
        self._set(size, groups, algorithm, global_ranks)

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
        """The algorithm for an all_reduce of ``nbytes`` bytes without measured figures (a group
        with figures lets them choose, :meth:`BridgeGroup._auto`); ``large`` is what "auto" then
        uses from :data:`BANDWIDTH_MIN_BYTES` up to :data:`PIPELINED_MIN_BYTES`."""
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

        lead = {s: self.all_reduce_algorithm(s) for s in sizes}
        if self.algorithm == "auto" and self.equal_groups:  # each group measures its links and chooses
            lead = {s: f"measured (if not: {a})" for s, a in lead.items()}
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
                "all_reduce": {size_name(s): a for s, a in lead.items()},
                "reduce": {size_name(s): a + " (all_reduce, result kept at the root)" for s, a in lead.items()},
                "reduce_scatter": {size_name(s): a + " (all_reduce, each rank keeps its chunk)"
                                   for s, a in lead.items()},
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
        cell = combined.lookup(Collective.ALL_REDUCE, dt, op)
        reduced = cell.via.split(":", 1)[1] if cell.via and cell.via.startswith("upcast:") else dt
        row: dict[str, Any] = {"dtype": dt, "op": op.value, "support": cell.support.value, "via": cell.via,
                               "reduced_as": reduced, "groups": []}
        if cell.support is Support.REFUSED:
            row["note"] = cell.note
        else:
            for g, t in zip(plan.groups, tables, strict=True):
                own = t.lookup(Collective.ALL_REDUCE, reduced, op)
                row["groups"].append({"backend": g.backend, "route": group_route(t, reduced, op),
                                      "library_cell": own.support.value, "library_via": own.via})
            row["leader_only"] = any(x["route"] == "host" for x in row["groups"])
        rows.append(row)
    return rows


def plan_for_layout(backends: Sequence[Backend], nodes: Sequence[str],
                    algorithm: str = "auto") -> tuple[Plan, list[CapabilityTable]]:
    """The plan and vendor-group tables that ranks running ``backends`` (one per rank) on ``nodes``
    would compute -- the same facts :func:`vcga.pg.transport.make_transport` publishes, without
    creating any group (``vcga info --plan``)."""
    peers = [{"backend": b.name, "vendor": b.vendor, "device_type": b.device_type, "global_rank": r,
              "node": n} for r, (b, n) in enumerate(zip(backends, nodes, strict=True))]
    plan = make_plan(peers, algorithm)
    by_name = {b.name: b for b in backends}
    return plan, [by_name[g.backend].capabilities() for g in plan.groups]


def link_classes(plan: Plan, peers: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The link class of each kind of step the plan takes (``vcga info --plan`` and the measured
    figures name them): each vendor group's own steps are *in-vendor* (on one node, or across
    nodes: the library's own network then), the steps between vendor groups *cross-vendor same
    node* when every set of shard peers sits on one node, *cross-node* when every set spans
    nodes, *mixed* otherwise."""
    out = {}
    for g in plan.groups:
        out[g.backend] = "in-vendor, " + ("one node" if len(g.nodes) == 1 else f"across {len(g.nodes)} nodes")
    k = max(g.size for g in plan.groups) if plan.equal_groups else 1
    spans = {len({peers[r].get("node", "") for r in plan.shard_peers(i)}) > 1 for i in range(k)}
    out["bridge"] = ("mixed" if len(spans) > 1 else "cross-node" if spans.pop() else "cross-vendor same node")
    return out


def pipelines(plan: Plan, peers: Sequence[dict[str, Any]], mode: str, async_ops: bool, shared_memory: bool) -> bool:
    """Whether a group pipelines its bandwidth all_reduces (config ``bridge_pipeline``; docs/bridge.md,
    'Pipelining across collectives'): only asynchronous groups of equal vendor groups of two or more
    ranks where the bandwidth algorithm may run, and only where every set of shard peers exchanges
    through gloo -- "auto": every set spans nodes; "on": that, or ``bridge_shm`` off. A pure
    function of the plan and the configuration: every rank decides the same (the configuration must
    agree, as for ``bridge_algorithm``)."""
    if mode == "off" or not async_ops or not plan.equal_groups or plan.algorithm not in ("auto", "bandwidth"):
        return False
    if min(g.size for g in plan.groups) < 2:
        return False
    crossing = link_classes(plan, peers)["bridge"] == "cross-node"
    return crossing or (mode == "on" and not shared_memory)


def size_name(n: int) -> str:
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
            raise VcgaConfigError("backend", name,
                                  f"one vendor and device type per backend name; ranks report {sorted(kinds)}")
    groups = []
    for name, ranks in by_backend.items():
        ordered = sorted(ranks, key=lambda r: (node_order[peers[r].get("node", "")], r))
        groups.append((name, tuple(ordered)))
    groups.sort(key=lambda item: (node_order[peers[item[1][0]].get("node", "")], min(item[1])))
    out = []
    for i, (name, members) in enumerate(groups):
        p = peers[members[0]]
        nodes = tuple(dict.fromkeys(peers[r].get("node", "") for r in members))
        out.append(VendorGroup(i, name, p["vendor"], p["device_type"], members, nodes))
    global_ranks = tuple(int(p.get("global_rank", r)) for r, p in enumerate(peers))
    return Plan(len(peers), tuple(out), algorithm, global_ranks)


# ===================================================================================================
# The combined capability table
# ===================================================================================================


def table_from_json(backend: str, rows: Sequence[dict[str, Any]]) -> CapabilityTable:
    """Rebuild a table from :meth:`CapabilityTable.to_json` rows."""
    cells = {}
    for row in rows:
        coll = Collective(row["collective"])
        op = ReduceOp(row["op"]) if row["op"] is not None else None
        cells[(coll, row["dtype"], op)] = Cell(Support(row["support"]), via=row["via"], note=row["note"],
                                               derived=bool(row.get("derived", False)))
    return CapabilityTable(backend, cells)


def combined_table(name: str, tables: Sequence[CapabilityTable]) -> CapabilityTable:
    """What the hierarchical group does correctly, given each vendor group's table.

    A reducing cell (all_reduce, reduce, reduce_scatter) is native when the host can reduce the
    dtype exactly (:data:`HOST_REDUCIBLE`), the op is one the bridge implements, and every vendor
    group has a route for it (:func:`group_route`: its library reduces it, or it can at least move
    it and its leader reduces the raw bytes on the host). A broadcast is native when every vendor
    group can broadcast the dtype; the other data movement goes through the host bridge as bytes and
    is native for every dtype.
    Every other cell is refused with the refusing vendors' reasons, non-final, so the standard
    emulations are derived on top: AVG = SUM then divide, PREMUL_SUM = scale then SUM, fp16/bf16/fp8
    through fp32 (accumulated across vendors in fp32), complex as real pairs.

    The cells are worked out as they are asked for (:class:`~vcga.capabilities.LazyCapabilityTable`:
    the same cells as a builder's ``build(derive=True)`` of every cell stated this way).
    """
    tables = list(tables)
    backends = ", ".join(t.backend for t in tables)
    # group_route per (table, dtype, op): once, not per collective
    routes: dict[tuple[int, str, ReduceOp], str | None] = {}

    def stated(key: CellKey) -> Cell:
        coll, dt, op = key
        reason = _bridge_refusal(coll, dt, op, tables, routes)
        if reason is None:
            note = (f"hierarchical over {backends}: in each vendor group by its own library, across "
                    f"vendors on the host" if coll.reduces or coll is Collective.BROADCAST else
                    f"host bridge (gloo) across {backends}, as bytes")
            return Cell(Support.NATIVE, note=note)
        return Cell(Support.REFUSED, note=reason)

    return LazyCapabilityTable(name, stated)


def group_route(table: CapabilityTable, dt: str, op: ReduceOp) -> str | None:
    """How one vendor group takes part in a bridged reduction of ``dt`` with ``op``.

    "library": its library (or its own emulation) reduces and reduce-scatters, broadcasts and
    all-gathers it. "host": it cannot reduce it but can move it -- the leader gathers the raw
    bytes and reduces them on the host in the dtype itself (fp64 on HCCL, which has no fp64).
    None: it cannot even move the dtype.
    """
    ok = [table.lookup(c, dt, op if c.reduces else None).support is not Support.REFUSED
          for c in (*_GROUP_STEPS, Collective.ALL_REDUCE)]
    if all(ok[:4]) and ok[5]:
        return "library"
    if ok[2] and ok[4] and op in _HOST_ROUTE_OPS:
        return "host"
    return None


def _bridge_refusal(coll: Collective, dt: str, op: ReduceOp | None, tables: Sequence[CapabilityTable],
                    routes: dict[tuple[int, str, ReduceOp], str | None] | None = None) -> str | None:
    """Why the bridge cannot run this cell itself (None: it can). ``routes``: a memo of
    :func:`group_route` per (table index, dtype, op)."""
    if coll.reduces:
        assert op is not None
        if op not in _BRIDGE_OPS:
            return f"mixed-vendor bridge composes {op.value} from SUM"
        if dt not in HOST_REDUCIBLE:
            return f"mixed-vendor bridge reduces {dt} in a wider dtype"
        if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and _dtypes.get(dt).kind not in "iub":
            return f"bitwise ops need an integer or bool dtype, not {dt}"
        for i, t in enumerate(tables):
            if routes is None:
                route = group_route(t, dt, op)
            elif (i, dt, op) in routes:
                route = routes[(i, dt, op)]
            else:
                route = routes[(i, dt, op)] = group_route(t, dt, op)
            if route is None:
                for c in _GROUP_STEPS:
                    cell = t.lookup(c, dt, op if c.reduces else None)
                    if cell.support is Support.REFUSED:
                        return f"{t.backend} cannot run {c.value} on {dt}: {cell.note or 'refused'}"
        return None
    if coll is Collective.BROADCAST:
        for t in tables:
            cell = t.lookup(Collective.BROADCAST, dt, None)
            if cell.support is Support.REFUSED:
                return f"{t.backend}: {cell.note or 'refused'}"
    return None
