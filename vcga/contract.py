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

A plugin imports only this module, :mod:`vcga.errors`, :mod:`vcga.dtypes` and :mod:`vcga.config`
(the public core API) -- never another plugin and never core internals.

Sections:

1. Vocabulary -- collectives, reduce ops, how a capability is supported.
2. CapabilityTable -- what a backend's native library does with each (collective, dtype, op).
3. Accelerator -- the device interface, with pinned return types.
4. Backend -- one vendor stack: probe, accelerator, capabilities, native group factory, env, topology.
5. Checkpoint formats -- tensor entries, readers, writers.
6. Conformance checks -- what ``vcga verify`` runs.
7. Hook specifications -- what a plugin implements.

Nothing here imports torch at module import time: ``vcga --help`` must stay fast. torch types
appear only under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

from vcga import dtypes as _dtypes

if TYPE_CHECKING:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from vcga.config import Config

__all__ = [
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
    "MemoryStats",
    "StreamLike",
    "EventLike",
    "Accelerator",
    "ProbeResult",
    "Topology",
    "Backend",
    "TensorEntry",
    "FormatReader",
    "FormatWriter",
    "FormatSpec",
    "CheckResult",
    "ConformanceCheck",
    "HookSpecs",
]

#: pluggy project name; also the entry-point group plugins register under.
PROJECT = "vcga"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ===================================================================================================
# 1. Vocabulary
# ===================================================================================================


class Collective(str, enum.Enum):
    """Collective families. Variants (``_into_tensor``, ``_coalesced``, ``_base``) share a row.

    Barrier has no dtype and is not in capability tables: every backend must support it."""

    ALL_REDUCE = "all_reduce"
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    GATHER = "gather"
    SCATTER = "scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"

    @property
    def reduces(self) -> bool:
        """True for collectives that take a reduce op."""
        return self in _REDUCING

    def __str__(self) -> str:
        return self.value


_REDUCING = frozenset({Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER})
#: Collectives that combine values with a reduce op.
REDUCING: tuple[Collective, ...] = (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)
#: Collectives that only move bytes (dtype matters only for the library's type check).
MOVING: tuple[Collective, ...] = (
    Collective.ALL_GATHER,
    Collective.GATHER,
    Collective.SCATTER,
    Collective.BROADCAST,
    Collective.ALL_TO_ALL,
    Collective.SEND_RECV,
)


class ReduceOp(str, enum.Enum):
    """Reduce ops, named as in ``torch.distributed.ReduceOp``."""

    SUM = "SUM"
    AVG = "AVG"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    BAND = "BAND"
    BOR = "BOR"
    BXOR = "BXOR"
    PREMUL_SUM = "PREMUL_SUM"

    def __str__(self) -> str:
        return self.value


BITWISE: tuple[ReduceOp, ...] = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


class Support(str, enum.Enum):
    """How VCGA runs one (collective, dtype, op) on a backend."""

    NATIVE = "native"  #: the vendor library does it, exactly as torch.distributed specifies
    EMULATED = "emulated"  #: VCGA composes it from native calls (see :data:`EMULATIONS`)
    REFUSED = "refused"  #: a typed :class:`~vcga.errors.VcgaUnsupportedError`, before any rank starts

    def __str__(self) -> str:
        return self.value


#: The emulation recipes a :class:`Cell` may name in ``via``. The dispatcher implements each one;
#: a table naming anything else is rejected when it is built. ``<dtype>`` is a canonical dtype name.
EMULATIONS: Mapping[str, str] = {
    "sum_then_divide": "AVG as SUM followed by division by the group size (floating dtypes)",
    "mul_then_sum": "PREMUL_SUM as a local multiply by the factor followed by SUM",
    "bool_as_max": "bool SUM/BOR as MAX (logical or), exact",
    "bool_as_min": "bool PRODUCT/BAND as MIN (logical and), exact",
    "upcast:<dtype>": "cast to a wider dtype the library has, run natively, cast back (integers: exact, "
    "wrap-around included; low-precision floats: one rounding at the end instead of one per step)",
    "bitcast:<dtype>": "move the same bytes viewed as a dtype whose width divides this one (data movement only)",
    "as_real": "complex viewed as pairs of its real dtype (SUM, AVG, PREMUL_SUM and data movement)",
    "gather_then_reduce": "all-gather the raw bytes, reduce locally in rank order in the dtype itself",
}


