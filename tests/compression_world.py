"""Rank body for tests/test_compression.py's spawned worlds (one world serves many assertions)."""

from __future__ import annotations

import hashlib
import os
from typing import Any


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).numpy().tobytes()).hexdigest()


def as_if_saved_on(blob: bytes, location: str) -> bytes:
    """``torch.save`` bytes made on this CPU-only host, as if their tensors had been saved on
    ``location`` (e.g. "cuda:0"): every storage's location tag in the archive's pickle rewritten,
    which is what ``torch.save`` writes on that device. ``torch.load`` of the result on this host
    fails as it would for a real checkpoint from a GPU (the caller checks that it does)."""
    import io
    import zipfile

    tag = b"X\x03\x00\x00\x00cpu"  # pickle protocol 2's BINUNICODE 'cpu' (torch.save's default protocol)
    new = location.encode()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                if tag not in data:
                    raise AssertionError("no storage location 'cpu' in the archive's pickle")
                data = data.replace(tag, b"X" + len(new).to_bytes(4, "little") + new)
            zout.writestr(info.filename, data)
    return out.getvalue()


def _digest_of(value: Any) -> str:
    """One digest of nested dicts, lists and tuples of tensors and plain values (keys in sorted order)."""
    import torch

    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"{type(v).__name__}{len(v)}".encode())
            for x in v:
                walk(x)
        else:
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()


