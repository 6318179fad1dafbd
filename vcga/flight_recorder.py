"""The flight recorder of the ``vcga`` process groups: what each rank's last collectives were.

Every ``vcga`` group keeps its last ``TORCH_FR_BUFFER_SIZE`` collectives (torch's variable and
default, 2000; 0 switches the recorder off; ``VCGA_FR_BUFFER_SIZE``, read first, sizes VCGA's
rings alone): sequence number, op, sizes and dtypes, state
(scheduled, started, completed), times, the bridge step it is in, and where it was called from.
Each rank writes all of it to one file -- torch's flight-recorder schema, which torch's own
analyzer (``torchfrtrace``) and ``vcga trace`` read -- when

- a collective times out (every rank that times out),
- a group is aborted,
- the process receives :data:`DUMP_SIGNAL` (SIGUSR1; installed only where nothing else handles it),
- the program calls :func:`dump`.

Files go to config ``trace_dir`` (``VCGA_TRACE_DIR``) as ``vcga_fr_trace_rank_<rank>``, else to
``TORCH_FR_DUMP_TEMP_FILE<rank>``, else to the temporary directory. docs/debugging.md walks
through a hang.

Importing this module loads nothing of torch; the dump and the analysis load on use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vcga.pg.recorder import DUMP_SIGNAL, FILE_PREFIX

__all__ = ["dump", "dump_path", "analyze", "DUMP_SIGNAL", "FILE_PREFIX"]


def dump(path: str | os.PathLike[str] | None = None, reason: str = "on demand") -> Path:
    """Write this rank's dump now (atomically) and return its path (default :func:`dump_path`).

    Holds every ``vcga`` group of this process that is still open; with no group (or the recorder
    switched off) the dump has no entries."""
    from vcga.pg.frdump import dump as _dump

    return _dump(reason, path)


def dump_path(rank: int | None = None) -> Path:
    """Where this rank's (or ``rank``'s) dump goes."""
    from vcga.pg.frdump import dump_path as _path

    return _path(rank)


def analyze(directory: str | os.PathLike[str], prefix: str | None = None) -> dict[str, Any]:
    """Analyze every rank's dump in ``directory`` with torch's flight-recorder analyzer (what
    ``vcga trace`` prints): the first collective not every rank joined, the ranks missing from it,
    mismatched ops, sizes or dtypes, and each rank's vendor.

    :raises vcga.errors.VcgaFormatError: no dump there, or a file that is not one.
    """
    from vcga.pg.frtrace import analyze as _analyze

    return _analyze(directory, prefix)
