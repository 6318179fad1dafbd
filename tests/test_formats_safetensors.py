"""The safetensors format: byte-identical to the library's writer, streaming, strict on bad files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from ckpt_helpers import checkpoint_for, read_all, write_all
from safetensors import TensorSpec, safe_open, serialize_file

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formats import safetensors_format as st

ST_DTYPES = [d for d in dtypes.ALL if d in st.SPEC.dtypes]


def _library_file(path, entries, metadata):
    keep, specs = [], {}
    for e in entries:
        a = np.frombuffer(bytes(e.data) or b"\0", dtype=np.uint8).copy()
        keep.append(a)
        specs[e.name] = TensorSpec(dtype=e.dtype, shape=list(e.shape), data_ptr=a.ctypes.data, data_len=len(e.data))
    serialize_file(specs, str(path), metadata=metadata)


def test_library_dtype_order_matches_installed_library(tmp_path):
    entries = [TensorEntry(f"x{dt}", dt, (1,), bytes(dtypes.get(dt).itemsize)) for dt in ST_DTYPES]
    _library_file(tmp_path / "lib.safetensors", entries, None)
    with safe_open(str(tmp_path / "lib.safetensors"), framework="numpy") as f:
        order = f.offset_keys()
    assert order == [entries[i].name for i in st.library_order([(e.name, e.dtype) for e in entries])]


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
@pytest.mark.parametrize("mode", ["plan", "spool"])
def test_output_is_byte_identical_to_serialize_file(tmp_path, metadata, mode):
    # (with two or more metadata keys the library's key order is a HashMap's, so only 0 or 1 key compare bytewise)
    entries = checkpoint_for(ST_DTYPES)
    _library_file(tmp_path / "lib.safetensors", entries, metadata)
    plan = [TensorEntry(e.name, e.dtype, e.shape, None) for e in entries] if mode == "plan" else None
    write_all(st.SPEC, tmp_path / "ours.safetensors", entries, metadata, plan=plan)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()


def test_library_loads_our_file_and_we_keep_per_tensor_metadata(tmp_path):
    import torch
    from safetensors.torch import load_file

    entries = checkpoint_for(ST_DTYPES)
    entries[0] = TensorEntry(entries[0].name, entries[0].dtype, entries[0].shape, entries[0].data, {"unit": "m"})
    write_all(st.SPEC, tmp_path / "o.safetensors", entries, {"a": "1", "b": "2"})
    loaded = load_file(str(tmp_path / "o.safetensors"))
    for e in entries:
        t = loaded[e.name]
        assert str(t.dtype) == f"torch.{e.dtype}" and tuple(t.shape) == e.shape
        assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == bytes(e.data) if t.numel() else True
    meta, got = read_all(st.SPEC, tmp_path / "o.safetensors")
    assert meta == {"a": "1", "b": "2"}
    assert got[entries[0].name][3] == {"unit": "m"}
    assert all(got[e.name][:3] == (e.dtype, e.shape, bytes(e.data)) for e in entries)


def test_writer_refuses_what_safetensors_lacks_and_leaves_nothing(tmp_path):
    dst = tmp_path / "o.safetensors"
    with pytest.raises(VcgaConversionError, match="'c' has dtype complex128"):
        write_all(st.SPEC, dst, [TensorEntry("c", "complex128", (1,), bytes(16))])
    with pytest.raises(VcgaConversionError, match="never written"):
        write_all(st.SPEC, dst, [], plan=[TensorEntry("a", "float32", (1,), None)])
    with pytest.raises(VcgaConversionError, match="plan said"):
        write_all(st.SPEC, dst, [TensorEntry("a", "float32", (2,), bytes(8))],
                  plan=[TensorEntry("a", "float32", (1,), None)])
    with pytest.raises(VcgaConversionError, match="data bytes"):
        write_all(st.SPEC, dst, [TensorEntry("a", "float32", (2,), bytes(7))])
    assert list(tmp_path.iterdir()) == []


def _valid(tmp_path):
    p = tmp_path / "ok.safetensors"
    write_all(st.SPEC, p, [TensorEntry("a", "float32", (2, 2), bytes(range(16))),
                           TensorEntry("b", "int8", (3,), b"\x01\x02\x03")])
    return p.read_bytes()


def _header(raw):
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


@pytest.mark.parametrize("damage", ["truncated", "huge_header_len", "bad_json", "offset_hole", "offset_past_end",
                                    "bad_dtype", "shape_mismatch", "not_object", "empty", "metadata_not_strings"])
def test_malformed_files_give_format_errors(tmp_path, damage):
    raw = _valid(tmp_path)
    n, head = _header(raw)
    body = raw[8 + n:]

    def build(h):
        hb = json.dumps(h).encode()
        return struct.pack("<Q", len(hb)) + hb + body

    bad = {
        "truncated": raw[: len(raw) - 3],
        "huge_header_len": struct.pack("<Q", 2**62) + raw[8:],
        "bad_json": raw[:8] + b"{" + b"x" * (n - 1) + body,
        "offset_hole": build({**head, "a": {**head["a"], "data_offsets": [1, 17]}}),
        "offset_past_end": build({**head, "b": {**head["b"], "data_offsets": [16, 40]}}),
        "bad_dtype": build({**head, "b": {**head["b"], "dtype": "Q7"}}),
        "shape_mismatch": build({**head, "a": {**head["a"], "shape": [3, 3]}}),
        "not_object": struct.pack("<Q", 2) + b"[]",
        "empty": b"",
        "metadata_not_strings": build({**head, "__metadata__": {"k": 1}}),
    }[damage]
    p = tmp_path / "bad.safetensors"
    p.write_bytes(bad)
    with pytest.raises(VcgaFormatError):
        read_all(st.SPEC, p)


# --- sharded checkpoints (Hugging Face layout) -------------------------------------------------------


def test_shard_size_writes_hugging_face_shards_and_index(tmp_path):
    from vcga.convert import convert

    entries = checkpoint_for(["float32", "int8", "bfloat16"])  # includes a 300 KiB tensor
    write_all(st.SPEC, tmp_path / "src.safetensors", entries, {"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    rep = convert(tmp_path / "src.safetensors", out / "model.safetensors", shard_size="100KiB", verify=True)
    names = sorted(p.name for p in out.iterdir())
    n = len(names) - 1
    assert n >= 2 and names[-1] == "model.safetensors.index.json"
    assert names[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert rep.outputs[-1].endswith("model.safetensors.index.json")  # the index appears last
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(e.nbytes for e in entries)
    # what transformers does to load it: safe_open the shard the weight_map names
    import torch

    for e in entries:
        with safe_open(str(out / index["weight_map"][e.name]), framework="pt") as f:
            t = f.get_tensor(e.name)
            assert t.dtype == getattr(torch, e.dtype) and tuple(t.shape) == e.shape
            assert (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"") == bytes(e.data)
        with safe_open(str(out / index["weight_map"][e.name]), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
    # and we read it back through the index, or through the base name (also what `vcga convert` finds)
    from vcga.convert import detect_source

    assert detect_source(out / "model.safetensors")[1].name == "model.safetensors.index.json"
    assert detect_source(out / "model.safetensors.index.json")[0].name == "safetensors"
    for src in (out / "model.safetensors.index.json", out / "model.safetensors"):
        meta, got = read_all(st.SPEC, src)
        assert meta == {"format": "pt"}
        assert {k: v[:3] for k, v in got.items()} == {e.name: (e.dtype, e.shape, bytes(e.data)) for e in entries}


def test_shard_size_larger_than_the_checkpoint_writes_one_file(tmp_path):
    from vcga.convert import convert

    write_all(st.SPEC, tmp_path / "src.safetensors", checkpoint_for(["int8"]))
    (tmp_path / "o").mkdir()
    convert(tmp_path / "src.safetensors", tmp_path / "o" / "m.safetensors", shard_size="1GiB")
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["m.safetensors"]


def _drop_one_of_a_shared_shard(wm):
    shard = next(v for v in wm.values() if list(wm.values()).count(v) > 1)
    drop = next(k for k, v in wm.items() if v == shard)
    return {k: v for k, v in wm.items() if k != drop}


@pytest.mark.parametrize("damage,match", [
    (lambda wm, d: {**wm, "x": "../escape.safetensors"}, "not a plain file name"),
    (lambda wm, d: {**wm, "x": "/etc/passwd"}, "not a plain file name"),
    (lambda wm, d: {**wm, "x": "sub/dir.safetensors"}, "not a plain file name"),
    (lambda wm, d: {**wm, "x": "missing.safetensors"}, "no such file"),
    (lambda wm, d: {**wm, "ghost": next(iter(wm.values()))}, "'ghost' is not in shard"),
    (lambda wm, d: _drop_one_of_a_shared_shard(wm), "does not list it"),
    (lambda wm, d: "not a map", "no weight_map"),
])
def test_malformed_shard_index_is_refused(tmp_path, damage, match):
    from vcga.convert import convert

    write_all(st.SPEC, tmp_path / "src.safetensors", checkpoint_for(["float32", "int8"]))
    convert(tmp_path / "src.safetensors", tmp_path / "m.safetensors", shard_size="64KiB")
    idx = tmp_path / "m.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"] = damage(doc["weight_map"], tmp_path)
    idx.write_text(json.dumps(doc))
    with pytest.raises(VcgaFormatError, match=match):
        read_all(st.SPEC, idx)
