"""What starting a job's group costs: torch's gloo against ``vcga`` and mixed-vendor ``vcga``.

Each start is a world of fresh processes that creates its group -- ``init_process_group`` and the
first 4 KiB fp32 all_reduce -- for one variant:

- ``gloo``: ``init_process_group("gloo")``, the anchor;
- ``vcga``: ``init_process_group("vcga")`` as a user on this machine gets it (auto: gloo underneath);
- ``mixed``: ``vcga`` with two simulated vendors, ``VCGA_SIM_VENDORS=nccl:n/2,hccl:n/2`` (the
  bridge: discovery, vendor groups, bridge sub-groups, link figures), its figures in the cache
  (an untimed start before the timed ones measured and stored them, as a job's first start does);
- ``mixed-measure``: the same with ``bridge_calibration: measure``: every start measures its
  links (what a first start on a new topology pays);
- ``vcga-imported``, ``mixed-imported`` (torchrun only): ``vcga`` and ``mixed`` with the modules
  their start imports imported by each rank before the start. gloo's code is loaded by ``import
  torch``, before gloo's start; vcga's own, at the start. These variants leave code loading out of
  both, the equal-work figure beside the figure of record (which counts vcga's imports).

The variants rotate, each world size's starts back to back. Two launchers:

- ``--launch torchrun`` (default): every start is ``python -m torch.distributed.run --standalone
  --nproc-per-node n benchmarks/_startup_rank.py``, each rank a fresh interpreter that imports torch
  and calls ``init_process_group`` through torchrun's store (``env://``), as a training script does:
  it pays for importing whatever vcga imports at that call. ``--python`` names the interpreter of the
  ranks (and of torchrun): the figure of record uses a user's install, ``make wheel-venv``
  (``.venv-wheel``: a built wheel, bytecode caches written as pip writes them); the editable checkout
  with ``PYTHONDONTWRITEBYTECODE=1`` is the case without caches (every module compiled at import).
  A start's figure is the largest, over its ranks, of the time from that rank's
  ``init_process_group`` call to the end of its first all_reduce. ``--release together`` (default):
  the ranks wait for one signal after their imports and all call it at once -- every rank's cost of
  the call on the CPUs at the same time, the case of a node whose ranks start together, and the
  reproducible one; ``--release own``: each rank calls it when its own imports are done, as a plain
  script does, and the figure then also holds how far apart the ranks finished importing torch
  (seconds on a loaded machine).
- ``--launch forkserver``: the ranks are forked from a server that imported torch and vcga (and
  its plugins: ``-fresh`` variants skip that), the store's server in this process; a start is timed
  from the moment every rank is released to the end of the slowest rank's first all_reduce. It
  leaves the imports out, and counts the store's load on the wire (below).

Per rank, the CPU seconds of ``init_process_group`` and the first all_reduce (all the process's
threads); per phase, each rank's own clock: for vcga the phases the group records itself
(``describe()["startup"]``: backend selection, discovery, native groups, bridge sub-groups,
whole-group gloo, calibration, with what the first collective creates lazily counted in its
phase), the rest of ``init_process_group`` ("torch") and the first collective.

Store load (forkserver only) is counted, in extra starts after the timed ones, through
:mod:`_store_proxy` (a relay per rank in front of the store's server, parsing every request on the
wire): requests and bytes per rank and in total, split by which part of creation named the key.
The relay slows every request, so counted starts are never timed.

Ranks are oversubscribed on this machine's cores: only ratios between variants of the same run
mean anything.

Usage::

    make wheel-venv
    python benchmarks/startup.py --python .venv-wheel/bin/python --ranks 16 32 --reps 3 --markdown
    python benchmarks/startup.py --python .venv-wheel/bin/python --ranks 16 32 --reps 3 --markdown \
        --variants gloo,vcga,mixed,vcga-imported,mixed-imported
    PYTHONDONTWRITEBYTECODE=1 python benchmarks/startup.py --ranks 16 32 --reps 3 --markdown
    python benchmarks/startup.py --launch forkserver --ranks 4 8 16 32 64 --reps 5 --json startup.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _ranks import table
from _store_proxy import StoreProxy

VARIANTS = ("gloo", "vcga", "mixed", "mixed-measure", "vcga-fresh", "mixed-fresh")
#: Under torchrun every rank is a fresh process: the ``-fresh`` variants are what every variant is.
#: ``-imported``: each rank imports the modules its start would before the start (as ``import torch``
#: loads gloo's): the equal-work figure beside the figure of record.
TORCHRUN_VARIANTS = ("gloo", "vcga", "mixed", "mixed-measure", "vcga-imported", "mixed-imported")
#: The rank program of the torchrun launch.
RANK_SCRIPT = Path(__file__).resolve().with_name("_startup_rank.py")
#: The phases a start is split into, in the order of the tables.
PHASES = ("backend selection", "discovery", "native groups", "bridge sub-groups", "whole-group gloo",
          "calibration", "rest of init", "first collective")
#: Store-load categories, by the key a request names (the first, for requests naming several).
CATEGORIES = ("connect", "discovery", "native groups", "bridge sub-groups", "whole-group gloo", "calibration",
              "gloo group", "other")
ELEMS = 1024  # 4 KiB of fp32


def classify(key: str) -> str:
    """Which part of group creation a store key belongs to (keys carry the prefixes vcga gives them)."""
    for needle, cat in (("vcga/discovery", "discovery"), ("vcga/layout", "discovery"), ("vcga/bridge/table", "discovery"),
                        ("vcga/bridge/figures", "calibration"),
                        ("vcga/bridge/shard", "bridge sub-groups"), ("vcga/bridge/world", "whole-group gloo"),
                        ("vcga/native", "native groups"), ("vcga/bridge/native", "native groups"),
                        ("vcga/bridge/status", "native groups"), ("vcga/bridge/failed", "native groups")):
        if needle in key:
            return cat
    if "vcga/" in key:
        return "other"
    return "gloo group"


def variant_env(variant: str, world: int, cache: str) -> dict[str, str | None]:
    """The environment of a variant's ranks (``cache``: the run's own link-figure cache)."""
    if base(variant) == "mixed":
        half = world // 2
        return {"VCGA_SIM_VENDORS": f"nccl:{world - half},hccl:{half}", "VCGA_BRIDGE_FIGURES_CACHE": cache,
                "VCGA_BRIDGE_CALIBRATION": "measure" if variant == "mixed-measure" else "cached"}
    return {"VCGA_SIM_VENDORS": None}


def schedule(reps: int, variants: tuple[str, ...], count: bool) -> list[tuple[str, str]]:
    """(kind, variant) per start: one untimed mixed start that fills the link-figure cache (as the
    job's first start, or ``vcga info --plan --calibrate``, would), the timed starts rotating, then
    one counted start each."""
    out: list[tuple[str, str]] = [("warm", "mixed")] if any(base(v) == "mixed" and v != "mixed-measure" for v in variants) else []
    for i in range(reps):
        k = i % len(variants)
        out += [("timed", v) for v in variants[k:] + variants[:k]]
    if count:
        out += [("counted", v) for v in variants if not v.endswith("-fresh")]  # the same requests
    return out


# ===================================================================================================
# A rank
# ===================================================================================================


def base(variant: str) -> str:
    """``vcga-fresh`` -> ``vcga``, ``mixed-measure`` -> ``mixed``: the group a variant creates."""
    return variant.split("-")[0]


def preload(rank: int, world: int) -> None:
    """What a process pays once, whatever groups it creates: vcga's modules, its plugins, this
    rank's backend and that backend's capability table (a process that created one group has
    paid it; the ``-fresh`` variants pay it inside the timed start)."""
    import vcga.bridge.create  # what a mixed group needs (the bridge, its cost model, its queue)
    import vcga.pg.discovery
    import vcga.process_group  # noqa: F401
    from vcga.config import load_config
    from vcga.plugin_manager import get_plugin_manager

    get_plugin_manager().select_backend(load_config(), rank=rank, world_size=world).capabilities()


def one_start(rank: int, world: int, store: Any, variant: str, timeout: float) -> dict[str, Any]:
    """Create the variant's group over ``store`` (connected before the start), run the first
    all_reduce: timings (the caller exits after)."""
    import torch
    import torch.distributed as dist

    gc_s: list[float] = []
    gc_t0: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:  # Python's collector, timed (it runs inside a start)
        if phase == "start":
            gc_t0.append(time.perf_counter())
        elif gc_t0:
            gc_s.append(time.perf_counter() - gc_t0.pop())

    gc.callbacks.append(on_gc)
    prof = None
    if os.environ.get("STARTUP_PROFILE") and rank == 0:  # --profile: where rank 0's start spends its CPU
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU: the ranks share the cores
        prof.enable()
    t1, c1 = time.time(), time.process_time()
    dist.init_process_group("gloo" if variant == "gloo" else "vcga", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    t2, c2 = time.time(), time.process_time()
    x = torch.ones(ELEMS)
    dist.all_reduce(x)
    t3, c3 = time.time(), time.process_time()
    if x[0].item() != world:
        raise SystemExit(f"rank {rank}: all_reduce gave {x[0].item()}, not {world}")
    startup: dict[str, Any] = {}
    if variant != "gloo":
        clock = dist.group.WORLD.transport.startup  # not describe(): it reads the node names from the store
        startup = clock.to_json() if clock is not None else {}
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(os.environ["STARTUP_PROFILE"], f"{variant}-{os.getpid()}.prof"))
    gc.callbacks.remove(on_gc)
    return {"t0": t1, "t_end": t3, "init": [t2 - t1, c2 - c1], "first": [t3 - t2, c3 - c2], "startup": startup,
            "gc_s": sum(gc_s), "gc_n": len(gc_s)}


def memory() -> dict[str, int]:
    """This process's memory in KiB (Linux ``smaps_rollup``): resident, proportional (shared pages
    divided among the processes that share them) and private (its own: what another rank adds)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                    out[k] = int(v.split()[0])
    except OSError:  # not Linux: not reported
        return {}
    return {"rss": out.get("Rss", 0), "pss": out.get("Pss", 0),
            "private": out.get("Private_Clean", 0) + out.get("Private_Dirty", 0)}


