"""Fault injection by configuration, for testing recovery: ``VCGA_FAULT`` (off when unset).

::

    VCGA_FAULT=kill:rank=1:step=7                   # SIGKILL rank 1 when it reaches step 7
    VCGA_FAULT=kill:rank=1:step=7:at=mid            # ... after its forward pass, before backward
    VCGA_FAULT=kill:rank=2:step=8:at=save           # ... while saving step 8 (its shard written,
                                                    #     the checkpoint not yet published)
    VCGA_FAULT=hang:rank=2:step=5                   # SIGSTOP rank 2 at step 5 (a hung rank)
    VCGA_FAULT="kill:rank=1:step=4,hang:rank=3:step=9:attempt=1"   # several, comma-separated

Each fault fires in one attempt of the job: ``attempt`` (default 0) is torchrun's restart count
(``TORCHELASTIC_RESTART_COUNT``), so a restarted job replaying step 7 does not die there again.
``rank`` is the global rank (``RANK``). Points: ``step`` (the start of a training step), ``mid``
(inside it) and ``save`` (inside :func:`vcga.checkpoint.save`, after this rank's shard is
durable). With ``VCGA_FAULT_LOG=<file>`` each fault appends a JSON line (kind, rank, step, time)
there just before it fires. Training scripts call :func:`point`; the library calls it once per save -- one check of
a module variable when ``VCGA_FAULT`` is unset.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass

from vcga.errors import VcgaConfigError

__all__ = ["Fault", "parse", "point", "reload"]

log = logging.getLogger("vcga.testing.fault")
_KINDS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
_POINTS = ("step", "mid", "save")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    at: str = "step"
    attempt: int = 0


def parse(text: str) -> list[Fault]:
    """``"kill:rank=1:step=7[:at=mid][:attempt=0],..."`` -> faults.

    :raises VcgaConfigError: anything else."""
    faults = []
    allowed = "kill|hang:rank=<int>:step=<int>[:at=step|mid|save][:attempt=<int>], comma-separated"
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, *fields = part.split(":")
        if kind not in _KINDS:
            raise VcgaConfigError("fault", part, allowed, "env VCGA_FAULT")
        values: dict[str, str] = {}
        for f in fields:
            key, sep, val = f.partition("=")
            if not sep or key not in ("rank", "step", "at", "attempt") or key in values:
                raise VcgaConfigError("fault", part, allowed, "env VCGA_FAULT")
            values[key] = val
        try:
            fault = Fault(kind, int(values["rank"]), int(values["step"]), values.get("at", "step"),
                          int(values.get("attempt", "0")))
        except (KeyError, ValueError):
            raise VcgaConfigError("fault", part, allowed, "env VCGA_FAULT") from None
        if fault.at not in _POINTS:
            raise VcgaConfigError("fault", part, allowed, "env VCGA_FAULT")
        faults.append(fault)
    return faults


_FAULTS: list[Fault] | None = None


def reload() -> None:
    """Re-read ``VCGA_FAULT`` (read once at import)."""
    global _FAULTS
    text = os.environ.get("VCGA_FAULT", "")
    _FAULTS = parse(text) or None


def point(where: str, step: int) -> None:
    """A place where a configured fault may fire (does nothing unless ``VCGA_FAULT`` names it)."""
    if _FAULTS is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for f in _FAULTS:
        if (f.rank, f.step, f.at, f.attempt) == (rank, step, where, attempt):
            # Logged before the signal (handlers flush per record): the process is about to vanish.
            log.warning("vcga fault: %s rank %d at %s of step %d (attempt %d)", f.kind, rank, where, step, attempt)
            record = os.environ.get("VCGA_FAULT_LOG")
            if record:  # when it fired, for measuring recovery (benchmarks/recovery.py)
                with open(record, "a") as out:
                    out.write(json.dumps({"kind": f.kind, "rank": rank, "step": step, "at": where,
                                          "attempt": attempt, "time": time.time()}) + "\n")
            os.kill(os.getpid(), _KINDS[f.kind])


reload()
