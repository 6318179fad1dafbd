#!/usr/bin/env python
"""Make the checkpoint fixtures under tests/fixtures with the real producers.

    .venv/bin/python scripts/make_fixtures.py [--keras-python /path/to/venv/bin/python]

- h5py (this venv): ``h5py_tree.h5`` -- nested groups, contiguous/chunked/gzip/lzf/shuffle/fletcher32
  datasets, big-endian data, scalar and empty datasets, bool/complex/every integer and IEEE float,
  bf16 and fp8 both as Keras 3 labels OPAQUE data and as HDF5 2.0-style custom float types, a hard
  link and a soft link to one dataset, attributes of many types on the root, groups and datasets.
- safetensors (this venv): ``library.safetensors`` through ``safetensors.torch.save_file``.
- torch (this venv): ``state_dict.pt`` (a module's state_dict with tied weights and a shared
  storage view), ``nested.pt`` (a training checkpoint dict), ``legacy.pt`` (pre-1.6 format).
- Keras 3 (a throwaway venv given by ``--keras-python``; KERAS_BACKEND=torch):
  ``keras3_legacy.h5`` (``model.save``), ``keras3.weights.h5`` and ``keras3_bf16.weights.h5``
  (``model.save_weights``). Keras is not a dependency of VCGA; make that venv with
  ``python -m venv /tmp/k && /tmp/k/bin/pip install keras h5py scipy torch==2.13.0``.

Contents come from tests/fixtures/recipes.py, which the tests use to check every value.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIX))

from recipes import expected_bytes, finite  # noqa: E402

DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]


def np_dtype(name: str):
    import ml_dtypes
    import numpy as np

    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def arr(name: str, dtype: str, shape: tuple[int, ...]):
    import numpy as np

    return np.frombuffer(expected_bytes(name, dtype, shape), dtype=np_dtype(dtype)).reshape(shape).copy()


def make_h5py_tree(path: Path) -> None:
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        f.attrs["title"] = "vcga h5py fixture"
        f.attrs["epoch"] = np.int64(7)
        f.attrs["lr"] = np.float32(0.125)
        f.attrs["layer_names"] = np.array([b"dense", b"conv"])
        f.attrs["flags"] = np.array([True, False])
        f.attrs["empty_attr"] = h5py.Empty("f8")
        plain = f.create_group("plain")
        plain.attrs["weight_names"] = ["w", "b"]
        for dt in ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                   "float32", "float64", "complex64", "complex128"]:
            name = f"plain/{dt}"
            ds = f.create_dataset(name, data=arr(name, dt, (3, 5)))
            ds.attrs["unit"] = "none"
        # big-endian storage: HDF5 converts on read
        for dt in ["int16", "uint32", "int64", "float32", "float64"]:
            name = f"bigendian/{dt}"
            f.create_dataset(name, data=arr(name, dt, (4, 3)).astype(np_dtype(dt).newbyteorder(">")))
        # filters
        comp = f.create_group("compressed")
        comp.attrs["note"] = "chunked"
        name = "compressed/gzip"
        f.create_dataset(name, data=arr(name, "float32", (64, 33)), chunks=(16, 8), compression="gzip",
                         compression_opts=6, shuffle=True, fletcher32=True)
        name = "compressed/lzf"
        f.create_dataset(name, data=arr(name, "int64", (50, 7)), chunks=True, compression="lzf")
        name = "compressed/gzip_bigendian"
        f.create_dataset(name, data=arr(name, "float64", (20, 5)).astype(">f8"), chunks=(7, 5), compression="gzip")
        # scalars and empties
        name = "scalars/f64"
        f.create_dataset(name, data=arr(name, "float64", ())[()])
        name = "scalars/i32"
        f.create_dataset(name, data=arr(name, "int32", ())[()])
        name = "empty/f32"
        f.create_dataset(name, data=np.zeros((0, 4), np.float32))
        # bf16/fp8 the Keras 3 way: OPAQUE data + attrs["dtype"]
        for dt in ["bfloat16", "float8_e4m3fn"]:
            name = f"keras_style/{dt}"
            ds = f.create_dataset(name, data=arr(name, dt, (2, 6)))
            ds.attrs["dtype"] = dt
        # bf16/fp8 as HDF5 custom float types (HDF5 2.0 predefines these layouts)
        for dt, (size, spos, epos, esize, mpos, msize, bias) in {
            "bfloat16": (2, 15, 7, 8, 0, 7, 127),
            "float8_e4m3fn": (1, 7, 3, 4, 0, 3, 7),
            "float8_e5m2": (1, 7, 2, 5, 0, 2, 15),
        }.items():
            for order, suffix in ((h5py.h5t.ORDER_LE, "le"), (h5py.h5t.ORDER_BE, "be")):
                if size == 1 and suffix == "be":
                    continue
                name = f"custom_float/{dt}_{suffix}"
                tid = h5py.h5t.IEEE_F32LE.copy()
                tid.set_fields(spos, epos, esize, mpos, msize)
                tid.set_size(size)
                tid.set_ebias(bias)
                tid.set_order(order)
                raw = np.frombuffer(expected_bytes(name, dt, (3, 4)), dtype=f"<u{size}").reshape(3, 4)
                space = h5py.h5s.create_simple((3, 4))
                grp = f.require_group("custom_float")
                dsid = h5py.h5d.create(grp.id, name.split("/")[1].encode(), tid, space)
                mtype = tid.copy()
                mtype.set_order(h5py.h5t.ORDER_LE)
                dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=mtype)
        # links: a hard link and a soft link to the same dataset
        f["links/hard"] = f["plain/float32"]
        f["links/soft"] = h5py.SoftLink("/plain/int64")
        f.create_group("empty_group").attrs["kind"] = "no datasets"


def make_safetensors(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for dt in DTYPES:
        if dt == "complex128":
            continue  # safetensors has no C128
        name = f"model.{dt}"
        raw = torch.frombuffer(bytearray(expected_bytes(name, dt, (4, 3))), dtype=torch.uint8)
        tensors[name] = raw.view(getattr(torch, dt)).reshape(4, 3)
    tensors["scalar"] = torch.frombuffer(bytearray(expected_bytes("scalar", "float32", ())), dtype=torch.float32)[0]
    tensors["empty"] = torch.zeros(0, 3, dtype=torch.int64)
    save_file(tensors, str(path), metadata={"format": "pt", "producer": "safetensors.torch.save_file"})


def _torch_tensor(name: str, dt: str, shape: tuple[int, ...]):
    import torch

    raw = torch.frombuffer(bytearray(expected_bytes(name, dt, shape)), dtype=torch.uint8)
    return raw.view(getattr(torch, dt)).reshape(shape)


def make_torch(state_dict_path: Path, nested_path: Path, legacy_path: Path) -> None:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(11, 6)
            self.norm = torch.nn.LayerNorm(6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.embed.weight  # tied, as in most language models
            self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))

    m = Tiny()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.from_numpy(finite(name, tuple(p.shape))))
        m.steps.fill_(12345)
    sd = m.state_dict()
    for dt in DTYPES:
        sd[f"extra.{dt}"] = _torch_tensor(f"extra.{dt}", dt, (2, 5))
    base = _torch_tensor("shared.base", "float32", (4, 4))
    sd["shared.base"] = base
    sd["shared.rows"] = base[1:3]  # a view into the same storage
    sd["scalar"] = _torch_tensor("scalar", "float64", ())
    sd["empty"] = torch.zeros(0, 2, dtype=torch.bfloat16)
    torch.save(sd, state_dict_path)
    nested = {"model": {"w": _torch_tensor("model.w", "float32", (3, 2)),
                        "layers": [_torch_tensor("model.layers.0", "int8", (4,)),
                                   _torch_tensor("model.layers.1", "int8", (4,))]},
              "epoch": 3, "lr": 0.5, "name": "run-7"}
    torch.save(nested, nested_path)
    torch.save({"w": _torch_tensor("legacy.w", "float32", (3, 3)), "i": _torch_tensor("legacy.i", "int64", (2,))},
               legacy_path, _use_new_zipfile_serialization=False)


KERAS_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import keras
from recipes import finite
out = sys.argv[2]

def build(dtype=None):
    kw = {} if dtype is None else {"dtype": dtype}
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense", **kw),
                             keras.layers.Dropout(0.1, name="drop"), keras.layers.Dense(2, name="out", **kw)],
                            name="seq")

m = build()
m.set_weights([finite(f"keras.{i}", tuple(w.shape)) for i, w in enumerate(m.get_weights())])
m.save(out + "/keras3_legacy.h5")
m.save_weights(out + "/keras3.weights.h5")
mb = build("bfloat16")
mb.set_weights([finite(f"keras.{i}", tuple(w.shape)) for i, w in enumerate(mb.get_weights())])
mb.save_weights(out + "/keras3_bf16.weights.h5")
print(keras.__version__)
"""


def make_keras(python: str) -> None:
    env = dict(os.environ, KERAS_BACKEND="torch")
    res = subprocess.run([python, "-c", KERAS_SCRIPT, str(FIX), str(FIX)], env=env, capture_output=True, text=True,
                         timeout=600)
    if res.returncode:
        raise SystemExit(f"keras fixtures failed:\n{res.stderr[-3000:]}")
    print("keras", res.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keras-python", help="python of a venv with keras installed (KERAS_BACKEND=torch)")
    args = ap.parse_args()
    FIX.mkdir(parents=True, exist_ok=True)
    make_h5py_tree(FIX / "h5py_tree.h5")
    make_safetensors(FIX / "library.safetensors")
    make_torch(FIX / "state_dict.pt", FIX / "nested.pt", FIX / "legacy.pt")
    if args.keras_python:
        make_keras(args.keras_python)
    for p in sorted(FIX.iterdir()):
        if p.suffix in (".h5", ".safetensors", ".pt"):
            print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