def rank_main(rank: int, world: int, ctl_port: int, spec: dict[str, Any]) -> None:
    """One rank of one start: a fresh process (forked from a server that imported torch and vcga,
    as a training script has by the time it calls init_process_group)."""
    os.environ.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    variant = spec["variant"]
    for k, v in variant_env(variant, world, spec["cache"]).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = spec["timeout"]
    ctl = dist.TCPStore("127.0.0.1", ctl_port, None, False, timeout=timedelta(seconds=timeout))
    it = spec["it"]
    if base(variant) != "gloo" and not variant.endswith("-fresh"):
        preload(rank, world)
    # The store connection is made before the start: torch's TCPStore client sometimes waits 5 s
    # when dozens connect at once (seen with both server backends), the same for every variant;
    # inside the timed start it would drown what the variants differ in.
    t0 = time.time()
    client = dist.TCPStore("127.0.0.1", spec["port"] if spec["port"] else spec["ports"][rank], world, False,
                           timeout=timedelta(seconds=timeout))
    store = dist.PrefixStore(f"start{it}", client)
    connect = time.time() - t0
    # Python's collector as in a process that has been running a while (a training script that
    # imported torch and built its model): nothing pending. Freshly forked from the preloaded server,
    # the first few thousand allocations of any start -- vcga's more than gloo's -- would trigger a
    # full collection of every object torch's import made (0.1-0.2 s of CPU): a cost of the fork,
    # not of the group (gc_s in the JSON: what collections ran inside the start).
    gc.collect()
    ctl.add(f"ready/{it}", 1)
    ctl.wait([f"go/{it}"])
    res = one_start(rank, world, store, base(variant), timeout)
    res["connect"] = connect
    res["mem"] = memory()
    ctl.set(f"res/{it}/{rank}", json.dumps(res))
    # Exit without tearing the group down: the next start is a new world of new processes, and a
    # torn-down group would only add its teardown to the store counts.
    ctl.wait([f"done/{it}"])
    os._exit(0)


