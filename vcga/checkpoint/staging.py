"""Staging for :func:`vcga.checkpoint.async_save`: the state's tensors copied into host buffers kept
from one save to the next."""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from typing import Any

import torch

_ALIGN = 64  # each buffer in the arena starts on a cache line (and on every dtype's alignment)


class _Arena:
    """One anonymous shared-memory file (``memfd_create``) holding every staging buffer, so the
    writer process can map them (docs/checkpoint.md). Nothing on disk or in /dev/shm: it is gone
    when the last process holding it exits."""

    _next_id = 0

    def __init__(self, size: int) -> None:
        _Arena._next_id += 1
        self.id = _Arena._next_id
        self.size = max(size, 1)
        self.fd = os.memfd_create(f"vcga-checkpoint-staging-{os.getpid()}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.base_tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.base_tensor.data_ptr()

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(offset, nbytes) of a contiguous CPU tensor lying in this arena, else None."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        nbytes = t.numel() * t.element_size()
        offset = t.data_ptr() - self.base
        if offset >= 0 and offset + nbytes <= self.size:
            return offset, nbytes
        return None

    def close(self) -> None:
        os.close(self.fd)  # the mapping (and the tensors over it) stay valid until dropped


def _buffers(obj: Any) -> list[torch.Tensor]:
    """The plain tensors that hold a state dict's data: each tensor, a DTensor's local tensor, a
    ShardedTensor's shards."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, torch.Tensor):
            if hasattr(o, "_local_tensor"):  # DTensor
                out.append(o._local_tensor)
            elif hasattr(o, "local_shards"):  # ShardedTensor
                out.extend(s.tensor for s in o.local_shards())
            else:
                out.append(o)
    return out


def versions(state_dict: Any) -> list[tuple[torch.Tensor, int]]:
    """Each buffer with its version counter (bumped by every in-place change)."""
    return [(t, t._version) for t in _buffers(state_dict)]


def changed(recorded: list[tuple[torch.Tensor, int]]) -> int | None:
    """The index of the first buffer changed in place since ``recorded``, else None."""
    for i, (t, v) in enumerate(recorded):
        if t._version != v:
            return i
    return None


class _Stager:
    """Copies a state dict into host buffers kept from one save to the next (pinned when the
    tensors live on an accelerator that can pin host memory), so staging is one copy per tensor
    and no allocation once warm. With ``shared=True`` the buffers lie in one :class:`_Arena` that
    the writer process maps."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._layout: tuple | None = None
        self.arena: _Arena | None = None
        self.retired: list[_Arena] = []  # arenas replaced by a new layout: the writer must drop them
        self._stream: Any = None

    def stage(self, state_dict: dict[str, Any], *, shared: bool = False, after: Any = None) -> dict[str, Any]:
        """The staged copy. ``after``: an event recorded on the training's stream that the copies
        must wait for (staging in a background thread, on its own stream)."""
        # torch's own helpers (what DCP's BlockingAsyncStager uses): they know DTensor and
        # ShardedTensor, keeping each shard's placement while copying its local data.
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        on_device = _device_type(state_dict)
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; else the device's module
        device_module = accelerator if accelerator is not None else getattr(torch, on_device or "cpu", None)
        # Whether the buffers fit is decided from the layout alone. torch's
        # _check_state_dict_similarity answers it by copying every tensor into the buffers (its
        # walk copies into the companion): staging cost two full copies, the call blocking twice
        # as long. copy_ itself is no check: it casts another dtype and broadcasts a smaller shape.
        layout = (_layout(state_dict), shared)
        if self._cache is None or layout != self._layout:
            pin = on_device is not None and device_module is not None and device_module.is_available()
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=pin and not shared)
            self._layout = layout
            if self.arena is not None:
                self.retired.append(self.arena)
                self.arena = None
            if shared:
                self.arena = _rehome(self._cache, _buffers(state_dict))
        if on_device is not None and after is not None:
            if self._stream is None:
                self._stream = torch.Stream(device=on_device)
            self._stream.wait_event(after)
            with self._stream:
                staged = _copy_state_dict(state_dict, self._cache, non_blocking=True)
            self._stream.synchronize()
            return staged
        staged = _copy_state_dict(state_dict, self._cache, non_blocking=on_device is not None)
        if on_device is not None and device_module is not None:
            device_module.synchronize()  # the copies were queued on the device's stream
        return staged


def _rehome(cache: dict[str, Any], sources: list[torch.Tensor]) -> _Arena:
    """Move every staging buffer of ``cache`` into one new arena (``Tensor.set_``: the state
    dict's structure, DTensor and ShardedTensor wrappers included, stays as torch made it)."""
    theirs = {t.data_ptr() for t in sources if t.numel()}
    bufs = [t for t in _buffers(cache) if t.numel() and t.data_ptr() not in theirs]
    offsets, size = [], 0
    for t in bufs:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    arena = _Arena(size)
    storage = arena.base_tensor.untyped_storage()
    for t, off in zip(bufs, offsets, strict=True):
        t.set_(storage, off // t.element_size(), t.shape, t.stride())  # contiguous, as torch.empty made it
    return arena


def snapshot(obj: Any) -> Any:
    """The nesting of dicts, lists and tuples copied (tensors and other values by reference): the
    background stager walks this while training may add or remove keys in the original."""
    if isinstance(obj, Mapping):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(snapshot(v) for v in obj)
    return obj


def _layout(obj: Any) -> Any:
    """What the staging buffers are made for: the nesting (keys in order), and each tensor's kind,
    dtype and shape -- a DTensor's placements and local shape, a ShardedTensor's shards -- so
    buffers are reused only when every copy lands in a buffer of its own dtype and shape."""
    if isinstance(obj, Mapping):
        return ("dict", tuple((k, _layout(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_layout(v) for v in obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local") and hasattr(obj, "placements"):  # DTensor
            local = obj.to_local()
            return ("dtensor", obj.dtype, tuple(obj.shape), str(obj.placements), tuple(local.shape), local.device.type)
        if hasattr(obj, "local_shards"):  # ShardedTensor
            return ("sharded", obj.dtype, tuple(obj.shape),
                    tuple((tuple(s.metadata.shard_offsets), tuple(s.tensor.shape)) for s in obj.local_shards()))
        return ("tensor", obj.dtype, tuple(obj.shape), obj.device.type)
    return None  # a plain value: staged by reference, no buffer


def _device_type(state_dict: Any) -> str | None:
    """The accelerator the state dict's buffers live on, or None when all are on the host."""
    for t in _buffers(state_dict):
        if t.device.type not in ("cpu", "meta"):
            return t.device.type
    return None
