"""Checksummed distributed checkpoints that survive a lost rank (docs/checkpoint.md).

::

    import vcga.checkpoint as ckpt

    step = ckpt.load_latest(state, "ckpt/") or 0       # resume (resharded if the world changed)
    ...
    ckpt.async_save(state, "ckpt/", step=step)          # or ckpt.save(...): collective

- :func:`save` / :func:`async_save` write ``root/step-<N>/`` through torch.distributed.checkpoint
  with VCGA's storage: per-rank vendor-bin shards (a checksum per tensor), DCP's metadata, a
  manifest, and ``root/latest`` written last, atomically, once every rank's file is durable.
- :func:`load_latest` loads the newest complete checkpoint in place, verifying every byte it
  reads, and falls back to the previous one when the newest is damaged.
- :mod:`vcga.checkpoint.directory` reads DCP directories (torch's layout and VCGA's) for
  ``vcga convert`` / ``vcga inspect``; :mod:`vcga.checkpoint.dcpmeta` unpickles DCP metadata with
  an allow-list. Those two never import torch; importing this package does not either -- the
  verbs load torch on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["save", "async_save", "load_latest", "wait", "wait_staged", "latest_step", "SaveFuture"]


def __getattr__(name: str) -> Any:  # the verbs import torch: load them on first use
    if name in __all__:
        from vcga.checkpoint import api

        return getattr(api, name)
    raise AttributeError(f"module 'vcga.checkpoint' has no attribute {name!r}")
