"""Property test: random checkpoints (dtypes, shapes incl. 0-d and empty, unicode names, metadata)
round-trip bit-exact through each format's writer and reader: every dtype a format holds, the
storage-only ones torch checkpoints (complex32, fnuz/e8m0 fp8, packed fp4) included."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from ckpt_helpers import read_all, write_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.formats import hdf5 as h5f
from vcga.formats import mindrecord, mindspore_ckpt, torch_pt, vbin
from vcga.formats import safetensors_format as stf

SPECS = [h5f.SPEC, stf.SPEC, torch_pt.SPEC, mindrecord.SPEC, mindspore_ckpt.SPEC, vbin.SPEC]


def _holds(spec, e: TensorEntry) -> bool:
    # safetensors' F4 has no shape for a 0-d float4_e2m1fn_x2 (refused typed: test_formats_safetensors);
    # HDF5 keeps the dtype label of opaque data in the attribute "dtype" (test_formats_hdf5)
    return e.dtype in spec.dtypes and not (spec is stf.SPEC and e.dtype == stf.PACKED_X2 and not e.shape) and not (
        spec is h5f.SPEC and e.dtype in h5f.OPAQUE_DTYPES and h5f.DTYPE_ATTR in e.metadata)

# A name component: any printable text without '/', not '.' (HDF5 paths); names join 1-3 components.
component = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/"), min_size=1,
                    max_size=12).filter(lambda s: s != ".")


FILE_META = {"k": "v"}  # the file-level metadata every random checkpoint carries


@st.composite
def checkpoints(draw):
    n = draw(st.integers(1, 6))
    # a tensor named as a file-level metadata key is refused by MindSpore's .ckpt (one dictionary holds both)
    names = draw(st.lists(st.lists(component, min_size=1, max_size=3).map("/".join).filter(lambda x: x not in FILE_META),
                          min_size=n, max_size=n, unique=True))
    # no name may be a group prefix of another (HDF5 paths)
    names = [x for x in names if not any(y.startswith(x + "/") for y in names if y != x)]
    entries = []
    for name in names:
        dt = draw(st.sampled_from(dtypes.EVERY))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        numel = int(np.prod(shape)) if shape else 1
        raw = draw(st.binary(min_size=numel * dtypes.get(dt).itemsize, max_size=numel * dtypes.get(dt).itemsize))
        if dt == "bool":
            raw = bytes(b % 2 for b in raw)
        text = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))  # HDF5: C strings
        meta = draw(st.dictionaries(st.text(text, min_size=1, max_size=5).filter(lambda k: not k.startswith("torch.")),
                                    st.text(text, max_size=8), max_size=2))
        entries.append(TensorEntry(name, dt, shape, raw, meta))
    return entries


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=checkpoints())
def test_random_checkpoints_round_trip(entries):
    # tmpfs when there is one: the property is about bytes, not about the disk's fsync latency
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=shm) as d:
        for spec in SPECS:
            kept = [e for e in entries if _holds(spec, e)]
            path = Path(d) / f"c{spec.extensions[0]}"
            write_all(spec, path, kept, FILE_META)
            _, got = read_all(spec, path)
            assert set(got) == {e.name for e in kept}, spec.name
            for e in kept:
                assert got[e.name][:3] == (e.dtype, e.shape, e.data), (spec.name, e.name)
                if spec is not torch_pt.SPEC:  # .pt has no place for metadata
                    assert got[e.name][3] == e.metadata, (spec.name, e.name)
            path.unlink()


def test_every_storage_only_dtype_round_trips_where_held_and_is_refused_typed_elsewhere(tmp_path):
    """Deterministic companion of the property test for the dtypes torch checkpoints beyond the
    collective world: each format that holds one round-trips every byte value; one that cannot
    (MindSpore .ckpt: none of them; safetensors: complex32) is refused by ``vcga convert`` with
    the typed error naming the tensor, and writes nothing."""
    import pytest

    from vcga.convert import convert
    from vcga.errors import VcgaConversionError

    raw = bytes(range(256)) * 2
    entries = [TensorEntry(f"t.{dt}", dt, (4, 512 // (4 * dtypes.get(dt).itemsize)), raw, {}) for dt in
               dtypes.STORAGE_ONLY]
    assert set(stf.SPEC.dtypes) >= {"float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"}
    for spec in SPECS:
        held = [e for e in entries if e.dtype in spec.dtypes]
        if spec is mindspore_ckpt.SPEC:
            assert not held
        path = tmp_path / f"c{spec.extensions[0]}"
        write_all(spec, path, held, {})
        _, got = read_all(spec, path)
        for e in held:
            assert got[e.name][:3] == (e.dtype, e.shape, e.data), (spec.name, e.name)
    src = tmp_path / "c.vbin"  # holds all of them
    for dst, refused in ((tmp_path / "o.safetensors", "complex32"), (tmp_path / "o.ckpt", "complex32")):
        with pytest.raises(VcgaConversionError, match=f"'t.{refused}' has dtype {refused}"):
            convert(src, dst)
        assert not dst.exists()


def test_safetensors_f4_counts_values_and_matches_the_library(tmp_path):
    """safetensors' F4 counts 4-bit values: the header's last dimension is twice torch's
    float4_e2m1fn_x2 shape, byte-identical to what the library's torch binding writes; a 0-d one
    has no F4 shape and is refused typed; an F4 tensor with an odd last dimension is refused at read."""
    import json
    import struct

    import pytest
    import safetensors.torch
    import torch

    from vcga.errors import VcgaConversionError, VcgaFormatError

    t = torch.arange(12, dtype=torch.uint8).reshape(2, 6).view(torch.float4_e2m1fn_x2)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_all(stf.SPEC, ours, [TensorEntry("w", "float4_e2m1fn_x2", (2, 6), bytes(range(12)), {})], {})
    safetensors.torch.save_file({"w": t}, str(theirs))
    assert ours.read_bytes() == theirs.read_bytes()
    (n,) = struct.unpack("<Q", ours.read_bytes()[:8])
    assert json.loads(ours.read_bytes()[8:8 + n])["w"]["shape"] == [2, 12]
    _, got = read_all(stf.SPEC, ours)
    assert got["w"][:3] == ("float4_e2m1fn_x2", (2, 6), bytes(range(12)))
    with pytest.raises(VcgaConversionError, match="0-d float4_e2m1fn_x2"):
        write_all(stf.SPEC, tmp_path / "z.safetensors", [TensorEntry("z", "float4_e2m1fn_x2", (), b"\x01", {})], {})
    odd = tmp_path / "odd.safetensors"
    header = json.dumps({"w": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}).encode()
    header += b" " * (-len(header) % 8)
    odd.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 3)
    with pytest.raises(VcgaFormatError):
        read_all(stf.SPEC, odd)
