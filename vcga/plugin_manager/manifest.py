"""What a plugin provides, known without importing it: what the plugin manager loads plugins by.

The manager imports a plugin only when a caller asks for something it provides: a job's
``init_process_group("vcga")`` imports the plugin of the backend it selects, ``vcga convert`` the
format plugins, ``vcga verify`` the conformance checks, a compression spec the compressors. What a
plugin provides is its :class:`Manifest`: the hooks it implements and, for ``vcga_backends``, the
facts selection needs about each backend (:class:`BackendFacts`). Manifests come from

- :data:`BUILTIN_MANIFESTS` for the built-in plugins (tests/test_plugin_manifest.py checks each
  against what its module really implements and returns);
- the vetting child for a third-party plugin (:mod:`vcga.plugin_manager.vetting`): right after the
  import it vets, it asks the plugin with :func:`manifest_of`, and the verdict cache keeps the
  answer with the verdict, so the plugin's author declares nothing;
- nowhere otherwise (vetting switched off, a module this process imported already, a plugin whose
  hook raised in the child): the plugin is then imported at the first query of any kind.

A manifest is only a guide to what to import: what a loaded plugin's hooks return is what counts.

Importing this module imports neither pluggy nor torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from vcga._values import FrozenValue

__all__ = ["BackendFacts", "Manifest", "BUILTIN_MANIFESTS", "HOOKS", "manifest_of"]

#: The hooks of :class:`vcga.contract.HookSpecs`, in its order (tests/test_plugin_manifest.py checks).
HOOKS = ("vcga_backends", "vcga_rank_backend", "vcga_tensor_to_host", "vcga_formats", "vcga_conformance_checks",
         "vcga_compressors")


class BackendFacts(FrozenValue):
    """What automatic selection needs to know of a backend before importing its plugin (the
    :class:`~vcga.contract.Backend` attributes of the same names).

    A frozen value (:mod:`vcga._values`), not a NamedTuple: ``typing.NamedTuple`` builds its class
    through ``collections.namedtuple``, which compiles ``__new__`` from source, about 0.15 ms per
    class on every rank of every job; this module is imported by each job's first group."""

    __slots__ = ("name", "priority", "simulated", "device_type", "requires")
    name: str
    priority: int
    simulated: bool
    device_type: str
    requires: tuple[str, ...]

    def __init__(self, name: str, priority: int = 0, simulated: bool = False, device_type: str = "cpu",
                 requires: tuple[str, ...] = ()) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "simulated", simulated)
        object.__setattr__(self, "device_type", device_type)
        object.__setattr__(self, "requires", requires)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "priority": self.priority, "simulated": self.simulated,
                "device_type": self.device_type, "requires": list(self.requires)}

    def why_not_here(self) -> str | None:
        """Why this backend cannot be available here, found without importing its plugin, or None
        when only its probe can tell: a module it requires is not installed (``find_spec``, which
        imports nothing for a top-level name), or torch's module for its device type counts no
        device (torch as already imported: this never imports it)."""
        import importlib.util

        for mod in self.requires:
            top = mod.partition(".")[0]
            try:
                if importlib.util.find_spec(top) is None:
                    return f"module {top} is not installed"
            except (ImportError, ValueError):  # ValueError: a sys.modules entry without __spec__
                pass
        torch = sys.modules.get("torch")
        if self.device_type != "cpu" and torch is not None:
            count = getattr(getattr(torch, self.device_type, None), "device_count", None)
            if callable(count):
                try:
                    if int(count()) == 0:
                        return f"no {self.device_type} device (torch.{self.device_type}.device_count() == 0)"
                except Exception:  # noqa: BLE001 - a driver error: the probe says it properly
                    return None
        return None


