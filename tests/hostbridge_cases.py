"""What each rank checks of :class:`vcga.bridge.host.SharedMemoryBridge` (run by tests/test_hostbridge.py
on spawned worlds over plain gloo; no vendor, real shared memory and real pipes)."""

from __future__ import annotations

import os
import select
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from vcga.contract import ReduceOp


def _input(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * salt + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(n, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)
    lo = 0 if dtype == torch.uint8 else -1000
    return torch.randint(lo, 256 if dtype == torch.uint8 else 1000, (n,), generator=g, dtype=dtype)


#: (dtype, op, element count): pieces of one slot, several slots (pieces alternate between the two
#: slot sets), odd counts, one element, none
CASES = [(torch.float32, ReduceOp.SUM, 1), (torch.float32, ReduceOp.SUM, 70_001),
         (torch.float32, ReduceOp.SUM, (10 << 20) // 4 + 3), (torch.float64, ReduceOp.SUM, (5 << 20) // 8 + 1),
         (torch.bfloat16, ReduceOp.SUM, 3_000_001), (torch.float16, ReduceOp.MAX, 1001),
         (torch.int64, ReduceOp.PRODUCT, 999), (torch.int32, ReduceOp.BXOR, (6 << 20) // 4),
         (torch.bool, ReduceOp.SUM, 12_345), (torch.uint8, ReduceOp.MIN, 5), (torch.float32, ReduceOp.SUM, 0)]


def exact_world(rank: int, size: int, init_method: str) -> dict[str, Any]:
    """Every case bitwise equal to combine_rows over all ranks' inputs in rank order, on every rank;
    nothing left in /dev/shm once the segment is open."""
    from vcga.bridge.host import SharedMemoryBridge, combine_rows

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    pg = dist.group.WORLD
    b = SharedMemoryBridge.open(pg, True, 30.0)
    assert b is not None
    dist.barrier()
    left = [p for p in [b.path, *(f"{b.path}.{q}" for q in range(size))] if os.path.exists(p)]
    failures = []
    for salt, (dtype, op, n) in enumerate(CASES * 2):  # twice: the second round starts in the other slot set
        xs = [_input(r, n, dtype, salt) for r in range(size)]
        want = torch.empty(n, dtype=dtype)
        combine_rows(torch.stack(xs) if n else torch.empty(size, 0, dtype=dtype), op, want)
        got = xs[rank].clone()
        b.all_reduce(got, op)
        if not torch.equal(got.view(torch.uint8) if n else got, want.view(torch.uint8) if n else want):
            failures.append(f"{dtype} {op.value} n={n}: differs from the in-order reference")
    # reduce_scatter: each peer gets its own row of everyone's rows, combined in peer order
    from vcga.bridge.host import SLOT_BYTES

    for salt, (dtype, op, c) in enumerate([(torch.float32, ReduceOp.SUM, 1), (torch.int64, ReduceOp.SUM, 1001),
                                           (torch.float32, ReduceOp.SUM, SLOT_BYTES // (size * 4) * 2 + 5),
                                           (torch.bool, ReduceOp.MAX, 777)]):
        xs = [_input(r, size * c, dtype, 100 + salt).view(size, c) for r in range(size)]
        want = torch.empty(c, dtype=dtype)
        combine_rows(torch.stack([x[rank] for x in xs]), op, want)
        got = torch.empty(c, dtype=dtype)
        b.reduce_scatter(xs[rank], op, got)
        if not torch.equal(got, want):
            failures.append(f"reduce_scatter {dtype} {op.value} c={c}: differs from the in-order reference")
    b.close()
    from vcga.bridge import host as hostbridge

    if b._in or b._out or b in hostbridge._OPEN:  # a closed bridge keeps no descriptor numbers (reused
        failures.append("a closed bridge still holds its pipes' descriptor numbers")  # by later files)
    dist.destroy_process_group()
    return {"left": left, "failures": failures, "path": b.path}


def _attempt(b: Any, expected: type[BaseException]) -> tuple[str | None, float]:
    """One small reduction through ``b``: (the ``expected`` error's message or None, seconds taken)."""
    t0 = time.monotonic()
    try:
        b.all_reduce(torch.ones(10), ReduceOp.SUM)
        return None, time.monotonic() - t0
    except expected as e:
        return str(e), time.monotonic() - t0


def misuse_world(rank: int, size: int, init_method: str) -> dict[str, Any]:
    """Peers that reduce different sizes fail on every rank with a typed error; a peer that never
    comes makes the others fail after the timeout (not hang)."""
    from vcga.bridge.host import SharedMemoryBridge
    from vcga.errors import VcgaCollectiveError

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    pg = dist.group.WORLD
    out: dict[str, Any] = {}
    b = SharedMemoryBridge.open(pg, True, 30.0)
    try:
        b.all_reduce(torch.ones(100 * (rank + 1)), ReduceOp.SUM)
        out["mismatch"] = None
    except VcgaCollectiveError as e:
        out["mismatch"] = str(e)
    b.close()
    b = SharedMemoryBridge.open(pg, True, 1.5)
    if rank != size - 1:  # the last rank stays away
        out["timeout"], out["waited_s"] = _attempt(b, TimeoutError)
    dist.barrier()
    b.close()
    dist.destroy_process_group()
    return out


#: the ways one peer cannot take part (fallback_world)
FALLBACKS = ("no-dir", "no-space", "attach", "unwanted")


def fallback_world(rank: int, size: int, init_method: str) -> dict[str, Any]:
    """One round per way one peer cannot take part: every rank gets None (and then reduces through
    gloo), nothing is left behind; then a round where all can, to show the patches are undone.
    "no-dir": peer 0 cannot make the segment; "no-space": peer 0 cannot reserve its pages (a full
    /dev/shm, ENOSPC); "attach": the last peer maps something else (another /dev/shm);
    "unwanted": the last peer's config says no."""
    import vcga.bridge.host as hb

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    last = rank == size - 1
    # A directory of this world's own on the same tmpfs: what is left in it is this world's, even
    # while other worlds (another test worker, another suite) make and remove their segments.
    shm_dir = os.path.join(hb.SHM_DIR, f"vcga-test-fallback-{init_method.rsplit(':', 1)[1]}")
    if rank == 0:
        os.mkdir(shm_dir)
    dist.barrier()
    hb.SHM_DIR = shm_dir
    attach, fallocate = hb._attach, hb.os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    out: dict[str, Any] = {}
    try:
        for how in (*FALLBACKS, "none"):
            before = set(os.listdir(shm_dir))
            if how == "no-dir" and rank == 0:
                hb.SHM_DIR = "/nonexistent-vcga-test-dir"
            if how == "attach" and last:
                hb._attach = lambda path, size, token: None
            if how == "no-space" and rank == 0:
                hb.os.posix_fallocate = full
            b = hb.SharedMemoryBridge.open(dist.group.WORLD, not (how == "unwanted" and last), 30.0)
            hb.SHM_DIR, hb._attach, hb.os.posix_fallocate = shm_dir, attach, fallocate
            dist.barrier()
            made = sorted(n for n in set(os.listdir(shm_dir)) - before if n.startswith("vcga-bridge-"))
            out[how] = {"bridge": b is not None, "left": made}
            if b is not None:
                b.close()
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(shm_dir, ignore_errors=True)
    dist.destroy_process_group()
    return out


def gone_world(rank: int, size: int, init_method: str, how: str) -> dict[str, Any]:
    """The last peer lets go of its pipes as its process's death would: ``how`` "all" (every end:
    the others' writes fail) or "writes" (its write ends only: the others read end-of-file). The
    others fail at once with a typed error naming it, not after the (60 s) timeout."""
    from vcga.bridge.host import SharedMemoryBridge
    from vcga.errors import VcgaCollectiveError

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    b = SharedMemoryBridge.open(dist.group.WORLD, True, 60.0, names=[f"rank {r}" for r in range(size)])
    b.all_reduce(torch.ones(10), ReduceOp.SUM)  # works while everyone is there
    out: dict[str, Any] = {}
    if rank == size - 1:
        for fd in b._out if how == "writes" else [*b._out, *b._in.values()]:
            os.close(fd)
        b._out, b._in = [], {}
    dist.barrier()
    if rank != size - 1:
        out["error"], out["seconds"] = _attempt(b, VcgaCollectiveError)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _say(queue: Any, *message: Any) -> None:
    """Put on the queue and flush it: the callers leave with os._exit, which would drop it."""
    queue.put(message)
    queue.close()
    queue.join_thread()


def killed_peer(rank: int, port: int, queue: Any, with_child: bool = False) -> None:
    """Rank 1 dies (os._exit) right after the segment is open; rank 0 reports ("rank 0", what its
    next reduction raised, how long it took) -- not a run_world target: a dying rank cannot report.

    ``with_child``: rank 1 first forks a child that outlives it by 45 s, as a DataLoader worker
    would; rank 1 reports ("child", its pid) for the test to kill it. The child must not hold
    rank 1's pipes open, and reports ("child refused", whether the bridge refused to reduce there)."""
    from vcga.bridge.host import SharedMemoryBridge
    from vcga.errors import VcgaCollectiveError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    b = SharedMemoryBridge.open(dist.group.WORLD, True, 60.0, names=["rank 0", "rank 1"])
    b.all_reduce(torch.ones(10), ReduceOp.SUM)
    if rank == 1:
        if with_child:
            pid = os.fork()
            if pid == 0:
                try:
                    b.all_reduce(torch.ones(10), ReduceOp.SUM)
                    refused = False
                except VcgaCollectiveError:
                    refused = True
                _say(queue, "child refused", refused)
                select.select([], [], [], 45.0)  # a worker that lives on (not a synchronisation)
                os._exit(0)
            _say(queue, "child", pid)
        os._exit(3)
    t0 = time.monotonic()
    try:
        b.all_reduce(torch.ones(10), ReduceOp.SUM)
        queue.put(("rank 0", None, time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put(("rank 0", f"{type(e).__name__}: {e}", time.monotonic() - t0))
