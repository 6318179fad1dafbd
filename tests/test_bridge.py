"""The mixed-vendor bridge (vcga/bridge/): plan, combined table, and spawned mixed worlds.

The worlds are fake-backed: their vendors are the simulated sim-nccl / sim-hccl / sim-cncl (CPU
stand-ins on gloo that follow each vendor library's rules, CNCL's fp64-as-fp32 included), laid out
with ``VCGA_SIM_VENDORS`` exactly as a user would. Each world batches many checks
(tests/bridge_cases.py) because a 4-rank world costs seconds to start on a small machine.
"""

from __future__ import annotations

import pytest

from vcga.testing import run_world


def peers(*backends: str, nodes: list[str] | None = None) -> list[dict]:
    vendors = {"sim-nccl": "nvidia", "sim-hccl": "huawei", "sim-cncl": "cambricon", "gloo": "cpu"}
    return [{"backend": b, "vendor": vendors[b], "device_type": "cpu", "global_rank": r,
             "node": (nodes[r] if nodes else "n0")} for r, b in enumerate(backends)]


# ---------------------------------------------------------------------------------------------------
# The plan (pure: the same facts give the same plan on every rank)
# ---------------------------------------------------------------------------------------------------

def test_plan_groups_leaders_and_algorithm() -> None:
    from vcga.bridge import AUTO_LARGE, BANDWIDTH_MIN_BYTES, PIPELINED_MIN_BYTES, make_plan

    p = make_plan(peers("sim-nccl", "sim-nccl", "sim-hccl", "sim-hccl"))
    assert [(g.backend, g.ranks, g.leader) for g in p.groups] == [("sim-nccl", (0, 1), 0), ("sim-hccl", (2, 3), 2)]
    assert p.equal_groups and p.contiguous
    assert p.shard_peers(0) == (0, 2) and p.shard_peers(1) == (1, 3)
    assert p.all_reduce_algorithm(BANDWIDTH_MIN_BYTES - 1) == "leader"
    assert p.all_reduce_algorithm(BANDWIDTH_MIN_BYTES) == AUTO_LARGE
    assert p.all_reduce_algorithm(PIPELINED_MIN_BYTES - 1, "bandwidth") == "bandwidth"
    assert p.all_reduce_algorithm(PIPELINED_MIN_BYTES - 1, "replicated") == "replicated"
    assert p.all_reduce_algorithm(PIPELINED_MIN_BYTES, "replicated") == "bandwidth"  # pipelined sizes
    assert make_plan(peers("sim-nccl", "sim-nccl", "sim-hccl", "sim-hccl"), "bandwidth").all_reduce_algorithm(1) == "bandwidth"
    assert make_plan(peers("sim-nccl", "sim-nccl", "sim-hccl", "sim-hccl"), "leader").all_reduce_algorithm(1 << 30) == "leader"
    # unequal vendor groups: shards cannot line up, leader algorithm at every size
    q = make_plan(peers("sim-nccl", "sim-hccl", "sim-hccl", "sim-cncl"), "bandwidth")
    assert [g.ranks for g in q.groups] == [(0,), (1, 2), (3,)]
    assert not q.equal_groups and q.all_reduce_algorithm(1 << 30) == "leader"
    d = q.describe()
    assert d["leaders"] == [0, 1, 3] and d["collectives"]["all_reduce"]["64 MiB"] == "leader"


def test_plan_keeps_nodes_and_vendor_groups_contiguous() -> None:
    from vcga.bridge import make_plan

    # interleaved ranks on two nodes: each vendor group is walked node by node, groups ordered by node
    p = make_plan(peers("sim-hccl", "sim-nccl", "sim-hccl", "sim-nccl", nodes=["a", "b", "b", "a"]))
    assert [(g.backend, g.ranks, g.nodes) for g in p.groups] == [("sim-hccl", (0, 2), ("a", "b")),
                                                                 ("sim-nccl", (3, 1), ("a", "b"))]
    assert not p.contiguous
    assert p.describe()["groups"][1]["leader"] == 3  # the nccl rank on node a leads


