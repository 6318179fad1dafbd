"""Huawei Ascend: torch_npu + HCCL, through torch_npu's ``ProcessGroupHCCL``.

Read in Ascend/pytorch (master, 2026) -- every statement below cites the file and function:

- the capability table: ``torch_npu/csrc/distributed/HCCLUtils.cpp`` (``kScalarTypeToHcclDataType``,
  ``getHcclDataType``) and ``ProcessGroupHCCL.cpp`` (``hcclOp``, ``unsupportedOp``,
  ``getHcclReduceOp``, ``checkSupportedDataType``, the pre/post hooks of ``allreduce``);
- the factory: ``torch_npu/_init/registry/distributed.py: _new_process_group_hccl_helper`` and the
  pybind signature in ``torch_npu/csrc/distributed/Init.cpp``;
- the to-host hook: ``torch_npu.get_npu_format`` / ``torch_npu.npu_format_cast``
  (``npu_native_functions.yaml``), the base formats of ``FormatHelper.cpp: InitializeInfo``;
- versions: ``torch_npu.__version__``, ``torch_npu.npu.utils.get_cann_version(module=...)``;
- the environment: CANN's HCCL environment-variable reference and ``TORCH_HCCL_*`` in
  ``ProcessGroupHCCL.hpp``.

``import torch_npu`` happens only inside :meth:`HcclBackend.probe` and later calls, never when vcga
or this plugin is imported: torch_npu without CANN makes the import fail, and torch_npu refuses to
load next to another accelerator ("Two accelerators cannot be used at the same time in PyTorch").
"""

from __future__ import annotations

import math
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
    import_vendor_module,
    to_host_contiguous,
    topology_from_tool,
    visible_devices_value,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
INSTALL_HINT = "install torch-npu matching your torch and your Ascend CANN toolkit"

# ---------------------------------------------------------------------------------------------------
# Capability table
# ---------------------------------------------------------------------------------------------------

#: ProcessGroupHCCL.cpp checkSupportedDataType: the HcclDataTypes every SoC reduces --
#: INT8, INT16, INT32, FP16, FP32, BFP16, INT64 -- plus bool and uint8, which allreduce/reduce/
#: reduce_scatter cast to int32 in their pre-hook (``_npu_dtype_cast(tensor, at::kInt)``) and copy
#: back in the post-hook. The same set is what every torch_npu release (v1.11 to master) moves
#: natively (HCCLUtils.cpp kScalarTypeToHcclDataType; bool travels as HCCL_DATA_TYPE_UINT8).
HCCL_NATIVE = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32")
#: fp64 is mapped (HCCL_DATA_TYPE_FP64) by every release, fp8 and uint16/32/64 only by recent
#: ones; checkSupportedDataType reduces uint64/fp64 only on Ascend950 and the others never. VCGA
#: moves all of them as same-width integers, bit-exact whatever the torch_npu, CANN or SoC.
HCCL_VERSION_DEPENDENT = ("uint16", "uint32", "uint64", "float64", "float8_e4m3fn", "float8_e5m2")
FLOATS = ("float16", "bfloat16", "float32")
_ARITH_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def hccl_capabilities(name: str = "hccl") -> CapabilityTable:
    """What ProcessGroupHCCL does with each (collective, dtype, op); each statement cites its source."""
    return (
        CapabilityTable.builder(name)
        # Everything not stated below: outside ProcessGroupHCCL's dtype and op maps (a later
        # statement overrides an earlier one; build() still derives VCGA's emulations here).
        .refuse(list(Collective), dtypes.ALL, None, final=False,
                note="not in HCCLUtils.cpp kScalarTypeToHcclDataType / ProcessGroupHCCL.cpp hcclOp")
        # HCCLUtils.cpp kScalarTypeToHcclDataType / getHcclDataType; ProcessGroupHCCL.cpp:
        # "AllGather & Broadcast support all data type, no need do more check".
        .native(MOVING, HCCL_NATIVE,
                note="HCCLUtils.cpp getHcclDataType (bool as HCCL_DATA_TYPE_UINT8)")
        # ProcessGroupHCCL.cpp hcclOp: MIN/MAX/SUM/PRODUCT -> HCCL_REDUCE_*; checkSupportedDataType;
        # getHcclReduceOp maps bool SUM to HCCL_REDUCE_MAX; bool/uint8 go through int32 and back.
        .native(REDUCING, HCCL_NATIVE, _ARITH_OPS,
                note="ProcessGroupHCCL.cpp hcclOp HCCL_REDUCE_SUM/PROD/MIN/MAX, checkSupportedDataType; "
                     "bool/uint8 reduced as int32 (allreduce pre-hook _npu_dtype_cast)")
        # getHcclReduceOp: "HCCL does not support ReduceOp::AVG yet / PTA supports it by summing
        # first, then dividing" (post-hook tensor.div_(getSize())): that is VCGA's sum_then_divide.
        .refuse(REDUCING, FLOATS, [ReduceOp.AVG], final=False,
                note="ProcessGroupHCCL.cpp getHcclReduceOp: AVG runs as HCCL_REDUCE_SUM then div_ by the size")
        # getHcclReduceOp: PREMUL_SUM is tensor.mul_(factor) (pre-hook) then HCCL_REDUCE_SUM:
        # VCGA's mul_then_sum.
        .refuse(REDUCING, FLOATS, [ReduceOp.PREMUL_SUM], final=False,
                note="ProcessGroupHCCL.cpp getHcclReduceOp: PREMUL_SUM runs as mul_ then HCCL_REDUCE_SUM")
        # HCCLUtils.cpp kScalarTypeToHcclDataType: fp64 in every release, the rest in recent ones.
        .refuse(MOVING, HCCL_VERSION_DEPENDENT, None, final=False,
                note="HCCLUtils.cpp kScalarTypeToHcclDataType: fp8/uint16/uint32/uint64 only in recent "
                     "torch_npu; support depends on torch_npu, CANN and SoC")
        # checkSupportedDataType: uint64/fp64 reductions only on Ascend950 (Atlas A5); fp8 and
        # uint16/uint32 never: "HCCL allreduce: Unsupported data type".
        .refuse(REDUCING, HCCL_VERSION_DEPENDENT, None, final=False,
                note="ProcessGroupHCCL.cpp checkSupportedDataType: 'Unsupported data type' (uint64/fp64 "
                     "only on Ascend950); reduce in a supported dtype, or on gloo")
        # getHcclDataType has no complex: "Unsupported data type for HCCL process group".
        .refuse(MOVING + REDUCING, dtypes.COMPLEX, None, final=False,
                note="HCCLUtils.cpp getHcclDataType: 'Unsupported data type for HCCL process group'")
        # ProcessGroupHCCL.cpp unsupportedOp / getHcclReduceOp: "Cannot use ReduceOp.BAND with HCCL".
        .refuse(REDUCING, dtypes.ALL, BITWISE,
                note="HCCL has no bitwise reduce ops (ProcessGroupHCCL.cpp getHcclReduceOp: "
                     "'Cannot use ReduceOp.BAND with HCCL'); use gloo, or MAX/MIN for bool")
        .build()
    )


