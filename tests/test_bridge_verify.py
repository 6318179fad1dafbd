"""vcga.bridge.verify: the online check of "auto"'s all_reduce choice, fed injected observations
(pure: no ranks; the two-node world with a burst bucket is in tests/test_multinode.py)."""

from __future__ import annotations

import pytest

from vcga.bridge.verify import MONITOR, SAMPLES, PlanCheck, class_bytes, size_class

MIB = 1 << 20


class World:
    """Every rank's PlanCheck, and what the payload of a watched call does with their reports: the
    element-wise SUM over ranks, as the all_reduce carries them."""

    def __init__(self, predicted: dict[str, float], world: int = 4, credit: dict[str, float] | None = None,
                 observed: dict | None = None) -> None:
        def predict(n: int) -> dict[str, float]:
            return {a: t * n / (64 * MIB) for a, t in predicted.items()}  # linear in the size

        def initial(n: int) -> str:
            return min(predicted, key=lambda a: predicted[a] * (credit or {}).get(a, 1.0))

        self.settled: list[dict] = []
        self.ranks = [PlanCheck(predict, initial, lambda n: credit or {}, r, world, observed=observed,
                                on_settle=lambda c: self.settled.append(dict(c.observed)))
                      for r in range(world)]

    def call(self, nbytes: int, took: dict[str, float] | float, late: list[float] | None = None) -> str:
        """One all_reduce of ``nbytes`` on every rank; ``took``: what each algorithm really takes for
        64 MiB (linear in the size); ``late[r]``: how long rank r waited for the late ranks (in its
        own time, not the algorithm's)."""
        begun = [c.begin(nbytes) for c in self.ranks]
        assert len(set(begun)) == 1, f"ranks disagree about the call: {begun}"
        alg, watched = begun[0]
        if watched:
            sent = [c.outgoing() for c in self.ranks]
            summed = [sum(col) for col in zip(*sent, strict=True)]
            for r, c in enumerate(self.ranks):
                seconds = (took[alg] if isinstance(took, dict) else took) * nbytes / (64 * MIB)
                seconds += late[r] if late else 0.0
                c.incoming(summed, nbytes, alg, seconds)
        choices = {c.algorithm(nbytes) for c in self.ranks}
        assert len(choices) == 1, f"ranks switched at different calls: {choices}"
        return alg


def test_a_choice_the_calls_contradict_is_replaced_by_the_faster_within_ten_calls():
    """An 8 ms token bucket: the figures predict leader fastest for 64 MiB (the link
    looked twice as fast as it is), but leader really takes 860 ms and bandwidth 606: the check
    sees leader depart from its prediction, tries bandwidth and keeps it -- every rank switches at
    the same call, and the class settles (watched only one call in MONITOR from then on)."""
    w = World({"leader": 0.40, "bandwidth": 0.45, "replicated": 0.95})
    took = {"leader": 0.860, "bandwidth": 0.606, "replicated": 1.25}
    ran = [w.call(64 * MIB, took) for _ in range(30)]
    assert ran[0] == "leader"
    switch = ran.index("bandwidth")
    assert switch <= 9 and set(ran[switch:]) == {"bandwidth"}, ran
    assert "replicated" not in ran  # predicted slower than what bandwidth was seen to take: never tried
    cls = w.ranks[0].classes[size_class(64 * MIB)]
    assert not cls.watched and cls.algorithm == "bandwidth"
    # the corrected figures (what the cache gets): the observed times beside the predictions
    entry = w.settled[-1][str(size_class(64 * MIB))]
    assert entry["chosen"] == "bandwidth"
    assert entry["seconds"] == pytest.approx({"leader": 0.860, "bandwidth": 0.606})


def test_the_waits_for_late_ranks_are_not_blamed_on_the_algorithm():
    """An uneven step: ranks 1-3 reach every call 0.5 s before rank 0 (unequal shares of
    work), so their own times include that wait. The observation is the minimum over ranks -- the
    late rank's, who waited for nobody -- and agrees with the prediction: nothing is switched."""
    w = World({"leader": 0.60, "bandwidth": 0.58, "replicated": 1.2})
    late = [0.0, 0.5, 0.5, 0.5]
    ran = [w.call(64 * MIB, {"leader": 0.63, "bandwidth": 0.60, "replicated": 1.2}, late) for _ in range(20)]
    assert set(ran) == {"bandwidth"}
    assert w.ranks[0].observed[str(size_class(64 * MIB))]["seconds"] == {"bandwidth": pytest.approx(0.60)}
    # judged by the earliest rank's own clock instead, bandwidth would look 1.8x its prediction and
    # leader (predicted 0.60 < 1.1/1.1) would have been tried
    w2 = World({"leader": 0.60, "bandwidth": 0.58, "replicated": 1.2})
    ran2 = [w2.call(64 * MIB, {"leader": 0.63, "bandwidth": 0.60, "replicated": 1.2}, [0.5] * 4) for _ in range(20)]
    assert "leader" in ran2


def test_a_prediction_the_calls_confirm_is_kept_and_only_monitored():
    w = World({"leader": 0.63, "bandwidth": 0.58, "replicated": 1.2})
    ran = [w.call(64 * MIB, {"leader": 0.65, "bandwidth": 0.60}) for _ in range(2 * MONITOR)]
    assert set(ran) == {"bandwidth"}
    calls = [w.ranks[0].begin(64 * MIB)[1] for _ in range(MONITOR * 2)]
    assert sum(calls) == 2  # settled: one watched call in MONITOR


