"""Plugins are imported when a job needs them: what ``init_process_group("vcga")`` imports, the
built-in manifests that say what each plugin provides, and selection that rules out a backend
without importing its plugin (docs/plugins.md, "What is imported when")."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import types

import pytest
from test_plugin_manager import _Backend  # the same test backend, with what selection reads added

from vcga.config import load_config
from vcga.contract import Backend, CapabilityTable, Collective, ProbeResult, ReduceOp, hookimpl
from vcga.errors import VcgaBackendUnavailable
from vcga.plugin_manager import BUILTIN_PLUGINS, VcgaPluginManager
from vcga.plugin_manager.hooks import HookRegistry, _plain_impls
from vcga.plugin_manager.manifest import BUILTIN_MANIFESTS, HOOKS, BackendFacts, Manifest, manifest_of

#: A one-rank job in a fresh interpreter: the vcga modules (and their plugins) that
#: init_process_group("vcga") and a first all_reduce import; then a group of a simulated vendor
#: (a backend chosen by name, through the rank hook) and the modules that one adds.
JOB = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    before = set(sys.modules)
    dist.init_process_group("vcga", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    x = torch.ones(1024)
    dist.all_reduce(x)
    assert x[0].item() == 1.0
    first = sorted(set(sys.modules) - before)
    from dataclasses import replace
    from vcga.config import load_config
    from vcga.process_group import VcgaOptions
    before = set(sys.modules)
    g = dist.new_group([0], backend="vcga", pg_options=VcgaOptions(replace(load_config(), sim_vendors="hccl:1")))
    dist.all_reduce(x, group=g)
    sim = sorted(set(sys.modules) - before)
    before = set(sys.modules)
    dist.broadcast(x, 0)
    later = sorted(set(sys.modules) - before)
    table = dist.group.WORLD.transport.table
    print(json.dumps({"first": first, "sim": sim, "later": later, "backend": dist.group.WORLD.transport.backend_name,
                      "sim_backend": g.transport.backend_name, "table_in_full": table._full is not None}))
    dist.destroy_process_group()
""")

#: What a job never imports unless it uses it: conformance, the formats, the compressors, their
#: interfaces (the contract's sections 4-6), the device interface (section 2: nothing asks a backend
#: for its accelerator) and vcga.compress (a job that sets no compression spec).
NEVER = ("vcga.conformance", "vcga.formats", "vcga.formatspec", "vcga.formatkit", "vcga.checkspec", "vcga.compressors",
         "vcga.plugins.compressors", "vcga.compress", "vcga.devicespec")
#: What a job imports only when it asks for it: VCGA_DEBUG's fingerprints, the torch profiler's spans.
ON_REQUEST = ("vcga.pg.debug", "vcga.pg.spans")
#: What a job imports at the first call that needs it: the collectives besides all_reduce, the
#: dispatcher's recipes (a call the native fast path does not take), point to point, monitored barriers.
AT_FIRST_USE = ("vcga.pg.collectives", "vcga.pg.recipes", "vcga.pg.p2p", "vcga.pg.monitored")


