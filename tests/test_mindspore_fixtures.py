"""VCGA reads files written by MindSpore 2.10 itself, value for value.

The fixtures in tests/fixtures/mindspore/ were made by scripts/make_mindspore_fixtures.py with
MindSpore's ``FileWriter`` and ``save_checkpoint``; ``expected.py`` regenerates the values they were
given. No MindSpore is needed here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from vcga.errors import VcgaFormatError
from vcga.formats import mindrecord, mindspore_ckpt
from vcga.formats.mindrecord._format import Header
from vcga.formats.mindrecord.reader import MindRecordDataset

FIX = Path(__file__).parent / "fixtures" / "mindspore"


def _load_expected():
    spec = importlib.util.spec_from_file_location("mindspore_fixture_expected", FIX / "expected.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


E = _load_expected()


def read_all(reader) -> dict[str, tuple[str, tuple[int, ...], bytes, dict]]:
    with reader as r:
        out = {}
        for e in r.entries():
            assert e.name not in out, f"{e.name} yielded twice"
            out[e.name] = (e.dtype, tuple(e.shape), bytes(e.data), dict(e.metadata))
        return out


def as_expected(tensors) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {n: (dt, tuple(s), d) for n, dt, s, d in tensors}


def test_manifest_matches_committed_files():
    manifest = json.loads((FIX / "MANIFEST.json").read_text())
    assert manifest["mindspore"] == "2.10.0"
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((FIX / name).read_bytes()).hexdigest() == digest, name


# ---------------------------------------------------------------------------------------------------
# MindRecord
# ---------------------------------------------------------------------------------------------------


def test_tensors_fixture_every_dtype_and_split_tensors():
    got = read_all(mindrecord.open_reader(FIX / "tensors.mindrecord"))
    want = as_expected(E.tensor_set())
    assert {k: v[:3] for k, v in got.items()} == want
    assert list(got) == list(want)  # file order
    assert got["layers.0.bool"][3] == {"fixture": "yes"}
    assert got["layers.1.uint8"][3] == {}
    # The two split tensors really were split by the producer, and the empty tensors are there.
    ds = MindRecordDataset(FIX / "tensors.mindrecord")
    try:
        names = [rec.raw["name"] for rec in ds.records()]
    finally:
        ds.close()
    assert names.count("big.weight") == 3 and names.count("huge.weight") == 5
    assert got["empty.rows"][:3] == ("float16", (0, 3), b"")
    assert got["empty.vector"][:3] == ("int64", (0,), b"")
    assert got["scalar.float32"][1] == ()


def test_tensors_fixture_file_metadata_and_layout():
    with mindrecord.open_reader(FIX / "tensors.mindrecord") as r:
        assert r.metadata == {"producer": "mindspore FileWriter"}
        assert r.layout == "tensors"
        idx = r.index()
    assert [(e.name, e.dtype, e.shape) for e in idx] == [(n, d, s) for n, d, s, _ in E.tensor_set()]
    assert all(e.data is None for e in idx)


def test_tensors_fixture_header_as_mindspore_wrote_it():
    """The facts the writer mimics, checked on MindSpore's own output."""
    raw = (FIX / "tensors.mindrecord").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = raw[8:8 + n].decode()
    assert text.startswith('{"header_size":16384,"index_fields":')
    keys = list(json.loads(text))
    assert keys == ["header_size", "index_fields", "page", "page_size", "compression_size", "schema",
                    "shard_addresses", "shard_id", "statistics", "version"]
    ds = MindRecordDataset(FIX / "tensors.mindrecord")
    try:
        h: Header = ds.header
        assert h.version == "3.0" and h.schema.blob_fields == ("data", "shape")
        # Two write calls: BLOB pages, then a RAW page, then more BLOB pages and RAW pages again.
        types = [p.page_type for p in h.pages]
        assert types.index("RAW_DATA") < len(types) - 1 and "BLOB_DATA" in types[types.index("RAW_DATA"):]
    finally:
        ds.close()


