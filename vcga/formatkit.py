"""Helpers every checkpoint format plugin shares (public core API, like :mod:`vcga.dtypes`).

A format plugin imports this module instead of re-implementing these:

- :func:`entry_array` -- a zero-copy little-endian numpy view of an entry's bytes, checked against
  its dtype and shape (the entry helpers themselves -- :func:`vcga.tensors.check_entry`, the one
  entry validation, and :func:`vcga.tensors.checksum`, the ``"xxh3_64:<16 hex>"`` string a
  :class:`~vcga.contract.TensorEntry` carries -- live in :mod:`vcga.tensors`);
- :func:`is_unicode` -- whether a name or metadata string can be written at all (no lone surrogates);
- :data:`TENSOR_METADATA_KEY` with :func:`pack_tensor_metadata` / :func:`unpack_tensor_metadata` --
  the convention that lets a format with only file-level string metadata (safetensors, ...) carry
  per-tensor metadata (HDF5 attributes, tie information) through a conversion;
- :func:`read_exact` / :func:`pread_exact` -- read a byte range (from a file object / a descriptor) or
  raise :class:`~vcga.errors.VcgaFormatError`;
- :class:`ReaderContext` -- the ``with`` protocol of readers (close);
- :class:`WriterContext` -- the one commit/abort/finished protocol of writers, over atomic outputs
  that a killed writer does not leave behind (:mod:`vcga.atomic`).

It imports numpy lazily and never imports torch.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from vcga import dtypes
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.tensors import check_entry

if TYPE_CHECKING:
    import numpy as np

    from vcga.atomic import AtomicFile, AtomicGroup
    from vcga.contract import TensorEntry

__all__ = [
    "entry_array",
    "is_unicode",
    "TENSOR_METADATA_KEY",
    "pack_tensor_metadata",
    "unpack_tensor_metadata",
    "read_exact",
    "pread_exact",
    "file_size",
    "ReaderContext",
    "WriterContext",
]

_Self = TypeVar("_Self")

#: File-level metadata key under which formats without per-tensor metadata keep it, as JSON
#: ``{"tensor name": {"key": "value", ...}, ...}`` (only tensors that have metadata are listed).
TENSOR_METADATA_KEY = "vcga.tensor_metadata"


def is_unicode(text: str) -> bool:
    """Whether ``text`` can be stored as UTF-8 (or UCS-4): no lone surrogates. Names and metadata a
    format writes must be (``"\\ud800"`` is a ``str`` Python accepts, but no file format does)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def entry_array(entry: TensorEntry, *, target: str | None = None) -> np.ndarray:
    """A zero-copy, read-only, little-endian numpy view of the entry with its shape
    (ml_dtypes' types for bf16 and fp8)."""
    import numpy as np

    buf = check_entry(entry, target=target)
    return np.frombuffer(buf, dtype=dtypes.to_numpy(entry.dtype)).reshape(entry.shape)


