"""Two nodes joined by a shaped link: the bridge's all_reduce against the link's bound and flat gloo,
and DDP step times with the bridge synchronous, asynchronous and flat gloo -- all in the same run.

The nodes are network namespaces on this machine (vcga.testing.multinode, docs/multinode.md; needs
root): node 0 runs two simulated NCCL ranks, node 1 two simulated HCCL ranks (``VCGA_BACKEND`` per
node), joined by a veth pair shaped with ``tc tbf`` at both ends. Ranks start through real
``torchrun --nnodes 2 --rdzv-backend c10d``. Per link rate, one job measures:

1. **all_reduce**, fp32, each size: the bridge as ``auto`` chooses (the group's α–β model), each
   algorithm forced (leader / bandwidth / replicated: the alternatives the model chose from), and
   flat gloo over the same four ranks. Calls rotate through the variants after a barrier; a call's
   time is the slowest rank's; medians over repetitions. The link bound: an all_reduce across two
   nodes must move each node's S bytes to the other node (reduce-scatter and all-gather across the
   link carry S/2 each way twice), so at best S / rate, each direction at once.
2. **DDP steps** (median step time, from a barrier to the end of the optimizer step) of a 4.2 M
   parameter MLP (eight 724 x 724 layers, 16.8 MB of fp32 gradients, 4 MiB buckets) and of
   examples/train_mixed.py's transformer: compute only (the same steps without DDP, every rank at
   once), the bridge asynchronous (the default: consecutive bucket all_reduces pipelined, a
   bucket's in-node reduce-scatter and exchange overlapping the previous one's exchange and
   all-gather), the bridge asynchronous in order (``bridge_pipeline: off``, one all_reduce after
   the other: the anchor of the pipeline), the bridge synchronous (``bridge_async: false``),
   flat gloo. The all_reduces are timed "in order" too. The bound: max(compute, gradient bytes / link rate); and, since DDP reduces gradients
   only while backward runs, max(compute, forward + gradient bytes / link rate) (the forward pass
   timed alone in the compute-only steps). After the timed steps every rank checks that the two
   bridge runs are bitwise identical (same reduction order), and that the asynchronous
   bridge's parameters are within the derived bound of flat gloo's (examples/train_mixed.py's
   check, with a recording run of gloo); the driver exits non-zero when any of these fails. Each
   step's CPU seconds (every thread of every rank, compute and communication) are measured too:
   spread evenly over the machine's cores they are the **equal-work bound** of the step as done
   (with the gradients' frames on the link, whichever is longer) -- where the ranks share fewer
   cores than they have threads, max(compute, link) can sit below what the cores can do.

The link bound is also given **framed**: tbf counts whole frames against the rate, so S bytes of
TCP payload occupy S / mss * (mtu + 14) bytes of it (``_link_facts``); and the bytes each node
actually handed its interface per call (``node sent / size``: the interface counts a GSO packet of
up to 64 KiB once, with one set of headers) show what the algorithm sent.

Usage (as root)::

    python benchmarks/multinode.py                          # 1 Gbit/s and 4 Gbit/s
    python benchmarks/multinode.py --rates 1gbit --markdown --reps 7
    python benchmarks/multinode.py --json out.json          # every figure, also each group's calibration
    python benchmarks/multinode.py --rates 1gbit --figures links.json
    vcga info --plan --vendors nccl:2,hccl:2 --nodes 2 --figures links.json [--observed]
    python benchmarks/multinode.py --rates 1gbit --sizes 64 --reps 30 --skip 10 --ddp-steps 0 --bucket-ms 8
        # the figure of record: auto against each algorithm forced behind an 8 ms token bucket, calls 11-30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

ALGORITHMS = ("leader", "bandwidth", "replicated")
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------
# One rank (runs under torchrun inside a node)
# ---------------------------------------------------------------------------------------------------


#: The MLP: eight layers of 724 x 724 (+ bias), 4,199,200 parameters, 16.8 MB of fp32 gradients;
#: 2.1 MB per layer, so DDP's 4 MiB buckets hold two layers each and the first bucket is ready a
#: quarter into backward (one layer per bucket of a two-layer 1024 x 2048 MLP would not be).
MLP_WIDTH, MLP_LAYERS = 724, 8


def mlp_task(batch: int):
    """The 4.2 M parameter MLP (16.8 MB of fp32 gradients) and its data."""
    import torch
    import torch.nn as nn

    def make_model() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(MLP_LAYERS):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    def make_batch(rank: int, step: int):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        return torch.randn(batch, MLP_WIDTH, generator=g), torch.randn(batch, MLP_WIDTH, generator=g)

    return make_model, make_batch, nn.functional.mse_loss


def rank_main(args: argparse.Namespace) -> None:
    from dataclasses import replace
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers backend "vcga"
    from vcga.config import load_config
    from vcga.process_group import VcgaOptions

    sys.path.insert(0, str(ROOT / "examples"))
    import train_mixed as tm

    dist.init_process_group(backend="vcga", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config()
    flat = dist.new_group(backend="gloo")
    groups: dict[str, Any] = {"auto": dist.group.WORLD, "flat": flat}
    for alg in ALGORITHMS:
        groups[alg] = dist.new_group(backend="vcga", pg_options=VcgaOptions(config=replace(cfg, bridge_algorithm=alg)))
    sync = dist.new_group(backend="vcga", pg_options=VcgaOptions(config=replace(cfg, bridge_async=False)))
    # asynchronous, one collective after the other: what the pipeline across collectives is
    # measured against, in the same run
    inorder = dist.new_group(backend="vcga", pg_options=VcgaOptions(config=replace(cfg, bridge_pipeline="off")))
    groups["in order"] = inorder
    segmented = {}
    for m in args.ddp_segments:
        segmented[m] = dist.new_group(backend="vcga", pg_options=VcgaOptions(config=replace(cfg, bridge_algorithm="bandwidth")))
        segmented[m].transport.group.reducer.fixed_segments = m
    out: dict[str, Any] = {"world": world, "calibration": dist.group.WORLD.transport.describe()["calibration"],
                           "pipeline": dist.group.WORLD.transport.describe()["pipeline"]}

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=flat)
        return t.tolist()

    # 1. all_reduce
    # The bytes each node puts on the link per call: its interface's counter (one reader per node:
    # local rank 0; the node's other rank adds 0), around the call, between two barriers so that
    # no other call's bytes fall in. Frames as tbf counts them (Ethernet header on).
    local0 = os.environ.get("LOCAL_RANK", "0") == "0"
    out["link"] = _link_facts() if rank == 0 else {}
    variants = ["auto", "in order", *ALGORITHMS, "flat"]
    rows = []
    for mib in args.sizes:
        x = torch.ones(mib * MIB // 4)
        times: dict[str, list[float]] = {v: [] for v in variants}
        sent: dict[str, list[float]] = {v: [] for v in variants}
        ran: list[str] = []  # what the auto group ran, call by call
        reducer = dist.group.WORLD.transport.group.reducer
        for rep in range(args.reps):
            for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                dist.barrier(group=flat)
                b0 = _tx_bytes() if local0 else 0
                before = dict(reducer.counts)
                t0 = time.perf_counter()
                dist.all_reduce(x, group=groups[v])
                times[v].append(time.perf_counter() - t0)
                dist.barrier(group=flat)
                if v == "auto":
                    ran.append(next((a for a in ALGORITHMS if reducer.counts[a] > before[a]), "?"))
                sent[v].append(float(_tx_bytes() - b0) if local0 else 0.0)
                x.fill_(1.0)
        med, wire = {}, {}
        for v in variants:
            med[v] = statistics.median(slowest(times[v])[args.skip:])  # the first calls warm up (and verify)
            wire[v] = statistics.median(slowest(sent[v])[args.skip:])  # the node that sent most
        chosen = reducer.algorithm(x, _sum())
        segs = reducer.segment_count(mib * MIB) if chosen == "bandwidth" else 1
        rows.append({"bytes": mib * MIB, "median_s": med, "auto_chose": chosen, "segments": segs,
                     "node_sent_bytes": wire, "auto_ran": ran, "calls": args.reps, "skipped": args.skip})
    out["all_reduce"] = rows

    # 2. DDP steps
    out["ddp"] = {}
    reducer = dist.group.WORLD.transport.group.reducer
    out["plan"] = getattr(reducer, "verification", None)
    # rank 0's figures now: with what the online check observed (the corrected figures)
    out["figures_now"] = reducer.figures.to_json() if reducer.figures is not None else None
    if args.ddp_steps <= 0:
        tasks = {}
    else:
        tasks = {"mlp": (*mlp_task(args.batch), {"bucket_cap_mb": 4}),
                 "train_mixed": (tm.TinyTransformer, tm.batch, tm.loss_of, {})}
    for name, (make_model, make_batch, loss, ddp_kw) in tasks.items():
        steps = args.ddp_steps
        kw = {"make_model": make_model, "make_batch": make_batch, "loss": loss}
        compute, forward, cpu = _compute_only(make_model, make_batch, loss, steps, flat)
        res: dict[str, Any] = {"compute_s": statistics.median(slowest(compute)[1:]),
                               "forward_s": statistics.median(slowest(forward)[1:]),
                               "compute_cpu_s": _total(statistics.median(cpu[1:]), flat),
                               "grad_bytes": sum(p.numel() * 4 for p in make_model().parameters())}
        models = {}
        queue = dist.group.WORLD.transport.group.queue
        most0 = queue.most_in_stage2
        queue.most_in_stage2 = 0
        for v, g in (("bridge_async", dist.group.WORLD), ("bridge_inorder", inorder), ("bridge_sync", sync),
                     ("flat_gloo", flat)):
            ts: list[float] = []
            cs: list[float] = []
            models[v], _ = tm.train(g, steps, 0.01, 0.9, times=ts, cpu_times=cs, **kw, **ddp_kw)
            res[v + "_s"] = statistics.median(slowest(ts)[1:])
            res[v + "_cpu_s"] = _total(statistics.median(cs[1:]), flat)
        ref, abs_sums = tm.train(flat, steps, 0.01, 0.9, record_abs=flat, **kw, **ddp_kw)
        check = tm.compare(models["bridge_async"], ref, abs_sums, 0.01, 0.9, flat)
        res["async_vs_sync_bitwise"] = tm.digest(models["bridge_async"]) == tm.digest(models["bridge_sync"])
        res["inorder_vs_sync_bitwise"] = tm.digest(models["bridge_inorder"]) == tm.digest(models["bridge_sync"])
        # the most all_reduces in their second stage at once during these steps (>= 2: they overlapped)
        res["most_in_stage2"] = queue.most_in_stage2
        queue.most_in_stage2 = max(most0, queue.most_in_stage2)
        res["identical_on_every_rank"] = check["identical_on_every_rank"]
        res["max_diff_over_bound"] = check["max_diff_over_bound"]
        res["within_bound"] = check["within_bound"]
        res["flat_equals_recorded_ref"] = tm.digest(models["flat_gloo"]) == tm.digest(ref)
        # The same steps with every bucket cut in a fixed number of pipeline segments (the figures'
        # choice aside): what the segments cost in CPU and time; same reduction order, same bits.
        for m, g in (segmented.items() if name == "mlp" else ()):
            ts, cs = [], []
            model, _ = tm.train(g, steps, 0.01, 0.9, times=ts, cpu_times=cs, **kw, **ddp_kw)
            res.setdefault("segments", {})[m] = {"s": statistics.median(slowest(ts)[1:]),
                                                 "cpu_s": _total(statistics.median(cs[1:]), flat),
                                                 "bitwise": tm.digest(model) == tm.digest(models["bridge_sync"])}
        out["ddp"][name] = res
    if rank == 0:
        Path(args.as_rank, "result.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _total(value: float, flat) -> float:
    """``value`` summed over every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=flat)
    return float(t.item())


