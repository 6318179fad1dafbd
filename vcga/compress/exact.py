"""Arithmetic whose bits do not depend on the library, the device or the thread count.

Decoding a compressed gradient must give the same bits on every rank -- across vendors too -- or
the replicas drift apart. IEEE 754 makes each element-wise ``+ - * / sqrt`` correctly rounded on
every CPU and accelerator; library reductions (``sum``, ``norm``, ``matmul``) add in an order of
their own. So decoders use only element-wise operations and the fixed-order reductions below.
One library kernel breaks the rule: torch's host ``sqrt`` goes through MKL's vector math, which
is not correctly rounded on every CPU (float64 one ulp off on AMD Zen 4), so host square roots
are taken by Python's ``math.sqrt`` (C's, correctly rounded) instead (:func:`sqrt1`).

- :func:`tree_sum`: a sum over dim 0 as a fixed binary tree of element-wise additions;
- :func:`orthonormalize`: Gram-Schmidt with :func:`tree_sum` dot products;
- :func:`outer_sum`: ``P @ Q.T`` as a fixed sequence of element-wise products and additions.

:func:`two_sum` is Knuth's error-free transformation behind exact error feedback
(:class:`vcga.compress.ErrorFeedback`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["two_sum", "two_sum_", "two_diff_", "tree_sum", "sqrt1", "orthonormalize", "outer_sum"]


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, e)`` with ``s = fl(a + b)`` and ``a + b == s + e`` exactly (Knuth, TAOCP 4.2.2; round
    to nearest, no overflow). Six separate element-wise operations: no fused multiply-add can
    contract them."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def two_sum_(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, e: torch.Tensor, tmp: torch.Tensor) -> None:
    """:func:`two_sum` into preallocated ``s`` and ``e`` (``tmp`` is scratch; none may alias ``a``
    or ``b``): the same six operations in the same order, without allocating."""
    torch.add(a, b, out=s)
    torch.sub(s, a, out=tmp)  # bb
    torch.sub(s, tmp, out=e)  # s - bb
    torch.sub(a, e, out=e)  # a - (s - bb)
    torch.sub(b, tmp, out=tmp)  # b - bb
    e.add_(tmp)


def two_diff_(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, e: torch.Tensor, tmp: torch.Tensor) -> None:
    """``s = fl(a − b)`` and ``a − b == s + e`` exactly, into preallocated tensors (none may alias
    ``a`` or ``b``): :func:`two_sum_` of ``a`` and ``−b`` without forming ``−b`` -- the same bits,
    since rounding to nearest is symmetric (``fl(−b − bb) == −fl(b + bb)``), one pass fewer."""
    torch.sub(a, b, out=s)
    torch.sub(s, a, out=tmp)  # bb
    torch.sub(s, tmp, out=e)  # s - bb
    torch.sub(a, e, out=e)  # a - (s - bb)
    torch.add(b, tmp, out=tmp)  # b + bb
    e.sub_(tmp)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by a fixed pairwise tree of element-wise additions (same bits everywhere).

    Rows are added in halves: ``x[:h] + x[h:2h]`` (an odd last row carried up), log2(n) steps; the
    error bound is that of pairwise summation, γ_⌈log2 n⌉ Σ|xᵢ|."""
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        y = x[:h] + x[h:2 * h]
        x = torch.cat([y, x[2 * h:]]) if x.shape[0] % 2 else y
    return x[0] if x.shape[0] else torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)


def sqrt1(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a one-element tensor, in its dtype and on its device.

    On the host, ``math.sqrt`` of the value: torch's CPU kernel (MKL's ``vdSqrt``) gives other
    bits on some CPUs, and ranks on different hosts would then orthonormalise differently. A
    double's square root rounded to float32, float16 or bfloat16 is their correctly rounded root
    (53 >= 2p + 2 bits). On an accelerator the device's own ``sqrt`` (CUDA's is correctly rounded),
    so no value leaves the device."""
    if x.device.type != "cpu":
        return x.sqrt()
    v = x.item()
    return torch.full_like(x, math.sqrt(v) if v >= 0 else math.nan)  # NaN below 0 (and for NaN), as torch's


def orthonormalize(p: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``p`` (``[n, r]``), in place, with fixed-order dot
    products (:func:`tree_sum`): column i is normalised, then its projection is removed from every
    later column at once -- the order of torch's PowerSGD hook. A zero column stays zero (instead
    of NaN), so an all-zero gradient decodes to zero.

    One tree per column: the products of column i with itself *and* with every later column are
    summed together (``d``), and the projections use ``d[1:] / ‖c‖`` (the dot products with the
    normalised column, up to one rounding). Every operation is element-wise or a fixed tree, so the
    bits are the same everywhere; it issues about half the small operations of a tree for the norm
    and another for the projections, which is what its time is on the host (r small, n a few
    thousand)."""
    r = p.shape[-1]
    for i in range(r):
        d = tree_sum(p[:, i:i + 1] * p[:, i:])  # [r - i]: ‖c‖², then <c, later columns>
        norm = sqrt1(d[:1])
        nz = norm > 0
        safe = torch.where(nz, norm + eps, torch.ones_like(norm))
        col = p[:, i:i + 1]
        col /= safe
        col.mul_(nz.to(col.dtype))
        if i + 1 < r:
            p[:, i + 1:] -= (d[1:] / safe) * col
    return p


#: Rows of ``p @ q.T`` :func:`outer_sum` forms at a time: its r products and additions then run on
#: a block that stays in the CPU's cache (128 rows of 1024 float32 = 512 KiB) instead of streaming
#: the whole matrix through memory r times -- several times faster on a 1024 x 1024 matrix, and
#: the same operations on every element, so the same bits.
OUTER_BLOCK_ROWS = 128


def outer_sum(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p @ q.T`` for ``p`` ``[n, r]`` and ``q`` ``[m, r]`` as r element-wise outer products added
    in order k = 0, 1, ...: the same bits on every device (r is small: the PowerSGD rank).
    ``out`` (``[n, m]``, optional) receives the result.

    These torch operations define the bits; :func:`vcga.compress.fused.outer_sum` gives the same
    bits on the host with one compiled loop where a self-check allows it."""
    n, r = p.shape
    m = q.shape[0]
    pt, qt = p.t().contiguous(), q.t().contiguous()  # rows k: contiguous columns of p and q
    if out is None:
        out = torch.empty(n, m, dtype=torch.result_type(p, q), device=p.device)
    rows = n if p.device.type != "cpu" else max(1, min(n, OUTER_BLOCK_ROWS * 1024 // max(m, 1)))
    tmp = torch.empty(min(rows, n), m, dtype=out.dtype, device=out.device) if r > 1 else None
    for a in range(0, n, rows):
        b = min(a + rows, n)
        o = out[a:b]
        torch.mul(pt[0, a:b].unsqueeze(1), qt[0].unsqueeze(0), out=o)
        for k in range(1, r):
            t = tmp[:b - a]  # type: ignore[index]
            torch.mul(pt[k, a:b].unsqueeze(1), qt[k].unsqueeze(0), out=t)
            o.add_(t)
    return out
