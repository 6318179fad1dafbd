"""The compressed sum among one set of peers: :class:`Exchange` (the engine's middle step).

One ``Exchange`` serves one peer group: it keeps each tensor's compressor state and error
feedback (:class:`_Slot`) and sums the peers' contributions compressed -- ``SUM`` compressors
through the group's all_reduce (one decode of the summed payload), ``GATHER`` ones by gathering
every peer's payload and decoding them in peer order, or in two phases (all_to_all of chunks,
server-side compression, all-gather) as 1-bit Adam's compressed allreduce. Every peer decodes the
same bytes with the same operations, so every peer gets the same bits (:mod:`vcga.compress.engine`
says where the exchange sits in the whole reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from vcga.compress.ef import ErrorFeedback, Scratch
from vcga.compress.layout import chunks, declared_sent
from vcga.compress.meter import WireMeter
from vcga.contract import Combine, CompressContext, Compressor, Support
from vcga.errors import VcgaError
from vcga.pg.comm import all_gather_single
from vcga.pg.recorder import stage

__all__ = ["Exchange", "mix_seed"]


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed from integers and strings (splitmix64 over a stable hash): the same on every rank."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        v = (p if isinstance(p, int)
             else int.from_bytes(str(p).encode()[:32].ljust(8, b"\0")[:8], "little") ^ len(str(p)))
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


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


class _InFlight(NamedTuple):
    """One payload dtype's buffer in flight: where its tensors sit in it, the collective's work
    (None: nothing to send), and whether it was gathered (to be added here in peer order) rather
    than summed by the library."""

    dtype: torch.dtype
    where: list[tuple[int, int]]
    buf: torch.Tensor
    work: Any
    gathered: bool


@dataclass
class _Travelling:
    """Payload sums in flight (:meth:`Exchange._start_sum`), one buffer per payload dtype."""

    payloads: dict[int, list[torch.Tensor]]
    buffers: list[_InFlight] = field(default_factory=list)


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
        #: issue the payload sums synchronously (a caller with nothing to overlap them with: no
        #: communication thread woken and waited for per collective)
        self.sync = False
        self._table = getattr(group, "capabilities", None) if group is not None else None
        self._seeds: dict[Any, int] = {}  # per key, the shared seed mixed with it (ctx: every call)

    # -- collectives (counted here when the transport cannot be) -----------------------------------

    def _count(self, kind: str, nbytes: int) -> None:
        if self.meter is None:
            return
        # What the compressor's payload costs, as handed to the collective (``label:payload``),
        # apart from what the backend's table turns it into at the transport (a dtype it does not
        # move natively travels bitcast through one it does, padded to that dtype's width).
        self.meter.count(self.label + ":payload", kind, nbytes, self.peers)
        if not self._metered_at_transport:
            self.meter.count(self.label, kind, nbytes, self.peers)

    def _all_reduce(self, t: torch.Tensor, async_op: bool = False) -> Any:
        self._count("all_reduce", t.numel() * t.element_size())
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Any:
        self._count("all_gather", inp.numel())
        return all_gather_single(out, inp, group=self.group, async_op=async_op)

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
        self._seeds.clear()

    def saved(self) -> dict[Any, dict[str, Any]]:
        """Every tensor's state between steps, as plain values (:meth:`restore` takes it back):
        the compressor's dict, the residual's exact parts, and the two-phase exchange's chunks."""
        return {k: {"state": s.state, "ef": s.ef.saved() if s.ef is not None else None, "chunks": s.chunks,
                    "server": {j: (st, ef.saved() if ef is not None else None) for j, (st, ef) in s.server.items()}}
                for k, s in self.slots.items()}

    def restore(self, saved: dict[Any, dict[str, Any]]) -> None:
        """Replace every tensor's state with what :meth:`saved` gave."""
        def ef_of(parts: Any) -> ErrorFeedback | None:
            if not self.c.error_feedback:
                return None
            ef = ErrorFeedback(record=self.record, scratch=self._scratch)
            ef.restore(parts)
            return ef

        self.slots = {k: _Slot(state=dict(v["state"]), ef=ef_of(v["ef"]),
                               chunks={j: dict(st) for j, st in v["chunks"].items()},
                               server={j: (dict(st), ef_of(parts)) for j, (st, parts) in v["server"].items()})
                      for k, v in saved.items()}

    def ctx(self, key: Any, step: int, role: str = "worker") -> CompressContext:
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = mix_seed(self.seed, repr(key))
        return CompressContext(self.peers, self.peer, step, seed, role)

    # -- the exchange --------------------------------------------------------------------------------

    def run(self, tensors: Sequence[torch.Tensor], keys: Sequence[Any], step: int,
            forms: bool = False, divisor: float = 1.0) -> list[list[torch.Tensor]] | None:
        """Replace each tensor by its sum over the peers (decoded from the compressed payloads),
        divided by ``divisor`` (the caller's average; folded into the decode where the compressor
        can, :meth:`~vcga.contract.Compressor.decompress_into`).

        With ``forms`` (a SUM compressor with a compact decoded form, :meth:`Compressor.decoded_layout`):
        return each tensor's compact form too (on the device it was decoded on, undivided: rebuild
        with :meth:`expand`), else None."""
        if self.peers <= 1 or self.group is None:
            if divisor != 1:
                for t in tensors:
                    t.div_(divisor)
            return None
        xs = []
        for t, k in zip(tensors, keys, strict=True):
            slot = self.slot(k)
            xs.append(slot.ef.input(t) if slot.ef is not None else t)
        got: list[list[torch.Tensor]] | None = [] if forms and self.c.combine is Combine.SUM else None
        if self.c.combine is Combine.SUM:
            outs = self._run_sum(xs, keys, step, got, into=None if self.host_decode else list(tensors),
                                 divisor=divisor)
        else:
            # encode, exchange and decode interleave per peer and chunk here: one step
            with stage("exchange", "compress", f"{type(self.c).__name__} {self.label}"):
                outs = self._run_two_phase(xs, keys, step) if self.c.server else self._run_gather(xs, keys, step)
        for i, (t, o) in enumerate(zip(tensors, outs, strict=True)):
            if o is t:  # decoded in place already, divided (Compressor.decompress_into)
                continue
            if divisor == 1:
                t.copy_(o.reshape(t.shape))
            elif got is not None and not self.host_decode and self.c.expand_divided(got[i], tuple(t.shape), t, divisor):
                pass  # the compact form's bits, which every island rank rebuilds the same way
            else:
                torch.div(o.reshape(t.shape), divisor, out=t)
        return got

    def decoded_finite(self, key: Any) -> bool | None:
        """Whether ``key``'s last decoded sum is finite, where the compressor can tell without reading
        it (:meth:`~vcga.contract.Compressor.decoded_finite`); None: read it."""
        slot = self.slots.get(key)
        return self.c.decoded_finite(slot.state) if slot is not None else None

    def _decode_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.host_decode else t

    def _run_sum(self, xs: list[torch.Tensor], keys: Sequence[Any], step: int,
                 forms: list[list[torch.Tensor]] | None = None,
                 into: list[torch.Tensor] | None = None, divisor: float = 1.0) -> list[torch.Tensor]:
        """The rounds of a SUM compressor; ``into``: the tensors the decoded sums go to, which a
        compressor may decode into directly (:meth:`~vcga.contract.Compressor.decompress_into`)."""
        c = self.c
        out: list[torch.Tensor | None] = [None] * len(xs)
        last_payload: list[list[torch.Tensor]] = [[] for _ in xs]
        pending = list(range(len(xs)))
        states = [self.slot(k).state for k in keys]
        ctxs = [self.ctx(k, step) for k in keys]  # immutable: one per tensor serves every round
        ef_done = False
        for rnd in range(c.rounds):
            if not pending:
                break
            with stage("encode", "compress", type(c).__name__):
                payloads = {i: c.compress(xs[i], states[i], ctxs[i], rnd) for i in pending}
            for i in pending:
                last_payload[i] = payloads[i]
            with stage("exchange", "compress", self.label):
                travelling = self._start_sum(payloads)
                if rnd == c.rounds - 1:
                    # What this rank sent is known once its last payload is (Compressor.sent): keep the
                    # residuals while the sum travels -- the error feedback's passes over every
                    # gradient then overlap the slow hop's round trip instead of following it (where
                    # the sum is issued asynchronously, :attr:`sync`)
                    self._update_ef(xs, keys, step, last_payload, ctxs)
                    ef_done = True
                summed = self._finish_sum(travelling)
            with stage("decode", "compress", type(c).__name__):
                for i in pending:
                    state, ctx = states[i], ctxs[i]
                    if into is not None and c.decompress_into(summed[i], state, ctx, rnd, into[i], divisor):
                        out[i] = into[i]
                        continue
                    got = c.decompress(summed[i], state, ctx, rnd)
                    if got is not None:
                        out[i] = got
            pending = [i for i in pending if out[i] is None]
        if pending:
            raise VcgaError(f"compressor {type(c).__name__} decoded nothing for {len(pending)} tensor(s) after "
                            f"its {c.rounds} round(s)")
        decoded = [o for o in out if o is not None]  # all of them: nothing is pending
        if forms is not None:  # before the next call of any kind can touch the state
            forms.extend(c.decoded_form(o, st) for o, st in zip(decoded, states, strict=True))
        if not ef_done:  # every tensor decoded before the last round (PowerSGD: all of them 1-D)
            self._update_ef(xs, keys, step, last_payload, ctxs)
        return [o.to(xs[i].device) for i, o in enumerate(decoded)]

    def _update_ef(self, xs: list[torch.Tensor], keys: Sequence[Any], step: int,
                   last_payload: list[list[torch.Tensor]], ctxs: Sequence[CompressContext]) -> None:
        """Each tensor's residual after this step (from the factors of what was sent where the
        compressor has them, :meth:`~vcga.contract.Compressor.sent_factors`)."""
        for i, k in enumerate(keys):
            slot = self.slot(k)
            if slot.ef is None:
                continue
            ctx = ctxs[i]
            factors = self.c.sent_factors(xs[i], last_payload[i], slot.state, ctx)
            if factors is not None:
                slot.ef.update_factored(xs[i], *factors)
            else:
                slot.ef.update(xs[i], self.c.sent(xs[i], last_payload[i], slot.state, ctx))

    def _start_sum(self, payloads: dict[int, list[torch.Tensor]]) -> _Travelling:
        """Start summing each payload tensor over the peers, element by element, the same bits on
        every peer; :meth:`_finish_sum` waits for the sums (the collectives are asynchronous, so the
        caller works while they travel).

        Payload tensors of one dtype travel as one buffer: summed by the library where the group sums
        that dtype natively (its result is one reduction, copied to every rank), else gathered as bytes
        and added in peer order here (floats narrower than float32 in float32, then rounded to their
        dtype once)."""
        sync = self.sync
        by_dtype: dict[torch.dtype, list[tuple[int, int]]] = {}
        for i, pl in payloads.items():
            for j, t in enumerate(pl):
                by_dtype.setdefault(t.dtype, []).append((i, j))
        out = _Travelling(payloads)
        for dtype, where in by_dtype.items():
            flat = torch.cat([payloads[i][j].reshape(-1) for i, j in where])
            if flat.numel() == 0:
                out.buffers.append(_InFlight(dtype, where, flat, None, False))
            elif self._sums_natively(dtype):
                out.buffers.append(_InFlight(dtype, where, flat, self._all_reduce(flat, async_op=not sync), False))
            else:
                raw = _as_bytes(flat)
                rows = torch.empty(self.peers * raw.numel(), dtype=torch.uint8, device=raw.device)
                out.buffers.append(_InFlight(dtype, where, rows, self._all_gather(rows, raw, async_op=not sync),
                                             True))
        return out

    def _finish_sum(self, travelling: _Travelling) -> dict[int, list[torch.Tensor]]:
        """Wait for :meth:`_start_sum`'s collectives; each payload tensor's sum over the peers."""
        payloads = travelling.payloads
        result = {i: [torch.empty(0)] * len(pl) for i, pl in payloads.items()}
        for dtype, where, buf, work, gathered in travelling.buffers:
            if work is not None:
                work.wait()
            if not gathered:
                summed = self._decode_device(buf) if buf.numel() else buf
            else:
                vals = self._decode_device(buf).view(self.peers, -1).view(dtype)
                acc = torch.float32 if dtype.is_floating_point and torch.finfo(dtype).bits < 32 else dtype
                summed = vals[0].to(acc)
                for p in range(1, self.peers):  # left to right in peer order
                    summed = summed + vals[p].to(acc)
                # rounded once to the payload's dtype: the compressor gets its sums in the dtype it
                # sent, as from a library that sums that dtype natively (PowerSGD multiplies them
                # with its bfloat16 / float16 gradients)
                summed = summed.to(dtype)
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
        payloads = [c.compress(x, self.slot(k).state, self.ctx(k, step)) for x, k in zip(xs, keys, strict=True)]
        packed = [self._pack(pl) for pl in payloads]
        sizes = [p.numel() for p in packed]
        mine = torch.cat(packed) if packed else torch.empty(0, dtype=torch.uint8)
        rows = torch.empty(self.peers * mine.numel(), dtype=torch.uint8, device=mine.device)
        self._all_gather(rows, mine)
        rows = self._decode_device(rows).view(self.peers, -1)
        outs = []
        off = 0
        for i, (x, k) in enumerate(zip(xs, keys, strict=True)):
            slot = self.slot(k)
            like = [self._decode_device(t) for t in payloads[i]]
            total = None
            for p in range(self.peers):  # decode each peer's payload, add in peer order
                pl = self._unpack(rows[p, off:off + sizes[i]], like)
                if p == self.peer and slot.ef is not None:  # the residual needs this rank's own decoded
                    dec = self._decoded(pl, slot.state, self.ctx(k, step))
                    slot.ef.update(x, dec.to(x.device).reshape(x.shape))
                    total = dec if total is None else c.decompress_add(pl, total, slot.state, self.ctx(k, step))
                elif total is None:
                    total = self._decoded(pl, slot.state, self.ctx(k, step))
                else:
                    total = c.decompress_add(pl, total, slot.state, self.ctx(k, step))
            off += sizes[i]
            outs.append(total.to(x.device))  # type: ignore[union-attr]
        return outs

    def _decoded(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext) -> torch.Tensor:
        """A GATHER compressor's decoded ``payload``, flat."""
        out = self.c.decompress(payload, state, ctx)
        if out is None:
            raise VcgaError(f"compressor {type(self.c).__name__} combines by GATHER but its decompress returned None "
                            "(only a SUM compressor's rounds before the last may)")
        return out.reshape(-1)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return chunks(n, self.peers)

    def _run_two_phase(self, xs: list[torch.Tensor], keys: Sequence[Any], step: int) -> list[torch.Tensor]:
        """1-bit Adam's compressed allreduce, for any element-wise GATHER compressor: worker payloads
        of chunk j go to peer j (all_to_all); peer j decodes and adds them in peer order, compresses
        the sum again with its server-side error feedback; the server payloads are all-gathered."""
        c, peers, me = self.c, self.peers, self.peer
        flat = [x.reshape(-1) for x in xs]
        bounds = [self._chunks(f.numel()) for f in flat]
        # phase 1: worker payloads, chunk j of every tensor to peer j
        work: list[list[list[torch.Tensor]]] = []  # [tensor][chunk] -> payload
        for f, k, bs in zip(flat, keys, bounds, strict=True):
            slot = self.slot(k)
            work.append([c.compress(f[a:b], slot.chunks.setdefault(j, {}), self.ctx((k, j), step))
                         if b > a else [] for j, (a, b) in enumerate(bs)])
        send_parts, in_splits = [], []
        for j in range(peers):
            part = [self._pack(work[i][j]) for i in range(len(flat))]
            send_parts.extend(part)
            in_splits.append(sum(p.numel() for p in part))
        mine_sizes = [self._pack(work[i][me]).numel() for i in range(len(flat))]
        dev = flat[0].device if flat else torch.device("cpu")
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8, device=dev)
        recv = torch.empty(peers * sum(mine_sizes), dtype=torch.uint8, device=send.device)
        self._all_to_all(recv, send, [sum(mine_sizes)] * peers, in_splits)
        recv = self._decode_device(recv).view(peers, -1) if recv.numel() else recv.view(peers, 0)
        # worker error feedback: what this rank sent is its own payloads, decoded
        for i, (x, k) in enumerate(zip(xs, keys, strict=True)):
            slot = self.slot(k)
            if slot.ef is not None:
                sent = torch.zeros_like(flat[i])
                for j, (a, b) in enumerate(bounds[i]):
                    if b > a:
                        st = slot.chunks[j]
                        sent[a:b] = self._decoded(work[i][j], st, self.ctx((k, j), step)).to(sent.device)
                slot.ef.update(x, sent.reshape(x.shape))
        # the server: decode and add chunk `me` of every peer, compress the sum again
        server_payloads: list[list[torch.Tensor]] = []
        off = 0
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
            for p in range(peers):
                pl = self._unpack(recv[p, off:off + mine_sizes[i]], like)
                total = (self._decoded(pl, wst, self.ctx((k, me), step)) if total is None
                         else c.decompress_add(pl, total, wst, self.ctx((k, me), step)))
            off += mine_sizes[i]
            y = total.to(flat[i].device)  # type: ignore[union-attr]
            ys = ef.input(y) if ef is not None else y
            ctx = self.ctx((k, me), step, "server")
            pl = c.compress(ys, st, ctx)
            if ef is not None:
                ef.update(ys, self._decoded([self._decode_device(t) for t in pl], st, ctx).to(ys.device))
            server_payloads.append(pl)
        # phase 2: all-gather the server payloads (padded to the largest chunk's)
        width = [[self._pack(work[i][j]).numel() for j in range(peers)] for i in range(len(flat))]
        row = max((sum(w[j] for w in width) for j in range(peers)), default=0)
        mine = torch.cat([self._pack(pl) for pl in server_payloads] +
                         [torch.zeros(row - sum(w[me] for w in width), dtype=torch.uint8, device=dev)])
        rows = torch.empty(peers * row, dtype=torch.uint8, device=mine.device)
        self._all_gather(rows, mine)
        rows = self._decode_device(rows).view(peers, -1) if rows.numel() else rows.view(peers, 0)
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
                out[a:b] = self._decoded(pl, st, self.ctx((k, j), step, "server"))
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
