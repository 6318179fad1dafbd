"""The built-in conformance checks, registered through the contract like any plugin's.

===  ======================  ===================================================================
 #   name                    what it proves
===  ======================  ===================================================================
 1   collectives             every collective entry point and every root is exact on this world
 2   exact-reduce            every reduce op is bit-exact on order-independent data; AVG ≤ 2 ulp
 3   random-reduce           random data stays within the Higham bound of a float64 reference
 4   cross-rank-identity     every rank holds the same bits (hashes compared through the store)
 5   dtype-matrix            every claimed capability works; every refusal raises the typed error
 6   layouts                 non-contiguous / offset / aliased buffers: exact, nothing else written
 7   sizes                   0, 1, fewer than ranks, not divisible, large
 8   uneven                  uneven all_to_all with zero splits; v-variants exact or cleanly refused
 9   async                   many outstanding async operations complete correctly
10   faults                  mismatch -> typed error; missing rank -> timeout error, in time
11   send-recv               pairs, ring, tags, batched and any-source point-to-point
12   gradients               DDP gradients within the derived bound of a float64 reference
13   mixed-vendors           the world really mixes vendors, and results cross them exactly
14   compression             every gradient compressor: identical ranks, exact error feedback,
                             unbiased where declared, no more bytes on the wire than declared
===  ======================  ===================================================================

docs/conformance.md explains each check and derives each bound. A vendor adds checks by returning
objects with ``name``, ``description`` and ``run(ctx)`` from the ``vcga_conformance_checks`` hook.
"""

from __future__ import annotations

from typing import Any

from vcga.contract import hookimpl

from .compression import Compression
from .coverage import Collectives, Layouts, Sizes, Uneven
from .mixed import MixedVendors
from .numerics import CrossRankIdentity, DtypeMatrix, ExactReduce, RandomReduce
from .runtime import AsyncOps, Faults, SendRecv
from .training import Gradients

__all__ = ["BUILTIN_CHECKS", "vcga_conformance_checks"]


def _builtin() -> list[Any]:
    return [
        Collectives(),
        ExactReduce(),
        RandomReduce(),
        CrossRankIdentity(),
        DtypeMatrix(),
        Layouts(),
        Sizes(),
        Uneven(),
        AsyncOps(),
        Faults(),
        SendRecv(),
        Gradients(),
        MixedVendors(),
        Compression(),
    ]


#: Built-in checks in their canonical order (the order the profiles list them in).
BUILTIN_CHECKS: tuple[str, ...] = tuple(c.name for c in _builtin())


@hookimpl
def vcga_conformance_checks() -> list[Any]:
    return _builtin()
