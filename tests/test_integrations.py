"""VCGA inside the frameworks, each with the real package on CPU, 2 processes (docs/integrations.md).

Each test runs a script from tests/integrations/ as its framework expects to be launched (a job
launched by torchrun gets torchrun's environment on ranks forked from the rank server,
tests/script_world.py), and asserts that the job ran on backend vcga (single vendor: transport
gloo; mixed: the bridge between sim-nccl and sim-hccl) and that every rank ends with bitwise
identical weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPTS = ROOT / "tests" / "integrations"
MIXED = {"VCGA_SIM_VENDORS": "nccl:1,hccl:1"}
BRIDGE = "bridge(sim-nccl:1,sim-hccl:1)"


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env.update({"PYTHONWARNINGS": "ignore", "RUST_LOG": "error", **(extra or {})})
    return env


def _run(cmd: list[str], extra_env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(extra_env), cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return r


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process Lightning job (Lightning's own launcher) for the tests below: its runs one after
    another, each with a new process group (tests/integrations/lightning_run.py). Returns the
    folder that holds each run's folder, or skips where neither Lightning package is installed."""
    runs = []
    if importlib.util.find_spec("pytorch_lightning") is not None:
        runs += ["pytorch_lightning:one-vendor", "pytorch_lightning:mixed"]
    if importlib.util.find_spec("lightning") is not None:
        runs += ["lightning.pytorch:mixed"]
    if not runs:
        pytest.skip("neither pytorch_lightning nor lightning is installed (test extras)")
    out = tmp_path_factory.mktemp("lightning")
    # VCGA's strategy is given no spec: it takes the configured one (Lightning's ignore it)
    _run([sys.executable, str(SCRIPTS / "lightning_run.py"), str(out), *runs],
         {"VCGA_COMPRESSION": "powersgd:rank=2,min_rate=0"}, timeout=360)
    return out


@pytest.mark.parametrize("vendors", [{}, MIXED], ids=["one-vendor", "mixed"])
def test_lightning_ddp_and_fsdp_strategies(lightning_job, vendors):
    """DDPStrategy(process_group_backend="vcga"), vcga.integrations.lightning.DDPStrategy with
    the configured compression (VCGA_COMPRESSION; on CPU, where Lightning's own registers no
    hook), and FSDP (ModelParallelStrategy + fully_shard)."""
    pytest.importorskip("pytorch_lightning")
    folder = lightning_job / f"pytorch_lightning-{'mixed' if vendors else 'one-vendor'}"
    digests = {}
    for strategy in ("pytorch_lightning.DDPStrategy", "vcga.DDPStrategy", "pytorch_lightning.ModelParallelStrategy"):
        ranks = [_read(folder / f"{strategy}-{r}.json") for r in (0, 1)]
        assert ranks[0]["sha256"] == ranks[1]["sha256"], strategy
        assert ranks[0]["sha256"] != ranks[0]["start_sha256"] and ranks[0]["steps"] == 4  # it trained
        for x in ranks:
            assert x["backend"] == "vcga" and x["transport"] == (BRIDGE if vendors else "gloo") and x["world"] == 2
        digests[strategy] = ranks[0]["sha256"]
    plain, compressed = (_read(folder / f"{s}-0.json")["compression"] for s in ("pytorch_lightning.DDPStrategy",
                                                                                "vcga.DDPStrategy"))
    assert plain is None
    # every bucket of the 4 steps went through the PowerSGD hook (mixed: scope bridge)
    assert compressed["spec"].startswith("powersgd") and compressed["step"] == 4, compressed
    assert compressed["stats"]["compressed"] >= 4 and compressed["stats"]["plain"] == 0, compressed
    assert compressed["scope"] == ("bridge" if vendors else "all"), compressed
    assert digests["vcga.DDPStrategy"] != digests["pytorch_lightning.DDPStrategy"]  # rank 2 of 32x8: lossy


def test_lightning_package_trainer_compresses_through_vcgas_strategy_for_it(lightning_job):
    """``lightning.pytorch``'s Trainer takes only strategies of its own package (ours for
    ``pytorch_lightning`` is refused with a ValueError): vcga.integrations.lightning.pytorch's
    DDPStrategy is the same adapter for it. Mixed vendors, configured compression."""
    pytest.importorskip("lightning")
    folder = lightning_job / "lightning.pytorch-mixed"
    ranks = [_read(folder / f"vcga.DDPStrategy-{r}.json") for r in (0, 1)]
    assert ranks[0]["sha256"] == ranks[1]["sha256"] != ranks[0]["start_sha256"]
    for x in ranks:
        assert x["trainer_package"] == "lightning.pytorch" and x["steps"] == 4
        assert x["backend"] == "vcga" and x["transport"] == BRIDGE and x["world"] == 2
        c = x["compression"]
        assert c["spec"].startswith("powersgd") and c["step"] == 4 and c["scope"] == "bridge", c
        assert c["stats"]["compressed"] >= 4 and c["stats"]["plain"] == 0, c


