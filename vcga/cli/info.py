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
        except Exception as e:  # noqa: BLE001 - isolation: one plugin's broken table must not hide the others
            entry["capabilities"] = None
            entry["capabilities_error"] = f"{type(e).__name__}: {e}"
        out["backends"].append(entry)
    out["plugins"] = [p.to_json() for p in pm.plugins()]
    out["compressors"] = [{"name": spec.name, "plugin": pname, "description": spec.description,
                           "options": {k: o.default for k, o in spec.options.items()}}
                          for pname, spec in pm.compressors()]
    try:
        out["selected_backend"] = pm.select_backend(config).name
    except VcgaError as e:
        out["selection_error"] = str(e)
    return out


def _render(data: dict[str, Any]) -> None:
    from rich.table import Table

    from vcga.cli._common import stdout_console

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
    for col in ("backend", "vendor", "device", "library", "ok", "devs", "cells n/e/r", "derived", "all_reduce ops"):
        bt.add_column(col, overflow="fold", no_wrap=col == "cells n/e/r")
    for b in data["backends"]:
        avail = "[green]yes[/green]" if b["available"] else "[red]no[/red]"
        caps = b.get("capabilities")
        if caps:
            c = caps["cells"]
            counts = f"{c['native']}/{c['emulated']}/{c['refused']}"
            derived = str(caps.get("derived_cells", ""))
            ops = (" ".join(caps["all_reduce_native_ops"]).replace("PRODUCT", "PROD").replace("PREMUL_SUM", "PREMUL")
                   or "-")
        else:
            counts, derived, ops = "[red]error[/red]", "", b.get("capabilities_error", "-")
        lib = b["dist_backend"] + (f" (sim {b['stands_for']})" if b.get("simulated") else "")
        bt.add_row(b["name"], b["vendor"], b["device_type"], lib, avail, str(b["device_count"]), counts, derived, ops)
    console.print(bt)
    console.print("[bold]Availability[/bold]")
    for b in data["backends"]:
        versions = ", ".join(f"{k} {v}" for k, v in b["versions"].items())
        mark = "[green]available[/green]" if b["available"] else "[red]unavailable[/red]"
        console.print(f"  {b['name']}: {mark}: {b['reason']}" + (f" ({versions})" if versions else ""),
                      highlight=False, soft_wrap=True)
    ct = Table(title="Gradient compressors (spec name[:key=value,...]; docs/compression.md)", title_justify="left")
    for col in ("compressor", "plugin", "options (defaults)", "what"):
        ct.add_column(col, overflow="fold")
    for c in data.get("compressors", []):
        opts = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in c["options"].items())
        ct.add_row(c["name"], c["plugin"], opts, c["description"])
    console.print(ct)
    if data["selected_backend"]:
        console.print(f"selected backend for this process: [bold]{data['selected_backend']}[/bold]")
    else:
        console.print(f"[red]no backend can be selected[/red]: {data['selection_error']}")


#: Column headings of the cell grid (``vcga info --cells``), one per canonical dtype.
_SHORT = {"bool": "bool", "uint8": "u8", "int8": "i8", "int16": "i16", "uint16": "u16", "int32": "i32",
          "uint32": "u32", "int64": "i64", "uint64": "u64", "float16": "f16", "bfloat16": "bf16", "float32": "f32",
          "float64": "f64", "complex64": "c64", "complex128": "c128", "float8_e4m3fn": "f8e4", "float8_e5m2": "f8e5"}
_MARK = {"native": "N", "stated": "E", "derived": "d", "refused": "·"}


