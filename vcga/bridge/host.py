"""The host side of the mixed-vendor bridge: combining the shard peers' values, and exchanging
them through shared memory when the peers share a node.

A bridge reduction (docs/bridge.md) combines one value per vendor group -- the *shard peers*,
one rank of each vendor group -- on the host. Across nodes that goes through gloo over TCP. When
every shard peer runs on the same node (one machine with cards of two vendors, or the simulated
vendors of ``VCGA_SIM_VENDORS``) the network is not needed: :class:`SharedMemoryBridge` gives the
peers one shared segment, each copies its value into its own slot, the peers meet at a barrier,
and each combines all slots in peer order into its own tensor (:func:`combine_rows`). Per rank
and byte that is one copy in and one combining pass, where gloo's two-peer ring sends, receives
(each a copy through the kernel's socket buffers, plus the syscalls) and combines; measured in
docs/benchmarks.md ("Shared memory between same-node shard peers"). NCCL takes the same route
between ranks of one node without a direct link (its SHM transport).

Why the segment is made by hand (``os.open`` in ``/dev/shm``, ``posix_fallocate``, ``mmap``)
rather than with :mod:`multiprocessing.shared_memory`: on Python 3.11 every process that attaches
a ``SharedMemory`` registers it with its resource tracker, which unlinks the segment when that
process exits and warns about a "leak" (fixed only by ``track=False`` in 3.13); and
``SharedMemory`` does not reserve the pages, so a full ``/dev/shm`` (64 MiB in a default Docker
container) would kill the process with SIGBUS on first write. Here the pages are reserved when
the segment is made (a full ``/dev/shm`` makes creation fail, and the peers fall back to gloo),
and the file is unlinked as soon as every peer has mapped it: nothing is left behind when a
process dies later.

Switch it off with config ``bridge_shm: false`` (env ``VCGA_BRIDGE_SHM=0``), as NCCL has
``NCCL_SHM_DISABLE``.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import select
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vcga.contract import ReduceOp
from vcga.errors import VcgaCollectiveError, VcgaPeerLostError

__all__ = ["as_bytes", "on_host", "put_back", "combine_rows", "combiner", "every_rank", "SharedMemoryBridge",
           "SHM_DIR", "SLOT_BYTES"]

log = logging.getLogger("vcga.bridge")

_COMBINE: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor,
}
_COMBINE_BOOL: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: torch.logical_or, ReduceOp.MAX: torch.logical_or, ReduceOp.BOR: torch.logical_or,
    ReduceOp.PRODUCT: torch.logical_and, ReduceOp.MIN: torch.logical_and, ReduceOp.BAND: torch.logical_and,
    ReduceOp.BXOR: torch.logical_xor,
}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous host tensor ``t`` as a 1-D uint8 tensor (no copy)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, contiguous (itself when it already is)."""
    if t.device.type != "cpu":
        return t.detach().to("cpu", memory_format=torch.contiguous_format)
    return t if t.is_contiguous() else t.contiguous()


def put_back(t: torch.Tensor, h: torch.Tensor) -> None:
    """Copy host copy ``h`` back into ``t`` (nothing when ``h`` is ``t`` itself)."""
    if h is not t:
        t.copy_(h.view(t.shape) if h.shape != t.shape else h)


def combiner(dtype: torch.dtype, op: ReduceOp) -> Callable[..., Any]:
    """The elementwise ``fn(a, b, out=...)`` that applies ``op`` in ``dtype`` (bool: logical ops)."""
    return (_COMBINE_BOOL if dtype == torch.bool else _COMBINE)[op]


