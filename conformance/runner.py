"""Spawns worlds and runs conformance checks in every rank, with deadlines.

A *world* is ``world_size`` processes on this machine, one per rank, sharing a TCP store. Each rank
creates the default process group -- either the ``vcga`` process group (``init_process_group
(backend="vcga")`` with ``VCGA_BACKEND`` or ``VCGA_SIM_VENDORS`` set, what users run) or the
backend's *native* group straight from its plugin's factory (``Backend.create_process_group``,
registered with torch under the name ``vcga_native``) -- then runs the planned checks in order.

The parent never waits without a deadline. It watches every rank's messages; when no rank has made
progress for ``stall_s`` seconds (a hung collective), when a rank dies, or when the world outlives
its deadline, the current check gets a failed result naming the rank and the case it was in, the
world is killed, and a fresh world runs the checks that remain (at most ``max_restarts`` times).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

from vcga import spawn
from vcga.contract import CheckResult

from .rank import _worker

# the world's description and group kind live in .world; their names stay importable from here
from .world import (
    Event,
    PlannedCheck,
    WorldOutcome,
    WorldSpec,
    resolve_group_kind,
    vcga_group_status,
)

log = logging.getLogger(__name__)

__all__ = [
    "WorldSpec",
    "PlannedCheck",
    "WorldOutcome",
    "Event",
    "vcga_group_status",
    "run_world",
    "planned_preloads",
]


#: Seconds a world may take to start (spawn, import torch, create the group) before it counts as hung.
STARTUP_S = 120.0


# ---------------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------------


@dataclass
class _RankState:
    check: str | None = None
    case: str | None = None
    waiting: str | None = None
    done: bool = False


def planned_preloads(plan: Sequence[PlannedCheck], registered: Mapping[str, Any] | None = None) -> list[str]:
    """The modules the planned checks name in ``preload`` (ConformanceCheck): heavy imports each of
    their ranks would make, which the rank server makes once before it forks them.

    :param registered: name -> check object (default: every check the plugins register)."""
    if registered is None:
        from vcga.plugin_manager import get_plugin_manager

        registered = {c.name: c for c in get_plugin_manager().conformance_checks()}
    return sorted({m for p in plan for m in getattr(registered.get(p.name), "preload", ())})


class _Attempt:
    """One spawned world: runs ``plan`` until done, a stall, a death or the deadline."""

    def __init__(self, spec: WorldSpec, group_kind: str, plan: list[PlannedCheck], timeout_s: float,
                 stall_s: float, deadline_s: float, emit: Callable[[Event], None], log_dir: str | None,
                 trace_dir: str, preload: Sequence[str] = ()) -> None:
        self.spec, self.group_kind, self.plan = spec, group_kind, plan
        self.trace_dir = trace_dir
        self.preload = list(preload)
        self.log_dir = log_dir
        self.timeout_s, self.stall_s, self.deadline_s = timeout_s, stall_s, deadline_s
        self.emit = emit
        self.results: dict[tuple[str, str], CheckResult] = {}
        self.order: list[tuple[str, str]] = []
        self.finished: list[str] = []  # checks every rank completed
        self.check_seconds: dict[str, float] = {}
        self.exports: dict[str, dict[str, Any]] = {}
        self.problem: CheckResult | None = None  # why the attempt stopped early
        self.problem_check: str | None = None
        self.setup_error: str | None = None
        self.unsupported: str | None = None  # the vcga group cannot build this (mixed-vendor) world
        self.group_resets = 0

    def run(self) -> None:
        # a forkserver with torch imported (a rank starts in 0.1 s, not 2), and the checks' preloads
        ctx = spawn.get_context(self.preload)
        port = spawn.free_port()
        store_timeout = self.stall_s * 2 + 60  # the parent decides about hangs before any store wait gives up
        # One pipe per rank, written synchronously: a rank that dies right after a message has
        # delivered it (a queue's feeder thread would lose it), and EOF says the rank is gone.
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.spec.world_size)]
        procs = [ctx.Process(target=_worker, name=f"vcga-verify-{self.spec.id}-r{r}",
                             args=(r, self.spec, self.group_kind, port, self.plan, self.timeout_s,
                                   store_timeout, pipes[r][1], self.log_path(r), self.trace_dir), daemon=True)
                 for r in range(self.spec.world_size)]
        for p in procs:
            p.start()
        for _, send_end in pipes:
            send_end.close()  # the parent keeps only the read ends, so EOF means the rank exited
        try:
            self._watch([recv for recv, _ in pipes], procs)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=2 if self.problem is None and self.setup_error is None
                           and self.unsupported is None else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            for recv, _ in pipes:
                recv.close()

    def log_path(self, rank: int) -> str | None:
        if not self.log_dir:
            return None
        return os.path.join(self.log_dir, f"{_file_name(self.spec)}-rank{rank}.log")

    def _messages(self, readers: list[Any], closed: set[int], timeout: float) -> list[tuple[str, int, Any]]:
        """Messages ready within ``timeout``; a reader at EOF joins ``closed`` (its rank exited)."""
        from multiprocessing.connection import wait

        live = [c for r, c in enumerate(readers) if r not in closed]
        out: list[tuple[str, int, Any]] = []
        # wait returns the objects it was given: the pipes' Connections
        ready = cast("list[Connection]", wait(live, timeout=timeout)) if live else []
        for conn in ready:
            r = readers.index(conn)
            try:
                while conn.poll():
                    out.append(conn.recv())
            except (EOFError, OSError):
                closed.add(r)
        return out

    def _watch(self, readers: list[Any], procs: list[Any]) -> None:
        n = self.spec.world_size
        states = [_RankState() for _ in range(n)]
        setup_errors: dict[int, str] = {}
        ready: set[int] = set()
        closed: set[int] = set()
        check_started: dict[str, float] = {}
        done_by: dict[str, set[int]] = {}
        start = last = time.monotonic()
        pending: list[tuple[str, int, Any]] = []
        while not all(s.done for s in states):
            if setup_errors:
                break  # a rank that cannot create its group dooms the world; the others wait forever
            if not pending:
                pending = self._messages(readers, closed, 0.25)
            if not pending:
                now = time.monotonic()
                dead = [r for r in sorted(closed) if not states[r].done and r not in setup_errors]
                if dead:
                    for r in dead:
                        procs[r].join(timeout=5)
                    if not all(r in ready for r in dead):
                        for r in dead:
                            setup_errors.setdefault(r, f"exited with code {procs[r].exitcode} before its group "
                                                       "was created")
                        break
                    self._stop(states, dead, "died", {r: procs[r].exitcode for r in dead})
                    return
                # Until every rank has created its group, "no progress" is process start-up
                # (spawn, import torch) on a machine that may be loaded; a group creation that
                # hangs ends at its own timeout, so allow at least STARTUP_S for it.
                limit = self.stall_s if len(ready) == n else max(self.stall_s, STARTUP_S)
                if now - last > limit:
                    self._stop(states, [r for r, s in enumerate(states) if not s.done], "hung", {})
                    return
                if now - start > self.deadline_s:
                    self._stop(states, [r for r, s in enumerate(states) if not s.done], "deadline", {})
                    return
                continue
            kind, rank, payload = pending.pop(0)
            last = time.monotonic()
            st = states[rank]
            if kind == "ready":
                ready.add(rank)
            elif kind == "setup-error":
                setup_errors[rank] = payload
                st.done = True
            elif kind == "setup-unsupported":
                self.unsupported = payload
                return
            elif kind == "check":
                st.check, st.case, st.waiting = payload, None, None
                if rank == 0:
                    check_started[payload] = last
                    self.emit(Event("check-start", self.spec, payload))
            elif kind == "case":
                st.check, st.case = payload
                st.waiting = None
                if rank == 0:
                    self.emit(Event("case", self.spec, payload[0], payload[1]))
            elif kind == "wait":
                st.waiting = payload[1]
            elif kind == "result":
                self._add(rank, payload)
            elif kind == "export":
                check, key, value = payload
                self.exports.setdefault(check, {})[key] = value
            elif kind == "check-done":
                done_by.setdefault(payload, set()).add(rank)
                st.waiting = None
                if len(done_by[payload]) == n:
                    self.finished.append(payload)
                    self.check_seconds[payload] = last - check_started.get(payload, last)
                    self.emit(Event("check-done", self.spec, payload, data=self._counts(payload)))
            elif kind == "fatal":
                check, err, tb = payload
                log.debug("rank %d: check %s raised:\n%s", rank, check, tb)
                self._add(rank, CheckResult(check, self.spec.label, "(check raised)", False,
                                            detail=f"rank {rank}: {err.splitlines()[0] if err else ''}"))
                self.problem_check = check  # the check's own failure row says why
                return
            elif kind == "done":
                st.done = True
                self.group_resets = max(self.group_resets, int(payload.get("group_resets", 0)))
        if setup_errors:
            errs = sorted(setup_errors.items())
            first = errs[0][1].splitlines()[0] if errs[0][1] else "unknown error"
            self.setup_error = f"rank {errs[0][0]}: {first}" + (
                f" (and {len(errs) - 1} more rank(s))" if len(errs) > 1 else "")

    def _stop(self, states: list[_RankState], ranks: list[int], why: str, exitcodes: dict[int, Any]) -> None:
        """Record why this world stops: blame the ranks that were inside a case (not waiting)."""
        busy = [r for r in ranks if states[r].waiting is None] or ranks
        waiting = [r for r in ranks if r not in busy]
        culprit = busy[0]
        check = states[culprit].check or (self.plan[0].name if self.plan else "runner")
        case = states[culprit].case or "(between cases)"
        who = f"rank {culprit}" if len(busy) == 1 else f"ranks {','.join(map(str, busy))}"
        if why == "died":
            codes = ", ".join(f"rank {r}: exit code {exitcodes[r]}" for r in busy if r in exitcodes)
            detail = f"{who} died during '{case}' ({codes})"
        elif why == "hung":
            detail = f"{who} made no progress for {self.stall_s:g} s in '{case}' (hung)"
        else:
            detail = f"the world outlived its {self.deadline_s:g} s deadline while {who} ran '{case}'"
        if waiting:
            detail += f"; {'rank' if len(waiting) == 1 else 'ranks'} {','.join(map(str, waiting))} " \
                      f"{'was' if len(waiting) == 1 else 'were'} waiting for it"
        detail += "; the world was stopped"
        self.problem_check = check
        self.problem = CheckResult(check, self.spec.label, case, False, detail=detail)

    def _add(self, rank: int, res: CheckResult) -> None:
        key = (res.check, res.case)
        prev = self.results.get(key)
        if prev is None:
            self.results[key] = res
            self.order.append(key)
            return
        worst = max((e for e in (prev.worst_error, res.worst_error) if e is not None), default=None)
        bound = prev.bound if worst == prev.worst_error else res.bound
        self.results[key] = dataclasses.replace(
            prev, passed=prev.passed and res.passed, skipped=prev.skipped and res.skipped,
            worst_error=worst, bound=bound,
            detail=prev.detail if (not prev.passed or res.passed) else res.detail)

    def _counts(self, check: str) -> dict[str, int]:
        rows = [r for (c, _), r in self.results.items() if c == check]
        return {"passed": sum(r.passed and not r.skipped for r in rows),
                "failed": sum(not r.passed for r in rows),
                "skipped": sum(r.skipped for r in rows)}

    def rows(self) -> list[CheckResult]:
        return [self.results[k] for k in self.order]


def _file_name(spec: WorldSpec) -> str:
    """The world's id as a file-name part."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in spec.id)


