"""NVIDIA: torch.cuda + NCCL, through torch's own ``ProcessGroupNCCL``.

Everything here follows the code that runs on the hardware, read in its source:

- the capability table: torch's ``NCCLUtils.hpp`` (the ``ncclDataType`` map, shipped in the wheel as
  ``torch/include/torch/csrc/distributed/c10d/NCCLUtils.hpp``) and ``ProcessGroupNCCL.cpp``
  (``ncclOp``, ``getNcclReduceOp``, ``allreduce``), plus NCCL's documentation of ``ncclAvg`` and
  ``ncclRedOpCreatePreMulSum``;
- the factory: ``torch/distributed/distributed_c10d.py: _new_process_group_helper`` (the NCCL branch);
- the environment: NCCL's environment-variable documentation and torch's ``TORCH_NCCL_*`` variables.

Nothing is imported from torch until a method is called: ``import vcga`` stays light.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vcga import dtypes
from vcga.config import Config
from vcga.contract import (
    BITWISE,
    MOVING,
    REDUCING,
    Backend,
    CapabilityTable,
    Collective,
    ProbeResult,
    ReduceOp,
    Topology,
    hookimpl,
)
from vcga.errors import VcgaBackendUnavailable
from vcga.vendor import (
    DeviceModuleAccelerator,
    check_group_args,
    count_devices,
    to_host_contiguous,
    topology_from_tool,
    visible_devices_value,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as C10dBackend

log = logging.getLogger(__name__)

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"

# ---------------------------------------------------------------------------------------------------
# Capability table
# ---------------------------------------------------------------------------------------------------

_SRC_DTYPES = "torch NCCLUtils.hpp ncclDataType / ProcessGroupNCCL getNcclDataType"
#: Dtypes ProcessGroupNCCL hands to NCCL (NCCLUtils.hpp ``ncclDataType``): bool travels as
#: ncclUint8; fp8 as ncclFloat8e4m3/e5m2 (NCCL >= 2.24, else as ncclUint8 -- same bytes either way).
#: Everything else -- int16, uint16/32/64 -- raises "Input tensor data type is not supported for
#: NCCL process group" (getNcclDataType). Complex is viewed as real by allreduce only.
NCCL_MOVED = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
              "float8_e4m3fn", "float8_e5m2")
#: Dtypes NCCL reduces: the map above minus bool (handled below) and fp8 (ProcessGroupNCCL::allreduce:
#: "Float8 dtypes are not currenlty supported for NCCL reductions").
NCCL_REDUCED = ("uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
FLOATS = ("float16", "bfloat16", "float32", "float64")
_ARITH_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def nccl_capabilities(name: str = "nccl") -> CapabilityTable:
    """What ProcessGroupNCCL does with each (collective, dtype, op); each statement cites its source."""
    return (
        CapabilityTable.builder(name)
        # Everything not stated below: outside ProcessGroupNCCL's dtype and op maps (a later
        # statement overrides an earlier one; build() still derives VCGA's emulations here).
        .refuse(list(Collective), dtypes.ALL, None, final=False,
                note="not in torch NCCLUtils.hpp ncclDataType / ProcessGroupNCCL.cpp ncclOp")
        # NCCLUtils.hpp ncclDataType: every collective moves these dtypes natively.
        .native(MOVING, NCCL_MOVED, note=_SRC_DTYPES)
        # ProcessGroupNCCL.cpp ncclOp: MIN/MAX/SUM/PRODUCT -> ncclMin/ncclMax/ncclSum/ncclProd.
        .native(REDUCING, NCCL_REDUCED, _ARITH_OPS,
                note="ProcessGroupNCCL.cpp ncclOp: ncclSum/ncclProd/ncclMin/ncclMax")
        # ProcessGroupNCCL.cpp ncclOp {AVG, ncclAvg} (NCCL_HAS_AVG, NCCL >= 2.10); getNcclReduceOp
        # PREMUL_SUM -> ncclRedOpCreatePreMulSum for ncclHalf/ncclFloat/ncclBfloat16/ncclDouble.
        .native(REDUCING, FLOATS, [ReduceOp.AVG, ReduceOp.PREMUL_SUM],
                note="ProcessGroupNCCL.cpp getNcclReduceOp: ncclAvg (NCCL >= 2.10); "
                     "ncclRedOpCreatePreMulSum for half/float/bfloat16/double (NCCL >= 2.11.1)")
        # getNcclReduceOp: "For bool tensors, map sum to max"; bool travels as ncclUint8, so
        # PRODUCT/MIN/MAX on {0, 1} are the logical and/or they mean.
        .native(REDUCING, ["bool"], _ARITH_OPS,
                note="ProcessGroupNCCL.cpp getNcclReduceOp: bool SUM -> ncclMax; bool as ncclUint8")
        # What the library refuses but VCGA can compose from the native cells above (build()
        # derives the recipe; the library's reason stays in the cell's note):
        # getNcclDataType: "Input tensor data type is not supported for NCCL process group".
        .refuse(MOVING + REDUCING, ["int16", "uint16", "uint32", "uint64"], None, final=False,
                note="ProcessGroupNCCL.cpp getNcclDataType: "
                     "'Input tensor data type is not supported for NCCL process group'")
        # ProcessGroupNCCL::allreduce: fp8 reductions raise; VCGA reduces them in float32.
        .refuse(REDUCING, dtypes.FP8, None, final=False,
                note="ProcessGroupNCCL.cpp allreduce: 'Float8 dtypes are not currenlty supported for NCCL reductions'")
        # getNcclReduceOp: PREMUL_SUM only for floating types; ncclAvg on integers truncates, and
        # VCGA keeps AVG to floating dtypes as torch.distributed's other backends do.
        .refuse(REDUCING, dtypes.INTEGER, [ReduceOp.AVG, ReduceOp.PREMUL_SUM], final=False,
                note="ProcessGroupNCCL.cpp getNcclReduceOp: "
                     "'PreMulSum Data type must be half, float, bfloat16 or double'; "
                     "integer AVG would truncate")
        # getNcclReduceOp: bool AVG is a TypeError; PREMUL_SUM needs a floating type.
        .refuse(REDUCING, ["bool"], [ReduceOp.AVG, ReduceOp.PREMUL_SUM], final=False,
                note="ProcessGroupNCCL.cpp getNcclReduceOp: 'Cannot use ReduceOp.AVG with boolean inputs'")
        # getNcclReduceOp: "Cannot use ReduceOp.BAND with NCCL" (and BOR, BXOR). Stays refused.
        .refuse(REDUCING, dtypes.ALL, BITWISE,
                note="NCCL has no bitwise reduce ops (ProcessGroupNCCL.cpp getNcclReduceOp: "
                     "'Cannot use ReduceOp.BAND with NCCL'); use gloo, or MAX/MIN for bool")
        .build()
    )


# ---------------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------------


class NcclBackend(Backend):
    """NVIDIA GPUs through torch.cuda and torch's ProcessGroupNCCL."""

    name = "nccl"
    vendor = "nvidia"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100
    #: Seconds ``nvidia-smi topo -m`` may take before the topology is reported unknown.
    topology_timeout_s: float = 10.0

    def __init__(self) -> None:
        self._table: CapabilityTable | None = None

    def probe(self) -> ProbeResult:
        try:
            import torch
            import torch.distributed as dist
        except Exception as e:  # noqa: BLE001 - a broken torch install is a reason, not a crash
            return ProbeResult(False, f"torch is not importable: {type(e).__name__}: {e}")
        if torch.version.cuda is None:
            hip = getattr(torch.version, "hip", None)
            if hip:
                return ProbeResult(False, f"torch {torch.__version__} is a ROCm build (HIP {hip}); "
                                          "the nccl plugin drives NVIDIA CUDA only")
            return ProbeResult(False, f"torch {torch.__version__} was built without CUDA")
        if not dist.is_available() or not dist.is_nccl_available():
            return ProbeResult(False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) was built without NCCL")
        n, reason = count_devices("cuda", "CUDA", VISIBLE_DEVICES_ENV)
        if not n:
            return ProbeResult(False, reason)
        try:
            nccl = _nccl_version_string(torch.cuda.nccl.version())
        except Exception as e:  # noqa: BLE001 - libnccl missing or broken
            return ProbeResult(False, f"NCCL library error: {type(e).__name__}: {e}")
        return ProbeResult(True, f"{n} CUDA device(s), NCCL {nccl}", n,
                           {"torch": torch.__version__, "cuda": str(torch.version.cuda), "nccl": nccl})

    def accelerator(self) -> DeviceModuleAccelerator:
        # torch.cuda holds every dtype torch has.
        return DeviceModuleAccelerator("cuda", VISIBLE_DEVICES_ENV, dtypes.ALL)

    def capabilities(self) -> CapabilityTable:
        if self._table is None:
            self._table = nccl_capabilities(self.name)
        return self._table

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> C10dBackend:
        """``ProcessGroupNCCL(store, rank, size, options)`` with the options torch's own
        ``_new_process_group_helper`` builds: a fresh ``ProcessGroupNCCL.Options()``,
        ``is_high_priority_stream = False``, ``_timeout = timeout``."""
        check_group_args(rank, world_size, timeout)
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise VcgaBackendUnavailable(self.name, "this torch build has no ProcessGroupNCCL")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        except Exception as e:  # the vendor's error becomes ours, with its text
            raise VcgaBackendUnavailable(
                self.name, f"ProcessGroupNCCL(rank={rank}, size={world_size}) failed: {type(e).__name__}: {e}") from e

    def vendor_env(self, config: Config) -> dict[str, str]:
        """See docs/vendor-env.md for the whole table and the reason for each line."""
        env = {
            # The timeout itself travels in ProcessGroupNCCL.Options._timeout. Blocking wait makes
            # a timed-out collective raise in the waiting thread (VCGA turns it into a typed
            # error) instead of the watchdog tearing the process down (torch's default).
            "TORCH_NCCL_BLOCKING_WAIT": "1",
        }
        if config.buffer_size_mb is not None:
            env["NCCL_BUFFSIZE"] = str(config.buffer_size_mb * 1024 * 1024)  # NCCL takes bytes
        if config.visible_devices is not None:
            env[VISIBLE_DEVICES_ENV] = visible_devices_value(config.visible_devices)
        if config.deterministic:
            # NCCL has no determinism switch. Pinning the ring algorithm makes the reduction order
            # independent of message size and excludes in-switch reductions (NVLS, CollNet).
            env["NCCL_ALGO"] = "Ring"
        if config.network_interface is not None:
            # NCCL's syntax: "=" before a name matches it exactly (a bare name is a prefix).
            env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(config.network_interface)
        if config.network_traffic_class is not None:
            env["NCCL_IB_TC"] = str(config.network_traffic_class)  # the GRH traffic class (RoCE: ToS byte)
        if config.network_service_level is not None:
            env["NCCL_IB_SL"] = str(config.network_service_level)
        return env

    def topology(self) -> Topology:
        topo = topology_from_tool(["nvidia-smi", "topo", "-m"], "GPU", self.topology_timeout_s)
        if topo.source != "unknown":
            return topo
        nvml = _nvml_topology()
        return nvml if nvml is not None else topo


