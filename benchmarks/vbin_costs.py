"""Where vendor-bin's time goes: the experiments behind docs/vendor-bin.md, "Piece sizes and access patterns".

Three measurements, each printed as a small table (medians over interleaved repetitions):

- ``hash``: checksum speed on a cache-hot 2 MiB buffer and on a 1 GiB buffer (from memory), and
  1 GiB split over two threads (python-xxhash releases the GIL above 64 KiB, so the threads can run
  at once). XXH3-64 is what vendor-bin uses; CRC32C (``crc32c``) and ISA-L's CRC32 (``isal``) are
  measured when installed (they are not VCGA dependencies).
- ``read``: a 1 GiB file written in 256 KiB, 2 MiB or 4 MiB pieces, read warm through a fresh
  private mapping with one XXH3 pass: plain faulting, ``MADV_POPULATE_READ`` first, or
  ``MADV_HUGEPAGE`` first; and how much of the mapping the kernel mapped with 2 MiB entries
  (``FilePmdMapped`` in /proc/self/smaps).
- ``write``: safetensors ``save_file`` against vendor-bin ``save_file`` as shipped, with its
  checksums computed by a helper thread that overlaps hashing piece N with writing piece N+1, and
  with no checksum at all (an ablation: that file could not be verified; it only shows what the
  hash costs).

    .venv/bin/python benchmarks/vbin_costs.py                       # all three, files in /dev/shm
    .venv/bin/python benchmarks/vbin_costs.py --only write --dir /tmp/i6  # writes on disk
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
MiB = 1 << 20
MADV_POPULATE_READ = 22  # linux/mman.h, Linux >= 5.14 (Python 3.11's mmap module lacks the name)


def best_rate(fn, buf, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(buf)
        times.append(time.perf_counter() - t0)
    return buf.nbytes / statistics.median(times) / 1e9


def bench_hash(reps: int) -> None:
    big = np.random.default_rng(0).integers(0, 255, 1 << 30, dtype=np.uint8)
    hot = big[: 2 * MiB]
    fns = {"XXH3-64 (xxhash, vendor-bin's)": xxhash.xxh3_64_intdigest}
    try:
        import crc32c

        fns["CRC32C (crc32c, SSE4.2)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        fns["CRC32 (isal, VPCLMULQDQ)"] = isal_zlib.crc32
    except ImportError:
        pass
    print("| checksum | 2 MiB, cache-hot | 1 GiB, from memory | 1 GiB, 1 thread | 1 GiB, 2 threads |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in fns.items():
        halves = [big[: 1 << 29], big[1 << 29:]]
        one, two = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            for h in halves:
                fn(h)
            one.append(time.perf_counter() - t0)
            threads = [threading.Thread(target=fn, args=(h,)) for h in halves]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            two.append(time.perf_counter() - t0)
        print(f"| {name} | {best_rate(fn, hot, reps * 50):.1f} GB/s | {best_rate(fn, big, reps):.1f} GB/s "
              f"| {statistics.median(one) * 1e3:.0f} ms | {statistics.median(two) * 1e3:.0f} ms |")


def _pmd_mapped_kib(addr: int) -> int:
    """FilePmdMapped of the mapping that starts at ``addr`` (kB, from /proc/self/smaps)."""
    mine = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                mine = int(head.split("-")[0], 16) == addr
            elif mine and head == "FilePmdMapped:":
                return int(line.split()[1])
    return 0


def bench_read(workdir: Path, reps: int) -> None:
    src = np.random.default_rng(1).integers(0, 255, 1 << 30, dtype=np.uint8)
    pieces = [256 * 1024, 2 * MiB, 4 * MiB]
    paths = {}
    for piece in pieces:
        path = workdir / f"read-{piece}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for s in range(0, src.nbytes, piece):
                os.pwrite(fd, memoryview(src)[s:s + piece], s)
            os.fsync(fd)
        finally:
            os.close(fd)
        paths[piece] = path
    del src

    def read(path: Path, advice: int | None) -> tuple[float, int]:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # as vendor-bin's reader maps
        a = np.frombuffer(mm, dtype=np.uint8)
        t0 = time.perf_counter()
        if advice is not None:
            mm.madvise(advice)
        xxhash.xxh3_64_intdigest(a)
        dt = time.perf_counter() - t0
        pmd = _pmd_mapped_kib(a.ctypes.data)
        del a
        mm.close()
        return dt, pmd

    modes = {"fault": None, "MADV_POPULATE_READ": MADV_POPULATE_READ,
             "MADV_HUGEPAGE": getattr(mmap, "MADV_HUGEPAGE", 14)}
    res: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for rep in range(reps):
        for piece in pieces if rep % 2 == 0 else pieces[::-1]:
            for mode, advice in modes.items():
                read(paths[piece], advice)  # warm the page cache
                res.setdefault((piece, mode), []).append(read(paths[piece], advice))
    print("| file written in | first pass over a fresh mapping | median | mapped with 2 MiB entries |")
    print("|---|---|---:|---:|")
    for (piece, mode), v in res.items():
        print(f"| {piece // 1024} KiB pieces | {mode} | {statistics.median(x[0] for x in v) * 1e3:.0f} ms "
              f"| {v[-1][1] // 1024} of 1024 MiB |")
    for p in paths.values():
        p.unlink()


class _NoHash:
    """Ablation only: a 'hasher' that hashes nothing (the file it writes cannot be verified)."""

    def update(self, data: object) -> None:
        pass

    def intdigest(self) -> int:
        return 0


class _ThreadedHash:
    """XXH3 computed by a helper thread: update() returns at once, so the writer's next write()
    (which releases the GIL) overlaps with hashing the piece before it."""

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vbin-hash")

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self._pending: concurrent.futures.Future | None = None

    def update(self, data: object) -> None:
        if self._pending is not None:
            self._pending.result()
        self._pending = self.pool.submit(self._h.update, data)

    def intdigest(self) -> int:
        if self._pending is not None:
            self._pending.result()
        return self._h.intdigest()


def bench_write(workdir: Path, reps: int, gib: float) -> None:
    import torch  # noqa: F401 - the mix is torch tensors
    from formats_vbin import make_mix
    from safetensors.torch import save_file as st_save_file

    from vcga.formats import vbin
    from vcga.formats.vbin import writer as vbin_writer  # the module whose xxhash VbinWriter uses

    tensors = make_mix(gib)
    nbytes = sum(t.nbytes for t in tensors.values())
    real = vbin_writer.xxhash

    def with_hasher(factory):
        def run() -> None:
            vbin_writer.xxhash = types.SimpleNamespace(xxh3_64=factory, xxh3_64_intdigest=real.xxh3_64_intdigest)
            try:
                vbin.save_file(tensors, workdir / "w.vbin")
            finally:
                vbin_writer.xxhash = real
        return run

    variants = {
        "safetensors save_file": lambda: st_save_file(tensors, str(workdir / "w.safetensors")),
        "vendor-bin save_file (as shipped)": with_hasher(real.xxh3_64),
        "vendor-bin, XXH3 in a helper thread": with_hasher(_ThreadedHash),
        "vendor-bin, no checksum (ablation)": with_hasher(_NoHash),
    }
    res: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(reps):
        for name, fn in variants.items() if rep % 2 == 0 else reversed(variants.items()):
            for p in workdir.glob("w.*"):
                p.unlink()
            os.sync()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            res[name].append(time.perf_counter() - t0)
    for p in workdir.glob("w.*"):
        p.unlink()
    anchor = res["safetensors save_file"]
    print(f"| {gib:g} GiB mix in {workdir}, {reps} reps | median | GB/s "
          "| speed vs safetensors (median of paired reps) | range |")
    print("|---|---:|---:|---:|---:|")
    for name, v in res.items():
        r = [a / b for a, b in zip(anchor, v, strict=False)]
        print(f"| {name} | {statistics.median(v) * 1e3:.0f} ms | {nbytes / statistics.median(v) / 1e9:.2f} "
              f"| {statistics.median(r):.2f}x | {min(r):.2f}-{max(r):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["hash", "read", "write"], default=None)
    ap.add_argument("--dir", default=None, help="where files go (default: a new directory in /dev/shm)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the write mix")
    args = ap.parse_args()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="vcga-costs-", dir="/dev/shm"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs\n")
    if args.only in (None, "hash"):
        bench_hash(args.reps)
        print()
    if args.only in (None, "read"):
        bench_read(workdir, args.reps)
        print()
    if args.only in (None, "write"):
        bench_write(workdir, args.reps, args.gib)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
