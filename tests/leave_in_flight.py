"""One rank of a two-rank ``vcga`` world that ends without ``destroy_process_group()``.

Run as ``python leave_in_flight.py RANK PORT [MODE]``. See
``tests/test_pg_units.py::test_a_rank_leaving_with_a_collective_in_flight_exits_cleanly`` and
``::test_abort_returns_without_waiting_for_a_collective_in_flight``.

- ``leave`` (the default): rank 0 starts an asynchronous all_reduce, takes its future (which hangs
  vcga's completion callback on gloo's native future, as DDP's reducer does) and returns from the
  script; rank 1 joins the all_reduce as soon as rank 0 is leaving, so the callback runs in gloo's
  worker thread while rank 0 exits, and rank 1 returns right after its own synchronous all_reduce.
- ``abort``: rank 0 starts an asynchronous all_reduce and aborts the group
  (``_abort_process_group``, as torchft and elastic recovery do) before rank 1 joins it. The abort
  must return while the all_reduce is still in flight (it must not wait for the collective, which
  gloo cannot abort), and later calls must raise ``VcgaCollectiveError``; then rank 1 joins.

Either way, each rank checks at its very end -- an atexit hook registered before ``import vcga``
runs after vcga's own -- that no gloo worker thread (``pt_gloo_runloop``) is still alive when the
interpreter starts to finalize: such a thread may release a Python object then, and the process
aborts (SIGABRT) at random. It prints ``gloo workers alive at exit: N`` if any is.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from gloo_threads import gloo_workers


def report_workers() -> None:
    n = gloo_workers()
    if n:
        print(f"gloo workers alive at exit: {n}", flush=True)


atexit.register(report_workers)  # before vcga's hooks are registered, so it runs after them

import vcga  # noqa: E402, F401 - registers backend "vcga"
from vcga.errors import VcgaCollectiveError  # noqa: E402

rank, port = int(sys.argv[1]), int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "leave"
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("vcga", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
t = torch.ones(1 << 16)
if mode == "leave":
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        work.get_future()
        store.set("leaving", "1")
    else:
        store.wait(["leaving"])
        dist.all_reduce(t)
        assert t[0].item() == 2.0
elif mode == "abort":
    if rank == 0:
        group = dist.group.WORLD
        work = dist.all_reduce(t, async_op=True)
        dist.distributed_c10d._abort_process_group()
        # rank 1 joins only after the abort returned: had it waited for the collective, it would
        # have waited out the 60 s timeout, and the work would be complete (with its error) by now
        assert not work.is_completed(), "abort() waited for the collective in flight"
        try:
            group.allreduce([torch.ones(1)])
        except VcgaCollectiveError as e:
            assert "aborted" in str(e), e
        else:
            raise AssertionError("a call on an aborted group did not raise")
        store.set("aborted", "1")
    else:
        store.wait(["aborted"])
        dist.all_reduce(t)  # the aborted group's gloo worker on rank 0 still runs its side
        assert t[0].item() == 2.0
else:
    raise SystemExit(f"unknown mode {mode}")
