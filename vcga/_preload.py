"""Imported once by the forkserver that starts rank processes (:func:`vcga.spawn.get_context`):
torch, and nothing that a forked child could not inherit.

- Device extensions stay out (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` during the import): torch_npu and
  torch_mlu may open their runtime, which a forked child must not inherit. Nothing here touches
  ``torch.cuda``; torch itself initialises no device and starts no thread at import.
- VCGA's own ``torch.backends`` hook is taken out too (``import vcga`` installed it just before):
  each child runs the entry points under its own environment (``vcga.spawn._like_a_spawned_child``).

- The parent's ``sys.path`` is taken first (:data:`vcga.spawn.SERVER_SYS_PATH_ENV`), so the modules
  preloaded after this one are found where the parent finds them.

The forkserver dies on any exception other than ImportError from a preloaded module, and then no
rank can start: so nothing here raises. Without torch the children import it themselves.
"""

from __future__ import annotations

import os
import sys

from vcga import _autoload

_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def _take_sys_path() -> None:
    """The parent's ``sys.path`` (:data:`vcga.spawn.SERVER_SYS_PATH_ENV`), for the modules preloaded
    after this one; the variable is removed (each rank gets its parent's environment anyway)."""
    import json

    paths = os.environ.pop("VCGA_SPAWN_SERVER_SYS_PATH", None)
    if paths is None:
        return
    try:
        given = json.loads(paths)
    except ValueError:
        return
    if isinstance(given, list) and all(isinstance(p, str) for p in given):
        sys.path[:] = given


def _preload() -> None:
    _take_sys_path()
    _autoload.uninstall()
    before = os.environ.get(_AUTOLOAD)
    os.environ[_AUTOLOAD] = "0"
    try:
        import torch  # noqa: F401
    except BaseException:  # noqa: BLE001 - leave no half-imported torch for the children to trip on
        for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
            del sys.modules[name]
    finally:
        if before is None:
            del os.environ[_AUTOLOAD]
        else:
            os.environ[_AUTOLOAD] = before


_preload()
