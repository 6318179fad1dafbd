"""The ``mindspore-ckpt`` format: VCGA's writer and reader, slices, CRC, empty tensors, refusals."""

from __future__ import annotations

import binascii
import os

import numpy as np
import pytest

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaConfigError, VcgaConversionError, VcgaFormatError
from vcga.formats import mindspore_ckpt as ck
from vcga.plugin_manager import VcgaPluginManager


def tensors(seed: int = 0) -> list[TensorEntry]:
    rng = np.random.default_rng(seed)
    out = []
    for i, dt in enumerate(sorted(ck.CKPT_DTYPES, key=dtypes.ALL.index)):
        shape = [(2, 3), (7,), (1, 2, 2), ()][i % 4]
        n = int(np.prod(shape)) if shape else 1
        data = rng.integers(0, 2, n, dtype=np.uint8).tobytes() if dt == "bool" else \
            rng.bytes(n * dtypes.get(dt).itemsize)
        out.append(TensorEntry(f"net.{dt}", dt, shape, data))
    out += [TensorEntry("empty.rows", "float32", (0, 3), b""), TensorEntry("empty.vector", "int64", (0,), b""),
            TensorEntry("big", "float32", (64, 33), rng.bytes(64 * 33 * 4))]
    return out


def write(path, entries, metadata=None, **options):
    with ck.open_writer(path, **options) as w:
        if metadata is not None:
            w.set_metadata(metadata)
        for e in entries:
            w.write(e)


def read(path, **options):
    with ck.open_reader(path, **options) as r:
        return r.metadata, [(e.name, e.dtype, tuple(e.shape), bytes(e.data)) for e in r.entries()]


def rows(entries):
    return [(e.name, e.dtype, tuple(e.shape), bytes(e.data)) for e in entries]


def test_registered_as_plugin():
    spec = {f.name: f for f in VcgaPluginManager().formats()}["mindspore-ckpt"]
    assert spec.dtypes == ck.CKPT_DTYPES and spec.extensions == (".ckpt",)
    assert not {"complex64", "float8_e4m3fn", "float8_e5m2"} & spec.dtypes


def test_message_classes_follow_mindspore_proto():
    checkpoint, value = ck.message_classes()
    fields = {f.name: (f.number, f.type, f.is_required) for f in value.DESCRIPTOR.fields}
    T = value.DESCRIPTOR.fields_by_name["tag"]
    assert fields == {"tag": (1, T.TYPE_STRING, True), "tensor": (2, T.TYPE_MESSAGE, False),
                      "maptensor": (3, T.TYPE_MESSAGE, False)}
    tp = value.DESCRIPTOR.fields_by_name["tensor"].message_type
    assert [(f.name, f.number, f.type, f.is_required, f.is_repeated) for f in tp.fields] == [
        ("dims", 1, T.TYPE_INT64, False, True), ("tensor_type", 2, T.TYPE_STRING, True, False),
        ("tensor_content", 3, T.TYPE_BYTES, True, False)]
    assert not tp.fields_by_name["dims"].is_packed  # proto2: dims unpacked, as MindSpore writes them
    assert [f.number for f in checkpoint.DESCRIPTOR.fields] == [1, 1001]


@pytest.mark.parametrize("crc", [False, True])
def test_round_trip_bit_exact(tmp_path, crc):
    src = tensors()
    write(tmp_path / "m.ckpt", src, {"note": "hi", "empty": ""}, crc=crc)
    meta, got = read(tmp_path / "m.ckpt")
    assert got == rows(src) and meta == {"note": "hi", "empty": ""}
    raw = (tmp_path / "m.ckpt").read_bytes()
    if crc:
        assert raw[-17:-10] == b"crc_num"
        assert int.from_bytes(raw[-10:], "big") == binascii.crc32(raw[:-17])
    else:
        assert b"crc_num" not in raw


def test_zero_d_has_no_dims_and_mindspore_dims_zero_scalar(tmp_path):
    write(tmp_path / "s.ckpt", [TensorEntry("s", "float32", (), b"\0\0\x80?")])
    checkpoint, _ = ck.message_classes()
    msg = checkpoint.FromString((tmp_path / "s.ckpt").read_bytes())
    assert list(msg.value[0].tensor.dims) == []
    # MindSpore's loader reads dims [0] with one element of content as a 0-d tensor too.
    m = checkpoint()
    v = m.value.add()
    v.tag, v.tensor.tensor_type, v.tensor.tensor_content = "s", "Float32", b"\0\0\x80?"
    v.tensor.dims.append(0)
    (tmp_path / "d0.ckpt").write_bytes(m.SerializeToString())
    assert read(tmp_path / "d0.ckpt")[1] == [("s", "float32", (), b"\0\0\x80?")]