def test_plan_rejects_unknown_algorithm_and_inconsistent_backend() -> None:
    from vcga.bridge import make_plan
    from vcga.errors import VcgaConfigError

    with pytest.raises(VcgaConfigError, match="bridge_algorithm"):
        make_plan(peers("sim-nccl", "sim-hccl"), "fastest")
    bad = peers("sim-nccl", "sim-nccl")
    bad[1]["vendor"] = "other"
    with pytest.raises(VcgaConfigError, match="one vendor and device type per backend"):
        make_plan(bad)


def test_config_key() -> None:
    from vcga.config import load_config
    from vcga.errors import VcgaConfigError

    assert load_config(env={}).bridge_algorithm == "auto"
    assert load_config(env={"VCGA_BRIDGE_ALGORITHM": "Bandwidth"}).bridge_algorithm == "bandwidth"
    with pytest.raises(VcgaConfigError, match="VCGA_BRIDGE_ALGORITHM"):
        load_config(env={"VCGA_BRIDGE_ALGORITHM": "ring"})


# ---------------------------------------------------------------------------------------------------
# The combined capability table
# ---------------------------------------------------------------------------------------------------

def _tables(*keys: str):
    from vcga.plugins.sim import VENDORS

    return [VENDORS[k][3]() for k in keys]


def test_combined_table_routes_every_dtype_correctly() -> None:
    from vcga.bridge import combined_table, group_route
    from vcga.contract import Support

    nccl, hccl, cncl = _tables("nccl", "hccl", "cncl")
    t = combined_table("bridge", [nccl, hccl, cncl])
    # fp32 SUM: native through every library; fp16/bf16: accumulated in fp32 across vendors
    assert t.lookup("all_reduce", "float32", "SUM").support is Support.NATIVE
    for dt in ("float16", "bfloat16"):
        cell = t.lookup("all_reduce", dt, "SUM")
        assert (cell.support, cell.via) == (Support.EMULATED, "upcast:float32")
    # fp64: CNCL's own table routes it around the library (gather_then_reduce, in fp64); HCCL has no
    # fp64 reduction at all, so its leader reduces the raw bytes on the host -- native for the bridge
    assert group_route(cncl, "float64", "SUM") == "library"
    assert group_route(hccl, "float64", "SUM") == "host"
    assert t.lookup("all_reduce", "float64", "SUM").support is Support.NATIVE
    # AVG and PREMUL_SUM are composed over the whole group, never per vendor group
    assert t.lookup("all_reduce", "float32", "AVG").via == "sum_then_divide"
    assert t.lookup("all_reduce", "float32", "PREMUL_SUM").via == "mul_then_sum"
    # no vendor has bitwise ops: refused with the vendor's reason; bool BOR becomes MAX
    cell = t.lookup("all_reduce", "int32", "BAND")
    assert cell.support is Support.REFUSED and "bitwise" in cell.note
    assert t.lookup("all_reduce", "bool", "BOR").via == "bool_as_max"
    # data movement: every dtype (bytes over the host bridge)
    assert t.lookup("all_to_all", "float64", None).support is Support.NATIVE
    assert t.lookup("broadcast", "float64", None).support is Support.NATIVE


def test_table_json_round_trip() -> None:
    from vcga.bridge import table_digest, table_from_json

    (cncl,) = _tables("cncl")
    back = table_from_json(cncl.backend, cncl.to_json())
    assert back == cncl and not back.diff(cncl) and table_digest(back) == table_digest(cncl)


