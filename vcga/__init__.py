"""VCGA: one PyTorch training script on NVIDIA (NCCL), Ascend (HCCL), Cambricon MLU (CNCL) and CPU (gloo).

Importing ``vcga`` is cheap and never imports torch; the parts that need torch load on first use.
It does make ``torch.distributed.init_process_group(backend="vcga")`` available, whether torch is
imported before or after (see :mod:`vcga._autoload`).

- :func:`vcga.init` -- set up this process from torchrun's environment and return a
  :class:`~vcga.pg.comm.Communicator`;
- :mod:`vcga.contract` -- the plugin contract (read it first);
- :mod:`vcga.errors` -- every error VCGA raises;
- :mod:`vcga.config` -- the unified configuration;
- :mod:`vcga.plugin_manager` -- plugin discovery and backend selection;
- :mod:`vcga.dtypes` -- the one dtype table;
- :mod:`vcga.process_group` -- the ``vcga`` torch.distributed backend.

Every public module is listed in :data:`vcga.contract.PUBLIC_API`; the rest is internal.
"""

from __future__ import annotations

from vcga import _autoload
from vcga._version import __version__

__all__ = ["__version__", "get_plugin_manager", "load_config", "init", "Communicator"]

_autoload.install()


def __getattr__(name: str):  # lazy re-exports keep `import vcga` light
    if name == "get_plugin_manager":
        from vcga.plugin_manager import get_plugin_manager

        return get_plugin_manager
    if name == "load_config":
        from vcga.config import load_config

        return load_config
    if name in ("init", "Communicator"):
        from vcga.pg import comm

        return getattr(comm, name)
    raise AttributeError(f"module 'vcga' has no attribute {name!r}")
