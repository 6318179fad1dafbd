"""Typed errors from the ``vcga`` process group: mismatches, timeouts, refusals -- never a hang.

One spawned 2-rank world runs every scenario, each on a fresh ``vcga`` group (``new_group`` with
its own options: debug mode on or off, a backend), so a scenario that times out its group cannot
disturb the next; the tests below assert on what each rank reported. Ranks that must stay out of a
collective wait on the store until the others are done -- never on a sleep -- and the world runner
kills anything that outlives its deadline, so a hang fails the suite instead of stalling it.
"""

from __future__ import annotations

import pytest

from vcga.testing import WorldFailed, run_world

TIMEOUT_S = 3.0
#: How much later than the timeout a waiting rank may raise: a store or gloo poll interval plus
#: process scheduling on a loaded 2-core machine ("timeout plus a few seconds").
SLACK_S = 20.0


def _group(backend: str | None = "gloo", debug: bool = False, timeout_s: float = TIMEOUT_S, **cfg: object):
    from dataclasses import replace

    import torch.distributed as dist

    from vcga.config import load_config
    from vcga.process_group import VcgaOptions

    config = replace(load_config(), debug=debug, collective_timeout_s=timeout_s, **cfg)
    return dist.new_group(backend="vcga", pg_options=VcgaOptions(config=config, backend=backend))


def _mismatch(rank: int, kind: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from vcga.errors import VcgaMismatchError

    g = _group(debug=True)
    t0 = time.monotonic()
    try:
        if kind == "shape":
            dist.all_reduce(torch.ones(4 if rank == 0 else 5), group=g)
        else:
            t = torch.ones(4)
            dist.all_reduce(t, group=g) if rank == 0 else dist.broadcast(t, 0, group=g)
    except VcgaMismatchError as e:
        elapsed = time.monotonic() - t0
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=g)  # nothing reached the network: the group still works
        return {"error": str(e), "elapsed": elapsed, "after": t.tolist(),
                "differences": {k: {int(r): v for r, v in d.items()} for k, d in e.differences.items()}}
    return {"error": None}


def _p2p_mismatch(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from vcga.errors import VcgaMismatchError

    g = _group(debug=True)
    if rank == 0:
        dist.send(torch.ones(8, dtype=torch.float32), 1, group=g)  # 32 bytes
        return {"error": None}
    try:
        dist.recv(torch.empty(4, dtype=torch.float64), 0, group=g)  # also 32 bytes: gloo would deliver garbage
    except VcgaMismatchError as e:
        return {"error": str(e), "fields": sorted(e.differences)}
    return {"error": None}


def _absent(rank: int, store, key: str, run) -> dict:
    """Rank 1 stays out (alive, waiting on ``key``); rank 0 runs ``run()`` and reports."""
    import time

    from vcga.errors import VcgaTimeoutError

    if rank == 1:
        store.wait([key])
        return {"error": None}
    t0 = time.monotonic()
    try:
        run()
    except VcgaTimeoutError as e:
        return {"error": str(e), "elapsed": time.monotonic() - t0, "missing": list(e.missing_ranks),
                "is_runtime": isinstance(e, RuntimeError)}
    finally:
        store.set(key, "1")
    return {"error": None}


def _refusal() -> dict:
    import torch
    import torch.distributed as dist

    from vcga.errors import VcgaUnsupportedError

    g = _group(backend="sim-hccl")
    out: dict = {}
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.float64), group=g)
    except VcgaUnsupportedError as e:
        out = {"backend": e.backend, "collective": e.collective, "dtype": e.dtype, "op": e.op, "msg": str(e)}
    t = torch.ones(3)
    dist.all_reduce(t, group=g)  # nothing was sent: the group is intact
    out["after"] = t.tolist()
    return out


def _creation(**options: object) -> str:
    from vcga.errors import VcgaError

    try:
        _group(**options)
    except VcgaError as e:
        return f"{type(e).__name__}: {e}"
    return "created"


