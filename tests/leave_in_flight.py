"""One rank of a two-rank ``vcga`` world in which rank 0 leaves with an all_reduce in flight.

Run as ``python leave_in_flight.py RANK PORT``. Rank 0 starts an asynchronous all_reduce, takes
its future (which hangs vcga's completion callback on gloo's native future, as DDP's reducer
does) and returns from the script; rank 1 joins the all_reduce as soon as rank 0 is leaving, so
the callback runs in gloo's worker thread while rank 0 exits. See
``tests/test_pg_units.py::test_a_rank_leaving_with_a_collective_in_flight_exits_cleanly``.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import vcga  # noqa: F401 - registers backend "vcga"

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("vcga", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
t = torch.ones(1 << 16)
if rank == 0:
    work = dist.all_reduce(t, async_op=True)
    work.get_future()
    store.set("leaving", "1")
else:
    store.wait(["leaving"])
    dist.all_reduce(t)
    assert t[0].item() == 2.0
