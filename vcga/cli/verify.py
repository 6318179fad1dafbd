"""``vcga verify``: run the conformance checks on a backend and print a result table."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--backend", "backend", default="gloo", show_default=True, help="Backend to certify.")
@click.option("--world-size", "world_size", default=2, show_default=True, type=click.IntRange(1, 16),
              help="Ranks to spawn on this machine.")
@click.option("--timeout", "timeout", default=60.0, show_default=True, type=click.FloatRange(min=1),
              help="Collective timeout in seconds.")
def verify(backend: str, world_size: int, timeout: float) -> None:
    """Certify that a backend's collectives are numerically right."""
    from rich.console import Console
    from rich.table import Table

    from vcga.conformance.runner import run_world

    console = Console()
    console.print(f"vcga verify: backend [bold]{backend}[/bold], {world_size} ranks")
    results = run_world(backend, world_size, timeout_s=timeout)
    table = Table()
    for col in ("check", "backend", "case", "worst error / bound", "result"):
        table.add_column(col)
    failed = 0
    for r in results:
        if r.skipped:
            verdict = "[yellow]skip[/yellow]"
        elif r.passed:
            verdict = "[green]pass[/green]"
        else:
            verdict = "[red]FAIL[/red]"
            failed += 1
        err = "" if r.worst_error is None else f"{r.worst_error:.3g} / {r.bound:.3g}"
        table.add_row(r.check, r.backend, r.case + (f"\n{r.detail}" if r.detail else ""), err, verdict)
    console.print(table)
    if not results:
        console.print("[red]no check ran[/red]")
        sys.exit(1)
    console.print(f"{len(results) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
