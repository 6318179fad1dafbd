"""FAKE torch_npu.npu: the device module torch_npu registers as ``torch.npu`` (see tests/fakes/README.md).

Names and signatures follow torch_npu/npu/__init__.py (``device_count``, ``is_available``,
``get_device_properties(device_name=None)``), npu/utils.py (``synchronize(device=None)``,
``set_device(device)``, ``current_device()``, ``current_stream(device=None)``), npu/memory.py,
npu/random.py (``get_rng_state(device='npu')``, ``set_rng_state(new_state, device='npu')``,
``manual_seed_all(seed)``) and npu/streams.py (``Stream``, ``Event``).
"""

import sys

from vcga_fake_device import make_device_module

import torch_npu

make_device_module(sys.modules[__name__], "npu", "VCGA_FAKE_NPU_COUNT", "VCGA_FAKE_NPU_DRIVER_ERROR", 8,
                   "Ascend910B3", torch_npu._fake_calls)

from torch_npu.npu import utils  # noqa: E402,F401
