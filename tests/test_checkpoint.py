"""vcga.checkpoint in one process (DCP without a process group): the layout, publication, keep-last,
verification at load with fallback to the previous checkpoint, async saving and its failures, and
the refusal to run code from a checkpoint. Multi-rank behaviour: tests/test_checkpoint_world.py;
restarts under torchrun: tests/test_elastic.py."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

import vcga.checkpoint as ckpt
from vcga.checkpoint.dcpmeta import MANIFEST_FILE, METADATA_FILE, dump_manifest, load_manifest, metadata_checksum
from vcga.errors import VcgaCheckpointError, VcgaChecksumError, VcgaConfigError, VcgaFormatError
from vcga.testing import fault


def _state(seed: int, *, huge: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
             "mask": torch.rand(7, generator=g) > 0.5, "big": torch.randn(2048, generator=g)}
    if huge:  # larger than a page: a tensor of its own pages, copied out as soon as it verifies
        model["huge"] = torch.randn(72_000, generator=g)
    return {"model": model, "optim": {"step": torch.tensor(float(seed)), "lr": 0.1 * seed,
                                      "betas": (0.9, 0.99)}, "epoch": seed}


def _fresh(*, huge: bool = False) -> dict:
    s = _state(999, huge=huge)
    s["epoch"] = -1
    s["optim"]["lr"] = -1.0
    return s


def _assert_state_equal(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k].view(torch.uint8),
                                                                 v.view(torch.uint8)), k
    assert torch.equal(got["optim"]["step"], want["optim"]["step"])
    assert got["optim"]["lr"] == want["optim"]["lr"] and tuple(got["optim"]["betas"]) == (0.9, 0.99)
    assert got["epoch"] == want["epoch"]


def test_save_publishes_a_checksummed_checkpoint_and_keeps_the_last_k(tmp_path):
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        assert ckpt.save(_state(step), root, step=step, keep_last=2) == root / f"step-{step}"
        assert ckpt.latest_step(root) == step
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-3"]
    assert sorted(p.name for p in (root / "step-3").iterdir()) == [METADATA_FILE, "__0_0.vbin", MANIFEST_FILE]
    manifest = load_manifest((root / "step-3" / MANIFEST_FILE).read_bytes())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["metadata"]["checksum"] == metadata_checksum((root / "step-3" / METADATA_FILE).read_bytes())
    # The shard is an ordinary vendor-bin file: every tensor has its stored checksum.
    from vcga.convert import inspect_checkpoint

    rows = inspect_checkpoint(root / "step-3" / "__0_0.vbin", verify=True).tensors
    assert {r["name"] for r in rows} >= {"model.w", "model.b", "model.mask", "model.big"}
    assert all(r["status"] == "ok" for r in rows)

    state = _fresh()
    assert ckpt.load_latest(state, root) == 3
    _assert_state_equal(state, _state(3))
    assert ckpt.load_latest(_fresh(), tmp_path / "nothing-here") is None


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _positions(path: Path) -> list[tuple[int, str | None]]:
    """Byte offsets covering every part of a vendor-bin file -- preamble, each tensor's bytes
    (first, middle, last), every gap, the index and the trailer -- with the tensor each is in."""
    from vcga.formats import vbin

    size = path.stat().st_size
    with vbin.VbinReader(path) as r:
        recs = sorted((rec.offset, rec.nbytes, rec.name) for rec in r._records if rec.nbytes)
        index_offset = r._root.index_offset
    out: list[tuple[int, str | None]] = [(0, None), (12, None), (40, None), (63, None)]
    prev = 64
    for off, n, name in recs:
        out += [(p, None) for p in {prev, (prev + off) // 2, off - 1} if prev <= p < off]  # the gap before
        out += [(off, name), (off + n // 2, name), (off + n - 1, name)]
        prev = off + n
    out += [(index_offset, None), ((index_offset + size - 64) // 2, None), (size - 64, None), (size - 1, None)]
    return out


def test_a_flipped_bit_anywhere_is_detected_and_the_previous_checkpoint_loads(tmp_path, caplog):
    root = tmp_path / "ck"
    ckpt.save(_state(1, huge=True), root, step=1)
    ckpt.save(_state(2, huge=True), root, step=2)
    shard = root / "step-2" / "__0_0.vbin"
    cases = [(shard, off, name) for off, name in _positions(shard)]
    assert "model.huge" in {name for _, _, name in cases}
    cases += [(root / "step-2" / METADATA_FILE, off, None)
              for off in (0, 40, (root / "step-2" / METADATA_FILE).stat().st_size - 2)]
    cases += [(root / "step-2" / MANIFEST_FILE, off, None) for off in (0, 30, 100)]
    assert len(cases) > 30
    for path, off, tensor in cases:
        caplog.clear()
        _flip(path, off, bit=off % 8)
        state = _fresh(huge=True)
        with caplog.at_level(logging.WARNING, logger="vcga.checkpoint"):
            assert ckpt.load_latest(state, root) == 1, (path.name, off)
        _assert_state_equal(state, _state(1, huge=True))
        warning = " ".join(r.getMessage() for r in caplog.records)
        assert "step-2" in warning and path.name in warning, (path.name, off, warning)
        if tensor is not None:
            assert repr(tensor) in warning, (off, tensor, warning)
        _flip(path, off, bit=off % 8)  # undo: step 2 is whole again
    state = _fresh(huge=True)
    assert ckpt.load_latest(state, root) == 2
    _assert_state_equal(state, _state(2, huge=True))


def test_load_reads_into_the_state_dicts_own_tensors_and_copies_only_where_it_must(tmp_path, monkeypatch):
    """A contiguous CPU destination of the stored dtype and shape receives the file's bytes in
    place (no copy: the same memory before and after); a strided destination and one of another
    dtype are copied into from a buffer. All load exactly."""
    from vcga.checkpoint import storage

    root = tmp_path / "ck"
    ckpt.save(_state(1, huge=True), root, step=1)
    state = _fresh(huge=True)
    state["model"]["w"] = torch.zeros(64, 66)[:, ::2]  # the stored (64, 33), strided
    state["model"]["big"] = torch.zeros(2048, dtype=torch.float64)  # stored as float32
    memory = {k: v.data_ptr() for k, v in state["model"].items()}
    copied: list[str] = []
    real = storage.tensors.to_torch

    def to_torch(entry, **kw):
        copied.append(entry.name)
        return real(entry, **kw)

    monkeypatch.setattr(storage.tensors, "to_torch", to_torch)
    assert ckpt.load_latest(state, root) == 1
    assert sorted(copied) == ["model.big", "model.w"]
    assert {k: v.data_ptr() for k, v in state["model"].items()} == memory
    want = _state(1, huge=True)
    assert torch.equal(state["model"]["w"], want["model"]["w"])
    assert torch.equal(state["model"]["big"], want["model"]["big"].double())
    state["model"]["w"], state["model"]["big"] = want["model"]["w"], want["model"]["big"]
    _assert_state_equal(state, want)


def test_the_unverified_reader_loads_damaged_bytes_as_they_are(tmp_path):
    """VcgaStorageReader(verify=False) -- only for measuring at equal work against a reader that
    checks nothing -- checks no tensor, so it loads a damaged one as it is; load_latest never
    uses it."""
    import torch.distributed.checkpoint as dcp

    from vcga.checkpoint.storage import SafeLoadPlanner, VcgaStorageReader
    from vcga.formats import vbin

    root = tmp_path / "ck"
    ckpt.save(_state(1, huge=True), root, step=1)
    shard = root / "step-1" / "__0_0.vbin"
    with vbin.VbinReader(shard) as r:
        rec = r._by_name["model.huge"]
    _flip(shard, rec.offset + 4 * 7 + 3, bit=7)  # element 7's sign bit (little-endian: its last byte)
    state = _fresh(huge=True)
    dcp.load(state, storage_reader=VcgaStorageReader(root / "step-1", verify=False), planner=SafeLoadPlanner(),
             no_dist=True)
    want = _state(1, huge=True)["model"]["huge"].clone()
    want[7] = -want[7]
    assert torch.equal(state["model"]["huge"], want)
    with pytest.raises(VcgaCheckpointError, match="model.huge"):
        ckpt.load_latest(_fresh(huge=True), root)


def test_a_damaged_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, caplog):
    root = tmp_path / "ck"
    ckpt.save(_state(1), root, step=1)
    ckpt.save(_state(2), root, step=2)
    data = bytearray((root / "latest").read_bytes())
    data[data.index(b'"step":2') + 7] = ord("1")  # one bit: '2' -> '1' would name another step
    (root / "latest").write_bytes(bytes(data))
    state = _fresh()
    with caplog.at_level(logging.WARNING, logger="vcga.checkpoint"):
        assert ckpt.load_latest(state, root) == 2
    assert "latest" in caplog.text and "damaged" in caplog.text
    _assert_state_equal(state, _state(2))


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    root = tmp_path / "ck"
    ckpt.save(_state(1), root, step=1)
    (root / "step-1" / "__0_0.vbin").unlink()
    with pytest.raises(VcgaCheckpointError, match="no checkpoint .* could be loaded.*__0_0.vbin"):
        ckpt.load_latest(_fresh(), root)


def test_resaving_a_step_replaces_it_and_checkpoints_of_an_abandoned_timeline_go(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        ckpt.save(_state(step), root, step=step, keep_last=5)
    (root / ".step-8.tmp-0123abcd").mkdir()  # left by a save that was killed
    # Training restarted from step 2 (say step 4 was bad) and saves step 4 again.
    (root / "latest").unlink()
    from vcga.checkpoint.storage import write_latest

    write_latest(root, 2)
    ckpt.save(_state(40), root, step=4, keep_last=5)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4"]
    state = _fresh()
    assert ckpt.load_latest(state, root) == 4
    _assert_state_equal(state, _state(40))


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_async_save_returns_a_future_and_a_failure_surfaces_in_the_next_save(tmp_path, writer):
    root = tmp_path / "ck"
    state = _state(5)
    fut = ckpt.async_save(state, root, step=5, writer=writer)
    ckpt.wait_staged()
    state["model"]["w"].add_(1.0)  # training goes on once the copy is made: the save holds its own
    assert fut.result(timeout=120) == root / "step-5"
    got = _fresh()
    assert ckpt.load_latest(got, root) == 5
    _assert_state_equal(got, _state(5))

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    fut = ckpt.async_save(_state(6), blocked / "ck", step=6, writer=writer)
    with pytest.raises(VcgaCheckpointError, match="step 6"):
        fut.result(timeout=120)
    ckpt.save(_state(7), root, step=7)  # seen on the future: the next save goes ahead

    ckpt.async_save(_state(8), blocked / "ck", step=8, writer=writer)  # nobody looks at this future...
    with pytest.raises(VcgaCheckpointError, match=r"previous async save \(step 8\) failed"):
        ckpt.save(_state(9), root, step=9)  # ...so the next save raises it
    ckpt.save(_state(9), root, step=9)
    assert ckpt.wait() is None and ckpt.latest_step(root) == 9


def test_async_save_stages_each_tensor_with_one_copy_and_new_buffers_when_the_layout_changes(tmp_path):
    """The call blocks for the staging copy: once warm, one copy per tensor. torch's
    _check_state_dict_similarity (used before) copies every tensor itself, so each was copied twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                self.copies += 1
            return func(*args, **(kwargs or {}))

    root = tmp_path / "ck"
    state = _state(1)
    # staging="blocking": the copies run in the calling thread, where the (thread-local) counting
    # mode sees them; the background stager runs the same code.
    ckpt.async_save(state, root, step=1, staging="blocking").result(timeout=120)  # cold: allocates the buffers
    n_tensors = 5  # model.w, .b, .mask, .big and optim.step
    for step in (2, 3):
        state["model"]["w"].add_(1.0)
        with CountCopies() as counter:
            fut = ckpt.async_save(state, root, step=step, staging="blocking")
        assert counter.copies == n_tensors, counter.copies
        fut.result(timeout=120)
        got = _fresh()
        assert ckpt.load_latest(got, root) == step
        assert torch.equal(got["model"]["w"], state["model"]["w"])
    # Another dtype, and a smaller shape that copy_ would broadcast into the old buffer: new
    # buffers, and the checkpoint holds what was passed.
    state["model"]["w"] = state["model"]["w"].double()
    state["model"]["big"] = state["model"]["big"][:1].clone()
    ckpt.async_save(state, root, step=4, staging="blocking").result(timeout=120)
    got = _fresh()
    got["model"]["w"], got["model"]["big"] = torch.zeros(64, 33, dtype=torch.float64), torch.zeros(1)
    assert ckpt.load_latest(got, root) == 4
    assert got["model"]["w"].dtype == torch.float64 and torch.equal(got["model"]["w"], state["model"]["w"])
    assert torch.equal(got["model"]["big"], state["model"]["big"])


