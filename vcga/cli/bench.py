"""``vcga bench``: nccl-tests for every backend (and mixed-vendor worlds).

::

    vcga bench                                   # all_reduce, 32M, 2 local ranks (nccl-tests' defaults)
    vcga bench all_reduce all_gather -b 8 -e 128M -f 2
    vcga bench -b 1M -e 64M -f 2 --nranks 4 --vendors nccl:2,hccl:2 --compare gloo
    torchrun --nproc-per-node 8 $(which vcga) bench -b 8 -e 1G -f 2     # under torchrun: its world
    vcga bench -b 1K -e 16M -f 2 --json > bench.json   # the table goes to stderr meanwhile
    vcga bench -b 1K -e 16M -f 2 --plot busbw.png

Exit status: 0 when every checked element was right, 1 when any was wrong, 2 for a usage error or
a failed run. The library (:mod:`vcga.bench.runner`) measures; only this module prints.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from vcga.bench.runner import OPS  # no torch at import: `vcga bench --help` stays light

_OP_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
               "alltoall": "all_to_all", "sendrecv": "send_recv", "all": "all"}


def _ops(values: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        key = v.lower().replace("-", "_").removesuffix("_perf")
        key = _OP_ALIASES.get(key.replace("_", ""), key) if key not in OPS else key
        if key == "all":
            out.extend(OPS)
        elif key in OPS:
            out.append(key)
        else:
            raise click.BadParameter(f"{v!r} is not a collective; use {', '.join(OPS)} or all",
                                     param_hint="COLLECTIVES")
    return tuple(dict.fromkeys(out)) or ("all_reduce",)


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("collectives", nargs=-1, metavar="[COLLECTIVE]...")
@click.option("-b", "--minbytes", default="32M", show_default=True,
              help="Smallest size (bytes; K, M, G suffixes, binary).")
@click.option("-e", "--maxbytes", default="32M", show_default=True, help="Largest size.")
@click.option("-f", "--stepfactor", type=click.IntRange(min=1), default=None,
              help="Multiply the size by this between rows.")
@click.option("-i", "--stepbytes", default=None,
              help="Add this many bytes between rows (when no stepfactor; default 1M).")
@click.option("-n", "--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Timed calls per row.")
@click.option("-w", "--warmup_iters", "--warmup-iters", "warmup_iters", type=click.IntRange(min=0), default=1,
              show_default=True, help="Untimed calls per size before the measurement.")
@click.option("-c", "--check", type=click.IntRange(min=0), default=1, show_default=True,
              help="Checked calls per row (every element compared exactly); 0: no check (#wrong N/A).")
@click.option("-d", "--datatype", default="float", show_default=True,
              help="int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16, or all.")
@click.option("-o", "--op", "redop", default="sum", show_default=True, help="sum, prod, max, min, avg, or all.")
@click.option("-r", "--root", type=click.IntRange(min=0), default=0, show_default=True,
              help="Root of broadcast and reduce.")
@click.option("--nranks", type=click.IntRange(min=1, max=256), default=None,
              help="Spawn this many local ranks (default 2; under torchrun its world is used).")
@click.option("--backend", default=None, metavar="NAME", help="VCGA backend of every rank (gloo, nccl, sim-hccl, ...).")
@click.option("--vendors", default=None, metavar="SPEC",
              help="Simulated mixed-vendor world, e.g. nccl:1,hccl:1 (as VCGA_SIM_VENDORS).")
@click.option("--compare", type=click.Choice(["gloo"]), default=None,
              help="Also run everything over a plain gloo group; adds the vcga/gloo time ratio.")
@click.option("--tiers/--no-tiers", default=None,
              help="Measure each tier of the bridge by itself (default: on in mixed or multi-node worlds).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=None,
              help="Collective timeout in seconds (default: the config's).")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON object with `rows` on stdout (the table goes to stderr).")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV rows on stdout (the table goes to stderr).")
@click.option("--plot", "plot", default=None, type=click.Path(dir_okay=False), metavar="FILE.png|svg",
              help="Plot busbw against size per collective and group (needs matplotlib: pip install 'vcga[plot]').")
@click.option("-q", "--quiet", is_flag=True, help="No table while it runs (only --json/--csv/--plot output).")
def bench(collectives: tuple[str, ...], minbytes: str, maxbytes: str, stepfactor: int | None, stepbytes: str | None,
          iters: int, warmup_iters: int, check: int, datatype: str, redop: str, root: int, nranks: int | None,
          backend: str | None, vendors: str | None, compare: str | None, tiers: bool | None, timeout: float | None,
          as_json: bool, as_csv: bool, plot: str | None, quiet: bool) -> None:
    """Measure collectives as nccl-tests does: time, algbw, busbw and #wrong per size.

    COLLECTIVE: all_reduce (default), all_gather, reduce_scatter, broadcast, reduce, all_to_all,
    send_recv, or all. See docs/bench.md.
    """
    from vcga.cli._common import fail
    from vcga.errors import VcgaError

    if as_json and as_csv:
        fail("--json and --csv are exclusive")
    if plot and not plot.lower().endswith((".png", ".svg")):
        fail(f"--plot {plot}: the file must end in .png or .svg")
    if plot:
        _need_matplotlib()
    try:
        from vcga.bench import runner as lib

        ops = _ops(collectives)
        spec = lib.BenchSpec(
            ops=ops, minbytes=lib.parse_size(minbytes), maxbytes=lib.parse_size(maxbytes), stepfactor=stepfactor,
            stepbytes=lib.parse_size(stepbytes) if stepbytes is not None else None, iters=iters,
            warmup_iters=warmup_iters, check=check,
            dtypes=tuple(lib.DTYPES) if datatype == "all" else (lib.dtype_name(datatype),),
            redops=lib.REDOPS if redop == "all" else (redop,), root=root, compare=compare, tiers=tiers)
        spec.validate()
        if vendors:
            from vcga.config import parse_sim_vendors

            parse_sim_vendors(vendors, "--vendors")
    except VcgaError as e:
        fail(str(e))
    except click.BadParameter as e:
        fail(e.format_message())

    machine = as_json or as_csv
    table = _Table(sys.stderr if machine else sys.stdout, spec, enabled=not quiet)
    torchrun = _under_torchrun() and nranks is None
    try:
        if torchrun:
            result = _run_here(spec, backend, vendors, timeout, table)
            if int(os.environ["RANK"]) != 0:
                return
        else:
            result = _run_spawned(spec, nranks or 2, backend, vendors, timeout, table)
    except VcgaError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    table.footer(result)
    rows = result["rows"]
    if as_json:
        click.echo(json.dumps(_json(spec, result), indent=1))
    elif as_csv:
        _csv(rows)
    if plot:
        from vcga.cli._bench_plot import plot_rows

        try:
            plot_rows(rows, plot)
        except OSError as e:
            fail(f"--plot {plot}: {e.strerror or e}")
        click.echo(f"# plot: {plot}", err=machine)
    sys.exit(1 if result["out_of_bounds"] else 0)


def _need_matplotlib() -> None:
    from vcga.cli._common import fail

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("--plot needs matplotlib, which is not installed: pip install 'vcga[plot]' (or pip install matplotlib)")


# ===================================================================================================
# Running the ranks
# ===================================================================================================


def _rank_env(backend: str | None, vendors: str | None, timeout: float | None) -> dict[str, str]:
    env: dict[str, str] = {}
    if backend:
        env["VCGA_BACKEND"] = backend
    if vendors:
        env["VCGA_SIM_VENDORS"] = vendors
    if timeout is not None:
        env["VCGA_TIMEOUT"] = str(timeout)
    return env


def _run_here(spec: Any, backend: str | None, vendors: str | None, timeout: float | None,
              table: _Table) -> dict[str, Any]:
    """Under torchrun: this process is one rank; rank 0 prints."""
    import vcga
    from vcga.bench import runner as lib

    os.environ.update(_rank_env(backend, vendors, timeout))
    comm = vcga.init()
    try:
        if comm.rank == 0:
            table.header(comm.world_size)
        return lib.run(spec, device=comm.device, backend=comm.backend, on_rows=table.rows, on_note=table.note)
    finally:
        comm.close()


def _rank_main(rank: int, world: int, port: int, spec: Any, queue: Any) -> None:
    """One spawned rank: measure, and (rank 0) send each size's rows and notes to the CLI."""
    import vcga
    from vcga.bench import runner as lib
    from vcga.spawn import END

    comm = vcga.init(rank=rank, world_size=world, local_rank=rank, init_method=f"tcp://127.0.0.1:{port}")
    try:
        result = lib.run(spec, device=comm.device, backend=comm.backend,
                         on_rows=lambda rows: queue.put(("rows", [r.to_json() for r in rows])),
                         on_note=lambda text: queue.put(("note", text)))
        if rank == 0:
            result["rows"] = [r.to_json() for r in result["rows"]]
            queue.put(("done", result))
            queue.put(END)
    finally:
        comm.close()


