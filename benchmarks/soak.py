"""Soak: many short jobs of random collectives; every result checked, every rank's exit code kept.

Each repetition starts ``--world`` fresh processes (as torchrun would: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``init_method="env://"``) that make ``--calls`` random calls with
the same random sequence on every rank, check every result exactly, then run ``all_gather_object``
and ``destroy_process_group`` and return from the script -- a finished training job's exit. A rank
that aborts at exit (SIGABRT: "terminate called without an active exception") shows as exit code
-6 even though all its results were right.

The mix (see :func:`plan`): all_reduce (SUM/MAX/MIN), all_gather_into_tensor, reduce_scatter_tensor,
broadcast, barrier, send/recv pairs, all_to_all_single; fp32, bf16, fp16, int64; 1 to 1 Mi elements
per rank (log-uniform); about 40 % asynchronous, completed by ``wait()``, by waiting on
``get_future()``, or by a ``get_future().then()`` callback, in a shuffled order, some after several
newer calls were issued. Inputs are small integers (|x| <= 8), so every sum is exact in every dtype
and every result is compared bit for bit with a value computed without the library.

Usage::

    python benchmarks/soak.py                      # 50 x 3000 calls, 4 ranks: gloo, vcga, nccl:2,hccl:2
    python benchmarks/soak.py --reps 5 --calls 300 --setups "gloo;vcga"
    python benchmarks/soak.py --setups "gloo;sim-nccl;sim-hccl;sim-cncl;nccl:2,hccl:2" --markdown
    python benchmarks/soak.py --lock /tmp/benchmarks.lock --progress   # a long run on a shared machine

A setup is ``gloo`` (backend gloo), ``vcga`` (backend vcga on gloo), a simulated vendor
(``sim-nccl``...: backend vcga with ``VCGA_BACKEND``), or a mixed-vendor layout (``nccl:2,hccl:2``:
``VCGA_SIM_VENDORS``); setups are separated by ``;``. Each repetition runs every setup once, one
after the other, with the same seed, so machine noise hits all of them alike. Throughput is calls
per second over the loop of calls and checks on the slowest rank (the same work for every setup),
median over repetitions, and its ratio to gloo's in the same run. The exit code is 0 only if every
rank of every job exited 0 with every result right.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier",
               "send_recv", "all_to_all_single")
DTYPES = ("float32", "bfloat16", "float16", "int64")
COMPLETIONS = ("wait", "future", "then")  # how an asynchronous call is completed
MAX_ELEMS = 1 << 20


# ------------------------------------------------------------------------------------------------
# The plan: one random sequence of calls, the same on every rank
# ------------------------------------------------------------------------------------------------

def plan(seed: int, calls: int, world: int, async_share: float = 0.4, max_log2: int = 20) -> list[dict[str, Any]]:
    """The calls of one job, the same on every rank: what each rank issues, in order, and in each
    call's ``complete`` the asynchronous calls completed right after it, in that (shuffled) order;
    the last call completes everything still pending. ``offs`` pick each rank's input out of the
    :class:`Pool`; sizes are log-uniform from 1 to ``2**max_log2`` elements per rank."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    pending: list[int] = []
    for i in range(calls):
        coll = rng.choice(COLLECTIVES)
        n = min(MAX_ELEMS, int(2 ** rng.uniform(0, max_log2)))
        call: dict[str, Any] = {
            "i": i, "coll": coll, "dtype": rng.choice(DTYPES), "n": n,
            "op": rng.choice(("sum", "sum", "max", "min")),
            "root": rng.randrange(world), "shift": rng.randrange(1, world) if world > 1 else 0,
            "offs": [rng.randrange(MAX_ELEMS) for _ in range(world)],
            "async": rng.random() < async_share, "completion": rng.choice(COMPLETIONS), "complete": [],
        }
        out.append(call)
        if call["async"]:
            pending.append(i)
        # now and then, complete a random part of what is pending, in a shuffled order
        if pending and (rng.random() < 0.3 or len(pending) > 8):
            k = rng.randint(1, len(pending))
            chosen = rng.sample(pending, k)
            call["complete"] = chosen
            pending = [p for p in pending if p not in chosen]
    rng.shuffle(pending)
    if out:
        out[-1]["complete"] = out[-1]["complete"] + pending
    return out


