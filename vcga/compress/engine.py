"""The compression engine: where the slow hop is, and the compressed exchange across it.

:class:`Reducer` sums a flat gradient buffer over a process group, compressing only what crosses
the slow hop (scope ``bridge``) or the whole all_reduce (scope ``all``); :class:`Exchange` is the
compressed sum among one set of peers (:mod:`vcga.compress.exchange`). Both are driven by
:func:`vcga.compress.ddp_hook` and used directly by ``vcga verify``'s compression check.

Scope ``bridge`` (``docs/compression.md`` has the pictures):

1. **Islands** are the ranks that share a backend *and* a node (published by every rank at
   creation): inside one, links are the vendor's own (NVLink, HCCS, shared memory); between them
   runs the slow hop (the host bridge between vendors, Ethernet between nodes).
2. Islands of equal size k: the buffer is cut into k equal parts (element ranges; a compressor
   that needs shapes sees the parameters in its part, or their rows: :meth:`Reducer.pieces`); a
   **reduce-scatter inside each island** (exact, the vendor's library) leaves part i, summed over
   the island, on local rank i; the **local ranks i of all
   islands** (the shard peers) sum it across islands *compressed*; an **all-gather inside each
   island** copies the parts back. Every island link carries its share; the slow hop carries each
   part once, compressed, from every island in parallel (as the bridge's bandwidth algorithm).
3. Islands of different sizes: an exact all_reduce inside each island, the compressed exchange
   among the islands' first ranks, a broadcast inside each island.

Every rank ends with the same bits: each part is reduced once inside an island and copied, the
compressed exchange decodes the same payload bytes with the same fixed-order operations on every
peer (:mod:`vcga.compress.exact`), and the results are copied.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vcga.compress.exchange import Exchange, mix_seed
from vcga.compress.layout import Layout
from vcga.compress.meter import WireMeter
from vcga.compress.spec import CompressionSpec
from vcga.compress.topology import Topology, discover_layout
from vcga.contract import Combine, Compressor
from vcga.errors import VcgaConfigError
from vcga.pg.comm import all_gather_single, reduce_scatter_single

__all__ = ["Layout", "Topology", "Exchange", "Reducer", "Pending", "discover_layout", "mix_seed", "create_compressor"]

log = logging.getLogger(__name__)


def _finite_each(ts: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor: no NaN or infinity in it -- its extremes are finite (NaN propagates through
    both). Exact, where a sum could overflow, and one pass over each tensor; one transfer to the
    host for all of them (a device tensor's answer waits on the device)."""
    flags = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in ts if t.numel()]
    got = iter(torch.stack(flags).tolist() if flags else [])
    return [bool(next(got)) if t.numel() else True for t in ts]


def create_compressor(spec: CompressionSpec) -> Compressor:
    """The configured compressor a parsed spec names."""
    from vcga.plugin_manager import get_plugin_manager

    for _, cs in get_plugin_manager().compressors():
        if cs.name == spec.name:
            comp = cs.create(**dict(spec.options))
            if not isinstance(comp, Compressor):
                raise VcgaConfigError("compression", spec.text, f"compressor {spec.name!r} to create a "
                                      f"vcga.contract.Compressor (it created {type(comp).__name__})")
            if comp.server and (comp.combine is not Combine.GATHER or not comp.elementwise):
                raise VcgaConfigError("compression", spec.text, f"{spec.name}: a two-phase (server) exchange "
                                      "needs an element-wise GATHER compressor")
            return comp
    raise VcgaConfigError("compression", spec.text, "a registered compressor (see `vcga info`)")


# ===================================================================================================
# The compressed exchange among one set of peers
# ===================================================================================================


class CopyBack(enum.Enum):
    """How the decoded result of a :class:`Pending` gets back to the whole island."""

    NONE = "none"  #: nothing to copy: the island is this rank, or it holds the whole result already
    BROADCAST = "broadcast"  #: unequal layouts: the island's first rank exchanged, it broadcasts
    GATHER = "gather"  #: every island rank decoded its own part: the parts are all-gathered
    COMPACT = "compact"  #: as GATHER, but the compressor's compact form of each part travels