def test_empty_tensors_kept_where_mindspore_loads_them(tmp_path):
    write(tmp_path / "e.ckpt", tensors())
    checkpoint, _ = ck.message_classes()
    msg = checkpoint.FromString((tmp_path / "e.ckpt").read_bytes())
    visible = {v.tag: list(v.tensor.dims) for v in msg.value}
    hidden = {v.tag: list(v.tensor.dims) for v in msg.vcga_extra}
    assert visible["empty.rows"] == [0, 3]  # MindSpore loads this as a (0, 3) Parameter
    assert hidden == {"empty.vector": [0]}  # MindSpore would read dims [0] as a scalar: kept in field 1001


def test_slices_joined_and_split_like_mindspore(tmp_path):
    src = tensors()
    write(tmp_path / "m.ckpt", src, slice_size=1000)
    with ck.open_reader(tmp_path / "m.ckpt") as r:
        big = next(p for p in r.params if p.name == "big")
        assert len(big.frames) == 9 and big.lengths[:-1] == [1000] * 8  # 8448 bytes in 1000-byte slices
        assert [(e.name, bytes(e.data)) for e in r.entries()] == [(e.name, bytes(e.data)) for e in src]


def test_dtypes_mindspore_cannot_hold_are_refused(tmp_path):
    for dt in ("complex64", "float8_e4m3fn", "float8_e5m2", "complex128"):
        with pytest.raises(VcgaConversionError, match=f"'w' has dtype {dt}") as info:
            write(tmp_path / "x.ckpt", [TensorEntry("w", dt, (1,), bytes(dtypes.get(dt).itemsize))])
        assert info.value.tensor == "w" and info.value.dtype == dt
    assert os.listdir(tmp_path) == []


def test_writer_atomic_and_metadata_clash(tmp_path):
    dest = tmp_path / "m.ckpt"
    dest.write_bytes(b"keep me")
    with pytest.raises(VcgaConversionError, match="also tensor names"):
        write(dest, [TensorEntry("a", "int8", (1,), b"\1")], {"a": "text"})
    assert dest.read_bytes() == b"keep me" and os.listdir(tmp_path) == ["m.ckpt"]


def test_crc_mismatch_raises_after_tensors(tmp_path):
    write(tmp_path / "m.ckpt", tensors(), crc=True)
    raw = bytearray((tmp_path / "m.ckpt").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "m.ckpt").write_bytes(raw)
    with pytest.raises(VcgaChecksumError):
        read(tmp_path / "m.ckpt")
    assert read(tmp_path / "m.ckpt", verify_crc=False)[1] == rows(tensors())


def test_invalid_slice_size(tmp_path):
    with pytest.raises(VcgaConfigError, match="slice_size"):
        ck.open_writer(tmp_path / "m.ckpt", slice_size=0)


def test_foreign_files_get_a_hint(tmp_path):
    (tmp_path / "lightning.ckpt").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(VcgaFormatError, match="zip archive.*--from torch"):
        ck.open_reader(tmp_path / "lightning.ckpt")
    (tmp_path / "pickle.ckpt").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(VcgaFormatError, match="pickle"):
        ck.open_reader(tmp_path / "pickle.ckpt")
    assert not ck.sniff(tmp_path / "lightning.ckpt") and not ck.sniff(tmp_path / "pickle.ckpt")


def test_empty_checkpoint(tmp_path):
    write(tmp_path / "e.ckpt", [])
    assert read(tmp_path / "e.ckpt") == ({}, [])
    write(tmp_path / "c.ckpt", [], crc=True)
    assert read(tmp_path / "c.ckpt") == ({}, []) and ck.sniff(tmp_path / "c.ckpt")


