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
- what a reader of untrusted files checks (docs/security.md): :func:`check_regular_file` and
  :func:`open_regular` (a source is a regular file: never a FIFO or a device, which may block or never
  end), :func:`is_plain_name` and :func:`named_file` (a file a checkpoint names stays in its
  directory, symbolic links included), :data:`MAX_TENSORS` with :func:`more_json_objects_than` (a header
  cannot make a reader build millions of objects), :func:`check_tensor_memory` (a tensor the reader
  must allocate whole fits the memory available);
- :class:`ReaderContext` -- the ``with`` protocol of readers (close);
- :class:`WriterContext` -- the one commit/abort/finished protocol of writers, over atomic outputs
  that a killed writer does not leave behind (:mod:`vcga.atomic`).

It imports numpy lazily and never imports torch.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeGuard, TypeVar

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
    "MAX_TENSORS",
    "check_regular_file",
    "open_regular",
    "is_plain_name",
    "named_file",
    "more_json_objects_than",
    "available_memory",
    "check_tensor_memory",
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


# ---------------------------------------------------------------------------------------------------
# Untrusted sources (docs/security.md)
# ---------------------------------------------------------------------------------------------------

#: The most tensors (or index records) a reader accepts from one checkpoint. Each costs the reader
#: and the conversion about a kilobyte of Python objects; a header declaring millions of them would
#: cost gigabytes before a byte of data is read. Far above real checkpoints, which hold thousands
#: (a model's shard, or a training state with its optimizer). Read at call time: a library user may
#: raise it (``vcga.formatkit.MAX_TENSORS = ...``).
MAX_TENSORS = 1 << 18

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(path: Any, mode: int) -> VcgaFormatError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return VcgaFormatError(path, f"is {kind}, not a regular file; VCGA reads checkpoints from regular files only "
                           "(a pipe or a device has no size to check reads against, may block, and may never end)")


def check_regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """The ``stat`` of ``path`` (a symbolic link is followed: model-hub caches store files that
    way), which must be a regular file.

    :raises VcgaFormatError: no such file, or a FIFO, a device, a socket or a directory.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise VcgaFormatError(path, "no such file") from None
    except OSError as e:
        raise VcgaFormatError(path, f"cannot open: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file ``path`` (close it yourself).

    Opened non-blocking, so that a FIFO put in a file's place never blocks the open, then checked
    with ``fstat`` on the descriptor itself (nothing can be swapped in between) and switched back to
    blocking reads.

    :raises VcgaFormatError: no such file, cannot open it, or not a regular file.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise VcgaFormatError(path, "no such file") from None
    except IsADirectoryError:
        raise _not_regular(path, stat.S_IFDIR) from None
    except OSError as e:
        raise VcgaFormatError(path, f"cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_plain_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a plain file name: one path component, not ``.`` or ``..``, no separator,
    no NUL -- what a checkpoint may use to name another of its files."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and (os.altsep is None or os.altsep not in name))


def _in_hub_blob_store(directory: Path, target: Path) -> bool:
    """Whether ``target`` is a blob of the Hugging Face hub cache repository whose snapshot holds
    ``directory`` (``<repo>/snapshots/<revision>/...`` links every file to ``<repo>/blobs/<hash>``)."""
    for folder in (directory, *directory.parents):
        if folder.parent.name == "snapshots":
            return target.parent == folder.parent.parent / "blobs"
    return False


def named_file(directory: str | os.PathLike[str], name: Any, *, source: Any, what: str) -> Path:
    """The path of the file ``name`` that a checkpoint (``source``) names in ``directory``.

    The name must be plain (:func:`is_plain_name`), and where it is a symbolic link its target must
    lie in the same directory (symbolic links resolved on both sides), or be a blob of the Hugging
    Face cache repository the directory is a snapshot of: a checkpoint never makes VCGA read a file
    elsewhere. A name that does not exist is returned as it is; the caller says it is missing.

    :raises VcgaFormatError: naming ``source``, what the file is (``what``) and where it points.
    """
    if not is_plain_name(name):
        raise VcgaFormatError(source, f"{what} {name!r} is not a plain file name in the checkpoint's directory "
                              "(path separators, '..' and absolute paths are refused)")
    folder = Path(directory)
    path = folder / name
    if not os.path.islink(path):
        return path
    base = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(path))
    if target.parent == base or _in_hub_blob_store(base, target):
        return path
    raise VcgaFormatError(source, f"{what} {name!r} is a symbolic link to {str(target)!r}, outside the checkpoint's "
                          f"directory {str(base)!r}; VCGA does not follow a checkpoint's links out of its directory "
                          "(replace the link with the file it points to)")


# A string literal (skipped whole: a brace inside it opens nothing) or an object's opening brace.
# Every quote either starts a literal that matches or is the last one: the scan stays linear.
_STRING_OR_OBJECT = re.compile(rb'"(?:[^"\\]|\\.)*"|(\{)', re.DOTALL)


def more_json_objects_than(text: Any, limit: int) -> bool:
    """Whether the JSON ``text`` (bytes, or any buffer: a memoryview of a mapping is not copied)
    holds more than ``limit`` objects (``{...}``), counted without parsing it: no Python object is
    built per entry, and counting stops past ``limit``. A reader asks before ``json.loads``, to
    bound what a header can make it build."""
    view = memoryview(text).cast("B")
    step = 1 << 24
    # An upper bound at C speed (braces inside strings count too), 16 MiB copied at a time.
    if sum(bytes(view[i:i + step]).count(b"{") for i in range(0, len(view), step)) <= limit:
        return False
    n = 0
    for m in _STRING_OR_OBJECT.finditer(view):
        if m.lastindex:
            n += 1
            if n > limit:
                return True
    return False


def available_memory() -> int | None:
    """Bytes of memory this process can still take: the kernel's ``MemAvailable``, less where the
    process's cgroup (v2) is limited to less; None where neither is known."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is not None:
            group = Path("/sys/fs/cgroup") / rel.lstrip("/")
            limit = (group / "memory.max").read_text().strip()
            if limit != "max":
                found.append(int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return max(min(found), 0) if found else None


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def check_tensor_memory(path: Any, name: str, nbytes: int, *, stored: int | None = None) -> None:
    """Refuse to allocate a tensor of ``nbytes`` that does not fit the memory available.

    For readers that build a tensor in memory from less than its size in the file (HDF5's
    compression and fill values, a DCP chunk with zero strides): a small file declaring terabytes
    must fail here, saying why, not exhaust the machine. ``stored``: the bytes the file holds for it.

    :raises VcgaFormatError: the tensor needs more memory than is available.
    """
    free = available_memory()
    if free is None or nbytes <= free:
        return
    held = f"; the file stores {_human(stored)} for it" if stored is not None else ""
    raise VcgaFormatError(path, f"tensor {name!r} declares {_human(nbytes)} ({nbytes} bytes), more than the "
                          f"{_human(free)} of memory available{held}. VCGA builds this tensor whole in memory; a "
                          "tensor that large cannot be converted on this machine, and a small file declaring it is "
                          "a decompression bomb")


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
