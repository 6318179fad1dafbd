"""VCGA inside the frameworks people train with (docs/integrations.md).

Most need nothing from VCGA but the backend name, which torch's ``torch.backends`` autoload
registers in every process where vcga is installed:

- PyTorch Lightning: ``DDPStrategy(process_group_backend="vcga")``, ``FSDPStrategy(process_group_backend="vcga")``;
- Ray Train: ``TorchTrainer(..., torch_config=TorchConfig(backend="vcga"))``.

Three adapters, each in its own module (importing it imports that framework, which is never a
dependency of vcga):

- :mod:`vcga.integrations.accelerate`: Hugging Face Accelerate forces gloo on CPU and reports
  gloo even when the group is vcga, and its DDP comm hooks are torch's four;
  :func:`~vcga.integrations.accelerate.accelerator` makes the ``vcga`` group and an ``Accelerator``
  that says so, and takes a ``compression`` spec;
- :mod:`vcga.integrations.lightning`: Lightning registers a DDP communication hook on CUDA only;
  its :class:`~vcga.integrations.lightning.DDPStrategy` takes a ``compression`` spec and registers
  :func:`vcga.compress.ddp_hook` on any device (``pytorch_lightning``; for ``lightning.pytorch``,
  :class:`vcga.integrations.lightning.pytorch.DDPStrategy`);
- :mod:`vcga.integrations.torchft`: torchft's reconfigurable process groups exist for NCCL and gloo
  only; :class:`~vcga.integrations.torchft.ProcessGroupVcga` is the same for ``vcga``.
"""