def _render_cells(data: dict[str, Any], only: tuple[str, ...]) -> None:
    """Every backend's table as a grid: one row per collective (and reduce op), one column per dtype.
    N native, E emulated as the plugin stated, d emulation VCGA derived, · refused."""
    from rich.table import Table

    from vcga import dtypes as vdt
    from vcga.cli._common import stdout_console
    from vcga.contract import Collective, ReduceOp

    console = stdout_console()
    for b in data["backends"]:
        if only and b["name"] not in only:
            continue
        rows = b.get("capability_cells")
        if rows is None:
            console.print(f"[red]{b['name']}: no capability table[/red]: {b.get('capabilities_error', '')}")
            continue
        cells = {(r["collective"], r["dtype"], r["op"]): r for r in rows}
        grid = Table(title=f"{b['name']}: N native, E emulated as stated, d derived by VCGA, · refused",
                     title_justify="left", pad_edge=False, box=None)
        grid.add_column("cell")
        for dt in vdt.ALL:
            grid.add_column(_SHORT.get(dt, dt), justify="center")
        for coll in Collective:
            for op in (list(ReduceOp) if coll.reduces else [None]):
                marks = []
                for dt in vdt.ALL:
                    r = cells.get((coll.value, dt, op.value if op else None))
                    kind = "refused" if r is None or r["support"] == "refused" else (
                        "native" if r["support"] == "native" else ("derived" if r.get("derived") else "stated"))
                    marks.append(_MARK[kind])
                grid.add_row(coll.value + (f" {op.value}" if op else ""), *marks)
        console.print(grid)
        console.print("derived cells and what they run on: vcga info --json --cells (derived, derived_from)")


# ---------------------------------------------------------------------------------------------------
# vcga info --plan: the mixed-vendor plan the ranks of a layout would compute
# ---------------------------------------------------------------------------------------------------


def _parse_counts(spec: str, option: str) -> list[tuple[str, int]]:
    out = []
    for part in spec.replace(" ", "").split(","):
        name, sep, count = part.rpartition(":")
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise click.BadParameter(f"{spec!r}: expected name:count pairs, e.g. nccl:2,hccl:2", param_hint=option)
        out.append((name, int(count)))
    return out


