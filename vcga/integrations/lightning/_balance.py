"""The balancer in a Lightning Trainer (:class:`Balance`, one class per Lightning package).

Lightning gives every rank a ``DistributedSampler`` (equal shares) unless told not to; the
callback takes its place with the balancer's batch sampler, and applies the loss scale, so the
LightningModule keeps returning the usual mean over its batch::

    balancer = Balancer(len(ds), global_batch=384, shares={"nccl": 2, "hccl": 1})
    trainer = Trainer(..., use_distributed_sampler=False, callbacks=[Balance(balancer)])
    # the module's train_dataloader(): DataLoader(ds, batch_sampler=balancer.batch_sampler())

- the loss scale: a gradient hook on the loss Lightning is about to differentiate multiplies the
  gradient that starts backward by ``loss_scale * len(batch)`` (``loss="mean"``: the module
  returns the mean over this rank's batch) or by ``loss_scale`` (``loss="sum"``); the loss value
  Lightning logs is left alone. ``loss=None``: the module scales its loss itself.
- measurement: each training batch from ``on_train_batch_start`` to the rank's last gradient
  (:meth:`vcga.balance.Balancer.measure`), so ``shares="auto"`` works;
- ``set_epoch``: Lightning calls it on the loader's ``batch_sampler.sampler``, the balancer;
- the balancer's position rides in Lightning's checkpoints as this callback's state.

Lightning's ``accumulate_grad_batches`` takes the same number of batches on every rank and divides
the loss by it, which keeps the mean exact; a per-vendor micro-batch cap, which needs a different
number of micro-steps per rank, is for loops that call :meth:`~vcga.balance.Balancer.accumulate`.
"""

from __future__ import annotations

from typing import Any

from vcga.errors import VcgaConfigError

__all__ = ["balance_callback"]

_LOSS = ("mean", "sum", None)


def balance_callback(base: type, module: str) -> type:
    """The ``Balance`` callback class on ``base`` (the Lightning package's ``Callback``)."""

    class Balance(base):
        """Run a Trainer with a :class:`vcga.balance.Balancer` (see :mod:`vcga.integrations.lightning._balance`).

        :param balancer: the balancer whose ``batch_sampler()`` the training loader uses.
        :param loss: what ``training_step`` returns: ``"mean"`` over the rank's batch (default),
            ``"sum"``, or None (the module applies ``balancer.loss_scale`` itself).
        """

        def __init__(self, balancer: Any, loss: str | None = "mean") -> None:
            super().__init__()
            if loss not in _LOSS:
                raise VcgaConfigError("loss", loss, '"mean" (the module returns the mean over its batch), '
                                      '"sum", or None (it scales the loss itself)', "vcga Balance callback")
            self.balancer, self.loss = balancer, loss
            self._scale: float | None = None
            self._measure: Any = None

        @property
        def state_key(self) -> str:
            return "vcga.Balance"

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
                raise VcgaConfigError("use_distributed_sampler", True, "False with vcga's Balance callback: "
                                      "Lightning's DistributedSampler would give every rank an equal share; "
                                      "Trainer(use_distributed_sampler=False) and DataLoader(ds, "
                                      "batch_sampler=balancer.batch_sampler())", "Trainer")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            from vcga.balance.balancer import samples_in

            samples = samples_in(batch)
            if samples is None:
                raise VcgaConfigError("batch", type(batch).__name__, "tensors whose first dimension is the "
                                      "samples (the callback scales the loss by the batch's length)",
                                      "vcga Balance callback")
            self._scale = self.balancer.loss_scale * (samples if self.loss == "mean" else 1)
            self._measure = self.balancer.measure(pl_module, samples)
            self._measure.__enter__()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self.loss is not None and self._scale is not None:
                scale = self._scale
                loss.register_hook(lambda g: g * scale)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self._measure is not None:
                self._measure.__exit__(None, None, None)
                self._measure, self._scale = None, None

        def state_dict(self) -> dict[str, Any]:
            return self.balancer.state_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.balancer.load_state_dict(state_dict)

    Balance.__module__ = module  # where users import it from (and pickle finds it)
    Balance.__qualname__ = "Balance"
    return Balance
