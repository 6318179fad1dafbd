"""Small helpers the built-in compressors share (sizes, and the element count a decoder needs)."""

from __future__ import annotations

import math
from typing import Any

from vcga import dtypes as _dtypes


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def itemsize(dtype: str) -> int:
    return _dtypes.get(dtype).itemsize


def compressed_numel(state: dict[str, Any], name: str) -> int:
    """The element count ``compress`` recorded in this tensor's state: a decoder rebuilds the
    tensor from it. A decode before any compress of the tensor is a driver bug: KeyError."""
    n = state.get("numel")
    if n is None:
        raise KeyError(f"{name}: decompress before compress on this tensor")
    return int(n)