def collect_plan(vendors: str | None = None, backends: str | None = None, nodes: int | None = None,
                 algorithm: str | None = None, figures: str | None = None,
                 compression: str | None = None, weights: str | None = None,
                 global_batch: int | None = None) -> dict[str, Any]:
    """The bridge plan for a layout, as JSON-ready dict (what every rank of that layout computes).

    The layout is ``backends`` (registered backend names with counts, e.g. ``nccl:8,hccl:8``), or
    ``vendors`` (the ``VCGA_SIM_VENDORS`` syntax: simulated vendors), or else the configured
    ``sim_vendors``/``backend``. Rank r gets its backend exactly as :func:`vcga.process_group`
    selects it (the plugins' ``vcga_rank_backend`` answer for simulated sets); ``nodes`` splits the
    ranks into that many equal, consecutive nodes ``node0``, ``node1``, ... (torchrun's layout);
    without it every rank is on this host, as in a single-node run. ``figures``: a JSON file of
    measured α–β figures (a group's ``transport.describe()["calibration"]``, or its ``figures``;
    benchmarks/multinode.py ``--figures`` writes one): the choice per message size they predict.
    ``compression`` (default: the configured ``compression``) adds where and from which size
    gradient compression applies. ``weights`` (``nccl=2.5,hccl=1``) with ``global_batch``: the
    samples of each global batch every rank takes under :class:`vcga.balance.Balancer`.
    """
    from dataclasses import replace

    from vcga.bridge import link_classes, node_name, plan_for_layout
    from vcga.config import load_config, parse_sim_vendors
    from vcga.errors import VcgaConfigError
    from vcga.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    config = load_config()
    if algorithm is not None:
        config = replace(config, bridge_algorithm=algorithm)
    if backends is not None:
        names = [name for name, n in _parse_counts(backends, "--backends") for _ in range(n)]
        source = f"--backends {backends}"
    else:
        if vendors is not None:
            sim = vendors.replace(" ", "")
            config = replace(config, sim_vendors=sim, backend="auto")
            parse_sim_vendors(sim, "--vendors")
        if not config.sim_vendors:
            raise click.UsageError("no layout to plan: give --vendors nccl:2,hccl:2 (simulated vendors), "
                                   "--backends nccl:8,hccl:8 (registered backends), or set VCGA_SIM_VENDORS")
        size = sum(n for _, n in parse_sim_vendors(config.sim_vendors))
        names = []
        for r in range(size):
            name = (config.backend if config.backend != "auto" else
                    pm.call_first("vcga_rank_backend", rank=r, world_size=size, config=config))
            if name is None:
                raise VcgaConfigError("sim_vendors", config.sim_vendors, "a loaded plugin that lays out simulated "
                                      "vendors (vcga.plugins.sim; is plugin autoload or VCGA_PLUGINS excluding it?)")
            names.append(name)
        source = (f"sim_vendors {config.sim_vendors}"
                  + (f", backend {config.backend}" if config.backend != "auto" else ""))
    size = len(names)
    if nodes is not None:
        if nodes < 1 or size % nodes:
            raise click.BadParameter(f"{nodes}: must divide the {size} ranks into equal nodes", param_hint="--nodes")
        node_of = [f"node{r // (size // nodes)}" for r in range(size)]
    else:
        node_of = [node_name()] * size
    records = {n: pm.backend(n) for n in dict.fromkeys(names)}
    out: dict[str, Any] = {"layout": source, "size": size, "nodes": list(dict.fromkeys(node_of)),
                           "backends": [records[n].name for n in names], "bridge": len(records) > 1}
    if len(records) > 1:
        plan, tables = plan_for_layout([records[n] for n in names], node_of, config.bridge_algorithm)
        out["plan"] = plan.describe(tables=tables)
        # how each set of shard peers reduces on the host (docs/bridge.md, "The host exchange")
        out["shard_exchange"] = ["shared memory" if config.bridge_shm and len({node_of[r] for r in peers}) == 1
                                 else "gloo" for peers in out["plan"]["shard_peers"]]
        out["link_classes"] = link_classes(plan, [{"node": n} for n in node_of])
        # whether the group pipelines consecutive all_reduces (docs/bridge.md); then "auto" chooses
        # by the cost per all_reduce of such a stream, as the ranks will
        from vcga.bridge.plan import pipelines

        out["pipeline"] = pipelines(plan, [{"node": n} for n in node_of], config.bridge_pipeline,
                                    config.bridge_async, config.bridge_shm)
        if figures is not None:
            out["figures"] = _figure_choices(plan, figures, out["pipeline"])
    elif figures is not None:
        raise click.UsageError("--figures needs a mixed-vendor layout (one backend has no bridge to choose for)")
    if weights is not None:
        out["shares"] = _shares(weights, global_batch, [records[n] for n in names])
    text = compression if compression is not None else config.compression
    if text:
        from vcga.compress import parse_spec
        from vcga.compress.plan import describe

        spec = parse_spec(text, source="--compression" if compression is not None else "config compression")
        if spec.enabled:
            facts = [(n, node_of[r], records[n].device_type) for r, n in enumerate(names)]
            out["compression"] = describe(spec, facts)
    return out


def _shares(weights: str, global_batch: int | None, records: list[Any]) -> dict[str, Any]:
    """What :class:`vcga.balance.Balancer` gives each rank of the layout for vendor ``weights``."""
    from vcga.balance.shares import counts_from_weights, parse_weights

    if global_batch is None:
        raise click.UsageError("--weights needs --global-batch: the samples of one optimizer step over all ranks")
    w = parse_weights(weights, "--weights")
    ranks = [(b.name, b.describe().get("stands_for")) for b in records]
    return {"weights": w, "global_batch": global_batch, "backends": [b for b, _ in ranks],
            "counts": counts_from_weights(global_batch, w, ranks, key="--weights")}


def _render_shares(s: dict[str, Any]) -> list[str]:
    w = ",".join(f"{k}={v:g}" for k, v in s["weights"].items())
    lines = ["", f"data-parallel shares (vcga.balance; weights {w}; global batch {s['global_batch']}; "
                 "largest remainder, at least 1 per rank)"]
    width = max(len(b) for b in s["backends"])
    for r, (b, c) in enumerate(zip(s["backends"], s["counts"], strict=True)):
        lines.append(f"  rank {r:<3} {b:<{width}}  {c:>6}  ({c / s['global_batch']:.1%})")
    return lines


