"""Balanced data parallelism across ranks of different speeds: every chip pulls its weight (docs/balance.md).

::

    from vcga.balance import Balancer

    balancer = Balancer(len(dataset), global_batch=384, shares="auto")   # or [256, 128], {"nccl": 2, "hccl": 1}
    for indices in balancer:                                             # this rank's part of each global batch
        x, y = dataset[indices]
        with balancer.measure(model):
            loss = loss_fn(model(x), y, reduction="sum") * balancer.loss_scale
            loss.backward()
        optimizer.step(); optimizer.zero_grad()

- :class:`Balancer` -- the global batches, this rank's share, the loss scale, measurement and
  re-balancing, micro-batches, its state for checkpoints;
- :class:`BatchSampler` -- the same for ``DataLoader(dataset, batch_sampler=...)``;
- :func:`split_counts`, :func:`counts_from_weights`, :class:`AutoPolicy` -- the arithmetic behind
  the shares (no torch; ``vcga info --plan --weights`` shows what weights yield).

Importing this package does not import torch; :class:`Balancer` loads it.
"""

from __future__ import annotations

from typing import Any

from vcga.balance.shares import AutoPolicy, Decision, counts_from_weights, parse_weights, split_counts

__all__ = ["Balancer", "BatchSampler", "Step", "AutoPolicy", "Decision", "split_counts", "counts_from_weights",
           "parse_weights"]


def __getattr__(name: str) -> Any:
    if name in ("Balancer", "BatchSampler", "Step"):
        from vcga.balance import balancer

        return getattr(balancer, name)
    raise AttributeError(f"module 'vcga.balance' has no attribute {name!r}")
