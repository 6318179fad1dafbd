"""Count what a world's ranks ask of a TCPStore: a relay between the ranks and the store's server.

Not a benchmark (the leading underscore keeps it out of the list of scripts to run); used by
``startup.py``. :class:`StoreProxy` starts a ``torch.distributed.TCPStore`` server and, per rank,
a listening port that relays every byte to it. Ranks connect to their own port as plain TCPStore
clients (``TCPStore(host, proxy.port(rank), is_master=False)``), so what is counted is what really
crosses the wire -- including what torch and gloo send on their own and the clones a rank makes
(a clone connects to the same port, so it counts for the same rank) -- not what a wrapper
believes it sends.

The client-to-server stream is parsed request by request with the TCPStore wire protocol of
torch 2.x (``torch/csrc/distributed/c10d/TCPStore.cpp``, checked against torch 2.13 by
tests/test_startup.py): a one-byte query type, then its arguments, strings and byte strings as a
``uint64`` length and the bytes. Each request is counted with its bytes in both directions and
the key it names, so a benchmark can split the load by key prefix (which part of group creation
asked). A ``get`` is two requests on the wire (TCPStore waits for the key, then gets it), and so
is a ``multi_get``; both count as they are sent.

A request the parser does not know stops parsing on that connection (bytes are still relayed and
counted) and is reported in :attr:`StoreProxy.errors`, so a protocol change shows up as an error,
not as wrong counts.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = ["StoreProxy", "Counts", "QUERY_TYPES"]

#: TCPStore query types, in the order of the enum of torch's TCPStoreBackend.hpp.
QUERY_TYPES = ("validate", "set", "compare_set", "get", "add", "check", "wait", "num_keys", "delete_key",
               "append", "multi_get", "multi_set", "cancel_wait", "ping", "queue_push", "queue_pop", "queue_len")

_U64 = struct.Struct("<Q")


@dataclass
class Counts:
    """Requests and bytes, by rank and by the category of the request's first key."""

    #: (rank, category) -> [requests, bytes sent by the rank, bytes received by the rank]
    cells: dict[tuple[int, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    #: request type -> number of requests (all ranks)
    types: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def total(self, category: str | None = None, rank: int | None = None) -> tuple[int, int]:
        """(requests, bytes both ways) over the ranks and categories asked for (None: all)."""
        req = nbytes = 0
        for (r, c), (n, up, down) in self.cells.items():
            if (category is None or c == category) and (rank is None or r == rank):
                req += n
                nbytes += up + down
        return req, nbytes


class _Parser:
    """Splits one connection's client-to-server bytes into requests (incrementally)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.broken: str | None = None

    def feed(self, data: bytes) -> list[tuple[str, str, int]]:
        """Append ``data``; return each complete request as (type, first key, size in bytes)."""
        if self.broken:
            return []
        self.buf += data
        out = []
        while self.buf:
            try:
                parsed = self._one()
            except ValueError as e:
                self.broken = str(e)
                return out
            if parsed is None:
                break
            kind, key, size = parsed
            del self.buf[:size]
            out.append((kind, key, size))
        return out

    def _one(self) -> tuple[str, str, int] | None:
        b = self.buf
        q = b[0]
        if q >= len(QUERY_TYPES):
            raise ValueError(f"unknown TCPStore query type {q}")
        kind = QUERY_TYPES[q]
        pos = 1

        def u64() -> int | None:
            nonlocal pos
            if len(b) < pos + 8:
                return None
            v = _U64.unpack_from(b, pos)[0]
            pos += 8
            return v

        def string() -> bytes | None:
            nonlocal pos
            n = u64()
            if n is None or len(b) < pos + n:
                return None
            s = bytes(b[pos:pos + n])
            pos += n
            return s

        key = b""
        if kind in ("validate", "ping"):
            if len(b) < pos + 4:
                return None
            pos += 4
        elif kind in ("num_keys", "cancel_wait"):
            pass
        elif kind in ("get", "delete_key", "queue_len"):
            key = string()
        elif kind in ("set", "append", "queue_push"):
            key = string()
            if key is None or string() is None:
                return None
        elif kind == "compare_set":
            key = string()
            if key is None or string() is None or string() is None:
                return None
        elif kind == "add":
            key = string()
            if key is None or u64() is None:
                return None
        elif kind in ("check", "wait", "multi_get"):
            n = u64()
            if n is None:
                return None
            for i in range(n):
                k = string()
                if k is None:
                    return None
                key = k if i == 0 else key
        elif kind == "multi_set":
            n = u64()
            if n is None:
                return None
            for i in range(n):
                k = string()
                if k is None or string() is None:
                    return None
                key = k if i == 0 else key
        else:  # queue_pop: key, then a one-byte "block" flag
            key = string()
            if key is None or len(b) < pos + 1:
                return None
            pos += 1
        if key is None:
            return None
        return kind, key.decode(errors="replace"), pos


class StoreProxy:
    """A TCPStore server and one counting relay port per rank (see the module docstring).

    :param world: ranks (one listening port each).
    :param classify: the category of a request from its first key (default: "all").
    """

    def __init__(self, world: int, classify: Callable[[str], str] | None = None, host: str = "127.0.0.1") -> None:
        import torch.distributed as dist

        self.host = host
        self.classify = classify or (lambda key: "all")
        self.server = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=600), wait_for_workers=False)
        self.counts = Counts()
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        for rank in range(world):
            s = socket.socket()
            s.bind((host, 0))
            s.listen(64)
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, ("listen", rank))
            self._listeners.append(s)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="store-proxy", daemon=True)
        self._thread.start()

    def port(self, rank: int) -> int:
        return self._listeners[rank].getsockname()[1]

    def reset(self) -> Counts:
        """Hand back the counts so far and start new ones."""
        with self._lock:
            old, self.counts = self.counts, Counts()
            return old

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            try:
                key.fileobj.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self._sel.close()

    def __enter__(self) -> StoreProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the relay -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(timeout=0.2):
                what = key.data[0]
                if what == "listen":
                    self._accept(key.fileobj, key.data[1])  # type: ignore[arg-type]
                else:
                    self._pump(key)

    def _accept(self, lst: socket.socket, rank: int) -> None:
        try:
            client, _ = lst.accept()
        except BlockingIOError:
            return
        upstream = socket.create_connection((self.host, self.server.port))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(True)
        state = {"rank": rank, "parser": _Parser(), "last": "connect", "pair": (client, upstream)}
        self._sel.register(client, selectors.EVENT_READ, ("up", state))
        self._sel.register(upstream, selectors.EVENT_READ, ("down", state))

    def _pump(self, key: selectors.SelectorKey) -> None:
        direction, state = key.data
        src: socket.socket = key.fileobj  # type: ignore[assignment]
        client, upstream = state["pair"]
        try:
            data = src.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            for s in (client, upstream):
                try:
                    self._sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()
            return
        rank = state["rank"]
        with self._lock:
            if direction == "up":
                parser = state["parser"]
                if parser.broken:  # still relayed and counted, no longer split into requests
                    self.counts.cells[(rank, state["last"])][1] += len(data)
                for kind, k, size in parser.feed(data):
                    cat = self.classify(k) if k else state["last"]
                    state["last"] = cat
                    cell = self.counts.cells[(rank, cat)]
                    cell[0] += 1
                    cell[1] += size
                    self.counts.types[kind] += 1
                if parser.broken and parser.broken not in self.errors:
                    self.errors.append(parser.broken)
            else:
                # replies belong to the request before them (TCPStore answers in order)
                self.counts.cells[(rank, state["last"])][2] += len(data)
        (upstream if direction == "up" else client).sendall(data)