def _figure_choices(plan: Any, path: str, stream: bool = False) -> dict[str, Any]:
    """The α–β figures in ``path`` and the all_reduce algorithm they predict fastest per size
    (``stream``: in a group that pipelines consecutive all_reduces)."""
    from pathlib import Path

    from vcga.bridge.cost import LinkFigures, choices
    from vcga.bridge.plan import PLAN_SIZES, size_name

    try:
        data = json.loads(Path(path).read_text())
        data = data.get("calibration", data) if isinstance(data, dict) else data
        fig = LinkFigures.from_json(data.get("figures", data))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise click.BadParameter(f"{path}: not a file of bridge link figures ({type(e).__name__}: {e}); "
                                 "write one with benchmarks/multinode.py --figures, or save a group's "
                                 "transport.describe()['calibration']", param_hint="--figures") from None
    if len(fig.groups) != len(plan.groups) or not plan.equal_groups:
        raise click.BadParameter(f"{path}: figures of {len(fig.groups)} vendor groups, but this layout has "
                                 f"{len(plan.groups)}{'' if plan.equal_groups else ' of unequal sizes (leader only)'}",
                                 param_hint="--figures")
    return {"file": path, "figures": fig.to_json(), "choice": choices(fig, PLAN_SIZES, size_name, stream)}


def _calibrate(pdata: dict[str, Any], vendors: str | None, backends: str | None, nodes: int | None,
               algorithm: str | None, figures: str | None) -> dict[str, Any]:
    """--calibrate: measure the layout's links on this host (:func:`vcga.bridge.figcache.calibrate_here`)."""
    from vcga.bridge.figcache import calibrate_here
    from vcga.spawn import RanksFailed

    if figures is not None:
        raise click.UsageError("--calibrate measures the figures; --figures reads them from a file: give one")
    if not pdata["bridge"]:
        raise click.UsageError("--calibrate needs a mixed-vendor layout (one backend has no bridge to measure)")
    if nodes is not None and nodes > 1:
        raise click.UsageError("--calibrate measures this host's links; a multi-node layout measures and caches its "
                               "figures at its next start with bridge_calibration: measure (VCGA_BRIDGE_CALIBRATION)")
    env = {"VCGA_SIM_VENDORS": vendors.replace(" ", "")} if vendors is not None and backends is None else {}
    if algorithm is not None:
        env["VCGA_BRIDGE_ALGORITHM"] = algorithm
    try:
        got = calibrate_here(pdata["size"], env, pdata["backends"] if backends is not None else None)
    except RanksFailed as e:
        raise click.ClickException(f"calibrating the layout failed: {e}") from None
    cal = got["calibration"]
    if not cal:
        raise click.ClickException("the group measured nothing: only equal vendor groups of two or more ranks, with "
                                   "bridge_algorithm auto or bandwidth, have figures to choose by")
    return {"file": f"measured now, cached in {got['cache']}", "figures": cal["figures"], "choice": cal["choice"]}


