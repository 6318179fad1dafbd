"""Building blocks for process groups written in Python.

Part of the public core API: the ``vcga`` process group (:mod:`vcga.process_group`) and any plugin
whose native group is a Python ``torch.distributed.ProcessGroup`` (the simulated vendors, a
mixed-vendor bridge) share these pieces instead of importing each other.

- :class:`PyWork` -- the work object such groups return: it waits for the native works it wraps,
  then runs the completion steps (copy a staging buffer back, divide by the group size, cast back
  from an upcast), translates failures into typed errors, and offers a future whose value is the
  output tensors, exactly as torch's own backends do (DDP's reducer relies on that value).
- :func:`reduce_op_of` / :func:`torch_reduce_op` -- between ``torch.distributed.ReduceOp`` (with
  the PREMUL_SUM factor) and :class:`vcga.contract.ReduceOp`.
- :func:`options` -- fill a c10d options struct in one call.

This module imports torch; import it only where torch is needed (never from ``vcga/__init__``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from vcga.contract import ReduceOp
from vcga.errors import adopt_torch_bases

log = logging.getLogger("vcga.work")

# The collective errors are torch's DistBackendError too, from here on (torch is loaded).
adopt_torch_bases(dist.DistBackendError)

__all__ = [
    "PyWork",
    "completed_work",
    "failed_future",
    "reduce_op_of",
    "torch_reduce_op",
    "options",
    "timeout_given",
    "Translate",
    "run_counted",
]

#: Turns an exception raised by a native library into the exception the caller should see.
Translate = Callable[[BaseException], BaseException]

_RED_OP_NAMES: dict[Any, ReduceOp] = {getattr(dist.ReduceOp.RedOpType, op.value): op for op in ReduceOp}


def reduce_op_of(torch_op: Any) -> tuple[ReduceOp, Any]:
    """``(op, factor)`` for a ``torch.distributed.ReduceOp`` (or its ``RedOpType``).

    ``factor`` is the PREMUL_SUM multiplier (a Python number or a tensor), else None.
    """
    kind = getattr(torch_op, "op", torch_op)
    op = _RED_OP_NAMES[kind]
    factor = getattr(torch_op, "factor", None) if op is ReduceOp.PREMUL_SUM else None
    return op, factor


def torch_reduce_op(op: ReduceOp, factor: Any = None) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op`` (PREMUL_SUM needs ``factor``)."""
    if op is ReduceOp.PREMUL_SUM:
        if factor is None:
            raise ValueError("PREMUL_SUM needs its factor")
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, op.value)


_OPTIONS = {
    "allreduce": _c10d.AllreduceOptions,
    "allreduce_coalesced": _c10d.AllreduceCoalescedOptions,
    "reduce": _c10d.ReduceOptions,
    "reduce_scatter": _c10d.ReduceScatterOptions,
    "broadcast": _c10d.BroadcastOptions,
    "allgather": _c10d.AllgatherOptions,
    "gather": _c10d.GatherOptions,
    "scatter": _c10d.ScatterOptions,
    "alltoall": _c10d.AllToAllOptions,
    "barrier": _c10d.BarrierOptions,
}


def options(kind: str, *, like: Any = None, op: ReduceOp | None = None, factor: Any = None,
            root: int | None = None) -> Any:
    """A fresh c10d options struct of ``kind`` ("allreduce", "reduce", "broadcast", ...).

    :param like: copy ``timeout`` and ``asyncOp`` from these options (the caller's).
    :param op: the reduce op to set (with ``factor`` for PREMUL_SUM).
    :param root: the root rank to set (broadcast, reduce, gather, scatter).
    """
    o: Any = _OPTIONS[kind]()  # one of c10d's option structs, each with its own fields
    if like is not None:
        o.timeout = like.timeout
        o.asyncOp = like.asyncOp
    if op is not None:
        o.reduceOp = torch_reduce_op(op, factor)
    if root is not None:
        o.rootRank = root
    return o


def timeout_given(timeout: Any) -> timedelta | None:
    """A wait timeout the caller actually set, or None.

    torch passes ``timedelta(0)`` (``kNoTimeout``) from C++ and leaves options at ``-1 ms``
    (``kUnsetTimeout``) when nobody set one.
    """
    if timeout is None or not isinstance(timeout, timedelta):
        return None
    return timeout if timeout > timedelta(0) else None


