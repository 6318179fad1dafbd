"""FAKE device runtime shared by the fake torch_npu and torch_mlu (tests only; see ../README.md).

Both vendors' device modules copy ``torch.cuda``'s API (torch_npu/npu/{__init__,utils,memory,random,
streams}.py; torch_mlu/mlu/{device,memory,random,streams}.py): ``device_count()``,
``set_device(device)``, ``current_device()``, ``synchronize(device=None)``,
``memory_allocated(device=None)``, ``memory_reserved(device=None)``,
``max_memory_allocated(device=None)``, ``get_device_properties(device)``, ``manual_seed(seed)``,
``manual_seed_all(seed)``, ``get_rng_state(device='<type>')``, ``set_rng_state(new_state,
device='<type>')``, ``current_stream(device=None)``, ``Stream(device=None, priority=0)``,
``Event(enable_timing=False, blocking=False, interprocess=False)``. :func:`make_device_module`
fills a module with exactly those names.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass

import torch

GiB = 1 << 30


@dataclass
class DeviceProperties:
    """What ``get_device_properties`` returns: torch_npu NPUDeviceProp / torch_mlu DeviceProp expose
    ``name`` and ``total_memory`` (torch_npu Module.cpp, torch_mlu Module.cpp)."""

    name: str
    total_memory: int


def make_device_module(module: types.ModuleType, device_type: str, count_env: str, error_env: str,
                       default_count: int, device_name: str, calls: list) -> None:
    """Populate ``module`` as the fake ``torch.<device_type>``; every call is logged in ``calls``."""
    state = {"current": 0, "seed": None, "rng": {}, "allocated": {}, "peak": {}}

    def count() -> int:
        err = os.environ.get(error_env)
        if err:
            raise RuntimeError(err)
        return int(os.environ.get(count_env, str(default_count)))

    def index(device, default_current=True) -> int:
        # The vendors accept an int, a "npu:1"-style string or a torch.device (_get_device_index).
        if device is None or device == device_type:
            return state["current"]
        if isinstance(device, str):
            device = int(device.split(":")[1])
        if isinstance(device, torch.device):
            device = device.index if device.index is not None else state["current"]
        if not 0 <= int(device) < count():
            raise RuntimeError(f"Invalid device, must be in range [0, {count()})")
        return int(device)

    def log(name, *args, **kwargs):
        calls.append((name, args, kwargs))

    def device_count() -> int:
        log("device_count")
        return count()

    def is_available() -> bool:
        log("is_available")
        return count() > 0

    def set_device(device) -> None:
        log("set_device", device)
        state["current"] = index(device)

    def current_device() -> int:
        log("current_device")
        return state["current"]

    def synchronize(device=None) -> None:
        log("synchronize", device)
        index(device)

    def memory_allocated(device=None) -> int:
        log("memory_allocated", device)
        return state["allocated"].get(index(device), 0)

    def max_memory_allocated(device=None) -> int:
        log("max_memory_allocated", device)
        return state["peak"].get(index(device), 0)

    def memory_reserved(device=None) -> int:
        log("memory_reserved", device)
        return 2 * state["allocated"].get(index(device), 0)

    def get_device_properties(device=None) -> DeviceProperties:
        log("get_device_properties", device)
        index(device)
        return DeviceProperties(device_name, 64 * GiB)

    def manual_seed(seed) -> None:
        log("manual_seed", seed)
        state["seed"] = int(seed)

    def manual_seed_all(seed) -> None:
        log("manual_seed_all", seed)
        state["seed"] = int(seed)
        for i in range(count()):
            state["rng"][i] = _rng_state_for(int(seed), i)

    def get_rng_state(device=device_type) -> torch.Tensor:
        log("get_rng_state", device=device)
        i = index(device)
        return state["rng"].get(i, _rng_state_for(0, i)).clone()

    def set_rng_state(new_state, device=device_type) -> None:
        log("set_rng_state", new_state, device=device)
        state["rng"][index(device)] = new_state.clone()

    class Stream:
        """``Stream(device=None, priority=0)`` (a _StreamBase subclass in both vendors)."""

        def __init__(self, device=None, priority=0, **kwargs):
            log("Stream", device=device, priority=priority)
            self.device_index = index(device)
            self.priority = priority
            self.waited_on: list = []

        def synchronize(self) -> None:
            pass

        def wait_stream(self, stream) -> None:
            self.waited_on.append(stream)

        def query(self) -> bool:
            return True

    class Event:
        """``Event(enable_timing=False, blocking=False, interprocess=False)``."""

        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            log("Event", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
            self.enable_timing = enable_timing
            self.recorded = False

        def record(self, stream=None) -> None:
            self.recorded = True

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return self.recorded

    def current_stream(device=None):
        log("current_stream", device)
        return Stream.__new__(Stream)  # the current stream exists already; no constructor call

    def _allocate(nbytes: int, device=None) -> None:
        """Test hook (not vendor API): pretend ``nbytes`` were allocated on ``device``."""
        i = index(device)
        state["allocated"][i] = state["allocated"].get(i, 0) + nbytes
        state["peak"][i] = max(state["peak"].get(i, 0), state["allocated"][i])

    for fn in (device_count, is_available, set_device, current_device, synchronize, memory_allocated,
               max_memory_allocated, memory_reserved, get_device_properties, manual_seed, manual_seed_all,
               get_rng_state, set_rng_state, current_stream, _allocate):
        setattr(module, fn.__name__, fn)
    module.Stream = Stream
    module.Event = Event


def _rng_state_for(seed: int, device: int) -> torch.Tensor:
    """A Philox-style state: 16 bytes, as the vendors' generators report (seed + offset)."""
    return torch.tensor(list((seed + 1000 * device).to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)


class FakeDevice:
    """``tensor.device`` of a fake device tensor: ``type`` and ``index`` like torch.device."""

    def __init__(self, type: str, index: int = 0) -> None:  # noqa: A002 - torch.device's own names
        self.type, self.index = type, index

    def __repr__(self) -> str:
        return f"device(type='{self.type}', index={self.index})"


class FakeDeviceTensor:
    """A tensor that lives on a device this machine lacks: its values are a CPU tensor
    (``payload``, any strides), plus the vendor's storage format where it has one. It offers what
    a to-host hook may use: ``device``, ``dtype``, ``shape``, ``detach()``, ``cpu()``."""

    def __init__(self, payload: torch.Tensor, device_type: str, calls: list, npu_format: int = 2) -> None:
        self.payload = payload
        self.device = FakeDevice(device_type)
        self.dtype = payload.dtype
        self.shape = payload.shape
        self.npu_format = npu_format
        self._calls = calls

    def detach(self) -> FakeDeviceTensor:
        self._calls.append(("Tensor.detach", (), {}))
        return self

    def cpu(self) -> torch.Tensor:
        # D2H copy: keeps the strides of a dense tensor, as torch's copy to CPU does.
        self._calls.append(("Tensor.cpu", (), {"npu_format": self.npu_format}))
        return self.payload.clone()

    def is_contiguous(self) -> bool:
        return self.payload.is_contiguous()