def test_vcga_lightning_strategy_refuses_compression_beside_a_hook_of_its_own():
    """DDP takes one communication hook: a compression spec and Lightning's ddp_comm_hook together
    are a typed error at construction, not one of them silently dropped."""
    pytest.importorskip("pytorch_lightning")
    from vcga.errors import VcgaConfigError
    from vcga.integrations.lightning import DDPStrategy

    with pytest.raises(VcgaConfigError, match="one communication hook"):
        DDPStrategy(compression="bf16", ddp_comm_hook=lambda state, bucket: None)
    assert DDPStrategy(compression="bf16").compression_state is None  # made when the model is wrapped
    if importlib.util.find_spec("lightning") is not None:  # the same for lightning.pytorch's
        from vcga.integrations.lightning.pytorch import DDPStrategy as ForLightning

        with pytest.raises(VcgaConfigError, match="one communication hook"):
            ForLightning(compression="bf16", ddp_comm_hook=lambda state, bucket: None)


@pytest.mark.parametrize("vendors", [{}, MIXED], ids=["one-vendor", "mixed"])
def test_accelerate_helper_runs_vcga_and_says_so(tmp_path, vendors):
    """vcga.integrations.accelerate.accelerator(cpu=True) in a 2-process job: DDP over vcga, and
    Accelerate reports backend vcga (it would say gloo: it forces gloo on CPU); with
    ``compression=``, DDP reduces through vcga's hook (Accelerate's comm_hook takes torch's only).
    Accelerate reads the job from the environment torchrun gives its workers; the ranks get that
    environment forked from the rank server (tests/script_world.py) instead of from torchrun."""
    pytest.importorskip("accelerate")
    from script_world import run_script

    codes = run_script(SCRIPTS / "accelerate_run.py", 2, [str(tmp_path), "helper"],
                       env={**vendors, "PYTHONWARNINGS": "ignore", "RUST_LOG": "error"}, timeout=240)
    assert codes == [0, 0], codes
    ranks = [_read(tmp_path / f"{r}.json") for r in (0, 1)]
    assert ranks[0]["sha256"] == ranks[1]["sha256"]
    for x in ranks:
        assert x["reported_without_helper"] == "gloo"  # Accelerate alone: runs the vcga group, says gloo
        assert x["state_backend"] == x["partial_state_backend"] == x["torch_backend"] == "vcga"
        assert x["transport"] == (BRIDGE if vendors else "gloo")
        assert x["num_processes"] == 2 and x["steps"] == 4 and x["distributed_type"].endswith("MULTI_CPU")
    # accelerator(compression=...): every bucket through vcga's hook, the user's DDP setting kept
    compressed = [x["compressed"] for x in ranks]
    assert compressed[0]["sha256"] == compressed[1]["sha256"] != ranks[0]["sha256"]  # lossy, ranks identical
    for c in compressed:
        assert c["steps"] == 4 and c["gradient_as_bucket_view"] is True and len(c["states"]) == 1, c
        state = c["states"][0]
        assert state["spec"].startswith("powersgd") and state["step"] == 4, state
        assert state["stats"]["compressed"] >= 4 and state["stats"]["plain"] == 0, state
        assert state["scope"] == ("bridge" if vendors else "all"), state


def test_accelerate_helper_refuses_compression_beside_torchs_hook():
    """DDP takes one communication hook: ``compression=`` beside Accelerate's own
    ``DistributedDataParallelKwargs(comm_hook=...)`` is a typed error, not one of them dropped."""
    pytest.importorskip("accelerate")
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from vcga.errors import VcgaConfigError
    from vcga.integrations.accelerate import accelerator

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(VcgaConfigError, match="one communication hook"):
        accelerator(cpu=True, compression="bf16", kwargs_handlers=[handler])


def _accelerate_alone(rank: int, world_size: int, init_method: str) -> str:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    try:
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="vcga")])
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def test_accelerate_alone_refuses_vcga_on_cpu():
    """Why the helper exists: asked for backend vcga on CPU, Accelerate raises. In a rank forked
    from the rank server: Accelerate's state is per process."""
    pytest.importorskip("accelerate")
    from vcga.testing import run_world

    got = run_world(_accelerate_alone, 1)[0]
    assert "ValueError: Your assigned backend vcga is not available, please use gloo" in got, got


