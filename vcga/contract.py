"""The VCGA plugin contract: every interface between the core and its plugins, in one file.

Read this file first. A plugin is a plain module (or object) with functions named after the hooks
below, decorated with :data:`hookimpl`; it is registered either as a built-in (``vcga.plugins.*``,
``vcga.formats.*``, ``vcga.conformance.*``) or through the entry-point group ``vcga``::

    # pyproject.toml of vcga-myvendor
    [project.entry-points.vcga]
    myvendor = "vcga_myvendor.plugin"

    # vcga_myvendor/plugin.py
    from vcga.contract import hookimpl, Backend
    @hookimpl
    def vcga_backends():
        return [MyVendorBackend()]

A plugin imports only the public core API, the modules listed in :data:`PUBLIC_API` (this module
first) -- never another plugin and never core internals. ``tests/test_walls.py`` holds every
built-in plugin, format and conformance module to that list.

Sections:

1. Capabilities -- collectives, reduce ops, how a capability is supported, and the
   CapabilityTable a backend returns: defined in :mod:`vcga.capabilities` (with the builder that
   derives VCGA's emulations) and re-exported here, so a plugin imports its interface from one module.
2. Accelerator -- the device interface, with pinned return types: defined in :mod:`vcga.devicespec`.
3. Backend -- one vendor stack: probe, accelerator, capabilities, native group factory, env, topology.
4. Checkpoint formats -- tensor entries, readers, writers: defined in :mod:`vcga.formatspec`.
5. Conformance checks -- what ``vcga verify`` runs: defined in :mod:`vcga.checkspec`.
6. Gradient compressors -- what ``vcga.compress`` drives on the slow hop: defined in
   :mod:`vcga.compressors`.

Sections 2 and 4 to 6 are re-exported here when first asked for (``from vcga.contract import
FormatSpec`` works as for any other name): a training job's ``init_process_group`` needs none of
them and does not pay for defining them.
7. Hook specifications -- what a plugin implements.

Nothing here imports torch at module import time: ``vcga --help`` must stay fast. torch types
appear only under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

from vcga._values import FrozenValue
from vcga.capabilities import (
    BITWISE,
    EMULATIONS,
    MOVING,
    REDUCING,
    CapabilityBuilder,
    CapabilityTable,
    Cell,
    CellKey,
    Collective,
    ReduceOp,
    Support,
    cell_name,
)

if TYPE_CHECKING:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as C10dBackend  # ProcessGroupGloo's and NCCL's base

    from vcga.checkspec import CheckResult, ConformanceCheck
    from vcga.compressors import Combine, CompressContext, Compressor, CompressorOption, CompressorSpec
    from vcga.config import Config
    from vcga.devicespec import Accelerator, EventLike, MemoryStats, StreamLike
    from vcga.formatspec import FormatReader, FormatSpec, FormatWriter, RandomAccessReader, TensorEntry

__all__ = [
    "PUBLIC_API",
    "PROJECT",
    "hookspec",
    "hookimpl",
    "Collective",
    "ReduceOp",
    "Support",
    "Cell",
    "CapabilityTable",
    "CapabilityBuilder",
    "EMULATIONS",
    "REDUCING",
    "MOVING",
    "BITWISE",
    "CellKey",
    "cell_name",
    "MemoryStats",
    "StreamLike",
    "EventLike",
    "Accelerator",
    "ProbeResult",
    "Topology",
    "Backend",
    "TensorEntry",
    "FormatReader",
    "RandomAccessReader",
    "FormatWriter",
    "FormatSpec",
    "CheckResult",
    "ConformanceCheck",
    "Combine",
    "CompressContext",
    "CompressorOption",
    "CompressorSpec",
    "Compressor",
    "HookSpecs",
]

#: The public core API: the only VCGA modules a plugin (backend, format or conformance check) may
#: import, and what a training script or tool may rely on. Everything else under ``vcga`` is
#: internal and may change. This is the one list: docs/plugins.md and docs/architecture.md point
#: here, and tests/test_walls.py enforces it on the built-in plugins (docs/architecture.md, "The walls").
PUBLIC_API: tuple[str, ...] = (
    "vcga",  # vcga.init, Communicator, get_plugin_manager, load_config, __version__
    "vcga.contract",  # this module: hook specs and every interface
    "vcga.capabilities",  # capability tables and their builder (re-exported here)
    "vcga.compressors",  # the gradient compressor interface (re-exported here)
    "vcga.formatspec",  # the checkpoint format interface (re-exported here)
    "vcga.checkspec",  # the conformance check interface (re-exported here)
    "vcga.devicespec",  # the device interface (re-exported here)
    "vcga.errors",  # every error VCGA raises
    "vcga.dtypes",  # the one dtype table
    "vcga.config",  # the unified configuration
    "vcga.plugin_manager",  # plugin discovery and backend selection
    "vcga.process_group",  # the ``vcga`` torch.distributed backend (VcgaOptions)
    "vcga.cpu",  # the host as an Accelerator
    "vcga.vendor",  # what accelerator plugins share: device-module Accelerator, probes, topology
    "vcga.pypg",  # Work/Future helpers for a backend whose native group is a Python ProcessGroup
    "vcga.spawn",  # a small local world of spawned ranks (capability measurement)
    "vcga.atomic",  # atomic writes
    "vcga.tensors",  # tensor entries from/to torch and numpy, checksums
    "vcga.formatkit",  # what format plugins share: reader/writer bases, entry buffers, metadata
    "vcga.wire",  # the tensor wire format
    "vcga.compress",  # gradient compression: spec strings, ddp_hook, the engine, the wire meter
    "vcga.compress.exact",  # fixed-order arithmetic for compressors' decoders
    "vcga.compress.fused",  # compiled host loops, used where a self-check finds the torch operations' bits
    "vcga.balance",  # balanced data parallelism: shares per rank by speed, the loss scale, re-balancing
    "vcga.testing",  # for a plugin's own tests: run_world (a local world of forked ranks), free_port
    "vcga.flight_recorder",  # dump the vcga groups' flight recorder on demand; analyze every rank's dump
    "vcga.profiling",  # Chrome traces of vcga collectives: the bridge's steps linked to their calls
)

#: pluggy project name; also the entry-point group plugins register under.
PROJECT = "vcga"

_F = TypeVar("_F", bound=Callable[..., Any])


class _HookspecMarker:
    """pluggy's ``HookspecMarker(PROJECT)``, without importing pluggy: it sets the same attribute
    (``vcga_spec``) to the same options, which is all pluggy reads when it registers the specs
    (tests/test_contract.py compares the two). A job's start imports a built-in plugin, which uses
    these markers, and need not import pluggy (about 2 ms on every rank; see
    :mod:`vcga.plugin_manager.hooks`)."""

    @overload
    def __call__(self, function: _F, firstresult: bool = ..., historic: bool = ...,
                 warn_on_impl: Warning | None = ..., warn_on_impl_args: Mapping[str, Warning] | None = ...) -> _F: ...

    @overload
    def __call__(self, function: None = ..., firstresult: bool = ..., historic: bool = ...,
                 warn_on_impl: Warning | None = ...,
                 warn_on_impl_args: Mapping[str, Warning] | None = ...) -> Callable[[_F], _F]: ...

    def __call__(self, function: _F | None = None, firstresult: bool = False, historic: bool = False,
                 warn_on_impl: Warning | None = None,
                 warn_on_impl_args: Mapping[str, Warning] | None = None) -> _F | Callable[[_F], _F]:
        if historic and firstresult:
            raise ValueError("cannot have a historic firstresult hook")
        opts = {"firstresult": firstresult, "historic": historic, "warn_on_impl": warn_on_impl,
                "warn_on_impl_args": warn_on_impl_args}

        def mark(func: _F) -> _F:
            setattr(func, PROJECT + "_spec", dict(opts))
            return func

        return mark if function is None else mark(function)


class _HookimplMarker:
    """pluggy's ``HookimplMarker(PROJECT)``, without importing pluggy (see :class:`_HookspecMarker`):
    it sets ``vcga_impl`` to the options pluggy's marker sets."""

    @overload
    def __call__(self, function: _F, hookwrapper: bool = ..., optionalhook: bool = ..., tryfirst: bool = ...,
                 trylast: bool = ..., specname: str | None = ..., wrapper: bool = ...) -> _F: ...

    @overload
    def __call__(self, function: None = ..., hookwrapper: bool = ..., optionalhook: bool = ...,
                 tryfirst: bool = ..., trylast: bool = ..., specname: str | None = ...,
                 wrapper: bool = ...) -> Callable[[_F], _F]: ...

    def __call__(self, function: _F | None = None, hookwrapper: bool = False, optionalhook: bool = False,
                 tryfirst: bool = False, trylast: bool = False, specname: str | None = None,
                 wrapper: bool = False) -> _F | Callable[[_F], _F]:
        opts = {"wrapper": wrapper, "hookwrapper": hookwrapper, "optionalhook": optionalhook, "tryfirst": tryfirst,
                "trylast": trylast, "specname": specname}

        def mark(func: _F) -> _F:
            setattr(func, PROJECT + "_impl", dict(opts))
            return func

        return mark if function is None else mark(function)


