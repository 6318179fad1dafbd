"""One ordered queue of collectives per group, run by one communication thread.

A process group written in Python runs a collective in the caller's thread unless something else
runs it. The mixed-vendor bridge (:mod:`vcga.bridge`) hands each of its collectives to a
:class:`WorkQueue` instead: the call returns at once with a :class:`QueuedWork`, and the queue's
thread runs the collectives one after the other, in the order they were issued. That is what lets
DDP's reducer overlap its bucket all_reduces with the backward pass, as it does on NCCL and gloo
(whose own worker threads run their collectives).

Why one thread per group and strict issue order: every rank issues a group's collectives in the
same order (torch.distributed requires it), so every rank's thread runs them in that order too --
no two ranks can ever wait for each other in different collectives. Two threads per group could
run two collectives in different orders on different ranks and deadlock.

- A synchronous call (``async_op=False``) on an idle queue runs in the caller's thread: no thread
  switch on the hot path, and still in order (nothing is queued before it, and nothing queued
  after it starts until it ends). Behind queued work it waits its turn like any other.
- A failure fails its work (raised, typed, by :meth:`QueuedWork.wait`) and *poisons* the queue:
  every collective still queued, and every later one, fails at once with an error naming the
  first failure. After a timeout or a lost peer the ranks no longer agree on where they are in the
  sequence, so running on would only mismatch collectives (NCCL aborts its communicator there).
- Each queued collective is counted for the exit drain of :mod:`vcga.pypg` until it has ended and
  its future's callbacks have run: a process that leaves with collectives in flight waits for
  them (bounded) instead of aborting when the thread comes back from a native call during
  interpreter finalization.
- A collective that calls another collective of the same queue (all_to_all through
  all_to_all_single) runs it in place, as part of its own job; so does a collective issued by a
  future callback that this thread runs (torch's ``powerSGD_hook`` chains its all_reduces that
  way and waits inside the callback).
- The thread does not survive a fork; a forked child that uses the queue gets a typed error.

**Two stages** (:class:`Continuation`): a collective issued with ``touches`` (the byte ranges it
reads and writes) may return a :class:`Continuation` from its first stage; its second stage then
runs on a second thread, in issue order too, while the first thread goes on with the next
collective's first stage. The bridge pipelines consecutive all_reduces that way (the next one's
in-group reduce-scatter and exchange overlap the previous one's exchange and in-group all-gather),
each stage on communicators of its own, so every rank still issues each communicator's operations
in the same order. The first thread *drains* -- waits until every second stage has ended, its
callbacks run -- before a collective without ``touches`` (it may use any communicator) and before
one whose ranges overlap a collective still in its second stage (it would read what that one has
not written yet): those run exactly as with one thread. A collective issued from a callback on the
second thread runs in place there, both its stages.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vcga import pypg
from vcga.errors import VcgaCollectiveError, VcgaError
from vcga.pg.recorder import Call, local

_time_ns = time.time_ns

__all__ = ["WorkQueue", "QueuedWork", "Continuation"]

log = logging.getLogger(__name__)


class QueuedWork(dist._Work):
    """The work of one queued collective: completed by the queue's thread.

    :meth:`wait` raises the collective's error (or the queue's first one). Its future's value is
    the output tensors, as torch's own backends give it (DDP's reducer reads it).
    """

    def __init__(self, result: Sequence[torch.Tensor], limit: float, call: Call | None = None) -> None:
        super().__init__()
        self._call = call  # the flight recorder's entry and profiler span of this collective, or None
        self._result = list(result)
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        self._limit = limit  # seconds a wait without its own timeout may take at most

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        if self._call is not None:
            self._call.end(error)  # ended now: the recorder's state, and the span closes here
        # The future first, then the work, as torch's gloo does (finishWorkGloo: the future is
        # completed, then finish()): once wait() returns, get_future() is done and every callback
        # hung on it has run. Callers rely on it: torchft chains its callbacks with .then() on the
        # future right after wait(), and a closure of its loop is only right if each runs at once.
        # Callbacks hung on the future (PyWork's, DDP's) run here, in this thread.
        try:
            if error is None:
                self._future.set_result(self._result)
            else:
                self._future.set_exception(error)
        finally:
            self._event.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = pypg.timeout_given(timeout)
        seconds = limit.total_seconds() if limit is not None else self._limit
        if not self._event.wait(seconds):
            raise TimeoutError(f"the collective did not complete within {seconds:g} s (waiting for the "
                               "group's communication thread)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return list(self._result)

    def get_future(self) -> torch.futures.Future:
        return self._future

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._event.is_set() else "pending"
        return f"QueuedWork({state})"


class Continuation:
    """What the first stage of a two-stage collective returns (module docstring): ``complete()``
    runs its second stage and returns the collective's value."""

    __slots__ = ("complete",)

    def __init__(self, complete: Callable[[], Any]) -> None:
        self.complete = complete


