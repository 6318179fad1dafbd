"""The least a vendor can state, and what VCGA derives from it (no processes: tables and dispatch).

- Data movement of every dtype is derived whenever a collective moves any dtype natively, with the
  preference docs/emulation.md states (integers first, views before padded copies).
- ``CapabilityTable.route`` -- what ``vcga verify`` and ``vcga info`` call "derived from" -- is the
  chain of calls the dispatcher really issues: checked cell by cell against a group that records
  the native calls it is handed (nothing runs; the spawned matrix in test_pg_collectives.py and the
  verify runs in test_example_plugin.py check the data).
- A refused point-to-point call raises before the group is touched, on the sending and the
  receiving side alike; an empty message travels as the table's first natively sent dtype.
- A verify family whose cells the table cannot run says which cells are missing and why.
"""

from __future__ import annotations

import itertools
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import ROOT

from vcga import dtypes as vdt
from vcga.contract import MOVING, CapabilityTable, Collective, ReduceOp, Support, cell_name
from vcga.errors import VcgaUnsupportedError

HELPERS = ROOT / "tests" / "helper_plugins"
sys.path.insert(0, str(HELPERS))
import minimal_plugins  # noqa: E402 - the helper plugin module, imported as the plugin manager would

P2P = Collective.SEND_RECV


def minimal() -> CapabilityTable:
    return minimal_plugins.MinimalBackend().capabilities()


def liar() -> CapabilityTable:
    return minimal_plugins.LiarBackend().capabilities()


# ---------------------------------------------------------------------------------------------------
# Derivation
# ---------------------------------------------------------------------------------------------------


def test_one_natively_moved_dtype_moves_every_dtype():
    t = minimal()
    for coll, dt in itertools.product(MOVING, vdt.ALL):
        cell = t.lookup(coll, dt)
        if dt == "float32":
            assert cell.support is Support.NATIVE and not cell.derived
            continue
        assert (cell.support, cell.via, cell.derived) == (Support.EMULATED, "bitcast:float32", True), (coll, dt)
        assert t.derived_from(coll, dt) == (coll, "float32", None)


def test_carrier_preference_integers_first_then_views_before_padding():
    def via(natives: list[str], dt: str) -> str | None:
        return CapabilityTable.builder("t").native([Collective.BROADCAST], natives).build().lookup(
            Collective.BROADCAST, dt).via

    # integers carry other dtypes' bytes before any float does, whatever the width
    assert via(["int32", "float64"], "int64") == "bitcast:int32"  # an int view beats a same-width float
    assert via(["int32", "float64"], "uint8") == "bitcast:int32"  # a padded int beats a float
    assert via(["int64", "float32"], "int32") == "bitcast:int64"  # acme's table: padded int64
    # views before padded copies, equal width first, then the widest dividing one
    assert via(["int8", "int32", "int64"], "complex128") == "bitcast:int64"
    assert via(["int8", "int32"], "float64") == "bitcast:int32"
    assert via(["int64", "int8"], "int16") == "bitcast:int8"
    # floats only when no integer is native; padded: the narrowest
    assert via(["float32", "float64"], "int64") == "bitcast:float64"
    assert via(["float64", "float32"], "int16") == "bitcast:float32"
    # bool never carries other dtypes' bytes (a library may normalise them)
    assert via(["bool"], "uint8") is None


def test_no_native_moving_dtype_derives_nothing_and_final_refusals_stay():
    t = (CapabilityTable.builder("t").native([Collective.BROADCAST], ["float32"])
         .refuse([Collective.BROADCAST], ["bool"], note="the vendor says no", final=True).build())
    assert t.lookup(Collective.ALL_GATHER, "int32").support is Support.REFUSED  # nothing native for all_gather
    assert t.lookup(Collective.BROADCAST, "bool").support is Support.REFUSED
    assert t.lookup(Collective.BROADCAST, "int8").via == "bitcast:float32"


def test_the_liars_derived_cells_name_the_lie():
    t = liar()
    lie = minimal_plugins.LIE
    derived = {key for key in ((Collective.ALL_REDUCE, d, ReduceOp.SUM) for d in vdt.ALL)
               if t.derived_from(*key) == lie}
    assert derived == {(Collective.ALL_REDUCE, d, ReduceOp.SUM) for d in ("bool", "uint8", "int8")}
    assert cell_name(lie) == "all_reduce int16 SUM"
    # the truthful minimal table refuses exactly those cells (nothing to derive them from)
    assert all(minimal().lookup(*k).support is Support.REFUSED for k in derived | {lie})