def _check_via(via: str) -> None:
    base, _, arg = via.partition(":")
    key = f"{base}:<dtype>" if arg else base
    if key not in EMULATIONS:
        raise ValueError(f"unknown emulation {via!r}; known: {', '.join(EMULATIONS)}")
    if arg:
        _dtypes.get(arg)


@dataclass(frozen=True)
class Cell:
    """One capability cell.

    :param support: native, emulated or refused.
    :param via: for emulated cells, the recipe (a key of :data:`EMULATIONS`).
    :param note: where the fact comes from (file, doc, measurement) and, for refused cells,
        what the user can do instead. Shown verbatim in errors and ``vcga info``.
    """

    support: Support
    via: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.support is Support.EMULATED:
            if not self.via:
                raise ValueError("an emulated cell must name its recipe in `via`")
            _check_via(self.via)


# ===================================================================================================
# 2. CapabilityTable
# ===================================================================================================

CellKey = tuple[Collective, str, "ReduceOp | None"]


class CapabilityTable:
    """What a backend does with each (collective, dtype, reduce op), queried *before* each call.

    Keys are ``(Collective, canonical dtype name, ReduceOp or None)``; the op is ``None`` for
    collectives that do not reduce. A missing cell is refused. Build one with :meth:`builder`.
    """

    __slots__ = ("backend", "_cells", "_default")

    def __init__(self, backend: str, cells: Mapping[CellKey, Cell], default: Cell | None = None) -> None:
        self.backend = backend
        self._cells: dict[CellKey, Cell] = dict(cells)
        self._default = default or Cell(Support.REFUSED, note=f"{backend} does not support this combination")

    @staticmethod
    def builder(backend: str) -> CapabilityBuilder:
        return CapabilityBuilder(backend)

    def lookup(self, collective: Collective | str, dtype: str, op: ReduceOp | str | None = None) -> Cell:
        """The cell for one call. ``dtype`` is a canonical name (see :mod:`vcga.dtypes`)."""
        coll = Collective(collective)
        rop = ReduceOp(op) if (op is not None and coll.reduces) else None
        return self._cells.get((coll, dtype, rop), self._default)

    def cells(self) -> Mapping[CellKey, Cell]:
        """Every explicit cell (the refused default is not listed)."""
        return dict(self._cells)

    def support_of(self, collective: Collective | str, dtype: str, op: ReduceOp | str | None = None) -> Support:
        return self.lookup(collective, dtype, op).support

    def summary(self) -> dict[str, Any]:
        """Counts per support kind plus the dtypes with any native reduction, for ``vcga info``."""
        counts = {s.value: 0 for s in Support}
        for coll in Collective:
            for dt in _dtypes.ALL:
                ops: Iterable[ReduceOp | None] = ReduceOp if coll.reduces else (None,)
                for op in ops:
                    counts[self.lookup(coll, dt, op).support.value] += 1
        native_reduce = sorted(
            {dt for (c, dt, op), cell in self._cells.items() if c is Collective.ALL_REDUCE and cell.support is Support.NATIVE},
            key=_dtypes.ALL.index,
        )
        native_ops = sorted(
            {op.value for (c, dt, op), cell in self._cells.items()
             if c is Collective.ALL_REDUCE and cell.support is Support.NATIVE and op is not None},
            key=[o.value for o in ReduceOp].index,
        )
        return {"cells": counts, "all_reduce_native_dtypes": native_reduce, "all_reduce_native_ops": native_ops}

    def to_json(self) -> list[dict[str, Any]]:
        """Every explicit cell as a JSON-ready row."""
        return [
            {"collective": c.value, "dtype": dt, "op": op.value if op else None,
             "support": cell.support.value, "via": cell.via, "note": cell.note}
            for (c, dt, op), cell in self._cells.items()
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CapabilityTable):
            return NotImplemented
        keys = set(self._cells) | set(other._cells)
        return all(
            (self.lookup(*k).support, self.lookup(*k).via) == (other.lookup(*k).support, other.lookup(*k).via)
            for k in keys
        )

    __hash__ = None  # type: ignore[assignment]

    def diff(self, other: CapabilityTable) -> list[str]:
        """Human-readable differences in (support, via) between two tables; empty when they agree."""
        out = []
        for k in sorted(set(self._cells) | set(other._cells), key=str):
            a, b = self.lookup(*k), other.lookup(*k)
            if (a.support, a.via) != (b.support, b.via):
                c, dt, op = k
                out.append(f"{c.value}/{dt}/{op.value if op else '-'}: {self.backend}={a.support.value}"
                           f"{'(' + a.via + ')' if a.via else ''} vs {other.backend}={b.support.value}"
                           f"{'(' + b.via + ')' if b.via else ''}")
        return out


