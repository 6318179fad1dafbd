"""The real vendor plugins' capability tables: the facts design.md states, the simulated stand-ins
(plugins/sim/) they must equal, and a cited source in every cell. (The walls every plugin keeps
are tested in tests/test_walls.py.)
"""

from __future__ import annotations

import re

import pytest

from vcga import dtypes
from vcga.contract import BITWISE, MOVING, REDUCING, Collective, ReduceOp, Support
from vcga.plugins import hccl, mlu, nccl, sim

ARITH = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
FLOAT_LOW = ("float16", "bfloat16", "float32")


def every_key():
    for coll in Collective:
        for dt in dtypes.ALL:
            for op in (ReduceOp if coll.reduces else (None,)):
                yield coll, dt, op


REAL_AND_SIM = [
    pytest.param(nccl.nccl_capabilities, sim.nccl_table, id="nccl"),
    pytest.param(hccl.hccl_capabilities, sim.hccl_table, id="hccl"),
    pytest.param(mlu.cncl_capabilities, sim.cncl_table, id="mlu"),
]


@pytest.mark.parametrize("real_fn, sim_fn", REAL_AND_SIM)
def test_real_table_equals_its_simulated_stand_in_cell_by_cell(real_fn, sim_fn):
    """Every (collective, dtype, op): same support and same emulation recipe, so what runs on the
    CPU stand-in is what runs on the vendor's hardware."""
    real, stand_in = real_fn(), sim_fn()
    diffs = []
    for key in every_key():
        a, b = real.lookup(*key), stand_in.lookup(*key)
        if (a.support, a.via) != (b.support, b.via):
            diffs.append(f"{key}: real {a.support.value}/{a.via} vs sim {b.support.value}/{b.via}")
    assert diffs == []
    assert real.diff(stand_in) == [] and real == stand_in


@pytest.mark.parametrize("real_fn, _sim", REAL_AND_SIM)
def test_every_cell_cites_its_source(real_fn, _sim):
    """Each cell's note names the vendor source file it comes from (a derived emulation carries the
    library's cited reason after 'library:')."""
    table = real_fn()
    cite = re.compile(r"\b[\w/]+\.(cpp|hpp|py)\b")
    missing = [key for key in every_key() if not cite.search(table.lookup(*key).note)]
    assert missing == []
    # the builder's catch-all makes every cell explicit: none falls back to the anonymous default
    assert len(table.cells()) == sum(1 for _ in every_key())


# --- design.md "Facts to start from", checked against the real tables ------------------------------

HCCL_DTYPES = ("int8", "int16", "int32", "int64", "float16", "float32", "bfloat16")  # design.md
CNCL_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "float32", "bfloat16")  # design.md


def test_hccl_facts_from_design():
    """design.md: HCCL native SUM/MIN/MAX/PROD; AVG emulated; BAND/BOR/BXOR refused; dtypes
    int8/16/32/64, fp16, fp32, bf16 (bool/uint8 cast to int32)."""
    t = hccl.hccl_capabilities()
    for coll in REDUCING:
        for dt in HCCL_DTYPES + ("bool", "uint8"):
            for op in ARITH:
                assert t.support_of(coll, dt, op) is Support.NATIVE, (coll, dt, op)
        for dt in dtypes.ALL:
            for op in BITWISE:
                assert t.support_of(coll, dt, op) is Support.REFUSED, (coll, dt, op)
            assert t.support_of(coll, dt, ReduceOp.AVG) is not Support.NATIVE
        for dt in FLOAT_LOW:
            assert t.lookup(coll, dt, ReduceOp.AVG).via == "sum_then_divide"
    for coll in MOVING:
        for dt in HCCL_DTYPES + ("bool", "uint8"):
            assert t.support_of(coll, dt) is Support.NATIVE
    others = set(dtypes.ALL) - set(HCCL_DTYPES) - {"bool", "uint8"}
    assert not [k for k in every_key() if k[1] in others and t.support_of(*k) is Support.NATIVE]


def test_cncl_facts_from_design():
    """design.md: CNCL SUM/MIN/MAX/PROD; AVG and bitwise refused (by the library: VCGA emulates AVG
    on floats); dtypes int8, uint8, int32, int64, fp16, fp32, bf16; fp64 silently reduced as fp32
    (so never native); bool as uint8."""
    t = mlu.cncl_capabilities()
    for coll in REDUCING:
        for dt in CNCL_DTYPES + ("bool",):
            for op in ARITH:
                assert t.support_of(coll, dt, op) is Support.NATIVE, (coll, dt, op)
        for dt in dtypes.ALL:
            for op in BITWISE:
                assert t.support_of(coll, dt, op) is Support.REFUSED
            assert t.support_of(coll, dt, ReduceOp.AVG) is not Support.NATIVE
        for dt in FLOAT_LOW:  # the library refuses AVG; the cell keeps its words and VCGA emulates
            cell = t.lookup(coll, dt, ReduceOp.AVG)
            assert cell.via == "sum_then_divide" and "Cannot use ReduceOp.AVG with CNCL" in cell.note
    # fp64: never handed to CNCL, every cell routed around the fp32 mapping
    for key in every_key():
        if key[1] == "float64":
            assert t.support_of(*key) is not Support.NATIVE, key
    for coll in REDUCING:
        for op in ARITH + (ReduceOp.AVG,):
            assert t.lookup(coll, "float64", op).via == "gather_then_reduce"
    others = set(dtypes.ALL) - set(CNCL_DTYPES) - {"bool"}
    assert not [k for k in every_key() if k[1] in others and t.support_of(*k) is Support.NATIVE]


def test_nccl_facts_from_design():
    """design.md: NCCL no bitwise ops; AVG and PREMUL_SUM native; fp8 on recent versions."""
    t = nccl.nccl_capabilities()
    for coll in REDUCING:
        for dt in dtypes.ALL:
            for op in BITWISE:
                assert t.support_of(coll, dt, op) is Support.REFUSED
        for dt in ("float16", "bfloat16", "float32", "float64"):
            for op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
                assert t.support_of(coll, dt, op) is Support.NATIVE
    for coll in MOVING:
        for dt in dtypes.FP8:
            assert t.support_of(coll, dt) is Support.NATIVE


def test_refused_cells_say_what_to_do():
    for table in (nccl.nccl_capabilities(), hccl.hccl_capabilities(), mlu.cncl_capabilities()):
        note = table.lookup("all_reduce", "int32", "BXOR").note
        assert "use gloo" in note
