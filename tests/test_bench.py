"""``vcga bench``: nccl-tests' sizes, formulas and columns, exact checks, and the CLI's outputs.

Two real worlds, both 2 ranks: docs/bench.md's command on a simulated mixed-vendor world (spawned with
``--nranks``, JSON), and every collective on one vendor under torchrun (CSV, ``--compare gloo``,
``--plot``). Everything else is pure functions.
"""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import VENV_BIN, run_vcga
from vcga.bench import runner as bench
from vcga.bench import spec as bench_spec
from vcga.errors import VcgaConfigError

# -- nccl-tests' arithmetic ------------------------------------------------------------------------


def test_sizes_parse_and_step_as_nccl_tests():
    assert [bench.parse_size(s) for s in ("8", "1K", "1M", "4m", "1G", "0.5K")] == [8, 1024, 1 << 20, 4 << 20, 1 << 30, 512]
    assert bench.sizes(1 << 20, 4 << 20, 2) == [1 << 20, 2 << 20, 4 << 20]
    assert bench.sizes(8, 100, 4) == [8, 32]
    assert bench.sizes(0, 2 << 20, None, 1 << 20) == [0, 1 << 20, 2 << 20]  # -i: fixed increments
    for bad in ("", "1T", "-4", "M"):
        with pytest.raises(VcgaConfigError):
            bench.parse_size(bad)
    with pytest.raises(VcgaConfigError):
        bench.sizes(8, 4, 2)


def test_geometry_and_bus_factors_are_nccl_tests():
    n = 4
    # all_gather: per-rank count rounded down to 16 bytes; size = the receive buffer
    g = bench.geometry("all_gather", 1000, 4, n)  # 250 elements, 62 per rank, 60 after rounding to 16 B
    assert (g.send, g.recv, g.param) == (60, 240, 60)
    g = bench.geometry("reduce_scatter", 1 << 20, 2, n)
    assert (g.send, g.recv, g.param) == (1 << 19, 1 << 17, 1 << 17)
    g = bench.geometry("all_to_all", 1 << 20, 8, n)
    assert (g.send, g.recv, g.param) == (1 << 17, 1 << 17, 1 << 15)
    assert bench.geometry("all_reduce", 1 << 20, 4, n).param == 1 << 18
    assert bench.algbw_bytes("all_gather", bench.geometry("all_gather", 1 << 20, 4, n), 4, n) == 1 << 20
    assert bench.bus_factor("all_reduce", n) == 2 * 3 / 4
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench.bus_factor(op, n) == 3 / 4
    for op in ("broadcast", "reduce", "send_recv"):
        assert bench.bus_factor(op, n) == 1.0


@pytest.mark.parametrize("dtype", sorted(bench_spec._EXACT))
@pytest.mark.parametrize("redop", bench.REDOPS)
@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_check_data_has_an_exact_answer_in_every_dtype(dtype, redop, n):
    """The exact result of every reduction of the check data is representable in the dtype (so any
    reduction order gives it bit for bit), and the data are not all equal (so a wrong answer shows)."""
    tdt = getattr(torch, {"half": "float16", "float": "float32", "double": "float64"}.get(dtype, dtype))
    parts = [bench.inputs(dtype, redop, n, r, 4096, rep=3) for r in range(n)]
    exact = bench_spec._reduce_exact(parts, redop, n)
    for t in (*parts, exact):
        assert torch.equal(t.to(tdt).to(torch.int64), t), (dtype, redop, n)
    assert len({tuple(p[:64].tolist()) for p in parts}) > 1 or redop == "prod"
    if redop == "avg":
        assert torch.equal(torch.stack(parts).sum(0) % n, torch.zeros_like(exact))


def test_tiers_of_mixed_and_multi_node_layouts():
    one_node = [("sim-nccl", "a"), ("sim-nccl", "a"), ("sim-hccl", "a"), ("sim-hccl", "a")]
    assert bench._tiers(one_node) == [("in-vendor", [[0, 1], [2, 3]]), ("cross-vendor", [[0, 2], [1, 3]])]
    assert bench._tiers([("sim-nccl", "a"), ("sim-hccl", "a")]) == [("cross-vendor", [[0, 1]])]
    two_nodes = [("nccl", "a"), ("nccl", "a"), ("hccl", "b"), ("hccl", "b")]
    assert bench._tiers(two_nodes) == [("in-vendor", [[0, 1], [2, 3]]), ("cross-node", [[0, 2], [1, 3]])]
    assert bench._tiers([("gloo", "a")] * 4) == []  # one vendor, one node: nothing but the world


def test_bad_flags_are_one_line_errors():
    for args, needle in ((["-d", "float128"], "datatype"), (["-o", "xor"], "op"), (["gather"], "not a collective"),
                         (["-b", "8M", "-e", "1M"], "minbytes"), (["--json", "--csv"], "exclusive"),
                         (["--plot", "x.pdf"], ".png or .svg")):
        r = run_vcga("bench", *args, timeout=60)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch):
    from click.testing import CliRunner

    from vcga.cli.bench import bench as cmd

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = CliRunner().invoke(cmd, ["--plot", "x.png", "--nranks", "2"])
    assert r.exit_code == 2
    assert "pip install 'vcga[plot]'" in r.output