class CapabilityBuilder:
    """Fluent construction of a :class:`CapabilityTable`; a later statement overrides an earlier one.

    State what the native library does (:meth:`native`), what must stay refused (:meth:`refuse`)
    and any special emulation (:meth:`emulate`); :meth:`build` then derives VCGA's standard
    emulations for every other cell (see :meth:`build`)::

        table = (CapabilityTable.builder("hccl")
                 .native(MOVING, dtypes=["int8", "float32"], note="ProcessGroupHCCL.cpp: getHcclDataType")
                 .native(REDUCING, dtypes=["float32"], ops=["SUM", "MIN", "MAX", "PRODUCT"])
                 .refuse(REDUCING, dtypes=dtypes.ALL, ops=BITWISE, note="HCCL has no bitwise ops")
                 .build())
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._cells: dict[CellKey, Cell] = {}
        self._final: set[CellKey] = set()

    def _keys(self, collectives: Iterable[Collective | str], dtypes: Iterable[str],
              ops: Iterable[ReduceOp | str] | None) -> list[CellKey]:
        keys: list[CellKey] = []
        ops_list = list(ops) if ops is not None else None
        for c in collectives:
            coll = Collective(c)
            for dt in dtypes:
                _dtypes.get(dt)
                if coll.reduces:
                    keys.extend((coll, dt, ReduceOp(op)) for op in (ops_list if ops_list is not None else ReduceOp))
                else:
                    keys.append((coll, dt, None))
        return keys

    def _set(self, keys: list[CellKey], cell: Cell, final: bool) -> CapabilityBuilder:
        for k in keys:
            self._cells[k] = cell
            if final:
                self._final.add(k)
            else:
                self._final.discard(k)
        return self

    def native(self, collectives: Iterable[Collective | str], dtypes: Iterable[str],
               ops: Iterable[ReduceOp | str] | None = None, note: str = "") -> CapabilityBuilder:
        """The library runs these exactly as torch.distributed specifies."""
        return self._set(self._keys(collectives, dtypes, ops), Cell(Support.NATIVE, note=note), True)

    def emulate(self, collectives: Iterable[Collective | str], dtypes: Iterable[str],
                ops: Iterable[ReduceOp | str] | None = None, *, via: str, note: str = "") -> CapabilityBuilder:
        """VCGA composes these with the recipe ``via`` (e.g. route around a library that mangles a dtype)."""
        return self._set(self._keys(collectives, dtypes, ops), Cell(Support.EMULATED, via=via, note=note), True)

    def refuse(self, collectives: Iterable[Collective | str], dtypes: Iterable[str],
               ops: Iterable[ReduceOp | str] | None = None, note: str = "", *, final: bool = True) -> CapabilityBuilder:
        """The library cannot do these. ``final=True`` keeps them refused; ``final=False`` records
        the library's reason but lets :meth:`build` derive an emulation where one exists."""
        return self._set(self._keys(collectives, dtypes, ops), Cell(Support.REFUSED, note=note), final)

    def build(self, derive: bool = True) -> CapabilityTable:
        """The table. With ``derive`` (default), every cell not stated final gets VCGA's standard
        emulation where one applies, built only from this table's native cells:

        - AVG on floats: ``sum_then_divide``; PREMUL_SUM on floats: ``mul_then_sum`` (needs native SUM);
        - bool SUM/BOR: ``bool_as_max``; bool PRODUCT/BAND: ``bool_as_min`` (needs native MAX/MIN on
          bool or uint8);
        - integers and bool: ``upcast`` to the narrowest native signed type that holds every value;
        - fp16, bf16, fp8: ``upcast:float32`` (one rounding at the end);
        - complex SUM/AVG/PREMUL_SUM and complex data movement: ``as_real``;
        - data movement: ``bitcast`` to a native dtype of equal (else dividing) width.

        Cells with no rule stay refused, with the library's reason when one was recorded.
        """
        cells = dict(self._cells)
        if derive:
            for key in _all_keys():
                if key in self._final or (key in cells and cells[key].support is not Support.REFUSED):
                    continue
                derived = _derive(key, self._cells, self._final)
                if derived is not None:
                    reason = cells[key].note if key in cells else ""
                    note = f"VCGA emulation: {EMULATIONS[_recipe_key(derived)]}"
                    if reason:
                        note += f" (library: {reason})"
                    cells[key] = Cell(Support.EMULATED, via=derived, note=note)
        return CapabilityTable(self.backend, cells)


