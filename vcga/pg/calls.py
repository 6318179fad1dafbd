"""How one call of the ``vcga`` process group reaches the library: :class:`CallPath`.

Every collective, point-to-point call and barrier of :class:`~vcga.process_group.VcgaProcessGroup`
goes through one :class:`CallPath`: it numbers the call (and in debug mode compares its
fingerprint first, :mod:`vcga.pg.debug`), takes the hot path straight to the native group when the
table calls the cell native and the tensors need no staging, or has the dispatcher
(:mod:`vcga.pg.dispatch`) issue the native calls, and wraps what was issued in a work whose
failures surface as typed errors (:class:`~vcga.errors.VcgaTimeoutError`,
:class:`~vcga.errors.VcgaCollectiveError`).

Hot path: a native cell with contiguous tensors goes straight to the native group, with no store
traffic and no copies; a synchronous call waits inline (failures become typed errors there) and
returns an already completed work.

Each collective is also recorded (:meth:`CallPath.record`): an entry of the group's flight
recorder, and a profiler span while a torch profiler runs (:mod:`vcga.pg.recorder`,
:mod:`vcga.pg.spans`). The call path reports when the call ended and with which typed error; the
process group dumps every recorder on a timeout (:mod:`vcga.pg.frdump`).
"""

from __future__ import annotations

import itertools
import re
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import profiler as _profiler
from torch.distributed import ReduceOp as _TorchReduceOp

from vcga.contract import Collective, ReduceOp
from vcga.errors import VcgaCollectiveError, VcgaError, VcgaPeerLostError, VcgaTimeoutError
from vcga.pg import recorder as _recorder
from vcga.pg.dispatch import Dispatcher, Steps
from vcga.pg.recorder import Call, FlightRecorder
from vcga.pypg import PyWork, reduce_op_of, waited_work

if TYPE_CHECKING:
    from vcga.pg.debug import FingerprintCheck

__all__ = ["CallPath"]

_SUM = _TorchReduceOp.SUM
_time_ns = time.time_ns  # a module global: one lookup on the hot path
_TIMEOUT = r"timed?[ _-]?out|timeout"  # matched on failures only (re caches it): no compilation at import
#: how the libraries report a peer whose process died: gloo ("Connection closed by peer", "Connection
#: reset by peer", a write's "Broken pipe"), NCCL ("remote process exited or there was a network error")
_PEER_LOST = r"(closed|reset) by peer|broken pipe|remote process exited"


