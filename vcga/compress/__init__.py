"""Gradient compression on the slow hop, for any backend (docs/compression.md).

Public API (a plugin and ``vcga verify`` use only these):

- :func:`ddp_hook` -- ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``;
- :func:`parse_spec` / :class:`CompressionSpec` -- the spec string ``name[:key=value,...]``;
- :class:`Reducer`, :class:`Exchange`, :class:`Topology`, :func:`create_compressor` -- the engine
  behind the hook (checks drive it directly);
- :class:`ErrorFeedback` -- exact error-feedback bookkeeping;
- :class:`WireMeter`, :func:`sent_bytes` -- bytes counted at the transport;
- :mod:`vcga.compress.exact` -- fixed-order arithmetic for decoders;
- :func:`vcga.compress.fused.checked` -- compiled host loops, used only where a self-check finds
  them giving the torch operations' bits (QSGD's host path uses it);
- :func:`compressors` -- the registered compressors.

Importing this package imports neither torch nor any of its modules; its members load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vcga.compress.spec import DRIVER_KEYS, CompressionSpec, configured_spec, parse_spec

__all__ = ["CompressionSpec", "DRIVER_KEYS", "parse_spec", "configured_spec", "compressors", "ddp_hook",
           "CompressionState", "Reducer", "Exchange", "Topology", "Layout", "create_compressor", "ErrorFeedback",
           "WireMeter", "sent_bytes", "LinkCost", "CompressCost"]

# Loaded on first use: vcga.config imports this package (for vcga.compress.syntax) in every process.
_LAZY = {
    "CompressionSpec": "vcga.compress.spec", "DRIVER_KEYS": "vcga.compress.spec",
    "parse_spec": "vcga.compress.spec", "configured_spec": "vcga.compress.spec",
    "ddp_hook": "vcga.compress.hook", "CompressionState": "vcga.compress.hook",
    "Reducer": "vcga.compress.engine", "Exchange": "vcga.compress.exchange", "Topology": "vcga.compress.topology",
    "create_compressor": "vcga.compress.engine", "sent_bytes": "vcga.compress.meter",
    "Layout": "vcga.compress.layout",
    "ErrorFeedback": "vcga.compress.ef", "WireMeter": "vcga.compress.meter",
    "LinkCost": "vcga.compress.cost", "CompressCost": "vcga.compress.cost",
}


def compressors() -> dict[str, Any]:
    """Compressor name -> :class:`~vcga.contract.CompressorSpec`, every plugin's (built-ins first)."""
    from vcga.plugin_manager import get_plugin_manager

    return {spec.name: spec for _, spec in get_plugin_manager().compressors()}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'vcga.compress' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
