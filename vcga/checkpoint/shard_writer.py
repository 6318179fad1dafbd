"""The process that writes :func:`vcga.checkpoint.async_save`'s shards (``writer="process"``).

Why a process: a background *thread* that hashes and writes a shard shares the training process's
GIL, and every Python line of it -- DCP's planning aside, the vendor-bin loop, the checksums --
makes the training thread wait for the GIL between its operators (docs/benchmarks.md,
"Checkpointing and recovery", measures both writers' stall). Here the training process only
plans (DCP, in its background thread, which then sleeps on a pipe) and the bytes are hashed,
written and fsynced by a child process with an interpreter of its own.

No copy crosses the process boundary. The stager puts the staged tensors in one *arena*: an
anonymous shared-memory file (``memfd_create``) that the training process maps and hands to the
child as a file descriptor (``SCM_RIGHTS`` over a Unix socket), once per layout. A write request
names each tensor's offset and length in the arena; the child maps the same pages and writes
them. The child imports neither torch (a test checks) nor the training script (it is ``python -m`` this module,
not a ``multiprocessing`` spawn that would re-import ``__main__``), is reniced (+10), and exits
when its socket closes -- also when the training process dies.

Protocol (``multiprocessing.connection`` messages over the socket, pickled; only the training
process's own child reads them):

- ``("arena", arena_id, size)`` followed by one byte carrying the descriptor;
- ``("write", path, metadata, entries)`` -> ``("ok", {name: (checksum, nbytes)})`` or
  ``("error", exception)``; an entry is ``(name, dtype, shape, attrs, source)`` with source
  ``("arena", arena_id, offset, nbytes)`` or ``("bytes", data)``.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from vcga.errors import VcgaCheckpointError, VcgaError, VcgaFormatError

__all__ = ["ShardWriterProcess", "write_shard"]

log = logging.getLogger("vcga.checkpoint")

_NICE = 10
#: How often a wait for the child checks that it is still alive (a wait on a dead child ends at once:
#: its socket closes; this covers a child that stopped answering without dying).
_POLL_S = 1.0


def write_shard(path: Path, metadata: dict[str, str], entries: list[Any]) -> dict[str, tuple[str, int]]:
    """Write ``entries`` (TensorEntry) as one vendor-bin file at ``path`` (fsynced, renamed into
    place by the format's writer); return each tensor's stored checksum and length, read back from
    the file's index."""
    from vcga.convert import format_by_name  # not .storage's helper: that module imports torch

    spec = format_by_name("vendor-bin")
    with spec.open_writer(path, metadata=metadata) as writer:
        for entry in entries:
            writer.write(entry)
    out: dict[str, tuple[str, int]] = {}
    with spec.open_reader(path, verify=False) as reader:
        for e in reader.index():
            if e.checksum is None:  # vendor-bin stores one per tensor: the file just written is damaged
                raise VcgaFormatError(path, f"the index holds no checksum for {e.name!r}")
            out[e.name] = (e.checksum, e.nbytes)
    return out


class ShardWriterProcess:
    """The training process's handle on its writer child (one per process, started on first use)."""

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The child must find the same vcga (a source checkout on sys.path included).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vcga.checkpoint.shard_writer", str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        child.close()
        self.sock = parent
        self.conn = Connection(os.dup(parent.fileno()))
        self.lock = threading.Lock()
        self.arenas: set[int] = set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _recv(self) -> Any:
        while not self.conn.poll(_POLL_S):
            if not self.alive():
                break
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise VcgaCheckpointError(f"the checkpoint writer process (pid {self.proc.pid}) died "
                                      f"(exit status {self.proc.poll()}); the next async_save starts "
                                      "a new one") from None

    def send_arena(self, arena_id: int, fd: int, size: int) -> None:
        with self.lock:
            self.conn.send(("arena", arena_id, size))
            socket.send_fds(self.sock, [b"A"], [fd])
            self.arenas.add(arena_id)

    def drop_arena(self, arena_id: int) -> None:
        with self.lock:
            if arena_id in self.arenas and self.alive():
                self.conn.send(("drop", arena_id))
            self.arenas.discard(arena_id)

    def write(self, path: Path, metadata: dict[str, str], entries: list[Any]) -> dict[str, tuple[str, int]]:
        with self.lock:
            try:
                self.conn.send(("write", str(path), metadata, entries))
            except OSError:
                pass  # a dead child: _recv says so
            kind, payload = self._recv()
        if kind == "ok":
            return payload
        raise payload

    def close(self, timeout: float = 10.0) -> None:
        for c in (self.conn, self.sock):
            try:
                c.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)


# --------------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------------


def _portable(e: BaseException) -> BaseException:
    """The exception itself when it survives pickling (VCGA's typed errors do), else a
    VcgaCheckpointError saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a description
        return VcgaCheckpointError(f"writing the shard failed: {type(e).__name__}: {e}")


def _serve(fd: int) -> None:
    from vcga.contract import TensorEntry

    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    arenas: dict[int, mmap.mmap] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the training process closed the socket (or died): nothing more to write
        if msg[0] == "arena":
            _, arena_id, size = msg
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            try:
                arenas[arena_id] = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
            finally:
                os.close(fds[0])
        elif msg[0] == "drop":
            old = arenas.pop(msg[1], None)
            if old is not None:
                old.close()
        elif msg[0] == "write":
            _, path, metadata, items = msg
            try:
                entries: list[TensorEntry] = []
                data = None
                for name, dtype, shape, attrs, source in items:
                    if source[0] == "arena":
                        _, arena_id, offset, nbytes = source
                        data = memoryview(arenas[arena_id])[offset:offset + nbytes]
                    else:
                        data = source[1]
                    entries.append(TensorEntry(name, dtype, tuple(shape), data, attrs))
                stored = write_shard(Path(path), metadata, entries)
                del entries, data  # release the views into the arena (a later "drop" closes it)
                reply: tuple[str, Any] = ("ok", stored)
            except BaseException as e:  # noqa: BLE001 - it belongs to the training process
                reply = ("error", _portable(e if isinstance(e, Exception) else VcgaError(repr(e))))
            conn.send(reply)


def main() -> None:
    try:
        os.nice(_NICE)  # below the training process: where cores are short, training keeps them
    except OSError:
        pass
    _serve(int(sys.argv[1]))


if __name__ == "__main__":
    main()
