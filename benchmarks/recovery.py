"""Checkpointing and recovery, measured side by side with torch's own, in one run, as median ratios.

Three parts (``--part io|stall|recovery``, all by default):

- **io** -- save and load throughput of ``vcga.checkpoint`` against torch.distributed.checkpoint's
  ``FileSystemWriter``/``FileSystemReader`` on the same state dict, at equal durability
  (``FileSystemWriter(sync_files=True)`` fsyncs every file it writes; VCGA fsyncs its shard, the
  metadata, the manifest, ``latest`` and the directories). Repetitions alternate which saves
  first, and rotate the three loads (below) through every order. Loads are measured cold (each
  checkpoint's pages dropped with POSIX_FADV_DONTNEED after an fsync, so both read the disk -- or
  the hypervisor's cache on a VM) and warm. VCGA's load
  verifies every checksum and padding byte of what it reads; torch's verifies nothing, so VCGA's
  reader also runs with its checks off (``vcga_unverified``: equal work). Ratios are medians of
  per-repetition pairs, each with a distribution-free 95% interval (``ratio_paired_ci95``).
- **stall** -- how long ``async_save`` holds up a training loop, against a synchronous ``save`` of
  the same state, for each configuration ``staging/writer`` (``--configs``; default all four:
  background or blocking staging, writer process or thread), repetitions interleaved. A step is
  fixed single-threaded matmul work of about ``--step-ms`` (forward and backward), then
  ``opt.step()`` of an Adam whose state (weights and both moments) is the state saved -- the
  optimizer step is what must wait for a background copy. Definition: the *stall* of one save is
  the loop's wall time from the ``async_save`` call until the save is done (the call, the
  optimizer step's wait for the copy, and the n steps that ran while the write was in flight)
  less n times the time of a step with no save in flight, measured right before and right after
  (the mean of the two, 3 to 10 steps each): every way the save slows training -- blocking,
  waiting, CPU or memory bandwidth or the GIL taken from the steps -- counts. Each repetition
  divides it by a synchronous ``save`` of the same state timed in the same repetition; reported
  is the median of those ratios with a distribution-free 95% interval (``stall_over_sync``,
  ``stall_over_sync_ci95``: use 15 or more repetitions), and the part timed directly (the call and
  the wait for the copy: ``blocked_and_waited_over_sync``) beside it.
- **recovery** -- ``examples/train_elastic.py`` under torchrun with one rank SIGKILLed mid-step
  (``VCGA_FAULT``), on backend vcga with two simulated vendors and, as the anchor, on torch's own
  gloo backend: time from the kill to the first peer's error (detection), from the new workers'
  start to their first completed step, from the kill to that step, and the steps lost (done but
  not checkpointed).

    .venv/bin/python benchmarks/recovery.py            # docs/benchmarks.md
    .venv/bin/python benchmarks/recovery.py --part io --mib 64 --reps 2        # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import vcga.checkpoint as ckpt
from vcga.checkpoint.storage import SafeLoadPlanner, VcgaStorageReader

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def make_state(mib: float, seed: int = 0) -> dict:
    """A model-and-optimizer-like state: weights, and Adam's two moments of each, fp32, plus bf16
    embeddings and small biases; ``mib`` MiB in all."""
    g = torch.Generator().manual_seed(seed)
    total = int(mib * MiB)
    model, moments = {}, {}
    i = 0
    used = 0
    while used < total:
        n = min(1 << 20, (total - used) // 12 + 1)  # a weight and its two moments: 12 bytes/element
        w = torch.randn(n, generator=g)
        model[f"layer{i}.weight"] = w
        model[f"layer{i}.bias"] = torch.randn(256, generator=g)
        moments[f"layer{i}.weight"] = {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g),
                                       "step": torch.tensor(10.0)}
        used += 12 * n
        i += 1
    model["embed"] = torch.randn(1024, 512, generator=g).to(torch.bfloat16)
    return {"model": model, "optim": {"state": moments, "lr": 1e-3}}


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


def _drop_cache(d: Path) -> None:
    for p in _files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _nbytes(state: dict) -> int:
    total = 0
    stack = [state]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, torch.Tensor):
            total += o.numel() * o.element_size()
    return total


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median: order statistics k and n+1-k
    with P(Binomial(n, 1/2) < k) <= (1 - level) / 2. None when n is too small for ``level``."""
    n = len(xs)
    xs = sorted(xs)
    tail, k = 0.0, 0
    while k < n:
        nxt = tail + math.comb(n, k) / 2 ** n
        if nxt > (1 - level) / 2:
            break
        tail, k = nxt, k + 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


