"""Checks 1, 6, 7 and 8: every collective and root, layouts, sizes, uneven splits."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from vcga.contract import CheckResult, Collective, ReduceOp

from . import data
from .base import Check, compare_exact, judge_refusal, needs, runnable, sizes_label
from .context import Context, Verdict, first_line
from .ops import (
    COLLECTIVE_OF,
    FORMS,
    REDUCING_FORMS,
    ROOTED_FORMS,
    input_numel,
    run_form,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Collectives", "Layouts", "Sizes", "Uneven"]


def _inputs_for(form: str, dt: str, numel: int, ws: int, seed: Any) -> Callable[[int], torch.Tensor]:
    """Exact SUM data for reducing forms, byte patterns (specials included) for moving ones."""
    if form in REDUCING_FORMS:
        return lambda r: data.exact_input(ReduceOp.SUM, dt, numel, r, ws, seed)
    return lambda r: data.movement_input(dt, numel, r, seed)


def _check_received(form: str, inputs: Callable[[int], torch.Tensor], rec: Any, ws: int, dt: str,
                    what: str) -> Verdict:
    if rec.got is None:
        return Verdict.ok(0.0, 0.0)
    if form in REDUCING_FORMS:
        want = data.exact_reduce(ReduceOp.SUM, [inputs(r) for r in range(ws)], dt)[rec.reduce_slice]
    else:
        want = rec.want
    return compare_exact(rec.got, want, what)


class Collectives(Check):
    """Check 1: every public collective entry point, every root, on this world size."""

    name = "collectives"
    description = ("every collective (all entry points, object collectives and barriers) with every "
                   "root gives the exact result on this world size")
    defaults = {"dtypes": ["float32", "int64"], "sizes": [1, 7], "forms": "all", "extras": True}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        ws = ctx.world_size
        sizes = list(self.opt(ctx, "sizes"))
        forms = FORMS if self.opt(ctx, "forms") == "all" else list(self.opt(ctx, "forms"))
        for form in forms:
            coll = COLLECTIVE_OF[form]
            roots: list[int | None] = list(range(ws)) if form in ROOTED_FORMS else [None]
            for dt in self.dtypes(ctx):
                op = ReduceOp.SUM if form in REDUCING_FORMS else None
                for root in roots:
                    case = f"{form}{' SUM' if op else ''} {dt}{f' root={root}' if root is not None else ''} " \
                           f"n={sizes_label(sizes)}"
                    yield ctx.run_unless(case, runnable(ctx, table, coll, dt, op),
                                         partial(self._one, ctx, form, dt, root or 0, sizes), dtype=dt,
                                         cell=(coll, dt, op))
        if self.opt(ctx, "extras"):
            yield from self._extras(ctx, table)

    @staticmethod
    def _one(ctx: Context, form: str, dt: str, root: int, sizes: list[int]) -> Verdict:
        ws = ctx.world_size
        verdicts = []
        for n in sizes:  # every size on every rank, whatever this rank saw: the ranks stay in step
            inputs = _inputs_for(form, dt, input_numel(form, n, ws), ws, ("collectives", root))
            rec = run_form(form, inputs, ctx.rank, ws, n, op=ReduceOp.SUM if form in REDUCING_FORMS else None,
                           root=root)
            verdicts.append(_check_received(form, inputs, rec, ws, dt, f"n={n}"))
        return next((v for v in verdicts if not v.passed), Verdict.ok(0.0, 0.0))

    def _extras(self, ctx: Context, table: Any) -> Iterator[CheckResult]:
        """The deprecated tensor spellings most code still calls, object collectives, barriers."""
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        n = 5

        def gather_into_tensor() -> Verdict:
            x = data.movement_input("float32", n, rank, "agit")
            out = torch.empty(n * ws)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(out, x)
            return compare_exact(out, torch.cat([data.movement_input("float32", n, r, "agit") for r in range(ws)]))

        def reduce_scatter_tensor() -> Verdict:
            xs = [data.exact_input(ReduceOp.SUM, "float32", n * ws, r, ws, "rst") for r in range(ws)]
            out = torch.empty(n)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dist.reduce_scatter_tensor(out, xs[rank].clone())
            return compare_exact(out, data.exact_reduce(ReduceOp.SUM, xs, "float32")[rank * n:(rank + 1) * n])

        def objects() -> Verdict:
            mine = {"rank": rank, "payload": list(range(rank + 1)), "text": "é" * rank}
            want = [{"rank": r, "payload": list(range(r + 1)), "text": "é" * r} for r in range(ws)]
            got: list[Any] = [None] * ws
            dist.all_gather_object(got, mine)
            if got != want:
                return Verdict.fail(f"all_gather_object returned {got!r}")
            for src in range(ws):
                lst = [mine] if rank == src else [None]
                dist.broadcast_object_list(lst, src=src)
                if lst[0] != want[src]:
                    return Verdict.fail(f"broadcast_object_list from {src} returned {lst[0]!r}")
            dst = ws - 1
            gathered = [None] * ws if rank == dst else None
            dist.gather_object(mine, gathered, dst=dst)
            if rank == dst and gathered != want:
                return Verdict.fail(f"gather_object returned {gathered!r}")
            out: list[Any] = [None]
            dist.scatter_object_list(out, want if rank == 0 else None, src=0)
            if out[0] != want[rank]:
                return Verdict.fail(f"scatter_object_list returned {out[0]!r}")
            return Verdict.ok()

        def barriers() -> Verdict:
            dist.barrier()
            work = dist.barrier(async_op=True)
            work.wait()
            return Verdict.ok()

        def monitored() -> Verdict:
            # torch.distributed.monitored_barrier() accepts only groups created as "gloo"; the vcga
            # group provides it as the process group's own method, which is what this calls
            ctx.group.monitored_barrier(ctx.timeout, True)
            return Verdict.ok()

        # torch's object collectives move pickles as uint8 and their sizes as int64 (gather and
        # scatter also all_gather the sizes, and the vcga group all_gathers int64 to agree on them)
        objects_need = [(c, d, None) for c in (Collective.ALL_GATHER, Collective.BROADCAST, Collective.GATHER,
                                               Collective.SCATTER) for d in ("uint8", "int64")]
        ag32, rs32 = (Collective.ALL_GATHER, "float32", None), (Collective.REDUCE_SCATTER, "float32", ReduceOp.SUM)
        extras: list[tuple[str, Callable[[], Verdict], str | None, Any]] = [
            ("all_gather_into_tensor float32 (deprecated spelling)", gather_into_tensor, runnable(ctx, table, *ag32),
             ag32),
            ("reduce_scatter_tensor SUM float32 (deprecated spelling)", reduce_scatter_tensor,
             runnable(ctx, table, *rs32), rs32),
            ("object collectives (all_gather, broadcast, gather, scatter)", objects,
             needs(ctx, table, objects_need, "the object collectives"), None),
            ("barrier, async barrier", barriers, None, None),
        ]
        extras.append(("monitored_barrier (the vcga group's)", monitored, None if ctx.through_vcga else
                       "torch.distributed allows monitored_barrier only on a group created as 'gloo'; the vcga "
                       "group provides its own", None))
        for case, body, why, cell in extras:
            yield ctx.run_unless(case, why, body, cell=cell)


# ---------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------

_SENTINEL = -7.0  # storage outside a view holds this; it must survive every collective


def _in_layout(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(view in ``layout`` holding ``values`` in logical row-major order, base storage or None)."""
    import torch

    n = values.numel()
    dt = values.dtype
    if layout == "contiguous":
        return values.clone(), None
    if layout == "offset":  # contiguous, but not at the start of its storage
        base = torch.full((n + 7,), _SENTINEL, dtype=dt)
        view = base[5:5 + n]
        view.copy_(values)
        return view, base
    if layout == "strided":  # every other element of a larger buffer
        base = torch.full((2 * n + 1,), _SENTINEL, dtype=dt)
        view = base[1::2][:n]
        view.copy_(values)
        return view, base
    if layout == "transposed":  # dense, column-major: the logical order is not the memory order
        rows = 4 if n % 4 == 0 else 1
        view = torch.empty((n // rows, rows), dtype=dt).t()
        view.copy_(values.reshape(rows, n // rows))
        return view, None
    if layout == "channels_last":  # a 4-D activation in NHWC memory order
        c = 4 if n % 4 == 0 else 1
        view = torch.empty((1, c, 1, n // c), dtype=dt).to(memory_format=torch.channels_last)
        view.copy_(values.reshape(1, c, 1, n // c))
        return view, None
    if layout == "expanded":  # stride 0: one element seen n times (read-only inputs only)
        return values[:1].expand(n), None
    raise ValueError(f"unknown layout {layout!r}")


def _logical(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


class Layouts(Check):
    """Check 6: non-contiguous tensors, storage offsets, in-place and out-of-place, aliased buffers."""

    name = "layouts"
    description = ("non-contiguous, offset, transposed, channels-last and aliased buffers, in place and "
                   "out of place: exact results and no byte written outside the tensor (or a clean refusal)")
    defaults = {"dtypes": ["float32"], "n": 24,
                "layouts": ["contiguous", "offset", "strided", "transposed", "channels_last", "expanded"]}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        n = int(self.opt(ctx, "n"))
        layouts = list(self.opt(ctx, "layouts"))
        for dt in self.dtypes(ctx):
            for layout in layouts:
                for form, target in (("all_reduce", "inout"), ("broadcast", "inout"),
                                     ("all_gather_single", "input"), ("all_gather_single", "output"),
                                     ("reduce_scatter_single", "input"), ("reduce_scatter_single", "output"),
                                     ("all_to_all_single", "input"), ("all_to_all_single", "output")):
                    if layout == "expanded" and target != "input":
                        continue  # a stride-0 tensor cannot receive data
                    if layout in ("transposed", "channels_last") and target != "inout":
                        continue  # multi-dimensional: split collectives would split its first dimension
                    if layout == "contiguous" and target == "output":
                        continue  # same as the input row
                    op = ReduceOp.SUM if form in REDUCING_FORMS else None
                    case = f"{form} {dt} {layout} {target}"
                    yield ctx.run_unless(case, runnable(ctx, table, COLLECTIVE_OF[form], dt, op),
                                         partial(self._one, ctx, form, dt, layout, target, n),
                                         dtype=dt, cell=(COLLECTIVE_OF[form], dt, op))
            for form in ("all_gather_single", "reduce_scatter_single"):
                case = f"{form} {dt} in place (aliased input and output)"
                op = ReduceOp.SUM if form in REDUCING_FORMS else None
                yield ctx.run_unless(case, runnable(ctx, table, COLLECTIVE_OF[form], dt, op),
                                     partial(self._aliased, ctx, form, dt, n), dtype=dt,
                                     cell=(COLLECTIVE_OF[form], dt, op))
            case = f"all_gather {dt} outputs are views of one buffer"
            yield ctx.run_unless(case, runnable(ctx, table, Collective.ALL_GATHER, dt, None),
                                 partial(self._gather_views, ctx, dt, n), dtype=dt,
                                 cell=(Collective.ALL_GATHER, dt, None))

    def _one(self, ctx: Context, form: str, dt: str, layout: str, target: str, n: int) -> Verdict:
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        numel = input_numel(form, n, ws)
        inputs = _inputs_for(form, dt, numel, ws, ("layout", layout))
        if layout == "expanded":  # every rank's input is its first element repeated
            raw = inputs
            inputs = lambda r: raw(r)[:1].expand(numel).contiguous()  # noqa: E731
        x_vals = inputs(rank)
        out_numel = {"all_reduce": n, "broadcast": n, "all_gather_single": n * ws,
                     "reduce_scatter_single": n, "all_to_all_single": n * ws}[form]
        if target in ("inout", "input"):
            x, x_base = _in_layout(x_vals, layout)
        else:
            x, x_base = x_vals.clone(), None
        if target == "output":
            out, out_base = _in_layout(torch.zeros(out_numel, dtype=x_vals.dtype), layout)
        else:
            out, out_base = torch.zeros(out_numel, dtype=x_vals.dtype), None
        x_before, out_before = x.clone(), out.clone()
        base_before = [b.clone() if b is not None else None for b in (x_base, out_base)]
        start = time.monotonic()
        try:
            if form == "all_reduce":
                dist.all_reduce(x)
                got = x
            elif form == "broadcast":
                dist.broadcast(x, src=ws - 1)
                got = x
            elif form == "all_gather_single":
                dist.all_gather_single(out, x)
                got = out
            elif form == "reduce_scatter_single":
                dist.reduce_scatter_single(out, x)
                got = out
            else:
                dist.all_to_all_single(out, x)
                got = out
        except Exception as e:  # noqa: BLE001 - a refusal is judged by _refusal, whatever its type
            return self._refusal(ctx, e, time.monotonic() - start, [(x, x_before), (out, out_before)], base_before,
                                 [x_base, out_base])
        if form == "all_reduce":
            want = data.exact_reduce(ReduceOp.SUM, [inputs(r) for r in range(ws)], dt)
        elif form == "reduce_scatter_single":
            want = data.exact_reduce(ReduceOp.SUM, [inputs(r) for r in range(ws)], dt)[rank * n:(rank + 1) * n]
        elif form == "broadcast":
            want = inputs(ws - 1)
        elif form == "all_gather_single":
            want = torch.cat([inputs(r) for r in range(ws)])
        else:
            want = torch.cat([inputs(r)[rank * n:(rank + 1) * n] for r in range(ws)])
        v = compare_exact(_logical(got), want, "result")
        if not v.passed:
            return v
        for base, before in zip((x_base, out_base), base_before, strict=True):
            if base is None or before is None:  # not in a layout with a base: before is None too
                continue
            outside = torch.ones(base.numel(), dtype=torch.bool)
            view = x if base is x_base else out
            idx = torch.arange(base.numel()).as_strided(view.shape, view.stride(),
                                                        view.storage_offset() - base.storage_offset())
            outside[idx.reshape(-1)] = False
            if not data.same_bits(base[outside], before[outside]):
                changed = int((base[outside].view(torch.uint8) != before[outside].view(torch.uint8)).sum())
                return Verdict.fail(f"the collective wrote outside the tensor ({changed} byte(s) of its "
                                    "storage changed)")
        if target in ("input", "output") and not data.same_bits(_logical(x), _logical(x_before)):
            return Verdict.fail("the collective modified its (read-only) input")
        return v

    @staticmethod
    def _refusal(ctx: Context, e: Exception, elapsed: float, tensors: list[tuple[torch.Tensor, torch.Tensor]],
                 bases_before: list[Any], bases: list[Any]) -> Verdict:
        """A refusal is acceptable (torch's NCCL refuses non-contiguous tensors too) if it is clean:
        prompt, typed when it comes from the vcga group, and nothing written."""
        for t, before in tensors:
            if not data.same_bits(_logical(t), _logical(before)):
                return Verdict(False, detail=f"raised {first_line(e)} after writing into the tensors", reset=True)
        for base, before in zip(bases, bases_before, strict=True):
            if base is not None and not data.same_bits(base, before):
                return Verdict(False, detail=f"raised {first_line(e)} after writing into the storage", reset=True)
        return judge_refusal(ctx, e, elapsed)

    @staticmethod
    def _aliased(ctx: Context, form: str, dt: str, n: int) -> Verdict:
        """In-place all_gather (input is this rank's slot of the output) and reduce_scatter (output
        is this rank's slot of the input), as NCCL documents and FSDP uses."""
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        if form == "all_gather_single":
            vals = [data.movement_input(dt, n, r, "alias") for r in range(ws)]
            buf = torch.zeros(n * ws, dtype=vals[0].dtype)
            buf[rank * n:(rank + 1) * n] = vals[rank]
            dist.all_gather_single(buf, buf[rank * n:(rank + 1) * n])
            return compare_exact(buf, torch.cat(vals))
        xs = [data.exact_input(ReduceOp.SUM, dt, n * ws, r, ws, "alias") for r in range(ws)]
        buf = xs[rank].clone()
        dist.reduce_scatter_single(buf[rank * n:(rank + 1) * n], buf)
        return compare_exact(buf[rank * n:(rank + 1) * n],
                             data.exact_reduce(ReduceOp.SUM, xs, dt)[rank * n:(rank + 1) * n])

    @staticmethod
    def _gather_views(ctx: Context, dt: str, n: int) -> Verdict:
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        vals = [data.movement_input(dt, n, r, "views") for r in range(ws)]
        buf = torch.zeros(n * ws, dtype=vals[0].dtype)
        dist.all_gather(list(buf.split(n)) if n else [buf[:0]] * ws, vals[rank].clone())
        return compare_exact(buf, torch.cat(vals))


# ---------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------


class Sizes(Check):
    """Check 7: 0 and 1 elements, fewer elements than ranks, sizes not divisible by the world
    size, and a large tensor."""

    name = "sizes"
    description = "0, 1, fewer elements than ranks, not divisible by the world size, and large tensors"
    defaults = {"dtypes": ["float32", "bfloat16", "int8"], "large": 1 << 20,
                "forms": ["all_reduce", "reduce", "broadcast", "all_gather_single", "all_gather",
                          "reduce_scatter_single", "all_to_all_single", "gather", "scatter"],
                "large_forms": ["all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast"]}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        ws = ctx.world_size
        small = {"0": 0, "1": 1, "fewer than ranks": max(ws - 1, 0), "not divisible": 2 * ws + 1}
        large = int(self.opt(ctx, "large"))
        for dt in self.dtypes(ctx):
            for form in self.opt(ctx, "forms"):
                op = ReduceOp.SUM if form in REDUCING_FORMS else None
                why = runnable(ctx, table, COLLECTIVE_OF[form], dt, op)
                sizes = dict(small)
                if form in self.opt(ctx, "large_forms") and large:
                    sizes[f"large ({large} per rank)"] = large
                for label, n in sizes.items():
                    case = f"{form} {dt} n={n} ({label})" if not label.startswith("large") else f"{form} {dt} {label}"
                    yield ctx.run_unless(case, why, partial(self._one, ctx, form, dt, n), dtype=dt,
                                         cell=(COLLECTIVE_OF[form], dt, op))

    @staticmethod
    def _one(ctx: Context, form: str, dt: str, n: int) -> Verdict:
        ws = ctx.world_size
        inputs = _inputs_for(form, dt, input_numel(form, n, ws), ws, ("sizes", n))
        rec = run_form(form, inputs, ctx.rank, ws, n, op=ReduceOp.SUM if form in REDUCING_FORMS else None,
                       root=ws - 1)
        return _check_received(form, inputs, rec, ws, dt, f"n={n}")


# ---------------------------------------------------------------------------------------------------
# Uneven splits
# ---------------------------------------------------------------------------------------------------


def _split_matrix(ws: int, seed: Any) -> list[list[int]]:
    """``m[s][d]``: elements rank s sends to rank d; random, with zeros, one silent sender and one
    rank that receives nothing (when the world has three ranks or more)."""
    import torch

    g = data.generator("splits", ws, seed)
    m = torch.randint(0, 6, (ws, ws), generator=g).tolist()
    if ws >= 2:
        m[0] = [0] * ws  # rank 0 sends nothing
        m[1][0] = 0
    if ws >= 3:
        for s in range(ws):
            m[s][ws - 1] = 0  # the last rank receives nothing
    return m


class Uneven(Check):
    """Check 8: uneven all_to_all (zero-length splits included) and the v-variants."""

    name = "uneven"
    description = ("uneven all_to_all_single / all_to_all with zero-length splits, and uneven all_gather, "
                   "gather, scatter and reduce_scatter: exact, or a clean refusal where the library has no v-variant")
    defaults = {"dtypes": ["float32", "int64"], "seeds": 2}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        for dt in self.dtypes(ctx):
            for seed in range(int(self.opt(ctx, "seeds"))):
                for form, must in (("all_to_all_single", True), ("all_to_all", True), ("all_gather", False),
                                   ("gather", False), ("scatter", False), ("reduce_scatter", False)):
                    op = ReduceOp.SUM if form in REDUCING_FORMS else None
                    case = f"{form} uneven {dt} splits#{seed}"
                    yield ctx.run_unless(case, runnable(ctx, table, COLLECTIVE_OF[form], dt, op),
                                         partial(self._one, ctx, form, dt, seed, must), dtype=dt,
                                         cell=(COLLECTIVE_OF[form], dt, op))

    def _one(self, ctx: Context, form: str, dt: str, seed: int, must: bool) -> Verdict:
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        m = _split_matrix(ws, seed)
        sizes = [sum(row) for row in m]  # also: per-rank sizes for the v-variants

        def block(s: int, d: int) -> torch.Tensor:
            return data.movement_input(dt, m[s][d], s * 1000 + d, ("uneven", seed)) if form != "reduce_scatter" \
                else data.exact_input(ReduceOp.SUM, dt, m[0][d] + m[1 % ws][d] + d + 1, s, ws, ("uneven-rs", seed, d))

        start = time.monotonic()
        try:
            if form == "all_to_all_single":
                x = torch.cat([block(rank, d) for d in range(ws)])
                out = torch.full((sum(m[s][rank] for s in range(ws)),), 0, dtype=x.dtype)
                dist.all_to_all_single(out, x, output_split_sizes=[m[s][rank] for s in range(ws)],
                                       input_split_sizes=m[rank])
                return compare_exact(out, torch.cat([block(s, rank) for s in range(ws)]))
            if form == "all_to_all":
                ins = [block(rank, d) for d in range(ws)]
                outs = [torch.zeros(m[s][rank], dtype=ins[0].dtype) for s in range(ws)]
                dist.all_to_all(outs, ins)
                return compare_exact(torch.cat(outs), torch.cat([block(s, rank) for s in range(ws)]))
            mine = data.movement_input(dt, sizes[rank], rank, ("v", seed))
            all_vals = [data.movement_input(dt, sizes[r], r, ("v", seed)) for r in range(ws)]
            if form == "all_gather":
                outs = [torch.zeros(sizes[r], dtype=mine.dtype) for r in range(ws)]
                dist.all_gather(outs, mine.clone())
                return compare_exact(torch.cat(outs), torch.cat(all_vals))
            if form == "gather":
                dst = ws - 1
                gathered = [torch.zeros(sizes[r], dtype=mine.dtype) for r in range(ws)] if rank == dst else None
                dist.gather(mine.clone(), gathered, dst=dst)
                return compare_exact(torch.cat(gathered), torch.cat(all_vals)) if gathered is not None else Verdict.ok()
            if form == "scatter":
                src = 0
                out = torch.zeros(sizes[rank], dtype=mine.dtype)
                dist.scatter(out, [v.clone() for v in all_vals] if rank == src else None, src=src)
                return compare_exact(out, all_vals[rank])
            # reduce_scatter with a different block size per destination rank
            ins = [block(rank, d) for d in range(ws)]
            out = torch.zeros(ins[rank].numel(), dtype=ins[0].dtype)
            dist.reduce_scatter(out, [t.clone() for t in ins])
            want = data.exact_reduce(ReduceOp.SUM, [block(s, rank) for s in range(ws)], dt)
            return compare_exact(out, want)
        except Exception as e:
            if must:
                raise
            return judge_refusal(ctx, e, time.monotonic() - start, "no v-variant, refused")
