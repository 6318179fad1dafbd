"""The gloo plugin: torch's CPU collective library as a VCGA backend.

Its capability table is *measured*, not assumed: :mod:`vcga.plugins.gloo.measure` runs every
(collective, dtype, reduce op) on a real gloo group, compares each result with the value computed
independently, and records native (ran and was right) or refused (raised, or returned a wrong
value). ``python -m vcga.plugins.gloo --measure`` regenerates ``gloo_capabilities.json``;
``tests/test_gloo_capabilities.py`` re-measures the installed torch and checks every cell. The
measurement is a module of its own: a job's group reads the table, never the code that measures it.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from vcga.capabilities import LazyCapabilityTable
from vcga.config import Config, gloo_env
from vcga.contract import (
    Backend,
    CapabilityTable,
    Cell,
    CellKey,
    Collective,
    ProbeResult,
    ReduceOp,
    Support,
    Topology,
    hookimpl,
)

if TYPE_CHECKING:  # vcga.cpu is imported where used: a job's group never asks for it
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as C10dBackend

    from vcga.cpu import CpuAccelerator

TABLE_FILE = Path(__file__).with_name("gloo_capabilities.json")
#: What each row of the table file holds (:func:`vcga.plugins.gloo.measure.table_text` writes it).
COLUMNS = ("collective", "dtype", "op", "ok", "detail")


class GlooBackend(Backend):
    name = "gloo"
    vendor = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0  # the fallback: any available accelerator backend wins

    def __init__(self) -> None:
        self._table: CapabilityTable | None = None

    def probe(self) -> ProbeResult:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            return ProbeResult(False, f"torch is not importable: {e}")
        if not dist.is_available():
            return ProbeResult(False, "this torch build has no torch.distributed")
        if not dist.is_gloo_available():
            return ProbeResult(False, "this torch build was compiled without gloo")
        return ProbeResult(True, f"torch {torch.__version__} gloo on {os.cpu_count()} CPU cores", 1,
                           {"torch": torch.__version__})

    def accelerator(self) -> CpuAccelerator:
        from vcga.cpu import CpuAccelerator

        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        if self._table is None:
            self._table = load_table(self.name)
        return self._table

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> C10dBackend:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def vendor_env(self, config: Config) -> dict[str, str]:
        # gloo reads no environment for timeouts or buffers (the timeout is passed to the
        # ProcessGroupGloo constructor) and reduces in a fixed order; only the interface.
        return gloo_env(config)

    def topology(self) -> Topology:
        nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
        return Topology(source="cpu", device_count=1,
                        detail=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                               f"{len(nodes) or 1} NUMA node(s)")


def load_table(backend_name: str = "gloo", path: Path = TABLE_FILE) -> CapabilityTable:
    """The measured table: measured-native cells are native; the rest get VCGA's standard
    emulations where one exists (fp8 moved as uint8, fp16 with a float32 upcast, ...), else stay
    refused with gloo's own error message as the reason.

    Only the file's bytes are read here: the table is named by their digest, so a group's creation
    parses nothing, and each cell is read from the rows when a collective first asks for it
    (stating all of them to a :class:`~vcga.capabilities.CapabilityBuilder` cost every rank of
    every job about 2 ms at group creation). tests/test_plugin_manifest.py checks the cells are
    the builder's."""
    source = path.read_bytes()
    rows = _Rows(source, path.name)
    return LazyCapabilityTable.from_source(backend_name, rows.stated, rows, source)  # the derived cells as asked for


class _Rows(AbstractSet[CellKey]):
    """The measured table's rows, read from the file's bytes when a cell is first asked for; as a
    set, the keys measured native: a builder's final statements (every other cell may get an
    emulation derived on top).

    The file holds one cell a line (:func:`vcga.plugins.gloo.measure.table_text`), so one cell is
    read from its own line, found by the row's opening: a job's first collectives ask for a few
    cells of 561, and parsing them all cost every rank 0.2 ms at its first all_reduce. What needs
    every row (the set's methods), or a file not laid out so, parses the whole file, once."""

    def __init__(self, source: bytes, file_name: str) -> None:
        self._source, self._file_name = source, file_name
        self._parsed: dict[tuple[str, str, str | None], tuple[bool, str]] | None = None
        self._native: Cell | None = None
        self._refused: dict[str, Cell] = {}  # one cell per reason, as a builder's statement makes

    @property
    def _rows(self) -> dict[tuple[str, str, str | None], tuple[bool, str]]:
        if self._parsed is None:
            data = json.loads(self._source)
            self._parsed = {(coll, dt, op): (ok, detail) for coll, dt, op, ok, detail in data["cells"]}
        return self._parsed

    def _line(self, name: tuple[str, str, str | None]) -> tuple[bool, str] | None:
        """The row of ``name`` from its own line, or None where no line opens with it."""
        opening = b"\n " + json.dumps(list(name)).encode()[:-1] + b", "
        start = self._source.find(opening)
        if start < 0:
            return None
        end = self._source.find(b"\n", start + 1)
        coll, dt, op, ok, detail = json.loads(self._source[start + 2:end].rstrip(b","))
        return ok, detail

    def row(self, key: CellKey) -> tuple[bool, str] | None:
        """``(ok, detail)`` of the cell measured for ``key``, or None where none was."""
        coll, dt, op = key
        name = (coll.value, dt, op.value if op is not None else None)
        if self._parsed is None:
            found = self._line(name)
            if found is not None:
                return found
        return self._rows.get(name)

    def native(self) -> Cell:
        """The cell of every cell measured native (it names the torch the table was measured with)."""
        if self._native is None:
            head = self._source.split(b"\n", 1)[0]
            try:  # the first line: the file's facts, up to its rows
                torch_version = json.loads(head[:head.rindex(b', "cells": [')] + b"}")["torch"]
            except ValueError:  # laid out otherwise: the whole file
                torch_version = json.loads(self._source)["torch"]
            self._native = Cell(Support.NATIVE, note=f"measured with torch {torch_version} ({self._file_name})")
        return self._native

    def stated(self, key: CellKey) -> Cell | None:
        """The cell a builder would have been told for ``key``: native where measured so, else
        refused with gloo's own message."""
        row = self.row(key)
        if row is None:
            return None
        ok, detail = row
        if ok:
            return self.native()
        cell = self._refused.get(detail)
        if cell is None:
            cell = self._refused[detail] = Cell(Support.REFUSED, note=f"gloo: {detail}")
        return cell

    def __contains__(self, key: object) -> bool:
        if not (isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], Collective) and isinstance(key[1], str)
                and (key[2] is None or isinstance(key[2], ReduceOp))):
            return False  # not a cell key: in no set of them
        row = self.row(key)
        return row is not None and row[0]

    def __iter__(self) -> Iterator[CellKey]:
        for (coll, dt, op), (ok, _) in self._rows.items():
            if ok:
                yield Collective(coll), dt, ReduceOp(op) if op else None

    def __len__(self) -> int:
        return sum(1 for ok, _ in self._rows.values() if ok)


@hookimpl
def vcga_backends() -> list[Backend]:
    return [GlooBackend()]


@hookimpl
def vcga_tensor_to_host(tensor: torch.Tensor) -> torch.Tensor | None:
    from vcga.cpu import host_to_host

    return host_to_host(tensor)