class PyWork(dist._Work):
    """A work object over zero or more native works plus completion steps.

    :param works: native works (c10d ``Work`` objects) to wait for, in issue order.
    :param finish: completion steps, run once, in order, after every native work succeeded.
    :param result: the output tensors: the value of :meth:`get_future` and :meth:`result`.
    :param translate: maps a native failure to the error the caller sees (typed VCGA errors).
    :param source_rank: for receives from any source: a callable giving the sender's rank.
    :param on_end: called once when the work has ended, with None or the error its waiters get
        (the ``vcga`` group's flight recorder and profiler spans learn so when a call ended).
    """

    def __init__(self, works: Sequence[Any] = (), finish: Sequence[Callable[[], Any]] = (),
                 result: Sequence[torch.Tensor] | None = None, translate: Translate | None = None,
                 source_rank: Callable[[], int] | None = None,
                 on_end: Callable[[BaseException | None], Any] | None = None) -> None:
        super().__init__()
        self._works = list(works)
        self._finish = list(finish)
        self._result = list(result) if result is not None else []
        self._translate = translate
        self._source = source_rank
        self._lock = threading.Lock()
        self._done = not self._works and not self._finish
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._futs: list[torch.futures.Future] | None = None
        #: per native work, the future its watcher thread completes (None: the work has its own future)
        self._watchers: list[torch.futures.Future | None] | None = None
        self._on_end = on_end
        if self._done and on_end is not None:
            self._ended()

    def _ended(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            try:
                on_end(self._error)
            except Exception:  # logged: bookkeeping must never fail the collective
                log.debug("vcga: a work's end hook failed", exc_info=True)

    # -- completion ------------------------------------------------------------------------------

    def _complete(self) -> None:
        """Run the completion steps once (thread-safe: a future callback and wait() may race)."""
        with self._lock:
            if self._done:
                return
            try:
                for step in self._finish:
                    step()
            except BaseException as e:  # noqa: BLE001 - recorded and re-raised to every waiter
                self._error = self._as_error(e)
            finally:
                self._done = True
        self._ended()
        if self._error is not None:
            raise self._error

    def _as_error(self, e: BaseException) -> BaseException:
        if self._translate is None:
            return e
        out = self._translate(e)
        if out is not e and out.__cause__ is None:
            out.__cause__ = e
        return out

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = self._as_error(e)
            self._done = True
        self._ended()
        raise self._error

    # -- the Work interface ----------------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until every native work finished and the completion steps ran.

        :raises: the translated error of the first failing step, on every call.
        """
        if not self._done:
            limit = timeout_given(timeout)
            watched = self._watchers  # set once, under the lock, by _watched()
            try:
                for j, w in enumerate(self._works):
                    by_watcher = watched[j] if watched is not None else None
                    if by_watcher is not None:
                        # A watcher thread already waits on this work; waiting on it again would
                        # repeat its completion (gloo's reduce_scatter work copies its chunk into
                        # the output on every wait). The watcher's future carries its outcome.
                        by_watcher.wait()
                    elif limit is None:
                        w.wait()
                    else:
                        w.wait(limit)
            except BaseException as e:  # noqa: BLE001 - translated, recorded, re-raised
                self._fail(e)
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(w.is_completed() or (f is not None and f.done())
               for w, f in zip(self._works, self._watched(), strict=True)):
            try:
                self.wait()  # every native work finished: this only runs the completion steps
            except BaseException:  # noqa: BLE001 - recorded; wait() and exception() report it
                pass
            return True
        return False

    def _watched(self) -> list[torch.futures.Future]:
        """Per native work: its future, or for a work without one a future a watcher completes.

        Some native works can only be waited on: gloo's reduce_scatter work (torch 2.13) never
        reports ``is_completed()`` and raises on ``get_future()``. A poll loop on it would spin
        forever and DDP-style ``get_future().then(...)`` code would fail, so such a work gets a
        daemon thread that waits for it and completes a future. Started on first need only: code
        that just calls ``wait()`` never pays for it."""
        with self._lock:
            if self._futs is None:
                pairs = [_future_of(w) for w in self._works]
                self._watchers = [f if by_watcher else None for f, by_watcher in pairs]
                self._futs = [f for f, _ in pairs]
        return self._futs

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return list(self._result)

    def synchronize(self) -> None:
        for w in self._works:
            w.synchronize()

    def _source_rank(self) -> int:
        if self._source is None:
            raise RuntimeError("source rank is only known for a receive from any source")
        self.wait()
        return self._source()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors once the work (and its steps) finished."""
        if self._future is None:
            if not self._works:
                try:
                    self.wait()
                except BaseException as e:  # noqa: BLE001
                    self._future = failed_future(e)
                else:
                    self._future = torch.futures.Future()
                    self._future.set_result(self._result)
            else:
                futs = self._watched()
                base = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
                # Done already: torch runs the callback right here, in this thread. Otherwise it
                # runs in the thread that completes the future: counted for the exit drain.
                self._future = base.then(self._on_native_done if base.done() else _NativeDone(self))
                _check_at_backward_end(self)
        return self._future

    def _on_native_done(self, fut: torch.futures.Future) -> list[torch.Tensor]:
        try:
            value = fut.value()
            if isinstance(value, list) and value and isinstance(value[0], torch.futures.Future):
                for f in value:  # collect_all: surface the first failure
                    f.value()
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        self._complete()
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self._done else "pending")
        return f"PyWork({len(self._works)} native, {len(self._finish)} steps, {state})"


