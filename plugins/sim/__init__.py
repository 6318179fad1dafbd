"""Simulated vendors: CPU stand-ins for NCCL, HCCL and CNCL that run on gloo.

``sim-nccl``, ``sim-hccl`` and ``sim-cncl`` report their vendor and device type "cpu", and carry
exactly the capability table of their real counterpart (the facts in design.md, cross-checked
against the real plugins' tables by tests/test_vendor_tables.py). Their native process group
behaves like the vendor library seen through its torch process group: it refuses what the vendor
refuses, with the vendor's message; performs natively what the vendor performs even where gloo
cannot (NCCL's PREMUL_SUM and fp8 data movement, HCCL's AVG); and mangles what the vendor mangles
(CNCL moves and reduces fp64 as fp32) -- so VCGA's dispatch is tested against the library's real
behaviour, not against gloo's. Each rule cites the vendor source it mirrors
(:data:`~vcga.plugins.sim.libraries.LIBRARIES`); :mod:`vcga.plugins.sim.group` applies them on gloo.

``VCGA_SIM_VENDORS=nccl:2,hccl:2`` (config key ``sim_vendors``) gives ranks 0-1 ``sim-nccl`` and
ranks 2-3 ``sim-hccl``: how mixed-vendor jobs are tested on one CPU machine.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from vcga import dtypes
from vcga.config import Config, gloo_env, parse_sim_vendors
from vcga.contract import (
    BITWISE,
    MOVING,
    REDUCING,
    Backend,
    CapabilityTable,
    ProbeResult,
    ReduceOp,
    hookimpl,
)
from vcga.errors import VcgaConfigError

from .libraries import LIBRARIES

if TYPE_CHECKING:  # vcga.cpu is imported where used: a job's group never asks for it
    import torch.distributed as dist

    from vcga.cpu import CpuAccelerator

FLOATS_NO_FP8 = ("float16", "bfloat16", "float32", "float64")

# --- the vendors' facts (design.md "Facts to start from"; sources cited in plugins/{nccl,hccl,mlu}.py) ---

def nccl_table(name: str = "sim-nccl") -> CapabilityTable:
    """NCCL through torch's ProcessGroupNCCL."""
    moved = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
             "float8_e4m3fn", "float8_e5m2")
    reduced = ("uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
    return (
        CapabilityTable.builder(name)
        .native(MOVING, moved, note="ProcessGroupNCCL getNcclDataType")
        .native(REDUCING, reduced, [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                note="ncclSum/ncclProd/ncclMin/ncclMax")
        .native(REDUCING, FLOATS_NO_FP8, [ReduceOp.AVG, ReduceOp.PREMUL_SUM], note="ncclAvg; ncclRedOpCreatePreMulSum")
        .native(REDUCING, ["bool"], [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.MIN],
                note="ProcessGroupNCCL maps bool SUM to ncclMax and PRODUCT to ncclMin")
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="NCCL has no bitwise reduce ops "
                "(torch: 'Cannot use ReduceOp.BAND with NCCL'); use gloo, or MAX/MIN for bool")
        .build()
    )


def hccl_table(name: str = "sim-hccl") -> CapabilityTable:
    """HCCL through torch_npu's ProcessGroupHCCL."""
    native_dt = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32")
    return (
        CapabilityTable.builder(name)
        .native(MOVING, native_dt, note="ProcessGroupHCCL getHcclDataType (bool/uint8 cast to int32)")
        .native(REDUCING, native_dt, [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                note="HcclReduceOp SUM/PROD/MIN/MAX; bool SUM mapped to MAX")
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="HCCL has no bitwise reduce ops "
                "(ProcessGroupHCCL rejects BAND/BOR/BXOR); use gloo, or MAX/MIN for bool")
        .build()
    )


def cncl_table(name: str = "sim-cncl") -> CapabilityTable:
    """CNCL through torch_mlu's ProcessGroupCNCL."""
    native_dt = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32")
    return (
        CapabilityTable.builder(name)
        .native(MOVING, native_dt, note="process_group_cncl getCnclDataType (bool as uint8)")
        .native(REDUCING, native_dt, [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                note="cnclSum/cnclProd/cnclMin/cnclMax; bool SUM mapped to MAX")
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="CNCL has no bitwise reduce ops; use gloo, or MAX/MIN for bool")
        # CNCL maps double to cnclFloat: fp64 would silently be reduced (and moved) as fp32.
        .emulate(MOVING, ["float64"], via="bitcast:int64",
                 note="CNCL maps double to cnclFloat; VCGA moves fp64 bytes as int64")
        .emulate(REDUCING, ["float64"], [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG,
                                          ReduceOp.PREMUL_SUM],
                 via="gather_then_reduce", note="CNCL reduces double as float; VCGA reduces fp64 on the host")
        .build()
    )


VENDORS = {
    # key in VCGA_SIM_VENDORS: (backend name, vendor, dist backend it stands for, table)
    "nccl": ("sim-nccl", "nvidia", "nccl", nccl_table),
    "hccl": ("sim-hccl", "huawei", "hccl", hccl_table),
    "cncl": ("sim-cncl", "cambricon", "cncl", cncl_table),
}


class SimBackend(Backend):
    """A simulated vendor: the vendor's capability table and behaviour, gloo underneath."""

    device_type = "cpu"
    dist_backend = "gloo"
    priority = -100
    simulated = True

    def __init__(self, key: str) -> None:
        self.key = key
        self.name, self.vendor, self.stands_for, self._table_fn = VENDORS[key]
        self._table: CapabilityTable | None = None

    def probe(self) -> ProbeResult:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            return ProbeResult(False, f"torch is not importable: {e}")
        if not (dist.is_available() and dist.is_gloo_available()):
            return ProbeResult(False, "simulated vendors run on gloo, which this torch build lacks")
        return ProbeResult(True, f"simulated {self.stands_for.upper()} on gloo (CPU)", 1,
                           {"torch": torch.__version__})

    def accelerator(self) -> CpuAccelerator:
        from vcga.cpu import CpuAccelerator

        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        if self._table is None:
            self._table = self._table_fn(self.name)
        return self._table

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup:
        """A gloo group behind the vendor library's rules (see :class:`~vcga.plugins.sim.libraries.VendorLibrary`)."""
        import torch.distributed as dist

        gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        from .group import SimVendorGroup  # torch: only when a group is made

        return SimVendorGroup(LIBRARIES[self.key], gloo, rank, world_size)

    def vendor_env(self, config: Config) -> dict[str, str]:
        # The bytes move through gloo, whichever library is simulated: gloo's variables.
        return gloo_env(config)

    def describe(self) -> dict:
        d = super().describe()
        d["stands_for"] = self.stands_for
        return d


def rank_layout(spec: str, world_size: int) -> list[str]:
    """Backend name per rank for a ``sim_vendors`` spec; counts must add up to the world size."""
    parts = parse_sim_vendors(spec)
    layout = [VENDORS[v][0] for v, n in parts for _ in range(n)]
    if len(layout) != world_size:
        raise VcgaConfigError("sim_vendors", spec, f"vendor counts that add up to the world size ({world_size}); "
                                                   f"they add up to {len(layout)}")
    return layout


@hookimpl
def vcga_backends() -> list[Backend]:
    return [SimBackend(k) for k in VENDORS]


@hookimpl
def vcga_rank_backend(rank: int, world_size: int, config: Config) -> str | None:
    if not config.sim_vendors:
        return None
    return rank_layout(config.sim_vendors, world_size)[rank]
