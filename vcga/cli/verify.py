"""``vcga verify``: run the conformance suite and print a summary table.

Plain ``vcga verify`` runs the quick profile on its default worlds (gloo, and a simulated
mixed-vendor world when this build has the bridge); ``--backend`` certifies one backend. The exit
status is 0 when every case passed, 1 when any failed (or nothing ran), 2 for a usage error.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from typing import Any

import click

from vcga.errors import VcgaError


@click.command()
@click.option("--backend", "backends", multiple=True, metavar="NAME",
              help="Backend to certify (repeatable). Default: the profile's backends plus its simulated "
                   "mixed-vendor sets.")
@click.option("--world-size", "world_sizes", multiple=True, type=click.IntRange(1, 64), metavar="N",
              help="World size to spawn for each backend (repeatable). Default: the profile's.")
@click.option("--profile", "profile", default="quick", show_default=True, metavar="quick|full|FILE",
              help="A built-in profile or a YAML profile file (see docs/conformance.md).")
@click.option("--mixed", "mixed", multiple=True, metavar="SPEC",
              help='Simulated vendor set to verify, e.g. "nccl:2,hccl:2" (repeatable; "none" for none).')
@click.option("--check", "checks", multiple=True, metavar="NAME", help="Run only this check (repeatable).")
@click.option("--group", "group", type=click.Choice(["auto", "vcga", "native"]), default=None,
              help="Verify through the vcga process group or the backend's native group "
                   "(default: the profile's, usually auto = vcga when this build registers it).")
@click.option("--timeout", "timeout", default=None, type=click.FloatRange(min=0.1),
              help="Collective timeout in seconds (default: the profile's).")
@click.option("--report", "report", default=None, type=click.Path(dir_okay=False, writable=True),
              help="Write the JSON report here (schema: docs/conformance.md).")
@click.option("--junit", "junit", default=None, type=click.Path(dir_okay=False, writable=True),
              help="Write JUnit XML here (one testsuite per world).")
@click.option("--list", "list_checks", is_flag=True, help="List the registered checks and exit.")
@click.option("--quiet", "-q", is_flag=True, help="No live progress; only the summary.")
def verify(backends: tuple[str, ...], world_sizes: tuple[int, ...], profile: str, mixed: tuple[str, ...],
           checks: tuple[str, ...], group: str | None, timeout: float | None, report: str | None,
           junit: str | None, list_checks: bool, quiet: bool) -> None:
    """Certify that a backend's collectives are numerically right."""
    import signal

    from vcga.cli._common import stdout_console

    # SIGTERM (a CI job cancelled) unwinds like Ctrl-C, so the runner's cleanup kills every rank
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = stdout_console(highlight=False)
    try:
        if list_checks:
            _list(console)
            return
        code = _run(console, backends, world_sizes, profile, mixed, checks, group, timeout, report, junit, quiet)
    except VcgaError as e:
        click.echo(f"vcga verify: error: {e}", err=True)
        sys.exit(2)
    sys.exit(code)


def _list(console: Any) -> None:
    from rich.table import Table

    from vcga.plugin_manager import get_plugin_manager

    table = Table(title="conformance checks")
    for col in ("check", "what it proves", "options (defaults)"):
        table.add_column(col)
    for c in get_plugin_manager().conformance_checks():
        opts = ", ".join(f"{k}={v}" for k, v in (getattr(c, "defaults", {}) or {}).items())
        table.add_row(c.name, getattr(c, "description", ""), opts)
    console.print(table)


