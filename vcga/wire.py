"""The tensor wire format: one self-describing, versioned, checksummed frame per tensor.

A frame is a binary header (dtype, shape, name, metadata, lengths, checksums) followed by the
tensor's raw little-endian C-order bytes. It is how a tensor crosses vendors (host-staged
transfers between vendor groups) and the unit any byte stream of tensors is made of. The exact
layout is specified in ``docs/wire-format.md``; this module is its reference implementation.

Copies: :func:`encode` returns the header and a view of the tensor's own memory separately, so
writing a frame with ``sendmsg``/``writelines`` copies nothing; :func:`decode` returns an entry
whose data is a view into the buffer it was given. :func:`dumps` joins the two (one copy) for
callers that need one ``bytes``.

Every length the header claims is checked against the bytes actually present before anything is
sliced or allocated; every problem is a :class:`~vcga.errors.VcgaFormatError` naming the byte
offset and what was expected (:class:`~vcga.errors.VcgaChecksumError` for damaged bytes).
"""

from __future__ import annotations

import io
import json
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from typing import IO, Any, NamedTuple

import xxhash

from vcga import dtypes, tensors
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaFormatError

__all__ = [
    "MAGIC",
    "VERSION",
    "ALIGNMENT",
    "MAX_NDIM",
    "Frame",
    "encode",
    "encode_entry",
    "dumps",
    "frame_length",
    "decode",
    "decode_frames",
    "loads_torch",
    "loads_numpy",
    "write",
    "read",
]

MAGIC = b"VCGW"
#: (major, minor). A reader accepts any minor of its major: minors only give meaning to bytes
#: that earlier minors require to be zero.
VERSION = (1, 0)
#: Header lengths are multiples of this, so a payload in a 64-byte-aligned buffer is aligned for
#: every dtype and for vector loads.
ALIGNMENT = 64
#: torch's own limit on dimensions.
MAX_NDIM = 64

# magic, major, minor, dtype code, ndim, header_len, name_len, meta_len, flags, payload_len, payload_xxh3
_FIXED = struct.Struct("<4sBBBBIIIIQQ")
assert _FIXED.size == 40
_U64 = struct.Struct("<Q")
_MAX_INDEX = (1 << 63) - 1  # torch and numpy index with int64
_STREAM_CHUNK = 64 << 20


class Frame(NamedTuple):
    """An encoded tensor: ``header`` bytes, then ``payload`` (a view of the tensor's memory)."""

    header: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes

    def buffers(self) -> tuple[bytes, memoryview]:
        """The two buffers to send back to back (``socket.sendmsg``, ``file.writelines``)."""
        return (self.header, self.payload)

    def tobytes(self) -> bytes:
        """The frame as one ``bytes`` (copies the payload once)."""
        return b"".join(self.buffers())


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _header_len(ndim: int, name_len: int, meta_len: int) -> int:
    return _align(_FIXED.size + 8 * ndim + name_len + meta_len + 8)


def encode_entry(entry: TensorEntry) -> Frame:
    """Encode a :class:`~vcga.contract.TensorEntry` (its data is not copied)."""
    payload = tensors.check_entry(entry)
    info = dtypes.get(entry.dtype)
    if len(entry.shape) > MAX_NDIM:
        raise VcgaFormatError("<wire>", f"tensor {entry.name!r} has {len(entry.shape)} dimensions",
                              expected=f"at most {MAX_NDIM}")
    name = entry.name.encode("utf-8")
    meta = (json.dumps(dict(entry.metadata), ensure_ascii=False, separators=(",", ":"), sort_keys=True)
            .encode("utf-8") if entry.metadata else b"")
    ndim = len(entry.shape)
    header_len = _header_len(ndim, len(name), len(meta))
    if header_len > 0xFFFFFFFF:
        raise VcgaFormatError("<wire>", f"tensor {entry.name!r}: name and metadata take {header_len} bytes",
                              expected="a header under 4 GiB")
    digest = tensors.checksum_int(payload)
    if entry.checksum is not None and tensors.format_checksum(digest) != entry.checksum:
        raise VcgaChecksumError("<wire>", f"tensor {entry.name!r} does not match the checksum it came with "
                                f"(computed {tensors.format_checksum(digest)})", expected=entry.checksum)
    buf = bytearray(header_len)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION[0], VERSION[1], info.code, ndim, header_len, len(name),
                     len(meta), 0, payload.nbytes, digest)
    struct.pack_into(f"<{ndim}Q", buf, _FIXED.size, *entry.shape)
    pos = _FIXED.size + 8 * ndim
    buf[pos:pos + len(name)] = name
    buf[pos + len(name):pos + len(name) + len(meta)] = meta
    _U64.pack_into(buf, header_len - 8, xxhash.xxh3_64_intdigest(memoryview(buf)[:header_len - 8]))
    return Frame(bytes(buf), payload)


def encode(obj: Any, name: str = "", metadata: Mapping[str, str] | None = None) -> Frame:
    """Encode a torch tensor, a numpy array or a TensorEntry (zero-copy for contiguous CPU memory;
    a device tensor comes to the host through its vendor plugin first)."""
    return encode_entry(tensors.from_any(name, obj, metadata))


