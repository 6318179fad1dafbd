"""Error feedback as exact bookkeeping: sent + residual == input, bit for bit.

A compressor sends an approximation of its input; error feedback keeps what was not sent and adds
it to the next gradient, so nothing is lost, only delayed (Seide et al. 2014; Karimireddy et al.
2019). Kept naively in the gradient's dtype, ``residual = fl(x − sent)`` drops up to half an ulp of
``x − sent`` at every step (and ``fl(g + residual)`` half an ulp of the next input): the
bookkeeping leaks exactly where compression is coarse.

:class:`ErrorFeedback` keeps the residual as an unevaluated pair ``hi + lo`` built with Knuth's
TwoSum (:func:`vcga.compress.exact.two_sum`), which is exact:

- ``input(g)``: ``x = fl(g + hi + lo)``, with both rounding errors captured exactly (``e``);
- ``update(x, sent)``: ``x − sent == h + l`` exactly; ``hi, lo = h, fl(l + e)``.

So at every step ``sent + (h + l) == x`` holds exactly (tested element by element with rationals),
and across steps the only loss is the rounding of ``l + e`` -- a term of order u²·|x| (u the
dtype's unit roundoff), against u·|x| per step for a single-tensor residual. Memory: two tensors
of the gradient's size (a single residual costs one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vcga.compress.exact import two_sum_

__all__ = ["ErrorFeedback", "EFRecord", "Scratch"]


@dataclass
class EFRecord:
    """One step's bookkeeping (kept when ``record`` is on, for checks): ``sent + hi + lo == x``."""

    x: torch.Tensor
    sent: torch.Tensor
    hi: torch.Tensor
    lo: torch.Tensor


#: Elements an error-feedback pass works on at a time on the CPU: its six to eight element-wise
#: operations then run on blocks that stay in the core's cache (6 tensors x 32 Ki float32 = 768 KiB)
#: instead of streaming the whole gradient through memory once per operation. Every element goes
#: through the same operations in the same order: the same bits as one pass over the whole tensor.
BLOCK = 32768


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

    Works in place: it keeps ``hi``, ``lo``, the input it returns (valid until :meth:`update`) and
    the carry -- four tensors of the gradient's size -- and borrows two scratch tensors from a
    :class:`Scratch` shared with the exchange's other residuals; nothing is allocated per step."""

    hi: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    record: bool = False
    last: EFRecord | None = None
    scratch: Scratch = field(default_factory=Scratch, repr=False)
    _x: torch.Tensor | None = field(default=None, repr=False)
    _carry: torch.Tensor | None = field(default=None, repr=False)
    _fresh: bool = field(default=True, repr=False)

    def input(self, g: torch.Tensor) -> torch.Tensor:
        """The compressor's input for gradient ``g``: ``g`` plus the residual."""
        if self.hi is None or self.hi.shape != g.shape or self.hi.dtype != g.dtype or self.hi.device != g.device:
            # first step, or the layout changed: nothing to carry
            c = torch.contiguous_format  # the passes below work on flat views of these
            self.hi, self.lo = torch.zeros_like(g, memory_format=c), torch.zeros_like(g, memory_format=c)
            self._x, self._carry = g.clone(memory_format=c), torch.zeros_like(g, memory_format=c)
            self._fresh = True
            return self._x
        x, carry, lo, hi = self._x, self._carry, self.lo, self.hi
        assert x is not None and carry is not None and lo is not None
        gf, xf, cf, hf, lf = (t.reshape(-1) for t in (g, x, carry, hi, lo))  # views: all contiguous
        tmp, e2 = self.scratch.get(g)
        for b in _blocks(gf.numel(), g.device):
            gb, xb, cb, hb, lb = gf[b], xf[b], cf[b], hf[b], lf[b]
            t, e = tmp[:gb.numel()], e2[:gb.numel()]
            two_sum_(gb, hb, xb, cb, t)  # g + hi == x + e1            (hi is free afterwards)
            two_sum_(xb, lb, hb, e, t)  # x + lo == x' + e2
            xb.copy_(hb)
            cb.add_(e)  # g + hi + lo == x + e1 + e2; this one rounding is of order u²|x|
        self._fresh = False
        return x

    def update(self, x: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``x − sent`` (exactly, as ``h + l``) for the next step."""
        assert self.hi is not None and self.lo is not None and self._carry is not None
        sent = sent.to(device=x.device, dtype=x.dtype).reshape(x.shape).contiguous()
        xf, sf, hf, lf, cf = (t.reshape(-1) for t in (x, sent, self.hi, self.lo, self._carry))
        tmp, neg = self.scratch.get(x)
        for b in _blocks(xf.numel(), x.device):
            xb, lb = xf[b], lf[b]
            t, ng = tmp[:xb.numel()], neg[:xb.numel()]
            torch.neg(sf[b], out=ng)
            two_sum_(xb, ng, hf[b], lb, t)  # x - sent == hi + lo exactly
            if not self._fresh and not self.record:
                lb.add_(cf[b])
        if self.record:
            self.last = EFRecord(x.detach().clone(), sent.detach().clone(), self.hi.clone(), self.lo.clone())
            if not self._fresh:
                self.lo.add_(self._carry)

    def residual(self) -> torch.Tensor | None:
        """The residual rounded to one tensor (for inspection)."""
        return None if self.hi is None else self.hi + self.lo
