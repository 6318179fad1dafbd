"""Discovery: every rank of a new ``vcga`` group learns what every other rank runs.

The first step of creating a group (:func:`vcga.pg.transport.make_transport`). Every rank must
reach the same decision -- one backend (a native group) or several (the mixed-vendor bridge, and
its plan) -- so every rank must see the same facts. Reading every rank's record would cost each
rank n reads and the store n² in total; instead rank 0 gathers and everyone reads one compact
record, through the group's store (prefix ``vcga/discovery``):

1. rank r publishes its record under ``r/<r>`` -- backend, vendor, device type, node (host name)
   and the digest of its backend's capability table, about 100 bytes -- then adds one to
   ``arrived``; the rank whose addition makes it n sets ``all``.
2. rank 0 waits for ``all``, reads the n records in one ``multi_get`` and publishes the *layout*
   under ``layout``: each distinct backend once, and for every rank the index of its backend and
   of its node, delta-coded and compressed (a torchrun layout -- k consecutive ranks per node --
   is a periodic sequence: about 200 bytes at 10,240 ranks), or the error every rank must raise.
   The node names go under ``nodes``, read only by :meth:`Layout.node_names` (``describe()``),
   never during creation.
3. every rank reads ``layout``.

So each rank makes a constant number of requests of constant size (rank 0 also one read of
every record, O(n) bytes), and the store carries O(n) bytes in total. A rank that never arrives
makes the others raise :class:`~vcga.errors.VcgaTimeoutError` naming it, within the timeout.
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
import socket
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vcga._values import FrozenValue
from vcga.errors import VcgaConfigError, VcgaTimeoutError

if TYPE_CHECKING:
    from vcga.contract import Backend, CapabilityTable

__all__ = ["Layout", "BackendFacts", "discover", "table_digest", "table_to_wire", "table_from_wire", "stack_digest",
           "encode_indices", "decode_indices"]

#: Bumped when the layout record changes meaning.
LAYOUT_VERSION = 1


# Frozen values (vcga._values), not dataclasses nor NamedTuples: every rank defines them when it
# creates its first group; a dataclass costs that rank ~0.5 ms of CPU to define, a NamedTuple
# ~0.15 ms (both compile methods from source).
class BackendFacts(FrozenValue):
    """One backend as the layout names it."""

    __slots__ = ("name", "vendor", "device_type", "digest", "stack")
    name: str
    vendor: str
    device_type: str
    #: :func:`table_digest` of its capability table (the same on every rank that runs it)
    digest: str
    #: :func:`stack_digest` of its libraries' versions, as its lowest rank found them (the
    #: link-figure cache is keyed on it: new vendor libraries, new figures)
    stack: str

    def __init__(self, name: str, vendor: str, device_type: str, digest: str, stack: str = "") -> None:
        self._set(name, vendor, device_type, digest, stack)


class Layout(FrozenValue):
    """What every rank of the group runs, the same on every rank (see the module docstring)."""

    __slots__ = ("backends", "rank_backend", "rank_node", "store")
    backends: tuple[BackendFacts, ...]
    #: per group rank: index into :attr:`backends`
    rank_backend: tuple[int, ...]
    #: per group rank: index of its node (nodes numbered in order of their lowest rank)
    rank_node: tuple[int, ...]
    #: where the node names are (for :meth:`node_names`)
    store: Any

    def __init__(self, backends: tuple[BackendFacts, ...], rank_backend: tuple[int, ...], rank_node: tuple[int, ...],
                 store: Any = None) -> None:
        self._set(backends, rank_backend, rank_node, store)

    @property
    def size(self) -> int:
        return len(self.rank_backend)

    def backend_of(self, rank: int) -> BackendFacts:
        return self.backends[self.rank_backend[rank]]

    def first_rank_of(self, index: int) -> int:
        """The lowest rank running backend ``index`` (it publishes that backend's table)."""
        return self.rank_backend.index(index)

    def peers(self, global_ranks: Sequence[int]) -> list[dict[str, Any]]:
        """Every rank's facts in the form :func:`vcga.bridge.make_plan` takes; ``node`` is the node's
        index (its name is read only when asked, :meth:`node_names`)."""
        out = []
        for r, (b, n) in enumerate(zip(self.rank_backend, self.rank_node, strict=True)):
            f = self.backends[b]
            out.append({"backend": f.name, "vendor": f.vendor, "device_type": f.device_type, "node": n,
                        "global_rank": global_ranks[r]})
        return out

    def node_names(self) -> list[str]:
        """The host name of each node index (one store read; for ``describe()`` and messages)."""
        if self.store is None:
            return []
        return json.loads(zlib.decompress(self.store.get("nodes")))


def table_digest(table: CapabilityTable) -> str:
    """A digest of a capability table's content (:func:`table_to_wire`'s canonical bytes),
    independent of the order its cells were stated in: two ranks whose tables differ in any cell
    (support, recipe or note) get different digests. Computed once per table object (a backend's
    table lives as long as the process). A table that carries an ``identity`` (one from
    :meth:`~vcga.capabilities.CapabilityBuilder.build_lazy`: a digest of what determines every
    cell) is named by it instead, without working out its cells."""
    identity = getattr(table, "identity", None)
    if identity:
        return str(identity)[:16]
    return hashlib.sha256(table_to_wire(table)).hexdigest()[:16]


#: Bumped when :func:`table_to_wire`'s form changes (it is part of every table digest).
WIRE_VERSION = 1


def table_to_wire(table: CapabilityTable) -> bytes:
    """A capability table as the bridge publishes it through the store, canonical: the same bytes
    for the same cells in whatever order they were stated (so :func:`table_digest`
    is a digest of these bytes). JSON: the backend, each distinct note once, and one row per cell
    ``[collective, dtype, op or "", support, via or "", note index, derived]``, sorted.

    About 20 KB before compression, a sixth of :meth:`CapabilityTable.to_json` (what ``vcga info``
    shows, with each emulated cell's route), and much cheaper to make: it is on the path of every
    mixed group's creation, where every other rank waits for it. Cached per table object."""
    hit = _WIRE.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    # the enums are str subclasses: sorted and written as their values
    cells = sorted((c, dt, op or "", cell.support, cell.via or "", cell.note, cell.derived)
                   for (c, dt, op), cell in table.cells().items())
    notes: dict[str, int] = {}
    rows = [[c, dt, op, sup, via, notes.setdefault(note, len(notes)), 1 if der else 0]
            for c, dt, op, sup, via, note, der in cells]
    text = json.dumps([WIRE_VERSION, table.backend, list(notes), rows], separators=(",", ":")).encode()
    _WIRE[id(table)] = (table, text)
    return text


_WIRE: dict[int, tuple[CapabilityTable, bytes]] = {}


def table_from_wire(backend: str, text: bytes) -> CapabilityTable:
    """The table :func:`table_to_wire` wrote (named ``backend``). Cells with the same content are
    one (immutable) :class:`~vcga.contract.Cell` object."""
    from vcga.capabilities import CapabilityTable, Cell, Collective, ReduceOp, Support

    version, _, notes, rows = json.loads(text)
    if version != WIRE_VERSION:
        raise ValueError(f"capability table in wire form {version}, this vcga reads {WIRE_VERSION}")
    colls = {c.value: c for c in Collective}
    ops: dict[str, ReduceOp | None] = {o.value: o for o in ReduceOp}
    ops[""] = None
    shared: dict[tuple[str, str, int, int], Cell] = {}
    cells = {}
    for c, dt, op, sup, via, note, der in rows:
        k = (sup, via, note, der)
        cell = shared.get(k)
        if cell is None:
            cell = shared[k] = Cell(Support(sup), via=via or None, note=notes[note], derived=bool(der))
        cells[(colls[c], dt, ops[op])] = cell
    return CapabilityTable(backend, cells)


def stack_digest(backend: Backend) -> str:
    """A digest of the library versions ``backend``'s probe found (the probe the plugin manager
    cached when it chose the backend; "" for a backend it does not know) and of torch's."""
    import torch

    versions: dict[str, str] = {"torch": torch.__version__}
    try:
        from vcga.plugin_manager import get_plugin_manager

        versions.update(get_plugin_manager().backend_record(backend.name).probe().versions)
    except Exception:  # noqa: BLE001 - a backend created outside the plugin manager (tests)
        pass
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:12]