class Manifest(FrozenValue):
    """The hooks a plugin implements and the backends it registers (a frozen value, as
    :class:`BackendFacts` is)."""

    __slots__ = ("hooks", "backends", "rank_backend_key")
    hooks: frozenset[str]
    backends: tuple[BackendFacts, ...]
    #: The config key without which the plugin's ``vcga_rank_backend`` answers None (the simulated
    #: vendors' ``sim_vendors``), so selection does not import it while that key is unset. Only
    #: built-in manifests say so; a third-party plugin implementing the hook is asked at every
    #: automatic selection.
    rank_backend_key: str | None

    def __init__(self, hooks: frozenset[str], backends: tuple[BackendFacts, ...] = (),
                 rank_backend_key: str | None = None) -> None:
        object.__setattr__(self, "hooks", hooks)
        object.__setattr__(self, "backends", backends)
        object.__setattr__(self, "rank_backend_key", rank_backend_key)

    def provides(self, hook: str) -> bool:
        return hook in self.hooks

    def to_json(self) -> dict[str, Any]:
        return {"hooks": sorted(self.hooks), "backends": [b.to_json() for b in self.backends]}

    @classmethod
    def from_json(cls, raw: Any) -> Manifest | None:
        """A manifest from the vetting cache, or None for anything malformed (the plugin is then
        imported at the first query, which is always correct)."""
        try:
            hooks = frozenset(raw["hooks"])
            if not all(isinstance(h, str) for h in hooks):
                return None
            backends = []
            for b in raw["backends"]:
                facts = BackendFacts(str(b["name"]), int(b["priority"]), bool(b["simulated"]), str(b["device_type"]),
                                     tuple(str(m) for m in b["requires"]))
                backends.append(facts)
        except (KeyError, TypeError, ValueError):
            return None
        return cls(hooks, tuple(backends))


def _cpu(name: str, priority: int = 0, simulated: bool = False) -> BackendFacts:
    return BackendFacts(name, priority, simulated, "cpu")


_FORMATS = Manifest(frozenset({"vcga_formats"}))

#: The built-in plugins' manifests, by module (``vcga.plugin_manager.BUILTIN_PLUGINS``).
BUILTIN_MANIFESTS: Mapping[str, Manifest] = {
    "vcga.plugins.gloo": Manifest(frozenset({"vcga_backends", "vcga_tensor_to_host"}), (_cpu("gloo"),)),
    "vcga.plugins.sim": Manifest(frozenset({"vcga_backends", "vcga_rank_backend"}),
                                 (_cpu("sim-nccl", -100, True), _cpu("sim-hccl", -100, True),
                                  _cpu("sim-cncl", -100, True)), rank_backend_key="sim_vendors"),
    "vcga.plugins.nccl": Manifest(frozenset({"vcga_backends", "vcga_tensor_to_host"}),
                                  (BackendFacts("nccl", 100, False, "cuda"),)),
    "vcga.plugins.hccl": Manifest(frozenset({"vcga_backends", "vcga_tensor_to_host"}),
                                  (BackendFacts("hccl", 100, False, "npu", ("torch_npu",)),)),
    "vcga.plugins.mlu": Manifest(frozenset({"vcga_backends", "vcga_tensor_to_host"}),
                                 (BackendFacts("mlu", 100, False, "mlu", ("torch_mlu",)),)),
    "vcga.plugins.compressors": Manifest(frozenset({"vcga_compressors"})),
    "vcga.conformance.checks": Manifest(frozenset({"vcga_conformance_checks"})),
    "vcga.formats.vbin": _FORMATS,
    "vcga.formats.hdf5": _FORMATS,
    "vcga.formats.safetensors_format": _FORMATS,
    "vcga.formats.torch_pt": _FORMATS,
    "vcga.formats.mindrecord": _FORMATS,
    "vcga.formats.mindspore_ckpt": _FORMATS,
}


def manifest_of(plugin: Any) -> Manifest:
    """Ask an imported plugin (a module or object) what it provides: the hooks pluggy finds on it,
    and the facts of the backends its ``vcga_backends`` returns (called once, here).

    :raises Exception: whatever the plugin's registration or its ``vcga_backends`` raises (the
        caller then knows no manifest, and the manager imports the plugin at the first query).
    """
    import pluggy

    from vcga.contract import PROJECT, Backend, HookSpecs

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    pm.register(plugin)
    hooks = frozenset(h for h in HOOKS if getattr(pm.hook, h).get_hookimpls())
    backends: list[BackendFacts] = []
    for impl in pm.hook.vcga_backends.get_hookimpls():
        returned: Any = impl.function()
        for b in returned or ():
            if isinstance(b, Backend):  # anything else is the loaded plugin's recorded hook error
                backends.append(BackendFacts(b.name, int(b.priority), bool(b.simulated), b.device_type,
                                             tuple(b.requires)))
    return Manifest(hooks, tuple(backends))
