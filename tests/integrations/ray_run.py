"""Ray Train on backend vcga: TorchTrainer(..., torch_config=TorchConfig(backend="vcga")) on a local
Ray cluster (ray.init(num_cpus=4)), 2 workers, on two simulated vendors (VCGA_SIM_VENDORS through
the run's worker_runtime_env) and, with ``--runs single,mixed``, first on one vendor. Nothing
registers vcga in the workers but torch's ``torch.backends`` autoload of the installed vcga: no
setup hook, no import.

argv: out_dir [--runs single,mixed]. Each worker writes out_dir/<run>-<rank>.json: the weights
after 4 steps of DDP, then after the same steps with vcga's compression hook registered on the
DDP model ``prepare_model`` returned.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")


def train_loop(config: dict) -> None:
    import hashlib
    import json

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from torch import nn

    ctx = ray.train.get_context()

    def train(spec: str | None) -> tuple[str, dict | None]:
        torch.manual_seed(0)
        model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
        state = None
        if spec:  # prepare_model hands back torch's DDP: vcga's compression hook goes on it as on any
            from vcga.compress import ddp_hook

            state, hook = ddp_hook(spec)
            model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(10 + ctx.get_world_rank())  # each worker its own data
        for _ in range(4):
            opt.zero_grad()
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        described = state.describe() if state is not None else None
        if state is not None:
            state.close()
        return digest, described

    digest, _ = train(None)
    compressed, state = train(config.get("compression"))
    with open(os.path.join(config["out"], f"{config['run']}-{ctx.get_world_rank()}.json"), "w") as f:
        json.dump({"sha256": digest, "backend": dist.get_backend(), "transport": dist.group.WORLD.transport.backend_name,
                   "world": dist.get_world_size(), "compressed_sha256": compressed, "compression": state}, f)


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = sys.argv[1]
    runs = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[2] == "--runs" else ["mixed"]
    envs = {"single": {}, "mixed": {"VCGA_SIM_VENDORS": "nccl:1,hccl:1"}}
    # The raylet starts no idle workers ahead of demand (by default it starts one per CPU when the
    # driver connects: an interpreter each that no task of this job uses, as the workers Ray
    # Train asks for are actors); read by the raylet that ray.init starts, from this environment.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        for run in runs:
            env = envs[run]
            trainer = TorchTrainer(
                train_loop, train_loop_config={"out": out, "run": run, "compression": "powersgd:rank=2,min_rate=0"},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                torch_config=TorchConfig(backend="vcga"),
                run_config=RunConfig(name=f"vcga-{run}", storage_path=os.path.join(out, "ray"),
                                     worker_runtime_env={"env_vars": env}))
            trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
