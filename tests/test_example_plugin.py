"""Out-of-tree plugins, installed for real: the example vendor package and a plugin that breaks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, run_vcga


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


def test_installed_example_plugin_appears_in_info(site_dir):
    r = run_vcga("info", "--json", env=_env(site_dir))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["acme"]["status"] == "loaded"
    assert plugins["acme"]["source"] == "entry point (vcga-example-plugin 0.1.0)"
    acme = {b["name"]: b for b in data["backends"]}["acme"]
    assert acme["available"] and acme["vendor"] == "acme" and acme["plugin"] == "acme"
    assert acme["capabilities"]["all_reduce_native_ops"] == ["SUM", "MIN", "MAX"]


def test_broken_plugin_is_shown_with_its_error_and_the_rest_works(site_dir):
    r = run_vcga("info", "--json", env=_env(site_dir))
    data = json.loads(r.stdout)
    broken = {p["name"]: p for p in data["plugins"]}["broken"]
    assert broken["status"] == "failed"
    assert broken["error"] == "ImportError: libvendor.so.3: cannot open shared object file"
    assert {b["name"] for b in data["backends"]} >= {"gloo", "acme", "sim-hccl"}
    table = run_vcga("info", env=_env(site_dir))
    assert "failed" in table.stdout and "libvendor.so.3" in table.stdout
    # ... and the plugin's own backend still certifies
    v = run_vcga("verify", "--backend", "acme", "--world-size", "2", "--check", "collectives",
                 "--check", "exact-reduce", env=_env(site_dir), timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr


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
