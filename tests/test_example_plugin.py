"""Out-of-tree plugins, installed for real: the example vendor package, a plugin that breaks, and
a vendor's first day -- the example certified with the full quick profile next to a minimal table
that lies about one cell, in one `vcga verify` run whose report several tests read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, run_vcga

HELPERS = ROOT / "tests" / "helper_plugins"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    """pip-install examples/vcga-example-plugin (a copy: the build must not touch the repo) into a
    fresh target directory, and hand-install a broken distribution next to it."""
    tmp = tmp_path_factory.mktemp("plugins")
    src = tmp / "src"
    shutil.copytree(ROOT / "examples" / "vcga-example-plugin", src)
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # A distribution whose plugin module raises at import, exactly as a broken vendor package would.
    (site / "vcga_broken_vendor.py").write_text("raise ImportError('libvendor.so.3: cannot open shared object file')\n")
    dist = site / "vcga_broken_vendor-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vcga-broken-vendor\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[vcga]\nbroken = vcga_broken_vendor\n")
    (dist / "RECORD").write_text("")
    return site


def _env(site, **extra):
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "200"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def info_json(site_dir):
    """`vcga info --json` with the example and the broken distribution installed: two tests read it."""
    return run_vcga("info", "--json", env=_env(site_dir))


def test_installed_example_plugin_appears_in_info(info_json):
    r = info_json
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["acme"]["status"] == "loaded"
    assert plugins["acme"]["source"] == "entry point (vcga-example-plugin 0.1.0)"
    acme = {b["name"]: b for b in data["backends"]}["acme"]
    assert acme["available"] and acme["vendor"] == "acme" and acme["plugin"] == "acme"
    assert acme["capabilities"]["all_reduce_native_ops"] == ["SUM", "MIN", "MAX"]


def test_broken_plugin_is_shown_with_its_error_and_the_rest_works(site_dir, info_json):
    r = info_json
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    broken = {p["name"]: p for p in data["plugins"]}["broken"]
    assert broken["status"] == "failed"
    assert broken["error"] == "ImportError: libvendor.so.3: cannot open shared object file"
    assert {b["name"] for b in data["backends"]} >= {"gloo", "acme", "sim-hccl"}
    table = run_vcga("info", env=_env(site_dir))
    assert "failed" in table.stdout and "libvendor.so.3" in table.stdout
    # ... and the example's backend still certifies next to it: test_the_example_plugin_passes_...


#: One rank: a job on automatic selection, then a group that names the example's backend; the
#: third-party plugin modules each step imported.
ACME_JOB = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from vcga.process_group import VcgaOptions
    dist.init_process_group("vcga", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    x = torch.ones(4)
    dist.all_reduce(x)
    auto = [dist.group.WORLD.transport.backend_name, sorted(m for m in sys.modules if m.startswith("vcga_"))]
    g = dist.new_group([0], backend="vcga", pg_options=VcgaOptions(backend="acme"))
    dist.all_reduce(x, group=g)
    acme = [g.transport.backend_name, sorted(m for m in sys.modules if m.startswith("vcga_"))]
    print(json.dumps({"auto": auto, "acme": acme}))
    dist.destroy_process_group()
""")


