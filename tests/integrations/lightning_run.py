"""PyTorch Lightning on backend vcga: DDPStrategy, VCGA's DDPStrategy with compression, then
FSDP, in one 2-process CPU job.

FSDP on CPU: Lightning's FSDPStrategy wraps FSDP1, which torch 2.13 refuses without an
accelerator ("FSDP needs a non-CPU accelerator device"), and Lightning refuses FSDPStrategy with
accelerator="cpu" anyway. So FSDP here is Lightning's ModelParallelStrategy with fully_shard (FSDP2)
on a data-parallel mesh of both ranks -- the same process_group_backend="vcga" plumbing.

argv: out_dir [package]. Lightning's own launcher starts rank 1 (it re-runs this script); each rank writes
out_dir/<package>.<strategy>-<rank>.json with the sha256 of its full weights after training and what its
process group was. VCGA_SIM_VENDORS=nccl:1,hccl:1 in the environment makes it a mixed-vendor job.
package "lightning.pytorch" (default "pytorch_lightning"): the Trainer of Lightning's other
package, with VCGA's DDPStrategy for it (vcga.integrations.lightning.pytorch) only.
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

PACKAGE = sys.argv[2] if len(sys.argv) > 2 else "pytorch_lightning"
pl = importlib.import_module(PACKAGE)
DDPStrategy, ModelParallelStrategy = pl.strategies.DDPStrategy, pl.strategies.ModelParallelStrategy

warnings.filterwarnings("ignore")


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
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
        with open(os.path.join(sys.argv[1], f"{name}-{self.global_rank}.json"), "w") as f:
            json.dump({"sha256": digest, "start_sha256": self._start, "backend": dist.get_backend(), "transport": pg.transport.backend_name,
                       "world": dist.get_world_size(), "steps": self.trainer.global_step, "trainer_package": pl.__name__,
                       "compression": state.describe() if state is not None else None}, f)


def fit(strategy) -> None:
    torch.manual_seed(1234)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())


if __name__ == "__main__":
    if PACKAGE == "lightning.pytorch":
        from vcga.integrations.lightning.pytorch import DDPStrategy as CompressedDDPStrategy

        fit(CompressedDDPStrategy(process_group_backend="vcga"))
        sys.exit(0)
    from vcga.integrations.lightning import DDPStrategy as CompressedDDPStrategy

    fit(DDPStrategy(process_group_backend="vcga"))
    # Lightning's own DDPStrategy registers a comm hook only on CUDA; VCGA's registers its
    # compression hook on any device (here the CPU)
    fit(CompressedDDPStrategy(process_group_backend="vcga"))  # the configured compression: VCGA_COMPRESSION
    fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="vcga"))
