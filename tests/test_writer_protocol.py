"""Every built-in writer follows the one commit/abort/finished protocol of formatkit.WriterContext."""

from __future__ import annotations

import os

import numpy as np
import pytest

from vcga.atomic import anonymous_files_supported
from vcga.contract import TensorEntry
from vcga.errors import VcgaConversionError
from vcga.formatkit import WriterContext
from vcga.plugin_manager import VcgaPluginManager

FORMATS = ["vendor-bin", "hdf5", "mindspore-ckpt", "mindrecord", "torch", "safetensors"]
EXT = {"vendor-bin": ".vbin", "hdf5": ".h5", "mindspore-ckpt": ".ckpt", "mindrecord": ".mindrecord", "torch": ".pt",
       "safetensors": ".safetensors"}


def _spec(name):
    return {s.name: s for s in VcgaPluginManager(env={}).formats()}[name]


def _entry(name="w"):
    a = np.arange(6, dtype=np.float32)
    return TensorEntry(name, "float32", (2, 3), memoryview(a.tobytes()), {})


def _open(fmt, path, **kw):
    spec = _spec(fmt)
    plan = [TensorEntry("w", "float32", (2, 3), None, {})]
    return spec.open_writer(path, plan=plan, **kw) if fmt in ("safetensors", "torch") else spec.open_writer(path, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_commit_then_everything_else(tmp_path, fmt):
    path = tmp_path / f"out{EXT[fmt]}"
    w = _open(fmt, path)
    assert isinstance(w, WriterContext) and not w.finished
    w.set_metadata({})
    w.write(_entry())
    if anonymous_files_supported(tmp_path):
        assert os.listdir(tmp_path) == []  # written, but nothing has a name yet
    w.commit()
    assert w.finished and path.exists()
    listing = sorted(os.listdir(tmp_path))
    w.commit()  # a second commit does nothing
    w.abort()  # so does an abort after the commit: the output stays
    assert sorted(os.listdir(tmp_path)) == listing
    with pytest.raises(VcgaConversionError, match="already committed"):
        w.write(_entry("x"))
    with pytest.raises(VcgaConversionError, match="already committed"):
        w.set_metadata({"a": "b"})
    with _spec(fmt).open_reader(path) as r:
        assert [e.name for e in r.index()] == ["w"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_abort_then_everything_else(tmp_path, fmt):
    (tmp_path / f"out{EXT[fmt]}").write_bytes(b"the previous version")
    w = _open(fmt, tmp_path / f"out{EXT[fmt]}")
    w.write(_entry())
    w.abort()
    w.abort()
    assert w.finished
    assert os.listdir(tmp_path) == [f"out{EXT[fmt]}"]
    assert (tmp_path / f"out{EXT[fmt]}").read_bytes() == b"the previous version"
    with pytest.raises(VcgaConversionError, match="already aborted"):
        w.commit()
    with pytest.raises(VcgaConversionError, match="already aborted"):
        w.write(_entry("x"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_block_and_publish_into(tmp_path, fmt):
    """An error inside `with` aborts; publish_into names the outputs in another folder, created at commit."""
    with pytest.raises(RuntimeError), _open(fmt, tmp_path / f"a{EXT[fmt]}") as w:
        w.write(_entry())
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    staging = tmp_path / "staging"
    with _open(fmt, tmp_path / f"b{EXT[fmt]}", publish_into=staging) as w:
        w.write(_entry())
        assert not staging.exists()
    assert os.listdir(tmp_path) == ["staging"] and f"b{EXT[fmt]}" in os.listdir(staging)
