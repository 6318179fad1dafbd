"""One rank of benchmarks/startup.py's torchrun launch: a fresh interpreter, started by torchrun,
that does what a training script does -- ``import torch``, then ``init_process_group`` (``env://``,
torchrun's store) and a first 4 KiB all_reduce -- and reports the wall and CPU seconds of those two
steps to the driver's control store.

With ``STARTUP_RELEASE=own`` each rank calls ``init_process_group`` as soon as its imports are
done, as a script does (``env://``); ``together`` makes every rank wait for the driver's signal
after its imports, so all ranks of a world begin ``init_process_group`` at once (every rank's cost
of the call lands on the CPUs at the same time: the worst case of a node whose ranks start
together). Released together, a rank connects to torchrun's store before the signal -- the client
``env://`` would make (torchrun's agent hosts the server) -- and hands it to ``init_process_group``:
torch's TCPStore client sometimes waits 5 s when dozens connect at the same instant, for every
backend alike, which would drown what the backends differ in.

Environment (set by the driver): ``STARTUP_CTL`` (host:port of the control store), ``STARTUP_IT``
(the start's number), ``STARTUP_BACKEND`` ("gloo" or "vcga"), ``STARTUP_TIMEOUT`` (seconds),
``STARTUP_IMPORT_FIRST`` ("vcga" or "mixed": import the modules that variant's start imports before
the start, as ``import torch`` loads gloo's code before gloo's; the equal-work figure),
``STARTUP_RELEASE`` ("own" or "together"), ``STARTUP_PROFILE`` (a folder: rank 0 writes a CPU
profile of its start there).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

ELEMS = 1024  # 4 KiB of fp32

#: The modules ``init_process_group("vcga")`` and the first all_reduce import, per variant (the
#: ``vcga_facts`` of a start list them; ``in_start`` says which a start still imported itself). Under
#: STARTUP_IMPORT_FIRST a rank imports them before the start: gloo's code comes with ``import torch``,
#: so this is the start with the same code loading left out of both.
START_MODULES = {
    "vcga": ("vcga.process_group", "vcga.pg.discovery", "vcga.plugin_manager.entrypoints", "vcga._usercache",
             "vcga.plugins.gloo"),
    "mixed": ("vcga.process_group", "vcga.pg.discovery", "vcga.plugin_manager.entrypoints", "vcga._usercache",
              "vcga.bridge.create", "vcga.bridge.verify", "vcga.bridge.figcache", "vcga.pg.workqueue",
              "vcga.pg.recipes", "vcga.plugins.sim.group", "vcga.plugins.sim.libraries"),
}


def vcga_modules() -> set[str]:
    return {m for m in sys.modules if m == "vcga" or m.startswith("vcga.")}


def vcga_facts(before: set[str]) -> dict[str, Any]:
    """How this process got vcga: from a wheel or an editable checkout, with or without bytecode
    caches, which of its modules the process had at the end and which the start itself imported."""
    now = vcga_modules()
    facts: dict[str, Any] = {"modules": sorted(now), "in_start": sorted(now - before)}
    pg = sys.modules.get("vcga.process_group")
    if pg is not None and getattr(pg, "__file__", None):
        facts["file"] = pg.__file__
        facts["installed"] = "site-packages" in pg.__file__
        facts["bytecode"] = os.path.exists(importlib.util.cache_from_source(pg.__file__))
    return facts


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["STARTUP_CTL"].rsplit(":", 1)
    it, backend = os.environ["STARTUP_IT"], os.environ["STARTUP_BACKEND"]
    timeout = timedelta(seconds=float(os.environ["STARTUP_TIMEOUT"]))
    torch.set_num_threads(1)
    first = os.environ.get("STARTUP_IMPORT_FIRST")
    if first:
        import importlib

        for name in START_MODULES[first]:
            importlib.import_module(name)
    ctl = dist.TCPStore(host, int(port), None, False, timeout=timeout)
    gc_s: list[float] = []
    gc_t0: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:  # Python's collector, timed (it may run inside the start)
        if phase == "start":
            gc_t0.append(time.perf_counter())
        elif gc_t0:
            gc_s.append(time.perf_counter() - gc_t0.pop())

    together = os.environ.get("STARTUP_RELEASE", "together") == "together"
    job_store = None
    if together and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # what env:// creates when torchrun's agent hosts the store
        job_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                                  timeout=timeout)
    ctl.add(f"ready/{it}", 1)
    if together:
        ctl.wait([f"go/{it}"])
    gc.callbacks.append(on_gc)
    prof = None
    if os.environ.get("STARTUP_PROFILE") and rank == 0:
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU: the ranks share the cores
        prof.enable()
    before = vcga_modules()
    t1, c1 = time.time(), time.process_time()
    if job_store is not None:
        dist.init_process_group(backend, store=job_store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    t2, c2 = time.time(), time.process_time()
    x = torch.ones(ELEMS)
    dist.all_reduce(x)
    t3, c3 = time.time(), time.process_time()
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(os.environ["STARTUP_PROFILE"], f"{backend}-{world}-{it}.prof"))
    gc.callbacks.remove(on_gc)
    if x[0].item() != world:
        raise SystemExit(f"rank {rank}: all_reduce gave {x[0].item()}, not {world}")
    startup: dict[str, Any] = {}
    if backend == "vcga":
        clock = dist.group.WORLD.transport.startup
        startup = clock.to_json() if clock is not None else {}
    res = {"t0": t1, "t_end": t3, "init": [t2 - t1, c2 - c1], "first": [t3 - t2, c3 - c2], "startup": startup,
           "gc_s": sum(gc_s), "gc_n": len(gc_s)}
    if rank == 0:
        res["vcga"] = vcga_facts(before)
    ctl.set(f"res/{it}/{rank}", json.dumps(res))
    ctl.wait([f"done/{it}"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