def _tx_bytes(dev: str = "eth0") -> int:
    """Bytes this node's link interface has sent (the node's own /sys, remounted by the harness)."""
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def _link_facts(dev: str = "eth0") -> dict[str, Any]:
    """What a TCP byte costs on the link: tbf counts whole frames (Ethernet header + IPv4 + TCP
    headers, TCP options) against the rate, so S bytes of payload take ceil(S / mss) frames of
    mtu + 14 bytes. mss = mtu - 40 (IPv4, TCP) - 12 when TCP timestamps are on (Linux's default)."""
    mtu = int(Path(f"/sys/class/net/{dev}/mtu").read_text())
    ts = Path("/proc/sys/net/ipv4/tcp_timestamps").read_text().strip() != "0"
    return {"mtu": mtu, "tcp_timestamps": ts, "mss": mtu - 40 - (12 if ts else 0), "frame": mtu + 14}


def _sum():
    from vcga.contract import ReduceOp

    return ReduceOp.SUM


def _compute_only(make_model, make_batch, loss, steps: int, flat) -> tuple[list[float], list[float]]:
    """The same steps without DDP, every rank at once (the CPU is shared as in the DDP runs): each
    step's seconds, those of its forward pass (with the loss) alone, and its CPU seconds. DDP reduces gradients only
    during backward, so a step takes at least forward + gradient bytes / link rate."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rank = dist.get_rank()
    times, forward, cpu = [], [], []
    for step in range(steps):
        x, y = make_batch(rank, step)
        dist.barrier(group=flat)
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = loss(model(x), y)
        forward.append(time.perf_counter() - t0)
        out.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, forward, cpu


# ---------------------------------------------------------------------------------------------------
# The driver: nodes, torchrun, tables
# ---------------------------------------------------------------------------------------------------


def run_rate(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    from vcga.testing.multinode import Cluster, parse_rate

    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    # Every group measures its links in this run (not a cache entry from an earlier one): the choice
    # shown beside the forced algorithms is then the one this run's figures make.
    env.update(VCGA_TIMEOUT="600", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VCGA_BRIDGE_CALIBRATION="measure")
    argv = [str(Path(__file__).resolve()), "--reps", str(args.reps), "--skip", str(args.skip),
            "--ddp-steps", str(args.ddp_steps),
            "--batch", str(args.batch), "--sizes", ",".join(map(str, args.sizes)),
            "--ddp-segments", ",".join(map(str, args.ddp_segments))]
    with tempfile.TemporaryDirectory(prefix="vcga-bench-mn-") as tmp, \
            Cluster(nodes=2, rate=rate, bucket_s=args.bucket_ms / 1e3) as cluster:
        launch = cluster.torchrun([*argv, "--as-rank", tmp], 2, env=env,
                                  node_env=[{"VCGA_BACKEND": "sim-nccl"}, {"VCGA_BACKEND": "sim-hccl"}])
        results = launch.wait(timeout=args.timeout)
        if any(r.returncode != 0 for r in results):
            raise SystemExit("benchmark failed:\n" + "\n".join(f"--- node {r.node} (exit {r.returncode})\n"
                                                               f"{r.output[-3000:]}" for r in results))
        out = json.loads(Path(tmp, "result.json").read_text())
    out["rate"], out["rate_bps"], out["bucket_ms"] = rate, parse_rate(rate), args.bucket_ms
    out["cores"] = len(os.sched_getaffinity(0))  # the nodes' ranks all run on this machine's cores
    return out


def _framed(nbytes: float, link: dict[str, Any]) -> float:
    """Bytes on the wire (as tbf counts them) that carry ``nbytes`` of TCP payload in full frames."""
    return nbytes / link["mss"] * link["frame"] if link else float(nbytes)


def _inorder_cells(d: dict[str, Any], bound: float, cores: int, link: dict[str, Any], rate: float) -> list[str]:
    """The asynchronous bridge without pipelining across collectives: its step, against the stated
    bound and its own equal-work bound; and how many all_reduces the pipelined one had in flight."""
    if "bridge_inorder_s" not in d:
        return ["", "", "", "", ""]
    cpu = d.get("bridge_inorder_cpu_s")
    equal = max(cpu / cores, _framed(d["grad_bytes"], link) / rate) if cores and cpu else None
    return [f"{d['bridge_inorder_s'] * 1e3:.0f}", f"{d['bridge_inorder_s'] / bound:.2f}",
            f"{cpu * 1e3:.0f}" if cpu else "", f"{d['bridge_inorder_s'] / equal:.2f}" if equal else "",
            str(d.get("most_in_stage2", ""))]


def report(res: dict[str, Any], markdown: bool) -> str:
    from _ranks import table

    rate = res["rate_bps"] / 8  # bytes/s each way
    link = res.get("link") or {}
    cores = res.get("cores", 0)
    first = res["all_reduce"][0] if res["all_reduce"] else {}
    lines = [f"link {res['rate']} (both ends tbf, bucket {res.get('bucket_ms', 1):g} ms, mtu {link.get('mtu', '?')}, "
             f"tcp mss {link.get('mss', '?')}), 2 nodes x 2 ranks (sim-nccl | sim-hccl), {cores} cores, "
             f"medians of calls {first.get('skipped', 1) + 1}-{first.get('calls', '?')}"]
    head = ["size", "link bound ms", "framed bound ms", "bridge auto ms", "/bound", "/framed", "auto chose",
            "node sent / size (interface)", "auto in order ms", "/framed", "leader ms", "bandwidth ms",
            "replicated ms", "flat gloo ms", "/bound"]
    rows = []
    for r in res["all_reduce"]:
        m, bound = r["median_s"], r["bytes"] / rate
        framed = _framed(r["bytes"], link) / rate
        sent = r.get("node_sent_bytes", {}).get("auto")
        chose = r["auto_chose"] + (f" x{r['segments']}" if r.get("segments", 1) > 1 else "")
        rows.append([f"{r['bytes'] >> 20} MiB", f"{bound * 1e3:.0f}", f"{framed * 1e3:.0f}", f"{m['auto'] * 1e3:.0f}",
                     f"{m['auto'] / bound:.2f}", f"{m['auto'] / framed:.2f}", chose,
                     f"{sent / r['bytes']:.3f}" if sent else "",
                     *((f"{m['in order'] * 1e3:.0f}", f"{m['in order'] / framed:.2f}") if "in order" in m else ("", "")),
                     *(f"{m[a] * 1e3:.0f}" for a in ALGORITHMS),
                     f"{m['flat'] * 1e3:.0f}", f"{m['flat'] / bound:.2f}"])
    lines.append(table(head, rows, markdown))
    lines.append("\n".join(f"auto ran, call by call ({r['bytes'] >> 20} MiB): " + " ".join(a[0] for a in r["auto_ran"])
                           for r in res["all_reduce"] if r.get("auto_ran")) + "  (l leader, b bandwidth, r replicated)")
    if not res["ddp"]:
        return "\n\n".join(lines)
    head = ["model", "grad MB", "compute ms", "grad/link ms", "bridge async ms", "/bound", "fwd+grad/link ms",
            "/that", "CPU ms/step: compute", "async", "sync", "flat gloo", "equal-work bound ms", "async /equal-work",
            "async in order ms", "/bound", "CPU ms/step", "/its equal-work", "in stage 2 at once",
            "bridge sync ms", "flat gloo ms", "async = in order = sync bits", "async vs gloo: diff/bound"]
    rows = []
    for name, d in res["ddp"].items():
        link_s = d["grad_bytes"] / rate
        bound = max(d["compute_s"], link_s)
        cpu = [d.get(k) for k in ("compute_cpu_s", "bridge_async_cpu_s", "bridge_sync_cpu_s", "flat_gloo_cpu_s")]
        # The equal-work bound: the step's work as the async bridge did it -- every rank's CPU
        # seconds (compute and communication) spread evenly over the machine's cores -- or the
        # gradients' frames on the link, whichever is longer.
        equal = max(cpu[1] / cores, _framed(d["grad_bytes"], link) / rate) if cores and cpu[1] else None
        rows.append([name, f"{d['grad_bytes'] / 1e6:.1f}", f"{d['compute_s'] * 1e3:.0f}", f"{link_s * 1e3:.0f}",
                     f"{d['bridge_async_s'] * 1e3:.0f}", f"{d['bridge_async_s'] / bound:.2f}",
                     *((f"{(d['forward_s'] + link_s) * 1e3:.0f}",
                        f"{d['bridge_async_s'] / max(bound, d['forward_s'] + link_s):.2f}") if "forward_s" in d else ("", "")),
                     *(f"{c * 1e3:.0f}" if c is not None else "" for c in cpu),
                     f"{equal * 1e3:.0f}" if equal else "", f"{d['bridge_async_s'] / equal:.2f}" if equal else "",
                     *_inorder_cells(d, bound, cores, link, rate),
                     f"{d['bridge_sync_s'] * 1e3:.0f}", f"{d['flat_gloo_s'] * 1e3:.0f}",
                     "yes" if d["async_vs_sync_bitwise"] and d.get("inorder_vs_sync_bitwise", True) else "NO",
                     f"{d['max_diff_over_bound']:.2g}" + ("" if d["within_bound"] else " (OVER)")])
    lines.append(table(head, rows, markdown))
    seg = [(name, m, v) for name, d in res["ddp"].items() for m, v in d.get("segments", {}).items()]
    if seg:
        lines.append(table(["model", "segments per bucket", "async bridge ms", "CPU ms/step (all ranks)",
                            "same bits as sync"],
                           [[name, str(m), f"{v['s'] * 1e3:.0f}", f"{v['cpu_s'] * 1e3:.0f}", "yes" if v["bitwise"] else "NO"]
                            for name, m, v in seg], markdown))
    return "\n\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1gbit,4gbit", help="link rates, tc notation, comma-separated")
    ap.add_argument("--sizes", default="1,4,16,64", help="all_reduce sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=6, help="all_reduce calls of each variant per size")
    ap.add_argument("--skip", type=int, default=1, help="the first calls of each variant left out of the medians")
    ap.add_argument("--bucket-ms", type=float, default=1.0,
                    help="tbf's bucket, in ms at the link's rate (1: the harness's default; 8: tc's burst 1mb "
                         "at 1 Gbit/s)")
    ap.add_argument("--ddp-steps", type=int, default=12, help="0: all_reduce only")
    ap.add_argument("--batch", type=int, default=128, help="MLP batch per rank")
    ap.add_argument("--ddp-segments", default="", help="also the MLP's DDP steps (async bridge) with every bucket "
                                                      "cut in each of these numbers of pipeline segments, e.g. 1,16")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--figures", help="write the auto group's measured link figures (of the first rate) here: "
                                      "`vcga info --plan --vendors nccl:2,hccl:2 --nodes 2 --figures FILE` reads it")
    ap.add_argument("--as-rank", help=argparse.SUPPRESS)  # set by the driver for the ranks under torchrun
    args = ap.parse_args()
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    args.ddp_segments = [int(s) for s in str(args.ddp_segments).split(",") if s]
    if args.as_rank:
        rank_main(args)
        return
    results = [run_rate(rate, args) for rate in args.rates.split(",")]
    for res in results:
        print(report(res, args.markdown), end="\n\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.figures:  # the calibration, its figures with what the auto group observed (vcga info --plan --observed)
        cal = results[0]["calibration"]
        if cal is not None and results[0].get("figures_now"):
            cal = {**cal, "figures": results[0]["figures_now"]}
        Path(args.figures).write_text(json.dumps(cal, indent=1))
    wrong = [f"{res['rate']} {name}: {what}" for res in results for name, d in res["ddp"].items()
             for what, ok in (("async and sync bridge parameters differ", d["async_vs_sync_bitwise"]),
                              ("async in order and sync bridge parameters differ", d.get("inorder_vs_sync_bitwise", True)),
                              ("ranks' parameters differ", d["identical_on_every_rank"]),
                              ("async bridge outside the derived bound of flat gloo", d["within_bound"]),
                              ("flat gloo differs from its recording run", d["flat_equals_recorded_ref"]),
                              *((f"{m} segments per bucket differ from sync", v["bitwise"])
                                for m, v in d.get("segments", {}).items())) if not ok]
    if wrong:
        raise SystemExit("parameter checks failed:\n  " + "\n  ".join(wrong))


if __name__ == "__main__":
    main()
