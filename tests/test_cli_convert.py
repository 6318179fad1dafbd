"""``vcga convert`` and ``vcga inspect`` from the command line: results, one-line errors, exit codes,
and no torch import unless a .pt file is involved."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ckpt_helpers import FIXTURES, checkpoint_for, read_all, write_all

from vcga.formats import hdf5 as h5f
from vcga.formats import safetensors_format as stf


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "vcga", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_convert_and_inspect_round_trip(tmp_path):
    out = tmp_path / "k.safetensors"
    r = run("convert", FIXTURES / "keras3_legacy.h5", out, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["source_format"], rep["target_format"], rep["tensors"], rep["verified"]) == \
           ("hdf5", "safetensors", 4, True)
    assert read_all(h5f.SPEC, FIXTURES / "keras3_legacy.h5")[1] == read_all(stf.SPEC, out)[1]
    r = run("inspect", out, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["format"] == "safetensors" and {t["status"] for t in data["tensors"]} == {"computed"}
    r = run("inspect", out)
    assert r.returncode == 0 and "float32" in r.stdout and "[4, 3]" in r.stdout


@pytest.mark.parametrize("args,fragment", [
    (["convert", "{fix}/library.safetensors", "{tmp}/o.safetensors", "--cast", "nonsense"], "invalid cast"),
    (["convert", "{tmp}/absent.h5", "{tmp}/o.safetensors"], "no such file"),
    (["convert", "{fix}/state_dict.pt", "{tmp}/o.safetensors"], "has dtype complex128, which safetensors cannot"),
    (["convert", "{tmp}/evil.pt", "{tmp}/o.h5"], "weights-only allow-list"),
    (["convert", "{tmp}/trunc.safetensors", "{tmp}/o.h5"], "not a valid safetensors file"),
    (["convert", "{fix}/library.safetensors", "{tmp}/o.xyz"], "cannot tell the target format"),
    (["inspect", "{tmp}/trunc.safetensors"], "not a valid safetensors file"),
    (["convert", "{fix}/library.safetensors", "{tmp}/o.h5", "--to", "nope"], "unknown format 'nope'"),
])
def test_errors_are_one_line_without_traceback_and_leave_nothing(tmp_path, args, fragment):
    import torch

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "trunc.safetensors").write_bytes((FIXTURES / "library.safetensors").read_bytes()[:100])
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run(*[a.format(fix=FIXTURES, tmp=tmp_path) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vcga: error: ") and fragment in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_inspect_mismatch_exits_1(tmp_path, monkeypatch):
    # A format that stores checksums (vendor-bin) is not on this branch: give the reader a stored
    # checksum through a wrapping spec registered as a plugin module.
    mod = tmp_path / "corrupt_plugin.py"
    mod.write_text(
        "from dataclasses import replace\n"
        "from vcga.contract import FormatSpec, hookimpl\n"
        "from vcga.formats import safetensors_format as st\n"
        "class R(st.SafetensorsReader):\n"
        "    def index(self):\n"
        "        return [replace(e, checksum='xxh3_64:0000000000000000') for e in super().index()]\n"
        "    def entries(self):\n"
        "        return (replace(e, checksum='xxh3_64:0000000000000000') for e in super().entries())\n"
        "@hookimpl\n"
        "def vcga_formats():\n"
        "    return [FormatSpec('stored-sums', ('.sums',), st.SPEC.dtypes, lambda p: False, R, st.SafetensorsWriter)]\n")
    write_all(stf.SPEC, tmp_path / "a.sums", checkpoint_for(["int8"]))
    env = {"PYTHONPATH": str(tmp_path), "VCGA_PLUGINS": "corrupt_plugin"}
    import os

    r = subprocess.run([sys.executable, "-m", "vcga", "inspect", str(tmp_path / "a.sums"), "--verify", "--json",
                        "--from", "stored-sums"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 1, r.stderr
    assert {t["status"] for t in json.loads(r.stdout)["tensors"]} == {"MISMATCH"}
    # and convert refuses a source whose stored checksum does not match
    r = subprocess.run([sys.executable, "-m", "vcga", "convert", str(tmp_path / "a.sums"), str(tmp_path / "o.h5"),
                        "--from", "stored-sums"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2 and "stored checksum" in r.stderr and not (tmp_path / "o.h5").exists()


def _modules_after(args):
    code = ("import sys; from vcga.cli import main\n"
            "try:\n    main(" + repr([str(a) for a in args]) + ")\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_torch_is_imported_only_for_pt_files(tmp_path):
    assert _modules_after(["--help"]) == "NO-TORCH"
    assert _modules_after(["convert", FIXTURES / "h5py_tree.h5", tmp_path / "a.h5"]) == "NO-TORCH"
    assert _modules_after(["convert", FIXTURES / "library.safetensors", tmp_path / "b.h5"]) == "NO-TORCH"
    assert _modules_after(["inspect", FIXTURES / "keras3.weights.h5"]) == "NO-TORCH"
    assert _modules_after(["convert", FIXTURES / "keras3.weights.h5", tmp_path / "c.pt"]) == "TORCH"