def _hold_staging(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the background stager wait for ``go`` before copying (``started`` says it is there):
    the test decides what happens while a copy is in flight, with no timing involved."""
    from vcga.checkpoint import staging

    started, go = threading.Event(), threading.Event()
    real = staging._Stager.stage

    def stage(self, *args, **kwargs):
        started.set()
        assert go.wait(60), "the test never released the staging copy"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(staging._Stager, "stage", stage)
    return started, go


def test_async_save_returns_before_the_copy_and_optimizer_step_waits_for_it(tmp_path, monkeypatch):
    """staging='background': async_save returns while the copy is still to be made; every
    optimizer's step() waits for it (a global step pre-hook), so the checkpoint holds the state of
    the call, not a later or torn one."""
    p = torch.nn.Parameter(torch.arange(1000, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(1000)
    started, go = _hold_staging(monkeypatch)
    fut = ckpt.async_save({"p": p.detach()}, tmp_path / "ck", step=1)  # returns with the copy held
    assert started.wait(60) and not fut.done()
    stepped = threading.Event()
    t = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    t.start()
    t.join(0.5)
    assert not stepped.is_set(), "optimizer.step() ran while the state was being copied"
    go.set()
    t.join(60)
    assert stepped.is_set() and torch.equal(p.detach(), torch.arange(1000, dtype=torch.float32) - 1)
    assert fut.result(timeout=120) == tmp_path / "ck" / "step-1"
    got = {"p": torch.zeros(1000)}
    assert ckpt.load_latest(got, tmp_path / "ck") == 1
    assert torch.equal(got["p"], torch.arange(1000, dtype=torch.float32))  # the state of the call


def test_a_change_outside_optimizer_step_during_the_copy_fails_the_save_and_publishes_nothing(tmp_path,
                                                                                              monkeypatch):
    root = tmp_path / "ck"
    ckpt.save(_state(1), root, step=1)
    state = _state(2)
    started, go = _hold_staging(monkeypatch)
    fut = ckpt.async_save(state, root, step=2)
    assert started.wait(60)
    state["model"]["big"].mul_(2)  # e.g. a BatchNorm forward updating its running stats, unguarded
    go.set()
    with pytest.raises(VcgaCheckpointError, match=r"changed in place while async_save was copying it.*wait_staged"):
        fut.result(timeout=120)
    assert ckpt.latest_step(root) == 1 and sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]
    # after wait_staged(), changes are the training's business: the save keeps its copy
    fut = ckpt.async_save(state, root, step=3)
    ckpt.wait_staged()
    state["model"]["big"].mul_(2)
    fut.result(timeout=120)
    got = _fresh()
    assert ckpt.load_latest(got, root) == 3
    assert torch.equal(got["model"]["big"], state["model"]["big"] / 2)


def test_the_writer_process_reads_the_staged_tensors_from_shared_memory_and_is_restarted_when_dead(tmp_path,
                                                                                                monkeypatch):
    """writer='process': every tensor reaches the writer as an (offset, length) in the shared arena
    -- no bytes through the socket but DCP's small pickled values -- and a writer that died
    between saves is replaced by the next save."""
    import signal

    from vcga.checkpoint import api
    from vcga.checkpoint.shard_writer import ShardWriterProcess

    sources = []
    real = ShardWriterProcess.write

    def spy(self, path, metadata, items):
        sources.extend((name, src[0]) for name, _, _, _, src in items)
        return real(self, path, metadata, items)

    monkeypatch.setattr(ShardWriterProcess, "write", spy)
    root = tmp_path / "ck"
    ckpt.async_save(_state(1), root, step=1).result(timeout=120)
    tensors = {"model.w", "model.b", "model.mask", "model.big", "optim.step"}
    assert {n for n, kind in sources if kind == "arena"} == tensors
    assert all(kind == "bytes" for n, kind in sources if n not in tensors)  # lr, betas, epoch: DCP's pickles
    old = api._ASYNC.writer
    with open(f"/proc/{old.proc.pid}/maps") as maps:  # the writer is a lean process: no torch in it
        assert "libtorch" not in maps.read()
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait(60)
    ckpt.async_save(_state(2), root, step=2).result(timeout=120)
    assert api._ASYNC.writer is not old and api._ASYNC.writer.alive()
    got = _fresh()
    assert ckpt.load_latest(got, root) == 2
    _assert_state_equal(got, _state(2))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_a_metadata_pickle_with_code_is_refused_and_never_run(tmp_path):
    root = tmp_path / "ck"
    ckpt.save(_state(1), root, step=1)
    d = root / "step-1"
    _Evil.marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil())
    (d / METADATA_FILE).write_bytes(evil)
    # An attacker who can write files can also fix the manifest's checksums: the allow-list is
    # what stops the code, not the checksum.
    manifest = load_manifest((d / MANIFEST_FILE).read_bytes())
    manifest["metadata"]["checksum"] = metadata_checksum(evil)
    (d / MANIFEST_FILE).write_bytes(dump_manifest(manifest))
    with pytest.raises(VcgaCheckpointError, match="refused: the pickle needs posix.system"):
        ckpt.load_latest(_fresh(), root)
    from vcga.convert import inspect_checkpoint

    with pytest.raises(VcgaFormatError, match="refused: the pickle needs posix.system"):
        inspect_checkpoint(d)
    assert not _Evil.marker.exists()


def test_a_value_pickle_with_code_is_not_run_on_load(tmp_path):
    """DCP's own planner unpickles non-tensor values with weights_only=False; VCGA's does not."""
    root = tmp_path / "ck"
    _Evil.marker = tmp_path / "pwned2"
    state = _state(1)
    state["hook"] = _Evil()
    ckpt.save(state, root, step=1)  # torch.save pickles the object's __reduce__: os.system and its argument
    with pytest.raises(VcgaCheckpointError, match="(?i)weights.only|unsupported global"):
        ckpt.load_latest(_fresh() | {"hook": None}, root)
    assert not _Evil.marker.exists()


def test_fault_specifications():
    f = fault.parse("kill:rank=1:step=7:at=mid, hang:rank=2:step=5:attempt=1")
    assert [(x.kind, x.rank, x.step, x.at, x.attempt) for x in f] == [("kill", 1, 7, "mid", 0), ("hang", 2, 5, "step", 1)]
    for bad in ("explode:rank=1:step=2", "kill:rank=1", "kill:rank=x:step=1", "kill:rank=1:step=1:at=lunch",
                "kill:rank=1:step=1:rank=2"):
        with pytest.raises(VcgaConfigError, match="VCGA_FAULT"):
            fault.parse(bad)
    assert fault.parse("") == []


def test_vcga_errors_survive_pickling_as_dcp_gathers_them_across_ranks():
    import pickle

    from vcga.errors import VcgaTimeoutError

    for err in (VcgaChecksumError("f.vbin", "tensor 'w': checksum mismatch", offset=4096, expected="xxh3_64:0"),
                VcgaTimeoutError("all_reduce", 15.0, rank=2, seq=7, missing_ranks=[3]),
                VcgaCheckpointError("save failed", step=3, failures={1: "OSError: disk full"})):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__


def test_a_failed_background_copy_fails_the_save_through_dcp_and_publishes_nothing(tmp_path, monkeypatch):
    """A failure in the background thread before DCP starts (the copy, the writer process) is
    raised inside the save's write step, so DCP fails it on every rank rather than leaving the
    other ranks waiting in its collectives; nothing is published."""
    from vcga.checkpoint import staging

    root = tmp_path / "ck"
    ckpt.save(_state(1), root, step=1)

    def broken(self, *args, **kwargs):
        raise MemoryError("no host memory for the staging buffers")

    monkeypatch.setattr(staging._Stager, "stage", broken)
    fut = ckpt.async_save(_state(2), root, step=2)
    ckpt.wait_staged()  # released even though the copy failed: no optimizer step waits forever
    with pytest.raises(VcgaCheckpointError, match="rank 0: VcgaCheckpointError: copying the state to host memory "
                                                  "failed: MemoryError"):
        fut.result(timeout=120)
    assert ckpt.latest_step(root) == 1 and sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]


def test_a_ranks_compression_entry_that_a_smaller_world_did_not_save_is_left_to_its_owner(tmp_path):
    """Resuming on more ranks (elastic): rank 1's ``vcga-compression-rank1`` entry is not in a
    checkpoint one rank saved. The load succeeds and leaves that entry as the template it was
    (CompressionState.load_state_dict then starts afresh, with a warning); any other key missing
    from the checkpoint still fails the load."""
    ckpt.save({"model": {"w": torch.arange(4.0)}, "compression": {"vcga-compression-rank0": b"rank 0's state"}},
              tmp_path, step=1)
    template = b"rank 1's fresh state"
    state = {"model": {"w": torch.zeros(4)}, "compression": {"vcga-compression-rank1": template}}
    assert ckpt.load_latest(state, tmp_path) == 1
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
    assert state["compression"]["vcga-compression-rank1"] is template
    mine = {"model": {"w": torch.zeros(4)}, "compression": {"vcga-compression-rank0": b""}}
    assert ckpt.load_latest(mine, tmp_path) == 1 and mine["compression"]["vcga-compression-rank0"] == b"rank 0's state"
    with pytest.raises(VcgaCheckpointError, match="model.v"):
        ckpt.load_latest({"model": {"w": torch.zeros(4), "v": torch.zeros(2)}}, tmp_path)
