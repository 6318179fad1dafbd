"""Helpers for the checkpoint-format tests (readers, writers, the conversion engine)."""

from __future__ import annotations

import hashlib
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from vcga import dtypes
from vcga.contract import FormatSpec, TensorEntry

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from recipes import expected_bytes, finite  # noqa: E402,F401


def read_all(spec: FormatSpec, path: Path) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...], bytes, dict[str, str]]]]:
    """(file metadata, {name: (dtype, shape, bytes, metadata)}) through the format's reader."""
    with spec.open_reader(path) as r:
        meta = dict(r.metadata)
        out = {e.name: (e.dtype, tuple(e.shape), bytes(e.data), dict(e.metadata)) for e in r.entries()}
    return meta, out


def write_all(spec: FormatSpec, path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
              **kw: Any) -> None:
    with spec.open_writer(path, **kw) as w:
        w.set_metadata(metadata or {})
        for e in entries:
            w.write(e)


def float32_layers(seed: int, count: int, base: int) -> list[TensorEntry]:
    """``count`` random float32 "layerI.weight" tensors of ``base + 1000 * i`` elements each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        a = rng.standard_normal(base + 1000 * i).astype(np.float32)
        out.append(TensorEntry(f"layer{i}.weight", "float32", a.shape, memoryview(a.tobytes()), {}))
    return out


def conversion_sources(d: Path, entries: list[TensorEntry]) -> tuple[Path, dict[str, bytes]]:
    """``entries`` written to ``d`` as src.safetensors and src.h5 (the two sources the kill tests
    convert from); returns (d, {name: bytes}) to check destinations against."""
    from vcga.convert import format_by_name

    for name, fmt in (("src.safetensors", "safetensors"), ("src.h5", "hdf5")):
        write_all(format_by_name(fmt), d / name, entries, {"origin": "test"})
    return d, {e.name: bytes(e.data) for e in entries}


def special_bytes(dtype: str, n: int, seed: int) -> bytes:
    """``n`` elements of ``dtype`` whose bytes are random, plus hand-picked specials for floats:
    NaN with a payload, -0.0, +-inf, the smallest subnormal (where the dtype has them)."""
    rng = np.random.default_rng(seed)
    item = dtypes.get(dtype).itemsize
    raw = bytearray(rng.integers(0, 256, size=n * item, dtype=np.uint8).tobytes())
    if dtype == "bool":
        raw = bytearray(b % 2 for b in raw)
    specials = {
        "float16": [b"\x01\x7e", b"\x00\x80", b"\x00\x7c", b"\x00\xfc", b"\x01\x00"],
        "bfloat16": [b"\x81\x7f", b"\x00\x80", b"\x80\x7f", b"\x80\xff", b"\x01\x00"],
        "float32": [b"\x01\x00\xc0\x7f", b"\x00\x00\x00\x80", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff",
                    b"\x01\x00\x00\x00"],
        "float64": [b"\x01\x00\x00\x00\x00\x00\xf8\x7f", b"\x00" * 7 + b"\x80", b"\x00" * 6 + b"\xf0\x7f",
                    b"\x00" * 6 + b"\xf0\xff", b"\x01" + b"\x00" * 7],
        "float8_e4m3fn": [b"\x7f", b"\x80", b"\x01"],
        "float8_e5m2": [b"\x7d", b"\x80", b"\x7c", b"\xfc", b"\x01"],
    }.get(dtype, [])
    for i, s in enumerate(specials[: n]):
        raw[i * item:(i + 1) * item] = s
    return bytes(raw)


def checkpoint_for(dts: list[str]) -> list[TensorEntry]:
    """One tensor per dtype (with specials), a 0-d and an empty tensor per dtype, and a 300 KiB tensor."""
    out = []
    for i, dt in enumerate(dts):
        out.append(TensorEntry(f"layers.{dt}.weight", dt, (3, 5), special_bytes(dt, 15, i)))
        out.append(TensorEntry(f"scalar.{dt}", dt, (), special_bytes(dt, 1, 100 + i)))
        out.append(TensorEntry(f"empty.{dt}", dt, (0, 3), b""))
    if "float32" in dts:
        out.append(TensorEntry("encoder/big.weight", "float32", (300, 256), special_bytes("float32", 300 * 256, 999)))
    return out


def digest(data: Any) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def crc(name: str) -> int:
    return zlib.crc32(name.encode())
