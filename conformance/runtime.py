"""Checks 9, 10 and 11: asynchronous operations, faults (mismatch, missing rank), point-to-point."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from vcga.contract import CheckResult, Collective, ReduceOp
from vcga.errors import VcgaMismatchError, VcgaTimeoutError

from . import data
from .base import Check, compare_exact, needs, runnable
from .context import Context, Verdict, first_line
from .ops import COLLECTIVE_OF, REDUCING_FORMS, input_numel, p2p

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncOps", "Faults", "SendRecv"]


class AsyncOps(Check):
    """Check 9: many outstanding asynchronous operations complete, each with its own right answer."""

    name = "async"
    description = ("many outstanding async collectives (waited out of order), futures and their "
                   "callbacks, and async point-to-point complete with exact results")
    defaults = {"outstanding": 32, "n": 1000, "dtype": "float32"}

    FORMS = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "all_to_all_single")

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        dt = str(self.opt(ctx, "dtype"))
        k, n = int(self.opt(ctx, "outstanding")), int(self.opt(ctx, "n"))
        every = [(COLLECTIVE_OF[f], dt, ReduceOp.SUM if f in REDUCING_FORMS else None) for f in self.FORMS]
        sum_ = (Collective.ALL_REDUCE, dt, ReduceOp.SUM)
        cases: list[tuple[str, Callable[[], Verdict], str | None, Any]] = [
            (f"{k} outstanding collectives on {dt}, waited in reverse order", lambda: self._many(ctx, dt, k, n),
             needs(ctx, table, every, "this case"), None),
            (f"futures: then() callbacks and collect_all over {min(k, 8)} all_reduce on {dt}",
             lambda: self._futures(ctx, dt, min(k, 8), n), runnable(ctx, table, *sum_), sum_),
        ]
        for case, body, why, cell in cases:
            yield ctx.run_unless(case, why, body, dtype=dt, cell=cell)
        case = f"{k} outstanding isend/irecv around the ring on {dt}"
        why = runnable(ctx, table, Collective.SEND_RECV, dt, None)
        if ctx.world_size < 2:
            why = why or "point-to-point needs two ranks"
        yield ctx.run_unless(case, why, lambda: self._p2p(ctx, dt, k, n), dtype=dt,
                             cell=(Collective.SEND_RECV, dt, None))

    def _many(self, ctx: Context, dt: str, k: int, n: int) -> Verdict:
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        pending: list[tuple[int, str, Any, Any]] = []
        for i in range(k):
            form = self.FORMS[i % len(self.FORMS)]
            numel = input_numel(form, n, ws)
            op = ReduceOp.SUM if form in REDUCING_FORMS else None
            inputs = (lambda r, i=i, m=numel: data.exact_input(ReduceOp.SUM, dt, m, r, ws, ("async", i))) if op \
                else (lambda r, i=i, m=numel: data.movement_input(dt, m, r, ("async", i)))
            x = inputs(rank).clone()
            root = i % ws
            if form == "all_reduce":
                work, got = dist.all_reduce(x, async_op=True), x
            elif form == "broadcast":
                work, got = dist.broadcast(x, src=root, async_op=True), x
            elif form == "all_gather_single":
                got = torch.empty(n * ws, dtype=x.dtype)
                work = dist.all_gather_single(got, x, async_op=True)
            elif form == "reduce_scatter_single":
                got = torch.empty(n, dtype=x.dtype)
                work = dist.reduce_scatter_single(got, x, async_op=True)
            else:
                got = torch.empty(n * ws, dtype=x.dtype)
                work = dist.all_to_all_single(got, x, async_op=True)
            pending.append((i, form, work, (got, inputs, root)))
        for i, form, work, _ in reversed(pending):
            if work.wait(timeout=ctx.timeout) is False:
                return Verdict.fail(f"operation #{i} ({form}) did not complete within {ctx.timeout_s:g} s")
        for i, form, _, (got, inputs, root) in pending:
            xs = [inputs(r) for r in range(ws)]
            if form == "all_reduce":
                want = data.exact_reduce(ReduceOp.SUM, xs, dt)
            elif form == "broadcast":
                want = xs[root]
            elif form == "all_gather_single":
                want = torch.cat(xs)
            elif form == "reduce_scatter_single":
                want = data.exact_reduce(ReduceOp.SUM, xs, dt)[rank * n:(rank + 1) * n]
            else:
                want = torch.cat([x[rank * n:(rank + 1) * n] for x in xs])
            v = compare_exact(got, want, f"operation #{i} ({form})")
            if not v.passed:
                return v
        # asked last: gloo marks some works completed a moment after wait() returns
        late = [f"#{i} ({form})" for i, form, work, _ in pending if not work.is_completed()]
        if late:
            return Verdict.fail(f"is_completed() is False after wait() returned for {', '.join(late)}")
        return Verdict.ok(0.0, 0.0)

    @staticmethod
    def _futures(ctx: Context, dt: str, k: int, n: int) -> Verdict:
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        xs = [[data.exact_input(ReduceOp.SUM, dt, n, r, ws, ("future", i)) for r in range(ws)] for i in range(k)]
        tensors = [xs[i][rank].clone() for i in range(k)]
        seen: list[int] = []
        futs = []
        for i, t in enumerate(tensors):
            fut = dist.all_reduce(t, async_op=True).get_future()
            futs.append(fut.then(partial(_noted, seen, i)))
        torch.futures.collect_all(futs).wait()
        if sorted(seen) != list(range(k)):
            return Verdict.fail(f"then() callbacks ran for {sorted(seen)}, expected all of 0..{k - 1}")
        for i, (t, fut) in enumerate(zip(tensors, futs, strict=True)):
            want = data.exact_reduce(ReduceOp.SUM, xs[i], dt)
            v = compare_exact(t, want, f"all_reduce #{i}")
            if not v.passed:
                return v
            value = fut.value()
            got = value[0] if isinstance(value, (list, tuple)) else value
            if not isinstance(got, torch.Tensor) or not data.same_bits(got, want):
                return Verdict.fail(f"future #{i} resolved to {type(got).__name__}, not the reduced tensor")
        return Verdict.ok(0.0, 0.0)

    @staticmethod
    def _p2p(ctx: Context, dt: str, k: int, n: int) -> Verdict:
        import torch
        import torch.distributed as dist

        ws, rank = ctx.world_size, ctx.rank
        right, left = (rank + 1) % ws, (rank - 1) % ws
        sends = [p2p(dist.isend(data.movement_input(dt, n, rank, ("ring", i)), dst=right, tag=i)) for i in range(k)]
        outs = [torch.empty(n, dtype=data.movement_input(dt, 0, 0).dtype) for _ in range(k)]
        recvs = [p2p(dist.irecv(outs[i], src=left, tag=i)) for i in range(k)]
        for w in reversed(recvs + sends):
            if w.wait(timeout=ctx.timeout) is False:
                return Verdict.fail(f"a point-to-point operation did not complete within {ctx.timeout_s:g} s")
        for i in range(k):
            v = compare_exact(outs[i], data.movement_input(dt, n, left, ("ring", i)), f"message #{i}")
            if not v.passed:
                return v
        return Verdict.ok(0.0, 0.0)


class Faults(Check):
    """Check 10: a mismatched collective raises the typed mismatch error, a missing rank the typed
    timeout error, each within the configured timeout plus a grace period, on every rank that waited."""

    name = "faults"
    description = ("a mismatched collective raises VcgaMismatchError and a missing rank VcgaTimeoutError, "
                   "on every waiting rank, within the configured timeout plus a grace period")
    defaults = {"timeout_s": 2.0, "grace_s": 5.0}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        t, grace = float(self.opt(ctx, "timeout_s")), float(self.opt(ctx, "grace_s"))
        # both faults are provoked with all_reduce SUM on float32
        why = runnable(ctx, ctx.capabilities(), Collective.ALL_REDUCE, "float32", ReduceOp.SUM)
        case = f"missing rank: the others raise a timeout error within {t:g} s + {grace:g} s"
        if ctx.world_size < 2 or why:
            yield ctx.result(case, True, skipped=True, detail=why or "needs two ranks")
        else:
            holder: dict[str, Any] = {}
            yield ctx.run_case(case, lambda: self._missing_rank(ctx, t, grace, holder))
            self._destroy(holder)
        case = f"mismatched shapes: every rank raises VcgaMismatchError within {t:g} s + {grace:g} s"
        if not ctx.through_vcga:
            yield ctx.result(case, True, skipped=True,
                             detail="native libraries do not compare collectives across ranks; this runs on the "
                                    "vcga group (debug mode)")
        elif ctx.world_size < 2 or why:
            yield ctx.result(case, True, skipped=True, detail=why or "needs two ranks")
        else:
            holder = {}
            yield ctx.run_case(case, lambda: self._mismatch(ctx, t, grace, holder))
            self._destroy(holder)

    @staticmethod
    def _new_group(ctx: Context, timeout_s: float, debug: bool) -> Any:
        """A fresh group of every rank with a short timeout (debug mode: ``VCGA_DEBUG`` set while the
        group is created, which is when the vcga group reads its configuration)."""
        import torch.distributed as dist

        old = os.environ.get("VCGA_DEBUG")
        if debug:
            os.environ["VCGA_DEBUG"] = "1"
        try:
            return dist.new_group(list(range(ctx.world_size)), timeout=timedelta(seconds=timeout_s))
        finally:
            if debug:
                if old is None:
                    os.environ.pop("VCGA_DEBUG", None)
                else:
                    os.environ["VCGA_DEBUG"] = old

    @staticmethod
    def _destroy(holder: dict[str, Any]) -> None:
        import torch.distributed as dist

        g = holder.get("group")
        if g is not None:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - a group left broken by the fault is expected to complain on teardown
                pass

    def _missing_rank(self, ctx: Context, t: float, grace: float, holder: dict[str, Any]) -> Verdict:
        import torch
        import torch.distributed as dist

        g = holder["group"] = self._new_group(ctx, t, debug=False)
        absent = ctx.world_size - 1
        if ctx.rank == absent:
            # Stay alive and keep the group open (a closed connection would be a different fault);
            # run_case's exchange then waits for the others to report.
            return Verdict.ok(detail=f"rank {absent} stayed away")
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=g)
        except Exception as e:  # noqa: BLE001 - any error is judged below, by its type
            elapsed = time.monotonic() - start
            if ctx.through_vcga and not isinstance(e, VcgaTimeoutError):
                return Verdict.fail(f"raised {first_line(e)} after {elapsed:.1f} s; expected VcgaTimeoutError",
                                    elapsed, t + grace)
            if elapsed > t + grace:
                return Verdict.fail(f"the timeout error came after {elapsed:.1f} s (timeout {t:g} s)",
                                    elapsed, t + grace)
            return Verdict.ok(elapsed, t + grace, detail=f"{type(e).__name__} after {elapsed:.1f} s")
        return Verdict.fail(f"all_reduce completed although rank {absent} never joined")

    def _mismatch(self, ctx: Context, t: float, grace: float, holder: dict[str, Any]) -> Verdict:
        import torch
        import torch.distributed as dist

        g = holder["group"] = self._new_group(ctx, t, debug=True)
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(ctx.rank + 1), group=g)
        except VcgaMismatchError as e:
            elapsed = time.monotonic() - start
            if elapsed > t + grace:
                return Verdict.fail(f"the mismatch error came after {elapsed:.1f} s (timeout {t:g} s)",
                                    elapsed, t + grace)
            if "shape" not in e.differences:
                return Verdict.fail(f"VcgaMismatchError does not name the shape: {e}")
            return Verdict.ok(elapsed, t + grace, detail=f"VcgaMismatchError after {elapsed:.1f} s")
        except Exception as e:  # noqa: BLE001 - any other error is the verdict
            return Verdict.fail(f"raised {first_line(e)}; expected VcgaMismatchError")
        return Verdict.fail("all_reduce with different shapes on different ranks completed without an error")


class SendRecv(Check):
    """Check 11: point-to-point in the patterns pipelines use."""

    name = "send-recv"
    description = "send/recv in pairs, around a ring, with out-of-order tags, batched, and from any source"
    defaults = {"dtypes": ["float32", "bfloat16", "int64", "bool"], "sizes": [0, 1, 1000]}

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        table = ctx.capabilities()
        patterns: dict[str, Callable[[Context, str, int], Verdict]] = {
            "pairs": _pairs, "ring": _ring, "tags out of order": _tags, "batch_isend_irecv ring": _batched,
            "any source": _any_source,
        }
        for dt in self.dtypes(ctx):
            why = runnable(ctx, table, Collective.SEND_RECV, dt, None)
            if ctx.world_size < 2:
                why = why or "needs two ranks"
            for name, fn in patterns.items():
                case = f"{name} {dt} n={','.join(map(str, self.opt(ctx, 'sizes')))}"
                yield ctx.run_unless(case, why, partial(_all_sizes, ctx, fn, dt, list(self.opt(ctx, "sizes"))),
                                     dtype=dt, cell=(Collective.SEND_RECV, dt, None))


def _noted(seen: list[int], i: int, fut: torch.futures.Future) -> Any:
    """A ``then()`` callback: note that callback ``i`` ran, pass the value on."""
    seen.append(i)
    return fut.value()


def _all_sizes(ctx: Context, fn: Callable[[Context, str, int], Verdict], dt: str, sizes: list[int]) -> Verdict:
    # every size on every rank, whatever this rank saw: a rank that stopped early would leave its
    # peers waiting for messages it never sends
    verdicts = [(n, fn(ctx, dt, n)) for n in sizes]
    for n, v in verdicts:
        if not v.passed:
            return Verdict.fail(f"n={n}: {v.detail}")
    return Verdict.ok(0.0, 0.0)


def _msg(dt: str, n: int, src: int, dst: int, tag: int = 0) -> torch.Tensor:
    return data.movement_input(dt, n, src * 100 + dst, ("p2p", tag))


def _empty(dt: str, n: int) -> torch.Tensor:
    import torch

    return torch.zeros(n, dtype=_msg(dt, 0, 0, 0).dtype)


def _pairs(ctx: Context, dt: str, n: int) -> Verdict:
    import torch.distributed as dist

    rank, ws = ctx.rank, ctx.world_size
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= ws:
        return Verdict.ok(detail="no partner")
    got = _empty(dt, n)
    if rank % 2 == 0:
        dist.send(_msg(dt, n, rank, peer), dst=peer)
        dist.recv(got, src=peer)
    else:
        dist.recv(got, src=peer)
        dist.send(_msg(dt, n, rank, peer), dst=peer)
    return compare_exact(got, _msg(dt, n, peer, rank))


def _ring(ctx: Context, dt: str, n: int) -> Verdict:
    import torch.distributed as dist

    rank, ws = ctx.rank, ctx.world_size
    right, left = (rank + 1) % ws, (rank - 1) % ws
    got = _empty(dt, n)
    s = p2p(dist.isend(_msg(dt, n, rank, right), dst=right))
    r = p2p(dist.irecv(got, src=left))
    s.wait()
    r.wait()
    return compare_exact(got, _msg(dt, n, left, rank))


def _tags(ctx: Context, dt: str, n: int) -> Verdict:
    """Rank 0 sends three tagged messages; rank 1 receives them in a different order."""
    import torch.distributed as dist

    if ctx.rank == 0:
        works = [p2p(dist.isend(_msg(dt, n, 0, 1, tag), dst=1, tag=tag)) for tag in (1, 2, 3)]
        for w in works:
            w.wait()
        return Verdict.ok()
    if ctx.rank == 1:
        got = {}
        for tag in (3, 1, 2):  # receive everything first, then judge
            got[tag] = _empty(dt, n)
            dist.recv(got[tag], src=0, tag=tag)
        for tag in (3, 1, 2):
            v = compare_exact(got[tag], _msg(dt, n, 0, 1, tag), f"tag {tag}")
            if not v.passed:
                return v
    return Verdict.ok()


def _batched(ctx: Context, dt: str, n: int) -> Verdict:
    import torch.distributed as dist

    rank, ws = ctx.rank, ctx.world_size
    right, left = (rank + 1) % ws, (rank - 1) % ws
    got = _empty(dt, n)
    ops = [dist.P2POp(dist.isend, _msg(dt, n, rank, right, 7), right),
           dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return compare_exact(got, _msg(dt, n, left, rank, 7))


def _any_source(ctx: Context, dt: str, n: int) -> Verdict:
    """Every rank but 0 sends to rank 0, which receives without naming the sender.

    One tag per message size: a sender goes on to the next size as soon as its message is taken,
    so without it rank 0's receive for one size could match another rank's message of the next
    size (any-source semantics allow that; gloo then aborts the process on the size mismatch)."""
    import torch.distributed as dist

    rank, ws = ctx.rank, ctx.world_size
    tag = 1000 + n
    if rank != 0:
        dist.send(_msg(dt, n, rank, 0, 9), dst=0, tag=tag)
        return Verdict.ok()
    received = []
    for _ in range(ws - 1):  # receive everything first, then judge
        got = _empty(dt, n)
        received.append((dist.recv(got, tag=tag), got))
    seen = []
    for src, got in received:
        if not isinstance(src, int) or not 0 < src < ws:
            return Verdict.fail(f"recv from any source returned sender {src!r}")
        v = compare_exact(got, _msg(dt, n, src, 0, 9), f"message from rank {src}")
        if not v.passed:
            return v
        seen.append(src)
    if sorted(seen) != list(range(1, ws)):
        return Verdict.fail(f"received from ranks {sorted(seen)}, expected 1..{ws - 1} once each")
    return Verdict.ok()
