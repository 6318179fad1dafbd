"""A test plugin with two failing backends (loaded in spawned ranks with ``VCGA_PLUGINS=bridge_fail_plugin``).

``test-nodevice``: gloo whose accelerator cannot name its device on the ranks that set
``VCGA_TEST_NO_DEVICE=1`` -- so those ranks cannot take part in the bridge's creation-time
measurement while the others can, and every rank must still agree on whether it runs.

``test-broken``: a backend whose native group cannot be created on its rank 1.

Stands for a vendor stack that fails on one device (a lost NPU, a driver error): its
``create_process_group`` raises :class:`VcgaBackendUnavailable` on the group's rank 1, while its
rank 0 is already inside gloo's rendezvous waiting for rank 1 -- the case where a mixed-vendor
job must stop every rank with one clear error instead of hanging. Loaded in spawned ranks with
``VCGA_PLUGINS=bridge_fail_plugin``.
"""

from __future__ import annotations

import os
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


class _NoDeviceAccelerator(CpuAccelerator):
    def device(self, index: int | None = None) -> Any:
        if os.environ.get("VCGA_TEST_NO_DEVICE") == "1":
            raise RuntimeError("cannot name this rank's device (test: injected failure)")
        return super().device(index)


class NoDeviceBackend(BrokenBackend):
    name = "test-nodevice"

    def probe(self) -> ProbeResult:
        return ProbeResult(True, "gloo whose accelerator fails on some ranks (tests)", 1)

    def accelerator(self) -> CpuAccelerator:
        return _NoDeviceAccelerator()

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, timeout)


@hookimpl
def vcga_backends() -> list[Backend]:
    return [BrokenBackend(), NoDeviceBackend()]
