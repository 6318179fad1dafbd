"""The ``mindrecord`` checkpoint format: MindSpore MindRecord datasets, read and written by VCGA.

Compatible with MindSpore 2.x both ways: MindSpore's ``FileReader`` reads what
:class:`~.writer.MindRecordWriter` writes, and :class:`~.reader.MindRecordReader` reads whatever
``FileWriter`` writes -- tensors stored by the convention of ``docs/mindrecord.md`` as tensors, any
other schema generically. Shards (``name0 .. nameN-1``), the ``.db`` SQLite index, BLOB and RAW pages
and version-3.0 integer compression are all handled here, without MindSpore installed.

Importing this module is cheap (no numpy, msgpack or sqlite3): the plugin manager imports it to
list formats, and ``vcga --help`` must stay fast. The reader and writer modules load on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vcga import dtypes
from vcga.contract import FormatReader, FormatSpec, FormatWriter, hookimpl

__all__ = ["SPEC", "sniff", "open_reader", "open_writer", "vcga_formats"]

_MAX_HEADER_JSON = 1 << 27  # MindSpore's largest header


def _first_shard(p: Path) -> Path | None:
    for width in (1, 2, 3):
        cand = p.with_name(p.name + "0" * width)
        if cand.is_file():
            return cand
    return None


def sniff(path: Any) -> bool:
    """True when ``path`` (or, for a sharded dataset's base name, its first shard ``path0``) starts
    like a MindRecord file: a u64 LE length, then the header JSON, which MindSpore always begins
    with ``{"header_size":``. Reads at most 4 KiB; never raises."""
    try:
        p = Path(os.fspath(path))
        if not p.is_file():
            first = _first_shard(p)
            if first is None:
                return False
            p = first
        with open(p, "rb") as f:
            head = f.read(4096)
    except (OSError, TypeError, ValueError):
        return False
    if len(head) < 10:
        return False
    n = int.from_bytes(head[:8], "little")
    if not 2 <= n <= _MAX_HEADER_JSON:
        return False
    body = head[8:]
    return body.startswith(b'{"header_size":') or (body.startswith(b"{") and b'"shard_addresses"' in body
                                                    and b'"page_size"' in body)


def open_reader(path: Any) -> FormatReader:
    """Open a MindRecord dataset for reading (any shard, or a sharded dataset's base name)."""
    from .reader import MindRecordReader

    return MindRecordReader(path)


def open_writer(path: Any, *, shard_size: int | None = None, header_size: int = 1 << 24,
                page_size: int = 1 << 25, publish_into: Any = None) -> FormatWriter:
    """Open a MindRecord dataset for writing.

    :param shard_size: bytes of tensor data per shard (``name0 .. nameN-1``); None: one file.
    :param header_size: bytes reserved for each shard's header; :param page_size: page size.
        MindSpore's limits apply (16 KiB..128 MiB, 32 KiB..256 MiB, multiples of 4); the defaults,
        16 MiB and 32 MiB, are FileWriter's. Tensors larger than a page are split over several records.
    """
    from .writer import MindRecordWriter

    return MindRecordWriter(path, shard_size=shard_size, header_size=header_size, page_size=page_size,
                            publish_into=publish_into)


SPEC = FormatSpec(
    name="mindrecord",
    extensions=(".mindrecord",),
    dtypes=frozenset(dtypes.EVERY),  # tensor bytes are stored verbatim: every dtype round-trips
    sniff=sniff,
    open_reader=open_reader,
    open_writer=open_writer,
    description="MindSpore MindRecord (FileWriter/FileReader 2.x compatible; shards name0..nameN-1 with .db indexes)",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
