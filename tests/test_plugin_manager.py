"""Plugin discovery, isolation of broken plugins, autoload control and backend selection."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest

from vcga.config import load_config
from vcga.contract import Backend, CapabilityTable, ProbeResult, hookimpl
from vcga.errors import VcgaBackendNotFound, VcgaBackendUnavailable, VcgaConfigError
from vcga.plugin_manager import BUILTIN_PLUGINS, VcgaPluginManager


class _Backend(Backend):
    vendor, device_type, dist_backend = "test", "cpu", "gloo"

    def __init__(self, name, probe=None, priority=0):
        self.name, self._probe, self.priority = name, probe, priority

    def probe(self):
        if isinstance(self._probe, Exception):
            raise self._probe
        return self._probe or ProbeResult(True, "fine", 1)

    def accelerator(self):
        raise NotImplementedError

    def capabilities(self):
        return CapabilityTable.builder(self.name).build()

    def create_process_group(self, store, rank, world_size, timeout):
        raise NotImplementedError


def make_module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_modules(monkeypatch):
    def install(name, **attrs):
        mod = make_module(name, **attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod
    return install


def test_builtins_load_and_register_backends():
    pm = VcgaPluginManager(env={})
    names = [r.name for r in pm.backend_records()]
    assert names[:4] == ["gloo", "sim-nccl", "sim-hccl", "sim-cncl"]
    assert {"nccl", "hccl", "mlu"} <= set(names)
    assert all(p.status == "loaded" for p in pm.plugins()), [p.to_json() for p in pm.plugins()]
    assert [p.name for p in pm.plugins()][: len(BUILTIN_PLUGINS)] == list(BUILTIN_PLUGINS)


def test_plugin_that_fails_to_import_is_recorded_and_others_work():
    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo", "vcga_no_such_module_xyz"), env={})
    recs = {p.name: p for p in pm.plugins()}
    bad = recs["vcga_no_such_module_xyz"]
    assert bad.status == "failed" and "ModuleNotFoundError" in bad.error and "Traceback" in bad.traceback
    assert pm.select_backend(load_config(env={})).name == "gloo"


def test_raising_hook_and_raising_probe_are_isolated(fake_modules):
    @hookimpl
    def vcga_backends():
        raise RuntimeError("vendor SDK exploded")

    fake_modules("plug_boom", vcga_backends=vcga_backends)
    fake_modules("plug_badprobe", vcga_backends=hookimpl(lambda: [_Backend("badprobe", probe=OSError("driver gone"), priority=50)]))
    fake_modules("plug_notabackend", vcga_backends=hookimpl(lambda: ["not a backend"]))
    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo", "plug_boom", "plug_badprobe", "plug_notabackend"), env={})
    assert [r.name for r in pm.backend_records()] == ["gloo", "badprobe"]
    recs = {p.name: p for p in pm.plugins()}
    assert "vendor SDK exploded" in recs["plug_boom"].hook_errors["vcga_backends"]
    assert "not a vcga.contract.Backend" in recs["plug_notabackend"].hook_errors["vcga_backends"]
    probe = pm.backend_record("badprobe").probe()
    assert not probe.available and probe.reason == "probe raised OSError: driver gone"
    # auto selection skips the broken, higher-priority backend and still finds gloo
    assert pm.select_backend(load_config(env={})).name == "gloo"
    with pytest.raises(VcgaBackendUnavailable, match="driver gone"):
        pm.select_backend(load_config(env={"VCGA_BACKEND": "badprobe"}))


def test_duplicate_backend_name_is_reported(fake_modules):
    fake_modules("plug_dup", vcga_backends=hookimpl(lambda: [_Backend("gloo")]))
    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo", "plug_dup"), env={})
    pm.backend_records()
    assert "already registered by plugin 'vcga.plugins.gloo'" in {p.name: p for p in pm.plugins()}["plug_dup"].hook_errors["vcga_backends"]


def _fake_entry_points(monkeypatch, eps):
    """Installed distributions as the manager reads them: one whose entry-point file holds ``eps``."""
    import vcga.plugin_manager as m

    text = "".join(f"[{e.group}]\n{e.name} = {e.value}\n" for e in eps)

    class Dist:
        def read_text(self, name):
            return text if name == "entry_points.txt" else None

        @property
        def entry_points(self):
            return m.importlib.metadata.EntryPoints(eps)

    monkeypatch.setattr(m.importlib.metadata, "distributions", lambda: [Dist()])


def test_entry_point_files_are_read_as_importlib_reads_them(tmp_path, monkeypatch):
    """The manager opens a folder distribution's ``entry_points.txt`` itself (at half the cost of
    ``read_text``): the same text for every installed distribution, and a distribution on
    ``sys.path`` that registers a plugin is found."""
    import importlib.metadata

    from vcga.plugin_manager.entrypoints import entry_points_text as _entry_points_text

    dists = list(importlib.metadata.distributions())
    assert dists and all(_entry_points_text(d) == d.read_text("entry_points.txt") for d in dists)
    info = tmp_path / "vcga_demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vcga-demo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nx = y:z\n\n[vcga]\ndemo = vcga_demo.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = VcgaPluginManager(env={})._entry_points()
    assert [(e.name, e.value, e.dist.name) for e in eps] == [("demo", "vcga_demo.plugin", "vcga-demo")]


@pytest.mark.parametrize("disable", ["1", "true", None])
def test_entry_point_autoload_and_its_switch(monkeypatch, fake_modules, disable):
    fake_modules("ep_plugin", vcga_backends=hookimpl(lambda: [_Backend("from-ep")]))
    _fake_entry_points(monkeypatch, [EntryPoint("ep", "ep_plugin", "vcga"), EntryPoint("other", "x", "other.group")])
    env = {} if disable is None else {"VCGA_DISABLE_PLUGIN_AUTOLOAD": disable}
    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo",), env=env)
    names = [r.name for r in pm.backend_records()]
    assert ("from-ep" in names) is (disable is None)
    assert pm.autoload_disabled is (disable is not None)


def test_vcga_plugins_loads_modules_even_with_autoload_disabled(fake_modules):
    fake_modules("explicit_plugin", vcga_backends=hookimpl(lambda: [_Backend("explicit")]))
    pm = VcgaPluginManager(builtins=(), env={"VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "VCGA_PLUGINS": "explicit_plugin"})
    assert [r.name for r in pm.backend_records()] == ["explicit"]
    assert pm.plugins()[0].source == "VCGA_PLUGINS"


def test_blocked_plugin_is_not_imported(fake_modules):
    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo", "vcga.plugins.sim"), env={"VCGA_BLOCK_PLUGINS": "vcga.plugins.sim"})
    assert {p.name: p.status for p in pm.plugins()}["vcga.plugins.sim"] == "blocked"
    assert [r.name for r in pm.backend_records()] == ["gloo"]


def test_selection_order(fake_modules):
    fake_modules("plug_fast", vcga_backends=hookimpl(lambda: [_Backend("fast", priority=10),
                                                              _Backend("down", ProbeResult(False, "no devices"), priority=99)]))
    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo", "vcga.plugins.sim", "plug_fast"), env={})
    assert pm.select_backend(load_config(env={})).name == "fast"  # highest available priority
    assert pm.select_backend(load_config(env={"VCGA_BACKEND": "gloo"})).name == "gloo"  # explicit wins
    with pytest.raises(VcgaBackendNotFound, match="registered backends: gloo, sim-nccl"):
        pm.select_backend(load_config(env={"VCGA_BACKEND": "nope"}))
    # simulated vendors: per-rank choice from VCGA_SIM_VENDORS, explicit backend still wins
    cfg = load_config(env={"VCGA_SIM_VENDORS": "nccl:1,hccl:2,cncl:1"})
    assert [pm.select_backend(cfg, rank=r, world_size=4).name for r in range(4)] == \
        ["sim-nccl", "sim-hccl", "sim-hccl", "sim-cncl"]
    with pytest.raises(VcgaConfigError, match="add up to the world size \\(3\\)"):
        pm.select_backend(cfg, rank=0, world_size=3)
    cfg = load_config(env={"VCGA_SIM_VENDORS": "nccl:2", "VCGA_BACKEND": "gloo"})
    assert pm.select_backend(cfg, rank=1, world_size=2).name == "gloo"


def test_simulated_backends_are_never_auto_selected():
    pm = VcgaPluginManager(builtins=("vcga.plugins.sim",), env={})
    with pytest.raises(VcgaBackendUnavailable, match="no backend is available"):
        pm.select_backend(load_config(env={}))


def test_tensor_to_host_through_the_owning_plugin():
    import torch

    pm = VcgaPluginManager(env={})
    t = torch.arange(12).reshape(3, 4).t()
    h = pm.tensor_to_host(t)
    assert h.is_contiguous() and torch.equal(h, t)
