"""Regression tests for what `vcga verify` checks in the ``vcga`` group, where raw gloo fails.

One spawned 3-rank world runs every scenario through the public ``torch.distributed`` API and
reports what each rank saw; the tests below assert on it. Scenarios on the simulated vendors
(``sim-hccl``, ``sim-cncl``: fake-backed, gloo underneath with the vendor's rules) use their own
``new_group`` inside the same world.

- uneven gather / scatter: refused with ``VcgaMismatchError`` on EVERY rank, promptly (torch's
  backends check only on the root, and the other ranks would wait for the timeout);
- a zero-length receive from any source completes and names the sender (gloo's enforce failed);
- a complex128 refusal names complex128 (torch hands backends ``view_as_real`` views);
- sim-cncl's table and dispatcher agree on complex128 SUM/AVG/PREMUL_SUM (emulated);
- raw gloo's bugs stay out of reach: strided tensors, uneven list all_to_all, reduce_scatter works
  that never report completion and have no future.
"""

from __future__ import annotations

import pytest

from vcga.testing import run_world

WORLD = 3
TIMEOUT_S = 20.0


def _group(backend: str):
    from dataclasses import replace

    import torch.distributed as dist

    from vcga.config import load_config
    from vcga.process_group import VcgaOptions

    config = replace(load_config(), collective_timeout_s=TIMEOUT_S)
    return dist.new_group(backend="vcga", pg_options=VcgaOptions(config=config, backend=backend))