def test_minimal_schema_fixture():
    got = read_all(mindrecord.open_reader(FIX / "minimal.mindrecord"))
    assert {k: v[:3] for k, v in got.items()} == as_expected(E.minimal_set())
    with mindrecord.open_reader(FIX / "minimal.mindrecord") as r:
        assert r.metadata == {"mindrecord.desc": "a minimal tensor dataset"}


@pytest.mark.parametrize("entry", ["sharded.mindrecord0", "sharded.mindrecord1", "sharded.mindrecord2",
                                   "sharded.mindrecord"])
def test_sharded_fixture_through_any_shard_or_base_name(entry):
    got = read_all(mindrecord.open_reader(FIX / entry))
    assert {k: v[:3] for k, v in got.items()} == as_expected(E.sharded_set())


def test_sharded_fixture_split_tensor_spans_shards():
    ds = MindRecordDataset(FIX / "sharded.mindrecord1")
    try:
        assert [s.path.name for s in ds.shards] == ["sharded.mindrecord0", "sharded.mindrecord1",
                                                    "sharded.mindrecord2"]
        shards_of = {}
        for rec in ds.records():
            shards_of.setdefault(rec.raw["name"], set()).add(rec.shard)
    finally:
        ds.close()
    assert any(len(s) > 1 for s in shards_of.values())


def test_typed_array_fixtures():
    """data stored as an int64 array (compressed) or float64 array: the field type is the dtype."""
    got = read_all(mindrecord.open_reader(FIX / "typed_int.mindrecord"))
    want = {r["name"]: ("int64", tuple(int(d) for d in r["shape"]), r["data"].astype("<i8").tobytes(), {})
            for r in E.typed_int_rows()}
    assert got == want
    assert got["step"][1] == () and got["none"][1] == (0, 2)
    got = read_all(mindrecord.open_reader(FIX / "typed_float.mindrecord"))
    assert got == {r["name"]: ("float64", r["data"].shape, r["data"].astype("<f8").tobytes(), {})
                   for r in E.typed_float_rows()}


def test_generic_fixture_every_field_type():
    got = read_all(mindrecord.open_reader(FIX / "generic.mindrecord"))
    rows = E.generic_rows()
    assert len(got) == len(rows) * len(E.GENERIC_SCHEMA)
    for i, row in enumerate(rows):
        def g(field):
            return got[f"{i}/{field}"]

        assert g("file_name")[:3] == ("uint8", (len(row["file_name"]),), row["file_name"].encode())
        assert g("file_name")[3] == {"mindrecord.type": "string"}
        assert g("label")[:3] == ("int32", (), np.int32(row["label"]).tobytes())
        assert g("count")[:3] == ("int64", (), np.int64(row["count"]).tobytes())
        assert g("score")[:3] == ("float64", (), np.float64(row["score"]).tobytes())
        assert g("weight")[:3] == ("float32", (), np.float32(row["weight"]).tobytes())
        assert g("image")[:3] == ("uint8", (len(row["image"]),), row["image"])
        assert g("ids")[:3] == ("int64", row["ids"].shape, row["ids"].astype("<i8").tobytes())  # compressed
        assert g("mask")[:3] == ("int32", row["mask"].shape, row["mask"].astype("<i4").tobytes())
        assert g("feature")[:3] == ("float32", (2, 3), row["feature"].astype("<f4").tobytes())
        assert g("vec")[:3] == ("float64", row["vec"].shape, row["vec"].astype("<f8").tobytes())


def test_sniff_recognises_mindspore_files_and_shard_names():
    for name in ("tensors.mindrecord", "sharded.mindrecord0", "sharded.mindrecord2", "generic.mindrecord"):
        assert mindrecord.sniff(FIX / name)
    assert mindrecord.sniff(FIX / "sharded.mindrecord")  # base name of a sharded dataset
    for name in ("tensors.mindrecord.db", "params.ckpt", "expected.py", "missing.mindrecord"):
        assert not mindrecord.sniff(FIX / name)


def test_renamed_shard_is_refused(tmp_path):
    for f in ("minimal.mindrecord", "minimal.mindrecord.db"):
        shutil.copy(FIX / f, tmp_path / f.replace("minimal", "renamed"))
    with pytest.raises(VcgaFormatError, match="rename"):
        mindrecord.open_reader(tmp_path / "renamed.mindrecord")