def _run(console: Any, backends: tuple[str, ...], world_sizes: tuple[int, ...], profile_name: str,
         mixed: tuple[str, ...], checks: tuple[str, ...], group: str | None, timeout: float | None,
         report: str | None, junit: str | None, quiet: bool) -> int:
    from vcga import spawn
    from vcga.conformance.profiles import load_profile
    from vcga.conformance.suite import build_worlds, rank_preloads, run_suite

    prof = load_profile(profile_name)
    # starts the ranks' forkserver now, with what the planned checks' ranks import (DDP's dynamo):
    # its imports overlap this process's
    spawn.get_context(rank_preloads(prof, list(checks) or None))
    from vcga.conformance.report import (
        build_report,
        summary_rows,
        write_junit,
        write_report,
    )

    mixed_sets: list[str] | None = None
    if mixed:
        mixed_sets = [] if list(mixed) == ["none"] else list(mixed)
    worlds = build_worlds(prof, backends=backends or None, world_sizes=world_sizes or None, mixed=mixed_sets,
                          group=group)
    console.print(f"vcga verify: profile [bold]{_esc(prof.name)}[/bold] ({_esc(prof.source)}); worlds: "
                  + _esc(", ".join(w.id for w in worlds)))
    _print_plugin_failures(console)
    log_dir = tempfile.mkdtemp(prefix="vcga-verify-")
    progress = _Progress(console, quiet)
    try:
        outcome = run_suite(prof, worlds, checks=list(checks) or None, timeout_s=timeout, on_event=progress,
                            log_dir=log_dir)
    finally:
        progress.stop()
    _print_summary(console, outcome, summary_rows(outcome))
    if report:
        write_report(report, build_report(outcome, ["vcga", *sys.argv[1:]]))
        console.print(f"report: {report}")
    if junit:
        write_junit(junit, outcome)
        console.print(f"junit: {junit}")
    rows = outcome.rows()
    passed = sum(r.passed and not r.skipped for _, _, r in rows)
    skipped = sum(r.skipped for _, _, r in rows)
    failed = outcome.failed
    console.print(f"{passed} passed, {failed} failed, {skipped} skipped in {outcome.elapsed_s:.1f} s")
    if failed:
        console.print(f"rank logs and flight-recorder dumps: {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    if not passed and not failed:
        console.print("[red]no case ran[/red]")
        return 1
    return 1 if failed else 0


def _print_plugin_failures(console: Any) -> None:
    """Name every plugin that did not load (a crashing import included) before the worlds run: the
    ranks go on without it, and a backend it would have provided is then reported missing."""
    from vcga.plugin_manager import get_plugin_manager

    for p in get_plugin_manager().plugins():
        if p.status == "failed":
            console.print(f"[yellow]plugin not loaded[/yellow]: {_esc(p.name)} ({_esc(p.source)}): {_esc(p.error)}",
                          soft_wrap=True)


class _Progress:
    """Live progress: a line per world and per finished check; on a terminal, a status line with
    the case running now."""

    def __init__(self, console: Any, quiet: bool) -> None:
        self.console, self.quiet = console, quiet
        self.status: Any = None
        self.last = 0.0
        if not quiet and console.is_terminal:
            self.status = console.status("starting")
            self.status.start()

    def __call__(self, event: Any) -> None:
        if self.quiet:
            return
        kind = event.kind
        w = event.world.id
        if kind == "world-start":
            attempt = event.data.get("attempt", 1)
            again = f", attempt {attempt}" if attempt > 1 else ""
            self.console.print(f"[bold]{_esc(w)}[/bold]: {event.data.get('group')} group, "
                               f"{len(event.data.get('checks', []))} checks{again}")
        elif kind == "check-done":
            d = event.data
            mark = "[red]✗[/red]" if d.get("failed") else "[green]✓[/green]"
            parts = [f"{d.get('passed', 0)} passed"]
            if d.get("failed"):
                parts.append(f"[red]{d['failed']} failed[/red]")
            if d.get("skipped"):
                parts.append(f"{d['skipped']} skipped")
            self.console.print(f"  {mark} {_esc(event.check):<22} {', '.join(parts)}")
        elif kind == "world-problem":
            self.console.print(f"  [red]![/red] {_esc(event.check or '')}: {_esc(event.detail)}", soft_wrap=True)
        elif kind == "world-done" and event.data.get("status") == "skipped":
            self.console.print(f"[bold]{_esc(w)}[/bold]: [yellow]skipped[/yellow]: {_esc(event.detail)}",
                               soft_wrap=True)
        elif kind == "case" and self.status is not None:
            now = time.monotonic()
            if now - self.last > 0.1:
                self.last = now
                self.status.update(_esc(f"{w} {event.check}: {event.case}"))

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()


def _esc(text: Any) -> str:
    """Escape rich markup: case names and library messages contain [brackets]."""
    from rich.markup import escape

    return escape(str(text))


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def _print_summary(console: Any, outcome: Any, rows: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="vcga verify summary")
    for col, justify in (("check", "left"), ("backend", "left"), ("dtype", "left"), ("cases", "right"),
                         ("failed", "right"), ("skipped", "right"), ("worst error / bound", "right"),
                         ("result", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "backend")  # type: ignore[arg-type]
    for row in rows:
        verdict = {"FAIL": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]",
                   "pass": "[green]pass[/green]"}[row.verdict]
        err = "" if row.worst_error is None else f"{_fmt(row.worst_error)} / {_fmt(row.bound)}"
        table.add_row(_esc(row.check), _esc(row.backend), row.dtype, str(row.cases), str(row.failed or ""),
                      str(row.skipped or ""), err, verdict)
    console.print(table)
    failures = [(world, r) for world, _, r in outcome.rows() if not r.passed]
    if failures:
        console.print("[bold red]failures[/bold red]")
        for world, r in failures[:60]:
            cell = ""
            if r.cell:  # which cell failed, and the native cell an emulated one is derived from
                cell = f" (cell {r.cell}" + (f", derived from {r.derived_from}" if r.derived_from else "") + ")"
            console.print("  [red]FAIL[/red] " + _esc(f"{r.check} [{world}] {r.case}: {r.detail}{cell}"),
                          soft_wrap=True)
        if len(failures) > 60:
            console.print(f"  ... and {len(failures) - 60} more (see --report)")
    skipped_worlds = [w for w in outcome.worlds if w.status == "skipped"]
    for w in skipped_worlds:
        console.print(f"[yellow]not verified[/yellow]: {_esc(w.spec.id)}: {_esc(w.detail)}", soft_wrap=True)
