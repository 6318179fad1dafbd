"""Property test: random checkpoints (dtypes, shapes incl. 0-d and empty, unicode names, metadata)
round-trip bit-exact through each of this branch's formats' writer and reader."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_helpers import read_all, write_all
from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.formats import hdf5 as h5f
from vcga.formats import mindrecord, mindspore_ckpt
from vcga.formats import safetensors_format as stf
from vcga.formats import torch_pt

SPECS = [h5f.SPEC, stf.SPEC, torch_pt.SPEC, mindrecord.SPEC, mindspore_ckpt.SPEC]

# A name component: any printable text without '/', not '.' (HDF5 paths); names join 1-3 components.
component = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/"), min_size=1,
                    max_size=12).filter(lambda s: s != ".")


@st.composite
def checkpoints(draw):
    n = draw(st.integers(1, 6))
    names = draw(st.lists(st.lists(component, min_size=1, max_size=3).map("/".join), min_size=n, max_size=n,
                          unique=True))
    # no name may be a group prefix of another (HDF5 paths)
    names = [x for x in names if not any(y.startswith(x + "/") for y in names if y != x)]
    entries = []
    for name in names:
        dt = draw(st.sampled_from(dtypes.ALL))
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
            kept = [e for e in entries if e.dtype in spec.dtypes]
            path = Path(d) / f"c{spec.extensions[0]}"
            write_all(spec, path, kept, {"k": "v"})
            _, got = read_all(spec, path)
            assert set(got) == {e.name for e in kept}, spec.name
            for e in kept:
                assert got[e.name][:3] == (e.dtype, e.shape, e.data), (spec.name, e.name)
                if spec is not torch_pt.SPEC:  # .pt has no place for metadata
                    assert got[e.name][3] == e.metadata, (spec.name, e.name)
            path.unlink()
