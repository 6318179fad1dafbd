"""Checks 2-5: exact results on order-independent data, Higham bounds on random data, cross-rank
bitwise identity, and the capability table cell by cell."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from vcga.contract import CheckResult, Collective, ReduceOp, Support
from vcga.errors import VcgaUnsupportedError

from . import data
from .base import (
    Check,
    compare_exact,
    compare_reference,
    compare_ulps,
    runnable,
    sizes_label,
)
from .context import Context, Verdict, first_line
from .ops import COLLECTIVE_OF, FORM_OF, REDUCING_FORMS, input_numel, p2p, run_form

__all__ = ["ExactReduce", "RandomReduce", "CrossRankIdentity", "DtypeMatrix"]


def _exact_case(ctx: Context, form: str, op: ReduceOp, dt: str, n: int, root: int, seed: Any = 0) -> Verdict:
    """Run one reducing form on exact data and compare: bit-exact, AVG within 2 ulp (floats) or
    below 1 (integers: torch leaves the rounding of an integer average to the library)."""
    ws = ctx.world_size
    numel = input_numel(form, n, ws)

    def inputs(r: int) -> Any:
        return data.exact_input(op, dt, numel, r, ws, seed)

    rec = run_form(form, inputs, ctx.rank, ws, n, op=op, root=root, premul_factor=data.PREMUL_FACTOR_EXACT)
    if rec.got is None:
        return Verdict.ok(0.0, 0.0)
    xs = [inputs(r) for r in range(ws)]
    if op is ReduceOp.AVG:
        exact = data.avg_exact(xs)[rec.reduce_slice]
        if not (rec.got.is_floating_point() or rec.got.is_complex()):
            import torch

            err = (rec.got.to(torch.float64) - exact).abs()
            worst = float(err.max()) if err.numel() else 0.0
            if worst < 1:
                return Verdict.ok(worst, 1.0)
            return Verdict.fail(f"integer AVG off by {worst:g} (must be below 1)", worst, 1.0)
        return compare_ulps(rec.got, exact, dt, 2.0)
    want = data.exact_reduce(op, xs, dt, data.PREMUL_FACTOR_EXACT)[rec.reduce_slice]
    return compare_exact(rec.got, want, f"n={n}")


def _exact_sizes(ctx: Context, form: str, op: ReduceOp, dt: str, sizes: list[int], root: int) -> Verdict:
    return _merge_verdicts([_exact_case(ctx, form, op, dt, n, root) for n in sizes])


def _merge_verdicts(verdicts: list[Verdict]) -> Verdict:
    """One verdict for several sizes or seeds: the first failure, else the one closest to its bound."""
    for v in verdicts:
        if not v.passed:
            return v

    def ratio(v: Verdict) -> float:
        e, b = v.worst_error or 0.0, v.bound
        return e / b if b else (0.0 if e == 0 else float("inf"))

    return max(verdicts, key=ratio, default=Verdict.ok())


class ExactReduce(Check):
    """Check 2: every reduce op on data whose exact result does not depend on reduction order."""

    name = "exact-reduce"
    description = ("every reduce op on order-independent data (nccl-tests style): bit-exact, "
                   "AVG within 2 ulp")
    defaults = {"dtypes": "all", "ops": "all", "sizes": [1, 33, 1025],
                "forms": ["all_reduce", "reduce", "reduce_scatter_single"]}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        sizes = list(self.opt(ctx, "sizes"))
        ops = self.ops(ctx)
        for form in self.opt(ctx, "forms"):
            if form not in REDUCING_FORMS:
                raise ValueError(f"exact-reduce: {form!r} is not a reducing form ({', '.join(REDUCING_FORMS)})")
            coll = COLLECTIVE_OF[form]
            for dt in self.dtypes(ctx):
                for op in data.ops_for(dt):
                    if op not in ops:
                        continue
                    unit = " (ulp)" if op is ReduceOp.AVG and data._kind(dt) in "fc" else ""
                    case = f"{form} {op} {dt} n={sizes_label(sizes)}{unit}"
                    root = ctx.world_size - 1  # a non-zero root where there is one
                    yield ctx.run_unless(case, runnable(ctx, table, coll, dt, op),
                                         partial(_exact_sizes, ctx, form, op, dt, sizes, root), dtype=dt,
                                         cell=(coll, dt, op))


class RandomReduce(Check):
    """Check 3: random data against a float64 reference within the Higham bound."""

    name = "random-reduce"
    description = ("random data against a float64 reference, element by element, within the Higham "
                   "bound for the dtype and world size")
    defaults = {"dtypes": ["float16", "bfloat16", "float32", "float64"],
                "ops": ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"], "sizes": [4097],
                "forms": ["all_reduce", "reduce_scatter_single"], "seeds": 1}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        sizes = list(self.opt(ctx, "sizes"))
        seeds = int(self.opt(ctx, "seeds"))
        for form in self.opt(ctx, "forms"):
            coll = COLLECTIVE_OF[form]
            for dt in self.dtypes(ctx):
                if data._kind(dt) not in "fc":
                    raise ValueError(f"random-reduce checks floating dtypes; {dt} is exact (exact-reduce)")
                for op in self.ops(ctx):
                    if op not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.PREMUL_SUM) \
                            or op not in data.ops_for(dt):
                        continue
                    case = f"{form} {op} {dt} n={sizes_label(sizes)}"
                    yield ctx.run_unless(case, runnable(ctx, table, coll, dt, op),
                                         partial(self._every, ctx, form, op, dt, sizes, seeds), dtype=dt,
                                         cell=(coll, dt, op))

    @classmethod
    def _every(cls, ctx: Context, form: str, op: ReduceOp, dt: str, sizes: list[int], seeds: int) -> Verdict:
        return _merge_verdicts([cls._one(ctx, form, op, dt, n, s) for n in sizes for s in range(seeds)])

    @staticmethod
    def _one(ctx: Context, form: str, op: ReduceOp, dt: str, n: int, seed: int) -> Verdict:
        ws = ctx.world_size
        numel = input_numel(form, n, ws)

        def inputs(r: int) -> Any:
            return data.random_input(op, dt, numel, r, seed)

        rec = run_form(form, inputs, ctx.rank, ws, n, op=op, root=ws - 1, premul_factor=data.PREMUL_FACTOR_RANDOM)
        if rec.got is None:
            return Verdict.ok(0.0, 0.0)
        ref = data.random_reference(op, [inputs(r) for r in range(ws)], dt, data.PREMUL_FACTOR_RANDOM)
        if rec.got.is_complex():  # (re, im) pairs: the reference is laid out the same way
            sl = rec.reduce_slice or slice(None)
            start = 0 if sl.start is None else 2 * sl.start
            stop = None if sl.stop is None else 2 * sl.stop
            ref = ref[slice(start, stop)]
        else:
            ref = ref[rec.reduce_slice or slice(None)]
        return compare_reference(rec.got, ref.value, ref.bound)


class CrossRankIdentity(Check):
    """Check 4: every rank ends with the same bits (hashes swapped through the store)."""

    name = "cross-rank-identity"
    description = ("every rank receives bitwise identical results (xxh3 hashes compared through the "
                   "store, not through the group under test)")
    defaults = {"dtypes": ["float16", "bfloat16", "float32", "float64"],
                "ops": ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"], "sizes": [4097],
                "forms": ["all_reduce", "all_gather_single", "broadcast"]}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        sizes = list(self.opt(ctx, "sizes"))
        for form in self.opt(ctx, "forms"):
            if form not in ("all_reduce", "all_gather_single", "all_gather", "broadcast"):
                raise ValueError(f"cross-rank-identity: {form!r} does not give every rank the same result")
            coll = COLLECTIVE_OF[form]
            for dt in self.dtypes(ctx):
                ops: list[ReduceOp | None] = (
                    [o for o in self.ops(ctx) if o in data.ops_for(dt)] if form in REDUCING_FORMS else [None])
                for op in ops:
                    case = f"{form}{' ' + str(op) if op else ''} {dt} n={sizes_label(sizes)}"
                    yield ctx.run_unless(case, runnable(ctx, table, coll, dt, op),
                                         partial(self._one, ctx, form, op, dt, sizes), dtype=dt,
                                         cell=(coll, dt, op))

    def _one(self, ctx: Context, form: str, op: ReduceOp | None, dt: str, sizes: list[int]) -> Verdict:
        ws = ctx.world_size
        digests = []
        for n in sizes:
            numel = input_numel(form, n, ws)

            def inputs(r: int, n: int = numel) -> Any:
                if op is None:
                    return data.random_input(ReduceOp.SUM, dt, n, r, "identity")
                return data.random_input(op, dt, n, r, "identity")

            rec = run_form(form, inputs, ctx.rank, ws, n, op=op, root=ws - 1,
                           premul_factor=data.PREMUL_FACTOR_RANDOM)
            digests.append(data.digest(rec.result()))
        everyone = ctx.exchange_json(f"digest:{form}:{op}:{dt}", digests)
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(everyone):
            groups.setdefault("/".join(d), []).append(r)
        if len(groups) == 1:
            return Verdict.ok()
        parts = [f"{'rank' if len(rs) == 1 else 'ranks'} {','.join(map(str, rs))} "
                 f"{'holds' if len(rs) == 1 else 'hold'} {h[:16]}" for h, rs in groups.items()]
        return Verdict.fail(f"results differ across ranks: {'; '.join(parts)}")


class DtypeMatrix(Check):
    """Check 5: the capability table, cell by cell: claims must work, refusals must be typed."""

    name = "dtype-matrix"
    description = ("every (collective, dtype, op) the capability table claims works exactly, and every "
                   "refused one raises VcgaUnsupportedError (a table that lies fails)")
    defaults = {"dtypes": "all", "n": 3}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        if table is None:
            yield ctx.result("capability table", True, skipped=True,
                             detail="the process group exposes no capability table for this mixed-vendor world")
            return
        n = int(self.opt(ctx, "n"))
        for coll in Collective:
            for dt in self.dtypes(ctx):
                ops: list[ReduceOp | None] = list(ReduceOp) if coll.reduces else [None]
                for op in ops:
                    cell = table.lookup(coll, dt, op)
                    ref = (coll, dt, op)
                    label = f"{cell.support}" + (f" via {cell.via}" if cell.via else "")
                    case = f"{coll} {dt}{' ' + str(op) if op else ''} [{label}]"
                    if coll is Collective.SEND_RECV and ctx.world_size < 2:
                        yield ctx.result(case, True, dtype=dt, skipped=True, detail="send/recv needs two ranks",
                                         cell=ref)
                        continue
                    if cell.support is Support.REFUSED:
                        if not ctx.through_vcga:
                            yield ctx.result(case, True, dtype=dt, skipped=True,
                                             detail="refusals are raised by the vcga group's dispatch; "
                                                    "a native group is not asked", cell=ref)
                            continue
                        yield ctx.run_case(case, partial(self._refused, ctx, coll, dt, op, n), dtype=dt, cell=ref)
                        continue
                    if cell.support is Support.EMULATED and not ctx.through_vcga:
                        yield ctx.result(case, True, dtype=dt, skipped=True, cell=ref,
                                         detail=f"emulated by VCGA ({cell.via}); a native group cannot run it")
                        continue
                    if op is not None and op not in data.ops_for(dt):
                        yield ctx.run_case(case, partial(self._runs, ctx, coll, dt, op, n), dtype=dt, cell=ref)
                        continue
                    yield ctx.run_case(case, partial(self._claimed, ctx, coll, dt, op, n), dtype=dt, cell=ref)

    @staticmethod
    def _call(ctx: Context, coll: Collective, dt: str, op: ReduceOp | None, n: int) -> Verdict:
        ws = ctx.world_size
        if coll is Collective.SEND_RECV:
            return _send_recv_cell(ctx, dt, n)
        form = FORM_OF[coll]
        if op is not None:
            return _exact_case(ctx, form, op, dt, n, root=ws - 1, seed="matrix")
        numel = input_numel(form, n, ws)

        def inputs(r: int) -> Any:
            return data.movement_input(dt, numel, r, "matrix")

        rec = run_form(form, inputs, ctx.rank, ws, n, root=ws - 1)
        if rec.got is None:
            return Verdict.ok(0.0, 0.0)
        return compare_exact(rec.got, rec.expected())

    def _claimed(self, ctx: Context, coll: Collective, dt: str, op: ReduceOp | None, n: int) -> Verdict:
        try:
            v = self._call(ctx, coll, dt, op, n)
        except Exception as e:  # noqa: BLE001 - any error on a claimed cell is the verdict
            return Verdict(False, detail=f"the table claims this cell but the call raised {first_line(e)}", reset=True)
        if not v.passed:
            return Verdict.fail(f"the table claims this cell but the result is wrong: {v.detail}",
                                v.worst_error, v.bound)
        return v

    @staticmethod
    def _runs(ctx: Context, coll: Collective, dt: str, op: ReduceOp, n: int) -> Verdict:
        """A claimed cell whose op has no defined value on the dtype (BAND on floats ...): it must run."""
        import torch.distributed as dist

        from .ops import torch_op

        form = FORM_OF[coll]
        x = data.movement_input(dt, input_numel(form, n, ctx.world_size), ctx.rank, "matrix")
        try:
            if form == "all_reduce":
                dist.all_reduce(x, op=torch_op(op, 0.5))
            else:
                run_form(form, lambda r: x, ctx.rank, ctx.world_size, n, op=op, root=ctx.world_size - 1)
        except Exception as e:  # noqa: BLE001 - any error on a claimed cell is the verdict
            return Verdict(False, detail=f"the table claims this cell but the call raised {first_line(e)}", reset=True)
        return Verdict.ok(detail=f"{op} has no defined value on {dt}: checked that it runs")

    @staticmethod
    def _refused(ctx: Context, coll: Collective, dt: str, op: ReduceOp | None, n: int) -> Verdict:
        if coll is Collective.SEND_RECV:
            return _send_recv_refused(ctx, dt, n)
        try:
            DtypeMatrix._call(ctx, coll, dt, op, n)
        except VcgaUnsupportedError as e:
            wrong = _wrong_cell(e, coll, dt, op)
            if wrong:
                return Verdict.fail("VcgaUnsupportedError names the wrong cell: " + wrong)
            return Verdict.ok(detail="refused with VcgaUnsupportedError")
        except ValueError as e:
            if _refused_by_torch(e):
                return Verdict.ok(detail=f"refused by torch.distributed itself, before any backend: {first_line(e)}")
            return Verdict.fail(f"the table refuses this cell; expected VcgaUnsupportedError, got {first_line(e)}")
        except Exception as e:  # noqa: BLE001 - any other error is the verdict
            return Verdict.fail(f"the table refuses this cell; expected VcgaUnsupportedError, got {first_line(e)}")
        return Verdict.fail("the table refuses this cell but the call ran: the table or the dispatch lies")


def _refused_by_torch(e: ValueError) -> bool:
    """torch.distributed's own argument check (e.g. 'all_reduce does not support RedOpType.MAX on
    complex tensors'): raised on every rank before any backend sees the call, so as clean as a
    VCGA refusal."""
    text = str(e)
    return "does not support" in text and "complex tensors" in text


def _wrong_cell(e: VcgaUnsupportedError, coll: Collective, dt: str, op: ReduceOp | None) -> str:
    """What a refusal names differently from the cell refused (empty when it names the cell)."""
    return ", ".join(f"{k}={getattr(e, k)!r} (expected {v!r})"
                     for k, v in (("collective", str(coll)), ("dtype", dt), ("op", str(op) if op else None))
                     if str(getattr(e, k, None)) != str(v) and not (k == "op" and v is None))


def _send_recv_cell(ctx: Context, dt: str, n: int) -> Verdict:
    """Every rank sends to its right and receives from its left, so every rank exercises the cell."""
    import torch
    import torch.distributed as dist

    rank, ws = ctx.rank, ctx.world_size
    right, left = (rank + 1) % ws, (rank - 1) % ws
    got = torch.empty(n, dtype=data.movement_input(dt, 0, 0).dtype)
    works = [p2p(dist.isend(data.movement_input(dt, n, rank, "matrix-p2p"), dst=right)),
             p2p(dist.irecv(got, src=left))]
    for w in works:
        w.wait()
    return compare_exact(got, data.movement_input(dt, n, left, "matrix-p2p"))


def _send_recv_refused(ctx: Context, dt: str, n: int) -> Verdict:
    """Every rank, alike: isend, irecv, batch_isend_irecv, send and recv of a refused dtype each raise
    VcgaUnsupportedError at once. The decision depends only on the table and the dtype, which both
    ends of a pair share, so nothing is posted and no rank waits for a peer. The non-blocking calls
    go first: a dispatch that lets one through is caught before a blocking call could wait."""
    import torch
    import torch.distributed as dist

    rank, ws = ctx.rank, ctx.world_size
    right, left = (rank + 1) % ws, (rank - 1) % ws
    x = data.movement_input(dt, n, rank, "matrix-p2p")
    y = torch.empty_like(x)
    calls = {
        "isend": lambda: dist.isend(x, dst=right),
        "irecv": lambda: dist.irecv(y, src=left),
        "batch_isend_irecv": lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, x, right),
                                                             dist.P2POp(dist.irecv, y, left)]),
        "send": lambda: dist.send(x, dst=right),
        "recv": lambda: dist.recv(y, src=left),
    }
    for name, call in calls.items():
        try:
            call()
        except VcgaUnsupportedError as e:
            wrong = _wrong_cell(e, Collective.SEND_RECV, dt, None)
            if wrong:
                return Verdict.fail(f"{name}: VcgaUnsupportedError names the wrong cell: {wrong}")
            continue
        except Exception as e:  # noqa: BLE001 - any other error is the verdict
            return Verdict(False, detail=f"{name}: the table refuses this cell; expected VcgaUnsupportedError, "
                                         f"got {first_line(e)}", reset=True)
        return Verdict(False, detail=f"the table refuses this cell but {name} ran: the table or the dispatch lies",
                       reset=True)
    return Verdict.ok(detail="isend, irecv, batch_isend_irecv, send and recv refused with VcgaUnsupportedError")