def _observed(pdata: dict[str, Any], figures: str | None) -> list[dict[str, Any]]:
    """--observed: per set of figures (the --figures file, else each cache entry with observations),
    per size class the observed all_reduce times against the predicted ones (docs/bridge.md,
    "Checked online")."""
    from pathlib import Path

    from vcga.bridge import figcache
    from vcga.bridge.cost import LinkFigures, predict
    from vcga.config import load_config

    if not pdata["bridge"]:
        raise click.UsageError("--observed needs a mixed-vendor layout (one backend has no bridge to choose for)")
    sources: list[tuple[str, Any]] = []
    if figures is not None:
        data = json.loads(Path(figures).read_text())
        data = data.get("calibration", data) if isinstance(data, dict) else data
        sources.append((figures, data.get("figures", data)))
    else:
        directory = figcache.cache_dir(load_config().bridge_figures_cache)
        for path in figcache.entries(directory):
            try:
                entry = json.loads(path.read_text())
                groups = ",".join(f"{g[0]}:{g[4]}" for g in entry["topology"]["groups"])
                sources.append((f"{path} ({groups}, measured {entry.get('measured_at', '?')})", entry["figures"]))
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                continue  # not an entry this version reads (figcache.load says why when a group starts)
    out = []
    for name, raw in sources:
        try:
            fig = LinkFigures.from_json(raw)
        except (ValueError, TypeError, KeyError) as e:
            raise click.BadParameter(f"{name}: not bridge link figures ({type(e).__name__}: {e})",
                                     param_hint="--figures") from None
        rows = []
        for cls, got in sorted(fig.observed.items(), key=lambda kv: int(kv[0])):
            nbytes = int(got.get("bytes", 1 << int(cls)))
            rows.append({"bytes": nbytes, "chosen": got.get("chosen"), "predicted_s": predict(fig, nbytes),
                         "observed_s": dict(got.get("seconds", {}))})
        out.append({"source": name, "classes": rows})
    return out


def _render_observed(data: list[dict[str, Any]]) -> list[str]:
    from vcga.bridge.plan import size_name

    lines = ["", "all_reduce times observed against predicted (ms; per size class, the least of the last calls "
                 "of each algorithm, late ranks' waits left out)"]
    if not data:
        lines.append("  nothing observed yet (no cache entry with observations; --figures FILE reads a saved one)")
    for src in data:
        lines.append(f"  {src['source']}")
        if not src["classes"]:
            lines.append("    no size class settled yet")
        for row in src["classes"]:
            cells = []
            for alg, pred in row["predicted_s"].items():
                obs = row["observed_s"].get(alg)
                cells.append(f"{alg} {pred * 1e3:.1f} / " + (f"{obs * 1e3:.1f}" if obs is not None else "–"))
            lines.append(f"    {size_name(row['bytes']):>7}  chose {row['chosen']:<10}  predicted / observed: "
                         + ", ".join(cells))
    return lines


def _ranks(rs: list[int]) -> str:
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def render_plan(data: dict[str, Any]) -> str:
    """``vcga info --plan`` as text (plain, so docs/bridge.md can show it literally)."""
    lines = [f"layout: {data['layout']} -> {data['size']} ranks on {len(data['nodes'])} node(s)"]
    if not data["bridge"]:
        lines.append(f"one backend ({data['backends'][0]}) on every rank: no bridge, the vendor's own group")
        if "compression" in data:
            from vcga.compress.plan import render

            lines.extend(render(data["compression"]))
        if "shares" in data:
            lines.extend(_render_shares(data["shares"]))
        return "\n".join(lines)
    p = data["plan"]
    lines.append(f"bridge_algorithm: {p['algorithm']}; vendor groups contiguous: {'yes' if p['contiguous'] else 'no'}")
    lines.append("")
    lines.append("vendor groups (bridge order)")
    w = max(len(g["backend"]) for g in p["groups"])
    for g in p["groups"]:
        lines.append(f"  {g['index']}  {g['backend']:<{w}}  {g['vendor']}/{g['device_type']}"
                     f"  ranks {_ranks(g['ranks'])}  leader {g['leader']}  node {','.join(g['nodes'])}")
    peers = "  ".join(f"[{_ranks(s)}] {how}" for s, how in zip(p["shard_peers"], data["shard_exchange"], strict=True))
    lines.append(f"shard peers (a host bridge group each): {peers}" if len(p["shard_peers"]) > 1 else
                 f"leaders' bridge group (unequal vendor groups: no shard peers): {peers}")
    lines.append("")
    lines.append("reductions across vendors (all_reduce SUM): combined cell; per vendor group, its route")
    wd = max(len(r["dtype"]) for r in p["routes"])
    for r in p["routes"]:
        head = f"  {r['dtype']:<{wd}}  "
        if r["support"] == "refused":
            lines.append(head + f"refused: {r.get('note', '')}")
            continue
        how = "native" if r["support"] == "native" else f"{r['via']} (whole reduction in {r['reduced_as']})"
        parts = []
        for g in r["groups"]:
            route = g["route"]
            if route == "library" and g["library_via"]:
                route += f" via {g['library_via']}"
            elif route == "host":
                route += f" (leader reduces the bytes in {r['reduced_as']})"
            parts.append(f"{g['backend']} {route}")
        lines.append(head + how + "; " + ", ".join(parts) + ("; leader algorithm only" if r["leader_only"] else ""))
    lines.append("")
    lines.append("all_reduce algorithm per message size (when every route is library; reduce and")
    lines.append("reduce_scatter run an all_reduce of that size: the root keeps it / each rank its chunk)")
    for size, alg in p["collectives"]["all_reduce"].items():
        lines.append(f"  {size:>7}  {alg}")
    if any("measured" in a for a in p["collectives"]["all_reduce"].values()):
        lines.append("  (measured: the group runs the algorithm its α–β link figures predict fastest -- "
                     "rank 0's cached")
        lines.append("   figures for this topology, else timed at creation and cached; describe()['calibration'];")
        lines.append("   --figures FILE shows saved figures, --calibrate measures them on this host now)")
    lines.append("other collectives")
    for name in ("broadcast", "all_gather", "gather", "scatter", "all_to_all", "send_recv", "barrier"):
        lines.append(f"  {name}: {p['collectives'][name]}")
    lines.extend(_render_links(data))
    if "observed" in data:
        lines.extend(_render_observed(data["observed"]))
    if "compression" in data:
        from vcga.compress.plan import render

        lines.extend(render(data["compression"]))
    if "shares" in data:
        lines.extend(_render_shares(data["shares"]))
    return "\n".join(lines)


