"""The flight recorder's dump: every group's entries, in the schema of torch's own recorder.

Loaded only when a dump is written (a collective timeout, an abort, SIGUSR1, or
:func:`vcga.flight_recorder.dump`). One file per rank, ``<dir>/vcga_fr_trace_rank_<rank>`` (config
``trace_dir``) or ``<TORCH_FR_DUMP_TEMP_FILE><rank>``, written atomically (:mod:`vcga.atomic`): a
pickled dict as torch's ``FlightRecorder::dump`` writes it, version 2.10 (torch 2.13), which
``torch.distributed.flight_recorder`` (``torchfrtrace``) and ``vcga trace`` read.

Each entry is named ``<library>:<op>`` after the collective library this rank's calls run on --
nccl, hccl, gloo, ... (torch's analyzer accepts those prefixes; ``vcga trace`` also others, such as
cncl). VCGA adds what torch's schema has no field for, under keys torch's analyzer does not read:
per entry ``vcga_stage`` (the bridge's or compression's step it was in when the dump was taken, or
failed in), ``vcga_steps`` (the steps with their times, for a call a profiler recorded) and
``vcga_error``; per dump ``vcga`` (this rank's
backend, vendor and library per group, and why the dump was written).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vcga.pg import recorder as _recorder
from vcga.pg.recorder import FILE_PREFIX

__all__ = ["VERSION", "FILE_PREFIX", "dump", "dump_quietly", "dump_on_failure", "dump_path", "build"]

log = logging.getLogger("vcga.flight_recorder")

#: The schema version torch 2.13's recorder writes (FlightRecorder.hpp ``version_val``) and its analyzer reads.
VERSION = "2.10"

_lock = threading.Lock()

#: torch dtype name -> c10's ScalarType name (what torch's recorder writes as input_dtypes)
_C10_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
              "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
              "complex64": "ComplexFloat", "complex128": "ComplexDouble", "complex32": "ComplexHalf",
              "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2", "uint16": "UInt16",
              "uint32": "UInt32", "uint64": "UInt64"}


def _dtype_name(dt: Any) -> str:
    name = str(dt).removeprefix("torch.")
    return _C10_NAMES.get(name, name)


def _this_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    recs = _recorder.recorders()
    return recs[0].global_rank if recs else 0


def dump_path(rank: int | None = None) -> Path:
    """Where this rank's dump goes (see the module docstring)."""
    rank = _this_rank() if rank is None else rank
    if _recorder.trace_dir:
        return Path(_recorder.trace_dir) / f"{FILE_PREFIX}{rank}"
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if prefix:
        return Path(f"{prefix}{rank}")
    return Path(tempfile.gettempdir()) / f"{FILE_PREFIX}{rank}"


_OWN = str(Path(__file__).resolve().parents[1]) + os.sep  # the vcga package: its frames are not the caller's


