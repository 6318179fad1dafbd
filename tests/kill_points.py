"""Moments inside a running `vcga convert` at which a test kills it with SIGKILL.

:func:`install` runs inside the converting process before the CLI. It numbers the moments as they
happen -- just before each tensor is handed to the writer, and just before each change to the
destination's directory (a folder made, a file named with linkat, a rename, a removal), seen
through Python's audit hooks -- and reports each on a descriptor. At the chosen moment the process
stops itself (SIGSTOP): it does nothing more, and the test kills it from outside with SIGKILL.
The hooks only observe; they change nothing in what the converter does.
"""

from __future__ import annotations

import os
import signal
import sys

# Audit events that change a directory, and the argument holding the path they change.
CHANGES = {"os.mkdir": 0, "os.link": 1, "os.rename": 1, "os.remove": 0, "os.rmdir": 0, "shutil.rmtree": 0}


def install(work: str, stop_at: int | None, report_fd: int) -> None:
    """Report every moment on ``report_fd`` (one line each); stop before moment ``stop_at`` (0-based)."""
    count = 0

    def moment(what: str) -> None:
        nonlocal count
        os.write(report_fd, f"{what}\n".encode())
        if count == stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        count += 1

    def audit(event: str, args: tuple) -> None:
        i = CHANGES.get(event)
        if i is None or len(args) <= i:
            return
        path = args[i]
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            # the source folder of a rename is the staging folder, inside work as well
            if path.startswith(work):
                moment(f"{event} {os.path.relpath(path, work)}")

    def profile(frame, event: str, arg: object) -> None:
        # writer.write(entry) called by vcga.convert.engine.convert: one moment per tensor
        if event == "call" and frame.f_code.co_name == "write":
            caller = frame.f_back
            if caller is not None and caller.f_code.co_name == "convert" and \
                    caller.f_code.co_filename.endswith(os.path.join("vcga", "convert", "engine.py")):
                moment("tensor")

    sys.addaudithook(audit)
    sys.setprofile(profile)


def launcher(tests_dir: str, work: str, stop_at: int | None, report_fd: int) -> str:
    """``python -c`` code running the real `vcga` CLI (arguments from argv) with the moments installed."""
    return (f"import sys; sys.path.insert(0, {tests_dir!r}); import kill_points; "
            f"kill_points.install({work!r}, {stop_at!r}, {report_fd}); from vcga.cli import main; main()")
