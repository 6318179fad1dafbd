"""What each rank of a mixed-vendor world checks (run by tests/test_bridge.py; fake-backed: the
vendors are the simulated sim-nccl / sim-hccl / sim-cncl, CPU stand-ins that follow each vendor
library's rules, including CNCL reducing fp64 as fp32).

:func:`mixed_world` runs, on one spawned world:

1. the collective matrix of tests/pg_cases.py on the mixed ``vcga`` group (every collective
   variant x pg_cases.DTYPES x ops x layouts, exact small-integer data: every native or
   emulated cell must be bit-exact, every refused cell must raise before any rank communicates);
2. numerics on random data, through a group per all_reduce algorithm (leader, bandwidth): every
   rank ends with the same bits (compared over a separate gloo group), the error against an
   extended-precision reference is within the Higham bound of docs/bridge.md, fp16 sums are at
   least as accurate as a single-vendor fp16 ring;
3. the plan: the same on every rank, and the algorithm counters show which algorithm ran.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

#: unit roundoff per dtype (design.md)
U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


def inputs(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rank ``rank``'s random input (every rank can regenerate every other rank's)."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64) * (1 + rank)
    return x.to(dtype)


def bound(dtype: torch.dtype, size: int, xs: list[torch.Tensor], exact: np.ndarray) -> np.ndarray:
    """The documented per-element bound of a bridged SUM (docs/bridge.md, "Error bounds")."""
    abs_sum = sum(np.abs(x.double().numpy()).astype(np.longdouble) for x in xs)
    if dtype in (torch.float16, torch.bfloat16):
        # accumulated in fp32 across the whole group, rounded once to the narrow dtype
        return U[dtype] * np.abs(exact) + (1 + U[dtype]) * gamma(size - 1, U[torch.float32]) * abs_sum
    return gamma(size - 1, U[dtype]) * abs_sum


@functools.cache
def _numerics_case(n: int, dtype: torch.dtype, salt: int, size: int) -> tuple[tuple[torch.Tensor, ...], np.ndarray, np.ndarray]:
    """Every rank's input of one :func:`numerics` case, their extended-precision sum and its bound.
    A world checks the same cases through every group it makes, so a rank works them out once
    (read-only: callers clone what they reduce)."""
    xs = tuple(inputs(r, n, dtype, salt) for r in range(size))
    exact = sum(x.double().numpy().astype(np.longdouble) for x in xs)
    return xs, exact, bound(dtype, size, list(xs), exact)


@functools.cache
def _ring_error(n: int, dtype: torch.dtype, salt: int, size: int) -> np.ndarray:
    """The error of a single-vendor ring in ``dtype`` (n-1 additions, each rounded to ``dtype``)."""
    xs, exact, _ = _numerics_case(n, dtype, salt, size)
    ring = xs[0].clone()
    for x in xs[1:]:
        ring = ring + x  # fp16 + fp16 rounds to fp16 after every step, as a ring does
    return np.abs(ring.double().numpy().astype(np.longdouble) - exact)


def numerics(group: Any, check: Any, rank: int, size: int, label: str) -> list[str]:
    """Random-data SUM / AVG through ``group``; returns failure messages (empty: all good)."""
    failures = []
    for salt, (dtype, n) in enumerate([(torch.float32, 1000), (torch.float32, 70_000), (torch.float64, 70_000),
                                       (torch.float16, 70_000), (torch.bfloat16, 5000), (torch.float32, 1),
                                       (torch.float32, 7), (torch.float64, 70_001)]):
        xs, exact, b = _numerics_case(n, dtype, salt, size)
        t = xs[rank].clone()
        dist.all_reduce(t, group=group)
        # 1. bitwise identical on every rank (compared over gloo, not through the bridge)
        mine = t.view(torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(everyone, mine, group=check)
        if not all(torch.equal(e, everyone[0]) for e in everyone):
            failures.append(f"{label} {dtype} n={n}: ranks ended with different bits")
        # 2. within the bound of an extended-precision reference
        err = np.abs(t.double().numpy().astype(np.longdouble) - exact)
        if not (err <= b).all():
            i = int(np.argmax(err - b))
            failures.append(f"{label} {dtype} n={n}: error {float(err[i]):.3g} > bound {float(b[i]):.3g} at {i}")
        # 3. fp16: at least as accurate as a single-vendor fp16 ring (n-1 additions, each rounded to fp16)
        if dtype in (torch.float16, torch.bfloat16):
            ring_err = _ring_error(n, dtype, salt, size)
            if err.sum() > ring_err.sum() or err.max() > ring_err.max():
                failures.append(f"{label} {dtype}: bridge error (sum {float(err.sum()):.3g}, max {float(err.max()):.3g}) "
                                f"worse than an fp16 ring (sum {float(ring_err.sum()):.3g}, max {float(ring_err.max()):.3g})")
    # int64 SUM (odd length, values near the wrap-around): exact, modulo 2**64 as a flat library
    g = torch.Generator().manual_seed(4242 + rank)
    t = torch.randint(-2 ** 62, 2 ** 62, (1001,), generator=g, dtype=torch.int64)
    ref = [torch.randint(-2 ** 62, 2 ** 62, (1001,), generator=torch.Generator().manual_seed(4242 + r),
                         dtype=torch.int64) for r in range(size)]
    dist.all_reduce(t, group=group)
    if not torch.equal(t, sum(ref[1:], ref[0])):
        failures.append(f"{label} int64 SUM: not exact")
    # AVG: SUM then one division (sum_then_divide), bitwise identical everywhere
    t = inputs(rank, 777, torch.float32, 99)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    everyone = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(everyone, t, group=check)
    if not all(torch.equal(e, everyone[0]) for e in everyone):
        failures.append(f"{label} AVG: ranks ended with different bits")
    return failures


#: (dtype, chunk) of each :func:`reduce_scatters` case: chunks of one element, odd sizes, and 1.2 MB
REDUCE_SCATTER_CASES = [(torch.int64, 1), (torch.int64, 1001), (torch.float32, 7), (torch.float32, 300_001),
                        (torch.float64, 4097), (torch.bool, 333)]


@functools.cache
def _reduce_scatter_case(salt: int, dtype: torch.dtype, c: int, rank: int, size: int) -> tuple[
        torch.Tensor, torch.Tensor | None, np.ndarray | None, np.ndarray | None]:
    """One :func:`reduce_scatters` case for ``rank``: its input (read-only: callers clone it), and
    its chunk's expected result -- exact (``want``: int64 SUM, bool MAX), or the extended-precision
    sum and its bound (floats). The same for every group a world checks, so worked out once."""
    xs = [inputs(r, size * c, torch.float64, 50 + salt) for r in range(size)]
    if dtype == torch.int64:
        xs = [(x * 1000).to(torch.int64) for x in xs]
    elif dtype == torch.bool:
        xs = [x > 0.5 for x in xs]
    else:
        xs = [x.to(dtype) for x in xs]
    mine = [x.view(size, c)[rank] for x in xs]
    if dtype == torch.bool:
        return xs[rank], torch.stack(mine).any(0), None, None
    if dtype == torch.int64:
        return xs[rank], sum(mine[1:], mine[0]), None, None
    exact = sum(x.double().numpy().astype(np.longdouble) for x in mine)
    return xs[rank], None, exact, bound(dtype, size, mine, exact)


def reduce_scatters(group: Any, rank: int, size: int, label: str) -> list[str]:
    """reduce_scatter_tensor and the list form: int64 exact, fp32 / fp64 within the SUM bound of an
    extended-precision reference, bool MAX exact; chunks of one element, odd sizes, and 1.2 MB
    (several pieces through shared memory are covered in tests/test_hostbridge.py)."""
    failures = []
    for salt, (dtype, c) in enumerate(REDUCE_SCATTER_CASES):
        mine_in, want, exact, b = _reduce_scatter_case(salt, dtype, c, rank, size)
        op = dist.ReduceOp.MAX if dtype == torch.bool else dist.ReduceOp.SUM
        for form in ("tensor", "list"):
            out = torch.empty(c, dtype=dtype)
            if form == "tensor":
                dist.reduce_scatter_tensor(out, mine_in.clone(), op=op, group=group)
            else:
                dist.reduce_scatter(out, list(mine_in.clone().view(size, c).unbind(0)), op=op, group=group)
            if want is not None:
                ok = torch.equal(out, want)
            else:
                err = np.abs(out.double().numpy().astype(np.longdouble) - exact)
                ok = bool((err <= b).all())
            if not ok:
                failures.append(f"{label} reduce_scatter ({form}) {dtype} chunk={c}: wrong or outside the bound")
    return failures


def uneven_all_gather(group: Any, rank: int, size: int) -> list[str]:
    """The list form of all_gather with a different size per rank (zero included) across vendors:
    exact on every rank (gloo's own list form aborts a rank on uneven sizes)."""
    failures = []
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        sizes = [(3 * r + 1) % 5 for r in range(size)]  # 1, 4, 2, 0, ...
        want = [torch.arange(sizes[r], dtype=torch.float64).mul(r + 1).to(dtype) for r in range(size)]
        outs = [torch.full((sizes[r],), -1, dtype=dtype) for r in range(size)]
        dist.all_gather(outs, want[rank].clone(), group=group)
        if not all(torch.equal(o, w) for o, w in zip(outs, want, strict=False)):
            failures.append(f"uneven all_gather {dtype}: {outs} != {want}")
    return failures


def large_all_gather(group: Any, rank: int, size: int) -> list[str]:
    """all_gather of a few MB per rank across vendors -- pieces in flight at once (bridge
    ``pipelined_allgather``), split where the bytes do not divide evenly -- in both forms, the list
    form with a different size per rank too: every rank's bytes in place on every rank."""
    from vcga.bridge.group import GATHER_PIECE_BYTES
    from vcga.pg.comm import all_gather_single

    failures = []
    n = 5 * GATHER_PIECE_BYTES // 4 + 3  # float32: 5 pieces, the last ones uneven
    want = [torch.arange(n, dtype=torch.float32).add_(1e6 * r) for r in range(size)]
    out = torch.empty(size * n, dtype=torch.float32)
    all_gather_single(out, want[rank].clone(), group=group)
    if not torch.equal(out, torch.cat(want)):
        failures.append("large all_gather (single tensor): bytes out of place")
    sizes = [n - 7 * r for r in range(size)]
    uneven = [w[:m].to(torch.int32) for w, m in zip(want, sizes, strict=False)]
    outs = [torch.full((m,), -1, dtype=torch.int32) for m in sizes]
    dist.all_gather(outs, uneven[rank].clone(), group=group)
    if not all(torch.equal(o, w) for o, w in zip(outs, uneven, strict=False)):
        failures.append("large uneven all_gather (list form): bytes out of place")
    return failures


def mixed_world(rank: int, size: int, init_method: str, matrix_dtypes: list[str]) -> dict[str, Any]:
    from pg_cases import Matrix

    import vcga  # noqa: F401 - registers backend "vcga"
    from vcga.config import load_config
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=size)
    world = dist.group.WORLD
    check = dist.new_group(backend="gloo")
    out: dict[str, Any] = {"failures": [], "backend": world.transport.backend_name}
    out["matrix"] = Matrix(world, "mixed", matrix_dtypes).run()
    out["failures"] += out["matrix"]["failures"]
    out["failures"] += uneven_all_gather(world, rank, size)
    out["failures"] += large_all_gather(world, rank, size)
    counts = {}
    from vcga.bridge import ALGORITHMS

    methods = {}
    # the bandwidth algorithm twice: in-group steps through the library's reduce_scatter/all_gather,
    # and through rings of its send/recv (every rank of a vendor group must use the same method);
    # the shard peers (all on this host) reduce through shared memory, except in the "-gloo" groups
    exchanges = {}
    for label, alg, method, shm in [(a, a, None, True) for a in ALGORITHMS] + [
            ("bandwidth-collective", "bandwidth", "collective", True), ("bandwidth-p2p", "bandwidth", "p2p", True),
            ("leader-gloo", "leader", None, False), ("bandwidth-p2p-gloo", "bandwidth", "p2p", False)]:
        g = dist.new_group(backend="vcga", pg_options=VcgaOptions(
            config=replace(load_config(), bridge_algorithm=alg, bridge_shm=shm)))
        exchanges[label] = g.transport.describe()["shard_exchange"]
        if method is not None:
            g.transport.group.reducer.group_method = method
        methods[label] = g.transport.group.reducer.group_method
        out["failures"] += numerics(g, check, rank, size, label)
        out["failures"] += reduce_scatters(g, rank, size, label)
        counts[label] = {**g.transport.group.reducer.counts, "hierarchical_rs": g.transport.group.hierarchical_reduce_scatters}
        if label == "bandwidth":
            out["calibration"] = g.transport.describe()["calibration"]
    out["counts"] = counts
    out["methods"] = methods
    out["exchanges"] = exchanges
    plan = world.transport.describe()["plan"]
    plans = [None] * size
    dist.all_gather_object(plans, json.dumps(plan, sort_keys=True), group=check)
    out["same_plan"] = len(set(plans)) == 1
    out["plan"] = plan
    out["table_native_fp16_sum"] = str(world.capabilities.lookup("all_reduce", "float16", "SUM").support)
    out["table_fp16_via"] = world.capabilities.lookup("all_reduce", "float16", "SUM").via
    dist.destroy_process_group()
    return out


