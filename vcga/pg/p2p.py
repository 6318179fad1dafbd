"""Point to point for the ``vcga`` process group: ``send``, ``recv`` and ``recv_anysource``, and in
debug mode (``VCGA_DEBUG``) the check that a message's sender and receiver agree on its dtype and
shape. Loaded at a group's first point-to-point call: a job's start, and a data-parallel job, never
make one.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import torch

from vcga.contract import Collective
from vcga.pg.allreduce import one_tensor
from vcga.pg.calls import CallPath

__all__ = ["PointToPoint"]


class _CheckWork:
    """A step that runs a check when waited on, in a work's native-work list."""

    def __init__(self, check: Any) -> None:
        self._check = check
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._done = True
            self._check()
        return True

    def is_completed(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
            fut.set_result([])
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut

    def synchronize(self) -> None:
        pass


def _next(counter: dict[int, int], peer: int) -> int:
    counter[peer] = counter.get(peer, 0) + 1
    return counter[peer]


class PointToPoint:
    """One group's point-to-point calls (torch's c10d signatures), with the message counters
    debug mode numbers each pair's messages by.

    :param calls: the group's call path.
    :param rank: this process's rank in the group.
    :param timeout: how long a debug-mode receiver waits for its sender's fingerprint.
    """

    def __init__(self, calls: CallPath, rank: int, timeout: Any) -> None:
        self.calls, self.rank, self.timeout = calls, rank, timeout
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Any:  # noqa: N803 - torch's names
        t = one_tensor(tensors, "send")
        # an empty message travels as one element (vcga.pg.recipes.empty_p2p): never the fast path
        if t.numel() and self.calls.fast_native(Collective.SEND_RECV, t):
            if self.calls.debug is not None:
                self._fingerprint_send(t, dstRank, tag)
            return self.calls.native_call("send", None, self.calls.native.send, tensors, dstRank, tag, async_op=True,
                                           result=tensors)
        # A refused dtype raises here, before anything is posted or counted; the receiver's recv
        # refuses the same dtype from the same table, so neither end waits for the other.
        steps = self.calls.translated("send", None, lambda s: self.calls.d.send(t, dstRank, tag, s))
        if self.calls.debug is not None:
            self._fingerprint_send(t, dstRank, tag)
        return self.calls.wrap("send", None, steps, tensors, True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Any:  # noqa: N803
        t = one_tensor(tensors, "recv")
        steps = self.calls.translated("recv", None, lambda s: self.calls.d.recv(t, srcRank, tag, s))
        if self.calls.debug is not None:
            # Checked when the receiver waits, before the data is awaited: a sender never blocks on
            # it (isend/irecv pairs in any order still work), and a mismatched send is named
            # instead of delivering reinterpreted bytes or a library error.
            n = _next(self.received, srcRank)
            steps.works.insert(0, _CheckWork(partial(self._fingerprint_recv, t, srcRank, tag, n)))
        return self.calls.wrap("recv", None, steps, tensors, True)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        t = one_tensor(tensors, "recv")
        return self.calls.issue("recv", None, lambda s: self.calls.d.recv(t, None, tag, s), tensors, True)

    def _fingerprint_send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        from vcga.pg.debug import fingerprint

        n = _next(self.sent, dst)
        fp = fingerprint("send", t)
        fp["tag"] = tag
        self.calls.debug.store.set(f"p2p/{self.rank}->{dst}/{n}", json.dumps(fp))  # type: ignore[union-attr]

    def _fingerprint_recv(self, t: torch.Tensor, src: int, tag: int, n: int) -> None:
        """Debug mode, receiver side: the matching send must carry the same dtype and shape."""
        from vcga.errors import VcgaMismatchError
        from vcga.pg.debug import fingerprint

        store = self.calls.debug.store  # type: ignore[union-attr]
        key = f"p2p/{src}->{self.rank}/{n}"
        store.wait([key], self.timeout)
        sent = json.loads(store.get(key))
        store.delete_key(key)
        mine = fingerprint("recv", t)
        diffs = {f: {src: sent.get(f), self.rank: mine.get(f)} for f in ("dtype", "shape")
                 if str(sent.get(f)) != str(mine.get(f))}
        if diffs:
            raise VcgaMismatchError(n, diffs, rank=self.rank)
