"""One short check of VCGA on a machine with an NVIDIA GPU (run it through scripts/gpu_check.sh).

Steps, in order (docs/gpu-check.md says what each proves):

1. nccl probe                      -- the plugin sees the GPU(s), NCCL and CUDA versions
2. nccl capability table           -- equals sim-nccl cell by cell, every cell cites its source
3. nccl topology                   -- nvidia-smi topo -m (or NVML) parsed into a link matrix
4. Accelerator calls               -- device, memory stats, RNG, streams/events, to-host hook
5. ProcessGroupNCCL ws=1 vs table  -- the plugin's factory; every all_reduce cell the table calls
                                      native runs and is exact, every other one is refused by NCCL
6. vcga group ws=1 on NCCL         -- init_process_group("vcga") on the GPU
7. mixed world, CPU sims only      -- 4 ranks sim-nccl/sim-hccl/sim-cncl/sim-hccl
8. mixed world, 1 CUDA + 3 sims    -- rank 0 real nccl on the GPU, ranks 1-3 simulated

A step prints PASS, FAIL or SKIP with a reason: SKIP when the machine has no NVIDIA GPU, or when a
step's prerequisite (the ``vcga`` process group, the mixed-vendor bridge) is not in this checkout.
The exit status is 1 when any step failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
WORKER_TIMEOUT_S = 180.0
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class Step:
    name: str
    result: str
    detail: str
    seconds: float = 0.0


class Skip(Exception):
    """The step does not apply here; the message says why."""


# ---------------------------------------------------------------------------------------------------
# Environment facts
# ---------------------------------------------------------------------------------------------------


def gpu_hardware() -> str | None:
    """Why we believe an NVIDIA GPU is attached (independent of torch), or None."""
    if os.path.exists("/dev/nvidia0"):
        return "/dev/nvidia0 exists"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and "GPU" in out.stdout:
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def vcga_group_registered() -> bool:
    """Is the `vcga` torch.distributed backend registered after `import vcga`?"""
    import torch.distributed as dist

    import vcga  # noqa: F401 - importing vcga registers the backend

    return "vcga" in [b.lower() for b in dist.Backend.backend_list]


# ---------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------


def step_probe(ctx: dict) -> str:
    from vcga.plugin_manager import get_plugin_manager

    probe = get_plugin_manager().backend_record("nccl").probe()
    ctx["probe"] = probe
    if probe.available:
        return f"{probe.reason}; versions {dict(probe.versions)}"
    if ctx["hardware"] is None:
        raise Skip(f"no NVIDIA GPU here ({probe.reason})")
    raise AssertionError(f"a GPU is attached ({ctx['hardware']}) but the nccl backend is unavailable: {probe.reason}")


def step_table(ctx: dict) -> str:
    import re

    from vcga import dtypes
    from vcga.contract import Collective, ReduceOp
    from vcga.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    real, stand_in = pm.backend("nccl").capabilities(), pm.backend("sim-nccl").capabilities()
    keys = [(c, d, o) for c in Collective for d in dtypes.ALL for o in (ReduceOp if c.reduces else (None,))]
    diff = [k for k in keys if (real.lookup(*k).support, real.lookup(*k).via)
            != (stand_in.lookup(*k).support, stand_in.lookup(*k).via)]
    uncited = [k for k in keys if not re.search(r"\b[\w/]+\.(cpp|hpp|py)\b", real.lookup(*k).note)]
    if diff or uncited:
        raise AssertionError(f"{len(diff)} cells differ from sim-nccl, {len(uncited)} cells cite no source")
    c = real.summary()["cells"]
    return f"{len(keys)} cells equal sim-nccl and cite sources ({c['native']} native, {c['emulated']} emulated)"


def step_topology(ctx: dict) -> str:
    from vcga.plugin_manager import get_plugin_manager

    need_gpu(ctx)
    topo = get_plugin_manager().backend("nccl").topology()
    if topo.source == "unknown":
        raise AssertionError(f"topology unknown: {topo.detail}")
    row0 = " ".join(topo.matrix[0]) if topo.matrix else ""
    return f"{topo.source}: {topo.device_count} GPU(s); GPU0 links: {row0}"


def step_accelerator(ctx: dict) -> str:
    import torch

    from vcga.plugin_manager import get_plugin_manager

    need_gpu(ctx)
    pm = get_plugin_manager()
    acc = pm.backend("nccl").accelerator()
    n = acc.device_count()
    acc.set_device(0)
    dev = acc.device()
    assert dev == torch.device("cuda", 0), dev
    before = acc.memory_stats()
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    after = acc.memory_stats()
    assert after.allocated - before.allocated >= x.numel(), (before, after)
    assert after.total and after.total > after.allocated
    del x
    acc.manual_seed(1234)
    state = acc.get_rng_state()
    a = torch.rand(8, device=dev)
    acc.set_rng_state(state)
    b = torch.rand(8, device=dev)
    assert torch.equal(a, b), "RNG state round trip did not reproduce the draws"
    stream = acc.new_stream()
    event = acc.new_event(enable_timing=True)
    with torch.cuda.stream(stream):
        y = torch.ones(1 << 20, device=dev) * 2
        event.record(stream)
    stream.wait_stream(acc.current_stream())
    event.synchronize()
    assert event.query()
    acc.synchronize()
    assert float(y.sum()) == 2 * (1 << 20)
    base = torch.arange(24, dtype=torch.float64, device=dev).reshape(4, 6)
    host = pm.tensor_to_host(base[:, ::2])
    assert host.device.type == "cpu" and host.is_contiguous() and torch.equal(host, base[:, ::2].cpu())
    assert {"bfloat16", "float8_e4m3fn"} <= acc.supported_dtypes()
    return f"{n} device(s); memory, RNG, stream/event, to-host hook all behaved"


def step_native_group(ctx: dict) -> str:
    """The plugin's ProcessGroupNCCL factory, ws=1, and every all_reduce cell of the table."""
    import torch
    import torch.distributed as dist

    from vcga import dtypes
    from vcga.contract import ReduceOp, Support
    from vcga.plugin_manager import get_plugin_manager

    need_gpu(ctx)
    backend = get_plugin_manager().backend("nccl")
    table = backend.capabilities()
    torch.cuda.set_device(0)
    pg = backend.create_process_group(dist.PrefixStore("gpu-check", dist.HashStore()), 0, 1,
                                      timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    checked, wrong = 0, []
    for dt in dtypes.ALL:
        for op in ReduceOp:
            cell = table.lookup("all_reduce", dt, op)
            x = (torch.arange(1, 9, dtype=torch.int64) % 2 == 0) if dt == "bool" else \
                torch.arange(1, 9, dtype=torch.int64).to(dtypes.to_torch(dt))
            t = x.to("cuda")
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist._make_nccl_premul_sum(2.0) if op is ReduceOp.PREMUL_SUM \
                else getattr(dist.ReduceOp, op.value)
            try:
                pg.allreduce([t], opts).wait()
                torch.cuda.synchronize()
                ran = True
            except Exception:  # noqa: BLE001 - NCCL's refusal is what we compare against
                ran = False
            checked += 1
            if cell.support is Support.NATIVE:
                want = x * 2 if op is ReduceOp.PREMUL_SUM else x  # world size 1
                if not ran:
                    wrong.append(f"{dt}/{op.value}: table says native, NCCL refused")
                elif not torch.equal(t.cpu().view(torch.uint8), want.contiguous().view(torch.uint8)):
                    wrong.append(f"{dt}/{op.value}: wrong value")
            elif ran and (op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
                          or "getNcclDataType" in cell.note or "Float8" in cell.note):
                wrong.append(f"{dt}/{op.value}: the table says NCCL refuses this, but it ran")
    if wrong:
        raise AssertionError(f"{len(wrong)} of {checked} cells disagree: " + "; ".join(wrong[:6]))
    return (f"{checked} all_reduce cells: every native cell exact; every cell the table says NCCL refuses "
            "(bitwise, unmapped dtypes, fp8 reductions) refused by NCCL")


def need_gpu(ctx: dict) -> None:
    if ctx["hardware"] is None:
        raise Skip("no NVIDIA GPU here")
    if not getattr(ctx.get("probe"), "available", False):
        raise Skip("nccl backend unavailable (step 1)")


def need_vcga_group() -> None:
    try:
        ok = vcga_group_registered()
    except Exception as e:
        raise Skip(f"importing vcga failed: {type(e).__name__}: {e}") from e
    if not ok:
        raise Skip("the `vcga` torch.distributed backend is not registered in this checkout")


def step_vcga_ws1(ctx: dict) -> str:
    need_gpu(ctx)
    need_vcga_group()
    return run_world(["nccl"], "vcga group ws=1 on NCCL")


def step_mixed_sim(ctx: dict) -> str:
    need_vcga_group()
    detail = run_world(["sim-nccl", "sim-hccl", "sim-cncl", "sim-hccl"], "mixed world (CPU sims)")
    ctx["bridge"] = True
    return detail


def step_mixed_cuda(ctx: dict) -> str:
    need_gpu(ctx)
    need_vcga_group()
    if not ctx.get("bridge"):
        raise Skip("the mixed-vendor bridge did not run on CPU sims (step 7)")
    return run_world(["nccl", "sim-hccl", "sim-cncl", "sim-hccl"], "mixed world (1 CUDA + 3 sims)")


# ---------------------------------------------------------------------------------------------------
# Worlds of worker processes
# ---------------------------------------------------------------------------------------------------


def run_world(backends: list[str], what: str) -> str:
    """Spawn one process per rank (``VCGA_BACKEND`` per rank), run the worker, collect results.

    A group that cannot be created with a typed VCGA error is a missing prerequisite (SKIP); a wrong
    value, a collective error, a crash or a timeout is a failure."""
    from vcga.testing import free_port

    port = free_port()
    procs = []
    for rank, backend in enumerate(backends):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
        env.update(VCGA_BACKEND=backend, VCGA_TIMEOUT=str(COLLECTIVE_TIMEOUT_S))
        spec = {"rank": rank, "world_size": len(backends), "port": port}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results, deadline = [], time.monotonic() + WORKER_TIMEOUT_S
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{what}: rank {rank} did not finish within {WORKER_TIMEOUT_S:g} s") from None
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            tail = (err.strip().splitlines() or ["(no output)"])[-1]
            raise AssertionError(f"{what}: rank {rank} exited {p.returncode} without a result: {tail}")
        results.append(json.loads(lines[-1]))
    init_errors = [r for r in results if r["stage"] == "init"]
    if init_errors and all(r["typed"] for r in init_errors):
        raise Skip(f"{what}: the group could not be created here: {init_errors[0]['error']}")
    bad = [r for r in results if r["stage"] != "done"]
    if bad:
        raise AssertionError(f"{what}: rank {bad[0]['rank']} failed at {bad[0]['stage']}: {bad[0]['error']}")
    devices = ", ".join(f"{r['rank']}:{r['backend']}@{r['device']}" for r in results)
    return f"all_reduce SUM (fp32, int64) and all_gather exact on every rank [{devices}]"


def worker(spec: dict) -> None:
    """One rank: init the `vcga` group, run the collectives, print one JSON line."""
    rank, world_size = spec["rank"], spec["world_size"]
    report = {"rank": rank, "stage": "init", "error": "", "typed": False, "backend": os.environ.get("VCGA_BACKEND"),
              "device": ""}
    try:
        import torch
        import torch.distributed as dist

        import vcga
        from vcga.errors import VcgaError
        from vcga.plugin_manager import get_plugin_manager

        try:
            backend = get_plugin_manager().select_backend(rank=rank, world_size=world_size)
            device = backend.accelerator().device(0)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            report["device"] = str(device)
            dist.init_process_group("vcga", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except Exception as e:
            chain, cur = [], e
            while cur is not None and len(chain) < 8:  # torch may wrap the creator's error
                chain.append(cur)
                cur = cur.__cause__ or cur.__context__
            typed = next((x for x in chain if isinstance(x, (VcgaError, NotImplementedError))), None)
            report.update(error=f"{type(typed or e).__name__}: {typed or e}", typed=typed is not None)
            raise
        report["stage"] = "collectives"
        total = world_size * (world_size + 1) // 2
        for dtype in (torch.float32, torch.int64):
            t = torch.full((1000,), rank + 1, dtype=dtype, device=device)
            dist.all_reduce(t)
            if not torch.equal(t.cpu(), torch.full((1000,), total, dtype=dtype)):
                raise AssertionError(f"all_reduce {dtype}: got {t[:3].tolist()}..., want {total}")
        outs = [torch.empty(4, dtype=torch.int64, device=device) for _ in range(world_size)]
        dist.all_gather(outs, torch.full((4,), rank, dtype=torch.int64, device=device))
        if [int(o[0]) for o in outs] != list(range(world_size)):
            raise AssertionError(f"all_gather: got {[o.tolist() for o in outs]}")
        dist.destroy_process_group()
        report["stage"] = "done"
        _ = vcga
    except Exception as e:  # noqa: BLE001
        if not report["error"]:
            report["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print(json.dumps(report), flush=True)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------

STEPS: list[tuple[str, Callable[[dict], str]]] = [
    ("1 nccl probe", step_probe),
    ("2 nccl capability table", step_table),
    ("3 nccl topology", step_topology),
    ("4 Accelerator calls", step_accelerator),
    ("5 ProcessGroupNCCL ws=1 vs table", step_native_group),
    ("6 vcga group ws=1 on NCCL", step_vcga_ws1),
    ("7 mixed world, CPU sims only", step_mixed_sim),
    ("8 mixed world, 1 CUDA + 3 sims", step_mixed_cuda),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    try:
        import vcga.plugins.nccl  # noqa: F401
    except ImportError as e:
        print(f"gpu_check: vcga is not installed in {sys.executable} ({e}); "
              "run `pip install -e .` next to your CUDA build of torch first (docs/gpu-check.md)", file=sys.stderr)
        return 2
    ctx: dict = {"hardware": gpu_hardware()}
    steps: list[Step] = []
    for name, fn in STEPS:
        t0 = time.monotonic()
        try:
            step = Step(name, PASS, fn(ctx))
        except Skip as e:
            step = Step(name, SKIP, str(e))
        except Exception as e:  # noqa: BLE001 - every failure is one row, never a crash
            step = Step(name, FAIL, f"{type(e).__name__}: {e}")
        step.seconds = round(time.monotonic() - t0, 2)
        steps.append(step)
    import torch

    print(f"vcga gpu check -- python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"GPU: {ctx['hardware'] or 'none found'}")
    width = max(len(s.name) for s in steps)
    print(f"{'step'.ljust(width)}  result  seconds  detail")
    for s in steps:
        print(f"{s.name.ljust(width)}  {s.result:<6}  {s.seconds:>7.2f}  {s.detail}")
    failed = sum(s.result == FAIL for s in steps)
    passed, skipped = sum(s.result == PASS for s in steps), sum(s.result == SKIP for s in steps)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(s) for s in steps], f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
