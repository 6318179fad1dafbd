"""FAKE torch_npu.npu.utils: ``get_cann_version(module="CANN")`` (torch_npu/npu/utils.py), which
reads the installed CANN packages' versions (``torch_npu._C._get_cann_version``)."""

import torch_npu

_VERSIONS = {"CANN": "8.3.RC1", "HCCL": "8.3.RC1", "RUNTIME": "8.3.RC1", "DRIVER": "25.2.0"}


def get_cann_version(module="CANN"):
    torch_npu._fake_calls.append(("get_cann_version", (), {"module": module}))
    return _VERSIONS[module]
