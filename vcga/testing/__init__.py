"""Tools for testing VCGA and plugins built on it: a small local world of rank processes, and a
free port for a rendezvous. Part of the public API (:data:`vcga.contract.PUBLIC_API`): a plugin's
own tests may use them (docs/plugins.md, "Testing a plugin"; docs/testing.md).

::

    from vcga.testing import run_world

    def rank_main(rank, world_size, init_method, size):   # module level: the ranks unpickle it
        import torch, torch.distributed as dist
        dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size)
        x = torch.full((size,), float(rank))
        dist.all_reduce(x)
        dist.destroy_process_group()
        return x[0].item()

    assert run_world(rank_main, 2, 16) == [1.0, 1.0]      # every rank's return value, in rank order

The submodules load only when named: :mod:`vcga.testing.fault` (fault injection by configuration,
which the library calls) and :mod:`vcga.testing.multinode` (several nodes on one machine, for the
multi-node tests and benchmarks; docs/multinode.md). This package imports :mod:`vcga.spawn` and the
standard library only, so it is cheap to import.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vcga import spawn
from vcga.spawn import RanksFailed, free_port

__all__ = ["run_world", "free_port", "WorldFailed", "WORLD_ENV"]

#: What every rank of :func:`run_world` has in its environment unless ``env`` says otherwise: no
#: entry-point plugins (the built-in backends and what ``VCGA_PLUGINS`` names, not whatever else
#: is installed), and a collective timeout of a minute, so a desynchronised test fails instead of
#: hanging.
WORLD_ENV = {"VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "VCGA_TIMEOUT": "60"}


class WorldFailed(RanksFailed, AssertionError):
    """A rank of :func:`run_world` failed; the message carries each failed rank's traceback. An
    AssertionError too: in a test it reads as the test's failure."""


def run_world(target: Callable[..., Any], world_size: int, *args: Any, env: Mapping[str, str] | None = None,
              timeout: float = 240.0, preload: Sequence[str] = ()) -> list[Any]:
    """Run ``target(rank, world_size, init_method, *args)`` on ``world_size`` rank processes and
    return their return values in rank order (:func:`vcga.spawn.run_world`); ``init_method`` is a
    fresh ``tcp://127.0.0.1:PORT``.

    The ranks are forked from the server of :func:`vcga.spawn.get_context`, which has imported
    torch (and the modules ``preload`` names, e.g. ``torch.distributed.checkpoint``): a rank starts
    in a fraction of a second. Each has :data:`WORLD_ENV`, then ``env``, in its environment, and a
    link-figure cache of the world's own (``VCGA_BRIDGE_FIGURES_CACHE``, removed after): a mixed
    world measures its links as a first start does, and nothing is written to the user's cache.
    ``target`` and ``args`` must be picklable (``target`` a module-level function).

    :raises WorldFailed: a rank raised (its traceback is in the message), died without reporting,
        or had not finished after ``timeout`` seconds; leftover ranks are killed, so a hang in the
        code under test fails the test instead of hanging it."""
    with tempfile.TemporaryDirectory(prefix="vcga-test-figures-") as figcache:
        try:
            return spawn.run_world(target, world_size, *args, timeout=timeout, preload=preload,
                                   env={**WORLD_ENV, "VCGA_BRIDGE_FIGURES_CACHE": figcache, **(env or {})})
        except RanksFailed as e:
            raise WorldFailed(str(e)) from None
