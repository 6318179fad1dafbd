"""The loaded plugins' hook implementations, with pluggy only where it is needed.

A job's ``init_process_group("vcga")`` loads one built-in plugin (its backend's) and calls its
``vcga_backends``. Importing pluggy, and registering the plugin through it, would cost every rank
of every job about 3 ms of CPU at that call. So a built-in plugin whose manifest is known
(:data:`vcga.plugin_manager.manifest.BUILTIN_MANIFESTS`, which tests/test_plugin_manifest.py
checks against what pluggy finds on each) is held here without pluggy: its implementations are the
functions its manifest names. pluggy's manager is built at the first plugin that is not such a
built-in (a third-party plugin, an in-process :meth:`~HookRegistry.register`, a hook marked with
options) or when a caller asks for :attr:`HookRegistry.pm`; it then registers the built-ins held so
far, and from then on holds every plugin, with its validation.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vcga import contract

if TYPE_CHECKING:
    import pluggy

    from vcga.plugin_manager.manifest import Manifest

__all__ = ["HookRegistry"]


class _Impl:
    """A built-in plugin's implementation of a hook, held without pluggy: the attributes of pluggy's
    ``HookImpl`` that the manager reads."""

    __slots__ = ("plugin_name", "function", "argnames")

    def __init__(self, plugin_name: str, function: Callable[..., Any], argnames: tuple[str, ...]) -> None:
        self.plugin_name, self.function, self.argnames = plugin_name, function, argnames


def _plain_impls(name: str, obj: Any, manifest: Manifest) -> dict[str, _Impl] | None:
    """A built-in plugin's implementations of the hooks its manifest names, or None where pluggy
    must register it: a hook it lacks, one that is not a plain marked function, or one marked with
    options (wrappers, call order, another spec name) that pluggy alone knows how to call."""
    out: dict[str, _Impl] = {}
    for hook in manifest.hooks:
        fn = getattr(obj, hook, None)
        opts = getattr(fn, contract.PROJECT + "_impl", None)
        if (not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__") or not isinstance(opts, dict)
                or any(opts.values())):
            return None
        # the positional parameters without a default, less an implicit self: pluggy's argnames
        code = fn.__code__
        args = code.co_varnames[:code.co_argcount]
        if fn.__defaults__:
            args = args[:-len(fn.__defaults__)]
        if args and "." in fn.__qualname__ and args[0] in ("self", "cls"):
            args = args[1:]
        out[hook] = _Impl(name, fn, tuple(args))
    return out


class HookRegistry:
    """The hook implementations of the plugins registered so far (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm: pluggy.PluginManager | None = None
        # while there is no pluggy manager: the built-ins held without it, and their implementations by hook
        self._plain: dict[str, Any] = {}
        self._plain_impls: dict[str, list[_Impl]] = {}

    @property
    def pm(self) -> pluggy.PluginManager:
        """pluggy's manager, built on first use with every plugin registered so far."""
        with self._lock:
            if self._pm is None:
                import pluggy

                pm = pluggy.PluginManager(contract.PROJECT)
                pm.add_hookspecs(contract.HookSpecs)
                for name, obj in self._plain.items():
                    pm.register(obj, name=name)
                self._plain.clear()
                self._plain_impls.clear()
                self._pm = pm
            return self._pm

    def register(self, obj: Any, name: str, builtin_manifest: Manifest | None = None) -> None:
        """Register a plugin: without pluggy where it is a built-in (``builtin_manifest`` given)
        whose hooks are plain, through pluggy otherwise.

        :raises Exception: what pluggy raises for a plugin it refuses (a name already taken, a
            hook that does not match its specification)."""
        with self._lock:
            impls = None
            if self._pm is None and builtin_manifest is not None and name not in self._plain:
                impls = _plain_impls(name, obj, builtin_manifest)
            if impls is None:
                self.pm.register(obj, name=name)
                return
            self._plain[name] = obj
            for hook, impl in impls.items():
                self._plain_impls.setdefault(hook, []).append(impl)

    def impls(self, hook_name: str) -> list[Any]:
        """The registered implementations of a hook (pluggy's ``HookImpl`` or :class:`_Impl`)."""
        with self._lock:
            if self._pm is None:
                return list(self._plain_impls.get(hook_name, ()))
            return list(getattr(self._pm.hook, hook_name).get_hookimpls())
