"""Error feedback as exact bookkeeping: sent + residual == input, bit for bit.

A compressor sends an approximation of its input; error feedback keeps what was not sent and adds
it to the next gradient, so nothing is lost, only delayed (Seide et al. 2014; Karimireddy et al.
2019). Kept naively in the gradient's dtype, ``residual = fl(x − sent)`` drops up to half an ulp of
``x − sent`` at every step (and ``fl(g + residual)`` half an ulp of the next input): the
bookkeeping leaks exactly where compression is coarse.

:class:`ErrorFeedback` keeps the residual as an unevaluated pair ``hi + lo`` built with Knuth's
TwoSum (:func:`vcga.compress.exact.two_sum`), which is exact:

- ``input(g)``: ``x = fl(g + hi)`` with its rounding error ``e`` captured exactly; ``lo`` is not
  added to ``x`` but kept as the *pending* part ``lo + e`` (one rounding, of order u²·|x|), so
  ``g + hi + lo == x + pending`` up to that rounding;
- ``update(x, sent)``: ``x − sent == h + l`` exactly (TwoSum of ``x`` and ``−sent``);
  ``hi, lo = h, fl(l + pending)``.

So at every step ``sent + (h + l) == x`` holds exactly (tested element by element with rationals),
and across steps the only loss is the rounding of ``l + pending`` and of ``lo + e`` -- terms of
order u²·|x| (u the dtype's unit roundoff), against u·|x| per step for a single-tensor residual.
The low part reaches the compressor's input one step later than the high part (it is below an ulp
of the input: delaying it changes nothing the compressor sees but its order). Memory: three tensors
of the gradient's size (``hi``, ``lo``, the input ``x``); two TwoSums of six element-wise
operations and one addition each per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vcga.compress import fused
from vcga.compress.exact import two_diff_, two_sum_

__all__ = ["ErrorFeedback", "EFRecord", "Scratch"]


@dataclass
class EFRecord:
    """One step's bookkeeping (kept when ``record`` is on, for checks): ``sent + hi + lo == x``."""

    x: torch.Tensor
    sent: torch.Tensor
    hi: torch.Tensor
    lo: torch.Tensor


#: Elements an error-feedback pass works on at a time on the CPU: its seven element-wise operations
#: then run on blocks that stay in the core's cache (5 tensors x 64 Ki float32 = 1.25 MiB) instead
#: of streaming the whole gradient through memory once per operation, and few enough blocks that
#: each operation's fixed cost per call stays small. Every element goes through the same
#: operations in the same order: the same bits as one pass over the whole tensor.
BLOCK = 65536


def _blocks(n: int, device: torch.device) -> list[slice]:
    if device.type != "cpu" or n <= BLOCK:
        return [slice(0, n)]
    return [slice(a, min(a + BLOCK, n)) for a in range(0, n, BLOCK)]


class Scratch:
    """Two scratch buffers shared by the residuals one exchange updates one after another."""

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (like.dtype, like.device)
        n = min(like.numel(), BLOCK) if like.device.type == "cpu" else like.numel()
        flat = self._flat.get(key)
        if flat is None or flat.numel() < 2 * n:
            flat = self._flat[key] = torch.empty(2 * n, dtype=like.dtype, device=like.device)
        return flat[:n], flat[n:2 * n]