# The three cyclic orders (each loader once in each place), then their reverses.
_LOAD_ORDERS = (("vcga", "torch", "vcga_unverified"), ("torch", "vcga_unverified", "vcga"),
                ("vcga_unverified", "vcga", "torch"), ("vcga_unverified", "torch", "vcga"),
                ("vcga", "vcga_unverified", "torch"), ("torch", "vcga", "vcga_unverified"))


def part_io(work: Path, mib: float, reps: int) -> dict:
    state = make_state(mib)
    nbytes = _nbytes(state)
    rows: dict[str, list[float]] = {k: [] for k in ("vcga_save", "torch_save", "vcga_load_cold", "torch_load_cold",
                                                     "vcga_load_warm", "torch_load_warm",
                                                     "vcga_unverified_load_cold", "vcga_unverified_load_warm")}
    for rep in range(reps):
        vroot, tdir = work / f"vcga-{rep}", work / f"torch-{rep}"
        order = ("vcga", "torch") if rep % 2 == 0 else ("torch", "vcga")
        for who in order:
            t = time.perf_counter()
            if who == "vcga":
                ckpt.save(state, vroot, step=rep, keep_last=1)
            else:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tdir, sync_files=True))
            rows[f"{who}_save"].append(nbytes / (time.perf_counter() - t) / 1e6)
        # vcga_unverified: VCGA's reader with its checksums off -- equal work with torch's reader,
        # which checks nothing (load_latest always verifies; this isolates what verifying costs).
        # Every loader takes every place in the order equally often (the first read after the
        # saves can differ from the later ones on a shared disk), and each pair both ways round.
        loaders = _LOAD_ORDERS[rep % len(_LOAD_ORDERS)]
        for temp in ("cold", "warm"):
            for who in loaders:
                if temp == "cold":
                    _drop_cache(tdir if who == "torch" else vroot)
                target = _zeros_like(state)
                t = time.perf_counter()
                if who == "vcga":
                    assert ckpt.load_latest(target, vroot) == rep
                elif who == "torch":
                    dcp.load(target, storage_reader=dcp.FileSystemReader(tdir))
                else:
                    dcp.load(target, storage_reader=VcgaStorageReader(vroot / f"step-{rep}", verify=False),
                             planner=SafeLoadPlanner())
                rows[f"{who}_load_{temp}"].append(nbytes / (time.perf_counter() - t) / 1e6)
                assert torch.equal(target["model"]["layer0.weight"], state["model"]["layer0.weight"])
        shutil.rmtree(vroot)
        shutil.rmtree(tdir)
    med = {k: statistics.median(v) for k, v in rows.items()}
    # Each repetition runs both back to back: the median of the per-repetition ratios is what a
    # shared machine's load drift disturbs least.
    compared = (("vcga", "save"), ("vcga", "load_cold"), ("vcga", "load_warm"),
                ("vcga_unverified", "load_cold"), ("vcga_unverified", "load_warm"))
    pairs = {f"{who}_{k}": [v / t for v, t in zip(rows[f"{who}_{k}"], rows[f"torch_{k}"], strict=False)] for who, k in compared}
    return {"mib": nbytes / MiB, "reps": reps, "MB_per_s": med,
            "ratio": {f"{who}_{k}": med[f"{who}_{k}"] / med[f"torch_{k}"] for who, k in compared},
            "ratio_paired": {k: statistics.median(v) for k, v in pairs.items()},
            "ratio_paired_ci95": {k: median_ci(v) for k, v in pairs.items()}, "samples": rows}


CONFIGS = ("background/process", "background/thread", "blocking/process", "blocking/thread")


