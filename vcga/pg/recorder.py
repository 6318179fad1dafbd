"""What each ``vcga`` group's last collectives were, and where they went: the flight recorder and
the profiler spans of one call.

Every collective of a :class:`~vcga.process_group.VcgaProcessGroup` becomes a :class:`Call` when
it is issued (:meth:`vcga.pg.calls.CallPath.record`): an entry of the group's ring buffer
(:class:`FlightRecorder`) holding its sequence number, op, sizes and dtypes, where it was called
from and when, its state (scheduled, started, completed) and -- on the bridge -- the stage it is
in. While torch's profiler records the calling thread the same object holds the call's span
(:mod:`vcga.pg.spans`). Entries are formatted (frames symbolized, sizes listed) only when a dump
is written (:mod:`vcga.pg.frdump`, loaded then): the hot path pays a counter, a clock read and a
ring slot refilled in place.

Where a call came from (its caller's stack, as torch's recorder takes it: :func:`where`) is taken
only while it can still matter, which keeps it off the synchronous hot path: an asynchronous call
takes it when it returns to its caller unfinished (the caller moves on), and so does a call off the
hot path (staged, several native calls); the hot path's synchronous call keeps its caller inside
until it ends, so a dump that finds it in flight (or failed, its error not yet out) reads the live
stack of its thread, and a failure takes it on that thread before the typed error leaves. A
synchronous call that completed on the hot path lists no frames (torch's recorder lists them for
every entry).

The ring has ``TORCH_FR_BUFFER_SIZE`` entries per group (torch's variable and default, 2000;
``TORCH_NCCL_TRACE_BUFFER_SIZE`` as torch also reads it; ``VCGA_FR_BUFFER_SIZE`` before both, for
VCGA's rings alone); 0 switches the recorder off.

Stages (:func:`stage`): the bridge's steps (in-vendor reduce-scatter, cross-vendor exchange,
in-vendor all-gather, ...) and compression's (encode, exchange, decode) run on the group's
communication threads; the call they belong to travels there as this module's thread-local
current call (:func:`current`, set by the work queue), so each step updates its call's entry and,
while a profiler records, opens a child span.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vcga.errors import VcgaConfigError, VcgaError

__all__ = ["Call", "FlightRecorder", "buffer_size", "configure", "current", "running", "stage", "recorders",
           "one", "described", "stacked", "new_call", "DEFAULT_ENTRIES", "DUMP_SIGNAL", "FILE_PREFIX"]

#: Entries per group where neither TORCH_FR_BUFFER_SIZE nor TORCH_NCCL_TRACE_BUFFER_SIZE is set
#: (torch's own default, FlightRecorder.hpp).
DEFAULT_ENTRIES = 2000

#: Every recorder of this process, for a dump (a group's recorder lives as long as the group).
_RECORDERS: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
#: Entry ids, process-wide and increasing, as torch numbers the entries of its one recorder: its
#: analyzer aligns the ranks' buffers on them.
_RECORD_IDS = itertools.count()
_time_ns, _get_ident = time.time_ns, threading.get_ident  # module globals: one lookup each on the hot path
local = threading.local()  # .call: the Call whose stages this thread runs now

#: frames kept per call, from the caller of the process group's method outwards
FRAMES = 10


#: VCGA's own size of its rings, read before torch's variables: torch's recorder is one per process
#: and records every call of torch's gloo and NCCL groups, the native groups under a ``vcga`` group
#: included, so ``TORCH_FR_BUFFER_SIZE=0`` with this set keeps one recorder of each call, VCGA's.
OWN_SIZE_VAR = "VCGA_FR_BUFFER_SIZE"


def buffer_size(env: Any = None) -> int:
    """Entries per group: :data:`OWN_SIZE_VAR` (``VCGA_FR_BUFFER_SIZE``), else
    ``TORCH_FR_BUFFER_SIZE``, else ``TORCH_NCCL_TRACE_BUFFER_SIZE``, else :data:`DEFAULT_ENTRIES`;
    0 switches the recorder off.

    :raises VcgaConfigError: a value that is not an integer >= 0."""
    env = os.environ if env is None else env
    for var in (OWN_SIZE_VAR, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        text = env.get(var)
        if text is None or not text.strip():
            continue
        try:
            n = int(text)
        except ValueError:
            n = -1
        if n < 0:
            raise VcgaConfigError(var, text, "an integer number of entries per group, >= 0 (0: no flight recorder)",
                                  f"env {var}")
        return n
    return DEFAULT_ENTRIES


#: config ``trace_dir`` of the last group created (None: TORCH_FR_DUMP_TEMP_FILE's prefix, else the temp dir)
trace_dir: str | None = None
#: the signal that makes every rank dump its recorder (installed where nothing else handles it)
DUMP_SIGNAL = "SIGUSR1"
#: dump file names: this prefix and the rank (torch's analyzer infers the prefix from the names)
FILE_PREFIX = "vcga_fr_trace_rank_"
_signal_installed = False
#: called with a recorded call and the typed error it ended with (the process group's: a timeout,
#: or a group's first failure, dumps the recorder)
on_failure: Callable[[Call, BaseException], None] | None = None


def configure(directory: str | None, on_signal: Callable[[int, Any], None]) -> None:
    """Where dumps go (config ``trace_dir``), and from the first group on :data:`DUMP_SIGNAL`
    runs ``on_signal`` (which writes a dump).

    The handler is installed only from the main thread and only where SIGUSR1 still has its
    default action: a handler the application (or its launcher) set stays. SIGTERM is never
    touched (torchrun stops workers with it). Python runs the handler in the main thread at its
    next bytecode: a rank blocked inside a native call dumps when that call returns or times out."""
    global trace_dir, _signal_installed
    trace_dir = directory
    if _signal_installed:
        return
    _signal_installed = True
    import signal

    sig = getattr(signal, DUMP_SIGNAL, None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, on_signal)
    except (ValueError, OSError):  # not the main interpreter, or the platform refuses
        pass


def recorders() -> list[FlightRecorder]:
    """The recorders of every group still open in this process, oldest first."""
    return sorted(_RECORDERS, key=lambda r: r.created)


def current() -> Call | None:
    """The call whose stages this thread runs now (set by the work queue and the call path)."""
    return getattr(local, "call", None)


@contextmanager
def running(call: Call | None) -> Iterator[None]:
    """Make ``call`` this thread's current call while the block runs (the previous one after)."""
    was = getattr(local, "call", None)
    local.call = call
    try:
        yield
    finally:
        local.call = was


