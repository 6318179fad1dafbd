"""Reading mindspore-ckpt: :class:`MindSporeCkptReader`, one Value at a time (summary in
:mod:`vcga.formats.mindspore_ckpt`)."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vcga import dtypes as _dtypes
from vcga import formatkit
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaFormatError
from vcga.formatkit import ReaderContext, open_regular, pread_exact, unpack_tensor_metadata

from ._proto import (
    _FIELD_EXTRA,
    _FIELD_VALUE,
    _MAX_DIMS,
    _MAX_MESSAGE,
    _MAX_NAME,
    _MAX_PREFIX,
    CRC_MARK,
    CRC_TRAILER,
    _dtype_of,
    _varint,
    message_classes,
    value_prefix,
)

log = logging.getLogger("vcga.formats.mindspore_ckpt")


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
        return _dtypes.nbytes(self.dtype, self.shape)


class MindSporeCkptReader(ReaderContext):
    """The ``mindspore-ckpt`` :class:`~vcga.contract.FormatReader`.

    :param path: the ``.ckpt`` file.
    :param verify_crc: when the file ends with a CRC trailer, check it while :meth:`entries` reads
        (a mismatch raises :class:`~vcga.errors.VcgaChecksumError` after the last tensor).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        self.path = Path(path)
        self.verify_crc = verify_crc
        self.fd = open_regular(self.path)
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
        except Exception:  # noqa: BLE001 - a finalizer cannot report; at interpreter exit any name may be gone
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
        for seen, (number, wire, pos, off, n) in enumerate(self._walk(0, self.body_end)):
            if seen >= formatkit.MAX_TENSORS:  # Values, and fields skipped (each logs a line)
                raise VcgaFormatError(self.path, f"holds more than {formatkit.MAX_TENSORS} top-level fields; VCGA "
                                      f"reads at most {formatkit.MAX_TENSORS} Values from one file "
                                      "(vcga.formatkit.MAX_TENSORS)", offset=pos)
            if number == 0:
                raise VcgaFormatError(self.path, "protobuf field number 0 is invalid", offset=pos)
            if number in (_FIELD_VALUE, _FIELD_EXTRA) and wire == 2:
                if n > _MAX_MESSAGE:
                    raise VcgaFormatError(self.path, f"a Value of {n} bytes is larger than protobuf can parse",
                                          offset=pos)
                frames.append(_Frame(number, pos, off, off + n))
            else:
                log.warning("%s: skipping unknown top-level protobuf field %d at byte %d", self.path, number, pos)
        return frames

    def _read_string(self, offset: int, length: int, what: str) -> str:
        if length > _MAX_NAME:
            raise VcgaFormatError(self.path, f"{what} of {length} bytes is implausibly long", offset=offset)
        try:
            return self._pread(length, offset).decode("utf-8")
        except UnicodeDecodeError:
            raise VcgaFormatError(self.path, f"{what} is not valid UTF-8", offset=offset) from None

    def _walk(self, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
        """Fields of the message in [start, end): (number, wire type, field offset, payload offset,
        payload length -- or the value, for a varint)."""
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
                yield number, 0, pos, pos + at, v[0]
                pos += v[1]
                continue
            if wire == 2:
                ln = _varint(head, at)
                if ln is None:
                    raise VcgaFormatError(self.path, "truncated protobuf length", offset=pos + at)
                length, at = ln
            elif wire in (1, 5):
                length = 8 if wire == 1 else 4
            else:
                raise VcgaFormatError(self.path, f"invalid protobuf wire type {wire} (field {number}); not a "
                                                 "MindSpore checkpoint, or a damaged one", offset=pos)
            if pos + at + length > end:
                where = "the file is truncated" if end == self.body_end else "beyond its message"
                raise VcgaFormatError(self.path, f"protobuf field {number} claims {length} bytes, only "
                                                 f"{end - pos - at} remain; {where}", offset=pos)
            yield number, wire, pos, pos + at, length
            pos += at + length

    def _skim(self, fr: _Frame) -> _Skim:
        """Tag, dims, tensor_type and content location of a Value, reading everything but the content."""
        s = _Skim(tag="", kind="")
        has_tag = False
        for number, wire, _, off, n in self._walk(fr.payload, fr.end):
            if number == 1 and wire == 2:
                s.tag, has_tag = self._read_string(off, n, "tensor name"), True
            elif number in (2, 3) and wire == 2:
                s.kind = "tensor" if number == 2 else "maptensor"
                if number == 3:
                    continue
                s.dims, s.tensor_type, s.content = [], "", (off, 0)
                for tn, tw, _, toff, tlen in self._walk(off, off + n):
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
