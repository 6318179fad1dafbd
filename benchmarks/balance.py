"""Balanced data parallelism across chips of different speeds: equal shares, ``"auto"`` and a hand
split from the true speeds, against the ideal.

Each job is a ``torchrun --standalone`` launch of fresh interpreters, as a user starts one, on a
mixed world of simulated vendors (``VCGA_SIM_VENDORS``), backend ``vcga``, one CPU thread per rank,
DDP with plain SGD, global batch 384. Every variant runs in the same job, in rounds (the machine is
shared, so the variants share its noise):

- ``alone``: every rank trains its own copy, without DDP or any communication, at the batch the
  hand split gives it -- all ranks at once, so they contend for the host as in the job. The sum
  of their throughputs is the **ideal**: every chip busy all the time, nothing waiting.
- ``equal``: DDP, ``global_batch / n`` per rank (what ``DistributedSampler`` gives);
- ``hand``: DDP, the global batch split in proportion to the true speeds (largest remainder);
- ``auto``: DDP with ``Balancer(shares="auto")`` from equal shares; timed after ``--settle`` steps.

**How a chip, and a slow one, is simulated.** Each step runs a real model on the host -- an MLP
(64 → 128 → 128 → 16, ReLU, cross-entropy) on ``--tokens`` vectors per sample, its gradients
all-reduced by DDP through the vcga bridge -- and the chip's compute as a wait: ``--device-us``
microseconds per sample (default 200) at speed 1. A rank of speed ``s`` takes ``1/s`` as long for
both: at the end of its backward -- after every gradient is computed, before autograd hands the
first layer's gradients (DDP's last bucket) on -- it sleeps until ``(device + host) / s`` has
passed since its forward began (``device`` = its samples x ``--device-us``, ``host`` = the real
forward and backward). Its peers wait for it in DDP's reduction as for a slower chip, and
``measure()`` sees it as it would see a slower chip. What it models: an accelerator whose kernels
take a fixed time per sample while the host thread waits (the host is idle then, so simulated
compute adds no CPU contention on this 2-core machine, shared with other work); the host's own
work -- framework, the real model, the all_reduce -- is real and is what the machine's load
disturbs. ``--device-us 0`` leaves only the real compute (stretched by ``1/s`` the same way).

``--configs slowdown``: two ranks at speed 1; in the ``auto`` run rank 1 drops to 0.5 at step
``--slow-at`` (thermal throttling), and the 20 steps that begin 20 steps later are timed, against
``hand`` from the new speeds.

Usage::

    python benchmarks/balance.py --markdown             # the table in docs/benchmarks.md
    python benchmarks/balance.py --configs two --jobs 1  # one quick job
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = {
    # name: (vendors, speeds before, speeds after the slowdown or None)
    "two": ("nccl:1,hccl:1", (1.0, 0.5), None),
    "three": ("nccl:1,hccl:1,cncl:1", (1.0, 0.5, 0.25), None),
    "slowdown": ("nccl:1,hccl:1", (1.0, 1.0), (1.0, 0.5)),
}
D, H, C = 64, 128, 16
N = 384 * 16


# ---------------------------------------------------------------------------------------------------
# The rank (under torchrun)
# ---------------------------------------------------------------------------------------------------


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import vcga  # noqa: F401 - registers backend "vcga"
    from vcga.balance import Balancer, split_counts

    torch.set_num_threads(1)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        if os.environ.get("LOCAL_RANK") == "0":
            logging.getLogger("vcga.balance").setLevel(logging.DEBUG)
    dist.init_process_group("vcga")
    rank, n = dist.get_rank(), dist.get_world_size()
    vendors, speeds, after = CONFIGS[args.config]
    B = args.global_batch
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(N, args.tokens, D, generator=g), torch.randint(0, C, (N,), generator=g)
    speed = [speeds[rank]]

    class Stall(torch.autograd.Function):
        """Identity on the first layer's parameters; in backward, the slow chip's extra time."""

        @staticmethod
        def forward(ctx: Any, *ps: torch.Tensor) -> Any:
            return tuple(p.view_as(p) for p in ps)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            real = time.perf_counter() - net_start[0]
            device = args.device_us * 1e-6 * net_rows[0]
            time.sleep(max(0.0, (device + real) / speed[0] - real))
            return grads

    net_start, net_rows = [0.0], [0]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            net_start[0], net_rows[0] = time.perf_counter(), x.shape[0]
            w, b = Stall.apply(self.fc1.weight, self.fc1.bias)
            h = torch.relu(nn.functional.linear(x, w, b))
            return self.fc3(torch.relu(self.fc2(h))).mean(1)  # the sequence's tokens pooled

    def make(ddp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = Net()
        model = nn.parallel.DistributedDataParallel(net) if ddp else net
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def step(model: nn.Module, opt: torch.optim.Optimizer, idx: list[int], scale: float,
             balancer: Any = None) -> None:
        x, y = X[idx], Y[idx]
        ctx = balancer.measure(model) if balancer is not None else _Null()
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y, reduction="sum") * scale
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def alone_for(steps: int) -> float:
        """This rank's own time for ``steps`` steps, all ranks starting together (no wait at the end)."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(model, opt, idx, 1.0)
        secs = time.perf_counter() - t0
        dist.barrier()
        return secs

    hand = split_counts(B, list(speeds))
    hand_after = split_counts(B, list(after)) if after else None
    out: dict[str, list[Any]] = {}

    def ddp_run(shares: Any, steps: int, settle: int = 3, slow_at: int | None = None,
                window: tuple[int, int] | None = None) -> tuple[float, list[int]]:
        model, opt = make(True)
        balancer = Balancer(N, B, shares, seed=1)
        it = _forever(balancer)
        total = settle + steps if window is None else window[1]
        times: list[float] = []
        dist.barrier()
        for s in range(total):
            if slow_at is not None and s == slow_at:
                speed[0] = after[rank]
            if window is not None and s == window[0] or window is None and s == settle:
                dist.barrier()
                t0 = time.perf_counter()
            step(model, opt, next(it), balancer.loss_scale, balancer)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        timed_steps = steps if window is None else window[1] - window[0]
        speed[0] = speeds[rank]
        return timed_steps * B / times[0], balancer.shares

    for _ in range(args.rounds):
        if after is None:
            model, opt = make(False)
            mine = hand[rank]
            idx = list(range(mine))
            for _ in range(3):
                step(model, opt, idx, 1.0)
            secs = alone_for(args.steps)
            alone: list[Any] = [None] * n
            dist.all_gather_object(alone, args.steps * mine / secs)
            out.setdefault("alone", []).append(sum(alone))
            out.setdefault("equal", []).append(ddp_run(split_counts(B, [1.0] * n), args.steps)[0])
            out.setdefault("hand", []).append(ddp_run(hand, args.steps)[0])
            tput, shares = ddp_run("auto", args.steps, settle=args.settle)
            out.setdefault("auto", []).append(tput)
            out.setdefault("auto_shares", []).append(shares)
        else:
            speed[0] = after[rank]
            out.setdefault("hand_after", []).append(ddp_run(hand_after, 20)[0])
            speed[0] = speeds[rank]
            s = args.slow_at
            tput, shares = ddp_run("auto", 0, slow_at=s, window=(s + 20, s + 40))
            out.setdefault("auto_after", []).append(tput)
            out.setdefault("auto_shares", []).append(shares)
    if rank == 0:
        out["hand_shares"] = [hand_after or hand]
        out["load"] = [os.getloadavg()[0]]
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _forever(balancer: Any) -> Any:
    """The balancer's steps across epochs (``set_epoch`` at each new one)."""
    while True:
        yield from balancer
        balancer.set_epoch(balancer.epoch + 1)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------


