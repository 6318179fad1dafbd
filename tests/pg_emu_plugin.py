"""A test plugin: backend ``test-emulations``, gloo underneath, with a table that forces recipes.

The shipped tables never need some recipes on pg_cases.DTYPES (gloo does bool PRODUCT itself;
no vendor needs ``upcast`` or ``as_real`` to move data). This table declares a library that is
poorer than gloo -- native only on a few dtypes and ops -- so that the dispatcher must emulate
everything else with every recipe in ``vcga.contract.EMULATIONS``, against a real library (gloo).
Loaded in spawned ranks with ``VCGA_PLUGINS=pg_emu_plugin``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from vcga.contract import BITWISE, MOVING, REDUCING, Backend, CapabilityTable, ProbeResult, ReduceOp, hookimpl
from vcga.cpu import CpuAccelerator

BASIC = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]


def table() -> CapabilityTable:
    return (
        CapabilityTable.builder("test-emulations")
        .native(MOVING, ["bool", "uint8", "int32", "int64", "float32"], note="test: gloo moves these")
        .native(REDUCING, ["uint8", "int32", "int64", "float32"], BASIC, note="test")
        .native(REDUCING, ["uint8", "int32", "int64"], BITWISE, note="test")
        .native(REDUCING, ["bool"], [ReduceOp.MIN, ReduceOp.MAX], note="test: bool only as MIN/MAX")
        .refuse(REDUCING, ["bool"], [ReduceOp.SUM, ReduceOp.BOR, ReduceOp.PRODUCT, ReduceOp.BAND],
                note="test library has no bool SUM/PRODUCT", final=False)
        .emulate(MOVING, ["int16"], via="upcast:int32", note="test: move int16 widened")
        .emulate(MOVING, ["complex64"], via="as_real", note="test: move complex as float pairs")
        .emulate(MOVING, ["float64"], via="bitcast:int64", note="test")
        .emulate(REDUCING, ["float64"], [*BASIC, ReduceOp.AVG, ReduceOp.PREMUL_SUM], via="gather_then_reduce",
                 note="test: reduce fp64 on the host")
        .build()
    )


class EmulationBackend(Backend):
    name = "test-emulations"
    vendor = "test"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -1000
    simulated = True

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "gloo with a deliberately poor capability table (tests)", 1)

    def accelerator(self) -> CpuAccelerator:
        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        return table()

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, timeout)


@hookimpl
def vcga_backends() -> list[Backend]:
    return [EmulationBackend()]
