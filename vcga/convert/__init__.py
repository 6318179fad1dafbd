"""Checkpoint conversion and inspection: ``vcga convert`` and ``vcga inspect`` as a library.

- :mod:`~vcga.convert.engine` -- joins any format's reader to any format's writer, streaming,
  checksummed and atomic;
- :mod:`~vcga.convert.detect` -- which format a path is in (name, signature, extension, shards);
- :mod:`~vcga.convert.inspect` -- a checkpoint's tensors and, on request, their checksums checked.

The names below are the library's API (docs/convert.md); the CLI is :mod:`vcga.cli.convert`.
"""

from __future__ import annotations

from vcga.convert.detect import available_formats, detect_source, detect_target, format_by_name
from vcga.convert.engine import (
    ConversionReport,
    Progress,
    check_dtypes,
    convert,
    parse_casts,
    parse_options,
    parse_size,
)
from vcga.convert.inspect import InspectReport, inspect_checkpoint

__all__ = [
    "ConversionReport",
    "InspectReport",
    "Progress",
    "available_formats",
    "check_dtypes",
    "convert",
    "detect_source",
    "detect_target",
    "format_by_name",
    "inspect_checkpoint",
    "parse_casts",
    "parse_options",
    "parse_size",
]