def _all_keys() -> Iterator[CellKey]:
    for coll in Collective:
        for dt in _dtypes.ALL:
            if coll.reduces:
                for op in ReduceOp:
                    yield (coll, dt, op)
            else:
                yield (coll, dt, None)


def _recipe_key(via: str) -> str:
    base, _, arg = via.partition(":")
    return f"{base}:<dtype>" if arg else base


# Upcast targets: a signed type that holds every value of the source, narrowest first.
_UPCAST_INT: Mapping[str, tuple[str, ...]] = {
    "bool": ("int8", "int16", "int32", "int64"),
    "uint8": ("int16", "int32", "int64"),
    "int8": ("int16", "int32", "int64"),
    "uint16": ("int32", "int64"),
    "int16": ("int32", "int64"),
    "uint32": ("int64",),
    "int32": ("int64",),
}
_REAL_OF = {"complex64": "float32", "complex128": "float64"}


def _runs(key: CellKey, cells: Mapping[CellKey, Cell], final: AbstractSet[CellKey]) -> bool:
    """Whether the dispatcher can run ``key`` at all: stated native or emulated, or derivable
    (unless stated refused for good). A recipe that dispatches its rewritten call again (``as_real``)
    works exactly when this holds for the rewritten cell -- whatever recipe that cell uses."""
    cell = cells.get(key)
    if cell is not None and cell.support is not Support.REFUSED:
        return True
    if key in final:
        return False
    return _derive(key, cells, final) is not None


def _derive(key: CellKey, native_cells: Mapping[CellKey, Cell], final: AbstractSet[CellKey] = frozenset()) -> str | None:
    coll, dt, op = key

    def native(c: Collective, d: str, o: ReduceOp | None) -> bool:
        cell = native_cells.get((c, d, o if c.reduces else None))
        return cell is not None and cell.support is Support.NATIVE

    info = _dtypes.get(dt)
    if coll.reduces:
        assert op is not None
        if info.kind == "c":
            real = _REAL_OF[dt]
            # The real cell may itself be emulated (CNCL's fp64 reductions: gather_then_reduce):
            # the dispatcher follows it, so the table must too.
            if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM) and _runs((coll, real, op), native_cells, final):
                return "as_real"
            return None
        if op is ReduceOp.AVG and info.kind == "f" and native(coll, dt, ReduceOp.SUM):
            return "sum_then_divide"
        if op is ReduceOp.PREMUL_SUM and info.kind == "f" and native(coll, dt, ReduceOp.SUM):
            return "mul_then_sum"
        if dt == "bool":
            if op in (ReduceOp.SUM, ReduceOp.BOR) and (native(coll, "bool", ReduceOp.MAX) or native(coll, "uint8", ReduceOp.MAX)):
                return "bool_as_max"
            if op in (ReduceOp.PRODUCT, ReduceOp.BAND) and (native(coll, "bool", ReduceOp.MIN) or native(coll, "uint8", ReduceOp.MIN)):
                return "bool_as_min"
            if op in (ReduceOp.MAX, ReduceOp.MIN) and native(coll, "uint8", op):
                return "bitcast:uint8"
        if dt in _UPCAST_INT and op not in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            for wide in _UPCAST_INT[dt]:
                if native(coll, wide, op):
                    return f"upcast:{wide}"
        if info.kind == "f" and info.itemsize <= 2 and op not in BITWISE:
            if native(coll, "float32", op):
                return "upcast:float32"
            if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) and native(coll, "float32", ReduceOp.SUM):
                return "upcast:float32"
        return None
    # data movement: an integer dtype whose width divides ours carries the same bytes. Only
    # integers: a library may normalise bool bytes or canonicalise float NaN payloads in transit.
    ints = [d for d in _dtypes.DTYPES.values() if d.kind in "ui" and d.name != dt]
    same = [d.name for d in ints if d.itemsize == info.itemsize]
    narrower = [d.name for d in sorted(ints, key=lambda d: -d.itemsize)
                if d.itemsize < info.itemsize and info.itemsize % d.itemsize == 0]
    for cand in same + narrower:
        if native(coll, cand, None):
            return f"bitcast:{cand}"
    return None


