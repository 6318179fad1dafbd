"""The torch .pt format: weights_only reads, torch.save-identical streaming writes, tied tensors."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from ckpt_helpers import FIXTURES, checkpoint_for, read_all, write_all

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formats import torch_pt


def _state_dict():
    g = torch.Generator().manual_seed(0)
    sd = collections.OrderedDict()
    for dt in dtypes.ALL:
        raw = torch.randint(0, 256, (2, 3, dtypes.get(dt).itemsize), dtype=torch.uint8, generator=g)
        if dt == "bool":
            raw = raw % 2
        sd[f"t.{dt}"] = raw.view(getattr(torch, dt)).reshape(2, 3)
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4, dtype=torch.int64)
    sd["tied"] = sd["t.float32"].detach()  # what Module.state_dict() gives for tied parameters
    sd._metadata = collections.OrderedDict([("", {"version": 1}), ("layer", {"version": 2})])
    return sd


def _bytes(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("mode", ["plan", "noplan"])
def test_writer_pickle_is_torch_saves_and_ties_survive(tmp_path, mode):
    sd = _state_dict()
    torch.save(sd, tmp_path / "ref.pt")
    with torch_pt.TorchReader(tmp_path / "ref.pt") as r:
        plan = r.index() if mode == "plan" else None
        with torch_pt.TorchWriter(tmp_path / "ours.pt", plan=plan) as w:
            w.set_metadata(r.metadata)
            for e in r.entries():
                w.write(e)
    ref, ours = zipfile.ZipFile(tmp_path / "ref.pt"), zipfile.ZipFile(tmp_path / "ours.pt")
    assert ref.read("ref/data.pkl") == ours.read("archive/data.pkl")
    if mode == "plan":  # same records in the same order as torch.save
        assert [i.filename.split("/", 1)[1] for i in ref.infolist()] == \
               [i.filename.split("/", 1)[1] for i in ours.infolist()]
    for mmap in (False, True):
        back = torch.load(tmp_path / "ours.pt", weights_only=True, mmap=mmap)
        assert list(back) == list(sd)
        for k, t in sd.items():
            assert (back[k].dtype, back[k].shape, _bytes(back[k])) == (t.dtype, t.shape, _bytes(t)), k
        assert back["tied"].untyped_storage().data_ptr() == back["t.float32"].untyped_storage().data_ptr()
        assert back._metadata == sd._metadata


def test_tie_claim_with_different_bytes_is_refused(tmp_path):
    a = TensorEntry("a", "float32", (2,), bytes(8))
    b = TensorEntry("b", "float32", (2,), b"\x01" * 8, {torch_pt.TIED_TO: "a"})
    with pytest.raises(VcgaConversionError, match="bytes differ"):
        write_all(torch_pt.SPEC, tmp_path / "o.pt", [a, b])
    assert list(tmp_path.iterdir()) == []


def test_every_dtype_round_trips_through_our_writer(tmp_path):
    entries = checkpoint_for(list(dtypes.EVERY))
    write_all(torch_pt.SPEC, tmp_path / "o.pt", entries)
    _, got = read_all(torch_pt.SPEC, tmp_path / "o.pt")
    for e in entries:
        assert got[e.name][:3] == (e.dtype, e.shape, bytes(e.data))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = marker
    torch.save({"w": torch.ones(2), "x": evil}, tmp_path / "evil.pt")
    with pytest.raises(VcgaFormatError, match="weights-only allow-list.*posix.system"):
        torch_pt.TorchReader(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("cut", [0, 10, 200, -30, -1])
def test_truncated_files_give_format_errors(tmp_path, cut):
    raw = (FIXTURES / "state_dict.pt").read_bytes()
    p = tmp_path / "t.pt"
    p.write_bytes(raw[:cut])
    with pytest.raises(VcgaFormatError):
        read_all(torch_pt.SPEC, p)


def test_bare_tensor_and_sparse_are_refused(tmp_path):
    torch.save(torch.ones(3), tmp_path / "bare.pt")
    with pytest.raises(VcgaFormatError, match="bare tensor"):
        torch_pt.TorchReader(tmp_path / "bare.pt")
    torch.save({"s": torch.eye(3).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(VcgaFormatError, match="layout"):
        torch_pt.TorchReader(tmp_path / "sparse.pt")


def test_module_import_and_sniff_do_not_import_torch():
    code = ("import sys; from vcga.formats import torch_pt; "
            f"assert torch_pt.sniff({str(FIXTURES / 'state_dict.pt')!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
