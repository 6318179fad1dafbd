"""Spawns a world per backend and runs conformance checks in every rank.

Each rank builds its backend's native process group over a TCPStore (the backend's own factory,
exactly what the ``vcga`` process group drives), runs every check and sends its results to the
parent, which waits with a deadline: a rank that hangs or dies becomes a failed result, never a
hung command.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from vcga.contract import CheckResult


@dataclass
class Context:
    """What a check sees on one rank."""

    rank: int
    world_size: int
    backend: Any  # vcga.contract.Backend
    pg: Any  # torch.distributed.ProcessGroup
    timeout: timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend_name: str, check_names: list[str] | None,
            timeout_s: float, results: Any) -> None:
    try:
        import torch.distributed as dist

        from vcga.plugin_manager import get_plugin_manager

        pm = get_plugin_manager()
        backend = pm.backend(backend_name)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
        pg = backend.create_process_group(dist.PrefixStore("vcga-verify", store), rank, world_size, timeout)
        ctx = Context(rank, world_size, backend, pg, timeout)
        for check in pm.conformance_checks():
            if check_names is not None and check.name not in check_names:
                continue
            for res in check.run(ctx):
                results.put(("result", rank, res))
        results.put(("done", rank, None))
    except BaseException as e:  # report, never hang the parent
        results.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_world(backend_name: str, world_size: int = 2, checks: list[str] | None = None,
              timeout_s: float = 60.0) -> list[CheckResult]:
    """Run the checks on a fresh ``world_size``-rank world; rank 0's results are returned, and a
    rank that fails, dies or outlives the deadline becomes a failed result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend_name, checks, timeout_s, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    merged: dict[tuple[str, str, str], CheckResult] = {}
    failures: list[CheckResult] = []
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s + 60
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures.append(CheckResult("runner", backend_name, f"world of {world_size}", False,
                                            detail=f"ranks {sorted(set(range(world_size)) - done)} did not finish in time"))
                break
            try:
                kind, rank, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done]
                if dead and results.empty():
                    failures.append(CheckResult("runner", backend_name, f"world of {world_size}", False,
                                                detail=f"ranks {dead} exited without reporting"))
                    break
                continue
            if kind == "result":
                _merge(merged, rank, payload)
            elif kind == "done":
                done.add(rank)
            else:
                failures.append(CheckResult("runner", backend_name, f"rank {rank}", False,
                                            detail=str(payload).splitlines()[0]))
                done.add(rank)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return list(merged.values()) + failures


def _merge(merged: dict[tuple[str, str, str], CheckResult], rank: int, res: CheckResult) -> None:
    """One row per case across ranks: it passes only if it passed on every rank; the worst error
    is the largest any rank saw; a failure's detail names the first rank that failed."""
    import dataclasses

    key = (res.check, res.backend, res.case)
    if not res.passed and res.detail:
        res = dataclasses.replace(res, detail=f"rank {rank}: {res.detail}")
    prev = merged.get(key)
    if prev is None:
        merged[key] = res
        return
    worst = max((e for e in (prev.worst_error, res.worst_error) if e is not None), default=None)
    merged[key] = dataclasses.replace(
        prev,
        passed=prev.passed and res.passed,
        skipped=prev.skipped and res.skipped,
        worst_error=worst,
        detail=prev.detail if not prev.passed else res.detail,
    )
