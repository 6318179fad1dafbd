"""VCGA's MindRecord and .ckpt readers and writers against MindSpore's own, same data, same run.

The data: 128 float32 tensors of 4 MiB (512 MiB), stored as ``{name, dtype, shape, data}`` records
(MindRecord) and as Parameters (.ckpt). MindSpore runs in its own interpreter (it is never a VCGA
dependency): each repetition starts ``<mindspore python> benchmarks/formats_mindspore.py --anchor``,
which times

- ``FileWriter.write_raw_data`` (16 records per call) + ``commit``, and ``FileReader.get_next`` over every row;
- ``save_checkpoint`` of prebuilt Tensors, and ``load_checkpoint``;

and leaves its files. VCGA, in this process, times its writers on the same tensors (before the anchor
in odd repetitions, after it in even ones) and its readers on MindSpore's files (so both readers read
the very same bytes). Throughputs are medians in GB/s (1e9 bytes); each ratio is the median over repetitions of
that repetition's MindSpore time / VCGA time, with its range.

Writes: VCGA's writers are atomic (temporary, fsync, rename); MindSpore's do not fsync. Both are
reported: against MindSpore as it is, and against MindSpore followed by an fsync of its files (the same
durability). Reads: page cache warm (right after writing) and cold (pages dropped with
POSIX_FADV_DONTNEED after an fsync, before each reader runs).

    .venv/bin/python benchmarks/formats_mindspore.py                      # the run in docs/benchmarks.md
    .venv/bin/python benchmarks/formats_mindspore.py --reps 1 --mib 64    # a quick look
    VCGA_MINDSPORE_PYTHON=/path/to/python ...                             # where MindSpore 2.10 lives
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

import numpy as np

MiB = 1 << 20
TENSOR_BYTES = 4 * MiB
DEFAULT_MINDSPORE_PYTHON = "/work/venvs/mindspore/bin/python"


def make_tensors(total_mib: int) -> list[tuple[str, np.ndarray]]:
    """Deterministic float32 tensors of 4 MiB (both interpreters build the same bytes)."""
    n = TENSOR_BYTES // 4
    base = np.arange(n, dtype=np.float32)
    return [(f"layers.{i}.weight", (base * np.float32(1.0 + i / 128)).reshape(1024, n // 1024))
            for i in range(total_mib * MiB // TENSOR_BYTES)]


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_files(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def mindrecord_files(d: Path, stem: str) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(stem))


# ---------------------------------------------------------------------------------------------------
# The anchor: MindSpore 2.10 (runs under MindSpore's interpreter; imports no VCGA code)
# ---------------------------------------------------------------------------------------------------


def anchor(work: Path, total_mib: int, cold: bool) -> dict[str, float]:
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindspore.mindrecord import FileReader, FileWriter

    tensors = make_tensors(total_mib)
    rows = [{"name": n, "dtype": "float32", "shape": np.array(a.shape, dtype=np.int64), "data": a.tobytes()}
            for n, a in tensors]
    out: dict[str, float] = {}

    mr = work / "ms.mindrecord"
    t0 = time.perf_counter()
    w = FileWriter(str(mr), shard_num=1, overwrite=True)
    w.add_schema({"name": {"type": "string"}, "dtype": {"type": "string"},
                  "shape": {"type": "int64", "shape": [-1]}, "data": {"type": "bytes"}}, "bench")
    for i in range(0, len(rows), 16):
        w.write_raw_data(rows[i:i + 16])
    w.commit()
    out["mindrecord_write"] = time.perf_counter() - t0
    files = mindrecord_files(work, "ms.mindrecord")
    t0 = time.perf_counter()
    fsync_files(files)
    out["mindrecord_fsync"] = time.perf_counter() - t0
    del rows

    def read_mr() -> float:
        t0 = time.perf_counter()
        r = FileReader(str(mr))
        n = sum(len(row["data"]) for row in r.get_next())
        r.close()
        dt = time.perf_counter() - t0
        assert n == total_mib * MiB, n
        return dt

    out["mindrecord_read_warm"] = read_mr()
    if cold:
        drop_cache(files)
        out["mindrecord_read_cold"] = read_mr()

    params = [{"name": n, "data": ms.Tensor(a)} for n, a in tensors]
    ck = work / "ms.ckpt"
    t0 = time.perf_counter()
    ms.save_checkpoint(params, str(ck))
    out["ckpt_write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fsync_files([ck])
    out["ckpt_fsync"] = time.perf_counter() - t0
    del params

    def read_ck() -> float:
        t0 = time.perf_counter()
        d = ms.load_checkpoint(str(ck))
        n = sum(p.asnumpy().nbytes for p in d.values())
        dt = time.perf_counter() - t0
        assert n == total_mib * MiB, n
        return dt

    out["ckpt_read_warm"] = read_ck()
    if cold:
        drop_cache([ck])
        out["ckpt_read_cold"] = read_ck()
    return out


# ---------------------------------------------------------------------------------------------------
# VCGA
# ---------------------------------------------------------------------------------------------------


def ours_write(work: Path, tensors) -> dict[str, float]:
    from vcga.contract import TensorEntry
    from vcga.formats import mindrecord, mindspore_ckpt

    entries = [TensorEntry(n, "float32", a.shape, memoryview(a).cast("B")) for n, a in tensors]
    out: dict[str, float] = {}
    for key, open_writer, path in (("mindrecord_write", mindrecord.open_writer, work / "vcga.mindrecord"),
                                   ("ckpt_write", mindspore_ckpt.open_writer, work / "vcga.ckpt")):
        t0 = time.perf_counter()
        with open_writer(path) as w:
            for e in entries:
                w.write(e)
        out[key] = time.perf_counter() - t0
    return out


def ours_read(work: Path, total_mib: int, cold: bool) -> dict[str, float]:
    """VCGA's readers on MindSpore's files: the very bytes MindSpore's readers read."""
    from vcga.formats import mindrecord, mindspore_ckpt

    out: dict[str, float] = {}
    for key, open_reader, path, files in (
            ("mindrecord_read", mindrecord.open_reader, work / "ms.mindrecord", mindrecord_files(work, "ms.mindrecord")),
            ("ckpt_read", mindspore_ckpt.open_reader, work / "ms.ckpt", [work / "ms.ckpt"])):
        for state in ("warm", "cold") if cold else ("warm",):
            if state == "cold":
                drop_cache(files)
            t0 = time.perf_counter()
            with open_reader(path) as r:
                n = sum(len(e.data) for e in r.entries())
            out[f"{key}_{state}"] = time.perf_counter() - t0
            assert n == total_mib * MiB, n
    return out


