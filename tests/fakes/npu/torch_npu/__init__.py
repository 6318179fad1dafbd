"""FAKE torch_npu for tests (see tests/fakes/README.md) -- no Ascend hardware, no CANN.

Follows Ascend/pytorch's ``torch_npu/__init__.py``: refuses to load next to another accelerator
(``_check_device_conflict``), then registers the device (``_init/registry/backend.py:
register_privateuse1_backend``: ``torch.utils.rename_privateuse1_backend("npu")``,
``torch._register_device_module("npu", torch_npu.npu)``) and the ``hccl`` distributed backend
(``_init/registry/distributed.py``); exports ``__version__`` (``torch_npu/version.py``),
``get_npu_format`` / ``npu_format_cast`` (``csrc/aten/npu_native_functions.yaml``) and ``Format``
(``npu/_format.py``).
"""

import os
from enum import IntEnum

_err = os.environ.get("VCGA_FAKE_TORCH_NPU_IMPORT_ERROR")
if _err:
    # What a torch_npu without CANN does: its extension cannot load libhccl.so / libascendcl.so.
    raise ImportError(_err)

import torch  # noqa: E402
import torch.distributed  # noqa: E402

#: Every call a VCGA plugin makes into this fake, in order: (name, args, kwargs).
_fake_calls: list = []


def _check_device_conflict():
    # torch_npu/__init__.py _check_device_conflict, message shortened.
    acc = torch._C._get_accelerator()
    if acc.type not in ("cpu", "npu"):
        raise RuntimeError(f"Two accelerators cannot be used at the same time in PyTorch: npu and {acc.type}.")


_check_device_conflict()

import torch_npu._C  # noqa: E402
import torch_npu._C._distributed_c10d  # noqa: E402
import torch_npu.npu  # noqa: E402
from torch_npu.version import __version__  # noqa: E402,F401


class Format(IntEnum):
    """torch_npu/npu/_format.py: NPU storage formats (aclFormat values)."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33


def get_npu_format(tensor):
    """``get_npu_format(Tensor self) -> int``; the real one is patched to return ``Format``."""
    _fake_calls.append(("get_npu_format", (tensor,), {}))
    return Format(tensor.npu_format)


def npu_format_cast(tensor, acl_format, *, customize_dtype=None, input_dtype=None):
    """``npu_format_cast(Tensor self, int acl_format, *, int? customize_dtype=None, int? input_dtype=None)``."""
    from vcga_fake_device import FakeDeviceTensor

    _fake_calls.append(("npu_format_cast", (tensor, int(acl_format)), {}))
    return FakeDeviceTensor(tensor.payload, "npu", _fake_calls, npu_format=int(acl_format))


def _register():
    # _init/registry/backend.py register_privateuse1_backend
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", torch_npu.npu)
    # _init/registry/distributed.py register_distributed_backend_for_npu
    torch.distributed.Backend.register_backend(
        "hccl",
        lambda dist_backend_opts, pg_options: torch_npu._C._distributed_c10d.ProcessGroupHCCL(
            dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size,
            torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()),
        extended_api=True,
        devices=["npu"],
    )


_register()
