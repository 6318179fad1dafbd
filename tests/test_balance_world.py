"""vcga.balance where users train, on mixed-vendor worlds (fake-backed: simulated vendors on CPU).

Plain DDP, DDP with a ``vcga.compress`` hook (fp16), FSDP2 and a Lightning Trainer each train 10
steps on two vendors (nccl:1,hccl:1) with uneven shares and a re-balance forced at step 5, save
through ``vcga.checkpoint``, and resume for 10 more steps on three ranks of another mix
(cncl:1,nccl:2) with other shares and another forced re-balance. Every step's averaged gradient
equals one process's gradient of the mean over the same global batch within the derived
summation bound (tests/balance_cases.py), and the global batches are the seeded sequence's,
across the re-balances and the resume. One world per mix serves every framework.
"""

from __future__ import annotations

import pytest
import torch
from balance_cases import SEED, B, N

from vcga.testing import run_world

MIX_A, MIX_B = "nccl:1,hccl:1", "cncl:1,nccl:2"
PLANS_A = {
    "ddp": {"shares": [11, 5], "force": (5, {"nccl": 1, "hccl": 3}), "micro_batch": {"nccl": 4}, "save": True},
    "compress": {"shares": [11, 5], "force": (5, [3, 13]), "save": True},
    "fsdp2": {"shares": [11, 5], "force": (5, {"nccl": 1, "hccl": 3}), "micro_batch": {"hccl": 3}, "save": True},
    "lightning": {"shares": [11, 5], "force": (5, [4, 12]), "save": True},
}
PLANS_B = {
    # "auto" re-balances on measured (real, noisy) times at steps 13 and 15; any shares are exact
    "ddp": {"shares": "auto", "warmup": 1, "window": 2, "force": (16, [6, 2, 8]), "resume": True},
    "compress": {"shares": {"nccl": 2, "cncl": 1}, "force": (15, [2, 7, 7]), "resume": True},
    "fsdp2": {"shares": [3, 6, 7], "force": (15, {"cncl": 3, "nccl": 1}), "micro_batch": 2, "resume": True},
    "lightning": {"shares": [5, 5, 6], "force": (15, [7, 7, 2]), "resume": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("pytorch_lightning")
    root = str(tmp_path_factory.mktemp("balance"))
    from balance_cases import world

    a = run_world(world, 2, PLANS_A, root, env={"VCGA_SIM_VENDORS": MIX_A})
    b = run_world(world, 3, PLANS_B, root, env={"VCGA_SIM_VENDORS": MIX_B})
    assert a[0]["transport"] == "bridge(sim-nccl:1,sim-hccl:1)"
    assert b[0]["transport"] == "bridge(sim-cncl:1,sim-nccl:2)"
    return a, b


def _expected(epoch: int, index: int) -> list[int]:
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
    return perm[index * B:(index + 1) * B].tolist()


def _check(runs, phase: str, shares_at: dict[int, list[int]]) -> list[dict]:
    a, b = runs
    records = a[0][phase]["records"] + b[0][phase]["records"]
    # the same sequence of global batches as one uninterrupted job: epoch 0's 12 steps, then epoch 1
    assert [(r["epoch"], r["index"]) for r in records] == [(0, i) for i in range(12)] + [(1, i) for i in range(8)]
    for step, r in enumerate(records):
        assert [len(p) for p in r["parts"]] == r["shares"], (phase, step)
        assert sum(r["parts"], []) == _expected(r["epoch"], r["index"]), (phase, step)
        if step in shares_at:
            assert r["shares"] == shares_at[step], (phase, step, r["shares"])
        assert r["ratio"] <= 1.0, (phase, step, r)
    return records


def test_ddp_uneven_shares_micro_batches_tokens_rebalance_and_resume_are_exact(runs):
    records = _check(runs, "ddp", {0: [11, 5], 4: [11, 5], 5: [4, 12], 9: [4, 12], 16: [6, 2, 8], 19: [6, 2, 8]})
    assert {r["norm"] for r in records} == {"samples", "tokens"}
    a, b = runs
    # "auto" decided on the second world's measured times, and every rank holds the same shares
    assert b[0]["ddp"]["auto"]["last_decision"] is not None
    assert all(x["ddp"]["shares"] == [6, 2, 8] for x in b[1:])


def test_ddp_with_a_compression_hook_is_exact_on_lossless_data_and_weights_ranks_right_when_lossy(runs):
    records = _check(runs, "compress", {0: [11, 5], 5: [3, 13], 10: [3, 7, 6], 15: [2, 7, 7]})
    assert {r["task"] for r in records} == {"linear", "regression"}
    assert all(r["ratio"] == 0.0 for r in records if r["task"] == "linear")  # lossless data: bitwise
    a, b = runs
    for x in (a[0], b[0]):  # every bucket went through the fp16 exchange
        assert x["compress"]["compression"]["compressed"] > 0 and x["compress"]["compression"]["plain"] == 0


def test_fsdp2_with_micro_batches_is_exact(runs):
    _check(runs, "fsdp2", {0: [11, 5], 5: [4, 12], 10: [3, 6, 7], 15: [10, 3, 3]})
    a, b = runs
    # uneven micro-steps on a model that reshards after forward: a typed error before any collective
    for x in (a[0], b[0]):
        assert "reshard_after_forward=False" in x["fsdp2"]["refused"], x["fsdp2"]["refused"]


def test_lightning_trainer_with_the_balance_callback_is_exact(runs):
    _check(runs, "lightning", {0: [11, 5], 5: [4, 12], 10: [5, 5, 6], 15: [7, 7, 2]})
    a, b = runs
    assert a[0]["lightning"]["steps"] == 10 and b[0]["lightning"]["steps"] == 10


def _example(rank: int, world: int, init_method: str, argv: list[str]) -> dict:
    import importlib.util
    import os
    from pathlib import Path

    host, port = init_method.removeprefix("tcp://").split(":")
    os.environ.update({"MASTER_ADDR": host, "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": str(world)})
    path = Path(__file__).resolve().parents[1] / "examples" / "train_balanced.py"
    spec = importlib.util.spec_from_file_location("train_balanced", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)


def test_the_example_in_docs_balance_trains_with_weights_a_cap_and_a_checkpoint(tmp_path):
    """examples/train_balanced.py as docs/balance.md shows it: vendor weights, a micro-batch cap on
    one vendor, a checkpoint; both ranks end with the same model, and it learned."""
    argv = ["--steps", "12", "--shares", "nccl=3,hccl=1", "--micro-batch", "nccl=64", "--ckpt", str(tmp_path),
            "--save-every", "6"]
    first, second = run_world(_example, 2, argv, env={"VCGA_SIM_VENDORS": MIX_A})
    assert first["loss"] == second["loss"] and first["steps"] == 12
    assert first["shares"] == [192, 64] and first["balancer"]["caps"] == [64, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-12", "step-6"]
    untrained = run_world(_example, 2, ["--steps", "0"], env={"VCGA_SIM_VENDORS": MIX_A})[0]
    assert first["loss"] < 0.7 * untrained["loss"], (first["loss"], untrained["loss"])
