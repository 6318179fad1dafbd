"""Atomic file output: nothing half-written ever appears, and nothing is left behind by a killed writer.

Every writer in VCGA (checkpoint formats, reports, caches) goes through this module.

- :class:`AtomicFile`: one output file. On Linux the data goes to an *anonymous* file
  (``O_TMPFILE``) in the destination's directory: it has no name, so a process killed while
  writing (``kill -9``, the OOM killer, a node going down) leaves nothing -- the kernel frees it.
  :meth:`AtomicFile.commit` flushes, fsyncs, gives the file its name and fsyncs the directory.
  A new destination gets its name in one step (``linkat`` through ``/proc/self/fd``, which fails
  rather than replace a file that appeared meanwhile); replacing an existing file takes two (link
  to a temporary name, then ``rename`` over the destination), and a kill in the microseconds
  between them leaves that temporary, stamped as described next.
- Where ``O_TMPFILE`` is refused (filesystems without it, no ``/proc``), the data goes to a hidden
  named temporary ``.<name>.vcga-tmp-<pid>-<host>-<boot>-<random>``: the writer's pid, a hash of
  its host name and pid namespace, and a hash of the boot it runs in. The next VCGA writer in that
  directory removes the temporaries (and staging folders) whose writer is dead: same host and pid
  namespace, and a pid no longer running or an earlier boot (:func:`remove_stale`). Temporaries of
  other hosts sharing the folder (NFS) are never touched.
- :meth:`AtomicFile.abort` (or an exception inside the ``with`` block) drops the data and leaves the
  destination as it was.
- :class:`AtomicGroup`: several files that appear together (shards plus an index, a MindRecord
  file plus its ``.db``). All are written anonymously; on commit every one is fsynced first, then
  each is named in the order it was opened, so open the file that makes the set discoverable (the
  index) last. A kill between the first and the last name leaves the files named so far (complete
  files; never a half-written one).

- :func:`publish_set`: moves a set of complete files from a stamped staging folder into place
  (``vcga convert``'s multi-file outputs). The renames are journaled in the staging folder, so if
  the writer is killed between two of them, the next writer in that directory removes the part
  already renamed: an incomplete set does not stay behind.

``commit(into=folder)`` names the output(s) in another folder on the same filesystem instead
(``vcga convert --verify`` reads the output there before moving it into place).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["AtomicFile", "AtomicGroup", "atomic_write_bytes", "fsync_dir", "remove_stale", "temp_name",
           "anonymous_files_supported", "publish_set"]

log = logging.getLogger(__name__)

_TMP_MARK = ".vcga-tmp-"
_STAMPED = re.compile(r"\.vcga-tmp-(?P<pid>\d+)-(?P<where>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})-[0-9a-f]{8}$")
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
#: What open(O_TMPFILE) answers where the filesystem (or an old kernel: EISDIR) does not support it.
_NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


_where_boot: tuple[str, str] | None = None


def _identity() -> tuple[str, str]:
    """(host + pid namespace, boot) hashes: a pid means one process only within both."""
    global _where_boot
    if _where_boot is None:
        try:
            pidns = str(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            pidns = ""
        _where_boot = (_short_hash(socket.gethostname() + "/" + pidns),
                       _short_hash(_read("/proc/sys/kernel/random/boot_id")))
    return _where_boot


def temp_name(path: str | os.PathLike[str]) -> Path:
    """A hidden name beside ``path`` stamped with this writer (see the module doc)."""
    p = Path(path)
    where, boot = _identity()
    return p.with_name(f".{p.name}{_TMP_MARK}{os.getpid()}-{where}-{boot}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, and belongs to someone else
        return True
    return True


def remove_stale(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temporaries and staging folders VCGA writers that are now dead left in ``directory``;
    returns their names. Never raises (a folder that cannot be listed is simply skipped)."""
    where, boot = _identity()
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(".") or _TMP_MARK not in e.name:
            continue
        m = _STAMPED.search(e.name)
        if m is None or m["where"] != where:
            continue  # not ours, or another host's (a shared filesystem): never touched
        pid = int(m["pid"])
        if m["boot"] == boot and (pid == os.getpid() or _alive(pid)):
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                _roll_back(Path(e.path), Path(directory))
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
            removed.append(e.name)
        except FileNotFoundError:
            pass  # another writer cleaned it first
        except OSError as err:
            log.warning("cannot remove %s, left by a dead writer: %s", e.path, err)
    if removed:
        log.info("removed %d temporaries of dead writers in %s: %s", len(removed), directory, ", ".join(removed))
    return removed