# ------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------

class Pool:
    """Inputs: one pool of random small integers (the same on every rank), viewed in each dtype."""

    def __init__(self, world: int, max_elems: int = MAX_ELEMS) -> None:
        import torch

        g = torch.Generator().manual_seed(20)
        # offsets run up to MAX_ELEMS (see plan); the largest piece is max_elems per rank
        base = torch.randint(-8, 9, (MAX_ELEMS + max_elems * world,), generator=g, dtype=torch.int8)
        self.by_dtype = {name: base.to(getattr(torch, name)) for name in DTYPES}

    def piece(self, dtype: str, off: int, n: int) -> Any:
        return self.by_dtype[dtype][off:off + n]


def _reduce(parts: list[Any], op: str) -> Any:
    import torch

    out = parts[0].clone()
    for p in parts[1:]:
        if op == "sum":
            out += p
        elif op == "max":
            torch.maximum(out, p, out=out)
        else:
            torch.minimum(out, p, out=out)
    return out


def _issue(call: dict[str, Any], rank: int, world: int, pool: Pool) -> tuple[list[Any], Any]:
    """Issue one call (asynchronously if the plan says so); return its work(s) and a checker that
    returns True when the result is exact."""
    import torch
    import torch.distributed as dist

    coll, dt, n, offs = call["coll"], call["dtype"], call["n"], call["offs"]
    aop = call["async"]
    # torch 2.13's names for the one-tensor forms (the old ones print a FutureWarning per call)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[call["op"]]

    def mine(r: int, length: int = n) -> Any:
        return pool.piece(dt, offs[r], length)

    if coll == "all_reduce":
        t = mine(rank).clone()
        w = dist.all_reduce(t, op=red, async_op=aop)
        return [w], lambda: torch.equal(t, _reduce([mine(r) for r in range(world)], call["op"]))
    if coll == "all_gather_into_tensor":
        out = torch.empty(n * world, dtype=getattr(torch, dt))
        w = gather_single(out, mine(rank).clone(), async_op=aop)
        return [w], lambda: all(torch.equal(out[r * n:(r + 1) * n], mine(r)) for r in range(world))
    if coll == "reduce_scatter_tensor":
        out = torch.empty(n, dtype=getattr(torch, dt))
        w = scatter_single(out, mine(rank, n * world).clone(), op=red, async_op=aop)
        return [w], lambda: torch.equal(out, _reduce([mine(r, n * world)[rank * n:(rank + 1) * n]
                                                      for r in range(world)], call["op"]))
    if coll == "broadcast":
        t = mine(rank).clone()
        w = dist.broadcast(t, src=call["root"], async_op=aop)
        return [w], lambda: torch.equal(t, mine(call["root"]))
    if coll == "barrier":
        return [dist.barrier(async_op=aop)], lambda: True
    if coll == "send_recv":  # a ring shifted by `shift`: every rank sends one message and receives one
        dst, src = (rank + call["shift"]) % world, (rank - call["shift"]) % world
        out = torch.empty(n, dtype=getattr(torch, dt))
        # a tag per call: gloo matches messages by (peer, tag), and several may be in flight
        # synchronous or not, both are waited once in _complete (a gloo p2p work's second wait()
        # waits for a second message)
        works = [dist.isend(mine(rank).clone(), dst, tag=call["i"]), dist.irecv(out, src, tag=call["i"])]
        return works, lambda: torch.equal(out, mine(src))
    if coll == "all_to_all_single":
        out = torch.empty(n * world, dtype=getattr(torch, dt))
        w = dist.all_to_all_single(out, mine(rank, n * world).clone(), async_op=aop)
        return [w], lambda: all(torch.equal(out[r * n:(r + 1) * n], mine(r, n * world)[rank * n:(rank + 1) * n])
                                for r in range(world))
    raise ValueError(coll)


