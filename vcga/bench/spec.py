"""What ``vcga bench`` measures and how it reckons, as nccl-tests does: the collectives, datatypes
and reduce ops by their nccl-tests names, the sizes visited, each collective's buffer layout, the
bandwidth formulas, the columns of a row, and the data whose exact result does not depend on
reduction order. Pure arithmetic and definitions (torch only inside :func:`inputs`); the run itself
is :mod:`vcga.bench.runner`, which re-exports the public names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vcga.errors import VcgaConfigError

#: The collectives, in nccl-tests' order of binaries.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send_recv")
#: Collectives that take a reduce op (``-o``) and a root (``-r``).
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")

#: nccl-tests' datatype names (``-d``) -> torch dtype name; torch's own names are accepted too.
DTYPES: dict[str, str] = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
    "uint64": "uint64", "half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16",
}
_ALIASES = {"char": "int8", "int": "int32", "float16": "half", "float32": "float", "float64": "double",
            "fp16": "half", "fp32": "float", "fp64": "double", "bf16": "bfloat16"}
#: nccl-tests' reduce op names (``-o``).
REDOPS = ("sum", "prod", "max", "min", "avg")

#: Largest integer each dtype holds exactly, together with every smaller one.
_EXACT = {"int8": 127, "uint8": 255, "int32": 2**31 - 1, "uint32": 2**32 - 1, "int64": 2**62,
          "uint64": 2**62, "float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**53}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``n`` ranks (doc/PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str | int) -> int:
    """nccl-tests' size syntax: a number with an optional binary suffix K, M or G (``1M`` = 1048576)."""
    if isinstance(text, int):
        return text
    s = str(text).strip()
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    scale = 1
    if s and s[-1].lower() in units:
        scale, s = units[s[-1].lower()], s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise VcgaConfigError("size", text,
                              "a byte count with an optional K, M or G suffix (binary), e.g. 8, 1K, 32M") from None
    if value < 0 or not math.isfinite(value):
        raise VcgaConfigError("size", text, "a byte count >= 0")
    return int(value)


def sizes(minbytes: int, maxbytes: int, stepfactor: int | None = None, stepbytes: int | None = None) -> list[int]:
    """The sizes nccl-tests' loop visits: multiply by ``stepfactor`` when it is > 1, else add ``stepbytes``."""
    if minbytes > maxbytes:
        raise VcgaConfigError("minbytes", minbytes, f"at most maxbytes ({maxbytes})")
    if stepfactor is not None and stepfactor > 1:
        out, s = [], max(minbytes, 1)
        if minbytes == 0:
            out.append(0)
        while s <= maxbytes:
            out.append(s)
            s *= stepfactor
        return out
    step = stepbytes if stepbytes is not None else 1 << 20
    if step <= 0:
        raise VcgaConfigError("stepbytes", step, "a byte count > 0 (or a stepfactor > 1)")
    return list(range(minbytes, maxbytes + 1, step))


@dataclass(frozen=True)
class Geometry:
    """One collective's buffers for one size, in elements (nccl-tests' GetCollByteCount)."""

    send: int
    recv: int
    param: int  # the count argument of the call (per rank for all_gather/reduce_scatter, per peer for all_to_all)


