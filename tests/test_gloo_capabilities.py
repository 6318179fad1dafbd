"""The gloo table, checked cell by cell against torch's real gloo, on as many ranks as the table was
measured with (three: a 2-rank world hides gloo's byte-summed bools).

Every cell the table claims native must run and return the exactly right value; every cell it does
not claim native must fail natively (it is refused, or VCGA emulates it). The measurement runs the
installed torch, so a torch upgrade that changes gloo shows up here as a failing cell.
"""

from __future__ import annotations

import pytest

from vcga.contract import Support
from vcga.plugins import gloo
from vcga.plugins.gloo import measure


@pytest.fixture(scope="module")
def measured():
    return measure.measure_in_subprocesses(world_size=measure.MEASURE_WORLD_SIZE)


def test_every_cell_matches_torch_gloo(measured):
    table = gloo.load_table()
    assert len(measured) == len(measure.all_cells())
    wrong = []
    for (coll, dt, op), (ok, detail) in measured.items():
        claimed_native = table.lookup(coll, dt, op).support is Support.NATIVE
        if claimed_native != ok:
            wrong.append(f"{coll}/{dt}/{op}: table says {'native' if claimed_native else 'not native'}, "
                         f"gloo {'works' if ok else 'fails: ' + detail}")
    assert not wrong, "\n".join(wrong)


def test_table_covers_the_basics_a_user_expects(measured):
    t = gloo.load_table()
    assert t.support_of("all_reduce", "float32", "SUM") is Support.NATIVE
    assert t.support_of("all_reduce", "float32", "BAND") is Support.REFUSED
    assert t.lookup("all_gather", "float8_e4m3fn").via == "bitcast:uint8"
    assert "Invalid scalar type" in t.lookup("all_reduce", "uint64", "SUM").note or \
        t.support_of("all_reduce", "uint64", "SUM") is not Support.REFUSED
