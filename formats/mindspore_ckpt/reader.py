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

import logging
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vcga import dtypes as _dtypes
from vcga.atomic import AtomicFile
from vcga.contract import FormatSpec, TensorEntry, hookimpl
from vcga.errors import VcgaChecksumError, VcgaConfigError, VcgaConversionError, VcgaFormatError
from vcga.formatkit import ReaderContext, WriterContext, pack_tensor_metadata, pread_exact, unpack_tensor_metadata

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

log = logging.getLogger(__name__)

#: mindspore/ccsrc/utils/checkpoint.proto (MindSpore 2.10), plus VCGA's field 1001, as the protobuf
#: text format of a FileDescriptorProto. Field numbers, labels and types are MindSpore's.
CHECKPOINT_PROTO = """
name: "vcga/mindspore_checkpoint.proto"
message_type {
  name: "Checkpoint"
  field { name: "value" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".Checkpoint.Value" }
  # VCGA: tensors MindSpore cannot load faithfully (shape (0,)); MindSpore's parser skips field 1001.
  field { name: "vcga_extra" number: 1001 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".Checkpoint.Value" }
  nested_type {
    name: "Value"
    field { name: "tag" number: 1 label: LABEL_REQUIRED type: TYPE_STRING }
    field { name: "tensor" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".TensorProto" oneof_index: 0 }
    field { name: "maptensor" number: 3 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".MapTensorProto" oneof_index: 0 }
    oneof_decl { name: "value" }
  }
}
message_type {
  name: "TensorProto"
  field { name: "dims" number: 1 label: LABEL_REPEATED type: TYPE_INT64 }
  field { name: "tensor_type" number: 2 label: LABEL_REQUIRED type: TYPE_STRING }
  field { name: "tensor_content" number: 3 label: LABEL_REQUIRED type: TYPE_BYTES }
}
message_type {
  name: "MapTensorProto"
  field { name: "tensor" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".TensorProto" }
}
"""

#: Dtypes MindSpore 2.10's load_checkpoint maps (serialization.py tensor_to_ms_type), so a VCGA-written
#: .ckpt holding them loads in MindSpore. (It also *writes* Complex64/128, which its loader rejects:
#: VCGA reads those but does not write them.)
CKPT_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                         "float16", "bfloat16", "float32", "float64"})

#: MindSpore splits a tensor into Values of at most 512 MiB (serialization.py SLICE_SIZE, in KiB).
DEFAULT_SLICE_SIZE = 512 * 1024 * 1024
#: Start writing to disk in the background after this many bytes (vcga.atomic.AtomicFile.writeback).
WRITEBACK_BYTES = 64 << 20
CRC_MARK = b"crc_num"
CRC_TRAILER = len(CRC_MARK) + 10

_FIELD_VALUE = 1
_FIELD_EXTRA = 1001
_MAX_NAME = 1 << 20  # longest tag or tensor_type VCGA reads: a name is not a megabyte
_MAX_DIMS = 64  # more dims than any framework allows
_MAX_PREFIX = 1 << 16  # a Value's bytes before its content: tag, dims, type and a few lengths
_MAX_MESSAGE = (1 << 31) - 1  # protobuf cannot parse a message of 2 GiB or more

_classes: tuple[Any, Any] | None = None