def _run_spawned(spec: Any, nranks: int, backend: str | None, vendors: str | None, timeout: float | None,
                 table: _Table) -> dict[str, Any]:
    from vcga.bench import runner as lib
    from vcga.errors import VcgaError
    from vcga.spawn import RanksFailed, stream_ranks

    env = _rank_env(backend, vendors, timeout)
    # a rank that never reports (a hung library) ends the run after the collective timeout and a margin
    wait = (timeout or float(os.environ.get("VCGA_TIMEOUT", "300") or 300)) + 120
    table.header(nranks)
    result: dict[str, Any] | None = None
    try:
        for kind, payload in stream_ranks(_rank_main, nranks, spec, timeout=wait, env=env):
            if kind == "rows":
                table.rows([lib.Row(**r) for r in payload])
            elif kind == "note":
                table.note(payload)
            else:
                result = payload
    except RanksFailed as e:
        raise VcgaError(f"vcga bench: {e}") from None
    if result is None:
        raise VcgaError("vcga bench: the ranks ended without a result")
    result["rows"] = [lib.Row(**r) for r in result["rows"]]
    return result


# ===================================================================================================
# Output
# ===================================================================================================


def _f(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: 2 decimals, fewer when the number is wide."""
    for fmt in (f"{{:{width}.2f}}", f"{{:{width}.1f}}", f"{{:{width}.0f}}"):
        s = fmt.format(value)
        if len(s) <= width:
            return s
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


_TIER_TITLE = {"world": "the whole world", "in-vendor": "in-vendor (each vendor's own library)",
               "cross-vendor": "cross-vendor (the host bridge between vendors on one node)",
               "cross-node": "cross-node (the network between nodes)"}


class _Table:
    """nccl-tests' text table, printed row by row while the run goes on."""

    def __init__(self, stream: Any, spec: Any, enabled: bool) -> None:
        self.stream, self.spec, self.enabled = stream, spec, enabled
        self.compare = spec.compare == "gloo"
        self.pending: dict[tuple[Any, ...], list[Any]] = {}
        self.section: tuple[Any, ...] | None = None

    def _out(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def header(self, nranks: int) -> None:
        s = self.spec
        step = f"{s.stepfactor}(factor)" if s.stepfactor and s.stepfactor > 1 else f"{s.stepbytes or 1 << 20}(bytes)"
        self._out(f"# vcga bench: {' '.join(s.ops)}  (nccl-tests' columns; docs/bench.md)")
        self._out(f"# nRanks {nranks} minBytes {s.minbytes} maxBytes {s.maxbytes} step: {step} "
                  f"warmup iters: {s.warmup_iters} iters: {s.iters} validation: {s.check}")
        self._out("#")

    def note(self, text: str) -> None:
        self._out(f"#  {text}")

    def _columns(self, tier: str) -> None:
        head1 = (f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"
                 "           out-of-place                       in-place          ")
        head2 = (f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>7}  {'algbw':>6}  "
                 f"{'busbw':>6}  {'#wrong':>6}  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}")
        head3 = (f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  "
                 f"{'(GB/s)':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}")
        if self.compare:
            head1 += "   gloo out-of-place        gloo in-place"
            head2 += f"  {'time':>7}  {'busbw':>6}  {'ratio':>5}  {'time':>7}  {'busbw':>6}  {'ratio':>5}"
            head3 += f"  {'(us)':>7}  {'(GB/s)':>6}  {'vcga/':>5}  {'(us)':>7}  {'(GB/s)':>6}  {'vcga/':>5}"
        if tier != "world":  # the subgroups of a tier run side by side: each line says which one it is
            head2 += "  group"
            head3 += "  (ranks, backends)"
        self._out(head1)
        self._out(head2)
        self._out(head3)

    def rows(self, rows: list[Any]) -> None:
        by_group: dict[tuple[Any, ...], dict[tuple[str, bool], Any]] = {}
        for r in rows:
            by_group.setdefault((r.tier, tuple(r.ranks), r.op, r.dtype, r.redop), {})[(r.group, r.in_place)] = r
        for key, cells in by_group.items():
            tier, ranks, op, dtype, redop = key
            first = cells[("vcga", False)]
            section = (tier, op, dtype, redop) if tier != "world" else key
            if section != self.section:
                self.section = section
                self._out("#")
                if tier == "world":
                    who = "+".join(dict.fromkeys(first.backends))
                    self._out(f"# {op}  {dtype}  {redop}  on {_TIER_TITLE['world']}: {len(ranks)} ranks "
                              f"{','.join(map(str, ranks))} ({who})")
                else:
                    self._out(f"# {op}  {dtype}  {redop}  on {_TIER_TITLE.get(tier, tier)}: its groups side by side")
                self._columns(tier)
            line = f"  {first.size_bytes:>10}  {first.count:>12}  {first.dtype:>8}  {first.redop:>6}  {first.root:>6}"
            for in_place in (False, True):
                r = cells.get(("vcga", in_place))
                line += self._body(r)
            if self.compare:
                for in_place in (False, True):
                    g = cells.get(("gloo", in_place))
                    v = cells.get(("vcga", in_place))
                    if g is None:
                        line += f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>5}"
                    else:
                        ratio = f"{v.vs_gloo:5.2f}" if v is not None and v.vs_gloo is not None else f"{'N/A':>5}"
                        line += f"  {_f(g.time_us, 7)}  {_f(g.busbw_gbps, 6)}  {ratio}"
            if tier != "world":
                line += f"  {','.join(map(str, ranks))} {'+'.join(dict.fromkeys(first.backends))}"
            self._out(line)

    @staticmethod
    def _body(r: Any) -> str:
        if r is None:
            return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
        wrong = f"{r.wrong:>6}" if r.wrong is not None else f"{'N/A':>6}"
        return f"  {_f(r.time_us, 7)}  {_f(r.algbw_gbps, 6)}  {_f(r.busbw_gbps, 6)}  {wrong}"

    def footer(self, result: dict[str, Any]) -> None:
        bad = result["out_of_bounds"]
        self._out(f"# {'Out of bounds values':<20} : {bad} {'FAILED' if bad else 'OK'}")
        self._out(f"# {'Avg bus bandwidth':<20} : {result['avg_bus_bandwidth_gbps']:g} ")
        self._out("#")


def _json(spec: Any, result: dict[str, Any]) -> dict[str, Any]:
    from dataclasses import asdict

    config = asdict(spec)
    config["ops"], config["dtypes"], config["redops"] = list(spec.ops), list(spec.dtypes), list(spec.redops)
    return {
        "command": ["vcga", *sys.argv[1:]],
        "config": config,
        "layout": result.get("layout", []),
        "rows": [r.to_json() for r in result["rows"]],
        "skipped": result["skipped"],
        "out_of_bounds": {"count": result["out_of_bounds"], "okay": result["out_of_bounds"] == 0},
        "average_bus_bandwidth_gbps": result["avg_bus_bandwidth_gbps"],
    }


CSV_FIELDS = ("op", "nranks", "size_bytes", "count", "dtype", "redop", "root", "time_us", "algbw_gbps", "busbw_gbps",
              "wrong", "in_place", "group", "tier", "ranks", "backends", "vs_gloo")


def _csv(rows: list[Any]) -> None:
    import csv

    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for r in rows:
        d = r.to_json()
        d["ranks"] = " ".join(map(str, d["ranks"]))
        d["backends"] = " ".join(d["backends"])
        w.writerow(["" if d[k] is None else d[k] for k in CSV_FIELDS])
