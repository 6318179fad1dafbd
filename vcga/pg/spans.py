"""torch profiler spans for the ``vcga`` group's calls, and the steps of each on other threads.

A call issued while torch's profiler records the calling thread gets a span named as torch names
a backend's calls, ``vcga:<op>`` (``gloo:all_reduce`` for gloo), opened on that thread with the
call's input tensors (their shapes appear with ``record_shapes=True``) and closed when the call
ends -- in whichever thread sees it end: torch's ``_call_end_callbacks_on_jit_fut`` runs the end
with the opening thread's profiler state, so the span lands on the calling thread's track with
its true length.

The bridge's and compression's steps run on the group's communication threads. torch's profiler
records a thread only if it was enabled there, or for every thread with
``torch.profiler.profile(experimental_config=torch._C._profiler._ExperimentalConfig(
profile_all_threads=True))``; torch offers no other way to let a thread join a session from
Python (its C++ ``enableProfilerInChildThread`` is not bound, and called through ctypes it
replaces the session's callback handle: the calling thread's callbacks leak). So each step opens
a ``record_function`` on its own thread -- recorded where torch records that thread -- and every
span also keeps its steps' times here (:data:`FINISHED`): :func:`vcga.profiling.export_chrome_trace`
adds to a Chrome trace the flow arrows from each call to its steps, and the steps themselves
where torch did not record their thread.

Nothing here runs unless a torch profiler runs in the process: :func:`recording` is one module
attribute read otherwise.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import profiler as _profiler

if TYPE_CHECKING:
    from vcga.pg.recorder import Call

__all__ = ["recording", "Span", "open_span", "FINISHED", "span_name", "step_name"]

#: Spans that ended, newest last (bounded): what :func:`vcga.profiling.export_chrome_trace` links.
FINISHED: collections.deque[Span] = collections.deque(maxlen=100_000)

_enter = torch._C._autograd._record_function_with_args_enter
_end_on = torch.ops.profiler._call_end_callbacks_on_jit_fut
_enter_step = torch.ops.profiler._record_function_enter_new
_exit_step = torch.ops.profiler._record_function_exit

#: The op names torch's recorder uses (vcga.pg.recorder) -> the name of the span.
_SPAN_OPS = {"_reduce_scatter_base": "reduce_scatter", "_all_gather_base": "all_gather",
             "allreduce_coalesced": "all_reduce_coalesced", "reduce_scatter_tensor_coalesced":
             "reduce_scatter_coalesced", "all_gather_into_tensor_coalesced": "all_gather_coalesced"}


def recording() -> bool:
    """Whether a torch profiler runs in this process now (torch.profiler and torch.autograd's set
    this flag). Whether it records the calling thread -- its own thread, or every thread with
    ``profile_all_threads`` (where ``torch.autograd._profiler_enabled()`` says False even on the
    profiling thread) -- torch's record function decides: a span it does not record costs a few
    microseconds, only while some profiler runs."""
    return bool(_profiler._is_profiler_enabled)


def span_name(op: str) -> str:
    return "vcga:" + _SPAN_OPS.get(op, op)


def step_name(step: list[Any]) -> str:
    """``vcga:<tier> <name> (<library>)``, e.g. ``vcga:in-vendor reduce_scatter (nccl)``."""
    name, tier, library = step[0], step[1], step[2]
    return f"vcga:{tier} {name} ({library})"


class Span:
    """A call's span: the torch record on the calling thread, and its steps' times.

    ``steps``: ``(thread native id, name, start_ns, end_ns)`` of each step, for the Chrome trace's
    flow arrows (:func:`vcga.profiling.export_chrome_trace`)."""

    __slots__ = ("name", "tid", "start_ns", "end_ns", "steps", "_done", "seq")

    def __init__(self, name: str, seq: int) -> None:
        self.name, self.seq = name, seq
        self.tid = threading.get_native_id()
        self.start_ns = time.time_ns()
        self.end_ns: int | None = None
        self.steps: list[tuple[int, str, int, int]] = []
        self._done: torch.futures.Future | None = None

    def close(self, call: Call) -> None:
        """End the span (any thread; once)."""
        done, self._done = self._done, None
        if done is None:
            return
        self.end_ns = time.time_ns()
        FINISHED.append(self)
        done.set_result(None)  # runs the record's end callbacks here, with the opening thread's profiler state

    def child(self, call: Call, step: list[Any]) -> Any:
        return _enter_step(step_name(step), None)

    def end_child(self, rec: Any, step: list[Any]) -> None:
        _exit_step._RecordFunction(rec)
        self.steps.append((threading.get_native_id(), step_name(step), step[3], step[4]))


def open_span(call: Call, tensors: Any) -> Span:
    """Open ``call``'s span on this thread (the profiler records it: :func:`recording`)."""
    span = Span(span_name(call.op), call.seq)
    rec = _enter(span.name, *tensors)
    done: torch.futures.Future = torch.futures.Future()
    _end_on._RecordFunction(rec, done)
    span._done = done
    return span
