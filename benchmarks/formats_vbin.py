"""vendor-bin against safetensors on the same tensors, in the same run, as median ratios.

Measures, with interleaved repetitions (the order alternates every repetition):

- write: ``vcga.formats.vbin.save_file`` (atomic: temporary, fsync, rename) against
  ``safetensors.torch.save_file`` (no fsync), and against save_file followed by an fsync (the same
  durability as vendor-bin);
- read: ``load_file`` then every byte of every tensor touched (XXH3 over each tensor's bytes, the
  cheapest full read there is), page cache warm and cold (pages dropped with POSIX_FADV_DONTNEED
  after an fsync, so both files come from the disk -- or from the hypervisor's cache on a VM, which
  makes the cold rows order-dependent there); vendor-bin with its default per-tensor checksum
  verification and with ``verify=False`` (the same work safetensors does);
- streaming-write peak RSS: a child process writes a 2 GiB checkpoint tensor by tensor (each
  tensor made, written, dropped) and reports its peak resident set; safetensors, which needs every
  tensor in memory at once, is measured the same way for comparison.

The tensor mix is 1 GiB: many 4 MiB tensors, some 256 KiB, some tiny, in fp32, bf16, fp16 and int64.

    .venv/bin/python benchmarks/formats_vbin.py                 # the run in docs/benchmarks.md
    .venv/bin/python benchmarks/formats_vbin.py --reps 3 --gib 0.25 --no-rss   # a quick look
    .venv/bin/python benchmarks/formats_vbin.py --dir /dev/shm/vcga-bench --no-rss --no-cold
        # memory only (tmpfs): no disk, fsync costs nothing -- the formats' own speed
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

from vcga.formats import vbin

MiB = 1 << 20


def make_mix(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """~``gib`` GiB: 93.75% in 4 MiB tensors, 6.25% in 256 KiB tensors, plus 64 tiny ones."""
    g = torch.Generator().manual_seed(seed)
    total = int(gib * 1024 * MiB)
    kinds = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    out: dict[str, torch.Tensor] = {}

    def make(nbytes: int, i: int) -> torch.Tensor:
        dt = kinds[i % len(kinds)]
        n = nbytes // torch.empty(0, dtype=dt).element_size()
        if dt is torch.int64:
            return torch.randint(-2**40, 2**40, (n,), generator=g, dtype=dt)
        return torch.randn(n, generator=g).to(dt)

    for i in range(int(total * 15 / 16) // (4 * MiB)):
        out[f"layers.{i}.weight"] = make(4 * MiB, i).reshape(-1, 1024)
    for i in range(int(total / 16) // (256 * 1024)):
        out[f"layers.{i}.norm"] = make(256 * 1024, i)
    for i in range(64):
        out[f"layers.{i}.bias"] = make(4 * (1 + i % 9), i)
    return out


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def touch(tensors: dict[str, torch.Tensor]) -> int:
    """Read every byte of every tensor (XXH3 over its bytes)."""
    acc = 0
    for t in tensors.values():
        acc ^= xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())
    return acc


def mapped_pass(path: Path) -> int:
    """XXH3 over a whole file through a fresh private mapping (one pass at memory speed when cached)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        view = memoryview(mm)
        try:
            return xxhash.xxh3_64_intdigest(view)
        finally:
            view.release()
    finally:
        mm.close()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_throughput(tensors: dict[str, torch.Tensor], reps: int, workdir: Path,
                     cold: bool = True) -> dict[str, list[float]]:
    vb, st = workdir / "mix.vbin", workdir / "mix.safetensors"
    res: dict[str, list[float]] = {k: [] for k in (
        "write vbin", "write safetensors", "write safetensors+fsync",
        "read vbin", "read vbin verify=False", "read safetensors",
        "cold read vbin", "cold read vbin verify=False", "cold read safetensors", "memory pass")}
    expect = touch(tensors)

    def write_vbin():
        vbin.save_file(tensors, vb)

    def write_st():
        st_save_file(tensors, str(st))

    def write_st_sync():
        st_save_file(tensors, str(st))
        fsync_path(st)

    def read(loader, cold):
        def run():
            d = loader()
            assert touch(d) == expect
        return run

    readers = {
        "vbin": lambda: vbin.load_file(vb),
        "vbin verify=False": lambda: vbin.load_file(vb, verify=False),
        "safetensors": lambda: st_load_file(str(st)),
    }
    for rep in range(reps):
        writes = [("write vbin", write_vbin), ("write safetensors", write_st),
                  ("write safetensors+fsync", write_st_sync)]
        if rep % 2:
            writes.reverse()
        for key, fn in writes:
            for p in (vb, st):
                p.unlink(missing_ok=True)
            os.sync()  # start every write from a clean page cache: nobody pays another's flush
            res[key].append(timed(fn))
            os.sync()
        # both files exist now (the last write of each kind); read them hot and cold
        if not vb.exists():
            write_vbin()
        if not st.exists():
            write_st()
        os.sync()
        order = list(readers.items()) if rep % 2 == 0 else list(reversed(readers.items()))
        # One XXH3 pass over the vendor-bin file's bytes through a fresh mapping (as the reader
        # maps it): what verifying every checksum adds to a warm read, independent of vbin's code.
        # (Not over the in-memory tensors: those sit on 4 KiB pages, the page cache's 2 MiB folios
        # are mapped with 2 MiB entries, and the pass over them is up to 2x faster.)
        res["memory pass"].append(timed(lambda: mapped_pass(vb)))
        for name, loader in order:
            timed(read(loader, False))  # warm: page cache holds the file
            res[f"read {name}"].append(timed(read(loader, False)))
        for name, loader in order if cold else ():
            gc.collect()  # no mapping of either file may survive: mapped pages cannot be dropped
            drop_cache(vb)
            drop_cache(st)
            res[f"cold read {name}"].append(timed(read(loader, True)))
        print(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in res.items() if v), flush=True)
    return res


