"""``monitored_barrier`` for the ``vcga`` process group: a barrier through the store that names the
ranks that did not arrive. Loaded at a group's first monitored barrier (a debugging aid; a job's
start never calls one).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from vcga.errors import VcgaTimeoutError
from vcga.pg.calls import CallPath
from vcga.pypg import timeout_given

__all__ = ["MonitoredBarrier"]


class MonitoredBarrier:
    """One group's monitored barriers, numbered in rounds over the group's store.

    :param store: the group's store (prefixed here).
    :param calls: the group's call path (sequence numbers, the flight recorder).
    """

    def __init__(self, store: Any, rank: int, size: int, global_ranks: list[int], timeout: timedelta,
                 calls: CallPath) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore("vcga/monitored_barrier", store)
        self.rank, self.size, self.global_ranks, self.timeout, self.calls = rank, size, global_ranks, timeout, calls
        self.round = 0

    def run(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier through the store that names the ranks that did not arrive.

        Rank 0 waits for each other rank's arrival (within ``timeout``, default the collective
        timeout), then releases everyone with a verdict; a missing rank makes rank 0 raise
        :class:`~vcga.errors.VcgaTimeoutError` naming it (all missing ones with ``wait_all_ranks``),
        and the other ranks raise the same verdict.
        """
        limit = timeout_given(timeout) or self.timeout
        seq = self.calls.next("monitored_barrier")
        call = self.calls.record(seq, "barrier", ())
        try:
            self._wait(limit, wait_all_ranks)
        except BaseException as e:
            if call is not None:
                call.end(e)
            raise
        if call is not None:
            call.end()

    def _wait(self, limit: timedelta, wait_all_ranks: bool) -> None:
        self.round += 1
        n, store = self.round, self.store
        store.set(f"{n}/arrive/{self.rank}", "1")
        ms = int(limit.total_seconds() * 1000)
        if self.rank == 0:
            deadline = time.monotonic() + limit.total_seconds()
            missing: list[int] = []
            for r in range(1, self.size):
                key = f"{n}/arrive/{r}"
                if missing and not wait_all_ranks:
                    break
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError
                    store.wait([key], timedelta(seconds=left))
                except Exception:  # noqa: BLE001 - DistStoreError on timeout
                    if not store.check([key]):
                        missing.append(r)
            for r in range(self.size):
                store.delete_key(f"{n}/arrive/{r}")
            if n > 1:
                store.delete_key(f"{n - 1}/verdict")
            if missing:
                who = (f"Rank {missing[0]}" if len(missing) == 1 else
                       "Ranks " + ", ".join(map(str, missing)))
                verdict = f"{who} failed to pass monitoredBarrier in {ms} ms"
            else:
                verdict = "ok"
            store.set(f"{n}/verdict", verdict)
            if missing:
                raise VcgaTimeoutError("monitored_barrier", limit.total_seconds(), rank=self.rank,
                                       missing_ranks=[self.global_ranks[r] for r in missing], detail=verdict)
            return None
        try:
            # rank 0 may spend the whole timeout waiting for a late rank before it answers
            store.wait([f"{n}/verdict"], limit + timedelta(seconds=max(5.0, limit.total_seconds())))
        except Exception as e:
            raise VcgaTimeoutError("monitored_barrier", limit.total_seconds(), rank=self.rank, missing_ranks=[0],
                                   detail="rank 0 never released the barrier") from e
        verdict = store.get(f"{n}/verdict").decode()
        if verdict != "ok":
            raise VcgaTimeoutError("monitored_barrier", limit.total_seconds(), rank=self.rank, detail=verdict)
        return None
