"""vendor-bin's layout: constants, the preamble and trailer structs, the index record, shard names.

What the writer (:mod:`.writer`) and the reader (:mod:`.reader`) share; the format is specified in
``docs/vendor-bin.md`` and summarised in :mod:`vcga.formats.vbin`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from vcga import tensors
from vcga.contract import TensorEntry
from vcga.errors import VcgaConversionError
from vcga.formatkit import is_unicode

FORMAT_NAME = "vendor-bin"
EXTENSION = ".vbin"
#: PNG-style signature: the high byte catches 7-bit channels, CR LF catches newline translation,
#: ^Z stops a DOS ``type``.
MAGIC = b"\x89VBIN\r\n\x1a"
TRAILER_MAGIC = b"\x89VBINEND"
#: (major, minor). Readers accept every minor of their major; a newer minor may add optional index
#: keys (ignored by older readers) but never changes the meaning of existing bytes.
VERSION = (1, 0)
DEFAULT_ALIGNMENT = 4096
SMALL_ALIGNMENT = 64
MIN_ALIGNMENT, MAX_ALIGNMENT = SMALL_ALIGNMENT, 1 << 30
PREAMBLE_SIZE = 64
TRAILER_SIZE = 64
MAX_NDIM = 64
_MAX_INDEX = (1 << 63) - 1

# magic, major, minor, alignment, file_id, reserved, xxh3 of the 56 bytes before it
_PREAMBLE = struct.Struct("<8sHHI16s24sQ")
# magic, major, minor, flags, index_offset, index_length, index_xxh3, file_id, xxh3 of the 56 bytes before it
_TRAILER = struct.Struct("<8sHHIQQQ16sQ")
assert _PREAMBLE.size == PREAMBLE_SIZE and _TRAILER.size == TRAILER_SIZE


_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes", "checksum"}
_ENTRY_OPTIONAL = {"metadata", "shard"}
_DOC_KEYS = {"format", "version", "file_id", "alignment", "metadata", "tensors"}
_DOC_OPTIONAL = {"shard", "shards"}


def shard_name(path: str | os.PathLike[str], number: int) -> str:
    """The file name of shard ``number`` of the checkpoint whose index is ``path``."""
    base = Path(path).name
    stem = base[: -len(EXTENSION)] if base.endswith(EXTENSION) and len(base) > len(EXTENSION) else base
    return f"{stem}-{number:05d}{EXTENSION}"


def _required_alignment(nbytes: int, alignment: int) -> int:
    return alignment if nbytes >= alignment else SMALL_ALIGNMENT


def _roundup(n: int, a: int) -> int:
    return -(-n // a) * a


class _Record(NamedTuple):
    """One tensor of the index, as written and as validated on read."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int
    metadata: Mapping[str, str]
    shard: int | None = None

    def to_json(self, with_shard: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                             "offset": self.offset, "nbytes": self.nbytes,
                             "checksum": tensors.format_checksum(self.checksum)}
        if self.metadata:
            d["metadata"] = dict(self.metadata)
        if with_shard:
            d["shard"] = self.shard
        return d

    def entry(self, data: Any) -> TensorEntry:
        return TensorEntry(self.name, self.dtype, self.shape, data, self.metadata,
                           tensors.format_checksum(self.checksum))


def _check_metadata(metadata: Any, where: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise VcgaConversionError(f"{where}: file metadata must map strings to strings", target=FORMAT_NAME)
    for s in (*metadata.keys(), *metadata.values()):
        _check_text(s, where, "metadata")
    return dict(metadata)


def _check_text(s: str, where: Any, what: str) -> None:
    if not is_unicode(s):
        raise VcgaConversionError(f"{where}: {what} {s!r} is not valid Unicode (lone surrogate)",
                                  target=FORMAT_NAME)


def _check_alignment(alignment: Any) -> int:
    if (type(alignment) is not int or alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise ValueError(f"alignment must be a power of two between {MIN_ALIGNMENT} and {MAX_ALIGNMENT}, "
                         f"got {alignment!r}")
    return alignment
