"""The dtype table against the real libraries: torch, numpy/ml_dtypes, safetensors, h5py/HDF5."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import h5py
import ml_dtypes
import numpy as np
import pytest
import torch

from vcga import dtypes
from vcga.errors import VcgaConversionError


def test_importing_the_table_imports_neither_torch_nor_numpy():
    code = "import sys, vcga.dtypes; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_table_covers_the_issue_list():
    assert set(dtypes.ALL) == {
        "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16",
        "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}
    assert set(dtypes.STORAGE_ONLY) == {"complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                                        "float4_e2m1fn_x2"}
    assert dtypes.EVERY == dtypes.ALL + dtypes.STORAGE_ONLY
    assert sorted(d.code for d in dtypes.DTYPES.values()) == list(range(1, 23))


def _torch_dtypes() -> list[torch.dtype]:
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def test_every_dtype_torch_checkpoints_is_in_the_table(tmp_path):
    """What torch's own dcp.save writes (it writes a tensor's bytes whatever its dtype) must be a
    dtype VCGA knows: a checkpoint torch wrote must convert. Outside: dtypes torch cannot even
    allocate or save (sub-byte ints, bits) and the quantized ones (a quantized tensor is its
    integers plus a scale and zero point, not a dtype of plain values; viewing bytes as qint8
    makes a tensor without them)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    written = []
    for i, dt in enumerate(_torch_dtypes()):
        if str(dt).startswith(("torch.qint", "torch.quint")):
            continue
        try:
            t = torch.zeros(2 * dt.itemsize, dtype=torch.uint8).view(dt)
        except (RuntimeError, TypeError):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dcp.save({"t": t}, checkpoint_id=str(tmp_path / str(i)))
            except (Exception, CheckpointException):  # noqa: BLE001 - a probe: any refusal skips the dtype
                continue
        written.append(str(dt).removeprefix("torch."))
    assert "float8_e8m0fnu" in written and "complex32" in written  # the probe did write odd ones
    assert set(written) - set(dtypes.EVERY) == set(), "torch writes dtypes VCGA does not know"


@pytest.mark.parametrize("name", dtypes.ALL)
def test_torch_and_numpy_agree_with_the_table(name):
    d = dtypes.get(name)
    tdt, ndt = dtypes.to_torch(name), dtypes.to_numpy(name)
    assert dtypes.from_torch(tdt) == name and dtypes.from_numpy(ndt) == name
    assert tdt.itemsize == ndt.itemsize == d.itemsize
    assert tdt.is_complex == (d.kind == "c") and tdt.is_floating_point == (d.kind == "f")
    assert ndt.byteorder in "<|=" and (ndt.byteorder != "=" or sys.byteorder == "little")
    assert dtypes.canonical(tdt) == dtypes.canonical(ndt) == dtypes.canonical(f"torch.{name}") == name
    assert dtypes.from_code(d.code) == name and dtypes.to_code(name) == d.code
    # torch and numpy read the same bytes as the same values (bit views, so NaNs compare too)
    raw = np.arange(4 * d.itemsize, dtype=np.uint8) * 37
    if name == "bool":
        raw = raw % 2
    a = raw.view(ndt)
    t = torch.from_numpy(raw.copy()).view(tdt)
    assert t.view(torch.uint8).numpy().tobytes() == a.view(np.uint8).tobytes()


