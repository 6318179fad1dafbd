"""What VCGA adds to Lightning's ``DDPStrategy``, for either of Lightning's two packages.

Lightning takes a DDP communication hook (``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``)
but registers it only when the root device is CUDA (2.6, ``DDPStrategy._register_ddp_hooks``): on
CPU, on an Ascend NPU or a Cambricon MLU the hook is dropped without a word. And the state of
:func:`vcga.compress.ddp_hook` can only be made once the process group exists (it gathers the
layout and creates the island and peer groups), after the strategy has been constructed.

:class:`CompressionMixin` goes before Lightning's ``DDPStrategy`` in a strategy's bases (one
class per package: :mod:`vcga.integrations.lightning`, :mod:`vcga.integrations.lightning.pytorch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vcga.errors import VcgaConfigError

if TYPE_CHECKING:
    from vcga.compress import CompressionSpec

__all__ = ["CompressionMixin"]


class CompressionMixin:
    """Lightning's ``DDPStrategy`` with one more argument, ``compression``: it makes
    :func:`vcga.compress.ddp_hook` when Lightning wraps the model in DDP, on every rank and any
    device, and registers it. ``strategy.compression_state`` is the hook's state (``stats``,
    ``describe()``). Everything else is Lightning's.

    :param compression: a compression spec (docs/compression.md), or None for the configured one
        (``compression`` / ``VCGA_COMPRESSION``; plain DDP when that is unset).
    :raises vcga.errors.VcgaConfigError: a bad spec (when the model is wrapped), or ``compression``
        given together with Lightning's own ``ddp_comm_hook`` (DDP takes one hook).
    """

    _ddp_comm_hook: Any
    model: Any

    def __init__(self, *args: Any, compression: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if compression is not None and self._ddp_comm_hook is not None:
            raise VcgaConfigError("compression", compression, "no ddp_comm_hook beside it: DDP takes one "
                                  "communication hook; drop ddp_comm_hook, or compression to use yours")
        self._compression = compression
        self.compression_state: Any = None

    def _register_ddp_hooks(self) -> None:
        spec: str | CompressionSpec | None = self._compression
        if spec is None and self._ddp_comm_hook is None:
            from vcga.compress import configured_spec

            configured = configured_spec()
            spec = configured if configured.enabled else None
        if spec is None:
            super()._register_ddp_hooks()  # type: ignore[misc]
            return
        from vcga.compress import ddp_hook

        self.compression_state, hook = ddp_hook(spec)
        self.model.register_comm_hook(self.compression_state, hook)

    def teardown(self) -> None:
        if self.compression_state is not None:
            self.compression_state.close()  # its worker thread and meter; the groups go with the default group
        super().teardown()  # type: ignore[misc]
