"""The communicators a bridge group runs on, per lane (pipeline stage).

A :class:`~vcga.bridge.group.BridgeGroup` and its :class:`~vcga.bridge.allreduce.AllReducer` share
one :class:`Communicators`: the gloo group over the whole ``vcga`` group, and per lane the vendor
group's dispatcher, the shard peers' gloo group and their shared segment. Lane 0 runs everything,
except the second stage of pipelined all_reduces, which runs on lane 1 (a second native group and
a second gloo group, so the two stages never share a communicator; docs/bridge.md, 'Pipelining
across collectives'). Which lane a thread uses is thread-local: the queue's second thread enters
lane 1 when it starts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vcga.bridge.host import SharedMemoryBridge
    from vcga.pg.dispatch import Dispatcher

__all__ = ["Communicators"]

#: A lane's vendor-group dispatcher, shard peers' gloo group and shared segment.
_Lane = tuple["Dispatcher | None", Any, "SharedMemoryBridge | None"]


class Communicators:
    """The whole-group gloo group (:attr:`world`) and, per lane, ``(inner, shard, shm)``.

    :param inner: this rank's vendor-group dispatcher (None when the vendor group has one rank).
    :param shard: gloo group of this rank's shard peers (leaders for local rank 0), or None.
    :param world: gloo group over the whole ``vcga`` group.
    :param shm: the shard peers' shared segment (all peers on this node), or None.
    """

    def __init__(self, inner: Dispatcher | None, shard: Any, world: Any, shm: SharedMemoryBridge | None) -> None:
        self.world = world
        self._lanes: list[_Lane | None] = [(inner, shard, shm), None]
        self._tl = threading.local()  # .lane: the lane this thread uses now (0 when unset)

    def _lane(self) -> _Lane:
        lane = self._lanes[getattr(self._tl, "lane", 0)]
        if lane is None:
            raise RuntimeError("this bridge group has no second lane")  # a thread entered lane 1 without one
        return lane

    @property
    def inner(self) -> Dispatcher | None:
        """The vendor group's dispatcher of the lane this thread uses."""
        return self._lane()[0]

    @property
    def shard(self) -> Any:
        """The shard peers' gloo group of the lane this thread uses."""
        return self._lane()[1]

    @property
    def shm(self) -> SharedMemoryBridge | None:
        """The shard peers' shared segment of the lane this thread uses (lane 1 has none)."""
        return self._lane()[2]

    @property
    def two_lanes(self) -> bool:
        """Whether lane 1 is set (:meth:`set_lane_b`)."""
        return self._lanes[1] is not None

    def set_lane_b(self, inner: Dispatcher | None, shard: Any) -> None:
        """Lane 1: a second native group of this rank's vendor group and a second gloo group of its
        shard peers (None drops it). It has no shared segment: only where shard peers use gloo."""
        self._lanes[1] = (inner, shard, None) if inner is not None else None

    def enter_lane_b(self) -> None:
        """Make this thread use lane 1 (the queue's second thread calls it when it starts)."""
        self._tl.lane = 1

    @contextlib.contextmanager
    def on_lane_b(self) -> Iterator[None]:
        was = getattr(self._tl, "lane", 0)
        self._tl.lane = 1
        try:
            yield
        finally:
            self._tl.lane = was

    def drop(self) -> None:
        """Forget every communicator (a closed bridge: the native groups' destructors join their threads)."""
        self.world = None
        self._lanes = [(None, None, None), None]
