"""Registers the ``vcga`` torch.distributed backend without importing torch.

Two ways in, both calling :func:`install`:

- ``import vcga`` (its ``__init__`` calls :func:`install`);
- torch's own plugin autoload: ``import torch`` calls every entry point in the group
  ``torch.backends``; ours is :func:`torch_autoload`. So ``init_process_group(backend="vcga")``
  works even in a script that never imports vcga.

:func:`install` registers at once when ``torch.distributed.distributed_c10d`` is already loaded,
and otherwise puts a finder on ``sys.meta_path`` that registers right after that module executes.
Registration itself touches only ``distributed_c10d.Backend.register_backend`` and hands it
:func:`_create` -- the real creator (``vcga.process_group``) is imported on first use, when torch
is fully initialised.

A failing ``torch.backends`` plugin makes ``import torch`` raise, so nothing here may raise: this
module imports only the standard library, and every step is wrapped and logged instead.
``VCGA_TORCH_AUTOLOAD=0`` turns both ways off (``torch.distributed.Backend.register_backend`` by
hand, or :func:`vcga.process_group.register`, still work).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Any

log = logging.getLogger("vcga")

_C10D = "torch.distributed.distributed_c10d"
_DEVICES = ["cpu", "cuda", "npu", "mlu"]  # kept equal to vcga.process_group.DEVICES (a test checks)
_installed = False


def _create(*args: Any, **kwargs: Any) -> Any:
    """The creator registered with torch; defers to :func:`vcga.process_group.create_process_group`.

    Python's cyclic collector is paused while the group's modules are imported too, not only while
    the group is created (``vcga.process_group._collection_deferred`` says why): importing them
    allocates tens of thousands of objects in a process that holds torch's 170,000, enough for
    several collections -- a full one, now and then, that costs a rank tens of milliseconds while
    every other rank waits. Deferred, the young objects are scanned once, after creation."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        from vcga.process_group import create_process_group

        return create_process_group(*args, **kwargs)
    finally:
        if was:
            gc.enable()


def _register(c10d: Any) -> None:
    try:
        backend_cls = c10d.Backend
        if "VCGA" in getattr(backend_cls, "_plugins", {}):
            return
        backend_cls.register_backend("vcga", _create, extended_api=True, devices=list(_DEVICES))
    except Exception as e:  # noqa: BLE001 - must never break `import torch`
        log.warning("vcga: could not register the torch.distributed backend 'vcga': %r", e)


class _Loader(importlib.abc.Loader):
    """Wraps distributed_c10d's loader: execute the module, then register."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _register(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds distributed_c10d through the other finders and wraps its loader (once)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _C10D:
            return None
        try:
            _remove_finder()
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is None or spec.loader is None:
                return None
            spec.loader = _Loader(spec.loader)
            return spec
        except Exception as e:  # noqa: BLE001
            log.warning("vcga: import hook failed, register 'vcga' by importing vcga after torch: %r", e)
            return None


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def install() -> None:
    """Make ``backend="vcga"`` available (idempotent; never raises, never imports torch)."""
    global _installed
    try:
        if os.environ.get("VCGA_TORCH_AUTOLOAD", "1").strip().lower() in ("0", "false", "no", "off"):
            return
        c10d = sys.modules.get(_C10D)
        if c10d is not None and hasattr(c10d, "Backend"):
            _register(c10d)
            _installed = True
            return
        if not _installed:
            sys.meta_path.insert(0, _Finder())
            _installed = True
    except Exception as e:  # noqa: BLE001
        log.warning("vcga: could not install the torch.distributed hook: %r", e)


def uninstall() -> None:
    """Take the import hook out again (a registration already made stays): the forkserver of
    :mod:`vcga.spawn` imports torch without it, and its children call :func:`install`."""
    global _installed
    _remove_finder()
    _installed = False


def torch_autoload() -> None:
    """Entry point in the group ``torch.backends``, called by ``import torch``. Never raises."""
    try:
        install()
    except BaseException:  # noqa: BLE001 - a raising torch.backends plugin breaks `import torch`
        pass