hookspec = _HookspecMarker()
hookimpl = _HookimplMarker()

# 1. Capabilities: vcga/capabilities.py (imported above).


# ===================================================================================================
# 2. Accelerator -- the device interface: vcga/devicespec.py, re-exported here on first use (below)
# ===================================================================================================


# ===================================================================================================
# 3. Backend -- one vendor stack
# ===================================================================================================


class ProbeResult(FrozenValue):
    """Whether a backend can run here, and why not.

    :param available: True when the backend can create a process group on this machine now.
    :param reason: one line; when unavailable, exactly why (module missing and the import error,
        zero devices, driver error); when available, a short description.
    :param device_count: devices the backend sees (0 when unavailable).
    :param versions: library versions found, e.g. ``{"torch": "2.13.0", "nccl": "2.27.5"}``.
    """

    __slots__ = ("available", "reason", "device_count", "versions")
    available: bool
    reason: str
    device_count: int
    versions: Mapping[str, str]

    def __init__(self, available: bool, reason: str, device_count: int = 0,
                 versions: Mapping[str, str] | None = None) -> None:
        object.__setattr__(self, "available", available)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "device_count", device_count)
        object.__setattr__(self, "versions", {} if versions is None else versions)


class Topology(FrozenValue):
    """What a backend knows of the links between its devices on this node.

    :param source: how it was found ("nvidia-smi topo -m", "npu-smi", "cnmon", "unknown").
    :param device_count: devices on this node.
    :param matrix: ``matrix[i][j]`` is the link type between devices i and j (e.g. "NV18", "PIX",
        "SYS", "X" on the diagonal), or None when unknown.
    :param detail: raw text or the reason the topology is unknown.
    """

    __slots__ = ("source", "device_count", "matrix", "detail")
    source: str
    device_count: int
    matrix: Sequence[Sequence[str]] | None
    detail: str

    def __init__(self, source: str, device_count: int = 0, matrix: Sequence[Sequence[str]] | None = None,
                 detail: str = "") -> None:
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "device_count", device_count)
        object.__setattr__(self, "matrix", matrix)
        object.__setattr__(self, "detail", detail)

    @classmethod
    def unknown(cls, detail: str = "") -> Topology:
        return cls(source="unknown", detail=detail)


