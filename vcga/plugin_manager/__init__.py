"""Finds, loads and isolates plugins; selects a backend.

Built-in plugins are module names loaded by the same code as third-party ones (pytest's pattern);
third-party plugins come from the entry-point group ``vcga``. Loading is lazy, per query: a plugin
is imported when a caller first asks for something it provides (:mod:`vcga.plugin_manager.manifest`
says what each provides without importing it) -- selecting a backend imports that backend's plugin,
:meth:`~VcgaPluginManager.formats` the format plugins, :meth:`~VcgaPluginManager.conformance_checks`
the checks, :meth:`~VcgaPluginManager.compressors` the compressors, and
:meth:`~VcgaPluginManager.plugins` (``vcga info``) every plugin. A plugin whose manifest is unknown
is imported at the first query of any kind. Loading is isolated: a plugin that fails to import,
whose hook raises, or whose backend's probe raises is recorded with its error and traceback, shown
by ``vcga info``, and never breaks an unrelated call. Third-party plugins (entry points and
``VCGA_PLUGINS``) are first imported in a child process (:mod:`vcga.plugin_manager.vetting`), so one
whose import ends or crashes the interpreter is recorded instead of taking VCGA down with it; that
child also reports the plugin's manifest. pluggy is imported once a plugin needs it (:mod:`.hooks`).

Environment:

- ``VCGA_DISABLE_PLUGIN_AUTOLOAD=1``: do not load entry points (built-ins still load), as
  ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does for pytest;
- ``VCGA_PLUGINS=mod.a,mod.b``: load these modules as plugins too (works with autoload disabled);
- ``VCGA_BLOCK_PLUGINS=name,...``: never load these plugins (by entry-point or module name);
- ``VCGA_BACKEND=name``: the explicit backend choice (see :mod:`vcga.config`);
- ``VCGA_PLUGIN_VET_TIMEOUT``, ``VCGA_PLUGIN_RECHECK``, ``VCGA_PLUGIN_VETTING``, ``VCGA_CACHE_DIR``:
  vetting of third-party plugins (see :mod:`vcga.plugin_manager.vetting`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from vcga import contract
from vcga.config import Config, load_config
from vcga.contract import Backend, ProbeResult
from vcga.errors import VcgaBackendNotFound, VcgaBackendUnavailable, VcgaConfigError, VcgaError, VcgaPluginError
from vcga.plugin_manager.hooks import HookRegistry
from vcga.plugin_manager.manifest import BUILTIN_MANIFESTS, BackendFacts, Manifest

if TYPE_CHECKING:
    import pluggy

    from vcga.checkspec import ConformanceCheck
    from vcga.compressors import CompressorSpec
    from vcga.formatspec import FormatSpec

__all__ = [
    "BUILTIN_PLUGINS",
    "PluginRecord",
    "BackendRecord",
    "VcgaPluginManager",
    "get_plugin_manager",
    "reset_plugin_manager",
]

log = logging.getLogger(__name__)

#: Built-in plugins, loaded by module name exactly like third-party ones (their manifests:
#: :data:`vcga.plugin_manager.manifest.BUILTIN_MANIFESTS`).
BUILTIN_PLUGINS: tuple[str, ...] = (
    "vcga.plugins.gloo",
    "vcga.plugins.sim",
    "vcga.plugins.nccl",
    "vcga.plugins.hccl",
    "vcga.plugins.mlu",
    "vcga.plugins.compressors",
    "vcga.conformance.checks",
    "vcga.formats.vbin",
    "vcga.formats.hdf5",
    "vcga.formats.safetensors_format",
    "vcga.formats.torch_pt",
    "vcga.formats.mindrecord",
    "vcga.formats.mindspore_ckpt",
)

_TRUE = {"1", "true", "yes", "on"}


class PluginRecord:
    """One plugin the manager tried to load. Plain classes, both records: a dataclass adds ~0.3 ms to each start."""

    __slots__ = ("name", "source", "module", "status", "error", "traceback", "hook_errors", "vetting")

    def __init__(self, name: str, source: str, module: str, status: str = "pending") -> None:
        self.name = name  #: entry-point name or module name
        self.source = source  #: "builtin", "entry point (dist 1.2.3)" or "VCGA_PLUGINS"
        self.module = module  #: the module path (entry-point value)
        #: "loaded", "failed", "blocked"; "pending" while not imported yet (:meth:`VcgaPluginManager.plugins`
        #: imports every plugin first, so it never shows)
        self.status = status
        self.error: str | None = None  #: one line
        self.traceback: str | None = None
        self.hook_errors: dict[str, str] = {}  #: hook name -> error line
        #: what importing it in a child did (:class:`vcga.plugin_manager.vetting.Verdict` as JSON); None when not vetted
        self.vetting: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "module": self.module, "status": self.status,
                "error": self.error, "hook_errors": dict(self.hook_errors), "vetting": self.vetting}


class BackendRecord:
    """A backend and its (cached) probe."""

    __slots__ = ("backend", "plugin", "_probe", "probe_traceback")

    def __init__(self, backend: Backend, plugin: str) -> None:
        self.backend, self.plugin = backend, plugin
        self._probe: ProbeResult | None = None
        self.probe_traceback: str | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    def probe(self) -> ProbeResult:
        """Probe once; a raising probe becomes 'unavailable' with the error as reason."""
        if self._probe is None:
            try:
                result = self.backend.probe()
                if not isinstance(result, ProbeResult):
                    raise TypeError(f"probe() returned {type(result).__name__}, not ProbeResult")
                self._probe = result
            except Exception as e:  # noqa: BLE001 - isolation: a broken probe must not break other backends
                self.probe_traceback = traceback.format_exc()
                self._probe = ProbeResult(False, f"probe raised {type(e).__name__}: {e}")
                log.warning("backend %s (plugin %s): probe raised %r", self.name, self.plugin, e)
        return self._probe


def _err_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class _Plugin:
    """A plugin the manager knows and may import: where it comes from, what it provides."""

    __slots__ = ("name", "module", "source", "loader", "manifest", "order")

    def __init__(self, name: str, module: str, source: str, loader: Callable[[], Any], manifest: Manifest | None,
                 order: int) -> None:
        self.name, self.module, self.source, self.loader = name, module, source, loader
        self.manifest = manifest  #: None: unknown, imported at the first query of any kind
        self.order = order  #: built-ins first, then VCGA_PLUGINS, then entry points: whose answer wins


class VcgaPluginManager:
    """The registry of plugins, backends, formats and conformance checks.

    Each query imports only the plugins that provide what it asks for (see the module docstring);
    what those plugins return is combined in the plugins' order -- built-ins first, then
    ``VCGA_PLUGINS``, then entry points -- whatever order they were imported in.
    """

    def __init__(self, builtins: Sequence[str] = BUILTIN_PLUGINS, env: dict[str, str] | None = None) -> None:
        self._env = dict(os.environ) if env is None else env
        self._builtins = tuple(builtins)
        self._hooks = HookRegistry()  # the loaded plugins' hook implementations
        self._records: dict[str, PluginRecord] = {}
        self._known: dict[str, _Plugin] = {}  # not imported yet; a plugin leaves when it is
        self._order: dict[str, int] = {}  # plugin name -> its place (registered ones after every known one)
        self._discovered = False
        self._lock = threading.RLock()
        self._backends_of: dict[str, list[BackendRecord]] = {}  # per loaded plugin, its hook called once
        self._backends: dict[str, BackendRecord] | None = None  # the merged view, None when stale

    @property
    def pm(self) -> pluggy.PluginManager:
        """pluggy's manager of the loaded plugins (built on first use: :class:`HookRegistry`)."""
        return self._hooks.pm

    # -- finding plugins -------------------------------------------------------------------------

    @property
    def autoload_disabled(self) -> bool:
        return self._env.get("VCGA_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in _TRUE

    def _blocked(self) -> set[str]:
        return {s.strip() for s in self._env.get("VCGA_BLOCK_PLUGINS", "").split(",") if s.strip()}

    def _discover(self) -> None:
        """Find every plugin once, importing none: built-ins with their manifests, third-party
        plugins vetted (from the cache, or in child processes) with theirs."""
        with self._lock:
            if self._discovered:
                return
            timeout_s = self._vet_timeout()  # a bad value raises before anything is marked found
            self._discovered = True
            blocked = self._blocked()
            for mod in self._builtins:  # ours: imported directly, never vetted
                self._add(mod, mod, "builtin", partial(importlib.import_module, mod), BUILTIN_MANIFESTS.get(mod),
                          blocked)
            third: list[tuple[str, str, str, Callable[[], Any], Any]] = []
            extra = [s.strip() for s in self._env.get("VCGA_PLUGINS", "").split(",") if s.strip()]
            for mod in extra:
                third.append((mod, mod, "VCGA_PLUGINS", partial(importlib.import_module, mod), None))
            if not self.autoload_disabled:
                for ep in self._entry_points():
                    dist = getattr(ep, "dist", None)
                    src = f"entry point ({dist.name} {dist.version})" if dist is not None else "entry point"
                    third.append((ep.name, ep.value, src, ep.load, ep))
            verdicts = self._vet(third, blocked, timeout_s)
            for name, module, src, loader, _ in third:
                verdict = verdicts.get(name)
                if verdict is not None and not verdict.safe:
                    self._refuse(name, module, src, verdict)
                    continue
                manifest = Manifest.from_json(verdict.manifest) if verdict is not None and verdict.manifest else None
                self._add(name, module, src, loader, manifest, blocked)
                if verdict is not None and name in self._records:
                    self._records[name].vetting = verdict.to_json()

    def _add(self, name: str, module: str, source: str, loader: Callable[[], Any], manifest: Manifest | None,
             blocked: set[str]) -> None:
        if name in self._records:  # the first of a name wins, as pluggy would refuse the second
            return
        rec = PluginRecord(name=name, source=source, module=module)
        self._records[name] = rec
        self._order[name] = len(self._order)
        if name in blocked or module in blocked:
            rec.status = "blocked"
            return
        self._known[name] = _Plugin(name, module, source, loader, manifest, self._order[name])

    def _vet_timeout(self) -> float | None:
        """``VCGA_PLUGIN_VET_TIMEOUT``, checked; None for vetting's default."""
        raw = self._env.get("VCGA_PLUGIN_VET_TIMEOUT", "").strip()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise VcgaConfigError("plugin vetting timeout", raw, "a number of seconds > 0",
                                  "env VCGA_PLUGIN_VET_TIMEOUT")
        return value

    def _vet(self, third: list[tuple[str, str, str, Callable[[], Any], Any]], blocked: set[str],
             timeout_s: float | None) -> dict[str, Any]:
        """Vet, in child processes, the third-party plugins this process may import."""
        if not third:
            return {}
        from vcga.plugin_manager import vetting  # only where there is a third-party plugin to vet

        if (self._env.get("VCGA_PLUGIN_VETTING", "").strip().lower() in {"0", "false", "no", "off"}
                or os.environ.get(vetting.CHILD_ENV) == "1"):
            return {}
        names, cands = [], []
        for name, module, _, _, ep in third:
            if name in self._records or name in names or name in blocked or module in blocked:
                continue
            modname = module.partition(":")[0].strip() if ep is not None else module
            if modname in sys.modules:  # already imported in this process: nothing left to guard
                continue
            dist = getattr(ep, "dist", None) if ep is not None else None
            key: dict[str, Any] | None
            if dist is not None:
                key = vetting.entry_point_key(ep.name, ep.value, dist.name, dist.version)
            else:
                key = vetting.module_key(modname)
            names.append(name)
            cands.append(vetting.Candidate("module" if ep is None else "entry point", module, key))
        if not cands:
            return {}
        recheck = self._env.get("VCGA_PLUGIN_RECHECK", "").strip().lower() in _TRUE
        if timeout_s is None:
            timeout_s = vetting.DEFAULT_TIMEOUT_S
        return dict(zip(names, vetting.vet(cands, timeout_s=timeout_s, recheck=recheck, env=self._env), strict=True))

    def _refuse(self, name: str, module: str, source: str, verdict: Any) -> None:
        """Record a plugin kept out because its import ends or stalls the process."""
        if name in self._records:
            return
        rec = PluginRecord(name=name, source=source, module=module, status="failed")
        again = "; cached verdict, VCGA_PLUGIN_RECHECK=1 checks again" if verdict.cached else ""
        rec.error = f"{verdict.detail}; so it was not imported (vetted in a child process{again})"
        rec.traceback = verdict.traceback
        rec.vetting = verdict.to_json()
        self._records[name] = rec
        self._order[name] = len(self._order)
        log.warning("plugin %s (%s) not loaded: %s", name, source, rec.error)

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        """The entry points of the group ``vcga``, the first of each name (the same distribution can
        appear twice on ``sys.path``). Only the distributions whose entry-point file names the group
        are parsed, and which those are is remembered between starts
        (:mod:`vcga.plugin_manager.entrypoints`): ``importlib.metadata.entry_points()`` parses every
        distribution's, some 20 us each, on every rank of every job."""
        from vcga.plugin_manager.entrypoints import declaring

        seen: set[str] = set()
        out = []
        try:
            for dist in declaring(contract.PROJECT):
                for ep in dist.entry_points.select(group=contract.PROJECT):
                    if ep.name not in seen:
                        seen.add(ep.name)
                        out.append(ep)
        except Exception as e:  # noqa: BLE001 - a broken distribution's metadata must not stop vcga
            log.warning("cannot read entry points: %r", e)
        return out

    # -- importing them --------------------------------------------------------------------------

    def load(self) -> None:
        """Import every plugin not imported yet (idempotent, thread-safe). Failures are recorded,
        never raised."""
        self._import_where(lambda m: True)

    def _import_where(self, wanted: Callable[[Manifest], bool]) -> None:
        """Import, in the plugins' order, each known plugin whose manifest is unknown or ``wanted``."""
        with self._lock:
            self._discover()
            for plugin in [p for p in self._known.values() if p.manifest is None or wanted(p.manifest)]:
                self._import(plugin)

    def _import(self, plugin: _Plugin) -> None:
        if self._known.pop(plugin.name, None) is None:
            return
        rec = self._records[plugin.name]
        try:
            obj = plugin.loader()
            self._hooks.register(obj, plugin.name, plugin.manifest if plugin.source == "builtin" else None)
            rec.status = "loaded"
        except (Exception, SystemExit) as e:  # noqa: BLE001 - ImportError, SyntaxError, pluggy validation,
            # anything the plugin raises; and sys.exit() at import, never a request to end the caller's program
            rec.status = "failed"
            rec.error = _err_line(e)
            rec.traceback = traceback.format_exc()
            log.warning("plugin %s (%s) failed to load: %s", plugin.name, plugin.source, rec.error)
            return
        self._backends = None

    def register(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, embedding applications): it comes after
        every other plugin."""
        with self._lock:
            self._discover()
            rec = PluginRecord(name=name, source="registered", module=getattr(plugin, "__name__", repr(plugin)))
            self._order[name] = len(self._order)
            try:
                self._hooks.register(plugin, name)
                rec.status = "loaded"
            except Exception as e:
                rec.status, rec.error, rec.traceback = "failed", _err_line(e), traceback.format_exc()
                raise VcgaPluginError(name, rec.error) from e
            finally:
                self._records[name] = rec
            self._backends = None

    def plugins(self) -> list[PluginRecord]:
        """Every plugin, in order, each imported (or refused, blocked, failed) first."""
        self.load()
        return list(self._records.values())

    # -- isolated hook calls ---------------------------------------------------------------------

    def _impls(self, hook_name: str) -> list[Any]:
        """The loaded implementations of a hook, in the plugins' order."""
        last = len(self._order)
        return sorted(self._hooks.impls(hook_name), key=lambda impl: self._order.get(impl.plugin_name, last))

    def _hook_failed(self, pname: str, hook_name: str, e: BaseException) -> None:
        rec = self._records.get(pname)
        if rec is not None:
            rec.hook_errors[hook_name] = _err_line(e)
        log.warning("plugin %s: %s raised %r", pname, hook_name, e)

    def _collect(self, hook_name: str) -> list[tuple[str, Any]]:
        """Call a list-returning hook on every plugin that implements it, separately; a raising
        plugin is recorded."""
        self._import_where(lambda m: m.provides(hook_name))
        out: list[tuple[str, Any]] = []
        for impl in self._impls(hook_name):
            try:
                items = impl.function()
                for item in items or ():
                    out.append((impl.plugin_name, item))
            except Exception as e:  # noqa: BLE001 - isolation: recorded against the plugin
                self._hook_failed(impl.plugin_name, hook_name, e)
        return out  # the plugins' order: built-ins first, then entry points

    def call_first(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a firstresult hook, isolating each implementation's failure: later plugins first
        (an entry point's answer overrides a built-in's), the first answer that is not None wins."""
        self._import_where(lambda m: self._asked(m, hook_name, kwargs))
        for impl in self._impls(hook_name)[::-1]:
            try:
                res = impl.function(*[kwargs[a] for a in impl.argnames])
            except VcgaError:
                raise  # a deliberate, typed error (bad config) is the answer, not a plugin failure
            except Exception as e:  # noqa: BLE001 - isolation: recorded against the plugin, the next one answers
                self._hook_failed(impl.plugin_name, hook_name, e)
                continue
            if res is not None:
                return res
        return None

    @staticmethod
    def _asked(manifest: Manifest, hook_name: str, kwargs: dict[str, Any]) -> bool:
        """Whether a plugin with this manifest could answer this call of a firstresult hook."""
        if not manifest.provides(hook_name):
            return False
        if hook_name == "vcga_rank_backend" and manifest.rank_backend_key is not None:
            return bool(getattr(kwargs.get("config"), manifest.rank_backend_key, None))
        if hook_name == "vcga_tensor_to_host" and manifest.backends:  # the plugin owning the device type
            device = getattr(getattr(kwargs.get("tensor"), "device", None), "type", None)
            return device is None or any(b.device_type == device for b in manifest.backends)
        return True

    # -- backends --------------------------------------------------------------------------------

    def _plugin_backends(self, pname: str, impl: Any) -> list[BackendRecord]:
        """One loaded plugin's backends, its hook called once (probes stay cached on the records)."""
        got = self._backends_of.get(pname)
        if got is None:
            got = []
            try:
                items = impl.function()
            except Exception as e:  # noqa: BLE001 - isolation: recorded against the plugin
                self._hook_failed(pname, "vcga_backends", e)
                items = ()
            for b in items or ():
                if isinstance(b, Backend):
                    got.append(BackendRecord(backend=b, plugin=pname))
                else:
                    rec = self._records.get(pname)
                    if rec is not None:
                        rec.hook_errors["vcga_backends"] = (
                            f"returned {type(b).__name__}, which is not a vcga.contract.Backend")
            self._backends_of[pname] = got
        return got

    def _loaded_backends(self) -> dict[str, BackendRecord]:
        """The backends of the plugins imported so far, by name: the first plugin (in order) that
        registers a name has it; a later one is recorded as that plugin's hook error."""
        with self._lock:
            if self._backends is None:
                found: dict[str, BackendRecord] = {}
                for impl in self._impls("vcga_backends"):
                    for br in self._plugin_backends(impl.plugin_name, impl):
                        if br.name in found:
                            rec = self._records.get(br.plugin)
                            if rec is not None:
                                rec.hook_errors["vcga_backends"] = (
                                    f"backend name {br.name!r} already registered by plugin {found[br.name].plugin!r}")
                            continue
                        found[br.name] = br
                self._backends = found
            return self._backends

    def backend_records(self) -> list[BackendRecord]:
        """Every backend of every plugin (imports every plugin that registers backends)."""
        self._import_where(lambda m: m.provides("vcga_backends"))
        return list(self._loaded_backends().values())

    def backend(self, name: str) -> Backend:
        """The backend called ``name`` (probe not checked)."""
        return self.backend_record(name).backend

    def backend_record(self, name: str) -> BackendRecord:
        """The backend called ``name``, importing only the plugins that say they register it (all of
        them when none does: a manifest may be out of date).

        :raises VcgaBackendNotFound: no plugin registers it."""
        self._import_where(lambda m: any(b.name == name for b in m.backends))
        rec = self._loaded_backends().get(name)
        if rec is None:
            self.load()
            rec = self._loaded_backends().get(name)
        if rec is None:
            raise VcgaBackendNotFound(name, [r.name for r in self.backend_records()])
        return rec

    def select_backend(self, config: Config | None = None, *, rank: int = 0, world_size: int = 1) -> Backend:
        """Choose this rank's backend and check it can run.

        Order: an explicit ``config.backend`` (``VCGA_BACKEND``); then a plugin's
        ``vcga_rank_backend`` answer (simulated vendor sets); then the available, non-simulated
        backend with the highest priority (among equals, the first plugin's). Only the plugins
        this needs are imported: the chosen backend's, and those of higher-priority backends that
        might be available (see :meth:`BackendFacts.why_not_here`).

        :raises VcgaBackendNotFound: an explicit name no plugin registers.
        :raises VcgaBackendUnavailable: the chosen backend cannot run here (with its probe reason).
        """
        config = config or load_config(env=self._env)
        name: str | None = None
        if config.backend != "auto":
            name = config.backend
        else:
            name = self.call_first("vcga_rank_backend", rank=rank, world_size=world_size, config=config)
        if name is not None:
            rec = self.backend_record(name)
            probe = rec.probe()
            if not probe.available:
                raise VcgaBackendUnavailable(name, probe.reason)
            return rec.backend
        with self._lock:
            chosen = self._auto_select()
            if chosen is None:  # nothing here: every plugin imported and probed, for the reasons
                self.load()
                chosen = self._auto_select()
            if isinstance(chosen, BackendRecord):
                return chosen.backend
            raise VcgaBackendUnavailable("auto", "no backend is available here; " + "; ".join(chosen or ()))

    def _auto_select(self) -> BackendRecord | list[str] | None:
        """The available non-simulated backend with the highest priority, importing plugins as the
        candidates ahead of it need; the reasons, one per candidate, when none is available; None
        when a candidate was ruled out without importing its plugin (the caller imports all, so the
        reason is the probe's)."""
        ruled_out = False
        why_not: dict[BackendFacts, str | None] = {}  # each declared backend asked once: find_spec walks sys.path
        while True:
            self._import_where(lambda m: False)  # plugins of unknown manifest: their backends count too
            # (-priority, plugin order, place in the plugin, then the loaded record or the declared facts)
            cands: list[tuple[int, int, int, BackendRecord | tuple[BackendFacts, _Plugin]]] = []
            for i, loaded in enumerate(self._loaded_backends().values()):
                if not loaded.backend.simulated:
                    cands.append((-loaded.backend.priority, self._order.get(loaded.plugin, 0), i, loaded))
            for p in self._known.values():
                for i, declared in enumerate(p.manifest.backends if p.manifest is not None else ()):
                    if not declared.simulated:
                        cands.append((-declared.priority, p.order, i, (declared, p)))
            cands.sort(key=lambda c: c[:3])
            reasons: list[str] = []
            for *_, cand in cands:
                if isinstance(cand, BackendRecord):
                    probe = cand.probe()
                    if probe.available:
                        return cand
                    reasons.append(f"{cand.name}: {probe.reason}")
                    continue
                facts, plugin = cand
                if facts not in why_not:
                    why_not[facts] = facts.why_not_here()
                why = why_not[facts]
                if why is not None:
                    ruled_out = True
                    reasons.append(f"{facts.name}: {why}")
                    continue
                self._import(plugin)  # it may be the one: import it and look again
                break
            else:
                return None if ruled_out else reasons

    # -- formats and checks ----------------------------------------------------------------------

    def formats(self) -> list[FormatSpec]:
        from vcga.formatspec import FormatSpec

        out: dict[str, FormatSpec] = {}
        for _, spec in self._collect("vcga_formats"):
            if isinstance(spec, FormatSpec) and spec.name not in out:
                out[spec.name] = spec
        return list(out.values())

    def conformance_checks(self) -> list[ConformanceCheck]:
        out: dict[str, ConformanceCheck] = {}
        for _, chk in self._collect("vcga_conformance_checks"):
            name = getattr(chk, "name", None)
            if isinstance(name, str) and name not in out:
                out[name] = chk
        return list(out.values())

    def compressors(self) -> list[tuple[str, CompressorSpec]]:
        """Every gradient compressor, with the plugin that contributed it: built-ins first; a name
        already taken is recorded as the later plugin's hook error (the first wins)."""
        from vcga.compressors import CompressorSpec

        out: dict[str, tuple[str, CompressorSpec]] = {}
        for pname, spec in self._collect("vcga_compressors"):
            rec = self._records.get(pname)
            if not isinstance(spec, CompressorSpec):
                if rec is not None:
                    rec.hook_errors["vcga_compressors"] = (
                        f"returned {type(spec).__name__}, which is not a vcga.contract.CompressorSpec")
                continue
            if spec.name in out:
                if rec is not None:
                    rec.hook_errors["vcga_compressors"] = (
                        f"compressor name {spec.name!r} already registered by plugin {out[spec.name][0]!r}")
                continue
            out[spec.name] = (pname, spec)
        return list(out.values())

    def tensor_to_host(self, tensor: Any) -> Any:
        """Bring a tensor to the host through its device's plugin (see ``vcga_tensor_to_host``)."""
        res = self.call_first("vcga_tensor_to_host", tensor=tensor)
        if res is None:
            if tensor.device.type != "cpu":
                raise VcgaPluginError(
                    "vcga", f"no loaded plugin can bring a {tensor.device.type!r} tensor to the host; "
                    "install the vendor's vcga plugin (see `vcga info`)")
            res = tensor.detach().contiguous()
        return res


_manager: VcgaPluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> VcgaPluginManager:
    """The process-wide plugin manager (created on first use, plugins loaded on first query)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = VcgaPluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests; after changing VCGA_* plugin variables)."""
    global _manager
    with _manager_lock:
        _manager = None
