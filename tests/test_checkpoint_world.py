"""vcga.checkpoint across ranks and vendors (fake-backed: the vendors are simulated on CPU).

One FSDP2 model + Adam (+ a DTensor of its own) is saved by 4 ranks of two vendors (nccl:2,hccl:2),
synchronously and with async_save; then

- loaded exactly on 3 ranks of three other vendors (resharded by DCP's planner);
- with a bit flipped in one of its shards, loaded on 2 ranks of the plain gloo backend: the damage
  is detected, a warning names the file and the tensor, and the previous checkpoint loads;
- converted (VCGA's layout, and the same state written by torch's own dcp.save) to one file whose
  tensors are the consolidated shards, bit for bit;
- on a small tmpfs filled up between two saves, the second save fails on every rank with a typed
  error, leaves nothing behind, and the first stays the latest and loads.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vcga.testing import run_world

MiB = 1 << 20


def _model_and_optimizer(seed_step: int | None):
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 12))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if seed_step is not None:
        import torch.distributed as dist

        for s in range(seed_step):
            torch.manual_seed(100 * s + dist.get_rank())
            model(torch.randn(5, 24)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def _state(model, opt, extra):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": extra, "step_count": 0}


def _full(state) -> dict[str, torch.Tensor]:
    """Every tensor of the state, whole (DTensors gathered), keyed like DCP's flattened names."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            out[prefix] = (obj.full_tensor() if hasattr(obj, "full_tensor") else obj).detach().clone()

    walk("", state)
    return out


def _plain(full: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Tensors as (dtype, shape, bytes): a rank's result must not hold memory torch shares by fd."""
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape), v.contiguous().reshape(-1).view(torch.uint8)
                .numpy().tobytes()) for k, v in full.items()}


def _extra_dtensor(value: float):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5) * value  # 7 rows over 4 ranks: uneven
    return distribute_tensor(base, mesh, [Shard(0)])


def _save_world(rank, world, init_method, root, torch_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import vcga.checkpoint as ckpt

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world)
    try:
        model, opt = _model_and_optimizer(1)
        s1 = _state(model, opt, _extra_dtensor(1.0))
        ckpt.save(s1, root, step=1)
        full1 = _full(s1)
        model2, opt2 = _model_and_optimizer(2)
        s2 = _state(model2, opt2, _extra_dtensor(2.0))
        s2["step_count"] = 2
        fut = ckpt.async_save(s2, root, step=2)
        full2 = _full(s2)
        assert fut.result(timeout=120) == Path(root) / "step-2"
        # torch's own writer, the same sharded state: for the converter's torch layout.
        dcp.save(s2, storage_writer=dcp.FileSystemWriter(torch_dir))
        ckpt.wait()
        backend = dist.group.WORLD.transport.backend_name if hasattr(dist.group.WORLD, "transport") else "?"
        return {"full1": _plain(full1), "full2": _plain(full2), "backend": backend} if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _load_world(rank, world, init_method, backend, root):
    import torch.distributed as dist

    import vcga.checkpoint as ckpt

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("vcga.checkpoint").addHandler(Keep(logging.WARNING))
    try:
        model, opt = _model_and_optimizer(None)  # fresh weights: everything must come from the checkpoint
        state = _state(model, opt, _extra_dtensor(0.0))
        step = ckpt.load_latest(state, root)
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full = _plain(_full(_state(model, opt, state["extra"])))
        return {"step": step, "full": full, "warnings": records, "step_count": state["step_count"]} \
            if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k] == b[k], k  # dtype, shape and every byte


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("world")
    root, torch_dir = tmp / "ckpt", tmp / "torch-dcp"
    out = run_world(_save_world, 4, str(root), str(torch_dir), env={"VCGA_SIM_VENDORS": "nccl:2,hccl:2"})[0]
    assert out["backend"] == "bridge(sim-nccl:2,sim-hccl:2)"
    return tmp, root, torch_dir, out