def test_combined_table_worked_out_on_demand_equals_the_whole_build() -> None:
    """The combined table works its cells out as they are asked for (creation does not build all
    ~500): asked one cell at a time, in any order, it gives exactly the cells a builder's
    build(derive=True) gives for the same stated cells, notes included, for every pair and the
    triple of the simulated vendors' tables."""
    import itertools

    from vcga.bridge import combined_table
    from vcga.bridge.plan import _bridge_refusal
    from vcga.capabilities import _all_keys
    from vcga.contract import CapabilityTable

    tabs = _tables("nccl", "hccl", "cncl")
    for combo in [*itertools.permutations(tabs, 2), tabs]:
        names = ", ".join(t.backend for t in combo)
        b = CapabilityTable.builder("bridge")
        for key in _all_keys():
            coll, dt, op = key
            ops = [op] if op is not None else None
            reason = _bridge_refusal(coll, dt, op, combo)
            if reason is None:
                b.native([coll], [dt], ops, note=(f"hierarchical over {names}: in each vendor group by its own library, "
                                                  "across vendors on the host" if coll.reduces or coll.value == "broadcast"
                                                  else f"host bridge (gloo) across {names}, as bytes"))
            else:
                b.refuse([coll], [dt], ops, note=reason, final=False)
        whole = b.build(derive=True)
        lazy = combined_table("bridge", combo)
        keys = list(_all_keys())
        for key in reversed(keys):  # emulated cells asked before the cells they derive from
            assert lazy.lookup(*key) == whole.lookup(*key), key
        assert combined_table("bridge", combo).cells() == whole.cells()
        assert lazy.lookup("all_reduce", "no-such-dtype", "SUM").support.value == "refused"


def test_table_wire_form_round_trip_and_digest() -> None:
    """The wire form the bridge publishes: the same cells back; the same bytes (so the same digest)
    whatever order the cells were stated in; another note, another digest."""
    from vcga.bridge import table_digest, table_from_wire, table_to_wire
    from vcga.contract import CapabilityTable

    for t in _tables("nccl", "hccl", "cncl"):
        back = table_from_wire(t.backend, table_to_wire(t))
        assert back.cells() == t.cells() and table_digest(back) == table_digest(t)
        shuffled = CapabilityTable(t.backend, dict(reversed(list(t.cells().items()))))
        assert table_to_wire(shuffled) == table_to_wire(t)
        key, cell = next(iter(t.cells().items()))
        other = CapabilityTable(t.backend, {**t.cells(), key: type(cell)(cell.support, cell.via, cell.note + "!")})
        assert table_digest(other) != table_digest(t)


def test_combine_rows_in_order_and_bool() -> None:
    import torch

    from vcga.bridge import combine_rows
    from vcga.contract import ReduceOp

    rows = torch.tensor([[1e8, 1.0], [1.0, 2.0], [-1e8, 3.0]], dtype=torch.float32)
    out = torch.empty(2)
    combine_rows(rows, ReduceOp.SUM, out)
    assert out.tolist() == [0.0, 6.0]  # left to right in fp32: 1e8 + 1 rounds to 1e8, then - 1e8
    b = torch.tensor([[True, False], [False, False], [True, False]])
    ob = torch.empty(2, dtype=torch.bool)
    combine_rows(b, ReduceOp.SUM, ob)
    assert ob.tolist() == [True, False]
    combine_rows(b, ReduceOp.PRODUCT, ob)
    assert ob.tolist() == [False, False]


# ---------------------------------------------------------------------------------------------------
# Mixed worlds (fake-backed: simulated vendors)
# ---------------------------------------------------------------------------------------------------

def _mixed(spec: str) -> list[dict]:
    from bridge_cases import mixed_world
    from pg_cases import DTYPES

    return run_world(mixed_world, 4, DTYPES, env={"VCGA_SIM_VENDORS": spec}, timeout=400)


@pytest.fixture(scope="module")
def two_vendors() -> list[dict]:
    return _mixed("nccl:2,hccl:2")


@pytest.fixture(scope="module")
def three_vendors() -> list[dict]:
    return _mixed("nccl:1,hccl:2,cncl:1")


@pytest.mark.parametrize("world", ["two_vendors", "three_vendors"])
def test_every_collective_exact_identical_and_within_bound(world: str, request: pytest.FixtureRequest) -> None:
    """Sim vendors (fake-backed): the whole collective matrix, then random-data numerics per algorithm."""
    results = request.getfixturevalue(world)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    assert results[0]["matrix"]["cases"] > 1000
    assert all(r["same_plan"] for r in results)
    # fp16 SUM is accumulated in fp32 across vendors
    assert results[0]["table_fp16_via"] == "upcast:float32"


