"""FAKE torch_mlu for tests (see tests/fakes/README.md) -- no Cambricon hardware, no Neuware.

Follows Cambricon/torch_mlu r1.22_pt2.4.0 ``torch_mlu/__init__.py``: ``from torch_mlu import
_MLUC``, ``import torch_mlu.mlu`` (whose ``cncl`` module registers the ``cncl`` backend),
``__version__ = _MLUC._get_version()``, then ``torch.utils.rename_privateuse1_backend("mlu")`` and
``torch._register_device_module('mlu', torch_mlu.mlu)``.
"""

import os

_err = os.environ.get("VCGA_FAKE_TORCH_MLU_IMPORT_ERROR")
if _err:
    # What a torch_mlu without Neuware does: its extension cannot load libcnrt.so / libcncl.so.
    raise ImportError(_err)

import torch  # noqa: E402
import torch.distributed  # noqa: E402

#: Every call a VCGA plugin makes into this fake, in order: (name, args, kwargs).
_fake_calls: list = []

import torch_mlu.mlu  # noqa: E402
from torch_mlu import _MLUC  # noqa: E402


def get_version():
    return _MLUC._get_version()


__version__ = get_version()

torch.utils.rename_privateuse1_backend("mlu")
torch._register_device_module("mlu", torch_mlu.mlu)