class CallPath:
    """Sequence numbers, the hot path, dispatch and typed failures for one group's calls.

    :param rank: this rank in the group.
    :param size: the group's size.
    :param native: the native group (the transport's ``group``), called directly on the hot path.
    :param dispatcher: what issues a call that is not on the hot path.
    :param backend: the transport's backend name, in error messages.
    :param timeout_s: the collective timeout, in error messages.
    :param debug: the fingerprint check of debug mode, or None.
    :param recorder: the group's flight recorder, or None (switched off).
    """

    def __init__(self, rank: int, size: int, native: Any, dispatcher: Dispatcher, backend: str, timeout_s: float,
                 debug: FingerprintCheck | None = None, recorder: FlightRecorder | None = None) -> None:
        self.rank, self.size = rank, size
        self.d = dispatcher
        self.use_native(native)
        self.backend = backend
        self.timeout_s = timeout_s
        self.debug = debug
        self.recorder = recorder
        self.seqs = itertools.count(1)  # next() is atomic under the GIL: DDP issues from autograd threads
        #: works issued since start_coalescing, or None when not coalescing
        self.coalescing: list[Any] | None = None
        # collective -> (torch dtype, RedOpType or None) -> native? : the hot path's only lookup
        self._fast: dict[Collective, dict[tuple[Any, Any], bool]] = {c: {} for c in Collective}

    def use_native(self, group: Any) -> None:
        """Call ``group`` from now on, on the hot path and through the dispatcher alike."""
        self.native = self.d.group = group
        #: the native group runs steps the flight recorder notes (vcga.pg.recorder.stage): the bridge
        self.steps_below = bool(getattr(type(group), "records_steps", False))  # a closed group raises on any attribute

    def next(self, name: str, tensors: Any = None, op: ReduceOp | None = None, root: int | None = None) -> int:
        """The next sequence number; in debug mode, first compare this call's fingerprint
        (built only then: the hot path pays one counter increment)."""
        seq = next(self.seqs)
        if self.debug is not None:  # VCGA_DEBUG only
            from vcga.pg.debug import fingerprint

            self.debug.check(seq, fingerprint(name, tensors, op.value if op is not None else None, root))
        return seq

    def record(self, seq: int, op: str, inputs: tuple[Any, ...], outputs: tuple[Any, ...] | None = None,
               tensors: Sequence[torch.Tensor] = ()) -> Call | None:
        """Record call ``seq`` (torch's recorder's ``op`` name; ``inputs`` and ``outputs`` as
        ``((shape, dtype), ...)``, outputs None: the inputs) in the flight recorder, and open its
        span with ``tensors`` while a torch profiler runs. None when neither records."""
        rec = self.recorder
        profiled = _profiler._is_profiler_enabled  # vcga.pg.spans.recording(), inline: the hot path
        if rec is None and not profiled:
            return None
        if rec is not None:  # the caller's stack is not taken here: see Call.take_stack
            call = rec.record(seq, op, inputs, inputs if outputs is None else outputs)
        else:
            call = Call(seq, op, inputs, inputs if outputs is None else outputs)
        if profiled:  # spans' module only while a profiler runs: a job's start does not import it
            from vcga.pg.spans import open_span

            call.span = open_span(call, tensors)
        return call

    def translate(self, e: BaseException, name: str, seq: int | None) -> BaseException:
        """The typed error for a failure of the native library in call ``name``."""
        if isinstance(e, VcgaError):
            return e
        msg = str(e).strip()
        first = msg.splitlines()[0] if msg else type(e).__name__
        if isinstance(e, TimeoutError) or re.search(_TIMEOUT, msg, re.IGNORECASE):
            return VcgaTimeoutError(name, self.timeout_s, rank=self.rank, seq=seq,
                                    detail=f"{self.backend}: {first}")
        if isinstance(e, ConnectionError) or re.search(_PEER_LOST, msg, re.IGNORECASE):
            return VcgaPeerLostError(name, self.timeout_s, rank=self.rank, seq=seq, backend=self.backend,
                                     detail=first)
        where = f"{name}" + (f" (#{seq})" if seq is not None else "")
        return VcgaCollectiveError(f"{where} failed in the native library: {first}", rank=self.rank,
                                   backend=self.backend)

    def fast_native(self, coll: Collective, t: torch.Tensor, red: Any = None) -> bool:
        """Native cell and nothing to stage: the call can go straight to the library. ``red``: the
        call's ``torch.distributed.ReduceOp`` (its options' ``reduceOp``), None for a collective
        without one."""
        if red is None:
            key: tuple[Any, Any] = (t.dtype, None)
        elif red == _SUM:
            # SUM, nearly every call: its RedOpType is neither fetched (``.op`` makes a new pybind
            # object) nor hashed (through Python), ~0.4 us a call
            key = (t.dtype, "SUM")
        else:
            key = (t.dtype, red.op)
        ok = self._fast[coll].get(key)
        if ok is None:
            op = reduce_op_of(red)[0] if red is not None else None
            ok = self._fast[coll][key] = self.d.is_native(coll, t.dtype, op)
        return ok and t.is_contiguous()

    def issue(self, name: str, seq: int | None, build: Callable[[Steps], Any], result: Sequence[torch.Tensor],
              async_op: bool, call: Call | None = None) -> Any:
        """Run ``build(steps)`` (which issues the native calls) and wrap what it issued. ``call``
        (:meth:`record`) is this thread's current call meanwhile: the bridge carries it to the
        thread that runs the collective."""
        local = _recorder.local
        was = getattr(local, "call", None)
        local.call = call
        try:
            steps = self.translated(name, seq, build)
        except Exception as e:
            if call is not None:
                call.end(e)
            raise
        finally:
            local.call = was
        return self.wrap(name, seq, steps, result, async_op, call)

    def translated(self, name: str, seq: int | None, build: Callable[[Steps], Any]) -> Steps:
        """The steps ``build(steps)`` issued (for a caller that adds to them before :meth:`wrap`):
        refusals and argument errors raised as they are, the caller's to see; any other failure as
        the typed error (:meth:`translate`)."""
        steps = Steps()
        try:
            build(steps)
        except (VcgaError, ValueError, TypeError):
            raise
        except Exception as e:
            raise self.translate(e, name, seq) from e
        return steps

    def wrap(self, name: str, seq: int | None, steps: Steps, result: Sequence[torch.Tensor], async_op: bool,
             call: Call | None = None) -> Any:
        """The work for what ``steps`` issued (waited on here for a synchronous call)."""
        if len(steps.works) == 1 and not steps.finish and steps.source is None and not async_op:
            return self.wait_inline(steps.works[0], name, seq, call)
        source = steps.source
        work = PyWork(steps.works, steps.finish, result, translate=partial(self.translate, name=name, seq=seq),
                      source_rank=(lambda: source._source_rank()) if source is not None else None,
                      on_end=call.end if call is not None else None)
        if call is not None:
            call.work = weakref.ref(work)  # its state is read at a dump if nobody waited for it
            call.take_stack()  # off the hot path (or asynchronous): the stack costs nothing that shows
        if self.coalescing is not None:
            self.coalescing.append(work)
        if not async_op:
            work.wait()
        return work

    def wait_inline(self, work: Any, name: str, seq: int | None, call: Call | None = None) -> Any:
        """Wait for a synchronous call's one native work here (so a failure becomes a typed error)
        and hand back a completed work (:func:`~vcga.pypg.waited_work`), not the native one:
        torch's wrappers wait again on what they get, and gloo's reduce_scatter work copies its
        chunk into the output on every wait (a second wait is a second copy).
        Nothing is left to collect when coalescing: the call is complete."""
        try:
            work.wait()
        except Exception as e:
            err = self.translate(e, name, seq)
            if call is not None:
                call.end(err)
            raise err from e
        if call is not None:
            if call.ended_ns is None and call.span is None:  # Call.end of a plain call, inline: the hot path
                call.ended_ns = _time_ns()
            else:
                call.end()
        return waited_work()

    def wrap_async(self, work: Any, name: str, seq: int | None, result: Sequence[torch.Tensor],
                   call: Call | None = None) -> Any:
        """An asynchronous native call's work, wrapped so its failures surface as typed errors."""
        wrapped = PyWork([work], (), result, translate=partial(self.translate, name=name, seq=seq),
                         on_end=call.end if call is not None else None)
        if call is not None:
            call.work = weakref.ref(wrapped)  # its state is read at a dump if nobody waited for it
            call.take_stack()  # returns unfinished: the caller moves on
        if self.coalescing is not None:
            self.coalescing.append(wrapped)
        return wrapped

    def native_call(self, name: str, seq: int | None, fn: Callable[..., Any], *args: Any, async_op: bool,
                    result: Sequence[torch.Tensor], call: Call | None = None) -> Any:
        """The hot path: one native call, no staging. Where the native group runs steps of its own
        (the bridge), ``call`` is this thread's current call meanwhile: the bridge carries it to
        the thread that runs the collective."""
        if self.steps_below:
            fn = partial(_as_current, call, fn)
        try:
            work = fn(*args)
        except (ValueError, TypeError) as e:
            if call is not None:
                call.end(e)
            raise
        except Exception as e:
            err = self.translate(e, name, seq)
            if call is not None:
                call.end(err)
            raise err from e
        if not async_op:
            return self.wait_inline(work, name, seq, call)
        return self.wrap_async(work, name, seq, result, call)


def _as_current(call: Call | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``call`` as this thread's current call (:func:`vcga.pg.recorder.current`);
    :func:`vcga.pg.recorder.running` as a plain function: every bridged call passes here, and a
    generator-based context manager costs a microsecond a call."""
    local = _recorder.local
    was = getattr(local, "call", None)
    local.call = call
    try:
        return fn(*args)
    finally:
        local.call = was
