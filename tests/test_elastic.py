"""examples/train_elastic.py under torchrun's elastic agent with real faults (fake-backed: the
vendors are simulated on CPU).

The uninterrupted runs are the references; they need no launcher, so their ranks are forked from
the rank server with torchrun's environment (tests/script_world.py). One job of 3 ranks
(nccl:2,hccl:1: an island of two ranks and one of one, so a lost rank's peers wait both inside an
island and across the hop) meets, one per attempt, the faults of the matrix that need a restart:

1. rank 1 SIGKILLed mid-step (after its forward pass, its peers waiting in the all_reduce);
2. rank 2 SIGKILLed during a save, after its shard was written and before the checkpoint was
   published: the previous checkpoint stays latest, and the next attempt resumes from it;
3. rank 1 SIGSTOPped (hung): its peers fail with a typed VcgaTimeoutError, torchrun restarts.

It must end with parameters bitwise equal to its uninterrupted run. Its launcher is torchrun's
command line and elastic agent (rendezvous, restarts, teardown) with each attempt's workers forked
from the agent's interpreter (tests/elastic_agent.py), not a fresh interpreter each: its four
attempts start twelve workers, each of which would import torch, torch._dynamo and vcga again
(about 3.5 CPU-s). The compressed job -- two ranks, one killed, one restart, the cheapest job with
a restart -- runs under the torchrun CLI itself, a fresh interpreter per worker: the launch a user
types, restart included.

A 4-rank uninterrupted run (nccl:2,hccl:2; it checkpoints with async_save and records the
magnitudes the 3-rank bound needs) is resumed at its step-6 checkpoint by 3 ranks of another
vendor mix (resharded; no restart, so forked ranks too), which must stay within the derived bound
of that run (the script checks; docstring of examples/train_elastic.py). Disk full, a corrupted
shard and resharding without restarts: tests/test_checkpoint_world.py and tests/test_checkpoint.py."""

from __future__ import annotations

import shutil

import pytest
from elastic_run import launch, run_forked

VENDORS = "nccl:2,hccl:2"  # the 4-rank run whose checkpoint 3 ranks resume
FAULT_VENDORS = "nccl:2,hccl:1"  # the fault job's
STEPS = ["--steps", "12", "--save-every", "3"]


# A launch with restarts waits out its faults (the hang: the collective timeout) and starts every
# worker again: on a busy 2-core machine it can take minutes. The runs end on their own; these are
# backstops.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    run = run_forked(tmp, nproc=4, vendors=VENDORS, name="ref",
                 args=["--root", str(tmp / "ref"), *STEPS, "--async", "--keep-last", "4",
                       "--record-bound", str(tmp / "ref.pt")])
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["backend"] == "bridge(sim-nccl:2,sim-hccl:2)" and run.result["final_step"] == 12
    return tmp, run.result


@pytest.fixture(scope="module")
def fault_reference(tmp_path_factory):
    """The fault job's uninterrupted run: the same ranks, vendors and steps, no fault."""
    tmp = tmp_path_factory.mktemp("elastic-faults")
    run = run_forked(tmp, nproc=3, vendors=FAULT_VENDORS, name="ref", args=["--root", str(tmp / "ref"), *STEPS])
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["backend"] == "bridge(sim-nccl:2,sim-hccl:1)" and run.result["final_step"] == 12
    assert run.result["identical_on_every_rank"]
    return run.result


