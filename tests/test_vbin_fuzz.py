"""Fuzzing the vendor-bin reader: mutated files give VcgaFormatError or valid data, never another
exception, never an allocation sized by a field instead of by the file.

Four mutators, each producing a file the reader must survive:

- ``raw``: byte-level damage anywhere (flips, overwrites, truncation, insertion, deletion, u64
  fields overwritten with extreme values) -- mostly stopped by checksums;
- ``json``: the index document edited (any value replaced by any JSON value, keys dropped, entries
  duplicated or reordered) and *re-checksummed*, so the field validation itself is exercised;
- ``index-text``: the index text damaged (broken JSON, non-ASCII, deep nesting) and re-checksummed;
- ``fields``: preamble and trailer fields set to extreme values and re-checksummed.

CI runs ``VCGA_FUZZ_EXAMPLES`` examples per mutator (default 150). The benchmark-sized run
(docs/vendor-bin.md, "Piece sizes and access patterns") sets it to 2,500 or more:
``VCGA_FUZZ_EXAMPLES=2500 pytest tests/test_vbin_fuzz.py`` is 10,000 mutated files.

Allocation bound: peak traced allocation while reading stays under ``file size + 64 x index length
+ 64 KiB``. Tensors cost nothing (they are views of the mapping) and no claimed size is ever
allocated; what remains is the JSON parse, which makes at most one Python object (a list or dict
of 56-64 bytes plus a pointer) per two bytes of index text -- 1,000 nested empty lists in a
2,000-byte index are the worst case the fuzzer finds (about 45 bytes per index byte).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vbin_craft import join, split, with_doc, with_index_bytes

from vcga import dtypes, tensors
from vcga.errors import VcgaFormatError
from vcga.formats import vbin

EXAMPLES = int(os.environ.get("VCGA_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

_DIR = Path(tempfile.mkdtemp(prefix="vcga-vbin-fuzz-"))  # made when the module is collected, in every worker
atexit.register(shutil.rmtree, _DIR, True)  # and removed when that process ends
STATS = {"files": 0, "rejected": 0, "max_peak_over_bound": 0.0}


def _seeds() -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    mixed = {name: np.frombuffer(rng.bytes(dtypes.get(name).itemsize * 6), dtype=dtypes.to_numpy(name))
             .reshape(2, 3) for name in dtypes.ALL if name != "bool"}
    mixed["bool"] = np.array([[True, False]])
    mixed["empty"] = np.zeros((0, 4), np.float32)
    mixed["scalar"] = np.array(2.5, np.float64)
    seeds = {
        "mixed-64": vbin.save(mixed, {"who": "fuzz", "ü": "ß"}, alignment=64),
        "paged-4096": vbin.save({"page": rng.random(1100, dtype=np.float32), "tiny": np.ones(2, np.int8)}),
        "tensor-metadata": vbin.save({f"m{i}": tensors.from_numpy(f"m{i}", np.arange(i, dtype=np.int16),
                                                                  {"k": str(i)}) for i in range(6)}, alignment=64),
        "empty": vbin.save({}),
    }
    sharded = _DIR / "sharded.vbin"
    vbin.save_file({f"w{i}": np.full(40, i, np.int32) for i in range(5)}, sharded, {"s": "1"}, shard_size=300)
    seeds["sharded-index"] = sharded.read_bytes()
    return seeds


SEEDS = _seeds()

json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 64, 4096, 2**63 - 1, 2**63, 2**64, *dtypes.ALL]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def json_mutation(draw):
    seed = draw(st.sampled_from(sorted(SEEDS)))
    data = SEEDS[seed]
    doc = split(data).doc
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "delete", "duplicate", "nudge", "deep"]))
        key = path[-1]
        if op == "replace":
            parent[key] = draw(json_values)
        elif op == "deep":  # a value nested deeper than repr() and json can recurse (patched in below)
            parent[key] = "\u0000DEEP\u0000"
        elif op == "delete":
            del parent[key]
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(draw(st.integers(0, len(parent))), json.loads(json.dumps(parent[key])))
        elif isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += draw(st.sampled_from([-4096, -64, -8, -1, 1, 8, 64, 4096, 2**40]))
    if "\u0000DEEP\u0000" in json.dumps(doc):
        depth = draw(st.sampled_from([50, 500, 900, 5000]))
        text = json.dumps(doc).replace('"\\u0000DEEP\\u0000"', "[" * depth + "]" * depth)
        return seed, with_index_bytes(data, text.encode())
    return seed, with_doc(data, doc, ascii_only=draw(st.booleans()))


@st.composite
def raw_mutation(draw):
    seed = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(SEEDS[seed])
    for _ in range(draw(st.integers(1, 4))):
        n = len(data)
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "u64"]))
        pos = draw(st.integers(0, max(n - 1, 0)))
        if op == "flip" and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and n:
            data[pos] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "u64" and n >= 8:
            pos = min(pos, n - 8)
            value = draw(st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1, n, n + 1, 2**40]))
            data[pos:pos + 8] = value.to_bytes(8, "little")
    return seed, bytes(data)


@st.composite
def index_text_mutation(draw):
    seed = draw(st.sampled_from(sorted(SEEDS)))
    data = SEEDS[seed]
    text = bytearray(split(data).index)
    op = draw(st.sampled_from(["splice", "nest", "replace"]))
    if op == "splice":
        pos = draw(st.integers(0, len(text)))
        text[pos:pos + draw(st.integers(0, 8))] = draw(st.binary(max_size=16))
    elif op == "nest":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        text = bytearray(b"[" * depth + b"]" * draw(st.sampled_from([0, depth])))
    else:
        text = bytearray(draw(st.sampled_from([b"", b"{}", b"[]", b"null", b'{"a":1,"a":1}', b"1e999999",
                                               b"9" * 5000, b'{"format":"vendor-bin"}', b"\xef\xbb\xbf{}"])))
    return seed, with_index_bytes(data, bytes(text))


@st.composite
def field_mutation(draw):
    seed = draw(st.sampled_from(sorted(SEEDS)))
    p = split(SEEDS[seed])
    u64 = st.sampled_from([0, 1, 63, 64, 65, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1])
    where = draw(st.sampled_from(["preamble", "trailer"]))
    if where == "preamble":
        field = draw(st.sampled_from(["alignment", "major", "minor", "file_id"]))
        p.preamble[field] = (draw(st.binary(min_size=16, max_size=16)) if field == "file_id"
                             else draw(u64) % (2**16 if field in ("major", "minor") else 2**32))
        return seed, join(p)
    field = draw(st.sampled_from(["index_offset", "index_length", "index_xxh3", "flags", "major", "minor"]))
    v = draw(u64)
    p.trailer[field] = v % (2**16 if field in ("major", "minor") else 2**32 if field == "flags" else 2**64)
    return seed, join(p, fix_index_fields=False)


def _safe_index_len(data: bytes) -> int:
    """The index length the trailer claims, if it fits in the file (else 0: no index to parse)."""
    if len(data) < 128:
        return 0
    ioff, ilen = int.from_bytes(data[-48:-40], "little"), int.from_bytes(data[-40:-32], "little")
    return ilen if ioff + ilen <= len(data) else 0


def _exercise(seed: str, data: bytes) -> None:
    path = _DIR / ("sharded.vbin" if seed == "sharded-index" else "fuzz.vbin")
    original = path.read_bytes() if seed == "sharded-index" else None
    path.write_bytes(data)
    index_len = _safe_index_len(data)
    tracemalloc.start()
    try:
        with vbin.VbinReader(path) as r:
            r.index()
            for e in r.entries():
                tensors.to_numpy(e)
                tensors.to_torch(e)
            r.verify()
    except VcgaFormatError:
        STATS["rejected"] += 1
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        if original is not None:
            path.write_bytes(original)
    STATS["files"] += 1
    bound = len(data) + 64 * index_len + 64 * 1024
    if peak / bound > STATS["max_peak_over_bound"]:
        STATS.update(max_peak_over_bound=peak / bound, worst=(seed, len(data), index_len, peak))
    assert peak <= bound, f"allocated {peak} bytes reading a {len(data)}-byte file"




def _warm_up() -> None:
    """One-time costs (torch's lazy kernels, first exception paths) are not per-file allocations."""
    for seed, data in SEEDS.items():
        for variant in (data, data[:-1], data[:100]):
            try:
                _exercise(seed, variant)
            except AssertionError:
                pass
    STATS.update(files=0, rejected=0, max_peak_over_bound=0.0)


_warm_up()


@FUZZ
@given(raw_mutation())
def test_fuzz_raw_damage(case):
    _exercise(*case)


@FUZZ
@given(json_mutation())
def test_fuzz_lying_index_with_valid_checksums(case):
    _exercise(*case)


@FUZZ
@given(index_text_mutation())
def test_fuzz_broken_index_text_with_valid_checksums(case):
    _exercise(*case)


@FUZZ
@given(field_mutation())
def test_fuzz_extreme_preamble_and_trailer_fields(case):
    _exercise(*case)


def test_seeds_are_valid():
    before = STATS["rejected"]
    for seed, data in SEEDS.items():
        _exercise(seed, data)
    assert STATS["rejected"] == before


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print(f"\nvbin fuzz: {STATS['files']} files read, {STATS['rejected']} rejected with VcgaFormatError, "
          f"peak allocation at most {STATS['max_peak_over_bound']:.3f} of the bound "
          f"(worst: seed, file bytes, index bytes, peak = {STATS.get('worst')})")