def test_saved_on_two_vendors_loads_resharded_on_three_others_then_falls_back_on_damage(saved, tmp_path):
    tmp, root, _, out = saved
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-2"]
    assert len(list((root / "step-2").glob("__*_0.vbin"))) == 4
    three = run_world(_load_world, 3, "vcga", str(root), env={"VCGA_SIM_VENDORS": "nccl:1,hccl:1,cncl:1"})[0]
    assert three["step"] == 2 and three["step_count"] == 2 and not three["warnings"]
    _equal(three["full"], out["full2"])

    # A flipped bit in a shard holding a sharded tensor's chunk: rank 2's file.
    damaged = tmp_path / "damaged"
    shutil.copytree(root, damaged)
    shard = damaged / "step-2" / "__2_0.vbin"
    from vcga.formats import vbin

    with vbin.VbinReader(shard) as r:
        rec = next(rec for rec in r._records if rec.name.startswith("model.0.weight"))
    data = bytearray(shard.read_bytes())
    data[rec.offset + rec.nbytes // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    two = run_world(_load_world, 2, "gloo", str(damaged))[0]
    assert two["step"] == 1
    _equal(two["full"], out["full1"])
    text = " ".join(two["warnings"])
    assert "step-2" in text and "__2_0.vbin" in text and repr(rec.name) in text, text


def test_sharded_checkpoints_convert_to_whole_tensors_bit_exact(saved, tmp_path):
    _, root, torch_dir, out = saved
    from vcga.convert import convert, inspect_checkpoint
    from vcga.formats import vbin

    for src, name in ((root / "step-2", "vcga"), (torch_dir, "torch")):
        dst = tmp_path / f"{name}.vbin"
        rep = convert(src, dst, verify=True)
        assert rep.source_format == "dcp"
        with vbin.VbinReader(dst) as r:
            assert r.metadata["dcp.layout"] == name
            for k, want in out["full2"].items():
                assert _plain({k: r.torch(k)})[k] == want, (name, k)
    rows = {r["name"]: r for r in inspect_checkpoint(root / "step-2", verify=True).tensors}
    assert rows["extra"]["shape"] == [7, 5] and rows["extra"]["status"] == "computed"  # 4 chunks, assembled
    # A chunk of a sharded tensor missing from the metadata's storage map: refused, not zero-filled.
    import pickle

    bad = tmp_path / "bad"
    shutil.copytree(torch_dir, bad)
    md = pickle.loads((bad / ".metadata").read_bytes())
    victim = next(k for k in md.storage_data if k.fqn == "extra" and any(k.offset))
    del md.storage_data[victim]
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    from vcga.errors import VcgaFormatError

    with pytest.raises(VcgaFormatError, match=r"'extra': the chunk at offsets \[\d+, 0\] has no storage entry"):
        convert(bad, tmp_path / "bad.vbin")


def _disk_full_world(rank, world, init_method, root, ballast):
    import os

    import torch.distributed as dist

    import vcga.checkpoint as ckpt
    from vcga.errors import VcgaCheckpointError

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world)
    try:
        model, opt = _model_and_optimizer(1)
        ckpt.save(_state(model, opt, _extra_dtensor(1.0)), root, step=1)
        if rank == 0:  # fill the filesystem, leaving less than a shard needs
            st = os.statvfs(root)
            with open(ballast, "wb") as f:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - 4096))
        dist.barrier()
        try:
            ckpt.save(_state(model, opt, _extra_dtensor(2.0)), root, step=2)
            raised = None
        except VcgaCheckpointError as e:
            raised = str(e)
        dist.barrier()
        leftovers = sorted(os.listdir(root))
        latest = ckpt.latest_step(root)
        fresh, fopt = _model_and_optimizer(None)
        state = _state(fresh, fopt, _extra_dtensor(0.0))
        loaded = ckpt.load_latest(state, root)
        dist.barrier()
        if rank == 0:
            os.unlink(ballast)
        dist.barrier()
        ckpt.save(_state(model, opt, _extra_dtensor(2.0)), root, step=2)  # space again: it works
        return {"raised": raised, "leftovers": leftovers, "latest": latest, "loaded": loaded,
                "after": ckpt.latest_step(root)}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(shutil.which("mount") is None, reason="needs mount(8)")
def test_disk_full_during_save_fails_typed_on_every_rank_and_the_previous_checkpoint_stays(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "vcga-test-full", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        outs = run_world(_disk_full_world, 2, str(mnt / "ckpt"), str(mnt / "ballast"),
                         env={"VCGA_SIM_VENDORS": "nccl:1,hccl:1"})
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
    for out in outs:
        assert out["raised"] is not None and "No space left on device" in out["raised"], out
        assert "previous checkpoint stays the latest" in out["raised"]
        assert out["leftovers"] == ["latest", "step-1"]  # nothing of the failed save remains
        assert out["latest"] == 1 and out["loaded"] == 1 and out["after"] == 2
