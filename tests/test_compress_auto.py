"""vcga.compress.auto: when=auto judged by the costs of real steps, fed injected observations
(pure: no ranks; the DDP worlds of tests/test_compression.py run it end to end)."""

from __future__ import annotations

import pytest
import torch

from vcga.compress.auto import DRIFT, MONITOR, WINDOW, AutoChoice

KEY = (1 << 20, ((1024, 1024),), "float32")


def run(ranks: list[AutoChoice], steps: int, cost, first: int = 1) -> list[bool]:
    """``steps`` steps on every rank from step ``first``: each bucket's observed cost is
    ``cost(rank, compress, step)``; the checks sum every rank's table as the hook's all_reduce
    does. Returns rank 0's mode per step."""
    modes = []
    for step in range(first, first + steps):
        modes.append(ranks[0].compress(KEY))
        for r, a in enumerate(ranks):
            for key in a.buckets:
                a.observe(key, a.compress(key), cost(r, a.compress(key), step))
        assert len({a.due(step) for a in ranks}) == 1  # every rank checks at the same boundary
        if ranks[0].due(step):
            summed = [sum(col) for col in zip(*(a.table() for a in ranks), strict=True)]
            settled = [a.agree(summed, len(ranks), step) for a in ranks]
            assert all(c == settled[0] for c in settled)  # every rank settles alike
        for a in ranks:
            a.advance()
        assert len({a.compress(KEY) for a in ranks}) == 1  # every rank runs the same mode next step
    return modes


def world(first: bool, n: int = 4) -> list[AutoChoice]:
    ranks = [AutoChoice() for _ in range(n)]
    for a in ranks:
        a.add(KEY, first, {"plain": 0.030, "compressed": 0.020})
    return ranks


def test_a_model_that_chose_compression_where_it_loses_is_overruled_by_the_steps():
    """The figures said compress (the link looked fast, the compressor cheap on an
    idle core), but with four ranks on two cores a compressed bucket costs 45 ms and a plain one
    30: the trial alternates the modes, and every rank goes plain at the same step and stays."""
    ranks = world(True)
    modes = run(ranks, 40, lambda r, c, s: 0.045 if c else 0.030)
    assert modes[:4] == [True, False, True, False]  # alternating: both timed under the same load
    settle = 2 * WINDOW + 2
    assert set(modes[settle:]) == {False}
    d = ranks[2].describe()[0]
    assert d["model_chose"] is True and d["compress"] is False and d["phase"] == "settled"
    assert d["observed_s"] == {"compressed": pytest.approx(0.045), "plain": pytest.approx(0.030)}
    assert d["predicted_s"] == {"plain": 0.030, "compressed": 0.020}


def test_a_load_that_changes_during_the_trial_does_not_decide_it():
    """The machine gets three times slower halfway through the trial (others' jobs start): both
    modes are timed in both halves, so compression, really faster, is still kept -- timed one mode
    after the other, the slow half would have fallen on plain alone and made compression look
    slower than it is, or the other way round."""
    modes = run(world(False), 40, lambda r, c, s: (0.020 if c else 0.030) * (3.0 if s > WINDOW + 1 else 1.0))
    assert modes[-1] is True


def test_a_right_choice_is_kept_and_the_margin_keeps_noise_from_flipping_it():
    """Compression really wins (20 against 30 ms): kept. A plain mode 2% faster than compression is
    within the margin: the model's mode stays."""
    assert run(world(True), 40, lambda r, c, s: 0.020 if c else 0.030)[-1] is True
    assert run(world(True), 40, lambda r, c, s: 0.0300 if c else 0.0294)[-1] is True


def test_the_ranks_decide_from_the_mean_over_ranks():
    """Rank 3 alone sees compression as slow (a straggler): the mean over the four ranks still
    favours it, and every rank keeps compressing."""
    modes = run(world(True), 40, lambda r, c, s: (0.060 if r == 3 else 0.015) if c else 0.030)
    assert modes[-1] is True


def test_a_settled_bucket_that_gets_slower_is_tried_again():
    """Plain settles at 30 ms; later the link degrades and plain takes DRIFT x longer: a check
    starts a new trial, and compression, now faster, is kept."""
    ranks = world(False)
    run(ranks, 20, lambda r, c, s: 0.045 if c else 0.030)
    assert ranks[0].compress(KEY) is False and ranks[0].buckets[KEY].phase == "settled"
    modes = run(ranks, 3 * MONITOR, lambda r, c, s: 0.045 if c else 0.030 * DRIFT * 2, first=21)
    assert modes[-1] is True and ranks[0].describe()[0]["trials"] == 2


def test_a_bucket_that_goes_plain_takes_its_residual_with_it():
    """Compression off for a bucket: its error-feedback residuals are added into the buffer that
    is reduced plainly (each at its place), and its compression state is dropped."""
    from vcga.compress.ef import ErrorFeedback
    from vcga.compress.engine import Reducer
    from vcga.compress.exchange import Exchange, _Slot

    red = Reducer.__new__(Reducer)  # only what release_residuals reads: a one-island layout
    red.scope, red.island = "all", (0,)
    red.layout = type("L", (), {"islands": [(0,)], "equal": True})()
    red.compressor = type("C", (), {"elementwise": False})()
    red._cut_cache = {}
    red.exchange = Exchange.__new__(Exchange)
    red.exchange.slots, red.exchange.peers, red.exchange._seeds = {}, 2, {}
    key = (0, ((4, 3), (5,)))
    ef = ErrorFeedback()
    ef.input(torch.ones(5))
    ef.update(torch.ones(5), torch.full((5,), 0.75))  # residual 0.25 for the bias at offset 12
    red.exchange.slots[(key, 0, 1, 12)] = _Slot(ef=ef)
    red.exchange.slots[((1, ((2,),)), 0, 0, 0)] = _Slot()  # another bucket's: untouched
    flat = torch.zeros(17)
    assert red.release_residuals(flat, [(4, 3), (5,)], key) == 1
    assert torch.equal(flat[12:], torch.full((5,), 0.25)) and not flat[:12].any()
    assert list(red.exchange.slots) == [((1, ((2,),)), 0, 0, 0)]