# -- typed errors through the autograd engine ------------------------------------------------------
#
# DDP's reducer takes a work's future during backward and waits on it in its final callback; a
# failure reaches `loss.backward()`'s caller as whatever that C++ future holds. A Python backend can
# only fail such a future through a `then()` callback, and torch turns the callback's exception into
# a plain RuntimeError ("Got the following error when running the callback: ...") there. A Python
# callback queued on the autograd engine keeps its exception intact instead: the engine carries it
# (torch's python_error) back to the caller as the same object. So a work whose future is taken
# during a backward pass is also waited on by one such callback per backward pass, queued before
# DDP's (DDP queues its own once every bucket was issued): it re-raises the work's typed error --
# a VcgaTimeoutError that is also torch's DistBackendError -- where DDP would have raised the wrapper.

_backward = threading.local()  # .task: (graph task id, the works to check at its end)


def _check_at_backward_end(work: PyWork) -> None:
    task = torch._C._current_graph_task_id()
    if task < 0:
        return
    held = getattr(_backward, "task", None)
    if held is None or held[0] != task:
        works: list[PyWork] = []
        _backward.task = (task, works)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_raise_typed, works))
        except RuntimeError:  # not inside a backward pass after all (a graph task outside the engine)
            _backward.task = None
            return
    else:
        works = held[1]
    works.append(work)


def _raise_typed(works: list[PyWork]) -> None:
    """At the end of a backward pass: the first failure among ``works``, typed (see above)."""
    _backward.task = None
    try:
        for w in works:
            w.wait()
    finally:
        works.clear()


def failed_future(error: BaseException) -> torch.futures.Future:
    """A completed future that failed with ``error`` for every consumer, C++ ones included.

    ``Future.set_exception`` is not that: it stores the exception as the future's *value* and only
    Python's ``wait()`` raises it. DDP's reducer, or a ``Work`` made from the future, reads the value:
    the work reports success, or DDP fails with "Unable to cast <exception> to Tensor". A callback
    that raises inside ``then()`` marks the chained future failed in C++ as well; its waiters get
    torch's wrapper ("Got the following error when running the callback: ..."), as from a work whose
    native works failed (``_on_native_done``), and :func:`vcga.errors.typed` recovers ``error``.
    """
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)

    def _raise(_: torch.futures.Future) -> None:
        raise error

    return done.then(_raise)


# -- leaving the process with work in flight -------------------------------------------------------
#
# torch runs a Python callback of a native future in the thread that completes the future (gloo's
# worker) and then destroys it there, taking the GIL in a ``noexcept`` destructor
# (``PythonFunctionGuard``); a watcher thread (below) returns from a native ``wait()`` into a
# ``noexcept`` GIL re-acquisition too. If the interpreter has begun finalizing by then, Python 3.11
# ends that thread with ``pthread_exit`` and the process aborts ("terminate called without an
# active exception") -- plain gloo with a ``then`` does the same. It happens when a process leaves
# with a collective in flight, or within a few ms of one completing. So both are counted while
# they exist, and an atexit hook -- atexit runs before finalization -- waits for the count to drop.
#
# A counted thread must drop every native object it holds *before* it leaves the count: what it
# still holds after ``_release()`` goes when the thread finishes (``threading.Thread.run`` deletes
# its target, and with it the closure), and by then the drain may have returned and the interpreter
# begun to finalize. Dropping the last reference to a c10d ``Work`` (or a group) goes through
# torch's ``IntrusivePtrNoGilDestructor``: it releases the GIL, runs the C++ destructor (freeing the
# work's tensors) and takes the GIL back in ``~gil_scoped_release`` -- ``noexcept``; if finalization
# began meanwhile, Python ends the thread there and the process aborts ("terminate called without an
# active exception": a rare SIGABRT of tests/exit_soak.py, after correct results). So the counted
# threads all start through :func:`run_counted`, which holds their function (and what it holds)
# only in a box it empties, lets go of it, and only then calls ``_release()``; what runs after that
# touches no native object.

_IN_FLIGHT = threading.Condition()
_LIVE = [0]  # callbacks and watchers alive
#: how long a leaving process waits for callbacks and watchers of collectives still in flight
EXIT_DRAIN_SECONDS = 10.0


