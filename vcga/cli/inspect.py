"""``vcga inspect FILE``: a checkpoint's tensors (name, dtype, shape, bytes, checksum status)."""

from __future__ import annotations

import json
import sys

import click

from vcga.cli._common import errors_as_one_line, human_bytes, progress_bar, stdout_console

_STATUS_STYLE = {"ok": "[green]ok[/green]", "MISMATCH": "[red]MISMATCH[/red]", "computed": "computed",
                 "stored": "stored", "none": "[dim]none[/dim]"}


@click.command()
@click.argument("file", metavar="FILE", required=False)
@click.option("--from", "src_format", metavar="FORMAT", help="Format of FILE (default: detected).")
@click.option("--verify", is_flag=True, help="Read every tensor and check it against its stored checksum "
                                             "(or show the computed one).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--formats", "list_formats", is_flag=True, help="List the formats VCGA can read and write.")
@click.option("--progress/--no-progress", default=None, help="Progress bar for --verify (default: on a terminal).")
def inspect(file: str | None, src_format: str | None, verify: bool, as_json: bool, list_formats: bool,
            progress: bool | None) -> None:
    """Show the tensors of checkpoint FILE: name, dtype, shape, bytes and checksum status.

    Exit status 1 when --verify finds a checksum mismatch, 2 on a malformed file.
    """
    from rich.table import Table

    console = stdout_console()
    if list_formats:
        from vcga import dtypes
        from vcga.convert import available_formats

        specs = available_formats()
        if as_json:
            click.echo(json.dumps([{"name": s.name, "extensions": list(s.extensions),
                                    "dtypes": [d for d in dtypes.EVERY if d in s.dtypes],
                                    "description": s.description} for s in specs], indent=2))
            return
        table = Table(title="Checkpoint formats", title_justify="left")
        for col in ("format", "extensions", "dtypes it lacks", "description"):
            table.add_column(col)
        for s in specs:
            lacks = [d for d in dtypes.EVERY if d not in s.dtypes]
            table.add_row(s.name, " ".join(s.extensions), ", ".join(lacks) or "-", s.description)
        console.print(table)
        return
    if file is None:
        raise click.UsageError("give a FILE (or --formats)")
    from vcga.convert.inspect import inspect_checkpoint

    with errors_as_one_line(), progress_bar(progress if verify else False) as update:
        report = inspect_checkpoint(file, src_format=src_format, verify=verify, progress=update)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        table = Table(title=f"{report.path} ({report.format}, {len(report.tensors)} tensors, "
                            f"{human_bytes(report.total_bytes)})", title_justify="left")
        for col in ("name", "dtype", "shape", "bytes", "checksum"):
            table.add_column(col, justify="right" if col == "bytes" else "left")
        for row in report.tensors:
            status = _STATUS_STYLE.get(row["status"], row["status"])
            shown = f"{status} {row['checksum']}" if row["checksum"] else status
            table.add_row(row["name"], row["dtype"], "[" + ", ".join(map(str, row["shape"])) + "]",
                          f"{row['bytes']:,}", shown)
        console.print(table)
        if report.metadata:
            meta = Table(title="metadata", title_justify="left")
            meta.add_column("key")
            meta.add_column("value")
            for k, v in report.metadata.items():
                meta.add_row(k, v if len(v) <= 200 else v[:197] + "...")
            console.print(meta)
        if verify:
            console.print(f"{len(report.tensors) - report.mismatches} tensors verified, {report.mismatches} mismatched")
    if report.mismatches:
        sys.exit(1)
