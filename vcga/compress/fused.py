"""Fused host loops for the exact error feedback and the fixed-order decode, with the bits of the
torch-op path.

On the host, :class:`~vcga.compress.ef.ErrorFeedback` and :func:`~vcga.compress.exact.outer_sum`
(:func:`outer_sum` here) are memory-bound chains of element-wise torch operations: a TwoSum is six of them, each one a
pass over its operands (blocked to stay in cache, still ~7 passes per call), and ``P Qᵀ`` at rank
r is 2r − 1 passes over the decoded matrix. A loop that does an element's whole chain in registers
reads and writes each tensor once: on a 1024 × 1024 float32 matrix here the error feedback's two
calls take about half the time and the rank-4 decode about a fifth.

The loops are numba-compiled (an optional dependency, in the test extras: ``pip install numba``),
and they perform exactly the reference's IEEE 754 operations in the reference's order -- additions,
subtractions and products, each correctly rounded, no fused multiply-add (numba leaves LLVM's
``contract`` flag off unless ``fastmath`` is asked for, and it is not). Because a compiler or a
numba release could still change that, the loops are used only after a self-check against the
torch-op path on values that expose any contraction or reassociation (magnitudes 10⁻³⁰..10³⁰,
cancellation, subnormals): any differing bit and the torch path stays in use, with a warning.
``VCGA_FUSED=0`` turns them off.

Only float32 and float64 CPU tensors take these loops; everything else (accelerators, half
precision) keeps the torch operations, which are the definition of the bits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vcga.compress.exact import outer_sum as _outer_sum_ops
from vcga.compress.exact import two_diff_, two_sum_

__all__ = ["kernels", "usable", "checked", "enabled", "outer_sum", "probe_values"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {}
T = TypeVar("T")


def _compile() -> Any:
    import numba

    jit = numba.njit(cache=True, nogil=True, boundscheck=False, fastmath=False, error_model="numpy")

    @jit
    def ef_input(g: Any, hi: Any, lo: Any, x: Any) -> None:  # pragma: no cover - compiled
        # x = fl(g + hi) and g + hi == x + e exactly (TwoSum); lo += e (the pending low part)
        for i in range(g.shape[0]):
            a = g[i]
            b = hi[i]
            s = a + b
            bb = s - a
            e = (a - (s - bb)) + (b - bb)
            x[i] = s
            lo[i] = lo[i] + e

    @jit
    def ef_update(x: Any, sent: Any, hi: Any, lo: Any, fresh: bool) -> None:  # pragma: no cover
        # x - sent == h + l exactly (TwoDiff); hi = h, lo = l (+ the pending low part)
        for i in range(x.shape[0]):
            a = x[i]
            b = sent[i]
            s = a - b
            bb = s - a
            e = (a - (s - bb)) - (b + bb)
            hi[i] = s
            lo[i] = e if fresh else e + lo[i]

    @jit
    def outer_sum(pt: Any, qt: Any, out: Any) -> None:  # pragma: no cover - compiled
        # out[i, j] = ((pt[0,i] qt[0,j] + pt[1,i] qt[1,j]) + ...) in order k = 0, 1, ...
        r, n = pt.shape
        m = qt.shape[1]
        for i in range(n):
            row = out[i]
            p0 = pt[0, i]
            for j in range(m):
                row[j] = p0 * qt[0, j]
            for k in range(1, r):
                pk = pt[k, i]
                for j in range(m):
                    prod = pk * qt[k, j]
                    row[j] = row[j] + prod

    return ef_input, ef_update, outer_sum


def probe_values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` values of ``dtype`` that expose a changed rounding: magnitudes 10⁻³⁰..10³⁰ of both signs
    and, in the first sixteenth, subnormals. A loop's self-check (:func:`checked`) runs it and its
    torch reference on these and compares every bit."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(n, generator=g, dtype=torch.float64)
    exp = torch.randint(-30, 31, (n,), generator=g).to(torch.float64)
    v = (mant * torch.pow(10.0, exp)).to(dtype)
    tiny = torch.finfo(dtype).tiny
    v[: n // 16] = torch.randn(n // 16, generator=g, dtype=torch.float64).to(dtype) * tiny  # subnormals
    return v


def _self_check(ef_input: Any, ef_update: Any, outer: Any) -> str | None:
    """None when the loops give the torch path's bits on probing values, else what differed."""
    for dtype in (torch.float32, torch.float64):
        n = 4096
        gv, hv, lv, sv = (probe_values(dtype, n, s) for s in (1, 2, 3, 4))
        lv = lv * 1e-8
        sv[: n // 2] = (gv[: n // 2] * 0.999).to(dtype)  # heavy cancellation in x - sent
        # reference
        x_ref, e, t = torch.empty_like(gv), torch.empty_like(gv), torch.empty_like(gv)
        two_sum_(gv, hv, x_ref, e, t)
        lo_ref = lv + e
        h_ref, l_ref = torch.empty_like(gv), torch.empty_like(gv)
        two_diff_(x_ref, sv, h_ref, l_ref, t)
        l2_ref = l_ref + lo_ref
        # loops
        x, lo = torch.empty_like(gv), lv.clone()
        ef_input(gv.numpy(), hv.numpy(), lo.numpy(), x.numpy())
        h, l2 = torch.empty_like(gv), lo.clone()
        ef_update(x.numpy(), sv.numpy(), h.numpy(), l2.numpy(), False)
        h1, l1 = torch.empty_like(gv), torch.empty_like(gv)
        ef_update(x.numpy(), sv.numpy(), h1.numpy(), l1.numpy(), True)
        for name, a, b in (("x", x, x_ref), ("pending", lo, lo_ref), ("hi", h, h_ref), ("lo", l2, l2_ref),
                           ("fresh hi", h1, h_ref), ("fresh lo", l1, l_ref)):
            if not torch.equal(a.view(torch.int64 if dtype == torch.float64 else torch.int32),
                               b.view(torch.int64 if dtype == torch.float64 else torch.int32)):
                return f"error feedback {name} ({dtype})"
        for r in (1, 2, 4, 7):
            p = probe_values(dtype, 97 * r, 5 + r).reshape(97, r) * 1e-5
            q = probe_values(dtype, 130 * r, 9 + r).reshape(130, r) * 1e-5
            want = _outer_sum_ops(p, q)
            got = torch.empty(97, 130, dtype=dtype)
            outer(p.t().contiguous().numpy(), q.t().contiguous().numpy(), got.numpy())
            same = (got == want) | (torch.isnan(got) & torch.isnan(want))
            if not bool(same.all()):
                return f"outer sum rank {r} ({dtype})"
    return None


def enabled() -> bool:
    """False when ``VCGA_FUSED=0`` (or ``false``, ``no``, ``off``) turns the loops off."""
    return os.environ.get("VCGA_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def checked(name: str, build: Callable[[], T], check: Callable[[T], str | None]) -> T | None:
    """Loops that ``build`` compiles (with numba), used only if ``check`` -- which runs them beside
    the torch operations that define their bits and returns None or what differed -- finds every
    bit the same; else None, and the caller keeps the torch operations. Decided once per process
    and ``name``: None also when numba is missing, cannot compile here, or ``VCGA_FUSED=0``.

    For plugins too: a compressor whose host path is a chain of element-wise torch operations can
    ship a loop that does them in one pass, with the torch chain as the reference (as QSGD does)."""
    got = _state.get(name, ...)
    if got is not ...:
        return got
    with _lock:
        if name in _state:
            return _state[name]
        k: T | None = None
        if enabled():
            try:
                k = build()
            except ImportError:
                k = None
            except Exception as e:  # noqa: BLE001 - a numba that cannot compile here: the torch path
                log.warning("vcga: fused host loops (%s) unavailable (%s); using torch operations", name, e)
                k = None
            if k is not None:
                bad = check(k)
                if bad is not None:
                    log.warning("vcga: the fused host loop for %s does not reproduce the torch operations' bits "
                                "here; using torch operations", bad)
                    k = None
        _state[name] = k
        return k


def kernels() -> tuple[Any, Any, Any] | None:
    """``(ef_input, ef_update, outer_sum)`` compiled and checked, or None (numba missing, turned
    off with ``VCGA_FUSED=0``, or a loop that did not reproduce the torch path's bits)."""
    return checked("k", lambda: _compile(), lambda k: _self_check(*k))


def usable(*tensors: torch.Tensor) -> bool:
    """Can the loops take these tensors (all on the host, float32 or float64 alike, contiguous,
    plain memory that numpy can view: no autograd, no lazy negation)?"""
    dt = tensors[0].dtype
    if dt not in (torch.float32, torch.float64):
        return False
    return all(t.device.type == "cpu" and t.dtype == dt and t.is_contiguous() and not t.requires_grad
               and not t.is_neg() for t in tensors)


def outer_sum(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`vcga.compress.exact.outer_sum`, with its bits, by one compiled loop where the tensors
    allow it (host, float32/float64) and the loops passed their self-check; else that function."""
    n, _ = p.shape
    m = q.shape[0]
    if out is None:
        out = torch.empty(n, m, dtype=torch.result_type(p, q), device=p.device)
    if n and m and usable(p, q, out) and (k := kernels()) is not None:
        k[2](p.t().contiguous().numpy(), q.t().contiguous().numpy(), out.numpy())
        return out
    return _outer_sum_ops(p, q, out)