def _nccl_version_string(v: Any) -> str:
    """torch.cuda.nccl.version() is (major, minor, patch) or (major, minor, patch, suffix)."""
    if isinstance(v, int):  # very old torch: one packed int
        return str(v)
    parts = [str(x) for x in v[:3]]
    suffix = f"{v[3]}" if len(v) > 3 and v[3] else ""
    return ".".join(parts) + suffix


def _nvml_topology() -> Topology | None:
    """The link matrix from NVML (``pynvml``, the nvidia-ml-py binding torch.cuda also uses), when
    nvidia-smi is absent. None when pynvml is not installed or NVML fails."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    # nvmlDeviceGetTopologyCommonAncestor levels, named as nvidia-smi topo -m names them.
    levels = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
    try:
        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            matrix = []
            for i in range(n):
                row = []
                for j in range(n):
                    if i == j:
                        row.append("X")
                        continue
                    nvlink = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    if nvlink == pynvml.NVML_P2P_STATUS_OK:
                        row.append("NV")
                    else:
                        lvl = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                        row.append(levels.get(int(lvl), str(lvl)))
                matrix.append(row)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVML errors mean "unknown", never a crash
        log.debug("NVML topology failed: %r", e)
        return None
    return Topology(source="nvml", device_count=n, matrix=matrix, detail="NVML common ancestor / NVLink P2P status")


# ---------------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------------


@hookimpl
def vcga_backends() -> list[Backend]:
    return [NcclBackend()]


@hookimpl
def vcga_tensor_to_host(tensor: torch.Tensor) -> torch.Tensor | None:
    """CUDA tensors have no private layouts: copy to the host, then make C-contiguous."""
    if tensor.device.type != "cuda":
        return None
    return to_host_contiguous(tensor)
