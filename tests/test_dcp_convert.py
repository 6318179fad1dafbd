"""vcga convert / vcga inspect on torch.distributed.checkpoint directories written by torch's own
dcp.save (FileSystemWriter layout): bit-exact for every dtype torch writes (bool, the integers,
fp16, bf16, fp32, fp64, complex32/64/128, every fp8 flavour, packed fp4) into vendor-bin, and into
safetensors for every dtype safetensors has (complex32 and complex128 are refused by name), and
typed errors for damaged directories -- a missing shard, corrupt metadata, a pickle with code
(never run).
Sharded tensors (FSDP2 chunks from several ranks) and VCGA's layout: tests/test_checkpoint_world.py."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from vcga import dtypes
from vcga.convert import convert, inspect_checkpoint
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formats import vbin

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32, torch.float8_e4m3fnuz,
          torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]
#: What safetensors has no dtype for.
NOT_IN_SAFETENSORS = (torch.complex128, torch.complex32)


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype, random bits (NaN payloads, -0.0, subnormals included), strided and not, 0-d, empty."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dt in enumerate(DTYPES):
        item = torch.empty((), dtype=dt).element_size()
        raw = torch.randint(0, 256, (6, 5, 4 * item), dtype=torch.uint8, generator=g)
        t = (raw[..., ::item] & 1).bool() if dt == torch.bool else raw.view(dt)
        out[f"t.{_name(dt)}"] = t.transpose(0, 1) if i % 2 else t  # odd ones are saved non-contiguous
    out["scalar.bf16"] = torch.tensor(-0.0, dtype=torch.bfloat16)
    out["empty"] = torch.empty(0, 3)
    return out


@pytest.fixture(scope="module")
def torch_dcp(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("dcp") / "ckpt"
    tensors = _tensors()
    state = {**tensors, "step": 7, "optim": {"lr": 0.25, "betas": (0.9, 0.999)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(d))  # torch's own writer: .metadata + __0_0.distcp
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp"]
    return d, tensors


def _bits(t: torch.Tensor) -> bytes:
    if not t.numel():
        return b""
    if t.element_size() in (1, 2, 4, 8):  # an integer view of the same width: copies for every dtype
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _safetensors_file(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes) straight from the file (safetensors 0.8's torch binding
    cannot load F8_E8M0 or F4, though it writes them)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def test_torch_dcp_directory_converts_bit_exact_for_every_dtype(torch_dcp, tmp_path):
    d, tensors = torch_dcp
    import safetensors
    import safetensors.torch

    # vendor-bin holds every dtype: one conversion, compared bit by bit.
    rep = convert(d, tmp_path / "all.vbin", verify=True)
    assert rep.tensors == len(tensors) and rep.verified
    with vbin.VbinReader(tmp_path / "all.vbin") as r:
        assert set(r.keys()) == set(tensors)
        for name, t in tensors.items():
            got = r.torch(name)
            assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), name
            assert _bits(got) == _bits(t), name
        assert json.loads(r.metadata["dcp.objects"]) == {"step": 7, "optim.lr": 0.25, "optim.betas": [0.9, 0.999]}
        assert r.metadata["dcp.layout"] == "torch"
    # safetensors: every dtype it holds (complex128 and complex32 are refused by name unless cast).
    with pytest.raises(VcgaConversionError, match=r"'t.complex(128|32)' has dtype complex(128|32)"):
        convert(d, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    held = {k: v for k, v in tensors.items() if v.dtype not in NOT_IN_SAFETENSORS}
    d2 = tmp_path / "st"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(held, checkpoint_id=str(d2))
    convert(d2, tmp_path / "m.safetensors", verify=True)
    with safetensors.safe_open(str(tmp_path / "m.safetensors"), framework="numpy") as f:  # the library accepts it
        assert set(f.keys()) == set(held)
    on_disk = _safetensors_file(tmp_path / "m.safetensors")
    loadable = {k for k, v in on_disk.items() if v[0] not in ("F8_E8M0", "F4")}
    for name, t in held.items():
        st_dtype, shape, data = on_disk[name]
        want_shape = list(t.shape) if t.dtype != torch.float4_e2m1fn_x2 else [*t.shape[:-1], 2 * t.shape[-1]]
        assert (st_dtype, shape) == (dtypes.to_safetensors(_name(t.dtype)), want_shape), name
        assert data == _bits(t), name
    # and the library's torch binding reads back the same tensors, where it can read the dtype
    from safetensors.torch import load as st_load

    only = {k: held[k] for k in loadable}
    d3 = tmp_path / "st3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(only, checkpoint_id=str(d3))
    convert(d3, tmp_path / "l.safetensors")
    got = st_load((tmp_path / "l.safetensors").read_bytes())
    for name, t in only.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape), name
        assert _bits(got[name]) == _bits(t), name
    # complex32 goes to safetensors through an exact cast to complex64
    c32 = tmp_path / "c32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"z": tensors["t.complex32"]}, checkpoint_id=str(c32))
    convert(c32, tmp_path / "z.safetensors", casts={"complex32": "complex64"})
    z = st_load((tmp_path / "z.safetensors").read_bytes())["z"]
    a, b = z.view(torch.float32), tensors["t.complex32"].to(torch.complex64).view(torch.float32)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])  # NaN payloads aside
    # inspect lists what DCP holds without reading tensor data, and reads it all with --verify.
    rep = inspect_checkpoint(d, verify=True)
    assert rep.format == "dcp" and {r["name"] for r in rep.tensors} == set(tensors)
    assert all(r["status"] == "computed" for r in rep.tensors)


def test_the_cli_reads_a_dcp_directory_without_importing_torch(torch_dcp, tmp_path):
    d, _ = torch_dcp
    code = ("import sys, runpy; sys.argv = ['vcga', 'convert', sys.argv[1], sys.argv[2]];"
            "import vcga.cli as c\ntry:\n    c.main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code, str(d), str(tmp_path / "m.vbin")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (tmp_path / "m.vbin").exists()


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_damaged_directories_are_typed_errors(torch_dcp, tmp_path):
    d, _ = torch_dcp
    # a shard file missing
    c = _copy(d, tmp_path)
    (c / "__0_0.distcp").unlink()
    with pytest.raises(VcgaFormatError, match="shard file __0_0.distcp is missing"):
        convert(c, tmp_path / "o.vbin")
    assert not (tmp_path / "o.vbin").exists()
    shutil.rmtree(c)
    # a truncated shard file
    c = _copy(d, tmp_path)
    data = (c / "__0_0.distcp").read_bytes()
    (c / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(VcgaFormatError, match="truncated|run past|not a torch.save archive"):
        convert(c, tmp_path / "o.vbin")
    shutil.rmtree(c)
    # corrupt metadata: cut short, and garbage
    c = _copy(d, tmp_path)
    meta = (c / ".metadata").read_bytes()
    for bad in (meta[: len(meta) // 2], b"\x00" * 40, b"not a pickle at all"):
        (c / ".metadata").write_bytes(bad)
        with pytest.raises(VcgaFormatError, match="DCP metadata is damaged"):
            inspect_checkpoint(c)
    # metadata that is a pickle, but of something else
    (c / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(VcgaFormatError, match="not DCP Metadata"):
        inspect_checkpoint(c)
    # no .metadata at all: not a DCP directory
    (c / ".metadata").unlink()
    with pytest.raises(VcgaFormatError, match="is a directory"):
        convert(c, tmp_path / "o.vbin")
    shutil.rmtree(c)


class _Evil:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_pickles_with_code_are_refused_and_never_run(torch_dcp, tmp_path):
    d, _ = torch_dcp
    _Evil.marker = str(tmp_path / "pwned")
    # .metadata with a __reduce__ calling os.system
    c = _copy(d, tmp_path)
    (c / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(VcgaFormatError, match="refused: the pickle needs posix.system, which is not one of DCP's"):
        convert(c, tmp_path / "o.vbin")
    # a class DCP's metadata never uses, smuggled inside otherwise valid metadata
    md = pickle.loads((d / ".metadata").read_bytes())  # our own file, written just now
    md.planner_data = {"x": _Evil()}
    (c / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(VcgaFormatError, match="refused: the pickle needs posix.system"):
        inspect_checkpoint(c)
    shutil.rmtree(c)
    # a chunk whose own pickle (inside its torch.save archive) calls os.system; the archive's CRCs
    # are fixed up, so only the pickle's content is wrong
    c = _copy(d, tmp_path)
    loc = next(v for k, v in pickle.loads((d / ".metadata").read_bytes()).storage_data.items()
               if k.fqn == "t.float32")
    blob = bytearray((c / loc.relative_path).read_bytes())
    item = blob[loc.offset:loc.offset + loc.length]
    with zipfile.ZipFile(io.BytesIO(bytes(item))) as z:
        info = z.getinfo("archive/data.pkl")
    evil = pickle.dumps(_Evil(), protocol=2)
    assert len(evil) <= info.file_size
    evil = evil.ljust(info.file_size, b".")  # same length: pickle stops at its STOP opcode
    h = info.header_offset
    name_len, extra_len = struct.unpack("<HH", item[h + 26:h + 30])  # the local header's own lengths
    at = h + 30 + name_len + extra_len
    item[at:at + len(evil)] = evil
    crc = struct.pack("<I", zlib.crc32(evil))
    if item[at + len(evil):at + len(evil) + 4] == b"PK\x07\x08":  # a data descriptor follows the data
        item[at + len(evil) + 4:at + len(evil) + 8] = crc
    cd = item.index(b"PK\x01\x02")  # the central directory: data.pkl's entry holds its CRC too
    while item[cd + 46:cd + 46 + len(info.filename)] != info.filename.encode():
        cd = item.index(b"PK\x01\x02", cd + 4)
    item[cd + 16:cd + 20] = crc
    blob[loc.offset:loc.offset + loc.length] = item
    (c / loc.relative_path).write_bytes(bytes(blob))
    with pytest.raises(VcgaFormatError, match="t.float32.*refused: needs posix.system"):
        convert(c, tmp_path / "o.vbin")
    assert not Path(_Evil.marker).exists()


def test_the_destination_may_not_be_inside_the_source_directory(torch_dcp, tmp_path):
    d, _ = torch_dcp
    c = _copy(d, tmp_path)
    with pytest.raises(VcgaConversionError, match="inside the source directory"):
        convert(c, c / "model.vbin")
    assert sorted(os.listdir(c)) == [".metadata", "__0_0.distcp"]
