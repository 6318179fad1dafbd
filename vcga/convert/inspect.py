"""Inspecting a checkpoint: its tensors and, on request, each one's checksum checked (``vcga inspect``).

Also importable from :mod:`vcga.convert`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vcga.contract import FormatSpec
from vcga.convert.detect import detect_source
from vcga.convert.engine import Progress
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.tensors import check_entry, checksum

__all__ = ["InspectReport", "inspect_checkpoint"]


@dataclass
class InspectReport:
    """A checkpoint's tensors and, with ``verify``, each one's checksum status."""

    path: str
    format: str
    metadata: dict[str, str]
    tensors: list[dict[str, Any]]
    total_bytes: int
    verified: bool
    mismatches: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def inspect_checkpoint(path: str | os.PathLike[str], *, src_format: str | None = None, verify: bool = False,
                       progress: Progress | None = None, specs: Sequence[FormatSpec] | None = None) -> InspectReport:
    """List a checkpoint's tensors (name, dtype, shape, bytes, stored checksum).

    With ``verify`` every tensor is read: a stored checksum is compared (status ``ok`` or
    ``MISMATCH``); without one the computed checksum is shown (status ``computed``). Without
    ``verify`` the status is ``stored`` or ``none`` and no tensor data is read.
    """
    spec, p = detect_source(path, src_format, specs)
    rows: list[dict[str, Any]] = []
    mismatches = 0
    with spec.open_reader(p) as reader:
        index = list(reader.index())
        for e in index:
            rows.append({"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes,
                         "stored_checksum": e.checksum, "checksum": e.checksum,
                         "status": "stored" if e.checksum else "none", "metadata": dict(e.metadata)})
        if verify:
            by_name = {r["name"]: r for r in rows}
            total = sum(e.nbytes for e in index)
            done = 0
            seen = 0
            for entry in reader.entries():
                row = by_name.get(entry.name)
                if row is None or (entry.dtype, list(entry.shape)) != (row["dtype"], row["shape"]):
                    raise VcgaFormatError(p, f"tensor {entry.name!r} read as {entry.dtype} {list(entry.shape)}, "
                                          "which its index does not list")
                try:
                    got = checksum(check_entry(entry))
                except VcgaConversionError as e:
                    raise VcgaFormatError(p, str(e)) from None
                stored = entry.checksum or row["stored_checksum"]
                if stored is None:
                    row["status"] = "computed"
                elif stored == got:
                    row["status"] = "ok"
                else:
                    row["status"] = "MISMATCH"
                    mismatches += 1
                row["checksum"] = got
                done += entry.nbytes
                seen += 1
                if progress is not None:
                    progress("verify", done, total, entry.name)
            if seen != len(rows):
                raise VcgaFormatError(p, f"read {seen} tensors but the index lists {len(rows)}")
        meta = dict(reader.metadata)
    return InspectReport(str(p), spec.name, meta, rows, sum(r["bytes"] for r in rows), verify, mismatches)