def test_info_json_marks_derived_cells_and_what_they_run_on():
    rows = {(r["collective"], r["dtype"], r["op"]): r for r in liar().to_json()}
    assert rows[("all_reduce", "uint8", "SUM")]["derived"] is True
    assert rows[("all_reduce", "uint8", "SUM")]["derived_from"] == "all_reduce int16 SUM"
    assert rows[("all_reduce", "int16", "SUM")]["derived"] is False
    assert rows[("broadcast", "bool", None)]["derived_from"] == "broadcast float32"
    assert liar().summary()["derived_cells"] == sum(r["derived"] for r in rows.values())


# ---------------------------------------------------------------------------------------------------
# route() is what the dispatcher does
# ---------------------------------------------------------------------------------------------------

_METHOD = {"allreduce": Collective.ALL_REDUCE, "reduce": Collective.REDUCE, "reduce_scatter": Collective.REDUCE_SCATTER,
           "allgather": Collective.ALL_GATHER, "gather": Collective.GATHER, "scatter": Collective.SCATTER,
           "broadcast": Collective.BROADCAST, "alltoall_base": Collective.ALL_TO_ALL, "send": P2P, "recv": P2P,
           "recv_anysource": P2P}


class RecordingGroup:
    """Records each native call the dispatcher hands the library: (collective, dtype, op).
    Nothing runs: this checks routing only."""

    def __init__(self) -> None:
        self.calls: list[tuple[Collective, str, ReduceOp | None]] = []

    def __getattr__(self, name: str) -> Any:
        coll = _METHOD[name]

        def call(*args: Any) -> object:
            from vcga.pypg import reduce_op_of

            first = args[0]
            while isinstance(first, list):
                first = first[0]
            opts = args[-1]
            op = reduce_op_of(opts.reduceOp)[0] if coll.reduces else None
            self.calls.append((coll, vdt.from_torch(first.dtype), op))
            return object()

        return call


def _dispatcher(table: CapabilityTable, group: RecordingGroup) -> Any:
    from vcga.pg.dispatch import Dispatcher
    from vcga.pg.transport import Transport

    class Recording(Transport):
        def __init__(self) -> None:
            self.table, self.group, self.backend_name, self.device_type = table, group, table.backend, "cpu"

    return Dispatcher(Recording(), rank=0, size=2)


def _call(d: Any, coll: Collective, dt: str, op: ReduceOp | None) -> None:
    from vcga.pg.dispatch import Steps
    from vcga.pypg import options

    tdt = vdt.to_torch(dt)
    x, s = torch.zeros(6, dtype=tdt), Steps()
    factor = 0.5 if op is ReduceOp.PREMUL_SUM else None
    if coll is Collective.ALL_REDUCE:
        d.all_reduce(x, op, factor, options("allreduce"), s)
    elif coll is Collective.REDUCE:
        d.reduce(x, 0, op, factor, options("reduce"), s)
    elif coll is Collective.REDUCE_SCATTER:
        d.reduce_scatter(torch.zeros(3, dtype=tdt), [x[:3], x[3:]], op, factor, options("reduce_scatter"), s)
    elif coll is Collective.ALL_GATHER:
        d.all_gather([torch.zeros(3, dtype=tdt), torch.zeros(3, dtype=tdt)], x[:3], options("allgather"), s)
    elif coll is Collective.GATHER:
        d.gather([torch.zeros(3, dtype=tdt), torch.zeros(3, dtype=tdt)], x[:3], 0, options("gather"), s)
    elif coll is Collective.SCATTER:
        d.scatter(torch.zeros(3, dtype=tdt), [x[:3], x[3:]], 0, options("scatter"), s)
    elif coll is Collective.BROADCAST:
        d.broadcast(x, 0, options("broadcast"), s)
    elif coll is Collective.ALL_TO_ALL:
        d.all_to_all(torch.zeros(6, dtype=tdt), x, [], [], options("alltoall"), s)
    else:
        d.send(x, 1, 0, s)
        d.recv(x, 1, 0, s)


