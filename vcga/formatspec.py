"""The checkpoint format interface: one stream of tensor entries (section 4 of :mod:`vcga.contract`,
which re-exports every name here; part of the public core API).

A format plugin's ``vcga_formats`` hook returns :class:`FormatSpec` objects; each opens a
:class:`FormatReader` that yields :class:`TensorEntry` objects and a :class:`FormatWriter` that takes
them. Defined apart from :mod:`vcga.contract` so that a process that never converts a checkpoint
(a training job's ``init_process_group``) does not define them; import them from either module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vcga import dtypes as _dtypes

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["TensorEntry", "FormatReader", "RandomAccessReader", "FormatWriter", "FormatSpec"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as every format reader yields it and every writer takes it.

    :param name: the tensor's key ("encoder.layers.0.weight"; HDF5 paths are '/'-joined).
    :param dtype: canonical dtype name (:mod:`vcga.dtypes`).
    :param shape: dimensions; ``()`` for a 0-d tensor.
    :param data: exactly ``numel * itemsize`` bytes, little-endian, C order: ``bytes``, a
        ``memoryview`` or anything with the buffer protocol (a zero-copy view where the reader can).
    :param metadata: per-tensor string metadata a format carries (HDF5 attributes, ...).
    :param checksum: ``"xxh3_64:<16 hex>"`` of ``data`` when the source stored one, else None.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any
    metadata: Mapping[str, str] = field(default_factory=dict)
    checksum: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _dtypes.get(self.dtype).itemsize


@runtime_checkable
class FormatReader(Protocol):
    """Streams the tensors of one checkpoint (all its shards). Use as a context manager."""

    @property
    def metadata(self) -> Mapping[str, str]:
        """File-level metadata (string to string). Read-only here, so an implementation may hold
        any mapping (a dict it fills while opening)."""
        ...

    def index(self) -> Sequence[TensorEntry]:
        """Every entry's name, dtype, shape and metadata, without reading tensor data.

        Entries in the returned list carry ``data=None``."""
        ...

    def entries(self) -> Iterator[TensorEntry]:
        """Yield each tensor with its data, in file order, reading one at a time (bounded memory)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> FormatReader: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


@runtime_checkable
class RandomAccessReader(FormatReader, Protocol):
    """A reader that also serves tensors by name, in any order (vendor-bin's does).

    :mod:`vcga.checkpoint` reads a checkpoint's shard files through it: each rank takes only the
    chunks it needs, and a damaged file is detected before any of its bytes are used."""

    def entry(self, name: str) -> TensorEntry:
        """One tensor with its data (a view where the format maps its file) and its stored
        ``checksum``; the data is checked against it first when the reader verifies.

        :raises KeyError: no tensor of that name."""
        ...

    def verify(self) -> None:
        """Check every stored checksum of the file(s) and every byte between the tensors.

        :raises vcga.errors.VcgaChecksumError: naming the file and the tensor (or offset)."""
        ...

    def release(self, name: str | None = None) -> None:
        """Let this process's resident memory drop tensor ``name``'s pages (all when None); data
        already handed out stays valid."""
        ...


@runtime_checkable
class FormatWriter(Protocol):
    """Writes one checkpoint atomically: nothing appears at the destination until :meth:`commit`.

    As a context manager it commits on success and aborts (removing every temporary) on error.
    """

    def set_metadata(self, metadata: Mapping[str, str]) -> None: ...

    def write(self, entry: TensorEntry) -> None:
        """Append one tensor; may be called many times; memory stays bounded by one tensor."""
        ...

    def commit(self) -> None:
        """fsync and rename into place."""
        ...

    def abort(self) -> None: ...

    def __enter__(self) -> FormatWriter: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


@dataclass(frozen=True)
class FormatSpec:
    """A checkpoint format a plugin contributes.

    :param name: short name used by ``--from``/``--to`` ("safetensors", "mindrecord", ...).
    :param extensions: file extensions including the dot (".safetensors", ".vbin").
    :param dtypes: canonical dtype names the format can hold exactly.
    :param sniff: ``sniff(path) -> bool``: does this file carry the format's signature?
        Must read at most a few KiB and never raise for a foreign file.
    :param open_reader: ``open_reader(path, **options) -> FormatReader``.
    :param open_writer: ``open_writer(path, **options) -> FormatWriter``; options include
        ``shard_size`` (bytes) where the format shards.
    :param description: one line for ``vcga info`` and ``vcga convert --help``.
    """

    name: str
    extensions: tuple[str, ...]
    dtypes: frozenset[str]
    sniff: Callable[[Any], bool]
    open_reader: Callable[..., FormatReader]
    open_writer: Callable[..., FormatWriter]
    description: str = ""