# ---------------------------------------------------------------------------------------------------
# Ascend storage formats (the to-host hook)
# ---------------------------------------------------------------------------------------------------

# aclFormat values (torch_npu/npu/_format.py: class Format). The base formats are those
# FormatHelper::IsBaseFormatType accepts (GetBaseFormat(f) == f): their memory is the logical
# tensor. Every other format is a private tiling that must be cast to its base before the bytes
# mean anything off the NPU.
ACL_FORMAT_NCHW, ACL_FORMAT_NHWC, ACL_FORMAT_ND, ACL_FORMAT_NCDHW = 0, 1, 2, 30
BASE_FORMATS = frozenset({ACL_FORMAT_NCHW, ACL_FORMAT_NHWC, ACL_FORMAT_ND, ACL_FORMAT_NCDHW})
#: FormatHelper.cpp InitializeInfo: private format -> its base format; GetBaseFormat returns ND
#: for any format missing from that table.
BASE_OF = {
    3: ACL_FORMAT_NCHW,     # NC1HWC0
    4: ACL_FORMAT_NCHW,     # FRACTAL_Z
    27: ACL_FORMAT_NCDHW,   # NDHWC
    29: ACL_FORMAT_ND,      # FRACTAL_NZ
    32: ACL_FORMAT_NCDHW,   # NDC1HWC0
    33: ACL_FORMAT_NCDHW,   # FRACTAL_Z_3D
    50: ACL_FORMAT_ND, 51: ACL_FORMAT_ND, 52: ACL_FORMAT_ND, 53: ACL_FORMAT_ND, 54: ACL_FORMAT_ND,  # NZ_C0_*
}


def to_base_format(tensor: torch.Tensor) -> torch.Tensor:
    """An NPU tensor in its base (ND-like) format: ``npu_format_cast`` when its storage format is
    private (FRACTAL_NZ, NC1HWC0, ...), the tensor itself otherwise."""
    import torch_npu

    fmt = int(torch_npu.get_npu_format(tensor))
    if fmt in BASE_FORMATS:
        return tensor
    return torch_npu.npu_format_cast(tensor, BASE_OF.get(fmt, ACL_FORMAT_ND))


# ---------------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------------


