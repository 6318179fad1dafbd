"""Checkpoint files are untrusted (docs/security.md): no file makes VCGA read outside the paths the
user gave -- HDF5 external storage, virtual datasets and links, files a checkpoint names through
'..', absolute paths or symbolic links out of its directory -- nor block on a FIFO, read a device
forever, or build a tensor or an index that does not fit in memory. Each hazard is crafted here
with the library that writes it (h5py, torch, VCGA's own writers)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import sqlite3
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
from ckpt_helpers import read_all, write_all
from click.testing import CliRunner

from vcga import formatkit
from vcga.cli import cli
from vcga.contract import TensorEntry
from vcga.convert import format_by_name
from vcga.errors import VcgaFormatError

#: After this long a reader blocked on one of the tests' FIFOs is let go (it reads end-of-file), and
#: the test fails for it: no test can hang on a FIFO.
RELEASE_AFTER_S = 10.0
READERS = ("hdf5", "safetensors", "torch", "vendor-bin", "mindrecord", "mindspore-ckpt")
TARGETS = ("out.safetensors", "out.pt", "out.h5", "out.mindrecord", "out.vbin", "out.ckpt")
DEVICES = ("/dev/zero", "/dev/urandom")


# The watchdog is a process of its own: a reader blocked in a library that holds the GIL (the
# safetensors binding opening a path) would keep a thread of this process from ever running.
_WATCHDOG = """
import os, select, sys
path, after = sys.argv[1], float(sys.argv[2])
while not select.select([sys.stdin], [], [], after)[0]:  # until the test closes our stdin
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while a reader waits
        print("released a reader", flush=True)
    except OSError:
        pass
"""


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO at ``path``. A watchdog opens its other end whenever someone has been blocked reading
    it for RELEASE_AFTER_S (the blocked open returns, reads end-of-file), and the test then fails:
    nothing may block on it, and no test hangs."""
    os.mkfifo(path)
    watchdog = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(path), str(RELEASE_AFTER_S)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield path
    finally:
        released, _ = watchdog.communicate(timeout=2 * RELEASE_AFTER_S)
    assert not released, f"a reader blocked on the FIFO {path}"


