"""FAKE torch_mlu.mlu: the device module torch_mlu registers as ``torch.mlu`` (see tests/fakes/README.md).

Names follow torch_mlu/mlu/{device,memory,random,streams}.py, which copy torch.cuda's; like the real
``torch_mlu/mlu/__init__.py`` it does ``from .cncl import *``.
"""

import sys

from vcga_fake_device import make_device_module

import torch_mlu

make_device_module(sys.modules[__name__], "mlu", "VCGA_FAKE_MLU_COUNT", "VCGA_FAKE_MLU_DRIVER_ERROR", 4,
                   "MLU370-X8", torch_mlu._fake_calls)

from .cncl import *  # noqa: E402, F403
