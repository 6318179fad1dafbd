"""The simulated vendors carry exactly the facts design.md states for their real counterparts."""

from __future__ import annotations

import pytest

from vcga.contract import BITWISE, MOVING, REDUCING, Collective, ReduceOp, Support
from vcga.plugins import sim

NATIVE_OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


@pytest.mark.parametrize("table_fn, dtypes_native", [
    (sim.hccl_table, ("int8", "int16", "int32", "int64", "float16", "float32", "bfloat16")),
    (sim.cncl_table, ("int8", "uint8", "int32", "int64", "float16", "float32", "bfloat16")),
])
def test_native_reductions_and_refused_bitwise(table_fn, dtypes_native):
    t = table_fn()
    for coll in REDUCING:
        for dt in dtypes_native:
            for op in NATIVE_OPS:
                assert t.support_of(coll, dt, op) is Support.NATIVE, (coll, dt, op)
            for op in BITWISE:
                assert t.support_of(coll, dt, op) is Support.REFUSED, (coll, dt, op)
        for dt in ("float16", "float32", "bfloat16"):  # AVG is not native: VCGA emulates it
            assert t.lookup(coll, dt, ReduceOp.AVG).via == "sum_then_divide"


def test_hccl_bool_and_uint8_are_native_through_its_int32_cast():
    t = sim.hccl_table()
    assert t.support_of("all_reduce", "uint8", "SUM") is Support.NATIVE
    assert t.support_of("all_reduce", "bool", "SUM") is Support.NATIVE


def test_cncl_fp64_is_routed_around_the_fp32_mangling():
    t = sim.cncl_table()
    for coll in REDUCING:
        for op in NATIVE_OPS + (ReduceOp.AVG,):
            assert t.lookup(coll, "float64", op).via == "gather_then_reduce"
    for coll in MOVING:
        assert t.lookup(coll, "float64").via == "bitcast:int64"
    assert t.lookup("all_reduce", "int16", "SUM").via == "upcast:int32"  # CNCL lacks int16


def test_nccl_avg_premul_native_bitwise_refused():
    t = sim.nccl_table()
    for op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        assert t.support_of("all_reduce", "float32", op) is Support.NATIVE
    for op in BITWISE:
        cell = t.lookup("all_reduce", "int32", op)
        assert cell.support is Support.REFUSED and "bitwise" in cell.note
    assert t.support_of(Collective.ALL_GATHER, "float8_e4m3fn") is Support.NATIVE


def test_rank_layout():
    assert sim.rank_layout("nccl:2,hccl:2", 4) == ["sim-nccl", "sim-nccl", "sim-hccl", "sim-hccl"]
