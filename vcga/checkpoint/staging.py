"""Staging for :func:`vcga.checkpoint.async_save`: the state's tensors copied into host buffers kept
from one save to the next."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class _Stager:
    """Copies a state dict into host buffers kept from one save to the next (pinned when the
    tensors live on an accelerator that can pin host memory), so staging is one copy per tensor
    and no allocation once warm."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._layout: tuple | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
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
        layout = _layout(state_dict)
        if self._cache is None or layout != self._layout:
            pin = on_device is not None and device_module is not None and device_module.is_available()
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=pin)
            self._layout = layout
        staged = _copy_state_dict(state_dict, self._cache, non_blocking=on_device is not None)
        if on_device is not None and device_module is not None:
            device_module.synchronize()  # the copies were queued on the device's stream
        return staged


def _layout(obj: Any) -> Any:
    """What the staging buffers are made for: the nesting (keys in order), and each tensor's kind,
    dtype and shape -- a DTensor's placements and local shape, a ShardedTensor's shards -- so
    buffers are reused only when every copy lands in a buffer of its own dtype and shape."""
    if isinstance(obj, Mapping):
        return ("dict", tuple((k, _layout(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_layout(v) for v in obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):  # DTensor
            local = obj.to_local()
            return ("dtensor", obj.dtype, tuple(obj.shape), str(obj.placements), tuple(local.shape), local.device.type)
        if hasattr(obj, "local_shards"):  # ShardedTensor
            return ("sharded", obj.dtype, tuple(obj.shape),
                    tuple((tuple(s.metadata.shard_offsets), tuple(s.tensor.shape)) for s in obj.local_shards()))
        return ("tensor", obj.dtype, tuple(obj.shape), obj.device.type)
    return None  # a plain value: staged by reference, no buffer


def _device_type(state_dict: Any) -> str | None:
    stack = [state_dict]
    while stack:
        obj = stack.pop()
        if isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            if local.device.type not in ("cpu", "meta"):
                return local.device.type
    return None