def _join(rank: int, world: int, port: int, vendors: str, timeout_s: str = "60") -> None:
    """This rank's default ``vcga`` group over simulated ``vendors`` (one torch thread: small worlds
    on a 2-core machine)."""
    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers backend "vcga" (torch's autoload does too; explicit here)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      VCGA_SIM_VENDORS=vendors, VCGA_TIMEOUT=timeout_s)
    torch.set_num_threads(1)
    dist.init_process_group("vcga")


def rank_main(rank: int, world: int, port: int, vendors: str, specs: list[str], queue: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga.compress import WireMeter, ddp_hook, parse_spec
    from vcga.compress.engine import Reducer, Topology

    _join(rank, world, port, vendors)
    out: dict[str, Any] = {"exact": {}, "ddp": {}, "wire": {}}
    topo = Topology.build()
    out["layout"] = topo.layout.describe()
    # 1. plumbing is exact: bf16 of small integers is lossless and their sums are exact, so every
    #    scope and layout must give the exact sum, bit for bit, whatever the partition
    shapes = [(37, 11), (5,), (64, 3), (1,)]
    total = sum(int(torch.tensor(s).prod()) for s in shapes)
    xs = [torch.randint(-8, 9, (total,), generator=torch.Generator().manual_seed(r)).float() for r in range(world)]
    want = torch.stack(xs).sum(0)
    for scope in ("bridge", "all"):
        for comp in ("bf16", "powersgd:rank=64,min_rate=0"):
            spec = parse_spec(f"{comp},scope={scope}".replace(":rank", ":rank").replace("bf16,", "bf16:"))
            red = Reducer(spec, topology=topo)
            flat = xs[rank].clone()
            red.all_reduce(flat, shapes, key=0)
            if comp == "bf16":
                out["exact"][f"{comp} {scope}"] = bool(torch.equal(flat, want))
            else:  # full rank: exact up to rounding; compare within a loose bound, bits across ranks below
                out["exact"][f"{comp} {scope}"] = float((flat - want).abs().max())
            digests: list[Any] = [None] * world
            dist.all_gather_object(digests, _digest(flat))
            out["exact"][f"{comp} {scope} identical"] = len(set(digests)) == 1
    # 1b. a bucket holding one large matrix (DDP's usual bucket): every island rank compresses
    #     its share of it (rows of the matrix), none idles while another compresses the whole
    meter = WireMeter()
    red = Reducer(parse_spec("powersgd:rank=2"), topology=topo, meter=meter)
    try:
        bucket = [(64, 32), (32,)]
        flat = torch.randn(64 * 32 + 32, generator=torch.Generator().manual_seed(7 + rank))
        red.all_reduce(flat, bucket, key="one-matrix")
        mine = {"payload": meter.total_sent("cross:payload"),
                "plain": 4 * (flat.numel() // max(len(red.island), 1)),
                # what the island's copy-back all-gather was handed (the decoded parts' compact form)
                "island_gather": meter.snapshot()["handed"].get("island", {}).get("all_gather", 0),
                "digest": _digest(flat)}
    finally:
        red.close()
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    out["one_matrix"] = shares
    # 2. DDP through the hook, every compressor: parameters bitwise identical after the steps
    for spec in specs:
        torch.manual_seed(0)
        unused = spec.endswith("|unused")  # DDP's own collectives for unused parameters, beside the hook's
        model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        if unused:
            model.spare = nn.Linear(4, 4)  # never used in forward
        ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=unused)
        meter = WireMeter()
        if spec == "torch-powersgd":  # torch's own hook: it issues all_reduces from future callbacks
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, ps.powerSGD_hook)
        else:
            state, hook = ddp_hook(spec.removesuffix("|unused"), meter=meter)
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x, y = torch.randn(8, 24, generator=g), torch.randn(8, 4, generator=g)
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        digests = [None] * world
        dist.all_gather_object(digests, _digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
        d = state.describe() if hasattr(state, "describe") else {"stats": None}
        out["ddp"][spec] = {"identical": len(set(digests)) == 1, "stats": d["stats"], "scope": d.get("scope"),
                            "link": d.get("link"), "auto": d.get("auto"),
                            "finite": bool(all(torch.isfinite(p).all() for p in model.parameters())),
                            "cross_sent": meter.total_sent("cross"),
                            # collectives of the compressed exchange (all rounds, all buckets) over the steps
                            "cross_calls": meter.snapshot()["calls"].get("cross:payload", 0),
                            "buckets": d["stats"] and sum(d["stats"].values())}
        if hasattr(state, "close"):
            state.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def failing_main(rank: int, world: int, port: int, vendors: str, overlap: bool, fault: str, queue: Any) -> None:
    """Two good DDP steps through vcga's hook, then one whose compressed exchange fails: ``fault``
    "injected" -- on every rank, a fault injected into the reducer's finish; "peer-absent" -- rank 1
    never starts the step, so rank 0's exchange times out (collective timeout 3 s). Rank 0 reports
    what its ``loss.backward()`` raised. (Two good steps: DDP's second forward rebuilds its buckets
    with a collective of its own.)"""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga.compress import ddp_hook
    from vcga.compress.engine import Reducer
    from vcga.errors import typed

    _join(rank, world, port, vendors, "3" if fault == "peer-absent" else "60")
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(24, 16))
    state, hook = ddp_hook("powersgd:rank=2", overlap=overlap)
    ddp.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    for step in range(3):
        if step == 2 and fault == "injected":
            def broken(self: Any, pending: Any, divisor: float = 1.0) -> None:
                raise ValueError("injected fault")

            Reducer.finish = broken  # type: ignore[method-assign]
        if step == 2 and fault == "peer-absent" and rank == 1:
            store.wait(["reported"], timedelta(seconds=120))  # rank 0 has what it needs
            break
        loss = ddp(torch.randn(4, 24, generator=g)).square().mean()
        try:
            loss.backward()
            out[f"step {step}"] = "ok"
        except Exception as e:  # noqa: BLE001 - what a training script would catch
            err = typed(e)
            out[f"step {step}"] = {"raised": type(e).__name__, "text": str(e), "typed": type(err).__name__,
                                   "typed_text": str(err), "cause": repr(err.__cause__)}
    if rank == 0:
        queue.put(out)
        store.set("reported", "1")
    if fault == "peer-absent":  # the group saw a timeout: leave without a teardown that waits on peers
        queue.close()
        queue.join_thread()
        os._exit(0)
    state.close()
    dist.destroy_process_group()


def resume_main(rank: int, world: int, port: int, vendors: str, runs: list[tuple[str, bool]], root: str,
                relocate: tuple[str, ...], queue: Any) -> None:
    """For each (spec, DDP's find_unused_parameters): DDP through vcga's hook for 6 steps straight;
    the same job stopped after 3 steps (vcga.checkpoint.save of the model and the compression
    state; for "sign" async_save, with a fourth step taken while it is in flight) and resumed in fresh objects from a differently initialised model; and resumed without
    the compression state; for the specs in ``relocate``, resumed from the state's bytes as if saved
    on a GPU (:func:`as_if_saved_on`). Reports digests of the parameters (identical across ranks?), the
    state's bucket keys, and what loading a state kept for another spec does."""
    import io
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga import checkpoint
    from vcga.compress import ddp_hook
    from vcga.errors import VcgaCheckpointError

    _join(rank, world, port, vendors)

    def job(spec: str, init_seed: int) -> tuple[Any, Any, Any, Any]:
        torch.manual_seed(init_seed)
        model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        # several buckets; without find_unused_parameters DDP's first step has one bucket of all
        ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=unused)
        state, hook = ddp_hook(spec)
        ddp.register_comm_hook(state, hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05)

    def train(ddp: Any, opt: Any, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 24, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()

    def digest(model: Any) -> str:
        d = _digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, d)
        return d if len(set(every)) == 1 else "ranks differ"

    out: dict[str, Any] = {}
    for spec, unused in runs:
        got: dict[str, Any] = {}
        model, ddp, state, opt = job(spec, 0)
        train(ddp, opt, range(6))
        got["straight"] = digest(model)
        got["straight keys"] = sorted(map(repr, state.reducer.exchange.slots))
        state.close()

        model, ddp, state, opt = job(spec, 0)
        train(ddp, opt, range(3))
        where = os.path.join(root, f"{spec}-{unused}".replace(":", "_").replace(",", "_").replace("=", "-"))
        if spec == "sign":
            # async_save takes the state when called: a step taken while the save is in flight
            # must not reach the checkpoint
            fut = checkpoint.async_save({"model": model.state_dict(), "compression": state}, where, step=3)
            mine = state.state_dict()
            train(ddp, opt, range(3, 4))
            fut.result(120)
        else:
            checkpoint.save({"model": model.state_dict(), "compression": state}, where, step=3)
            mine = state.state_dict()
        got["entry"] = sorted(mine)
        state.close()

        for with_state in (True, False):
            model, ddp, state, opt = job(spec, 1)  # another init: the checkpoint must bring the model back
            wanted: dict[str, Any] = {"model": model.state_dict()}
            if with_state:
                wanted["compression"] = state
            got["loaded step" if with_state else "loaded step, no state"] = checkpoint.load_latest(wanted, where)
            train(ddp, opt, range(3, 6))
            got["resumed" if with_state else "resumed without the state"] = digest(model)
            if with_state:
                got["resumed keys"] = sorted(map(repr, state.reducer.exchange.slots))
            state.close()

        if spec in relocate:
            # the same state as if saved on a GPU, resumed on this CPU-only host: torch.load alone fails
            entry = next(iter(mine))
            moved = {entry: as_if_saved_on(mine[entry], "cuda:0")}
            try:
                torch.load(io.BytesIO(moved[entry]), weights_only=True)
                got["cuda bytes load here"] = True
            except RuntimeError:
                got["cuda bytes load here"] = False
            model, ddp, state, opt = job(spec, 1)
            checkpoint.load_latest({"model": model.state_dict()}, where)
            state.load_state_dict(moved, strict=True)
            train(ddp, opt, range(3, 6))
            got["resumed from cuda bytes"] = digest(model)
            state.close()

        # a state kept for another compression: a warning and a fresh start, or (strict) a typed error
        other, _ = ddp_hook("bf16" if not spec.startswith("bf16") else "fp16")
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("vcga.compress.hook").addHandler(handler)
        try:
            other.load_state_dict(mine)
        finally:
            logging.getLogger("vcga.compress.hook").removeHandler(handler)
        got["other spec warned"] = records
        got["other spec step"] = other.step
        try:
            other.load_state_dict(mine, strict=True)
            got["other spec strict"] = None
        except VcgaCheckpointError as e:
            got["other spec strict"] = str(e)
        other.close()
        out[f"{spec} {unused}"] = got
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def alone_main(rank: int, world: int, port: int, vendors: str, specs: list[str], queue: Any) -> None:
    """DDP through ``ddp_hook(spec)`` beside plain DDP on the same model and batches: per spec, the
    hook's stats and whether every gradient equals plain DDP's, bit for bit (a world where nothing
    crosses a link: the hook must reduce exactly and say so)."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga.compress import ddp_hook

    _join(rank, world, port, vendors)
    out: dict[str, Any] = {}
    for spec in specs:
        nets = []
        for _ in range(2):
            torch.manual_seed(0)
            nets.append(DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))))
        state, hook = ddp_hook(spec)
        nets[0].register_comm_hook(state, hook)
        same = True
        for step in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
            grads = []
            for net in nets:
                net.zero_grad()
                net(x).square().mean().backward()
                grads.append([p.grad.clone() for p in net.parameters()])
            same = same and all(torch.equal(a, b) for a, b in zip(*grads, strict=False))
            with torch.no_grad():  # the same step for both: they stay equal
                for net in nets:
                    for p, g in zip(net.parameters(), grads[1], strict=False):
                        p.sub_(0.1 * g)
        state.close()
        out[spec] = {"stats": dict(state.stats), "same": same}
    if rank == 0:
        queue.put(out)


def narrow_main(rank: int, world: int, port: int, vendors: str, specs: list[str], queue: Any) -> None:
    """DDP of a bfloat16 model and of a float16 one through ``ddp_hook(spec)``, four SGD steps:
    per (dtype, spec), the error if one was raised, else whether every rank holds the same bits,
    whether the parameters stayed finite, and the hook's stats."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga.compress import ddp_hook

    _join(rank, world, port, vendors)
    out: dict[str, Any] = {}
    for dt in (torch.bfloat16, torch.float16):
        for spec in specs:
            torch.manual_seed(0)
            net = DDP(nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)).to(dt))
            state, hook = ddp_hook(spec)
            net.register_comm_hook(state, hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            got: dict[str, Any] = {}
            try:
                for step in range(4):
                    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(10 * step + rank)).to(dt)
                    opt.zero_grad()
                    net(x).float().square().mean().backward()
                    opt.step()
            except Exception as e:  # noqa: BLE001 - reported to the test, which names it
                got["error"] = repr(e)[:400]
            state.close()
            flat = torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])
            digests: list[Any] = [None] * world
            dist.all_gather_object(digests, _digest(flat))
            got.update(identical=len(set(digests)) == 1, finite=bool(torch.isfinite(flat).all()), stats=dict(state.stats))
            out[f"{str(dt).split('.')[1]} {spec}"] = got
    if rank == 0:
        queue.put(out)


