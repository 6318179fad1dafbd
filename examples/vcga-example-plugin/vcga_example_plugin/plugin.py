"""The 'acme' backend: a vendor whose collective library is (for this example) gloo on the CPU,
but which supports only a few dtypes natively. It shows the whole contract a vendor implements,
using only the public core API -- exactly what `pip install vcga-<vendor>` would register.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from vcga.contract import MOVING, REDUCING, Backend, CapabilityTable, ProbeResult, ReduceOp, hookimpl
from vcga.cpu import CpuAccelerator

NATIVE_DTYPES = ("float32", "float64", "int64")


class AcmeBackend(Backend):
    name = "acme"
    vendor = "acme"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -10  # never preferred over the built-in gloo by automatic selection

    def probe(self) -> ProbeResult:
        try:
            import torch.distributed as dist
        except ImportError as e:
            return ProbeResult(False, f"torch is not importable: {e}")
        if not dist.is_gloo_available():
            return ProbeResult(False, "acme runs on gloo, which this torch lacks")
        return ProbeResult(True, "acme example backend (gloo underneath)", 1, {"acme": "0.1.0"})

    def accelerator(self) -> CpuAccelerator:
        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        return (
            CapabilityTable.builder(self.name)
            .native(MOVING, NATIVE_DTYPES, note="acme docs: float32/float64/int64 only")
            .native(REDUCING, NATIVE_DTYPES, [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX],
                    note="acme docs: SUM/MIN/MAX")
            .build()
        )

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def vendor_env(self, config: Any) -> dict[str, str]:
        return {"ACME_TIMEOUT_MS": str(int(config.collective_timeout_s * 1000))}


@hookimpl
def vcga_backends() -> list[Backend]:
    return [AcmeBackend()]
