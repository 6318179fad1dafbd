"""Run examples/train_elastic.py under torchrun's elastic agent for the fault-matrix tests, and
without it for their references.

:func:`launch` starts the agent as one subprocess (in a session of its own) and waits for it:
``agent="torchrun"`` is the torchrun CLI (``python -m torch.distributed.run``, a fresh interpreter
per worker and attempt), ``agent="fork"`` is tests/elastic_agent.py (torchrun's command line and
agent, its workers forked from an interpreter that has imported torch, torch._dynamo and vcga
once). Either way the workers are the agent's children, and the harness acts as the operator of a
hung worker would be expected to: when a worker stopped by SIGSTOP (``VCGA_FAULT=hang:...``) has a
SIGTERM pending -- the agent sends it when it tears the failed attempt down, and a stopped process
cannot act on it -- the harness continues it (SIGCONT) so it dies at once, instead of the agent
waiting its fixed 30 s before SIGKILL. The waiting polls the process table with a deadline, at
which the agent's process group (its workers included) is SIGKILLed; nothing is synchronised by
sleeping.

:func:`run_forked` runs the same script and environment without an agent, its ranks forked from
the rank server (tests/script_world.py): for a reference run, with no fault and no restart to launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_elastic.py"
AGENT = Path(__file__).resolve().parent / "elastic_agent.py"
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


@dataclass
class Run:
    returncode: int
    output: str
    events: list[dict] = field(default_factory=list)
    result: dict | None = None
    continued: int = 0  # stopped workers the harness continued


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def _stopped_with_sigterm_pending(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    if not fields.get("State", "").strip().startswith("T"):
        return False
    pending = int(fields.get("SigPnd", "0").strip(), 16) | int(fields.get("ShdPnd", "0").strip(), 16)
    return bool(pending & _SIGTERM_BIT)


def launch(tmp: Path, *, nproc: int, vendors: str, args: list[str], fault: str = "", max_restarts: int = 0,
           timeout_s: float = 20.0, deadline_s: float = 540.0, name: str = "run", agent: str = "torchrun") -> Run:
    """The script under torchrun's elastic agent, ``agent="torchrun"`` (the CLI: a fresh interpreter
    per worker) or ``"fork"`` (tests/elastic_agent.py: workers forked from the agent's interpreter)."""
    out, events = tmp / f"{name}.json", tmp / f"{name}.events"
    env = {**os.environ, "VCGA_SIM_VENDORS": vendors, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1",
           "VCGA_TIMEOUT": str(timeout_s), "OMP_NUM_THREADS": "1", "VCGA_FAULT": fault,
           "PYTHONUNBUFFERED": "1"}
    launcher = {"torchrun": ["-m", "torch.distributed.run"], "fork": ["-u", str(AGENT)]}[agent]
    cmd = [sys.executable, *launcher, "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", str(SCRIPT), *args,
           "--out", str(out), "--events", str(events)]
    log = tmp / f"{name}.log"
    continued = 0
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + deadline_s
        try:
            while proc.poll() is None:
                if time.monotonic() > end:
                    raise AssertionError(f"the {agent} launch did not finish within {deadline_s:g} s; log: {log}")
                for child in _children(proc.pid):
                    if _stopped_with_sigterm_pending(child):
                        os.kill(child, signal.SIGCONT)
                        continued += 1
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    run = Run(proc.returncode, log.read_text(errors="replace"), continued=continued)
    if events.exists():
        run.events = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    if out.exists():
        run.result = json.loads(out.read_text())
    return run


def run_forked(tmp: Path, *, nproc: int, vendors: str, args: list[str], timeout_s: float = 20.0,
               deadline_s: float = 540.0, name: str = "run") -> Run:
    """:func:`launch`'s job without torchrun (no fault, no restart): the ranks' output is the test's
    own (pytest shows it on a failure), not :attr:`Run.output`."""
    from script_world import run_script

    out, events = tmp / f"{name}.json", tmp / f"{name}.events"
    env = {"VCGA_SIM_VENDORS": vendors, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "VCGA_TIMEOUT": str(timeout_s),
           "OMP_NUM_THREADS": "1", "VCGA_FAULT": "", "PYTHONUNBUFFERED": "1"}
    codes = run_script(SCRIPT, nproc, [*args, "--out", str(out), "--events", str(events)], env=env,
                       timeout=deadline_s)
    run = Run(next((c for c in codes if c), 0), f"(forked ranks, exit statuses {codes}: their output is above)")
    if events.exists():
        run.events = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    if out.exists():
        run.result = json.loads(out.read_text())
    return run
