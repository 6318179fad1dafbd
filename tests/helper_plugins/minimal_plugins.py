"""The least a vendor can state, as two backends with gloo underneath (``VCGA_PLUGINS=minimal_plugins``).

- ``minimal``: float32 moved natively by every moving collective (send/recv included) and float32
  SUM reduced natively by every reducing collective -- nothing else. Every other cell is VCGA's
  derivation (``CapabilityBuilder.build``): data movement of every dtype as a bitcast to float32,
  AVG and PREMUL_SUM on float32, fp16/bf16/fp8 SUM through float32; the rest is refused.
- ``minimal-liar``: the same table plus exactly one lie: it claims ``all_reduce int16 SUM`` as
  native, which gloo does not do (it raises "Invalid scalar type"). VCGA derives ``all_reduce SUM``
  on bool, uint8 and int8 from that cell (``upcast:int16``), so ``vcga verify`` must fail exactly
  these four cells: the lie, and the three derived from it, named as derived.

Both use only the public core API, as an out-of-tree plugin would.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from vcga.contract import MOVING, REDUCING, Backend, CapabilityTable, Collective, ProbeResult, ReduceOp, hookimpl
from vcga.cpu import CpuAccelerator

#: The cell the liar lies about, as ``vcga verify`` names cells.
LIE = (Collective.ALL_REDUCE, "int16", ReduceOp.SUM)


class MinimalBackend(Backend):
    name = "minimal"
    vendor = "minimal"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -1000
    lies = False

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "a minimal capability table over gloo (tests)", 1)

    def accelerator(self) -> CpuAccelerator:
        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        b = (CapabilityTable.builder(self.name)
             .native(MOVING, ["float32"], note="minimal: float32 only")
             .native(REDUCING, ["float32"], [ReduceOp.SUM], note="minimal: float32 SUM only"))
        if self.lies:
            b.native([LIE[0]], [LIE[1]], [LIE[2]], note="a lie: gloo has no int16 reductions")
        return b.build()

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class LiarBackend(MinimalBackend):
    name = "minimal-liar"
    lies = True


@hookimpl
def vcga_backends() -> list[Backend]:
    return [MinimalBackend(), LiarBackend()]
