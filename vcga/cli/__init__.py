"""The ``vcga`` command line (click).

Subcommands live in their own modules and load only when invoked, so ``vcga --help`` imports
neither torch nor any plugin. Only the CLI prints; the library logs and raises. A
:class:`~vcga.errors.VcgaError` becomes a one-line message and exit status 2 -- no traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from vcga import __version__

# name -> (module, function, one-line help). The help is here so `vcga --help` needs no import.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": ("vcga.cli.bench", "bench", "Measure collectives as nccl-tests does (time, algbw, busbw, #wrong)."),
    "info": ("vcga.cli.info", "info", "Show plugins, backends, availability and capabilities."),
    "verify": ("vcga.cli.verify", "verify", "Certify that a backend's collectives are numerically right."),
    "convert": ("vcga.cli.convert", "convert", "Convert a checkpoint between formats (streaming, exact, atomic)."),
    "inspect": ("vcga.cli.inspect", "inspect", "List a checkpoint's tensors and check their checksums."),
    "trace": ("vcga.cli.trace", "trace", "Analyze every rank's flight-recorder dump: who left which collective out."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when run (or asked for their help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(SUBCOMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in SUBCOMMANDS:
            module, attr, _ = SUBCOMMANDS[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][2]) for name in sorted(SUBCOMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vcga")
def cli() -> None:
    """VCGA: vendor-neutral collectives and checkpoints for PyTorch.

    Run one training script on NVIDIA (NCCL), Ascend (HCCL), Cambricon MLU (CNCL) and CPU (gloo),
    certify a backend with `vcga verify`, and move checkpoints between ecosystems.
    """


def main(argv: list[str] | None = None) -> Any:
    from vcga.errors import VcgaError

    try:
        return cli.main(args=argv, prog_name="vcga", standalone_mode=True)
    except VcgaError as e:  # pragma: no cover - commands catch their own; this is the last net
        click.echo(f"vcga: error: {e}", err=True)
        sys.exit(2)