class _Quiet:
    """What :func:`stage` returns when nothing times the step."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_QUIET = _Quiet()


class _Timed:
    """A step of a profiled call: its times, and a child span on this thread."""

    __slots__ = ("_call", "_step", "_span")

    def __init__(self, call: Call, name: str, tier: str, library: str) -> None:
        self._call = call
        self._step: list[Any] = [name, tier, library, 0, None]

    def __enter__(self) -> None:
        call, step = self._call, self._step
        step[3] = time.time_ns()
        if call.steps is None:
            call.steps = []
        call.steps.append(step)
        self._span = call.span.child(call, step)

    def __exit__(self, *exc: Any) -> None:
        self._step[4] = time.time_ns()
        self._call.span.end_child(self._span, self._step)


def stage(name: str, tier: str, library: str) -> Any:
    """One step of the current call: ``name`` (reduce_scatter, exchange, encode, ...) in ``tier``
    (in-vendor, cross-vendor, compress) by ``library`` (nccl, gloo, shared memory, topk, ...)::

        with stage("reduce_scatter", "in-vendor", "nccl"):
            ...

    The call's entry notes the step as the one it is in (a dump says where a hung call waits);
    while the call has a span, the step is timed and opens a child span on this thread
    (:mod:`vcga.pg.spans`). Without a current call (a step outside any ``vcga`` collective:
    calibration) it does nothing."""
    call = getattr(local, "call", None)
    if call is None:
        return _QUIET
    call.stage = (name, tier, library)
    if call.span is None:
        return _QUIET
    return _Timed(call, name, tier, library)


class Call:
    """One collective as the recorder and the profiler see it (see the module docstring).

    Times are ``time.time_ns()`` (the clock of torch's flight recorder); ``stage`` is the bridge or
    compression step entered last, ``(name, tier, library)``; a profiled call (``span``) also keeps
    its steps' times in ``steps``, ``[name, tier, library, start_ns, end_ns or None]`` each.
    """

    __slots__ = ("record_id", "seq", "op", "inputs", "outputs", "created_ns", "started_ns", "ended_ns",
                 "error", "traceback", "thread", "stage", "steps", "span", "work", "recorder", "__weakref__")

    def __init__(self, seq: int, op: str, inputs: tuple[Any, ...], outputs: tuple[Any, ...],
                 traceback: Any = None) -> None:
        self.fill(seq, op, inputs, outputs, traceback)

    def fill(self, seq: int, op: str, inputs: tuple[Any, ...], outputs: tuple[Any, ...], traceback: Any = None,
             recorder: FlightRecorder | None = None) -> None:
        """(Re)initialise this entry as call ``seq``: a ring slot is refilled in place (see
        :meth:`FlightRecorder.record`). The record id is set last: a dump that interrupts this
        (a signal) skips an entry without one and sees a refilled one whole, old or new.
        :meth:`FlightRecorder.record` writes this out for an ended entry it refills: a field added
        here is reset there too."""
        self.seq = seq
        self.op = op
        #: ((shape, dtype), ...) of the inputs and the outputs, in torch's recorder's convention;
        #: shapes as plain tuples (a torch.Size would keep the entry tracked by the collector)
        self.inputs = inputs
        self.outputs = outputs
        self.created_ns = _time_ns()
        self.started_ns: int | None = None
        self.ended_ns: int | None = None
        self.error: BaseException | None = None
        #: the caller's stack (:func:`where`); None: not taken (yet), (): none to take
        self.traceback = traceback
        #: the thread that issued the call (a synchronous call's stack is read there at a dump)
        self.thread = _get_ident()
        self.stage: tuple[str, str, str] | None = None
        self.steps: list[list[Any]] | None = None
        #: the profiler span (vcga.pg.spans.Span) while one records this call, else None
        self.span: Any = None
        #: a weak reference to the work of an asynchronous native call (its state is read at a dump)
        self.work: Any = None
        #: the ring it is in (None: not recorded, only profiled)
        self.recorder = recorder
        self.record_id = next(_RECORD_IDS)

    @property
    def state(self) -> str:
        """torch's recorder's states: completed, started or scheduled (a failed call stays where it failed)."""
        if self.ended_ns is not None and self.error is None:
            return "completed"
        return "started" if self.started_ns is not None else "scheduled"

    def take_stack(self) -> None:
        """Take the caller's stack now, unless taken already: a call that returns to its caller
        unfinished (asynchronous), or one that is not on the hot path."""
        if self.traceback is None:
            self.traceback = where(0)

    def _stack_if_caller(self) -> None:
        """On the thread that issued the call, take its stack if none was taken."""
        if self.traceback is None and self.thread == _get_ident():
            self.traceback = where(0)

    def start(self) -> None:
        if self.started_ns is None:
            self.started_ns = time.time_ns()

    def end(self, error: BaseException | None = None) -> None:
        """The call ended (``error`` None: completed). The first report counts; a typed error reported
        later replaces the library's own (the work queue sees the raw failure first)."""
        if self.ended_ns is not None:
            if isinstance(error, VcgaError) and self.error is not None and not isinstance(self.error, VcgaError):
                self.error = error
                self._stack_if_caller()  # the caller, its typed error on the way out
                if on_failure is not None and self.recorder is not None:
                    on_failure(self, error)
            return
        self.ended_ns = _time_ns()
        if error is None:  # the common case first: one test
            if self.span is not None:
                self.span.close(self)
            return
        self.error = error
        self._stack_if_caller()  # a synchronous call failing: its caller is still on this stack
        if self.span is not None:
            self.span.close(self)
        if on_failure is not None and self.recorder is not None:
            on_failure(self, error)

    def __repr__(self) -> str:
        return f"Call(#{self.seq} {self.op} {self.state})"


class FlightRecorder:
    """One group's ring buffer of :class:`Call` entries.

    :param entries: ring size (> 0).
    :param group_name: the group's name (torch's ``pg_name``); :param group_desc: its description.
    :param ranks: the group's global ranks; :param rank: this rank in the group.
    :param library: the collective library this rank's calls run on, in torch's recorder's names
        (nccl, hccl, gloo, ...): the prefix of every entry's ``profiling_name``.
    :param facts: what a dump adds about this rank (backend, vendor, transport).
    :param timeout_s: the group's collective timeout.
    """

    def __init__(self, entries: int, group_name: str, group_desc: str, ranks: Sequence[int], rank: int,
                 library: str, facts: dict[str, Any], timeout_s: float) -> None:
        self.size = entries
        self.ring: list[Call | None] = [None] * entries
        self.count = 0  # calls recorded so far (the next slot is count % size)
        self.group_name, self.group_desc = group_name, group_desc
        self.ranks, self.rank = list(ranks), rank
        self.library = library
        self.facts = dict(facts)
        self.timeout_s = timeout_s
        #: a collective of this group failed (its first failure dumped the recorder)
        self.failed = False
        self.created = next(_RECORD_IDS)
        _RECORDERS.add(self)

    def add(self, call: Call) -> None:
        # two threads recording at once may share a slot; each call still has its own record_id
        # and the ring stays a list of calls (torch's recorder takes a mutex for the same race)
        i = self.count
        self.count = i + 1
        self.ring[i % self.size] = call

    def record(self, seq: int, op: str, inputs: tuple[Any, ...], outputs: tuple[Any, ...]) -> Call:
        """The entry for call ``seq``, in the ring: the oldest entry itself refilled in place once it
        has ended, so a long job adds no objects. (Entries that outlive the collector's young
        generations are what makes it run full collections: with a fresh object per call, one
        full collection of a torch process every few ten thousand calls, ~2 us a call.) An entry
        still running, or holding a profiler span, keeps its object for whoever holds it; the
        ring takes a new one."""
        i = self.count
        self.count = i + 1
        j = i % self.size
        call = self.ring[j]
        if call is None or call.ended_ns is None or call.span is not None:
            call = self.ring[j] = Call.__new__(Call)
            call.fill(seq, op, inputs, outputs, None, self)  # positional: keywords cost on every call
            return call
        # Call.fill, written out: a bridged call's hooks cost in proportion to the Python calls
        # they make (docs/debugging.md, "What the recorder and the hooks cost")
        call.seq = seq
        call.op = op
        call.inputs = inputs
        call.outputs = outputs
        call.created_ns = _time_ns()
        call.started_ns = call.ended_ns = call.error = call.traceback = call.stage = call.steps = call.work = None
        call.thread = _get_ident()
        call.record_id = next(_RECORD_IDS)  # last, as in Call.fill
        return call

    def calls(self) -> list[Call]:
        """The calls in the ring, oldest first."""
        ring = list(self.ring)  # a copy taken under the GIL: a call recorded meanwhile is left out or in
        filled = [c for c in ring if c is not None and getattr(c, "record_id", None) is not None]
        return sorted(filled, key=lambda c: c.record_id)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank] if self.rank < len(self.ranks) else self.rank


