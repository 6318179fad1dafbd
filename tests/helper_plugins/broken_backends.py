"""Deliberately broken backends for tests (loaded with VCGA_PLUGINS=broken_backends).

- ``broken-sum``: gloo underneath, but its all_reduce adds 1 to every float16 result.
- ``broken-create``: its native process group cannot be created.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from vcga.contract import Backend, hookimpl
from vcga.errors import VcgaBackendUnavailable


class _WrongFp16Sum:
    """Delegates to a gloo group; corrupts float16 all_reduce results after they arrive."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def allreduce(self, tensors: list, opts: Any) -> Any:
        import torch

        work = self.inner.allreduce(tensors, opts)
        work.wait()
        for t in tensors:
            if t.dtype == torch.float16:
                t.add_(1)
        return work

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _GlooBased(Backend):
    vendor, device_type, dist_backend = "test", "cpu", "gloo"
    priority = -1000

    def probe(self):
        from vcga.contract import ProbeResult

        return ProbeResult(True, "test backend", 1)

    def accelerator(self):
        from vcga.cpu import CpuAccelerator

        return CpuAccelerator()

    def capabilities(self):
        from vcga.plugin_manager import get_plugin_manager

        return get_plugin_manager().backend("gloo").capabilities()


class BrokenSum(_GlooBased):
    name = "broken-sum"

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        return _WrongFp16Sum(dist.ProcessGroupGloo(store, rank, world_size, timeout))


class BrokenCreate(_GlooBased):
    name = "broken-create"

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        raise VcgaBackendUnavailable(self.name, "the vendor library refused to initialise (test)")


@hookimpl
def vcga_backends() -> list[Backend]:
    return [BrokenSum(), BrokenCreate()]