def test_a_job_imports_only_its_backends_plugin():
    """The module count of a one-rank ``init_process_group("vcga")`` + all_reduce (auto selection,
    gloo here): no conformance, format or compressor module, and of the plugins only gloo's; a
    simulated vendor's group then adds the sim plugin and still no other."""
    r = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=240,
                       env={**_env(), "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["backend"], out["sim_backend"]) == ("gloo", "sim-hccl")
    assert not out["table_in_full"]  # gloo's table: digested at discovery, one cell looked up, none derived in full
    first, sim = out["first"], out["sim"]
    vcga_first = [m for m in first if m.startswith("vcga")]
    unused = [m for m in vcga_first if m.startswith(NEVER) or m.startswith("vcga.plugins.")]
    assert unused == ["vcga.plugins.gloo"], f"imported by the job: {unused}"
    assert len(vcga_first) <= 30, vcga_first  # 21 today: the group's own modules, the manager, gloo's plugin
    assert not [m for m in first + sim if m in ON_REQUEST], first + sim  # no VCGA_DEBUG, no profiler running
    assert not [m for m in first + sim if m in AT_FIRST_USE], first + sim
    assert "vcga.pg.collectives" in out["later"], out["later"]  # a broadcast loads the other collectives
    plugins_added = [m for m in sim if m.startswith("vcga.plugins.")]
    assert plugins_added, sim
    assert all(m == "vcga.plugins.sim" or m.startswith("vcga.plugins.sim.") for m in plugins_added), sim
    assert not [m for m in sim if m.startswith(NEVER)], sim
    assert not [m for m in first + sim if m.partition(".")[0] == "pluggy"]  # built-in plugins held without it


def test_lazy_tables_are_the_built_tables():
    """``build_lazy`` gives :meth:`build`'s cells (final refusals kept, the rest derived), and its
    digest is of the statements' source, the backend and vcga's version, not of the cells."""
    from vcga.capabilities import CapabilityBuilder, LazyCapabilityTable
    from vcga.pg.discovery import table_digest
    from vcga.plugins import gloo

    def statements() -> CapabilityBuilder:
        return (CapabilityTable.builder("t").native(["all_reduce"], ["int32", "float32"], ["SUM", "MAX"])
                .native(["all_gather"], ["uint8"]).refuse(["all_reduce"], ["int16", "float16"], ["SUM"], note="no")
                .refuse(["all_reduce"], ["int8"], ["SUM"], note="gloo: no int8", final=False))

    built, lazy = statements().build(), statements().build_lazy(b"src")
    assert lazy.lookup("all_reduce", "int16", "SUM").note == "no"  # final: never derived
    assert lazy.lookup("all_reduce", "int8", "SUM").via == "upcast:int32"  # non-final: derived on top
    assert lazy.lookup("all_gather", "float64").via == "bitcast:uint8"
    assert lazy.cells() == built.cells()
    assert table_digest(statements().build_lazy(b"src")) == table_digest(lazy)
    assert table_digest(statements().build_lazy(b"other")) != table_digest(lazy)
    assert table_digest(lazy) != table_digest(built)  # named by its source, not its cells
    table = gloo.load_table()
    assert isinstance(table, LazyCapabilityTable)
    digest = table_digest(table)
    assert table._full is None, "the digest worked the whole table out"
    stated = CapabilityTable.builder("gloo")
    data = json.loads(gloo.TABLE_FILE.read_text())
    assert data["columns"] == list(gloo.COLUMNS)
    for coll, dt, op, ok, detail in data["cells"]:  # one statement per cell: what load_table states in groups
        if ok:
            stated.native([coll], [dt], [op] if op else None,
                          note=f"measured with torch {data['torch']} ({gloo.TABLE_FILE.name})")
        else:
            stated.refuse([coll], [dt], [op] if op else None, note=f"gloo: {detail}", final=False)
    assert table.cells() == stated.build().cells()
    assert table_digest(table) == digest
    fresh = gloo.load_table()
    table_digest(fresh)
    assert fresh.lookup("all_reduce", "float32", "SUM") == table.lookup("all_reduce", "float32", "SUM")
    assert fresh._stated_fn.__self__._parsed is None, "naming the table or a native cell parsed the whole file"
    from vcga.plugins.gloo.measure import all_cells

    by_line = gloo._Rows(gloo.TABLE_FILE.read_bytes(), gloo.TABLE_FILE.name)
    whole = gloo._Rows(gloo.TABLE_FILE.read_bytes(), gloo.TABLE_FILE.name)
    assert whole._rows and whole.native() == by_line.native()
    assert [by_line.row(k) for k in all_cells()] == [whole.row(k) for k in all_cells()]
    assert by_line._parsed is None  # every one of them read from its own line
    # as a set, the keys measured native; a file laid out otherwise (one line) is parsed whole
    native_keys = {(Collective(c), dt, ReduceOp(op) if op else None) for c, dt, op, ok, _ in data["cells"] if ok}
    assert set(by_line) == native_keys and len(by_line) == len(native_keys)
    assert all(k in by_line for k in native_keys) and ("x", "y", "z") not in by_line and 3 not in by_line
    one_line = gloo._Rows(json.dumps(data).encode(), "one-line.json")
    assert [one_line.row(k) for k in all_cells()] == [whole.row(k) for k in all_cells()]
    assert one_line.native().note == f"measured with torch {data['torch']} (one-line.json)"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("VCGA_") or k == "VCGA_CACHE_DIR"}


@pytest.mark.parametrize("module", BUILTIN_PLUGINS)
def test_builtin_manifests_say_what_the_plugins_provide(module):
    """Each built-in manifest equals what its module really implements and returns (so selection
    never skips a plugin it should have asked); the simulated vendors' rank hook answers nothing
    without ``sim_vendors``, which is what their manifest's key says."""
    declared = BUILTIN_MANIFESTS[module]
    real = manifest_of(importlib.import_module(module))
    assert (real.hooks, real.backends) == (declared.hooks, declared.backends)
    # held without pluggy, its implementations are what pluggy registers: the same functions, called
    # with the same arguments
    plain = _plain_impls(module, importlib.import_module(module), declared)
    assert plain is not None and set(plain) == declared.hooks
    registry = HookRegistry()
    registry.pm.register(importlib.import_module(module), name=module)
    for hook, impl in plain.items():
        [theirs] = registry.impls(hook)
        assert (impl.function, impl.argnames, impl.plugin_name) == (theirs.function, theirs.argnames, module)
    if declared.rank_backend_key is not None:
        hook = importlib.import_module(module).vcga_rank_backend
        assert all(hook(rank=r, world_size=4, config=load_config(env={})) is None for r in range(4))
        assert hook(rank=0, world_size=2, config=load_config(env={"VCGA_SIM_VENDORS": "nccl:2"})) is not None