def cli_run(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(cli, [str(a) for a in args])
    return r.exit_code, r.stderr


def one_line_error(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("vcga: error: "), (code, err)
    return lines[0]


def entries(n: int = 3) -> list[TensorEntry]:
    return [TensorEntry(f"layer{i}.weight", "float32", (4,), np.arange(4, dtype="<f4").tobytes(), {})
            for i in range(n)]


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# ---------------------------------------------------------------------------------------------------
# HDF5 that points outside its file
# ---------------------------------------------------------------------------------------------------


def _h5_external_storage(path: Path, outside: Path) -> str:
    with h5py.File(path, "w") as f:
        f["plain"] = np.arange(3.0)
        f.create_dataset("weights", shape=(64,), dtype="u1", external=[(str(outside), 0, 64)])
    return "dataset 'weights' keeps its bytes in another file"


def _h5_virtual(path: Path, outside: Path) -> str:
    with h5py.File(path, "w") as f:
        layout = h5py.VirtualLayout(shape=(8,), dtype="f4")
        layout[:] = h5py.VirtualSource(str(outside), "x", shape=(8,))
        f.create_virtual_dataset("weights", layout)
    return "dataset 'weights' is a virtual dataset mapped onto 'x' in"


def _h5_soft_through_external(path: Path, outside: Path) -> str:
    with h5py.File(path, "w") as f:
        f["a_alias"] = h5py.SoftLink("/z_link/x")  # walked first, and leads through the external link
        f["z_link"] = h5py.ExternalLink(str(outside), "/")
    return "'a_alias (through z_link)' is an external link to"


HDF5_HAZARDS = {"external storage": _h5_external_storage, "virtual dataset": _h5_virtual,
                "soft link through an external link": _h5_soft_through_external}


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("hazard", sorted(HDF5_HAZARDS))
def test_hdf5_data_outside_the_file_is_refused_before_that_file_is_opened(tmp_path, hazard, command):
    # The outside file is a FIFO: opening it at all would block, reading from it would get nothing.
    with fifo(tmp_path / "secret") as secret:
        expected = HDF5_HAZARDS[hazard](tmp_path / "evil.h5", secret)
        before = listing(tmp_path)
        args = ["convert", tmp_path / "evil.h5", tmp_path / "out.safetensors"] if command == "convert" else \
            ["inspect", tmp_path / "evil.h5"]
        line = one_line_error(*cli_run(*args))
    assert expected in line and str(secret) in line, line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("target", TARGETS)
def test_no_target_format_is_left_with_an_output(tmp_path, target):
    with fifo(tmp_path / "secret") as secret:
        _h5_external_storage(tmp_path / "evil.h5", secret)
        before = listing(tmp_path)
        line = one_line_error(*cli_run("convert", tmp_path / "evil.h5", tmp_path / target))
    assert "keeps its bytes in another file" in line
    assert listing(tmp_path) == before


def test_hdf5_names_of_other_files_are_refused_however_they_are_spelled(tmp_path):
    (tmp_path / "sub").mkdir()
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    (tmp_path / "secret").write_bytes(b"s" * 64)
    for i, name in enumerate(["../other.h5", str(other)]):
        with h5py.File(tmp_path / "sub" / f"link{i}.h5", "w") as f:
            f["w"] = h5py.ExternalLink(name, "/x")
        with pytest.raises(VcgaFormatError, match=r"'w' is an external link to .*other\.h5"):
            format_by_name("hdf5").open_reader(tmp_path / "sub" / f"link{i}.h5")
        with h5py.File(tmp_path / "sub" / f"raw{i}.h5", "w") as f:
            f.create_dataset("w", shape=(64,), dtype="u1",
                             external=[("../secret" if i == 0 else str(tmp_path / "secret"), 0, 64)])
        with pytest.raises(VcgaFormatError, match="keeps its bytes in another file"):
            format_by_name("hdf5").open_reader(tmp_path / "sub" / f"raw{i}.h5")


def test_hdf5_soft_links_inside_the_file_still_read(tmp_path):
    with h5py.File(tmp_path / "ok.h5", "w") as f:
        f["g/x"] = np.arange(4.0)
        f["alias"] = h5py.SoftLink("g/x")
        f["g/relative"] = h5py.SoftLink("x")
        f["g/chain"] = h5py.SoftLink("/alias")
        f["loop"] = h5py.SoftLink("/loop")
    with pytest.raises(VcgaFormatError, match="soft link 'loop' leads through more than 16 soft links"):
        read_all(format_by_name("hdf5"), tmp_path / "ok.h5")
    with h5py.File(tmp_path / "ok.h5", "a") as f:
        del f["loop"]
    _, got = read_all(format_by_name("hdf5"), tmp_path / "ok.h5")
    assert sorted(got) == ["alias", "g/chain", "g/relative", "g/x"]
    assert {v[2] for v in got.values()} == {np.arange(4.0).tobytes()}


# ---------------------------------------------------------------------------------------------------
# FIFOs and devices given as the source
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", READERS)
def test_every_reader_refuses_a_fifo_or_a_device(tmp_path, fmt):
    spec = format_by_name(fmt)
    with fifo(tmp_path / "pipe") as pipe, pytest.raises(VcgaFormatError, match="is a FIFO"):
        spec.open_reader(pipe)
    for device in DEVICES:
        with pytest.raises(VcgaFormatError, match="is a character device, not a regular file"):
            spec.open_reader(device)


@pytest.mark.parametrize("args", [
    ["convert", "{pipe}", "{tmp}/o.safetensors"],
    ["convert", "{pipe}", "{tmp}/o.h5", "--from", "safetensors"],
    ["inspect", "{pipe}"],
    ["inspect", "/dev/zero"],
    ["inspect", "/dev/urandom", "--from", "mindspore-ckpt"],
    ["convert", "/dev/urandom", "{tmp}/o.vbin", "--from", "hdf5"],
])
def test_the_cli_refuses_a_fifo_or_a_device_before_sniffing_it(tmp_path, args):
    with fifo(tmp_path / "pipe") as pipe:
        before = listing(tmp_path)
        line = one_line_error(*cli_run(*[a.format(pipe=pipe, tmp=tmp_path) for a in args]))
    assert "not a regular file" in line and ("FIFO" in line or "character device" in line), line
    assert listing(tmp_path) == before


# ---------------------------------------------------------------------------------------------------
# Files a checkpoint names: '..', absolute paths, symbolic links out of its directory
# ---------------------------------------------------------------------------------------------------


def _move_out_and_link(path: Path, outside: Path) -> None:
    """Replace ``path`` by a symbolic link to a copy of it in ``outside`` (a directory elsewhere)."""
    outside.mkdir(exist_ok=True)
    shutil.move(path, outside / path.name)
    path.symlink_to(outside / path.name)


def _hub_snapshot(src_dir: Path, hub: Path) -> Path:
    """``src_dir``'s files laid out as the Hugging Face hub cache does: ``blobs/<hash>`` and a
    ``snapshots/<revision>`` of relative symbolic links to them; returns the snapshot directory."""
    snap = hub / "models--org--name" / "snapshots" / "0123abc"
    blobs = hub / "models--org--name" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(src_dir.iterdir())):
        shutil.copy(p, blobs / f"blob{i}")
        (snap / p.name).symlink_to(Path("../../blobs") / f"blob{i}")
    return snap


def _safetensors_shards(d: Path) -> Path:
    d.mkdir()
    es = entries()
    with format_by_name("safetensors").open_writer(d / "model.safetensors", plan=es, shard_size=16) as w:
        w.set_metadata({})
        for e in es:
            w.write(e)
    return d / "model.safetensors.index.json"


def test_sharded_safetensors_shard_names_stay_in_the_index_directory(tmp_path):
    spec = format_by_name("safetensors")
    index = _safetensors_shards(tmp_path / "ckpt")
    doc = json.loads(index.read_text())
    first = sorted(set(doc["weight_map"].values()))[0]
    for bad in (f"../{first}", str(tmp_path / "ckpt" / first)):
        tampered = dict(doc, weight_map={k: (bad if v == first else v) for k, v in doc["weight_map"].items()})
        index.write_text(json.dumps(tampered))
        with pytest.raises(VcgaFormatError, match="not a plain file name"):
            spec.open_reader(index)
    index.write_text(json.dumps(doc))
    assert len(read_all(spec, index)[1]) == 3
    hub_snap = _hub_snapshot(tmp_path / "ckpt", tmp_path / "hub")  # links into the hub's blobs: followed
    assert read_all(spec, hub_snap / index.name)[1] == read_all(spec, index)[1]
    _move_out_and_link(tmp_path / "ckpt" / first, tmp_path / "elsewhere")
    with pytest.raises(VcgaFormatError, match=f"shard '{first}' is a symbolic link to .*elsewhere.*outside"):
        spec.open_reader(index)


def test_vbin_shards_may_not_link_out_of_the_directory(tmp_path):
    spec = format_by_name("vendor-bin")
    (tmp_path / "ckpt").mkdir()
    write_all(spec, tmp_path / "ckpt" / "m.vbin", entries(), shard_size=16)
    shard = sorted(p for p in (tmp_path / "ckpt").iterdir() if p.name != "m.vbin")[0]
    assert len(read_all(spec, tmp_path / "ckpt" / "m.vbin")[1]) == 3
    _move_out_and_link(shard, tmp_path / "elsewhere")
    with pytest.raises(VcgaFormatError, match="is a symbolic link to .*outside the checkpoint's directory"):
        read_all(spec, tmp_path / "ckpt" / "m.vbin")


def _mindrecord_shards(d: Path) -> Path:
    d.mkdir()
    write_all(format_by_name("mindrecord"), d / "m.mindrecord", entries(), shard_size=16, header_size=1 << 14,
              page_size=1 << 15)
    return d / "m.mindrecord0"


def _rewrite_header(path: Path, edit) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    header = edit(json.loads(data[8:8 + n]))
    new = json.dumps(header, separators=(",", ":")).encode()
    data[:8 + max(n, len(new))] = struct.pack("<Q", len(new)) + new.ljust(max(n, len(new)), b"\0")
    path.write_bytes(bytes(data))


def test_mindrecord_shards_and_indexes_stay_in_the_dataset_directory(tmp_path):
    spec = format_by_name("mindrecord")
    first = _mindrecord_shards(tmp_path / "ds")
    good = read_all(spec, first)[1]
    assert len(good) == 3
    assert read_all(spec, _hub_snapshot(tmp_path / "ds", tmp_path / "hub") / first.name)[1] == good
    saved = first.read_bytes()
    for bad in ("../m.mindrecord1", str(tmp_path / "ds" / "m.mindrecord1")):
        _rewrite_header(first, lambda h, bad=bad: dict(h, shard_addresses=[h["shard_addresses"][0], bad]))
        with pytest.raises(VcgaFormatError, match="is not a plain file name"):
            spec.open_reader(first)
        first.write_bytes(saved)
    for name in ("m.mindrecord1", "m.mindrecord0.db"):
        shutil.copytree(tmp_path / "ds", tmp_path / "work")
        _move_out_and_link(tmp_path / "work" / name, tmp_path / f"elsewhere-{name}")
        with pytest.raises(VcgaFormatError, match=f"'{name}' is a symbolic link to .*outside"):
            spec.open_reader(tmp_path / "work" / "m.mindrecord0")
        shutil.rmtree(tmp_path / "work")


def test_a_mindrecord_index_that_is_a_view_is_refused(tmp_path):
    first = _mindrecord_shards(tmp_path / "ds")
    con = sqlite3.connect(str(first) + ".db")
    con.execute("ALTER TABLE INDEXES RENAME TO ROWS")
    # A view could compute rows for ever (a recursive query); any view is refused before it is read.
    con.execute("CREATE VIEW INDEXES AS SELECT * FROM ROWS")
    con.commit()
    con.close()
    with pytest.raises(VcgaFormatError, match="INDEXES is a view, not a table"):
        format_by_name("mindrecord").open_reader(first)


def _torch_dcp(d: Path) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0), "v": torch.ones(2, dtype=torch.int64)}, checkpoint_id=str(d))
    return d