def test_ray_train_torch_config_backend_vcga(tmp_path):
    """TorchTrainer(torch_config=TorchConfig(backend="vcga")) on ray.init(num_cpus=4): the workers
    find backend vcga through torch's autoload alone, on two vendors; vcga's compression hook
    registers on the model ``prepare_model`` returns. (Ray's cluster start is most
    of this test's cost, so it runs the mixed world only; `ray_run.py OUT --runs single,mixed` adds
    the one-vendor run, docs/integrations.md.)"""
    pytest.importorskip("ray.train")
    _run([sys.executable, str(SCRIPTS / "ray_run.py"), str(tmp_path)], timeout=280)
    for run, transport in (("mixed", BRIDGE),):
        ranks = [_read(tmp_path / f"{run}-{r}.json") for r in (0, 1)]
        assert ranks[0]["sha256"] == ranks[1]["sha256"], run
        assert all(x["backend"] == "vcga" and x["transport"] == transport and x["world"] == 2 for x in ranks)
        # vcga's compression hook on the DDP model prepare_model returns: every bucket through it
        assert ranks[0]["compressed_sha256"] == ranks[1]["compressed_sha256"] != ranks[0]["sha256"], run
        for x in ranks:
            c = x["compression"]
            assert c["spec"].startswith("powersgd") and c["step"] == 4 and c["scope"] == "bridge", c
            assert c["stats"]["compressed"] >= 4 and c["stats"]["plain"] == 0, c


def _replica_main(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    import runpy
    import warnings

    os.chdir(ROOT)
    os.environ.update({**env, "PYTHONWARNINGS": "ignore", "RUST_LOG": "error"})
    warnings.simplefilter("ignore")  # what PYTHONWARNINGS=ignore does at an interpreter's start
    with open(os.devnull, "wb") as null, open(log, "wb") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


class _Replica:
    """``python SCRIPT ARGV`` as a process forked from the rank server (torch already imported), with
    ``env`` and stderr to ``log``: what the test needs of a ``subprocess.Popen``."""

    def __init__(self, script: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        from vcga.spawn import get_context

        self.proc = get_context().Process(target=_replica_main, args=(script, argv, env, str(log)))
        self.proc.start()
        self.pid = self.proc.pid

    def wait(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            raise subprocess.TimeoutExpired(f"replica {self.pid}", timeout)
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()


def test_torchft_heals_a_dead_replica_group_on_a_mixed_vendor_world(tmp_path):
    """torchft's Manager over ProcessGroupVcga: replica 0 on sim-nccl, replica 1 on sim-hccl. Replica
    1 crashes mid-training; replica 0 trains on alone (the job is not restarted); a new replica 1
    process joins, torchft heals it from replica 0, and both end bitwise identical. Each replica is
    a process of its own, forked from the rank server (:class:`_Replica`)."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    script = str(SCRIPTS / "torchft_replica.py")
    addr = lighthouse.address()
    go = tmp_path / "go"
    procs: list[_Replica] = []

    def start(role: str, replica: str, backend: str, *extra: str) -> _Replica:
        p = _Replica(script, [role, replica, addr, str(tmp_path / f"{role}.json"), *extra],
                     {"VCGA_BACKEND": backend}, tmp_path / f"{role}.log")
        procs.append(p)
        return p

    try:
        alone = tmp_path / "alone"
        survivor = start("survivor", "0", "sim-nccl", str(alone))
        victim = start("victim", "1", "sim-hccl")
        rejoiner = start("rejoiner", "1", "sim-hccl", str(go))  # imports now, joins when told
        assert victim.wait(timeout=180) == 17, (tmp_path / "victim.log").read_text()[-3000:]
        until = time.monotonic() + 120
        while not alone.exists():  # the survivor saw the crash (a quorum of one) and trains on alone
            assert survivor.poll() is None and time.monotonic() < until, (tmp_path / "survivor.log").read_text()[-3000:]
            time.sleep(0.05)
        go.write_text("the victim died and the survivor trains alone")
        assert rejoiner.wait(timeout=180) == 0, (tmp_path / "rejoiner.log").read_text()[-3000:]
        assert survivor.wait(timeout=60) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        lighthouse.shutdown()
    s, r = _read(tmp_path / "survivor.json"), _read(tmp_path / "rejoiner.json")
    assert s["sha256"] == r["sha256"] and s["step"] == r["step"]  # healed: bitwise identical, same step
    assert s["pid"] == survivor.pid  # the survivor is the process started first: the job never restarted
    assert r["healed"] is not None and r["healed"]["step"] > 1  # the rejoiner's first step came from a heal
    assert BRIDGE in s["groups"] and "sim-nccl" in s["groups"]  # mixed quorum, then alone, then mixed again
    assert r["groups"] == [BRIDGE]
