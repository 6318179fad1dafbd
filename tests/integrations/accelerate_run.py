"""Hugging Face Accelerate on backend vcga, on CPU; run under torchrun (2 processes) by the tests.

argv: out_dir mode -- mode "helper": vcga.integrations.accelerate.accelerator(cpu=True) and a few
training steps, each rank writing out_dir/<rank>.json (weights' sha256, the backend Accelerate
reports, the group's transport; then the same steps with ``compression=``: the hook's states); mode "plain": what Accelerate does by itself when asked for vcga
on CPU (InitProcessGroupKwargs(backend="vcga")), written as the error it raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore")


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode == "plain":
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        try:
            Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="vcga")])
            result = {"error": None}
        except ValueError as e:
            result = {"error": str(e)}
        with open(os.path.join(out_dir, f"plain-{rank}.json"), "w") as f:
            json.dump(result, f)
        return

    from accelerate.state import PartialState

    import vcga
    from vcga.integrations.accelerate import accelerator

    # Accelerate alone, with the vcga group made first (the only way it runs vcga on CPU): it uses
    # the group but reports gloo. accelerator() then builds on the same (singleton) state.
    vcga.init()
    before = PartialState(cpu=True).backend
    acc = accelerator(cpu=True)

    def train(acc: Any) -> tuple[str, int, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        model, opt, loader = acc.prepare(model, opt, loader)  # DDP over the default (vcga) group; sharded loader
        steps = 0
        for x, y in loader:
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            steps += 1
        params = acc.unwrap_model(model).parameters()
        return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest(), steps, model

    digest, steps, _ = train(acc)
    result = {"sha256": digest, "reported_without_helper": before, "steps": steps, "state_backend": acc.state.backend,
              "partial_state_backend": PartialState().backend, "distributed_type": str(acc.distributed_type),
              "num_processes": acc.num_processes, "torch_backend": dist.get_backend(),
              "transport": dist.group.WORLD.transport.backend_name}
    # the same training with vcga's compression, beside a DDP setting of the user's own (kept)
    from accelerate.utils import DistributedDataParallelKwargs

    from vcga.integrations.accelerate import compression_states

    acc = accelerator(cpu=True, compression="powersgd:rank=2,min_rate=0",
                      kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    digest, steps, model = train(acc)
    states = compression_states(acc)
    result["compressed"] = {"sha256": digest, "steps": steps, "states": [s.describe() for s in states],
                            "gradient_as_bucket_view": model.gradient_as_bucket_view}
    for s in states:
        s.close()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