# ===================================================================================================
# The driver
# ===================================================================================================


#: What a training script has imported by the time it calls init_process_group; the rank
#: processes are forked from a server that imported these (a fresh interpreter per rank would
#: spend seconds of CPU in `import torch` before every start, and hold a copy of torch's pages of
#: its own: 64 ranks x ~300 MB). Forked, a rank shares the server's pages until it writes them; the
#: JSON's ``mem`` says what each rank held at the end of its start (rss, pss, private KiB). vcga's
#: own modules are here too: importing them is what a process pays once, never part of a start.
PRELOAD = ["torch", "torch.distributed", "vcga", "vcga.process_group", "vcga.pg.discovery", "vcga.bridge.create",
           "vcga.plugin_manager"]


class Driver:
    """What both launchers share: the schedule of starts, run in order."""

    schedule: list[tuple[str, str]]
    world: int
    args: argparse.Namespace
    mem_available: float

    def one(self, kind: str, variant: str) -> dict[str, Any]:
        raise NotImplementedError

    def run(self) -> dict[str, Any]:
        starts = []
        for kind, variant in self.schedule:
            entry = self.one(kind, variant)
            starts.append(entry)
            if self.args.progress:
                print(f"  {self.world} ranks {kind} {variant}: {entry['total']:.3f} s", file=sys.stderr, flush=True)
        return {"world": self.world, "starts": starts, "mem_available_gib": self.mem_available}


