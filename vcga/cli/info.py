"""``vcga info``: every plugin, backend, availability with its reason, devices and capabilities."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from vcga.errors import VcgaError


def collect(verbose: bool = False) -> dict[str, Any]:
    """The facts ``vcga info`` shows, as a JSON-ready dict (also used by tests)."""
    from vcga import __version__
    from vcga.config import load_config
    from vcga.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    config = load_config()
    out: dict[str, Any] = {
        "vcga": __version__,
        "python": sys.version.split()[0],
        "autoload_disabled": pm.autoload_disabled,
        "config": config.to_dict(),
        "plugins": [],
        "backends": [],
        "selected_backend": None,
        "selection_error": None,
    }
    records = pm.backend_records()  # loads plugins and calls vcga_backends
    for rec in records:
        entry: dict[str, Any] = rec.backend.describe()
        entry["plugin"] = rec.plugin
        probe = rec.probe()
        entry.update(available=probe.available, reason=probe.reason, device_count=probe.device_count,
                     versions=dict(probe.versions))
        try:
            table = rec.backend.capabilities()
            entry["capabilities"] = table.summary()
            if verbose:
                entry["capability_cells"] = table.to_json()
        except Exception as e:  # isolation: one plugin's broken table must not hide the others
            entry["capabilities"] = None
            entry["capabilities_error"] = f"{type(e).__name__}: {e}"
        out["backends"].append(entry)
    out["plugins"] = [p.to_json() for p in pm.plugins()]
    try:
        out["selected_backend"] = pm.select_backend(config).name
    except VcgaError as e:
        out["selection_error"] = str(e)
    return out


def _render(data: dict[str, Any]) -> None:
    from vcga.cli._common import stdout_console
    from rich.table import Table

    console = stdout_console()
    console.print(f"[bold]vcga {data['vcga']}[/bold] (python {data['python']})"
                  + ("  [yellow]entry-point autoload disabled[/yellow]" if data["autoload_disabled"] else ""))

    pt = Table(title="Plugins", title_justify="left")
    for col in ("plugin", "source", "status", "error"):
        pt.add_column(col)
    for p in data["plugins"]:
        status = {"loaded": "[green]loaded[/green]", "failed": "[red]failed[/red]"}.get(p["status"], p["status"])
        err = p["error"] or "; ".join(f"{k}: {v}" for k, v in p["hook_errors"].items())
        pt.add_row(p["name"], p["source"], status, err or "")
    console.print(pt)

    bt = Table(title="Backends", title_justify="left")
    for col in ("backend", "vendor", "device", "library", "ok", "devs", "cells n/e/r", "all_reduce ops"):
        bt.add_column(col, overflow="fold", no_wrap=col == "cells n/e/r")
    for b in data["backends"]:
        avail = "[green]yes[/green]" if b["available"] else "[red]no[/red]"
        caps = b.get("capabilities")
        if caps:
            c = caps["cells"]
            counts = f"{c['native']}/{c['emulated']}/{c['refused']}"
            ops = " ".join(caps["all_reduce_native_ops"]).replace("PRODUCT", "PROD").replace("PREMUL_SUM", "PREMUL") or "-"
        else:
            counts, ops = "[red]error[/red]", b.get("capabilities_error", "-")
        lib = b["dist_backend"] + (f" (sim {b['stands_for']})" if b.get("simulated") else "")
        bt.add_row(b["name"], b["vendor"], b["device_type"], lib, avail, str(b["device_count"]), counts, ops)
    console.print(bt)
    console.print("[bold]Availability[/bold]")
    for b in data["backends"]:
        versions = ", ".join(f"{k} {v}" for k, v in b["versions"].items())
        mark = "[green]available[/green]" if b["available"] else "[red]unavailable[/red]"
        console.print(f"  {b['name']}: {mark}: {b['reason']}" + (f" ({versions})" if versions else ""),
                      highlight=False, soft_wrap=True)
    if data["selected_backend"]:
        console.print(f"selected backend for this process: [bold]{data['selected_backend']}[/bold]")
    else:
        console.print(f"[red]no backend can be selected[/red]: {data['selection_error']}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the same facts as JSON.")
@click.option("--cells", is_flag=True, help="With --json: include every capability cell.")
def info(as_json: bool, cells: bool) -> None:
    """Show every plugin, backend, availability with the reason, devices and capabilities."""
    try:
        data = collect(verbose=cells)
    except VcgaError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=False))
    else:
        _render(data)