_JOURNAL = ".vcga-publishing.json"


def publish_set(staging: Path, parent: Path, files: list[Path]) -> list[str]:
    """Rename the complete, fsynced ``files`` (all in the stamped folder ``staging``) into ``parent``,
    in the given order, and fsync ``parent``; returns the final paths.

    Several names cannot appear in one step. So that a kill between two renames leaves no partial
    set behind for good, a journal naming each file (and its inode) is made durable in ``staging``
    first: when the next writer in ``parent`` finds ``staging`` with its writer dead
    (:func:`remove_stale`), and the set is incomplete, it removes the files of the set that were
    already renamed -- those still having the inode recorded, never a file put there since.
    """
    if len(files) > 1:
        entries = []
        for f in files:
            st = f.stat()
            entries.append({"name": f.name, "dev": st.st_dev, "ino": st.st_ino})
        journal = staging / _JOURNAL
        fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, json.dumps(entries).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(staging)
    out = []
    for f in files:
        final = parent / f.name
        os.replace(f, final)
        out.append(str(final))
    fsync_dir(parent)
    return out


def _roll_back(staging: Path, parent: Path) -> None:
    """Undo a dead writer's incomplete :func:`publish_set` (see there)."""
    try:
        entries = json.loads((staging / _JOURNAL).read_text())
    except (OSError, ValueError):
        return  # no journal: nothing of it was renamed into parent
    try:
        pending = [e for e in entries if (staging / e["name"]).exists()]
        if not pending:
            return  # every file reached its name: the output is complete, keep it
        for e in entries:
            final = parent / e["name"]
            try:
                st = final.stat()
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == (e["dev"], e["ino"]):
                final.unlink()
                log.info("removed %s: part of an output whose writer died before naming all of it", final)
    except (OSError, KeyError, TypeError) as err:
        log.warning("cannot roll back the partial output %s left in %s: %s", staging.name, parent, err)