@dataclass
class ErrorFeedback:
    """The residual of one tensor (or chunk) a compressor sends: ``hi + lo``, both of its dtype.

    Works in place: it keeps ``hi``, ``lo`` and the input it returns (valid until :meth:`update`)
    -- three tensors of the gradient's size -- and borrows two scratch tensors from a
    :class:`Scratch` shared with the exchange's other residuals; nothing is allocated per step.
    Between :meth:`input` and :meth:`update`, ``lo`` holds the pending low part (old ``lo`` plus the
    rounding error of ``x``)."""

    hi: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    record: bool = False
    last: EFRecord | None = None
    scratch: Scratch = field(default_factory=Scratch, repr=False)
    _x: torch.Tensor | None = field(default=None, repr=False)
    _fresh: bool = field(default=True, repr=False)
    #: (hi, lo, x, their flat numpy views or None): the fused loops' operands, made again only when
    #: one of those tensors is replaced -- each view costs more per call than a small tensor's loop
    _arrays: tuple[object, object, object, tuple[object, object, object] | None] | None = field(default=None,
                                                                                            repr=False)

    def _host_arrays(self) -> tuple[object, object, object] | None:
        """Flat numpy views of ``hi``, ``lo`` and the input buffer where the fused loops can take
        them (:func:`vcga.compress.fused.usable`), else None."""
        hi, lo, x = self.hi, self.lo, self._x
        got = self._arrays
        if got is not None and got[0] is hi and got[1] is lo and got[2] is x:
            return got[3]
        assert hi is not None and lo is not None and x is not None
        views = ((hi.reshape(-1).numpy(), lo.reshape(-1).numpy(), x.reshape(-1).numpy()) if fused.usable(hi, lo, x)
                 else None)
        self._arrays = (hi, lo, x, views)
        return views

    def input(self, g: torch.Tensor) -> torch.Tensor:
        """The compressor's input for gradient ``g``: ``g`` plus the residual."""
        if self.hi is not None and self.hi.device != g.device:
            # a residual restored from a checkpoint, read onto the host: carry it to the gradients'
            # device (a copy is exact); one kept for another layout is dropped just below
            assert self.lo is not None
            self.hi, self.lo = self.hi.to(g.device), self.lo.to(g.device)
            self._x = torch.empty_like(self.hi)
        if self.hi is None or self.hi.shape != g.shape or self.hi.dtype != g.dtype:
            # first step, or the layout changed: nothing to carry
            c = torch.contiguous_format  # the passes below work on flat views of these
            self.hi, self.lo = torch.zeros_like(g, memory_format=c), torch.zeros_like(g, memory_format=c)
            self._x = g.clone(memory_format=c)
            self._fresh = True
            return self._x
        x, lo, hi = self._x, self.lo, self.hi
        assert x is not None and lo is not None
        gf = g.reshape(-1)
        if (k := fused.kernels()) is not None and (arrays := self._host_arrays()) is not None and fused.usable(gf):
            k[0](gf.numpy(), arrays[0], arrays[1], arrays[2])  # the same operations, one pass
            self._fresh = False
            return x
        xf, hf, lf = (t.reshape(-1) for t in (x, hi, lo))  # views: all contiguous
        e1, tmp = self.scratch.get(g)
        for b in _blocks(gf.numel(), g.device):
            xb, lb = xf[b], lf[b]
            e, t = e1[:xb.numel()], tmp[:xb.numel()]
            two_sum_(gf[b], hf[b], xb, e, t)  # g + hi == x + e exactly     (hi is free afterwards)
            lb.add_(e)  # the pending low part: g + hi + lo == x + lo', one rounding of order u²|x|
        self._fresh = False
        return x

    def update(self, x: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``x − sent`` (exactly, as ``h + l``) plus the pending low part for the next step."""
        assert self.hi is not None and self.lo is not None
        sent = sent.to(device=x.device, dtype=x.dtype).reshape(x.shape).contiguous()
        if (not self.record and x is self._x and (k := fused.kernels()) is not None
                and (arrays := self._host_arrays()) is not None and fused.usable(sent)):
            # the same operations, one pass
            k[1](arrays[2], sent.reshape(-1).numpy(), arrays[0], arrays[1], self._fresh)
            return
        xf, sf, hf, lf = (t.reshape(-1) for t in (x, sent, self.hi, self.lo))
        if self.record:  # the identity is checked on (h, l) before the pending part joins them
            pending = self.lo.clone()
            lf = torch.empty_like(lf)
        if not self.record and fused.usable(xf, sf, hf, lf) and (k := fused.kernels()) is not None:
            k[1](xf.numpy(), sf.numpy(), hf.numpy(), lf.numpy(), self._fresh)  # the same operations, one pass
            return
        l2, tmp = self.scratch.get(x)
        for b in _blocks(xf.numel(), x.device):
            lb = lf[b]
            n = lb.numel()
            if self._fresh or self.record:
                two_diff_(xf[b], sf[b], hf[b], lb, tmp[:n])  # x - sent == hi + lo exactly
            else:
                ln = l2[:n]
                two_diff_(xf[b], sf[b], hf[b], ln, tmp[:n])
                torch.add(ln, lb, out=lb)  # l + pending: the order u²|x| rounding
        if self.record:
            lo = lf.reshape(self.lo.shape)
            self.last = EFRecord(x.detach().clone(), sent.detach().clone(), self.hi.clone(), lo.clone())
            self.lo = lo if self._fresh else lo.add_(pending)

    def update_factored(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """:meth:`update` with ``sent`` = :func:`vcga.compress.exact.outer_sum` of ``p`` ``[n, r]``
        and ``q`` ``[m, r]`` (``x`` holds n x m elements), the same bits, without forming ``sent``
        where the fused loop can (:func:`vcga.compress.fused.factored`): one pass instead of writing
        a gradient-sized tensor and reading it back."""
        assert self.hi is not None and self.lo is not None
        if (not self.record and x is self._x and p.shape[0] * q.shape[0] == x.numel()
                and (k := fused.factored()) is not None and (arrays := self._host_arrays()) is not None
                and fused.usable(x, p, q)):
            k[0](arrays[2], p.t().contiguous().numpy(), q.t().contiguous().numpy(), arrays[0], arrays[1], self._fresh)
            return
        xf, hf, lf = (t.reshape(-1) for t in (x, self.hi, self.lo))
        if (not self.record and p.shape[0] * q.shape[0] == xf.numel() and fused.usable(xf, p, q, hf, lf)
                and (k := fused.factored()) is not None):
            k[0](xf.numpy(), p.t().contiguous().numpy(), q.t().contiguous().numpy(), hf.numpy(), lf.numpy(),
                 self._fresh)
            return
        self.update(x, fused.outer_sum(p, q).reshape(x.shape))

    def saved(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The residual between steps, exactly: ``(hi, lo)`` (None before the first step)."""
        return None if self.hi is None or self.lo is None else (self.hi, self.lo)

    def restore(self, saved: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Carry on from a residual :meth:`saved` gave (a resumed job): the next :meth:`input` adds it."""
        if saved is None:
            self.hi = self.lo = self._x = None
            return
        hi, lo = saved
        if hi.shape != lo.shape or hi.dtype != lo.dtype:
            raise ValueError(f"a residual's two parts differ: {tuple(hi.shape)} {hi.dtype} and "
                             f"{tuple(lo.shape)} {lo.dtype}")
        c = torch.contiguous_format
        self.hi, self.lo = hi.contiguous(memory_format=c), lo.contiguous(memory_format=c)
        self._x = torch.empty_like(self.hi, memory_format=c)  # input()'s output buffer
        self._fresh = False

    def residual(self) -> torch.Tensor | None:
        """The residual rounded to one tensor (for inspection)."""
        return None if self.hi is None or self.lo is None else self.hi + self.lo
