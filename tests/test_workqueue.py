"""vcga.pg.workqueue: the ordered queue and communication thread behind asynchronous bridge collectives
(in one process; the bridge's use of it is tested in spawned worlds, tests/test_bridge.py)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch

from vcga import pypg
from vcga.errors import VcgaCollectiveError
from vcga.pg.workqueue import QueuedWork, WorkQueue
from vcga.pypg import PyWork


def make(timeout_s: float = 5.0) -> WorkQueue:
    return WorkQueue("test", timedelta(seconds=timeout_s))


def test_async_calls_return_at_once_and_run_in_issue_order_on_one_thread():
    q = make()
    gate = threading.Event()
    order, threads = [], set()

    def job(i):
        def fn():
            if i == 0:
                assert gate.wait(10)
            order.append(i)
            threads.add(threading.current_thread().name)
        return fn

    works = [q.run(job(i), [torch.tensor([i])], async_op=True) for i in range(5)]
    assert all(isinstance(w, QueuedWork) for w in works)
    assert not any(w.is_completed() for w in works)  # the first one is held: nothing ran yet
    gate.set()
    for w in works:
        assert w.wait()
    assert order == [0, 1, 2, 3, 4] and threads == {"vcga-comm test"} and q.queued == 5
    assert works[3].get_future().value()[0].item() == 3
    q.close()


def test_wait_returns_after_the_future_is_done_and_its_callbacks_ran():
    """torch's order (gloo's finishWorkGloo: future completed, then the work finished): a work is
    not completed while its future's callbacks run, so whoever returns from wait() finds the future
    done and may chain ``.then()`` on it that runs at once -- torchft's managed works rely on it
    (its integration test healed to different weights when this was the other way round)."""
    q = make()
    gate = threading.Event()
    w = q.run(lambda: gate.wait(10), [torch.tensor([1])], async_op=True)
    seen = []
    w.get_future().add_done_callback(lambda f: seen.append(("completed during callback", w.is_completed())))
    gate.set()
    assert w.wait()
    assert seen == [("completed during callback", False)] and w.get_future().done()
    chained = []
    w.get_future().then(lambda f: chained.append(f.value()[0].item()))
    assert chained == [1]  # done already: the callback ran in place
    q.close()


def test_a_synchronous_call_runs_inline_when_idle_and_behind_queued_work_otherwise():
    q = make()
    where = []
    assert q.run(lambda: where.append(threading.current_thread() is threading.main_thread()) or 7, [],
                 async_op=False) == 7
    gate = threading.Event()
    q.run(lambda: gate.wait(10), [], async_op=True)
    t = threading.Thread(target=lambda: q.run(lambda: where.append("sync after async"), [], async_op=False))
    t.start()
    t.join(0.3)
    assert t.is_alive() and where == [True]  # it waits its turn behind the held async call
    gate.set()
    t.join(10)
    assert where == [True, "sync after async"] and q.queued == 2
    q.close()


def test_a_failure_fails_its_work_typed_through_pywork_and_poisons_the_queue():
    q = make()
    gate = threading.Event()

    def boom():
        assert gate.wait(10)  # the next call is queued before this one fails
        raise RuntimeError("[gloo] Connection reset by peer")

    first = q.run(boom, [], async_op=True)
    later = q.run(lambda: None, [], async_op=True)
    gate.set()
    translated = PyWork([first], translate=lambda e: VcgaCollectiveError(f"translated: {e}"))
    with pytest.raises(VcgaCollectiveError, match="translated: .*Connection reset"):
        translated.wait()
    with pytest.raises(VcgaCollectiveError, match="earlier collective of this group failed .*Connection reset"):
        later.wait()
    assert isinstance(later.exception(), VcgaCollectiveError)
    with pytest.raises(VcgaCollectiveError, match="cannot be used any more"):
        q.run(lambda: None, [], async_op=False)  # later calls refuse at once
    q.close()


def test_a_wait_is_bounded_and_close_fails_what_is_still_queued():
    q = make(timeout_s=0.2)
    q.MARGIN_S = 0.0
    gate = threading.Event()
    held = q.run(lambda: gate.wait(10), [], async_op=True)
    queued = q.run(lambda: None, [], async_op=True)
    with pytest.raises(TimeoutError):
        held.wait(timedelta(milliseconds=50))
    with pytest.raises(TimeoutError):
        queued.wait()  # its own limit: the timeout per collective ahead of it, plus one
    q.close(wait_s=0.1)
    gate.set()
    with pytest.raises(VcgaCollectiveError, match="destroyed with this collective still queued"):
        queued.wait(timedelta(seconds=10))
    assert held.wait(timedelta(seconds=10))
    with pytest.raises(VcgaCollectiveError, match="destroyed"):
        q.run(lambda: None, [], async_op=True)


def test_queued_collectives_are_counted_for_the_exit_drain_until_their_callbacks_ran(own_exit_count):
    q = make()
    gate = threading.Event()
    w = q.run(lambda: gate.wait(10), [torch.zeros(1)], async_op=True)
    seen = []
    w.get_future().then(lambda f: seen.append(threading.current_thread().name))
    assert pypg._drain_at_exit(limit=0.2) is False  # in flight: the drain waits (and warns)
    gate.set()
    assert pypg._drain_at_exit(limit=10) is True and seen == ["vcga-comm test"]
    q.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_cannot_use_the_queue():
    q = make()
    q.run(lambda: None, [], async_op=True).wait()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            q.run(lambda: None, [], async_op=True)
            code = 1
        except VcgaCollectiveError as e:
            code = 0 if "forked child" in str(e) else 2
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    q.close()


def test_a_collective_calling_another_one_of_the_queue_runs_it_in_place():
    q = make()
    order = []

    def outer():
        order.append("outer")
        assert q.run(lambda: order.append("inner") or 5, [], async_op=True) == 5  # not queued behind itself
        order.append("outer done")

    q.run(outer, [], async_op=True).wait(timedelta(seconds=10))
    q.run(outer, [], async_op=False)
    assert order == ["outer", "inner", "outer done"] * 2
    q.close()


def test_a_collective_issued_by_a_future_callback_on_the_thread_runs_there_in_order():
    """torch's powerSGD_hook issues its next all_reduce from the previous one's future callback and
    waits for it there. The callback runs on the queue's thread; queued behind itself, the new
    collective would wait for that thread forever (here: the callback gives up after 5 s)."""
    import time

    q = make()
    gate = threading.Event()
    order = []
    q.run(lambda: gate.wait(10), [], async_op=True)  # holds the thread: the callback is attached first
    first = q.run(lambda: order.append("first"), [torch.tensor([1.0])], async_op=True)
    q.run(lambda: order.append("queued after first"), [], async_op=True)

    def callback(fut):
        inner = q.run(lambda: order.append("from callback"), [torch.tensor([2.0])], async_op=True)
        if isinstance(inner, QueuedWork):  # queued: it can only run once this callback returns
            deadline = time.monotonic() + 5
            while not inner.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
        order.append(threading.current_thread().name)
        return fut.value()

    chained = first.get_future().then(callback)
    gate.set()
    chained.wait()
    assert q.idle(10)
    # run in place, on the queue's thread, before what was queued after the collective it follows
    assert order == ["first", "from callback", "vcga-comm test", "queued after first"], order
    q.close()


def _until(cond, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_two_stage_collectives_overlap_on_a_second_thread_and_drain_when_they_must():
    """A collective issued with ``touches`` may hand its second stage to the second thread (the
    bridge's pipelined all_reduces): the first thread goes on with the next one's first stage; it
    waits (drains) before one whose ranges overlap a second stage in flight, and before one without
    ranges; second stages and callbacks run in issue order on the second thread."""
    from vcga.pg.workqueue import Continuation

    lane = threading.local()
    q = WorkQueue("test", timedelta(seconds=5), stage2_init=lambda: setattr(lane, "b", True))
    gates = [threading.Event() for _ in range(3)]
    order = []

    def job(i):
        def first():
            order.append(f"1:{i}")

            def second():
                assert gates[i].wait(10)
                order.append(f"2:{i} {threading.current_thread().name} {getattr(lane, 'b', False)}")
                return i
            return Continuation(second)
        return first

    w0 = q.run(job(0), [torch.tensor([0])], async_op=True, touches=[(0, 100)])
    w1 = q.run(job(1), [torch.tensor([1])], async_op=True, touches=[(100, 200)])
    assert _until(lambda: q.continued == 2)
    assert q.most_in_stage2 == 2 and order == ["1:0", "1:1"]  # both in their second stage at once
    w2 = q.run(job(2), [torch.tensor([2])], async_op=True, touches=[(150, 160)])  # overlaps job 1
    plain = q.run(lambda: order.append("plain"), [], async_op=True)
    gates[0].set()
    assert w0.wait(timedelta(seconds=10))
    assert not _until(lambda: "1:2" in order, 0.3)  # held: job 1 still holds its range
    gates[1].set()
    assert w1.wait(timedelta(seconds=10)) and _until(lambda: "1:2" in order)
    assert not _until(lambda: "plain" in order, 0.3)  # no ranges: waits until nothing is in stage 2
    gates[2].set()
    assert w2.wait(timedelta(seconds=10)) and plain.wait(timedelta(seconds=10))
    assert order == ["1:0", "1:1", "2:0 vcga-comm2 test True", "2:1 vcga-comm2 test True", "1:2",
                     "2:2 vcga-comm2 test True", "plain"], order
    assert w1.get_future().value()[0].item() == 1
    # a synchronous two-stage call on an idle queue runs both stages in the caller's thread
    assert q.run(job(0), [], async_op=False, touches=[(0, 1)]) == 0 and order[-1].startswith("2:0 MainThread")
    assert q.idle(10)
    q.close()


def test_a_second_stage_failure_is_typed_on_wait_poisons_the_queue_and_is_counted_for_the_exit_drain(own_exit_count):
    from vcga.pg.workqueue import Continuation

    q = make()
    gate = threading.Event()

    def second():
        assert gate.wait(10)
        raise RuntimeError("[gloo] Connection reset by peer")

    w = q.run(lambda: Continuation(second), [torch.zeros(1)], async_op=True, touches=[(0, 4)])
    later = q.run(lambda: Continuation(lambda: None), [torch.zeros(1)], async_op=True, touches=[(8, 12)])
    assert _until(lambda: q.continued == 2)
    assert pypg._drain_at_exit(limit=0.2) is False  # both in their second stage: the exit drain waits
    gate.set()
    with pytest.raises(RuntimeError, match="Connection reset"):
        w.wait(timedelta(seconds=10))
    with pytest.raises(VcgaCollectiveError, match="cannot be used any more"):
        later.wait(timedelta(seconds=10))
    assert pypg._drain_at_exit(limit=10) is True
    with pytest.raises(VcgaCollectiveError, match="cannot be used any more"):
        q.run(lambda: None, [], async_op=True)
    q.close()
    assert q._thread2 is not None and _until(lambda: not q._thread2.is_alive())
