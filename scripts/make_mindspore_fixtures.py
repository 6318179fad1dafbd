"""Make the MindSpore fixtures in tests/fixtures/mindspore/ with MindSpore's own writers.

Run it with a Python that has MindSpore 2.10 (never a VCGA dependency; keep it in its own venv)::

    python3.11 -m venv /work/venvs/mindspore
    /work/venvs/mindspore/bin/pip install mindspore==2.10.0 "numpy<2"
    /work/venvs/mindspore/bin/python scripts/make_mindspore_fixtures.py

The values come from tests/fixtures/mindspore/expected.py (numpy only, fixed seeds), which the tests
import too: they check that VCGA reads back exactly what MindSpore was given. MANIFEST.json records
the producer versions and the SHA-256 of every file written.

Fixtures:

- ``tensors.mindrecord``: the tensor convention of docs/mindrecord.md (name, dtype, shape, data,
  offset, metadata) -- every dtype as raw bytes, 0-d and empty tensors, two tensors split over
  several records -- written by FileWriter in two ``write_raw_data`` calls;
- ``minimal.mindrecord``: just {name, dtype, shape, data};
- ``sharded.mindrecord0..2``: ``FileWriter(shard_num=3)``, two calls, a split tensor across shards;
- ``typed_int.mindrecord`` / ``typed_float.mindrecord``: tensors whose ``data`` is a typed array field
  (compressed int64 with an int32 ``shape`` field; float64 without a ``shape`` field);
- ``generic.mindrecord``: an ordinary dataset (strings, scalars, bytes, int/float arrays);
- ``params.ckpt`` / ``params_crc.ckpt``: ``save_checkpoint`` without / with ``crc_check``, every
  dtype load_checkpoint knows, a 0-d tensor, an empty tensor (dropped by MindSpore), append_dict;
- ``split.ckpt``: MindSpore's slice threshold (``serialization.SLICE_SIZE``, 512 MiB) lowered to
  1 KiB, so its own splitting code cuts small tensors into several Values with one tag;
- ``complex.ckpt``: complex tensors, which save_checkpoint writes (and load_checkpoint refuses).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "tests" / "fixtures" / "mindspore"


def _load_expected(out: Path):
    sys.path.insert(0, str(out))
    import expected  # the module lives beside the fixtures

    return expected


def _remove(paths):
    for p in paths:
        if os.path.exists(p):
            os.chmod(p, 0o600)  # save_checkpoint leaves its files read-only
            os.remove(p)


def make_mindrecord(out: Path, E) -> list[str]:
    from mindspore.mindrecord import FileWriter

    made = []

    def writer(name, shard_num, schema, desc):
        base = out / name
        names = [name] if shard_num == 1 else [f"{name}{i}" for i in range(shard_num)]
        _remove([out / n for n in names] + [out / (n + ".db") for n in names])
        w = FileWriter(str(base), shard_num=shard_num, overwrite=True)
        w.set_header_size(E.HEADER_SIZE)
        w.set_page_size(E.PAGE_SIZE)
        w.add_schema(schema, desc)
        made.extend(names + [n + ".db" for n in names])
        return w

    rows = E.records_of(E.tensor_set())
    w = writer("tensors.mindrecord", 1, E.TENSOR_SCHEMA, E.TENSORS_DESC)
    half = len(rows) // 2
    w.write_raw_data(rows[:half])
    w.write_raw_data(rows[half:])
    w.commit()

    w = writer("minimal.mindrecord", 1, E.MINIMAL_SCHEMA, "a minimal tensor dataset")
    w.write_raw_data(E.records_of(E.minimal_set(), with_extras=False))
    w.commit()

    # Two calls of equally many rows per shard (see expected.sharded_set): the layout is deterministic.
    rows = E.records_of(E.sharded_set())
    w = writer("sharded.mindrecord", 3, E.TENSOR_SCHEMA, E.TENSORS_DESC)
    w.write_raw_data(rows[: len(rows) // 2])
    w.write_raw_data(rows[len(rows) // 2:])
    w.commit()

    w = writer("typed_int.mindrecord", 1, E.TYPED_INT_SCHEMA, "int64 tensors as typed arrays")
    w.write_raw_data(E.typed_int_rows())
    w.commit()

    w = writer("typed_float.mindrecord", 1, E.TYPED_FLOAT_SCHEMA, "float64 tensors as typed arrays")
    w.write_raw_data(E.typed_float_rows())
    w.commit()

    w = writer("generic.mindrecord", 1, E.GENERIC_SCHEMA, "an ordinary dataset")
    w.write_raw_data(E.generic_rows())
    w.commit()
    return made


def _ms_tensor(dtype: str, shape, data: bytes, E):
    import mindspore as ms

    if dtype == "bfloat16":
        return ms.Tensor(E.bf16_as_float32(data).reshape(shape), ms.bfloat16)  # exact: see expected.py
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)  # fixtures are made on a little-endian machine
    return ms.Tensor(arr.copy())


def make_ckpt(out: Path, E) -> list[str]:
    import mindspore as ms
    from mindspore.train import serialization

    made = []
    params = [{"name": n, "data": _ms_tensor(dt, shape, data, E)} for n, dt, shape, data in E.ckpt_params()]
    for name, crc in (("params.ckpt", False), ("params_crc.ckpt", True)):
        _remove([out / name])
        ms.save_checkpoint(params, str(out / name), append_dict=dict(E.CKPT_APPEND), crc_check=crc)
        made.append(name)

    old = serialization.SLICE_SIZE
    serialization.SLICE_SIZE = E.SPLIT_SLICE_KIB
    try:
        _remove([out / "split.ckpt"])
        params = [{"name": n, "data": _ms_tensor(dt, shape, data, E)} for n, dt, shape, data in E.ckpt_split_params()]
        ms.save_checkpoint(params, str(out / "split.ckpt"))
        made.append("split.ckpt")
    finally:
        serialization.SLICE_SIZE = old

    _remove([out / "complex.ckpt"])
    params = [{"name": n, "data": _ms_tensor(dt, shape, data, E)} for n, dt, shape, data in E.ckpt_complex_params()]
    ms.save_checkpoint(params, str(out / "complex.ckpt"))
    made.append("complex.ckpt")
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory (default: %(default)s)")
    args = ap.parse_args(argv)
    import mindspore

    out = args.out.resolve()
    E = _load_expected(out)
    files = make_mindrecord(out, E) + make_ckpt(out, E)
    for name in files:
        os.chmod(out / name, 0o644)  # MindSpore makes its files private or read-only
    manifest = {
        "made_by": "scripts/make_mindspore_fixtures.py",
        "mindspore": mindspore.__version__,
        "numpy": np.__version__,
        "files": {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in sorted(files)},
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(files)} files to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
