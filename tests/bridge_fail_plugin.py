"""A test plugin: backend ``test-broken``, whose native group cannot be created on its rank 1.

Stands for a vendor stack that fails on one device (a lost NPU, a driver error): its
``create_process_group`` raises :class:`VcgaBackendUnavailable` on the group's rank 1, while its
rank 0 is already inside gloo's rendezvous waiting for rank 1 -- the case where a mixed-vendor
job must stop every rank with one clear error instead of hanging. Loaded in spawned ranks with
``VCGA_PLUGINS=bridge_fail_plugin``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from vcga.contract import MOVING, REDUCING, Backend, CapabilityTable, ProbeResult, ReduceOp, hookimpl
from vcga.cpu import CpuAccelerator
from vcga.errors import VcgaBackendUnavailable


class BrokenBackend(Backend):
    name = "test-broken"
    vendor = "test"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -1000
    simulated = True

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "gloo whose rank 1 cannot create its group (tests)", 1)

    def accelerator(self) -> CpuAccelerator:
        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        return (CapabilityTable.builder(self.name)
                .native(MOVING, ["float32", "int64"], note="test")
                .native(REDUCING, ["float32", "int64"], [ReduceOp.SUM, ReduceOp.MAX], note="test")
                .build())

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        if rank == 1:
            raise VcgaBackendUnavailable(self.name, "device 1 is lost (test: injected failure)")
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)


@hookimpl
def vcga_backends() -> list[Backend]:
    return [BrokenBackend()]
