"""VCGA's ``DDPStrategy`` for the ``pytorch_lightning`` package (``vcga.integrations.lightning.DDPStrategy``)."""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.strategies import DDPStrategy as _LightningDDPStrategy

from vcga.integrations.lightning._balance import balance_callback
from vcga.integrations.lightning._compression import CompressionMixin

__all__ = ["DDPStrategy", "Balance"]


class DDPStrategy(CompressionMixin, _LightningDDPStrategy):
    __doc__ = CompressionMixin.__doc__
    __module__ = "vcga.integrations.lightning"  # where users import it from (and pickle finds it)


Balance = balance_callback(Callback, "vcga.integrations.lightning")
