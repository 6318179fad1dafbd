"""A DDP job that hangs the way real ones do -- one rank's data runs out a step early -- for
docs/debugging.md::

    VCGA_SIM_VENDORS=nccl:2,hccl:2 VCGA_TIMEOUT=20 VCGA_TRACE_DIR=/tmp/hang \\
        torchrun --standalone --nproc-per-node 4 examples/debug_hang.py --short-rank 3 --trace /tmp/hang/step

Every rank trains ``--steps`` steps of DDP on backend ``vcga`` (four ranks: two simulated NCCL,
two simulated HCCL, a mixed-vendor group) and then meets the others at a barrier. The rank
``--short-rank`` has one batch fewer: it skips the last step -- and with it that step's gradient
all_reduces -- and waits at the barrier while the others wait in the all_reduce. Every rank times
out (``VCGA_TIMEOUT``), prints what it raised, and its flight recorder is dumped into
``VCGA_TRACE_DIR``; ``vcga trace $VCGA_TRACE_DIR`` then says who left what out.

``--trace PREFIX`` profiles step 1 (a healthy one) on every rank, every thread, and writes
``PREFIX<rank>.json`` (Chrome trace, the bridge's steps linked to their all_reduce);
examples/trace_timeline.py draws one as a PNG.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import vcga  # noqa: F401 - registers backend "vcga"
from vcga.errors import VcgaError, VcgaTimeoutError


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)) for _ in range(steps)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--short-rank", type=int, default=None, help="this rank gets one batch fewer")
    p.add_argument("--trace", metavar="PREFIX", help="profile step 1; write PREFIX<rank>.json")
    args = p.parse_args()

    dist.init_process_group("vcga")
    rank = dist.get_rank()
    net = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = batches(rank, args.steps - (rank == args.short_rank))
    try:
        for step, (x, y) in enumerate(data):
            prof = None
            if args.trace and step == 1:
                from torch._C._profiler import _ExperimentalConfig

                prof = torch.profiler.profile(record_shapes=True,
                                              experimental_config=_ExperimentalConfig(profile_all_threads=True))
                prof.start()
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()  # DDP all_reduces every bucket's gradients
            opt.step()
            if prof is not None:
                prof.stop()
                from vcga.profiling import export_chrome_trace

                export_chrome_trace(prof, f"{args.trace}{rank}.json")
        dist.barrier()
    except VcgaTimeoutError as e:  # also torch.distributed.DistBackendError
        print(f"rank {rank} raised {type(e).__name__}: {str(e).split('; ')[0]}", flush=True)
        return 1
    except VcgaError as e:
        print(f"rank {rank} raised {type(e).__name__}: {e}", flush=True)
        return 1
    dist.destroy_process_group()
    print(f"rank {rank}: {len(data)} steps, done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
