"""The collective matrix, run inside each rank of a spawned world (see test_pg_collectives.py).

For one ``vcga`` group this runs every collective variant x dtype x reduce op x layout
(contiguous, strided = non-contiguous, empty = zero-size) x in-place/out-of-place, through the
public ``torch.distributed`` API, and checks each result against a value computed here, without
the library, from every rank's input (each rank can regenerate every other rank's input).

The data is order-independent (small integers, nccl-tests' idea): every partial sum, product and
min/max is exactly representable in every dtype used, so SUM, PRODUCT, MIN, MAX, the bitwise ops
and PREMUL_SUM with a power-of-two factor must be bit-exact on every path. Only AVG divides by a
group size that may not be a power of two; its bound is derived in :func:`_avg_bound`.

What the capability table says decides what is expected: a refused cell must raise
:class:`VcgaUnsupportedError` naming backend, collective, dtype and op, before any rank
communicates; a native or emulated cell must give the right answer. Which emulation recipes ran is
reported back, so the parent can check that every recipe in ``EMULATIONS`` was exercised.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from vcga import dtypes as vdt
from vcga.contract import Collective, ReduceOp, Support
from vcga.errors import VcgaUnsupportedError

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool"]
#: dtypes beyond those eight: they drive the upcast / bitcast / as_real recipes on gloo.
EXTRA_DTYPES = ["int16", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"]
LAYOUTS = ["contig", "strided", "empty"]
CHUNK = 5  # elements per rank-chunk (non-empty layouts)

OPS = list(ReduceOp)
#: On the strided and empty layouts the variants other than all_reduce run a subset of ops that
#: still crosses every path: native (SUM, MAX), sum_then_divide (AVG), mul_then_sum (PREMUL_SUM),
#: and a bitwise op (native on integers, refused on floats). all_reduce runs every op everywhere.
LAYOUT_OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.BOR, ReduceOp.PREMUL_SUM]
PREMUL_FACTOR = 0.5  # a power of two: scaling small integers is exact in every float dtype


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------

def values(rank: int, n: int, dt: str, salt: int) -> torch.Tensor:
    """Rank ``rank``'s input, as exact float64 / int64 / bool values (dtype-independent): a tensor
    of the caller's own (the cases reduce into what they are given)."""
    return _values(rank, n, dt, salt).clone()


@functools.cache
def _values(rank: int, n: int, dt: str, salt: int) -> torch.Tensor:
    """:func:`values`, made once per argument set: every rank works out every rank's input for
    each case's expected result, about 14,000 times a world."""
    i = torch.arange(n, dtype=torch.int64)
    k = (i * 7 + rank * 5 + salt * 3) % 4
    if dt == "bool":
        return k % 2 == 0
    info = vdt.get(dt)
    if info.kind == "u":
        return k  # 0..3
    return torch.tensor([-2, -1, 1, 2], dtype=torch.int64)[k]  # never 0: PRODUCT stays informative


def make(rank: int, n: int, dt: str, salt: int, layout: str) -> torch.Tensor:
    """A tensor of ``dt`` holding :func:`values`; strided layout gives a non-contiguous view."""
    v = values(rank, n, dt, salt)
    tdt = vdt.to_torch(dt)
    t = _to(dt, v) if dt != "bool" else v.clone()
    if layout == "strided":
        base = torch.zeros(2 * n, dtype=tdt)
        view = base[::2]
        view.copy_(t)
        return view
    return t


