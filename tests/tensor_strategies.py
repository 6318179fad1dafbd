"""Hypothesis strategies for tensors of every dtype, with their expected bytes computed independently.

A drawn :class:`Case` holds a numpy array (possibly a non-contiguous view) and the exact bytes its
C-order little-endian packing must have, derived from the raw bytes it was built from by slicing
*uint8* arrays only -- no float arithmetic, so NaN payloads, signalling NaNs, ``-0.0`` and
subnormals cannot be altered on the way to the expectation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from vcga import dtypes

#: Float bit patterns that must survive exactly, per itemsize (little-endian bytes).
SPECIAL_FLOATS: dict[str, list[bytes]] = {
    "float64": [struct.pack("<d", -0.0), struct.pack("<Q", 0x7FF0000000000001),  # signalling NaN
                struct.pack("<Q", 0xFFF8DEADBEEF0001), struct.pack("<d", float("inf")), struct.pack("<Q", 1)],
    "float32": [struct.pack("<f", -0.0), struct.pack("<I", 0x7F800001), struct.pack("<I", 0xFFC0BEEF),
                struct.pack("<f", float("-inf")), struct.pack("<I", 1)],
    "float16": [b"\x00\x80", b"\x01\x7c", b"\x55\xfe", b"\x00\x7c", b"\x01\x00"],
    "bfloat16": [b"\x00\x80", b"\x81\x7f", b"\xc1\xff", b"\x80\x7f", b"\x01\x00"],
    "float8_e4m3fn": [b"\x80", b"\x7f", b"\xff", b"\x01"],
    "float8_e5m2": [b"\x80", b"\x7d", b"\xfe", b"\x7c", b"\x01"],
}
SPECIAL_FLOATS["complex64"] = [a + b for a in SPECIAL_FLOATS["float32"][:3] for b in SPECIAL_FLOATS["float32"][:3]]
SPECIAL_FLOATS["complex128"] = [a + b for a in SPECIAL_FLOATS["float64"][:3] for b in SPECIAL_FLOATS["float64"][:3]]


@dataclass
class Case:
    """An array to store and the bytes it must come back as."""

    dtype: str
    array: np.ndarray  # may be a non-contiguous view
    expected: bytes  # C-order little-endian bytes of ``array``'s values
    layout: str  # "contiguous", "strided", "transposed", "reversed"
    raw: bytes  # the base buffer the view was cut from
    base_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def tensor(self):
        """The same view as a torch tensor (torch has no negative steps: "reversed" uses flip, a copy)."""
        import torch

        tdt = dtypes.to_torch(self.dtype)
        if not self.raw:
            base = torch.empty(self.base_shape, dtype=tdt)
        else:
            base = torch.frombuffer(bytearray(self.raw), dtype=torch.uint8).view(tdt).reshape(self.base_shape)
        if self.layout == "strided" and self.base_shape:
            return base[..., ::2]
        if self.layout == "transposed":
            return base.transpose(0, -1)
        if self.layout == "reversed":
            if self.dtype in dtypes.COMPLEX:
                return base.flip(0)
            # flip has no kernel for fp8 or uint64: flip integers of the same width instead
            width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[base.element_size()]
            return base.view(width).flip(0).view(tdt)
        return base


def torch_bytes(t) -> bytes:
    """C-order bytes of any torch tensor (test-side, independent of vcga.tensors)."""
    import torch

    if t.numel() == 0:
        return b""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def element_bytes(dtype: str, n: int) -> st.SearchStrategy[bytes]:
    """``n`` elements' worth of bytes: random bits (every NaN payload is some bit pattern) mixed
    with the special values above; bools stay 0/1 (other bytes are not valid bools in torch)."""
    size = dtypes.get(dtype).itemsize
    if dtype == "bool":
        return st.lists(st.sampled_from([b"\x00", b"\x01"]), min_size=n, max_size=n).map(b"".join)
    elem = st.binary(min_size=size, max_size=size)
    if dtype in SPECIAL_FLOATS:
        elem = st.one_of(elem, st.sampled_from(SPECIAL_FLOATS[dtype]))
    return st.lists(elem, min_size=n, max_size=n).map(b"".join)


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)


@st.composite
def cases(draw: st.DrawFn, dtype_names: tuple[str, ...] = dtypes.ALL, layouts: tuple[str, ...] = (
        "contiguous", "strided", "transposed", "reversed")) -> Case:
    dtype = draw(st.sampled_from(dtype_names))
    shape = draw(shapes)
    layout = draw(st.sampled_from(layouts))
    if layout in ("transposed", "reversed") and len(shape) < 1 or layout == "transposed" and len(shape) < 2:
        layout = "contiguous"
    size = dtypes.get(dtype).itemsize
    base_shape = shape[:-1] + (shape[-1] * 2,) if (layout == "strided" and shape) else shape
    n = int(np.prod(base_shape, dtype=np.int64)) if base_shape else 1
    raw = draw(element_bytes(dtype, n))
    # the same bytes as a uint8 array with one trailing axis per element: all slicing happens here
    u8 = np.frombuffer(raw, dtype=np.uint8).reshape(base_shape + (size,))
    base = np.frombuffer(raw, dtype=np.uint8).view(dtypes.to_numpy(dtype)).reshape(base_shape)
    if layout == "strided" and shape:
        view, u8v = base[..., ::2], u8[..., ::2, :]
    elif layout == "transposed":
        view, u8v = np.swapaxes(base, 0, -1), np.swapaxes(u8, 0, -2)
    elif layout == "reversed":
        view, u8v = base[::-1], u8[::-1]
    else:
        view, u8v = base, u8
    expected = np.ascontiguousarray(u8v).tobytes()
    return Case(dtype, view, expected, layout, raw, base_shape)
