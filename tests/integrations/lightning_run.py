"""PyTorch Lightning on backend vcga: DDPStrategy, VCGA's DDPStrategy with compression, then
FSDP, in one 2-process CPU job; several runs (package and vendor set) one after another in it.

FSDP on CPU: Lightning's FSDPStrategy wraps FSDP1, which torch 2.13 refuses without an
accelerator ("FSDP needs a non-CPU accelerator device"), and Lightning refuses FSDPStrategy with
accelerator="cpu" anyway. So FSDP here is Lightning's ModelParallelStrategy with fully_shard (FSDP2)
on a data-parallel mesh of both ranks -- the same process_group_backend="vcga" plumbing.

argv: out_dir [RUN ...], RUN = PACKAGE:VENDORS (default ``pytorch_lightning:one-vendor``).
PACKAGE ``pytorch_lightning`` trains with the three strategies; ``lightning.pytorch`` (the Trainer
of Lightning's other package) with VCGA's DDPStrategy for it (vcga.integrations.lightning.pytorch)
only. VENDORS ``one-vendor`` or ``mixed`` (VCGA_SIM_VENDORS=nccl:1,hccl:1: a mixed-vendor job).

The first Trainer's launcher starts rank 1 (it re-runs this script with the same argv, so both
ranks make the same runs in the same order). Lightning keeps the process group it created for
the next Trainer; between runs each rank destroys it, as a script does to change its backend's
configuration, and the next Trainer creates a new one. Each rank writes
out_dir/<PACKAGE>-<VENDORS>/<package>.<strategy>-<rank>.json with the sha256 of its full weights
after training and what its process group was.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from vcga.testing import free_port

warnings.filterwarnings("ignore")

MIXED = "nccl:1,hccl:1"


def model_class(pl):  # one LightningModule class per Lightning package
    ModelParallelStrategy = pl.strategies.ModelParallelStrategy

    class Model(pl.LightningModule):
        def __init__(self, out: str) -> None:
            super().__init__()
            self.out = out
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

        def configure_model(self) -> None:
            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8)  # Lightning adds a DistributedSampler

        def on_train_start(self) -> None:
            self._start = self._digest()

        def _digest(self) -> str:
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.net.parameters()]
            return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in full)).hexdigest()

        def on_train_end(self) -> None:
            digest = self._digest()  # FSDP: every rank gathers the full weights (DTensor.full_tensor)
            pg = dist.group.WORLD
            strategy = self.trainer.strategy
            state = getattr(strategy, "compression_state", None)
            name = f"{type(strategy).__module__.split('.')[0]}.{type(strategy).__name__}"
            with open(os.path.join(self.out, f"{name}-{self.global_rank}.json"), "w") as f:
                json.dump({"sha256": digest, "start_sha256": self._start, "backend": dist.get_backend(),
                           "transport": pg.transport.backend_name, "world": dist.get_world_size(),
                           "steps": self.trainer.global_step, "trainer_package": pl.__name__,
                           "compression": state.describe() if state is not None else None}, f)

    return Model


def fit(pl, model, strategy) -> None:
    torch.manual_seed(1234)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)


def run(package: str, vendors: str, out: str) -> None:
    if vendors not in ("one-vendor", "mixed"):
        raise SystemExit(f"vendors must be one-vendor or mixed, not {vendors!r}")
    if dist.is_initialized():  # the previous run's group: this run's vendors make a new one
        # on a port of its own, which rank 0 picks and tells rank 1 over the old group: on the old
        # port the new group's start hangs, with backend gloo as with vcga (the first group's
        # TCP store, still referenced, keeps serving it)
        port = [free_port() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(port, src=0)
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port[0])
    os.environ.pop("VCGA_SIM_VENDORS", None)
    if vendors == "mixed":
        os.environ["VCGA_SIM_VENDORS"] = MIXED
    os.makedirs(out, exist_ok=True)
    pl = importlib.import_module(package)
    Model = model_class(pl)
    if package == "lightning.pytorch":
        from vcga.integrations.lightning.pytorch import DDPStrategy as ForLightning

        fit(pl, Model(out), ForLightning(process_group_backend="vcga"))
        return
    from vcga.integrations.lightning import DDPStrategy as CompressedDDPStrategy

    fit(pl, Model(out), pl.strategies.DDPStrategy(process_group_backend="vcga"))
    # Lightning's own DDPStrategy registers a comm hook only on CUDA; VCGA's registers its
    # compression hook on any device (here the CPU)
    fit(pl, Model(out), CompressedDDPStrategy(process_group_backend="vcga"))  # the configured compression: VCGA_COMPRESSION
    fit(pl, Model(out), pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                            process_group_backend="vcga"))


if __name__ == "__main__":
    for item in sys.argv[2:] or ["pytorch_lightning:one-vendor"]:
        package, _, vendors = item.partition(":")
        vendors = vendors or "one-vendor"
        run(package, vendors, os.path.join(sys.argv[1], f"{package}-{vendors}"))