def empty_like_layout(n: int, dt: str, layout: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A zeroed output buffer; strided layout gives a non-contiguous view (every other element)."""
    tdt = vdt.to_torch(dt)
    shape = shape or (n,)
    if layout == "strided" and n:
        return torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=tdt)[..., ::2]
    return torch.zeros(shape, dtype=tdt)


def _exact(per_rank: list[torch.Tensor], op: ReduceOp, dt: str, size: int) -> torch.Tensor:
    """The exact reduction of int64/bool values, computed here in float64 / int64."""
    if dt == "bool":
        stack = torch.stack(per_rank)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return stack.any(0)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return stack.all(0)
        return stack.sum(0) % 2 == 1  # BXOR
    stack = torch.stack(per_rank).to(torch.int64)
    if op is ReduceOp.SUM:
        return stack.sum(0)
    if op is ReduceOp.PRODUCT:
        return stack.prod(0)
    if op is ReduceOp.MIN:
        return stack.min(0).values
    if op is ReduceOp.MAX:
        return stack.max(0).values
    if op is ReduceOp.AVG:
        return stack.to(torch.float64).sum(0) / size
    if op is ReduceOp.PREMUL_SUM:
        return (stack.to(torch.float64) * PREMUL_FACTOR).sum(0)
    acc = stack[0].clone()
    for row in stack[1:]:
        acc = {ReduceOp.BAND: acc & row, ReduceOp.BOR: acc | row, ReduceOp.BXOR: acc ^ row}[op]
    return acc


def _to(dt: str, exact: torch.Tensor) -> torch.Tensor:
    """Exact values as ``dt`` (one rounding, from float64, for the floating dtypes)."""
    tdt = vdt.to_torch(dt)
    kind = vdt.get(dt).kind
    if kind == "c":  # imaginary part 0 - x, not -x: an exact zero is +0.0, as any sum of +-x gives
        re = exact.to(torch.float64)
        return torch.complex(re, 0.0 - re).to(tdt)
    if kind == "f":
        return exact.to(torch.float64).to(tdt)
    return exact.to(tdt) if dt != "bool" else exact


_UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53,
         "float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3, "complex64": 2.0 ** -24, "complex128": 2.0 ** -53}


def _avg_bound(dt: str) -> float:
    """Relative error bound of AVG on exact-sum data.

    The sum is exact (small integers), so the only error is dividing by the group size: one
    rounding to ``dt`` (u), or, on the upcast path (fp16/bf16/fp8 via float32), a rounding to
    float32 then to ``dt``: |err| <= (u + u32 + u * u32) |avg|, which covers both.
    """
    u = _UNIT[dt]
    u32 = 2.0 ** -24
    return u + u32 + u * u32


def same(got: torch.Tensor, want: torch.Tensor, dt: str, op: ReduceOp | None) -> str:
    """'' when ``got`` matches; else a one-line reason. Bit-exact except AVG (bounded)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    if got.numel() == 0:
        return ""
    if op is ReduceOp.AVG and vdt.get(dt).kind in "fc":
        g = torch.view_as_real(got).double() if got.is_complex() else got.double()
        w = torch.view_as_real(want).double() if want.is_complex() else want.double()
        err = (g - w).abs()
        bound = _avg_bound(dt) * w.abs()
        if bool((err <= bound).all()):
            return ""
        return f"AVG error {err.max().item():g} beyond the derived bound {bound.max().item():g}"
    gb = got.contiguous().view(torch.uint8) if got.dim() else got.reshape(1).view(torch.uint8)
    wb = want.contiguous().view(torch.uint8) if want.dim() else want.reshape(1).view(torch.uint8)
    if torch.equal(gb, wb):
        return ""
    return f"got {got.tolist()} want {want.tolist()}"


# ---------------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------------


class Matrix:
    """Runs every case on one group; collects failures and the recipes that ran."""

    def __init__(self, group: Any, label: str, dtypes: list[str]) -> None:
        self.g = group
        self.label = label
        self.dtypes = dtypes
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.table = group.capabilities
        self.backend = group.transport.backend_name
        self.failures: list[str] = []
        self.recipes: Counter[str] = Counter()
        self.cases = 0
        self.refused = 0
        self.salt = 0

    # -- bookkeeping -----------------------------------------------------------------------------

    def cell(self, coll: Collective, dt: str, op: ReduceOp | None = None) -> Any:
        cell = self.table.lookup(coll, dt, op)
        if cell.support is Support.EMULATED and cell.via:
            self.recipes[cell.via.partition(":")[0]] += 1
        return cell

    def fail(self, what: str, why: str) -> None:
        self.failures.append(f"[{self.label} r{self.rank}/{self.size}] {what}: {why}")

    def expect_refusal(self, what: str, fn: Any, coll: Collective, dt: str, op: ReduceOp | None) -> None:
        self.refused += 1
        try:
            fn()
        except VcgaUnsupportedError as e:
            fields = (e.backend, e.collective, e.dtype, e.op)
            want = (self.backend, coll.value, dt, op.value if op else None)
            if fields != want:
                self.fail(what, f"refusal names {fields}, expected {want}")
            return
        except Exception as e:  # noqa: BLE001
            self.fail(what, f"refused cell raised {type(e).__name__}: {e}")
            return
        self.fail(what, "refused cell did not raise VcgaUnsupportedError")

    def run_case(self, what: str, coll: Collective, dt: str, op: ReduceOp | None, fn: Any) -> None:
        """``fn()`` runs the collective and returns a list of (got, want) pairs."""
        self.cases += 1
        self.salt += 1
        cell = self.cell(coll, dt, op)
        if cell.support is Support.REFUSED:
            self.expect_refusal(what, fn, coll, dt, op)
            return
        try:
            pairs = fn()
        except Exception as e:  # noqa: BLE001
            self.fail(what, f"{cell.support.value} cell raised {type(e).__name__}: {str(e)[:300]}")
            return
        for i, (got, want) in enumerate(pairs):
            why = same(got, want, dt, op)
            if why:
                self.fail(what + (f" [{i}]" if len(pairs) > 1 else ""), f"{cell.support.value}"
                          f"{'/' + cell.via if cell.via else ''}: {why}")

    # -- helpers -----------------------------------------------------------------------------------

    def n(self, layout: str) -> int:
        return 0 if layout == "empty" else CHUNK

    def reduce_op(self, op: ReduceOp, dt: str) -> Any:
        if op is ReduceOp.PREMUL_SUM:
            return dist._make_nccl_premul_sum(PREMUL_FACTOR)
        return getattr(dist.ReduceOp, op.value)

    def all_inputs(self, n: int, dt: str, salt: int) -> list[torch.Tensor]:
        return [values(r, n, dt, salt) for r in range(self.size)]

    # -- reductions --------------------------------------------------------------------------------

    def reductions(self, dt: str, layout: str) -> None:
        n, size, rank = self.n(layout), self.size, self.rank
        async_op = layout == "strided"
        complex_dt = vdt.get(dt).kind == "c"
        for op in OPS:
            if complex_dt and op not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
                continue  # torch refuses these on complex tensors before any backend sees them
            tag = f"{dt}/{op.value}/{layout}"

            def ar(op: ReduceOp = op) -> list[tuple[torch.Tensor, torch.Tensor]]:
                salt = self.salt
                t = make(rank, n, dt, salt, layout)
                if complex_dt:  # torch.distributed would hand the backend a real view; call the group directly
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = self.reduce_op(op, dt)
                    self.g.allreduce([t], opts).wait()
                else:
                    w = dist.all_reduce(t, op=self.reduce_op(op, dt), group=self.g, async_op=async_op)
                    if async_op:
                        w.wait()
                return [(t, _to(dt, _exact(self.all_inputs(n, dt, salt), op, dt, size)))]

            self.run_case(f"all_reduce {tag}", Collective.ALL_REDUCE, dt, op, ar)
            if complex_dt or (layout != "contig" and op not in LAYOUT_OPS):
                continue

            def arc(op: ReduceOp = op) -> list[tuple[torch.Tensor, torch.Tensor]]:
                salt = self.salt
                a, b = make(rank, n, dt, salt, layout), make(rank, n + 1, dt, salt + 100, layout)
                opts = dist.AllreduceCoalescedOptions()
                opts.reduceOp = self.reduce_op(op, dt)
                self.g.allreduce_coalesced([a, b], opts).wait()
                return [(a, _to(dt, _exact(self.all_inputs(n, dt, salt), op, dt, size))),
                        (b, _to(dt, _exact(self.all_inputs(n + 1, dt, salt + 100), op, dt, size)))]

            self.run_case(f"all_reduce_coalesced {tag}", Collective.ALL_REDUCE, dt, op, arc)

            def rd(op: ReduceOp = op) -> list[tuple[torch.Tensor, torch.Tensor]]:
                salt = self.salt
                root = size - 1
                t = make(rank, n, dt, salt, layout)
                w = dist.reduce(t, root, op=self.reduce_op(op, dt), group=self.g, async_op=async_op)
                if async_op:
                    w.wait()
                if rank == root:
                    return [(t, _to(dt, _exact(self.all_inputs(n, dt, salt), op, dt, size)))]
                return [(t, make(rank, n, dt, salt, "contig"))]  # non-root tensors are left unchanged

            self.run_case(f"reduce {tag}", Collective.REDUCE, dt, op, rd)

            def rs_list(op: ReduceOp = op) -> list[tuple[torch.Tensor, torch.Tensor]]:
                salt = self.salt
                ins = [make(rank, n, dt, salt + 10 * j, layout) for j in range(size)]
                out = empty_like_layout(n, dt, layout)
                w = dist.reduce_scatter(out, ins, op=self.reduce_op(op, dt), group=self.g, async_op=async_op)
                if async_op:
                    w.wait()
                want = _exact([values(r, n, dt, salt + 10 * rank) for r in range(size)], op, dt, size)
                return [(out, _to(dt, want))]

            self.run_case(f"reduce_scatter {tag}", Collective.REDUCE_SCATTER, dt, op, rs_list)

            for inplace in (False, True):
                def rs_tensor(op: ReduceOp = op, inplace: bool = inplace) -> list[tuple[torch.Tensor, torch.Tensor]]:
                    salt = self.salt
                    inp = make(rank, n * size, dt, salt, "contig" if inplace else layout)
                    out = inp[rank * n:(rank + 1) * n] if inplace else empty_like_layout(n, dt, layout)
                    full = [values(r, n * size, dt, salt) for r in range(size)]
                    want = _exact([f[rank * n:(rank + 1) * n] for f in full], op, dt, size)
                    dist.reduce_scatter_tensor(out, inp, op=self.reduce_op(op, dt), group=self.g)
                    return [(out, _to(dt, want))]

                self.run_case(f"reduce_scatter_tensor {'in-place' if inplace else 'out-of-place'} {tag}",
                              Collective.REDUCE_SCATTER, dt, op, rs_tensor)

    # -- data movement -----------------------------------------------------------------------------

    def movement(self, dt: str, layout: str) -> None:
        n, size, rank = self.n(layout), self.size, self.rank
        tag = f"{dt}/{layout}"
        async_op = layout == "strided"
        direct = vdt.get(dt).kind == "c"  # complex: exercise the group's own recipes (torch would view as real)

        def bc() -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt, root = self.salt, size - 1
            t = make(rank, n, dt, salt, layout)
            if direct:
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                self.g.broadcast([t], opts).wait()
            else:
                w = dist.broadcast(t, dist.get_global_rank(self.g, root), group=self.g, async_op=async_op)
                if async_op:
                    w.wait()
            return [(t, make(root, n, dt, salt, "contig"))]

        self.run_case(f"broadcast {tag}", Collective.BROADCAST, dt, None, bc)

        def ag() -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt = self.salt
            outs = [empty_like_layout(n, dt, layout) for _ in range(size)]
            inp = make(rank, n, dt, salt, layout)
            if direct:
                self.g.allgather([outs], [inp]).wait()
            else:
                w = dist.all_gather(outs, inp, group=self.g, async_op=async_op)
                if async_op:
                    w.wait()
            return [(o, make(r, n, dt, salt, "contig")) for r, o in enumerate(outs)]

        self.run_case(f"all_gather {tag}", Collective.ALL_GATHER, dt, None, ag)

        for inplace in (False, True):
            def agt(inplace: bool = inplace) -> list[tuple[torch.Tensor, torch.Tensor]]:
                salt = self.salt
                out = empty_like_layout(n * size, dt, "contig" if inplace else layout)
                if inplace:
                    inp = out[rank * n:(rank + 1) * n]
                    inp.copy_(make(rank, n, dt, salt, "contig"))
                else:
                    inp = make(rank, n, dt, salt, layout)
                if direct:
                    self.g._allgather_base(out, inp).wait()
                else:
                    dist.all_gather_into_tensor(out, inp, group=self.g)
                want = torch.cat([make(r, n, dt, salt, "contig") for r in range(size)])
                return [(out, want)]

            self.run_case(f"all_gather_into_tensor {'in-place' if inplace else 'out-of-place'} {tag}",
                          Collective.ALL_GATHER, dt, None, agt)

        def agc() -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt = self.salt
            ins = [make(rank, n, dt, salt, layout), make(rank, n + 2, dt, salt + 1, layout)]
            outs = [[empty_like_layout(n, dt, layout), empty_like_layout(n + 2, dt, layout)] for _ in range(size)]
            self.g.allgather_coalesced(outs, ins).wait()
            return [(outs[r][0], make(r, n, dt, salt, "contig")) for r in range(size)] + \
                   [(outs[r][1], make(r, n + 2, dt, salt + 1, "contig")) for r in range(size)]

        self.run_case(f"all_gather_coalesced {tag}", Collective.ALL_GATHER, dt, None, agc)

        def ga() -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt, root = self.salt, 0
            inp = make(rank, n, dt, salt, layout)
            outs = [empty_like_layout(n, dt, layout) for _ in range(size)] if rank == root else None
            if direct:
                opts = dist.GatherOptions()
                opts.rootRank = root
                self.g.gather([outs] if outs is not None else [], [inp], opts).wait()
            else:
                dist.gather(inp, outs, dst=dist.get_global_rank(self.g, root), group=self.g)
            if rank != root:
                return []
            return [(o, make(r, n, dt, salt, "contig")) for r, o in enumerate(outs)]

        self.run_case(f"gather {tag}", Collective.GATHER, dt, None, ga)

        def sc() -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt, root = self.salt, size - 1
            out = empty_like_layout(n, dt, layout)
            ins = [make(root, n, dt, salt + 10 * r, layout) for r in range(size)] if rank == root else None
            if direct:
                opts = dist.ScatterOptions()
                opts.rootRank = root
                self.g.scatter([out], [ins] if ins is not None else [], opts).wait()
            else:
                dist.scatter(out, ins, src=dist.get_global_rank(self.g, root), group=self.g)
            return [(out, make(root, n, dt, salt + 10 * rank, "contig"))]

        self.run_case(f"scatter {tag}", Collective.SCATTER, dt, None, sc)

        def a2a_list() -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt = self.salt
            ins = [make(rank, n + j, dt, salt + 10 * j, layout) for j in range(size)]
            outs = [empty_like_layout(n + rank, dt, layout) for _ in range(size)]
            if direct:
                self.g.alltoall(outs, ins).wait()
            else:
                dist.all_to_all(outs, ins, group=self.g)
            return [(outs[r], make(r, n + rank, dt, salt + 10 * rank, "contig")) for r in range(size)]

        self.run_case(f"all_to_all {tag}", Collective.ALL_TO_ALL, dt, None, a2a_list)

        def a2a_single(uneven: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
            salt = self.salt
            # rank r sends (r + j) % 3 rows of 2 to rank j when uneven, CHUNK rows otherwise
            rows = (lambda r, j: ((r + j) % 3) if n else 0) if uneven else (lambda r, j: n)
            in_splits = [rows(rank, j) for j in range(size)]
            out_splits = [rows(r, rank) for r in range(size)]
            full = [values(r, 2 * sum(rows(r, j) for j in range(size)), dt, salt) for r in range(size)]
            tdt = vdt.to_torch(dt)
            inp = _to(dt, full[rank]).view(-1, 2) if full[rank].numel() else torch.empty((0, 2), dtype=tdt)
            if layout == "strided" and inp.numel():
                inp = inp.t().contiguous().t()  # same values, column-major: not contiguous
            out = empty_like_layout(sum(out_splits), dt, layout, (sum(out_splits), 2))
            if direct:
                self.g.alltoall_base(out, inp, out_splits if uneven else [], in_splits if uneven else []).wait()
            else:
                dist.all_to_all_single(out, inp, out_splits if uneven else None, in_splits if uneven else None,
                                       group=self.g)
            want = []
            for r in range(size):
                start = sum(rows(r, j) for j in range(rank))
                want.append(_to(dt, full[r]).view(-1, 2)[start:start + rows(r, rank)] if full[r].numel()
                            else torch.empty((0, 2), dtype=tdt))
            return [(out, torch.cat(want) if want else out)]

        self.run_case(f"all_to_all_single even {tag}", Collective.ALL_TO_ALL, dt, None, lambda: a2a_single(False))
        self.run_case(f"all_to_all_single uneven {tag}", Collective.ALL_TO_ALL, dt, None, lambda: a2a_single(True))

        if size > 1:
            def p2p() -> list[tuple[torch.Tensor, torch.Tensor]]:
                salt = self.salt
                nxt, prv = (rank + 1) % size, (rank - 1) % size
                g = dist.get_global_rank
                send = make(rank, n, dt, salt, layout)
                recv = empty_like_layout(n, dt, layout)
                ops = [dist.P2POp(dist.isend, send, g(self.g, nxt), self.g),
                       dist.P2POp(dist.irecv, recv, g(self.g, prv), self.g)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                out = [(recv, make(prv, n, dt, salt, "contig"))]
                # blocking send/recv: even ranks send first (a ring of blocking calls would deadlock)
                t = empty_like_layout(n, dt, layout)
                if rank % 2 == 0:
                    if nxt != rank:
                        dist.send(make(rank, n, dt, salt + 1, layout), g(self.g, nxt), group=self.g)
                    if prv != rank:
                        dist.recv(t, g(self.g, prv), group=self.g)
                else:
                    dist.recv(t, g(self.g, prv), group=self.g)
                    dist.send(make(rank, n, dt, salt + 1, layout), g(self.g, nxt), group=self.g)
                return out + [(t, make(prv, n, dt, salt + 1, "contig"))]

            self.run_case(f"send/recv {tag}", Collective.SEND_RECV, dt, None, p2p)

    def run(self) -> dict[str, Any]:
        for dt in self.dtypes:
            for layout in LAYOUTS:
                if vdt.get(dt).kind in "fiu" or dt == "bool" or dt.startswith("complex"):
                    self.reductions(dt, layout)
                self.movement(dt, layout)
        dist.barrier(group=self.g)
        return {"label": self.label, "failures": self.failures, "recipes": dict(self.recipes),
                "cases": self.cases, "refused": self.refused}