def message_classes() -> tuple[Any, Any]:
    """``(Checkpoint, Value)`` message classes, built once from :data:`CHECKPOINT_PROTO`."""
    global _classes
    if _classes is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

        fdp = text_format.Parse(CHECKPOINT_PROTO, descriptor_pb2.FileDescriptorProto())
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        checkpoint = message_factory.GetMessageClass(pool.FindMessageTypeByName("Checkpoint"))
        value = message_factory.GetMessageClass(pool.FindMessageTypeByName("Checkpoint.Value"))
        _classes = (checkpoint, value)
    return _classes


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def value_prefix(field_number: int, tag: str, dims: Sequence[int], tensor_type: str, content_len: int) -> bytes:
    """The bytes that, followed by ``content_len`` bytes of tensor content, are exactly
    ``Checkpoint(<field>=[Value(tag, TensorProto(dims, tensor_type, content))]).SerializeToString()``.

    protobuf serializes the tag, dims and tensor_type; only the keys and lengths of the three fields
    that enclose the content are added here, by the wire format's rules. This lets the writer hand a
    tensor's bytes to the file as they are -- protobuf's Python API can only serialize a whole message
    into a new bytes object, copying every tensor three times. The tests check that the result equals
    SerializeToString byte for byte.
    """
    _, value_cls = message_classes()
    head = value_cls()
    head.tag = tag
    head.tensor.dims.extend(dims)
    head.tensor.tensor_type = tensor_type
    tensor_head = head.tensor.SerializePartialToString()  # dims, tensor_type (content not set yet)
    head.ClearField("tensor")
    tag_part = head.SerializePartialToString()  # field 1
    tensor_len = len(tensor_head) + 1 + len(_varint_bytes(content_len)) + content_len
    value_len = len(tag_part) + 1 + len(_varint_bytes(tensor_len)) + tensor_len
    return b"".join((_varint_bytes(field_number << 3 | 2), _varint_bytes(value_len), tag_part,
                     b"\x12", _varint_bytes(tensor_len), tensor_head, b"\x1a", _varint_bytes(content_len)))


