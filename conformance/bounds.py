"""Error bounds for the numeric conformance checks, derived -- never guessed.

Every floating-point bound here comes from the standard model of floating-point arithmetic
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.2): each operation on
representable numbers returns ``(x op y)(1 + δ)``, ``|δ| ≤ u``, with ``u`` the unit roundoff of the
dtype, plus (for multiplication and division only) an absolute term ``|η| ≤ tiny/2`` when the
result underflows (``tiny`` = the smallest positive subnormal). Addition that underflows is exact.

From it (``γ_k = k·u / (1 − k·u)``):

- **SUM** of ``n`` rank contributions, in any order and any tree shape (Higham (4.4)):
  ``|ŝ − s| ≤ γ_{n−1} · Σ|x_r|``. One rank (n = 1) must be exact.
- **AVG**: either SUM then one division by ``n`` (error ≤ γ_n·Σ|x_r|/n), or each term multiplied by
  ``fl(1/n)`` first and then summed, as NCCL does for floats (each term picks up ≤ γ_2, the sum
  γ_{n−1}, and (1+γ_2)(1+γ_{n−1}) ≤ 1+γ_{n+1}, Higham Lemma 3.3). The bound covers both:
  ``γ_{n+1} · Σ|x_r| / n + n·tiny``.
- **PREMUL_SUM** with factor ``f``: each term ``fl(f·x_r)`` (≤ u) then a sum (γ_{n−1}):
  ``γ_{n+1} · |f|·Σ|x_r| + n·tiny`` (γ_{n+1} ≥ γ_n also covers a factor rounded to the dtype).
- **PRODUCT** of ``n`` factors, any order: ``|p̂ − p| ≤ γ_{n−1} · |p| + (n−1)·tiny``.
- **MIN, MAX, bitwise ops, data movement**: exact (a selection or a copy), bound 0.

Low-precision dtypes a library accumulates in a wider type (fp16 summed in fp32, rounded once at
the end) stay inside these bounds: ``u_16 + γ_{n−1}(u_32)(1+u_16) ≤ γ_{n−1}(u_16)`` for n ≥ 2.

The references the checks compare against are computed in float64 -- sums compensated (Ogita,
Rump and Oishi's Sum2, error ≤ ``u·|s| + γ_{n−1}²·Σ|x|`` at ``u = 2⁻⁵³``), products left to right --
so each check adds the reference's own error: negligible for fp32 and narrower, essential for fp64.
"""

from __future__ import annotations

import math

from vcga import dtypes as _dtypes

__all__ = [
    "SIGNIFICAND_BITS",
    "unit_roundoff",
    "gamma",
    "tiny",
    "min_normal",
    "ulp",
    "sum_bound",
    "avg_bound",
    "premul_sum_bound",
    "product_bound",
    "U_FP64",
]

#: Significand precision p (implicit bit included) of every floating dtype; u = 2^-p.
SIGNIFICAND_BITS: dict[str, int] = {
    "float64": 53,
    "float32": 24,
    "float16": 11,
    "bfloat16": 8,
    "float8_e4m3fn": 4,
    "float8_e5m2": 3,
    "complex64": 24,
    "complex128": 53,
}

#: Smallest normal exponent (x ≥ 2^emin is normal) of every floating dtype.
_EMIN: dict[str, int] = {
    "float64": -1022,
    "float32": -126,
    "float16": -14,
    "bfloat16": -126,
    "float8_e4m3fn": -6,
    "float8_e5m2": -14,
    "complex64": -126,
    "complex128": -1022,
}

U_FP64 = 2.0**-53


def _floating(dtype: str) -> str:
    if dtype not in SIGNIFICAND_BITS:
        kind = _dtypes.get(dtype).kind
        raise ValueError(f"{dtype} is not a floating dtype (kind {kind!r}); integer results are checked exactly")
    return dtype


def unit_roundoff(dtype: str) -> float:
    """``u = 2^-p``: half the distance from 1 to the next representable number."""
    return 2.0 ** -SIGNIFICAND_BITS[_floating(dtype)]


def gamma(k: int, u: float) -> float:
    """Higham's ``γ_k = k·u / (1 − k·u)``; infinite when ``k·u ≥ 1`` (no bound exists)."""
    if k <= 0:
        return 0.0
    ku = k * u
    return math.inf if ku >= 1 else ku / (1 - ku)


def min_normal(dtype: str) -> float:
    return 2.0 ** _EMIN[_floating(dtype)]


def tiny(dtype: str) -> float:
    """The smallest positive subnormal: the spacing of numbers below :func:`min_normal`."""
    return 2.0 ** (_EMIN[_floating(dtype)] - SIGNIFICAND_BITS[dtype] + 1)


def ulp(x: float, dtype: str) -> float:
    """The unit in the last place of ``|x|`` in ``dtype`` (the subnormal spacing below the normal range)."""
    ax = abs(x)
    if ax < min_normal(dtype):
        return tiny(dtype)
    e = math.floor(math.log2(ax))
    return 2.0 ** (e - SIGNIFICAND_BITS[dtype] + 1)


def sum_bound(abs_sum: float, n: int, dtype: str) -> float:
    """Bound on ``|ŝ − s|`` for a sum of ``n`` terms with ``Σ|x| = abs_sum``: ``γ_{n−1}·Σ|x|``."""
    return gamma(n - 1, unit_roundoff(dtype)) * abs_sum


def avg_bound(abs_sum: float, n: int, dtype: str) -> float:
    """Bound on the AVG of ``n`` terms: ``γ_{n+1}·Σ|x|/n + n·tiny`` (sum-then-divide or premultiply)."""
    return gamma(n + 1, unit_roundoff(dtype)) * abs_sum / n + n * tiny(dtype)


def premul_sum_bound(abs_scaled_sum: float, n: int, dtype: str) -> float:
    """Bound on ``Σ fl(f·x_r)``: ``γ_{n+1}·|f|·Σ|x| + n·tiny``; pass ``|f|·Σ|x|``."""
    return gamma(n + 1, unit_roundoff(dtype)) * abs_scaled_sum + n * tiny(dtype)


def product_bound(abs_product: float, n: int, dtype: str) -> float:
    """Bound on a product of ``n`` factors: ``γ_{n−1}·|p| + (n−1)·tiny``."""
    return gamma(n - 1, unit_roundoff(dtype)) * abs_product + max(n - 1, 0) * tiny(dtype)
