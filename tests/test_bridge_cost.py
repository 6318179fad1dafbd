"""vcga.bridge.cost: the α–β fit, the predictions per algorithm and the choice (pure; the measuring
runs in the spawned worlds of tests/test_bridge.py and the two-node world of tests/test_multinode.py)."""

from __future__ import annotations

import json
import math

import pytest

from vcga.bridge.cost import (
    SIZES,
    AlphaBeta,
    LinkFigures,
    bandwidth_time,
    choose,
    fit,
    predict,
    segment_cost,
    segments,
)
from vcga.bridge.plan import MODEL_MAX_SEGMENTS, MODEL_MIN_SEGMENT_BYTES

MB = 1e6


def test_fit_goes_through_both_points_and_survives_noise():
    ab = fit(SIZES, (1e-3, 1e-3 + (SIZES[1] - SIZES[0]) / (100 * MB)))
    assert ab.beta_Bps == pytest.approx(100 * MB) and ab.alpha_s == pytest.approx(1e-3 - SIZES[0] / (100 * MB))
    assert fit(SIZES, (2e-3, 1e-3)) == AlphaBeta(2e-3, math.inf)  # noise made the line fall: all α
    assert fit(SIZES, (1e-6, 1.0)).alpha_s == 0.0  # a negative intercept is no latency, not negative time


def figures(bridge_all: AlphaBeta, bridge_one: AlphaBeta, in_group: AlphaBeta, exchange: str = "gloo",
            k: int = 2) -> LinkFigures:
    g = dict.fromkeys(("reduce_bcast", "all_reduce", "rsag_collective", "rsag_p2p"), in_group)
    return LinkFigures(groups=[g, dict(g)], bridge={"leaders": bridge_one, "all_sets": bridge_all},
                       classes={"a": "in-vendor, one node", "b": "in-vendor, one node", "bridge": "cross-node"},
                       exchange=exchange, group_size=k, equal_groups=True, min_segment_bytes=MODEL_MIN_SEGMENT_BYTES,
                       max_segments=MODEL_MAX_SEGMENTS)


def test_a_slow_link_with_a_fixed_cost_makes_small_messages_go_through_the_leaders():
    """1 Gbit/s between nodes (125 MB/s, shared by the two shard-peer sets: 62.5 MB/s each), 500 µs
    per exchange, fast in-group steps: one leader exchange wins while α dominates; from a few hundred
    KiB the two sets in parallel (half the bytes each) and the pipeline win."""
    fig = figures(bridge_all=AlphaBeta(500e-6, 62.5 * MB), bridge_one=AlphaBeta(500e-6, 125 * MB),
                  in_group=AlphaBeta(100e-6, 2000 * MB))
    assert choose(fig, 4 << 10)[0] == "leader"
    assert choose(fig, 64 << 20)[0] == "bandwidth"
    p = predict(fig, 64 << 20)
    # bandwidth: each set sends its half over its share of the link, the in-group steps of the
    # other segments hidden behind it -> close to the link's bound N / 125 MB/s
    assert p["bandwidth"] == pytest.approx((64 << 20) / (125 * MB), rel=0.05)
    assert p["replicated"] > 1.9 * p["bandwidth"]  # every set sends all N bytes over the shared link


def test_the_pipeline_depth_is_the_predicted_fastest_counting_what_segments_cost():
    """A DDP bucket of 4 MiB over the slow link: cut into segments so that its in-group steps hide
    behind the exchange (one segment would add them in full) -- but only as far as a further
    doubling saves more than the fixed cost (α) its extra segments add on the CPU; a fast link with
    a large fixed cost per step keeps one segment."""
    slow = figures(bridge_all=AlphaBeta(500e-6, 62.5 * MB), bridge_one=AlphaBeta(500e-6, 125 * MB),
                   in_group=AlphaBeta(1e-3, 500 * MB))
    n = 4 << 20
    m = segments(slow, n)
    assert segment_cost(slow) == pytest.approx(1e-3)

    def cost(c: int) -> float:
        return bandwidth_time(slow, n, c) + (c - 1) * segment_cost(slow)

    assert 1 < m <= MODEL_MAX_SEGMENTS and n / m >= MODEL_MIN_SEGMENT_BYTES
    assert cost(m) == min(cost(c) for c in (1, 2, 4, 8, 16))
    assert bandwidth_time(slow, n, m) < 0.95 * bandwidth_time(slow, n, 1)
    # the wall-time prediction alone would cut deeper, for less than the segments cost
    deepest = min((1, 2, 4, 8, 16), key=lambda c: bandwidth_time(slow, n, c))
    assert deepest > m and bandwidth_time(slow, n, m) - bandwidth_time(slow, n, deepest) < (deepest - m) * segment_cost(slow)
    # a large message still goes in many segments: there the overlap saves far more than they cost
    assert segments(slow, 64 << 20) >= 8
    fast = figures(bridge_all=AlphaBeta(2e-3, 5000 * MB), bridge_one=AlphaBeta(2e-3, 5000 * MB),
                   in_group=AlphaBeta(2e-3, 5000 * MB))
    assert segments(fast, n) == 1


def test_one_fast_stream_beats_parallel_sets_when_the_sets_share_a_link_worse():
    """If the sets in parallel get much less than half each (contention), the model keeps the leader."""
    fig = figures(bridge_all=AlphaBeta(500e-6, 20 * MB), bridge_one=AlphaBeta(500e-6, 125 * MB),
                  in_group=AlphaBeta(10e-6, 10_000 * MB))
    assert choose(fig, 4 << 20)[0] == "leader"