def _job(config: str, args: argparse.Namespace) -> dict[str, Any]:
    vendors, speeds, _ = CONFIGS[config]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "VCGA_SIM_VENDORS": vendors, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(len(speeds)),
               "--log-dir", str(Path(tmp) / "torchrun"),
               __file__, "--as-rank", "--config", config, "--out", str(out), "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--settle", str(args.settle), "--slow-at", str(args.slow_at),
               "--global-batch", str(args.global_batch), "--device-us", str(args.device_us),
               "--tokens", str(args.tokens)] + (["--verbose"] if args.verbose else [])
        load = os.getloadavg()[0]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if args.verbose:
            print(r.stdout + "\n".join(x for x in r.stderr.splitlines() if "vcga.balance" in x), flush=True)
        if r.returncode != 0:
            raise SystemExit(f"{config}: the job failed\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        got = json.loads(out.read_text())
        got["load"].append(load)
        return got


def _median(jobs: list[dict[str, Any]], key: str) -> float:
    """The median over every round of every job."""
    return statistics.median(x for j in jobs for x in j[key])


def _ratio(jobs: list[dict[str, Any]], num: str, den: str, spread: bool = False) -> str:
    """The median of ``num / den`` taken within each round (seconds apart: the load they saw is alike),
    with ``spread`` its range over the rounds."""
    r = [a / b for j in jobs for a, b in zip(j[num], j[den], strict=True)]
    return f"{statistics.median(r):.2f}" + (f" ({min(r):.2f}-{max(r):.2f})" if spread else "")


def _shares(jobs: list[dict[str, Any]]) -> str:
    """Each rank's median of the shares "auto" ended with, over every round."""
    ends = [s for j in jobs for s in j["auto_shares"]]
    return "/".join(str(round(statistics.median(s[r] for s in ends))) for r in range(len(ends[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--jobs", type=int, default=3, help="torchrun jobs per configuration (medians reported)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every variant within a job")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    ap.add_argument("--settle", type=int, default=30, help="auto: steps before timing (calibration, re-balancing)")
    ap.add_argument("--slow-at", type=int, default=20, help="--slowdown: the step at which rank 1 halves its speed")
    ap.add_argument("--global-batch", type=int, default=384)
    ap.add_argument("--device-us", type=float, default=200.0,
                    help="simulated device time per sample at speed 1, in microseconds (0: real CPU compute only)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per sample (the real compute per sample)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print rank 0's re-balancing decisions")
    ap.add_argument("--json", help="write every job's figures here")
    ap.add_argument("--tabulate", nargs="+", metavar="JSON", help="print the table of saved runs (--json) together")
    ap.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.as_rank:
        _rank(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _ranks import table

    if args.tabulate:  # several runs' --json, one table
        results: dict[str, list[dict[str, Any]]] = {}
        for path in args.tabulate:
            for c, jobs in json.loads(Path(path).read_text()).items():
                results.setdefault(c, []).extend(jobs)
        args.jobs = len(next(iter(results.values())))
    else:
        results = {c: [_job(c, args) for _ in range(args.jobs)] for c in args.configs}
    lines = []
    for c, jobs in results.items():
        vendors, speeds, after = CONFIGS[c]
        loads = [x for j in jobs for x in j["load"]]
        load = f"{min(loads):.1f}-{max(loads):.1f}"
        if after is None:
            alone, equal, hand, auto = (_median(jobs, k) for k in ("alone", "equal", "hand", "auto"))
            lines.append([f"{len(speeds)} ranks, speeds {'/'.join(f'{s:g}' for s in speeds)}", f"{alone:,.0f}",
                          f"{equal:,.0f}", f"{hand:,.0f} ({'/'.join(map(str, jobs[0]['hand_shares'][0]))})",
                          f"{auto:,.0f} ({_shares(jobs)})", _ratio(jobs, "auto", "alone", True),
                          _ratio(jobs, "auto", "hand", True), _ratio(jobs, "hand", "equal"),
                          _ratio(jobs, "auto", "equal"), load])
        else:
            hand, auto = _median(jobs, "hand_after"), _median(jobs, "auto_after")
            lines.append([f"2 ranks, 1/1, rank 1 -> 0.5 at step {args.slow_at}", "-", "-",
                          f"{hand:,.0f} ({'/'.join(map(str, jobs[0]['hand_shares'][0]))})",
                          f"{auto:,.0f} ({_shares(jobs)})", "-", _ratio(jobs, "auto_after", "hand_after", True),
                          "-", "-", load])
    head = ["world", "ideal (alone, summed)", "equal", "hand (shares)", "auto (shares at the end)", "auto/ideal",
            "auto/hand", "hand/equal", "auto/equal", "load (1 min)"]
    print(table(head, lines, args.markdown))
    print(f"samples/s: medians over {args.jobs} jobs x {args.rounds} rounds; ratios: medians of the ratios within "
          f"each round; global batch {args.global_batch}, "
          f"{args.steps} timed steps per variant (auto after {args.settle}; the slowdown: steps "
          f"{args.slow_at + 20}-{args.slow_at + 39})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
