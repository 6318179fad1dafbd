"""Worker for tests/test_fuzz_readers.py: mutate a fixture many times and read each mutant fully.

Run as ``python fuzz_readers_worker.py FORMAT FIXTURE N SEED WORKDIR``. Prints one JSON line:
counts of outcomes, and the first unexpected exception (anything but VcgaFormatError) if any.
It runs in its own process so that a crash in a native library fails the test instead of pytest.
"""

from __future__ import annotations

import json
import random
import sys
import traceback
from pathlib import Path


def mutate(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    kind = rng.choice(["flip", "flip", "bytes", "truncate", "splice", "zero"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == "bytes":
        i = rng.randrange(len(data))
        for j in range(i, min(len(data), i + rng.randint(1, 16))):
            data[j] = rng.randrange(256)
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    elif kind == "splice":
        i = rng.randrange(len(data))
        if rng.random() < 0.5:
            del data[i:i + rng.randint(1, 64)]
        else:
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:  # zero a 8-byte aligned word: offsets and lengths become 0
        i = rng.randrange(0, max(1, len(data) - 8), 8)
        data[i:i + 8] = bytes(8)
    return bytes(data)


def main() -> None:
    import os

    os.environ.setdefault("VCGA_HDF5_SCAN_TIMEOUT_S", "15")  # a hang is reported as a format error sooner
    fmt, fixture, n, seed, workdir = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    from vcga.errors import VcgaFormatError
    from vcga.plugin_manager import get_plugin_manager

    spec = next(s for s in get_plugin_manager().formats() if s.name == fmt)
    raw = fixture.read_bytes()
    rng = random.Random(seed)
    counts = {"ok": 0, "format_error": 0}
    path = workdir / f"mutant{fixture.suffix}"
    for i in range(n):
        data = mutate(raw, rng)
        path.write_bytes(data)
        (workdir / "current").write_text(str(i))
        try:
            with spec.open_reader(path) as r:
                r.index()
                dict(r.metadata)
                for e in r.entries():
                    memoryview(e.data).nbytes  # noqa: B018 - touch the data
            counts["ok"] += 1
        except VcgaFormatError:
            counts["format_error"] += 1
        except Exception as e:  # noqa: BLE001 - anything else is a finding
            (workdir / "finding.bin").write_bytes(data)
            print(json.dumps({**counts, "unexpected": f"{type(e).__name__}: {e}"[:500], "iteration": i,
                              "traceback": traceback.format_exc()[-2000:]}))
            return
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
