"""A node's link goes down during checkpointed training: examples/train_elastic.py on two namespace
nodes (vcga.testing.multinode; fake-backed: sim-nccl on node 0, sim-hccl on node 1), torchrun's
command line and agent with c10d rendezvous, each node's workers forked from its agent
(tests/elastic_agent.py; tests/test_multinode.py launches the torchrun command itself). The ranks' traffic runs over a second network (``VCGA_NETWORK_INTERFACE=eth1``)
whose link on node 1 is taken down mid-training, while torchrun's own rendezvous keeps network 0.

Every rank must end with a typed error within the collective timeout (no hang), the newest
published checkpoint must be complete and verify, and -- the link back up -- the same job
relaunched must resume from it and finish with the same bits on every rank. Needs root; where the
machine refuses to build nodes the test skips with its reason, unless VCGA_MULTINODE_REQUIRED=1."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from vcga.testing.multinode import Cluster, NodesUnavailable

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_elastic.py")
# torchrun's command line and agent, its workers forked from the agent's interpreter
# (tests/elastic_agent.py): torch and vcga imported once per node and launch, not once per worker
AGENT = [str(ROOT / "tests" / "elastic_agent.py")]
NPROC = 2
TIMEOUT = 10.0  # the ranks' collective timeout (s)
TYPED = {"VcgaCollectiveError", "VcgaTimeoutError", "VcgaPeerLostError"}

pytestmark = pytest.mark.timeout(900)


def _cluster() -> Cluster:
    try:
        return Cluster(nodes=2, rate=["1gbit", "1gbit"], networks=2)
    except NodesUnavailable as e:
        if os.environ.get("VCGA_MULTINODE_REQUIRED") == "1":
            raise
        pytest.skip(e.reason)


def _env(backend: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env.update(VCGA_BACKEND=backend, VCGA_TIMEOUT=str(TIMEOUT), VCGA_NETWORK_INTERFACE="eth1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_node_link_down_ends_typed_and_the_job_resumes_from_its_last_checkpoint(tmp_path):
    import vcga.checkpoint as ckpt
    from vcga.convert import inspect_checkpoint

    root, events = tmp_path / "ckpt", tmp_path / "events"
    args = [SCRIPT, "--root", str(root), "--steps", "30", "--save-every", "2", "--events", str(events)]
    node_env = [_env("sim-nccl"), _env("sim-hccl")]
    cluster = _cluster()
    with cluster:
        launch = cluster.torchrun([*args, "--out", str(tmp_path / "first.json")], NPROC, env={}, node_env=node_env,
                                  launcher=AGENT)
        deadline = time.monotonic() + 600
        while (ckpt.latest_step(root) or 0) < 4:  # trained and checkpointed a little
            if any(c is not None for c in launch.poll()) or time.monotonic() > deadline:
                out = "\n".join(r.output[-3000:] for r in launch.wait(timeout=30))
                pytest.fail(f"no checkpoint of step 4 before the job ended or the deadline\n{out}")
            time.sleep(0.1)
        down_at = time.time()
        cluster.nodes[1].set_link(False, network=1)
        results = launch.wait(timeout=6 * TIMEOUT + 120)  # a hang fails here
        assert all(r.returncode not in (0, None) for r in results), [r.output[-2000:] for r in results]
        failed = [e for e in _events(events) if e["event"] == "failed"]
        assert sorted(e["rank"] for e in failed) == list(range(2 * NPROC)), failed
        for e in failed:
            assert e["error"] in TYPED, e
            assert e["time"] - down_at <= 2 * TIMEOUT + 10, e

        latest = ckpt.latest_step(root)
        assert latest is not None and latest >= 4 and latest % 2 == 0
        report = inspect_checkpoint(root / f"step-{latest}", verify=True)  # complete, every chunk verified
        assert report.format == "dcp" and report.tensors and report.mismatches == 0

        cluster.nodes[1].set_link(True, network=1)
        again = cluster.torchrun([*args, "--out", str(tmp_path / "second.json")], NPROC, env={}, node_env=node_env,
                                  launcher=AGENT)
        results = again.wait(timeout=600)
        assert all(r.returncode == 0 for r in results), [r.output[-3000:] for r in results]
        starts = [e for e in _events(events) if e["event"] == "start"]
        assert [s["resumed_from"] for s in starts] == [None, latest]
        final = json.loads((tmp_path / "second.json").read_text())
        assert final["final_step"] == 30 and final["identical_on_every_rank"]
        assert final["backend"] == "bridge(sim-nccl:2,sim-hccl:2)"
    assert cluster.remaining() == []
