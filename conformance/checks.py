"""Built-in conformance checks.

``exact-sum``: all_reduce SUM on order-independent data (small integers stored in floating point,
as nccl-tests does): every partial sum is an integer far below 2**mantissa_bits, so every
summation order gives the same, exactly representable result. Anything but a bit-exact match is a
bug in the backend, not rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vcga.contract import CheckResult, Collective, ReduceOp, Support, hookimpl

# Integer values in [-8, 8]: with <= 16 ranks every partial sum is within +-128, exact even in
# bfloat16 (8 significant bits represent every integer up to 256).
EXACT_SUM_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
EXACT_SUM_SIZES = (1, 7, 1024, 65537)


def rank_values(n: int, rank: int) -> Any:
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return (i * 7 + rank * 13) % 17 - 8


class ExactSum:
    name = "exact-sum"
    description = "all_reduce SUM is bit-exact on order-independent integer-valued data"

    def run(self, context: Any) -> Iterator[CheckResult]:
        import torch
        import torch.distributed as dist

        from vcga import dtypes

        table = context.backend.capabilities()
        for dt in EXACT_SUM_DTYPES:
            if table.support_of(Collective.ALL_REDUCE, dt, ReduceOp.SUM) is not Support.NATIVE:
                yield CheckResult(self.name, context.backend.name, f"all_reduce SUM {dt}", True, dtype=dt,
                                  skipped=True, detail="not native on this backend")
                continue
            worst = 0.0
            failed = ""
            for n in EXACT_SUM_SIZES:
                t = rank_values(n, context.rank).to(dtypes.to_torch(dt))
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.SUM
                context.pg.allreduce([t], opts).wait(context.timeout)
                want = sum(rank_values(n, r) for r in range(context.world_size)).to(t.dtype)
                err = (t.double() - want.double()).abs().max().item() if n else 0.0
                worst = max(worst, err)
                if not torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t, want) and not failed:
                    failed = f"n={n}: max |error| {err:g}, expected bit-exact"
            yield CheckResult(self.name, context.backend.name,
                              f"all_reduce SUM {dt} n={','.join(map(str, EXACT_SUM_SIZES))} ws={context.world_size}",
                              not failed, dtype=dt, worst_error=worst, bound=0.0, detail=failed)


@hookimpl
def vcga_conformance_checks() -> list[Any]:
    return [ExactSum()]