def where(depth: int) -> Any:
    """This thread's Python stack, as torch's own recorder takes it
    (``torch._C._profiler.gather_traceback``: code objects and offsets read in C++, about half a
    microsecond; walking ``sys._getframe`` in Python made a frame object for every frame on the
    way, several microseconds a call). Symbolized only at a dump (:mod:`vcga.pg.frdump`), without
    the call path's own frames and at most :data:`FRAMES` of the rest. ``depth`` is kept for the
    callers' bookkeeping: the frames it would skip are the call path's, dropped at the dump."""
    gather = _gather_traceback
    if gather is None:
        gather = _bind_gather()
    return gather(True, False, False)


_gather_traceback: Any = None  # bound on first use: this module is imported without torch (vcga trace)


def _bind_gather() -> Any:
    global _gather_traceback
    from torch._C._profiler import gather_traceback

    _gather_traceback = gather_traceback
    return gather_traceback


def new_call(recorder: FlightRecorder | None, seq: int, op: str, inputs: tuple[Any, ...],
             outputs: tuple[Any, ...], depth: int = 1) -> Call:
    """A :class:`Call` with its caller's frames (``depth`` frames above this function's caller),
    added to ``recorder``'s ring if given."""
    if recorder is None:
        return Call(seq, op, inputs, outputs, ())
    call = recorder.record(seq, op, inputs, outputs)
    call.traceback = where(depth + 1)
    return call


def one(t: Any) -> tuple[Any, ...]:
    """``((shape, dtype),)`` of one tensor: an entry's inputs or outputs (a plain tuple: see
    :attr:`Call.inputs`)."""
    return ((tuple(t.shape), t.dtype),)


def described(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """``((shape, dtype), ...)`` of ``tensors``: an entry's inputs or outputs."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def stacked(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """A list of equal tensors as torch's recorder lists it: one ``(n, *shape)`` entry (all_gather's
    outputs, reduce_scatter's inputs; the analyzer checks their element count against the group size)."""
    if not tensors:
        return ()
    t = tensors[0]
    return (((len(tensors), *t.shape), t.dtype),)  # a plain tuple: see Call.inputs
