"""A finished job exits cleanly after a run of asynchronous collectives.

A native gloo group left to its destructor outlives ``destroy_process_group()`` (gloo's
``shutdown()`` does nothing; only its destructor joins its worker threads), so its threads run on
into the interpreter's exit and the group is destroyed whenever its last reference goes: in one of
its own worker threads (which then joins itself: "terminate called after throwing an instance of
'std::system_error' -- Resource deadlock avoided") or while Python finalized (a worker releasing a
Python object then takes the GIL, Python ends that thread inside a ``noexcept`` destructor:
"terminate called without an active exception"). tests/exit_soak.py runs many short jobs built to
hit that, and each rank also reports gloo worker threads still alive after the destroy (exit code 4),
which a group left to its destructor leaves whenever the script still holds a work handle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("exit_soak.py")
RACE = Path(__file__).with_name("exit_race.py")


def _fatal_lines(stderr: str) -> str:
    """The lines of an abort, wherever they are in stderr: other ranks' output (tracebacks, torch's
    warnings) can push them out of any tail."""
    keys = ("terminate called", "Fatal Python error", "Aborted")
    return "\n".join(line for line in stderr.splitlines() if any(k in line for k in keys))

#: vcga on gloo, each simulated vendor and a mixed group (fake-backed: the simulated vendors run on
#: gloo), jobs of 4 ranks each; plain gloo runs in benchmarks/soak.py
SETUPS = "vcga*3;sim-nccl;sim-hccl;sim-cncl;nccl:2,hccl:2"


def test_every_rank_of_many_short_jobs_exits_cleanly_with_exact_results() -> None:
    env = {**os.environ, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--setups", SETUPS, "--world", "4", "--calls", "24"],
                       capture_output=True, text=True, timeout=600, env=env)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and len(rows) == 5, r.stdout + _fatal_lines(r.stderr) + r.stderr[-3000:]
    # 0: exact results, no gloo worker left after destroy_process_group, a clean exit; 3: a wrong
    # result; 4: gloo workers still alive after the destroy; -6: the abort
    bad = {row["setup"]: row["codes"] for row in rows if any(c for job in row["codes"] for c in job)}
    assert not bad, (bad, _fatal_lines(r.stderr), r.stderr[-3000:])


def test_a_watcher_thread_late_to_leave_the_exit_drain_holds_nothing_native() -> None:
    """A counted thread drops its c10d work before it leaves the exit drain's count: made likely
    by tests/exit_race.py (a large work, its watcher paused right before it leaves the count), the
    race aborted 8 of 10 jobs when the watcher's closure still held the work."""
    env = {**os.environ, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(RACE), "4"], capture_output=True, text=True, timeout=300, env=env)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and len(rows) == 1, r.stdout + _fatal_lines(r.stderr) + r.stderr[-3000:]
    # 0: a clean exit with the right result; 3: a wrong result; -6: the abort
    assert all(c == 0 for job in rows[0]["codes"] for c in job), (rows[0]["codes"], _fatal_lines(r.stderr))