# ---------------------------------------------------------------------------------------------------
# .ckpt
# ---------------------------------------------------------------------------------------------------


def _ckpt_expected():
    want = as_expected(t for t in E.ckpt_params() if t[0] != "net.empty")
    want["epoch_num"] = ("int64", (), np.int64(E.CKPT_APPEND["epoch_num"]).tobytes())
    return want


@pytest.mark.parametrize("name", ["params.ckpt", "params_crc.ckpt"])
def test_ckpt_fixture_every_dtype(name):
    got = read_all(mindspore_ckpt.open_reader(FIX / name))
    assert {k: v[:3] for k, v in got.items()} == _ckpt_expected()
    # MindSpore's save_checkpoint silently dropped the empty tensor it was given (VCGA's writer keeps it).
    assert "net.empty" not in got
    with mindspore_ckpt.open_reader(FIX / name) as r:
        assert r.metadata == {"note": E.CKPT_APPEND["note"]}
        assert (r.stored_crc is not None) == (name == "params_crc.ckpt")


def test_ckpt_fixture_crc_matches_and_damage_is_detected(tmp_path):
    from vcga.errors import VcgaChecksumError

    raw = bytearray((FIX / "params_crc.ckpt").read_bytes())
    # Flip one bit inside a tensor's content: the file still parses, the CRC no longer matches.
    pos = raw.index(b"Float64") + 12
    raw[pos] ^= 0x01
    bad = tmp_path / "damaged.ckpt"
    bad.write_bytes(raw)
    with mindspore_ckpt.open_reader(bad) as r, pytest.raises(VcgaChecksumError, match="CRC"):
        list(r.entries())
    with mindspore_ckpt.open_reader(bad, verify_crc=False) as r:
        assert len(list(r.entries())) == len(_ckpt_expected())


def test_ckpt_fixture_split_tensors_joined():
    with mindspore_ckpt.open_reader(FIX / "split.ckpt") as r:
        assert len(r.frames) > len(r.params)  # MindSpore's own code split them
        assert [len(p.frames) for p in r.params] == [6, 3, 1]
    got = read_all(mindspore_ckpt.open_reader(FIX / "split.ckpt"))
    assert {k: v[:3] for k, v in got.items()} == as_expected(E.ckpt_split_params())


def test_ckpt_fixture_complex_tensors_read():
    got = read_all(mindspore_ckpt.open_reader(FIX / "complex.ckpt"))
    assert {k: v[:3] for k, v in got.items()} == as_expected(E.ckpt_complex_params())


def test_ckpt_sniff():
    for name in ("params.ckpt", "params_crc.ckpt", "split.ckpt", "complex.ckpt"):
        assert mindspore_ckpt.sniff(FIX / name)
    for name in ("tensors.mindrecord", "tensors.mindrecord.db", "expected.py", "nope.ckpt"):
        assert not mindspore_ckpt.sniff(FIX / name)


def test_our_row_encoding_is_byte_identical_to_filewriter():
    """Every raw row (msgpack) and blob (data + compressed shape) that FileWriter wrote, re-encoded by
    VCGA's writer code, gives the same bytes."""
    from vcga.formats.mindrecord._format import compress_int_array, pack_raw_row

    ds = MindRecordDataset(FIX / "tensors.mindrecord")
    try:
        shard = ds.shards[0]
        n = 0
        for loc, rec in zip(shard.rows, ds.records(), strict=False):
            start = ds.header.page_offset(loc.raw_page) + loc.raw_start
            stored_raw = shard.pread(loc.raw_end - loc.raw_start, start)[8:]
            assert pack_raw_row(rec.raw) == stored_raw
            start = ds.header.page_offset(loc.blob_page) + loc.blob_start
            stored_blob = shard.pread(loc.blob_end - loc.blob_start, start)[8:]
            data = ds.read(rec, "data")
            shape = compress_int_array(ds.decode_array(rec, "shape"))
            ours = len(data).to_bytes(8, "big") + data + len(shape).to_bytes(8, "big") + shape
            assert ours == stored_blob
            n += 1
        assert n == len(E.records_of(E.tensor_set()))
    finally:
        ds.close()
