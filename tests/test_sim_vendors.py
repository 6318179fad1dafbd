"""The simulated vendor groups (fake-backed stand-ins for NCCL, HCCL and CNCL on gloo) behave like
the vendor libraries -- refuse what they refuse with their message, do what they do beyond gloo,
mangle what they mangle -- and ``vcga`` routes around every one of those behaviours.

One 2-rank world builds each raw simulated group through its plugin's factory (what the ``vcga``
group drives) next to a ``vcga`` group on the same vendor, runs the same calls on both and reports.
"""

from __future__ import annotations

from typing import Any

import pytest

from vcga.testing import run_world


def _try(fn: Any) -> tuple[str, str]:
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the type and text are what is checked
        return type(e).__name__, str(e).splitlines()[0]
    return "ok", repr(out)


def vendors_world(rank: int, world_size: int, init_method: str) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import vcga  # noqa: F401
    from vcga.contract import ReduceOp
    from vcga.plugin_manager import get_plugin_manager
    from vcga.process_group import VcgaOptions
    from vcga.pypg import options

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=VcgaOptions(backend="gloo"))
    store = dist.distributed_c10d._get_default_store()
    pm = get_plugin_manager()
    def fp64_input(r: int) -> torch.Tensor:  # none of these is representable in fp32
        return torch.tensor([0.1, 0.7, 1e-9, 1.0 / 3.0], dtype=torch.float64) * (r + 1)

    third = fp64_input(rank)
    exact_sum = fp64_input(0) + fp64_input(1)  # two ranks: one addition, the same in any order

    def raw_allreduce(g: Any, t: torch.Tensor, op: ReduceOp, factor: Any = None) -> list:
        g.allreduce([t], options("allreduce", op=op, factor=factor)).wait()
        return t.tolist()

    def raw_broadcast(g: Any, t: torch.Tensor) -> torch.Tensor:
        g.broadcast([t], options("broadcast", root=0)).wait()
        return t

    out: dict[str, Any] = {}
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("raw-gloo", store), rank, world_size, timedelta(seconds=30))
    out["gloo premul"] = _try(lambda: raw_allreduce(gloo, torch.ones(2), ReduceOp.PREMUL_SUM, 2.0))
    out["gloo fp8 broadcast"] = _try(lambda: raw_broadcast(gloo, torch.ones(2).to(torch.float8_e4m3fn)))
    for key in ("nccl", "hccl", "cncl"):
        backend = pm.backend(f"sim-{key}")
        raw = backend.create_process_group(dist.PrefixStore(f"raw-{key}", store), rank, world_size,
                                           timedelta(seconds=30))
        g = dist.new_group(backend="vcga", pg_options=VcgaOptions(backend=f"sim-{key}"))
        r, v = f"raw {key}", f"vcga {key}"
        out[f"{r} band"] = _try(lambda: raw_allreduce(raw, torch.ones(2, dtype=torch.int32), ReduceOp.BAND))
        out[f"{r} premul"] = _try(lambda: raw_allreduce(raw, torch.ones(2), ReduceOp.PREMUL_SUM, 2.0))
        out[f"{r} avg"] = _try(lambda: raw_allreduce(raw, torch.full((2,), float(rank)), ReduceOp.AVG))
        out[f"{r} int16 sum"] = _try(lambda: raw_allreduce(raw, torch.full((2,), 300, dtype=torch.int16), ReduceOp.SUM))
        fp8 = torch.full((2,), 1.5 if rank == 0 else 0.0).to(torch.float8_e4m3fn)
        out[f"{r} fp8 broadcast"] = _try(lambda: raw_broadcast(raw, fp8.clone()).float().tolist())
        t64 = third.clone()
        out[f"{r} fp64 sum exact"] = _try(lambda: torch.equal(torch.tensor(raw_allreduce(raw, t64, ReduceOp.SUM),
                                                                           dtype=torch.float64), exact_sum))
        b64 = third.clone()
        out[f"{r} fp64 broadcast exact"] = _try(
            lambda: torch.equal(raw_broadcast(raw, b64), fp64_input(0)))

        def vcga_all_reduce(t: torch.Tensor, op: Any) -> torch.Tensor:
            dist.all_reduce(t, op=op, group=g)
            return t

        out[f"{v} premul"] = _try(lambda: vcga_all_reduce(torch.ones(2), dist._make_nccl_premul_sum(2.0)).tolist())
        out[f"{v} avg"] = _try(lambda: vcga_all_reduce(torch.full((2,), float(rank)), dist.ReduceOp.AVG).tolist())
        out[f"{v} band"] = _try(lambda: vcga_all_reduce(torch.ones(2, dtype=torch.int32), dist.ReduceOp.BAND).tolist())
        out[f"{v} int16 sum"] = _try(lambda: vcga_all_reduce(torch.full((2,), 300, dtype=torch.int16),
                                                             dist.ReduceOp.SUM).tolist())
        out[f"{v} fp64 sum exact"] = _try(lambda: torch.equal(vcga_all_reduce(third.clone(), dist.ReduceOp.SUM),
                                                              exact_sum))
        b = third.clone()
        out[f"{v} fp64 broadcast exact"] = _try(
            lambda: (dist.broadcast(b, 0, group=g), torch.equal(b, fp64_input(0)))[1])
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def seen() -> dict:
    return run_world(vendors_world, 2, timeout=300)[1]  # rank 1: a receiver of every broadcast