def _finish_in_place(out: Any) -> Any:
    return out.complete() if isinstance(out, Continuation) else out


class WorkQueue:
    """The ordered queue and thread of one group (module docstring).

    :param name: names the thread and the errors (e.g. ``bridge(sim-nccl:2,sim-hccl:2) rank 0``).
    :param timeout: the group's collective timeout: bounds each collective's own waits; a wait for
        a queued work gives up after the timeout times the number of collectives ahead of it, plus
        one, and a margin (the thread must have been stuck).
    """

    #: seconds added to a queued work's wait limit (thread scheduling on a loaded machine)
    MARGIN_S = 30.0

    def __init__(self, name: str, timeout: timedelta, stage2_init: Callable[[], None] | None = None) -> None:
        self.name = name
        self._timeout = timeout.total_seconds()
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[Callable[[], Any], QueuedWork, list[tuple[int, int]] | None]] = \
            collections.deque()
        self._running = False  # a collective runs now (the thread's, or a synchronous caller's)
        # second stages handed over by the first thread, in issue order: (continuation, work, touches)
        self._stage2: collections.deque[tuple[Continuation, QueuedWork, list[tuple[int, int]]]] = collections.deque()
        self._in_stage2: list[list[tuple[int, int]]] = []  # touches of every collective not yet ended there
        self._thread2: threading.Thread | None = None
        self._stage2_init = stage2_init  # run first on the second thread (the bridge picks its communicators)
        self._failed: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._local = threading.local()  # .active: this thread runs one of this queue's collectives
        #: collectives run by the thread (tests read it: did a call really go asynchronous?)
        self.queued = 0
        #: collectives whose second stage ran on the second thread, and the most that were there at
        #: once (tests and benchmarks read them: did collectives really overlap?)
        self.continued = 0
        self.most_in_stage2 = 0

    # -- issuing ----------------------------------------------------------------------------------

    def run(self, fn: Callable[[], Any], result: Sequence[torch.Tensor], async_op: bool,
            touches: list[tuple[int, int]] | None = None, call: Call | None = None) -> Any:
        """Run collective ``fn`` in issue order: now, in this thread, when the call is synchronous and
        nothing is queued or in a second stage (returns ``fn``'s value); else queued (returns a
        :class:`QueuedWork`; a synchronous call then waits for it). ``touches``: the byte ranges
        ``[start, end)`` the collective reads and writes, when it may return a :class:`Continuation`
        (module docstring); then the two stages' value is the call's. ``call``: its flight
        recorder entry and span (:mod:`vcga.pg.recorder`), the current call of the thread that runs it."""
        if getattr(self._local, "active", False):
            return _finish_in_place(fn())  # a collective of this queue calling another one: part of the same job
        if threading.current_thread() is self._thread or threading.current_thread() is self._thread2:
            # A future's callback, run by this thread as the collective before it completed (torch's
            # powerSGD_hook issues its next all_reduce there and waits for it): run it now, in place.
            # Queued, it would wait for this very thread, which waits in the callback. Every rank's
            # thread gets here right after the same collective, and the thread holds the queue
            # (``_running``) while callbacks run, so the order is the same on every rank.
            with self._cv:
                self._check()
            return self._run_here(fn, call)
        with self._cv:
            self._check()
            inline = not async_op and not self._running and not self._jobs and not self._in_stage2
            if inline:
                self._running = True
            else:
                ahead = len(self._jobs) + 1 + self._running + len(self._in_stage2)
                work = QueuedWork(result, self._timeout * ahead + self.MARGIN_S, call)
                self._jobs.append((fn, work, touches))
                pypg._hold()  # released when the work has ended (exit drain, module docstring)
                self.queued += 1
                self._start()
                self._cv.notify_all()
        if not inline:
            if not async_op:
                work.wait()
            return work
        try:
            return self._run_here(fn, call)
        finally:
            with self._cv:
                self._running = False
                self._cv.notify_all()

    def _run_here(self, fn: Callable[[], Any], call: Call | None = None) -> Any:
        """Run ``fn`` in the calling thread as this queue's current collective; a failure poisons
        the queue (the ranks no longer agree on the sequence) and is raised to the caller."""
        self._local.active = True
        try:
            if call is None:
                return _finish_in_place(fn())
            if call.started_ns is None:  # Call.start, inline: every synchronous bridged call passes here
                call.started_ns = _time_ns()
            was = getattr(local, "call", None)
            if was is call:  # the usual case: the call path made it current (vcga.pg.calls._as_current)
                return _finish_in_place(fn())
            local.call = call
            try:
                return _finish_in_place(fn())
            finally:
                local.call = was
        except BaseException as e:
            self._poison(e)
            raise
        finally:
            self._local.active = False

    def _check(self) -> None:
        if os.getpid() != self._pid:
            raise VcgaCollectiveError(f"{self.name}: this group's communication thread belongs to process "
                                      f"{self._pid}; a forked child cannot use the group (create it in the child)")
        if self._closed:
            raise VcgaCollectiveError(f"{self.name}: the process group was destroyed")
        if self._failed is not None:
            raise self._after_failure()

    def _after_failure(self) -> VcgaError:
        """The error of a collective that follows a failed one (typed: nothing ran)."""
        first = self._failed
        detail = (f"{self.name}: an earlier collective of this group failed ({type(first).__name__}: "
                  f"{str(first).splitlines()[0] if str(first) else ''}); the ranks no longer agree on the "
                  f"sequence, so the group cannot be used any more -- destroy it and create a new one")
        return VcgaCollectiveError(detail)

    def _poison(self, e: BaseException) -> None:
        with self._cv:
            if self._failed is None:
                self._failed = e
            self._cv.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"vcga-comm {self.name}", daemon=True)
            self._thread.start()

    def _drain(self, touches: list[tuple[int, int]] | None) -> None:
        """On the first thread, before a collective's first stage: wait until no collective whose
        ranges overlap ``touches`` (all of them, for None) is in its second stage. Bounded: each of
        those has its own bounded waits; a second thread stuck past them all is an error."""
        def busy() -> bool:
            if touches is None:
                return bool(self._in_stage2)
            return any(a < e and s < b for held in self._in_stage2 for a, b in held for s, e in touches)

        with self._cv:
            if not busy():
                return
            limit = self._timeout * (len(self._in_stage2) + 1) + self.MARGIN_S
            if not self._cv.wait_for(lambda: not busy(), limit):
                raise VcgaCollectiveError(f"{self.name}: the collectives ahead of this one did not end within "
                                          f"{limit:g} s (waiting for the group's second communication thread)")

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._running or not self._jobs):
                    self._cv.wait()
                if not self._jobs:  # closed and nothing left
                    return
                fn, work, touches = self._jobs.popleft()
                self._running = True
                failed = self._failed
            error: BaseException | None = None
            handed = False
            try:
                if failed is not None or self._closed:
                    error = self._after_failure() if failed is not None else VcgaCollectiveError(
                        f"{self.name}: the process group was destroyed with this collective still queued")
                else:
                    out, error = self._run_active(
                        functools.partial(self._first_stage, fn, work, touches), "queued collective")
                    handed = out is True  # None when it failed
            finally:
                try:
                    if not handed:
                        work._finish(error)  # its callbacks run here, holding the queue (see run())
                finally:
                    with self._cv:
                        self._running = False
                        self._cv.notify_all()
                    # let go of the job before it leaves the exit drain's count: what it holds must
                    # not be freed after the drain returned (vcga/pypg.py, above run_counted)
                    fn = work = touches = error = None  # type: ignore[assignment]
                    if not handed:
                        pypg._release()

    def _first_stage(self, fn: Callable[[], Any], work: QueuedWork, touches: list[tuple[int, int]] | None) -> bool:
        """Run a queued collective (its first stage, when it has two); True when its second stage
        was handed to the second thread, which then finishes its work."""
        self._drain(touches)
        call = work._call
        if call is None:
            out = fn()
        else:
            call.start()
            local.call = call  # this thread's current call: its steps are this call's
            try:
                out = fn()
            finally:
                local.call = None
        if not isinstance(out, Continuation):
            return False
        if touches is None:
            raise TypeError("a collective without touches returned a Continuation")
        self._hand_over(out, work, touches)
        return True

    def _run_active(self, fn: Callable[[], Any], what: str) -> tuple[Any, BaseException | None]:
        """Run ``fn`` as one of this queue's collectives on a queue thread: ``(value, None)``, or
        ``(None, error)`` with the queue poisoned (the error goes to the waiter, typed there)."""
        self._local.active = True
        try:
            return fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, typed there
            self._poison(e)
            log.debug("vcga %s: %s failed: %s", self.name, what, e)
            return None, e
        finally:
            self._local.active = False

    def _hand_over(self, cont: Continuation, work: QueuedWork, touches: list[tuple[int, int]]) -> None:
        with self._cv:
            self._stage2.append((cont, work, touches))
            self._in_stage2.append(touches)
            self.continued += 1
            self.most_in_stage2 = max(self.most_in_stage2, len(self._in_stage2))
            if self._thread2 is None:
                self._thread2 = threading.Thread(target=self._loop2, name=f"vcga-comm2 {self.name}", daemon=True)
                self._thread2.start()
            self._cv.notify_all()

    def _loop2(self) -> None:
        """The second thread: each handed-over collective's second stage, in issue order; then its
        work is finished (callbacks run here) and released."""
        if self._stage2_init is not None:
            self._stage2_init()
        while True:
            with self._cv:
                while not self._stage2 and not (self._closed and not self._running and not self._jobs):
                    self._cv.wait()
                if not self._stage2:  # closed, and the first thread hands over nothing more
                    return
                cont, work, touches = self._stage2.popleft()
                failed, closed = self._failed, self._closed
            error: BaseException | None = None
            try:
                if failed is not None:
                    error = self._after_failure()
                elif closed:
                    error = VcgaCollectiveError(f"{self.name}: the process group was destroyed with this "
                                                "collective in flight")
                else:
                    local.call = work._call
                    try:
                        _, error = self._run_active(cont.complete, "a collective's second stage")
                    finally:
                        local.call = None
            finally:
                try:
                    work._finish(error)  # callbacks run here; collectives they issue run in place
                finally:
                    with self._cv:
                        # by identity: equal ranges never coexist (they overlap), but be exact
                        del self._in_stage2[next(i for i, h in enumerate(self._in_stage2) if h is touches)]
                        self._cv.notify_all()
                    cont = work = touches = error = _ = None  # type: ignore[assignment] # as in _loop
                    pypg._release()

    # -- ending -----------------------------------------------------------------------------------

    def close(self, wait_s: float = 5.0) -> None:
        """Fail what is still queued, and let the thread end (it finishes a collective it is in)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            threads = [self._thread, self._thread2]
        deadline = time.monotonic() + wait_s
        for thread in threads:
            if thread is not None and thread is not threading.current_thread() and os.getpid() == self._pid:
                thread.join(max(0.0, deadline - time.monotonic()))

    def idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (tests); False at the timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._running or self._jobs or self._in_stage2:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True