def _rename_dcp_files(d: Path, rename) -> None:
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, just written by torch
    for idx, loc in list(md.storage_data.items()):
        md.storage_data[idx] = dataclasses.replace(loc, relative_path=rename(loc.relative_path))
    (d / ".metadata").write_bytes(pickle.dumps(md))


def test_dcp_file_names_stay_in_the_checkpoint_directory(tmp_path):
    from vcga.checkpoint.directory import DcpDirectoryReader

    d = _torch_dcp(tmp_path / "step-1")
    good = read_all(_dcp_spec(), d)[1]
    assert sorted(good) == ["v", "w"]
    assert read_all(_dcp_spec(), _hub_snapshot(d, tmp_path / "hub"))[1] == good
    saved = (d / ".metadata").read_bytes()
    for rename in (lambda n: f"../{n}", lambda n: str(d / n)):
        _rename_dcp_files(d, rename)
        with pytest.raises(VcgaFormatError, match="not a plain file name in the checkpoint directory"):
            DcpDirectoryReader(d)
        (d / ".metadata").write_bytes(saved)
    for name in (".metadata", "__0_0.distcp"):
        shutil.copytree(d, tmp_path / "work")
        _move_out_and_link(tmp_path / "work" / name, tmp_path / f"elsewhere{name}")
        with pytest.raises(VcgaFormatError, match=f"'{name}' is a symbolic link to .*outside"):
            read_all(_dcp_spec(), tmp_path / "work")
        shutil.rmtree(tmp_path / "work")
    # a FIFO in place of a data file, or of the metadata
    for name in ("__0_0.distcp", ".metadata"):
        shutil.copytree(d, tmp_path / "work")
        (tmp_path / "work" / name).unlink()
        with fifo(tmp_path / "work" / name), pytest.raises(VcgaFormatError, match="is a FIFO"):
            read_all(_dcp_spec(), tmp_path / "work")
        shutil.rmtree(tmp_path / "work")


