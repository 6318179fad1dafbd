"""Seeing inside a mixed-vendor job: profiler spans, the flight recorder and ``vcga trace``, typed
errors through DDP.

Two worlds (tests/observe_cases.py), each started once for the module:

- four ranks, ``nccl:2,hccl:2`` (the asynchronous bridge): a profiled DDP step holds a
  ``vcga:all_reduce`` span for every bucket's all_reduce with the bridge's steps inside; rank 3
  skips an all_reduce -- the others raise VcgaTimeoutError, every rank leaves a dump, and
  ``vcga trace`` names rank 3 and the collective's number; ranks gather different sizes --
  ``vcga trace`` names the size mismatch; a DDP loop whose peer stops dead and an FSDP2 loop whose
  peer stays out catch ``VcgaTimeoutError`` (also torch's ``DistBackendError``) without
  ``vcga.errors.typed()``;
- two ranks on one vendor: the same spans, without steps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from observe_cases import mixed_world, single_world

from vcga.testing import run_world

STEP = re.compile(r"vcga:(in-vendor|cross-vendor) [a-z_]+ \(.+\)")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    d = tmp_path_factory.mktemp("mixed")
    return d, run_world(mixed_world, 4, str(d), env={"VCGA_SIM_VENDORS": "nccl:2,hccl:2"}, timeout=180)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    d = tmp_path_factory.mktemp("single")
    return run_world(single_world, 2, str(d), env={"VCGA_SIM_VENDORS": "nccl:2"}, timeout=120)


def _slices(step: dict, name: str) -> list[dict]:
    return [e for e in step["events"] if e["ph"] == "X" and e["name"] == name]


def _covers(outer: dict, inner: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def _check_calls(step: dict) -> list[dict]:
    """A span per all_reduce the flight recorder saw in the step, with its input shape."""
    calls = _slices(step, "vcga:all_reduce")
    assert len(step["all_reduces"]) >= 2, step["all_reduces"]  # the model's two buckets
    assert sorted(str(c["dims"]) for c in calls) == sorted(str(s) for s in step["all_reduces"])
    return calls


def _check_nesting(step: dict, kind: str, leader: bool) -> None:
    """Every step lies inside a call's span and is linked to it by a flow arrow; ``kind``: the
    category the steps must have (torch's user_annotation, or vcga_step where VCGA added them).
    Which steps run depends on the algorithm the bridge's figures chose; every rank has one in its
    vendor group, and a vendor group's leader (``leader``) crosses vendors in every algorithm."""
    calls = _check_calls(step)
    steps = [e for e in step["events"] if e["ph"] == "X" and STEP.fullmatch(e["name"])]
    tiers = {s["name"].split(" ")[0] for s in steps}
    assert "vcga:in-vendor" in tiers and ("vcga:cross-vendor" in tiers or not leader), steps
    assert {s["cat"] for s in steps} == {kind}
    for s in steps:
        assert any(_covers(c, s) for c in calls), s
    starts = {e["id"]: e for e in step["events"] if e["ph"] == "s" and e["cat"] == "vcga"}
    ends = [e for e in step["events"] if e["ph"] == "f" and e["cat"] == "vcga"]
    assert len(ends) == len(steps) == len(starts)
    for f in ends:
        s = starts[f["id"]]
        # calls overlap on the caller's thread; a viewer binds an arrow to the latest slice begun before it
        parent = max((c for c in calls if c["tid"] == s["tid"] and c["ts"] <= s["ts"] <= c["ts"] + c["dur"]),
                     key=lambda c: c["ts"])
        child = max((x for x in steps if x["tid"] == f["tid"] and x["ts"] <= f["ts"] <= x["ts"] + x["dur"]),
                    key=lambda x: x["ts"])
        assert _covers(parent, child)
        assert child["tid"] != parent["tid"]  # the step ran on the group's communication thread


def test_mixed_spans_every_bucket_with_the_bridge_steps_inside(mixed: tuple[Path, list[dict]]) -> None:
    _, results = mixed
    for rank, r in enumerate(results):
        leader = rank in (0, 2)
        _check_nesting(r["all_threads"], "user_annotation", leader)  # torch recorded the communication thread
        _check_nesting(r["default"], "vcga_step", leader)  # only the caller's: vcga.profiling added the steps


def test_single_vendor_spans_every_bucket(single: list[dict]) -> None:
    for r in single:
        _check_calls(r)
        assert not [e for e in r["events"] if STEP.fullmatch(e["name"] or "")]


def test_nothing_of_the_recorder_dump_or_trace_loads_at_init(mixed: tuple[Path, list[dict]]) -> None:
    assert [r["loaded_at_init"] for r in mixed[1]] == [[]] * 4


def _trace(directory: Path, *extra: str) -> tuple[int, str]:
    from vcga.cli import cli

    res = CliRunner().invoke(cli, ["trace", str(directory), *extra])
    return res.exit_code, res.output


def test_a_skipped_all_reduce_times_out_dumps_and_vcga_trace_names_the_rank(mixed: tuple[Path, list[dict]]) -> None:
    d, results = mixed
    assert [r["skip"] for r in results] == ["VcgaTimeoutError"] * 3 + ["skipped"]
    assert all(r["skip_is_dist_backend_error"] for r in results[:3])
    assert sorted(p.name for p in (d / "skip").iterdir()) == [f"vcga_fr_trace_rank_{r}" for r in range(4)]
    code, out = _trace(d / "skip", "--json")
    assert code == 1, out
    report = json.loads(out)
    (problem,) = report["problems"]
    assert (problem["kind"], problem["missing_ranks"], problem["seq"], problem["op"]) == ("missing ranks", [3], 2,
                                                                                           "all_reduce")
    assert [problem["ranks"][str(r)]["vendor"] for r in range(4)] == ["nvidia", "nvidia", "huawei", "huawei"]
    assert report["torchfrtrace_reads"]
    import pickle

    with open(d / "skip" / "vcga_fr_trace_rank_0", "rb") as f:
        entries = [e for e in pickle.load(f)["entries"] if e["process_group"][0] == problem["group"]]
    done, timed_out = [e for e in entries if e["collective_seq_id"] in (1, 2)]
    assert done["state"] == "completed" and done["frames"] == []  # a synchronous call that completed: none taken
    assert any(f["name"] == "mixed_world" and f["filename"].endswith("observe_cases.py") for f in timed_out["frames"]), \
        timed_out["frames"]  # a failed one: its caller's, taken on the typed error's way out
    code, text = _trace(d / "skip")
    assert code == 1 and "collective #2 (all_reduce) was not joined by rank(s) [3]" in text, text
    assert "rank 3 (huawei, sim-hccl on hccl): never called it" in text, text


def test_a_size_mismatch_is_named_as_one(mixed: tuple[Path, list[dict]]) -> None:
    d, results = mixed
    assert [r["mismatch"] for r in results] == ["VcgaMismatchError"] * 4
    code, out = _trace(d / "mismatch", "--json")
    assert code == 1, out
    # the dumps also hold the group of the skipped all_reduce, still open: its problem comes first
    skipped, problem = json.loads(out)["problems"]
    assert (skipped["op"], skipped["missing_ranks"]) == ("all_reduce", [3])
    assert (problem["kind"], problem["seq"], problem["op"], problem["odd_ranks"]) == ("size mismatch", 2, "gather", [1])
    assert problem["ranks"]["1"]["input_sizes"] == [[8]] and problem["ranks"]["0"]["input_sizes"] == [[4]]


def test_ddp_loop_catches_a_dead_peer_as_vcga_timeout_error(mixed: tuple[Path, list[dict]]) -> None:
    results = mixed[1]
    for r in results[:3]:
        assert r["ddp"] is not None, r
        assert (r["ddp"]["type"], r["ddp"]["step"]) == ("VcgaTimeoutError", 2), r["ddp"]
        assert r["ddp"]["dist_backend_error"] and r["ddp"]["dist_error"], r["ddp"]
    assert results[3]["ddp"] is None


def test_ddp_loop_catches_a_killed_peer_as_vcga_timeout_error(tmp_path: Path) -> None:
    """A peer killed outright (its connections close, unlike a stopped one) in a DDP loop on the
    asynchronous bridge: rank 0's ``except VcgaTimeoutError`` catches it -- a VcgaPeerLostError,
    also a VcgaCollectiveError and torch's DistBackendError -- at once rather than after the 60 s
    collective timeout, and the rank leaves a flight-recorder dump."""
    from observe_cases import killed_ddp_peer

    from vcga.spawn import get_context
    from vcga.testing import free_port

    ctx = get_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=killed_ddp_peer, args=(r, port, queue, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        caught = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert caught is not None, "rank 0's loop ran to the end: the killed peer was not noticed"
    assert (caught["type"], caught["step"]) == ("VcgaPeerLostError", 2), caught
    assert caught["collective_error"] and caught["dist_backend_error"], caught
    assert "gone" in caught["message"], caught
    assert caught["seconds"] < 30, caught  # the collective timeout is 60 s
    assert procs[1].exitcode == -9
    assert (tmp_path / "vcga_fr_trace_rank_0").is_file()


def test_fsdp_loop_catches_a_missing_peer_typed(mixed: tuple[Path, list[dict]]) -> None:
    """The timeout itself, or -- where FSDP first waits on a later all-gather, or gloo closed the
    connection of the rank that timed out first (a lost peer, VcgaPeerLostError) -- the group's
    failure after it; typed either way, and torch's DistBackendError."""
    results = mixed[1]
    for r in results[:3]:
        f = r["fsdp"]
        assert f is not None and f["step"] == 1 and f["dist_backend_error"], r
        assert f["type"] in ("VcgaTimeoutError", "VcgaCollectiveError", "VcgaPeerLostError"), f
    assert results[3]["fsdp"] is None


def test_vcga_trace_without_dumps_is_a_one_line_error(tmp_path: Path) -> None:
    code, out = _trace(tmp_path)
    assert code == 2 and out.startswith("vcga: error:") and out.count("\n") == 1, out


def test_ring_keeps_the_newest_entries_and_torch_fr_buffer_size_is_validated() -> None:
    from vcga.errors import VcgaConfigError
    from vcga.pg.recorder import DEFAULT_ENTRIES, FlightRecorder, buffer_size, new_call

    assert buffer_size({}) == DEFAULT_ENTRIES
    assert buffer_size({"TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}) == 7
    assert buffer_size({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}) == 0
    # VCGA's own size first: torch's recorder off (it records the native calls again), VCGA's on
    assert buffer_size({"VCGA_FR_BUFFER_SIZE": "5", "TORCH_FR_BUFFER_SIZE": "0"}) == 5
    assert buffer_size({"VCGA_FR_BUFFER_SIZE": "0", "TORCH_FR_BUFFER_SIZE": "9"}) == 0
    with pytest.raises(VcgaConfigError, match="VCGA_FR_BUFFER_SIZE"):
        buffer_size({"VCGA_FR_BUFFER_SIZE": "many"})
    with pytest.raises(VcgaConfigError, match="TORCH_FR_BUFFER_SIZE"):
        buffer_size({"TORCH_FR_BUFFER_SIZE": "-1"})
    rec = FlightRecorder(3, "g", "d", [0, 1], 0, "gloo", {}, 1.0)
    for seq in range(1, 6):
        new_call(rec, seq, "all_reduce", (), ())
    assert [c.seq for c in rec.calls()] == [3, 4, 5]


def test_a_full_ring_refills_ended_entries_and_keeps_nothing_for_the_collector() -> None:
    """Once the ring is full, an ended entry's object is refilled in place and what an entry holds
    is untracked by the garbage collector: a long job adds no objects that would make it run full
    collections. An entry still running keeps its object (whoever waits on it still holds it)."""
    import gc

    import torch

    from vcga.pg.recorder import FRAMES, FlightRecorder, described, new_call, where

    rec = FlightRecorder(4, "g", "d", [0, 1], 0, "gloo", {}, 1.0)
    t = torch.zeros(2, 3)
    running = new_call(rec, 0, "all_reduce", described([t]), described([t]))  # never ends
    for seq in range(1, 4):
        new_call(rec, seq, "all_reduce", described([t]), described([t])).end()
    first = list(rec.ring)
    for seq in range(4, 12):
        new_call(rec, seq, "all_reduce", described([t]), described([t])).end()
    assert [c.seq for c in rec.calls()] == [8, 9, 10, 11]
    assert [id(c) for c in rec.ring[1:]] == [id(c) for c in first[1:]]  # ended ones: refilled
    assert running.seq == 0 and running.state == "scheduled" and all(c is not running for c in rec.ring)
    for _ in range(3):  # a collection untracks a tuple whose items it has already untracked: one level each
        gc.collect()
    newest = rec.calls()[-1]
    assert newest.inputs == (((2, 3), torch.float32),)
    assert not gc.is_tracked(newest.inputs)
    call = new_call(rec, 12, "all_reduce", described([t]), described([t]))
    frames = where(0)
    for _ in range(3):
        gc.collect()
    assert not gc.is_tracked(frames) and not gc.is_tracked(call.traceback) and not gc.is_tracked(call.inputs)
    from vcga.pg.frdump import _frames  # symbolized at a dump: the caller first, the call path's frames left out

    (taken,) = _frames([call])
    assert taken[0]["name"] == "test_a_full_ring_refills_ended_entries_and_keeps_nothing_for_the_collector", taken
    assert taken[0]["filename"] == __file__ and 1 <= len(taken) <= FRAMES


def test_a_refilled_entry_keeps_nothing_of_the_call_it_held() -> None:
    """The hot path refills an ended entry field by field (inline, not through Call.fill): the new
    call must not inherit the old one's state, step, error, stack, work or steps."""
    from vcga.pg.recorder import FlightRecorder

    rec = FlightRecorder(1, "g", "d", [0, 1], 0, "gloo", {}, 1.0)
    old = rec.record(1, "all_reduce", (((4,), "f"),), (((4,), "f"),))
    old.start()
    old.stage = ("exchange", "cross-vendor", "gloo")
    old.error, old.traceback, old.work, old.steps = RuntimeError("old"), ("frames",), object(), [["s"]]
    old.ended_ns = old.started_ns + 1
    new = rec.record(2, "broadcast", (((8,), "f"),), (((8,), "f"),))
    assert new is old  # refilled in place
    assert (new.seq, new.op, new.inputs) == (2, "broadcast", (((8,), "f"),))
    assert new.state == "scheduled" and new.started_ns is None and new.ended_ns is None
    assert (new.stage, new.error, new.traceback, new.work, new.steps, new.span) == (None,) * 6
    assert rec.calls() == [new] and new.record_id > 0


def test_a_call_lists_its_callers_frames_while_in_flight_failed_or_asynchronous_not_once_completed() -> None:
    """The stack stays off the synchronous hot path: a synchronous call in flight shows its
    thread's live stack at a dump, a failed one the stack it failed on; an asynchronous call keeps
    the stack it was issued from after its caller moved on; a completed synchronous call lists none."""
    import _thread
    import threading
    import time
    import types

    import torch
    from torch._C._distributed_c10d import _create_work_from_future

    from vcga.errors import VcgaCollectiveError
    from vcga.pg.calls import CallPath
    from vcga.pg.frdump import _frames
    from vcga.pg.recorder import FlightRecorder, described

    class Work:  # a native work whose wait() blocks or fails in C, without a Python frame of its own
        def __init__(self, wait: object) -> None:
            self.wait = wait

    rec = FlightRecorder(8, "g", "d", [0, 1], 0, "gloo", {}, 1.0)
    path = CallPath(0, 2, object(), types.SimpleNamespace(), "gloo", 1.0, recorder=rec)  # type: ignore[arg-type]
    t = torch.ones(2)
    gate = _thread.allocate_lock()
    gate.acquire()

    def blocked_caller() -> None:
        call = path.record(1, "all_reduce", described([t]))
        path.native_call("all_reduce", 1, lambda: Work(gate.acquire), async_op=False, result=[t], call=call)

    th = threading.Thread(target=blocked_caller)
    th.start()
    try:
        deadline = time.monotonic() + 30  # until the thread waits in the call (no frame of the test above it)
        live: list = []
        while time.monotonic() < deadline and not (live and live[0]["name"] == "blocked_caller"):
            calls = rec.calls()
            live = _frames(calls)[0] if calls else []
        assert live and live[0]["name"] == "blocked_caller" and live[0]["filename"] == __file__, live
    finally:
        gate.release()
        th.join(10)
    assert rec.calls()[0].state == "completed" and _frames(rec.calls()) == [[]]

    def failing_caller() -> None:
        call = path.record(2, "all_reduce", described([t]))
        path.native_call("all_reduce", 2, lambda: Work(_thread.allocate_lock().release), async_op=False,
                         result=[t], call=call)  # releasing an unlocked lock raises RuntimeError

    with pytest.raises(VcgaCollectiveError, match="failed in the native library"):
        failing_caller()

    def async_caller() -> object:
        call = path.record(3, "all_reduce", described([t]))
        return path.native_call("all_reduce", 3, _create_work_from_future, torch.futures.Future(), async_op=True,
                                result=[t], call=call)

    work = async_caller()
    failed, issued = _frames(rec.calls()[1:])
    assert failed[0]["name"] == "failing_caller" and issued[0]["name"] == "async_caller", (failed, issued)
    assert work is not None


def test_vcga_trace_reads_a_library_torchs_analyzer_does_not_know(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks on CNCL (a prefix torch's analyzer refuses): the dumps, written in this process one
    rank at a time, are analyzed all the same; rank 1 never called collective #2."""
    import gc
    import weakref

    import torch

    from vcga.pg import frdump, recorder
    from vcga.pg.recorder import FlightRecorder, new_call

    monkeypatch.setattr(recorder, "_RECORDERS", weakref.WeakSet())  # none of other tests' groups

    shape = ((torch.Size([4]), torch.float32),)
    for rank, calls in ((0, 2), (1, 1)):
        rec = FlightRecorder(8, "0", "default_pg", [0, 1], rank, "cncl",
                             {"backend": "mlu", "vendor": "cambricon", "library": "cncl"}, 1.0)
        for seq in range(1, calls + 1):
            new_call(rec, seq, "all_reduce", shape, shape).end()
        frdump.dump("test", tmp_path / f"vcga_fr_trace_rank_{rank}")
        del rec
        gc.collect()  # the next dump holds the next rank's recorder only
    code, out = _trace(tmp_path, "--json")
    report = json.loads(out)
    assert code == 1 and not report["torchfrtrace_reads"] and report["libraries"] == ["cncl"]
    (problem,) = report["problems"]
    assert (problem["kind"], problem["missing_ranks"], problem["seq"]) == ("missing ranks", [1], 2)
    assert problem["ranks"]["0"]["vendor"] == "cambricon" and problem["ranks"]["0"]["op"] == "cncl:all_reduce"


@pytest.mark.parametrize("said", [
    "[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:10670: Connection reset by peer",
    "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13445",
    "[third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error: Broken pipe",
    "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5",
])
def test_a_library_reporting_a_dead_peer_becomes_a_lost_peer_that_timeout_handlers_catch(said: str) -> None:
    """What gloo and NCCL say when a peer's process died, as the call path types it; a timeout
    stays a timeout and any other failure a collective error."""
    import pickle
    import types

    import torch.distributed as dist

    from vcga.errors import VcgaCollectiveError, VcgaPeerLostError, VcgaTimeoutError
    from vcga.pg.calls import CallPath

    path = CallPath(1, 2, object(), types.SimpleNamespace(), "gloo", 60.0)  # type: ignore[arg-type]
    lost = path.translate(RuntimeError(said), "all_reduce", 7)
    assert isinstance(lost, VcgaPeerLostError) and isinstance(lost, VcgaTimeoutError), lost
    assert isinstance(lost, VcgaCollectiveError) and isinstance(lost, dist.DistBackendError)
    assert (lost.rank, lost.seq, lost.collective, lost.backend) == (1, 7, "all_reduce", "gloo")
    assert str(lost).startswith("[gloo] rank 1: all_reduce (#7) cannot complete: a peer's process or connection is gone")
    assert said in str(lost)  # what the library said, for the logs
    back = pickle.loads(pickle.dumps(lost))  # torch.distributed.checkpoint gathers errors by pickling
    assert type(back) is VcgaPeerLostError and str(back) == str(lost) and back.__dict__ == lost.__dict__
    assert type(path.translate(RuntimeError("Timed out waiting 60000ms"), "all_reduce", 7)) is VcgaTimeoutError
    assert type(path.translate(RuntimeError("invalid usage"), "all_reduce", 7)) is VcgaCollectiveError
    assert type(path.translate(ConnectionResetError(104, "reset"), "all_reduce", 7)) is VcgaPeerLostError


def test_arrows_link_each_call_to_its_own_steps_when_a_preempted_thread_puts_the_clocks_apart() -> None:
    """vcga.profiling.link_steps on a made trace (in-process): torch's slice of a call may start
    milliseconds before VCGA's own start of it (the thread was preempted between the two records on
    a loaded host); the arrow still runs from that call to its steps, and two calls of one name on
    one thread each keep their own steps. A call outside the trace gets no arrow."""
    from vcga.pg.spans import FINISHED, Span
    from vcga.profiling import link_steps

    def span(seq: int, start_us: float, end_us: float, steps: list[tuple[str, float, float]]) -> Span:
        s = Span.__new__(Span)
        s.name, s.seq, s.tid = "vcga:all_reduce", seq, 7
        s.start_ns, s.end_ns = int(start_us * 1000), int(end_us * 1000)
        s.steps = [(8, name, int(a * 1000), int(b * 1000)) for name, a, b in steps]
        return s

    def x(name: str, tid: int, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    step = "vcga:in-vendor all_reduce (sim-nccl)"
    # call 1: torch recorded it 5 ms before VCGA's start; call 2 close behind it, on time
    trace = {"traceEvents": [x("vcga:all_reduce", 7, 1_000.0, 9_000.0), x(step, 8, 7_000.0, 1_000.0),
                             x("vcga:all_reduce", 7, 10_100.0, 2_000.0), x(step, 8, 10_500.0, 1_000.0)]}
    made = [span(1, 6_000.0, 10_000.0, [(step, 7_000.0, 8_000.0)]),
            span(2, 10_100.0, 12_100.0, [(step, 10_500.0, 11_500.0)]),
            span(3, 50_000.0, 51_000.0, [(step, 50_100.0, 50_200.0)])]
    FINISHED.extend(made)
    try:
        assert link_steps(trace) == 2
    finally:
        for s in made:
            FINISHED.remove(s)
    events = trace["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    arrows = sorted((starts[e["id"]]["ts"], e["ts"]) for e in events if e["ph"] == "f")
    # each arrow starts just inside its call's slice and ends just inside that call's own step
    assert arrows == [(1_000.5, 7_000.5), (10_100.5, 10_500.5)]
    assert not [e for e in events if e["ph"] == "X" and e["cat"] == "vcga_step"]  # torch recorded every step


def test_a_dump_symbolizes_its_stacks_without_importing_inductor() -> None:
    """A fresh interpreter (the rank servers of this suite import torch._dynamo, and inductor with
    it): torch's symbolizer, through vcga.pg.frdump, names the caller's frames without importing
    torch._inductor or torch._dynamo (about a CPU-second per rank that dumps), and torch's lazy
    loader still imports inductor afterwards."""
    import subprocess
    import sys

    code = (
        "import json, sys, torch\n"
        "from torch._C._profiler import gather_traceback\n"
        "from vcga.pg.frdump import _symbolize\n"
        "def caller():\n"
        "    return gather_traceback(True, False, False)\n"
        "frames = _symbolize([caller()])[0]\n"
        "out = {'frames': frames[:2], 'inductor': 'torch._inductor' in sys.modules, 'dynamo': 'torch._dynamo' in sys.modules}\n"
        "out['later'] = torch._inductor.__name__\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["frames"] == [{"name": "caller", "filename": "<string>", "line": 5},
                             {"name": "<module>", "filename": "<string>", "line": 6}], out
    assert not out["inductor"] and not out["dynamo"], out
    assert out["later"] == "torch._inductor"
