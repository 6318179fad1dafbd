"""``vcga convert SRC DST``: any checkpoint format to any other, streaming, exact, atomic."""

from __future__ import annotations

import json

import click

from vcga.cli._common import errors_as_one_line, human_bytes, progress_bar

EPILOG = """\b
Examples:
  vcga convert model.h5 model.safetensors
  vcga convert model.safetensors model.mindrecord --shard-size 2GiB
  vcga convert model.pt model.h5 --cast bfloat16=float32 --verify
  vcga convert ckpt.bin out.vbin --from torch --to vendor-bin
Formats are recognised by their signature, then by extension; `vcga inspect --formats` lists them.
"""


@click.command(epilog=EPILOG)
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--from", "src_format", metavar="FORMAT", help="Source format (default: detected).")
@click.option("--to", "dst_format", metavar="FORMAT", help="Target format (default: from DST's extension).")
@click.option("--cast", "casts", multiple=True, metavar="FROM=TO",
              help="Cast every FROM tensor to TO, e.g. bfloat16=float32 (repeatable). Without it a dtype the "
                   "target lacks is an error, never a silent cast.")
@click.option("--shard-size", metavar="SIZE", help="Bytes per shard for formats that shard (e.g. 2GiB, 500MB).")
@click.option("--verify", is_flag=True, help="Re-read the output and compare every tensor's checksum before "
                                             "moving it into place.")
@click.option("--overwrite", is_flag=True, help="Replace existing destination files (never the source).")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="Writer option for the target format, e.g. -o compression=gzip for hdf5 (repeatable).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the conversion report as JSON.")
def convert(src: str, dst: str, src_format: str | None, dst_format: str | None, casts: tuple[str, ...],
            shard_size: str | None, verify: bool, overwrite: bool, options: tuple[str, ...], progress: bool | None,
            as_json: bool) -> None:
    """Convert checkpoint SRC into DST (hdf5, mindrecord, vendor-bin, safetensors, torch, mindspore-ckpt).

    Streams tensor by tensor (memory: about two tensors), checks that the target holds every
    dtype exactly before writing anything, and leaves DST absent on any error.
    """
    from vcga.convert import convert as run
    from vcga.convert import parse_casts, parse_options

    with errors_as_one_line():
        cast_map = parse_casts(casts)
        writer_options = parse_options(options)
        with progress_bar(progress) as update:
            report = run(src, dst, src_format=src_format, dst_format=dst_format, casts=cast_map,
                         shard_size=shard_size, verify=verify, overwrite=overwrite, writer_options=writer_options,
                         progress=update)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    rate = report.bytes / report.seconds / 1e6 if report.seconds > 0 else 0.0
    casts_txt = "".join(f", cast {k} x{v}" for k, v in report.casts.items())
    click.echo(f"converted {report.tensors} tensors ({human_bytes(report.bytes)}) {report.source_format} -> "
               f"{report.target_format} in {report.seconds:.2f} s ({rate:.0f} MB/s){casts_txt}"
               f"{', verified' if report.verified else ''}")
    for path in report.outputs:
        click.echo(f"  wrote {path}")
    for note in report.notes:
        click.echo(f"  note: {note}")
