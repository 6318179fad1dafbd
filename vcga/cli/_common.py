"""Helpers shared by the checkpoint subcommands: one-line errors and a progress bar."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``vcga: error: <message>`` on one line to stderr and exit (no traceback)."""
    click.echo(f"vcga: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def errors_as_one_line() -> Iterator[None]:
    """Turn the errors a user can cause (VcgaError, OSError) into one line and exit status 2."""
    from vcga.errors import VcgaError

    try:
        yield
    except VcgaError as e:
        fail(str(e))
    except OSError as e:  # disk full, permission denied, ... on the user's paths
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        fail(f"{e.strerror or e}{where}")
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", code=130)


def stdout_console(**kwargs: Any) -> Any:
    """A rich console on stdout. When stdout is not a terminal (CI logs, a pipe) and COLUMNS is not
    set, rich would wrap tables at 80 columns and cut cells to "pa…"; a log reads better wide."""
    import os

    from rich.console import Console

    console = Console(**kwargs)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160, **kwargs)
    return console


@contextlib.contextmanager
def progress_bar(enabled: bool | None) -> Iterator[Callable[[str, int, int, str], None] | None]:
    """A rich progress bar on stderr when it is a terminal (or when forced); yields the callback."""
    from rich.console import Console

    console = Console(stderr=True)
    if enabled is False or (enabled is None and not console.is_terminal):
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(TextColumn("[bold]{task.fields[phase]}[/bold]"), BarColumn(), DownloadColumn(binary_units=True),
                   TransferSpeedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"),
                   console=console, transient=True)
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int, name: str) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=max(total, 1), phase=phase, tensor="")
        shown = name if len(name) <= 40 else "…" + name[-39:]
        bar.update(tasks[phase], completed=done if total else 1, tensor=shown)

    with bar:
        yield update


def human_bytes(n: int) -> str:
    step = 1024.0
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < step or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= step
    return f"{n} B"