def pack_tensor_metadata(metadata: Mapping[str, str], per_tensor: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """File-level metadata with the per-tensor metadata folded in under :data:`TENSOR_METADATA_KEY`."""
    out = dict(metadata)
    kept = {name: dict(m) for name, m in per_tensor.items() if m}
    if kept:
        out[TENSOR_METADATA_KEY] = json.dumps(kept, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    else:
        out.pop(TENSOR_METADATA_KEY, None)
    return out


def unpack_tensor_metadata(metadata: Mapping[str, str], *,
                           path: Any = "") -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """Split file-level metadata into (file metadata, per-tensor metadata).

    :raises VcgaFormatError: the key is present but not a JSON object of string maps.
    """
    out = dict(metadata)
    raw = out.pop(TENSOR_METADATA_KEY, None)
    if raw is None:
        return out, {}
    try:
        per = json.loads(raw)
        ok = isinstance(per, dict) and all(
            isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items())
            for v in per.values())
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise VcgaFormatError(path, f"metadata key {TENSOR_METADATA_KEY!r} is not a JSON object of string maps")
    return out, per


def file_size(f: BinaryIO | io.IOBase) -> int:
    return os.fstat(f.fileno()).st_size


def read_exact(f: io.BufferedIOBase, offset: int, size: int, *, path: Any, what: str) -> memoryview:
    """Read ``size`` bytes at ``offset`` into a fresh, writable buffer (one allocation, left
    uninitialised until the read fills it, no intermediate copy).

    :raises VcgaFormatError: the range runs past the end of the file (checked before allocating).
    """
    import numpy as np

    total = file_size(f)
    if offset < 0 or size < 0 or offset + size > total:
        raise VcgaFormatError(path, f"{what}: {size} bytes at this offset run past the end of the file ({total} bytes)",
                              offset=offset)
    view = np.empty(size, dtype=np.uint8).data.cast("B")
    buf = view
    f.seek(offset)
    got = 0
    while got < size:
        n = f.readinto(view[got:])
        if not n:
            raise VcgaFormatError(path, f"{what}: file ended after {got} of {size} bytes", offset=offset + got)
        got += n
    return buf


def pread_exact(fd: int, n: int, offset: int, *, end: int, path: Any) -> bytes:
    """Exactly ``n`` bytes at ``offset`` of the open descriptor ``fd`` (a positioned read: no shared
    file position, so readers can serve tensors in any order).

    :raises VcgaFormatError: the range lies beyond ``end`` (the file size), the read fails, or the file ends
        early (it was truncated while being read).
    """
    if n < 0 or offset < 0 or offset + n > end:
        raise VcgaFormatError(path, f"read of {n} bytes lies beyond the end of the file", offset=offset)
    try:
        out = os.pread(fd, n, offset)
    except OSError as e:
        raise VcgaFormatError(path, f"read failed: {e.strerror}", offset=offset) from None
    if len(out) != n:
        raise VcgaFormatError(path, "file ended early (was it truncated while being read?)", offset=offset)
    return out


class ReaderContext:
    """``with reader:`` closes the reader at the end of the block (the class defines ``close``)."""

    def close(self) -> None:  # pragma: no cover - every reader defines its own
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WriterContext:
    """The one commit/abort/finished protocol of every checkpoint writer.

    A writer opens each output file with :meth:`_open_output` (all of them in one
    :class:`~vcga.atomic.AtomicGroup`: anonymous files on Linux, so a killed writer leaves nothing),
    completes their content in :meth:`_finish` (headers, index, trailer) and releases what it holds
    in :meth:`_discard` (an open library handle). This class does the rest, alike for every format:

    - :meth:`commit`: ``_finish``, then fsync every output and give them their names together (the
      index last, in opening order). Any error aborts and is raised. A second ``commit`` is a no-op;
      ``commit`` after :meth:`abort` raises :class:`~vcga.errors.VcgaConversionError`.
    - :meth:`abort`: drop every output; the destination is left as it was. A no-op once finished.
    - ``write``/``set_metadata`` after either: :meth:`_check_open` raises ``VcgaConversionError``.
    - ``with writer:`` commits when the block ends normally, aborts when it raises, and leaves a
      writer already committed or aborted inside the block as it is.

    :param publish_into: name the outputs in this folder (same filesystem; created at commit when
        missing) instead of beside the destination, keeping their names: ``vcga convert --verify``
        reads an output there before moving it into place.
    """

    _outputs: AtomicGroup | None = None
    _state: str = "open"  # "open", "committed", "aborted"
    _publish_into: str | os.PathLike[str] | None = None
    #: shown in errors: the destination
    path: Any = None

    def _init_outputs(self, publish_into: str | os.PathLike[str] | None = None) -> None:
        from vcga.atomic import AtomicGroup

        self._outputs = AtomicGroup()
        self._state = "open"
        self._publish_into = publish_into

    def _open_output(self, path: str | os.PathLike[str], mode: str = "wb", *, named: bool = False,
                     overwrite: bool = True) -> AtomicFile:
        """A new output of this writer (``named``: a library needs a path; ``overwrite``: False refuses
        to replace an existing file at commit; see :class:`~vcga.atomic.AtomicFile`)."""
        if self._outputs is None:
            self._init_outputs()
        assert self._outputs is not None
        return self._outputs.open(path, mode, named=named, overwrite=overwrite)

    def _finish(self) -> None:
        """Complete the outputs' content; nothing is published yet. (Override.)"""

    def _discard(self) -> None:
        """Release what the writer holds, on abort (never raises). (Override.)"""

    def _check_open(self) -> None:
        if self._state != "open":
            raise VcgaConversionError(f"{self.path}: the writer was already {self._state}; open a new one")

    @property
    def finished(self) -> bool:
        return self._state != "open"

    def commit(self, into: str | os.PathLike[str] | None = None) -> None:
        if self._state == "committed":
            return
        if self._state == "aborted":
            self._check_open()
        into = into if into is not None else self._publish_into
        try:
            self._finish()
            if self._outputs is not None:
                self._outputs.commit(into=into)
        except BaseException:
            self.abort()
            raise
        self._state = "committed"

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            self._discard()
        finally:
            if self._outputs is not None:
                self._outputs.abort()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self.finished:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()
