"""The ``mindspore-ckpt`` checkpoint format: MindSpore ``.ckpt`` files, read and written through protobuf.

A ``.ckpt`` is a concatenation of serialized ``Checkpoint`` messages, one per parameter (or per slice
of a large one), optionally followed by ``b"crc_num"`` and a 10-byte big-endian CRC-32 of every byte
before it. Since concatenated protobuf messages parse as one message whose repeated fields are
concatenated, the file as a whole is one ``Checkpoint`` -- which is how MindSpore loads it, all at once.
VCGA streams it instead, one ``Value`` at a time (see :class:`MindSporeCkptReader`).

What MindSpore 2.10 does, and what VCGA does about it (docs/mindspore-ckpt.md has the details):

- tensors over 512 MiB are split into consecutive ``Value``\\ s with the same tag; both sides join them;
- a 0-d tensor has no ``dims``; MindSpore's loader also reads ``dims == [0]`` as 0-d;
- ``save_checkpoint`` silently omits empty tensors. VCGA writes them: shape ``(0, 3)`` as an ordinary
  ``Value`` with empty content (MindSpore loads it as a (0, 3) Parameter), and shape ``(0,)`` -- which
  MindSpore would load as a garbage 0-d scalar, since it reads ``dims == [0]`` as 0-d -- in field 1001 of
  ``Checkpoint`` (``vcga_extra``), unknown to MindSpore, whose parser skips it;
- ``append_dict`` strings are ``Value``\\ s of type ``"str"`` (UCS-4); VCGA maps them to and from the
  checkpoint's file-level metadata.

The message classes are built at import from the descriptor text below (protobuf text format of a
``FileDescriptorProto``, parsed with :mod:`google.protobuf.text_format`) into a private descriptor
pool: no generated ``_pb2`` module to keep in step with the protobuf runtime, no ``protoc`` at build
time, and no clash with MindSpore's own ``checkpoint.proto`` when both are imported in one process.
"""

from __future__ import annotations

import os
from typing import Any

from vcga.contract import FormatSpec, hookimpl

from ._proto import (
    _FIELD_EXTRA,
    _FIELD_VALUE,
    CHECKPOINT_PROTO,
    CKPT_DTYPES,
    CRC_MARK,
    CRC_TRAILER,
    DEFAULT_SLICE_SIZE,
    _varint,
    message_classes,
    value_prefix,
)
from .reader import MindSporeCkptReader
from .writer import MindSporeCkptWriter

__all__ = [
    "SPEC",
    "CKPT_DTYPES",
    "CHECKPOINT_PROTO",
    "MindSporeCkptReader",
    "MindSporeCkptWriter",
    "sniff",
    "open_reader",
    "open_writer",
    "vcga_formats",
    "message_classes",
    "value_prefix",
]


def sniff(path: Any) -> bool:
    """True when ``path`` starts like a MindSpore checkpoint: field 1 (or VCGA's 1001) of
    ``Checkpoint``, holding a Value whose first field is its UTF-8 tag followed by its tensor.
    A .ckpt has no magic number, so this is a structural check of the first bytes. Never raises."""
    try:
        with open(os.fspath(path), "rb") as f:
            head = f.read(4096)
    except (OSError, TypeError, ValueError):
        return False
    if len(head) == CRC_TRAILER and head.startswith(CRC_MARK):
        return True  # an empty checkpoint saved with crc_check=True
    key = _varint(head, 0)
    if key is None or key[0] not in ((_FIELD_VALUE << 3) | 2, (_FIELD_EXTRA << 3) | 2):
        return False
    ln = _varint(head, key[1])
    if ln is None or ln[0] < 4:
        return False
    pos = ln[1]
    if pos >= len(head) or head[pos] != 0x0A:  # Value.tag, field 1, length-delimited
        return False
    tl = _varint(head, pos + 1)
    if tl is None or tl[0] > ln[0]:
        return False
    end = tl[1] + tl[0]
    if end >= len(head):
        return False  # a tag longer than the 4 KiB probe is not a parameter name
    try:
        head[tl[1]:end].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return head[end] in (0x12, 0x1A)  # Value.tensor or Value.maptensor


def open_reader(path: Any, *, verify_crc: bool = True) -> MindSporeCkptReader:
    """Open a ``.ckpt`` for reading; a CRC trailer is verified unless ``verify_crc=False``."""
    return MindSporeCkptReader(path, verify_crc=verify_crc)


def open_writer(path: Any, *, crc: bool = False, slice_size: int = DEFAULT_SLICE_SIZE,
                publish_into: Any = None) -> MindSporeCkptWriter:
    """Open a ``.ckpt`` for writing.

    :param crc: append MindSpore's CRC trailer (``save_checkpoint(crc_check=True)``).
    :param slice_size: split larger tensors into Values of this many bytes (MindSpore: 512 MiB).
    :param publish_into: name the output in this folder at commit (``vcga convert``'s staging).
    """
    return MindSporeCkptWriter(path, crc=crc, slice_size=slice_size, publish_into=publish_into)


SPEC = FormatSpec(
    name="mindspore-ckpt",
    extensions=(".ckpt",),
    dtypes=CKPT_DTYPES,
    sniff=sniff,
    open_reader=open_reader,
    open_writer=open_writer,
    description="MindSpore .ckpt (protobuf; save_checkpoint/load_checkpoint 2.x compatible, CRC trailer optional)",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