def test_ml_dtypes_provide_the_types_numpy_lacks():
    for name in dtypes.ML_DTYPES:
        assert dtypes.to_numpy(name) == np.dtype(getattr(ml_dtypes, name))
    # ml_dtypes' other fp8 flavours are different encodings, not ours
    for other in (ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.float4_e2m1fn):
        with pytest.raises(dtypes.UnknownDTypeError):
            dtypes.from_numpy(other)
    # and their values agree with torch's float8 types bit for bit
    bits = np.arange(256, dtype=np.uint8)
    for name in (*dtypes.FP8, "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        a = bits.view(dtypes.to_numpy(name)).astype(np.float32)
        t = torch.from_numpy(bits.copy()).view(dtypes.to_torch(name)).float().numpy()
        assert np.array_equal(a, t, equal_nan=True)


@pytest.mark.parametrize("name", dtypes.STORAGE_ONLY)
def test_the_storage_only_dtypes_against_torch(name):
    d = dtypes.get(name)
    tdt = dtypes.to_torch(name)
    assert dtypes.from_torch(tdt) == name and dtypes.canonical(tdt) == name and tdt.itemsize == d.itemsize
    assert tdt.is_complex == (d.kind == "c")
    assert dtypes.from_code(d.code) == name
    ndt = dtypes.to_numpy(name)
    assert ndt.itemsize == d.itemsize
    if name in dtypes.NUMPY_OPAQUE:  # numpy has no such type: opaque bytes, never mistaken for another
        assert ndt.kind == "V"
        with pytest.raises(dtypes.UnknownDTypeError):
            dtypes.from_numpy(ndt)
    else:
        assert dtypes.from_numpy(ndt) == name
    assert name not in dtypes.ALL  # no capability table lists it: collectives refuse it
    with pytest.raises(VcgaConversionError, match="mindspore has no dtype"):
        dtypes.to_mindspore(name)


def test_numpy_outsiders_are_refused():
    for bad in (np.float128 if hasattr(np, "float128") else np.longdouble, object, "U3", [("a", "<f4")], "V4"):
        with pytest.raises(dtypes.UnknownDTypeError):
            dtypes.from_numpy(bad)
    assert dtypes.from_numpy(np.dtype(">f4")) == "float32"  # byte order is the caller's business


def test_torch_outsiders_are_refused():
    for bad in (torch.quint8, torch.bits8, torch.uint4):
        with pytest.raises(dtypes.UnknownDTypeError, match="unknown torch dtype"):
            dtypes.from_torch(bad)


def test_safetensors_spellings_match_the_library(tmp_path):
    """Write one tensor of each dtype with safetensors itself and read the header it wrote."""
    from safetensors.torch import save_file

    for name in dtypes.EVERY:
        tdt = dtypes.to_torch(name)
        t = torch.zeros(2 * tdt.itemsize, dtype=torch.uint8).view(tdt)
        path = tmp_path / f"{name}.safetensors"
        if name not in dtypes.SAFETENSORS:
            with pytest.raises(Exception):  # noqa: B017 - safetensors' own refusal; VCGA's typed one is below
                save_file({"t": t}, str(path))
            with pytest.raises(VcgaConversionError, match=f"safetensors has no dtype for {name}"):
                dtypes.to_safetensors(name)
            continue
        save_file({"t": t}, str(path))
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        assert header["t"]["dtype"] == dtypes.to_safetensors(name)
        assert dtypes.from_safetensors(header["t"]["dtype"]) == name


def test_mindspore_spellings():
    # str(mindspore.<dtype>) in MindSpore 2.10 (checked in its venv); .ckpt accepts a subset
    assert dtypes.to_mindspore("bfloat16") == "BFloat16"
    assert dtypes.to_mindspore("float8_e4m3fn") == "Float8E4M3FN"
    assert dtypes.to_mindspore("uint8", ckpt=True) == "UInt8"
    assert dtypes.from_mindspore("Uint8") == "uint8"  # MindSpore < 2.0 spelling in old .ckpt files
    for name in dtypes.ALL:
        assert dtypes.from_mindspore(dtypes.to_mindspore(name)) == name
    for name in ("complex64", "complex128", "float8_e4m3fn", "float8_e5m2"):
        with pytest.raises(VcgaConversionError, match="mindspore-ckpt has no dtype"):
            dtypes.to_mindspore(name, ckpt=True)


def test_mindspore_spellings_against_mindspore_itself():
    """Optional oracle: the MindSpore venv beside the repository, where it was installed."""
    py = "/work/venvs/mindspore/bin/python"
    import os

    if not os.path.exists(py):
        pytest.skip("no MindSpore venv on this machine")
    code = ("import json; from mindspore import dtype as m; "
            f"print(json.dumps({{n: str(getattr(m, 'bool_' if n == 'bool' else n)) for n in {dtypes.ALL!r}}}))")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode:
        pytest.skip(f"MindSpore did not import: {out.stderr[-200:]}")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {n: dtypes.get(n).mindspore for n in dtypes.ALL}


@pytest.mark.parametrize("name", sorted(dtypes.H5PY_NATIVE - {"bool"}))
def test_hdf5_names_are_the_types_h5py_writes(tmp_path, name):
    with h5py.File(tmp_path / "t.h5", "w") as f:
        ds = f.create_dataset("x", data=np.zeros(2, dtype=dtypes.to_numpy(name)))
        stored = ds.id.get_type()
        if dtypes.get(name).kind == "c":
            # h5py writes complex as an {r, i} compound; HDF5 2.0's own complex type is a separate class
            assert stored.get_class() == h5py.h5t.COMPOUND
            assert getattr(h5py.h5t, dtypes.to_hdf5(name).removeprefix("H5T_")).get_size() == stored.get_size()
        else:
            assert stored.equal(getattr(h5py.h5t, dtypes.to_hdf5(name).removeprefix("H5T_")))
        assert dtypes.from_numpy(ds.dtype) == name
    assert dtypes.from_hdf5(dtypes.to_hdf5(name)) == name


def test_hdf5_bool_and_the_types_h5py_cannot_write(tmp_path):
    with pytest.raises(VcgaConversionError, match="enum"):
        dtypes.to_hdf5("bool")
    with h5py.File(tmp_path / "t.h5", "w") as f:
        assert f.create_dataset("b", data=np.zeros(2, dtype=bool)).id.get_type().get_class() == h5py.h5t.ENUM
        # h5py 3.16 stores bf16 and e4m3fn as opaque bytes and refuses e5m2 (ml_dtypes reports its
        # kind as "f"): a writer needs VCGA's convention for all three
        for name in ("bfloat16", "float8_e4m3fn"):
            ds = f.create_dataset(name, data=np.zeros(2, dtype=dtypes.to_numpy(name)))
            assert ds.id.get_type().get_class() == h5py.h5t.OPAQUE
        with pytest.raises(TypeError, match="Unsupported float type"):
            f.create_dataset("e5m2", data=np.zeros(2, dtype=dtypes.to_numpy("float8_e5m2")))
    assert frozenset(dtypes.EVERY) == dtypes.HDF5


def test_unknown_names_raise_typed_errors():
    for f in (dtypes.get, dtypes.from_safetensors, dtypes.from_mindspore, dtypes.from_hdf5, dtypes.canonical):
        with pytest.raises(dtypes.UnknownDTypeError):
            f("bf16")
    with pytest.raises(dtypes.UnknownDTypeError):
        dtypes.from_code(0)
    with pytest.raises(dtypes.UnknownDTypeError):
        dtypes.get(["float32"])  # unhashable input is still a typed error


def test_bits_dtype_views_the_same_bytes():
    for name in dtypes.EVERY:
        assert dtypes.bits_dtype(name).itemsize == dtypes.get(name).itemsize
