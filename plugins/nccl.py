"""NVIDIA: torch.cuda + NCCL. (Probe only so far; the full plugin is issue #5.)"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vcga.contract import Backend, CapabilityTable, ProbeResult, hookimpl
from vcga.errors import VcgaBackendUnavailable

if TYPE_CHECKING:
    import torch.distributed as dist


class NcclBackend(Backend):
    name = "nccl"
    vendor = "nvidia"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100

    def probe(self) -> ProbeResult:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            return ProbeResult(False, f"torch is not importable: {e}")
        if torch.version.cuda is None:
            return ProbeResult(False, f"torch {torch.__version__} was built without CUDA")
        if not dist.is_nccl_available():
            return ProbeResult(False, f"torch {torch.__version__} was built without NCCL")
        try:
            n = torch.cuda.device_count()
        except Exception as e:  # driver errors surface here
            return ProbeResult(False, f"CUDA driver error: {e}")
        if n == 0:
            return ProbeResult(False, "no CUDA device is visible (torch.cuda.device_count() == 0)")
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return ProbeResult(True, f"{n} CUDA device(s), NCCL {nccl}", n,
                           {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl})

    def accelerator(self) -> Any:
        raise VcgaBackendUnavailable(self.name, "the NCCL accelerator is not implemented yet (issue #5)")

    def capabilities(self) -> CapabilityTable:
        return CapabilityTable.builder(self.name).build(derive=False)

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup:
        raise VcgaBackendUnavailable(self.name, "the NCCL process-group factory is not implemented yet (issue #5)")


@hookimpl
def vcga_backends() -> list[Backend]:
    return [NcclBackend()]
