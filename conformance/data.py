"""Test data and reference results for the conformance checks.

Every rank can generate every rank's input from a seed, so expected results are computed locally
without trusting the collective under test.

*Exact data* (nccl-tests style) makes the right answer independent of reduction order, so any
deviation is a bug, not rounding:

- SUM, AVG, PREMUL_SUM: integer mantissas ``k`` sharing one exponent (``k·2⁻²``), with
  ``|k| ≤ 2^p / n`` so that every partial sum of ``n`` ranks is an integer multiple of ``2⁻²`` below
  ``2^p·2⁻²``: exactly representable whatever the order. AVG data is non-negative (no cancellation),
  so its one rounding is bounded relative to the result (2 ulp).
- PRODUCT: signed powers of two whose exponents cannot leave the normal range for ``n`` factors.
- MIN, MAX: any exactly representable values; bitwise ops: random bit patterns.
- Integers: values small enough that no sum or product of ``n`` ranks overflows.

*Random data* (normal values rounded to the dtype) exercises rounding; it is compared with a float64
reference within the bounds of :mod:`vcga.conformance.bounds`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from vcga import dtypes as _dtypes
from vcga.contract import ReduceOp

from . import bounds

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHARED_EXPONENT",
    "PREMUL_FACTOR_EXACT",
    "PREMUL_FACTOR_RANDOM",
    "generator",
    "exact_input",
    "movement_input",
    "random_input",
    "exact_reduce",
    "Reference",
    "random_reference",
    "same_bits",
    "digest",
    "ops_for",
]

#: The exponent exact SUM data shares: values are k·2^SHARED_EXPONENT (fractions, yet exact).
SHARED_EXPONENT = -2
#: PREMUL_SUM factor on exact data: a power of two, so fl(f·x) is exact.
PREMUL_FACTOR_EXACT = 0.5
#: PREMUL_SUM factor on random data: exact in every dtype (two significant bits), not a power of two.
PREMUL_FACTOR_RANDOM = 0.75

# Largest normal exponent of each floating dtype (the smallest is in bounds).
_EMAX = {"float64": 1023, "float32": 127, "float16": 15, "bfloat16": 127, "float8_e4m3fn": 8, "float8_e5m2": 15}
_REAL_OF = {"complex64": "float32", "complex128": "float64"}


def generator(*key: object) -> torch.Generator:
    """A torch generator seeded from ``key`` (stable across processes and runs)."""
    import torch

    g = torch.Generator()
    g.manual_seed(xxhash.xxh64_intdigest(repr(key).encode()) & ((1 << 63) - 1))
    return g


def _kind(dtype: str) -> str:
    return _dtypes.get(dtype).kind


def _int_range(dtype: str) -> tuple[int, int]:
    """Inclusive value range of an integer dtype, capped to int64 (so references compute in int64)."""
    import torch

    info = torch.iinfo(_dtypes.to_torch(dtype))
    return max(info.min, -(2**63)), min(info.max, 2**63 - 1)


def _randint(g: torch.Generator, lo: int, hi: int, n: int) -> torch.Tensor:
    """Uniform int64 in [lo, hi] (inclusive), for any bounds inside int64."""
    import torch

    if hi - lo < 2**62:
        return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64)
    raw = torch.randint(0, 256, (n * 8,), generator=g, dtype=torch.uint8).view(torch.int64)
    return raw.clamp(lo, hi)


def _random_bits(g: torch.Generator, dtype: str, n: int) -> torch.Tensor:
    import torch

    size = _dtypes.get(dtype).itemsize
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(_dtypes.to_torch(dtype))


def _to(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """Cast float64/int64 values (exactly representable by construction) to ``dtype``."""
    import torch

    tdt = _dtypes.to_torch(dtype)
    if _kind(dtype) == "c":
        real = values.to(torch.float64)
        return torch.complex(real, real.flip(0) if real.numel() else real).to(tdt)
    return values.to(tdt)


def exact_input(op: ReduceOp | str, dtype: str, n: int, rank: int, world_size: int, seed: object = 0) -> torch.Tensor:
    """Rank ``rank``'s input for reducing ``op`` on order-independent data (see the module docstring)."""
    import torch

    op = ReduceOp(op)
    g = generator("exact", str(op), dtype, n, rank, world_size, seed)
    kind = _kind(dtype)
    if kind == "b":  # every op on bool is a logical one: any values are order-independent
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).to(torch.bool)
    if kind in "ui":
        lo, hi = _int_range(dtype)
        if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            return _random_bits(g, dtype, n)
        if op is ReduceOp.PRODUCT:
            mags = torch.randint(1, 3, (n,), generator=g, dtype=torch.int64)
            signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) * 2 - 1 if lo < 0 else 1
            return (mags * signs).to(_dtypes.to_torch(dtype))
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            return _randint(g, lo, hi, n).to(_dtypes.to_torch(dtype))
        # SUM, AVG, PREMUL_SUM: no partial sum of world_size ranks may overflow
        cap = hi // max(world_size, 1)
        low = 0 if (lo == 0 or op is ReduceOp.AVG) else -cap
        return _randint(g, low, cap, n).to(_dtypes.to_torch(dtype))
    real = _REAL_OF.get(dtype, dtype)
    p = bounds.SIGNIFICAND_BITS[real]
    if op is ReduceOp.PRODUCT:
        emax = _EMAX[real]
        emin = -math.floor(math.log2(1 / bounds.min_normal(real)))
        e = min(3, emax // max(world_size, 1), (-emin) // max(world_size, 1))
        exps = torch.randint(-e, e + 1, (n,), generator=g, dtype=torch.int64).to(torch.float64)
        signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1
        return _to(signs * torch.pow(2.0, exps), dtype)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        k = _randint(g, -(2 ** (p - 1)), 2 ** (p - 1), n).to(torch.float64)
        return _to(k * 2.0**SHARED_EXPONENT, dtype)
    cap = 2**p // max(world_size, 1)
    low = 0 if op is ReduceOp.AVG else -cap
    k = _randint(g, low, cap, n).to(torch.float64)
    return _to(k * 2.0**SHARED_EXPONENT, dtype)


def movement_input(dtype: str, n: int, rank: int, seed: object = 0) -> torch.Tensor:
    """Data for collectives that only move bytes: random bit patterns for integers, random exact
    values with -0.0, ±inf and NaN for floats (moved data must keep every bit), 0/1 for bool."""
    import torch

    g = generator("move", dtype, n, rank, seed)
    kind = _kind(dtype)
    if kind == "b":
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).to(torch.bool)
    if kind in "ui":
        return _random_bits(g, dtype, n)
    real = _REAL_OF.get(dtype, dtype)
    p = bounds.SIGNIFICAND_BITS[real]
    k = _randint(g, -(2 ** (p - 1)), 2 ** (p - 1), n).to(torch.float64) * 2.0**SHARED_EXPONENT
    specials = torch.tensor([-0.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    if real == "float8_e4m3fn":  # e4m3fn has no infinities
        specials = torch.tensor([-0.0, math.nan], dtype=torch.float64)
    m = min(len(specials), n // 4)  # keep most of the tensor ordinary
    if m:
        k[:m] = specials[:m]
        k = k[torch.randperm(n, generator=g)]
    return _to(k, dtype)


def random_input(op: ReduceOp | str, dtype: str, n: int, rank: int, seed: object = 0) -> torch.Tensor:
    """Random data for the rounding checks: normal values (SUM, AVG, PREMUL_SUM) or signed values in
    [0.5, 2) (PRODUCT, so products of a few ranks stay in range), rounded to ``dtype``."""
    import torch

    op = ReduceOp(op)
    g = generator("random", str(op), dtype, n, rank, seed)
    real = _REAL_OF.get(dtype, dtype)
    if op is ReduceOp.PRODUCT:
        mag = torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.5
        sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1
        vals = mag * sign
    else:
        vals = torch.randn(n, generator=g, dtype=torch.float64)
        if real.startswith("float8"):
            vals = vals.clamp(-8, 8)
    if _kind(dtype) == "c":
        im = torch.randn(n, generator=g, dtype=torch.float64)
        return torch.complex(vals, im).to(_dtypes.to_torch(dtype))
    return vals.to(_dtypes.to_torch(dtype))


def ops_for(dtype: str) -> tuple[ReduceOp, ...]:
    """The reduce ops that have a defined result on ``dtype`` (AVG/PREMUL_SUM only on floats and
    complex, bitwise only on integers and bool, MIN/MAX/PRODUCT not on complex)."""
    kind = _kind(dtype)
    if kind == "b":
        return (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    if kind in "ui":
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    if kind == "c":
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
    return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PREMUL_SUM)


def exact_reduce(op: ReduceOp | str, xs: Sequence[torch.Tensor], dtype: str,
                 premul_factor: float = PREMUL_FACTOR_EXACT) -> torch.Tensor:
    """The exact result of reducing ``xs`` (one tensor per rank) with ``op``, in ``dtype``.

    Exact for the data :func:`exact_input` makes, except AVG, whose one rounding the caller bounds
    (2 ulp on floats, < 1 on integers) against :func:`avg_exact`."""
    import torch

    op = ReduceOp(op)
    kind = _kind(dtype)
    tdt = _dtypes.to_torch(dtype)
    if kind == "b":
        stack = torch.stack([x.to(torch.uint8) for x in xs])
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            out = stack.amax(0)
        elif op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            out = stack.amin(0)
        elif op is ReduceOp.BXOR:
            out = stack.sum(0) % 2
        else:
            raise ValueError(f"{op} has no defined result on bool")
        return out.to(torch.bool)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        if kind not in "ui":
            raise ValueError(f"{op} is defined on integers only")
        acc = xs[0].contiguous().view(torch.uint8).clone()
        for x in xs[1:]:
            b = x.contiguous().view(torch.uint8)
            acc = {ReduceOp.BAND: acc & b, ReduceOp.BOR: acc | b, ReduceOp.BXOR: acc ^ b}[op]
        return acc.view(tdt)
    wide = torch.complex128 if kind == "c" else (torch.float64 if kind == "f" else torch.int64)
    stack = torch.stack([x.to(wide) for x in xs])
    if op is ReduceOp.SUM:
        out = stack.sum(0)
    elif op is ReduceOp.PREMUL_SUM:
        out = (stack * premul_factor).sum(0)
    elif op is ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op is ReduceOp.MIN:
        out = stack.amin(0)
    elif op is ReduceOp.MAX:
        out = stack.amax(0)
    elif op is ReduceOp.AVG:
        # floats: the caller bounds the one rounding against avg_exact(); integers: truncation
        out = stack.sum(0) / len(xs) if kind in "fc" else torch.div(stack.sum(0), len(xs), rounding_mode="trunc")
    else:  # pragma: no cover
        raise ValueError(op)
    return out.to(tdt)


def avg_exact(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The mathematically exact AVG of exact data, in float64 (or complex128)."""
    import torch

    wide = torch.complex128 if xs[0].is_complex() else torch.float64
    return torch.stack([x.to(wide) for x in xs]).sum(0) / len(xs)


class Reference:
    """A float64 reference for a reduction of random data, with a per-element error bound.

    :param value: the reference result (float64, or complex128 viewed as pairs of float64).
    :param bound: the per-element bound on |computed − value| for a correct backend, including the
        reference's own float64 error (see :mod:`vcga.conformance.bounds`).
    """

    __slots__ = ("value", "bound")

    def __init__(self, value: torch.Tensor, bound: torch.Tensor) -> None:
        self.value, self.bound = value, bound

    def __getitem__(self, index: slice) -> Reference:
        return Reference(self.value[index], self.bound[index])


#: Relative slack for evaluating a bound in float64 (its own error is ~n·2⁻⁵³, far below this).
EVAL_SLACK = 1 + 2.0**-40


def _sum2(stack: torch.Tensor) -> torch.Tensor:
    """Compensated sum over the first dimension (Ogita, Rump and Oishi's Sum2: TwoSum on every
    addition, the errors summed and added back): as accurate as summing in twice the precision,
    vectorised over the elements."""
    import torch

    s = stack[0].clone()
    c = torch.zeros_like(s)
    for x in stack[1:]:
        t = s + x
        z = t - s
        c = c + ((s - (t - z)) + (x - z))  # TwoSum: the exact rounding error of s + x
        s = t
    return s + c


def random_reference(op: ReduceOp | str, xs: Sequence[torch.Tensor], dtype: str,
                     premul_factor: float = PREMUL_FACTOR_RANDOM) -> Reference:
    """float64 reference and Higham bound for reducing random data ``xs`` with SUM, AVG,
    PREMUL_SUM or PRODUCT. Complex data is compared as (real, imaginary) pairs."""
    import torch

    op = ReduceOp(op)
    n = len(xs)
    real = _REAL_OF.get(dtype, dtype)
    if xs[0].is_complex():
        cols = [torch.view_as_real(x.to(torch.complex128)).reshape(-1) for x in xs]
    else:
        cols = [x.to(torch.float64) for x in xs]
    stack = torch.stack(cols)  # (ranks, elements)
    if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        # f·x is exact in float64 for data narrower than float64; for float64 data its rounding is
        # the u64·Σ|f·x| term below
        terms = stack * premul_factor if op is ReduceOp.PREMUL_SUM else stack
        s = _sum2(terms)
        abs_sum = terms.abs().sum(0)  # rounding here is covered by EVAL_SLACK
        u = bounds.unit_roundoff(real)
        # Sum2's own error (Ogita, Rump, Oishi 2005, Prop. 4.5): u64·|s| + γ_{n−1}(u64)²·Σ|x|
        ref_err = bounds.U_FP64 * s.abs() + bounds.gamma(n - 1, bounds.U_FP64) ** 2 * abs_sum
        if op is ReduceOp.SUM:
            value = s
            bound = bounds.gamma(n - 1, u) * abs_sum + ref_err
        elif op is ReduceOp.AVG:
            value = s / n
            bound = (bounds.gamma(n + 1, u) * abs_sum / n + n * bounds.tiny(real)
                     + ref_err / n + bounds.U_FP64 * value.abs())
        else:
            value = s
            bound = (bounds.gamma(n + 1, u) * abs_sum + n * bounds.tiny(real)
                     + ref_err + bounds.U_FP64 * abs_sum)
    elif op is ReduceOp.PRODUCT:
        value = stack.prod(0)
        p = value.abs()
        bound = (bounds.product_bound(1.0, n, real) - max(n - 1, 0) * bounds.tiny(real)) * p \
            + max(n - 1, 0) * bounds.tiny(real) + bounds.gamma(n - 1, bounds.U_FP64) * p
    else:
        raise ValueError(f"random data is checked for SUM, AVG, PREMUL_SUM and PRODUCT, not {op}")
    return Reference(value, bound * EVAL_SLACK)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (defined for every dtype, NaN payloads and -0.0 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def digest(t: torch.Tensor) -> str:
    """xxh3-64 of a tensor's dtype, shape and bytes."""
    import torch

    h = xxhash.xxh3_64()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
