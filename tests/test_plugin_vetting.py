"""Third-party plugins whose import ends or crashes the process are vetted in a child and kept
out (vcga/plugin_manager/vetting.py); their verdicts are cached in the user's cache (vcga/_usercache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_vcga

from vcga._usercache import SCHEMA, EntryCache
from vcga.errors import VcgaConfigError
from vcga.plugin_manager import VcgaPluginManager, vetting

PLUGINS = {
    "p_exit": "import sys\nsys.exit(3)\n",
    "p_segv": "import ctypes\nctypes.string_at(0)\n",
    "p_abort": "import os\nos.abort()\n",
    "p_osexit": "import os\nos._exit(0)\n",  # a 'clean' exit in the middle of the import
    "p_atexit": "import atexit, os\natexit.register(os.abort)\n",  # imports fine, kills the interpreter at exit
    "p_raise": "raise RuntimeError('vendor SDK missing')\n",
    "p_ok": "from vcga.contract import hookimpl\n\n@hookimpl\ndef vcga_backends():\n    return []\n",
    "p_hang": "import time\ntime.sleep(600)\n",
    "p_thread": "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n",
}


def write_plugins(d: Path, *names: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / f"{n}.py").write_text(PLUGINS[n])
    return d


def write_entry_point_dist(site: Path, module_src: str) -> None:
    """An installed distribution `crashy-vendor 1.2` with a `vcga` entry point, as pip leaves it."""
    (site / "crashy_vendor_plugin.py").write_text(module_src)
    info = site / "crashy_vendor-1.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: crashy-vendor\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text("[vcga]\ncrashy = crashy_vendor_plugin\n")


def by_name(data: dict) -> dict:
    return {p["name"]: p for p in data["plugins"]}


def test_vcga_info_survives_plugins_that_end_or_crash_the_process(tmp_path):
    """`vcga info --json` exits 0 and names each plugin with its failure;
    a second run answers from the cache."""
    site = write_plugins(tmp_path / "site", "p_exit", "p_segv", "p_abort", "p_osexit", "p_atexit", "p_raise", "p_ok")
    write_entry_point_dist(site, PLUGINS["p_segv"])
    env = {"PYTHONPATH": str(site), "VCGA_PLUGINS": "p_exit,p_segv,p_abort,p_osexit,p_atexit,p_raise,p_ok",
           "VCGA_CACHE_DIR": str(tmp_path / "cache")}
    expected = {  # name: (outcome, words of the error)
        "p_exit": ("exit", "the import called sys.exit(3)"),
        "p_segv": ("signal", "the import crashed the process: SIGSEGV"),
        "crashy": ("signal", "the import crashed the process: SIGSEGV"),
        "p_abort": ("signal", "the import crashed the process: SIGABRT"),
        "p_osexit": ("exited", "the process exited with status 0 during the import"),
        "p_atexit": ("at-exit", "the interpreter then ended with SIGABRT"),
        "p_raise": ("exception", "RuntimeError: vendor SDK missing"),
    }
    for run in (1, 2):
        r = run_vcga("info", "--json", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        plugins = by_name(json.loads(r.stdout))
        for name, (outcome, words) in expected.items():
            p = plugins[name]
            assert p["status"] == "failed", p
            assert p["vetting"]["outcome"] == outcome and words in p["error"], p
            assert p["vetting"]["cached"] is (run == 2), p
        assert plugins["crashy"]["source"] == "entry point (crashy-vendor 1.2)"
        assert "not imported" in plugins["p_segv"]["error"] and "not imported" not in plugins["p_raise"]["error"]
        assert plugins["p_ok"]["status"] == "loaded" and plugins["p_ok"]["vetting"]["outcome"] == "ok"
        # the built-ins are imported directly and still work
        assert plugins["vcga.plugins.gloo"]["status"] == "loaded" and plugins["vcga.plugins.gloo"]["vetting"] is None
        assert json.loads(r.stdout)["selected_backend"] == "gloo"
    # the text view names them too; --recheck-plugins vets again instead of reading the cache
    r = run_vcga("info", "--recheck-plugins", env={**env, "COLUMNS": "250"})
    assert r.returncode == 0 and "SIGSEGV" in r.stdout and "sys.exit(3)" in r.stdout
    assert "cached verdict" not in r.stdout


JOB = """
import sys, tempfile
import torch, torch.distributed as dist
from vcga.plugin_manager import get_plugin_manager
dist.init_process_group("vcga", init_method="file://" + tempfile.mkdtemp() + "/store", rank=0, world_size=1)
t = torch.arange(4.0)
dist.all_reduce(t)
ours = {p.name: (p.status, p.vetting["outcome"]) for p in get_plugin_manager().plugins() if p.vetting}
print(dist.get_backend(), get_plugin_manager().select_backend().name, t.tolist(), sorted(ours.items()))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("plugin,outcome", [("p_exit", "exit"), ("p_segv", "signal")])
def test_a_gloo_job_runs_with_a_crashing_plugin_present(tmp_path, plugin, outcome):
    """init_process_group("vcga") loads every plugin; a crashing one (vetted by the job itself: an empty
    cache) must not take down a job whose backend another plugin provides."""
    site = write_plugins(tmp_path / "site", plugin)
    (tmp_path / "job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env.update(PYTHONPATH=str(site), VCGA_PLUGINS=plugin, VCGA_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(tmp_path / "job.py")], capture_output=True, text=True, env=env,
                       timeout=180, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[0] == f"vcga gloo [0.0, 1.0, 2.0, 3.0] [('{plugin}', ('failed', '{outcome}'))]"


def test_hangs_are_bounded_and_judged_again_with_a_longer_timeout(tmp_path, monkeypatch):
    site = write_plugins(tmp_path / "site", "p_hang", "p_thread")
    monkeypatch.syspath_prepend(str(site))
    env = {"VCGA_PLUGINS": "p_hang,p_thread", "VCGA_CACHE_DIR": str(tmp_path / "cache"),
           "VCGA_PLUGIN_VET_TIMEOUT": "1.5"}

    def verdicts(**extra):
        pm = VcgaPluginManager(builtins=(), env={**env, **extra})
        return {p.name: (p.status, p.vetting["outcome"], p.vetting["cached"], p.error) for p in pm.plugins()}

    first = verdicts()
    assert first["p_hang"][:3] == ("failed", "hang", False)
    assert "the import did not finish within 1.5 s" in first["p_hang"][3]
    assert first["p_thread"][:3] == ("failed", "hang", False)  # a non-daemon thread would block the job's exit
    assert "exiting after the import did not finish" in first["p_thread"][3]
    assert {k: v[:3] for k, v in verdicts().items()} == {"p_hang": ("failed", "hang", True),
                                                         "p_thread": ("failed", "hang", True)}
    assert verdicts(VCGA_PLUGIN_VET_TIMEOUT="1.6")["p_hang"][2] is False  # a longer timeout judges again


def test_cache_entries_are_checked_and_corrupt_ones_discarded(tmp_path, monkeypatch):
    site = write_plugins(tmp_path / "site", "p_segv", "p_ok")
    monkeypatch.syspath_prepend(str(site))
    env = {"VCGA_CACHE_DIR": str(tmp_path / "cache")}
    cands = [vetting.Candidate("module", m, vetting.module_key(m)) for m in ("p_segv", "p_ok")]
    cache = EntryCache("plugins", env=env)
    paths = [cache.path_for(c.key) for c in cands]

    def run(**kw):
        return [(v.outcome, v.cached) for v in vetting.vet(cands, env=env, **kw)]

    assert run() == [("signal", False), ("ok", False)]
    assert run() == [("signal", True), ("ok", True)]
    assert sorted(p.name for p in (tmp_path / "cache" / "plugins").iterdir()) == sorted(p.name for p in paths)
    # garbage, a truncated file, another entry's content, an old schema: each discarded, vetted again
    good = json.loads(paths[1].read_text())
    for damage in (b"\x00garbage", paths[0].read_bytes()[:40], paths[1].read_bytes(),
                   json.dumps({**json.loads(paths[0].read_text()), "schema": SCHEMA + 1}).encode(),
                   json.dumps({**json.loads(paths[0].read_text()), "value": {"outcome": "ok"}}).encode()):
        paths[0].write_bytes(damage)
        assert run() == [("signal", False), ("ok", True)], damage
        assert json.loads(paths[0].read_text())["value"]["outcome"] == "signal"  # rewritten, valid
    assert json.loads(paths[1].read_text()) == good
    # VCGA_PLUGIN_RECHECK / recheck=True ignores the cache
    assert run(recheck=True) == [("signal", False), ("ok", False)]
    # a changed module file is a new key: vetted again (the plugin was fixed)
    (site / "p_segv.py").write_text("# fixed\n")
    fixed = [vetting.Candidate("module", "p_segv", vetting.module_key("p_segv"))]
    assert [(v.outcome, v.cached) for v in vetting.vet(fixed, env=env)] == [("ok", False)]


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch, caplog):
    site = write_plugins(tmp_path / "site", "p_exit")
    monkeypatch.syspath_prepend(str(site))
    (tmp_path / "file").write_text("not a folder")
    env = {"VCGA_PLUGINS": "p_exit", "VCGA_CACHE_DIR": str(tmp_path / "file" / "cache")}
    for _ in range(2):
        rec = VcgaPluginManager(builtins=(), env=env).plugins()[0]
        assert (rec.status, rec.vetting["outcome"], rec.vetting["cached"]) == ("failed", "exit", False)
    assert "cannot write the VCGA cache" in caplog.text


