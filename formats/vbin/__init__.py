"""vendor-bin (``.vbin``): VCGA's own checkpoint format -- streaming writes, mapped reads, checksums.

Specified in ``docs/vendor-bin.md``; in short::

    [preamble 64 B] [tensor bytes at aligned offsets, zero padding between] [index: JSON] [trailer 64 B]

- A writer appends each tensor as it comes (memory bounded by one tensor) and writes the index and
  the fixed-size trailer last, so a converter streams any checkpoint through in one pass.
- A tensor of at least ``alignment`` bytes (default 4096) starts at a multiple of it -- the page size
  of x86-64 and most aarch64 kernels and the logical block size O_DIRECT needs on 512e and 4Kn
  drives -- so it can be mapped, registered for DMA or read with O_DIRECT on its own; smaller
  tensors start at a multiple of 64 (a cache line, more than any dtype needs) rather than wasting
  a page each.
- Each tensor carries an XXH3-64 checksum; the index and the trailer carry their own, and the
  preamble its own, so any single-bit flip in the file is detected (payload flips when the tensor
  is verified, padding flips by :meth:`VbinReader.verify`, everything else on open).
- A reader maps the file and validates every preamble, trailer and index field against the file
  size before it slices or allocates anything; tensors are views of the mapping (no copy), checked
  on first access when ``verify`` is on.
- Sharding: with ``shard_size`` the writer produces ``<stem>-00000.vbin``, ``<stem>-00001.vbin``, ...
  (each a complete vendor-bin file) and, at the path asked for, an index file listing them.

This module never imports torch: torch tensors are made by :func:`vcga.tensors.to_torch` on demand.
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Mapping
from typing import Any

import xxhash

from vcga import dtypes, tensors
from vcga.contract import FormatSpec, hookimpl
from vcga.errors import VcgaConversionError

from ._format import (
    DEFAULT_ALIGNMENT,
    EXTENSION,
    FORMAT_NAME,
    MAGIC,
    PREAMBLE_SIZE,
    SMALL_ALIGNMENT,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    VERSION,
    _check_alignment,
    _check_metadata,
    shard_name,
)
from .reader import VbinReader
from .writer import VbinWriter, _FileWriter

__all__ = [
    "FORMAT_NAME",
    "EXTENSION",
    "MAGIC",
    "TRAILER_MAGIC",
    "VERSION",
    "DEFAULT_ALIGNMENT",
    "SMALL_ALIGNMENT",
    "PREAMBLE_SIZE",
    "TRAILER_SIZE",
    "VbinReader",
    "VbinWriter",
    "open_reader",
    "open_writer",
    "sniff",
    "save_file",
    "load_file",
    "save",
    "load",
    "safe_open",
    "shard_name",
    "SPEC",
]

# ===================================================================================================
# The plugin and the convenience API
# ===================================================================================================


def sniff(path: Any) -> bool:
    """True when ``path`` starts with the vendor-bin signature. Reads 8 bytes; never raises."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (OSError, TypeError, ValueError):
        return False


def open_reader(path: str | os.PathLike[str], *, verify: bool = True, **_options: Any) -> VbinReader:
    """``FormatSpec.open_reader``: a :class:`VbinReader` (unknown options are ignored)."""
    return VbinReader(path, verify=verify)


def open_writer(path: str | os.PathLike[str], *, shard_size: int | None = None,
                alignment: int = DEFAULT_ALIGNMENT, metadata: Mapping[str, str] | None = None,
                overwrite: bool = True, publish_into: str | os.PathLike[str] | None = None,
                **_options: Any) -> VbinWriter:
    """``FormatSpec.open_writer``: a :class:`VbinWriter` (unknown options are ignored)."""
    return VbinWriter(path, shard_size=shard_size, alignment=alignment, metadata=metadata, overwrite=overwrite,
                      publish_into=publish_into)


def save_file(tensors_: Mapping[str, Any], filename: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None, *, shard_size: int | None = None,
              alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Save a dict of torch tensors and/or numpy arrays (safetensors' verb). Atomic: the file
    appears complete or not at all. Non-contiguous tensors are packed; nothing else is copied."""
    with VbinWriter(filename, metadata=metadata, shard_size=shard_size, alignment=alignment) as w:
        for name, t in tensors_.items():
            w.add(name, t)


def load_file(filename: str | os.PathLike[str], framework: str = "pt", *, verify: bool = True) -> dict[str, Any]:
    """Load every tensor (safetensors' verb): torch tensors (``"pt"``) or numpy arrays (``"np"``)
    sharing the file's mapping, each checksum checked unless ``verify=False``."""
    with VbinReader(filename, verify=verify) as r:
        for f in [r._root, *(r._shard(i) for i in range(len(r._shards)))]:
            f.advise(mmap.MADV_WILLNEED)  # everything will be read: start the readahead now
        return dict(r.tensors(framework))


def save(tensors_: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *,
         alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """The bytes of a vendor-bin file holding ``tensors_`` (in memory; no sharding)."""
    _check_alignment(alignment)
    out = io.BytesIO()
    w = _FileWriter(out, alignment, "<bytes>")
    names: set[str] = set()
    for name, t in tensors_.items():
        entry = tensors.from_any(name, t)
        if name in names:  # pragma: no cover - dict keys are unique
            raise VcgaConversionError(f"duplicate tensor name {name!r}", tensor=name, target=FORMAT_NAME)
        names.add(name)
        data = tensors.check_entry(entry, target=FORMAT_NAME)
        w.add(entry, data, xxhash.xxh3_64_intdigest(data), None)
    w.finish(_check_metadata(metadata, "<bytes>"))
    return out.getvalue()


def load(data: bytes | bytearray | memoryview, framework: str = "np", *, verify: bool = True) -> dict[str, Any]:
    """Load every tensor from the bytes of a vendor-bin file (views of ``data``)."""
    with VbinReader(data, verify=verify) as r:
        return dict(r.tensors(framework))


def safe_open(filename: str | os.PathLike[str], framework: str = "pt", *, verify: bool = True) -> VbinReader:
    """safetensors' ``safe_open``: a lazy reader; ``get_tensor(name)`` returns ``framework`` tensors."""
    return VbinReader(filename, verify=verify, framework=framework)


SPEC = FormatSpec(
    name=FORMAT_NAME,
    extensions=(EXTENSION,),
    dtypes=frozenset(dtypes.EVERY),
    sniff=sniff,
    open_reader=open_reader,
    open_writer=open_writer,
    description="VCGA vendor-bin: aligned tensors, per-tensor xxh3, streaming writes, zero-copy mapped reads",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
