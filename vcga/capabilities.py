"""Capability tables: what a backend's library does with each (collective, dtype, reduce op).

The vocabulary (:class:`Collective`, :class:`ReduceOp`, :class:`Support`), the :class:`Cell` and
:class:`CapabilityTable` a backend returns from :meth:`vcga.contract.Backend.capabilities`, and the
:class:`CapabilityBuilder` that derives VCGA's standard emulations (:data:`EMULATIONS`) from the
native cells a plugin states. :mod:`vcga.contract` re-exports every public name here, so a plugin
imports its whole interface from the contract; both modules are public core API.

Nothing here imports torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from vcga import dtypes as _dtypes
from vcga._values import FrozenValue

__all__ = [
    "BITWISE",
    "EMULATIONS",
    "MOVING",
    "REDUCING",
    "CapabilityBuilder",
    "CapabilityTable",
    "Cell",
    "CellKey",
    "Collective",
    "ReduceOp",
    "Support",
    "cell_name",
]


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
    "bitcast:<dtype>": "move the same bytes as <dtype> elements: a view when <dtype>'s width divides this one's, "
    "else the bytes padded to whole <dtype> elements and cut back after the call (data movement; "
    "bool MIN/MAX as uint8)",
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


class Cell(FrozenValue):
    """One capability cell.

    :param support: native, emulated or refused.
    :param via: for emulated cells, the recipe (a key of :data:`EMULATIONS`).
    :param note: where the fact comes from (file, doc, measurement) and, for refused cells,
        what the user can do instead. Shown verbatim in errors and ``vcga info``.
    :param derived: True for an emulation :meth:`CapabilityBuilder.build` derived (the plugin did
        not state the cell); ``vcga info --cells`` marks these.

    Frozen and compared by value, as ``@dataclass(frozen=True)`` would make it; defined without
    dataclasses, which would cost each rank 0.5 ms at every start (:mod:`vcga._values`).
    """

    __slots__ = ("support", "via", "note", "derived")
    support: Support
    via: str | None
    note: str
    derived: bool

    def __init__(self, support: Support, via: str | None = None, note: str = "", derived: bool = False) -> None:
        if support is Support.EMULATED:
            if not via:
                raise ValueError("an emulated cell must name its recipe in `via`")
            _check_via(via)
        object.__setattr__(self, "support", support)
        object.__setattr__(self, "via", via)
        object.__setattr__(self, "note", note)
        object.__setattr__(self, "derived", derived)


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
        # the enum conversions are skipped when the caller passes members (the hot callers do)
        coll = collective if type(collective) is Collective else Collective(collective)
        rop = (op if type(op) is ReduceOp else ReduceOp(op)) if (op is not None and coll.reduces) else None
        return self._cells.get((coll, dtype, rop), self._default)

    def cells(self) -> Mapping[CellKey, Cell]:
        """Every explicit cell (the refused default is not listed)."""
        return dict(self._cells)

    def support_of(self, collective: Collective | str, dtype: str, op: ReduceOp | str | None = None) -> Support:
        return self.lookup(collective, dtype, op).support

    def summary(self) -> dict[str, Any]:
        """Counts per support kind (and how many emulated cells VCGA derived) plus the dtypes with
        any native reduction, for ``vcga info``."""
        counts = {s.value: 0 for s in Support}
        derived = 0
        for coll in Collective:
            for dt in _dtypes.ALL:
                ops: Iterable[ReduceOp | None] = ReduceOp if coll.reduces else (None,)
                for op in ops:
                    cell = self.lookup(coll, dt, op)
                    counts[cell.support.value] += 1
                    derived += cell.derived
        native_reduce = sorted(
            {dt for (c, dt, op), cell in self._cells.items()
             if c is Collective.ALL_REDUCE and cell.support is Support.NATIVE},
            key=_dtypes.ALL.index,
        )
        native_ops = sorted(
            {op.value for (c, dt, op), cell in self._cells.items()
             if c is Collective.ALL_REDUCE and cell.support is Support.NATIVE and op is not None},
            key=[o.value for o in ReduceOp].index,
        )
        return {"cells": counts, "derived_cells": derived, "all_reduce_native_dtypes": native_reduce,
                "all_reduce_native_ops": native_ops}

    def route(self, collective: Collective | str, dtype: str, op: ReduceOp | str | None = None,
              ) -> list[tuple[CellKey, Cell]]:
        """The cells one call goes through, as the dispatcher follows recipes: the asked cell first,
        then the cell of each rewritten call, ending at a native cell (or at a refused one, or where
        the chain would loop). Every recipe issues exactly one further call, so this is a chain.

        ``vcga verify`` and ``vcga info`` name an emulated cell's last (native) cell as the cell it is
        *derived from*: if the library gets that one wrong, every cell routed through it is wrong too.
        (A complex PREMUL_SUM factor turns ``as_real``'s rewritten op into SUM at run time; the route
        shows the op as called.)"""
        coll = Collective(collective)
        key: CellKey = (coll, dtype, ReduceOp(op) if (op is not None and coll.reduces) else None)
        out: list[tuple[CellKey, Cell]] = []
        seen: set[CellKey] = set()
        while key not in seen:
            seen.add(key)
            cell = self.lookup(*key)
            out.append((key, cell))
            if cell.support is not Support.EMULATED or cell.via is None:
                break
            nxt = _rewritten(key, cell.via)
            if nxt is None:
                break
            key = nxt
        return out

    def derived_from(self, collective: Collective | str, dtype: str, op: ReduceOp | str | None = None,
                     ) -> CellKey | None:
        """For an emulated cell, the native cell its recipes finally run on (see :meth:`route`);
        None for native and refused cells and for chains that end refused."""
        chain = self.route(collective, dtype, op)
        if len(chain) < 2 or chain[-1][1].support is not Support.NATIVE:
            return None
        return chain[-1][0]

    def to_json(self) -> list[dict[str, Any]]:
        """Every explicit cell as a JSON-ready row: ``derived`` says whether VCGA derived the cell
        (else the plugin stated it), ``derived_from`` names the native cell an emulated one runs on."""
        rows = []
        for (c, dt, op), cell in self._cells.items():
            src = self.derived_from(c, dt, op) if cell.support is Support.EMULATED else None
            rows.append({"collective": c.value, "dtype": dt, "op": op.value if op else None,
                         "support": cell.support.value, "via": cell.via, "note": cell.note,
                         "derived": cell.derived, "derived_from": cell_name(src) if src is not None else None})
        return rows

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
        op_members: list[ReduceOp] | None = None  # converted once, when a reducing collective needs them
        for c in collectives:
            coll = Collective(c)
            for dt in dtypes:
                _dtypes.get(dt)
                if coll.reduces:
                    if op_members is None:
                        op_members = [ReduceOp(op) for op in ops] if ops is not None else list(ReduceOp)
                    keys.extend((coll, dt, op) for op in op_members)
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
        - complex SUM/AVG/PREMUL_SUM: ``as_real``;
        - data movement, for every dtype, whenever the collective moves any dtype natively:
          ``bitcast`` to a dtype it moves natively -- integers before floats (bool never carries
          other bytes), a width that divides this dtype's (a plain view, equal width first) before
          a padded byte view. A moving collective only moves bytes, so every one of these is exact.

        Cells with no rule stay refused, with the library's reason when one was recorded.
        """
        cells = dict(self._cells)
        if derive:
            for key in _all_keys():
                if key in self._final or (key in cells and cells[key].support is not Support.REFUSED):
                    continue
                cell = _derived_cell(key, self._cells, self._final)
                if cell is not None:
                    cells[key] = cell
        return CapabilityTable(self.backend, cells)

    def build_lazy(self, source: bytes) -> LazyCapabilityTable:
        """The table :meth:`build` returns, its derived cells worked out when first asked for: a
        training job's collectives ask for a handful of some 500, and every rank of every job
        creates its backend's table at group creation.

        ``source``: the bytes every statement was made from (a measured table's file), so that the
        statements are a function of them. The table's :attr:`~LazyCapabilityTable.identity` is a
        digest of those bytes, the backend's name and vcga's version (whose rules derive every
        other cell); ranks compare it at group creation (:func:`vcga.pg.discovery.table_digest`)
        instead of working the table out in full. So two ranks agree on the table when they
        state it from the same bytes with the same vcga release; ranks of different vcga releases
        are told to install the same one, even where their tables happen to be equal."""
        return LazyCapabilityTable.from_source(self.backend, dict(self._cells).get, frozenset(self._final), source)


