"""vendor-bin: bit-exact round trips, layout, zero-copy lazy reads, damage, truncation, sharding,
atomic writes, and the plugin registration `vcga convert` relies on."""

from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensor_strategies import cases, torch_bytes
from vbin_craft import join, split, with_doc, with_index_bytes

from vcga import dtypes, tensors
from vcga.contract import FormatReader, FormatWriter, TensorEntry
from vcga.errors import VcgaChecksumError, VcgaConversionError, VcgaFormatError
from vcga.formats import vbin

HYPO = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _sample(alignment: int = 64) -> bytes:
    """A small file exercising every region: small and large tensors, padding, empty, 0-d, metadata."""
    rng = np.random.default_rng(0)
    return vbin.save({
        "small": np.array([1.5, -0.0, np.nan], dtype=np.float32),
        "big": rng.integers(0, 255, 300, dtype=np.uint8),
        "empty": np.zeros((0, 5), dtype=np.float64),
        "scalar": np.array(3, dtype=np.int16),
        "bf": np.arange(7, dtype=np.float32).astype(dtypes.to_numpy("bfloat16")),
    }, {"producer": "test"}, alignment=alignment)


# -- round trips -----------------------------------------------------------------------------------


@HYPO
@given(st.lists(cases(), min_size=1, max_size=5), st.sampled_from([64, 4096]), st.booleans())
def test_round_trip_is_bit_exact(tmp_path_factory, items, alignment, as_torch):
    path = tmp_path_factory.mktemp("rt") / "x.vbin"
    src = {f"t{i}": (c.tensor() if as_torch else c.array) for i, c in enumerate(items)}
    vbin.save_file(src, path, {"k": "v"}, alignment=alignment)
    for framework in ("pt", "np"):
        loaded = vbin.load_file(path, framework)
        assert list(loaded) == list(src)
        for (name, got), case in zip(loaded.items(), items, strict=False):
            if framework == "pt":
                assert got.dtype == dtypes.to_torch(case.dtype) and tuple(got.shape) == case.shape
                assert torch_bytes(got) == case.expected, name
            else:
                assert got.dtype == dtypes.to_numpy(case.dtype) and got.shape == case.shape
                assert got.tobytes() == case.expected, name
    with vbin.VbinReader(path) as r:
        assert r.metadata == {"k": "v"}
        r.verify()
        for e, case in zip(r.index(), items, strict=False):
            assert e.data is None and e.checksum == tensors.checksum(case.expected)
    # and in memory, through the same writer
    assert [a.tobytes() for a in vbin.load(vbin.save(src, alignment=alignment)).values()] == \
        [c.expected for c in items]


def test_layout_follows_the_spec(tmp_path):
    path = tmp_path / "l.vbin"
    vbin.save_file({"a": np.zeros(10, np.uint8), "b": np.ones(5000, np.uint8), "c": np.ones(3, np.int32),
                    "e": np.zeros(0, np.int8), "d": np.ones(4096, np.uint8)}, path)
    data = path.read_bytes()
    p = split(data)
    assert p.preamble["magic"] == b"\x89VBIN\r\n\x1a" and (p.preamble["major"], p.preamble["minor"]) == (1, 0)
    assert p.preamble["alignment"] == 4096 and p.trailer["magic"] == b"\x89VBINEND"
    assert p.trailer["file_id"] == p.preamble["file_id"]
    doc = p.doc
    assert doc["format"] == "vendor-bin" and doc["file_id"] == p.preamble["file_id"].hex()
    offsets = {t["name"]: (t["offset"], t["nbytes"]) for t in doc["tensors"]}
    assert offsets == {"a": (64, 10), "b": (4096, 5000), "c": (9152, 12), "e": (0, 0), "d": (12288, 4096)}
    assert p.trailer["index_offset"] == 12288 + 4096
    assert len(data) == p.trailer["index_offset"] + p.trailer["index_length"] + 64


