"""The wire format: bit-exact round trips, damage detection, truncation, streams."""

from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensor_strategies import cases, torch_bytes

from vcga import dtypes, tensors, wire
from vcga.errors import VcgaChecksumError, VcgaFormatError

HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
names = st.text(max_size=20)
metadata = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)


@HYPO
@given(cases(), names, metadata)
def test_numpy_round_trip_is_bit_exact(case, name, meta):
    frame = wire.dumps(case.array, name, meta)
    assert len(frame) % 64 == len(case.expected) % 64  # payload starts 64-aligned
    e = wire.decode(frame)
    assert (e.name, e.dtype, e.shape, dict(e.metadata)) == (name, case.dtype, case.shape, meta)
    assert bytes(e.data) == case.expected
    assert wire.loads_numpy(frame).tobytes() == case.expected
    assert torch_bytes(wire.loads_torch(frame)) == case.expected


@HYPO
@given(cases())
def test_torch_round_trip_is_bit_exact_and_zero_copy(case):
    t = case.tensor()
    frame = wire.encode(t, "t")
    assert bytes(frame.payload) == case.expected
    buf = bytearray(frame.tobytes())  # writable: decoding shares it
    back = wire.loads_torch(buf)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch_bytes(back) == case.expected
    if back.numel():
        assert back.data_ptr() == np.frombuffer(buf, np.uint8).ctypes.data + len(frame.header)


def test_encode_does_not_copy_contiguous_tensors():
    t = torch.arange(1000, dtype=torch.float32)
    frame = wire.encode(t)
    assert np.frombuffer(frame.payload, np.uint8).ctypes.data == t.data_ptr()


def test_header_layout_matches_the_spec():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    frame = wire.encode(a, "w", {"k": "v"})
    h = frame.header
    magic, major, minor, code, ndim, hlen, nlen, mlen, flags, plen, psum = struct.unpack_from("<4sBBBBIIIIQQ", h)
    assert (magic, major, minor, code, ndim) == (b"VCGW", 1, 0, dtypes.to_code("float32"), 2)
    assert (hlen, nlen, mlen, flags, plen) == (len(h), 1, len(b'{"k":"v"}'), 0, 24)
    assert hlen % 64 == 0
    assert struct.unpack_from("<2Q", h, 40) == (2, 3)
    assert h[56:57] == b"w" and h[57:66] == b'{"k":"v"}'
    assert psum == tensors.checksum_int(a)
    assert not any(h[66:hlen - 8])


def _sample_frame() -> bytes:
    return wire.dumps(np.array([[1.5, -0.0], [np.nan, 7]], dtype=np.float32), "sample", {"a": "b"})


def test_every_single_bit_flip_is_detected():
    frame = _sample_frame()
    for bit in range(len(frame) * 8):
        damaged = bytearray(frame)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(VcgaFormatError):
            wire.decode(bytes(damaged))


def test_payload_damage_is_a_checksum_error_and_can_be_skipped():
    frame = bytearray(_sample_frame())
    frame[-1] ^= 0x40
    with pytest.raises(VcgaChecksumError, match="payload checksum mismatch"):
        wire.decode(frame)
    assert wire.decode(frame, verify=False).shape == (2, 2)


def test_truncation_at_every_length_is_a_format_error():
    frame = _sample_frame()
    for n in range(len(frame)):
        with pytest.raises(VcgaFormatError) as info:
            wire.decode(frame[:n])
        assert "truncated" in str(info.value) or n == 0
        with pytest.raises(VcgaFormatError):
            wire.read(io.BytesIO(frame[:n])) if n else (_ for _ in ()).throw(VcgaFormatError("x", "empty"))


def test_trailing_bytes_and_multiple_frames():
    a, b = _sample_frame(), wire.dumps(torch.ones(3, dtype=torch.bool), "b")
    with pytest.raises(VcgaFormatError, match="bytes after the frame"):
        wire.decode(a + b)
    got = list(wire.decode_frames(a + b))
    assert [e.name for e in got] == ["sample", "b"]
    assert wire.frame_length(a + b) == len(a)


def test_claimed_sizes_are_checked_before_use():
    frame = bytearray(_sample_frame())

    def refix(buf: bytearray) -> bytes:
        hlen = struct.unpack_from("<I", buf, 8)[0]
        struct.pack_into("<Q", buf, hlen - 8, __import__("xxhash").xxh3_64_intdigest(bytes(buf[:hlen - 8])))
        return bytes(buf)

    huge = bytearray(frame)
    struct.pack_into("<Q", huge, 40, 2**62)  # a dimension claiming more than int64 elements
    with pytest.raises(VcgaFormatError, match="more elements than int64"):
        wire.decode(refix(huge))
    struct.pack_into("<Q", huge, 40, 2**40)  # a consistent claim of 8 TiB in a 300-byte frame
    struct.pack_into("<Q", huge, 24, 2**40 * 2 * 4)
    with pytest.raises(VcgaFormatError, match="truncated payload"):
        wire.decode(refix(huge))
    with pytest.raises(VcgaFormatError, match="truncated payload"):
        wire.read(io.BytesIO(refix(huge)))
    hdr = bytearray(frame)
    struct.pack_into("<I", hdr, 12, 2**31)  # name length beyond the buffer
    with pytest.raises(VcgaFormatError, match="header length"):
        wire.decode(bytes(hdr))
    code = bytearray(frame)
    code[6] = 99
    with pytest.raises(VcgaFormatError, match="unknown dtype code 99"):
        wire.decode(bytes(code))
    dims = bytearray(frame)
    dims[7] = 200
    with pytest.raises(VcgaFormatError, match="200 dimensions"):
        wire.decode(bytes(dims))


def test_streams_round_trip_and_grow_with_the_data(tmp_path):
    items = [torch.randn(3, 5), torch.tensor(2.0, dtype=torch.bfloat16), torch.zeros(0, 4, dtype=torch.int64)]
    path = tmp_path / "frames.bin"
    with open(path, "wb") as f:
        for i, t in enumerate(items):
            wire.write(f, t, f"t{i}")
    with open(path, "rb") as f:
        got = []
        while (e := wire.read(f)) is not None:
            got.append(tensors.to_torch(e))
    assert [tensors.bits_equal(a, b) for a, b in zip(items, got, strict=False)] == [True] * 3
    # a pipe claiming a huge payload: reading stops at the end of data with a typed error
    frame = bytearray(wire.dumps(np.zeros(4, np.uint8)))
    r, w = os.pipe()
    os.write(w, bytes(frame[:-2]))
    os.close(w)
    with os.fdopen(r, "rb") as pipe, pytest.raises(VcgaFormatError, match="truncated payload"):
        wire.read(pipe)


def test_encode_checks_a_carried_checksum():
    e = tensors.from_numpy("x", np.arange(3, dtype=np.int8))
    bad = type(e)(e.name, e.dtype, e.shape, e.data, {}, "xxh3_64:" + "0" * 16)
    with pytest.raises(VcgaChecksumError, match="does not match the checksum"):
        wire.encode_entry(bad)