def _dcp_spec():
    from vcga.checkpoint.directory import DCP_SPEC

    return DCP_SPEC


def test_a_path_the_user_names_is_followed_when_it_is_a_symbolic_link(tmp_path):
    """Model-hub caches and users' own folders link files from elsewhere: the path given is theirs."""
    (tmp_path / "store").mkdir()
    write_all(format_by_name("safetensors"), tmp_path / "store" / "m.safetensors", entries())
    with h5py.File(tmp_path / "store" / "m.h5", "w") as f:
        f["w"] = np.arange(4.0)
    d = _torch_dcp(tmp_path / "store" / "dcp")
    (tmp_path / "links").mkdir()
    for name in ("m.safetensors", "m.h5", "dcp"):
        (tmp_path / "links" / name).symlink_to(tmp_path / "store" / name)
    assert cli_run("convert", tmp_path / "links" / "m.safetensors", tmp_path / "a.h5")[0] == 0
    assert cli_run("convert", tmp_path / "links" / "m.h5", tmp_path / "b.safetensors")[0] == 0
    assert cli_run("convert", tmp_path / "links" / "dcp", tmp_path / "c.safetensors")[0] == 0
    assert read_all(_dcp_spec(), d)[1]["w"][2] == read_all(format_by_name("safetensors"),
                                                            tmp_path / "c.safetensors")[1]["w"][2]