def test_killed_and_hung_ranks_restart_and_end_bitwise_equal_to_the_uninterrupted_run(fault_reference, tmp_path):
    ref = fault_reference
    faults = ",".join(["kill:rank=1:step=4:at=mid:attempt=0",
                       "kill:rank=2:step=6:at=save:attempt=1",
                       "hang:rank=1:step=10:attempt=2"])
    run = launch(tmp_path, nproc=3, vendors=FAULT_VENDORS, fault=faults, max_restarts=3, name="faults", agent="fork",
                 args=["--root", str(tmp_path / "ckpt"), *STEPS])
    out = run.output
    assert run.returncode == 0, out[-6000:]
    for line in ("vcga fault: kill rank 1 at mid of step 4 (attempt 0)",
                 "vcga fault: kill rank 2 at save of step 6 (attempt 1)",
                 "vcga fault: hang rank 1 at step of step 10 (attempt 2)"):
        assert line in out
    assert "VcgaTimeoutError" in out  # the hung rank's peers timed out, typed
    assert run.continued >= 1  # the hung rank was torn down by the agent (SIGTERM, then continued)
    starts = [(e["attempt"], e["resumed_from"]) for e in run.events if e["event"] == "start"]
    # 0: fresh. 1: after the kill at step 4, from step 3. 2: the save of step 6 never published,
    # so from step 3 again. 3: after the hang at step 10, from step 9.
    assert starts == [(0, None), (1, 3), (2, 3), (3, 9)], starts
    done = [e for e in run.events if e["event"] == "done"]
    assert len(done) == 1 and done[0]["final_step"] == 12
    assert run.result["identical_on_every_rank"] and run.result["backend"] == "bridge(sim-nccl:2,sim-hccl:1)"
    assert run.result["digest"] == ref["digest"]  # bitwise equal to the uninterrupted run
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-12", "step-6", "step-9"]


def test_three_ranks_resume_a_four_rank_checkpoint_within_the_derived_bound(reference, tmp_path):
    ref_dir, _ = reference
    root = tmp_path / "ckpt"
    root.mkdir()
    shutil.copytree(ref_dir / "ref" / "step-6", root / "step-6")  # written by async_save on 4 ranks
    from vcga.checkpoint.storage import write_latest

    write_latest(root, 6)
    run = run_forked(tmp_path, nproc=3, vendors="nccl:1,hccl:2", name="three",
                     args=["--root", str(root), *STEPS, "--compare-with", str(ref_dir / "ref.pt")])
    assert run.returncode == 0, run.output[-4000:]
    res = run.result
    assert res["world"] == 3 and res["resumed_from"] == 6 and res["final_step"] == 12
    assert res["backend"] == "bridge(sim-nccl:1,sim-hccl:2)"
    b = res["bound"]
    assert b["steps_compared"] == 6 and b["within_bound"] and 0 < b["max_bound"] < 1e-3, b


def test_a_compressed_job_killed_mid_step_resumes_with_its_residuals_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    """``--compression powersgd`` (fake-backed: nccl:1,hccl:1 simulated, scope bridge): the hook's
    state -- error-feedback residuals, PowerSGD's warm start, its step count -- is checkpointed with
    the model, so a rank SIGKILLed mid-step and restarted by torchrun ends bit for bit where the
    uninterrupted compressed run does. (Without the state in the checkpoint it does not: the
    resumed residuals would start at zero.)"""
    spec = ["--steps", "6", "--save-every", "2", "--compression", "powersgd:rank=2,min_rate=0"]
    ref = run_forked(tmp_path, nproc=2, vendors="nccl:1,hccl:1", name="cref",
                     args=["--root", str(tmp_path / "ref"), *spec])
    assert ref.returncode == 0, ref.output[-4000:]
    run = launch(tmp_path, nproc=2, vendors="nccl:1,hccl:1", name="ckill", max_restarts=1,
                 fault="kill:rank=1:step=3:at=mid:attempt=0", args=["--root", str(tmp_path / "ckpt"), *spec])
    assert run.returncode == 0, run.output[-4000:]
    assert "vcga fault: kill rank 1 at mid of step 3 (attempt 0)" in run.output
    starts = [(e["attempt"], e["resumed_from"]) for e in run.events if e["event"] == "start"]
    assert starts == [(0, None), (1, 2)], starts
    for res in (ref.result, run.result):
        assert res["identical_on_every_rank"] and res["final_step"] == 6
        c = res["compression"]
        # the restored step count and stats carry on: 6 steps, every one compressed, across the hop
        assert c["spec"].startswith("powersgd") and c["scope"] == "bridge" and c["step"] == 6, c
        assert c["stats"] == {"compressed": 6, "plain": 0}, c
    assert run.result["digest"] == ref.result["digest"]
