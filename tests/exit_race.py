"""The exit race of a counted thread, made likely: see tests/test_exit_soak.py.

Run as ``python tests/exit_race.py JOBS``; prints one JSON line ``{"codes": [[rank codes] per job]}``.

Each job is 2 ranks forked from this process. Each rank starts one asynchronous
reduce-scatter (``reduce_scatter_single``: a gloo work without a future of its own: vcga watches it on a counted
thread, ``vcga-work-watch``), waits for its future, drops the handle, destroys the group and leaves
through the end of this script. The input is large (2 x 64 MiB), so the work's C++ destructor takes
a while, and the watcher is made to pause for 0.3 s right before it leaves the exit drain's count
(``vcga.pypg._release``), as a thread descheduled on a busy machine would. A watcher that still
held the work at that point would drop it during the interpreter's finalization and the process
would abort (SIGABRT, "terminate called without an active exception").

A rank's exit code: 0; 3 a wrong result; -6 the abort.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch  # before any fork
import torch.distributed as dist

#: how long the watcher pauses before it leaves the count, and the elements of each rank's output
DELAY_S = 0.3
N = 1 << 24


def rank(r: int, world: int, port: int) -> int:
    import vcga  # noqa: F401 - registers backend "vcga"
    from vcga import pypg
    from vcga.pg.comm import reduce_scatter_single

    release = pypg._release

    def late_release() -> None:
        if threading.current_thread().name == "vcga-work-watch":
            time.sleep(DELAY_S)  # a descheduled watcher: nothing else changes
        release()

    pypg._release = late_release
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, r == 0, timeout=timeout)
    dist.init_process_group("vcga", store=store, rank=r, world_size=world, timeout=timeout)
    out = torch.empty(N)
    work = reduce_scatter_single(out, torch.ones(N * world), async_op=True)
    work.get_future().wait()
    del work
    ok = torch.equal(out, torch.full((N,), float(world)))
    dist.destroy_process_group()
    return 0 if ok else 3


def main() -> None:
    jobs, world = int(sys.argv[1]), 2
    torch.set_num_threads(1)
    codes = []
    for _ in range(jobs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = []
        for r in range(world):
            pid = os.fork()
            if pid == 0:
                sys.exit(rank(r, world, port))  # leaves through Python's finalization
            pids.append(pid)
        codes.append([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
    print(json.dumps({"codes": codes}), flush=True)


if __name__ == "__main__":
    main()