def test_a_challenger_must_beat_the_incumbent_by_the_margin():
    """Tried because the incumbent departed from its prediction, the alternative is only 2% faster:
    noise, not a reason to change the order of reduction."""
    w = World({"leader": 0.40, "bandwidth": 0.45, "replicated": 0.95})
    ran = [w.call(64 * MIB, {"leader": 0.61, "bandwidth": 0.60}) for _ in range(20)]
    assert "bandwidth" in ran and ran[-1] == "leader"


def test_a_settled_class_that_gets_slower_is_checked_again():
    """The link gets congested after the class settled: the monitoring calls see its algorithm at
    twice its settled time twice running, and the class is judged again (here bandwidth suffers
    more than leader, which then wins)."""
    w = World({"leader": 0.63, "bandwidth": 0.58, "replicated": 1.2})
    for _ in range(12):
        w.call(64 * MIB, {"leader": 0.65, "bandwidth": 0.60})
    assert w.ranks[0].algorithm(64 * MIB) == "bandwidth"
    ran = [w.call(64 * MIB, {"leader": 0.70, "bandwidth": 1.30}) for _ in range(8 * MONITOR)]
    assert ran[-1] == "leader" and w.ranks[3].algorithm(64 * MIB) == "leader"


def test_a_pipelining_group_credits_the_stream_and_sizes_are_scaled_to_their_class():
    """In a group that pipelines consecutive all_reduces a watched call runs alone; bandwidth's time
    counts at what it costs in a stream (here 0.7 of it), so a leader 10% faster alone does not
    win. Calls of 40 and 60 MiB share the class of 32 MiB and are scaled to it by the prediction."""
    assert size_class(40 * MIB) == size_class(60 * MIB) == size_class(32 * MIB)
    assert class_bytes(size_class(60 * MIB)) == 32 * MIB
    w = World({"leader": 0.63, "bandwidth": 0.80, "replicated": 1.2}, credit={"bandwidth": 0.7})
    ran = [w.call(40 * MIB if i % 2 else 60 * MIB, {"leader": 0.60, "bandwidth": 0.66}) for i in range(20)]
    assert ran[0] == "bandwidth" and set(ran) == {"bandwidth"}


def test_cached_corrections_start_a_class_settled():
    """The next start reads the corrected figures from the cache: the class begins on the observed
    fastest and is only monitored."""
    cls = str(size_class(64 * MIB))
    w = World({"leader": 0.40, "bandwidth": 0.45, "replicated": 0.95},
              observed={cls: {"chosen": "bandwidth", "seconds": {"leader": 0.86, "bandwidth": 0.606}}})
    assert [w.call(64 * MIB, {"leader": 0.86, "bandwidth": 0.606}) for _ in range(MONITOR)] == ["bandwidth"] * MONITOR
    assert sum(c.begin(64 * MIB)[1] for c in w.ranks[:1] for _ in range(MONITOR)) == 1


def test_the_first_call_of_an_algorithm_is_not_its_time():
    """It connects the algorithm's gloo pairs: a first leader call of 5 s does not make the check
    try anything; the next SAMPLES calls judge it."""
    w = World({"leader": 0.40, "bandwidth": 0.45, "replicated": 0.95})
    w.call(64 * MIB, 5.0)
    ran = [w.call(64 * MIB, {"leader": 0.41, "bandwidth": 0.50}) for _ in range(SAMPLES + 4)]
    assert set(ran) == {"leader"} and not w.ranks[0].classes[size_class(64 * MIB)].watched


def test_a_burst_knee_is_found_and_the_sustained_rate_predicts_past_it():
    """Timed through an 8 ms token bucket at 1 Gbit/s: 64 KiB and 2 MiB pass at twice the link's
    rate (the bucket lets 1 MB by at once), 8 MiB shows the sustained 125 MB/s. The fit keeps the
    burst line up to 2 MiB and the sustained rate past it; without the third size it would predict
    64 MiB at half its time. A third size on the same line finds no knee. Both survive the JSON
    a cache entry holds."""
    from vcga.bridge.cost import AlphaBeta, LinkFigures, fit, fit_past_knee

    sizes = (64 << 10, 2 << 20, 8 << 20)
    burst, link = 250e6, 125e6
    t2 = 1e-4 + sizes[1] / burst
    seconds = (1e-4 + sizes[0] / burst, t2, t2 + (sizes[2] - sizes[1]) / link)
    ab = fit_past_knee(sizes, seconds)
    assert ab.knee_bytes == sizes[1] and ab.sustained_Bps == pytest.approx(link)
    assert ab.time(64 * MIB) == pytest.approx(t2 + (64 * MIB - sizes[1]) / link)
    assert fit(sizes[:2], seconds[:2]).time(64 * MIB) < 0.55 * ab.time(64 * MIB)
    assert fit_past_knee(sizes, (*seconds[:2], 1e-4 + sizes[2] / burst)).knee_bytes == 0.0
    g = {k: AlphaBeta(1e-4, 1e9) for k in ("reduce_bcast", "all_reduce", "rsag_collective", "rsag_p2p")}
    fig = LinkFigures(groups=[g, dict(g)], bridge={"leaders": ab, "all_sets": ab}, classes={}, exchange="gloo",
                      group_size=2, equal_groups=True, min_segment_bytes=256 << 10, max_segments=16,
                      observed={"26": {"chosen": "bandwidth", "seconds": {"bandwidth": 0.6}}})
    back = LinkFigures.from_json(fig.to_json())
    assert back.bridge["leaders"] == ab and back.observed == fig.observed
