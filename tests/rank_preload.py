"""Imported once by each test worker's rank server (tests/conftest.py: vcga.spawn.add_preload):
what the ranks of many tests would otherwise each do after they start.

- ``torch._dynamo``: DDP's constructor imports it, about 1 CPU-s in every rank that builds a DDP
  model; ``torch.distributed.checkpoint`` for the checkpoint worlds.
- What the suite's other worlds import: pipelining, Lightning (about 0.8 CPU-s), VCGA's
  checkpoint, compression-hook and balancer modules. Here, not in a world's own ``preload``: a
  server is started again for a module name it was not started with (about 3.5 CPU-s), and it
  was, once per worker, for each of those worlds.
- The compressors' fused host loops (numba), compiled -- or loaded from numba's cache -- and
  self-checked against the torch operations once, here, instead of in every rank that compresses
  (:mod:`vcga.compress.preload` for VCGA's own; the compressor plugins' loops below; with a cold
  cache, each rank would wait for the machine's one compile, then load it). A rank keeps the verdict the server reached
  on this machine, as a process does after its first check.

The server dies on an exception other than ImportError from a preloaded module, and then no rank
can start: so nothing here raises. Nothing here starts a thread or touches a device.
"""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo
import torch.distributed.checkpoint
import torch.distributed.pipelining

import vcga.balance.balancer
import vcga.checkpoint.api
import vcga.compress.hook
import vcga.process_group

with contextlib.suppress(ImportError):  # a test extra: without it, its tests skip
    import pytorch_lightning  # noqa: F401

_threads = torch.get_num_threads()
torch.set_num_threads(1)  # the self-checks' small ops must not start an OpenMP team that forked ranks inherit dead
try:
    with contextlib.suppress(Exception):  # no numba, or one that cannot compile here: each rank checks for itself
        import vcga.compress.preload  # noqa: F401 - VCGA's own loops, on import
        from vcga.plugins import compressors
        from vcga.plugins.compressors import qsgd

        compressors._select_loop()
        qsgd._loops()
finally:
    torch.set_num_threads(_threads)