def _callers(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A call's frames without VCGA's own innermost ones (as torch's recorder starts at its API)."""
    i = 0
    while i < len(frames) - 1 and str(frames[i].get("filename", "")).startswith(_OWN):
        i += 1
    return frames[i:]


def _thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


def _observe(call: _recorder.Call) -> None:
    """An asynchronous call nobody waited for yet: ask its work whether it ended (its end hook
    then records the outcome)."""
    ref = call.work
    work = ref() if ref is not None else None
    if work is not None and call.ended_ns is None:
        try:
            work.is_completed()
        except Exception:  # noqa: BLE001 - a dump reads what it can
            pass


def _entry(call: _recorder.Call, rec: _recorder.FlightRecorder, pg_id: int, frames: list[dict[str, Any]],
           names: dict[int, str]) -> dict[str, Any]:
    completed = call.ended_ns is not None and call.error is None
    e: dict[str, Any] = {
        "record_id": call.record_id,
        "pg_id": pg_id,
        "process_group": (rec.group_name, rec.group_desc),
        "thread_name": names.get(call.thread, ""),
        "thread_id": str(call.thread),
        "collective_seq_id": call.seq,
        "p2p_seq_id": 0,
        "op_id": call.seq,
        "profiling_name": f"{rec.library}:{call.op}",
        "time_created_ns": call.created_ns,
        "input_sizes": [list(shape) for shape, _ in call.inputs],
        "input_dtypes": [_dtype_name(dt) for _, dt in call.inputs],
        "output_sizes": [list(shape) for shape, _ in call.outputs],
        "output_dtypes": [_dtype_name(dt) for _, dt in call.outputs],
        "state": call.state,
        "time_discovered_started_ns": call.started_ns,
        "time_discovered_completed_ns": call.ended_ns if completed else None,
        "retired": call.ended_ns is not None,
        "timeout_ms": int(rec.timeout_s * 1000),
        "is_p2p": False,
        "frames": _callers(frames),
    }
    if completed:
        e["duration_ms"] = (call.ended_ns - (call.started_ns or call.created_ns)) / 1e6  # type: ignore[operator]
    if call.steps:
        e["vcga_steps"] = [{"name": n, "tier": t, "library": lib, "start_ns": a, "end_ns": b}
                           for n, t, lib, a, b in list(call.steps)]
    if call.stage is not None and (call.ended_ns is None or call.error is not None):  # where it is, or failed
        n, t, lib = call.stage
        e["vcga_stage"] = f"{t} {n} ({lib})"
    if call.error is not None:
        first = str(call.error).splitlines()
        e["vcga_error"] = f"{type(call.error).__name__}: {first[0] if first else ''}"
    return e


#: Where the call path's own frames come from (left out of a dump's frames: a reader wants the caller).
_CALL_PATH = tuple(os.path.normpath(os.path.join(os.path.dirname(_recorder.__file__), "..", name))
                   for name in ("pg", "process_group.py", "pypg.py"))


def _frames(calls: list[_recorder.Call]) -> list[list[dict[str, Any]]]:
    """Each call's frames as torch's recorder writes them, innermost first, the call path's own
    left out, at most :data:`vcga.pg.recorder.FRAMES`: the stack it took (symbolized by torch in
    one batch, :func:`_symbolize`), or for a call that took none and is in flight or failed (a
    synchronous call on the hot path, whose caller is still inside it) the live stack of its
    thread; none for the rest."""
    taken = [i for i, c in enumerate(calls) if c.traceback is not None and not isinstance(c.traceback, tuple)]
    out: list[list[dict[str, Any]]] = [[] for _ in calls]
    # in flight, or failed before its caller took the stack (the typed error not yet out of the call)
    live = [i for i, c in enumerate(calls) if c.traceback is None and (c.ended_ns is None or c.error is not None)]
    if live:
        stacks = sys._current_frames()
        for i in live:
            top = stacks.get(calls[i].thread)
            if top is not None:
                out[i] = _shown(_walk(top))
    if not taken:
        return out
    for i, frames in zip(taken, _symbolize([calls[i].traceback for i in taken]), strict=True):
        out[i] = _shown([{"name": f["name"], "filename": f["filename"], "line": int(f["line"])} for f in frames])
    return out


def _symbolize(tracebacks: list[Any]) -> list[list[dict[str, Any]]]:
    """torch's ``symbolize_tracebacks``, without importing inductor where it is not imported yet.

    torch's symbolizer asks ``hasattr(torch, "_inductor")`` to map frames of inductor-generated
    code back to the model's source; torch's lazy module loader turns that question into an import
    of torch._inductor and torch._dynamo, about a CPU-second and 70 MB in a process that
    never compiled anything -- paid by every rank that dumps. Before inductor is imported no frame
    can be inductor's, so for the length of the call, and on this thread only, the question is
    answered "no" (other threads keep torch's loader)."""
    import torch
    from torch._C._profiler import symbolize_tracebacks

    if "torch._inductor" in sys.modules:
        return symbolize_tracebacks(tracebacks)
    loader = torch.__dict__.get("__getattr__")
    if loader is None:  # a torch without lazy modules: nothing to keep out
        return symbolize_tracebacks(tracebacks)
    me = threading.get_ident()

    def lookup(name: str) -> Any:
        if name == "_inductor" and threading.get_ident() == me:
            raise AttributeError(name)
        return loader(name)

    torch.__dict__["__getattr__"] = lookup  # the module's own __getattr__ (PEP 562): torch's lazy modules
    try:
        return symbolize_tracebacks(tracebacks)
    finally:
        torch.__dict__["__getattr__"] = loader


def _walk(frame: Any) -> list[dict[str, Any]]:
    """A live thread's frames, innermost first (as many as the call path's and the shown ones can take)."""
    frames: list[dict[str, Any]] = []
    while frame is not None and len(frames) < 64:
        code = frame.f_code
        frames.append({"name": code.co_name, "filename": code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return frames


def _shown(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frames a dump lists: the call path's own (innermost) left out, at most FRAMES of the rest."""
    k = 0
    while k < len(frames) and os.path.normpath(frames[k]["filename"]).startswith(_CALL_PATH):
        k += 1
    return frames[k:k + _recorder.FRAMES]


def build(reason: str = "on demand") -> dict[str, Any]:
    """This rank's dump as a dict (torch's schema plus VCGA's keys; see the module docstring)."""
    recs = _recorder.recorders()
    rows: list[tuple[_recorder.Call, _recorder.FlightRecorder, int]] = []
    for pg_id, rec in enumerate(recs):
        for call in rec.calls():
            _observe(call)
            rows.append((call, rec, pg_id))
    rows.sort(key=lambda r: r[0].record_id)
    names = _thread_names()
    frames = _frames([c for c, _, _ in rows])
    entries = [_entry(c, rec, pg_id, f, names) for (c, rec, pg_id), f in zip(rows, frames, strict=True)]
    pg_config, pg_status, groups = {}, {}, {}
    for pg_id, rec in enumerate(recs):
        pg_config[rec.group_name] = {"name": rec.group_name, "desc": rec.group_desc, "ranks": str(rec.ranks)}
        calls = rec.calls()
        pg_status[str(pg_id)] = {
            "last_enqueued_collective": max((c.seq for c in calls), default=-1),
            "last_started_collective": max((c.seq for c in calls if c.started_ns is not None), default=-1),
            "last_completed_collective": max((c.seq for c in calls if c.state == "completed"), default=-1),
        }
        groups[rec.group_name] = {**rec.facts, "rank_in_group": rec.rank, "ranks": list(rec.ranks),
                                  "entries": rec.size, "recorded": rec.count}
    return {
        "version": VERSION,
        "comm_lib_version": "",
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": entries,
        "vcga": {"rank": _this_rank(), "pid": os.getpid(), "reason": reason, "time_ns": time.time_ns(),
                 "groups": groups},
    }


def dump(reason: str = "on demand", path: str | os.PathLike[str] | None = None) -> Path:
    """Write this rank's dump (atomically) and return its path."""
    from vcga.atomic import atomic_write_bytes

    target = Path(path) if path is not None else dump_path()
    with _lock:
        data = pickle.dumps(build(reason))
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, data)
    return target


def dump_quietly(reason: str) -> Path | None:
    """:func:`dump`, logging instead of raising (a dump must never be what fails a job)."""
    try:
        path = dump(reason)
    except Exception:  # logged: the failure being reported matters more
        log.warning("vcga: writing the flight recorder's dump (%s) failed", reason, exc_info=True)
        return None
    log.warning("vcga: flight recorder dumped to %s (%s); `vcga trace %s` analyzes every rank's dump",
                path, reason, path.parent)
    return path


def dump_on_failure(error: BaseException) -> Path | None:
    """The dump a collective timeout writes (on every rank that times out)."""
    first = str(error).splitlines()
    return dump_quietly(f"{type(error).__name__}: {first[0] if first else ''}")
