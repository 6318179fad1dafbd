"""Finds, loads and isolates plugins; selects a backend.

Built-in plugins are module names loaded by the same code as third-party ones (pytest's pattern);
third-party plugins come from the entry-point group ``vcga``. Loading is lazy -- nothing is
imported until a caller asks for backends, formats or checks -- and isolated: a plugin that fails
to import, whose hook raises, or whose backend's probe raises is recorded with its error and
traceback, shown by ``vcga info``, and never breaks an unrelated call. Third-party plugins (entry
points and ``VCGA_PLUGINS``) are first imported in a child process (:mod:`vcga.plugin_manager.vetting`), so one
whose import ends or crashes the interpreter is recorded instead of taking VCGA down with it.

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

import functools
import importlib
import importlib.metadata
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from vcga import contract
from vcga.config import Config, load_config
from vcga.contract import Backend, CompressorSpec, ConformanceCheck, FormatSpec, ProbeResult
from vcga.errors import VcgaBackendNotFound, VcgaBackendUnavailable, VcgaConfigError, VcgaError, VcgaPluginError
from vcga.plugin_manager import vetting

__all__ = [
    "BUILTIN_PLUGINS",
    "PluginRecord",
    "BackendRecord",
    "VcgaPluginManager",
    "get_plugin_manager",
    "reset_plugin_manager",
]

log = logging.getLogger(__name__)

#: Built-in plugins, loaded by module name exactly like third-party ones.
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


@dataclass
class PluginRecord:
    """One plugin the manager tried to load."""

    name: str  #: entry-point name or module name
    source: str  #: "builtin", "entry point (dist 1.2.3)" or "VCGA_PLUGINS"
    module: str  #: the module path (entry-point value)
    status: str = "pending"  #: "loaded", "failed", "blocked"
    error: str | None = None  #: one line
    traceback: str | None = None
    hook_errors: dict[str, str] = field(default_factory=dict)  #: hook name -> error line
    #: what importing it in a child did (:class:`vcga.plugin_manager.vetting.Verdict` as JSON); None when not vetted
    vetting: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "module": self.module, "status": self.status,
                "error": self.error, "hook_errors": dict(self.hook_errors), "vetting": self.vetting}


@dataclass
class BackendRecord:
    """A backend and its (cached) probe."""

    backend: Backend
    plugin: str
    _probe: ProbeResult | None = None
    probe_traceback: str | None = None

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


class VcgaPluginManager:
    """The registry of plugins, backends, formats and conformance checks."""

    def __init__(self, builtins: Sequence[str] = BUILTIN_PLUGINS, env: dict[str, str] | None = None) -> None:
        self._env = dict(os.environ) if env is None else env
        self._builtins = tuple(builtins)
        self.pm = pluggy.PluginManager(contract.PROJECT)
        self.pm.add_hookspecs(contract.HookSpecs)
        self._records: dict[str, PluginRecord] = {}
        self._loaded = False
        self._lock = threading.RLock()
        self._backends: dict[str, BackendRecord] | None = None

    # -- loading ---------------------------------------------------------------------------------

    @property
    def autoload_disabled(self) -> bool:
        return self._env.get("VCGA_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in _TRUE

    def _blocked(self) -> set[str]:
        return {s.strip() for s in self._env.get("VCGA_BLOCK_PLUGINS", "").split(",") if s.strip()}

    def load(self) -> None:
        """Load every plugin once (idempotent, thread-safe). Failures are recorded, never raised."""
        with self._lock:
            if self._loaded:
                return
            timeout_s = self._vet_timeout()  # a bad value raises before anything is marked loaded
            self._loaded = True
            blocked = self._blocked()
            for mod in self._builtins:  # ours: imported directly, never vetted
                self._load_one(mod, mod, "builtin", functools.partial(importlib.import_module, mod), blocked)
            third: list[tuple[str, str, str, Callable[[], Any], Any]] = []
            extra = [s.strip() for s in self._env.get("VCGA_PLUGINS", "").split(",") if s.strip()]
            for mod in extra:
                third.append((mod, mod, "VCGA_PLUGINS", functools.partial(importlib.import_module, mod), None))
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
                else:
                    self._load_one(name, module, src, loader, blocked)
                    if verdict is not None:
                        self._records[name].vetting = verdict.to_json()

    def _vet_timeout(self) -> float:
        raw = self._env.get("VCGA_PLUGIN_VET_TIMEOUT", "").strip()
        if not raw:
            return vetting.DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise VcgaConfigError("plugin vetting timeout", raw, "a number of seconds > 0",
                                  "env VCGA_PLUGIN_VET_TIMEOUT")
        return value

    def _vet(self, third: list[tuple[str, str, str, Callable[[], Any], Any]], blocked: set[str],
             timeout_s: float) -> dict[str, Any]:
        """Vet, in child processes, the third-party plugins this process is about to import."""
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
        log.warning("plugin %s (%s) not loaded: %s", name, source, rec.error)

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        try:
            eps = importlib.metadata.entry_points(group=contract.PROJECT)
        except Exception as e:  # noqa: BLE001 - a broken distribution's metadata must not stop vcga
            log.warning("cannot read entry points: %r", e)
            return []
        seen: set[str] = set()
        out = []
        for ep in eps:  # the same distribution can appear twice on sys.path; keep the first
            if ep.name not in seen:
                seen.add(ep.name)
                out.append(ep)
        return out

    def _load_one(self, name: str, module: str, source: str, loader: Callable[[], Any], blocked: set[str]) -> None:
        if name in self._records:
            return
        rec = PluginRecord(name=name, source=source, module=module)
        self._records[name] = rec
        if name in blocked or module in blocked:
            rec.status = "blocked"
            return
        try:
            plugin = loader()
            self.pm.register(plugin, name=name)
            rec.status = "loaded"
        except (Exception, SystemExit) as e:  # noqa: BLE001 - ImportError, SyntaxError, pluggy validation, anything the
            # plugin raises; and sys.exit() at import, never a request to end the caller's program
            rec.status = "failed"
            rec.error = _err_line(e)
            rec.traceback = traceback.format_exc()
            log.warning("plugin %s (%s) failed to load: %s", name, source, rec.error)

    def register(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, embedding applications)."""
        with self._lock:
            self.load()
            rec = PluginRecord(name=name, source="registered", module=getattr(plugin, "__name__", repr(plugin)))
            try:
                self.pm.register(plugin, name=name)
                rec.status = "loaded"
            except Exception as e:
                rec.status, rec.error, rec.traceback = "failed", _err_line(e), traceback.format_exc()
                raise VcgaPluginError(name, rec.error) from e
            finally:
                self._records[name] = rec
            self._backends = None

    def plugins(self) -> list[PluginRecord]:
        self.load()
        return list(self._records.values())

    # -- isolated hook calls ---------------------------------------------------------------------

    def _collect(self, hook_name: str) -> list[tuple[str, Any]]:
        """Call a list-returning hook on every plugin separately; a raising plugin is recorded."""
        self.load()
        hook = getattr(self.pm.hook, hook_name)
        out: list[tuple[str, Any]] = []
        for impl in hook.get_hookimpls():
            pname = self.pm.get_name(impl.plugin) or repr(impl.plugin)
            try:
                items = impl.function()
                for item in items or ():
                    out.append((pname, item))
            except Exception as e:  # noqa: BLE001 - isolation: recorded against the plugin
                rec = self._records.get(pname)
                if rec is not None:
                    rec.hook_errors[hook_name] = _err_line(e)
                log.warning("plugin %s: %s raised %r", pname, hook_name, e)
        return out  # registration order: built-ins first, then entry points

    def call_first(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a firstresult hook, isolating each implementation's failure."""
        self.load()
        hook = getattr(self.pm.hook, hook_name)
        for impl in hook.get_hookimpls()[::-1]:  # pluggy's order: last registered first
            pname = self.pm.get_name(impl.plugin) or repr(impl.plugin)
            try:
                res = impl.function(*[kwargs[a] for a in impl.argnames])
            except VcgaError:
                raise  # a deliberate, typed error (bad config) is the answer, not a plugin failure
            except Exception as e:  # noqa: BLE001 - isolation: recorded against the plugin, the next one answers
                rec = self._records.get(pname)
                if rec is not None:
                    rec.hook_errors[hook_name] = _err_line(e)
                log.warning("plugin %s: %s raised %r", pname, hook_name, e)
                continue
            if res is not None:
                return res
        return None

    # -- backends --------------------------------------------------------------------------------

    def backend_records(self) -> list[BackendRecord]:
        with self._lock:
            if self._backends is None:
                found: dict[str, BackendRecord] = {}
                for pname, b in self._collect("vcga_backends"):
                    if not isinstance(b, Backend):
                        rec = self._records.get(pname)
                        if rec is not None:
                            rec.hook_errors["vcga_backends"] = (
                                f"returned {type(b).__name__}, which is not a vcga.contract.Backend")
                        continue
                    if b.name in found:
                        rec = self._records.get(pname)
                        if rec is not None:
                            rec.hook_errors["vcga_backends"] = (
                                f"backend name {b.name!r} already registered by plugin {found[b.name].plugin!r}")
                        continue
                    found[b.name] = BackendRecord(backend=b, plugin=pname)
                self._backends = found
            return list(self._backends.values())

    def backend(self, name: str) -> Backend:
        """The backend called ``name`` (probe not checked)."""
        for rec in self.backend_records():
            if rec.name == name:
                return rec.backend
        raise VcgaBackendNotFound(name, [r.name for r in self.backend_records()])

    def backend_record(self, name: str) -> BackendRecord:
        for rec in self.backend_records():
            if rec.name == name:
                return rec
        raise VcgaBackendNotFound(name, [r.name for r in self.backend_records()])

    def select_backend(self, config: Config | None = None, *, rank: int = 0, world_size: int = 1) -> Backend:
        """Choose this rank's backend and check it can run.

        Order: an explicit ``config.backend`` (``VCGA_BACKEND``); then a plugin's
        ``vcga_rank_backend`` answer (simulated vendor sets); then the available, non-simulated
        backend with the highest priority.

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
        candidates = [r for r in self.backend_records() if not r.backend.simulated]
        candidates.sort(key=lambda r: -r.backend.priority)
        reasons = []
        for rec in candidates:
            probe = rec.probe()
            if probe.available:
                return rec.backend
            reasons.append(f"{rec.name}: {probe.reason}")
        raise VcgaBackendUnavailable("auto", "no backend is available here; " + "; ".join(reasons))

    # -- formats and checks ----------------------------------------------------------------------

    def formats(self) -> list[FormatSpec]:
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