def test_a_crashing_parent_package_is_not_executed_to_locate_its_module(tmp_path, monkeypatch):
    """The cache key needs the module's file; finding `pkg.mod` must not import `pkg` (it crashes)."""
    pkg = tmp_path / "crashpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGINS["p_segv"])
    (pkg / "mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    key = vetting.module_key("crashpkg.mod")
    assert key is not None and key["file"] == str(pkg / "mod.py")
    assert vetting.module_key("crashpkg.nosuch") is None and vetting.module_key("nosuchpkg_xyz.mod") is None
    pm = VcgaPluginManager(builtins=(), env={"VCGA_PLUGINS": "crashpkg.mod", "VCGA_CACHE_DIR": str(tmp_path / "c")})
    assert pm.plugins()[0].vetting["outcome"] == "signal"
    assert "crashpkg" not in sys.modules


def test_concurrent_ranks_vet_at_once_without_corrupting_the_cache(tmp_path):
    """Every rank loads plugins at init_process_group; four processes vetting one empty cache at once."""
    site = write_plugins(tmp_path / "site", "p_segv", "p_ok")
    cache = tmp_path / "cache"
    code = ("import json; from vcga.plugin_manager import VcgaPluginManager as M; "
            "print(json.dumps({p.name: p.vetting['outcome'] for p in M(builtins=()).plugins()}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), VCGA_PLUGINS="p_segv,p_ok",
               VCGA_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, stdin=subprocess.DEVNULL) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out) == {"p_segv": "signal", "p_ok": "ok"}
    files = sorted((cache / "plugins").iterdir())
    assert len(files) == 2 and all(f.suffix == ".json" for f in files), files  # no temporaries left
    for f in files:
        doc = json.loads(f.read_text())
        assert EntryCache("plugins", env={"VCGA_CACHE_DIR": str(cache)}).get(doc["key"]) == doc["value"]