def _derived_cell(key: CellKey, stated: Mapping[CellKey, Cell], final: AbstractSet[CellKey]) -> Cell | None:
    """The emulated cell :meth:`CapabilityBuilder.build` derives for ``key`` (not stated final, and
    not stated native or emulated) from the ``stated`` cells, or None when no rule applies."""
    derived = _derive(key, stated, final)
    if derived is None:
        return None
    refused = stated.get(key)
    reason = refused.note if refused is not None else ""
    note = f"VCGA emulation: {EMULATIONS[_recipe_key(derived)]}"
    if reason:
        note += f" (library: {reason})"
    return Cell(Support.EMULATED, via=derived, note=note, derived=True)


class LazyCapabilityTable(CapabilityTable):
    """A :class:`CapabilityTable` whose cells are worked out when first asked for.

    ``stated(key)`` gives the cell a builder would have been told for ``key`` (None: nothing
    stated); a refused stated cell not in ``final`` lets VCGA's standard emulations be derived on
    top, exactly as :meth:`CapabilityBuilder.build` derives them -- the same cells, one at a time. Why:
    a mixed-vendor group's combined table (:func:`vcga.bridge.combined_table`) has some 500 cells,
    each a function of the vendor groups' tables; working them all out costs every rank CPU at
    every group creation (docs/bridge.md, "Discovery and the plan"), where a training job's
    collectives ask for a handful. Anything
    that reads the whole table (:meth:`cells`, :meth:`to_json`, :meth:`summary`, comparisons)
    works it out in full, once. A plugin gets one from :meth:`CapabilityBuilder.build_lazy`
    (:mod:`vcga.contract` does not export the class).

    ``identity``: a digest that determines every cell (see :meth:`CapabilityBuilder.build_lazy`),
    or None: the table's digest is then that of its cells, worked out in full.
    """

    __slots__ = ("_stated_fn", "_stated", "_final", "_memo", "_full", "identity")

    def __init__(self, backend: str, stated: Callable[[CellKey], Cell | None],
                 final: AbstractSet[CellKey] = frozenset(), identity: str | None = None) -> None:
        self.backend = backend
        self.identity = identity
        self._final = final
        self._default = Cell(Support.REFUSED, note=f"{backend} does not support this combination")
        self._stated_fn = stated
        self._stated = _StatedCells(stated)
        self._memo: dict[CellKey, Cell | None] = {}
        self._full: dict[CellKey, Cell] | None = None

    @classmethod
    def from_source(cls, backend: str, stated: Callable[[CellKey], Cell | None], final: AbstractSet[CellKey],
                    source: bytes) -> LazyCapabilityTable:
        """The table whose statements ``stated`` and ``final`` read from ``source`` alone (a measured
        table's file), named as :meth:`CapabilityBuilder.build_lazy` names it: for a plugin that
        looks each cell up in its file when asked, rather than stating every cell to a builder."""
        import hashlib

        from vcga._version import __version__

        ident = hashlib.sha256(b"\0".join([b"statements", backend.encode(), __version__.encode(), source]))
        return cls(backend, stated, final, ident.hexdigest())

    def _cell(self, key: CellKey) -> Cell | None:
        """The cell for ``key`` (a key of :func:`_all_keys`), or None: not stated, nothing derived."""
        if key in self._memo:
            return self._memo[key]
        cell = self._stated.get(key)
        if (cell is None or cell.support is Support.REFUSED) and key not in self._final:
            cell = _derived_cell(key, self._stated, self._final) or cell
        self._memo[key] = cell
        return cell

    def lookup(self, collective: Collective | str, dtype: str, op: ReduceOp | str | None = None) -> Cell:
        coll = collective if type(collective) is Collective else Collective(collective)
        rop = (op if type(op) is ReduceOp else ReduceOp(op)) if (op is not None and coll.reduces) else None
        if dtype not in _ALL_DTYPES or (coll.reduces and rop is None):
            return self._default
        return self._cell((coll, dtype, rop)) or self._default

    # what the whole-table methods of CapabilityTable read; computed, so read-only here
    @property
    def _cells(self) -> dict[CellKey, Cell]:  # type: ignore[override]
        if self._full is None:
            full = {}
            for key in _all_keys():
                cell = self._cell(key)
                if cell is not None:
                    full[key] = cell
            self._full = full
        return self._full


