"""The ``mindrecord`` format: VCGA's writer and reader, round trips, layout, atomicity, options."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaConfigError, VcgaConversionError
from vcga.formats import mindrecord
from vcga.formats.mindrecord import _format as F
from vcga.formats.mindrecord.reader import MindRecordDataset
from vcga.plugin_manager import VcgaPluginManager

SMALL = {"header_size": 1 << 14, "page_size": 1 << 15}


def tensors(seed: int = 0) -> list[TensorEntry]:
    """Every dtype (random bit patterns: NaN payloads included), 0-d, empty and page-splitting tensors."""
    rng = np.random.default_rng(seed)
    out = []
    for i, dt in enumerate(dtypes.EVERY):
        shape = [(2, 3), (5,), (1, 2, 2), ()][i % 4]
        n = int(np.prod(shape)) if shape else 1
        size = n * dtypes.get(dt).itemsize
        data = rng.integers(0, 2, n, dtype=np.uint8).tobytes() if dt == "bool" else rng.bytes(size)
        out.append(TensorEntry(f"t.{dt}", dt, shape, data, {"i": str(i)} if i % 3 == 0 else {}))
    out.append(TensorEntry("empty.2d", "float32", (0, 3), b""))
    out.append(TensorEntry("empty.1d", "bfloat16", (0,), b""))
    out.append(TensorEntry("empty.3d", "complex128", (2, 0, 4), b""))
    out.append(TensorEntry("big", "float64", (100, 100), rng.bytes(80000)))  # 3 pages of 32 KiB
    out.append(TensorEntry("after.big", "int8", (3,), b"\x01\x02\x03"))
    return out


def write(path, entries, metadata=None, **options):
    with mindrecord.open_writer(path, **options) as w:
        if metadata is not None:
            w.set_metadata(metadata)
        for e in entries:
            w.write(e)


def read(path):
    with mindrecord.open_reader(path) as r:
        return r.metadata, [(e.name, e.dtype, tuple(e.shape), bytes(e.data), dict(e.metadata)) for e in r.entries()]


def as_rows(entries):
    return [(e.name, e.dtype, tuple(e.shape), bytes(e.data), dict(e.metadata)) for e in entries]


def test_registered_as_plugin_with_every_dtype():
    pm = VcgaPluginManager()
    spec = {f.name: f for f in pm.formats()}["mindrecord"]
    assert spec.dtypes == frozenset(dtypes.EVERY)
    assert ".mindrecord" in spec.extensions


def test_round_trip_every_dtype_bit_exact(tmp_path):
    src = tensors()
    write(tmp_path / "m.mindrecord", src, {"producer": "test", "ünïcode": "✓"}, **SMALL)
    meta, got = read(tmp_path / "m.mindrecord")
    assert got == as_rows(src)
    assert meta == {"producer": "test", "ünïcode": "✓"}
    assert sorted(os.listdir(tmp_path)) == ["m.mindrecord", "m.mindrecord.db"]


def test_large_tensor_is_split_into_records_and_joined(tmp_path):
    write(tmp_path / "m.mindrecord", tensors(), **SMALL)
    ds = MindRecordDataset(tmp_path / "m.mindrecord")
    try:
        recs = [r for r in ds.records() if r.raw["name"] == "big"]
        offsets = [r.raw["offset"] for r in recs]
        lengths = [r.blobs["data"][1] for r in recs]
        page_size = ds.header.page_size
        blob_pages = [p for p in ds.header.pages if p.page_type == "BLOB_DATA"]
    finally:
        ds.close()
    assert len(recs) == 3 and offsets == [0, lengths[0], lengths[0] + lengths[1]] and sum(lengths) == 80000
    assert all(length % 8 == 0 for length in lengths)  # slices hold whole float64 elements
    assert all(p.used <= page_size for p in blob_pages)


def test_header_layout_matches_mindspore(tmp_path):
    write(tmp_path / "m.mindrecord", tensors(), **SMALL)
    raw = (tmp_path / "m.mindrecord").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert list(header) == ["header_size", "index_fields", "page", "page_size", "compression_size", "schema",
                            "shard_addresses", "shard_id", "statistics", "version"]
    assert header["version"] == "3.0" and header["statistics"] is None
    assert raw[8 + n:header["header_size"]] == bytes(header["header_size"] - 8 - n)  # zero padding
    assert header["schema"][0]["blob_fields"] == ["data", "shape"]
    assert header["schema"][0]["schema"]["shape"] == {"shape": [-1], "type": "int64"}
    assert header["index_fields"] == [{"index_field": "name", "schema_id": 0}]
    pages = header["page"]
    kinds = [p["page_type"] for p in pages]
    assert kinds == sorted(kinds)  # BLOB pages first, then RAW pages (as in one FileWriter call)
    last = pages[-1]
    assert len(raw) == header["header_size"] + last["page_id"] * header["page_size"] + last["page_size"]


def test_empty_dataset(tmp_path):
    write(tmp_path / "e.mindrecord", [], **SMALL)
    meta, got = read(tmp_path / "e.mindrecord")
    assert got == [] and meta == {}
    raw = (tmp_path / "e.mindrecord").read_bytes()
    assert json.loads(raw[8:])["page"] is None  # as FileWriter writes an empty dataset


def test_shards_named_like_filewriter(tmp_path):
    src = [TensorEntry(f"w{i}", "float32", (256,), np.full(256, i, np.float32).tobytes()) for i in range(11)]
    write(tmp_path / "s.mindrecord", src, shard_size=1024, **SMALL)
    names = sorted(os.listdir(tmp_path))
    expect = sorted([f"s.mindrecord{i:02d}" for i in range(11)] + [f"s.mindrecord{i:02d}.db" for i in range(11)])
    assert names == expect
    for entry in ("s.mindrecord00", "s.mindrecord07", "s.mindrecord"):
        assert read(tmp_path / entry)[1] == as_rows(src)
    ds = MindRecordDataset(tmp_path / "s.mindrecord05")
    try:
        assert ds.header.shard_addresses == tuple(f"s.mindrecord{i:02d}" for i in range(11))
        assert [s.header.shard_id for s in ds.shards] == list(range(11))
    finally:
        ds.close()


def test_tensor_larger_than_a_shard_spans_shards(tmp_path):
    rng = np.random.default_rng(3)
    src = [TensorEntry("a", "uint8", (10,), rng.bytes(10)), TensorEntry("huge", "float32", (30000,),
                                                                       rng.bytes(120000))]
    write(tmp_path / "s.mindrecord", src, shard_size=40000, **SMALL)
    assert (tmp_path / "s.mindrecord0").exists() and (tmp_path / "s.mindrecord2").exists()
    assert read(tmp_path / "s.mindrecord")[1] == as_rows(src)


def test_writer_is_atomic_on_error(tmp_path):
    dest = tmp_path / "m.mindrecord"
    dest.write_bytes(b"old contents")
    with pytest.raises(VcgaConversionError, match="twice"), mindrecord.open_writer(dest, **SMALL) as w:
        w.write(TensorEntry("x", "float32", (1,), b"\0\0\0\0"))
        w.write(TensorEntry("x", "float32", (1,), b"\0\0\0\0"))
    assert sorted(os.listdir(tmp_path)) == ["m.mindrecord"]
    assert dest.read_bytes() == b"old contents"


def test_abort_leaves_nothing_with_shards(tmp_path):
    w = mindrecord.open_writer(tmp_path / "m.mindrecord", shard_size=100, **SMALL)
    for i in range(5):
        w.write(TensorEntry(f"t{i}", "uint8", (200,), bytes(200)))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_wrong_data_length_refused(tmp_path):
    with pytest.raises(VcgaConversionError, match="needs 8"), \
            mindrecord.open_writer(tmp_path / "m.mindrecord", **SMALL) as w:
        w.write(TensorEntry("x", "float32", (2,), b"\0" * 7))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key,value", [("page_size", 1000), ("page_size", (1 << 15) + 2), ("header_size", 1 << 28),
                                       ("shard_size", 0), ("shard_size", -5)])
def test_invalid_options(tmp_path, key, value):
    with pytest.raises(VcgaConfigError, match=key):
        mindrecord.open_writer(tmp_path / "m.mindrecord", **{key: value})


def test_source_is_not_modified_by_reading(tmp_path):
    write(tmp_path / "m.mindrecord", tensors(), **SMALL)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    stat = {p: os.stat(tmp_path / p).st_mtime_ns for p in before}
    read(tmp_path / "m.mindrecord")
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before
    assert {p: os.stat(tmp_path / p).st_mtime_ns for p in before} == stat


def test_sniff(tmp_path):
    write(tmp_path / "m.mindrecord", tensors(), **SMALL)
    write(tmp_path / "s.mindrecord", tensors(), shard_size=50000, **SMALL)
    assert mindrecord.sniff(tmp_path / "m.mindrecord")
    assert mindrecord.sniff(tmp_path / "s.mindrecord1") and mindrecord.sniff(tmp_path / "s.mindrecord")
    (tmp_path / "x.bin").write_bytes(b"\x05\0\0\0\0\0\0\0hello")
    assert not mindrecord.sniff(tmp_path / "x.bin")
    assert not mindrecord.sniff(tmp_path / "m.mindrecord.db")
    assert not mindrecord.sniff(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Integer-array compression: against a scalar re-implementation of shard_column.cc
# ---------------------------------------------------------------------------------------------------


def _reference_compress(values: list[int]) -> bytes:
    out = bytearray(len(values).to_bytes(4, "big"))
    bitmap = bytearray((len(values) + 3) // 4)
    body = bytearray()
    for i, v in enumerate(values):
        code = next(c for c, bits in enumerate((8, 16, 32, 64)) if -(1 << (bits - 1)) <= v < (1 << (bits - 1)))
        bitmap[i // 4] |= code << (2 * (3 - i % 4))
        body += v.to_bytes(1 << code, "little", signed=True)
    return bytes(out + bitmap + body)


def test_compression_known_bytes():
    assert F.compress_int_array(np.array([2, 4])) == bytes.fromhex("00000002000204")
    assert F.compress_int_array(np.array([], dtype=np.int64)) == bytes.fromhex("00000000")
    assert F.compress_int_array(np.array([70000, 100000000000])) == bytes.fromhex("00000002b07011010000e8764817000000")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), max_size=40))
def test_compression_matches_reference_and_round_trips(values):
    packed = F.compress_int_array(np.array(values, dtype=np.int64))
    assert packed == _reference_compress(values)
    assert F.decompress_int_array(packed, "<i8", "x", "test").tolist() == values
