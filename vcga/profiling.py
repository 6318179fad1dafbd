"""torch profiler traces of ``vcga`` collectives, with the bridge's steps linked to their calls.

Under ``torch.profiler.profile()`` every collective of a ``vcga`` group is a span named as torch
names a backend's calls -- ``vcga:all_reduce``, ``vcga:all_gather``, ... -- on the thread that
called it, lasting until the call ended (with the input shapes when ``record_shapes=True``). On
a mixed-vendor group the collective runs on the group's communication threads, in steps:
``vcga:in-vendor reduce_scatter (sim-nccl)``, ``vcga:cross-vendor exchange (gloo)``,
``vcga:in-vendor all_gather (sim-nccl)``, and compression's ``vcga:compress encode (topk)``,
... torch's profiler records those threads only when asked to record every thread::

    from torch._C._profiler import _ExperimentalConfig
    with torch.profiler.profile(experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        ...
    vcga.profiling.export_chrome_trace(prof, "step.json")

:func:`export_chrome_trace` writes the trace as ``prof.export_chrome_trace`` does and adds a flow
arrow from each call to each of its steps (trace viewers then show which collective a step
belongs to), and -- where torch did not record a step's thread -- the step itself, from the times
VCGA kept (category ``vcga_step``). Nothing is kept while no profiler runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["export_chrome_trace", "link_steps"]


def export_chrome_trace(prof: Any, path: str | os.PathLike[str]) -> Path:
    """``prof.export_chrome_trace(path)``, then :func:`link_steps` on the file (rewritten atomically)."""
    from vcga.atomic import atomic_write_bytes

    target = Path(path)
    prof.export_chrome_trace(str(target))
    with open(target, encoding="utf-8") as f:
        trace = json.load(f)
    link_steps(trace)
    atomic_write_bytes(target, json.dumps(trace).encode())
    return target


def link_steps(trace: dict[str, Any]) -> int:
    """Add to a Chrome trace (torch's JSON, as loaded) the flow arrows from each ``vcga`` call
    this process profiled to its steps, and the steps torch did not record; returns the number of
    arrows added. Only calls that fall inside the trace are linked."""
    from vcga.pg.spans import FINISHED

    base = int(trace.get("baseTimeNanoseconds", 0))
    events = trace.setdefault("traceEvents", [])
    slices = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
    if not slices:
        return 0
    lo = min(e["ts"] for e in slices)
    hi = max(e["ts"] + e.get("dur", 0) for e in slices)
    pid = os.getpid()
    recorded: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for e in slices:
        recorded.setdefault((e.get("tid"), e.get("name", "")), []).append(e)
    used: set[int] = set()

    def us(ns: int) -> float:
        return (ns - base) / 1000.0

    def match(tid: int, name: str, start: float, end: float) -> dict[str, Any] | None:
        """torch's slice for an interval VCGA timed: same thread and name, the nearest start among
        the slices that overlap it or start near it. The two clocks and the record's own setup put
        the starts some microseconds apart, and a thread preempted between torch's record and
        VCGA's (a loaded host) puts them milliseconds apart; one thread's calls of one name never
        overlap each other, so overlap still names the call."""
        near = [e for e in recorded.get((tid, name), []) if id(e) not in used
                and (abs(e["ts"] - start) < _NEAR_US or (e["ts"] <= end and e["ts"] + e.get("dur", 0) >= start))]
        if not near:
            return None
        best = min(near, key=lambda e: abs(e["ts"] - start))
        used.add(id(best))
        return best

    def inside(e: dict[str, Any]) -> float:
        # just past the slice's start: a viewer binds an arrow to the latest slice begun there
        return e["ts"] + min(e.get("dur", 0) / 2, _INSIDE_US)

    added = 0
    flow = 1 + max((int(e.get("id", 0)) for e in events if e.get("ph") in ("s", "f", "t")
                    and str(e.get("id", "")).isdigit()), default=0)
    for span in list(FINISHED):
        if span.end_ns is None or not span.steps:
            continue
        start, end = us(span.start_ns), us(span.end_ns)
        if end < lo or start > hi:
            continue
        parent = match(span.tid, span.name, start, end)
        if parent is None:
            continue  # torch did not record the call (its thread was not profiled)
        for tid, name, a_ns, b_ns in span.steps:
            a, b = us(a_ns), us(b_ns)
            child = match(tid, name, a, b)
            if child is None:
                child = {"ph": "X", "cat": "vcga_step", "name": name, "pid": pid, "tid": tid, "ts": a,
                         "dur": max(b - a, 0.001),
                         "args": {"vcga seq": span.seq, "call": span.name,
                                  "source": "vcga (torch's profiler did not record this thread)"}}
                events.append(child)
            events.append({"ph": "s", "id": flow, "pid": pid, "tid": span.tid, "ts": inside(parent), "cat": "vcga",
                           "name": "vcga step"})
            events.append({"ph": "f", "bp": "e", "id": flow, "pid": pid, "tid": tid, "ts": inside(child), "cat": "vcga",
                           "name": "vcga step"})
            flow += 1
            added += 1
    return added


#: how far apart torch's start of a slice and VCGA's own may be and still be the same call
_NEAR_US = 2000.0
#: where in a slice an arrow starts or ends: this far past its start (at most half its length)
_INSIDE_US = 0.5
