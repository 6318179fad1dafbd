"""``vcga bench``: nccl-tests' measurements for every backend, and for mixed-vendor worlds.

What is measured follows NVIDIA's nccl-tests (``src/common.cu``, ``doc/PERFORMANCE.md``) so the
numbers read the same:

- sizes from ``minbytes`` to ``maxbytes`` by ``stepfactor`` (or ``stepbytes``); for each size the
  buffers of each collective are laid out as nccl-tests' ``GetCollByteCount`` does (all_gather,
  reduce_scatter and all_to_all round the per-rank count down to 16 bytes); ``size`` is the larger of
  the send and receive buffer in bytes and ``count`` the elements per call parameter;
- ``warmup_iters`` calls per size (sizes doubling) before anything is timed; per row one more
  untimed call, a barrier, then ``iters`` calls timed together: ``time`` is their mean, averaged
  over the ranks of the group;
- ``algbw`` = bytes / time and ``busbw`` = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
  reduce_scatter, all_to_all) or 1 (broadcast, reduce, send_recv), as nccl-tests' ``GetBw``;
- ``#wrong``: ``check`` more calls on fresh data, every element of every rank's result compared
  bit for bit with the exact answer, summed over the ranks. The data are small integers chosen per
  dtype, op and world size so that every exact result is representable (the result then does not
  depend on reduction order; see :func:`inputs`).

Torch's API differs from NCCL's in one respect: all_reduce, broadcast and reduce have only an
in-place form. Their out-of-place column is what a torch user writes to keep the input: copy into
the output buffer, then the in-place collective (the copy is timed). send_recv has no in-place
column (sending and receiving one buffer at once races in torch's point-to-point API).

Mixed worlds are also measured per tier of the bridge, as nccl-tests' ``NCCL_TESTS_SPLIT`` runs
disjoint subgroups side by side: **in-vendor** (the ranks of one backend on one node: the vendor's
own library), **cross-vendor** (one rank of each backend on one node: the host bridge) and
**cross-node** (the i-th rank of every node: the network). Each subgroup is a ``vcga`` group of its
own; the subgroups of a tier run at the same time, each reported by itself.

The definitions and formulas above are :mod:`vcga.bench.spec`; this module runs the measurement and
returns rows. It never prints (the CLI does, :mod:`vcga.cli.bench`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# the nccl-tests definitions and formulas live in vcga.bench.spec; their public names stay importable from here
from vcga.bench.spec import (
    DTYPES,
    OPS,
    REDOPS,
    REDUCING,
    ROOTED,
    BenchSpec,
    Geometry,
    Row,
    _reduce_exact,
    algbw_bytes,
    bus_factor,
    dtype_name,
    geometry,
    inputs,
    parse_size,
    sizes,
)
from vcga.errors import VcgaError
from vcga.pg.comm import all_gather_single, reduce_scatter_single

__all__ = [
    "OPS",
    "DTYPES",
    "REDOPS",
    "BenchSpec",
    "Row",
    "bus_factor",
    "geometry",
    "inputs",
    "parse_size",
    "run",
    "sizes",
]

# ===================================================================================================
# One group under test
# ===================================================================================================


@dataclass
class Unit:
    """A group being measured: the world, or one subgroup of a tier; the ``gloo`` twin is optional."""

    tier: str
    ranks: list[int]  # global ranks, in group order
    backends: list[str]
    group: Any  # the vcga group (None on ranks outside it)
    gloo: Any = None

    @property
    def member(self) -> bool:
        return self.group is not None


class _Collective:
    """Buffers and calls for one (collective, dtype, op, size) on one group (this rank's part)."""

    def __init__(self, op: str, torch_dtype: Any, redop: str, g: Geometry, group: Any, ranks: list[int],
                 root: int, device: Any) -> None:
        import torch
        import torch.distributed as dist

        self.op, self.g, self.group, self.redop = op, g, group, redop
        self.n = len(ranks)
        self.me = dist.get_rank(group)
        self.root = root
        self.root_global = ranks[root]
        self.ranks = ranks
        self.dtype = torch_dtype
        self.device = device
        self.rop = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
                    "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}[redop]
        self.send = torch.zeros(g.send, dtype=torch_dtype, device=device)
        self.recv = torch.zeros(g.recv, dtype=torch_dtype, device=device)

    # -- calls -------------------------------------------------------------------------------------

    def call(self, in_place: bool) -> None:
        import torch.distributed as dist

        op, grp, s, r = self.op, self.group, self.send, self.recv
        p = self.g.param
        if op == "all_reduce":
            if not in_place:
                r.copy_(s)
            dist.all_reduce(r, op=self.rop, group=grp)
        elif op == "all_gather":
            all_gather_single(r, r[self.me * p:(self.me + 1) * p] if in_place else s, group=grp)
        elif op == "reduce_scatter":
            reduce_scatter_single(s[self.me * p:(self.me + 1) * p] if in_place else r, s, op=self.rop, group=grp)
        elif op == "broadcast":
            if not in_place and self.me == self.root:
                r.copy_(s)
            dist.broadcast(r, self.root_global, group=grp)
        elif op == "reduce":
            if not in_place:
                r.copy_(s)
            dist.reduce(r, self.root_global, op=self.rop, group=grp)
        elif op == "all_to_all":
            dist.all_to_all_single(s if in_place else r, s, group=grp)
        else:  # send_recv: to the next rank, from the previous one, at once (nccl-tests' ring of pairs)
            nxt, prv = self.ranks[(self.me + 1) % self.n], self.ranks[(self.me - 1) % self.n]
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, nxt, grp), dist.P2POp(dist.irecv, r, prv, grp)])
            for w in works:
                w.wait()

    # -- data and check ----------------------------------------------------------------------------

    def _salt(self) -> int:
        return OPS.index(self.op)

    def fill(self, rep: int, in_place: bool) -> None:
        """This rank's inputs for repetition ``rep``, where the call reads them."""
        dt = self.dtype_name
        mine = inputs(dt, self.redop, self.n, self.me, self.g.send, rep, self._salt()).to(self.dtype)
        self.recv.zero_()
        if self.op == "all_gather" and in_place:
            p = self.g.param
            self.recv[self.me * p:(self.me + 1) * p].copy_(mine)
        elif in_place and self.op in ("all_reduce", "broadcast", "reduce"):
            self.recv.copy_(mine)
        else:
            self.send.copy_(mine)

    @property
    def dtype_name(self) -> str:
        from vcga import dtypes

        return dtypes.from_torch(self.dtype)

    def result_and_expected(self, rep: int, in_place: bool) -> tuple[Any, Any] | None:
        """(this rank's result, the exact answer) as int64 tensors, or None when this rank holds
        no result (reduce off the root)."""
        import torch

        dt, n, p, salt = self.dtype_name, self.n, self.g.param, self._salt()

        def of(r: int, count: int) -> Any:
            return inputs(dt, self.redop, n, r, count, rep, salt)

        op = self.op
        if op == "all_reduce":
            return self.recv, _reduce_exact([of(r, p) for r in range(n)], self.redop, n)
        if op == "all_gather":
            return self.recv, torch.cat([of(r, p) for r in range(n)])
        if op == "reduce_scatter":
            out = self.send[self.me * p:(self.me + 1) * p] if in_place else self.recv
            return out, _reduce_exact([of(r, p * n)[self.me * p:(self.me + 1) * p] for r in range(n)], self.redop, n)
        if op == "broadcast":
            return self.recv, of(self.root, p)
        if op == "reduce":
            if self.me != self.root:
                return None
            return self.recv, _reduce_exact([of(r, p) for r in range(n)], self.redop, n)
        if op == "all_to_all":
            out = self.send if in_place else self.recv
            return out, torch.cat([of(r, p * n)[self.me * p:(self.me + 1) * p] for r in range(n)])
        return self.recv, of((self.me - 1) % n, p)

    def wrong(self, rep: int, in_place: bool) -> int:
        """Elements of this rank's result that differ, bit for bit, from the exact answer."""
        import torch

        got = self.result_and_expected(rep, in_place)
        if got is None:
            return 0
        out, want = got
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
        unsigned = self.dtype in (torch.uint32, torch.uint64)
        want_t = want.to(torch.int64).to(self.dtype) if unsigned else want.to(self.dtype)
        return int((out.detach().cpu().contiguous().view(bits) != want_t.contiguous().view(bits)).sum())