def _refusal(fn) -> dict:
    import time

    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return {"type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}
    return {"type": None, "s": time.monotonic() - t0}


def _scenarios(rank: int, ws: int, init_method: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from vcga.contract import Collective, ReduceOp

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=ws)
    g = _group("gloo")
    out: dict = {}

    # -- a. uneven gather / scatter: every rank refuses, then the group still works ------------------
    def uneven_gather() -> None:
        outs = [torch.zeros(r + 1) for r in range(ws)] if rank == 0 else None
        dist.gather(torch.ones(rank + 1), outs, dst=0, group=g)

    def uneven_scatter() -> None:
        ins = [torch.full((r + 1,), float(r)) for r in range(ws)] if rank == ws - 1 else None
        dist.scatter(torch.zeros(rank + 1), ins, src=ws - 1, group=g)

    def gather_list_wrong() -> None:  # every input the same, but the root's list disagrees
        outs = [torch.zeros(2 if r == 1 else 3) for r in range(ws)] if rank == 0 else None
        dist.gather(torch.ones(3), outs, dst=0, group=g)

    def gather_dtype_wrong() -> None:
        outs = [torch.zeros(3) for _ in range(ws)] if rank == 0 else None
        dist.gather(torch.ones(3, dtype=torch.float64 if rank == 1 else torch.float32), outs, dst=0, group=g)

    out["uneven_gather"] = _refusal(uneven_gather)
    out["uneven_scatter"] = _refusal(uneven_scatter)
    out["gather_list_wrong"] = _refusal(gather_list_wrong)
    out["gather_dtype_wrong"] = _refusal(gather_dtype_wrong)
    # equal element counts in different shapes are fine (the bytes move flat), and the group works
    outs = [torch.zeros(6) for _ in range(ws)] if rank == 1 else None
    dist.gather(torch.arange(6.0).reshape(2, 3) + rank, outs, dst=1, group=g)
    out["gather_after"] = [o.tolist() for o in outs] if outs else None
    o = torch.zeros(2, 2)
    dist.scatter(o, [torch.full((4,), float(r)) for r in range(ws)] if rank == 0 else None, src=0, group=g)
    out["scatter_after"] = o.flatten().tolist()

    # -- b. zero-length messages, from any source too --------------------------------------------------
    # One tag per message kind: an any-source receive matches whichever tag-equal message comes
    # first, so without tags rank 1's *next* message could satisfy the receive meant for rank 2's
    # (and gloo aborts the process on the size mismatch that follows).
    got: dict = {}
    if rank == 0:
        for _ in range(ws - 1):
            w = dist.irecv(torch.empty(0), src=None, group=g, tag=0)
            w.wait()
            got.setdefault("empty_from", []).append(w._source_rank())
        t = torch.empty(0, dtype=torch.bool)
        dist.recv(t, src=1, group=g, tag=1)  # a specific source, another dtype
        w = dist.irecv(torch.zeros(3), src=None, group=g, tag=2)  # and a normal message after them
        w.wait()
        got["then_from"] = w._source_rank()
    else:
        dist.send(torch.empty(0), 0, group=g, tag=0)
        if rank == 1:
            dist.send(torch.empty(0, dtype=torch.bool), 0, group=g, tag=1)
            dist.send(torch.ones(3), 0, group=g, tag=2)
    out["p2p_empty"] = got

    # -- e. strided (non-contiguous) tensors: right values, nothing outside the view written ----------
    base = torch.arange(12.0) + 100 * rank
    view = base[1::3]  # 4 elements, stride 3
    before = base.clone()
    dist.all_reduce(view, group=g)
    outside = torch.ones(12, dtype=torch.bool)
    outside[1::3] = False
    want = sum(torch.arange(12.0)[1::3] + 100 * r for r in range(ws))
    out["strided_all_reduce"] = bool(torch.equal(view, want)) and bool(torch.equal(base[outside], before[outside]))
    bbase = torch.full((4, 4), float(rank))
    bview = bbase.t()[1]  # a column: stride 4
    dist.broadcast(bview, src=2, group=g)
    out["strided_broadcast"] = bool((bview == 2).all()) and bool((bbase[:, :1] == rank).all())
    gbase = torch.zeros(ws, 6)
    gouts = list(gbase[:, ::2].unbind(0))  # each row's even columns: stride 2
    dist.all_gather(gouts, torch.full((3,), float(rank)).expand(3), group=g)
    out["strided_all_gather"] = (bool(torch.equal(gbase[:, ::2], torch.arange(ws, dtype=torch.float32)[:, None]
                                                  .expand(ws, 3))) and bool((gbase[:, 1::2] == 0).all()))
    rs_in = [torch.full((4, 2), float(rank + d)).t()[0] for d in range(ws)]  # stride 2 inputs
    rs_out = torch.zeros(8)[::2]
    dist.reduce_scatter(rs_out, rs_in, group=g)
    out["strided_reduce_scatter"] = bool((rs_out == sum(r + rank for r in range(ws))).all())
    if rank == 0:
        dist.send(torch.arange(8.0)[::2], 1, group=g)
    elif rank == 1:
        rbase = torch.zeros(8)
        dist.recv(rbase[1::2], 0, group=g)
        out["strided_recv"] = rbase.tolist()

    # -- e. uneven list all_to_all ----------------------------------------------------------------------
    ins = [torch.full((rank + d,), float(10 * rank + d)) for d in range(ws)]  # zero-length blocks too
    outs = [torch.empty(s + rank) for s in range(ws)]
    dist.all_to_all(outs, ins, group=g)
    out["uneven_all_to_all"] = all(torch.equal(outs[s], torch.full((s + rank,), float(10 * s + rank)))
                                   for s in range(ws))

    # -- e. reduce_scatter works complete on their own and have futures --------------------------------
    def polled(work) -> bool:
        deadline = time.monotonic() + TIMEOUT_S
        while not work.is_completed():  # a poll loop, as user code writes it; bounded
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    o1 = torch.zeros(2)
    w1 = dist.reduce_scatter(o1, [torch.ones(2) * (d + 1) for d in range(ws)], async_op=True, group=g)
    out["rs_list_polled"] = polled(w1) and o1.tolist() == [float(ws * (rank + 1))] * 2
    o2 = torch.zeros(2)
    w2 = dist.reduce_scatter_single(o2, torch.arange(2.0 * ws), async_op=True, group=g)
    value = w2.get_future().then(lambda f: f.value()[0] * 2).wait()
    out["rs_single_future"] = value.tolist() == [4.0 * ws * rank, (4.0 * rank + 2) * ws]
    out["rs_single_polled"] = polled(w2)
    # A synchronous call hands back a completed work: waiting on it again (torch's wrappers do)
    # must not touch the output. gloo's own reduce_scatter work copies its chunk into the output
    # on every wait(), so returning it cost an extra copy per call and would rewrite o3 here.
    o3 = torch.zeros(2)
    sync = dist.ReduceScatterOptions()
    sync.asyncOp = False
    w3 = g.reduce_scatter_single(o3, torch.arange(2.0 * ws), sync)
    got = o3.tolist()
    o3.zero_()
    w3.wait()
    out["rs_sync_rewait_is_a_no_op"] = (got == [2.0 * ws * rank, (2.0 * rank + 1) * ws] and w3.is_completed()
                                        and o3.tolist() == [0.0, 0.0])

    # -- c, d. complex128 on the simulated vendors ------------------------------------------------------
    for backend in ("sim-hccl", "sim-cncl"):
        sg = _group(backend)
        table = sg.capabilities
        res = {}
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            cell = table.lookup(Collective.ALL_REDUCE, "complex128", op)
            t = torch.full((5,), complex(rank + 1, -2 * rank), dtype=torch.complex128)
            top = dist._make_nccl_premul_sum(0.5) if op is ReduceOp.PREMUL_SUM else getattr(dist.ReduceOp, op.value)
            r = _refusal(lambda t=t, top=top: dist.all_reduce(t, op=top, group=sg))
            res[op.value] = {"cell": cell.support.value, "via": cell.via, "refusal": r, "got": t.tolist()}
        t = torch.full((3,), complex(1, rank), dtype=torch.complex128)
        res["reduce"] = _refusal(lambda t=t: dist.reduce(t, dst=0, group=sg))
        res["reduce_got"] = t.tolist()
        out[backend] = res
    dist.barrier(group=g)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(_scenarios, WORLD, timeout=300)


@pytest.mark.parametrize("case", ["uneven_gather", "uneven_scatter", "gather_list_wrong", "gather_dtype_wrong"])
def test_uneven_gather_scatter_refused_on_every_rank(world, case):
    """Every rank raises VcgaMismatchError (torch's rule: equal sizes and dtype), long before the
    timeout -- not the root alone while the others wait."""
    for rank, r in enumerate(world):
        got = r[case]
        assert got["type"] == "VcgaMismatchError", (rank, got)
        assert got["s"] < TIMEOUT_S / 2, (rank, got)
    msg = world[0][case]["msg"]
    assert ("dtype" if case == "gather_dtype_wrong" else "numel") in msg


def test_gather_scatter_still_work(world):
    """Equal element counts in other shapes move flat; the group works after the refusals."""
    assert world[1]["gather_after"] == [[float(v + r) for v in range(6)] for r in range(WORLD)]
    for rank, r in enumerate(world):
        assert r["scatter_after"] == [float(rank)] * 4


def test_zero_length_receive_from_any_source(world):
    got = world[0]["p2p_empty"]
    assert sorted(got["empty_from"]) == list(range(1, WORLD))
    assert got["then_from"] == 1


@pytest.mark.parametrize("case", ["strided_all_reduce", "strided_broadcast", "strided_all_gather",
                                  "strided_reduce_scatter"])
def test_strided_tensors_on_gloo(world, case):
    """gloo itself reads and writes strided tensors as if contiguous; through vcga they are staged."""
    assert all(r[case] for r in world), [r[case] for r in world]


def test_strided_recv_on_gloo(world):
    assert world[1]["strided_recv"] == [0.0, 0.0, 0.0, 2.0, 0.0, 4.0, 0.0, 6.0]


def test_uneven_list_all_to_all_on_gloo(world):
    assert all(r["uneven_all_to_all"] for r in world)


def test_reduce_scatter_work_completes_and_has_a_future(world):
    """gloo's reduce_scatter work never reports completion and has no future; vcga's does."""
    for r in world:
        assert r["rs_list_polled"] and r["rs_single_polled"] and r["rs_single_future"], r


def test_sync_reduce_scatter_returns_a_completed_work(world):
    """Waiting again on what a synchronous call returned changes nothing (gloo's work would copy again)."""
    assert all(r["rs_sync_rewait_is_a_no_op"] for r in world), world


def test_complex128_refusal_names_complex128_sim_hccl(world):
    """Fake-backed (sim-hccl): HCCL has no fp64 reductions, so complex128 SUM is refused -- and the
    error names the dtype the user passed, although torch hands the backend a float64 view."""
    for r in world:
        for op in ("SUM", "AVG", "PREMUL_SUM"):
            res = r["sim-hccl"][op]
            assert res["cell"] == "refused"
            assert res["refusal"]["type"] == "VcgaUnsupportedError"
            assert "complex128" in res["refusal"]["msg"] and "on float64" not in res["refusal"]["msg"]


def test_complex128_table_and_dispatch_agree_sim_cncl(world):
    """Fake-backed (sim-cncl): the float64 cells are emulated (gather_then_reduce), so complex128
    SUM/AVG/PREMUL_SUM are emulated as_real -- the table says so and the group runs them exactly."""
    total = sum(complex(r + 1, -2 * r) for r in range(WORLD))
    want = {"SUM": total, "AVG": total / WORLD, "PREMUL_SUM": total * 0.5}
    for r in world:
        for op, value in want.items():
            res = r["sim-cncl"][op]
            assert (res["cell"], res["via"]) == ("emulated", "as_real")
            assert res["refusal"]["type"] is None, res["refusal"]
            for got in res["got"]:
                assert abs(got - value) <= 4 * 2**-53 * abs(value), (op, got, value)
        assert r["sim-cncl"]["reduce"]["type"] is None
    assert world[0]["sim-cncl"]["reduce_got"] == [complex(WORLD, sum(range(WORLD)))] * 3


def test_complex_cells_follow_their_real_cells_in_every_shipped_table():
    """The derivation rule behind the sim-cncl fix, for every shipped table: a complex
    SUM/AVG/PREMUL_SUM cell runs (as_real) exactly when its real cell runs, native or emulated."""
    from vcga.contract import Collective, ReduceOp, Support
    from vcga.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    for name in ("gloo", "sim-nccl", "sim-hccl", "sim-cncl"):
        table = pm.backend(name).capabilities()
        for coll in Collective:
            if not coll.reduces:
                continue
            for cdt, rdt in (("complex64", "float32"), ("complex128", "float64")):
                for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
                    real = table.lookup(coll, rdt, op).support is not Support.REFUSED
                    cplx = table.lookup(coll, cdt, op).support is not Support.REFUSED
                    assert real == cplx, (name, coll.value, cdt, op.value)