def test_sniff_our_output(tmp_path):
    write(tmp_path / "m.ckpt", tensors())
    write(tmp_path / "only_hidden.ckpt", [TensorEntry("e", "int8", (0,), b"")])
    assert ck.sniff(tmp_path / "m.ckpt") and ck.sniff(tmp_path / "only_hidden.ckpt")


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, 70000])
@pytest.mark.parametrize("field", [1, 1001])
def test_value_prefix_equals_protobuf_serialization(n, field):
    """The writer frames the content itself (no copies); the bytes must be protobuf's own."""
    checkpoint, _ = ck.message_classes()
    content = bytes(range(256)) * (n // 256) + bytes(n % 256)
    for tag, dims, tensor_type in (("w", [n], "UInt8"), ("a.b" * 50, [], "Float32"), ("é", [0, 3, 1 << 40], "Int8")):
        msg = checkpoint()
        value = (msg.vcga_extra if field == 1001 else msg.value).add()
        value.tag = tag
        value.tensor.dims.extend(dims)
        value.tensor.tensor_type = tensor_type
        value.tensor.tensor_content = content
        assert ck.value_prefix(field, tag, dims, tensor_type, n) + content == msg.SerializeToString()


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (test helper; lengths < 128)."""
    assert len(payload) < 128
    return bytes([field << 3 | 2, len(payload)]) + payload


def test_canonical_values_take_the_one_copy_path(tmp_path, monkeypatch):
    write(tmp_path / "m.ckpt", tensors(), slice_size=1000, crc=True)
    monkeypatch.setattr(ck.MindSporeCkptReader, "_parse", lambda *a: pytest.fail("full parse not expected"))
    assert read(tmp_path / "m.ckpt")[1] == rows(tensors())
    for name in ("params_crc.ckpt", "split.ckpt"):  # MindSpore's own output is canonical too
        with ck.open_reader(ck_fixture(name)) as r:
            assert all(len(bytes(e.data)) == e.nbytes for e in r.entries())


def ck_fixture(name):
    from pathlib import Path

    return Path(__file__).parent / "fixtures" / "mindspore" / name


def test_noncanonical_encodings_are_parsed_by_protobuf(tmp_path, monkeypatch):
    """Fields in another order, packed dims and an unknown field: valid protobuf, parsed in full."""
    content = bytes(range(8))
    reordered = _ld(3, content) + _ld(2, b"Int16") + b"\x08\x02\x08\x02"  # content, type, dims 2, 2
    packed = _ld(1, b"\x04") + _ld(2, b"UInt8") + _ld(3, content[:4]) + b"\x78\x05"  # packed dims; field 15
    data = _ld(1, _ld(1, b"r") + _ld(2, reordered)) + _ld(1, _ld(1, b"p") + _ld(2, packed))
    (tmp_path / "odd.ckpt").write_bytes(data)
    calls = []
    real = ck.MindSporeCkptReader._parse
    monkeypatch.setattr(ck.MindSporeCkptReader, "_parse", lambda self, *a: calls.append(1) or real(self, *a))
    assert read(tmp_path / "odd.ckpt")[1] == [("r", "int16", (2, 2), content), ("p", "uint8", (4,), content[:4])]
    assert len(calls) == 2


def test_per_tensor_metadata_round_trips(tmp_path):
    """.ckpt has no per-tensor metadata: it rides in one string value (vcga.formatkit's convention)."""
    src = [TensorEntry("a", "int8", (1,), b"\1", {"unit": "m", "é": "✓"}), TensorEntry("b", "int8", (1,), b"\2")]
    write(tmp_path / "m.ckpt", src, {"note": "x"})
    with ck.open_reader(tmp_path / "m.ckpt") as r:
        assert r.metadata == {"note": "x"}
        assert [(e.name, dict(e.metadata)) for e in r.index()] == [("a", {"unit": "m", "é": "✓"}), ("b", {})]
        assert [(e.name, dict(e.metadata)) for e in r.entries()] == [("a", {"unit": "m", "é": "✓"}), ("b", {})]


def test_invalid_unicode_refused_before_writing(tmp_path):
    with pytest.raises(VcgaConversionError, match="Unicode"):
        write(tmp_path / "m.ckpt", [TensorEntry("bad\ud800", "int8", (1,), b"\1")])
    with pytest.raises(VcgaConversionError, match="Unicode"):
        write(tmp_path / "m.ckpt", [], {"k": "\udfff"})
    assert os.listdir(tmp_path) == []