def failing_world(rank: int, size: int, init_method: str, backends: list[str]) -> dict[str, Any]:
    """Each rank picks its backend; returns the error group creation raised (or None)."""
    import os
    import time

    os.environ["VCGA_BACKEND"] = backends[rank]
    import vcga  # noqa: F401

    t0 = time.monotonic()
    try:
        dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=size)
    except Exception as e:  # noqa: BLE001 - reported to the test
        chain, cur = [], e
        while cur is not None and len(chain) < 8:
            chain.append(cur)
            cur = cur.__cause__ or cur.__context__
        from vcga.errors import VcgaError

        typed = next((x for x in chain if isinstance(x, VcgaError)), None)
        return {"type": type(typed or e).__name__, "message": str(typed or e), "seconds": time.monotonic() - t0}
    dist.destroy_process_group()
    return {"type": None, "message": "", "seconds": time.monotonic() - t0}


def no_device_world(rank: int, size: int, init_method: str, backends: list[str], no_device: list[int]) -> dict[str, Any]:
    """Each rank picks its backend; the ranks in ``no_device`` cannot name their device. Returns
    whether the group came up, what it measured at creation, and one all_reduce's result."""
    import os
    import time

    os.environ["VCGA_BACKEND"] = backends[rank]
    if rank in no_device:
        os.environ["VCGA_TEST_NO_DEVICE"] = "1"
    import vcga  # noqa: F401

    t0 = time.monotonic()
    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=size)
    created = time.monotonic() - t0
    group = dist.group.WORLD.transport.group
    t = torch.full((1 << 18,), float(rank + 1))  # 1 MiB: a size where auto uses the large-message choice
    dist.all_reduce(t)
    out = {"created_s": created, "calibration": group.reducer.calibration, "auto_large": group.reducer.auto_large,
           "sum_ok": bool((t == sum(range(1, size + 1))).all())}
    dist.destroy_process_group()
    return out