def geometry(op: str, nbytes: int, elt: int, n: int) -> Geometry:
    count = nbytes // elt
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        base = (count // n) & ~(16 // elt - 1) if elt <= 16 else count // n
        if op == "all_gather":
            return Geometry(base, base * n, base)
        if op == "reduce_scatter":
            return Geometry(base * n, base, base)
        return Geometry(base * n, base * n, base)
    return Geometry(count, count, count)


def algbw_bytes(op: str, g: Geometry, elt: int, n: int) -> int:
    """The bytes nccl-tests divides by the time for algbw (its GetBw)."""
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return g.param * elt * n
    return g.param * elt


@dataclass
class BenchSpec:
    """What to measure (the CLI's flags)."""

    ops: tuple[str, ...] = ("all_reduce",)
    minbytes: int = 32 << 20
    maxbytes: int = 32 << 20
    stepfactor: int | None = None
    stepbytes: int | None = None
    iters: int = 20
    warmup_iters: int = 1
    check: int = 1
    dtypes: tuple[str, ...] = ("float",)
    redops: tuple[str, ...] = ("sum",)
    root: int = 0
    compare: str | None = None  # "gloo": the same run over a plain gloo group
    tiers: bool | None = None  # None: when the world mixes backends or nodes

    def validate(self) -> None:
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise VcgaConfigError("collective", ",".join(bad) or "(none)", "one or more of " + ", ".join(OPS))
        for d in self.dtypes:
            dtype_name(d)
        for o in self.redops:
            if o not in REDOPS:
                raise VcgaConfigError("op", o, "one of " + ", ".join(REDOPS) + " or all")
        if self.iters < 1:
            raise VcgaConfigError("iters", self.iters, "an integer >= 1")
        if self.warmup_iters < 0 or self.check < 0:
            raise VcgaConfigError("warmup_iters/check", (self.warmup_iters, self.check), "integers >= 0")
        if self.compare not in (None, "gloo"):
            raise VcgaConfigError("compare", self.compare, "gloo")
        sizes(self.minbytes, self.maxbytes, self.stepfactor, self.stepbytes)


def dtype_name(name: str) -> str:
    """nccl-tests' (or torch's) datatype name -> nccl-tests' name."""
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise VcgaConfigError("datatype", name, "one of " + ", ".join(DTYPES) + " (nccl-tests' names; "
                              "float16/float32/float64/bf16 accepted) or all")
    return key


@dataclass
class Row:
    """One measured line: one (collective, size, dtype, op) on one group, out-of-place or in-place."""

    op: str
    nranks: int
    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # None: not checked (-c 0)
    in_place: bool
    group: str = "vcga"  # "vcga", or "gloo" for --compare gloo
    tier: str = "world"  # "world", "in-vendor", "cross-vendor", "cross-node"
    ranks: list[int] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    vs_gloo: float | None = None  # this row's time / the same row's time on plain gloo

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ===================================================================================================
# Data whose exact result does not depend on reduction order
# ===================================================================================================


def inputs(dtype: str, redop: str, n: int, rank: int, count: int, rep: int, salt: int = 0) -> Any:
    """This rank's send data (int64 torch tensor) for one check: small integers, different per rank,
    element, repetition and collective (``salt``), whose exact reduction fits ``dtype``.

    Every partial result is an integer the dtype holds exactly, so any reduction order gives the
    same bits. SUM: values <= exact/n. AVG: per element a mean t <= exact/n - 2 and each rank t+1 or
    t-1 in pairs (t for a last unpaired rank), so the sum is n*t and the mean t exactly. PROD: 1 or
    2, with at most log2(exact) ranks ever contributing 2. MIN/MAX: any integer up to 2**20."""
    import torch

    exact = _EXACT[dtype]
    i = torch.arange(count, dtype=torch.int64)
    base = i * 2654435761 + rep * 977 + salt * 7919
    mix = (base + rank * 40503) % 2147483647
    if redop == "prod":
        k = min(n, int(math.log2(exact)))
        return 1 + (mix % 2) if rank < k else torch.ones(count, dtype=torch.int64)
    if redop == "avg":
        t = (base % 2147483647) % max(1, exact // n - 1)
        d = 0 if (n % 2 and rank == n - 1) else (1 if rank % 2 == 0 else -1)
        if dtype.startswith("uint"):  # no negative values: only where t >= 1
            return t + d * (t >= 1).to(torch.int64)
        return t + d
    if redop == "sum":
        return mix % (max(0, exact // n) + 1)
    return mix % (min(exact, 1 << 20) + 1)


def _reduce_exact(parts: Sequence[Any], redop: str, n: int) -> Any:
    import torch

    stack = torch.stack(list(parts))
    if redop in ("sum", "avg"):
        out = stack.sum(0)
        return out // n if redop == "avg" else out
    if redop == "prod":
        return stack.prod(0)
    return stack.max(0).values if redop == "max" else stack.min(0).values
