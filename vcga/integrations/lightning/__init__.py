"""PyTorch Lightning's ``DDPStrategy`` with VCGA's gradient compression, on any device.

Lightning ships in two packages, ``pytorch_lightning`` and ``lightning`` (``lightning.pytorch``),
and each Trainer takes only strategies of its own package. The mapping is Lightning's own:

- ``pytorch_lightning`` -> ``from vcga.integrations.lightning import DDPStrategy``;
- ``lightning.pytorch`` -> ``from vcga.integrations.lightning.pytorch import DDPStrategy``.

Either is Lightning's ``DDPStrategy`` with one more argument, ``compression`` (a spec such as
``"powersgd:rank=4"``; None: the configured ``compression`` / ``VCGA_COMPRESSION``, and nothing
when that is unset). Lightning registers a DDP communication hook only on CUDA; these register
:func:`vcga.compress.ddp_hook` on every device (:mod:`vcga.integrations.lightning._compression`).
``Balance`` (the same two ways) runs a Trainer with a :class:`vcga.balance.Balancer`: shares
per rank by speed, the loss scale applied for the module (:mod:`vcga.integrations.lightning._balance`).

Importing this package imports no Lightning; asking for ``DDPStrategy`` or ``Balance`` imports
``pytorch_lightning``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DDPStrategy", "Balance"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # lazily: a lightning.pytorch user may not have pytorch_lightning
        from vcga.integrations.lightning import _pytorch_lightning

        return getattr(_pytorch_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
