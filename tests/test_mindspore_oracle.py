"""MindSpore itself reads what VCGA writes (optional: needs a Python with MindSpore 2.10).

Set ``VCGA_MINDSPORE_PYTHON`` to that interpreter (default: /work/venvs/mindspore/bin/python when it
exists). The test writes a MindRecord dataset (one file and sharded) and a .ckpt with VCGA, has
MindSpore's ``FileReader`` and ``load_checkpoint`` read them in a subprocess (tests/mindspore_oracle.py),
and compares every value MindSpore returns with what was written.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.formats import mindrecord
from vcga.formats import mindspore_ckpt as ck

ORACLE = Path(__file__).parent / "mindspore_oracle.py"
DEFAULT_PYTHON = "/work/venvs/mindspore/bin/python"


def _mindspore_python() -> str:
    python = os.environ.get("VCGA_MINDSPORE_PYTHON") or (DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else "")
    if not python:
        pytest.skip("MindSpore is not available: set VCGA_MINDSPORE_PYTHON to a Python with mindspore==2.10.0 "
                    "installed (see scripts/make_mindspore_fixtures.py) to have MindSpore read VCGA's output")
    try:
        probe = subprocess.run([python, "-c", "import mindspore, sys; sys.stdout.write(mindspore.__version__)"],
                               capture_output=True, text=True, timeout=300)
    except OSError as e:
        pytest.skip(f"VCGA_MINDSPORE_PYTHON={python} cannot be run: {e}")
    if probe.returncode != 0:
        pytest.skip(f"VCGA_MINDSPORE_PYTHON={python} cannot import mindspore: {probe.stderr.strip()[-200:]}")
    return python


def _run_oracle(python: str, jobs: list[dict], tmp_path: Path) -> list[dict]:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([python, str(ORACLE), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())["results"]


def _tensors() -> list[TensorEntry]:
    rng = np.random.default_rng(11)
    out = []
    for i, dt in enumerate(dtypes.ALL):
        shape = [(3, 2), (6,), (2, 1, 2), ()][i % 4]
        n = int(np.prod(shape)) if shape else 1
        data = rng.integers(0, 2, n, dtype=np.uint8).tobytes() if dt == "bool" else \
            rng.bytes(n * dtypes.get(dt).itemsize)
        out.append(TensorEntry(f"w.{dt}", dt, shape, data, {"index": str(i)} if i % 2 else {}))
    out += [TensorEntry("empty.rows", "float32", (0, 3), b""), TensorEntry("empty.vector", "int8", (0,), b""),
            TensorEntry("big", "float32", (120, 100), rng.bytes(48000))]
    return out


def _b64(d: dict) -> bytes:
    return base64.b64decode(d["bytes"] if "bytes" in d else d["b64"])


def _tensors_from_rows(rows: list[dict]) -> dict:
    """Join MindSpore's rows back into tensors by the documented convention (docs/mindrecord.md)."""
    parts: dict[str, list] = {}
    for row in rows:
        shape = row["shape"]
        assert shape["array"] == "int64"
        dims = tuple(np.frombuffer(_b64(shape), "<i8").tolist())
        meta = json.loads(row["metadata"]) if row["metadata"] else {}
        parts.setdefault(row["name"], []).append((row["offset"], row["dtype"], dims, meta, _b64(row["data"])))
    out = {}
    for name, ps in parts.items():
        ps.sort(key=lambda p: p[0])
        assert len({(p[1], p[2], json.dumps(p[3])) for p in ps}) == 1
        data = b"".join(p[4] for p in ps)
        assert [p[0] for p in ps] == list(np.cumsum([0] + [len(p[4]) for p in ps[:-1]]))
        out[name] = (ps[0][1], ps[0][2], data, ps[0][3])
    return out


def test_mindspore_reads_our_mindrecord_and_ckpt(tmp_path):
    python = _mindspore_python()
    src = _tensors()
    small = {"header_size": 1 << 14, "page_size": 1 << 15}
    with mindrecord.open_writer(tmp_path / "one.mindrecord", **small) as w:
        for e in src:
            w.write(e)
    (tmp_path / "sharded").mkdir()
    with mindrecord.open_writer(tmp_path / "sharded" / "s.mindrecord", shard_size=20000, **small) as w:
        for e in src:
            w.write(e)
    shards = sorted(p for p in os.listdir(tmp_path / "sharded") if not p.endswith(".db"))
    assert len(shards) >= 3
    ckpt_src = [e for e in src if e.dtype in ck.CKPT_DTYPES]
    with ck.open_writer(tmp_path / "m.ckpt", crc=True, slice_size=10000) as w:
        w.set_metadata({"note": "written by vcga", "blank": ""})
        for e in ckpt_src:
            w.write(e)

    results = _run_oracle(python, [
        {"kind": "mindrecord", "path": str(tmp_path / "one.mindrecord")},
        {"kind": "mindrecord", "path": str(tmp_path / "sharded" / shards[1])},  # any shard opens them all
        {"kind": "ckpt", "path": str(tmp_path / "m.ckpt"), "crc_check": True},
    ], tmp_path)

    want = {e.name: (e.dtype, tuple(e.shape), bytes(e.data), dict(e.metadata)) for e in src}
    for res in results[:2]:
        got = _tensors_from_rows(res["rows"])
        assert got == want  # every dtype, 0-d, empty and split tensors, bit for bit

    params = results[2]["params"]
    assert params.pop("note") == {"str": "written by vcga"} and params.pop("blank") == {"str": ""}
    # Per-tensor metadata travels as one more string (vcga.formatkit.TENSOR_METADATA_KEY).
    packed = json.loads(params.pop("vcga.tensor_metadata")["str"])
    assert packed == {e.name: dict(e.metadata) for e in ckpt_src if e.metadata}
    expect_ckpt = {e.name: e for e in ckpt_src if tuple(e.shape) != (0,)}  # (0,) is kept where MindSpore can't see
    assert set(params) == set(expect_ckpt)
    for name, e in expect_ckpt.items():
        p = params[name]
        assert p["dtype"] == dtypes.get(e.dtype).mindspore, name
        assert tuple(p["shape"]) == tuple(e.shape), name
        assert base64.b64decode(p["b64"]) == bytes(e.data), name
    # ... and VCGA itself still reads the (0,) tensor back.
    with ck.open_reader(tmp_path / "m.ckpt") as r:
        assert {x.name: tuple(x.shape) for x in r.entries()}["empty.vector"] == (0,)
