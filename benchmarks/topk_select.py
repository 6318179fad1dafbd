"""Top-k's selection: ``torch.topk`` on the whole gradient against the sampled narrowing that the
``topk`` compressor uses (plugins/compressors/__init__.py ``largest``), one CPU thread, side by side.

For each size and share kept: the median time of each over interleaved repetitions, their ratio,
and whether both selected the same values (the narrowing is exact; the table says so per row).

    .venv/bin/python benchmarks/topk_select.py                 # the table in docs/benchmarks.md
    .venv/bin/python benchmarks/topk_select.py --reps 5 --sizes 65536,4194304 --ratios 0.01

``--payload`` times the compressor's whole host payload instead (the selection, the ascending
indices and their values): the torch path (``largest``, then a sort or marks read back) against
the radix-select loop that float32 host tensors take, and whether both sent the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vcga.plugins.compressors import largest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="65536,1048576,4194304,25165824", help="elements per tensor, comma-separated")
    p.add_argument("--ratios", default="0.001,0.01,0.1", help="shares kept, comma-separated")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a rank's, in the benchmarks)")
    p.add_argument("--payload", action="store_true", help="the whole payload: torch path against the host loop")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.payload:
        payload(args)
        return
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.reps} interleaved repetitions")
    print("| elements | kept | torch.topk | narrowed | narrowed / topk | same values |")
    print("|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        a = torch.randn(n, generator=g).abs()  # what top-k selects on: |gradient + residual|
        for ratio in (float(r) for r in args.ratios.split(",")):
            k = max(1, round(ratio * n))
            whole, narrowed = [], []
            for _ in range(args.reps):  # interleaved: the machine's noise hits both alike
                t0 = time.perf_counter()
                ref = torch.topk(a, k, sorted=False).indices
                t1 = time.perf_counter()
                idx = largest(a, k)
                t2 = time.perf_counter()
                whole.append(t1 - t0)
                narrowed.append(t2 - t1)
            same = torch.equal(torch.sort(a[ref]).values, torch.sort(a[idx]).values)
            tw, tn = statistics.median(whole), statistics.median(narrowed)
            print(f"| {n:,} | {ratio:g} | {tw * 1e3:.2f} ms | {tn * 1e3:.2f} ms | {tn / tw:.2f} | {'yes' if same else 'NO'} |",
                  flush=True)


def payload(args: argparse.Namespace) -> None:
    from vcga.plugins.compressors import TopK, _select, _select_loop

    select = _select_loop()
    if select is None:
        raise SystemExit("the host loop is not in use here (numba missing, or VCGA_FUSED=0)")

    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.reps} interleaved repetitions")
    print("| elements | kept | torch path | radix-select loop | loop / torch path | same payload |")
    print("|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        x = torch.randn(n, generator=g)
        for ratio in (float(r) for r in args.ratios.split(",")):
            k = TopK(ratio, ef=True, server=False).k(n)
            ops, loop = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                want = TopK._compress_ops(x, k)
                t1 = time.perf_counter()
                got = _select(select, x, k)
                t2 = time.perf_counter()
                ops.append(t1 - t0)
                loop.append(t2 - t1)
            same = all(torch.equal(a, b) for a, b in zip(want, got, strict=False))
            to, tl = statistics.median(ops), statistics.median(loop)
            print(f"| {n:,} | {ratio:g} | {to * 1e3:.2f} ms | {tl * 1e3:.2f} ms | {tl / to:.2f} | {'yes' if same else 'NO'} |",
                  flush=True)


if __name__ == "__main__":
    main()
