"""Counting gloo's worker threads in this process: the exit tests' witness that a group's native
workers were all joined (tests/exit_soak.py, tests/leave_in_flight.py)."""

from __future__ import annotations

import os


def gloo_workers() -> int:
    """gloo's worker threads (``pt_gloo_runloop``) alive in this process now; they run works and
    release what the works held, so one alive at exit can still touch freed state."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return n
