"""Imported by a rank server before it forks ranks that compress (``vcga.spawn.get_context``'s
``preload``; ``vcga verify``'s compression check names it): numba, and the fused host loops of
:mod:`vcga.compress.fused` compiled -- or loaded from numba's cache -- and self-checked once, in
the server, instead of in every rank (about 0.7 CPU-s a rank here). A forked rank keeps the verdict
the server reached on this machine, as a process does after its first check.

A rank server dies on an exception other than ImportError from a preloaded module, and then no
rank can start: so nothing here raises (without numba, or where it cannot compile, each rank
checks for itself). Nothing here starts a thread or touches a device: the self-checks run with
one intra-op thread, so the server starts no OpenMP team that forked ranks would inherit dead.
"""

from __future__ import annotations

import contextlib


def _warm() -> None:
    import torch

    from vcga.compress import fused

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.suppress(Exception):
            fused.kernels()
            fused.factored()
    finally:
        torch.set_num_threads(threads)


_warm()