# ===================================================================================================
# 3. Accelerator -- the device interface
# ===================================================================================================


@dataclass(frozen=True)
class MemoryStats:
    """Device memory in bytes. ``None`` where the device cannot tell (e.g. the CPU's reserved pool)."""

    allocated: int
    reserved: int | None
    peak_allocated: int | None
    total: int | None


@runtime_checkable
class StreamLike(Protocol):
    """What VCGA needs of a vendor stream (``torch.cuda.Stream``, ``torch.npu.Stream``, ...)."""

    def synchronize(self) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...


@runtime_checkable
class EventLike(Protocol):
    """What VCGA needs of a vendor event."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@runtime_checkable
class Accelerator(Protocol):
    """One vendor's device module seen through a small, typed interface.

    Return types are part of the contract (DeepSpeed's accelerator interface drifted because they
    were not): ``device`` returns a ``torch.device``, counts and indices are ``int``, memory is a
    :class:`MemoryStats`, RNG state is a CPU ``torch.ByteTensor``.
    """

    #: "cuda", "npu", "mlu" or "cpu": the torch device type.
    device_type: str
    #: The environment variable that restricts visible devices (``CUDA_VISIBLE_DEVICES``, ...), or None.
    visible_devices_env: str | None

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``index`` (default: the current device)."""
        ...

    def set_device(self, index: int) -> None: ...

    def current_device(self) -> int: ...

    def synchronize(self, index: int | None = None) -> None: ...

    def memory_stats(self, index: int | None = None) -> MemoryStats: ...

    def manual_seed(self, seed: int) -> None:
        """Seed every device of this type."""
        ...

    def get_rng_state(self, index: int | None = None) -> torch.Tensor: ...

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None: ...

    def current_stream(self, index: int | None = None) -> StreamLike: ...

    def new_stream(self, index: int | None = None) -> StreamLike: ...

    def new_event(self, enable_timing: bool = False) -> EventLike: ...

    def supported_dtypes(self) -> frozenset[str]:
        """Canonical dtype names the device can hold (not: that collectives accept them)."""
        ...


# ===================================================================================================
# 4. Backend -- one vendor stack
# ===================================================================================================


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend can run here, and why not.

    :param available: True when the backend can create a process group on this machine now.
    :param reason: one line; when unavailable, exactly why (module missing and the import error,
        zero devices, driver error); when available, a short description.
    :param device_count: devices the backend sees (0 when unavailable).
    :param versions: library versions found, e.g. ``{"torch": "2.13.0", "nccl": "2.27.5"}``.
    """

    available: bool
    reason: str
    device_count: int = 0
    versions: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    """What a backend knows of the links between its devices on this node.

    :param source: how it was found ("nvidia-smi topo -m", "npu-smi", "cnmon", "unknown").
    :param device_count: devices on this node.
    :param matrix: ``matrix[i][j]`` is the link type between devices i and j (e.g. "NV18", "PIX",
        "SYS", "X" on the diagonal), or None when unknown.
    :param detail: raw text or the reason the topology is unknown.
    """

    source: str
    device_count: int = 0
    matrix: Sequence[Sequence[str]] | None = None
    detail: str = ""

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
                             timeout: timedelta) -> dist.ProcessGroup:
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


# ===================================================================================================
# 5. Checkpoint formats -- one stream of tensor entries
# ===================================================================================================


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as every format reader yields it and every writer takes it.

    :param name: the tensor's key ("encoder.layers.0.weight"; HDF5 paths are '/'-joined).
    :param dtype: canonical dtype name (:mod:`vcga.dtypes`).
    :param shape: dimensions; ``()`` for a 0-d tensor.
    :param data: exactly ``numel * itemsize`` bytes, little-endian, C order: ``bytes``, a
        ``memoryview`` or anything with the buffer protocol (a zero-copy view where the reader can).
    :param metadata: per-tensor string metadata a format carries (HDF5 attributes, ...).
    :param checksum: ``"xxh3_64:<16 hex>"`` of ``data`` when the source stored one, else None.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any
    metadata: Mapping[str, str] = field(default_factory=dict)
    checksum: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _dtypes.get(self.dtype).itemsize


@runtime_checkable
class FormatReader(Protocol):
    """Streams the tensors of one checkpoint (all its shards). Use as a context manager."""

    #: File-level metadata (string to string).
    metadata: Mapping[str, str]

    def index(self) -> Sequence[TensorEntry]:
        """Every entry's name, dtype, shape and metadata, without reading tensor data.

        Entries in the returned list carry ``data=None``."""
        ...

    def entries(self) -> Iterator[TensorEntry]:
        """Yield each tensor with its data, in file order, reading one at a time (bounded memory)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> FormatReader: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class FormatWriter(Protocol):
    """Writes one checkpoint atomically: nothing appears at the destination until :meth:`commit`.

    As a context manager it commits on success and aborts (removing every temporary) on error.
    """

    def set_metadata(self, metadata: Mapping[str, str]) -> None: ...

    def write(self, entry: TensorEntry) -> None:
        """Append one tensor; may be called many times; memory stays bounded by one tensor."""
        ...

    def commit(self) -> None:
        """fsync and rename into place."""
        ...

    def abort(self) -> None: ...

    def __enter__(self) -> FormatWriter: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class FormatSpec:
    """A checkpoint format a plugin contributes.

    :param name: short name used by ``--from``/``--to`` ("safetensors", "mindrecord", ...).
    :param extensions: file extensions including the dot (".safetensors", ".vbin").
    :param dtypes: canonical dtype names the format can hold exactly.
    :param sniff: ``sniff(path) -> bool``: does this file carry the format's signature?
        Must read at most a few KiB and never raise for a foreign file.
    :param open_reader: ``open_reader(path, **options) -> FormatReader``.
    :param open_writer: ``open_writer(path, **options) -> FormatWriter``; options include
        ``shard_size`` (bytes) where the format shards.
    :param description: one line for ``vcga info`` and ``vcga convert --help``.
    """

    name: str
    extensions: tuple[str, ...]
    dtypes: frozenset[str]
    sniff: Callable[[Any], bool]
    open_reader: Callable[..., FormatReader]
    open_writer: Callable[..., FormatWriter]
    description: str = ""