def _tables() -> list[CapabilityTable]:
    from vcga.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    sys.path.insert(0, str(ROOT / "tests"))
    import pg_emu_plugin

    return [liar(), pm.backend("gloo").capabilities(), pm.backend("sim-cncl").capabilities(),
            pm.backend("sim-hccl").capabilities(), pg_emu_plugin.table()]


@pytest.mark.parametrize("table", _tables(), ids=lambda t: t.backend)
def test_route_is_the_chain_of_calls_the_dispatcher_issues(table: CapabilityTable):
    for coll, dt in itertools.product(Collective, vdt.ALL):
        for op in (list(ReduceOp) if coll.reduces else [None]):
            chain = table.route(coll, dt, op)
            group = RecordingGroup()
            d = _dispatcher(table, group)
            if chain[-1][1].support is Support.REFUSED:
                with pytest.raises(VcgaUnsupportedError):
                    _call(d, coll, dt, op)
                assert group.calls == [], (coll, dt, op)  # refused before the library is touched
                continue
            _call(d, coll, dt, op)
            want = chain[-1][0]
            assert set(group.calls) == {want}, (cell_name((coll, dt, op)), group.calls, want)


# ---------------------------------------------------------------------------------------------------
# Point to point: refused alike on both ends, before the library is touched
# ---------------------------------------------------------------------------------------------------


def test_refused_point_to_point_raises_on_both_ends_before_anything_is_posted():
    from vcga.pg.dispatch import Steps

    table = CapabilityTable.builder("p2p").native([P2P], ["float32"]).refuse([P2P], ["bool"], note="no bool").build()
    group = RecordingGroup()
    d = _dispatcher(table, group)
    for t in (torch.zeros(4, dtype=torch.bool), torch.zeros(0, dtype=torch.bool)):  # empty messages too
        with pytest.raises(VcgaUnsupportedError, match="no bool"):
            d.send(t, 1, 0, Steps())
        with pytest.raises(VcgaUnsupportedError, match="no bool"):
            d.recv(t, 1, 0, Steps())
        with pytest.raises(VcgaUnsupportedError, match="no bool"):
            d.recv(t, None, 0, Steps())  # from any source
    assert group.calls == []
    # an empty message of any dtype travels as one element of the first natively sent dtype
    d.send(torch.zeros(0, dtype=torch.int16), 1, 0, Steps())
    d.recv(torch.zeros(0, dtype=torch.float64), 1, 0, Steps())
    assert group.calls == [(P2P, "float32", None)] * 2


# ---------------------------------------------------------------------------------------------------
# Families that cannot run say what is missing
# ---------------------------------------------------------------------------------------------------


def test_a_family_whose_cells_the_table_cannot_run_says_which_and_why():
    from vcga.conformance.base import needs
    from vcga.conformance.training import DDP_CELLS

    ctx = SimpleNamespace(through_vcga=True)
    reduce_only = (CapabilityTable.builder("reduce-only")
                   .native([Collective.ALL_REDUCE], ["float32"], ["SUM"], note="x").build())
    why = needs(ctx, reduce_only, DDP_CELLS, "DDP")  # type: ignore[arg-type]
    assert why is not None and why.startswith("DDP needs 5 cells of which 4 cannot run here")
    for missing in ("all_gather int64", "broadcast float32", "broadcast int32", "broadcast int64"):
        assert missing in why
    assert "reduce-only does not support this combination" in why  # the table's own reason
    assert needs(ctx, minimal(), DDP_CELLS, "DDP") is None  # one moving dtype is enough


def test_info_cells_shows_the_grid_with_derived_cells(monkeypatch: pytest.MonkeyPatch):
    from click.testing import CliRunner

    from vcga.cli import cli

    monkeypatch.setenv("VCGA_PLUGINS", "minimal_plugins")  # importable: HELPERS is on sys.path
    monkeypatch.setenv("COLUMNS", "200")
    r = CliRunner().invoke(cli, ["info", "--cells", "--backend", "minimal-liar"])
    assert r.exit_code == 0, r.output
    rows = {ln.split()[0] + (" " + ln.split()[1] if ln.split()[1].isupper() else ""): ln.split()[-17:]
            for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in {c.value for c in Collective}}
    marks = dict(zip(vdt.ALL, rows["all_reduce SUM"], strict=False))
    assert (marks["int16"], marks["float32"], marks["uint8"], marks["float64"]) == ("N", "N", "d", "·")
    assert rows["broadcast"] == ["N" if d == "float32" else "d" for d in vdt.ALL]