def test_gloo_itself_lacks_what_the_vendors_do(seen: dict) -> None:
    assert seen["gloo premul"] == ("RuntimeError", "Cannot use ReduceOp.PREMUL_SUM with Gloo")
    assert seen["gloo fp8 broadcast"][0] != "ok"


def test_sim_nccl_is_nccl(seen: dict) -> None:
    """Fake-backed NCCL: refuses bitwise ops and int16 in torch's words; PREMUL_SUM and fp8 work."""
    assert seen["raw nccl band"] == ("ValueError", "Cannot use ReduceOp.BAND with NCCL")
    assert seen["raw nccl int16 sum"] == ("TypeError", "Input tensor data type is not supported for NCCL process group: Short")
    assert seen["raw nccl premul"] == ("ok", "[4.0, 4.0]")
    assert seen["raw nccl avg"] == ("ok", "[0.5, 0.5]")
    assert seen["raw nccl fp8 broadcast"] == ("ok", "[1.5, 1.5]")
    assert seen["raw nccl fp64 sum exact"] == ("ok", "True")


def test_sim_hccl_is_hccl(seen: dict) -> None:
    """Fake-backed HCCL: no bitwise ops, no fp64; int16 natively; AVG as torch_npu does it."""
    assert seen["raw hccl band"] == ("RuntimeError", "Cannot use ReduceOp.BAND with HCCL")
    assert seen["raw hccl fp64 broadcast exact"] == ("RuntimeError", "Unsupported data type for HCCL process group")
    assert seen["raw hccl int16 sum"] == ("ok", "[600, 600]")
    assert seen["raw hccl avg"] == ("ok", "[0.5, 0.5]")
    assert seen["raw hccl premul"] == ("ok", "[4.0, 4.0]")


def test_vendor_library_facts_are_read_only_and_default_as_stated() -> None:
    """A library's facts: the defaults its docstring states, a copy of the widening map, no assignment."""
    from vcga.contract import ReduceOp
    from vcga.plugins.sim.libraries import LIBRARIES, VendorLibrary

    wide = {"int16": "int32"}
    lib = VendorLibrary(name="X", moves=frozenset({"int16"}), reduces=frozenset(), dtype_error=(TypeError, "no"),
                        reduce_dtype_error=None, op_errors={ReduceOp.BAND: (ValueError, "no")}, avg="native",
                        premul=frozenset(), premul_error=(TypeError, "no"), reduce_wide=wide)
    wide["int8"] = "int32"
    assert lib.reduce_wide == {"int16": "int32"} and (lib.int_avg_trunc, lib.as_bytes, lib.source) == (False, frozenset(), "")
    with pytest.raises(AttributeError):
        lib.avg = "refuse"  # type: ignore[misc]
    assert LIBRARIES["hccl"].reduce_wide == {"int16": "int32"} and LIBRARIES["nccl"].int_avg_trunc
    assert LIBRARIES["cncl"].as_float32 == frozenset({"float64"}) and LIBRARIES["cncl"].reduce_wide == {}


def test_sim_cncl_is_cncl(seen: dict) -> None:
    """Fake-backed CNCL: AVG/PREMUL_SUM/bitwise refused in its words; fp64 silently handled as fp32."""
    assert seen["raw cncl avg"] == ("ValueError", "Cannot use ReduceOp.AVG with CNCL")
    assert seen["raw cncl premul"] == ("ValueError", "Unhandled ReduceOp")
    assert seen["raw cncl band"] == ("ValueError", "Cannot use ReduceOp.BAND with CNCL")
    assert seen["raw cncl int16 sum"] == ("RuntimeError", "Unsupported data type for CNCL process group")
    assert seen["raw cncl fp64 sum exact"] == ("ok", "False"), "CNCL mangles fp64 sums"
    assert seen["raw cncl fp64 broadcast exact"] == ("ok", "False"), "CNCL mangles fp64 moves"


@pytest.mark.parametrize("key", ["nccl", "hccl", "cncl"])
def test_vcga_routes_around_every_vendor(seen: dict, key: str) -> None:
    v = f"vcga {key}"
    assert seen[f"{v} premul"] == ("ok", "[4.0, 4.0]")
    assert seen[f"{v} avg"] == ("ok", "[0.5, 0.5]")
    assert seen[f"{v} band"][0] == "VcgaUnsupportedError"  # no vendor here has bitwise ops: refused, typed
    # int16: native on HCCL; NCCL and CNCL lack it, vcga reduces it widened to int32 (exact)
    assert seen[f"{v} int16 sum"] == ("ok", "[600, 600]")
    if key == "hccl":  # HCCL has no fp64 at all: refused, typed, before anything moved
        assert seen[f"{v} fp64 sum exact"][0] == "VcgaUnsupportedError"
        assert seen[f"{v} fp64 broadcast exact"] == ("ok", "True")  # moved as int64 bytes
    else:  # CNCL: fp64 keeps fp64 accuracy through vcga (gather_then_reduce, bitcast:int64)
        assert seen[f"{v} fp64 sum exact"] == ("ok", "True")
        assert seen[f"{v} fp64 broadcast exact"] == ("ok", "True")