def scenarios_world(rank: int, world_size: int, init_method: str) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=VcgaOptions(backend="gloo"))
    store = dist.distributed_c10d._get_default_store()
    out = {
        "mismatch_shape": _mismatch(rank, "shape"),
        "mismatch_collective": _mismatch(rank, "collective"),
        "p2p_mismatch": _p2p_mismatch(rank),
        "refusal": _refusal(),
        "unavailable": _creation(backend="nccl"),
        "mixed": _creation(backend=None, sim_vendors="nccl:1,hccl:1"),
    }
    g = _group(debug=True)
    out["debug_absent"] = _absent(rank, store, "k1", lambda: dist.all_reduce(torch.ones(2), group=g))
    g = _group()
    out["sync_absent"] = _absent(rank, store, "k2", lambda: dist.all_reduce(torch.ones(1024), group=g))
    g = _group()
    out["async_absent"] = _absent(rank, store, "k3",
                                  lambda: dist.all_reduce(torch.ones(1024), group=g, async_op=True).wait())
    g = _group(timeout_s=60)
    g.monitored_barrier(timedelta(seconds=TIMEOUT_S))  # everyone arrives: passes
    out["monitored"] = _absent(rank, store, "k4",
                               lambda: g.monitored_barrier(timedelta(seconds=TIMEOUT_S), wait_all_ranks=True))
    dist.barrier()  # the default group was never disturbed
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_world(scenarios_world, 2, timeout=300)


@pytest.mark.parametrize("kind", ["shape", "collective"])
def test_debug_mismatch_raises_on_every_rank(reports: list[dict], kind: str) -> None:
    """VCGA_DEBUG=1: different shapes (or collectives) on two ranks -> VcgaMismatchError on both."""
    res = [r[f"mismatch_{kind}"] for r in reports]
    for r in res:
        assert r["error"] is not None, "no mismatch raised"
        assert r["elapsed"] < TIMEOUT_S, "the mismatch must be found before the timeout, not by it"
        assert r["after"] == [3.0, 3.0, 3.0]
    assert res[0]["differences"] == res[1]["differences"]
    assert "rank 0" in res[0]["error"] and "rank 1" in res[0]["error"]
    if kind == "shape":
        assert res[0]["differences"] == {"shape": {0: "(4,)", 1: "(5,)"}}
    else:  # all_reduce vs broadcast also differ in op and root
        assert res[0]["differences"]["collective"] == {0: "all_reduce", 1: "broadcast"}


def test_debug_p2p_mismatch_named_on_receiver(reports: list[dict]) -> None:
    """A send/recv pair whose dtypes differ (same byte count) is named, not reinterpreted."""
    r = reports[1]["p2p_mismatch"]
    assert r["error"] is not None
    assert r["fields"] == ["dtype", "shape"]


def test_debug_missing_rank_is_named(reports: list[dict]) -> None:
    r = reports[0]["debug_absent"]
    assert r["missing"] == [1]
    assert "never reached" in r["error"]
    assert r["elapsed"] <= TIMEOUT_S + SLACK_S


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_that_never_joins_gives_typed_timeout(reports: list[dict], mode: str) -> None:
    """A rank that never joins -> VcgaTimeoutError on the rank that waited, within the timeout."""
    r = reports[0][f"{mode}_absent"]
    assert r["error"] is not None and "did not complete within" in r["error"]
    assert r["is_runtime"], "VcgaTimeoutError is also a RuntimeError, as torch's timeouts are"
    assert TIMEOUT_S * 0.9 <= r["elapsed"] <= TIMEOUT_S + SLACK_S


def test_monitored_barrier_names_missing_rank(reports: list[dict]) -> None:
    r = reports[0]["monitored"]
    assert r["missing"] == [1]
    assert "Rank 1 failed to pass monitoredBarrier" in r["error"]


def test_refusal_is_typed_and_identical_on_every_rank(reports: list[dict]) -> None:
    """sim-hccl (fake-backed HCCL) refuses fp64 reductions: the error names everything and a fix."""
    a, b = (r["refusal"] for r in reports)
    assert a["msg"] == b["msg"]
    assert (a["backend"], a["collective"], a["dtype"], a["op"]) == ("sim-hccl", "all_reduce", "float64", "SUM")
    assert "float32" in a["msg"] and "Cast the tensor" in a["msg"]
    assert a["after"] == [2.0, 2.0, 2.0]


def test_unavailable_backend_fails_every_rank(reports: list[dict]) -> None:
    assert all(r["unavailable"].startswith("VcgaBackendUnavailable") and "nccl" in r["unavailable"] for r in reports)


def test_mixed_vendors_create_a_bridged_group(reports: list[dict]) -> None:
    """sim_vendors nccl:1,hccl:1 (fake-backed vendors): the group is created on every rank, through
    the mixed-vendor bridge (its collectives: tests/test_bridge.py)."""
    assert [r["mixed"] for r in reports] == ["created", "created"]


def test_world_runner_reports_a_dead_rank() -> None:
    """The harness itself: a rank that dies is a failure with its reason, not a hang."""
    with pytest.raises(WorldFailed, match="rank 1"):
        run_world(_die_on_rank_1, 2, timeout=60)


def _die_on_rank_1(rank: int, world_size: int, init_method: str) -> None:
    import os

    if rank == 1:
        os._exit(3)
