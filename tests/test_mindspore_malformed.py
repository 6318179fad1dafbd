"""Malformed MindRecord datasets and .ckpt files: a typed VcgaFormatError, nothing else, no big allocation.

MindSpore's own reader trusts the ``.db`` offsets (one bad blob offset and it reads out of bounds);
VCGA's readers check every size and offset against the file before reading. The hand-made cases
below cover each class of damage (sizes, offsets, counts, checksums); the fuzz test then mutates real files at random
(CI-sized by default; ``VCGA_FUZZ_ITERATIONS=5000`` for a long run) and requires that every outcome
is either a clean read or a VcgaFormatError, with traced allocations bounded by the input's size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from vcga.contract import TensorEntry
from vcga.errors import VcgaFormatError
from vcga.formats import mindrecord
from vcga.formats import mindspore_ckpt as ck

FIX = Path(__file__).parent / "fixtures" / "mindspore"
SMALL = {"header_size": 1 << 14, "page_size": 1 << 15}


def _dataset(tmp_path: Path, name: str = "m.mindrecord", **options) -> Path:
    rng = np.random.default_rng(1)
    with mindrecord.open_writer(tmp_path / name, **{**SMALL, **options}) as w:
        w.write(TensorEntry("a", "float32", (2, 3), rng.bytes(24), {"k": "v"}))
        w.write(TensorEntry("big", "float64", (5000,), rng.bytes(40000)))
        w.write(TensorEntry("e", "int8", (0, 2), b""))
        w.write(TensorEntry("s", "bfloat16", (), rng.bytes(2)))
    return tmp_path / name


def _read_everything(open_reader, path) -> int:
    with open_reader(path) as r:
        r.index()
        n = 0
        for e in r.entries():
            n += len(bytes(e.data))
        return n


def _patch_header(path: Path, mutate) -> None:
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert 8 + len(new) <= header["header_size"] if isinstance(header.get("header_size"), int) else True
    raw[:8 + max(n, len(new))] = struct.pack("<Q", len(new)) + new + bytes(max(0, n - len(new)))
    path.write_bytes(raw)


def _sql(path: Path, statement: str) -> None:
    con = sqlite3.connect(path)
    con.execute(statement)
    con.commit()
    con.close()


def _mr_error(path, match):
    with pytest.raises(VcgaFormatError, match=match) as info:
        _read_everything(mindrecord.open_reader, path)
    assert "\n" not in str(info.value)  # one line, ready for the CLI
    return info.value


# ---------------------------------------------------------------------------------------------------
# MindRecord: one case per kind of damage
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 5, 8, 100, 1 << 14, (1 << 14) + 100, -1])
def test_truncated_data_file(tmp_path, cut):
    p = _dataset(tmp_path)
    raw = p.read_bytes()
    p.write_bytes(raw[:cut])
    _mr_error(p, "short|truncated|beyond|not valid JSON|MindRecord")


def test_huge_claimed_header_length(tmp_path):
    p = _dataset(tmp_path)
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 62)
    p.write_bytes(raw)
    _mr_error(p, "claims")


def test_page_beyond_end_of_file(tmp_path):
    p = _dataset(tmp_path)
    _patch_header(p, lambda h: h["page"][-1].__setitem__("page_size", 30000))  # the last page
    _mr_error(p, "beyond the end of the file")


def test_wrong_page_id_in_header(tmp_path):
    p = _dataset(tmp_path)
    _patch_header(p, lambda h: h["page"][0].__setitem__("page_id", 7))
    _mr_error(p, "page_id")


@pytest.mark.parametrize("column,value", [("PAGE_OFFSET_BLOB", 999999), ("PAGE_OFFSET_BLOB_END", 1 << 40),
                                          ("PAGE_OFFSET_BLOB", 3), ("PAGE_ID_BLOB", 99), ("PAGE_ID_RAW", 0),
                                          ("PAGE_OFFSET_RAW", -8), ("ROW_GROUP_ID", 5)])
def test_wrong_offsets_in_db(tmp_path, column, value):
    """MindSpore segfaults on a bad blob offset; VCGA names the row."""
    p = _dataset(tmp_path)
    _sql(Path(str(p) + ".db"), f"UPDATE INDEXES SET {column} = {value} WHERE ROW_ID = 1")
    _mr_error(p, "row 1|index")


def test_huge_field_length_inside_blob(tmp_path):
    p = _dataset(tmp_path)
    raw = bytearray(p.read_bytes())
    body = (1 << 14) + 8  # first blob row of page 0: u64 LE row length, then u64 BE len(data)
    raw[body:body + 8] = struct.pack(">Q", 1 << 60)
    p.write_bytes(raw)
    _mr_error(p, "claims")


def test_corrupt_compressed_shape(tmp_path):
    p = _dataset(tmp_path)
    raw = bytearray(p.read_bytes())
    body = (1 << 14) + 8
    dlen = struct.unpack(">Q", raw[body:body + 8])[0]
    shape_at = body + 8 + dlen + 8
    raw[shape_at:shape_at + 4] = struct.pack(">I", 1 << 30)  # claims a billion dims
    p.write_bytes(raw)
    _mr_error(p, "compressed integer array")


@pytest.mark.parametrize("evil", ["../m2.mindrecord", "sub/m.mindrecord", "..", "/etc/passwd", "a\\b", ""])
def test_shard_address_with_path_separators(tmp_path, evil):
    p = _dataset(tmp_path)
    _patch_header(p, lambda h: h.__setitem__("shard_addresses", ["m.mindrecord", evil]))
    _mr_error(p, "not a plain file name")


def test_missing_shard(tmp_path):
    _dataset(tmp_path, shard_size=100)
    os.remove(tmp_path / "m.mindrecord2")
    _mr_error(tmp_path / "m.mindrecord0", "no such file|cannot open")


def test_missing_db(tmp_path):
    p = _dataset(tmp_path)
    os.remove(str(p) + ".db")
    err = _mr_error(p, "index .* is missing")
    assert "m.mindrecord.db" in str(err)


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty", "no_table", "wrong_name", "fewer_rows",
                                    "text_offsets"])
def test_corrupt_db(tmp_path, damage):
    p = _dataset(tmp_path)
    db = Path(str(p) + ".db")
    if damage == "garbage":
        db.write_bytes(os.urandom(4096))
    elif damage == "truncate":
        db.write_bytes(db.read_bytes()[:1000])
    elif damage == "empty":
        db.write_bytes(b"")
    elif damage == "no_table":
        _sql(db, "DROP TABLE INDEXES")
    elif damage == "wrong_name":
        _sql(db, "UPDATE SHARD_NAME SET NAME = 'other.mindrecord'")
    elif damage == "fewer_rows":
        _sql(db, "DELETE FROM INDEXES WHERE ROW_ID = 2")
    elif damage == "text_offsets":
        _sql(db, "UPDATE INDEXES SET PAGE_OFFSET_RAW = 'x' WHERE ROW_ID = 0")
    _mr_error(p, "index|database|belongs")


def test_records_that_do_not_tile_a_tensor(tmp_path):
    p = _dataset(tmp_path)
    # Drop a middle record of the split tensor from the raw page: make its offset claim byte 8 instead.
    raw = bytearray(p.read_bytes())
    marker = b"\xa6offset"
    first = raw.index(b"\xa3big")
    at = raw.index(marker, first + 1)
    at = raw.index(marker, at + 1)  # second record of "big"
    assert raw[at + len(marker)] in (0xCD, 0xCE)  # uint16 / uint32 offset
    raw[at + len(marker)] = 0x08  # positive fixint 8, then the old bytes -> msgpack says extra data
    p.write_bytes(raw)
    _mr_error(p, "msgpack|overlap|gap|raw row")


def test_mismatched_shards(tmp_path):
    _dataset(tmp_path, shard_size=100)
    _patch_header(tmp_path / "m.mindrecord1", lambda h: h.__setitem__("compression_size", 12345))
    _mr_error(tmp_path / "m.mindrecord0", "compression_size .* differs")


# ---------------------------------------------------------------------------------------------------
# .ckpt: one case per kind of damage
# ---------------------------------------------------------------------------------------------------


def _ckpt(tmp_path: Path, crc=False) -> Path:
    rng = np.random.default_rng(2)
    p = tmp_path / "m.ckpt"
    with ck.open_writer(p, crc=crc, slice_size=600) as w:
        w.write(TensorEntry("a", "float32", (2, 3), rng.bytes(24)))
        w.write(TensorEntry("big", "int16", (1000,), rng.bytes(2000)))
        w.write(TensorEntry("e", "int8", (0,), b""))
        w.set_metadata({"note": "x"})
    return p


def _ck_error(path, match):
    with pytest.raises(VcgaFormatError, match=match) as info:
        _read_everything(ck.open_reader, path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cut", [1, 2, 10, 40, -5])
def test_ckpt_truncated(tmp_path, cut):
    p = _ckpt(tmp_path)
    p.write_bytes(p.read_bytes()[:cut])
    _ck_error(p, "truncated|claims|protobuf|lacks")


def test_ckpt_huge_claimed_length(tmp_path):
    p = tmp_path / "h.ckpt"
    p.write_bytes(b"\x0a" + b"\xff" * 9 + b"\x01" + b"\x0a\x01a")
    _ck_error(p, "claims|larger")


def test_ckpt_content_disagrees_with_dims(tmp_path):
    checkpoint, _ = ck.message_classes()
    m = checkpoint()
    v = m.value.add()
    v.tag, v.tensor.tensor_type, v.tensor.tensor_content = "w", "Float32", b"\0" * 12
    v.tensor.dims.extend([1 << 40, 1 << 40])
    (tmp_path / "d.ckpt").write_bytes(m.SerializeToString())
    _ck_error(tmp_path / "d.ckpt", "need")


@pytest.mark.parametrize("tensor_type,match", [("Int4", "int4"), ("Quux", "tensor_type"), ("", "tensor_type")])
def test_ckpt_unknown_tensor_type(tmp_path, tensor_type, match):
    checkpoint, _ = ck.message_classes()
    m = checkpoint()
    v = m.value.add()
    v.tag, v.tensor.tensor_type, v.tensor.tensor_content = "w", tensor_type, b"\0"
    (tmp_path / "t.ckpt").write_bytes(m.SerializeToString())
    _ck_error(tmp_path / "t.ckpt", match)


def test_ckpt_value_missing_required_field(tmp_path):
    # Value{tag="w", tensor{dims=[1]}}: tensor_type and tensor_content (required) are missing.
    (tmp_path / "r.ckpt").write_bytes(b"\x0a\x07\x0a\x01w\x12\x02\x08\x01")
    _ck_error(tmp_path / "r.ckpt", "tensor_type|not valid protobuf")


def test_ckpt_duplicate_names(tmp_path):
    checkpoint, _ = ck.message_classes()
    data = b""
    for tag in ("a", "b", "a"):
        m = checkpoint()
        v = m.value.add()
        v.tag, v.tensor.tensor_type, v.tensor.tensor_content = tag, "Int8", b"\1"
        v.tensor.dims.append(1)
        data += m.SerializeToString()
    (tmp_path / "dup.ckpt").write_bytes(data)
    _ck_error(tmp_path / "dup.ckpt", "twice")


def test_ckpt_maptensor_refused(tmp_path):
    checkpoint, _ = ck.message_classes()
    m = checkpoint()
    v = m.value.add()
    v.tag = "table"
    t = v.maptensor.tensor.add()
    t.tensor_type, t.tensor_content = "Int64", b"\0" * 8
    (tmp_path / "map.ckpt").write_bytes(m.SerializeToString())
    _ck_error(tmp_path / "map.ckpt", "MapParameter")


# ---------------------------------------------------------------------------------------------------
# Fuzzing both readers
# ---------------------------------------------------------------------------------------------------

FUZZ_ITERATIONS = int(os.environ.get("VCGA_FUZZ_ITERATIONS", "150"))


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 or not b:  # flip bits
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 2:  # plant a huge or odd 64-bit number (lengths, offsets)
        pos = rng.randrange(len(b))
        value = rng.choice([0, 1, 0xFFFFFFFFFFFFFFFF, 1 << 62, 1 << 31, rng.getrandbits(64)])
        b[pos:pos + 8] = value.to_bytes(8, rng.choice(["little", "big"]))
    elif kind == 3:  # insert or delete bytes
        pos = rng.randrange(len(b))
        if rng.random() < 0.5:
            b[pos:pos] = os.urandom(rng.randint(1, 16))
        else:
            del b[pos:pos + rng.randint(1, 16)]
    elif kind == 4:  # overwrite a run with random bytes
        pos = rng.randrange(len(b))
        n = rng.randint(1, 64)
        b[pos:pos + n] = bytes(rng.getrandbits(8) for _ in range(min(n, len(b) - pos)))
    else:  # edit a number in the JSON header / a varint region: replace a digit
        digits = [i for i in range(min(len(b), 4096)) if 0x30 <= b[i] <= 0x39]
        if digits:
            b[rng.choice(digits)] = rng.choice(b"0123456789-")
    return bytes(b)


def _mutate_db(db: Path, rng: random.Random) -> None:
    if rng.random() < 0.3:
        db.write_bytes(_mutate(db.read_bytes(), rng))
        return
    con = sqlite3.connect(db)
    try:
        col = rng.choice(["ROW_ID", "PAGE_ID_RAW", "PAGE_OFFSET_RAW", "PAGE_OFFSET_RAW_END", "ROW_GROUP_ID",
                          "PAGE_ID_BLOB", "PAGE_OFFSET_BLOB", "PAGE_OFFSET_BLOB_END"])
        value = rng.choice([-1, 0, 1, 7, 1 << 20, 1 << 62, "'x'", "NULL", "1.5"])
        con.execute(f"UPDATE INDEXES SET {col} = {value} WHERE ROW_ID = (SELECT MIN(ROW_ID) FROM INDEXES)")
        con.commit()
    except sqlite3.Error:
        pass
    finally:
        con.close()


def _check_outcome(open_reader, path: Path, budget: int, what: str) -> str:
    tracemalloc.start()
    try:
        _read_everything(open_reader, path)
        outcome = "read"
    except VcgaFormatError:
        outcome = "refused"
    except Exception as e:  # pragma: no cover - the failure being hunted
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= budget, f"{what}: allocated {peak} bytes for {budget // 4} bytes of input"
    return outcome


def _mindrecord_seeds(tmp_path: Path) -> list[tuple[Path, list[str]]]:
    """(entry shard, files of the dataset) for our output and MindSpore's."""
    ours = _dataset(tmp_path / "ours" if (tmp_path / "ours").mkdir() is None else tmp_path)
    sharded_dir = tmp_path / "sharded"
    sharded_dir.mkdir()
    _dataset(sharded_dir, shard_size=30000)
    seeds = [(ours, [ours.name, ours.name + ".db"])]
    seeds.append((sharded_dir / "m.mindrecord0", sorted(os.listdir(sharded_dir))))
    for name, files in (("tensors.mindrecord", ["tensors.mindrecord", "tensors.mindrecord.db"]),
                        ("generic.mindrecord", ["generic.mindrecord", "generic.mindrecord.db"]),
                        ("typed_int.mindrecord", ["typed_int.mindrecord", "typed_int.mindrecord.db"]),
                        ("sharded.mindrecord0", [f"sharded.mindrecord{i}{s}" for i in range(3) for s in ("", ".db")])):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        for f in files:
            shutil.copy(FIX / f, d / f)
        seeds.append((d / name, files))
    return seeds


