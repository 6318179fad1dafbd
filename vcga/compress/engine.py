"""The compression engine: where the slow hop is, and the compressed exchange across it.

:class:`Reducer` sums a flat gradient buffer over a process group, compressing only what crosses
the slow hop (scope ``bridge``) or the whole all_reduce (scope ``all``); :class:`Exchange` is the
compressed sum among one set of peers. Both are driven by :func:`vcga.compress.ddp_hook` and used
directly by ``vcga verify``'s compression check.

Scope ``bridge`` (``docs/compression.md`` has the pictures):

1. **Islands** are the ranks that share a backend *and* a node (published by every rank at
   creation): inside one, links are the vendor's own (NVLink, HCCS, shared memory); between them
   runs the slow hop (the host bridge between vendors, Ethernet between nodes).
2. Islands of equal size k: the buffer is cut into k parts (element ranges; whole parameters for a
   compressor that needs shapes); a **reduce-scatter inside each island** (exact, the vendor's
   library) leaves part i, summed over the island, on local rank i; the **local ranks i of all
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

import logging
import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vcga.contract import Combine, CompressContext, Compressor, Support
from vcga.compress.ef import ErrorFeedback, Scratch
from vcga.compress.layout import Layout, chunks, declared_sent
from vcga.compress.meter import WireMeter
from vcga.compress.spec import CompressionSpec
from vcga.errors import VcgaConfigError, VcgaError

__all__ = ["Layout", "Topology", "Exchange", "Reducer", "discover_layout", "mix_seed", "create_compressor"]

log = logging.getLogger(__name__)


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed from integers and strings (splitmix64 over a stable hash): the same on every rank."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        v = p if isinstance(p, int) else int.from_bytes(str(p).encode()[:32].ljust(8, b"\0")[:8], "little") ^ len(str(p))
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


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
# Layout: islands and the slow hop
# ===================================================================================================


def _backend_name(group: Any) -> str:
    transport = getattr(group, "transport", None)
    backend = getattr(transport, "backend", None)
    if backend is not None and hasattr(backend, "name"):
        return str(backend.name)
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a group torch does not know by name
        return type(group).__name__


def _device_type(group: Any) -> str:
    transport = getattr(group, "transport", None)
    dt = getattr(getattr(transport, "backend", None), "device_type", None)
    return str(dt) if dt else "cpu"


def discover_layout(group: Any) -> Layout:
    """Every rank's (backend, node, device type), gathered over ``group`` (collective)."""
    mine = (_backend_name(group), socket.gethostname(), _device_type(group))
    facts: list[Any] = [None] * group.size()
    dist.all_gather_object(facts, mine, group=group)
    return Layout.from_facts(facts)