# -- real runs --------------------------------------------------------------------------------------


def _assert_formulas(row: dict) -> None:
    n, t = row["nranks"], row["time_us"] * 1e-6
    elt = {"float": 4, "int32": 4, "half": 2, "double": 8}[row["dtype"]]
    moved = row["count"] * elt * (n if row["op"] in ("all_gather", "reduce_scatter", "all_to_all") else 1)
    assert math.isclose(row["algbw_gbps"], moved / 1e9 / t, rel_tol=1e-9)
    assert math.isclose(row["busbw_gbps"], row["algbw_gbps"] * bench.bus_factor(row["op"], n), rel_tol=1e-9)


def test_issue_command_on_a_mixed_vendor_world_json():
    """`vcga bench all_reduce all_gather -b 1M -e 4M -f 2 --nranks 2 --json` with VCGA_SIM_VENDORS=nccl:1,hccl:1."""
    r = run_vcga("bench", "all_reduce", "all_gather", "-b", "1M", "-e", "4M", "-f", "2", "--nranks", "2", "--json",
                 "-n", "3", env={"VCGA_SIM_VENDORS": "nccl:1,hccl:1"}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [x["backend"] for x in out["layout"]] == ["sim-nccl", "sim-hccl"]
    rows = out["rows"]
    fields = {"op", "nranks", "size_bytes", "count", "dtype", "redop", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "in_place"}
    assert all(fields <= set(row) for row in rows)
    world = [x for x in rows if x["tier"] == "world"]
    got = {(x["op"], x["size_bytes"], x["in_place"]) for x in world}
    assert got == {(op, s, ip) for op in ("all_reduce", "all_gather") for s in (1 << 20, 2 << 20, 4 << 20)
                   for ip in (False, True)}
    for row in rows:
        assert row["wrong"] == 0 and row["time_us"] > 0 and row["nranks"] == 2, row
        _assert_formulas(row)
    # the mixed world is also measured per tier: here the only tier is the bridge between the two vendors
    assert {x["tier"] for x in rows} == {"world", "cross-vendor"}
    assert out["out_of_bounds"] == {"count": 0, "okay": True}
    # the table went to stderr meanwhile, with nccl-tests' column names
    assert "#wrong" in r.stderr and "algbw" in r.stderr and "busbw" in r.stderr and "out-of-place" in r.stderr


def test_every_collective_under_torchrun_csv_compare_and_plot(tmp_path, capfd):
    """One vendor under torchrun: all seven collectives (int32, prod) checked exactly, the gloo
    comparison (whose in-place all_to_all is wrong: the check sees it, VCGA's is right), CSV and a PNG.
    The `vcga` console script runs on 2 ranks forked from the rank server with the environment
    torchrun gives its workers (tests/script_world.py; `vcga bench` reads the job from it), their
    stdout and stderr this process's file descriptors."""
    from script_world import run_script

    png = tmp_path / "busbw.png"
    capfd.readouterr()
    codes = run_script(VENV_BIN / "vcga", 2, ["bench", "all", "-b", "4K", "-e", "8K", "-f", "2", "-n", "2", "-d",
                                              "int32", "-o", "prod", "--compare", "gloo", "--csv", "--plot", str(png)],
                       timeout=240)
    out, err = capfd.readouterr()
    r = subprocess.CompletedProcess("vcga bench", 0 if codes == [0, 0] else 1, out, err)
    assert r.returncode == 0, (codes, r.stderr[-3000:])
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    vcga_rows = [x for x in rows if x["group"] == "vcga"]
    assert {x["op"] for x in vcga_rows} == set(bench.OPS)
    for x in vcga_rows:
        assert x["wrong"] == "0" and x["dtype"] == "int32", x
        assert x["redop"] == ("prod" if x["op"] in bench.REDUCING else "none")
        assert float(x["vs_gloo"]) > 0
        _assert_formulas({k: (float(v) if k.endswith(("_us", "_gbps")) else int(v) if k in ("nranks", "count") else v)
                          for k, v in x.items()})
    assert not [x for x in vcga_rows if x["op"] == "send_recv" and x["in_place"] == "True"]  # no in-place send_recv
    gloo_a2a = [x for x in rows if x["group"] == "gloo" and x["op"] == "all_to_all" and x["in_place"] == "True"]
    # Plain gloo's in-place all_to_all reads an input its own writes may already have overwritten.
    # Whether a run shows it depends on the threads' timing (one run on a quiet machine, under two
    # pytest workers, came out right), so: its rows are there, and whenever one is wrong the run
    # says so; VCGA's own rows are right every time (above).
    assert gloo_a2a and all(int(x["wrong"]) >= 0 for x in gloo_a2a)
    assert ("plain gloo got" in r.stderr) == any(int(x["wrong"]) > 0 for x in rows if x["group"] == "gloo")
    assert "Out of bounds values : 0 OK" in r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
