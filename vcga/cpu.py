"""The host as an :class:`~vcga.contract.Accelerator`: used by gloo and the simulated vendors.

Part of the public core API so that every CPU-backed plugin (gloo, the simulated vendors, an
out-of-tree CPU collective library) shares one implementation instead of importing each other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vcga import dtypes
from vcga.contract import MemoryStats

if TYPE_CHECKING:
    import torch

__all__ = ["CpuAccelerator", "host_to_host"]


class _NullStream:
    """The CPU executes eagerly: a stream is already synchronised."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


class _NullEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss_bytes() -> int | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    except (ImportError, OSError):
        return None


class CpuAccelerator:
    """The host CPU, as one device ``cpu`` (index 0)."""

    device_type = "cpu"
    visible_devices_env: str | None = None

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> torch.device:
        import torch

        self._check(index)
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        self._check(index)

    def current_device(self) -> int:
        return 0

    def synchronize(self, index: int | None = None) -> None:
        self._check(index)

    def memory_stats(self, index: int | None = None) -> MemoryStats:
        """Process memory: ``allocated`` is the resident set, ``peak_allocated`` its high-water mark."""
        self._check(index)
        return MemoryStats(allocated=_rss_bytes(), reserved=None, peak_allocated=_peak_rss_bytes(),
                           total=_total_memory())

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        import torch

        self._check(index)
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        import torch

        self._check(index)
        torch.set_rng_state(state)

    def current_stream(self, index: int | None = None) -> _NullStream:
        self._check(index)
        return _NullStream()

    def new_stream(self, index: int | None = None) -> _NullStream:
        self._check(index)
        return _NullStream()

    def new_event(self, enable_timing: bool = False) -> _NullEvent:
        return _NullEvent()

    def supported_dtypes(self) -> frozenset[str]:
        return frozenset(dtypes.ALL)

    @staticmethod
    def _check(index: int | None) -> None:
        if index not in (None, 0):
            raise IndexError(f"the CPU accelerator has one device (index 0), not {index}")


def host_to_host(tensor: torch.Tensor) -> torch.Tensor | None:
    """The CPU's device-to-host hook: a contiguous view (no copy when already contiguous)."""
    if tensor.device.type != "cpu":
        return None
    # resolve lazy conjugate/negative views: the raw bytes must be the values the tensor shows
    return tensor.detach().resolve_conj().resolve_neg().contiguous()
