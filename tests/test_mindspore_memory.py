"""Streaming: writing and reading MindRecord and .ckpt holds about one tensor in memory, not the checkpoint.

Each case runs in a fresh interpreter and compares its peak RSS (VmHWM; ru_maxrss would carry the parent's across exec) before and after
streaming 12 tensors of 16 MiB (192 MiB) through a writer and back through the reader, plus one
48 MiB tensor that the format splits (MindRecord pages, .ckpt slices) and the reader joins.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

MiB = 1 << 20

SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from vcga.contract import TensorEntry
    from vcga.formats import mindrecord, mindspore_ckpt

    MiB = 1 << 20
    fmt, path = sys.argv[1], sys.argv[2]
    mod, opts = (mindrecord, {}) if fmt == "mindrecord" else (mindspore_ckpt, {"slice_size": 16 * MiB})
    peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
    buf = np.full(48 * MiB, 7, dtype=np.uint8)   # the producer's one tensor buffer, reused
    with mod.open_writer(path + "warmup") as w:   # imports and first-use costs before the baseline
        w.write(TensorEntry("w", "uint8", (4,), b"abcd"))
    with mod.open_reader(path + "warmup") as r:
        list(r.entries())
    base = peak()
    with mod.open_writer(path, **opts) as w:
        for i in range(12):
            buf[:8] = i
            w.write(TensorEntry(f"t{i}", "uint8", (16 * MiB,), memoryview(buf)[:16 * MiB]))
        w.write(TensorEntry("split", "uint8", (48 * MiB,), memoryview(buf)))
    wrote = peak()
    n = 0
    with mod.open_reader(path) as r:
        for e in r.entries():
            n += len(e.data)
            assert bytes(memoryview(e.data)[:8]) == bytes(buf[:8]) or e.name != "split"
    assert n == 12 * 16 * MiB + 48 * MiB, n
    read = peak()
    print(base, wrote, read)
""")


@pytest.mark.parametrize("fmt", ["mindrecord", "mindspore-ckpt"])
def test_peak_memory_is_about_one_tensor(tmp_path, fmt):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, fmt, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    base, wrote, read = map(int, proc.stdout.split())
    # Writing keeps nothing of the tensors (they go from the producer's buffer to the file).
    assert wrote - base < 16 * MiB, (wrote - base) / MiB
    # Reading holds the tensor being yielded, the previous one (until the consumer's loop variable
    # moves on) and the buffers of the slice in flight (.ckpt: its bytes, protobuf's parse and the
    # content; at most 3 x 16 MiB) -- for the joined 48 MiB tensor 48 + 16 + 48 = 112 MiB, plus
    # slack: about one tensor, never the 240 MiB file.
    assert read - base < 128 * MiB, (read - base) / MiB
    print(f"{fmt}: peak RSS +{(wrote - base) / MiB:.0f} MiB writing, +{(read - base) / MiB:.0f} MiB reading")