def _forget_in_child() -> None:
    """After a fork: the child has none of the parent's threads, so nothing of the count is its
    own (a child that exits normally would wait for them in vain); the lock may have been held by
    a thread that does not exist here."""
    global _IN_FLIGHT
    _IN_FLIGHT = threading.Condition()
    _LIVE[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _hold() -> None:
    with _IN_FLIGHT:
        _LIVE[0] += 1


def _release() -> None:
    if _IN_FLIGHT is None:  # module globals already cleared (a late collection at exit)
        return
    with _IN_FLIGHT:
        _LIVE[0] -= 1
        _IN_FLIGHT.notify_all()


def _drain_at_exit(limit: float | None = None) -> bool:
    """atexit hook: wait (GIL released) until nothing counted is alive, at most ``limit`` seconds
    (:data:`EXIT_DRAIN_SECONDS`), so a thread that needs the GIL for it still gets it; then warn.
    True if nothing was left."""
    limit = EXIT_DRAIN_SECONDS if limit is None else limit
    with _IN_FLIGHT:
        done = _IN_FLIGHT.wait_for(lambda: _LIVE[0] <= 0, timeout=limit)
        left = _LIVE[0]
    if not done:
        log.warning("vcga: leaving with %d collective(s) still in flight after waiting %.0f s; "
                    "wait for every work (or destroy_process_group()) before exiting", left, limit)
    return done


#: Run at exit after the drain: vcga.process_group shuts down the groups a script left open.
_AFTER_DRAIN: list[Callable[[], None]] = []


def _at_exit() -> None:
    _drain_at_exit()  # returns at once when nothing is in flight
    for fn in _AFTER_DRAIN:
        fn()


atexit.register(_at_exit)


def run_counted(fn: Callable[[], Any], name: str) -> threading.Thread:
    """Run ``fn`` in a daemon thread counted by the exit drain (see above), and drop it -- with
    what it holds -- before the thread leaves the count.

    For a work's watcher (:func:`_future_of`) and for teardown that may block on a collective still
    running in a native library (a group's destructor joins its worker threads): the caller returns
    at once, and a process that exits meanwhile gives it up to :data:`EXIT_DRAIN_SECONDS` before it
    finalizes."""

    box = [fn]  # the thread's only reference: gone before _release() (see above)

    def run() -> None:
        try:
            box.pop()()
        except BaseException:  # teardown is best effort; nobody waits for a result
            log.debug("vcga: %s failed", name, exc_info=True)
        finally:
            _release()

    _hold()
    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


class _NativeDone:
    """The callback a :class:`PyWork` hangs on its native future, counted while it exists (see
    above: torch destroys it in the thread that completed the future)."""

    __slots__ = ("_work",)

    def __init__(self, work: PyWork) -> None:
        self._work = work
        _hold()

    def __call__(self, fut: torch.futures.Future) -> list[torch.Tensor]:
        work = self._work
        # A failure's traceback keeps this frame alive (the work records the error): it must not
        # keep the callback alive too, or the count would not drop when torch releases it.
        del self
        return work._on_native_done(fut)

    def __del__(self) -> None:
        # The work (and its native works) goes first, while still counted (see above): the slot
        # would otherwise be cleared only after __del__ returns, past the drain.
        del self._work
        _release()


def _complete(work: Any, fut: torch.futures.Future) -> None:
    """A watcher's body (:func:`_future_of`): wait for ``work``, complete ``fut`` with the outcome."""
    try:
        work.wait()
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        fut.set_exception(e)
    else:
        fut.set_result(None)
    finally:
        # a failure's traceback keeps this frame alive in the future: not the work with it (its
        # destructor must run now, while the thread is counted; see above)
        del work, fut


def _future_of(work: Any) -> tuple[torch.futures.Future, bool]:
    """``(work.get_future(), False)``, or -- for a work that has none -- ``(a future completed by a
    daemon thread that waits for the work, True)`` (see :meth:`PyWork._watched`). The watcher is
    counted until it has finished (see above)."""
    try:
        return work.get_future(), False
    except RuntimeError as e:
        if "not implemented" not in str(e).lower():
            raise
    fut: torch.futures.Future = torch.futures.Future()
    run_counted(functools.partial(_complete, work, fut), "vcga-work-watch")
    return fut, True


def completed_work(result: Sequence[torch.Tensor] = ()) -> PyWork:
    """A work that is already complete (nothing to communicate: world of one, empty input...)."""
    return PyWork(result=result)


_WAITED: PyWork | None = None


def waited_work() -> PyWork:
    """The handle a synchronous call returns after it waited inline: one shared, completed work
    with an empty result.

    torch's wrappers (``dist.all_reduce(..., async_op=False)`` and the rest) call ``wait()`` on
    what a group returns and then drop it; a fresh work per call would cost an allocation on the
    hottest path for nothing, and handing back the native work is wrong where its ``wait()`` is
    not idempotent (gloo's reduce_scatter work copies its chunk into the output on every wait)."""
    global _WAITED
    if _WAITED is None:
        _WAITED = PyWork()
    return _WAITED