@contextlib.contextmanager
def _trace_dir(spec: WorldSpec, log_dir: str | None) -> Iterator[str]:
    """Where the world's ranks write flight-recorder dumps: ``<log_dir>/<world>-traces``, kept with
    the rank logs; without a log folder, a temporary one removed when the world ends."""
    if log_dir:
        yield os.path.join(log_dir, f"{_file_name(spec)}-traces")  # made by the first dump
    else:
        with tempfile.TemporaryDirectory(prefix="vcga-verify-traces-") as path:
            yield path


def run_world(spec: WorldSpec, plan: Sequence[PlannedCheck], *, timeout_s: float = 60.0,
              stall_s: float | None = None, deadline_s: float = 1800.0, max_restarts: int = 2,
              on_event: Callable[[Event], None] | None = None, log_dir: str | None = None,
              preload: Sequence[str] | None = None) -> WorldOutcome:
    """Run ``plan`` in a fresh world for ``spec`` and return every result.

    :param timeout_s: the collective timeout each rank's group is created with.
    :param stall_s: seconds without progress from any rank after which the world counts as hung
        (default ``2 * timeout_s + 10``: a collective that times out properly reports well before).
    :param deadline_s: the most one attempt may take in total.
    :param max_restarts: fresh worlds started after a hang or death, for the checks that remain.
    :param log_dir: where each rank's stdout/stderr go (``<world>-rank<r>.log``) and its
        flight-recorder dumps (``<world>-traces/``); None: output inherited, dumps in a temporary
        folder removed with the world (never the default dump folder, where a job's dumps are).
    :param preload: the modules the rank server imports (default: :func:`planned_preloads` of
        ``plan``); the same for every world of a run, so that no world restarts the server.
    """
    emit = on_event or (lambda e: None)
    stall = stall_s if stall_s is not None else 2 * timeout_s + 10
    start = time.monotonic()
    if preload is None:
        preload = planned_preloads(plan)  # of the whole plan, before the filter below
    plan = [p for p in plan if p.applies_to(spec)]
    kind, why = resolve_group_kind(spec)
    if kind is None:
        out = WorldOutcome(spec, group_kind="none", status="skipped", detail=why)
        out.results = [CheckResult(p.name, spec.label, f"world of {spec.world_size}", True, skipped=True,
                                   detail=why) for p in plan]
        emit(Event("world-done", spec, detail=why, data={"status": "skipped"}))
        return out
    out = WorldOutcome(spec, group_kind=kind)
    remaining = list(plan)
    with _trace_dir(spec, log_dir) as traces:
        while remaining:
            out.attempts += 1
            emit(Event("world-start", spec, data={"attempt": out.attempts, "group": kind,
                                                  "checks": [p.name for p in remaining]}))
            attempt = _Attempt(spec, kind, remaining, timeout_s, stall, deadline_s, emit, log_dir, traces,
                               preload)
            attempt.run()
            out.results.extend(attempt.rows())
            out.check_seconds.update(attempt.check_seconds)
            out.group_resets += attempt.group_resets
            for check, values in attempt.exports.items():
                out.exports.setdefault(check, {}).update(values)
            if attempt.unsupported is not None:
                why = f"this build cannot create this mixed-vendor group: {attempt.unsupported}"
                out.status, out.detail = "skipped", why
                out.results = [CheckResult(p.name, spec.label, f"world of {spec.world_size}", True, skipped=True,
                                           detail=why) for p in remaining]
                break
            if attempt.setup_error is not None:
                out.status, out.detail = "setup-failed", attempt.setup_error
                out.results.append(CheckResult("runner", spec.label, f"create a {kind} group of {spec.world_size}",
                                               False, detail=attempt.setup_error))
                emit(Event("world-problem", spec, detail=attempt.setup_error))
                break
            if attempt.problem_check is None:
                break  # every planned check finished
            if attempt.problem is not None:
                out.results.append(attempt.problem)
                emit(Event("world-problem", spec, attempt.problem.check, attempt.problem.case,
                           detail=attempt.problem.detail))
            out.status = "stopped"
            out.detail = attempt.problem.detail if attempt.problem else f"check {attempt.problem_check} raised"
            done = set(attempt.finished) | {attempt.problem_check}
            remaining = [p for p in remaining if p.name not in done]
            if remaining and out.attempts > max_restarts:
                for p in remaining:
                    out.results.append(CheckResult(p.name, spec.label, "(not run)", False,
                                                   detail=f"not run: the world was stopped {out.attempts} times"))
                break
    out.elapsed_s = time.monotonic() - start
    emit(Event("world-done", spec, detail=out.detail, data={"status": out.status, "elapsed_s": out.elapsed_s}))
    return out
