"""In-process unit tests of the pieces under the ``vcga`` process group: work objects, the
timeout rule, op conversion and the dispatcher's refusals -- no world needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from vcga import pypg
from vcga.config import Config
from vcga.contract import CapabilityTable, Collective, ReduceOp
from vcga.errors import VcgaError, VcgaTimeoutError, VcgaUnsupportedError, typed
from vcga.pypg import PyWork, completed_work, reduce_op_of, torch_reduce_op
from vcga.testing import free_port


def _work(value=None):
    """A completed native work (torch's own future-backed work)."""
    fut = torch.futures.Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


def test_pywork_runs_completion_steps_once_and_exposes_the_result() -> None:
    t = torch.zeros(3)
    steps = []
    w = PyWork([_work([t])], [lambda: steps.append(1), lambda: t.add_(2)], [t])
    assert w.wait() and w.wait()
    assert steps == [1] and t.tolist() == [2.0, 2.0, 2.0]
    assert w.is_completed() and w.is_success()
    assert w.result()[0] is t
    assert w.get_future().wait()[0] is t


def test_pywork_future_runs_the_steps_without_wait() -> None:
    """DDP's reducer only calls get_future(): the steps must run on completion."""
    t = torch.ones(2)
    w = PyWork([_work([t])], [lambda: t.mul_(5)], [t])
    assert w.get_future().wait()[0].tolist() == [5.0, 5.0]
    w.wait()
    assert t.tolist() == [5.0, 5.0]  # and not twice


@pytest.mark.parametrize("native", [True, False], ids=["native-works", "no-native-works"])
def test_a_failed_pywork_fails_for_a_cpp_consumer_of_its_future(native: bool) -> None:
    """DDP's reducer and c10d read a work's future in C++. A future completed with
    ``Future.set_exception`` looks successful there (the exception is its value): a c10d work made
    from it reports success (``isSuccess`` reads the future's error in C++). Both of PyWork's paths
    -- with native works, and a work whose steps ran inline -- must fail where C++ looks, and carry
    the VCGA error for ``typed``."""
    err = VcgaError("completion step failed")

    def step() -> None:
        raise err

    t = torch.zeros(2)
    w = PyWork([_work([t])] if native else [], [step], [t])
    fut = w.get_future()
    assert not _create_work_from_future(fut).is_success()
    with pytest.raises(RuntimeError) as got:
        fut.value()
    assert typed(got.value) is err


class _CopyOnWaitWork(dist._Work):
    """Like gloo's reduce_scatter work (torch 2.13): no future, and every wait() repeats its
    completion (gloo copies the result chunk again). The first waiter blocks until released; a
    second waiter counts, releases the first and returns."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits == 1:
            self.entered.set()
            assert self.release.wait(10)
        else:
            self.release.set()
        return True

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented for this work")


def test_pywork_waits_on_a_watched_work_once() -> None:
    """While get_future()'s watcher thread waits on a work without a future, wait() takes the
    watcher's outcome instead of waiting on (and re-running) the native work a second time."""
    native = _CopyOnWaitWork()
    t = torch.ones(2)
    w = PyWork([native], [], [t])
    fut = w.get_future()
    assert native.entered.wait(10)  # the watcher is inside the native wait
    # Only unblocks the watcher if wait() below does not: a second native wait would.
    timer = threading.Timer(0.2, native.release.set)
    timer.start()
    try:
        assert w.wait()
    finally:
        timer.cancel()
    assert fut.wait()[0] is t and w.is_completed()
    assert native.waits == 1


class _FailingWork(dist._Work):
    """A native work whose wait raises, as gloo's does on a timeout."""

    def wait(self, timeout=None):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_exception(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
        return fut


def test_pywork_translates_native_failures() -> None:
    def translate(e: BaseException) -> BaseException:
        return VcgaTimeoutError("all_reduce", 3.0, rank=0, seq=7, detail=str(e))

    w = PyWork([_FailingWork()], [], [], translate=translate)
    with pytest.raises(VcgaTimeoutError, match=r"all_reduce \(#7\) did not complete within 3 s") as info:
        w.wait()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(VcgaTimeoutError):
        w.wait()  # every waiter sees the same error
    with pytest.raises(Exception, match="did not complete"):
        w.get_future().wait()


def test_exit_drain_waits_for_callbacks_of_native_futures(own_exit_count, caplog) -> None:
    """The atexit hook waits until the completion callback a PyWork hung on a native future has
    run and been destroyed -- and only as long as it is told to, warning when one is left."""
    native = torch.futures.Future()
    t = torch.ones(2)
    w = PyWork([_create_work_from_future(native)], [lambda: t.mul_(3)], [t])
    fut = w.get_future()
    assert pypg._LIVE[0] == 1
    with caplog.at_level(logging.WARNING, logger="vcga.work"):
        assert not pypg._drain_at_exit(0.05)  # the native future is still pending
    assert "leaving with 1 collective(s) still in flight" in caplog.text
    threading.Thread(target=native.set_result, args=([t],)).start()  # completes it in another thread, as gloo does
    assert pypg._drain_at_exit(30)
    assert pypg._LIVE[0] == 0
    assert fut.wait()[0].tolist() == [3.0, 3.0]


def test_exit_drain_waits_for_watcher_threads(own_exit_count) -> None:
    """A work without a future gets a watcher thread blocked in the native wait(): the exit drain
    waits for it too (its return into the interpreter needs the GIL, like a callback)."""
    native = _CopyOnWaitWork()
    w = PyWork([native], [], [])
    fut = w.get_future()
    assert native.entered.wait(10) and pypg._LIVE[0] == 2  # the watcher, and the callback on its future
    assert not pypg._drain_at_exit(0.05)
    native.release.set()
    assert pypg._drain_at_exit(30) and pypg._LIVE[0] == 0
    assert fut.done()


def test_a_forked_child_does_not_wait_for_its_parents_work(own_exit_count) -> None:
    """A child forked while a callback is pending starts with nothing in flight: it has none of the
    parent's threads, so waiting for them at its exit would only cost the whole drain limit."""
    native = torch.futures.Future()
    PyWork([_create_work_from_future(native)], [], []).get_future()
    assert pypg._LIVE[0] == 1
    pid = os.fork()
    if pid == 0:  # the child must never return into pytest, whatever happens
        code = 1
        try:
            code = 0 if pypg._LIVE[0] == 0 and pypg._drain_at_exit(0.0) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    native.set_result(None)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pypg._drain_at_exit(30)


def _two_ranks_leaving(mode: str, layout: dict | None = None) -> tuple[subprocess.CompletedProcess, tuple[int, str]]:
    """Run tests/leave_in_flight.py's MODE on two ranks; (rank 1's result, rank 0's (code, output))."""
    script = Path(__file__).with_name("leave_in_flight.py")
    port = str(free_port())
    env = {**os.environ, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", **(layout or {})}
    first = subprocess.Popen([sys.executable, str(script), "0", port, mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        second = subprocess.run([sys.executable, str(script), "1", port, mode], env=env, capture_output=True,
                                text=True, timeout=120)
        out, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    return second, (first.returncode, out)


@pytest.mark.parametrize("layout", [{}, {"VCGA_SIM_VENDORS": "nccl:1,hccl:1"}], ids=["gloo", "bridge"])
def test_a_rank_leaving_with_a_collective_in_flight_exits_cleanly(layout: dict) -> None:
    """Ranks that return from their script without destroy_process_group() -- rank 0 with an
    all_reduce in flight whose future it took (as DDP's reducer does), rank 1 right after its own
    all_reduce -- exit with 0, not SIGABRT, and no gloo worker thread is left when the interpreter
    starts to finalize (checked by an atexit hook that runs after vcga's). Before the exit drain,
    gloo's worker destroyed vcga's Python callback while rank 0 finalized (SIGABRT in 3 of 15 runs);
    before the at-exit shutdown of open groups (vcga.process_group._shutdown_at_exit), gloo's idle
    workers lived into finalization on both ranks (every run), and a worker that dropped its last
    work there aborted the process now and then (rank 1: 2 of 7 runs on a loaded machine). On a
    mixed world (``bridge``, fake-backed sim vendors) the all_reduce waits on the bridge's
    communication thread (vcga/pg/workqueue.py), which the drain also waits for."""
    joining, (code, out) = _two_ranks_leaving("leave", layout)
    assert joining.returncode == 0 and "alive at exit" not in joining.stdout, joining.stdout + joining.stderr
    assert code == 0 and "terminate called" not in out and "still in flight" not in out and "alive at exit" not in out, (
        code, out)


def test_abort_returns_without_waiting_for_a_collective_in_flight() -> None:
    """_abort_process_group() returns while an all_reduce is still in flight (rank 1 joins it only
    afterwards; a group whose abort joined gloo's workers would wait out the 60 s timeout, and the
    work would have finished with an error), later calls raise VcgaCollectiveError, the collective
    still completes for the peer, and both ranks exit 0 with no gloo worker left at exit: the
    aborted group is released in a background thread that the exit drain waits for."""
    joining, (code, out) = _two_ranks_leaving("abort")
    assert joining.returncode == 0 and "alive at exit" not in joining.stdout, joining.stdout + joining.stderr
    assert code == 0 and "alive at exit" not in out, (code, out)


def test_closing_a_native_transport_drops_its_group() -> None:
    """destroy_process_group() -> VcgaProcessGroup.shutdown() -> NativeTransport.close(): the native
    group is shut down and the transport's reference goes (a ProcessGroupGloo joins its worker
    threads only in its destructor); later calls raise a typed error instead of reaching it."""
    import weakref

    from vcga.errors import VcgaCollectiveError
    from vcga.pg.transport import NativeTransport

    class Native:
        shut = 0

        def shutdown(self) -> None:
            Native.shut += 1

    class Backend:
        name, vendor, device_type = "fake", "fake", "cpu"

        def capabilities(self) -> None:
            return None

    native = Native()
    alive = weakref.ref(native)
    t = NativeTransport(Backend(), native)  # type: ignore[arg-type]
    del native
    t.close()
    assert Native.shut == 1 and alive() is None
    with pytest.raises(VcgaCollectiveError, match="shut down by destroy_process_group"):
        t.group.allreduce([torch.ones(1)])
    t.close()  # a second close (shutdown, then abort) is harmless
    assert Native.shut == 1


class _StuckGroup:
    """Stands for a native group whose worker sits in a collective: its teardown (gloo's destructor
    joining that worker) blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.aborted = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def abort(self) -> None:
        self.aborted += 1

    def shutdown(self) -> None:
        self.entered.set()
        self.release.wait(5)


class _FakeBackend:
    name, vendor, device_type = "fake", "fake", "cpu"

    def capabilities(self) -> None:
        return None


def test_aborting_a_native_transport_does_not_wait_for_its_group(own_exit_count) -> None:
    """abort() aborts the native group and returns while its teardown is still blocked (a worker in
    a collective); the teardown runs in a background thread that the exit drain counts, and the
    group's last reference goes there. Calls after the abort raise a typed error."""
    import weakref

    from vcga.errors import VcgaCollectiveError
    from vcga.pg.transport import NativeTransport

    native = _StuckGroup()
    alive, release, entered = weakref.ref(native), native.release, native.entered
    t = NativeTransport(_FakeBackend(), native)  # type: ignore[arg-type]
    del native
    t.abort()
    assert entered.wait(30) and not release.is_set()
    assert alive() is not None and alive().aborted == 1  # abort() returned with the teardown still blocked
    with pytest.raises(VcgaCollectiveError, match="aborted"):
        t.group.allreduce([torch.ones(1)])
    assert not pypg._drain_at_exit(0.05)  # the releasing thread is counted
    release.set()
    assert pypg._drain_at_exit(30) and alive() is None


def test_aborting_a_bridge_lets_its_queue_finish_before_its_groups_go(own_exit_count) -> None:
    """A mixed-vendor transport's abort: the work queue is closed without waiting (what is queued
    fails), every group is aborted, and in the background the queue's thread is given the group's
    timeout to end the collective it is in before the groups are shut down and dropped."""
    import weakref

    from vcga.bridge.comms import Communicators
    from vcga.bridge.create import BridgeTransport
    from vcga.bridge.group import BridgeGroup
    from vcga.errors import VcgaCollectiveError

    class Queue:
        def __init__(self) -> None:
            self.waits: list[tuple[float, str]] = []

        def close(self, wait_s: float = 5.0) -> None:
            self.waits.append((wait_s, threading.current_thread().name))

    native, world, queue = _StuckGroup(), _StuckGroup(), Queue()
    world.release.set()
    group = BridgeGroup.__new__(BridgeGroup)
    # what abort and _drop_groups use (no plan is needed here)
    group.comms = Communicators(object(), None, world, None)
    group.comms.set_lane_b(object(), object())  # a pipelining bridge's second lane
    group.queue = queue
    alive = weakref.ref(native)
    t = BridgeTransport.__new__(BridgeTransport)
    t.group, t.backend_name, t.timeout, t._closables = group, "fake", timedelta(seconds=60), [native, world]
    del native, world
    t.abort()
    me = threading.current_thread().name
    assert queue.waits[0] == (0, me)
    assert alive() is not None and alive().aborted == 1
    with pytest.raises(VcgaCollectiveError, match="aborted"):
        t.group.allreduce([torch.ones(1)])
    alive().release.set()
    assert pypg._drain_at_exit(30) and alive() is None
    assert len(queue.waits) == 2 and queue.waits[1][0] >= 60 and queue.waits[1][1] != me
    assert group.inner is None and group.world is None and not group.comms.two_lanes


def test_completed_work() -> None:
    w = completed_work([torch.ones(1)])
    assert w.is_completed() and w.wait() and w.get_future().wait()[0].item() == 1.0


@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduce_op_round_trip(op: ReduceOp) -> None:
    factor = 0.25 if op is ReduceOp.PREMUL_SUM else None
    back, f = reduce_op_of(torch_reduce_op(op, factor))
    assert back is op and f == factor


def test_timeout_rule() -> None:
    from torch.distributed import distributed_c10d as c10d

    from vcga.process_group import _effective_timeout

    cfg = Config(collective_timeout_s=12.0)
    assert _effective_timeout(c10d.default_pg_timeout, cfg) == timedelta(seconds=12)  # torch's default: not given
    assert _effective_timeout(None, cfg) == timedelta(seconds=12)
    assert _effective_timeout(timedelta(seconds=5), cfg) == timedelta(seconds=5)  # explicit wins


def test_refusal_names_everything_and_hints() -> None:
    from vcga.pg.dispatch import Dispatcher, Steps
    from vcga.pg.transport import Transport

    class Tiny(Transport):
        def __init__(self) -> None:
            self.table = (CapabilityTable.builder("tiny").native([Collective.ALL_REDUCE], ["float32"], ["SUM"])
                          .build(derive=False))
            self.group = None
            self.backend_name = "tiny"
            self.device_type = "cpu"

    d = Dispatcher(Tiny(), rank=0, size=2)
    with pytest.raises(VcgaUnsupportedError) as info:
        d.all_reduce(torch.ones(2, dtype=torch.float64), ReduceOp.SUM, None, dist.AllreduceOptions(), Steps())
    e = info.value
    assert (e.backend, e.collective, e.dtype, e.op) == ("tiny", "all_reduce", "float64", "SUM")
    assert "SUM works here on: float32" in str(e)


def test_emulation_loop_is_refused_not_followed() -> None:
    from vcga.contract import Cell, Support
    from vcga.pg.dispatch import Dispatcher, Steps
    from vcga.pg.recipes import MAX_EMULATION_DEPTH
    from vcga.pg.transport import Transport

    loop = {(Collective.BROADCAST, "int16", None): Cell(Support.EMULATED, via="upcast:int32"),
            (Collective.BROADCAST, "int32", None): Cell(Support.EMULATED, via="bitcast:int16")}

    class Loop(Transport):
        def __init__(self) -> None:
            self.table = CapabilityTable("loop", loop)
            self.group = None
            self.backend_name = "loop"
            self.device_type = "cpu"

    with pytest.raises(VcgaUnsupportedError, match=f"longer than {MAX_EMULATION_DEPTH} steps"):
        Dispatcher(Loop(), 0, 2).broadcast(torch.ones(4, dtype=torch.int16), 0, dist.BroadcastOptions(), Steps())


def test_typed_finds_the_vcga_error_behind_torch_future_wrappers() -> None:
    """DDP and FSDP wait on torch futures; an error a collective's future carries reaches their
    caller as a RuntimeError ("Got the following error when running the callback: ..."), one
    level per then(). vcga.errors.typed gives back the VCGA error itself (the two-node elastic
    test records it), and leaves other errors alone."""
    import torch

    from vcga.errors import VcgaCollectiveError, VcgaTimeoutError, typed

    original = VcgaTimeoutError("all_reduce", 10, rank=3, seq=31, detail="bridge: recv timed out")
    fut = torch.futures.Future()
    chained = fut.then(lambda f: f.value()).then(lambda f: f.value())
    fut.set_exception(original)
    with pytest.raises(RuntimeError) as caught:
        chained.wait()
    assert not isinstance(caught.value, VcgaTimeoutError)  # torch's wrapper, not ours
    assert typed(caught.value) is original
    direct = VcgaCollectiveError("gloo failed", rank=1)
    assert typed(direct) is direct
    other = RuntimeError("something else")
    assert typed(other) is other
    try:
        raise RuntimeError("wrapped") from direct
    except RuntimeError as e:
        assert typed(e) is direct