def make_training(mib: float, seed: int = 1) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Parameters and an Adam whose state (the weights and both moments, 12 bytes per element)
    is about ``mib`` MiB, with fixed gradients so that every ``opt.step()`` changes all of it."""
    g = torch.Generator().manual_seed(seed)
    n_total = int(mib * MiB) // 12
    params = []
    while n_total > 0:
        n = min(1 << 20, n_total)
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = torch.randn(n, generator=g) * 1e-3
        params.append(p)
        n_total -= n
    opt = torch.optim.Adam(params, lr=1e-4, foreach=True)
    opt.step()  # creates both moments
    return params, opt


def part_stall(work: Path, mib: float, reps: int, steps_ms: float, configs: tuple[str, ...] = CONFIGS) -> dict:
    """Each configuration (staging/writer) of async_save against a synchronous save of the same
    state, repetitions interleaved. A step is matmul work then ``opt.step()`` (Adam over the saved
    state): the optimizer's step is what waits for a background staging copy, so the stall counts it."""
    torch.set_num_threads(1)
    params, opt = make_training(mib)
    a = torch.randn(384, 384)

    def state() -> dict:
        return {"model": {f"p{i}": p.detach() for i, p in enumerate(params)}, "optim": opt.state_dict()}

    def compute() -> None:
        b = a
        for _ in range(reps_per_step):
            b = torch.tanh(b @ a)

    waited = [0.0]

    def step() -> None:
        compute()
        t = time.perf_counter()
        ckpt.wait_staged()  # what opt.step()'s hook would wait for, timed here (then it waits for nothing)
        waited[0] += time.perf_counter() - t
        opt.step()

    def steps(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            step()
        return time.perf_counter() - t

    def compute_s() -> float:
        t = time.perf_counter()
        compute()
        return time.perf_counter() - t

    reps_per_step = 1
    # Forward and backward (the matmul work) last about steps_ms, then the optimizer step: the
    # share of a real step that a background copy can overlap.
    while compute_s() < steps_ms / 1000:
        reps_per_step *= 2
    rows: dict[str, dict[str, list]] = {c: {k: [] for k in ("sync", "stall", "blocked", "waited", "window", "control",
                                                                  "steps")}
                                        for c in configs}
    first: dict[str, dict] = {}
    n_prev = 3
    for rep in range(reps + 1):  # the first async save of each configuration starts its writer
        for config in (configs if rep % 2 == 0 else configs[::-1]):  # and allocates its buffers
            staging, writer = config.split("/")
            root = work / f"stall-{rep}-{staging}-{writer}"
            t = time.perf_counter()
            ckpt.save(state(), root, step=0, keep_last=1)
            sync_s = time.perf_counter() - t
            # The anchor of the stall: the same loop with no save in flight, measured right before
            # and right after the save's window (a fixed baseline from the start of the run would
            # count every drift of a shared machine's load, step after step, as stall).
            before = steps(n_prev) / n_prev
            waited[0] = 0.0
            t = time.perf_counter()
            fut = ckpt.async_save(state(), root, step=1, keep_last=1, staging=staging, writer=writer)
            call = time.perf_counter() - t
            n = 0
            while not fut.done():
                step()
                n += 1
            with_save = time.perf_counter() - t  # the call and every step that overlapped the save
            wait_s = waited[0]
            fut.result()
            n_prev = min(max(n, 3), 10)  # the anchors' length: enough steps to average, bounded
            after = steps(n_prev) / n_prev
            per_step = (before + after) / 2
            stall = with_save - n * per_step  # what the save cost the loop: blocked, waited, slower steps
            if rep == 0:
                first[config] = {"sync_s": sync_s, "blocked_s": call, "stall_s": stall}
            else:
                r = rows[config]
                for k, v in (("sync", sync_s), ("blocked", call), ("stall", stall), ("steps", n), ("waited", wait_s),
                             ("window", with_save), ("control", n * per_step)):
                    r[k].append(v)
            shutil.rmtree(root)
    out: dict = {"mib": _nbytes(state()) / MiB, "reps": reps, "first_async": first, "configs": {}}
    for config, r in rows.items():
        out["configs"][config] = {
            "step_s": statistics.median(c / max(n, 1) for c, n in zip(r["control"], r["steps"], strict=False)),
            "sync_save_s": statistics.median(r["sync"]), "async_blocked_s": statistics.median(r["blocked"]),
            "async_stall_s": statistics.median(r["stall"]),
            "stall_over_sync": statistics.median(s / y for s, y in zip(r["stall"], r["sync"], strict=False)),
            "stall_over_sync_ci95": median_ci([s / y for s, y in zip(r["stall"], r["sync"], strict=False)]),
            "blocked_over_sync": statistics.median(b / y for b, y in zip(r["blocked"], r["sync"], strict=False)),
            "async_waited_s": statistics.median(r["waited"]),
            # The part of the stall timed directly (the call, and the optimizer step waiting for the
            # copy): the rest is the steps' slowdown, read off against the anchor steps.
            "blocked_and_waited_over_sync": statistics.median((b + w) / y for b, w, y in
                                                              zip(r["blocked"], r["waited"], r["sync"], strict=False)),
            "window_s": statistics.median(r["window"]),
            "steps_during_save": statistics.median(r["steps"]), "samples": r}
    return out


def _launch(work: Path, name: str, backend: str, vendors: str, fault: str) -> dict:
    events, faults = work / f"{name}.events", work / f"{name}.faults"
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per attempt (rank 0 hosts it), for both.
    # With the agent's shared store (torchrun's default) the keys of the dead attempt are still
    # there, and torch's own gloo group of the restarted attempt reads the killed rank's old
    # address unless the new rank rewrote it first: "Gloo connectFullMesh failed ... Connection
    # refused", a failed restart whenever the race goes that way (VCGA keys its store per
    # attempt: docs/checkpoint.md). The anchor must restart reliably, and both run alike.
    env = {**os.environ, "VCGA_SIM_VENDORS": vendors, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "VCGA_TIMEOUT": "30",
           "OMP_NUM_THREADS": "1", "VCGA_FAULT": fault, "VCGA_FAULT_LOG": str(faults),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--max-restarts", "1", "--monitor-interval", "0.1", "--log-dir", str(work / f"{name}-torchrun"),
           str(ROOT / "examples" / "train_elastic.py"),
           "--root", str(work / f"{name}-ckpt"), "--steps", "10", "--save-every", "3", "--backend", backend,
           "--events", str(events)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{name}: torchrun failed\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    kill = json.loads(faults.read_text().splitlines()[0])
    failed = [e for e in ev if e["event"] == "failed" and e["attempt"] == 0]
    start1 = next(e for e in ev if e["event"] == "start" and e["attempt"] == 1)
    first1 = next(e for e in ev if e["event"] == "first_step" and e["attempt"] == 1)
    return {"detect_s": min(e["time"] for e in failed) - kill["time"] if failed else None,
            "errors": sorted({e["error"] for e in failed}),
            "restart_to_first_step_s": first1["time"] - start1["process_start"],
            "kill_to_first_step_s": first1["time"] - kill["time"],
            "steps_lost": kill["step"] - start1["resumed_from"]}


def part_recovery(work: Path, reps: int) -> dict:
    rows: dict[str, list[dict]] = {"vcga": [], "gloo": []}
    for rep in range(reps):
        for who in (("vcga", "gloo") if rep % 2 == 0 else ("gloo", "vcga")):
            rows[who].append(_launch(work, f"{who}-{rep}", who, "nccl:2,hccl:2", "kill:rank=1:step=7:at=mid"))
    out = {}
    for who, runs in rows.items():
        # detect_s is None in a launch where no peer recorded its error before torchrun stopped it
        med = {k: (statistics.median(v) if (v := [r[k] for r in runs if r[k] is not None]) else None)
               for k in ("detect_s", "restart_to_first_step_s", "kill_to_first_step_s", "steps_lost")}
        out[who] = {**med, "errors": sorted({x for r in runs for x in r["errors"]}), "runs": runs}
    out["ratio_vcga_over_gloo"] = {k: out["vcga"][k] / out["gloo"][k] for k in
                                   ("restart_to_first_step_s", "kill_to_first_step_s") if out["gloo"][k]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("io", "stall", "recovery", "all"), default="all")
    p.add_argument("--mib", type=float, default=256, help="state size for io and stall")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--recovery-reps", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=50.0, help="training step length for the stall part")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="async_save staging/writer configurations for the stall part, comma-separated")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory on disk)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    work = Path(tempfile.mkdtemp(prefix="vcga-recovery-", dir=args.dir or str(ROOT)))
    out: dict = {"host": os.uname().nodename, "cpus": os.cpu_count(), "torch": torch.__version__}
    try:
        if args.part in ("io", "all"):
            out["io"] = part_io(work, args.mib, args.reps)
            print(json.dumps({"io": {k: v for k, v in out["io"].items() if k != "samples"}}, indent=1), flush=True)
        if args.part in ("stall", "all"):
            out["stall"] = part_stall(work, args.mib, args.reps, args.step_ms, tuple(args.configs.split(",")))
            print(json.dumps({"stall": {**out["stall"], "configs": {
                c: {k: v for k, v in r.items() if k != "samples"} for c, r in out["stall"]["configs"].items()}}},
                indent=1), flush=True)
        if args.part in ("recovery", "all"):
            out["recovery"] = part_recovery(work, args.recovery_reps)
            print(json.dumps({"recovery": {k: ({kk: vv for kk, vv in v.items() if kk != "runs"}
                                               if isinstance(v, dict) else v)
                                           for k, v in out["recovery"].items()}}, indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ckpt.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    threading.excepthook = lambda a: None if a.exc_type is SystemExit else sys.__excepthook__(a.exc_type,
                                                                                             a.exc_value,
                                                                                             a.exc_traceback)
    main()
