"""Section 2 of the plugin contract, the device interface: :class:`Accelerator`, the
:class:`StreamLike` and :class:`EventLike` it hands out, and :class:`MemoryStats`.

Import them from :mod:`vcga.contract`, which re-exports them on first use: a training job's
``init_process_group`` never asks a backend for its accelerator, and defining three protocol
classes cost every rank of every job 0.1 ms at its start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vcga._values import FrozenValue

if TYPE_CHECKING:
    import torch

__all__ = ["MemoryStats", "StreamLike", "EventLike", "Accelerator"]


class MemoryStats(FrozenValue):
    """Device memory in bytes. ``None`` where the device cannot tell (e.g. the CPU's reserved pool).

    The contract's value classes are frozen and compare by value, as ``@dataclass(frozen=True)``
    would make them; defined without dataclasses, which would cost each rank 0.5 ms a class at
    every start (:mod:`vcga._values`)."""

    __slots__ = ("allocated", "reserved", "peak_allocated", "total")
    allocated: int
    reserved: int | None
    peak_allocated: int | None
    total: int | None

    def __init__(self, allocated: int, reserved: int | None, peak_allocated: int | None, total: int | None) -> None:
        object.__setattr__(self, "allocated", allocated)
        object.__setattr__(self, "reserved", reserved)
        object.__setattr__(self, "peak_allocated", peak_allocated)
        object.__setattr__(self, "total", total)


@runtime_checkable
class StreamLike(Protocol):
    """What VCGA needs of a vendor stream (``torch.cuda.Stream``, ``torch.npu.Stream``, ...)."""

    def synchronize(self) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...


@runtime_checkable
class EventLike(Protocol):
    """What VCGA needs of a vendor event."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@runtime_checkable
class Accelerator(Protocol):
    """One vendor's device module seen through a small, typed interface.

    Return types are part of the contract (DeepSpeed's accelerator interface drifted because they
    were not): ``device`` returns a ``torch.device``, counts and indices are ``int``, memory is a
    :class:`MemoryStats`, RNG state is a CPU ``torch.ByteTensor``.
    """

    #: "cuda", "npu", "mlu" or "cpu": the torch device type.
    device_type: str
    #: The environment variable that restricts visible devices (``CUDA_VISIBLE_DEVICES``, ...), or None.
    visible_devices_env: str | None

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``index`` (default: the current device)."""
        ...

    def set_device(self, index: int) -> None: ...

    def current_device(self) -> int: ...

    def synchronize(self, index: int | None = None) -> None: ...

    def memory_stats(self, index: int | None = None) -> MemoryStats: ...

    def manual_seed(self, seed: int) -> None:
        """Seed every device of this type."""
        ...

    def get_rng_state(self, index: int | None = None) -> torch.Tensor: ...

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None: ...

    def current_stream(self, index: int | None = None) -> StreamLike: ...

    def new_stream(self, index: int | None = None) -> StreamLike: ...

    def new_event(self, enable_timing: bool = False) -> EventLike: ...

    def supported_dtypes(self) -> frozenset[str]:
        """Canonical dtype names the device can hold (not: that collectives accept them)."""
        ...