def test_without_vetting_sys_exit_at_import_is_still_recorded(tmp_path, monkeypatch):
    """VCGA_PLUGIN_VETTING=0 imports in-process: SystemExit from a plugin must not end the caller."""
    site = write_plugins(tmp_path / "site", "p_exit")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "p_exit", raising=False)
    rec = VcgaPluginManager(builtins=(), env={"VCGA_PLUGINS": "p_exit", "VCGA_PLUGIN_VETTING": "0"}).plugins()[0]
    assert (rec.status, rec.error, rec.vetting) == ("failed", "SystemExit: 3", None)


@pytest.mark.parametrize("bad", ["soon", "0", "-1", "inf"])
def test_a_bad_vetting_timeout_is_a_config_error(bad):
    with pytest.raises(VcgaConfigError, match="VCGA_PLUGIN_VET_TIMEOUT"):
        VcgaPluginManager(builtins=(), env={"VCGA_PLUGIN_VET_TIMEOUT": bad}).plugins()


def test_the_child_reports_an_exception_with_its_traceback(tmp_path, monkeypatch):
    site = write_plugins(tmp_path / "site", "p_raise")
    monkeypatch.syspath_prepend(str(site))
    (v,) = vetting.vet([vetting.Candidate("module", "p_raise", None)], env={"VCGA_CACHE_DIR": str(tmp_path)})
    assert (v.outcome, v.detail, v.cached) == ("exception", "RuntimeError: vendor SDK missing", False)
    assert "Traceback" in v.traceback and 'p_raise.py", line 1' in v.traceback
    assert not (tmp_path / "plugins").exists()  # key None: not cacheable, nothing stored


def test_vcga_verify_names_the_crashed_plugin_and_goes_on(tmp_path):
    site = write_plugins(tmp_path / "site", "p_segv")
    r = run_vcga("verify", "--backend", "gloo", "--world-size", "1", "--check", "collectives", "--mixed", "none",
                 "--quiet", env={"PYTHONPATH": str(site), "VCGA_PLUGINS": "p_segv", "COLUMNS": "250",
                                 "VCGA_CACHE_DIR": str(tmp_path / "cache")}, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "plugin not loaded: p_segv (VCGA_PLUGINS): the import crashed the process: SIGSEGV" in r.stdout
    assert " 0 failed" in r.stdout