class ForkDriver(Driver):
    """Runs the schedule of one world size: per start, a world of rank processes forked from a
    server that imported torch and vcga."""

    def __init__(self, world: int, args: argparse.Namespace) -> None:
        import multiprocessing as mp

        import torch.distributed as dist

        self.world, self.args = world, args
        self.timeout = args.timeout
        self.ctl = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=self.timeout),
                                 wait_for_workers=False)
        self.server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=self.timeout),
                                    wait_for_workers=False)
        self.proxy = StoreProxy(world, classify) if args.count else None
        # the link-figure cache of this world size's starts (filled by the "warm" start, removed at close)
        self.cache = tempfile.TemporaryDirectory(prefix="vcga-startup-figures-")
        self.schedule = schedule(args.reps, tuple(args.variants), args.count)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.procs: list[Any] = []
        self.it = 0
        #: the machine's MemAvailable (GiB), lowest seen with a world's ranks up (before each start)
        self.mem_available = float("inf")

    def _alive(self) -> None:
        failed = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
        if failed:
            raise SystemExit(f"ranks {failed} failed (see their tracebacks above)")

    def _wait_keys(self, keys: list[str]) -> list[bytes]:
        deadline = time.monotonic() + self.timeout
        while not self.ctl.check(keys):  # polled: a wait that times out logs a warning each time
            self._alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"no answer from the ranks within {self.timeout:g} s")
            time.sleep(0.01)
        return self.ctl.multi_get(keys)

    def one(self, kind: str, variant: str) -> dict[str, Any]:
        it = self.it = self.it + 1
        counted = kind == "counted"
        spec = {"it": it, "variant": variant, "timeout": self.timeout, "cache": self.cache.name,
                "port": None if counted else self.server.port,
                "ports": [self.proxy.port(r) for r in range(self.world)] if counted and self.proxy else []}
        self.procs = [self.ctx.Process(target=rank_main, args=(r, self.world, self.ctl.port, spec))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()
        try:
            deadline = time.monotonic() + self.timeout
            while self.ctl.add(f"ready/{it}", 0) < self.world:
                self._alive()
                if time.monotonic() > deadline:
                    raise SystemExit("ranks never got ready")
                time.sleep(0.005)
            time.sleep(0.2)  # let the forked processes settle: only the start itself is measured
            self.mem_available = min(self.mem_available, mem_available_gib())
            if self.proxy is not None:
                self.proxy.reset()
            t_go = time.time()
            self.ctl.set(f"go/{it}", "1")
            ranks = [json.loads(v) for v in self._wait_keys([f"res/{it}/{r}" for r in range(self.world)])]
            self.mem_available = min(self.mem_available, mem_available_gib())  # every rank still up, after its start
            entry = {"kind": kind, "variant": variant, "t_go": t_go, "ranks": ranks,
                     "total": max(r["t_end"] for r in ranks) - t_go}
            if counted and self.proxy is not None:
                time.sleep(0.2)  # let the relay pass the last replies
                counts = self.proxy.reset()
                entry["store"] = {f"{r}|{c}": v for (r, c), v in counts.cells.items()}
                entry["store_types"] = dict(counts.types)
                entry["store_errors"] = list(self.proxy.errors)
            self.ctl.set(f"done/{it}", "1")
            for p in self.procs:
                p.join(timeout=60)
            self._alive()
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        return entry

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.cache.cleanup()


class TorchrunDriver(Driver):
    """Runs the schedule of one world size: per start, ``torchrun --standalone`` with a world of
    fresh interpreters (:mod:`_startup_rank`), released together after their imports through a
    control store in this process."""

    def __init__(self, world: int, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.world, self.args = world, args
        self.timeout = args.timeout
        self.ctl = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=self.timeout),
                                 wait_for_workers=False)
        self.cache = tempfile.TemporaryDirectory(prefix="vcga-startup-figures-")
        self.logs = tempfile.TemporaryDirectory(prefix="vcga-startup-logs-")
        self.schedule = schedule(args.reps, tuple(args.variants), False)
        self.it = 0
        self.mem_available = float("inf")

    def one(self, kind: str, variant: str) -> dict[str, Any]:
        it = self.it = self.it + 1
        env = dict(os.environ)
        for k, v in variant_env(variant, self.world, self.cache.name).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env.update({"STARTUP_CTL": f"127.0.0.1:{self.ctl.port}", "STARTUP_IT": str(it),
                    "STARTUP_BACKEND": "gloo" if variant == "gloo" else "vcga", "STARTUP_TIMEOUT": str(self.timeout),
                    "STARTUP_RELEASE": self.args.release,
                    "STARTUP_IMPORT_FIRST": base(variant) if variant.endswith("-imported") else "",
                    "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        if self.args.profile:
            env["STARTUP_PROFILE"] = os.path.abspath(self.args.profile)
        log_path = os.path.join(self.logs.name, f"{it}.log")
        # --log-dir: torchrun's own folder for the start, in ours (removed at the end), not a
        # torchelastic_* folder it would leave in the temporary directory for every start
        cmd = [self.args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.world),
               "--log-dir", os.path.join(self.logs.name, f"{it}-torchrun"), str(RANK_SCRIPT)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + self.timeout
            while self.ctl.add(f"ready/{it}", 0) < self.world:
                self._alive(proc, log_path)
                if time.monotonic() > deadline:
                    raise SystemExit(f"the ranks never got ready within {self.timeout:g} s")
                time.sleep(0.01)
            t_go = time.time()
            if self.args.release == "together":
                time.sleep(0.2)  # let the last rank reach its wait: only the start itself is measured
                self.mem_available = min(self.mem_available, mem_available_gib())
                t_go = time.time()
                self.ctl.set(f"go/{it}", "1")
            keys = [f"res/{it}/{r}" for r in range(self.world)]
            while not self.ctl.check(keys):
                self._alive(proc, log_path)
                if time.monotonic() > deadline + self.timeout:
                    raise SystemExit(f"no answer from the ranks within {self.timeout:g} s")
                time.sleep(0.01)
            ranks = [json.loads(v) for v in self.ctl.multi_get(keys)]
            self.ctl.set(f"done/{it}", "1")
            rc = proc.wait(timeout=self.timeout)
            if rc != 0:
                raise SystemExit(f"torchrun exited with {rc}:\n{tail(log_path)}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return {"kind": kind, "variant": variant, "t_go": t_go, "ranks": ranks,
                "total": max(r["t_end"] - r["t0"] for r in ranks)}

    @staticmethod
    def _alive(proc: subprocess.Popen[bytes], log_path: str) -> None:
        if proc.poll() is not None:
            raise SystemExit(f"torchrun ended early with {proc.returncode}:\n{tail(log_path)}")

    def close(self) -> None:
        self.cache.cleanup()
        self.logs.cleanup()


def tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def phases_of(rank: dict[str, Any], which: int) -> dict[str, float]:
    """One rank's seconds per phase (PHASES) of one start; ``which`` 0: wall, 1: CPU."""
    key = "s" if which == 0 else "cpu_s"
    out = dict.fromkeys(PHASES, 0.0)
    inside = lazy = 0.0
    for name, v in rank["startup"].items():
        out[name] = out.get(name, 0.0) + v[key]
        if v.get("lazy"):
            lazy += v[key]
        else:
            inside += v[key]
    out["rest of init"] = max(0.0, rank["init"][which] - inside)
    out["first collective"] = max(0.0, rank["first"][which] - lazy)
    return out


def summarize(result: dict[str, Any], variants: tuple[str, ...]) -> dict[str, Any]:
    """Per variant: median total, median ratio to gloo (start by start), mean phase seconds, store load."""
    world = result["world"]
    timed = [s for s in result["starts"] if s["kind"] == "timed"]
    out: dict[str, Any] = {"world": world, "variants": {}, "mem_available_gib": result.get("mem_available_gib", 0.0)}
    by_v = {v: [s for s in timed if s["variant"] == v] for v in variants}
    for v in variants:
        starts = by_v[v]
        row: dict[str, Any] = {"total_s": statistics.median(s["total"] for s in starts), "n": len(starts),
                               "totals": [s["total"] for s in starts]}
        if "gloo" in by_v and v != "gloo":
            ratios = [a["total"] / b["total"] for a, b in zip(starts, by_v["gloo"], strict=False)]
            row["ratio"] = statistics.median(ratios)
            row["ratio_range"] = (min(ratios), max(ratios))
        for which, name in ((0, "phases_s"), (1, "phases_cpu_s")):
            phases = dict.fromkeys(PHASES, 0.0)
            for s in starts:
                for rk in s["ranks"]:
                    for ph, sec in phases_of(rk, which).items():
                        phases[ph] = phases.get(ph, 0.0) + sec / (len(starts) * world)
            row[name] = phases
        row["cpu_per_rank_s"] = statistics.median(
            sum(rk["init"][1] + rk["first"][1] for rk in s["ranks"]) / world for s in starts)
        cpus = sorted(rk["init"][1] + rk["first"][1] for s in starts for rk in s["ranks"])
        row["cpu_rank_s"] = {"median": statistics.median(cpus), "q1": cpus[len(cpus) // 4],
                             "q3": cpus[(3 * len(cpus)) // 4], "n": len(cpus)}
        if all("connect" in rk for s in starts for rk in s["ranks"]):
            row["connect_s"] = statistics.median(max(rk["connect"] for rk in s["ranks"]) for s in starts)
        facts = [rk["vcga"] for s in starts for rk in s["ranks"] if "vcga" in rk]
        if facts:
            row["vcga"] = facts[0]
        mems = [rk["mem"] for s in starts for rk in s["ranks"] if rk.get("mem")]
        if mems:  # MiB per rank, mean over ranks and starts
            row["mem_mib"] = {k: sum(m[k] for m in mems) / len(mems) / 1024 for k in ("rss", "pss", "private")}
        counted = [s for s in result["starts"] if s["kind"] == "counted" and s["variant"] == v]
        if counted:
            row["store"] = store_load(counted[0], world)
        out["variants"][v] = row
    return out


def store_load(start: dict[str, Any], world: int) -> dict[str, Any]:
    per_rank = [[0, 0] for _ in range(world)]
    by_cat: dict[str, list[int]] = {}
    for key, (n, up, down) in start["store"].items():
        r, cat = key.split("|", 1)
        per_rank[int(r)][0] += n
        per_rank[int(r)][1] += up + down
        c = by_cat.setdefault(cat, [0, 0])
        c[0] += n
        c[1] += up + down
    return {"requests_total": sum(r[0] for r in per_rank), "bytes_total": sum(r[1] for r in per_rank),
            "requests_per_rank_max": max(r[0] for r in per_rank), "bytes_per_rank_max": max(r[1] for r in per_rank),
            "requests_per_rank_mean": sum(r[0] for r in per_rank) / world,
            "bytes_per_rank_mean": sum(r[1] for r in per_rank) / world,
            "by_category": by_cat, "types": start["store_types"], "errors": start["store_errors"]}


# ===================================================================================================
# Output
# ===================================================================================================


def _kb(n: float) -> str:
    return f"{n / 1024:.1f}" if n < 10 * 1024 * 1024 else f"{n / 1024:.0f}"


def render(summaries: list[dict[str, Any]], variants: tuple[str, ...], markdown: bool) -> str:
    connect = all("connect_s" in s["variants"][v] for s in summaries for v in variants)
    head = ["ranks", *[f"{v} s" for v in variants], *[f"{v}/gloo" for v in variants if v != "gloo"],
            *[f"{v} CPU ms/rank" for v in variants], *(["store connect s"] if connect else [])]
    lines = []
    for s in summaries:
        vs = s["variants"]
        lines.append([str(s["world"]), *[f"{vs[v]['total_s']:.3f}" for v in variants],
                      *[f"{vs[v]['ratio']:.2f} ({vs[v]['ratio_range'][0]:.2f}–{vs[v]['ratio_range'][1]:.2f})"
                        for v in variants if v != "gloo"],
                      *[cpu_cell(vs[v], vs[variants[0]], v != variants[0]) for v in variants],
                      *([f"{statistics.median(vs[v]['connect_s'] for v in variants):.3f}"] if connect else [])])
    out = ["time from init_process_group to the end of the first 4 KiB all_reduce, the largest over the ranks "
           "(median over starts; ratio: median of start-by-start ratios, range); CPU of init_process_group and "
           "the first all_reduce per rank (median over ranks and starts, [interquartile range], +difference to "
           "gloo's median)", table(head, lines, markdown), ""]
    facts = [(v, s["variants"][v]["vcga"]) for s in summaries[:1] for v in variants if "vcga" in s["variants"][v]]
    for v, f in facts:
        if v == "gloo":
            continue
        how = "a wheel (site-packages)" if f.get("installed") else "an editable checkout"
        cached = "with" if f.get("bytecode") else "without"
        inside = f.get("in_start", f["modules"])
        out.append(f"{v}: vcga from {how}, {cached} bytecode caches; {len(f['modules'])} vcga modules at the end, "
                   f"{len(inside)} of them imported by the start")
    if facts:
        out.append("")
    for key, what in (("phases_s", "wall"), ("phases_cpu_s", "CPU")):
        used = [p for p in PHASES if any(s["variants"][v][key].get(p, 0) > 0 for s in summaries for v in variants)]
        head = ["ranks", "variant", *[f"{p} ms" for p in used]]
        lines = []
        for s in summaries:
            for v in variants:
                ph = s["variants"][v][key]
                lines.append([str(s["world"]), v, *[f"{ph.get(p, 0) * 1e3:.1f}" for p in used]])
        out += [f"per phase, {what}: mean over ranks of each rank's milliseconds", table(head, lines, markdown), ""]
    if any("mem_mib" in s["variants"][v] for s in summaries for v in variants):
        head = ["ranks", "variant", "RSS MiB/rank", "PSS MiB/rank", "private MiB/rank", "machine MemAvailable GiB (lowest seen)"]
        lines = [[str(s["world"]), v, *[f"{s['variants'][v]['mem_mib'][k]:.0f}" for k in ("rss", "pss", "private")],
                  f"{s.get('mem_available_gib', 0):.1f}"]
                 for s in summaries for v in variants if "mem_mib" in s["variants"][v]]
        out += ["memory of a rank at the end of its start (mean; forked from a server that imported torch: "
                "PSS counts the shared pages once over all processes)", table(head, lines, markdown), ""]
    if any("store" in s["variants"][v] for s in summaries for v in variants):
        cats = [c for c in CATEGORIES if any(c in s["variants"][v].get("store", {}).get("by_category", {})
                                             for s in summaries for v in variants)]
        head = ["ranks", "variant", "requests/rank (max)", "KiB/rank (max)", "requests total", "KiB total",
                *[f"{c} req / KiB" for c in cats]]
        lines = []
        for s in summaries:
            for v in variants:
                st = s["variants"][v].get("store")
                if not st:
                    continue
                bc = st["by_category"]
                lines.append([str(s["world"]), v, f"{st['requests_per_rank_mean']:.1f} ({st['requests_per_rank_max']})",
                              f"{_kb(st['bytes_per_rank_mean'])} ({_kb(st['bytes_per_rank_max'])})",
                              str(st["requests_total"]), _kb(st["bytes_total"]),
                              *[f"{bc[c][0]} / {_kb(bc[c][1])}" if c in bc else "" for c in cats]])
        out += ["store load of one start, counted on the wire (requests and bytes both ways)",
                table(head, lines, markdown)]
        errors = {e for s in summaries for v in variants for e in s["variants"][v].get("store", {}).get("errors", [])}
        if errors:
            out.append("store relay could not parse: " + "; ".join(sorted(errors)))
    return "\n".join(out)


def cpu_cell(row: dict[str, Any], gloo: dict[str, Any], diff: bool) -> str:
    c = row["cpu_rank_s"]
    text = f"{c['median'] * 1e3:.1f} [{c['q1'] * 1e3:.1f}–{c['q3'] * 1e3:.1f}]"
    if diff:
        text += f" (+{(c['median'] - gloo['cpu_rank_s']['median']) * 1e3:.1f})"
    return text


def compile_sources() -> None:
    """Write vcga's bytecode, as ``pip install`` does: a checkout run with PYTHONDONTWRITEBYTECODE
    would otherwise compile every module in every rank of every start."""
    import compileall
    import importlib.util

    for pkg in ("vcga", "vcga.plugins", "vcga.formats", "vcga.conformance"):
        spec = importlib.util.find_spec(pkg)
        for d in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(d, quiet=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", choices=("torchrun", "forkserver"), default="torchrun",
                   help="torchrun: fresh interpreters, as users launch (default); forkserver: forked from a "
                        "server that imported torch and vcga, with store counts")
    p.add_argument("--release", choices=("together", "own"), default="together",
                   help="torchrun launch: every rank calls init_process_group at once, on a signal after every "
                        "rank's imports (together), or each after its own imports (own)")
    p.add_argument("--python", default=sys.executable,
                   help="torchrun launch: the interpreter of torchrun and the ranks (e.g. .venv-wheel/bin/python)")
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--reps", type=int, default=5, help="timed starts per variant and world size")
    p.add_argument("--variants", default="gloo,vcga,mixed")
    p.add_argument("--no-count", dest="count", action="store_false", help="skip the counted starts")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", help="write every start's raw figures and the summaries here")
    p.add_argument("--progress", action="store_true", help="print each start to stderr")
    p.add_argument("--profile", metavar="DIR", help="write a cProfile of rank 0's start per start here")
    a = p.parse_args()
    a.variants = a.variants.split(",")
    variants = tuple(a.variants)
    allowed = TORCHRUN_VARIANTS if a.launch == "torchrun" else VARIANTS
    if any(v not in allowed for v in variants) or variants[0] != "gloo":
        p.error(f"--variants: gloo first, then some of {', '.join(allowed[1:])} (with --launch {a.launch})")
    if any(n < 2 or n % 2 for n in a.ranks):
        p.error("--ranks: even numbers >= 2 (the mixed variant splits them between two vendors)")
    if a.launch == "torchrun":
        a.count = False  # the store is torchrun's agent's: nothing in front of it to count through
    else:
        compile_sources()
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        os.environ["STARTUP_PROFILE"] = os.path.abspath(a.profile)
    raw, summaries = [], []
    load = [os.getloadavg()[0]]
    driver = TorchrunDriver if a.launch == "torchrun" else ForkDriver
    for n in a.ranks:
        d = driver(n, a)
        try:
            result = d.run()
        finally:
            d.close()
        raw.append(result)
        summaries.append(summarize(result, variants))
        if a.progress:
            print(render(summaries[-1:], variants, False), file=sys.stderr, flush=True)
    load.append(os.getloadavg()[0])
    print(f"{os.cpu_count()} cores; 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after; "
          f"launch: {a.launch}" + (f" ({a.python}, release: {a.release})" if a.launch == "torchrun" else ""))
    print(render(summaries, variants, a.markdown))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summaries": summaries, "raw": raw, "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
