"""Check 13: a mixed-vendor world is what it claims, and results cross vendors exactly.

Every other check also runs in mixed-vendor worlds (``VCGA_SIM_VENDORS``): that is how "the above
through the bridge" is verified. This check adds what only a mixed world has: each rank really runs
the vendor the layout gives it, and the collectives that cross vendors keep each dtype's accuracy
(float64 through a CNCL group, whose library reduces doubles as floats) and give every rank the
same bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from vcga.config import parse_sim_vendors
from vcga.contract import CheckResult, ReduceOp

from . import data
from .base import Check, compare_exact, compare_reference
from .context import Context, Verdict
from .ops import FORMS, REDUCING_FORMS, input_numel, run_form

__all__ = ["MixedVendors"]


class MixedVendors(Check):
    name = "mixed-vendors"
    description = ("in a simulated mixed-vendor world, ranks run their own vendors, and collectives across "
                   "vendors are exact or within the dtype's bound, bitwise identical on every rank")
    defaults = {"n": 4097, "dtypes": ["float64", "float32", "float16", "bfloat16"]}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        if not ctx.vendor_set:
            yield ctx.result("vendor layout", True, skipped=True,
                             detail="not a mixed-vendor world (this check runs in VCGA_SIM_VENDORS worlds)")
            return
        yield ctx.run_case(f"vendor layout {ctx.vendor_set}", lambda: self._layout(ctx))
        n = int(self.opt(ctx, "n"))
        for dt in self.dtypes(ctx):
            yield ctx.run_case(f"all_reduce SUM {dt} across vendors: Higham bound and identical bits",
                               partial(self._sum, ctx, dt, n), dtype=dt)
        for form in FORMS:
            yield ctx.run_case(f"{form} float32 across vendors: exact and identical bits",
                               partial(self._form, ctx, form), dtype="float32")

    @staticmethod
    def _layout(ctx: Context) -> Verdict:
        expected = [v for v, count in parse_sim_vendors(ctx.vendor_set or "") for _ in range(count)]
        mine = ctx.backend.describe().get("stands_for") or ctx.backend.dist_backend
        everyone = ctx.exchange_json("vendors", [ctx.backend.name, mine, ctx.backend.vendor])
        wrong = [f"rank {r} runs {name} ({vendor}), expected {expected[r]}"
                 for r, (name, stands, vendor) in enumerate(everyone) if stands != expected[r]]
        if wrong:
            return Verdict.fail("; ".join(wrong))
        if len({v for _, _, v in everyone}) < 2:
            return Verdict.fail("every rank runs the same vendor: this is not a mixed-vendor world")
        return Verdict.ok(detail=", ".join(f"{r}:{name}" for r, (name, _, _) in enumerate(everyone)))

    @staticmethod
    def _identical(ctx: Context, tag: str, got: Any) -> str:
        digests = ctx.exchange(tag, data.digest(got).encode())
        if len(set(digests)) == 1:
            return ""
        return "results differ across ranks: " + ", ".join(
            f"rank {r}: {d.decode()[:16]}" for r, d in enumerate(digests))

    def _sum(self, ctx: Context, dt: str, n: int) -> Verdict:
        ws = ctx.world_size

        def inputs(r: int) -> Any:
            return data.random_input(ReduceOp.SUM, dt, n, r, "mixed")

        rec = run_form("all_reduce", inputs, ctx.rank, ws, n, op=ReduceOp.SUM)
        ref = data.random_reference(ReduceOp.SUM, [inputs(r) for r in range(ws)], dt)
        v = compare_reference(rec.result(), ref.value, ref.bound)
        differ = self._identical(ctx, f"mixed-sum:{dt}", rec.got)
        if differ:
            return Verdict.fail(differ, v.worst_error, v.bound)
        return v

    def _form(self, ctx: Context, form: str) -> Verdict:
        ws = ctx.world_size
        n = 5
        numel = input_numel(form, n, ws)
        if form in REDUCING_FORMS:
            def inputs(r: int) -> Any:
                return data.exact_input(ReduceOp.SUM, "float32", numel, r, ws, "mixed")
        else:
            def inputs(r: int) -> Any:
                return data.movement_input("float32", numel, r, "mixed")
        rec = run_form(form, inputs, ctx.rank, ws, n, op=ReduceOp.SUM if form in REDUCING_FORMS else None,
                       root=ws - 1)
        if rec.got is None:  # a non-root rank of reduce/gather: nothing received, nothing to swap
            return Verdict.ok()
        want = (data.exact_reduce(ReduceOp.SUM, [inputs(r) for r in range(ws)], "float32")[rec.reduce_slice]
                if form in REDUCING_FORMS else rec.expected())
        v = compare_exact(rec.got, want)
        if form in ("all_reduce", "all_gather_single", "all_gather", "broadcast"):
            differ = self._identical(ctx, f"mixed-form:{form}", rec.got)  # every rank exchanges, always
            if differ and v.passed:
                return Verdict.fail(differ)
        return v