def _render_links(data: dict[str, Any]) -> list[str]:
    """The link classes of the layout and, with --figures, their α–β figures and the choice."""
    classes = data.get("link_classes", {})
    lines = ["", "link classes: " + "; ".join(f"{k}: {v}" for k, v in classes.items() if k != "bridge")
             + f"; between vendor groups: {classes.get('bridge', '?')}"]
    f = data.get("figures")
    if not f:
        return lines
    fig = f["figures"]

    def ab(pair: list[float]) -> str:
        alpha, beta = pair[:2]
        out = f"α {alpha * 1e6:.0f} µs β " + ("inf" if beta == float("inf") else f"{beta / 1e6:.0f} MB/s")
        if len(pair) == 4 and pair[2]:  # a burst knee (a token bucket): the sustained rate past it
            out += f", past {pair[2] / (1 << 20):.0f} MiB {pair[3] / 1e6:.0f} MB/s"
        return out

    lines.append(f"α–β figures ({f['file']}; time = α + bytes/β per step; shard peers exchange through "
                 f"{fig['exchange']})")
    for g, steps in zip(data["plan"]["groups"], fig["groups"], strict=True):
        lines.append(f"  {g['backend']} ({classes.get(g['backend'], 'in-vendor')}): "
                     + "; ".join(f"{k} {ab(v)}" for k, v in steps.items()))
    lines.append(f"  between vendor groups ({classes.get('bridge', '?')}): "
                 + "; ".join(f"{k} {ab(v)}" for k, v in fig["bridge"].items()))
    lines.append("all_reduce algorithm these figures choose (predicted ms of each; bandwidth in x pipeline segments"
                 + ("; from 1 MiB per all_reduce of a pipelined stream: the group pipelines consecutive all_reduces)"
                    if data.get("pipeline") else ")"))
    for size, c in f["choice"].items():
        pred = ", ".join(f"{a} {t * 1e3:.2f}" + (f" x{c['segments']}" if a == "bandwidth" and "segments" in c else "")
                         for a, t in c["predicted_s"].items())
        lines.append(f"  {size:>7}  {c['algorithm']:<10}  ({pred})")
    return lines


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the same facts as JSON.")
@click.option("--cells", is_flag=True,
              help="Every capability cell: a grid per backend (N native, E stated emulation, d derived by VCGA, "
                   "· refused); with --json, every cell with its recipe, note and the native cell it derives from.")