# ===================================================================================================
# The compressed exchange among one set of peers
# ===================================================================================================


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _from_bytes(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # clone: a slice of the byte buffer may not be aligned for the payload's dtype
    return buf.clone().view(like.dtype).reshape(like.shape) if like.numel() else torch.empty_like(like)


@dataclass
class _Slot:
    """Per-tensor state kept across steps: the compressor's dict and the error-feedback residuals.

    The two-phase exchange adds the compressor's state of each chunk (``chunks``) and, for the
    chunk this rank serves, the server's state and residual (``server``)."""

    state: dict[str, Any] = field(default_factory=dict)
    ef: ErrorFeedback | None = None
    chunks: dict[int, dict[str, Any]] = field(default_factory=dict)
    server: dict[int, tuple[dict[str, Any], ErrorFeedback | None]] = field(default_factory=dict)


class Exchange:
    """Sums tensors over ``peers`` ranks (a process group), compressed, in place.

    :param compressor: the configured compressor.
    :param group: the process group of the peers (None: nothing to exchange, one peer).
    :param peers: how many; :param peer: this rank's index among them.
    :param label: the meter's label for this exchange's bytes.
    :param meter: a :class:`~vcga.compress.meter.WireMeter`, or None.
    :param record: keep the last step's error-feedback records (checks read them).
    :param host_decode: decode on the host (the peers' devices differ: host arithmetic is IEEE on all).
    """

    def __init__(self, compressor: Compressor, group: Any, peers: int, peer: int, *, seed: int = 0,
                 label: str = "cross", meter: WireMeter | None = None, record: bool = False,
                 host_decode: bool = False) -> None:
        self.c, self.group, self.peers, self.peer = compressor, group, peers, peer
        self.seed, self.label, self.meter, self.record = seed, label, meter, record
        self.host_decode = host_decode
        self.slots: dict[Any, _Slot] = {}
        self._scratch = Scratch()  # shared by the residuals: they are updated one after another
        self._metered_at_transport = False
        self._table = getattr(group, "capabilities", None) if group is not None else None

    # -- collectives (counted here when the transport cannot be) -----------------------------------

    def _count(self, kind: str, nbytes: int) -> None:
        if self.meter is not None and not self._metered_at_transport:
            self.meter.count(self.label, kind, nbytes, self.peers)

    def _all_reduce(self, t: torch.Tensor) -> None:
        self._count("all_reduce", t.numel() * t.element_size())
        dist.all_reduce(t, group=self.group)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._count("all_gather", inp.numel())
        dist.all_gather_into_tensor(out, inp, group=self.group)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        self._count("all_to_all", inp.numel())
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _sums_natively(self, dtype: torch.dtype) -> bool:
        """Can the group sum this payload dtype natively (so the library moves it as it is)?"""
        from vcga import dtypes as _dtypes
        from vcga.contract import Collective, ReduceOp

        if self._table is not None:
            try:
                cell = self._table.lookup(Collective.ALL_REDUCE, _dtypes.from_torch(dtype), ReduceOp.SUM)
            except Exception:  # noqa: BLE001 - a dtype VCGA has no name for
                return False
            return cell.support is Support.NATIVE
        return dtype in (torch.float32, torch.float64)

    # -- bookkeeping ---------------------------------------------------------------------------------

    def slot(self, key: Any) -> _Slot:
        s = self.slots.get(key)
        if s is None:
            s = self.slots[key] = _Slot(ef=ErrorFeedback(record=self.record, scratch=self._scratch)
                                        if self.c.error_feedback else None)
        return s

    def records(self) -> list[tuple[Any, str, Any]]:
        """The last step's error-feedback records (``record=True``): (key, "worker" or "server j", record)."""
        out = []
        for k, slot in self.slots.items():
            if slot.ef is not None and slot.ef.last is not None:
                out.append((k, "worker", slot.ef.last))
            for j, (_, ef) in slot.server.items():
                if ef is not None and ef.last is not None:
                    out.append((k, f"server {j}", ef.last))
        return out

    def forget(self, keep: Callable[[Any], bool]) -> None:
        """Drop the state of keys no longer used (DDP rebuilt its buckets)."""
        for k in [k for k in self.slots if not keep(k)]:
            del self.slots[k]

    def ctx(self, key: Any, step: int, role: str = "worker") -> CompressContext:
        return CompressContext(self.peers, self.peer, step, mix_seed(self.seed, repr(key)), role)

    # -- the exchange --------------------------------------------------------------------------------

    def run(self, tensors: Sequence[torch.Tensor], keys: Sequence[Any], step: int) -> None:
        """Replace each tensor by its sum over the peers (decoded from the compressed payloads)."""
        if self.peers <= 1 or self.group is None:
            return
        xs = []
        for t, k in zip(tensors, keys):
            slot = self.slot(k)
            xs.append(slot.ef.input(t) if slot.ef is not None else t)
        if self.c.combine is Combine.SUM:
            outs = self._run_sum(xs, keys, step)
        elif self.c.server:
            outs = self._run_two_phase(xs, keys, step)
        else:
            outs = self._run_gather(xs, keys, step)
        for t, o in zip(tensors, outs):
            t.copy_(o.reshape(t.shape))

    def _decode_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.host_decode else t

    def _run_sum(self, xs: list[torch.Tensor], keys: Sequence[Any], step: int) -> list[torch.Tensor]:
        c = self.c
        out: list[torch.Tensor | None] = [None] * len(xs)
        last_payload: list[list[torch.Tensor]] = [[] for _ in xs]
        pending = list(range(len(xs)))
        for rnd in range(c.rounds):
            if not pending:
                break
            payloads = {i: c.compress(xs[i], self.slot(keys[i]).state, self.ctx(keys[i], step), rnd) for i in pending}
            for i in pending:
                last_payload[i] = payloads[i]
            summed = self._sum_payloads(payloads)
            for i in pending:
                got = c.decompress(summed[i], self.slot(keys[i]).state, self.ctx(keys[i], step), rnd)
                if got is not None:
                    out[i] = got
            pending = [i for i in pending if out[i] is None]
        if pending:
            raise VcgaError(f"compressor {type(c).__name__} decoded nothing for {len(pending)} tensor(s) after "
                            f"its {c.rounds} round(s)")
        for i, k in enumerate(keys):
            slot = self.slot(k)
            if slot.ef is not None:
                slot.ef.update(xs[i], c.sent(xs[i], last_payload[i], slot.state, self.ctx(k, step)))
        return [o.to(xs[i].device) for i, o in enumerate(out)]  # type: ignore[union-attr]

    def _sum_payloads(self, payloads: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Each payload tensor summed over the peers, element by element, the same bits on every peer.

        Payload tensors of one dtype travel as one buffer: summed by the library where the group sums
        that dtype natively (its result is one reduction, copied to every rank), else gathered as bytes
        and added in peer order here (floats narrower than float32 in float32)."""
        by_dtype: dict[torch.dtype, list[tuple[int, int]]] = {}
        for i, pl in payloads.items():
            for j, t in enumerate(pl):
                by_dtype.setdefault(t.dtype, []).append((i, j))
        result = {i: [torch.empty(0)] * len(pl) for i, pl in payloads.items()}
        for dtype, where in by_dtype.items():
            flat = torch.cat([payloads[i][j].reshape(-1) for i, j in where])
            if flat.numel() == 0:
                summed = flat
            elif self._sums_natively(dtype):
                self._all_reduce(flat)
                summed = self._decode_device(flat)
            else:
                raw = _as_bytes(flat)
                rows = torch.empty(self.peers * raw.numel(), dtype=torch.uint8, device=raw.device)
                self._all_gather(rows, raw)
                vals = self._decode_device(rows).view(self.peers, -1).view(dtype)
                acc = torch.float32 if dtype.is_floating_point and torch.finfo(dtype).bits < 32 else dtype
                summed = vals[0].to(acc)
                for p in range(1, self.peers):  # left to right in peer order
                    summed = summed + vals[p].to(acc)
            off = 0
            for i, j in where:
                n = payloads[i][j].numel()
                result[i][j] = summed[off:off + n].reshape(payloads[i][j].shape)
                off += n
        return result

    def _pack(self, payload: list[torch.Tensor]) -> torch.Tensor:
        parts = [_as_bytes(t) for t in payload]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, off = [], 0
        for t in like:
            n = t.numel() * t.element_size()
            out.append(_from_bytes(buf[off:off + n], t))
            off += n
        return out

    def _run_gather(self, xs: list[torch.Tensor], keys: Sequence[Any], step: int) -> list[torch.Tensor]:
        c = self.c
        payloads = [c.compress(x, self.slot(k).state, self.ctx(k, step)) for x, k in zip(xs, keys)]
        packed = [self._pack(pl) for pl in payloads]
        sizes = [p.numel() for p in packed]
        mine = torch.cat(packed) if packed else torch.empty(0, dtype=torch.uint8)
        rows = torch.empty(self.peers * mine.numel(), dtype=torch.uint8, device=mine.device)
        self._all_gather(rows, mine)
        rows = self._decode_device(rows).view(self.peers, -1)
        outs = []
        off = 0
        for i, (x, k) in enumerate(zip(xs, keys)):
            slot = self.slot(k)
            like = [self._decode_device(t) for t in payloads[i]]
            total = None
            for p in range(self.peers):  # decode each peer's payload, add in peer order
                pl = self._unpack(rows[p, off:off + sizes[i]], like)
                dec = c.decompress(pl, slot.state, self.ctx(k, step)).reshape(-1)
                if p == self.peer and slot.ef is not None:
                    slot.ef.update(x, dec.to(x.device).reshape(x.shape))
                total = dec if total is None else total + dec
            off += sizes[i]
            outs.append(total.to(x.device))  # type: ignore[union-attr]
        return outs

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return chunks(n, self.peers)

    def _run_two_phase(self, xs: list[torch.Tensor], keys: Sequence[Any], step: int) -> list[torch.Tensor]:
        """1-bit Adam's compressed allreduce, for any element-wise GATHER compressor: worker payloads
        of chunk j go to peer j (all_to_all); peer j decodes and adds them in peer order, compresses
        the sum again with its server-side error feedback; the server payloads are all-gathered."""
        c, P, me = self.c, self.peers, self.peer
        flat = [x.reshape(-1) for x in xs]
        bounds = [self._chunks(f.numel()) for f in flat]
        # phase 1: worker payloads, chunk j of every tensor to peer j
        work: list[list[list[torch.Tensor]]] = []  # [tensor][chunk] -> payload
        for f, k, bs in zip(flat, keys, bounds):
            slot = self.slot(k)
            work.append([c.compress(f[a:b], slot.chunks.setdefault(j, {}), self.ctx((k, j), step))
                         if b > a else [] for j, (a, b) in enumerate(bs)])
        send_parts, in_splits = [], []
        for j in range(P):
            part = [self._pack(work[i][j]) for i in range(len(flat))]
            send_parts.extend(part)
            in_splits.append(sum(p.numel() for p in part))
        mine_sizes = [self._pack(work[i][me]).numel() for i in range(len(flat))]
        dev = flat[0].device if flat else torch.device("cpu")
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8, device=dev)
        recv = torch.empty(P * sum(mine_sizes), dtype=torch.uint8, device=send.device)
        self._all_to_all(recv, send, [sum(mine_sizes)] * P, in_splits)
        recv = self._decode_device(recv).view(P, -1) if recv.numel() else recv.view(P, 0)
        # worker error feedback: what this rank sent is its own payloads, decoded
        for i, (x, k) in enumerate(zip(xs, keys)):
            slot = self.slot(k)
            if slot.ef is not None:
                sent = torch.zeros_like(flat[i])
                for j, (a, b) in enumerate(bounds[i]):
                    if b > a:
                        st = slot.chunks[j]
                        sent[a:b] = c.decompress(work[i][j], st, self.ctx((k, j), step)).reshape(-1).to(sent.device)
                slot.ef.update(x, sent.reshape(x.shape))
        # the server: decode and add chunk `me` of every peer, compress the sum again
        server_payloads, off = [], 0
        for i, k in enumerate(keys):
            a, b = bounds[i][me]
            if b <= a:
                server_payloads.append([])
                continue
            slot = self.slot(k)
            st, ef = slot.server.setdefault(me, ({}, ErrorFeedback(record=self.record, scratch=self._scratch)
                                                     if c.error_feedback else None))
            like = [self._decode_device(t) for t in work[i][me]]
            total = None
            wst = slot.chunks[me]  # chunk me's worker state: the peers' payloads have its shape
            for p in range(P):
                dec = c.decompress(self._unpack(recv[p, off:off + mine_sizes[i]], like), wst,
                                   self.ctx((k, me), step)).reshape(-1)
                total = dec if total is None else total + dec
            off += mine_sizes[i]
            y = total.to(flat[i].device)  # type: ignore[union-attr]
            ys = ef.input(y) if ef is not None else y
            ctx = self.ctx((k, me), step, "server")
            pl = c.compress(ys, st, ctx)
            if ef is not None:
                ef.update(ys, c.decompress([self._decode_device(t) for t in pl], st, ctx).reshape(-1).to(ys.device))
            server_payloads.append(pl)
        # phase 2: all-gather the server payloads (padded to the largest chunk's)
        width = [[self._pack(work[i][j]).numel() for j in range(P)] for i in range(len(flat))]
        row = max((sum(w[j] for w in width) for j in range(P)), default=0)
        mine = torch.cat([self._pack(pl) for pl in server_payloads] +
                         [torch.zeros(row - sum(w[me] for w in width), dtype=torch.uint8, device=dev)])
        rows = torch.empty(P * row, dtype=torch.uint8, device=mine.device)
        self._all_gather(rows, mine)
        rows = self._decode_device(rows).view(P, -1) if rows.numel() else rows.view(P, 0)
        outs = []
        for i, k in enumerate(keys):
            out = torch.zeros_like(self._decode_device(flat[i]))
            for j, (a, b) in enumerate(bounds[i]):
                if b <= a:
                    continue
                start = sum(width[q][j] for q in range(i))
                like = [self._decode_device(t) for t in work[i][j]]
                pl = self._unpack(rows[j, start:start + width[i][j]], like)
                st = self.slot(k).chunks[j]  # chunk j's worker state: same chunk, same shape
                out[a:b] = c.decompress(pl, st, self.ctx((k, j), step, "server")).reshape(-1)
            outs.append(out.to(flat[i].device))
        return outs

    # -- what the exchange declares ------------------------------------------------------------------

    def declared_sent(self, shapes: Sequence[tuple[int, ...]], dtype: str) -> float:
        """Bytes this rank sends for tensors of ``shapes``, from the compressor's declared payload
        sizes and this exchange's collectives (the meter's factors)."""
        native = self.c.combine is Combine.SUM and self._payload_summed_natively(dtype)
        return declared_sent(self.c, shapes, dtype, self.peers, native)

    def _payload_summed_natively(self, dtype: str) -> bool:
        # the dtype of a SUM compressor's payload is what its compress returns; probe with a tiny tensor
        from vcga import dtypes as _dtypes

        x = torch.zeros(2, 2, dtype=_dtypes.to_torch(dtype))
        pl = self.c.compress(x, {}, CompressContext(self.peers, self.peer, 0, 0), 0)
        return all(self._sums_natively(t.dtype) for t in pl)


# ===================================================================================================
# The reducer: islands, parts, the exchange
# ===================================================================================================


@dataclass
class Topology:
    """A group's layout and the subgroups scope ``bridge`` exchanges through (made once, shared by
    every :class:`Reducer` of the group: creating groups is collective and not free).

    :ivar island_group: this rank's island (None when it has one rank).
    :ivar peer_group: this rank's set of peers across islands (None when it exchanges nothing).
    """

    group: Any
    layout: Layout
    rank: int
    island: tuple[int, ...]
    local: int
    island_group: Any = None
    peer_group: Any = None
    peers: tuple[int, ...] = ()

    @classmethod
    def build(cls, group: Any = None) -> Topology:
        """Gather the layout over ``group`` (collective); with more than one island on the default
        group, create the island and peer groups (every rank of the job creates every group, in the
        same order, as ``torch.distributed.new_group`` requires)."""
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        layout = discover_layout(group)
        island = layout.island_of(rank)
        topo = cls(group, layout, rank, island, island.index(rank))
        if len(layout.islands) > 1 and dist.get_world_size() == group.size():
            for isl in layout.islands:
                g = dist.new_group(list(isl)) if len(isl) > 1 else None
                if rank in isl:
                    topo.island_group = g
            for ps in layout.peer_sets():
                g = dist.new_group(list(ps))
                if rank in ps:
                    topo.peer_group, topo.peers = g, ps
        return topo


class Reducer:
    """Sums flat gradient buffers over a process group, compressing where the spec says.

    Every rank of ``group`` must create it (collective unless a ``topology`` is given: see
    :meth:`Topology.build`; scope ``bridge`` needs the default group, whose ranks all create the
    subgroups).

    :param spec: a parsed :class:`~vcga.compress.spec.CompressionSpec` (enabled).
    :param group: the process group (default: the default group).
    :param meter: count bytes per label ("island", "cross") at the transport.
    :param record: keep the last step's error-feedback records (checks).
    :param topology: the group's :class:`Topology`, to share one between reducers.
    """

    def __init__(self, spec: CompressionSpec, group: Any = None, *, meter: WireMeter | None = None,
                 record: bool = False, topology: Topology | None = None) -> None:
        self.spec = spec
        self.group = group if group is not None else dist.group.WORLD
        self.size, self.rank = self.group.size(), dist.get_rank(self.group)
        self.compressor = create_compressor(spec)
        self.topology = topo = topology if topology is not None else Topology.build(self.group)
        self.layout = topo.layout
        self.scope = spec.scope or ("bridge" if len(self.layout.islands) > 1 else "all")
        self.meter = meter
        self._attached: list[Any] = []
        self.island_group: Any = None
        self.island: tuple[int, ...] = (self.rank,)
        self.local = 0
        facts = self.layout.facts
        if self.scope == "bridge" and len(self.layout.islands) > 1:
            if dist.get_world_size() != self.size:
                raise VcgaConfigError("compression", spec.text, "scope=bridge on the default group (it creates the "
                                      "island and peer groups, which every rank of the job must join); use scope=all "
                                      "on a subgroup")
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
        self.step = 0

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
        """k + 1 cut points of ``n`` elements: equal ranges, or parameter boundaries nearest to them."""
        if offsets is None:
            c = -(-n // k) if n else 0
            return [min(i * c, n) for i in range(k + 1)]
        cuts = [0]
        for i in range(1, k):
            target = i * n / k
            best = min(offsets, key=lambda o: (abs(o - target), o))
            cuts.append(max(best, cuts[-1]))
        cuts.append(n)
        return cuts

    def _views(self, buf: torch.Tensor, start: int, shapes: Sequence[tuple[int, ...]] | None,
               offsets: Sequence[int] | None, a: int, b: int) -> tuple[list[int], list[torch.Tensor]]:
        """The tensors the compressor sees for elements [a, b) of the bucket, living in ``buf`` at
        ``start``, with their indices: one flat range, or the parameters (non-empty) in their shapes."""
        if shapes is None or offsets is None:
            return ([0], [buf[start:start + (b - a)]]) if b > a else ([], [])
        idx, out = [], []
        for j, (s, o) in enumerate(zip(shapes, offsets)):
            n = math.prod(s)
            if a <= o and o + n <= b and n:
                idx.append(j)
                out.append(buf[start + o - a:start + o - a + n].view(s))
        return idx, out

    def _exchange(self, buf: torch.Tensor, shapes: Any, offsets: Any, a: int, b: int, key: Any, part: int) -> None:
        idx, views = self._views(buf, 0, shapes, offsets, a, b)
        self.exchange.run(views, [(key, part, j) for j in idx], self.step)

    # -- the reduction ---------------------------------------------------------------------------------

    def all_reduce(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]] | None = None,
                   key: Any = 0, compress: bool = True) -> None:
        """Sum ``flat`` (1-D, contiguous) over the group, in place. ``shapes``: the parameters laid out
        in it, in order (a compressor that needs shapes gets them; default: one flat tensor)."""
        if not compress:
            dist.all_reduce(flat, group=self.group)
            return
        n = flat.numel()
        need_shapes = not self.compressor.elementwise
        if need_shapes and shapes is None:
            shapes = [(n,)]
        offsets = None
        if need_shapes:
            offsets, o = [], 0
            for s in shapes:  # type: ignore[union-attr]
                offsets.append(o)
                o += math.prod(s)
            if o != n:
                raise ValueError(f"parameter shapes hold {o} elements, the buffer {n}")
        else:
            shapes = None
        if self.scope == "all" or len(self.layout.islands) < 2:
            if self.scope == "bridge":  # one island: nothing crosses a slow hop
                dist.all_reduce(flat, group=self.group)
                return
            self._exchange(flat, shapes, offsets, 0, n, key, 0)
            return
        k = len(self.island)
        if not self.layout.equal:
            if self.island_group is not None:
                dist.all_reduce(flat, group=self.island_group)
            if self.local == 0:
                self._exchange(flat, shapes, offsets, 0, n, key, 0)
            if self.island_group is not None:
                dist.broadcast(flat, src=self.island[0], group=self.island_group)
            return
        cuts = self.cuts(n, k, [o for o in offsets] if offsets is not None else None)
        width = max(cuts[i + 1] - cuts[i] for i in range(k)) if k else 0
        a, b = cuts[self.local], cuts[self.local + 1]
        if k == 1:
            self._exchange(flat, shapes, offsets, 0, n, key, 0)
            return
        direct = all(cuts[i + 1] - cuts[i] == width for i in range(k))
        if direct:
            send = flat
        else:
            send = flat.new_zeros(k * width)
            for i in range(k):
                send[i * width:i * width + cuts[i + 1] - cuts[i]] = flat[cuts[i]:cuts[i + 1]]
        part = flat.new_empty(width)
        dist.reduce_scatter_tensor(part, send, group=self.island_group)  # exact, inside the island
        self._exchange(part, shapes, offsets, a, b, key, self.local)
        if direct:
            dist.all_gather_into_tensor(flat, part, group=self.island_group)
        else:
            rows = flat.new_empty(k * width)
            dist.all_gather_into_tensor(rows, part, group=self.island_group)
            for i in range(k):
                flat[cuts[i]:cuts[i + 1]] = rows[i * width:i * width + cuts[i + 1] - cuts[i]]

    def declared_cross_sent(self, n: int, shapes: Sequence[tuple[int, ...]] | None, dtype: str,
                            local: int | None = None) -> float:
        """Bytes local rank ``local`` (default: this rank's) is declared to send across the slow hop
        for a buffer of ``n`` elements."""
        local = self.local if local is None else local
        if self.scope == "bridge" and len(self.layout.islands) > 1 and self.layout.equal and len(self.island) > 1:
            offsets = None
            if not self.compressor.elementwise:
                shapes = shapes or [(n,)]
                offsets, o = [], 0
                for s in shapes:
                    offsets.append(o)
                    o += math.prod(s)
            cuts = self.cuts(n, len(self.island), offsets)
            a, b = cuts[local], cuts[local + 1]
            if offsets is None:
                return self.exchange.declared_sent([(b - a,)] if b > a else [], dtype)
            return self.exchange.declared_sent([s for s, o in zip(shapes, offsets) if a <= o < b], dtype)  # type: ignore[arg-type]
        if self.scope == "bridge" and len(self.layout.islands) > 1 and not self.layout.equal and local != 0:
            return 0.0
        if self.compressor.elementwise:
            return self.exchange.declared_sent([(n,)], dtype)
        return self.exchange.declared_sent(list(shapes or [(n,)]), dtype)