def test_shared_memory_exchange_is_not_pipelined():
    """Through shared memory the exchange is synchronous: segments only add their α."""
    args = (AlphaBeta(50e-6, 500 * MB), AlphaBeta(50e-6, 1000 * MB), AlphaBeta(100e-6, 500 * MB))
    fig_gloo, fig_shm = figures(*args), figures(*args, exchange="shared memory")
    n = 64 << 20
    r, b = 100e-6 + (n / 8) / (500 * MB), 50e-6 + (n / 8 / 2) / (500 * MB)
    assert bandwidth_time(fig_shm, n, 8) == pytest.approx(8 * (r + b))
    assert segments(fig_shm, n) == 1
    assert predict(fig_gloo, n)["bandwidth"] < predict(fig_shm, n)["bandwidth"]


def test_unequal_groups_have_only_the_leader():
    fig = figures(AlphaBeta(1e-4, 1e8), AlphaBeta(1e-4, 1e8), AlphaBeta(1e-4, 1e9))
    fig.equal_groups = False
    assert set(predict(fig, 1 << 20)) == {"leader"}


def test_figures_round_trip_through_json_and_name_their_topology():
    fig = figures(AlphaBeta(5e-4, 6e7), AlphaBeta(4e-4, math.inf), AlphaBeta(1e-4, 2e9))
    back = LinkFigures.from_json(json.loads(json.dumps(fig.to_json())))
    assert back == fig and choose(back, 1 << 20) == choose(fig, 1 << 20)
    topo = {"groups": [["sim-nccl", 2, "node0"], ["sim-hccl", 2, "node1"]], "bridge": "cross-node"}
    assert LinkFigures.key(topo) == LinkFigures.key(json.loads(json.dumps(topo))) != LinkFigures.key({})


def test_the_bridge_value_classes_compare_by_value_and_the_frozen_ones_stay_frozen():
    """α–β figures, the plan and its vendor groups are frozen values (equal, hashed and pickled by
    their fields); the link figures compare every field, and are mutable, so unhashable."""
    import dataclasses
    import pickle

    from vcga.bridge.plan import make_plan

    ab = AlphaBeta(1e-4, 2e9)
    assert ab == AlphaBeta(1e-4, 2e9, 0.0, 0.0) != AlphaBeta(1e-4, 2e9, 1.0, 1e9) and hash(ab) == hash(AlphaBeta(1e-4, 2e9))
    assert pickle.loads(pickle.dumps(ab)) == ab and repr(ab).startswith("AlphaBeta(alpha_s=")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ab.alpha_s = 1.0  # type: ignore[misc]
    fig = figures(AlphaBeta(5e-4, 6e7), AlphaBeta(4e-4, math.inf), AlphaBeta(1e-4, 2e9))
    other = LinkFigures.from_json(fig.to_json())
    assert other == fig
    other.observed = {"64 KiB": {"chosen": "leader"}}
    assert other != fig and list(fig.to_json()) == list(LinkFigures.FIELDS)
    with pytest.raises(TypeError):
        hash(fig)
    peers = [{"backend": b, "vendor": b, "device_type": "cpu", "node": "n0"} for b in ("a", "a", "b", "b")]
    plan = make_plan(peers, "auto")
    assert plan == make_plan(peers, "auto") != make_plan(peers, "leader") and hash(plan) == hash(make_plan(peers, "auto"))
    assert pickle.loads(pickle.dumps(plan)) == plan and plan.groups[1].ranks == (2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups[0].ranks = ()  # type: ignore[misc]


def test_a_pipelining_group_predicts_the_bandwidth_algorithm_per_all_reduce_of_a_stream():
    """Figures one group measured between two namespace nodes over 1 Gbit/s: one 4 MiB
    all_reduce alone is a tie between the leaders (41.0 ms) and the bandwidth algorithm (41.0 ms,
    in-group steps plus exchange). In a group that pipelines consecutive all_reduces (a DDP step's
    buckets) the in-group steps overlap the previous and next buckets' exchanges: per all_reduce
    only the busier of the two counts, m * max(r, b), and the bandwidth algorithm wins clearly."""
    in_group = {"reduce_bcast": AlphaBeta(988e-6, 813 * MB), "all_reduce": AlphaBeta(854e-6, 1134 * MB),
                "rsag_collective": AlphaBeta(2218e-6, 270 * MB), "rsag_p2p": AlphaBeta(1149e-6, 580 * MB)}
    fig = LinkFigures(groups=[in_group, dict(in_group)],
                      bridge={"leaders": AlphaBeta(56e-6, 122 * MB), "all_sets": AlphaBeta(351e-6, 59 * MB)},
                      classes={"bridge": "cross-node"}, exchange="gloo", group_size=2, equal_groups=True,
                      min_segment_bytes=MODEL_MIN_SEGMENT_BYTES, max_segments=MODEL_MAX_SEGMENTS)
    n = 4 << 20
    alone, streamed = predict(fig, n), predict(fig, n, stream=True)
    assert choose(fig, n)[0] == "leader" and alone["bandwidth"] == pytest.approx(alone["leader"], rel=0.02)
    assert choose(fig, n, stream=True)[0] == "bandwidth" and streamed["leader"] == alone["leader"]
    s = n / segments(fig, n)  # the segments of one all_reduce alone
    r = in_group["rsag_p2p"].time(s)
    b = fig.bridge["all_sets"].time(s / 2)
    assert streamed["bandwidth"] == pytest.approx(segments(fig, n) * max(r, b))
    assert streamed["bandwidth"] < 0.9 * streamed["leader"]
    # through shared memory the exchange is synchronous: nothing overlaps, the same prediction
    shm = LinkFigures(**{**fig.__dict__, "exchange": "shared memory"})
    assert predict(shm, n, stream=True) == predict(shm, n)
