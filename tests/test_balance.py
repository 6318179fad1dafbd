"""vcga.balance in one process: the arithmetic of shares, the auto policy, the global batches and
their state, the loss scale, micro-batches, the compute clock, the batch sampler, the Lightning
callback's checks and ``vcga info --plan --weights``. (Ranks of mixed vendors training with it:
tests/test_balance_world.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from vcga.balance import AutoPolicy, Balancer, counts_from_weights, parse_weights, split_counts
from vcga.balance.shares import micro_sizes
from vcga.errors import VcgaCheckpointError, VcgaConfigError, VcgaError

# -- shares --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("total", "weights", "counts"), [
    (384, [1, 0.5], [256, 128]),
    (384, [1, 0.5, 0.25], [219, 110, 55]),  # quotas 219.43, 109.71, 54.86: remainders .86 and .71 get one each
    (10, [1, 1, 1], [4, 3, 3]),  # a tie goes to the lower rank
    (10, [100, 0.001, 0.001], [8, 1, 1]),  # at least one each, taken from the rank most above its quota
    (3, [5, 1, 1], [1, 1, 1]),
])
def test_split_counts_is_largest_remainder_with_one_sample_per_rank(total, weights, counts):
    assert split_counts(total, weights) == counts
    assert sum(counts) == total


@pytest.mark.parametrize(("total", "weights", "what"), [
    (2, [1, 1, 1], ">= 3 for 3 ranks"), (8, [1, 0], "finite weights > 0"), (8, [1, float("nan")], "finite"),
    (8, [], "one weight per rank")])
def test_split_counts_refuses_what_cannot_be_split(total, weights, what):
    with pytest.raises(VcgaConfigError, match=what):
        split_counts(total, weights)


def test_vendor_weights_name_a_backend_or_the_library_a_simulated_one_stands_for():
    ranks = [("sim-nccl", "nccl"), ("sim-hccl", "hccl"), ("hccl", None)]
    assert counts_from_weights(35, {"nccl": 2.5, "hccl": 1}, ranks) == [19, 8, 8]
    assert counts_from_weights(35, {"sim-nccl": 1, "hccl": 1, "sim-hccl": 5}, ranks) == [5, 25, 5]  # name first
    with pytest.raises(VcgaConfigError, match=r"none for sim-hccl \(simulating hccl\)"):
        counts_from_weights(35, {"nccl": 2.5}, ranks)
    assert parse_weights("nccl=2.5, hccl=1") == {"nccl": 2.5, "hccl": 1.0}
    for bad in ("nccl", "nccl=0", "nccl=x", "nccl=1,nccl=2", "=1"):
        with pytest.raises(VcgaConfigError, match="backend=weight pairs"):
            parse_weights(bad)


def test_micro_sizes_are_the_fewest_micro_batches_under_the_cap_as_equal_as_possible():
    assert micro_sizes(11, 4) == [4, 4, 3] and micro_sizes(12, 4) == [4, 4, 4] and micro_sizes(9, 4) == [3, 3, 3]
    assert micro_sizes(5, None) == [5] and micro_sizes(3, 4) == [3]


# -- the auto policy -----------------------------------------------------------------------------------


def test_auto_moves_to_speeds_then_holds_within_the_hysteresis():
    p = AutoPolicy(smoothing=0.5, hysteresis=0.03)
    # equal shares; rank 1 measured at half the speed: 2 s for 192 samples against 1 s
    d = p.decide(384, [192, 192], [(1.0, 192), (2.0, 192)], None)
    assert d.changed and d.shares == [256, 128] and d.speeds == [192.0, 96.0]
    # the same speeds measured again: nothing to gain
    d2 = p.decide(384, d.shares, [(256 / 192, 256), (128 / 96, 128)], d.speeds)
    assert not d2.changed and d2.shares == [256, 128]
    # noise of 2 %: within the hysteresis, the shares stay
    d3 = p.decide(384, d2.shares, [(256 / 192 * 1.02, 256), (128 / 96, 128)], d2.speeds)
    assert not d3.changed


def test_auto_smooths_a_change_of_speed_and_converges_on_equal_step_times_despite_a_fixed_cost():
    p = AutoPolicy(smoothing=0.5, hysteresis=0.03)
    speeds, shares, est = [100.0, 100.0], [100, 100], None
    history = []
    for window in range(12):
        if window == 2:
            speeds = [100.0, 50.0]  # rank 1 halves its speed
        # each rank's time per step: a fixed 0.1 s plus its samples over its speed
        figures = [(5 * (0.1 + n / v), 5 * n) for n, v in zip(shares, speeds, strict=True)]
        d = p.decide(200, shares, figures, est)
        shares, est = d.shares, d.speeds
        history.append(shares)
    assert history[1] == [100, 100]
    assert 100 < history[2][0] < 120  # part of the way at the first window after the change (unsmoothed: 131)
    t = [0.1 + n / v for n, v in zip(shares, speeds, strict=True)]
    assert abs(t[0] - t[1]) / max(t) < 0.05, (history, t)  # equal step times: the fixed cost is allowed for
    assert history[-1] == history[-2]  # settled


def test_auto_keeps_the_shares_when_a_rank_measured_nothing_and_refuses_bad_parameters():
    d = AutoPolicy().decide(10, [5, 5], [(1.0, 5), (0.0, 0)], None)
    assert not d.changed and d.shares == [5, 5] and "ranks [1] measured nothing" in d.reason
    for kw in ({"smoothing": 1.0}, {"smoothing": -0.1}, {"hysteresis": 1.5}):
        with pytest.raises(VcgaConfigError):
            AutoPolicy(**kw)


# -- the balancer in a world of one -------------------------------------------------------------------


def test_global_batches_are_a_seeded_permutation_per_epoch_with_the_tail_left_out():
    b = Balancer(100, 32, [32], seed=5)
    assert len(b) == b.steps_per_epoch == 3  # 100 = 3 x 32 + a tail of 4, left out
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(5)).tolist()
    assert list(b) == [perm[0:32], perm[32:64], perm[64:96]]
    assert list(b) == [perm[0:32], perm[32:64], perm[64:96]]  # a new pass without set_epoch: the same order
    b.set_epoch(1)
    assert next(iter(b)) == torch.randperm(100, generator=torch.Generator().manual_seed(6)).tolist()[:32]
    assert b.global_indices(2) == torch.randperm(100, generator=torch.Generator().manual_seed(6)).tolist()[64:96]
    with pytest.raises(IndexError):
        b.global_indices(3)
    tail = Balancer(100, 32, "auto", drop_last=False)
    sizes = [len(x) for x in tail]
    assert sizes == [32, 32, 32, 4] and tail.loss_scale == 1 / 4  # the tail is one shorter step
    assert Balancer(10, 5, [5], shuffle=False).global_indices(1) == [5, 6, 7, 8, 9]


def test_state_dict_holds_the_global_cursor_and_a_new_balancer_continues_the_sequence():
    a = Balancer(100, 10, [10], seed=3)
    a.set_epoch(2)
    it = iter(a)
    seen = [next(it) for _ in range(4)]
    state = a.state_dict()
    assert state == {"format": "vcga.balance/1", "num_samples": 100, "global_batch": 10, "seed": 3, "shuffle": True,
                     "drop_last": True, "epoch": 2, "cursor": 4}
    b = Balancer(100, 10, [10], seed=0)  # the saved seed wins
    b.load_state_dict(state)
    b.set_epoch(2)  # a resumed loop calling set_epoch with the epoch it saved keeps its place
    assert list(b) == list(it) and len(seen) == 4
    assert b.current is not None and (b.current.epoch, b.current.index) == (2, 9)
    with pytest.raises(VcgaCheckpointError, match="global_batch=10"):
        Balancer(100, 20, [20]).load_state_dict(state)
    with pytest.raises(VcgaCheckpointError, match="format"):
        Balancer(100, 10, [10]).load_state_dict({**state, "format": "other/9"})


def test_loss_scale_turns_local_sums_into_the_global_mean_and_refuses_an_empty_count():
    b = Balancer(64, 16, [16])
    next(iter(b))
    assert b.loss_scale == 1 / 16
    assert b.loss_scale_for(40) == 1 / 40 and b.loss_scale_for(torch.tensor(8)) == 1 / 8
    with pytest.raises(VcgaError, match="nothing to average"):
        b.loss_scale_for(0)


@pytest.mark.parametrize(("kwargs", "what"), [
    ({"shares": "fast"}, '"auto", a list'), ({"shares": [8, 8]}, "1 integer counts"), ({"shares": [15]}, "sum"),
    ({"global_batch": 0}, "global_batch"), ({"global_batch": 17}, "at most num_samples"),
    ({"num_samples": 0}, "num_samples"), ({"micro_batch": 0}, "caps >= 1"), ({"micro_batch": [2, 2]}, "one cap"),
    ({"window": 0}, "window"), ({"smoothing": 2.0}, "smoothing"),
])
def test_bad_arguments_are_typed_errors_naming_the_argument(kwargs, what):
    args = {"num_samples": 16, "global_batch": 16, "shares": [16], **kwargs}
    with pytest.raises(VcgaConfigError, match=what) as e:
        Balancer(args.pop("num_samples"), args.pop("global_batch"), **args)
    assert "vcga.balance" in str(e.value)


# -- micro-batches and the compute clock ----------------------------------------------------------------


class _Ddp:
    """What accumulate() needs of a DDP model: no_sync, recorded."""

    def __init__(self) -> None:
        self.synced: list[bool] = []
        self._sync = True

    @contextmanager
    def no_sync(self):
        self._sync = False
        yield
        self._sync = True


def test_accumulate_cuts_the_step_under_the_cap_and_synchronises_only_the_last_micro_step():
    b = Balancer(40, 10, [10], micro_batch=4)
    idx = next(iter(b))
    assert b.micro_steps() == [3]
    model = _Ddp()
    parts = []
    for part in b.accumulate(model, idx):
        parts.append(part)
        model.synced.append(model._sync)
    assert [len(p) for p in parts] == [4, 3, 3] and sum(parts, []) == idx and model.synced == [False, False, True]
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    cut = b.micro_batches({"x": x, "pair": (x, y)})
    assert [c["x"].shape[0] for c in cut] == [4, 3, 3] and torch.equal(torch.cat([c["pair"][1] for c in cut]), y)
    with pytest.raises(VcgaConfigError, match="batch"):
        b.micro_batches("text")


def test_measure_ends_at_the_last_gradient_not_at_the_end_of_the_block(monkeypatch):
    """The time a rank waits for its peers after its last gradient (DDP's final wait) is not its
    compute: a clock the test moves by hand shows which instants the measurement uses."""
    import vcga.balance.timing as timing

    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    net = torch.nn.Linear(3, 2)
    b = Balancer(8, 4, [4])
    next(iter(b))
    for p in net.parameters():  # registered before the clock's own hooks: runs first, moves the clock
        p.register_post_accumulate_grad_hook(lambda _p: now.__setitem__(0, now[0] + 1.0))
    now[0] = 10.0
    with b.measure(net):
        net(torch.ones(4, 3)).sum().backward()  # two gradients: the last at 12
        now[0] = 50.0  # waiting for peers
    with b.measure():  # without a module: the whole block
        now[0] = 53.0
    with b.measure(net, samples=2):
        pass  # no gradient in the block: the whole block again
    assert b._clock.take() == ((12.0 - 10.0) + (53.0 - 50.0) + 0.0, 4 + 4 + 2)


def test_a_data_loader_takes_the_batch_sampler_and_frameworks_find_set_epoch_on_its_sampler():
    from torch.utils.data import DataLoader, TensorDataset

    b = Balancer(24, 8, [8], seed=1)
    loader = DataLoader(TensorDataset(torch.arange(24)), batch_sampler=b.batch_sampler())
    assert len(loader) == 3
    got = [x.tolist() for (x,) in loader]
    assert got == [b.global_indices(i) for i in range(3)]
    loader.batch_sampler.sampler.set_epoch(4)  # where Lightning calls it
    assert b.epoch == 4 and next(iter(loader))[0].tolist() == b.global_indices(0)


def test_lightning_callback_refuses_a_distributed_sampler_and_an_unknown_loss():
    pytest.importorskip("pytorch_lightning")
    from types import SimpleNamespace

    from vcga.integrations.lightning import Balance

    b = Balancer(8, 4, [4])
    with pytest.raises(VcgaConfigError, match="loss"):
        Balance(b, loss="max")
    cb = Balance(b)
    trainer = SimpleNamespace(_accelerator_connector=SimpleNamespace(use_distributed_sampler=True))
    with pytest.raises(VcgaConfigError, match="use_distributed_sampler=False"):
        cb.setup(trainer, None, "fit")
    assert cb.state_dict() == b.state_dict()


# -- vcga info --plan --weights ------------------------------------------------------------------------


def test_info_plan_shows_the_shares_vendor_weights_yield():
    from click.testing import CliRunner

    from vcga.cli import cli

    r = CliRunner().invoke(cli, ["info", "--plan", "--json", "--vendors", "nccl:1,hccl:2", "--weights",
                                 "nccl=2.5,hccl=1", "--global-batch", "384"])
    assert r.exit_code == 0, r.output
    shares = json.loads(r.output)["shares"]
    assert shares["counts"] == [214, 85, 85] and shares["backends"] == ["sim-nccl", "sim-hccl", "sim-hccl"]
    r = CliRunner().invoke(cli, ["info", "--plan", "--vendors", "nccl:1,hccl:2", "--weights", "nccl=2.5,hccl=1",
                                 "--global-batch", "384"])
    assert "rank 0   sim-nccl     214  (55.7%)" in r.output, r.output
    r = CliRunner().invoke(cli, ["info", "--plan", "--vendors", "nccl:1,hccl:2", "--weights", "nccl=2"])
    assert r.exit_code != 0 and "--weights needs --global-batch" in r.output
    r = CliRunner().invoke(cli, ["info", "--plan", "--vendors", "nccl:1,hccl:2", "--weights", "nccl=2",
                                 "--global-batch", "8"])
    assert r.exit_code != 0 and "none for sim-hccl" in r.output


def test_the_shares_arithmetic_imports_no_torch():
    code = "import sys, vcga.balance, vcga.balance.shares; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_script_in_docs_balance_is_the_example_file():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "balance.md").read_text()
    start, end = "<!-- example: examples/train_balanced.py -->\n```python\n", "```\n<!-- end example -->"
    block = doc.split(start, 1)[1].split(end)[0]
    assert block == (root / "examples" / "train_balanced.py").read_text()