def test_two_vendors_run_both_algorithms(two_vendors: list[dict]) -> None:
    r = two_vendors[0]
    assert r["backend"] == "bridge(sim-nccl:2,sim-hccl:2)"
    assert r["counts"]["leader"]["bandwidth"] == 0 and r["counts"]["leader"]["leader"] > 0
    assert r["counts"]["bandwidth"]["bandwidth"] > 0 and r["counts"]["replicated"]["replicated"] > 0
    assert r["counts"]["bandwidth-p2p"]["bandwidth"] > 0 and r["methods"]["bandwidth-p2p"] == "p2p"
    assert r["counts"]["bandwidth-collective"]["bandwidth"] > 0
    # the creation-time measurement ran and chose from what it measured, the same on every rank
    cal = r["calibration"]
    assert set(cal["group_methods"]) == {"sim-nccl", "sim-hccl"} and cal["exchange"] == "shared memory"
    assert cal["classes"] == {"sim-nccl": "in-vendor, one node", "sim-hccl": "in-vendor, one node",
                              "bridge": "cross-vendor same node"}
    order = ["leader", "bandwidth", "replicated"]
    for c in cal["choice"].values():  # the cheapest prediction, from figures of every kind of step
        assert set(c["predicted_s"]) == set(order)
        assert c["algorithm"] == min(order, key=lambda a: (c["predicted_s"][a], order.index(a)))
    fig = cal["figures"]
    assert [set(g) for g in fig["groups"]] == [{"reduce_bcast", "all_reduce", "rsag_collective", "rsag_p2p"}] * 2
    assert set(fig["bridge"]) == {"leaders", "all_sets"} and all(v[0] >= 0 and v[1] > 0 for v in fig["bridge"].values())
    assert all(x["calibration"] == cal for x in two_vendors)
    assert r["plan"]["leaders"] == [0, 2] and r["plan"]["shard_peers"] == [[0, 2], [1, 3]]
    assert r["counts"]["bandwidth-p2p-gloo"]["bandwidth"] > 0 and r["counts"]["leader-gloo"]["leader"] > 0
    # reduce_scatter: hierarchical wherever the bandwidth algorithm runs, through both in-group
    # methods and both shard exchanges; as an all_reduce under the leader algorithm
    for label in ("bandwidth", "bandwidth-collective", "bandwidth-p2p", "bandwidth-p2p-gloo"):
        assert r["counts"][label]["hierarchical_rs"] > 0, (label, r["counts"][label])
    assert r["counts"]["leader"]["hierarchical_rs"] == 0 and r["counts"]["leader-gloo"]["hierarchical_rs"] == 0


def test_same_node_shard_peers_exchange_through_shared_memory(two_vendors: list[dict], three_vendors: list[dict]) -> None:
    """Every shard peer is on this host: the bridge reduces through shared memory by default, through
    gloo with bridge_shm off (both groups passed the numerics of the world above)."""
    for r in two_vendors:
        ex = r["exchanges"]
        assert ex["leader"] == ex["bandwidth-p2p"] == "shared memory", ex
        assert ex["leader-gloo"] == ex["bandwidth-p2p-gloo"] == "gloo", ex
    # nccl:1,hccl:2,cncl:1: unequal groups, so only the leaders (ranks 0, 1, 3) have shard peers
    assert [r["exchanges"]["leader"] for r in three_vendors] == ["shared memory", "shared memory", None, "shared memory"]


def test_three_vendors_fp64_keeps_fp64_through_sim_cncl(three_vendors: list[dict]) -> None:
    """nccl:1,hccl:2,cncl:1: fp64 passed the fp64 bound (CNCL alone would reduce it as fp32, ~1e8 x worse);
    unequal vendor groups always take the leader algorithm."""
    r = three_vendors[0]
    assert r["backend"] == "bridge(sim-nccl:1,sim-hccl:2,sim-cncl:1)"
    for alg in ("bandwidth", "replicated"):
        assert r["counts"][alg][alg] == 0 and r["counts"][alg]["leader"] > 0
    assert r["calibration"] is None  # nothing to measure: unequal groups never shard
    assert [g["backend"] for g in r["plan"]["groups"]] == ["sim-nccl", "sim-hccl", "sim-cncl"]


