"""The conversion engine: every ordered pair of registered formats round-trips bit-exact; dtypes a
target lacks are refused by name (or cast only when asked); errors leave no destination."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from ckpt_helpers import FIXTURES, checkpoint_for, read_all, write_all

from vcga import dtypes
from vcga.contract import FormatSpec, TensorEntry
from vcga.convert import (
    check_dtypes,
    convert,
    detect_source,
    detect_target,
    inspect_checkpoint,
    parse_casts,
    parse_size,
)
from vcga.errors import VcgaChecksumError, VcgaConversionError, VcgaFormatError
from vcga.plugin_manager import get_plugin_manager

SPECS = {s.name: s for s in get_plugin_manager().formats()}
PAIRS = [(a, b) for a, b in itertools.permutations(sorted(SPECS), 2)]


def _file_for(spec: FormatSpec, tmp: Path, stem: str) -> Path:
    return tmp / f"{stem}{spec.extensions[0]}"


def _sha(paths):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_the_matrix_covers_every_registered_format():
    assert {"hdf5", "safetensors", "torch"} <= set(SPECS)
    assert len(PAIRS) == len(SPECS) * (len(SPECS) - 1)


@pytest.mark.parametrize("src_name,dst_name", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_ordered_pair_round_trips_bit_exact(tmp_path, src_name, dst_name):
    """A -> B -> A on a checkpoint holding every dtype both formats hold (with NaN payloads,
    -0.0, infinities, subnormals, 0-d and empty tensors): every byte comes back."""
    a, b = SPECS[src_name], SPECS[dst_name]
    dts = [d for d in dtypes.ALL if d in a.dtypes and d in b.dtypes]
    entries = checkpoint_for(dts)
    src = _file_for(a, tmp_path, "src")
    write_all(a, src, entries, {"note": "matrix"})
    before = _sha(list(tmp_path.iterdir()))
    mid = _file_for(b, tmp_path / "mid", "mid")
    mid.parent.mkdir()
    rep = convert(src, mid, src_format=a.name, dst_format=b.name, verify=True)
    assert rep.tensors == len(entries) and rep.verified
    back = _file_for(a, tmp_path / "back", "back")
    back.parent.mkdir()
    convert(mid, back, src_format=b.name, dst_format=a.name, verify=True)
    _, got_mid = read_all(b, mid)
    _, got_back = read_all(a, back)
    for e in entries:
        assert got_mid[e.name][:3] == (e.dtype, e.shape, bytes(e.data)), (dst_name, e.name)
        assert got_back[e.name][:3] == (e.dtype, e.shape, bytes(e.data)), (src_name, e.name)
    assert set(got_back) == {e.name for e in entries}
    assert _sha([p for p in tmp_path.iterdir() if p.is_file()]) == before  # the source is untouched


REFUSALS = [(t, d) for t in sorted(SPECS) for d in dtypes.ALL if d not in SPECS[t].dtypes]


@pytest.mark.parametrize("target,dtype", REFUSALS or [pytest.param(None, None, marks=pytest.mark.skip)],
                         ids=[f"{t}-lacks-{d}" for t, d in REFUSALS] or ["none"])
def test_a_dtype_the_target_lacks_is_refused_by_name_unless_cast(tmp_path, target, dtype):
    src_spec = next(s for s in SPECS.values() if dtype in s.dtypes)
    src = _file_for(src_spec, tmp_path, "src")
    bad = TensorEntry("blocks.3.odd", dtype, (2, 2), bytes(4 * dtypes.get(dtype).itemsize))
    write_all(src_spec, src, [TensorEntry("ok", "float32", (1,), bytes(4)), bad])
    dst = _file_for(SPECS[target], tmp_path, "dst")
    with pytest.raises(VcgaConversionError) as ei:
        convert(src, dst, dst_format=target)
    assert "'blocks.3.odd'" in str(ei.value) and dtype in str(ei.value) and "--cast" in str(ei.value)
    assert (ei.value.tensor, ei.value.dtype, ei.value.target) == ("blocks.3.odd", dtype, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [src])
    # ...and converts when a cast is asked for (zeros fit every dtype of the same kind), where the
    # target has a dtype a cast may go to (complex has none in a format without complex: refused)
    kind = dtypes.get(dtype).kind
    to = next((d for d in dtypes.ALL if d in SPECS[target].dtypes and dtypes.get(d).kind in
               {"b": "bui", "u": "uif", "i": "if", "f": "f", "c": "c"}[kind] and d != dtype), None)
    if to is None:
        real = next(d for d in SPECS[target].dtypes if dtypes.get(d).kind == "f")
        with pytest.raises(VcgaConversionError, match="refusing cast"):
            convert(src, dst, dst_format=target, casts={dtype: real})
        return
    rep = convert(src, dst, dst_format=target, casts={dtype: to})
    assert rep.casts == {f"{dtype}->{to}": 1}
    _, got = read_all(SPECS[target], dst)
    assert got["blocks.3.odd"][:2] == (to, (2, 2))


def test_casts_are_exact_where_they_can_be_and_refuse_overflow(tmp_path):
    import ml_dtypes
    import numpy as np

    h5 = SPECS["hdf5"]
    vals = np.array([1.5, -0.0, 3.0e38, np.inf], np.float32)
    write_all(h5, tmp_path / "s.h5", [
        TensorEntry("bf", "bfloat16", (4,), vals.astype(ml_dtypes.bfloat16).tobytes()),
        TensorEntry("i", "int64", (2,), np.array([1, 2**40], np.int64).tobytes()),
    ])
    convert(tmp_path / "s.h5", tmp_path / "o.h5", casts={"bfloat16": "float32"})
    _, got = read_all(h5, tmp_path / "o.h5")
    assert got["bf"][2] == vals.astype(ml_dtypes.bfloat16).astype(np.float32).tobytes()  # bf16 -> f32 is exact
    with pytest.raises(VcgaConversionError, match=r"'i': values 1\.\.1099511627776 do not fit int32"):
        convert(tmp_path / "s.h5", tmp_path / "o2.h5", casts={"int64": "int32"})
    with pytest.raises(VcgaConversionError, match=r"'bf': element 2 .* overflows float16"):
        convert(tmp_path / "s.h5", tmp_path / "o3.h5", casts={"bfloat16": "float16"})
    assert not (tmp_path / "o2.h5").exists() and not (tmp_path / "o3.h5").exists()
    for bad in ("float32=int32", "complex64=float32", "int8=bool", "x=y", "float32"):
        with pytest.raises(VcgaConversionError):
            parse_casts([bad])


class _CorruptingWriter:
    """Wraps a real writer and flips one bit of one tensor: --verify must catch it."""

    def __init__(self, inner):
        self.inner = inner

    def set_metadata(self, m):
        self.inner.set_metadata(m)

    def write(self, e):
        if e.name == "scalar.float32":
            data = bytearray(bytes(e.data))
            data[0] ^= 1
            e = replace(e, data=bytes(data))
        self.inner.write(e)

    def commit(self):
        self.inner.commit()

    def abort(self):
        self.inner.abort()

    def __enter__(self):
        return self

    def __exit__(self, t, *a):
        self.inner.__exit__(t, *a)


def test_verify_catches_a_corrupted_output_and_leaves_no_destination(tmp_path):
    st = SPECS["safetensors"]
    write_all(st, tmp_path / "s.safetensors", checkpoint_for(["float32", "int8"]))
    evil = FormatSpec("evil-st", (".evil",), st.dtypes, st.sniff, st.open_reader,
                      lambda p, **kw: _CorruptingWriter(st.open_writer(p)))
    with pytest.raises(VcgaChecksumError, match="'scalar.float32' reads back as"):
        convert(tmp_path / "s.safetensors", tmp_path / "o.evil", verify=True, specs=[st, evil])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]
    # without --verify the same corruption goes through: that is what --verify is for
    convert(tmp_path / "s.safetensors", tmp_path / "o.evil", specs=[st, evil])
    assert (tmp_path / "o.evil").exists()


def test_a_reader_failing_midway_leaves_no_destination(tmp_path):
    st = SPECS["safetensors"]
    write_all(st, tmp_path / "s.safetensors", checkpoint_for(["float32", "int8"]))

    class Failing:
        def __init__(self, p):
            self.r = st.open_reader(p)
            self.metadata = self.r.metadata

        def index(self):
            return self.r.index()

        def entries(self):
            for i, e in enumerate(self.r.entries()):
                if i == 3:
                    raise VcgaFormatError("x", "disk went away")
                yield e

        def close(self):
            self.r.close()

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.close()

    spec = FormatSpec("failing", (".fail",), st.dtypes, lambda p: False, Failing, st.open_writer)
    (tmp_path / "s.fail").write_bytes((tmp_path / "s.safetensors").read_bytes())
    for target in ("o.h5", "o.safetensors", "o.pt"):
        with pytest.raises(VcgaFormatError, match="disk went away"):
            convert(tmp_path / "s.fail", tmp_path / target, src_format="failing", specs=[spec, *SPECS.values()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.fail", "s.safetensors"]


def test_destination_rules(tmp_path):
    st = SPECS["safetensors"]
    src = tmp_path / "s.safetensors"
    write_all(st, src, checkpoint_for(["float32"]))
    with pytest.raises(VcgaConversionError, match="is the source"):
        convert(src, src, overwrite=True)
    (tmp_path / "o.h5").write_bytes(b"keep me")
    with pytest.raises(VcgaConversionError, match="exists; pass --overwrite"):
        convert(src, tmp_path / "o.h5")
    assert (tmp_path / "o.h5").read_bytes() == b"keep me"
    convert(src, tmp_path / "o.h5", overwrite=True)
    assert read_all(SPECS["hdf5"], tmp_path / "o.h5")[1]
    with pytest.raises(VcgaConversionError, match="does not exist"):
        convert(src, tmp_path / "nodir" / "o.h5")
    with pytest.raises(VcgaConversionError, match="cannot tell the target format"):
        convert(src, tmp_path / "o.unknown")
    with pytest.raises(VcgaConversionError, match="does not shard"):
        convert(src, tmp_path / "o2.pt", shard_size="1MiB")
    with pytest.raises(VcgaConversionError, match="no writer option 'bogus'"):
        convert(src, tmp_path / "o3.h5", writer_options={"bogus": 1})
    convert(src, tmp_path / "o4.h5", writer_options={"compression": "gzip"})
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_detection_by_signature_extension_and_mindspore_shard_names(tmp_path):
    h5, st = SPECS["hdf5"], SPECS["safetensors"]
    write_all(h5, tmp_path / "really_h5.safetensors", checkpoint_for(["int8"]))
    assert detect_source(tmp_path / "really_h5.safetensors")[0].name == "hdf5"  # signature beats extension
    assert detect_target("x.weights.h5").name == "hdf5"
    assert detect_target("x.bin").name == "torch"
    # MindSpore's FileWriter(name, shard_num=N) writes name0..name{N-1}: a spec with that extension
    # is found from a shard's name, and a missing base name opens shard 0.
    fake = FormatSpec("shardy", (".shardy",), frozenset(dtypes.ALL), lambda p: False, st.open_reader,
                      st.open_writer)
    write_all(st, tmp_path / "m.shardy0", checkpoint_for(["int8"]))
    write_all(st, tmp_path / "m.shardy1", checkpoint_for(["int8"]))
    spec, path = detect_source(tmp_path / "m.shardy", specs=[fake])
    assert (spec.name, path.name) == ("shardy", "m.shardy0")
    assert detect_source(tmp_path / "m.shardy1", specs=[fake])[0].name == "shardy"
    with pytest.raises(VcgaFormatError, match="no such file"):
        detect_source(tmp_path / "absent.h5")
    (tmp_path / "mystery").write_bytes(b"hello")
    with pytest.raises(VcgaFormatError, match="pass --from"):
        detect_source(tmp_path / "mystery")


def test_sizes_and_check_dtypes():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 500 * 10**6 and parse_size("4096") == 4096
    for bad in ("-1", "lots", "2XB", "0"):
        with pytest.raises(VcgaConversionError):
            parse_size(bad)
    idx = [TensorEntry("a", "complex128", (1,), None)]
    assert check_dtypes(idx, SPECS["safetensors"], {"complex128": "complex64"}) == ["complex64"]


def test_inspect_reports_and_verifies(tmp_path):
    rep = inspect_checkpoint(FIXTURES / "state_dict.pt", verify=True)
    assert rep.format == "torch" and rep.mismatches == 0
    row = next(r for r in rep.tensors if r["name"] == "head.weight")
    assert row["status"] == "computed" and row["checksum"].startswith("xxh3_64:") and row["bytes"] == 11 * 6 * 4
    rep2 = inspect_checkpoint(FIXTURES / "state_dict.pt")
    assert {r["status"] for r in rep2.tensors} == {"none"} and rep2.total_bytes == rep.total_bytes


def test_interrupt_midway_leaves_no_destination_and_no_staging(tmp_path):
    st = SPECS["safetensors"]
    write_all(st, tmp_path / "s.safetensors", checkpoint_for(["float32", "int8", "int16"]))
    seen = []

    def progress(phase, done, total, name):
        seen.append(name)
        if len(seen) == 3:
            raise KeyboardInterrupt

    for target in ("o.h5", "o.pt", "o.safetensors"):
        seen.clear()
        with pytest.raises(KeyboardInterrupt):
            convert(tmp_path / "s.safetensors", tmp_path / target, progress=progress)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"], target