class Completions:
    """Counts results; ``then`` callbacks report from gloo's thread, hence the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.right = 0
        self.wrong: list[int] = []
        self.outstanding = threading.Semaphore(0)
        self.then_count = 0

    def record(self, i: int, ok: bool) -> None:
        with self.lock:
            if ok:
                self.right += 1
            else:
                self.wrong.append(i)


def _complete(call: dict[str, Any], works: list[Any], check: Any, done: Completions) -> None:
    how = call["completion"] if call["async"] else "wait"
    if how != "wait" and len(works) == 1:
        try:
            fut = works[0].get_future()
        except RuntimeError:  # gloo: some works have no future (reduce_scatter, p2p); vcga's all do
            fut = None
        if fut is not None and how == "future":
            fut.wait()
            done.record(call["i"], check())
            return
        if fut is not None:  # "then": checked in the thread that completes the future
            def cb(f: Any) -> None:
                try:
                    f.value()
                    ok = check()
                except Exception:  # noqa: BLE001 - a failed collective counts as a wrong result
                    ok = False
                done.record(call["i"], ok)
                done.outstanding.release()

            done.then_count += 1
            fut.then(cb)
            return
    for w in works:
        if w is not None:  # a synchronous call returns None
            w.wait()
    done.record(call["i"], check())


def run_calls(calls: list[dict[str, Any]], rank: int, world: int, pool: Pool, timeout: float) -> dict[str, Any]:
    """Make ``calls`` on the default group (initialised), complete each when the plan says so, check
    every result. Returns this rank's counts and the seconds the loop took."""
    done = Completions()
    inflight: dict[int, tuple[dict[str, Any], list[Any], Any]] = {}
    t0 = time.perf_counter()
    for call in calls:
        works, check = _issue(call, rank, world, pool)
        if call["async"]:
            inflight[call["i"]] = (call, works, check)
        else:
            _complete(call, works, check, done)
        for j in call["complete"]:
            _complete(*inflight.pop(j), done)
    for _ in range(done.then_count):  # every callback has reported
        if not done.outstanding.acquire(timeout=timeout):
            break
    return {"rank": rank, "right": done.right, "wrong": done.wrong, "seconds": time.perf_counter() - t0,
            "missing": len(calls) - done.right - len(done.wrong)}


def rank_main(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if args.setup != "gloo":
        import vcga  # noqa: F401 - registers backend "vcga" (torch's autoload would, too)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher's view of a rank that hangs
    torch.set_num_threads(1)
    pool = Pool(world)
    calls = plan(args.seed, args.calls, world)
    dist.init_process_group("gloo" if args.setup == "gloo" else "vcga", init_method="env://",
                            timeout=timedelta(seconds=args.timeout))
    stats = run_calls(calls, rank, world, pool, args.timeout)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, stats)
    dist.destroy_process_group()
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(gathered))
    return 0


# ------------------------------------------------------------------------------------------------
# The launcher
# ------------------------------------------------------------------------------------------------

