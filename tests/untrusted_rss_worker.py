"""Child process of tests/test_untrusted_sources.py: open each hostile file in DIR and report, as
JSON, the error and how far the peak resident set grew above the baseline taken after every
import (getrusage's ru_maxrss, a high-water mark: each case's figure includes the cases before)."""

from __future__ import annotations

import json
import resource
import sqlite3  # noqa: F401
import sys
from pathlib import Path

import h5py  # noqa: F401 - imported before the baseline: libraries are not what is measured
import numpy  # noqa: F401
import safetensors  # noqa: F401
import xxhash  # noqa: F401

from vcga.convert import format_by_name
from vcga.errors import VcgaError

CASES = (("bomb.h5", "hdf5"), ("many.safetensors", "safetensors"), ("many.vbin", "vendor-bin"),
         ("many.ckpt", "mindspore-ckpt"))


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(folder: Path) -> None:
    specs = {fmt: format_by_name(fmt) for _, fmt in CASES}
    baseline = peak_mib()
    report = {}
    for name, fmt in CASES:
        try:
            with specs[fmt].open_reader(folder / name) as reader:
                for _ in reader.entries():
                    pass
            error = "none"
        except VcgaError as e:
            error = f"{type(e).__name__}: {e}"
        report[name] = (error, round(peak_mib() - baseline, 1))
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