# ---------------------------------------------------------------------------------------------------
# .pt on a torch whose weights_only loader could be bypassed (CVE-2025-32434)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version,refused", [("2.4.0", True), ("2.5.1+cu124", True), ("2.6.0", False),
                                             ("2.13.0+cpu", False), ("3.0.0a0", False)])
def test_pt_sources_are_refused_on_a_torch_older_than_2_6(tmp_path, monkeypatch, version, refused):
    import torch

    torch.save({"w": torch.arange(3.0)}, tmp_path / "m.pt")
    monkeypatch.setattr(torch, "__version__", version)
    code, err = cli_run("convert", tmp_path / "m.pt", tmp_path / "o.safetensors")
    if refused:
        line = one_line_error(code, err)
        assert f"torch {version} is too old" in line and "CVE-2025-32434" in line and "torch>=2.6" in line
        assert not (tmp_path / "o.safetensors").exists()
    else:
        assert code == 0, err


# ---------------------------------------------------------------------------------------------------
# Resource limits: a header declaring too many tensors, a tensor declaring too many bytes
# ---------------------------------------------------------------------------------------------------


def _nine_tensors(fmt: str, d: Path) -> Path:
    es = entries(9)
    if fmt == "dcp":
        import torch
        import torch.distributed.checkpoint as dcp

        with __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            dcp.save({e.name: torch.zeros(4) for e in es}, checkpoint_id=str(d / "dcp"))
        return d / "dcp"
    if fmt == "safetensors-index":
        return _safetensors_shards(d / "st")
    ext = {"hdf5": "h5", "vendor-bin": "vbin", "mindspore-ckpt": "ckpt", "torch": "pt"}.get(fmt, fmt)
    kw = {"header_size": 1 << 14, "page_size": 1 << 15} if fmt == "mindrecord" else {}
    write_all(format_by_name(fmt), d / f"m.{ext}", es, **kw)
    return d / f"m.{ext}"


@pytest.mark.parametrize("fmt", [*READERS, "safetensors-index", "dcp"])
def test_every_reader_bounds_the_tensors_a_file_declares(tmp_path, monkeypatch, fmt):
    path = _nine_tensors(fmt, tmp_path)
    spec = _dcp_spec() if fmt == "dcp" else format_by_name(fmt.removesuffix("-index"))
    assert len(read_all(spec, path)[1]) == (3 if fmt == "safetensors-index" else 9)
    monkeypatch.setattr(formatkit, "MAX_TENSORS", 2)
    with pytest.raises(VcgaFormatError, match="MAX_TENSORS"):
        read_all(spec, path)


def test_a_pt_pickle_building_too_many_tensors_is_refused_before_torch_unpickles_it(tmp_path, monkeypatch):
    import torch

    from vcga.formats import torch_pt

    base = torch.zeros(4)
    torch.save({f"v{i}": base[:1] for i in range(600)}, tmp_path / "views.pt")  # one storage, 600 views
    monkeypatch.setattr(formatkit, "MAX_TENSORS", 8)

    def load(*_a, **_k):
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(VcgaFormatError, match="its pickle builds more than 8 tensors"):
        torch_pt.TorchReader(tmp_path / "views.pt")
    torch.save({f"t{i}": torch.zeros(1) for i in range(40)}, tmp_path / "many.pt")  # a storage record each
    with pytest.raises(VcgaFormatError, match=r"holds 4\d zip records, more than the 8 tensors"):
        torch_pt.TorchReader(tmp_path / "many.pt")