# ===================================================================================================
# 6. Conformance checks -- what `vcga verify` runs
# ===================================================================================================


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one case of a conformance check.

    :param check: the check's name.
    :param backend: the backend it ran on (or a vendor set like "sim:nccl:2,hccl:2").
    :param case: what exactly ran ("all_reduce SUM float32 n=4097 ws=2").
    :param passed: True when the case met its bound.
    :param dtype: the dtype involved, when one is.
    :param worst_error: the largest error seen (0.0 for exact checks), when numeric.
    :param bound: the bound it was checked against, when numeric.
    :param detail: one line explaining a failure (or a skip).
    :param skipped: True when the case did not apply (e.g. a refused cell).
    """

    check: str
    backend: str
    case: str
    passed: bool
    dtype: str | None = None
    worst_error: float | None = None
    bound: float | None = None
    detail: str = ""
    skipped: bool = False


@runtime_checkable
class ConformanceCheck(Protocol):
    """One conformance check. It runs inside every rank of a world the runner spawned and uses
    only the public API (``torch.distributed`` on the ``vcga`` group, and this contract).

    Two optional members (not part of the protocol, so existing checks stay valid): ``defaults``,
    a dict of the options the check accepts with their defaults (profiles may override exactly
    these); and ``compare(exports)``, called once after all worlds ran with ``{world id: {key:
    value}}`` from the context's ``export()``, yielding :class:`CheckResult` rows that compare
    worlds (backend against backend). See docs/conformance.md.
    """

    #: Unique name, e.g. "exact-reduce".
    name: str
    #: One line: what the check proves.
    description: str

    def run(self, context: Any) -> Iterable[CheckResult]:
        """Run on one rank and yield results. ``context`` carries rank, world size, backend,
        process group and the profile's options (see :mod:`vcga.conformance`)."""
        ...


# ===================================================================================================
# 7. Hook specifications
# ===================================================================================================


class HookSpecs:
    """The hooks a plugin may implement. Every hook is optional."""

    @hookspec
    def vcga_backends(self) -> Sequence[Backend]:
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
    def vcga_formats(self) -> Sequence[FormatSpec]:
        """Return the checkpoint formats this plugin contributes."""

    @hookspec
    def vcga_conformance_checks(self) -> Sequence[ConformanceCheck]:
        """Return extra conformance checks for ``vcga verify`` (a vendor's own, for example)."""