def test_reads_share_the_mapping_and_never_modify_the_file(tmp_path):
    path = tmp_path / "m.vbin"
    vbin.save_file({"w": torch.arange(8192, dtype=torch.float32)}, path)
    before = path.read_bytes()
    with vbin.safe_open(path) as r:
        t = r.get_tensor("w")
        a = r.numpy("w")
        assert np.frombuffer(a, np.uint8).ctypes.data == t.data_ptr()  # one mapping, no copies
        assert t.data_ptr() % 4096 == (np.frombuffer(r._root.buf, np.uint8).ctypes.data + 4096) % 4096
    t += 1  # copy-on-write: the process sees its change, the file does not
    assert t[0].item() == 1
    assert path.read_bytes() == before
    del t, a
    gc.collect()


def test_tensors_outlive_the_reader(tmp_path):
    path = tmp_path / "o.vbin"
    vbin.save_file({"w": torch.arange(100, dtype=torch.int64)}, path)
    d = vbin.load_file(path)
    gc.collect()
    assert d["w"].sum().item() == sum(range(100))


def test_access_is_lazy_and_verification_on_demand(tmp_path):
    data = bytearray(_sample())
    doc = split(bytes(data)).doc
    big = next(t for t in doc["tensors"] if t["name"] == "big")
    data[big["offset"] + 5] ^= 0x10  # damage one tensor only
    path = tmp_path / "lazy.vbin"
    path.write_bytes(data)
    with vbin.VbinReader(path) as r:  # opening reads the index, not the data
        assert [e.name for e in r.index()] == ["small", "big", "empty", "scalar", "bf"]
        assert r.numpy("small").view(np.uint32)[1] == 0x80000000
        with pytest.raises(VcgaChecksumError, match="'big': checksum mismatch") as info:
            r.entry("big")
        assert info.value.offset == big["offset"]
    with vbin.VbinReader(path, verify=False) as r:
        assert r.numpy("big").shape == (300,)  # unverified access is the caller's choice
        r.verify(["small", "scalar"])  # per tensor, as `vcga inspect --verify` reports them
        with pytest.raises(VcgaChecksumError):
            r.verify(["big"])
        with pytest.raises(VcgaChecksumError):
            r.verify()
        with pytest.raises(KeyError):
            r.verify(["nope"])
    with pytest.raises(VcgaChecksumError):
        vbin.load_file(path)


def _in_order_file(tmp_path) -> tuple[Path, dict, dict]:
    """Small tensors around two page-aligned larger ones, with padding between."""
    rng = np.random.default_rng(3)
    n = 70_000
    arrays = {"first": np.arange(5, dtype=np.int32), "big1": rng.standard_normal(n).astype(np.float32),
              "mid": np.ones(3, np.float64), "big2": rng.standard_normal(n).astype(np.float32),
              "last": np.arange(9, dtype=np.int8)}
    path = tmp_path / "order.vbin"
    vbin.save_file(arrays, path)
    return path, arrays, {t["name"]: t for t in split(path.read_bytes()).doc["tensors"]}


def test_read_in_order_yields_every_tensor_verified_in_file_order(tmp_path):
    path, arrays, _ = _in_order_file(tmp_path)
    with vbin.VbinReader(path) as r:
        got = [(e.name, tensors.to_numpy(e).copy()) for e in r.read_in_order()]
        assert r._verified == set(arrays)  # nothing is hashed a second time on access
    assert [n for n, _ in got] == list(arrays)
    for name, a in got:
        assert np.array_equal(a, arrays[name]), name
    with vbin.VbinReader(path.read_bytes()) as r:  # bytes in memory: the same pass, copied from them
        assert [(e.name, tensors.to_numpy(e).tobytes()) for e in r.read_in_order()] == [
            (n, a.tobytes()) for n, a in got]


