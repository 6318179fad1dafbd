"""What each rank of tests/test_observe.py's worlds does: profiled DDP steps, a rank that skips a
collective, ranks that call one differently, a DDP loop whose peer stops dead and an FSDP2 loop
whose peer stays out.

Every case runs on a group of its own (a group a timeout poisoned is not used again); timeouts
are the case's own (3 s), so a case that hangs fails in seconds. Ranks wait for each other through
the store, never by sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

#: what init_process_group must not load (the dump, the analysis, the CLI, the trace linker)
LAZY = ("vcga.pg.frdump", "vcga.pg.frtrace", "vcga.flight_recorder", "vcga.profiling", "vcga.cli.trace",
        "torch.distributed.flight_recorder")
CASE_TIMEOUT = timedelta(seconds=3)
WAIT = timedelta(seconds=120)


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8))


def _profiled_step(ddp: Any, x: Any, path: str, all_threads: bool) -> dict[str, Any]:
    """One DDP step under torch's profiler, exported with vcga.profiling; the spans, steps and
    flow arrows of the trace, and the all_reduce calls the group's flight recorder saw meanwhile."""
    import torch
    from torch._C._profiler import _ExperimentalConfig

    from vcga.pg.recorder import recorders
    from vcga.profiling import export_chrome_trace

    rec = next((r for r in recorders() if r.group_name == "0"), None)  # None: TORCH_FR_BUFFER_SIZE=0
    before = rec.count if rec is not None else 0
    kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)} if all_threads else {}
    with torch.profiler.profile(record_shapes=True, **kw) as prof:
        ddp(x).sum().backward()
    calls = ([c for c in rec.calls()[-(rec.count - before):] if c.op == "all_reduce"]
             if rec is not None and rec.count > before else [])
    export_chrome_trace(prof, path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    keep = [{k: e.get(k) for k in ("ph", "name", "tid", "ts", "dur", "cat", "id", "bp")}
            | {"dims": (e.get("args") or {}).get("Input Dims")}
            for e in events if str(e.get("name", "")).startswith("vcga") or e.get("cat") in ("vcga", "vcga_step")]
    return {"events": keep, "all_reduces": [[list(s) for s, _ in c.inputs] for c in calls]}


def single_world(rank: int, world: int, init: str, outdir: str) -> dict[str, Any]:
    """One vendor (sim-nccl on every rank): the spans of a profiled DDP step."""
    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers the backend

    dist.init_process_group("vcga", init_method=init, rank=rank, world_size=world)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    x = torch.randn(4, 64)
    for _ in range(2):  # DDP rebuilds its buckets after the first step
        ddp(x).sum().backward()
    out = _profiled_step(ddp, x, os.path.join(outdir, f"single{rank}.json"), all_threads=False)
    dist.destroy_process_group()
    out["cpu_s"] = time.process_time()
    return out


def mixed_world(rank: int, world: int, init: str, outdir: str) -> dict[str, Any]:
    """nccl:2,hccl:2 (asynchronous bridge): profiled DDP steps, a skipped all_reduce, a size
    mismatch, DDP with a peer that stops dead, FSDP2 with a peer that stays out."""
    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers the backend

    out: dict[str, Any] = {}
    dist.init_process_group("vcga", init_method=init, rank=rank, world_size=world)
    out["loaded_at_init"] = [m for m in LAZY if m in sys.modules]
    store = dist.distributed_c10d._get_default_store()

    # -- profiled DDP steps: every thread recorded, then torch's default (the caller's thread only)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    x = torch.randn(4, 64)
    for _ in range(2):
        ddp(x).sum().backward()
    out["all_threads"] = _profiled_step(ddp, x, os.path.join(outdir, f"mixed{rank}.json"), all_threads=True)
    out["default"] = _profiled_step(ddp, x, os.path.join(outdir, f"mixed_default{rank}.json"), all_threads=False)

    # -- rank 3 skips the group's second all_reduce
    import vcga.flight_recorder as fr
    from vcga.errors import VcgaError, VcgaMismatchError, VcgaTimeoutError

    os.environ["VCGA_TRACE_DIR"] = os.path.join(outdir, "skip")  # config trace_dir, read as the group is made
    group = dist.new_group(backend="vcga", timeout=CASE_TIMEOUT)
    t = torch.ones(16)
    dist.all_reduce(t, group=group)
    if rank == 3:
        fr.dump()
        out["skip"] = "skipped"
    else:
        try:
            dist.all_reduce(t, group=group)
            out["skip"] = "completed"
        except VcgaTimeoutError as e:
            out["skip"] = type(e).__name__
            out["skip_is_dist_backend_error"] = isinstance(e, dist.DistBackendError)
    _all_arrive(store, "skip_done", rank, world)

    # -- ranks call gather with different sizes (rank 1 twice as many elements)
    os.environ["VCGA_TRACE_DIR"] = os.path.join(outdir, "mismatch")
    group2 = dist.new_group(backend="vcga", timeout=CASE_TIMEOUT)
    dist.all_reduce(t, group=group2)
    mine = torch.ones(8 if rank == 1 else 4)
    try:
        dist.gather(mine, [torch.empty(4) for _ in range(world)] if rank == 0 else None, dst=0, group=group2)
        out["mismatch"] = "completed"
    except VcgaMismatchError as e:
        out["mismatch"] = type(e).__name__
    fr.dump()
    _all_arrive(store, "mismatch_done", rank, world)

    # -- DDP on the asynchronous bridge; rank 3 stops dead (SIGSTOP: no connection closes, as a node
    #    that lost power) before its second backward; the others' training loop catches the timeout
    os.environ["VCGA_TRACE_DIR"] = os.path.join(outdir, "ddp")
    group3 = dist.new_group(backend="vcga", timeout=CASE_TIMEOUT)
    store.set(f"pid{rank}", str(os.getpid()))
    net = torch.nn.parallel.DistributedDataParallel(_model(), process_group=group3, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    caught = None
    for step in range(4):  # DDP rebuilds its buckets in step 1's forward (a broadcast): the stop comes after
        if rank == 3 and step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT once the others caught the error
            break
        opt.zero_grad()
        loss = net(x).sum()
        try:
            loss.backward()
        except VcgaTimeoutError as e:  # no vcga.errors.typed(): the exception is the typed error itself
            caught = {"type": type(e).__name__, "step": step,
                      "dist_backend_error": isinstance(e, dist.DistBackendError),
                      "dist_error": isinstance(e, dist.DistError), "message": str(e).splitlines()[0][:300]}
            break
        opt.step()
    out["ddp"] = caught
    _stopped_peer_resumes(store, "ddp", rank, world)

    # -- FSDP2 (fully_shard over the group's mesh): rank 3 stays out of its second step, waiting
    #    (alive) until the others caught the timeout
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    os.environ["VCGA_TRACE_DIR"] = os.path.join(outdir, "fsdp")
    group4 = dist.new_group(backend="vcga", timeout=CASE_TIMEOUT)
    mesh = DeviceMesh.from_group(group4, "cpu")
    sharded = _model()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    caught = None
    for step in range(3):
        if rank == 3 and step == 1:
            break
        try:
            opt.zero_grad()
            sharded(x).sum().backward()  # FSDP all-gathers parameters, reduce-scatters gradients
            opt.step()
        except VcgaError as e:  # FSDP prefetches: the work it waits on first may be one issued after the
            # one that timed out, which fails as the group's later calls do (VcgaCollectiveError)
            caught = {"type": type(e).__name__, "step": step, "message": str(e).splitlines()[0][:300],
                      "dist_backend_error": isinstance(e, dist.DistBackendError)}
            break
    out["fsdp"] = caught
    _all_arrive(store, "fsdp_done", rank, world)
    out["cpu_s"] = time.process_time()
    return out


def _stopped_peer_resumes(store: Any, case: str, rank: int, world: int) -> None:
    """Once every other rank caught its error, rank 0 resumes rank 3 (stopped with SIGSTOP)."""
    if rank != 3:
        _all_arrive(store, f"{case}_caught", rank, world - 1)
        if rank == 0:
            os.kill(int(store.get("pid3")), signal.SIGCONT)
    _all_arrive(store, f"{case}_done", rank, world)


def _all_arrive(store: Any, key: str, rank: int, world: int) -> None:
    """A barrier through the store (the groups under test may be poisoned by then)."""
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(world)], WAIT)