def test_a_job_imports_the_example_plugin_only_when_it_uses_acme(site_dir, info_json):
    """What the vetting child reported of the installed example (one CPU backend, priority -10) is
    all selection needs: a job on automatic selection runs on gloo without importing it; a group
    that names acme imports it then."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env.update(_env(site_dir))
    r = subprocess.run([sys.executable, "-c", ACME_JOB], capture_output=True, text=True, timeout=240, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["auto"] == ["gloo", []], out
    assert out["acme"][0] == "acme" and "vcga_example_plugin.plugin" in out["acme"][1], out


def test_autoload_switch_hides_entry_point_plugins(site_dir):
    r = run_vcga("info", "--json", env=_env(site_dir, VCGA_DISABLE_PLUGIN_AUTOLOAD="1"))
    data = json.loads(r.stdout)
    assert data["autoload_disabled"] is True
    assert {"acme", "broken"}.isdisjoint(p["name"] for p in data["plugins"])
    # an explicit module list still loads it
    r = run_vcga("info", "--json", env=_env(site_dir, VCGA_DISABLE_PLUGIN_AUTOLOAD="1",
                                                VCGA_PLUGINS="vcga_example_plugin.plugin"))
    assert "acme" in {b["name"] for b in json.loads(r.stdout)["backends"]}


def test_repository_copy_untouched():
    """Building the example must not leave build artefacts in the repository."""
    leftovers = [p.name for p in (ROOT / "examples" / "vcga-example-plugin").iterdir()
                 if p.name in ("build",) or p.name.endswith(".egg-info")]
    assert not leftovers, textwrap.shorten(str(leftovers), 200)


# ---------------------------------------------------------------------------------------------------
# A vendor's first day: one verify run, read by the tests below
# ---------------------------------------------------------------------------------------------------

#: The lie of tests/helper_plugins/minimal_plugins.py and the cells VCGA derives from it.
LIE = "all_reduce int16 SUM"
DERIVED_FROM_LIE = {"all_reduce bool SUM", "all_reduce uint8 SUM", "all_reduce int8 SUM"}


@pytest.fixture(scope="module")
def first_day(site_dir, tmp_path_factory):
    """``vcga verify`` with the full quick profile on two backends, as one run (one report):
    ``acme`` (examples/vcga-example-plugin, pip-installed, found through its entry point) and
    ``minimal-liar`` (tests/helper_plugins/minimal_plugins.py: float32 moved and float32 SUM reduced
    natively, plus one lie). Returns (exit status, stdout, {backend: [result rows]})."""
    tmp = tmp_path_factory.mktemp("first-day")
    report = tmp / "report.json"
    env = {"PYTHONPATH": os.pathsep.join([str(site_dir), str(HELPERS), os.environ.get("PYTHONPATH", "")]),
           "VCGA_PLUGINS": "minimal_plugins", "COLUMNS": "250", "TMPDIR": str(tmp)}
    r = run_vcga("verify", "--backend", "acme", "--backend", "minimal-liar", "--quiet", "--report", str(report),
                 env=env, timeout=1200)
    assert report.exists(), r.stdout + r.stderr
    data = json.loads(report.read_text())
    by_backend: dict[str, list[dict]] = {}
    for row in data["results"]:
        by_backend.setdefault(row["backend"], []).append(row)
    assert [w["id"] for w in data["worlds"]] == [f"{b} ws={n}" for b in ("acme", "minimal-liar") for n in (1, 2, 3)]
    assert all(w["status"] == "completed" for w in data["worlds"]), data["worlds"]
    return r.returncode, r.stdout, by_backend


def _quick_checks() -> set[str]:
    import yaml

    return set(yaml.safe_load((ROOT / "conformance" / "quick.yaml").read_text())["checks"])


@pytest.mark.timeout(1500)
def test_the_example_plugin_passes_the_full_quick_profile(first_day):
    """`pip install ./examples/vcga-example-plugin && vcga verify --backend acme`: every family ran,
    nothing failed; what acme's table refuses is skipped with the table's reason."""
    _, _, rows = first_day
    acme = rows["acme"]
    failed = [f"{r['world']} {r['check']} {r['case']}: {r['detail']}" for r in acme if r["status"] == "fail"]
    assert not failed, failed[:10]
    ran = {r["check"] for r in acme if r["status"] == "pass"}
    assert ran == _quick_checks() - {"mixed-vendors"}  # mixed-vendors runs only in simulated vendor sets
    assert sum(r["status"] == "pass" for r in acme) > 2000
    refused = [r for r in acme if r["status"] == "skip" and r["detail"].startswith("refused by")]
    assert refused and all("acme capability table: acme does not support this combination" in r["detail"]
                           for r in refused)
    # what a plugin most easily breaks: p2p and moving of every dtype, DDP (it broadcasts int32)
    by_case = {(r["world"], r["check"], r["case"]): r for r in acme}
    for ws in (2, 3):
        for dt in ("bool", "int32", "uint8", "bfloat16"):
            cell = by_case[(f"acme ws={ws}", "dtype-matrix", f"send_recv {dt} [emulated via bitcast:int64]")]
            assert cell["status"] == "pass" and cell["derived_from"] == "send_recv int64"
        assert by_case[(f"acme ws={ws}", "send-recv", "ring bool n=0,1,257")]["status"] == "pass"
    assert [r["status"] for r in acme if r["check"] == "gradients"] == ["pass", "pass"]


@pytest.mark.timeout(1500)
def test_a_plugin_that_lies_about_one_cell_fails_that_cell_and_the_cells_derived_from_it(first_day):
    code, stdout, rows = first_day
    assert code == 1
    failed = [r for r in rows["minimal-liar"] if r["status"] == "fail"]
    assert failed and {r["cell"] for r in failed} == {LIE} | DERIVED_FROM_LIE, \
        sorted({(r["check"], r["case"], r["cell"]) for r in failed})
    for r in failed:
        assert r["derived_from"] == (None if r["cell"] == LIE else LIE), r
    # every world size, through both families that exercise the cells
    assert {(r["world_size"], r["check"]) for r in failed} == {
        (n, c) for n in (1, 2, 3) for c in ("exact-reduce", "dtype-matrix")}
    for cell in DERIVED_FROM_LIE:
        assert f"(cell {cell}, derived from {LIE})" in stdout
    assert f"(cell {LIE})" in stdout


@pytest.mark.timeout(1500)
def test_a_float32_only_table_passes_everything_else_and_ddp_trains(first_day):
    """Apart from the lie, the liar's table is the minimal one: float32 moved and float32 SUM reduced
    natively. Every other case passes or is skipped with the table's reason; DDP trains on it."""
    _, _, rows = first_day
    liar = [r for r in rows["minimal-liar"] if r["cell"] not in {LIE} | DERIVED_FROM_LIE]
    assert all(r["status"] in ("pass", "skip") for r in liar)
    assert {r["check"] for r in liar if r["status"] == "pass"} == _quick_checks() - {"mixed-vendors"}
    grads = [r for r in liar if r["check"] == "gradients"]
    assert [(r["world_size"], r["status"]) for r in grads] == [(2, "pass"), (2, "pass")]
    refused = [r for r in liar if r["status"] == "skip" and r["detail"].startswith("refused by")]
    assert refused and all("minimal-liar capability table: minimal-liar does not support" in r["detail"]
                           for r in refused)
    # every dtype moves, derived from the one native float32 cell of each moving collective
    moved = [r for r in liar if r["check"] == "dtype-matrix" and r["cell"] and r["cell"].split()[0] in
             ("broadcast", "all_gather", "gather", "scatter", "all_to_all", "send_recv") and r["world_size"] == 3]
    assert len(moved) == 6 * 17 and all(r["status"] == "pass" for r in moved)