class _StatedCells(Mapping[CellKey, Cell]):
    """The stated cells of a :class:`LazyCapabilityTable`, each asked of ``stated`` once."""

    def __init__(self, stated: Callable[[CellKey], Cell | None]) -> None:
        self._fn = stated
        self._memo: dict[CellKey, Cell | None] = {}

    def get(self, key: CellKey, default: Any = None) -> Any:
        if key in self._memo:
            cell = self._memo[key]
        else:
            coll, dt, op = key
            inside = dt in _ALL_DTYPES and (op is not None) == coll.reduces  # a key of _all_keys()
            cell = self._memo[key] = self._fn(key) if inside else None
        return default if cell is None else cell

    def __getitem__(self, key: CellKey) -> Cell:
        cell = self.get(key)
        if cell is None:
            raise KeyError(key)
        return cell

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[CellKey]:
        return (k for k in _all_keys() if self.get(k) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_ALL_DTYPES = frozenset(_dtypes.ALL)


def _all_keys() -> Iterator[CellKey]:
    for coll in Collective:
        for dt in _dtypes.ALL:
            if coll.reduces:
                for op in ReduceOp:
                    yield (coll, dt, op)
            else:
                yield (coll, dt, None)


def cell_name(key: CellKey) -> str:
    """A cell as ``vcga verify`` and ``vcga info`` name it: ``"all_reduce int16 SUM"``, ``"broadcast bool"``."""
    coll, dt, op = key
    return f"{coll.value} {dt}" + (f" {op.value}" if op is not None else "")


def _rewritten(key: CellKey, via: str) -> CellKey | None:
    """The cell of the call recipe ``via`` rewrites ``key`` into (mirrors :mod:`vcga.pg.dispatch`)."""
    coll, dt, op = key
    base, _, arg = via.partition(":")
    if base in ("sum_then_divide", "mul_then_sum"):
        return (coll, dt, ReduceOp.SUM)
    if base in ("bool_as_max", "bool_as_min"):
        return (coll, dt, ReduceOp.MAX if base == "bool_as_max" else ReduceOp.MIN)
    if base in ("upcast", "bitcast") and arg:
        return (coll, arg, op)
    if base == "as_real" and dt in _REAL_OF:
        return (coll, _REAL_OF[dt], op)
    if base == "gather_then_reduce" and coll.reduces:
        return ({Collective.ALL_REDUCE: Collective.ALL_GATHER, Collective.REDUCE: Collective.GATHER,
                 Collective.REDUCE_SCATTER: Collective.ALL_TO_ALL}[coll], dt, None)
    return None


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


def _derive(key: CellKey, native_cells: Mapping[CellKey, Cell],
            final: AbstractSet[CellKey] = frozenset()) -> str | None:
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
            if op in (ReduceOp.SUM, ReduceOp.BOR) and (native(coll, "bool", ReduceOp.MAX)
                                                      or native(coll, "uint8", ReduceOp.MAX)):
                return "bool_as_max"
            if op in (ReduceOp.PRODUCT, ReduceOp.BAND) and (native(coll, "bool", ReduceOp.MIN)
                                                           or native(coll, "uint8", ReduceOp.MIN)):
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
    # Data movement: any dtype the collective moves natively carries our bytes (the dispatcher's
    # bitcast: a view when its width divides ours, else a byte view padded to its width and cut
    # back). Integers first: a library could in principle normalise bool bytes or canonicalise
    # float NaN payloads in transit, so a float carries other dtypes' bytes only when no integer
    # can (verify moves NaN payloads and special bytes through every derived cell), and bool never.
    # Then views before padded copies, equal width first.
    order = list(_dtypes.DTYPES)
    carriers = [d for d in _dtypes.DTYPES.values()
                if d.name not in (dt, "bool") and native(coll, d.name, None)]
    if not carriers:
        return None

    def preference(d: _dtypes.DType) -> tuple[bool, bool, int, int]:
        view = info.itemsize % d.itemsize == 0
        return (d.kind not in "ui", not view, -d.itemsize if view else d.itemsize, order.index(d.name))

    return f"bitcast:{min(carriers, key=preference).name}"
