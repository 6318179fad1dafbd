"""The SQLite index beside every MindRecord shard (``<shard>.db``), read and written with stdlib sqlite3.

MindSpore's reader finds every row through this index and trusts it blindly (one wrong blob offset
makes it read out of bounds). VCGA reads it too -- a dataset without its index, or with an index that
does not describe the data file, is refused, as MindSpore refuses it -- but checks every row's
location against the shard header and the file size before anything is read.

Schema (shard_index_generator.cc)::

    CREATE TABLE INDEXES(ROW_ID INT NOT NULL, PAGE_ID_RAW INT NOT NULL, PAGE_OFFSET_RAW INT NOT NULL,
      PAGE_OFFSET_RAW_END INT NOT NULL, ROW_GROUP_ID INT NOT NULL, PAGE_ID_BLOB INT NOT NULL,
      PAGE_OFFSET_BLOB INT NOT NULL, PAGE_OFFSET_BLOB_END INT NOT NULL,
      INC_0 INT, <field>_0 <TYPE>, ..., PRIMARY KEY(ROW_ID, INC_0, ...))
    CREATE TABLE SHARD_NAME(NAME TEXT NOT NULL)      -- one row: the shard's file name

Offsets are relative to the page start; ``*_OFFSET`` points at the row's u64 length prefix and
``*_OFFSET_END`` just past the row.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcga.errors import VcgaFormatError
from vcga.formatkit import check_regular_file

from ._format import BLOB_PAGE, RAW_PAGE, Header

__all__ = ["RowLocation", "write_index", "index_bytes", "CAN_SERIALIZE", "read_index", "SQL_TYPES"]

#: SQLite column type of an index field (shard_index_generator.cc GenerateFieldName/TakeFieldType).
SQL_TYPES = {"string": "TEXT", "int32": "INTEGER", "int64": "INTEGER", "float32": "NUMERIC", "float64": "NUMERIC"}

_LOCATION_COLUMNS = ("ROW_ID", "PAGE_ID_RAW", "PAGE_OFFSET_RAW", "PAGE_OFFSET_RAW_END", "ROW_GROUP_ID",
                     "PAGE_ID_BLOB", "PAGE_OFFSET_BLOB", "PAGE_OFFSET_BLOB_END")


@dataclass(frozen=True)
class RowLocation:
    """Where one row's raw and blob parts are: page ids and [start, end) offsets inside the page."""

    row_id: int
    raw_page: int
    raw_start: int
    raw_end: int
    group: int
    blob_page: int
    blob_start: int
    blob_end: int


#: sqlite3 can hand over a database as bytes (Python 3.11+): the index is then built in memory and
#: written into the shard's anonymous output (vcga.atomic), which has no path SQLite could open.
CAN_SERIALIZE = hasattr(sqlite3.Connection, "serialize")


def write_index(db_path: str | os.PathLike[str], shard_name: str, index_fields: Sequence[tuple[str, str]],
                rows: Iterable[Sequence[Any]]) -> None:
    """Create the index at ``db_path`` (an empty temporary the caller commits atomically).

    :param index_fields: ``(field name, field type)`` of each index field, in header order.
    :param rows: the eight location integers of each row followed by its index-field values.
    """
    con = sqlite3.connect(os.fspath(db_path), isolation_level=None)
    try:
        _fill(con, shard_name, index_fields, rows)
    finally:
        con.close()


def index_bytes(shard_name: str, index_fields: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]]) -> bytes:
    """The same index as :func:`write_index`, as the bytes of its database file (needs :data:`CAN_SERIALIZE`)."""
    con = sqlite3.connect(":memory:", isolation_level=None)
    try:
        _fill(con, shard_name, index_fields, rows)
        if sys.version_info < (3, 11):
            raise RuntimeError("sqlite3 serialize needs Python 3.11 (see CAN_SERIALIZE); use write_index")
        return bytes(con.serialize())
    finally:
        con.close()


def _fill(con: sqlite3.Connection, shard_name: str, index_fields: Sequence[tuple[str, str]],
          rows: Iterable[Sequence[Any]]) -> None:
    cols = ", ".join(
        f"{c:<20} INT  NOT NULL" for c in _LOCATION_COLUMNS)
    extra = "".join(f",INC_{i} INT, {name}_0 {SQL_TYPES[ftype]}" for i, (name, ftype) in enumerate(index_fields))
    pkey = ",".join(["ROW_ID"] + [f"INC_{i}" for i in range(len(index_fields))])
    # The file is a temporary that the caller fsyncs and renames (or built in memory): no journal is needed.
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.execute("BEGIN")
    con.execute(f"CREATE TABLE INDEXES(  {cols}{extra}, PRIMARY KEY({pkey}))")
    con.execute("CREATE TABLE SHARD_NAME(NAME TEXT NOT NULL)")
    con.execute("INSERT INTO SHARD_NAME (NAME) VALUES (?)", (shard_name,))
    names = list(_LOCATION_COLUMNS)
    for i, (name, _) in enumerate(index_fields):
        names += [f"INC_{i}", f"{name}_0"]
    marks = ",".join("?" * len(names))
    n_loc = len(_LOCATION_COLUMNS)
    con.executemany(
        f"INSERT INTO INDEXES ({','.join(names)}) VALUES ({marks})",
        (tuple(r[:n_loc]) + tuple(v for value in r[n_loc:] for v in (0, value)) for r in rows),
    )
    con.execute("COMMIT")


#: The longest text or blob SQLite may build while VCGA reads an index (shard names, locations).
_MAX_VALUE = 1 << 20
#: SQLite virtual-machine steps allowed per row the index must hold (reading one takes a few dozen).
_STEPS_PER_ROW = 1 << 16