def combine_rows(rows: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> None:
    """``out = rows[0] op rows[1] op ...`` left to right, in ``rows``' dtype.

    Every peer runs these same correctly rounded elementwise operations on the same bytes in the
    same order, so every peer gets the same bits (the "computed once" of docs/bridge.md).
    """
    fn = combiner(rows.dtype, op)
    if rows.shape[0] == 1:
        out.copy_(rows[0])
        return
    fn(rows[0], rows[1], out=out)
    for r in rows[2:]:
        fn(out, r, out=out)


def every_rank(pg: Any, mine: bool) -> bool:
    """True on every rank when ``mine`` is true on every rank of the gloo group ``pg`` (collective)."""
    flag = torch.tensor([1 if mine else 0], dtype=torch.int64)
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    pg.allreduce([flag], o).wait()
    return bool(flag.item())


#: Where segments are made (a tmpfs on Linux). Module-level so a test can point one rank elsewhere.
SHM_DIR = "/dev/shm"
#: Bytes per peer slot. A reduction larger than this goes in slot-sized pieces, one barrier each.
#: A segment holds two sets of slots (see :meth:`SharedMemoryBridge.all_reduce`): 16 MiB for two
#: peers, 24 MiB for three, per shard group -- small beside the 64 MiB of a default container's
#: ``/dev/shm``. Measured against 1 MiB slots (a quarter of the memory): the same at 4 MiB, better
#: at 16 MiB (docs/benchmarks.md, "Shared memory between same-node shard peers").
SLOT_BYTES = 4 << 20
_HEADER_BYTES = 4096  # the token, then (sequence number, bytes) per slot; the slots start page-aligned
_TOKEN_BYTES = 16
_NAME_BYTES = 128


class SharedMemoryBridge:
    """The shard peers' reduction through one shared segment (all peers on one node).

    Make it with :meth:`open` (collective over the peers' gloo group), use :meth:`all_reduce`
    (collective: every peer calls it in the same order with the same element count and dtype),
    and :meth:`close` it with the group.

    The peers meet at a barrier made of named pipes (FIFOs), one per ordered pair of peers:
    arriving, a peer writes one byte into its pipe to every other peer, then reads one byte from
    each other peer's pipe to it (``poll`` with the collective timeout), far cheaper than a gloo
    barrier (docs/benchmarks.md, "Shared memory between same-node shard peers"). One byte per pair
    and barrier keeps it exact when a fast peer's byte for the next barrier arrives early (it waits
    in the pipe for the next read). A pipe per pair also tells which peer is gone: when a peer's process dies,
    its write ends close (the reader sees end-of-file) and its read ends close (a writer gets
    EPIPE), so the others fail at once naming it -- as gloo does on a closed connection -- instead
    of waiting for the timeout.
    """

    def __init__(self, mm: mmap.mmap, peers: int, me: int, pipes_in: dict[int, int], pipes_out: list[int],
                 timeout_s: float, path: str = "", names: Sequence[str] = ()) -> None:
        self.peers, self.me, self.timeout_s = peers, me, timeout_s
        #: the segment's name when it was made (unlinked since: for messages and tests); the
        #: pipes were ``<path>.<from>-<to>``
        self.path = path
        #: how messages name each peer (e.g. "rank 2")
        self.names = list(names) or [f"shard peer {q}" for q in range(peers)]
        self._mm, self._in, self._out = mm, pipes_in, pipes_out
        self._from = {fd: q for q, fd in pipes_in.items()}
        self._to = list(zip([q for q in range(peers) if q != me], pipes_out, strict=True))  # (peer, write end)
        self._one = b"\1"
        #: (set, peer) -> [sequence number, bytes] of the piece in that slot: checked after each
        #: barrier, so peers that disagree on what they reduce fail loudly instead of mixing data
        self._heads = np.frombuffer(mm, dtype=np.int64, count=2 * peers * 2, offset=_TOKEN_BYTES).reshape(2, peers, 2)
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=_HEADER_BYTES, count=2 * peers * SLOT_BYTES)
        self._slots = data.view(2, peers, SLOT_BYTES)
        self._seq = 0
        #: set in a forked child (see :func:`_forget_in_child`): the pipes are closed there
        self._forked = False
        _track(self)

    @staticmethod
    def segment_bytes(peers: int) -> int:
        return _HEADER_BYTES + 2 * peers * SLOT_BYTES

    @classmethod
    def open(cls, pg: Any, wanted: bool, timeout_s: float, names: Sequence[str] = ()) -> SharedMemoryBridge | None:
        """Make the segment on peer 0 and the pipes, map and open them on every peer, unlink them;
        collective over the peers' gloo group ``pg``. ``names``: how messages name each peer.

        ``wanted``: this rank may use shared memory (enabled in its config, and every peer on its
        node). Returns None on every peer -- which then reduce through gloo -- unless every peer
        wanted it and could map the same segment and open every pipe (a different ``/dev/shm``, as
        in separate containers, or one too small, is found here, not later).
        """
        if not every_rank(pg, wanted):
            return None
        me, peers = pg.rank(), pg.size()
        size = cls.segment_bytes(peers)
        msg = torch.zeros(_NAME_BYTES + _TOKEN_BYTES, dtype=torch.uint8)
        path, mm = "", None
        if me == 0:
            path, mm = _create(size)
            if mm is not None:
                msg[:len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
                msg[_NAME_BYTES:] = torch.frombuffer(bytearray(mm[:_TOKEN_BYTES]), dtype=torch.uint8)
        o = dist.BroadcastOptions()
        o.rootRank = 0
        pg.broadcast([msg], o).wait()
        raw = bytes(msg.tolist())
        path = raw[:_NAME_BYTES].rstrip(b"\0").decode()
        if not path:
            return None  # peer 0 could not make it (logged there); every peer got the empty name
        if me != 0:
            mm = _attach(path, size, raw[_NAME_BYTES:])
        others = [q for q in range(peers) if q != me]
        pipes_in: dict[int, int] = {}
        pipes_out: list[int] = []
        try:
            if mm is not None:
                pipes_in = _own_pipes(path, me, others)
            # every peer has mapped the segment (or failed to) and made its pipes: open the others'
            ok = every_rank(pg, len(pipes_in) == len(others))
            if ok:
                try:
                    pipes_out = [os.open(f"{path}.{me}-{q}", os.O_WRONLY | os.O_NONBLOCK) for q in others]
                except OSError as e:
                    log.info("vcga bridge: cannot open a shard peer's pipe (%s); using gloo", e)
                ok = every_rank(pg, len(pipes_out) == len(others))
        finally:
            # every peer is past its opens (or failed): nothing needs the names any more
            for name in [f"{path}.{q}-{me}" for q in pipes_in] + ([path] if me == 0 else []):
                try:
                    os.unlink(name)
                except OSError:
                    pass
        if not ok:
            for fd in [*pipes_out, *pipes_in.values()]:
                os.close(fd)
            if mm is not None:
                mm.close()
            return None
        return cls(mm, peers, me, pipes_in, pipes_out, timeout_s, path, names)  # type: ignore[arg-type]

    def _gone(self, q: int) -> VcgaPeerLostError:
        return VcgaPeerLostError("bridge shared-memory barrier", self.timeout_s,
                                 detail=f"the process of {self.names[q]} is gone, its pipe closed")

    def _barrier(self) -> None:
        for q, fd in self._to:
            try:
                os.write(fd, self._one)
            except BrokenPipeError:
                raise self._gone(q) from None
        pending = dict(self._from)  # read end -> the peer it comes from
        waiting = select.poll()
        for fd in pending:
            waiting.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            events = waiting.poll(left * 1000) if left > 0 else []
            if not events:
                who = ", ".join(self.names[q] for q in sorted(pending.values()))
                raise TimeoutError(f"bridge shared-memory barrier: {who} did not arrive within {self.timeout_s:g} s")
            for fd, _ in events:
                try:
                    got = os.read(fd, 1)  # one byte per pair and barrier; a next one stays queued
                except BlockingIOError:
                    continue
                if not got:  # end of file: every write end closed, the peer's process is gone
                    raise self._gone(pending[fd])
                waiting.unregister(fd)
                del pending[fd]

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        """Reduce host tensor ``t`` (contiguous) across the peers, in place, in slot-sized pieces.

        Per piece: copy it into this peer's slot, barrier, combine every slot in peer order into
        ``t``. The slots alternate between two sets, so a piece needs one barrier, not two: a
        peer writes set s for piece k only after passing the barrier of piece k-1, which no peer
        enters before it has finished reading piece k-2, the last one in set s.
        """
        flat = t.view(-1)
        per = SLOT_BYTES // flat.element_size()
        for lo in range(0, flat.numel(), per):
            piece = flat[lo:lo + per]
            combine_rows(self._exchange(piece).view(t.dtype), op, piece)

    def reduce_scatter(self, rows: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> None:
        """``out`` = row ``me`` of every peer's ``rows`` combined in peer order (host tensors,
        contiguous; ``rows`` has one row per peer, ``out`` one row's length).

        Per piece of columns: each peer copies its rows' columns into its slot, barrier, and each
        combines, from every slot, its own row. Same slots, headers and barrier as
        :meth:`all_reduce` (the sequence numbers run on across both).
        """
        p, c = rows.shape
        width = max(1, SLOT_BYTES // (p * rows.element_size()))
        for lo in range(0, c, width):
            w = min(width, c - lo)
            every = self._exchange(rows[:, lo:lo + w]).view(rows.dtype).view(p, p, w)
            combine_rows(every[:, self.me], op, out[lo:lo + w])

    def _exchange(self, piece: torch.Tensor) -> torch.Tensor:
        """Copy ``piece`` into this peer's slot of the current set, meet the others, check that
        every peer put the same piece; return every peer's slot as (peers, bytes) uint8 (readable
        until the piece after next, which reuses the set)."""
        if self._forked:
            raise VcgaCollectiveError("bridge shared-memory reduction called in a forked child process: the "
                                      "bridge belongs to the rank that made it; reduce in that process")
        nbytes = piece.numel() * piece.element_size()
        s = self._seq & 1
        slots = self._slots[s]
        slots[self.me, :nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
        heads = self._heads[s]
        heads[self.me] = (self._seq, nbytes)
        self._barrier()
        self._check(heads, nbytes)
        self._seq += 1
        return slots[:, :nbytes]

    def _check(self, heads: np.ndarray, nbytes: int) -> None:
        if not ((heads[:, 0] == self._seq).all() and (heads[:, 1] == nbytes).all()):
            raise VcgaCollectiveError(
                f"bridge shared-memory reduction: the shard peers disagree on piece {self._seq} "
                f"(sequence numbers {heads[:, 0].tolist()}, bytes {heads[:, 1].tolist()}); every peer must "
                "reduce the same element count and dtype in the same order")

    def close(self) -> None:
        """Close the pipes and unmap the segment (no tensor of ours views it any more)."""
        if self._mm is None:
            return
        self._slots = self._heads = None  # type: ignore[assignment]
        _OPEN.discard(self)
        self._close_pipes()
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        self._mm = None  # type: ignore[assignment]

    def _close_pipes(self) -> None:
        for fd in [*self._in.values(), *self._out]:
            try:
                os.close(fd)
            except OSError:
                pass
        # forget the numbers: the system reuses them for the next file this process opens
        self._in, self._out, self._from, self._to = {}, [], {}, []


_OPEN: weakref.WeakSet[SharedMemoryBridge] = weakref.WeakSet()
_AT_FORK = [False]


def _track(bridge: SharedMemoryBridge) -> None:
    """Remember an open bridge, so that a forked child can let go of its pipes."""
    if not _AT_FORK[0] and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)
        _AT_FORK[0] = True
    _OPEN.add(bridge)


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker, a subprocess before exec): close the inherited
    pipe ends. Why: a peer learns that a rank died from its pipes closing -- end-of-file, EPIPE --
    and a child still holding them would hide the death until the collective timeout. The child
    never reduces through the bridge (it is not a rank); the mapping stays, harmlessly."""
    for b in list(_OPEN):
        b._close_pipes()
        b._forked = True


def _own_pipes(path: str, me: int, others: Sequence[int]) -> dict[int, int]:
    """Make the pipes from every other peer to this one and open their read ends; {} on failure.

    O_RDONLY | O_NONBLOCK: the open does not wait for a writer, and once the writer has come and
    gone, a read returns end-of-file -- how a dead peer shows."""
    made: dict[int, int] = {}
    try:
        for q in others:
            name = f"{path}.{q}-{me}"
            os.mkfifo(name, 0o600)
            try:
                made[q] = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                os.unlink(name)
                raise
        return made
    except OSError as e:
        log.info("vcga bridge: cannot make a pipe in %s (%s); the shard peers reduce through gloo", SHM_DIR, e)
        for q, fd in made.items():
            os.close(fd)
            try:
                os.unlink(f"{path}.{q}-{me}")
            except OSError:
                pass
        return {}


def _create(size: int) -> tuple[str, mmap.mmap | None]:
    """A new segment of ``size`` bytes with its pages reserved and a random token in front."""
    path = os.path.join(SHM_DIR, f"vcga-bridge-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        log.info("vcga bridge: no shared memory in %s (%s); the shard peers reduce through gloo", SHM_DIR, e)
        return "", None
    try:
        os.posix_fallocate(fd, 0, size)  # reserve now: a full tmpfs fails here, not with SIGBUS later
        mm = mmap.mmap(fd, size)
        mm[:_TOKEN_BYTES] = secrets.token_bytes(_TOKEN_BYTES)
        return path, mm
    except OSError as e:
        # A warning, as NCCL gives one: a too-small /dev/shm (64 MiB in a default container) is a
        # setting to fix (docker run --shm-size), and the fallback is slower.
        log.warning("vcga bridge: cannot reserve %d MiB in %s (%s); these shard peers reduce through gloo "
                    "instead (slower). Give %s more space, e.g. docker run --shm-size=1g",
                    size >> 20, SHM_DIR, e, SHM_DIR)
        try:
            os.unlink(path)
        except OSError:
            pass
        return "", None
    finally:
        os.close(fd)


def _attach(path: str, size: int, token: bytes) -> mmap.mmap | None:
    """Map the segment peer 0 made, if this process sees the same one (same token)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        log.info("vcga bridge: cannot open the shard peers' segment %s (%s: another /dev/shm?); using gloo", path, e)
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mm = mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if mm[:_TOKEN_BYTES] != token:
        mm.close()
        return None
    return mm