def dumps(obj: Any, name: str = "", metadata: Mapping[str, str] | None = None) -> bytes:
    """One frame as ``bytes``."""
    return encode(obj, name, metadata).tobytes()


class _Header(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    metadata: dict[str, str]
    header_len: int
    payload_len: int
    payload_xxh3: int


def _fail(source: Any, base: int, rel: int, message: str, expected: str | None = None) -> VcgaFormatError:
    return VcgaFormatError(source, message, offset=base + rel, expected=expected)


def _parse_fixed(fixed: bytes | memoryview, source: Any, base: int) -> tuple[int, ...]:
    """Check the 40 fixed bytes; returns (code, ndim, header_len, name_len, meta_len, payload_len, xxh3)."""
    magic, major, minor, code, ndim, header_len, name_len, meta_len, flags, payload_len, xxh = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise _fail(source, base, 0, f"bad magic {bytes(magic)!r}: not a VCGA wire frame", f"{MAGIC!r}")
    if major != VERSION[0]:
        raise _fail(source, base, 4, f"wire format version {major}.{minor} is not supported",
                    f"major version {VERSION[0]}")
    if flags != 0:
        raise _fail(source, base, 20, f"unknown flags 0x{flags:08x}", "0 in version 1")
    try:
        dtypes.from_code(code)
    except dtypes.UnknownDTypeError:
        raise _fail(source, base, 6, f"unknown dtype code {code}",
                    f"one of {sorted(dtypes.get(n).code for n in dtypes.EVERY)}") from None
    if ndim > MAX_NDIM:
        raise _fail(source, base, 7, f"{ndim} dimensions", f"at most {MAX_NDIM}")
    want = _header_len(ndim, name_len, meta_len)
    if header_len != want:
        raise _fail(source, base, 8, f"header length {header_len} does not match its contents",
                    f"{want} for {ndim} dims, a {name_len}-byte name and {meta_len} bytes of metadata")
    return code, ndim, header_len, name_len, meta_len, payload_len, xxh


def _parse_rest(fields: tuple[int, ...], header: bytes | memoryview, source: Any, base: int) -> _Header:
    code, ndim, header_len, name_len, meta_len, payload_len, xxh = fields
    stored = _U64.unpack_from(header, header_len - 8)[0]
    computed = xxhash.xxh3_64_intdigest(header[:header_len - 8])
    if stored != computed:
        raise VcgaChecksumError(source, f"frame header checksum mismatch (computed {computed:016x})",
                                offset=base + header_len - 8, expected=f"{stored:016x}")
    shape = struct.unpack_from(f"<{ndim}Q", header, _FIXED.size)
    info = dtypes.get(dtypes.from_code(code))
    numel, nonzero = 1, 1
    for d in shape:
        numel *= d
        nonzero *= d or 1
    if nonzero > _MAX_INDEX:
        raise _fail(source, base, _FIXED.size, f"shape {list(shape)} has more elements than int64 can index")
    if payload_len != numel * info.itemsize:
        raise _fail(source, base, 24, f"payload length {payload_len} does not match shape {list(shape)} "
                    f"of {info.name}", f"{numel * info.itemsize}")
    pos = _FIXED.size + 8 * ndim
    try:
        name = bytes(header[pos:pos + name_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(source, base, pos + e.start, "tensor name is not UTF-8") from None
    pos += name_len
    metadata: dict[str, str] = {}
    if meta_len:
        try:
            metadata = json.loads(bytes(header[pos:pos + meta_len]).decode("utf-8"))
        except (ValueError, RecursionError):
            raise _fail(source, base, pos, "metadata is not valid UTF-8 JSON", "a JSON object") from None
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise _fail(source, base, pos, "metadata is not an object of strings", "a JSON object of strings")
    pad = header[pos + meta_len:header_len - 8]
    if any(pad):
        raise _fail(source, base, pos + meta_len, "non-zero header padding", "zero bytes")
    return _Header(name, info.name, tuple(shape), metadata, header_len, payload_len, xxh)


def _parse_header(buf: memoryview, source: Any, base: int) -> _Header:
    avail = buf.nbytes
    if avail < _FIXED.size:
        raise _fail(source, base, 0, f"truncated frame: {avail} bytes", f"at least {_FIXED.size} header bytes")
    fields = _parse_fixed(buf[:_FIXED.size], source, base)
    header_len = fields[2]
    if avail < header_len:
        raise _fail(source, base, avail, f"truncated frame header: {avail} of {header_len} bytes",
                    f"{header_len} header bytes")
    return _parse_rest(fields, buf[:header_len], source, base)


def _entry(h: _Header, payload: Any, source: Any, base: int, verify: bool) -> TensorEntry:
    if verify:
        got = xxhash.xxh3_64_intdigest(payload)
        if got != h.payload_xxh3:
            raise VcgaChecksumError(source, f"tensor {h.name!r}: payload checksum mismatch (computed "
                                    f"{got:016x}); the bytes were damaged in transit",
                                    offset=base + h.header_len, expected=f"{h.payload_xxh3:016x}")
    return TensorEntry(h.name, h.dtype, h.shape, payload, h.metadata, tensors.format_checksum(h.payload_xxh3))


def frame_length(buffer: Any, *, source: Any = "<wire>") -> int:
    """Total length (header + payload) of the frame at the start of ``buffer``; needs only its header."""
    h = _parse_header(tensors.byte_view(buffer), source, 0)
    return h.header_len + h.payload_len


def _decode_at(buf: memoryview, base: int, source: Any, verify: bool) -> tuple[TensorEntry, int]:
    view = buf[base:]
    h = _parse_header(view, source, base)
    end = h.header_len + h.payload_len
    if view.nbytes < end:
        raise _fail(source, base, view.nbytes, f"truncated payload: {view.nbytes - h.header_len} of "
                    f"{h.payload_len} bytes", f"{end} bytes in the frame")
    return _entry(h, view[h.header_len:end], source, base, verify), base + end


def decode(buffer: Any, *, verify: bool = True, source: Any = "<wire>") -> TensorEntry:
    """Decode exactly one frame. The entry's data is a view into ``buffer`` (no copy).

    :param verify: recompute the payload checksum (the header's own checksum is always checked).
    :raises VcgaFormatError: malformed or truncated, or bytes after the frame.
    :raises VcgaChecksumError: damaged bytes.
    """
    buf = tensors.byte_view(buffer)
    entry, end = _decode_at(buf, 0, source, verify)
    if end != buf.nbytes:
        raise _fail(source, 0, end, f"{buf.nbytes - end} bytes after the frame", "exactly one frame")
    return entry


def decode_frames(buffer: Any, *, verify: bool = True, source: Any = "<wire>") -> Iterator[TensorEntry]:
    """Decode back-to-back frames until the buffer ends (views, no copies)."""
    buf = tensors.byte_view(buffer)
    pos = 0
    while pos < buf.nbytes:
        entry, pos = _decode_at(buf, pos, source, verify)
        yield entry


def loads_torch(buffer: Any, *, verify: bool = True) -> Any:
    """Decode one frame to a torch tensor (shares ``buffer`` when it is writable, see
    :func:`vcga.tensors.to_torch`)."""
    return tensors.to_torch(decode(buffer, verify=verify))


def loads_numpy(buffer: Any, *, verify: bool = True) -> Any:
    """Decode one frame to a numpy array (a view of ``buffer``)."""
    return tensors.to_numpy(decode(buffer, verify=verify))


def write(stream: IO[bytes], obj: Any, name: str = "", metadata: Mapping[str, str] | None = None) -> int:
    """Write one frame to a binary stream without joining header and payload; returns its length."""
    frame = encode(obj, name, metadata)
    stream.write(frame.header)
    stream.write(frame.payload)
    return frame.nbytes


def _remaining(stream: IO[bytes]) -> int | None:
    """Bytes left in a regular file, or None for pipes and sockets."""
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return st.st_size - stream.tell()
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        if isinstance(stream, io.BytesIO):
            return stream.getbuffer().nbytes - stream.tell()
        return None


def _read_exact(stream: IO[bytes], n: int, source: Any, base: int, what: str) -> memoryview:
    """Read exactly ``n`` bytes; memory follows what actually arrives, never the claim alone."""
    avail = _remaining(stream)
    if avail is not None and avail < n:
        raise _fail(source, base, avail, f"truncated {what}: {avail} of {n} bytes left", f"{n} bytes")
    if avail is not None or n <= _STREAM_CHUNK:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = stream.readinto(view[got:])  # type: ignore[attr-defined]
            if not k:
                raise _fail(source, base, got, f"truncated {what}: {got} of {n} bytes", f"{n} bytes")
            got += k
        return view
    parts, got = [], 0  # a pipe claiming a huge frame: grow with the data, not with the claim
    while got < n:
        chunk = stream.read(min(_STREAM_CHUNK, n - got))
        if not chunk:
            raise _fail(source, base, got, f"truncated {what}: {got} of {n} bytes", f"{n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return memoryview(bytearray(b"".join(parts)))


def read(stream: IO[bytes], *, verify: bool = True, source: Any = "<stream>") -> TensorEntry | None:
    """Read one frame from a binary stream; ``None`` at a clean end of stream.

    The payload lands in a fresh writable buffer, so :func:`vcga.tensors.to_torch` shares it."""
    first = stream.read(_FIXED.size)
    if not first:
        return None
    if len(first) < _FIXED.size:
        raise _fail(source, 0, len(first), f"truncated frame: {len(first)} bytes", f"{_FIXED.size} header bytes")
    fields = _parse_fixed(first, source, 0)
    header_len = fields[2]
    rest = _read_exact(stream, header_len - _FIXED.size, source, _FIXED.size, "frame header")
    h = _parse_rest(fields, memoryview(first + bytes(rest)), source, 0)
    payload = _read_exact(stream, h.payload_len, source, h.header_len, "payload")
    return _entry(h, payload, source, 0, verify)
