"""Atomic file output: temporary file, fsync, rename -- nothing half-written ever appears.

Every writer in VCGA (checkpoint formats, reports, generated tables) goes through this module.

- :class:`AtomicFile`: one output file. Data goes to a hidden temporary in the destination's
  directory (same filesystem, so the rename is atomic); :meth:`AtomicFile.commit` flushes, fsyncs,
  renames into place and fsyncs the directory; :meth:`AtomicFile.abort` (or an exception inside the
  ``with`` block) removes the temporary and leaves the destination untouched.
- :class:`AtomicGroup`: several files that appear together (shards plus an index, a MindRecord
  file plus its ``.db``). All are written as temporaries; on commit they are renamed in the order
  they were opened, so open the file that makes the set discoverable (the index) last.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["AtomicFile", "AtomicGroup", "atomic_write_bytes", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """A file that appears at ``path`` only when committed.

    :param path: the destination.
    :param mode: ``"wb"`` (default) or ``"w+b"`` when the writer must read back (e.g. patch a header).
    :param overwrite: when False, :meth:`commit` refuses to replace an existing file.
    """

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb", *, overwrite: bool = True) -> None:
        if mode not in ("wb", "w+b"):
            raise ValueError("AtomicFile supports binary write modes 'wb' and 'w+b'")
        self.path = Path(path)
        self.overwrite = overwrite
        self.tmp_path = self.path.with_name(f".{self.path.name}.vcga-tmp-{os.getpid()}-{secrets.token_hex(4)}")
        self._flusher: threading.Thread | None = None
        self._file: IO[bytes] | None = open(self.tmp_path, mode)  # noqa: SIM115 - closed in commit/abort
        self.committed = False

    @property
    def file(self) -> IO[bytes]:
        if self._file is None:
            raise ValueError(f"{self.path}: already committed or aborted")
        return self._file

    def write(self, data: Any) -> int:
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def writeback(self) -> None:
        """Start writing what was written so far to disk, in the background.

        An ``fdatasync`` in a daemon thread (at most one at a time) lets the disk work while the
        writer produces more data, so that :meth:`commit`'s fsync has little left to wait for: a
        durable write then costs about max(produce, disk) instead of their sum. Writers of large
        files call it every few tens of MiB. Errors are left for the final fsync to report.
        """
        if self._flusher is not None and self._flusher.is_alive():
            return
        f = self.file
        f.flush()
        self._flusher = threading.Thread(target=_fdatasync_quietly, args=(f.fileno(),), daemon=True,
                                         name="vcga-writeback")
        self._flusher.start()

    def _join_writeback(self) -> None:
        if self._flusher is not None:
            self._flusher.join()  # before the descriptor is fsynced, closed or reused
            self._flusher = None

    def _finish_tmp(self) -> None:
        self._join_writeback()
        f = self.file
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None

    def commit(self) -> None:
        """Flush, fsync, rename into place, fsync the directory."""
        self._finish_tmp()
        self._rename()

    def _rename(self) -> None:
        if not self.overwrite and self.path.exists():
            self._cleanup()
            raise FileExistsError(f"{self.path} exists; refusing to overwrite")
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        self.committed = True

    def _cleanup(self) -> None:
        try:
            self.tmp_path.unlink()
        except FileNotFoundError:
            pass

    def abort(self) -> None:
        """Remove the temporary; the destination is left as it was."""
        self._join_writeback()
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self.committed:
            self._cleanup()

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None and not self.committed and self._file is not None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:  # an abandoned writer must not leave a temporary behind
        try:
            if not self.committed:
                self.abort()
        except Exception:
            pass


def _fdatasync_quietly(fd: int) -> None:
    try:
        os.fdatasync(fd)
    except (OSError, AttributeError):  # reported by the final fsync; no fdatasync on some platforms
        pass


class AtomicGroup:
    """Several :class:`AtomicFile` outputs committed together (in opening order)."""

    def __init__(self) -> None:
        self.files: list[AtomicFile] = []
        self.done = False

    def open(self, path: str | os.PathLike[str], mode: str = "wb", *, overwrite: bool = True) -> AtomicFile:
        af = AtomicFile(path, mode, overwrite=overwrite)
        self.files.append(af)
        return af

    def commit(self) -> None:
        """fsync every temporary first, then rename each into place."""
        try:
            for af in self.files:
                if af._file is not None:
                    af._finish_tmp()
            for af in self.files:
                af._rename()
        except BaseException:
            self.abort()
            raise
        self.done = True

    def abort(self) -> None:
        """Remove every temporary not yet renamed. (If a rename itself fails midway -- a full disk
        cannot cause that, since all data is already fsynced -- files renamed before it stay: they
        may have replaced originals, and deleting them would lose more.)"""
        for af in self.files:
            af.abort()
        self.done = True

    def __enter__(self) -> AtomicGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None and not self.done:
            self.commit()
        elif not self.done:
            self.abort()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with AtomicFile(path) as f:
        f.write(data)