def encode_indices(values: Sequence[int]) -> str:
    """Non-negative ints as zigzag deltas (uint32), zlib-compressed, base64: a periodic layout
    (k ranks per node, a backend per node) compresses to a few hundred bytes at any size."""
    out = array.array("I")
    prev = 0
    for v in values:
        d = v - prev
        prev = v
        out.append(d << 1 if d >= 0 else ((-d) << 1) - 1)
    if out.itemsize != 4:  # pragma: no cover - "I" is 4 bytes on every platform torch runs on
        raise RuntimeError("array('I') is not 32 bits here")
    return base64.b64encode(zlib.compress(out.tobytes(), 9)).decode()


def decode_indices(text: str) -> tuple[int, ...]:
    raw = array.array("I")
    raw.frombytes(zlib.decompress(base64.b64decode(text)))
    out, prev = [], 0
    for z in raw:
        prev += (z >> 1) if not z & 1 else -((z + 1) >> 1)
        out.append(prev)
    return tuple(out)


# ===================================================================================================
# The protocol
# ===================================================================================================


def _wait(store: Any, keys: list[str], timeout: timedelta) -> bool:
    try:
        store.wait(keys, timeout)
        return True
    except Exception:  # noqa: BLE001 - DistStoreError on timeout
        return False


def _missing(store: Any, size: int) -> list[int]:
    """Ranks whose record is not there (the failure path only: one check per rank)."""
    return [r for r in range(size) if not store.check([f"r/{r}"])]


