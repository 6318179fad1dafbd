"""VCGA's ``DDPStrategy`` for the ``lightning`` package's ``lightning.pytorch`` Trainer.

``import lightning as L; L.Trainer(strategy=DDPStrategy(process_group_backend="vcga",
compression="powersgd:rank=4"))``. For ``pytorch_lightning``: :mod:`vcga.integrations.lightning`.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

from vcga.integrations.lightning._compression import CompressionMixin

__all__ = ["DDPStrategy"]


class DDPStrategy(CompressionMixin, _LightningDDPStrategy):
    __doc__ = CompressionMixin.__doc__