class Backend(abc.ABC):
    """One vendor stack: its device, its collective library and what that library can do.

    Subclass this in a plugin and return instances from :meth:`HookSpecs.vcga_backends`.
    Constructing a Backend must be cheap and must not import the vendor module; do that in
    :meth:`probe` and later calls.
    """

    #: Unique name users select, e.g. "nccl", "hccl", "mlu", "gloo", "sim-hccl".
    name: str
    #: Who makes the device: "nvidia", "huawei", "cambricon", "cpu".
    vendor: str
    #: torch device type: "cuda", "npu", "mlu", "cpu".
    device_type: str
    #: The torch.distributed backend it drives: "nccl", "hccl", "cncl", "gloo".
    dist_backend: str
    #: Automatic selection picks the available backend with the highest priority.
    priority: int = 0
    #: True for stand-ins (simulated vendors) that automatic selection must never pick.
    simulated: bool = False
    #: Top-level modules this backend cannot run without (``("torch_npu",)``). Automatic selection
    #: counts the backend unavailable where one is not installed without importing its plugin
    #: (docs/plugins.md, "What is imported when"); :meth:`probe` still decides where they are.
    requires: tuple[str, ...] = ()

    @abc.abstractmethod
    def probe(self) -> ProbeResult:
        """Say whether this backend can run here, and why not. Must not raise for "unavailable"."""

    @abc.abstractmethod
    def accelerator(self) -> Accelerator:
        """The device interface. Called only when :meth:`probe` said available."""

    @abc.abstractmethod
    def capabilities(self) -> CapabilityTable:
        """What the native library does with each (collective, dtype, op)."""

    @abc.abstractmethod
    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup | C10dBackend:
        """Create the vendor's native process group over ``store``.

        :param store: a store private to this group (callers prefix it).
        :param rank: this process's rank in the group.
        :param world_size: the group size.
        :param timeout: the collective timeout to configure natively.
        :returns: a ``torch.distributed.ProcessGroup`` (or ``Backend``) driving the vendor library.
        :raises vcga.errors.VcgaBackendUnavailable: when the native group cannot be created.
        """

    def vendor_env(self, config: Config) -> dict[str, str]:
        """Translate the unified config into this vendor's environment variables.

        Returns only the variables to set; the caller applies them before the vendor library
        initialises. Values the user already set in the environment are not overridden by callers.
        """
        return {}

    def topology(self) -> Topology:
        """Probe device links on this node; return :meth:`Topology.unknown` when it cannot tell."""
        return Topology.unknown("this backend does not probe topology")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vendor": self.vendor, "device_type": self.device_type,
                "dist_backend": self.dist_backend, "priority": self.priority, "simulated": self.simulated}