# ===================================================================================================
# The run
# ===================================================================================================


OnRow = Callable[[list[Row]], None]
OnNote = Callable[[str], None]


def _tiers(layout: list[tuple[str, str]]) -> list[tuple[str, list[list[int]]]]:
    """The subgroups of each bridge tier for ``layout`` [(backend, node) per rank]: only sets of 2+ ranks."""
    nodes = list(dict.fromkeys(node for _, node in layout))
    backends = list(dict.fromkeys(b for b, _ in layout))
    out: list[tuple[str, list[list[int]]]] = []
    by_bn: dict[tuple[str, str], list[int]] = {}
    for r, (b, node) in enumerate(layout):
        by_bn.setdefault((b, node), []).append(r)
    in_vendor = [rs for rs in by_bn.values() if len(rs) >= 2]
    if in_vendor and len(backends) > 1:
        out.append(("in-vendor", in_vendor))
    cross_vendor = []
    for node in nodes:
        here = [by_bn[(b, node)] for b in backends if (b, node) in by_bn]
        if len(here) < 2:
            continue
        for i in range(max(len(rs) for rs in here)):
            peers = [rs[i] for rs in here if i < len(rs)]
            if len(peers) >= 2:
                cross_vendor.append(peers)
    if cross_vendor:
        out.append(("cross-vendor", cross_vendor))
    if len(nodes) > 1:
        per_node = [[r for r, (_, nd) in enumerate(layout) if nd == node] for node in nodes]
        cross_node = []
        for i in range(max(len(rs) for rs in per_node)):
            peers = [rs[i] for rs in per_node if i < len(rs)]
            if len(peers) >= 2:
                cross_node.append(peers)
        if cross_node:
            out.append(("cross-node", cross_node))
    return out


