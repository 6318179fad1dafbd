"""Cambricon MLU: torch_mlu + CNCL. (Probe only so far; the full plugin is issue #5.)"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vcga.contract import Backend, CapabilityTable, ProbeResult, hookimpl
from vcga.errors import VcgaBackendUnavailable

if TYPE_CHECKING:
    import torch.distributed as dist


class MluBackend(Backend):
    name = "mlu"
    vendor = "cambricon"
    device_type = "mlu"
    dist_backend = "cncl"
    priority = 100

    def probe(self) -> ProbeResult:
        # find_spec first: importing torch_mlu is what registers the device with torch, and a broken
        # install can fail in ways that must be reported, not raised.
        if importlib.util.find_spec("torch_mlu") is None:
            return ProbeResult(False, "module torch_mlu is not installed (install torch_mlu from Cambricon's Neuware channel)")
        try:
            import torch_mlu  # noqa: F401
            import torch
        except Exception as e:
            return ProbeResult(False, f"import torch_mlu failed: {type(e).__name__}: {e}")
        try:
            n = torch.mlu.device_count()
        except Exception as e:
            return ProbeResult(False, f"mlu driver error: {e}")
        if n == 0:
            return ProbeResult(False, "no mlu device is visible (torch.mlu.device_count() == 0)")
        return ProbeResult(True, f"{n} mlu device(s)", n, {"torch": torch.__version__})

    def accelerator(self) -> Any:
        raise VcgaBackendUnavailable(self.name, "the mlu accelerator is not implemented yet (issue #5)")

    def capabilities(self) -> CapabilityTable:
        return CapabilityTable.builder(self.name).build(derive=False)

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup:
        raise VcgaBackendUnavailable(self.name, "the mlu process-group factory is not implemented yet (issue #5)")


@hookimpl
def vcga_backends() -> list[Backend]:
    return [MluBackend()]