def discover(store: Any, rank: int, size: int, backend: Backend, timeout: timedelta,
             global_ranks: Sequence[int]) -> Layout:
    """Publish this rank's facts and return the group's :class:`Layout` (collective over the group).

    :param store: the group's store (this function prefixes it with ``vcga/discovery``).
    :raises VcgaTimeoutError: a rank never published (named), or rank 0 never published the layout.
    :raises VcgaConfigError: ranks of one backend disagree on its vendor, device type or
        capability table (every rank raises the same error).
    """
    import torch.distributed as dist  # here: importing this module stays torch-free

    disc = dist.PrefixStore("vcga/discovery", store)
    me = {"b": backend.name, "v": backend.vendor, "d": backend.device_type, "n": socket.gethostname(),
          "t": table_digest(backend.capabilities()), "s": stack_digest(backend)}
    disc.set(f"r/{rank}", json.dumps(me, separators=(",", ":")))
    if disc.add("arrived", 1) == size:
        disc.set("all", "1")
    if rank == 0:
        if not _wait(disc, ["all"], timeout):
            missing = _missing(disc, size)
            raise VcgaTimeoutError("process group creation", timeout.total_seconds(), rank=global_ranks[rank],
                                   missing_ranks=[global_ranks[r] for r in missing],
                                   detail="ranks never published their backend")
        records = [json.loads(v) for v in disc.multi_get([f"r/{r}" for r in range(size)])]
        text, nodes = _layout(records, global_ranks)
        disc.set("nodes", nodes)  # type: ignore[arg-type]  # c10d stores take bytes; torch's stub says str
        disc.set("layout", text)  # type: ignore[arg-type]
    elif not _wait(disc, ["layout"], timeout):
        missing = _missing(disc, size) or [0]
        raise VcgaTimeoutError("process group creation", timeout.total_seconds(), rank=global_ranks[rank],
                               missing_ranks=[global_ranks[r] for r in missing],
                               detail="ranks never published their backend" if missing != [0] else
                               "rank 0 never published the group's layout")
    else:
        text = disc.get("layout")
    return _parse(text, disc)


def _layout(records: list[dict[str, Any]], global_ranks: Sequence[int]) -> tuple[bytes, bytes]:
    """Rank 0: the layout record (JSON) and the node names (compressed JSON)."""
    backends: dict[str, int] = {}
    facts: list[tuple[str, str, str, str, str, int]] = []  # name, vendor, device type, table, stack, first rank
    nodes: dict[str, int] = {}
    rank_backend, rank_node = [], []
    error = None
    for r, rec in enumerate(records):
        b = backends.get(rec["b"])
        if b is None:
            b = backends[rec["b"]] = len(facts)
            facts.append((rec["b"], rec["v"], rec["d"], rec["t"], rec.get("s", ""), r))
        f = facts[b]
        if error is None and (rec["v"], rec["d"]) != (f[1], f[2]):
            error = ["backend", rec["b"], f"one vendor and device type per backend name; rank {global_ranks[f[5]]} "
                                          f"reports {(f[1], f[2])}, rank {global_ranks[r]} {(rec['v'], rec['d'])}"]
        if error is None and rec["t"] != f[3]:
            error = ["backend", rec["b"], f"the same capability table on every rank of backend {rec['b']!r}; rank "
                                          f"{global_ranks[r]}'s differs from rank {global_ranks[f[5]]}'s (different "
                                          "plugin versions?). Install the same vcga and plugin versions on every node"]
        rank_backend.append(b)
        rank_node.append(nodes.setdefault(rec["n"], len(nodes)))
    out = {"v": LAYOUT_VERSION, "backends": [f[:5] for f in facts], "rb": encode_indices(rank_backend),
           "rn": encode_indices(rank_node)}
    if error is not None:
        out["error"] = error
    return (json.dumps(out, separators=(",", ":")).encode(),
            zlib.compress(json.dumps(list(nodes)).encode(), 9))


def _parse(text: bytes, store: Any) -> Layout:
    d = json.loads(text)
    if d.get("error"):
        key, value, allowed = d["error"]
        raise VcgaConfigError(key, value, allowed)
    return Layout(tuple(BackendFacts(*f) for f in d["backends"]), decode_indices(d["rb"]), decode_indices(d["rn"]),
                  store)
