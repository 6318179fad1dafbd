"""``vcga trace DIR``: every rank's flight-recorder dump, analyzed (:func:`vcga.flight_recorder.analyze`)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from vcga.cli._common import errors_as_one_line


def _rank_line(r: int, row: dict[str, Any]) -> str:
    who = f"rank {r} ({row.get('vendor') or '?'}, {row.get('backend') or '?'} on {row.get('library') or '?'})"
    if not row.get("joined"):
        return f"{who}: never called it" + ("" if row.get("dump", True) else " (and left no dump)")
    sizes = row.get("input_sizes")
    text = f"{who}: {row['op']} " + (f"of {sizes} {row.get('input_dtypes')}" if sizes else "(no tensors)")
    text += f", {row['state']}"
    if row.get("stage"):
        text += f", in {row['stage']}"
    if row.get("error"):
        error = row["error"].split(";")[0]
        text += f"; {error if len(error) <= 160 else error[:157] + '...'}"
    if row.get("called_from"):
        text += f"; called from {row['called_from']}"
    return text


@click.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--prefix", metavar="PREFIX", help="The dump files' common name prefix (default: vcga_fr_trace_rank_, "
                                                 "else inferred from the names).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
def trace(directory: str, prefix: str | None, as_json: bool) -> None:
    """Analyze the flight-recorder dumps every rank wrote into DIR (on a timeout, an abort, SIGUSR1
    or vcga.flight_recorder.dump()) with torch's flight-recorder analyzer.

    Names the first collective of each group that not every rank joined, the ranks missing from
    it, and calls that differ in op, sizes or dtypes, with each rank's vendor. Exit status 1 when
    it finds a problem, 2 when DIR holds no readable dump.
    """
    from vcga.flight_recorder import analyze

    with errors_as_one_line():
        report = analyze(directory, prefix)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        sys.exit(1 if report["problems"] else 0)
    echo = click.echo
    ranks = report["ranks"]
    echo(f"{len(ranks)} dumps in {report['directory']} (flight-recorder version {report['version']}); "
         f"{report['matched']} collectives matched on every rank")
    for r, info in sorted(ranks.items()):
        reason = (info.get("reason") or "").split(";")[0]
        echo(f"  rank {r}: {info.get('vendor') or '?'}, backend {info.get('backend') or '?'} on "
             f"{info.get('library') or '?'}, {info['entries']} entries" + (f"; dump: {reason}" if reason else ""))
    if report["missing_dumps"]:
        echo(click.style(f"no dump from rank(s) {report['missing_dumps']}", bold=True) + ": a rank that was killed, "
             "or that never timed out (dump it with SIGUSR1 or vcga.flight_recorder.dump())")
    if not report["problems"]:
        echo("no collective that some rank left out or called differently")
        return
    for p in report["problems"]:
        where = f"group {p['group']}" + (f" ({p['desc']})" if p["desc"] and p["desc"] != p["group"] else "")
        if p["kind"] == "missing ranks":
            head = f"{where}: collective #{p['seq']} ({p['op']}) was not joined by rank(s) {p['missing_ranks']}"
        else:
            odd = f"; rank(s) {p['odd_ranks']} differ from the others" if p["odd_ranks"] else ""
            head = f"{where}: collective #{p['seq']} ({p['op']}): {p['kind']}{odd}"
        echo(click.style(head, fg="red", bold=True))
        for m in p["mismatches"]:
            if m.get("detail"):
                echo(f"  rank {m['rank']}: {m['detail']}")
        for r, row in sorted(p["ranks"].items()):
            echo("  " + _rank_line(r, row))
    sys.exit(1)
