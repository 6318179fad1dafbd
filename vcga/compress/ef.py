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

from vcga.compress.exact import two_sum

__all__ = ["ErrorFeedback", "EFRecord"]


@dataclass
class EFRecord:
    """One step's bookkeeping (kept when ``record`` is on, for checks): ``sent + hi + lo == x``."""

    x: torch.Tensor
    sent: torch.Tensor
    hi: torch.Tensor
    lo: torch.Tensor


@dataclass
class ErrorFeedback:
    """The residual of one tensor (or chunk) a compressor sends: ``hi + lo``, both of its dtype."""

    hi: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    record: bool = False
    last: EFRecord | None = None
    _carry: torch.Tensor | None = field(default=None, repr=False)

    def input(self, g: torch.Tensor) -> torch.Tensor:
        """The compressor's input for gradient ``g``: ``g`` plus the residual (a new tensor)."""
        if self.hi is None or self.hi.shape != g.shape or self.hi.dtype != g.dtype:
            self.hi, self.lo = torch.zeros_like(g), torch.zeros_like(g)  # first step, or the layout changed
            self._carry = None
            return g.clone()
        a, e1 = two_sum(g, self.hi)
        x, e2 = two_sum(a, self.lo)
        self._carry = e1 + e2  # g + hi + lo == x + e1 + e2 exactly; this sum rounds at u²|x|
        return x

    def update(self, x: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep ``x − sent`` (exactly, as ``h + l``) for the next step."""
        sent = sent.to(x.dtype).reshape(x.shape)
        h, l = two_sum(x, -sent)
        if self.record:
            self.last = EFRecord(x.detach().clone(), sent.detach().clone(), h.clone(), l.clone())
        self.hi = h
        self.lo = l if self._carry is None else l + self._carry
        self._carry = None

    def residual(self) -> torch.Tensor | None:
        """The residual rounded to one tensor (for inspection)."""
        return None if self.hi is None else self.hi + self.lo