def test_fuzz_mindrecord_reader(tmp_path):
    seeds = _mindrecord_seeds(tmp_path)
    rng = random.Random(0xC0FFEE)
    outcomes = {"read": 0, "refused": 0}
    for it in range(FUZZ_ITERATIONS):
        entry, files = seeds[it % len(seeds)]
        work = tmp_path / f"w{it % 4}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for f in files:
            shutil.copy(entry.parent / f, work / f)
        target = work / rng.choice(files)
        if target.name.endswith(".db"):
            _mutate_db(target, rng)
        else:
            target.write_bytes(_mutate(target.read_bytes(), rng))
        total = sum((work / f).stat().st_size for f in os.listdir(work))
        outcomes[_check_outcome(mindrecord.open_reader, work / entry.name, 4 * total + (4 << 20),
                                f"iteration {it} ({target.name})")] += 1
    print(f"mindrecord fuzz: {outcomes}")
    assert outcomes["refused"] > FUZZ_ITERATIONS // 4  # the mutations really exercise the checks


def test_fuzz_ckpt_reader(tmp_path):
    ours = _ckpt(tmp_path)
    ours_crc = _ckpt(tmp_path / "crc" if (tmp_path / "crc").mkdir() is None else tmp_path, crc=True)
    seeds = [ours.read_bytes(), ours_crc.read_bytes()] + [
        (FIX / n).read_bytes() for n in ("params.ckpt", "params_crc.ckpt", "split.ckpt", "complex.ckpt")]
    rng = random.Random(0xBEEF)
    outcomes = {"read": 0, "refused": 0}
    target = tmp_path / "fuzz.ckpt"
    for it in range(FUZZ_ITERATIONS):
        data = _mutate(seeds[it % len(seeds)], rng)
        target.write_bytes(data)
        outcomes[_check_outcome(ck.open_reader, target, 4 * len(data) + (4 << 20), f"iteration {it}")] += 1
    print(f"ckpt fuzz: {outcomes}")
    assert outcomes["refused"] > FUZZ_ITERATIONS // 4


def test_compressed_data_claiming_billions_of_elements(tmp_path):
    """A typed int64 data field says 2**32-1 elements in a few bytes: refused before any allocation."""
    for f in ("typed_int.mindrecord", "typed_int.mindrecord.db"):
        shutil.copy(FIX / f, tmp_path / f)
    p = tmp_path / "typed_int.mindrecord"
    raw = bytearray(p.read_bytes())
    body = (1 << 14) + 8  # first blob row: u64 BE len(data), then the compressed array's u32 BE count
    raw[body + 8:body + 12] = b"\xff\xff\xff\xff"
    p.write_bytes(raw)
    tracemalloc.start()
    try:
        _mr_error(p, "claims 4294967295 elements")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 16 << 20
