"""The capability table and the standard emulations derived from a table's native cells."""

from __future__ import annotations

import pytest

from vcga import dtypes
from vcga.contract import (
    BITWISE,
    EMULATIONS,
    MOVING,
    REDUCING,
    CapabilityTable,
    Cell,
    Collective,
    ReduceOp,
    Support,
    TensorEntry,
)

AR = Collective.ALL_REDUCE


def small_table(**kw):
    return (
        CapabilityTable.builder("t")
        .native(MOVING, ["int32", "float32", "uint8"])
        .native(REDUCING, ["int32", "float32"], [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
        .native(REDUCING, ["uint8"], [ReduceOp.MAX, ReduceOp.MIN])
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="no bitwise ops here")
        .build(**kw)
    )


def test_missing_cell_is_refused_and_op_ignored_for_moving_collectives():
    t = small_table(derive=False)
    assert t.lookup(AR, "float64", "SUM").support is Support.REFUSED
    assert t.lookup(Collective.BROADCAST, "int32", "SUM") == t.lookup("broadcast", "int32")
    assert t.lookup(AR, "int32", ReduceOp.SUM).support is Support.NATIVE


@pytest.mark.parametrize(
    "coll, dt, op, via",
    [
        (AR, "float32", ReduceOp.AVG, "sum_then_divide"),
        (AR, "float32", ReduceOp.PREMUL_SUM, "mul_then_sum"),
        (AR, "bool", ReduceOp.SUM, "bool_as_max"),
        (AR, "bool", ReduceOp.PRODUCT, "bool_as_min"),
        (AR, "bool", ReduceOp.MAX, "bitcast:uint8"),
        (AR, "int16", ReduceOp.SUM, "upcast:int32"),
        (AR, "uint8", ReduceOp.SUM, "upcast:int32"),
        (AR, "float16", ReduceOp.SUM, "upcast:float32"),
        (AR, "bfloat16", ReduceOp.AVG, "upcast:float32"),
        (AR, "complex64", ReduceOp.SUM, "as_real"),
        (Collective.ALL_GATHER, "float8_e4m3fn", None, "bitcast:uint8"),
        (Collective.BROADCAST, "float64", None, "bitcast:int32"),
        (Collective.SCATTER, "complex128", None, "bitcast:int32"),
    ],
)
def test_derived_emulations(coll, dt, op, via):
    cell = small_table().lookup(coll, dt, op)
    assert (cell.support, cell.via) == (Support.EMULATED, via)
    assert cell.note.startswith("VCGA emulation: ")


def test_final_refusals_are_not_emulated_and_keep_their_note():
    t = small_table()
    cell = t.lookup(AR, "int32", ReduceOp.BAND)
    assert cell.support is Support.REFUSED and cell.note == "no bitwise ops here"
    # no rule applies: integer AVG, complex MIN
    assert t.lookup(AR, "int32", ReduceOp.AVG).support is Support.REFUSED
    assert t.lookup(AR, "complex64", ReduceOp.MIN).support is Support.REFUSED


def test_library_reason_kept_when_not_final():
    t = (CapabilityTable.builder("t").native(REDUCING, ["float32"], [ReduceOp.SUM])
         .refuse(REDUCING, ["float32"], [ReduceOp.AVG], note="lib: no AVG", final=False).build())
    cell = t.lookup(AR, "float32", ReduceOp.AVG)
    assert cell.via == "sum_then_divide" and "lib: no AVG" in cell.note


def test_complex_follows_its_real_cell_whatever_runs_it():
    """as_real dispatches the real view again, so the derived complex cell must follow the real
    cell however it runs: native, derived, stated emulated (CNCL's fp64: gather_then_reduce) --
    and stay refused when the real cell is refused for good (vcga verify found the table refusing
    complex128 SUM on sim-cncl while the group ran it)."""
    t = (CapabilityTable.builder("t")
         .native(REDUCING, ["float32"], [ReduceOp.SUM])
         .emulate(REDUCING, ["float64"], [ReduceOp.SUM, ReduceOp.AVG], via="gather_then_reduce")
         .refuse(REDUCING, ["float32"], [ReduceOp.PREMUL_SUM], note="never")  # mul_then_sum would apply
         .build())
    assert t.lookup(AR, "complex128", ReduceOp.SUM).via == "as_real"  # real cell stated emulated
    assert t.lookup(AR, "complex128", ReduceOp.AVG).via == "as_real"
    assert t.lookup(AR, "complex64", ReduceOp.AVG).via == "as_real"  # real cell derived (sum_then_divide)
    assert t.lookup(AR, "float32", ReduceOp.PREMUL_SUM).support is Support.REFUSED
    assert t.lookup(AR, "complex64", ReduceOp.PREMUL_SUM).support is Support.REFUSED  # real cell final


def test_emulated_cell_must_name_a_known_recipe():
    with pytest.raises(ValueError, match="recipe"):
        Cell(Support.EMULATED)
    with pytest.raises(ValueError, match="unknown emulation"):
        Cell(Support.EMULATED, via="magic")
    with pytest.raises(ValueError, match="unknown dtype"):
        Cell(Support.EMULATED, via="upcast:int128")
    for key in EMULATIONS:
        Cell(Support.EMULATED, via=key.replace("<dtype>", "int64"))


def test_equality_diff_and_summary():
    a, b = small_table(), small_table()
    assert a == b and a.diff(b) == []
    c = CapabilityTable.builder("c").native(REDUCING, ["int32"], [ReduceOp.SUM]).build(derive=False)
    assert a != c
    assert any(line.startswith("all_reduce/int32/MIN") for line in a.diff(c))
    s = a.summary()
    # 3 reducing collectives x 9 ops + 6 moving collectives, per dtype
    assert sum(s["cells"].values()) == (3 * 9 + 6) * len(dtypes.ALL)
    assert s["all_reduce_native_ops"] == ["SUM", "PRODUCT", "MIN", "MAX"]


def test_tensor_entry_sizes():
    e = TensorEntry("w", "bfloat16", (3, 0, 2), b"")
    assert (e.numel, e.nbytes) == (0, 0)
    assert TensorEntry("s", "float64", (), b"\0" * 8).nbytes == 8


# The contract's markers and value classes are defined without pluggy and without dataclasses (a
# job's start imports them on every rank); they must behave as those would.

@pytest.mark.parametrize("opts", [{}, {"firstresult": True}, {"historic": True},
                                  {"warn_on_impl": DeprecationWarning("x"), "warn_on_impl_args": {"a": UserWarning("y")}}])
def test_hookspec_marks_as_pluggys_marker_does(opts):
    import pluggy

    from vcga.contract import PROJECT, hookspec

    def ours(): ...

    def theirs(): ...

    assert hookspec(ours, **opts) is ours and hookspec(**opts)(theirs) is theirs
    assert ours.vcga_spec == theirs.vcga_spec == pluggy.HookspecMarker(PROJECT)(lambda: None, **opts).vcga_spec
    with pytest.raises(ValueError, match="historic firstresult"):
        hookspec(ours, historic=True, firstresult=True)


@pytest.mark.parametrize("opts", [{}, {"tryfirst": True}, {"trylast": True}, {"optionalhook": True},
                                  {"hookwrapper": True}, {"wrapper": True}, {"specname": "vcga_backends"}])
def test_hookimpl_marks_as_pluggys_marker_does(opts):
    import pluggy

    from vcga.contract import PROJECT, hookimpl

    def ours(): ...

    assert hookimpl(**opts)(ours) is ours
    assert ours.vcga_impl == pluggy.HookimplMarker(PROJECT)(lambda: None, **opts).vcga_impl


def test_value_classes_are_frozen_values():
    """Equal by value within a class, hashable, shown with their fields, frozen, and copied and
    pickled whole: what ``@dataclass(frozen=True)`` gave them."""
    import copy
    import pickle
    from dataclasses import FrozenInstanceError

    from vcga.contract import MemoryStats, ProbeResult, Topology
    from vcga.process_group import VcgaOptions

    values = [ProbeResult(True, "ok", 2, {"torch": "2"}), Topology("cpu", 1, [["X"]], "d"), MemoryStats(1, None, 2, 3),
              Cell(Support.EMULATED, via="upcast:float32", note="n"), dtypes.get("bfloat16"), VcgaOptions(backend="gloo")]
    for v in values:
        twin = type(v)(*v._values())
        assert twin == v and twin is not v
        assert copy.copy(v) == v and copy.deepcopy(v) == v and pickle.loads(pickle.dumps(v)) == v
        name = v.__slots__[0]
        with pytest.raises(FrozenInstanceError):
            setattr(v, name, None)
        with pytest.raises(FrozenInstanceError):
            delattr(v, name)
    assert ProbeResult(False, "x") != ProbeResult(False, "y") and ProbeResult(False, "x") != (False, "x", 0, {})
    assert ProbeResult(False, "x").versions == {} and ProbeResult(False, "x").versions is not ProbeResult(False, "y").versions
    assert repr(Topology.unknown("d")) == "Topology(source='unknown', device_count=0, matrix=None, detail='d')"
    for hashable in values[2:]:
        assert hash(hashable) == hash(type(hashable)(*hashable._values()))
    assert len({Cell(Support.NATIVE, note="a"), Cell(Support.NATIVE, note="a"), Cell(Support.NATIVE)}) == 2