def _utf8(text: str) -> bool:
    """protobuf strings and MindSpore's UCS-4 strings need valid Unicode (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _dtype_of(tensor_type: str) -> str | None:
    for d in _dtypes.DTYPES.values():
        if d.mindspore == tensor_type:
            return d.name
    return None


# ---------------------------------------------------------------------------------------------------
# Wire-level walking (framing only; messages are parsed by protobuf)
# ---------------------------------------------------------------------------------------------------


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """Decode a base-128 varint at ``pos``; None when ``buf`` ends first or it exceeds 10 bytes."""
    result = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        b = buf[i]
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i + 1
        shift += 7
    return None


@dataclass
class _Frame:
    """One top-level field of the file: its field number and where its payload is."""

    field: int
    start: int  #: first byte of the field's tag
    payload: int  #: first byte of the payload
    end: int  #: one past the payload


@dataclass
class _Skim:
    """What :meth:`MindSporeCkptReader._skim` learns of one Value without reading its content."""

    tag: str
    kind: str  #: "tensor" or "maptensor"
    dims: list[int] = field(default_factory=list)
    tensor_type: str = ""
    content: tuple[int, int] = (0, 0)  #: absolute (offset, length)


@dataclass
class _Param:
    """A tensor: one Value, or several consecutive Values with the same tag."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    frames: list[_Frame]
    lengths: list[int]
    skims: list[_Skim]

    @property
    def nbytes(self) -> int:
        n = _dtypes.get(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


class MindSporeCkptReader(ReaderContext):
    """The ``mindspore-ckpt`` :class:`~vcga.contract.FormatReader`.

    :param path: the ``.ckpt`` file.
    :param verify_crc: when the file ends with a CRC trailer, check it while :meth:`entries` reads
        (a mismatch raises :class:`~vcga.errors.VcgaChecksumError` after the last tensor).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        self.path = Path(path)
        self.verify_crc = verify_crc
        try:
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise VcgaFormatError(self.path, f"cannot open: {e.strerror}") from None
        try:
            self.size = os.fstat(self.fd).st_size
            self.body_end, self.stored_crc = self.size, None
            if self.size >= CRC_TRAILER:
                tail = self._pread(CRC_TRAILER, self.size - CRC_TRAILER)
                if tail[:len(CRC_MARK)] == CRC_MARK:
                    self.body_end = self.size - CRC_TRAILER
                    self.stored_crc = int.from_bytes(tail[len(CRC_MARK):], "big")
            self._check_not_foreign()
            self.frames = self._frames()
            self.params, strings = self._plan()
            # Per-tensor metadata rides in one string value (vcga.formatkit's convention).
            self.metadata, self.tensor_metadata = unpack_tensor_metadata(strings, path=self.path)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    # -- FormatReader ------------------------------------------------------------------------------

    def index(self) -> Sequence[TensorEntry]:
        return [TensorEntry(p.name, p.dtype, p.shape, None, dict(self.tensor_metadata.get(p.name, {})))
                for p in self.params]

    def entries(self) -> Iterator[TensorEntry]:
        state = {"crc": 0, "done": 0}
        checking = self.verify_crc and self.stored_crc is not None
        for p in self.params:
            if len(p.frames) == 1:
                data: bytes | bytearray = self._content(p, 0, checking, state)
            else:  # a split tensor: one buffer for the whole tensor, one slice in flight
                data = bytearray(p.nbytes)
                pos = 0
                for i in range(len(p.frames)):
                    content = self._content(p, i, checking, state)
                    data[pos:pos + len(content)] = content
                    pos += len(content)
                    del content
            entry = TensorEntry(p.name, p.dtype, p.shape, data, dict(self.tensor_metadata.get(p.name, {})))
            del data  # the consumer holds the only reference: it may drop the tensor before the next
            yield entry
            del entry
        if checking:
            crc = self._crc_range(state["crc"], state["done"], self.body_end)
            if crc != self.stored_crc:
                raise VcgaChecksumError(self.path, f"CRC-32 of the checkpoint is {crc:#010x}, its trailer says "
                                                   f"{self.stored_crc:#010x}; the file was damaged after it was "
                                                   "written")

    def _content(self, p: _Param, i: int, checking: bool, state: dict[str, int]) -> bytes:
        """The tensor content of the ``i``-th Value of ``p``, feeding the CRC on the way.

        Fast path: when the bytes before the content are exactly what protobuf serializes for this
        tag, dims and type (:func:`value_prefix`, built by protobuf) and the content ends the Value,
        the Value *is* the canonical serialization of those fields, so the content is read straight
        into its bytes object -- one copy. Any other encoding (fields reordered, packed dims, unknown
        fields) is parsed by protobuf in full."""
        fr, sk = p.frames[i], p.skims[i]
        if checking:  # bytes between Values (metadata, unknown fields) count too
            state["crc"] = self._crc_range(state["crc"], state["done"], fr.start)
        state["done"] = fr.end
        off, n = sk.content
        if off + n == fr.end and off - fr.start <= _MAX_PREFIX:
            head = self._pread(off - fr.start, fr.start)
            if head == value_prefix(fr.field, sk.tag, sk.dims, sk.tensor_type, n):
                content = self._pread(n, off)
                if checking:
                    state["crc"] = zlib.crc32(content, zlib.crc32(head, state["crc"]))
                return content
        raw = self._pread(fr.end - fr.start, fr.start)
        if checking:
            state["crc"] = zlib.crc32(raw, state["crc"])
        _, value_cls = message_classes()
        view = memoryview(raw)
        value = self._parse(value_cls, view[fr.payload - fr.start:], fr)
        view.release()
        del view, raw
        return self._check_value(value, p, fr)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- reading helpers ---------------------------------------------------------------------------

    def _pread(self, n: int, offset: int) -> bytes:
        return pread_exact(self.fd, n, offset, end=self.size, path=self.path)

    def _crc_range(self, crc: int, start: int, end: int) -> int:
        while start < end:
            n = min(end - start, 1 << 24)
            crc = zlib.crc32(self._pread(n, start), crc)
            start += n
        return crc

    def _check_not_foreign(self) -> None:
        head = self._pread(min(4, self.size), 0)
        hint = None
        if head.startswith(b"PK"):
            hint = "a zip archive (a PyTorch or Lightning checkpoint? read it with --from torch)"
        elif head[:1] == b"\x80":
            hint = "a Python pickle (a PyTorch checkpoint? read it with --from torch)"
        elif head.startswith(b"\x89HDF"):
            hint = "an HDF5 file (read it with --from hdf5)"
        if hint:
            raise VcgaFormatError(self.path, f"is not a MindSpore checkpoint: it is {hint}")

    def _frames(self) -> list[_Frame]:
        """Walk the top-level fields: tags and lengths only."""
        frames: list[_Frame] = []
        pos = 0
        while pos < self.body_end:
            head = self._pread(min(20, self.body_end - pos), pos)
            tag = _varint(head, 0)
            if tag is None:
                raise VcgaFormatError(self.path, "truncated protobuf field tag", offset=pos)
            key, at = tag
            number, wire = key >> 3, key & 7
            if wire == 2:
                ln = _varint(head, at)
                if ln is None:
                    raise VcgaFormatError(self.path, "truncated protobuf length", offset=pos + at)
                length, at = ln
            elif wire == 0:
                v = _varint(head, at)
                if v is None:
                    raise VcgaFormatError(self.path, "truncated protobuf varint", offset=pos + at)
                length, at = 0, v[1]
            elif wire in (1, 5):
                length = 8 if wire == 1 else 4
            else:
                raise VcgaFormatError(self.path, f"invalid protobuf wire type {wire} (field {number}); not a "
                                                 "MindSpore checkpoint, or a damaged one", offset=pos)
            end = pos + at + length
            if end > self.body_end:
                raise VcgaFormatError(self.path, f"protobuf field {number} claims {length} bytes, only "
                                                 f"{self.body_end - pos - at} remain; the file is truncated",
                                      offset=pos)
            if number == 0:
                raise VcgaFormatError(self.path, "protobuf field number 0 is invalid", offset=pos)
            if number in (_FIELD_VALUE, _FIELD_EXTRA) and wire == 2:
                if length > _MAX_MESSAGE:
                    raise VcgaFormatError(self.path, f"a Value of {length} bytes is larger than protobuf can parse",
                                          offset=pos)
                frames.append(_Frame(number, pos, pos + at, end))
            else:
                log.warning("%s: skipping unknown top-level protobuf field %d at byte %d", self.path, number, pos)
            pos = end
        return frames

    def _read_string(self, offset: int, length: int, what: str) -> str:
        if length > _MAX_NAME:
            raise VcgaFormatError(self.path, f"{what} of {length} bytes is implausibly long", offset=offset)
        try:
            return self._pread(length, offset).decode("utf-8")
        except UnicodeDecodeError:
            raise VcgaFormatError(self.path, f"{what} is not valid UTF-8", offset=offset) from None

    def _walk(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """Fields of the message in [start, end): (number, wire type, payload offset, payload length or value)."""
        pos = start
        while pos < end:
            head = self._pread(min(20, end - pos), pos)
            tag = _varint(head, 0)
            if tag is None:
                raise VcgaFormatError(self.path, "truncated protobuf field tag", offset=pos)
            key, at = tag
            number, wire = key >> 3, key & 7
            if wire == 0:
                v = _varint(head, at)
                if v is None:
                    raise VcgaFormatError(self.path, "truncated protobuf varint", offset=pos + at)
                yield number, 0, pos + at, v[0]
                pos += v[1]
            elif wire == 2:
                ln = _varint(head, at)
                if ln is None:
                    raise VcgaFormatError(self.path, "truncated protobuf length", offset=pos + at)
                length, at2 = ln
                if pos + at2 + length > end:
                    raise VcgaFormatError(self.path, f"protobuf field {number} claims {length} bytes beyond its "
                                                     "message", offset=pos)
                yield number, 2, pos + at2, length
                pos += at2 + length
            elif wire in (1, 5):
                n = 8 if wire == 1 else 4
                if pos + at + n > end:
                    raise VcgaFormatError(self.path, "truncated fixed-width protobuf field", offset=pos)
                yield number, wire, pos + at, n
                pos += at + n
            else:
                raise VcgaFormatError(self.path, f"invalid protobuf wire type {wire}", offset=pos)

    def _skim(self, fr: _Frame) -> _Skim:
        """Tag, dims, tensor_type and content location of a Value, reading everything but the content."""
        s = _Skim(tag="", kind="")
        has_tag = False
        for number, wire, off, n in self._walk(fr.payload, fr.end):
            if number == 1 and wire == 2:
                s.tag, has_tag = self._read_string(off, n, "tensor name"), True
            elif number in (2, 3) and wire == 2:
                s.kind = "tensor" if number == 2 else "maptensor"
                if number == 3:
                    continue
                s.dims, s.tensor_type, s.content = [], "", (off, 0)
                for tn, tw, toff, tlen in self._walk(off, off + n):
                    if len(s.dims) > _MAX_DIMS:  # before a crafted Value turns into millions of ints
                        raise VcgaFormatError(self.path, f"tensor {s.tag!r} has more than {_MAX_DIMS} dims",
                                              offset=toff)
                    if tn == 1 and tw == 0:
                        s.dims.append(tlen - (1 << 64) if tlen >= 1 << 63 else tlen)
                    elif tn == 1 and tw == 2:  # packed dims (proto3 writers)
                        packed = self._pread(min(tlen, 10 * (_MAX_DIMS + 1)), toff)
                        if tlen > len(packed):
                            raise VcgaFormatError(self.path, f"tensor {s.tag!r} has more than {_MAX_DIMS} dims",
                                                  offset=toff)
                        p = 0
                        while p < len(packed):
                            v = _varint(packed, p)
                            if v is None:
                                raise VcgaFormatError(self.path, "truncated packed dims", offset=toff + p)
                            s.dims.append(v[0] - (1 << 64) if v[0] >= 1 << 63 else v[0])
                            p = v[1]
                    elif tn == 2 and tw == 2:
                        s.tensor_type = self._read_string(toff, tlen, "tensor_type")
                    elif tn == 3 and tw == 2:
                        s.content = (toff, tlen)
        if not has_tag or not s.kind:
            raise VcgaFormatError(self.path, "a checkpoint Value lacks its tag or its tensor", offset=fr.start)
        return s

    def _plan(self) -> tuple[list[_Param], dict[str, str]]:
        params: list[_Param] = []
        metadata: dict[str, str] = {}
        seen: set[str] = set()
        prev: tuple[str, int] | None = None  # (tag, field) of the previous tensor Value
        for fr in self.frames:
            s = self._skim(fr)
            where = f"tensor {s.tag!r}"
            if s.kind == "maptensor":
                raise VcgaFormatError(self.path, f"{where} is a MindSpore MapParameter (maptensor), which VCGA "
                                                 "does not convert", offset=fr.start)
            if s.tensor_type == "str" and fr.field == _FIELD_VALUE:
                off, n = s.content
                if n % 4:
                    raise VcgaFormatError(self.path, f"string value {s.tag!r} is not UCS-4", offset=off)
                if s.tag in metadata:
                    raise VcgaFormatError(self.path, f"string value {s.tag!r} appears twice", offset=fr.start)
                metadata[s.tag] = self._pread(n, off).decode("utf-32-le", "replace").rstrip("\x00")
                prev = None
                continue
            dtype = _dtype_of(s.tensor_type)
            if dtype is None:
                extra = " (Int4 packs two values per byte; VCGA has no int4 dtype)" if s.tensor_type == "Int4" else ""
                raise VcgaFormatError(self.path, f"{where} has tensor_type {s.tensor_type!r}{extra}",
                                      expected="a MindSpore tensor type VCGA knows: " + ", ".join(
                                          sorted(d.mindspore for d in _dtypes.DTYPES.values() if d.mindspore)))
            if any(d < 0 for d in s.dims) or len(s.dims) > _MAX_DIMS:
                raise VcgaFormatError(self.path, f"{where} has invalid dims {s.dims}", offset=fr.start)
            itemsize = _dtypes.get(dtype).itemsize
            shape = tuple(s.dims)
            if shape == (0,) and s.content[1] == itemsize and fr.field == _FIELD_VALUE:
                shape = ()  # serialization.py: `if dims == [0]: dims = []` -- MindSpore's 0-d spelling
            if prev == (s.tag, fr.field) and params and params[-1].name == s.tag:
                last = params[-1]  # a slice of a split tensor
                if (last.dtype, last.shape) != (dtype, shape):
                    raise VcgaFormatError(self.path, f"{where}: slices disagree on dtype or dims "
                                                     f"({last.dtype} {list(last.shape)} vs {dtype} {list(shape)})")
                last.frames.append(fr)
                last.lengths.append(s.content[1])
                last.skims.append(s)
            else:
                if s.tag in seen:
                    raise VcgaFormatError(self.path, f"{where} appears twice (not as consecutive slices)",
                                          offset=fr.start)
                seen.add(s.tag)
                params.append(_Param(s.tag, dtype, shape, [fr], [s.content[1]], [s]))
            prev = (s.tag, fr.field)
        for p in params:
            if sum(p.lengths) != p.nbytes:
                raise VcgaFormatError(self.path, f"tensor {p.name!r}: {sum(p.lengths)} bytes of content, dtype "
                                                 f"{p.dtype} and dims {list(p.shape)} need {p.nbytes}")
        clash = seen & set(metadata)
        if clash:
            raise VcgaFormatError(self.path, f"names used both by a tensor and a string value: {sorted(clash)}")
        return params, metadata

    def _parse(self, value_cls: Any, payload: memoryview, fr: _Frame) -> Any:
        from google.protobuf.message import DecodeError

        try:
            return value_cls.FromString(payload)
        except (DecodeError, ValueError) as e:
            raise VcgaFormatError(self.path, f"checkpoint Value is not valid protobuf ({e})", offset=fr.start) from None

    def _check_value(self, value: Any, p: _Param, fr: _Frame) -> bytes:
        """The parsed Value must say what the skim said (the file did not change in between)."""
        t = value.tensor
        if value.tag != p.name or _dtype_of(t.tensor_type) != p.dtype:
            raise VcgaFormatError(self.path, f"tensor {p.name!r} changed while being read", offset=fr.start)
        return t.tensor_content


# ---------------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------------


class MindSporeCkptWriter(WriterContext):
    """The ``mindspore-ckpt`` :class:`~vcga.contract.FormatWriter`.

    :param path: the ``.ckpt`` file to create.
    :param crc: append MindSpore's ``crc_num`` trailer (``save_checkpoint(crc_check=True)``).
    :param slice_size: split tensors into Values of at most this many bytes (MindSpore: 512 MiB;
        protobuf cannot parse a message of 2 GiB).
    """

    def __init__(self, path: str | os.PathLike[str], *, crc: bool = False,
                 slice_size: int = DEFAULT_SLICE_SIZE) -> None:
        if not isinstance(slice_size, int) or isinstance(slice_size, bool) or not 0 < slice_size <= (1 << 30):
            raise VcgaConfigError("slice_size", slice_size, "1 byte to 1 GiB")
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise VcgaConversionError(f"{self.path}: directory {self.path.parent} does not exist")
        self.crc_enabled = bool(crc)
        self.slice_size = slice_size
        self.metadata: dict[str, str] = {}
        self.names: set[str] = set()
        self.tensor_metadata: dict[str, dict[str, str]] = {}
        self.crc = 0
        self.unsynced = 0
        self.out = AtomicFile(self.path)
        self.done = False

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        if not all(isinstance(k, str) and k and isinstance(v, str) and _utf8(k) and _utf8(v)
                   for k, v in metadata.items()):
            raise VcgaConversionError("mindspore-ckpt metadata must map non-empty strings to strings "
                                      "(valid Unicode: no lone surrogates)")
        trailing = sorted(k for k, v in metadata.items() if v.endswith("\x00"))
        if trailing:  # MindSpore stores strings as numpy UCS-4 arrays, which drop trailing NULs
            raise VcgaConversionError(f"mindspore-ckpt metadata values of {trailing} end with NUL characters, "
                                      "which a MindSpore checkpoint cannot keep")
        self.metadata = dict(metadata)

    def _emit(self, *parts: Any) -> None:
        """Append ``parts`` with one ``writev`` (the tensor's bytes go from the caller's buffer to the
        file; every write of this writer goes this way, so the buffered file object stays empty)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        for v in views:
            if self.crc_enabled:
                self.crc = zlib.crc32(v, self.crc)
            self.unsynced += len(v)
        fd = self.out.file.fileno()
        while views:
            n = os.writev(fd, views[:512])
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0
        if self.unsynced >= WRITEBACK_BYTES:  # let the disk work while the next tensors arrive
            self.out.writeback()
            self.unsynced = 0

    def write(self, entry: TensorEntry) -> None:
        if self.done:
            raise VcgaConversionError(f"{self.path}: writer already committed or aborted")
        name, dtype, shape = entry.name, entry.dtype, tuple(entry.shape)
        if dtype not in CKPT_DTYPES:
            raise VcgaConversionError(
                f"tensor {name!r} has dtype {dtype}, which MindSpore checkpoints cannot hold "
                f"(they hold {', '.join(sorted(CKPT_DTYPES))}); cast it explicitly to convert",
                tensor=name, dtype=dtype, target="mindspore-ckpt")
        if not isinstance(name, str) or not name or not _utf8(name):
            raise VcgaConversionError(f"tensor name {name!r} is not a non-empty Unicode string", tensor=str(name))
        if name in self.names:
            raise VcgaConversionError(f"tensor {name!r} is written twice", tensor=name)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise VcgaConversionError(f"tensor {name!r}: invalid shape {list(shape)}", tensor=name)
        if not all(isinstance(k, str) and isinstance(v, str) and _utf8(k) and _utf8(v)
                   for k, v in entry.metadata.items()):
            raise VcgaConversionError(f"tensor {name!r}: metadata must map Unicode strings to strings", tensor=name)
        data = memoryview(entry.data if entry.data is not None else b"").cast("B")
        if data.nbytes != entry.nbytes:
            raise VcgaConversionError(f"tensor {name!r}: {data.nbytes} bytes of data, but {dtype} "
                                      f"{list(shape)} needs {entry.nbytes}", tensor=name, dtype=dtype)
        self.names.add(name)
        if entry.metadata:
            self.tensor_metadata[name] = dict(entry.metadata)
        tensor_type = _dtypes.get(dtype).mindspore
        itemsize = _dtypes.get(dtype).itemsize
        step = max(self.slice_size - self.slice_size % itemsize, itemsize)
        # shape (0,) goes to field 1001: MindSpore would read dims [0] as a 0-d scalar.
        field_number = _FIELD_EXTRA if shape == (0,) else _FIELD_VALUE
        pos = 0
        while True:
            piece = data[pos:pos + step]
            self._emit(value_prefix(field_number, name, shape, tensor_type, len(piece)), piece)
            pos += step
            if pos >= data.nbytes:
                break

    def commit(self) -> None:
        if self.done:
            raise VcgaConversionError(f"{self.path}: writer already committed or aborted")
        try:
            strings = pack_tensor_metadata(self.metadata, self.tensor_metadata)
            clash = self.names & set(strings)
            if clash:
                raise VcgaConversionError(f"{self.path}: metadata keys {sorted(clash)} are also tensor names; "
                                          "MindSpore keeps both in one dictionary")
            checkpoint_cls, _ = message_classes()
            for key, text in strings.items():
                # save_checkpoint(append_dict={key: text}): dims [0], type "str", numpy UCS-4 bytes.
                msg = checkpoint_cls()
                value = msg.value.add()
                value.tag = key
                value.tensor.dims.append(0)
                value.tensor.tensor_type = "str"
                # numpy stores "" as one NUL character (dtype <U1), and MindSpore cannot load zero bytes.
                value.tensor.tensor_content = text.encode("utf-32-le") or b"\x00" * 4
                self._emit(msg.SerializeToString())
            if self.crc_enabled:
                trailer = CRC_MARK + self.crc.to_bytes(10, "big")
                self.crc_enabled = False  # the trailer is not part of the checksum
                self._emit(trailer)
            self.out.commit()
        except BaseException:
            self.abort()
            raise
        self.done = True

    def abort(self) -> None:
        self.out.abort()
        self.done = True

    @property
    def finished(self) -> bool:
        return self.done


# ---------------------------------------------------------------------------------------------------
# Plugin
# ---------------------------------------------------------------------------------------------------


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


def open_writer(path: Any, *, crc: bool = False, slice_size: int = DEFAULT_SLICE_SIZE) -> MindSporeCkptWriter:
    """Open a ``.ckpt`` for writing.

    :param crc: append MindSpore's CRC trailer (``save_checkpoint(crc_check=True)``).
    :param slice_size: split larger tensors into Values of this many bytes (MindSpore: 512 MiB).
    """
    return MindSporeCkptWriter(path, crc=crc, slice_size=slice_size)


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