def _connect_readonly(db_path: Path, rows: int) -> sqlite3.Connection:
    """The index opened read-only, bounded: an index is a file like any other of the dataset, and
    SQLite would run what its schema holds (a view computing rows forever, a column expression
    building a gigabyte value)."""
    # immutable=1: no locks, no journal recovery -- SQLite never writes to a source it reads.
    uri = db_path.resolve().as_uri() + "?mode=ro&immutable=1"
    con = sqlite3.connect(uri, uri=True)
    try:
        con.execute("PRAGMA trusted_schema=OFF")  # the schema may call only side-effect-free functions
        setlimit, length = getattr(con, "setlimit", None), getattr(sqlite3, "SQLITE_LIMIT_LENGTH", None)
        if setlimit is not None and length is not None:  # Python 3.11+
            setlimit(length, _MAX_VALUE)
        budget = [(rows + 1024) * _STEPS_PER_ROW // 1000]

        def spend() -> int:
            budget[0] -= 1
            return int(budget[0] < 0)  # non-zero interrupts the statement

        con.set_progress_handler(spend, 1000)
        kinds = dict(con.execute("SELECT name, type FROM sqlite_master WHERE name IN ('INDEXES', 'SHARD_NAME')"))
    except BaseException:
        con.close()
        raise
    views = sorted(n for n, t in kinds.items() if t != "table")
    if views:
        con.close()
        raise VcgaFormatError(db_path, f"MindRecord index: {views[0]} is a {kinds[views[0]]}, not a table; "
                              "not an index MindSpore writes")
    return con


def read_index(db_path: Path, data_path: Path, header: Header, file_size: int) -> list[RowLocation]:
    """Read and validate the index of one shard; every location is checked against the header."""
    if not db_path.exists():
        raise VcgaFormatError(data_path, f"MindRecord index {db_path.name} is missing; MindSpore writes it beside "
                                         "every shard and cannot read the shard without it. Copy it along with the "
                                         "data file (or rewrite the dataset)")
    check_regular_file(db_path)
    try:
        con = _connect_readonly(db_path, header.row_count)
    except sqlite3.Error as e:
        raise VcgaFormatError(db_path, f"cannot open the MindRecord index: {e}") from None
    try:
        try:
            names = con.execute("SELECT NAME FROM SHARD_NAME").fetchmany(2)
            n_rows = con.execute("SELECT COUNT(*) FROM INDEXES").fetchone()[0]
            expected = header.row_count
            if n_rows != expected:
                raise VcgaFormatError(db_path, f"the MindRecord index lists {n_rows} rows but the data file "
                                               f"holds {expected}; the index is stale or corrupt")
            rows = con.execute(f"SELECT {','.join(_LOCATION_COLUMNS)} FROM INDEXES ORDER BY ROW_ID").fetchall()
        except (sqlite3.Error, UnicodeDecodeError) as e:  # a damaged TEXT value fails to decode
            raise VcgaFormatError(db_path, f"the MindRecord index is corrupt ({e})") from None
    finally:
        con.close()
    if len(names) != 1 or names[0][0] != data_path.name:
        got = [n[0] for n in names]
        raise VcgaFormatError(db_path, f"the MindRecord index belongs to {got!r}, not to {data_path.name!r} "
                                       "(MindSpore refuses renamed shards too; rename the files back)")
    pages = header.pages
    out: list[RowLocation] = []
    for expect_id, row in enumerate(rows):
        if len(row) != 8 or any(not isinstance(v, int) for v in row):
            raise VcgaFormatError(db_path, f"MindRecord index row {expect_id} holds non-integer locations {row!r}")
        loc = RowLocation(*row)
        if loc.row_id != expect_id:
            raise VcgaFormatError(db_path, f"MindRecord index row ids are not 0..{len(rows) - 1} "
                                           f"(found {loc.row_id} at position {expect_id})")
        _check_location(loc, pages, header, file_size, db_path)
        out.append(loc)
    return out


def _check_location(loc: RowLocation, pages: Sequence[Any], header: Header, file_size: int, db_path: Path) -> None:
    def bad(msg: str) -> VcgaFormatError:
        return VcgaFormatError(db_path, f"MindRecord index row {loc.row_id}: {msg}; the index does not describe "
                                        "the data file")

    if not 0 <= loc.blob_page < len(pages) or pages[loc.blob_page].page_type != BLOB_PAGE:
        raise bad(f"PAGE_ID_BLOB {loc.blob_page} is not a blob page")
    if not 0 <= loc.raw_page < len(pages) or pages[loc.raw_page].page_type != RAW_PAGE:
        raise bad(f"PAGE_ID_RAW {loc.raw_page} is not a raw page")
    blob = pages[loc.blob_page]
    if not blob.start_row_id <= loc.row_id < blob.end_row_id:
        raise bad(f"blob page {blob.page_id} holds rows {blob.start_row_id}..{blob.end_row_id - 1}")
    if loc.group != blob.page_type_id:
        raise bad(f"ROW_GROUP_ID {loc.group} differs from its blob page's group {blob.page_type_id}")
    for kind, page, start, end in (("blob", blob, loc.blob_start, loc.blob_end),
                                   ("raw", pages[loc.raw_page], loc.raw_start, loc.raw_end)):
        if not (start >= 0 and start + 8 <= end <= page.used):
            raise bad(f"{kind} row at [{start}, {end}) lies outside page {page.page_id} ({page.used} bytes used)")
        if header.page_offset(page.page_id) + end > file_size:
            raise bad(f"{kind} row ends beyond the end of the file")