def async_world(rank: int, size: int, init_method: str) -> dict[str, Any]:
    """The asynchronous bridge (``nccl:2,hccl:2``, fake-backed sim vendors), on one spawned world:

    1. a call returns before its collective can complete: rank 3 joins only after rank 0 said its
       call came back (through the store); with collectives in the caller's thread rank 0 would wait
       in its call for rank 3, which waits for rank 0 -- a timeout instead of a result;
    2. many collectives in flight at once (every algorithm's sizes, a reduce_scatter, a broadcast,
       an all_gather, a barrier), waited for afterwards: the same bits as the same calls one at a
       time on a group with ``bridge_async: false``, and the same bits on every rank; the queue's
       thread ran them (``queue.queued``), the synchronous group has no queue; and the same bits
       again through the bandwidth algorithm pipelined in several segments over gloo, and pipelined
       across collectives (``bridge_pipeline: on``), with the same tensor reduced twice in flight;
       2b. two pipelined all_reduces in their second stage at once (rank 0's first exchange held
       back by its peers until it has handed over the second), and a third on the first's tensor;
    3. an error surfaces typed on ``wait()``: rank 3 leaves a group's all_reduce out; the others'
       ``wait()`` raises VcgaTimeoutError, and the group's next call VcgaCollectiveError; the same
       through the pipeline (3b).
    """
    import time
    from datetime import timedelta

    from vcga.bridge.cost import GROUP_KINDS, AlphaBeta, LinkFigures
    from vcga.config import load_config
    from vcga.errors import VcgaCollectiveError, VcgaTimeoutError
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=size)
    store = dist.distributed_c10d._get_default_store()
    check = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}

    # 1.
    t = torch.full((1024,), float(rank + 1))
    if rank == 3:
        store.wait(["returned"], timedelta(seconds=60))
        w = dist.all_reduce(t, async_op=True)
    else:
        w = dist.all_reduce(t, async_op=True)
        out["completed_at_return"] = w.is_completed()
        if rank == 0:
            store.set("returned", "1")
    w.wait()
    out["first_sum_ok"] = bool((t == 10.0).all())

    # 2.
    sync = dist.new_group(backend="vcga", pg_options=VcgaOptions(config=replace(load_config(), bridge_async=False)))
    # the bandwidth algorithm through gloo, pipelined: figures of a slow link make every message
    # from 512 KiB on go in several segments (k = 2 per vendor group and two groups: one addition
    # per element in each step, so any segmentation gives the same bits)
    piped = dist.new_group(backend="vcga", pg_options=VcgaOptions(
        config=replace(load_config(), bridge_algorithm="bandwidth", bridge_shm=False)))
    slow = LinkFigures(groups=[{k: AlphaBeta(1e-4, 5e8) for k in GROUP_KINDS}] * 2,
                       bridge={"leaders": AlphaBeta(5e-4, 1.25e8), "all_sets": AlphaBeta(5e-4, 6.25e7)},
                       classes={}, exchange="gloo", group_size=2, equal_groups=True,
                       min_segment_bytes=256 << 10, max_segments=16)
    piped.transport.group.reducer.apply_figures(slow)
    out["segments"] = [piped.transport.group.reducer.segment_count(n * 4) for n in (300_000, 1 << 20, 5_000_000)]
    # the same, pipelined across collectives (bridge_pipeline: on -- every set exchanges through
    # gloo here): a bandwidth all_reduce's in-group all-gather and callbacks run on the queue's
    # second thread, over a second native group, while the next one is reduce-scattered
    across = dist.new_group(backend="vcga", pg_options=VcgaOptions(
        config=replace(load_config(), bridge_algorithm="bandwidth", bridge_shm=False, bridge_pipeline="on")))
    across.transport.group.reducer.apply_figures(slow)
    across.transport.group.reducer.fixed_segments = 3  # every all_reduce in 3 segments (padded, uneven) through both stages
    out["pipeline_flags"] = [g.transport.describe()["pipeline"] for g in (dist.group.WORLD, sync, piped, across)]
    digests = {}
    for label, group in (("async", dist.group.WORLD), ("sync", sync), ("pipelined", piped), ("across", across)):
        ts = [inputs(rank, n, torch.float32, salt) for salt, n in enumerate((1000, 70_000, 300_000, 1 << 20, 5_000_000))]
        rs_in, rs_out = inputs(rank, 4 * 50_000, torch.float32, 9), torch.empty(50_000)
        bc, ag_out = inputs(rank, 777, torch.float64, 10), torch.empty(4 * 333, dtype=torch.int64)
        works = [dist.all_reduce(x, group=group, async_op=True) for x in ts]
        # the same tensor again while the first is in flight: pipelined, its reduce-scatter would
        # read what the first has not all-gathered yet (the queue drains first)
        works.append(dist.all_reduce(ts[3], group=group, async_op=True))
        works.append(dist.all_reduce(ts[3][1000:300_000], group=group, async_op=True))  # a view inside it
        works.append(dist.reduce_scatter_single(rs_out, rs_in, group=group, async_op=True))
        works.append(dist.broadcast(bc, src=2, group=group, async_op=True))
        works.append(dist.all_gather_single(ag_out, torch.arange(333) * (rank + 1), group=group, async_op=True))
        works.append(dist.barrier(group=group, async_op=True))
        for x in works:
            x.wait()
        shared, own = hashlib.sha256(), hashlib.sha256()  # the same on every rank / this rank's chunk
        for x in [*ts, bc, ag_out]:
            shared.update(x.contiguous().view(torch.uint8).numpy().tobytes())
        own.update(rs_out.view(torch.uint8).numpy().tobytes())
        digests[label] = (shared.hexdigest(), own.hexdigest())
    out["async_equals_sync"] = digests["async"] == digests["sync"]
    out["pipelined_equals_sync"] = digests["pipelined"] == digests["sync"]
    out["across_equals_sync"] = digests["across"] == digests["sync"]
    aq = across.transport.group.queue
    out["across_continued"] = aq.continued

    # 2b. Two all_reduces in their second stage at once, and one that overlaps the first (it must
    # wait for it): ranks 2 and 3 issue theirs only once rank 0 has handed two over, so rank 0's
    # first exchange cannot end before its second collective is in the second stage too.
    gated = {}
    for label, group in (("sync", sync), ("across", across)):
        xa, xb = inputs(rank, 1 << 20, torch.float32, 20), inputs(rank, 600_000, torch.float32, 21)
        if label == "across" and rank >= 2:
            store.wait(["two handed over"], timedelta(seconds=120))
        ws = [dist.all_reduce(x, group=group, async_op=True) for x in (xa, xb, xa)]
        if label == "across" and rank == 0:
            deadline = time.monotonic() + 120
            while aq.continued < out["across_continued"] + 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            store.set("two handed over", "1")
        for w in ws:
            w.wait()
        gated[label] = hashlib.sha256(xa.numpy().tobytes() + xb.numpy().tobytes()).hexdigest()
    out["gated_equals_sync"] = gated["across"] == gated["sync"]
    out["most_in_stage2"] = aq.most_in_stage2
    out["across_pipelined_all_reduces"] = across.transport.group.pipelined_all_reduces
    every = [None] * size
    dist.all_gather_object(every, digests["async"][0], group=check)
    out["identical_on_every_rank"] = len(set(every)) == 1
    out["queued"] = dist.group.WORLD.transport.group.queue.queued
    out["sync_has_no_queue"] = sync.transport.group.queue is None
    out["counts"] = dict(dist.group.WORLD.transport.group.reducer.counts)

    # 3.
    short = dist.new_group(backend="vcga", timeout=timedelta(seconds=3))
    short2 = dist.new_group(backend="vcga", timeout=timedelta(seconds=3), pg_options=VcgaOptions(  # for 3b
        config=replace(load_config(), bridge_algorithm="bandwidth", bridge_shm=False, bridge_pipeline="on")))
    if rank != 3:
        out["missing_peer"], out["after"] = _without_rank_3(short, 1000, (VcgaTimeoutError,))
    # 3b. The same through the pipeline: rank 3 leaves out a pipelined all_reduce; the others'
    # wait() raises typed (in the first stage or the second), and the group's next call refuses.
    if rank != 3:
        out["piped_missing_peer"], out["piped_after"] = _without_rank_3(
            short2, 100_000, (VcgaTimeoutError, VcgaCollectiveError))
    dist.barrier(group=check)
    dist.destroy_process_group()
    return out


def _without_rank_3(group, numel: int, typed: tuple[type[BaseException], ...]) -> tuple[str, str]:
    """An async all_reduce of ``numel`` elements that rank 3 leaves out, then a small one: what
    the first's wait() raised (the name of a ``typed`` error, else the whole error) and what the
    group's next call raised ("VcgaCollectiveError" when it refuses after the earlier failure)."""
    from vcga.errors import VcgaCollectiveError

    w = dist.all_reduce(torch.ones(numel), group=group, async_op=True)
    try:
        w.wait()
        first = "no error"
    except typed as e:
        first = type(e).__name__
    except Exception as e:  # noqa: BLE001
        first = f"{type(e).__name__}: {e}"
    try:
        dist.all_reduce(torch.ones(10), group=group)
        after = "no error"
    except VcgaCollectiveError as e:
        after = "VcgaCollectiveError" if "earlier collective" in str(e) else str(e)
    return first, after