def setup_env(setup: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    if setup.startswith("sim-"):
        env["VCGA_BACKEND"] = setup
    elif ":" in setup:
        env["VCGA_SIM_VENDORS"] = setup
    return env


def _allow_core() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_job(setup: str, world: int, calls: int, seed: int, timeout: float, cores: str | None = None) -> dict[str, Any]:
    """One job: ``world`` fresh processes. Returns every rank's exit code and rank 0's report.
    With ``cores``, ranks may dump core (into their working directory, the job's temporary one),
    and a failed job's cores and logs are moved to ``cores``."""
    from vcga.testing import (
        free_port,  # here, not at the top: tests/exit_soak.py forks gloo ranks that never import vcga
    )

    with tempfile.TemporaryDirectory(prefix="vcga-soak-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**setup_env(setup), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(world)}
        cmd = [sys.executable, __file__, "--rank-of", setup, "--calls", str(calls), "--seed", str(seed),
               "--timeout", str(timeout), "--out", str(out)]
        procs = []
        logs = []
        for r in range(world):
            log = open(Path(tmp) / f"rank{r}.log", "w+")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=tmp, preexec_fn=_allow_core if cores else None))
        codes = []
        deadline = time.monotonic() + timeout + 60
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in procs:  # every rank still running prints its threads' stacks, then goes
                    if q.poll() is None:
                        q.send_signal(signal.SIGUSR1)
                time.sleep(2)
                p.kill()
                codes.append(p.wait())
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
        report = json.loads(out.read_text()) if out.exists() else None
        if cores and any(codes):
            keep = Path(cores) / f"{setup.replace(':', '_').replace(',', '+')}-seed{seed}-{os.getpid()}-{time.time_ns()}"
            keep.mkdir(parents=True)
            for f in Path(tmp).iterdir():
                if f.name.startswith(("core", "rank")):
                    f.rename(keep / f.name)
    return {"codes": codes, "report": report, "logs": texts}


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="gloo;vcga;nccl:2,hccl:2",
                    help="';'-separated setups (gloo, vcga, sim-nccl, sim-hccl, sim-cncl, nccl:2,hccl:2 ...)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="first repetition's seed (each repetition its own)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per collective and per job, seconds")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--progress", action="store_true", help="a line per job on stderr")
    ap.add_argument("--lock", help="hold this flock(1)-style lock file during each repetition (all its setups): "
                                   "a long soak on a shared machine lets others in between repetitions")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--cores", help="let ranks dump core; keep a failed job's cores and logs in this folder")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank of this setup
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_of:
        args.setup = args.rank_of
        return rank_main(args)

    setups = [s.strip() for s in args.setups.split(";") if s.strip()]
    rows: dict[str, dict[str, Any]] = {s: {"setup": s, "rates": [], "codes": [], "wrong": 0, "missing": 0,
                                           "failed_jobs": 0, "by_rep": {}} for s in setups}
    for rep in range(args.reps):
        with _locked(args.lock):
            jobs = {setup: run_job(setup, args.world, args.calls, args.seed + rep, args.timeout, args.cores)
                    for setup in setups}
        for setup, job in jobs.items():
            row = rows[setup]
            row["codes"].append(job["codes"])
            rep_ok = job["report"] is not None
            if rep_ok:
                for r in job["report"]:
                    row["wrong"] += len(r["wrong"])
                    row["missing"] += r["missing"]
                row["rates"].append(args.calls / max(r["seconds"] for r in job["report"]))
                row["by_rep"][rep] = row["rates"][-1]
            if args.progress:
                rate = f"{row['rates'][-1]:.1f} calls/s" if rep_ok else "no report"
                wrong = sum(len(r["wrong"]) + r["missing"] for r in job["report"]) if rep_ok else "?"
                print(f"[{setup}] repetition {rep}: exit codes {job['codes']}, {rate}, wrong {wrong}",
                      file=sys.stderr, flush=True)
            if not rep_ok or any(c != 0 for c in job["codes"]):
                row["failed_jobs"] += 1
                bad = [r for r, c in enumerate(job["codes"]) if c != 0]
                tail = job["logs"][bad[0]][-600:] if bad else "no report"
                print(f"[{setup}] repetition {rep}: exit codes {job['codes']}: {tail.strip()}", file=sys.stderr)
    out_rows = []
    for s in setups:
        row = rows[s]
        rate = statistics.median(row["rates"]) if row["rates"] else math.nan
        codes = [c for rep in row["codes"] for c in rep]
        # the ratio to gloo's rate in the same repetition, median over repetitions (paired: noise
        # that slows a whole repetition cancels)
        paired = [row["by_rep"][k] / rows["gloo"]["by_rep"][k] for k in row["by_rep"]
                  if k in rows.get("gloo", {}).get("by_rep", {})]
        out_rows.append({"setup": s, "reps": args.reps, "calls": args.calls, "world": args.world,
                         "calls_per_s": rate, "ratio_to_gloo": statistics.median(paired) if paired else math.nan,
                         "wrong": row["wrong"], "missing": row["missing"],
                         "exit_codes": {str(c): codes.count(c) for c in sorted(set(codes))},
                         "failed_jobs": row["failed_jobs"]})
    head = ["setup", "reps x calls", "calls/s (median)", "vs gloo (median of same-rep ratios)", "wrong",
            "rank exit codes", "failed jobs"]
    lines = [[r["setup"], f"{r['reps']} x {r['calls']}", f"{r['calls_per_s']:.1f}", f"{r['ratio_to_gloo']:.3f}",
              str(r["wrong"] + r["missing"]), ", ".join(f"{k}: {v}" for k, v in r["exit_codes"].items()),
              str(r["failed_jobs"])] for r in out_rows]
    sys.path.insert(0, str(Path(__file__).parent))
    from _ranks import table

    print(table(head, lines, args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(out_rows, indent=1))
    return 0 if all(r["failed_jobs"] == 0 and r["wrong"] == 0 and r["missing"] == 0 for r in out_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
