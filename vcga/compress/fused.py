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

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from vcga.compress.exact import outer_sum as _outer_sum_ops
from vcga.compress.exact import two_diff_, two_sum_

__all__ = ["kernels", "factored", "usable", "checked", "enabled", "outer_sum", "orthonormalize", "probe_values"]

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
        # Up to four products per pass over a row (the same roundings in the same order, each
        # product and each sum rounded on its own), so a rank-4 row is written once, not 7 times.
        # The passes are written out here, not in a helper: numba caches a loop that calls
        # another jitted closure anew in every process.
        r, n = pt.shape
        m = qt.shape[1]
        for i in range(n):
            row = out[i]
            p0 = pt[0, i]
            if r >= 4:
                p1, p2, p3 = pt[1, i], pt[2, i], pt[3, i]
                for j in range(m):
                    row[j] = ((p0 * qt[0, j] + p1 * qt[1, j]) + p2 * qt[2, j]) + p3 * qt[3, j]
                k = 4
            elif r == 3:
                p1, p2 = pt[1, i], pt[2, i]
                for j in range(m):
                    row[j] = (p0 * qt[0, j] + p1 * qt[1, j]) + p2 * qt[2, j]
                k = 3
            elif r == 2:
                p1 = pt[1, i]
                for j in range(m):
                    row[j] = p0 * qt[0, j] + p1 * qt[1, j]
                k = 2
            else:
                for j in range(m):
                    row[j] = p0 * qt[0, j]
                k = 1
            while k + 3 <= r:
                pa, pb, pc = pt[k, i], pt[k + 1, i], pt[k + 2, i]
                for j in range(m):
                    row[j] = ((row[j] + pa * qt[k, j]) + pb * qt[k + 1, j]) + pc * qt[k + 2, j]
                k += 3
            while k < r:
                pk = pt[k, i]
                for j in range(m):
                    row[j] = row[j] + pk * qt[k, j]
                k += 1

    return ef_input, ef_update, outer_sum


def _compile_factored() -> Any:
    import numba
    import numpy as np

    jit = numba.njit(cache=True, nogil=True, boundscheck=False, fastmath=False, error_model="numpy")

    @jit
    def ef_update_outer(x: Any, pt: Any, qt: Any, hi: Any, lo: Any, fresh: bool) -> None:  # pragma: no cover
        # row i of sent = ((pt[0,i] qt[0] + pt[1,i] qt[1]) + ...) in order k (outer_sum's bits), formed
        # in a row buffer that stays in cache; then x - sent == h + l exactly (TwoDiff), as ef_update.
        # Loops over a row's elements only: they vectorise.
        r, n = pt.shape
        m = qt.shape[1]
        row = np.empty(m, dtype=x.dtype)
        for i in range(n):
            # the row as outer_sum forms it: up to four products per pass (written out again here:
            # numba caches a loop that calls another jitted closure anew in every process)
            p0 = pt[0, i]
            if r >= 4:
                p1, p2, p3 = pt[1, i], pt[2, i], pt[3, i]
                for j in range(m):
                    row[j] = ((p0 * qt[0, j] + p1 * qt[1, j]) + p2 * qt[2, j]) + p3 * qt[3, j]
                k = 4
            elif r == 3:
                p1, p2 = pt[1, i], pt[2, i]
                for j in range(m):
                    row[j] = (p0 * qt[0, j] + p1 * qt[1, j]) + p2 * qt[2, j]
                k = 3
            elif r == 2:
                p1 = pt[1, i]
                for j in range(m):
                    row[j] = p0 * qt[0, j] + p1 * qt[1, j]
                k = 2
            else:
                for j in range(m):
                    row[j] = p0 * qt[0, j]
                k = 1
            while k + 3 <= r:
                pa, pb, pc = pt[k, i], pt[k + 1, i], pt[k + 2, i]
                for j in range(m):
                    row[j] = ((row[j] + pa * qt[k, j]) + pb * qt[k + 1, j]) + pc * qt[k + 2, j]
                k += 3
            while k < r:
                pk = pt[k, i]
                for j in range(m):
                    row[j] = row[j] + pk * qt[k, j]
                k += 1
            base = i * m
            for j in range(m):
                a = x[base + j]
                b = row[j]
                s = a - b
                bb = s - a
                e = (a - (s - bb)) - (b + bb)
                hi[base + j] = s
                lo[base + j] = e if fresh else e + lo[base + j]

    @jit
    def orthonormalize(p: Any, eps: Any, buf: Any) -> None:  # pragma: no cover - compiled
        # exact.orthonormalize's operations in its order: per column i, the products of column i
        # with columns i.. summed over rows by the same pairwise tree (rows [0, h) + [h, 2h), an odd
        # last row carried after them), the norm, the division, the projections
        n, r = p.shape
        zero = p.dtype.type(0)
        one = p.dtype.type(1)
        for i in range(r):
            w = r - i
            for a in range(n):
                for j in range(w):
                    buf[a, j] = p[a, i] * p[a, i + j]
            rows = n
            while rows > 1:
                h = rows // 2
                for a in range(h):
                    for j in range(w):
                        buf[a, j] = buf[a, j] + buf[h + a, j]
                if rows % 2:
                    for j in range(w):
                        buf[h, j] = buf[2 * h, j]
                    rows = h + 1
                else:
                    rows = h
            if n == 0:
                for j in range(w):
                    buf[0, j] = zero
            norm = np.sqrt(buf[0, 0])
            nz = norm > zero
            safe = norm + eps if nz else one
            f = one if nz else zero
            for a in range(n):
                p[a, i] = (p[a, i] / safe) * f
            for j in range(1, w):
                t = buf[0, j] / safe
                for a in range(n):
                    p[a, i + j] = p[a, i + j] - t * p[a, i]

    return ef_update_outer, orthonormalize


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
        for r in (1, 2, 3, 4, 5, 7, 8):  # every way a row's passes group the products
            p = probe_values(dtype, 97 * r, 5 + r).reshape(97, r) * 1e-5
            q = probe_values(dtype, 130 * r, 9 + r).reshape(130, r) * 1e-5
            want = _outer_sum_ops(p, q)
            got = torch.empty(97, 130, dtype=dtype)
            outer(p.t().contiguous().numpy(), q.t().contiguous().numpy(), got.numpy())
            same = (got == want) | (torch.isnan(got) & torch.isnan(want))
            if not bool(same.all()):
                return f"outer sum rank {r} ({dtype})"
    return None