@pytest.mark.parametrize("where", ["first", "big1", "mid", "big2", "last", "gap"])
def test_read_in_order_stops_at_the_first_damaged_tensor_or_padding_byte(tmp_path, where):
    path, arrays, doc = _in_order_file(tmp_path)
    data = bytearray(path.read_bytes())
    if where == "gap":  # a padding byte between "mid" and "big2"
        pos = doc["mid"]["offset"] + doc["mid"]["nbytes"] + 1
        assert pos < doc["big2"]["offset"]
    else:
        pos = doc[where]["offset"] + doc[where]["nbytes"] - 1
    data[pos] ^= 0x04
    path.write_bytes(data)
    names = list(arrays)
    yielded: list[str] = []
    with vbin.VbinReader(path) as r, pytest.raises(VcgaChecksumError) as info:
        for e in r.read_in_order():
            yielded.append(e.name)
    if where == "gap":  # seen as the pass reaches it: before "big2"
        assert yielded == names[:names.index("big2")] and "padding" in str(info.value) and info.value.offset == pos
    else:
        assert yielded == names[:names.index(where)]  # never the damaged one, nor any after it
        assert f"{where!r}: checksum mismatch" in str(info.value)
    with vbin.VbinReader(path) as r:  # unverified (equal work with a reader that checks nothing)
        assert [e.name for e in r.read_in_order(verify=False)] == names


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_read_in_order_reads_into_given_buffers_and_verifies_what_it_does_not_yield(tmp_path, monkeypatch, chunk):
    """Destinations given in ``into`` receive the bytes (the entry views them); tensors not
    ``wanted`` are not yielded but still hashed -- in pieces of READ_CHUNK bytes (4096: "big1"
    spans many reads, the streamed hash must equal the one-shot checksum)."""
    from vcga.formats.vbin import reader as vbin_reader

    monkeypatch.setattr(vbin_reader, "READ_CHUNK", chunk)
    path, arrays, doc = _in_order_file(tmp_path)
    dest = np.zeros_like(arrays["big1"])
    with vbin.VbinReader(path) as r:
        got = {e.name: (e, tensors.to_numpy(e).copy())
               for e in r.read_in_order(into={"big1": memoryview(dest).cast("B")}, wanted={"big1", "mid", "last"})}
        assert r._verified == set(arrays)
    assert set(got) == {"big1", "mid", "last"}
    assert np.array_equal(dest, arrays["big1"])  # read straight into the destination
    assert np.frombuffer(got["big1"][0].data, np.float32).ctypes.data == dest.ctypes.data
    for name in ("mid", "last"):
        assert np.array_equal(got[name][1], arrays[name])
    data = bytearray(path.read_bytes())
    data[doc["big2"]["offset"] + 5] ^= 0x80  # in a tensor nobody asked for
    path.write_bytes(data)
    with vbin.VbinReader(path) as r, pytest.raises(VcgaChecksumError, match="'big2': checksum mismatch"):
        for _ in r.read_in_order(wanted={"first"}):
            pass
    with vbin.VbinReader(path) as r:
        with pytest.raises(ValueError, match="writable flat byte buffer"):
            next(r.read_in_order(into={"big1": memoryview(bytes(4 * 70_000))}))
        with pytest.raises(ValueError, match="writable flat byte buffer"):
            next(r.read_in_order(into={"big1": memoryview(bytearray(10))}))


def test_read_in_order_refuses_a_file_replaced_or_truncated_after_it_was_opened(tmp_path):
    path, arrays, doc = _in_order_file(tmp_path)
    original = path.read_bytes()
    with vbin.VbinReader(path) as r:
        other = tmp_path / "other.vbin"
        other.write_bytes(original)
        os.replace(other, path)  # same bytes, another file
        with pytest.raises(VcgaFormatError, match="replaced while it was being read"):
            next(r.read_in_order())
    with vbin.VbinReader(path) as r:
        it = r.read_in_order()
        assert next(it).name == "first"
        with open(path, "r+b") as f:  # cut inside "big2", after the pass began
            f.truncate(doc["big2"]["offset"] + 100)
        with pytest.raises(VcgaFormatError, match="truncated while being read"):
            list(it)