def test_a_tensor_larger_than_the_memory_available_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    with h5py.File(tmp_path / "bomb.h5", "w") as f:  # 64 MiB of zeros, stored in a few KiB
        f.create_dataset("bomb", shape=(1 << 24,), dtype="f4", chunks=(1 << 20,), compression="gzip")[:] = 0
    d = _torch_dcp(tmp_path / "dcp")
    monkeypatch.setattr(formatkit, "available_memory", lambda: 16)
    with pytest.raises(VcgaFormatError, match=r"tensor 'bomb' declares 64\.0 MiB .* more than the 16 B of memory "
                                              r"available; the file stores .* decompression bomb"):
        read_all(format_by_name("hdf5"), tmp_path / "bomb.h5")
    with pytest.raises(VcgaFormatError, match=r"tensor 'w' declares 24 B \(24 bytes\), more than the 16 B"):
        read_all(_dcp_spec(), d)


def test_dcp_chunks_are_checked_for_overlap_on_a_grid():
    from vcga.checkpoint.directory import _grid

    grid = [((r, c), (2, 3), None) for r in (0, 2) for c in (0, 3, 6)]
    assert _grid((4, 9), grid)
    assert not _grid((4, 9), [*grid[:-1], ((2, 5), (2, 4), None)])  # straddles a cut: not one cell
    assert not _grid((4, 9), [*grid, grid[0]])  # a chunk twice


def test_hostile_files_fail_within_bounded_memory(tmp_path):
    """A 1 TiB gzip dataset in a few KiB of HDF5, a safetensors header and a vendor-bin index
    declaring a million tensors, a MindSpore checkpoint of a million Values: each fails with a
    typed error, and the peak resident memory of the process that reads them (a child, measured
    with getrusage) stays within 256 MiB of what it held before."""
    n = 10**6
    with h5py.File(tmp_path / "bomb.h5", "w") as f:
        f.create_dataset("bomb", shape=(1 << 38,), dtype="f4", chunks=(1 << 20,), compression="gzip")[:1 << 20] = 0
    with open(tmp_path / "many.safetensors", "wb") as f:
        body = [b"{"]
        for lo in range(0, n, 100_000):
            body.append(b",".join(b'"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % i
                                  for i in range(lo, lo + 100_000)))
            body.append(b",")
        body[-1] = b"}"
        size = sum(map(len, body))
        f.write(struct.pack("<Q", size + (-size % 8)))
        f.writelines(body)
        f.write(b" " * (-size % 8))
    (tmp_path / "many.ckpt").write_bytes(b"\x0a\x00" * n)  # a million empty Values
    _vbin_with_many_tensors(tmp_path / "many.vbin", n)
    worker = Path(__file__).with_name("untrusted_rss_worker.py")
    r = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    for case, (error, grown_mib) in report.items():
        assert error.startswith("VcgaFormatError"), (case, error)
        assert grown_mib <= 256, (case, grown_mib, report)
    assert "declares 1.0 TiB" in report["bomb.h5"][0]
    for case in ("many.safetensors", "many.vbin", "many.ckpt"):
        assert "MAX_TENSORS" in report[case][0], report[case]


def _vbin_with_many_tensors(path: Path, n: int) -> None:
    """A vendor-bin file whose index lists ``n`` empty tensors, checksums valid (docs/vendor-bin.md)."""
    import vbin_craft
    import xxhash

    write_all(format_by_name("vendor-bin"), path, [TensorEntry("t", "float32", (0,), b"", {})])
    parts = vbin_craft.split(path.read_bytes())
    doc = parts.doc
    entry = json.dumps(doc["tensors"][0], separators=(",", ":")).encode()
    head, tail = json.dumps(dict(doc, tensors=[]), separators=(",", ":")).encode().split(b'"tensors":[]')
    chunks = [head + b'"tensors":[', b",".join(entry.replace(b'"t"', b'"t%d"' % i) for i in range(n)), b"]" + tail]
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(c)
    parts.index = b""  # the trailer is rebuilt by hand below: join() would need the index in one piece
    pre = vbin_craft.join(parts)[:vbin_craft.PREAMBLE.size + len(parts.body)]
    t = dict(parts.trailer, index_offset=len(pre), index_length=sum(map(len, chunks)), index_xxh3=h.intdigest())
    tr = vbin_craft.TRAILER.pack(t["magic"], t["major"], t["minor"], t["flags"], t["index_offset"],
                                 t["index_length"], t["index_xxh3"], t["file_id"], 0)[:56]
    with open(path, "wb") as f:
        f.write(pre)
        f.writelines(chunks)
        f.write(tr + struct.pack("<Q", xxhash.xxh3_64_intdigest(tr)))
