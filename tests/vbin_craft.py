"""Take vendor-bin files apart and put them back together, with valid checksums, from the spec
(docs/vendor-bin.md) alone -- so tests can hand the reader files whose checksums are right but
whose fields lie, which random damage alone never reaches."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

PREAMBLE = struct.Struct("<8sHHI16s24sQ")
TRAILER = struct.Struct("<8sHHIQQQ16sQ")


@dataclass
class Parts:
    preamble: dict[str, Any]
    body: bytes  # bytes between the preamble and the index
    index: bytes
    trailer: dict[str, Any]

    @property
    def doc(self) -> Any:
        return json.loads(self.index)


def split(data: bytes) -> Parts:
    magic, major, minor, alignment, file_id, reserved, _ = PREAMBLE.unpack_from(data, 0)
    t0 = len(data) - TRAILER.size
    tmagic, tmajor, tminor, flags, ioff, ilen, isum, tfid, _ = TRAILER.unpack_from(data, t0)
    assert ioff + ilen == t0
    return Parts(
        {"magic": magic, "major": major, "minor": minor, "alignment": alignment, "file_id": file_id, "reserved": reserved},
        data[PREAMBLE.size:ioff], data[ioff:t0],
        {"magic": tmagic, "major": tmajor, "minor": tminor, "flags": flags, "index_offset": ioff, "index_length": ilen,
             "index_xxh3": isum, "file_id": tfid})


def join(p: Parts, *, fix_index_fields: bool = True) -> bytes:
    """Reassemble; checksums recomputed (and, unless told otherwise, the index offset/length and
    checksum follow the index bytes)."""
    pre = PREAMBLE.pack(p.preamble["magic"], p.preamble["major"], p.preamble["minor"], p.preamble["alignment"],
                        p.preamble["file_id"], p.preamble["reserved"], 0)[:56]
    pre += struct.pack("<Q", xxhash.xxh3_64_intdigest(pre))
    t = dict(p.trailer)
    if fix_index_fields:
        t.update(index_offset=len(pre) + len(p.body), index_length=len(p.index),
                 index_xxh3=xxhash.xxh3_64_intdigest(p.index))
    tr = TRAILER.pack(t["magic"], t["major"], t["minor"], t["flags"], t["index_offset"], t["index_length"],
                      t["index_xxh3"], t["file_id"], 0)[:56]
    tr += struct.pack("<Q", xxhash.xxh3_64_intdigest(tr))
    return pre + p.body + p.index + tr


def with_doc(data: bytes, doc: Any, *, ascii_only: bool = True) -> bytes:
    p = split(data)
    p.index = json.dumps(doc, separators=(",", ":"), ensure_ascii=ascii_only).encode("utf-8")
    return join(p)


def with_index_bytes(data: bytes, index: bytes) -> bytes:
    p = split(data)
    p.index = index
    return join(p)