def test_every_builtin_and_every_hook_is_in_the_manifests():
    from vcga.contract import HookSpecs

    assert set(BUILTIN_MANIFESTS) == set(BUILTIN_PLUGINS)
    assert list(HOOKS) == [n for n in vars(HookSpecs) if n.startswith("vcga_")]


class _Dev(_Backend):
    """test_plugin_manager's backend with a device type, requirements and a count of its probes."""

    def __init__(self, name, device_type="cpu", priority=50, requires=()):
        super().__init__(name, priority=priority)
        self.device_type, self.requires = device_type, requires
        self.probed = 0

    def probe(self):
        self.probed += 1
        return super().probe()


def test_selection_rules_out_backends_without_importing_their_plugins(monkeypatch):
    """Auto selection imports a plugin only while its backend might be available: one whose
    required module is not installed, or whose device type torch counts none of, is ruled out from
    its manifest; the plugin of the chosen backend is imported; with nothing available, every
    plugin is imported so the error carries each probe's own reason."""
    imported: list[str] = []

    def plugin(name: str, backend: Backend) -> str:
        mod = types.ModuleType(name)
        mod.vcga_backends = hookimpl(lambda: [backend])
        monkeypatch.setitem(sys.modules, name, mod)
        return name

    def loader_counting(pm: VcgaPluginManager) -> None:
        for p in pm._known.values():
            inner = p.loader
            p.loader = lambda inner=inner, n=p.name: (imported.append(n), inner())[1]

    facts = {
        "plug_nomod": BackendFacts("nomod", 300, False, "cpu", ("vcga_no_such_vendor_sdk",)),
        "plug_nodev": BackendFacts("nodev", 200, False, "cpu_test_device"),
        "plug_good": BackendFacts("good", 100, False, "cpu"),
        "plug_low": BackendFacts("low", 10, False, "cpu"),
    }
    for name, f in facts.items():
        plugin(name, _Dev(f.name, f.device_type, f.priority, f.requires))
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "cpu_test_device", types.SimpleNamespace(device_count=lambda: 0), raising=False)
    monkeypatch.setattr("vcga.plugin_manager.BUILTIN_MANIFESTS",
                        {n: Manifest(frozenset({"vcga_backends"}), (f,)) for n, f in facts.items()})
    pm = VcgaPluginManager(builtins=tuple(facts), env={})
    pm._discover()
    loader_counting(pm)
    assert pm.select_backend(load_config(env={})).name == "good"
    assert imported == ["plug_good"]
    # a name asked for explicitly imports its plugin only
    assert pm.backend_record("low").name == "low" and imported == ["plug_good", "plug_low"]

    # nothing available: every plugin is imported, and the reasons are the probes'
    for name in facts:
        sys.modules[name].vcga_backends = hookimpl(lambda n=facts[name].name: [_Down(n)])
    pm = VcgaPluginManager(builtins=tuple(facts), env={})
    pm._discover()
    imported.clear()
    loader_counting(pm)
    with pytest.raises(VcgaBackendUnavailable) as e:
        pm.select_backend(load_config(env={}))
    assert sorted(imported) == sorted(facts)
    assert all(f"{f.name}: down here" in str(e.value) for f in facts.values()), str(e.value)


class _Down(_Dev):
    def probe(self):
        return ProbeResult(False, "down here")


def test_pluggy_takes_over_the_plugins_held_without_it(monkeypatch):
    """Built-in plugins are held without pluggy until a plugin needs it; then pluggy holds them all,
    and every query answers as before: a registered plugin's backend comes after the built-in's,
    a name taken is refused, and a hook's arguments reach each implementation."""
    calls = []

    def rank_backend(rank, world_size, config):
        calls.append((rank, world_size))
        return "plain"

    held = types.ModuleType("plug_held")
    held.vcga_backends = hookimpl(lambda: [_Dev("plain")])
    held.vcga_rank_backend = hookimpl(rank_backend)
    monkeypatch.setitem(sys.modules, "plug_held", held)
    monkeypatch.setattr("vcga.plugin_manager.BUILTIN_MANIFESTS", {
        "plug_held": Manifest(frozenset({"vcga_backends", "vcga_rank_backend"}), (BackendFacts("plain", 60),))})
    pm = VcgaPluginManager(builtins=("plug_held",), env={})
    assert pm.select_backend(load_config(env={}), rank=1, world_size=3).name == "plain"
    assert calls == [(1, 3)] and pm._hooks._pm is None and pm._hooks._plain == {"plug_held": held}
    pm.register(types.SimpleNamespace(vcga_backends=hookimpl(lambda: [_Dev("registered", priority=90)])), "extra")
    assert pm._hooks._pm is not None and pm._hooks._plain == {}
    assert sorted(pm.pm.list_name_plugin()) == [("extra", pm.pm.get_plugin("extra")), ("plug_held", held)]
    assert [r.name for r in pm.backend_records()] == ["plain", "registered"]
    assert pm.call_first("vcga_rank_backend", rank=2, world_size=3, config=None) == "plain" and calls[-1] == (2, 3)
    with pytest.raises(Exception, match="already registered"):
        pm.register(held, "plug_held")