def killed_ddp_peer(rank: int, port: int, queue: Any, tmp: str) -> None:
    """``nccl:1,hccl:1``, DDP on the asynchronous bridge: rank 1's process is killed (SIGKILL, as
    the kernel's out-of-memory killer does) before its third backward; rank 0 reports what its
    training loop's ``except VcgaTimeoutError`` caught, and how long the backward took. Not a
    :func:`~vcga.testing.run_world` target: a killed rank cannot report."""
    from vcga.testing import WORLD_ENV

    os.environ.update({**WORLD_ENV, "VCGA_SIM_VENDORS": "nccl:1,hccl:1", "VCGA_BRIDGE_FIGURES_CACHE": tmp,
                       "VCGA_TRACE_DIR": tmp})
    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers the backend
    from vcga.errors import VcgaCollectiveError, VcgaTimeoutError

    dist.init_process_group("vcga", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    net = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 64)
    caught = None
    for step in range(4):  # DDP rebuilds its buckets in step 1's forward (a broadcast): the kill comes after
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = net(x).sum()
        t0 = time.monotonic()
        try:
            loss.backward()
        except VcgaTimeoutError as e:  # no vcga.errors.typed(), and a timeout's handler sees a lost peer too
            caught = {"type": type(e).__name__, "step": step, "seconds": time.monotonic() - t0,
                      "collective_error": isinstance(e, VcgaCollectiveError),
                      "dist_backend_error": isinstance(e, dist.DistBackendError),
                      "message": str(e).splitlines()[0][:300]}
            break
        except Exception as e:  # noqa: BLE001 - what the loop's handler would have missed, to the test
            caught = {"type": type(e).__name__, "step": step, "missed": True, "message": str(e).splitlines()[0][:300]}
            break
        opt.step()
    queue.put(caught)
    queue.close()
    queue.join_thread()
    os._exit(0)  # the group is unusable: nothing left to tear down cleanly