def _sync(device: Any) -> None:
    import torch

    if device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize(device)


def run(spec: BenchSpec, *, device: Any, backend: str, on_rows: OnRow | None = None,
        on_note: OnNote | None = None) -> dict[str, Any]:
    """Measure ``spec`` on the default ``vcga`` group (already initialised on every rank).

    Every rank calls this; rank 0 gets ``on_rows`` with each size's rows as soon as they are
    measured, ``on_note`` for comments (what runs, what was skipped and why), and the returned
    summary; other ranks return an empty dict.

    :param device: this rank's device (tensors live there; the gloo comparison runs on the CPU).
    :param backend: this rank's VCGA backend name.
    """
    import torch.distributed as dist

    spec.validate()
    world = dist.get_world_size()
    rank = dist.get_rank()
    control = dist.new_group(backend="gloo")  # barriers and result exchange, outside what is measured

    layouts: list[Any] = [None] * world
    dist.all_gather_object(layouts, (backend, socket.gethostname(), os.getpid(), str(device)), group=control)
    layout = [(b, node) for b, node, _, _ in layouts]
    all_backends = [b for b, _ in layout]
    note = on_note if (on_note is not None and rank == 0) else (lambda _m: None)
    emit = on_rows if (on_rows is not None and rank == 0) else (lambda _r: None)

    units_by_tier: list[tuple[str, list[Unit]]] = []
    world_unit = Unit("world", list(range(world)), all_backends, dist.group.WORLD)
    if spec.compare == "gloo":
        world_unit.gloo = dist.new_group(backend="gloo")
    units_by_tier.append(("world", [world_unit]))
    mixed = len(set(all_backends)) > 1 or len({n for _, n in layout}) > 1
    if spec.tiers or (spec.tiers is None and mixed):
        for tier, subsets in _tiers(layout):
            units = []
            for ranks in subsets:  # every rank creates every subgroup, in the same order
                g = dist.new_group(ranks, backend="vcga")
                gg = dist.new_group(ranks, backend="gloo") if spec.compare == "gloo" else None
                units.append(Unit(tier, ranks, [all_backends[r] for r in ranks],
                                  g if rank in ranks else None, gg if rank in ranks else None))
            units_by_tier.append((tier, units))

    for r, (b, node, pid, dev) in enumerate(layouts):
        note(f"Rank {r:2d} Pid {pid:6d} on {node} backend {b} device {dev}")

    dtype_names = [dtype_name(d) for d in spec.dtypes]
    all_sizes = sizes(spec.minbytes, spec.maxbytes, spec.stepfactor, spec.stepbytes)
    rows: list[Row] = []
    skipped: list[str] = []
    for tier, units in units_by_tier:
        mine = next((u for u in units if u.member), None)
        if tier != "world":
            note(f"tier {tier}: "
                 + "; ".join(f"ranks {','.join(map(str, u.ranks))} ({'+'.join(dict.fromkeys(u.backends))})"
                             for u in units) + " side by side")
        for op in spec.ops:
            redops = spec.redops if op in REDUCING else ("sum",)
            for dt in dtype_names:
                for redop in redops:
                    def take(size_rows: list[Row]) -> None:
                        rows.extend(size_rows)
                        emit(size_rows)

                    why = _measure(spec, op, dt, redop, units, mine, all_sizes, control, device, rank, take, note)
                    if why:
                        skipped.append(why)
                        note("skipped: " + why)
    dist.barrier(group=control)
    for u in (x for _, us in units_by_tier for x in us):
        if u.group is not None and u.group is not dist.group.WORLD:
            dist.destroy_process_group(u.group)
        if u.gloo is not None:
            dist.destroy_process_group(u.gloo)
    if rank != 0:
        dist.destroy_process_group(control)
        return {}
    dist.destroy_process_group(control)
    checked = [r for r in rows if r.wrong is not None and r.group == "vcga"]  # gloo is the anchor, not under test
    vcga_rows = [r for r in rows if r.group == "vcga" and r.tier == "world"]
    return {
        "rows": rows,
        "skipped": skipped,
        "out_of_bounds": sum(r.wrong for r in checked if r.wrong),
        "avg_bus_bandwidth_gbps": (sum(r.busbw_gbps for r in vcga_rows) / len(vcga_rows)) if vcga_rows else 0.0,
        "layout": [{"rank": r, "backend": b, "node": n, "pid": p, "device": d}
                   for r, (b, n, p, d) in enumerate(layouts)],
    }