@dataclass
class Pending:
    """A buffer between :meth:`Reducer.begin` and :meth:`Reducer.finish`: the tensors its
    compressed exchange replaces (views into the buffer or its island part) and how the result
    gets back to the whole island (``after``)."""

    flat: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    keys: list[Any] = field(default_factory=list)
    exchange: bool = False
    after: CopyBack = CopyBack.NONE
    part: torch.Tensor | None = None
    cuts: list[int] = field(default_factory=list)
    width: int = 0
    direct: bool = True
    plan: Any = None
    #: after :meth:`Reducer.finish` with a divisor: the whole buffer holds the average already
    averaged: bool = False


class Reducer:
    """Sums flat gradient buffers over a process group, compressing where the spec says.

    Every rank of ``group`` must create it (collective unless a ``topology`` is given: see
    :meth:`Topology.build`; scope ``bridge`` needs the island and peer groups, which every rank of
    the job creates: on the default group, or on a subgroup through :meth:`Topology.build_job_wide`).

    :param spec: a parsed :class:`~vcga.compress.spec.CompressionSpec` (enabled).
    :param group: the process group (default: the default group).
    :param meter: count bytes per label ("island", "cross") at the transport.
    :param record: keep the last step's error-feedback records (checks).
    :param topology: the group's :class:`Topology`, to share one between reducers.
    """

    def __init__(self, spec: CompressionSpec, group: Any = None, *, meter: WireMeter | None = None,
                 record: bool = False, topology: Topology | None = None) -> None:
        self.spec = spec
        if group is None:
            group = dist.group.WORLD
        self.group = group
        self.size, self.rank = self.group.size(), dist.get_rank(self.group)
        self.compressor = create_compressor(spec)
        self.topology = topo = topology if topology is not None else Topology.build(self.group)
        self.layout = topo.layout
        # Scope bridge exchanges through island and peer groups, which every rank of the job must
        # create together (torch.distributed.new_group): on a subgroup -- DDP over the data-parallel
        # ranks of a job that also splits its model -- they exist only when the job created every
        # data-parallel group's at once (Topology.build_job_wide). Without them the default is ``all``.
        self.scope = spec.scope or ("bridge" if topo.bridged else "all")
        if self.scope == "bridge" and len(self.layout.islands) > 1 and not topo.bridged:
            raise VcgaConfigError("compression", spec.text, "scope=all (or no scope) on a subgroup, or pass "
                                  "data_parallel_groups= (every data-parallel group of the job, on every rank): "
                                  "scope=bridge creates island and peer groups, which every rank of the job must "
                                  f"join, and this group has {self.size} of {dist.get_world_size()} ranks")
        self.meter = meter
        self._attached: list[Any] = []
        self.island_group: Any = None
        self.island: tuple[int, ...] = (self.rank,)
        self.local = 0
        facts = self.layout.facts
        if self.scope == "bridge" and len(self.layout.islands) > 1:
            self.island, self.local, self.island_group = topo.island, topo.local, topo.island_group
            peers = len(topo.peers)
            peer = topo.peers.index(self.rank) if topo.peers else 0
            devices = {facts[r][2] for r in topo.peers}
            self.exchange = Exchange(self.compressor, topo.peer_group, peers, peer, seed=spec.seed, label="cross",
                                     meter=meter, record=record, host_decode=len(devices) > 1)
            self._attach(self.island_group, "island")
            self._attach(topo.peer_group, "cross")
        else:
            devices = {f[2] for f in facts}
            self.exchange = Exchange(self.compressor, self.group, self.size, self.rank, seed=spec.seed,
                                     label="cross", meter=meter, record=record, host_decode=len(devices) > 1)
            self._attach(self.group, "cross")
        # Does anything cross a link? Not in a world of one rank, nor with scope bridge on one
        # island (the island's exact reduction is then the whole sum). The same on every rank.
        self.crosses = len(self.layout.islands) > 1 if self.scope == "bridge" else self.size > 1
        self.step = 0
        #: Tensors whose sum came out non-finite, their compression state dropped (:meth:`_restart`).
        self.restarted = 0
        self._cut_cache: dict[Any, tuple[Any, Any, list[int]]] = {}
        self._rows: dict[Any, torch.Tensor] = {}  # the island all_to_all's receive buffer, per size
        self._a2a: dict[torch.dtype, bool] = {}
        self._compact_cache: dict[Any, Any] = {}

    def _island_all_to_all(self, dtype: torch.dtype) -> bool:
        """Does the island move ``dtype`` with all_to_all natively (its table says so; a group
        without a table, plain gloo, does)?"""
        got = self._a2a.get(dtype)
        if got is None:
            table = getattr(self.island_group, "capabilities", None)
            got = True
            if table is not None:
                from vcga import dtypes as _dtypes
                from vcga.contract import Collective, Support

                try:
                    got = table.lookup(Collective.ALL_TO_ALL, _dtypes.from_torch(dtype)).support is Support.NATIVE
                except Exception:  # noqa: BLE001 - a table that cannot answer: the library's reduce-scatter
                    got = False
            self._a2a[dtype] = got
        return got

    def _attach(self, group: Any, label: str) -> None:
        if self.meter is None or group is None:
            return
        cm = self.meter.attached(group, label)
        if cm.__enter__():
            self._attached.append(cm)
            if label == "cross":
                self.exchange._metered_at_transport = True
        else:
            cm.__exit__(None, None, None)

    def close(self) -> None:
        """Stop metering (the groups stay: torch destroys them with the default group)."""
        while self._attached:
            self._attached.pop().__exit__(None, None, None)

    # -- layout of a buffer ----------------------------------------------------------------------------

    @staticmethod
    def cuts(n: int, k: int, offsets: Sequence[int] | None) -> list[int]:
        """k + 1 cut points of ``n`` elements: equal ranges, or the allowed cut points (``offsets``,
        sorted) nearest to them."""
        if offsets is None:
            c = -(-n // k) if n else 0
            return [min(i * c, n) for i in range(k + 1)]
        cuts = [0]
        for i in range(1, k):
            target = i * n / k
            j = bisect.bisect_left(offsets, target)
            near = list(offsets[max(j - 1, 0):j + 1])
            best = min(near, key=lambda o: (abs(o - target), o)) if near else 0
            cuts.append(max(best, cuts[-1]))
        cuts.append(n)
        return cuts

    @staticmethod
    def offsets(shapes: Sequence[tuple[int, ...]]) -> list[int]:
        """Where each parameter starts in the flat buffer."""
        out, o = [], 0
        for s in shapes:
            out.append(o)
            o += math.prod(s)
        return out

    @staticmethod
    def pieces(shapes: Sequence[tuple[int, ...]], offsets: Sequence[int], a: int,
               b: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """The tensors a compressor that needs shapes sees for elements [a, b) of a bucket: (parameter
        index, start in the bucket, shape) -- whole parameters, or, where a part boundary cuts a
        matrix, its whole rows in the range as a matrix of their own (PowerSGD compresses it on its
        own at the spec's rank) and a cut row's elements as a 1-D piece (which travels as it is).

        Parts are equal element ranges, so the reduce-scatter and all-gather inside an island move
        the bucket without a copy, and every island rank compresses its share: cutting only between
        parameters would hand the whole of a bucket's one large matrix (DDP's usual bucket) to one
        rank and make the others pad their parts to its size."""
        out = []
        for j, (s, o) in enumerate(zip(shapes, offsets, strict=True)):
            n = math.prod(s)
            lo, hi = max(a, o), min(b, o + n)
            if hi <= lo:
                continue
            if (lo == o and hi == o + n) or len(s) < 2 or not s[0]:
                out.append((j, lo, tuple(s) if (lo == o and hi == o + n) else (hi - lo,)))
                continue
            row = n // s[0]
            r0 = o + -(-(lo - o) // row) * row  # the first row boundary at or after lo
            r1 = o + (hi - o) // row * row  # the last at or before hi
            if r1 <= r0:  # inside one row
                out.append((j, lo, (hi - lo,)))
                continue
            if lo < r0:
                out.append((j, lo, (r0 - lo,)))
            out.append((j, r0, ((r1 - r0) // row, *s[1:])))
            if r1 < hi:
                out.append((j, r1, (hi - r1,)))
        return out

    def _layout_of(self, n: int, shapes: Sequence[tuple[int, ...]] | None, k: int) -> tuple[Any, Any, list[int]]:
        """(shapes, offsets, cuts) of a bucket of ``n`` elements cut into ``k`` parts (cached: DDP
        hands the same buckets every step)."""
        key = (n, tuple(shapes) if shapes is not None else None, k)
        got = self._cut_cache.get(key)
        if got is None:
            if self.compressor.elementwise:
                got = (None, None, self.cuts(n, k, None))
            else:
                shapes = list(shapes) if shapes is not None else [(n,)]
                offsets = self.offsets(shapes)
                held = sum(math.prod(s) for s in shapes)
                if held != n:
                    raise ValueError(f"parameter shapes hold {held} elements, the buffer {n}")
                got = (shapes, offsets, self.cuts(n, k, None))
            self._cut_cache[key] = got
        return got

    def _views(self, buf: torch.Tensor, start: int, shapes: Sequence[tuple[int, ...]] | None,
               offsets: Sequence[int] | None, a: int, b: int) -> tuple[list[tuple[int, ...]], list[torch.Tensor]]:
        """The tensors the compressor sees for elements [a, b) of the bucket, living in ``buf`` at
        ``start``, with their keys' tails: one flat range ``(0,)``, or the parameters (pieces,
        :meth:`pieces`) in their shapes, ``(parameter index, start in the bucket)``."""
        if shapes is None or offsets is None:
            return ([(0,)], [buf[start:start + (b - a)]]) if b > a else ([], [])
        idx: list[tuple[int, ...]] = []
        out: list[torch.Tensor] = []
        for j, o, s in self.pieces(shapes, offsets, a, b):
            n = math.prod(s)
            if n:
                idx.append((j, o))
                out.append(buf[start + o - a:start + o - a + n].view(s))
        return idx, out

    def _compact_plan(self, n: int, shapes: Any, offsets: Any, cuts: list[int], k: int,
                      dtype: torch.dtype) -> list[tuple[int, list[tuple[int, tuple[int, ...], list[Any]]]]] | None:
        """How the island copies decoded parts back in the compressor's compact form
        (:meth:`~vcga.contract.Compressor.decoded_layout`): per part, its bytes and its pieces
        (start in the bucket, shape, the form's (shape, dtype) tensors); None when the compressor
        has no compact form or it would not be smaller than the part (cached per bucket layout)."""
        key = (n, tuple(shapes) if shapes is not None else None, k, dtype)
        if key in self._compact_cache:
            return self._compact_cache[key]
        from vcga import dtypes as _dtypes

        plan: list[tuple[int, list[tuple[int, tuple[int, ...], list[Any]]]]] | None = []
        c = self.compressor
        name = _dtypes.from_torch(dtype)
        if c.combine is not Combine.SUM or self.exchange.peers <= 1 or self.exchange.group is None:
            plan = None
        else:
            for j in range(k):
                a, b = cuts[j], cuts[j + 1]
                pieces = ([(a, (b - a,))] if b > a else []) if offsets is None else \
                    [(o, s) for _, o, s in self.pieces(shapes, offsets, a, b) if math.prod(s)]
                items, nbytes = [], 0
                for o, s in pieces:
                    lay = c.decoded_layout(tuple(s), name)
                    if lay is None:
                        plan = None
                        break
                    form = [(tuple(ts), _dtypes.to_torch(td)) for ts, td in lay]
                    nbytes += sum(math.prod(ts) * td.itemsize for ts, td in form)
                    items.append((o, tuple(s), form))
                if plan is None:
                    break
                plan.append((nbytes, items))
            if plan is not None and max(nb for nb, _ in plan) >= max(cuts[j + 1] - cuts[j] for j in range(k)) * \
                    dtype.itemsize:
                plan = None  # no smaller than the decoded values: copy those
        self._compact_cache[key] = plan
        return plan

    def _compact_all_gather(self, per: list[tuple[Pending, list[list[torch.Tensor]]]], divisor: float = 1.0) -> None:
        """Every island rank gets every part's compact form (of every buffer in ``per``, in one
        all-gather) and rebuilds the others' parts in place (its own is there already): the same
        bytes through the same element-wise operations on the same kind of device as the part's
        owner decoded them -- the same bits."""
        from vcga.compress.exchange import _as_bytes, _from_bytes

        device = per[0][0].flat.device
        widths = [max(nb for nb, _ in p.plan) for p, _ in per]
        mine: list[torch.Tensor] = []
        for (_, forms), width in zip(per, widths, strict=True):
            got = [_as_bytes(t.to(device)) for form in forms for t in form]
            pad = width - sum(t.numel() for t in got)
            mine.extend(got)
            if pad:
                mine.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        total = sum(widths)
        blob = torch.cat(mine) if len(mine) > 1 else mine[0]
        k = len(self.island)
        rows = torch.empty(k * total, dtype=torch.uint8, device=device)
        all_gather_single(rows, blob, group=self.island_group)
        dev = torch.device("cpu") if self.exchange.host_decode else device
        rows = rows.view(k, total)
        base = 0
        for (p, _), width in zip(per, widths, strict=True):
            for j, (_, items) in enumerate(p.plan):
                if j == self.local:
                    continue
                off = base
                for o, s, lay in items:
                    form = []
                    for ts, td in lay:
                        nb = math.prod(ts) * td.itemsize
                        form.append(_from_bytes(rows[j, off:off + nb], torch.empty(ts, dtype=td)).to(dev))
                        off += nb
                    view = p.flat[o:o + math.prod(s)].view(s)
                    # the owner's bits (Exchange.run): divided within the expansion where the
                    # compressor folds it there, else the expanded value divided
                    if (divisor != 1 and dev == device and not self.exchange.host_decode
                            and self.compressor.expand_divided(form, s, view, divisor)):
                        continue
                    if dev == device and divisor == 1:
                        self.compressor.expand(form, s, out=view)
                    else:
                        whole = self.compressor.expand(form, s)
                        view.copy_((whole / divisor if divisor != 1 else whole).to(device))
            base += width

    # -- the reduction ---------------------------------------------------------------------------------

    def all_reduce(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]] | None = None,
                   key: Any = 0, compress: bool = True) -> None:
        """Sum ``flat`` (1-D, contiguous) over the group, in place. ``shapes``: the parameters laid out
        in it, in order (a compressor that needs shapes gets them; default: one flat tensor)."""
        if not compress:
            dist.all_reduce(flat, group=self.group)
            return
        self.finish([self.begin(flat, shapes, key)])

    def begin(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]] | None = None, key: Any = 0) -> Pending:
        """The first stage of a compressed sum of ``flat``: the exact reduction inside the island.
        :meth:`finish` does the rest for one or more begun buffers at once -- one compressed
        exchange for all of them (two collectives across the slow hop for PowerSGD, however many
        buffers) and one copy back. Collective: every rank begins and finishes the same buffers
        (keys) in the same order."""
        n = flat.numel()
        k = len(self.island) if self.scope == "bridge" and len(self.layout.islands) > 1 and self.layout.equal else 1
        shapes, offsets, cuts = self._layout_of(n, shapes, k)
        if self.scope == "all" or len(self.layout.islands) < 2:
            if self.scope == "bridge":  # one island: nothing crosses a slow hop
                dist.all_reduce(flat, group=self.group)
                return Pending(flat)
            return self._pending(flat, flat, shapes, offsets, 0, n, key, 0)
        if not self.layout.equal:
            if self.island_group is not None:
                dist.all_reduce(flat, group=self.island_group)
            p = self._pending(flat, flat, shapes, offsets, 0, n, key, 0) if self.local == 0 else Pending(flat)
            p.after = CopyBack.BROADCAST if self.island_group is not None else CopyBack.NONE
            return p
        k = len(self.island)
        if k == 1:
            return self._pending(flat, flat, shapes, offsets, 0, n, key, 0)
        width = max(cuts[i + 1] - cuts[i] for i in range(k)) if k else 0
        a, b = cuts[self.local], cuts[self.local + 1]
        direct = all(cuts[i + 1] - cuts[i] == width for i in range(k))
        if direct:
            send = flat
        else:
            send = flat.new_zeros(k * width)
            for i in range(k):
                send[i * width:i * width + cuts[i + 1] - cuts[i]] = flat[cuts[i]:cuts[i + 1]]
        part = flat.new_empty(width)
        self._island_reduce_scatter(part, send, k)  # exact, inside the island
        p = self._pending(flat, part, shapes, offsets, a, b, key, self.local)
        p.plan = self._compact_plan(n, shapes, offsets, cuts, k, flat.dtype)
        p.after = CopyBack.COMPACT if p.plan is not None else CopyBack.GATHER
        p.part, p.cuts, p.width, p.direct = part, cuts, width, direct
        return p

    def release_residuals(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]] | None, key: Any) -> int:
        """Add this rank's error-feedback residuals of the buffer ``key`` into ``flat`` and drop the
        buffer's compression state: it is about to be reduced plainly (``when=auto`` turned its
        compression off), and what compression held back goes with that sum instead of being lost.
        Each residual sits where its tensor does in the buffer (a part's range, a parameter's
        offset, a two-phase chunk), so the plain sum over the group adds every residual once --
        each is held by one rank (a part's residual by that part's rank in each island, as the part
        was the island's sum). Returns how many residuals were added."""
        n = flat.numel()
        k = len(self.island) if self.scope == "bridge" and len(self.layout.islands) > 1 and self.layout.equal else 1
        _, _, cuts = self._layout_of(n, shapes, k)
        added = 0
        for skey, slot in list(self.exchange.slots.items()):
            if not (isinstance(skey, tuple) and skey and skey[0] == key):
                continue
            tail = skey[2:]
            start = cuts[skey[1]] if tail == (0,) else tail[1]  # a part's flat range, or a piece's offset
            if slot.ef is not None and (res := slot.ef.residual()) is not None:
                flat[start:start + res.numel()] += res.reshape(-1).to(flat.device, flat.dtype)
                added += 1
                size = res.numel()
            else:
                size = cuts[skey[1] + 1] - cuts[skey[1]] if tail == (0,) else 0
            for j, (_, ef) in slot.server.items():  # a two-phase exchange: the chunk this rank served
                if ef is not None and (res := ef.residual()) is not None and size:
                    a = self.exchange._chunks(size)[j][0]
                    flat[start + a:start + a + res.numel()] += res.reshape(-1).to(flat.device, flat.dtype)
                    added += 1
        self.exchange.forget(lambda kk: not (isinstance(kk, tuple) and kk and kk[0] == key))
        return added

    def _pending(self, flat: torch.Tensor, buf: torch.Tensor, shapes: Any, offsets: Any, a: int, b: int,
                 key: Any, part: int) -> Pending:
        idx, views = self._views(buf, 0, shapes, offsets, a, b)
        return Pending(flat, views, [(key, part, *j) for j in idx], exchange=True)

    def finish(self, pending: Sequence[Pending], divisor: float = 1.0) -> None:
        """The compressed exchange of every begun buffer in ``pending`` at once, and the copy back
        inside the island (see :meth:`begin`). ``divisor``: divide the sums by it (an average) where
        the exchange decodes them -- folded into the decode where the compressor can -- and mark
        each buffer that holds the average whole (:attr:`Pending.averaged`); the others hold the
        sum."""
        views = [v for p in pending for v in p.views]
        keys = [kk for p in pending for kk in p.keys]
        compact = [p for p in pending if p.after is CopyBack.COMPACT]
        forms: list[list[torch.Tensor]] | None = None
        if any(p.exchange for p in pending):
            forms = self.exchange.run(views, keys, self.step, forms=bool(compact), divisor=divisor)
        if compact and forms is None:  # the exchange had nothing to say: copy the values back
            for p in compact:
                p.after = CopyBack.GATHER
            compact = []
        if compact:
            assert forms is not None
            at, per = 0, []
            for p in pending:
                if p.after is CopyBack.COMPACT:
                    per.append((p, forms[at:at + len(p.views)]))
                at += len(p.views)
            for p, _ in per:  # this rank's part: decoded in place by the exchange
                a, b = p.cuts[self.local], p.cuts[self.local + 1]
                p.flat[a:b].copy_(p.part[:b - a])  # type: ignore[index]
            self._compact_all_gather(per, divisor)
        for p in pending:
            if p.after is CopyBack.BROADCAST:
                dist.broadcast(p.flat, src=self.topology.ranks[self.island[0]], group=self.island_group)
            elif p.after is CopyBack.GATHER:
                assert p.part is not None  # a GATHER copy-back always has its part
                k = len(self.island)
                if p.direct:
                    all_gather_single(p.flat, p.part, group=self.island_group)
                else:
                    rows = p.flat.new_empty(k * p.width)
                    all_gather_single(rows, p.part, group=self.island_group)
                    for i in range(k):
                        p.flat[p.cuts[i]:p.cuts[i + 1]] = rows[i * p.width:i * p.width + p.cuts[i + 1] - p.cuts[i]]
        for p in pending:  # what an exchange divided (this rank's, or its island leader's), or copies of it
            p.averaged = p.exchange or p.after is not CopyBack.NONE
        sums = [(key, view) for p in pending for key, view in zip(p.keys, p.views, strict=True)]  # this rank's share
        told = [self.exchange.decoded_finite(key) for key, _ in sums]  # the compressor knows, or read it
        read = iter(_finite_each([v for (_, v), t in zip(sums, told, strict=True) if t is None]))
        dropped = [key for (key, _), t in zip(sums, told, strict=True) if not (t if t is not None else next(read))]
        if dropped:
            self._restart(dropped)

    def _restart(self, keys: list[Any]) -> None:
        """Drop the compression state of tensors whose sum is not finite.

        An overflow (one rank's inf or NaN, routine in float16 training: torch.amp's GradScaler then
        skips the step and lowers its scale) would stay in every error-feedback residual and
        PowerSGD warm start it reached -- ``inf - inf`` is NaN -- and every later sum of those
        tensors would be NaN: training could not recover (torch's powerSGD_hook cannot). Their state
        starts afresh instead, as at a job's first step; this sum stays non-finite, so the overflow
        is still seen. Each tensor's sum is the same bits on every rank that holds its state (its
        peers), so they decide alike (PowerSGD's peers keep one Q). Only this rank's share is read."""
        drop = set(keys)
        self.exchange.forget(lambda k: k not in drop)
        self.restarted += len(drop)
        log.info("%d compressed sums were not finite (an overflow): their residuals and warm starts start afresh",
                 len(drop))

    def _island_reduce_scatter(self, part: torch.Tensor, send: torch.Tensor, k: int) -> None:
        """``part`` = this rank's chunk of ``send`` summed over the island, the same bits wherever
        it is read (each chunk is summed once, on its owner; the all-gather copies it).

        On the host (CPU tensors: gloo, or a vendor stand-in over it) as an all_to_all and a sum
        of the k rows in island-rank order: gloo's reduce_scatter clones its input and all-reduces
        the clone, so it costs more than its all_reduce of the same bytes, and an all_to_all less.
        A device library's own reduce-scatter (NCCL, HCCL) is used as it is."""
        if part.device.type != "cpu" or not self._island_all_to_all(part.dtype):
            reduce_scatter_single(part, send, group=self.island_group)
            return
        rows = self._rows.get((send.numel(), send.dtype))
        if rows is None:
            rows = self._rows[(send.numel(), send.dtype)] = torch.empty_like(send)
        dist.all_to_all_single(rows, send, group=self.island_group)
        r = rows.view(k, -1)
        torch.add(r[0], r[1], out=part)
        for i in range(2, k):  # left to right in island-rank order
            part.add_(r[i])

    def declared_cross_sent(self, n: int, shapes: Sequence[tuple[int, ...]] | None, dtype: str,
                            local: int | None = None) -> float:
        """Bytes local rank ``local`` (default: this rank's) is declared to send across the slow hop
        for a buffer of ``n`` elements."""
        local = self.local if local is None else local
        if self.scope == "bridge" and len(self.layout.islands) > 1 and self.layout.equal and len(self.island) > 1:
            shapes_, offsets, cuts = self._layout_of(n, shapes, len(self.island))
            a, b = cuts[local], cuts[local + 1]
            if offsets is None:
                return self.exchange.declared_sent([(b - a,)] if b > a else [], dtype)
            return self.exchange.declared_sent([s for _, _, s in self.pieces(shapes_, offsets, a, b)], dtype)
        if self.scope == "bridge" and len(self.layout.islands) > 1 and not self.layout.equal and local != 0:
            return 0.0
        if self.compressor.elementwise:
            return self.exchange.declared_sent([(n,)], dtype)
        return self.exchange.declared_sent(list(shapes or [(n,)]), dtype)
