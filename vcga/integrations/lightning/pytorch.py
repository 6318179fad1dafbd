"""VCGA's ``DDPStrategy`` and ``Balance`` callback for the ``lightning`` package's ``lightning.pytorch`` Trainer.

``import lightning as L; L.Trainer(strategy=DDPStrategy(process_group_backend="vcga",
compression="powersgd:rank=4"))``. For ``pytorch_lightning``: :mod:`vcga.integrations.lightning`.
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

from vcga.integrations.lightning._balance import balance_callback
from vcga.integrations.lightning._compression import CompressionMixin

__all__ = ["DDPStrategy", "Balance"]


class DDPStrategy(CompressionMixin, _LightningDDPStrategy):
    __doc__ = CompressionMixin.__doc__


Balance = balance_callback(Callback, "vcga.integrations.lightning.pytorch")
