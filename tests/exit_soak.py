"""Many short jobs that end the way a finished training script does: the exit-abort soak.

Run as ``python tests/exit_soak.py --setups "vcga*4;nccl:2,hccl:2" --world W --calls N`` (a setup,
``*`` how many jobs of it; setups as in benchmarks/soak.py); prints one JSON line per setup,
``{"setup": ..., "codes": [[every rank's exit code] for each job]}``. See tests/test_exit_soak.py.

Each job is ``W`` ranks forked from this process (torch is imported once, here, before any thread
exists), a fresh group on a fresh port. Every rank makes the same ``N`` random calls
(``benchmarks/soak.py``'s mix: seven collectives, four dtypes, sync and async completed out of order,
by ``wait()``, by a future or by a ``then`` callback), checks every result exactly, waits for what is
still in flight in a shuffled order, waits for one more all_reduce whose handle it keeps (as a
script's local variable would), calls ``destroy_process_group()`` and leaves through the end of
this script -- Python's own finalization, the exit under test, not ``os._exit``. Built to make the
abort likely: several ranks per job, many jobs, works in flight until the very end, and nothing
between the last wait and the exit that would give gloo's threads the GIL.

A rank's exit code: 0; 3 a wrong or missing result; 4 gloo worker threads (``pt_gloo_runloop``)
still alive after ``destroy_process_group()`` -- the cause of the abort: such a thread can release a
Python object after finalization began; -6 (SIGABRT) the abort itself.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402 - benchmarks/soak.py: the mix and its checks
import torch  # noqa: E402 - after the path, before any fork
import torch.distributed as dist  # noqa: E402
from gloo_threads import gloo_workers  # noqa: E402

SETUP_ENV = {"VCGA_BACKEND", "VCGA_SIM_VENDORS"}


def rank(r: int, world: int, port: int, setup: str, calls: list, pool: soak.Pool) -> int:
    if setup != "gloo":
        import vcga  # noqa: F401 - registers backend "vcga"
    store = dist.TCPStore("127.0.0.1", port, world, r == 0, timeout=timedelta(seconds=float(os.environ.get("EXIT_SOAK_TIMEOUT", "120"))))
    dist.init_process_group("gloo" if setup == "gloo" else "vcga", store=store, rank=r, world_size=world,
                            timeout=timedelta(seconds=float(os.environ.get("EXIT_SOAK_TIMEOUT", "120"))))
    stats = soak.run_calls(calls, r, world, pool, 120.0)
    last = dist.all_reduce(torch.ones(1), async_op=True)
    last.wait()
    dist.destroy_process_group()
    if stats["wrong"] or stats["missing"]:
        return 3
    return 4 if gloo_workers() else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--setups", default="vcga*4", help="';'-separated SETUP*JOBS (gloo, vcga, sim-nccl, nccl:2,hccl:2...)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--max-log2", type=int, default=14, help="largest message: 2**this elements per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pool = soak.Pool(args.world, 1 << args.max_log2)
    seed = args.seed
    for item in filter(None, (x.strip() for x in args.setups.split(";"))):
        setup, _, jobs = item.partition("*")
        for k in SETUP_ENV:  # read by each rank when it creates its group
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in soak.setup_env(setup).items() if k in SETUP_ENV})
        codes = []
        for _ in range(int(jobs or 1)):
            calls = soak.plan(seed, args.calls, args.world, async_share=0.6, max_log2=args.max_log2)
            seed += 1
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            pids = []
            for r in range(args.world):
                pid = os.fork()
                if pid == 0:
                    # The rank leaves through the end of this script (see the module docstring).
                    sys.exit(rank(r, args.world, port, setup, calls, pool))
                pids.append(pid)
            codes.append([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
        print(json.dumps({"setup": setup, "codes": codes}), flush=True)


if __name__ == "__main__":
    main()