def anonymous_files_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether :class:`AtomicFile` writes anonymous files in ``directory`` (``O_TMPFILE`` and ``/proc``)."""
    fd = _open_anonymous(Path(directory))
    if fd is None:
        return False
    os.close(fd)
    return True


def _open_anonymous(directory: Path) -> int | None:
    if not _O_TMPFILE or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(directory, _O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in _NO_TMPFILE:
            return None
        raise


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
    :param named: write to a named temporary even where an anonymous file is possible (a library
        that needs a path: :attr:`tmp_path`).
    :param clean: remove dead writers' temporaries from the directory first (:func:`remove_stale`).
    """

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb", *, overwrite: bool = True,
                 named: bool = False, clean: bool = True) -> None:
        if mode not in ("wb", "w+b"):
            raise ValueError("AtomicFile supports binary write modes 'wb' and 'w+b'")
        self.path = Path(path)
        self.final_path: Path | None = None  #: where :meth:`commit` put it
        self.overwrite = overwrite
        self.committed = False
        self._flusher: threading.Thread | None = None
        self._file: IO[bytes] | None = None
        directory = self.path.parent
        if clean:
            remove_stale(directory)
        fd = None if named else _open_anonymous(directory)
        #: the named temporary, or None while the data is in an anonymous file
        self.tmp_path: Path | None = None
        if fd is None:
            self.tmp_path = temp_name(self.path)
            fd = os.open(self.tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self._file = os.fdopen(fd, mode)

    @property
    def anonymous(self) -> bool:
        return self.tmp_path is None

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
        """Flush and fsync the data (the descriptor stays open: an anonymous file is named through it)."""
        self._join_writeback()
        f = self.file
        f.flush()
        os.fsync(f.fileno())

    def commit(self, into: str | os.PathLike[str] | None = None) -> None:
        """Flush, fsync, name the file (in ``into`` instead of the destination's folder when given;
        created when missing, once the data is safe), fsync the directory."""
        try:
            self._finish_tmp()
            _make_dir(into)
        except BaseException:
            self.abort()
            raise
        self._publish(into)

    def _publish(self, into: str | os.PathLike[str] | None = None) -> None:
        dest = self.path if into is None else Path(into) / self.path.name
        f = self.file
        try:
            if self.tmp_path is None:
                self._link(f.fileno(), dest)
            else:
                if not self.overwrite and dest.exists():
                    raise FileExistsError(errno.EEXIST, f"{dest} exists; refusing to overwrite", str(dest))
                os.replace(self.tmp_path, dest)
        except BaseException:
            self.abort()
            raise
        f.close()
        self._file = None
        fsync_dir(dest.parent)
        self.committed = True
        self.final_path = dest

    def _link(self, fd: int, dest: Path) -> None:
        try:
            _name_anonymous(fd, dest)  # fails if dest exists: never replaces a file that appeared meanwhile
            return
        except FileExistsError:
            if not self.overwrite:
                raise FileExistsError(errno.EEXIST, f"{dest} exists; refusing to overwrite", str(dest)) from None
        # Replacing: a link cannot overwrite, a rename can. A kill between the two leaves the stamped
        # temporary, which the next writer in this folder removes.
        tmp = temp_name(dest)
        _name_anonymous(fd, tmp)
        try:
            os.replace(tmp, dest)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def abort(self) -> None:
        """Drop the data; the destination is left as it was."""
        self._join_writeback()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # a failed flush of data we are throwing away
            self._file = None
        if not self.committed and self.tmp_path is not None:
            _unlink_quietly(self.tmp_path)

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
        except Exception:  # noqa: BLE001 - a finalizer cannot report; at interpreter exit any name may be gone
            pass


def _make_dir(into: str | os.PathLike[str] | None) -> None:
    if into is not None:
        os.makedirs(into, exist_ok=True)


def _name_anonymous(fd: int, dest: Path) -> None:
    """linkat(AT_FDCWD, "/proc/self/fd/<fd>", AT_FDCWD, dest, AT_SYMLINK_FOLLOW): the documented way
    to give an O_TMPFILE file a name (open(2)). os.link calls plain link(2) -- which does not follow
    the /proc link -- unless a directory descriptor is passed, hence src_dir_fd."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), dest, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _fdatasync_quietly(fd: int) -> None:
    try:
        os.fdatasync(fd)
    except (OSError, AttributeError):  # reported by the final fsync; no fdatasync on some platforms
        pass


class AtomicGroup:
    """Several :class:`AtomicFile` outputs committed together (named in opening order)."""

    def __init__(self) -> None:
        self.files: list[AtomicFile] = []
        self.done = False
        self._cleaned: set[Path] = set()

    def open(self, path: str | os.PathLike[str], mode: str = "wb", *, overwrite: bool = True,
             named: bool = False) -> AtomicFile:
        directory = Path(path).parent
        af = AtomicFile(path, mode, overwrite=overwrite, named=named, clean=directory not in self._cleaned)
        self._cleaned.add(directory)
        self.files.append(af)
        return af

    def commit(self, into: str | os.PathLike[str] | None = None) -> None:
        """fsync every file first, then name each (in ``into`` when given)."""
        try:
            for af in self.files:
                if af._file is not None:
                    af._finish_tmp()
            _make_dir(into)  # only now: a failure (or a kill) above leaves no empty folder
            for af in self.files:
                if not af.committed:
                    af._publish(into)
        except BaseException:
            self.abort()
            raise
        self.done = True

    def abort(self) -> None:
        """Drop every file not yet named. (If naming itself fails midway -- a full disk cannot
        cause that, since all data is already fsynced -- files named before it stay: they may have
        replaced originals, and deleting them would lose more.)"""
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