def overflow_main(rank: int, world: int, port: int, vendors: str, specs: list[str], queue: Any) -> None:
    """DDP through ``ddp_hook(spec)`` with torch.amp's GradScaler, eight steps; at step 3 rank 1's
    loss overflows (times infinity, as a float16 overflow on one rank). Per spec: the scale after
    every step (the scaler halves it for each step it skips), whether the parameters are finite
    and the same bits on every rank at the end, and the hook's description."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga.compress import ddp_hook

    _join(rank, world, port, vendors)
    out: dict[str, Any] = {}
    for spec in specs:
        torch.manual_seed(0)
        net = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)))
        state, hook = ddp_hook(spec)
        net.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        scales = []
        for step in range(8):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            loss = net(x).square().mean()
            if step == 3 and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        state.close()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, _digest(flat))
        out[spec] = {"scales": scales, "identical": len(set(digests)) == 1,
                     "finite": bool(torch.isfinite(flat).all()), "describe": state.describe()}
    if rank == 0:
        queue.put(out)


def subgroup_main(rank: int, world: int, port: int, vendors: str, specs: list[str], queue: Any) -> None:
    """DDP over a data-parallel subgroup, as in a job that also splits its model: a (dp, tp) =
    (2, 2) ``DeviceMesh``, whose data-parallel groups are ranks {0, 2} and {1, 3}, each pair across
    the two vendors. Per spec: the error if the hook refused, else its scope, its stats and whether
    the pair holds the same gradients. A spec ending in ``+mesh`` passes every data-parallel group,
    read from the mesh as docs/compression.md shows."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga.compress import ddp_hook

    _join(rank, world, port, vendors)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_group()
    d = mesh.mesh_dim_names.index("dp")
    groups = mesh.mesh.movedim(d, -1).reshape(-1, mesh.mesh.size(d)).tolist()  # docs/compression.md's line
    out: dict[str, Any] = {"mesh groups": groups}
    for spec in specs:
        torch.manual_seed(0)
        net = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), process_group=dp)
        try:
            text = spec.removesuffix("+mesh")
            state, hook = ddp_hook(text, process_group=dp, data_parallel_groups=groups if spec.endswith("+mesh") else None)
        except Exception as e:  # noqa: BLE001 - reported to the test, which reads it
            out[spec] = {"error": f"{type(e).__name__}: {e}"}
            continue
        net.register_comm_hook(state, hook)
        for step in range(3):
            net(torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        digests: list[Any] = [None, None]
        dist.all_gather_object(digests, _digest(grads), group=dp)
        out[spec] = {"scope": state.describe()["scope"], "stats": dict(state.stats),
                     "identical": len(set(digests)) == 1, "finite": bool(torch.isfinite(grads).all())}
        state.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        queue.put(everyone)


def subgroup_bridge_main(rank: int, world: int, port: int, vendors: str, specs: list[str], root: str,
                         queue: Any) -> None:
    """Scope bridge on data-parallel subgroups the job creates together (``data_parallel_groups``):
    on nccl:2,hccl:2, groups {0, 2, 3} (rank 0's island of one nccl rank, ranks 2-3 one hccl island:
    unequal, so the island sums, its first rank exchanges and broadcasts) and {1}. Per spec: scope,
    layout, the bytes each rank sent per label, whether the group holds the same gradients, the
    checkpoint entry's key, and whether a new hook loaded from a ``vcga.checkpoint`` of the whole
    job (under ``root``) holds this rank's own state. Then three wrong calls, each made by every
    rank: the errors."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vcga import checkpoint
    from vcga.compress import WireMeter, ddp_hook

    def kept(state: Any) -> Any:  # what the hook carries across steps: step count and every tensor's state
        return state.step, _digest_of(state.reducer.exchange.saved()) if state.reducer is not None else None

    _join(rank, world, port, vendors)
    groups = [[0, 2, 3], [1]]
    made = [dist.new_group(g) for g in groups]  # every rank creates both, in order
    mine = 0 if rank in groups[0] else 1
    dp = made[mine]
    out: dict[str, Any] = {}
    for spec in specs:
        torch.manual_seed(0)
        net = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), process_group=dp)
        meter = WireMeter()
        state, hook = ddp_hook(spec, process_group=dp, meter=meter, data_parallel_groups=groups)
        net.register_comm_hook(state, hook)
        for step in range(3):
            net(torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        digests: list[Any] = [None] * len(groups[mine])
        dist.all_gather_object(digests, _digest(grads), group=dp)
        d = state.describe()
        out[spec] = {"scope": d.get("scope"), "islands": [i["ranks"] for i in d["layout"]["islands"]] if "layout" in d else None,
                     "stats": dict(state.stats), "identical": len(set(digests)) == 1,
                     "finite": bool(torch.isfinite(grads).all()), "entries": sorted(state.state_dict()),
                     "sent": {label: meter.total_sent(label) for label in ("island", "cross")}}
        where = os.path.join(root, f"s{specs.index(spec)}")
        checkpoint.save({"compression": state}, where, step=3)
        fresh, _ = ddp_hook(spec, process_group=dp, data_parallel_groups=groups)
        checkpoint.load_latest({"compression": fresh}, where)
        out[spec]["reloaded"] = kept(fresh) == kept(state)
        state.close()
        fresh.close()
    wrong = {"groups differ between ranks": [[0, 2, 3], [1]] if rank != 3 else [[1], [0, 2, 3]],
             "a rank left out": [[0, 2, 3]],
             "not the process group": [[0, 1], [2, 3]]}
    for what, given in wrong.items():
        try:
            ddp_hook(specs[0], process_group=dp, data_parallel_groups=given)
            out[what] = {"error": ""}
        except Exception as e:  # noqa: BLE001 - reported to the test, which reads it
            out[what] = {"error": f"{type(e).__name__}: {e}"}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        queue.put(everyone)