def check_same_bytes(work: Path, tensors) -> None:
    """VCGA reads MindSpore's files back as exactly the tensors both sides wrote."""
    from vcga.formats import mindrecord, mindspore_ckpt

    want = {n: a.tobytes() for n, a in tensors}
    for open_reader, path in ((mindrecord.open_reader, work / "ms.mindrecord"),
                              (mindspore_ckpt.open_reader, work / "ms.ckpt"),
                              (mindrecord.open_reader, work / "vcga.mindrecord"),
                              (mindspore_ckpt.open_reader, work / "vcga.ckpt")):
        with open_reader(path) as r:
            got = {e.name: bytes(e.data) for e in r.entries()}
        assert got == want, f"{path.name} does not hold the benchmark tensors"


def report(runs: dict[str, dict[str, list[float]]], mib: int, cold: bool) -> None:
    """Print the table. Throughputs are medians; a ratio is the median over repetitions of that
    repetition's MindSpore time / VCGA time (the two sides of a repetition run back to back, so
    load that comes and goes on the machine affects both), with its smallest and largest value."""
    ms, vc = runs["mindspore"], runs["vcga"]
    n = len(vc["ckpt_write"])

    def ms_time(key: str, fsync: bool = False) -> list[float]:
        return [a + b for a, b in zip(ms[key], ms[key.replace("write", "fsync")], strict=False)] if fsync else ms[key]

    rows = [
        ("MindRecord write (MindSpore without fsync)", ms_time("mindrecord_write"), vc["mindrecord_write"]),
        ("MindRecord write (MindSpore + fsync)", ms_time("mindrecord_write", True), vc["mindrecord_write"]),
        ("MindRecord read, page cache warm", ms["mindrecord_read_warm"], vc["mindrecord_read_warm"]),
        (".ckpt write (MindSpore without fsync)", ms_time("ckpt_write"), vc["ckpt_write"]),
        (".ckpt write (MindSpore + fsync)", ms_time("ckpt_write", True), vc["ckpt_write"]),
        (".ckpt read, page cache warm", ms["ckpt_read_warm"], vc["ckpt_read_warm"]),
    ]
    if cold:
        rows.insert(3, ("MindRecord read, page cache cold", ms["mindrecord_read_cold"], vc["mindrecord_read_cold"]))
        rows.append((".ckpt read, page cache cold", ms["ckpt_read_cold"], vc["ckpt_read_cold"]))
    total = mib * MiB
    print(f"\n{mib} MiB of 4 MiB float32 tensors, {n} repetitions\n")
    print("| operation | MindSpore 2.10 GB/s | VCGA GB/s | VCGA / MindSpore (min-max) |")
    print("|---|---:|---:|---:|")
    for label, t_ms, t_vc in rows:
        ratios = [a / b for a, b in zip(t_ms, t_vc, strict=False)]
        print(f"| {label} | {total / statistics.median(t_ms) / 1e9:.2f} | {total / statistics.median(t_vc) / 1e9:.2f}"
              f" | {statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f}) |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mib", type=int, default=512, help="total tensor data (multiple of 4 MiB)")
    ap.add_argument("--dir", type=Path, default=None, help="where files go (default: a temporary directory)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache reads")
    ap.add_argument("--mindspore-python", default=os.environ.get("VCGA_MINDSPORE_PYTHON", DEFAULT_MINDSPORE_PYTHON))
    ap.add_argument("--json", type=Path, help="also write the raw timings here")
    ap.add_argument("--report", type=Path, help="only print the table for timings saved with --json")
    ap.add_argument("--anchor", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cold = not args.no_cold

    if args.anchor:
        json.dump(anchor(args.dir, args.mib, cold), sys.stdout)
        return 0
    if args.report:
        runs = json.loads(args.report.read_text())
        report(runs, args.mib, "mindrecord_read_cold" in runs["vcga"])
        return 0

    if not os.path.exists(args.mindspore_python):
        print(f"MindSpore's interpreter {args.mindspore_python} not found: set VCGA_MINDSPORE_PYTHON", file=sys.stderr)
        return 2
    tensors = make_tensors(args.mib)
    runs: dict[str, dict[str, list[float]]] = {"mindspore": {}, "vcga": {}}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="vcga-bench-ms-") as tmp:
        work = Path(tmp)
        for rep in range(args.reps):
            for p in work.iterdir():
                p.unlink()
            # Alternate who writes first, so neither side always inherits the other's dirty pages.
            timings = ours_write(work, tensors) if rep % 2 else {}
            proc = subprocess.run([args.mindspore_python, __file__, "--anchor", "--dir", str(work), "--mib",
                                   str(args.mib)] + (["--no-cold"] if not cold else []),
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                runs["mindspore"].setdefault(k, []).append(v)
            if not rep % 2:
                timings = ours_write(work, tensors)
            timings.update(ours_read(work, args.mib, cold))
            for k, v in timings.items():
                runs["vcga"].setdefault(k, []).append(v)
            if rep == 0:
                check_same_bytes(work, tensors)
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)

    report(runs, args.mib, cold)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
