"""Cambricon MLU: torch_mlu + CNCL, through torch_mlu's ``ProcessGroupCNCL``.

Read in Cambricon/torch_mlu (release branch r1.22_pt2.4.0, the newest release in the public
snapshot; the r2.x develop branches are cited where they differ) -- every statement cites the file:

- the capability table: ``torch_mlu/csrc/framework/distributed/process_group_cncl.cpp``
  (``cncl_op``, ``cncl_data_type``, ``getCnclDataType``, ``getCnclReduceOp``) and
  ``cncl_utils.cpp`` (``to_cncl_data_type``);
- the factory: ``torch_mlu/csrc/python/ProcessGroupCNCL.cpp`` (pybind constructors) and the
  creator ``torch_mlu/mlu/cncl.py`` registers for the ``cncl`` backend;
- the fp64 caveat: ``torch_mlu/csrc/aten/utils/types.cpp`` ("pytorch 64bit is using on-chip
  32bit") and ``tensor_util.cpp`` ("MLU operators don't support 64-bit calculation");
- versions: ``torch_mlu.__version__`` and ``torch_mlu.mlu.cncl.version()``;
- the environment: ``TORCH_CNCL_*`` in ``process_group_cncl.hpp``; ``MLU_VISIBLE_DEVICES``.

``import torch_mlu`` happens only inside :meth:`MluBackend.probe` and later calls.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

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

log = logging.getLogger(__name__)

VISIBLE_DEVICES_ENV = "MLU_VISIBLE_DEVICES"
INSTALL_HINT = "install torch_mlu from Cambricon's Neuware channel, matching your torch and CNToolkit"

# ---------------------------------------------------------------------------------------------------
# Capability table
# ---------------------------------------------------------------------------------------------------

#: process_group_cncl.cpp cncl_data_type: kChar, kByte, kFloat, kInt, kLong, kHalf, kBool (as
#: cnclUint8), kBFloat16 -- and kDouble, mapped to cnclFloat (below). Anything else: "Unsupported
#: data type for CNCL process group" (getCnclDataType).
CNCL_NATIVE = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32")
FLOATS = ("float16", "bfloat16", "float32")
_ARITH_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
#: Every op VCGA offers on fp64 through CNCL, by reducing the raw fp64 bytes itself.
_FP64_OPS = _ARITH_OPS + (ReduceOp.AVG, ReduceOp.PREMUL_SUM)


def cncl_capabilities(name: str = "mlu") -> CapabilityTable:
    """What ProcessGroupCNCL does with each (collective, dtype, op); each statement cites its source."""
    return (
        CapabilityTable.builder(name)
        # Everything not stated below: outside ProcessGroupCNCL's dtype and op maps (a later
        # statement overrides an earlier one; build() still derives VCGA's emulations here).
        .refuse(list(Collective), dtypes.ALL, None, final=False,
                note="not in process_group_cncl.cpp cncl_data_type / cncl_op")
        # process_group_cncl.cpp cncl_data_type / getCnclDataType (bool as cnclUint8).
        .native(MOVING, CNCL_NATIVE, note="process_group_cncl.cpp getCnclDataType (bool as cnclUint8)")
        # process_group_cncl.cpp cncl_op: MIN/MAX/SUM/PRODUCT -> cnclMin/cnclMax/cnclSum/cnclProd;
        # getCnclReduceOp: "For bool tensors, map sum to max".
        .native(REDUCING, CNCL_NATIVE, _ARITH_OPS,
                note="process_group_cncl.cpp cncl_op cnclSum/cnclProd/cnclMin/cnclMax; bool SUM -> cnclMax")
        # getCnclReduceOp (r1.22): "Cannot use ReduceOp.AVG with CNCL". The r2.x develop branches
        # divide around cnclSum themselves -- VCGA's sum_then_divide, so the result is the same.
        .refuse(REDUCING, FLOATS, [ReduceOp.AVG], final=False,
                note="process_group_cncl.cpp getCnclReduceOp: 'Cannot use ReduceOp.AVG with CNCL'")
        # cncl_op has no PREMUL_SUM: getCnclReduceOp "Unhandled ReduceOp".
        .refuse(REDUCING, FLOATS, [ReduceOp.PREMUL_SUM], final=False,
                note="process_group_cncl.cpp getCnclReduceOp: 'Unhandled ReduceOp' for PREMUL_SUM")
        # getCnclDataType: int16, uint16/32/64, fp8, complex are "Unsupported data type for CNCL
        # process group"; VCGA widens or bit-casts them onto the native dtypes.
        .refuse(MOVING + REDUCING, ("int16", "uint16", "uint32", "uint64") + dtypes.FP8 + dtypes.COMPLEX, None,
                final=False,
                note="process_group_cncl.cpp getCnclDataType: 'Unsupported data type for CNCL process group'")
        # cncl_data_type {at::kDouble, cnclFloat}: CNCL would move and reduce fp64 as fp32 without a
        # word. VCGA never hands fp64 to CNCL: it moves the bytes as int64 and reduces fp64 itself.
        # On a real MLU the values are already fp32-rounded on upload (types.cpp), and any fp64
        # arithmetic on the chip runs as fp32 -- so gather_then_reduce must reduce on the host
        # (through vcga_tensor_to_host) to add no further rounding.
        .emulate(MOVING, ["float64"], via="bitcast:int64",
                 note="process_group_cncl.cpp cncl_data_type maps kDouble to cnclFloat; VCGA moves fp64 bytes as int64")
        .emulate(REDUCING, ["float64"], _FP64_OPS, via="gather_then_reduce",
                 note="process_group_cncl.cpp cncl_data_type maps kDouble to cnclFloat (fp64 reduced as fp32); "
                      "VCGA reduces fp64 itself")
        # getCnclReduceOp: "Cannot use ReduceOp.BAND with CNCL" (BOR, BXOR). Stays refused.
        .refuse(REDUCING, dtypes.ALL, BITWISE,
                note="CNCL has no bitwise reduce ops (process_group_cncl.cpp getCnclReduceOp: "
                     "'Cannot use ReduceOp.BAND with CNCL'); use gloo, or MAX/MIN for bool")
        .build()
    )


#: torch_mlu/csrc/aten/utils/types.cpp CNNL_TYPE_AND_SCALAR_TYPE_WITHOUT_DOUBLE: the dtypes an MLU
#: holds as themselves. float64 and complex128 are absent on purpose: the chip stores them as
#: float32 / complex64 ("pytorch 64bit is using on-chip 32bit"), so they are not held without loss.
#: uint16/32/64 have no CNNL type; fp8 arrives only in the r2.x develop branches.
MLU_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "complex64")


# ---------------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------------


class MluBackend(Backend):
    """Cambricon MLUs through torch_mlu and its ProcessGroupCNCL."""

    name = "mlu"
    vendor = "cambricon"
    device_type = "mlu"
    dist_backend = "cncl"
    priority = 100
    requires = ("torch_mlu",)
    #: Seconds ``cnmon topo -m`` may take before the topology is reported unknown.
    topology_timeout_s: float = 10.0

    def __init__(self) -> None:
        self._table: CapabilityTable | None = None

    def probe(self) -> ProbeResult:
        torch_mlu, reason = import_vendor_module("torch_mlu", INSTALL_HINT)
        if torch_mlu is None:
            return ProbeResult(False, reason)
        import torch

        n, reason = count_devices("mlu", "MLU", VISIBLE_DEVICES_ENV)
        if not n:
            return ProbeResult(False, reason)
        versions = {"torch": torch.__version__, "torch_mlu": str(getattr(torch_mlu, "__version__", "unknown")),
                    "cncl": _cncl_version(torch_mlu)}
        return ProbeResult(True, f"{n} MLU device(s), torch_mlu {versions['torch_mlu']}, CNCL {versions['cncl']}",
                           n, versions)

    def accelerator(self) -> DeviceModuleAccelerator:
        if import_vendor_module("torch_mlu", INSTALL_HINT)[0] is None:  # importing it registers torch.mlu
            raise VcgaBackendUnavailable(self.name, self.probe().reason)

        return DeviceModuleAccelerator("mlu", VISIBLE_DEVICES_ENV, MLU_DTYPES)

    def capabilities(self) -> CapabilityTable:
        if self._table is None:
            self._table = cncl_capabilities(self.name)
        return self._table

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup:
        """``ProcessGroupCNCL(store, rank, size, timeout)``: the constructor torch_mlu's own ``cncl``
        creator calls (torch_mlu/mlu/cncl.py). It builds the vendor's ``ProcessGroupCNCL::Options``
        in C++ (``Options::create()``, ``is_high_priority_stream = false``, ``timeout``) --
        ProcessGroupCNCL.cpp init lambda. The Python ``Options`` object is not used: its binding
        inherits ``_timeout`` from ``ProcessGroup.Options`` while the C++ struct derives from
        ``Backend::Options``, so setting the timeout through it is not what torch_mlu exercises."""
        check_group_args(rank, world_size, timeout)
        torch_mlu, reason = import_vendor_module("torch_mlu", INSTALL_HINT)
        if torch_mlu is None:
            raise VcgaBackendUnavailable(self.name, reason)
        try:
            return torch_mlu._MLUC.ProcessGroupCNCL(store, rank, world_size, timeout)
        except Exception as e:
            raise VcgaBackendUnavailable(
                self.name, f"ProcessGroupCNCL(rank={rank}, size={world_size}) failed: {type(e).__name__}: {e}") from e

    def vendor_env(self, config: Config) -> dict[str, str]:
        """See docs/vendor-env.md for the whole table and the reason for each line."""
        env = {
            # The timeout itself travels to the ProcessGroupCNCL constructor. torch_mlu's default
            # TORCH_CNCL_ASYNC_ERROR_HANDLING is 0 (NoHandling): a timed-out collective would never
            # raise. With blocking wait, WorkCNCL::wait raises at the timeout (VCGA makes it typed).
            "TORCH_CNCL_BLOCKING_WAIT": "1",
        }
        if config.visible_devices is not None:
            env[VISIBLE_DEVICES_ENV] = visible_devices_value(config.visible_devices)
        # buffer_size_mb, deterministic and the network section (interface, traffic class, service
        # level): neither torch_mlu's process group nor any CNCL document we could find names a
        # variable for them (CNCL's documented ones mirror NCCL's for transports: CNCL_IB_DISABLE,
        # CNCL_SHM_DISABLE, CNCL_P2P_LEVEL, CNCL_IB_GID_INDEX); not applied rather than guessed
        # (docs/vendor-env.md). The bridge's exchange between nodes still follows the interface.
        return env

    def topology(self) -> Topology:
        return topology_from_tool(["cnmon", "topo", "-m"], "MLU", self.topology_timeout_s)


def _cncl_version(torch_mlu: object) -> str:
    """torch_mlu.mlu.cncl.version() -> (major, minor, patch); "unknown" where it fails."""
    try:
        return ".".join(str(x) for x in torch_mlu.mlu.cncl.version())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return "unknown"


# ---------------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------------

_fp64_warned = threading.Event()


@hookimpl
def vcga_backends() -> list[Backend]:
    return [MluBackend()]


@hookimpl
def vcga_tensor_to_host(tensor: torch.Tensor) -> torch.Tensor | None:
    """MLU tensors: copied to the host and made C-contiguous.

    The fp64 caveat: the MLU keeps float64 / complex128 as float32 / complex64 on the chip
    (torch_mlu casts on upload, warning "MLU operators don't support 64-bit calculation"). The host
    copy is float64 again but carries float32 precision -- lost on upload, not here; VCGA logs it
    once per process.
    """
    if tensor.device.type != "mlu":
        return None
    import torch

    if tensor.dtype in (torch.float64, torch.complex128) and not _fp64_warned.is_set():
        _fp64_warned.set()
        log.warning("an MLU %s tensor holds %s precision only: torch_mlu stores 64-bit floats as 32-bit "
                    "on the chip; the host copy cannot restore what was lost on upload",
                    dtypes.from_torch(tensor.dtype), "float32" if tensor.dtype == torch.float64 else "complex64")
    return to_host_contiguous(tensor)
