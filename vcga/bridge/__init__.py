"""The mixed-vendor bridge: one ``vcga`` process group over ranks of several vendors.

When the ranks of a ``vcga`` group run different backends (NVIDIA next to Ascend next to MLU, or
their simulated stand-ins), :func:`vcga.pg.transport.make_transport` hands over to
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
   a memory segment for their reductions (:mod:`vcga.bridge.host`). A rank whose native group cannot be
   created makes every rank raise the same :class:`~vcga.errors.VcgaBackendUnavailable` naming it,
   within the timeout;
4. presents it all as a :class:`~vcga.pg.transport.Transport` (:class:`BridgeTransport`): ``table``
   says what the hierarchical group does correctly (:func:`combined_table`), ``group`` is a
   :class:`BridgeGroup` with the c10d methods the dispatcher drives.

Inside a vendor group every step goes through that vendor's own :class:`~vcga.pg.dispatch.Dispatcher`
(its capability table, its emulations: CNCL's fp64 is reduced on the host in fp64, not by CNCL as
fp32). Across vendor groups bytes travel through gloo on the host (or shared memory, for shard
peers on one node) and reductions are computed on the host in the tensor's dtype, in plan order;
each cross-vendor result is computed from the same bytes by the same operations in the same order
on every peer and then copied, so every rank ends
with the same bits. Algorithms and error bounds: ``docs/bridge.md``.

Modules: :mod:`vcga.bridge.plan` (the plan and the combined table: pure, no torch),
:mod:`vcga.bridge.group` (:class:`BridgeGroup`, the hierarchical collectives and their
communication queue), :mod:`vcga.bridge.allreduce` (its all_reduce algorithms, their α–β
measurement per link class and the choice; the model itself in :mod:`vcga.bridge.cost`) and
:mod:`vcga.bridge.create` (discovery, the native and host groups, :class:`BridgeTransport`).
Importing this package imports only the plan; the torch-bound names load on first use, so
``from vcga.bridge import make_plan`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vcga.bridge.plan import (
    ALGORITHMS,
    AUTO_LARGE,
    BANDWIDTH_MIN_BYTES,
    PIPELINED_MIN_BYTES,
    Plan,
    VendorGroup,
    combined_table,
    group_route,
    link_classes,
    make_plan,
    node_name,
    plan_for_layout,
    reduction_routes,
    table_digest,
    table_from_json,
    table_from_wire,
    table_to_wire,
)

if TYPE_CHECKING:  # the names loaded on first access (_LAZY), for the type checker
    from vcga.bridge.create import BridgeTransport, create_bridge_transport
    from vcga.bridge.group import BridgeGroup
    from vcga.bridge.host import combine_rows

__all__ = [
    "ALGORITHMS",
    "AUTO_LARGE",
    "BANDWIDTH_MIN_BYTES",
    "BridgeGroup",
    "BridgeTransport",
    "PIPELINED_MIN_BYTES",
    "Plan",
    "VendorGroup",
    "combine_rows",
    "combined_table",
    "create_bridge_transport",
    "group_route",
    "link_classes",
    "make_plan",
    "node_name",
    "plan_for_layout",
    "reduction_routes",
    "table_digest",
    "table_from_json",
    "table_from_wire",
    "table_to_wire",
]

#: Names that need torch, and the module that has each (loaded on first access, PEP 562).
_LAZY = {
    "BridgeGroup": "vcga.bridge.group",
    "BridgeTransport": "vcga.bridge.create",
    "create_bridge_transport": "vcga.bridge.create",
    "combine_rows": "vcga.bridge.host",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