# 2. Accelerator: vcga/devicespec.py, 4. Checkpoint formats: vcga/formatspec.py, and 5. Conformance
#    checks: vcga/checkspec.py -- like 6. Gradient compressors: vcga/compressors.py -- re-exported here
#    on first use: a process that never asks a backend for its device, converts, checks or compresses
#    (a training job's ``init_process_group``) does not define them.

_SECTIONS = {
    "vcga.devicespec": ("MemoryStats", "StreamLike", "EventLike", "Accelerator"),
    "vcga.formatspec": ("TensorEntry", "FormatReader", "RandomAccessReader", "FormatWriter", "FormatSpec"),
    "vcga.checkspec": ("CheckResult", "ConformanceCheck"),
    "vcga.compressors": ("Combine", "CompressContext", "Compressor", "CompressorOption", "CompressorSpec"),
}
_LAZY = {name: module for module, names in _SECTIONS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vcga.contract' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# ===================================================================================================
# 7. Hook specifications
# ===================================================================================================


class HookSpecs:
    """The hooks a plugin may implement. Every hook is optional.

    pluggy never calls a specification's body, so the ones that return a sequence have none
    (``type: ignore[empty-body]``)."""

    @hookspec
    def vcga_backends(self) -> Sequence[Backend]:  # type: ignore[empty-body]
        """Return the backends this plugin contributes.

        Called once when the plugin manager loads plugins. Return cheap objects: probing happens
        later, and a backend whose probe raises is reported, not fatal.
        """

    @hookspec(firstresult=True)
    def vcga_rank_backend(self, rank: int, world_size: int, config: Config) -> str | None:
        """Choose the backend for one rank of a job, or return None to leave it to the default.

        Used by simulated vendor sets (``VCGA_SIM_VENDORS=nccl:2,hccl:2``) to give ranks different
        backends. An explicit ``backend`` in the config always wins over this hook.
        """

    @hookspec(firstresult=True)
    def vcga_tensor_to_host(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Bring a device tensor to the host in the neutral layout, or return None if not yours.

        The result is a CPU tensor, contiguous, C order, in the same dtype and with the same values
        -- vendor-private layouts (Ascend's NZ/5HD formats) converted to ND first. Implemented by
        the plugin that owns ``tensor.device.type``; the wire format and every checkpoint writer
        call it before a tensor crosses vendors or goes to disk.
        """

    @hookspec
    def vcga_formats(self) -> Sequence[FormatSpec]:  # type: ignore[empty-body]
        """Return the checkpoint formats this plugin contributes."""

    @hookspec
    def vcga_conformance_checks(self) -> Sequence[ConformanceCheck]:  # type: ignore[empty-body]
        """Return extra conformance checks for ``vcga verify`` (a vendor's own, for example)."""

    @hookspec
    def vcga_compressors(self) -> Sequence[CompressorSpec]:  # type: ignore[empty-body]
        """Return the gradient compressors this plugin contributes (see :class:`Compressor`)."""