def test_native_group_failure_stops_every_rank_with_one_error() -> None:
    """Rank 2 of a mixed world cannot create its native group (test plugin); rank 1, its vendor
    partner, is blocked in the library's rendezvous: every rank raises the same typed error, and
    well within the collective timeout (VCGA_TIMEOUT=60), not by timing out."""
    from bridge_cases import failing_world

    results = run_world(failing_world, 3, ["sim-nccl", "test-broken", "test-broken"],
                        env={"VCGA_PLUGINS": "bridge_fail_plugin", "VCGA_TIMEOUT": "60"}, timeout=120)
    assert {r["type"] for r in results} == {"VcgaBackendUnavailable"}, results
    assert len({r["message"] for r in results}) == 1, results
    msg = results[0]["message"]
    assert "rank 2 (test-broken)" in msg and "device 1 is lost" in msg and "rank 1 " not in msg
    assert all(r["seconds"] < 60 for r in results), results


def test_a_rank_without_a_device_name_skips_the_measurement_on_every_rank() -> None:
    """Fake-backed (test plugin ``test-nodevice``): the accelerator of rank 3 cannot name its device,
    so it cannot run the creation-time measurement. Every rank agrees to skip it (auto keeps its
    default) instead of ranks 0-2 waiting in the measurement for a rank that never comes."""
    from bridge_cases import no_device_world

    from vcga.bridge import AUTO_LARGE

    results = run_world(no_device_world, 4, ["sim-nccl", "sim-nccl", "test-nodevice", "test-nodevice"], [3],
                        env={"VCGA_PLUGINS": "bridge_fail_plugin", "VCGA_TIMEOUT": "20"}, timeout=90)
    assert all(r["calibration"] is None and r["auto_large"] == AUTO_LARGE for r in results), results
    assert all(r["sum_ok"] for r in results), results
    assert all(r["created_s"] < 20 for r in results), results


@pytest.mark.parametrize("world,spec", [("two_vendors", "nccl:2,hccl:2"), ("three_vendors", "nccl:1,hccl:2,cncl:1")])
def test_cli_plan_is_what_the_ranks_describe(world: str, spec: str, request: pytest.FixtureRequest) -> None:
    """`vcga info --plan --json` for the same layout (same host, default algorithm) equals the plan
    every rank of the spawned world describes: groups, leaders, shard peers, routes, algorithm per size."""
    import json

    from conftest import run_vcga

    ranks = request.getfixturevalue(world)
    r = run_vcga("info", "--plan", "--json", env={"VCGA_SIM_VENDORS": spec})
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)["plan"]
    assert cli["routes"] and cli == ranks[0]["plan"]


def test_bridge_collectives_are_asynchronous_ordered_and_bitwise_like_the_synchronous_path() -> None:
    """Fake-backed sim vendors, ``nccl:2,hccl:2`` (tests/bridge_cases.py ``async_world``): a call
    returns before its collective can complete; many collectives in flight end with the same bits
    as one at a time without the queue, on every rank; an error surfaces typed on wait() and fails
    the group's next call."""
    from bridge_cases import async_world

    results = run_world(async_world, 4, env={"VCGA_SIM_VENDORS": "nccl:2,hccl:2"}, timeout=300)
    for r in results[:3]:
        assert r["completed_at_return"] is False, r
    for r in results:
        assert r["first_sum_ok"] and r["async_equals_sync"] and r["identical_on_every_rank"], r
        assert r["pipelined_equals_sync"] and 1 < r["segments"][1] < r["segments"][2], r
        assert r["queued"] >= 9 and r["sync_has_no_queue"], r
        # pipelined across collectives only where asked (one node: shared memory, unless off)
        assert r["pipeline_flags"] == [False, False, False, True], r
        assert r["across_equals_sync"] and r["gated_equals_sync"], r
        assert r["across_continued"] >= 5 and r["across_pipelined_all_reduces"] >= 10, r
    assert results[0]["most_in_stage2"] >= 2, results[0]
    for r in results[:3]:
        assert r["piped_missing_peer"] in ("VcgaTimeoutError", "VcgaCollectiveError", "VcgaPeerLostError"), r
        assert r["piped_after"] == "VcgaCollectiveError", r
    assert sum(results[0]["counts"].values()) >= 6  # five all_reduces and the reduce_scatter went through the bridge
    for r in results[:3]:
        assert r["missing_peer"] == "VcgaTimeoutError" and r["after"] == "VcgaCollectiveError", r