def _measure(spec: BenchSpec, op: str, dt: str, redop: str, units: list[Unit], mine: Unit | None,
             all_sizes: list[int], control: Any, device: Any, rank: int, take: OnRow, note: OnNote) -> str | None:
    """All sizes of one (collective, dtype, op) on the units of one tier (side by side); rank 0's
    rows go to ``take`` size by size. Returns why the combination was skipped (the same on every
    rank), or None."""
    import torch
    import torch.distributed as dist

    from vcga import dtypes

    tdtype = dtypes.to_torch(DTYPES[dt])
    elt = torch.empty(0, dtype=tdtype).element_size()
    kinds = [("vcga", False)] + ([("gloo", True)] if spec.compare == "gloo" else [])
    n_me = len(mine.ranks) if mine is not None else 0
    root = spec.root

    def agree(problem: str | None) -> str | None:
        """Every rank's verdict -> the first problem any rank met (so all ranks skip together)."""
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, problem, group=control)
        return next((p for p in seen if p), None)

    if op == "send_recv" and min(len(u.ranks) for u in units) < 2:
        return f"{op}: needs 2 ranks or more"
    if op in ROOTED and not 0 <= root < min(len(u.ranks) for u in units):
        return f"{op}: root {root} is not a rank of every group measured"

    # Warm-up, as nccl-tests: every size from minbytes doubling, warmup_iters calls each. A refusal
    # (the capability table says no) or a library error skips this combination on every rank.
    problem: dict[str, str | None] = {"vcga": None, "gloo": None}
    for kind, _ in kinds:
        err = None
        if mine is not None:
            grp = mine.group if kind == "vcga" else mine.gloo
            dev = device if kind == "vcga" else torch.device("cpu")
            try:
                s = max(all_sizes[0], 1)
                while s <= all_sizes[-1]:
                    warm = _Collective(op, tdtype, redop, geometry(op, s, elt, n_me), grp, mine.ranks, root, dev)
                    for _ in range(max(spec.warmup_iters, 1)):
                        warm.call(False)
                    _sync(dev)
                    s *= 2
            except (VcgaError, RuntimeError, ValueError, TypeError) as e:
                err = f"{op} {dt} {redop} on {kind}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        problem[kind] = agree(err)
    if problem["vcga"]:
        return problem["vcga"]
    if problem["gloo"] is not None:
        kinds = [("vcga", False)]
        note(f"no gloo comparison for {op} {dt} {redop}: {problem['gloo']}")

    gloo_wrong: dict[bool, int] = {}
    for nbytes in all_sizes:
        local: list[tuple[str, bool, float, int]] = []  # (kind, in_place, seconds, wrong)
        for kind, _ in kinds:
            for in_place in (False, True):
                if in_place and op == "send_recv":
                    continue
                secs, wrong = 0.0, 0
                c: _Collective | None = None
                if mine is not None:
                    grp = mine.group if kind == "vcga" else mine.gloo
                    dev = device if kind == "vcga" else torch.device("cpu")
                    c = _Collective(op, tdtype, redop, geometry(op, nbytes, elt, n_me), grp, mine.ranks, root, dev)
                    c.fill(0, in_place)
                    c.call(in_place)  # one untimed call (nccl-tests' BenchTime)
                    _sync(dev)
                dist.barrier(group=control)
                if c is not None:
                    t0 = time.perf_counter()
                    for _ in range(spec.iters):
                        c.call(in_place)
                    _sync(c.device)
                    secs = (time.perf_counter() - t0) / spec.iters
                dist.barrier(group=control)
                if c is not None:
                    for rep in range(1, spec.check + 1):
                        c.fill(rep, in_place)
                        c.call(in_place)
                        _sync(c.device)
                        wrong += c.wrong(rep, in_place)
                        if wrong:
                            break
                    del c
                local.append((kind, in_place, secs, wrong))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, local, group=control)
        if rank != 0:
            continue
        size_rows: list[Row] = []
        for u in units:
            g = geometry(op, nbytes, elt, len(u.ranks))
            times: dict[tuple[str, bool], float] = {}
            for i, (kind, in_place, _, _) in enumerate(every[u.ranks[0]]):
                secs = sum(every[r][i][2] for r in u.ranks) / len(u.ranks)  # nccl-tests' -a 1: mean over ranks
                wrong_n = sum(every[r][i][3] for r in u.ranks)
                times[(kind, in_place)] = secs
                algbw = algbw_bytes(op, g, elt, len(u.ranks)) / 1e9 / secs if secs > 0 else 0.0
                size_rows.append(Row(op=op, nranks=len(u.ranks), size_bytes=max(g.send, g.recv) * elt, count=g.param,
                                     dtype=dt, redop=redop if op in REDUCING else "none",
                                     root=root if op in ROOTED else -1, time_us=secs * 1e6, algbw_gbps=algbw,
                                     busbw_gbps=algbw * bus_factor(op, len(u.ranks)),
                                     wrong=wrong_n if spec.check else None, in_place=in_place, group=kind,
                                     tier=u.tier, ranks=list(u.ranks), backends=list(u.backends)))
            for row in size_rows[-len(every[u.ranks[0]]):]:
                if row.group == "vcga" and ("gloo", row.in_place) in times and times[("gloo", row.in_place)] > 0:
                    row.vs_gloo = times[("vcga", row.in_place)] / times[("gloo", row.in_place)]
                if row.group == "gloo" and row.wrong:
                    gloo_wrong[row.in_place] = gloo_wrong.get(row.in_place, 0) + row.wrong
        take(size_rows)
    for in_place, n_wrong in gloo_wrong.items():
        note(f"plain gloo got {n_wrong} elements wrong in {op} {dt} {'in-place' if in_place else 'out-of-place'} "
             "(the comparison's anchor, not counted as out of bounds)")
    return None
