"""Fixtures made by the real producers (h5py, Keras 3, safetensors, torch) read back exactly.

Every value is checked: each tensor's bytes are recomputed from tests/fixtures/recipes.py, which
scripts/make_fixtures.py also uses to make the files.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ckpt_helpers import FIXTURES, expected_bytes, finite, read_all

from vcga import dtypes
from vcga.convert import detect_source
from vcga.formats import hdf5 as hdf5_format
from vcga.formats import safetensors_format, torch_pt

INTS_FLOATS = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
               "float32", "float64", "complex64", "complex128"]


def test_h5py_tree_every_dataset_and_value():
    meta, got = read_all(hdf5_format.SPEC, FIXTURES / "h5py_tree.h5")
    want: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for dt in INTS_FLOATS:
        want[f"plain/{dt}"] = (dt, (3, 5), expected_bytes(f"plain/{dt}", dt, (3, 5)))
    for dt in ["int16", "uint32", "int64", "float32", "float64"]:  # stored big-endian, read little-endian
        want[f"bigendian/{dt}"] = (dt, (4, 3), expected_bytes(f"bigendian/{dt}", dt, (4, 3)))
    want["compressed/gzip"] = ("float32", (64, 33), expected_bytes("compressed/gzip", "float32", (64, 33)))
    want["compressed/lzf"] = ("int64", (50, 7), expected_bytes("compressed/lzf", "int64", (50, 7)))
    want["compressed/gzip_bigendian"] = ("float64", (20, 5),
                                         expected_bytes("compressed/gzip_bigendian", "float64", (20, 5)))
    want["scalars/f64"] = ("float64", (), expected_bytes("scalars/f64", "float64", ()))
    want["scalars/i32"] = ("int32", (), expected_bytes("scalars/i32", "int32", ()))
    want["empty/f32"] = ("float32", (0, 4), b"")
    for dt in ["bfloat16", "float8_e4m3fn"]:
        want[f"keras_style/{dt}"] = (dt, (2, 6), expected_bytes(f"keras_style/{dt}", dt, (2, 6)))
    for name, dt in [("bfloat16_le", "bfloat16"), ("bfloat16_be", "bfloat16"),
                     ("float8_e4m3fn_le", "float8_e4m3fn"), ("float8_e5m2_le", "float8_e5m2")]:
        want[f"custom_float/{name}"] = (dt, (3, 4), expected_bytes(f"custom_float/{name}", dt, (3, 4)))
    want["links/hard"] = want["plain/float32"]
    want["links/soft"] = want["plain/int64"]
    assert set(got) == set(want)
    for name, (dt, shape, data) in want.items():
        assert got[name][:3] == (dt, shape, data), name
    # attributes: plain strings stay strings; typed values keep their HDF5 type through h5attr: JSON
    assert got["plain/float32"][3] == {"unit": "none"}
    assert meta["title"] == "vcga h5py fixture"
    assert meta["epoch"] == 'h5attr:{"dtype":"<i8","shape":[],"value":[7]}'
    assert meta["layer_names"] == 'h5attr:{"dtype":"|S5","shape":[2],"value":["dense","conv"]}'
    assert meta["empty_attr"] == 'h5attr:{"dtype":"<f8","empty":true}'
    assert '"empty_group":{"kind":"no datasets"}' in meta[hdf5_format.GROUPS_KEY]


def _keras_expected(dtype=None):
    shapes = [(4, 3), (3,), (3, 2), (2,)]
    vals = [finite(f"keras.{i}", s) for i, s in enumerate(shapes)]
    if dtype == "bfloat16":
        vals = [v.astype(ml_dtypes.bfloat16) for v in vals]
    return vals


def test_keras3_legacy_h5_model_file():
    meta, got = read_all(hdf5_format.SPEC, FIXTURES / "keras3_legacy.h5")
    k, b, k2, b2 = _keras_expected()
    assert got == {
        "model_weights/dense/seq/dense/kernel": ("float32", (4, 3), k.tobytes(), {}),
        "model_weights/dense/seq/dense/bias": ("float32", (3,), b.tobytes(), {}),
        "model_weights/out/seq/out/kernel": ("float32", (3, 2), k2.tobytes(), {}),
        "model_weights/out/seq/out/bias": ("float32", (2,), b2.tobytes(), {}),
    }
    assert meta["backend"] == "torch" and meta["keras_version"].startswith("3.")
    # Keras writes model_config as a variable-length ASCII string: kept with its HDF5 type
    value, _ = hdf5_format.decode_attr(meta["model_config"])
    assert meta["model_config"].startswith('h5attr:{"dtype":"vlen-ascii"')
    assert b'"class_name": "Sequential"' in value.item()


@pytest.mark.parametrize("fixture,dtype", [("keras3.weights.h5", None), ("keras3_bf16.weights.h5", "bfloat16")])
def test_keras3_weights_files(fixture, dtype):
    _, got = read_all(hdf5_format.SPEC, FIXTURES / fixture)
    k, b, k2, b2 = _keras_expected(dtype)
    dt = dtype or "float32"
    assert got == {
        "layers/dense/vars/0": (dt, (4, 3), k.tobytes(), {}),
        "layers/dense/vars/1": (dt, (3,), b.tobytes(), {}),
        "layers/dense_1/vars/0": (dt, (3, 2), k2.tobytes(), {}),
        "layers/dense_1/vars/1": (dt, (2,), b2.tobytes(), {}),
    }


def test_safetensors_library_file():
    meta, got = read_all(safetensors_format.SPEC, FIXTURES / "library.safetensors")
    assert meta == {"format": "pt", "producer": "safetensors.torch.save_file"}
    # The library wrote every dtype of the collective world that safetensors has (the fixture's
    # dtypes, scripts/make_fixtures.py); the storage-only dtypes torch's dcp.save writes are read
    # from files torch and the library wrote in tests/test_dcp_convert.py.
    made = safetensors_format.SPEC.dtypes & set(dtypes.ALL)
    for dt in made:
        assert got[f"model.{dt}"][:3] == (dt, (4, 3), expected_bytes(f"model.{dt}", dt, (4, 3)))
    assert got["scalar"][:3] == ("float32", (), expected_bytes("scalar", "float32", ()))
    assert got["empty"][:3] == ("int64", (0, 3), b"")
    assert len(got) == len(made) + 2


def test_torch_state_dict_with_tied_and_shared_tensors():
    meta, got = read_all(torch_pt.SPEC, FIXTURES / "state_dict.pt")
    emb = finite("embed.weight", (11, 6)).tobytes()
    assert got["embed.weight"] == ("float32", (11, 6), emb, {})
    assert got["head.weight"] == ("float32", (11, 6), emb, {torch_pt.TIED_TO: "embed.weight"})
    assert got["norm.weight"][2] == finite("norm.weight", (6,)).tobytes()
    assert got["norm.bias"][2] == finite("norm.bias", (6,)).tobytes()
    assert got["steps"][:3] == ("int64", (), np.int64(12345).tobytes())
    for dt in ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
               "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]:
        assert got[f"extra.{dt}"][:3] == (dt, (2, 5), expected_bytes(f"extra.{dt}", dt, (2, 5))), dt
    base = expected_bytes("shared.base", "float32", (4, 4))
    assert got["shared.base"][2] == base
    assert got["shared.rows"] == ("float32", (2, 4), base[16:48], {torch_pt.SHARES_STORAGE_WITH: "shared.base"})
    assert got["scalar"][:3] == ("float64", (), expected_bytes("scalar", "float64", ()))
    assert got["empty"][:3] == ("bfloat16", (0, 2), b"")
    assert '"version": 1' in meta[torch_pt.STATE_DICT_METADATA_KEY]


def test_torch_nested_checkpoint_flattens_and_keeps_scalars():
    meta, got = read_all(torch_pt.SPEC, FIXTURES / "nested.pt")
    assert list(got) == ["model.w", "model.layers.0", "model.layers.1"]
    assert got["model.w"][2] == expected_bytes("model.w", "float32", (3, 2))
    assert got["model.layers.1"][2] == expected_bytes("model.layers.1", "int8", (4,))
    assert meta[torch_pt.EXTRA_KEY] == '{"epoch": 3, "lr": 0.5, "name": "run-7"}'


def test_torch_legacy_format():
    _, got = read_all(torch_pt.SPEC, FIXTURES / "legacy.pt")
    assert got["w"][2] == expected_bytes("legacy.w", "float32", (3, 3))
    assert got["i"][2] == expected_bytes("legacy.i", "int64", (2,))


@pytest.mark.parametrize("fixture,fmt", [("h5py_tree.h5", "hdf5"), ("keras3.weights.h5", "hdf5"),
                                         ("library.safetensors", "safetensors"), ("state_dict.pt", "torch"),
                                         ("legacy.pt", "torch")])
def test_signatures_are_recognised(fixture, fmt, tmp_path):
    # copy under a name with no extension: only the signature can tell
    p = tmp_path / "checkpoint"
    p.write_bytes((FIXTURES / fixture).read_bytes())
    spec, _ = detect_source(p)
    assert spec.name == fmt
