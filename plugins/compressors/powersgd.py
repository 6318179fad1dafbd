"""PowerSGD: low-rank gradients by one power iteration per step, warm-started."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vcga.contract import Combine, CompressContext, Compressor

from ._shapes import itemsize as _itemsize
from ._shapes import numel as _numel

if TYPE_CHECKING:
    import torch


# -- PowerSGD ------------------------------------------------------------------------------------------


def _buffer(state: dict[str, Any], name: str, q: torch.Tensor, rows: int) -> torch.Tensor:
    """A rows x len(q) buffer kept in ``state`` across steps (a fresh 4 MiB matrix per call costs
    the allocator and the page faults as much as filling it)."""
    import torch

    shape = (rows, q.shape[0])
    buf = state.get(name)
    if buf is None or tuple(buf.shape) != shape or buf.dtype != q.dtype or buf.device != q.device:
        buf = state[name] = torch.empty(shape, dtype=q.dtype, device=q.device)
    return buf


class PowerSGD(Compressor):
    """Rank-r power iteration per matrix with warm start and error feedback (Vogels et al. 2019).

    Round 0 sends P = M Q (Q shared: drawn from the shared seed, or last step's), round 1 sends
    Q = Mᵀ P̂ with P̂ the orthonormalised sum of the Ps. What this rank sent is P̂ Qᵢᵀ, the
    projection of its own matrix (the paper's error feedback; torch's hook keeps the input minus
    the *averaged* approximation instead, which mixes the other ranks' gradients into the residual).

    ``iters`` > 1 runs that many power (subspace) iterations per step: after round 2i + 1 the
    summed Q is orthonormalised and round 2i + 2 sends P = M Q̂ again -- each iteration sends P and
    Q once more (bytes × iters), and the rank-r subspace gets closer to the top-r singular subspace
    of this step's summed matrix instead of relying on the warm start alone to track it."""

    combine = Combine.SUM
    elementwise = False

    def __init__(self, rank: int, warm: bool, ef: bool, min_rate: float, eps: float, iters: int = 1) -> None:
        self.rank, self.warm, self.error_feedback, self.min_rate, self.eps = rank, warm, ef, min_rate, eps
        self.iters = iters
        self.rounds = 2 * iters

    def _plan(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(rows, cols, rank) when the tensor is compressed, None when it travels as it is."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = _numel(shape) // n if n else 0
        r = min(n, m, self.rank)
        if r == 0 or (n + m) * r * self.iters * self.min_rate >= n * m:
            return None
        return n, m, r

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        p = self._plan(shape)
        if p is None:
            return _numel(shape) * _itemsize(dtype)
        n, m, r = p
        return (n + m) * r * self.iters * _itemsize(dtype)

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext,
                 round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        from vcga.compress.exact import orthonormalize

        p = self._plan(tuple(x.shape))
        state["compressed"] = p is not None
        if p is None:
            return [x.reshape(-1).contiguous()] if round == 0 else []
        n, m, r = p
        mat = x.reshape(n, m)
        if round == 0:
            q = state.get("q") if self.warm else None
            if q is None or q.shape != (m, r):
                g = torch.Generator(device="cpu")
                g.manual_seed(ctx.seed)  # the same Q on every peer
                q = torch.randn(m, r, generator=g, dtype=torch.float64).to(x.dtype).to(x.device)
            if q.dtype not in (torch.float32, torch.float64):
                # in a narrow float, M Q of a warm Q (last step's summed Q: the gradients' scale)
                # could overflow; its orthonormal columns keep the products at the gradients' scale.
                # (P̂ does not change: Gram-Schmidt of M Q R, R upper triangular with a positive
                # diagonal, is that of M Q -- so the wider floats skip this r-column pass.)
                q = orthonormalize(q.clone(), self.eps)
            state["q"] = q
            return [(mat @ q.to(mat.device)).contiguous()]
        if round % 2 == 0:  # a further iteration: P = M Q̂, Q̂ the last round's orthonormalised sum
            return [(mat @ state["q_hat"].to(mat.device)).contiguous()]
        # Mᵀ P̂ as (P̂ᵀ M)ᵀ: the BLAS walks M by rows, on the host twice as fast as through the
        # transposed view (the same bits with the BLAS torch ships here). A BLAS that ordered the
        # dot products otherwise would change only this rank's own payload: no peer recomputes it,
        # and the residual keeps x - P̂ Q_ownᵀ exactly for whatever Q_own is.
        q_own = (state["p"].to(mat.device).t() @ mat).t().contiguous()
        state["q_own"] = q_own
        return [q_own]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor | None:  # noqa: A002
        from vcga.compress.fused import orthonormalize

        if not state.get("compressed", True):
            return payload[0]  # an uncompressed tensor: its sum, done in round 0
        if round % 2 == 0:
            state["p"] = orthonormalize(payload[0].clone(), self.eps)
            return None
        q = payload[0]
        if round + 1 < self.rounds:  # another iteration follows: it multiplies by the summed Q, orthonormalised
            state["q_hat"] = orthonormalize(q.clone(), self.eps)
            return None
        # the decoded matrix is read once by the driver before the next call: reuse its buffer
        return self._decoded(q, state, _buffer(state, "decoded", q, state["p"].shape[0]))

    def _decoded(self, q: torch.Tensor, state: dict[str, Any], out: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
        """The last round's decode: P̂ (Q / divisor)ᵀ (fixed order) into ``out`` ``[n, m]``."""
        from vcga.compress.fused import outer_sum

        if self.warm:
            state["q"] = q.clone()
        state["q_sum"] = q  # with P̂, the compact form of the decoded sum (decoded_form)
        return outer_sum(state["p"], q / divisor if divisor != 1 else q, out=out)

    def decompress_into(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                        round: int, out: torch.Tensor, divisor: float = 1.0) -> bool:  # noqa: A002
        if not state.get("compressed", True) or round + 1 < self.rounds or not out.is_contiguous():
            return False
        q = payload[0]
        if out.device != q.device or out.dtype != q.dtype:
            return False
        # the average divides the small summed Q, not the decoded matrix: the same bits as
        # expand_divided of the compact form (P̂, summed Q) on every island rank
        self._decoded(q, state, out.view(state["p"].shape[0], q.shape[0]), divisor)
        return True

    def expand_divided(self, form: list[torch.Tensor], shape: tuple[int, ...], out: torch.Tensor,
                       divisor: float) -> bool:
        import torch

        from vcga.compress.fused import outer_sum

        if not out.is_contiguous():
            return False
        if len(form) == 1:
            torch.div(form[0].reshape(shape), divisor, out=out)
            return True
        p, q = form
        outer_sum(p, q / divisor if divisor != 1 else q, out=out.view(p.shape[0], q.shape[0]))
        return True

    def decoded_finite(self, state: dict[str, Any]) -> bool | None:
        import torch

        if not state.get("compressed", True) or "q_sum" not in state:
            return None
        p, q = state["p"], state["q_sum"]
        # the extremes of both factors in one transfer: all finite exactly when they are (NaN
        # propagates through both), and the largest magnitudes are the larger of |min| and |max|
        p_lo, p_hi, q_lo, q_hi = torch.stack([*torch.aminmax(p), *torch.aminmax(q)]).tolist()
        if not all(math.isfinite(v) for v in (p_lo, p_hi, q_lo, q_hi)):
            return False
        # each decoded element is a sum of r products p_ik q_jk (divided): at most r max|P̂| max|Q|
        # in magnitude, every partial sum too (up to roundings of relative size r u): no overflow,
        # no inf - inf, when that bound is below the dtype's largest finite value with room
        bound = p.shape[1] * max(-p_lo, p_hi) * max(-q_lo, q_hi)
        return True if bound < torch.finfo(q.dtype).max / 4 else None

    def decoded_layout(self, shape: tuple[int, ...], dtype: str) -> list[tuple[tuple[int, ...], str]] | None:
        p = self._plan(tuple(shape))
        if p is None:
            return [((_numel(shape),), dtype)]
        n, m, r = p
        return [((n, r), dtype), ((m, r), dtype)]

    def decoded_form(self, decoded: torch.Tensor, state: dict[str, Any]) -> list[torch.Tensor]:
        if not state.get("compressed", True):
            return [decoded.reshape(-1)]
        return [state["p"], state["q_sum"]]

    def expand(self, form: list[torch.Tensor], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        from vcga.compress.fused import outer_sum

        if len(form) == 1:
            got = form[0].reshape(shape)
            return got if out is None else out.copy_(got)
        p, q = form
        return outer_sum(p, q, out=out)

    def sent(self, x: torch.Tensor, payload: list[torch.Tensor], state: dict[str, Any],
             ctx: CompressContext) -> torch.Tensor:
        from vcga.compress.fused import outer_sum

        if self._plan(tuple(x.shape)) is None:
            return x
        # P̂ Q_ownᵀ in outer_sum's fixed order (sent_factors' bits), on this rank's device: error
        # feedback keeps x - sent exactly for these bits; the driver usually forms them on the fly
        # (sent_factors) instead of calling this
        q = state["q_own"]
        p = state["p"].to(q.device)
        return outer_sum(p, q, out=_buffer(state, "sent", q, p.shape[0])).reshape(x.shape)

    def sent_factors(self, x: torch.Tensor, payload: list[torch.Tensor], state: dict[str, Any],
                     ctx: CompressContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._plan(tuple(x.shape)) is None:
            return None
        q = state["q_own"]
        return state["p"].to(q.device), q