class HcclBackend(Backend):
    """Ascend NPUs through torch_npu and its ProcessGroupHCCL."""

    name = "hccl"
    vendor = "huawei"
    device_type = "npu"
    dist_backend = "hccl"
    priority = 100
    requires = ("torch_npu",)
    #: Seconds ``npu-smi info -t topo`` may take before the topology is reported unknown.
    topology_timeout_s: float = 10.0

    def __init__(self) -> None:
        self._table: CapabilityTable | None = None

    def probe(self) -> ProbeResult:
        torch_npu, reason = import_vendor_module("torch_npu", INSTALL_HINT)
        if torch_npu is None:
            return ProbeResult(False, reason)
        import torch

        n, reason = count_devices("npu", "NPU", VISIBLE_DEVICES_ENV)
        if not n:
            return ProbeResult(False, reason)
        versions = {"torch": torch.__version__, "torch_npu": str(getattr(torch_npu, "__version__", "unknown")),
                    "cann": _cann_version(torch_npu, "CANN")}
        hccl = _cann_version(torch_npu, "HCCL")
        if hccl != "unknown":
            versions["hccl"] = hccl
        return ProbeResult(True, f"{n} NPU device(s), torch_npu {versions['torch_npu']}, CANN {versions['cann']}",
                           n, versions)

    def accelerator(self) -> DeviceModuleAccelerator:
        if import_vendor_module("torch_npu", INSTALL_HINT)[0] is None:  # importing it registers torch.npu
            raise VcgaBackendUnavailable(self.name, self.probe().reason)

        # torch_npu CalcuOpUtil.cpp ACL_TYPE_TO_SCALAR_TYPE_MAP: every canonical dtype has an ACL type.
        return DeviceModuleAccelerator("npu", VISIBLE_DEVICES_ENV, dtypes.ALL)

    def capabilities(self) -> CapabilityTable:
        if self._table is None:
            self._table = hccl_capabilities(self.name)
        return self._table

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup:
        """``ProcessGroupHCCL(store, rank, size, options)`` with the options torch_npu's own
        ``_new_process_group_hccl_helper`` builds: ``ProcessGroupHCCL.Options()``,
        ``is_high_priority_stream = False``, ``_timeout = timeout``."""
        check_group_args(rank, world_size, timeout)
        torch_npu, reason = import_vendor_module("torch_npu", INSTALL_HINT)
        if torch_npu is None:
            raise VcgaBackendUnavailable(self.name, reason)
        pg_class = torch_npu._C._distributed_c10d.ProcessGroupHCCL
        options = pg_class.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        try:
            return pg_class(store, rank, world_size, options)
        except Exception as e:
            raise VcgaBackendUnavailable(
                self.name, f"ProcessGroupHCCL(rank={rank}, size={world_size}) failed: {type(e).__name__}: {e}") from e

    def vendor_env(self, config: Config) -> dict[str, str]:
        """See docs/vendor-env.md for the whole table and the reason for each line."""
        timeout = max(1, math.ceil(config.collective_timeout_s))
        env = {
            # Device-side wait for peers inside a collective (seconds; 0 would mean "never").
            "HCCL_EXEC_TIMEOUT": str(timeout),
            # Link set-up when the communicator is created; HCCL accepts [120, 7200] seconds.
            "HCCL_CONNECT_TIMEOUT": str(min(7200, max(120, timeout))),
            # Raise a timed-out collective in the waiting thread (VCGA makes it a typed error)
            # instead of letting the watchdog tear the process down.
            "TORCH_HCCL_BLOCKING_WAIT": "1",
        }
        if config.buffer_size_mb is not None:
            env["HCCL_BUFFSIZE"] = str(config.buffer_size_mb)  # HCCL takes MB (default 200)
        if config.deterministic:
            env["HCCL_DETERMINISTIC"] = "true"
        if config.visible_devices is not None:
            env[VISIBLE_DEVICES_ENV] = visible_devices_value(config.visible_devices)
        if config.network_interface is not None:
            # The host NIC HCCL uses to reach the root node when it builds a communicator; "=" makes
            # the names exact (as NCCL's syntax), the first one found is used.
            env["HCCL_SOCKET_IFNAME"] = "=" + ",".join(config.network_interface)
        if config.network_traffic_class is not None:
            env["HCCL_RDMA_TC"] = str(config.network_traffic_class)  # [0, 255], a multiple of 4: DSCP x 4
        if config.network_service_level is not None:
            env["HCCL_RDMA_SL"] = str(config.network_service_level)  # [0, 7]: the NIC's PFC priority
        return env

    def topology(self) -> Topology:
        return topology_from_tool(["npu-smi", "info", "-t", "topo"], "NPU", self.topology_timeout_s)


def _cann_version(torch_npu: Any, module: str) -> str:
    """torch_npu.npu.utils.get_cann_version(module=...) (torch_npu >= 2.1); "unknown" where absent."""
    try:
        return str(torch_npu.npu.utils.get_cann_version(module=module))
    except Exception:  # noqa: BLE001 - older torch_npu lacks it; a version is never worth a failure
        return "unknown"


# ---------------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------------


@hookimpl
def vcga_backends() -> list[Backend]:
    return [HcclBackend()]


@hookimpl
def vcga_tensor_to_host(tensor: torch.Tensor) -> torch.Tensor | None:
    """NPU tensors: private storage formats (FRACTAL_NZ, NC1HWC0, ...) cast to their base format
    on the device, then copied to the host and made C-contiguous."""
    if tensor.device.type != "npu":
        return None
    return to_host_contiguous(to_base_format(tensor.detach()))