@click.option("--backend", "only", multiple=True, metavar="NAME", help="With --cells: only this backend (repeatable).")
@click.option("--plan", "plan", is_flag=True,
              help="Show the mixed-vendor plan (vendor groups, leaders, shard peers, routes, algorithm per size).")
@click.option("--vendors", metavar="SPEC",
              help="With --plan: simulated vendors, VCGA_SIM_VENDORS syntax (nccl:2,hccl:2).")
@click.option("--backends", metavar="SPEC", help="With --plan: registered backends per rank (nccl:8,hccl:8).")
@click.option("--nodes", type=int, help="With --plan: split the ranks into this many equal consecutive nodes.")
@click.option("--figures", metavar="FILE", help="With --plan: measured α–β link figures (JSON): show them and "
              "the algorithm they choose per size.")
@click.option("--observed", is_flag=True, help="With --plan: the all_reduce times groups of this layout observed "
              "against what their figures predicted, per size class, and the algorithm each settled on (from "
              "--figures FILE, else every entry of the link-figure cache).")
@click.option("--algorithm", type=click.Choice(["auto", "leader", "bandwidth", "replicated"]),
              help="With --plan: bridge_algorithm (default: the configured one).")
@click.option("--recheck-plugins", is_flag=True,
              help="Vet every third-party plugin again in a child process instead of trusting cached verdicts "
                   "(after a driver or SDK update; same as VCGA_PLUGIN_RECHECK=1).")
@click.option("--calibrate", is_flag=True, help="With --plan: run the layout's ranks on this host now, measure the "
              "bridge's α–β link figures, refresh their cache entry and show them (single-node layouts).")
@click.option("--compression", metavar="SPEC",
              help="With --plan: a gradient compression spec (powersgd:rank=4, ...; default: the configured "
                   "`compression`): where it applies and from which size it pays per link class.")
@click.option("--weights", metavar="SPEC", help="With --plan: vendor weights (nccl=2.5,hccl=1): the samples each rank "
              "takes of a global batch under vcga.balance (docs/balance.md); with --global-batch.")
@click.option("--global-batch", type=click.IntRange(min=1), help="With --weights: samples per optimizer step.")
def info(as_json: bool, cells: bool, only: tuple[str, ...], plan: bool, vendors: str | None, backends: str | None,
         nodes: int | None, algorithm: str | None, figures: str | None, recheck_plugins: bool, calibrate: bool,
         compression: str | None, weights: str | None, global_batch: int | None, observed: bool) -> None:
    """Show every plugin, backend, availability with the reason, devices and capabilities.

    With --plan: the plan every rank of a mixed-vendor layout computes (docs/bridge.md).
    """
    if recheck_plugins:
        import os

        os.environ["VCGA_PLUGIN_RECHECK"] = "1"  # read when the plugin manager is created, below
    if plan:
        try:
            pdata = collect_plan(vendors, backends, nodes, algorithm, figures, compression, weights, global_batch)
            if calibrate:
                pdata["figures"] = _calibrate(pdata, vendors, backends, nodes, algorithm, figures)
            if observed:
                pdata["observed"] = _observed(pdata, figures)
        except VcgaError as e:
            raise click.ClickException(str(e)) from None
        click.echo(json.dumps(pdata, indent=2) if as_json else render_plan(pdata))
        return
    if (vendors or backends or nodes is not None or algorithm or figures or calibrate or compression or weights
            or global_batch is not None or observed):
        raise click.UsageError("--vendors, --backends, --nodes, --algorithm, --figures, --calibrate, --compression, "
                               "--weights, --global-batch and --observed go with --plan")
    try:
        data = collect(verbose=cells)
    except VcgaError as e:
        raise click.ClickException(str(e)) from None
    if only and not cells:
        raise click.UsageError("--backend goes with --cells")
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=False))
    elif cells:
        _render_cells(data, only)
    else:
        _render(data)
