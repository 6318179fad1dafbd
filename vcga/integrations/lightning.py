"""PyTorch Lightning's ``DDPStrategy`` with VCGA's gradient compression, on any device.

Lightning takes a DDP communication hook (``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``)
but registers it only when the root device is CUDA (pytorch_lightning 2.6,
``DDPStrategy._register_ddp_hooks``): on CPU, on an Ascend NPU or a Cambricon MLU the hook is
dropped without a word. And the state of :func:`vcga.compress.ddp_hook` can only be made once the
process group exists (it gathers the layout and creates the island and peer groups), after the
strategy has been constructed.

:class:`DDPStrategy` here is Lightning's with one more argument, ``compression`` (a spec such as
``"powersgd:rank=4"``; None: the configured ``compression`` / ``VCGA_COMPRESSION``, and nothing
when that is unset): it makes the hook when Lightning wraps the model in DDP, on every rank and
any device, and registers it. ``strategy.compression_state`` is the hook's state (its ``stats``,
``describe()``). Everything else is Lightning's.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import DDPStrategy as _LightningDDPStrategy

from vcga.errors import VcgaConfigError

__all__ = ["DDPStrategy"]


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` that reduces gradients through :func:`vcga.compress.ddp_hook`.

    :param compression: a compression spec (docs/compression.md), or None for the configured one.
    :raises vcga.errors.VcgaConfigError: a bad spec (when the model is wrapped), or ``compression``
        given together with Lightning's own ``ddp_comm_hook`` (DDP takes one hook).
    """

    def __init__(self, *args: Any, compression: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if compression is not None and self._ddp_comm_hook is not None:
            raise VcgaConfigError("compression", compression, "no ddp_comm_hook beside it: DDP takes one "
                                  "communication hook; drop ddp_comm_hook, or compression to use yours")
        self._compression = compression
        self.compression_state: Any = None

    def _register_ddp_hooks(self) -> None:
        spec = self._compression
        if spec is None and self._ddp_comm_hook is None:
            from vcga.config import load_config

            from vcga.compress import parse_spec

            configured = load_config().compression
            if configured and parse_spec(configured, source="config compression / env VCGA_COMPRESSION").enabled:
                spec = configured
        if spec is None:
            super()._register_ddp_hooks()
            return
        from vcga.compress import ddp_hook

        self.compression_state, hook = ddp_hook(spec)
        self.model.register_comm_hook(self.compression_state, hook)  # type: ignore[union-attr]

    def teardown(self) -> None:
        if self.compression_state is not None:
            self.compression_state.close()  # its worker thread and meter; the groups go with the default group
        super().teardown()
