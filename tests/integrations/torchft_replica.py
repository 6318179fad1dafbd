"""One torchft replica group (one process) training on backend vcga; run by tests/test_integrations.py.

argv: role replica_id lighthouse_addr out_json [signal_file], role one of survivor, victim, rejoiner
(the survivor creates signal_file when it trains alone; the rejoiner imports everything, then
waits for its signal_file -- the test writes it once the survivor is alone -- before it creates
its Manager: were it to join before the survivor saw the crash, the survivor could never tell the
crash happened)

Trains a small model with torchft's DDP and OptimizerWrapper under a Manager whose process group is
vcga.integrations.torchft.ProcessGroupVcga (this replica's vendor: VCGA_BACKEND). The victim exits
hard (os._exit, no cleanup) after DIE_AFTER steps trained together with the survivor, as a crashed
replica group. The survivor trains on: together, alone, and together again once the rejoiner (a
new process with the victim's replica id) joined -- torchft heals the rejoiner in its first
quorum. Both stop JOINT_STEPS steps after that quorum and write their step, the sha256 of their
weights, and (the rejoiner) how long the heal took.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta

T_START = time.monotonic()

import torch  # noqa: E402
from torch import nn, optim  # noqa: E402
from torchft import Manager  # noqa: E402
from torchft.ddp import DistributedDataParallel  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

from vcga.integrations.torchft import ProcessGroupVcga  # noqa: E402

JOINT_STEPS = 3
DIE_AFTER = 3


def main() -> None:
    role, replica_id, lighthouse, out_path = sys.argv[1:5]
    if role == "rejoiner":  # started early so imports are done; joins when the test says the victim died
        go, until = sys.argv[5], time.monotonic() + 150
        while not os.path.exists(go):
            if time.monotonic() > until:
                raise SystemExit("rejoiner: never told to join")
            time.sleep(0.05)
    torch.manual_seed(int(replica_id) + 1)  # replicas start different: the heal must make them equal
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = optim.SGD(model.parameters(), lr=0.05)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupVcga(timeout=timedelta(seconds=20)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica_{replica_id}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, timeout=timedelta(seconds=20),
                      quorum_timeout=timedelta(seconds=60), use_async_quorum=False)
    ddp = DistributedDataParallel(manager, model)
    fopt = OptimizerWrapper(manager, opt)
    t_manager = time.monotonic()
    # phases: "wait" (for a quorum of two), "joint" (training together; the victim crashes here),
    # "alone" (the survivor, after the crash), "healed" (together again: the rejoiner from its first
    # quorum of two, where torchft loads the survivor's weights into it)
    phase = "wait"
    joint_steps = 0
    heal_from = None
    healed_s = None
    first_commit = True
    last_commit = time.monotonic()
    longest_gap = 0.0
    backends = set()
    gen = torch.Generator().manual_seed(100 + int(replica_id))
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        fopt.zero_grad()  # the quorum (a replica that is behind is healed here: it loads the weights)
        before = manager.current_step()
        n = manager.num_participants()
        backends.add(manager._pg._pg.transport.backend_name)  # this quorum's vcga group
        if phase == "wait" and n == 2:
            phase = "healed" if role == "rejoiner" else "joint"
            heal_from = manager.current_step() if phase == "healed" else None
        elif phase == "joint" and n == 1:
            phase = "alone"
            if len(sys.argv) > 5:
                open(sys.argv[5], "w").close()
        elif phase == "alone" and n == 2:
            phase, heal_from = "healed", manager.current_step()
        x = torch.randn(16, 8, generator=gen)
        ddp(x).pow(2).mean().backward()
        fopt.step()  # applies the step only when every participant's allreduce succeeded (should_commit)
        committed = manager.current_step() > before
        now = time.monotonic()
        if committed:
            longest_gap, last_commit = max(longest_gap, now - last_commit), now
            if role == "rejoiner" and first_commit and phase == "healed":
                healed_s = {"from_manager": now - t_manager, "from_start": now - T_START, "step": manager.current_step()}
            first_commit = False
        if phase == "joint" and committed:
            joint_steps += 1
            if role == "victim" and joint_steps >= DIE_AFTER:
                os._exit(17)  # a crash: no cleanup, no goodbye to the lighthouse or the peers
        if phase == "healed" and committed and manager.current_step() >= heal_from + JOINT_STEPS:
            break
        if phase in ("wait", "alone"):
            time.sleep(0.02)  # pace the steps alone: the test only needs the replica to keep training
    else:
        raise SystemExit(f"replica {replica_id}: still in phase {phase} after 150 s")
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    with open(out_path, "w") as f:
        json.dump({"replica": replica_id, "step": manager.current_step(), "sha256": digest, "healed": healed_s,
                   "heal_from": heal_from, "longest_gap_s": longest_gap, "pid": os.getpid(),
                   "groups": sorted(backends), "backend": os.environ.get("VCGA_BACKEND")}, f)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