RSS_CHILD = r"""
import json, os, sys
import numpy as np
framework = sys.argv[1]; path = sys.argv[2]; sizes = json.loads(sys.argv[3])
if framework == "torch":
    import torch
from vcga.formats import vbin
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
counter = 0
def make(n):
    global counter
    counter += 1
    a = np.full(n, counter % 251, dtype=np.uint8)  # exactly n bytes, every page touched, no temporaries
    return torch.from_numpy(a) if framework == "torch" else a
baseline = rss()
if framework == "safetensors":
    import torch
    from safetensors.torch import save_file
    baseline = rss()
    d = {f"t{i}": torch.from_numpy(make(n)) for i, n in enumerate(sizes)}
    save_file(d, path)
else:
    with vbin.VbinWriter(path) as w:
        for i, n in enumerate(sizes):
            t = make(n)
            w.add(f"t{i}", t)
            del t
# VmHWM is this process's own high-water mark; ru_maxrss would include the parent's resident set
# at fork time (Linux carries it across exec), which is not what we measure.
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"baseline": baseline, "peak": peak}))
"""


def bench_rss(workdir: Path, gib: float = 2.0) -> list[dict]:
    total = int(gib * 1024 * MiB)
    configs = {
        "64 x 32 MiB": [32 * MiB] * (total // (32 * MiB)),
        "mix, largest 256 MiB": [256 * MiB] * 2 + [64 * MiB] * 8 + [4 * MiB] * ((total - 1024 * MiB) // (4 * MiB)),
    }
    rows = []
    for name, sizes in configs.items():
        for framework in ("numpy", "torch", "safetensors"):
            if framework == "safetensors" and name != "64 x 32 MiB":
                continue
            path = workdir / f"rss-{framework}.out"
            out = subprocess.run([sys.executable, "-c", RSS_CHILD, framework, str(path), json.dumps(sizes)],
                                 capture_output=True, text=True, timeout=1200, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            path.unlink(missing_ok=True)
            r.update(config=name, framework=framework, largest=max(sizes), total=sum(sizes))
            rows.append(r)
            print(f"  rss {name} {framework}: peak {r['peak'] / MiB:.0f} MiB, baseline {r['baseline'] / MiB:.0f} MiB",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the tensor mix (default 1 GiB)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions (default 7)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory on /tmp's disk)")
    ap.add_argument("--no-rss", action="store_true", help="skip the streaming-write peak RSS measurement")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache reads (meaningless on tmpfs)")
    ap.add_argument("--json", default=None, help="also write the raw timings here")
    args = ap.parse_args()

    workdir = Path(args.dir or tempfile.mkdtemp(prefix="vcga-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"making the {args.gib:g} GiB mix ...", flush=True)
    tensors = make_mix(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    counts = {}
    for t in tensors.values():
        k = "4 MiB" if t.nbytes == 4 * MiB else "256 KiB" if t.nbytes == 256 * 1024 else "tiny"
        counts[k] = counts.get(k, 0) + 1
    print(f"{len(tensors)} tensors ({counts}), {nbytes / MiB:.1f} MiB, in {workdir}", flush=True)
    res = bench_throughput(tensors, args.reps, workdir, cold=not args.no_cold)
    med = {k: statistics.median(v) for k, v in res.items() if v}
    gb = nbytes / 1e9

    def row(what: str, ours: str, anchor: str) -> str:
        # Each repetition ran both sides back to back: the median of the paired ratios cancels
        # most of the drift a shared machine adds; the median throughputs are shown beside it.
        ratios = [a / o for o, a in zip(res[ours], res[anchor], strict=False)]
        return (f"| {what} | {gb / med[ours]:.2f} GB/s | {gb / med[anchor]:.2f} GB/s | "
                f"**{statistics.median(ratios):.2f}x** | {min(ratios):.2f}-{max(ratios):.2f} |")

    lines = [
        f"| {args.gib:g} GiB mix, {args.reps} interleaved repetitions | vendor-bin (median) | "
        "safetensors (median) | speed ratio vbin/safetensors (median of paired reps) | range |",
        "|---|---|---|---|---|",
        row("write (vbin durable; safetensors save_file)", "write vbin", "write safetensors"),
        row("write (both durable: safetensors + fsync)", "write vbin", "write safetensors+fsync"),
        row("read, warm cache (vbin verifies checksums)", "read vbin", "read safetensors"),
        row("read, warm cache (vbin verify=False)", "read vbin verify=False", "read safetensors"),
    ]
    if not args.no_cold:
        lines += [
            row("read, cold cache (vbin verifies checksums)", "cold read vbin", "cold read safetensors"),
            row("read, cold cache (vbin verify=False)", "cold read vbin verify=False", "cold read safetensors"),
        ]
    # A verified read does the consumer's pass plus one more pass over the same bytes, so against a
    # reader that verifies nothing its ratio cannot exceed T_safetensors / (T_safetensors + T_pass).
    ceiling = [s / (s + m) for s, m in zip(res["read safetensors"], res["memory pass"], strict=False)]
    lines += ["", "One XXH3 pass over the vendor-bin file through a fresh mapping (page cache warm): "
              f"median {med['memory pass']:.3f} s "
              f"({gb / med['memory pass']:.2f} GB/s). Ceiling for a warm read that verifies every checksum "
              f"against one that verifies nothing: T_st / (T_st + T_pass) = **{statistics.median(ceiling):.2f}x** "
              f"(range {min(ceiling):.2f}-{max(ceiling):.2f})."]
    rss_rows = [] if args.no_rss else bench_rss(workdir)
    if rss_rows:
        lines += ["", "| 2 GiB written tensor by tensor | writer | peak RSS | baseline RSS (imports, "
                  "before the first tensor) | peak - baseline | largest tensor + 100 MiB | peak within | "
                  "peak - baseline within |", "|---|---|---|---|---|---|---|---|"]
        for r in rss_rows:
            bound = r["largest"] + 100 * MiB
            who = ("safetensors save_file (needs every tensor in memory)" if r["framework"] == "safetensors"
                   else f"vbin VbinWriter, {r['framework']} tensors")
            lines.append(f"| {r['config']} | {who} | {r['peak'] / MiB:.0f} MiB | {r['baseline'] / MiB:.0f} MiB "
                         f"| {(r['peak'] - r['baseline']) / MiB:.0f} MiB | {bound / MiB:.0f} MiB "
                         f"| {'yes' if r['peak'] <= bound else 'no'} "
                         f"| {'yes' if r['peak'] - r['baseline'] <= bound else 'no'} |")
    print("\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"timings": res, "rss": rss_rows, "bytes": nbytes}, indent=1))
    for p in workdir.glob("mix.*"):
        p.unlink()


if __name__ == "__main__":
    main()