def _self_check_factored(ef_update_outer: Any, ortho: Any) -> str | None:
    """None when the factored error-feedback loop and the orthonormalisation give the bits of the
    torch operations that define them on probing values, else what differed."""
    from vcga.compress.exact import orthonormalize as _ortho_ops

    for dtype in (torch.float32, torch.float64):
        bits = torch.int64 if dtype == torch.float64 else torch.int32
        for r, (n, m) in ((1, (31, 17)), (2, (23, 19)), (3, (29, 33)), (4, (97, 130)), (5, (17, 41)), (7, (40, 65)),
                          (8, (13, 27))):
            p = probe_values(dtype, n * r, 20 + r).reshape(n, r) * 1e-5
            q = probe_values(dtype, m * r, 40 + r).reshape(m, r) * 1e-5
            x = probe_values(dtype, n * m, 60 + r)
            x[: n * m // 2] = _outer_sum_ops(p, q).reshape(-1)[: n * m // 2] * 1.001  # heavy cancellation
            lo0 = probe_values(dtype, n * m, 80 + r) * 1e-8
            for fresh in (True, False):
                h_ref, l_ref, t = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
                two_diff_(x, _outer_sum_ops(p, q).reshape(-1), h_ref, l_ref, t)
                if not fresh:
                    l_ref = l_ref + lo0
                h, lo = torch.empty_like(x), lo0.clone()
                ef_update_outer(x.numpy(), p.t().contiguous().numpy(), q.t().contiguous().numpy(), h.numpy(),
                                lo.numpy(), fresh)
                if not (torch.equal(h.view(bits), h_ref.view(bits)) and torch.equal(lo.view(bits), l_ref.view(bits))):
                    return f"factored error feedback rank {r} ({dtype})"
            for cols in (p, torch.cat([p[:, :1] * 0, p], 1)):  # a zero column stays zero
                want = _ortho_ops(cols.clone())
                got = cols.clone()
                ortho(got.numpy(), _scalar(dtype, 0.0), torch.empty(got.shape, dtype=dtype).numpy())
                same = (got.view(bits) == want.view(bits)) | (torch.isnan(got) & torch.isnan(want))
                if not bool(same.all()):
                    return f"orthonormalisation rank {cols.shape[1]} ({dtype})"
    return None


def _scalar(dtype: torch.dtype, v: float) -> Any:
    """``v`` as a numpy scalar of ``dtype``: what a tensor of that dtype adds a Python float as."""
    import numpy as np

    return (np.float32 if dtype == torch.float32 else np.float64)(v)


def factored() -> tuple[Any, Any] | None:
    """``(ef_update_outer, orthonormalize)`` compiled and checked, or None (as :func:`kernels`)."""
    return checked("factored", lambda: _compile_factored(), lambda k: _self_check_factored(*k))


def orthonormalize(p: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """:func:`vcga.compress.exact.orthonormalize` (in place), with its bits, by one compiled loop
    where the tensor allows it (host, float32/float64, contiguous, ``eps`` 0: what the loop was
    checked with) and the loop passed its self-check: that function's tree per column is a few
    small torch operations per level, each costing more than its arithmetic at PowerSGD's ranks."""
    from vcga.compress.exact import orthonormalize as _ortho_ops

    if eps == 0 and p.dim() == 2 and p.numel() and usable(p) and (k := factored()) is not None:
        k[1](p.numpy(), _scalar(p.dtype, eps), torch.empty(p.shape, dtype=p.dtype).numpy())
        return p
    return _ortho_ops(p, eps)


def enabled() -> bool:
    """False when ``VCGA_FUSED=0`` (or ``false``, ``no``, ``off``) turns the loops off."""
    return os.environ.get("VCGA_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def checked(name: str, build: Callable[[], T], check: Callable[[T], str | None]) -> T | None:
    """Loops that ``build`` compiles (with numba), used only if ``check`` -- which runs them beside
    the torch operations that define their bits and returns None or what differed -- finds every
    bit the same; else None, and the caller keeps the torch operations. Decided once per process
    and ``name``: None also when numba is missing, cannot compile here, or ``VCGA_FUSED=0``. numba
    compiles a loop at its first call, so in ``check``: the check runs under a lock that lets one
    process of the machine compile ``name``'s loops at a time (:func:`_one_compile_at_a_time`).

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
                with _one_compile_at_a_time(name):  # numba compiles at a loop's first call: in the check
                    bad = check(k)
                if bad is not None:
                    log.warning("vcga: the fused host loop for %s does not reproduce the torch operations' bits "
                                "here; using torch operations", bad)
                    k = None
        _state[name] = k
        return k


#: How long a process waits for another one's compile of the same loops before it compiles them
#: itself: a compile takes seconds; a holder that never ends it (stopped in a debugger, SIGSTOP)
#: must not stop every other rank of the machine. A holder that dies releases the lock at once.
COMPILE_WAIT_S = 120.0


@contextlib.contextmanager
def _one_compile_at_a_time(name: str) -> Iterator[None]:
    """Holds a lock that every process of this machine's user takes to compile ``name``'s loops.

    numba's on-disk cache (``cache=True``) spares a process the compile only once the cache has an
    entry, and the ranks of a job start together: on a fresh install every rank of the first job
    would compile the same loops at the same time (about 5 CPU-s for all of them,
    docs/compression.md, "Fused loops at start-up"). Under this lock the first process compiles and
    writes numba's cache; the others wait for it and then load from the cache. The lock is a file in
    VCGA's user cache (:mod:`vcga._usercache`, ``fused/NAME.lock``), taken with ``flock`` through
    filelock, so the kernel releases it when its holder dies. Where it cannot be taken (a folder
    that cannot be written, :data:`COMPILE_WAIT_S` passed), the process compiles without it, as it
    would alone."""
    from filelock import FileLock, Timeout

    from vcga._usercache import cache_dir

    lock: FileLock | None = None
    try:
        folder = cache_dir() / "fused"
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder / f"{name}.lock"), timeout=COMPILE_WAIT_S)
        lock.acquire()
    except (OSError, Timeout) as e:
        log.debug("vcga: compiling the fused loops (%s) without the machine-wide lock: %s", name, e)
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def kernels() -> tuple[Any, Any, Any] | None:
    """``(ef_input, ef_update, outer_sum)`` compiled and checked, or None (numba missing, turned
    off with ``VCGA_FUSED=0``, or a loop that did not reproduce the torch path's bits)."""
    return checked("k", lambda: _compile(), lambda k: _self_check(*k))


def usable(*tensors: torch.Tensor) -> bool:
    """Can the loops take these tensors (all on the host, float32 or float64 alike, contiguous,
    plain memory that numpy can view: no autograd, no lazy negation)?"""
    dt = tensors[0].dtype
    if dt is not torch.float32 and dt is not torch.float64:
        return False
    for t in tensors:  # a plain loop of the cheapest checks: it runs several times per tensor and step
        if t.dtype is not dt or not t.is_cpu or t.requires_grad or not t.is_contiguous() or t.is_neg():
            return False
    return True


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