# -- damage ----------------------------------------------------------------------------------------


def _read_all(data: bytes) -> None:
    with vbin.VbinReader(data) as r:
        r.verify()
        for e in r.entries():
            tensors.to_numpy(e)


def test_every_single_bit_flip_anywhere_is_detected():
    data = _sample()
    assert len(data) < 2500
    regions = {"preamble": range(0, 64), "trailer": range(len(data) - 64, len(data))}
    p = split(data)
    regions["index"] = range(p.trailer["index_offset"], len(data) - 64)
    detected_on_open = 0
    for bit in range(len(data) * 8):
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(VcgaFormatError):
            _read_all(bytes(damaged))
        if any(bit // 8 in r for r in regions.values()):
            with pytest.raises(VcgaFormatError):  # structure flips: caught before any data is read
                vbin.VbinReader(bytes(damaged))
            detected_on_open += 1
    assert detected_on_open == 8 * sum(len(r) for r in regions.values())


def test_bit_flips_in_a_default_aligned_file_on_disk(tmp_path):
    data = vbin.save({"a": np.arange(10, dtype=np.int8), "page": np.arange(1500, dtype=np.float32),
                      "b": np.ones(3, np.float64)})
    assert len(data) > 2 * 4096  # a padded first page, the page-aligned tensor, then the rest
    path = tmp_path / "f.vbin"
    rng = np.random.default_rng(1)
    positions = sorted(set(rng.integers(0, len(data), 300).tolist()) | {0, 63, 64, 4095, 4096, len(data) - 1})
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(damaged)
        with pytest.raises(VcgaFormatError), vbin.VbinReader(path) as r:
            r.verify()


def test_truncation_at_every_length_is_a_format_error(tmp_path):
    data = _sample()
    path = tmp_path / "t.vbin"
    for n in range(len(data)):
        with pytest.raises(VcgaFormatError) as info:
            vbin.VbinReader(data[:n])
        assert type(info.value) in (VcgaFormatError, VcgaChecksumError)
    for n in range(0, len(data), 7):  # through the file path (mmap) too
        path.write_bytes(data[:n])
        with pytest.raises(VcgaFormatError):
            vbin.load_file(path, "np")


def test_lying_fields_with_valid_checksums_are_format_errors():
    data = _sample()
    doc = split(data).doc
    nums = {t["name"]: t for t in doc["tensors"]}

    def crafted(edit):
        d = json.loads(json.dumps(doc))
        edit(d, {t["name"]: t for t in d["tensors"]})
        return with_doc(data, d)

    cases_ = {
        "huge nbytes": lambda d, t: t["big"].update(nbytes=2**62, shape=[2**62]),
        "past the index": lambda d, t: t["big"].update(offset=t["big"]["offset"] + 64),
        "overlap": lambda d, t: t["bf"].update(offset=t["big"]["offset"]),
        "misaligned": lambda d, t: t["small"].update(offset=t["small"]["offset"] + 4),
        "negative offset": lambda d, t: t["small"].update(offset=-64),
        "shape mismatch": lambda d, t: t["small"].update(shape=[4]),
        "unknown dtype": lambda d, t: t["small"].update(dtype="float128"),
        "float offset": lambda d, t: t["small"].update(offset=64.0),
        "bool dim": lambda d, t: t["small"].update(shape=[True, 3], nbytes=12),
        "int64 overflow": lambda d, t: t["empty"].update(shape=[0, 2**62, 4]),
        "duplicate name": lambda d, t: t["bf"].update(name="small"),
        "empty with offset": lambda d, t: t["empty"].update(offset=64),
        "bad checksum text": lambda d, t: t["small"].update(checksum="crc32:0"),
        "metadata not strings": lambda d, t: d.update(metadata={"a": 1}),
        "wrong file id": lambda d, t: d.update(file_id="0" * 32),
        "wrong format": lambda d, t: d.update(format="safetensors"),
        "unknown key": lambda d, t: d.update(extra=1),
        "missing key": lambda d, t: d.pop("tensors"),
        "not a list": lambda d, t: d.update(tensors={}),
        "shard field": lambda d, t: t["small"].update(shard=0),
        "65 dims": lambda d, t: t["scalar"].update(shape=[1] * 65),
    }
    assert nums  # the sample has the tensors the edits name
    for what, edit in cases_.items():
        with pytest.raises(VcgaFormatError) as info:
            _read_all(crafted(edit))
        assert info.value.offset is not None, what
    text = json.dumps(doc, separators=(",", ":"))
    for field in ('"shape":[3]', '"name":"small"', '"metadata":{"producer":"test"}'):
        key = field.split(":")[0]
        for depth in (500, 900, 5000):  # up to and past json's recursion limit
            deep = text.replace(field, f"{key}:" + "[" * depth + "]" * depth, 1)
            assert deep != text
            with pytest.raises(VcgaFormatError):
                _read_all(with_index_bytes(data, deep.encode()))
    for raw in (b"[" * 100000, b'{"a":1,"a":2}', b'{"x":NaN}', b"\xff\xfe", b"1" * 5000, b""):
        with pytest.raises(VcgaFormatError):
            _read_all(with_index_bytes(data, raw))


def test_lying_trailer_and_preamble_fields_are_format_errors():
    data = _sample()
    for field, value in [("index_offset", 2**63), ("index_offset", 10), ("index_length", 2**64 - 1),
                         ("flags", 1), ("major", 2), ("file_id", b"x" * 16)]:
        p = split(data)
        p.trailer[field] = value
        with pytest.raises(VcgaFormatError):
            vbin.VbinReader(join(p, fix_index_fields=False))
    for field, value in [("alignment", 3), ("alignment", 2**31), ("major", 9), ("file_id", b"y" * 16)]:
        p = split(data)
        p.preamble[field] = value
        with pytest.raises(VcgaFormatError):
            vbin.VbinReader(join(p))


def test_newer_minor_versions_may_add_keys():
    data = _sample()
    p = split(data)
    p.preamble["minor"] = p.trailer["minor"] = 7
    doc = p.doc
    doc["version"] = [1, 7]
    doc["future"] = {"anything": [1, 2]}
    doc["tensors"][0]["future"] = True
    p.index = json.dumps(doc).encode()
    r = vbin.VbinReader(join(p))
    assert r.numpy("small").shape == (3,)


# -- writing ---------------------------------------------------------------------------------------


def test_writes_are_atomic(tmp_path):
    path = tmp_path / "a.vbin"
    with pytest.raises(RuntimeError), vbin.VbinWriter(path) as w:
        w.add("x", np.ones(3))
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    vbin.save_file({"old": np.ones(1)}, path)
    before = path.read_bytes()
    with pytest.raises(VcgaConversionError, match="duplicate tensor name"), vbin.VbinWriter(path) as w:
        w.add("x", np.ones(3))
        w.add("x", np.ones(3))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["a.vbin"]
    with pytest.raises(FileExistsError):
        vbin.VbinWriter(path, overwrite=False)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["a.vbin"]


def test_writer_keeps_no_tensor_alive(tmp_path):
    """Memory is bounded by one tensor: after write() the writer holds no reference to its data."""
    with vbin.VbinWriter(tmp_path / "s.vbin") as w:
        refs = []
        for i in range(5):
            a = np.full(100_000 if i % 2 else 1_500_000, i, dtype=np.float32)  # one piece, several pieces
            refs.append(weakref.ref(a))
            w.add(f"t{i}", a)
            del a
            gc.collect()
            assert all(r() is None for r in refs)
    assert vbin.load_file(tmp_path / "s.vbin", "np")["t4"][0] == 4


def test_a_damaged_source_aborts_the_write(tmp_path):
    """An entry whose bytes do not match the checksum its source stored: the checkpoint cannot be
    trusted, so the writer aborts and nothing appears."""
    w = vbin.VbinWriter(tmp_path / "c.vbin")
    e = tensors.from_numpy("x", np.arange(2**21, dtype=np.int32))  # 8 MiB: hashed in pieces as written
    w.write(tensors.from_numpy("ok", np.arange(3)))
    with pytest.raises(VcgaChecksumError, match="does not match the checksum its source stored"):
        w.write(TensorEntry("x", "int32", e.shape, e.data, {}, "xxh3_64:" + "f" * 16))
    with pytest.raises(VcgaConversionError, match="already aborted"):
        w.commit()
    assert os.listdir(tmp_path) == []


def test_writer_checks_entries(tmp_path):
    w = vbin.VbinWriter(tmp_path / "c.vbin")
    e = tensors.from_numpy("x", np.arange(4, dtype=np.int32))
    with pytest.raises(VcgaConversionError, match="data bytes"):
        w.write(TensorEntry("y", "int32", (5,), e.data))
    with pytest.raises(VcgaConversionError, match="surrogate"):
        w.write(TensorEntry("\ud800", "int32", (4,), e.data))
    with pytest.raises(VcgaConversionError, match="strings to strings"):
        w.set_metadata({"a": 1})
    with pytest.raises(ValueError, match="alignment"):
        vbin.VbinWriter(tmp_path / "d.vbin", alignment=100)
    w.set_metadata({"late": "yes"})  # metadata can come after the tensors (the index is written last)
    w.write(e)
    w.commit()
    with vbin.VbinReader(tmp_path / "c.vbin") as r:
        assert r.metadata == {"late": "yes"} and r.keys() == ["x"]


def test_entries_from_another_reader_carry_their_checksums(tmp_path):
    vbin.save_file({"a": np.arange(5.0), "b": np.ones((2, 2), np.bool_)}, tmp_path / "src.vbin")
    with vbin.VbinReader(tmp_path / "src.vbin") as r, vbin.VbinWriter(tmp_path / "dst.vbin") as w:
        w.set_metadata(r.metadata)
        for e in r.entries():
            w.write(e)  # the stored checksum travels and is checked against what is written
    a, b = (vbin.VbinReader(tmp_path / n).index() for n in ("src.vbin", "dst.vbin"))
    assert [(e.name, e.checksum) for e in a] == [(e.name, e.checksum) for e in b]


# -- sharding --------------------------------------------------------------------------------------


def test_sharding(tmp_path):
    path = tmp_path / "model.vbin"
    src = {f"w{i}": np.full(1000, i, dtype=np.float32) for i in range(7)}  # 4000 bytes each
    src["tiny"] = np.zeros(0, np.int8)
    vbin.save_file(src, path, {"m": "1"}, shard_size=10_000)
    assert sorted(os.listdir(tmp_path)) == ["model-00000.vbin", "model-00001.vbin", "model-00002.vbin",
                                             "model-00003.vbin", "model.vbin"]
    with vbin.VbinReader(path) as r:
        assert r.sharded and r.metadata == {"m": "1"} and list(r.keys()) == list(src)
        assert len(r.files) == 5
        r.verify()
        got = {e.name: tensors.to_numpy(e).copy() for e in r.read_in_order()}  # shard by shard
        assert list(got) == list(src) and all(np.array_equal(got[k], v) for k, v in src.items())
    got = vbin.load_file(path, "np")
    assert all(np.array_equal(got[k], v) for k, v in src.items())
    with vbin.VbinReader(tmp_path / "model-00001.vbin") as r:  # each shard is a vendor-bin file too
        assert r.keys() == ["w2", "w3"]


def _sharded(tmp_path):
    path = tmp_path / "s.vbin"
    vbin.save_file({f"w{i}": np.full(100, i, np.int64) for i in range(4)}, path, shard_size=1600)
    return path


def test_missing_or_foreign_shards_are_format_errors(tmp_path):
    path = _sharded(tmp_path)
    (tmp_path / "s-00001.vbin").rename(tmp_path / "moved.vbin")
    with vbin.VbinReader(path) as r:
        assert r.numpy("w0")[0] == 0  # the shards that are there still read
        with pytest.raises(VcgaFormatError, match="shard 1 .* is missing"):
            r.numpy("w2")
    # a shard from another checkpoint with the right name
    vbin.save_file({"w2": np.full(100, 2, np.int64), "w3": np.full(100, 3, np.int64)}, tmp_path / "s-00001.vbin")
    with vbin.VbinReader(path) as r, pytest.raises(VcgaFormatError, match="not the shard the index lists"):
        r.numpy("w3")


@pytest.mark.parametrize("name", ["../evil.vbin", "/etc/passwd", "sub/x.vbin", "..", ".", "", "a\\b.vbin"])
def test_shard_names_cannot_leave_the_directory(tmp_path, name):
    path = _sharded(tmp_path)
    doc = split(path.read_bytes()).doc
    doc["shards"][0]["file"] = name
    path.write_bytes(with_doc(path.read_bytes(), doc))
    with pytest.raises(VcgaFormatError, match="not a plain file name"):
        vbin.VbinReader(path)


def test_empty_sharded_checkpoint(tmp_path):
    vbin.save_file({}, tmp_path / "e.vbin", shard_size=100)
    assert vbin.load_file(tmp_path / "e.vbin") == {}
    assert os.listdir(tmp_path) == ["e.vbin"]


# -- the plugin ------------------------------------------------------------------------------------


def test_registered_as_a_format_plugin(tmp_path):
    from vcga.plugin_manager import get_plugin_manager

    spec = next(s for s in get_plugin_manager().formats() if s.name == "vendor-bin")
    assert spec.extensions == (".vbin",) and spec.dtypes == frozenset(dtypes.EVERY)
    path = tmp_path / "p.vbin"
    with spec.open_writer(path, shard_size=None) as w:
        assert isinstance(w, FormatWriter)
        w.set_metadata({"a": "b"})
        w.write(tensors.from_numpy("x", np.arange(3)))
    assert spec.sniff(path)
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04 not ours")
    assert not spec.sniff(tmp_path / "other.bin") and not spec.sniff(tmp_path / "missing")
    assert not spec.sniff(tmp_path)
    with spec.open_reader(path) as r:
        assert isinstance(r, FormatReader)
        assert [e.name for e in r.entries()] == ["x"] and r.metadata == {"a": "b"}


def test_the_format_never_imports_torch(tmp_path):
    code = ("import sys, numpy as np; from vcga.formats import vbin; "
            f"vbin.save_file({{'a': np.ones(3)}}, {str(tmp_path / 'n.vbin')!r}); "
            f"vbin.load_file({str(tmp_path / 'n.vbin')!r}, 'np'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_preamble_checksum_covers_reserved_bytes():
    data = bytearray(_sample())
    data[40] = 1  # reserved
    with pytest.raises(VcgaChecksumError, match="preamble checksum"):
        vbin.VbinReader(bytes(data))
    assert struct.unpack_from("<I", data, 12)[0] == 64


def test_a_failed_write_aborts(tmp_path, monkeypatch):
    """Disk full in the middle of a tensor: the temporaries go, nothing appears."""
    w = vbin.VbinWriter(tmp_path / "full.vbin")
    w.add("a", np.ones(10))
    calls = {"n": 0}
    real = vbin._FileWriter._write

    def failing(self, data):
        calls["n"] += 1
        if memoryview(data).nbytes > 1000:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(vbin._FileWriter, "_write", failing)
    with pytest.raises(OSError, match="No space left"):
        w.add("b", np.ones(1 << 18))
    assert os.listdir(tmp_path) == []
    with pytest.raises(VcgaConversionError, match="already aborted"):
        w.add("c", np.ones(3))
