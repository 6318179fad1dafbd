"""Counting the bytes a rank puts on the wire, at the transport.

:class:`WireMeter` wraps the transport of a ``vcga`` process group (the object the dispatcher hands
native cells to: a vendor's process group, or the bridge) and counts, for every collective that
reaches it, the bytes this rank hands over -- after VCGA's emulations, so an fp16 sum the bridge
carries as float32 counts 4 bytes per element. A group that is not a ``vcga`` group (plain gloo)
is counted where the compression engine calls it instead.

Bytes *sent* per rank follow the bandwidth-optimal algorithms (the factors nccl-tests uses for bus
bandwidth), with P ranks in the group and b the bytes this rank hands over:

=================================  ===============
all_reduce (b in, b out)           2(P−1)/P · b
reduce_scatter (b in)              (P−1)/P · b
all_gather (b in)                  (P−1) · b
all_to_all (b in)                  (P−1)/P · b
broadcast, send                    b
=================================  ===============
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["WireMeter", "sent_bytes"]

_KIND = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_coalesced": "all_gather",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "broadcast": "broadcast", "send": "send", "gather": "all_gather", "scatter": "all_to_all",
}


def sent_bytes(kind: str, nbytes: int, size: int) -> float:
    """Bytes one rank sends for a collective ``kind`` handing over ``nbytes`` in a group of ``size``."""
    if size <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (size - 1) / size * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (size - 1) / size * nbytes
    if kind == "all_gather":
        return (size - 1) * nbytes
    return float(nbytes)


def _nbytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _input_bytes(method: str, args: tuple[Any, ...]) -> int:
    """The bytes this rank hands over for a c10d method call (its input side)."""
    if method in ("allreduce", "allreduce_coalesced", "broadcast", "send", "reduce"):
        return _nbytes(args[0])
    if method in ("allgather", "allgather_coalesced", "gather"):
        return _nbytes(args[1])
    if method in ("_allgather_base", "_reduce_scatter_base", "alltoall_base"):
        return _nbytes(args[1])
    if method in ("reduce_scatter", "alltoall", "scatter"):
        return _nbytes(args[1])
    return 0


class _Metered:
    """A transport group whose c10d methods count their bytes, then forward."""

    def __init__(self, inner: Any, meter: WireMeter, label: str, size: int) -> None:
        self._inner, self._meter, self._label, self._size = inner, meter, label, size

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        kind = _KIND.get(name)
        if kind is None or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._meter.count(self._label, kind, _input_bytes(name, args), self._size)
            return attr(*args, **kwargs)

        return call


class WireMeter:
    """Bytes per label (e.g. "cross", "island") and collective kind, counted at the transport."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def count(self, label: str, kind: str, nbytes: int, size: int) -> None:
        with self._lock:
            self.handed[label][kind] += nbytes
            self.sent[label] += sent_bytes(kind, nbytes, size)
            self.calls[label] += 1

    def reset(self) -> None:
        with self._lock:
            self.handed.clear()
            self.sent.clear()
            self.calls.clear()

    def total_sent(self, label: str | None = None) -> float:
        with self._lock:
            return self.sent.get(label, 0.0) if label is not None else sum(self.sent.values())

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"sent": dict(self.sent), "handed": {k: dict(v) for k, v in self.handed.items()},
                    "calls": dict(self.calls)}

    @staticmethod
    def transport_of(group: Any) -> Any:
        """The ``vcga`` process group behind ``group`` (it is the group itself for a Python
        backend), or None for any other group."""
        return group if hasattr(group, "transport") and hasattr(group, "native_replaced") else None

    @contextmanager
    def attached(self, group: Any, label: str) -> Iterator[bool]:
        """Count every collective that reaches ``group``'s transport under ``label`` while inside.
        Yields False (counting nothing) for a group that is not a ``vcga`` group."""
        pg = self.transport_of(group)
        if pg is None:
            yield False
            return
        proxy = _Metered(pg.transport.group, self, label, pg.size())
        with pg.native_replaced(proxy):
            yield True
