"""Capability-aware dispatch: every collective goes native, emulated or refused -- never wrong.

Before each call the dispatcher looks up (collective, dtype, reduce op) in the transport's
:class:`~vcga.contract.CapabilityTable`:

- **native**: the transport's group runs it (tensors made contiguous first where needed);
- **emulated**: the cell's recipe (``via``, one of :data:`vcga.contract.EMULATIONS`) rewrites the
  call into another call -- a different op, dtype or collective -- which is dispatched again
  (so ``bool SUM`` can become ``bool MAX`` which can become ``uint8 MAX``), plus local steps that
  run before the native call (scale, cast) or after it completes (divide, cast back, reduce);
- **refused**: :class:`~vcga.errors.VcgaUnsupportedError` naming backend, collective, dtype, op,
  the library's reason and what to do, raised before any rank touches the network. Every rank holds
  the same table, so every rank refuses the same call.

Each recipe issues exactly one native call, so an emulated collective is one native work plus
completion steps (:class:`Steps`); the process group wraps them in a :class:`vcga.pypg.PyWork`.
The error bound of every recipe is in ``docs/emulation.md``.

The lookups live here; the recipes, the calls that move data or go point to point, and the
refusals in :mod:`vcga.pg.recipes`, loaded at the first call that needs one: a job whose calls
all take the process group's native fast path never reads them.

The entry points take *canonical* arguments (one tensor, or plain lists); the process group
(:mod:`vcga.process_group`) maps torch's many variants (``_coalesced``, ``_base``, list forms) onto
them and takes the native fast path itself when the cell is native and nothing needs staging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vcga import dtypes as _dtypes
from vcga.contract import Cell, Collective, ReduceOp, Support
from vcga.errors import VcgaUnsupportedError
from vcga.pg.transport import Transport

__all__ = ["Steps", "Dispatcher"]


class Steps:
    """What one collective turned into: native works to wait for, then local steps to run."""

    __slots__ = ("works", "finish", "source")

    def __init__(self) -> None:
        self.works: list[Any] = []
        self.finish: list[Callable[[], Any]] = []
        #: for a receive from any source: the native work that knows the sender
        self.source: Any = None


class Dispatcher:
    """Routes canonical collective calls through one transport's capability table.

    :param transport: what moves the bytes (:mod:`vcga.pg.transport`).
    :param rank: this process's rank in the group.
    :param size: the group size.
    """

    def __init__(self, transport: Transport, rank: int, size: int) -> None:
        self.transport = transport
        self.group = transport.group
        self.table = transport.table
        self.backend = transport.backend_name
        self.rank = rank
        self.size = size
        self._cells: dict[tuple[Collective, torch.dtype, ReduceOp | None], Cell] = {}
        #: what an empty point-to-point message travels as (:func:`vcga.pg.recipes.p2p_unit`,
        #: worked out from the table at the first empty message)
        self.p2p_unit: torch.dtype | None = None
        self.p2p_unit_known = False

    def cell(self, coll: Collective, dtype: torch.dtype, op: ReduceOp | None = None) -> Cell:
        """The capability cell for one call (cached per (collective, dtype, op))."""
        key = (coll, dtype, op if coll.reduces else None)
        cell = self._cells.get(key)
        if cell is None:
            try:
                name = _dtypes.from_torch(dtype)
            except _dtypes.UnknownDTypeError:
                cell = Cell(Support.REFUSED, note=f"VCGA has no canonical name for {dtype}")
            else:
                cell = self.table.lookup(coll, name, key[2])
            self._cells[key] = cell
        return cell

    def is_native(self, coll: Collective, dtype: torch.dtype, op: ReduceOp | None = None) -> bool:
        return self.cell(coll, dtype, op).support is Support.NATIVE

    def refuse(self, coll: Collective, dtype: torch.dtype, op: ReduceOp | None, reason: str) -> VcgaUnsupportedError:
        """The typed error for a refused cell, with a hint built from the table."""
        from vcga.pg import recipes

        return recipes.refuse(self, coll, dtype, op, reason)

    # ===========================================================================================
    # The calls (canonical arguments; each one native, emulated or refused: vcga.pg.recipes)
    # ===========================================================================================

    def all_reduce(self, t: torch.Tensor, op: ReduceOp, factor: Any, like: Any, steps: Steps, depth: int = 0) -> None:
        """All-reduce ``t`` in place."""
        from vcga.pg import recipes

        recipes.all_reduce(self, t, op, factor, like, steps, depth)

    def reduce(self, t: torch.Tensor, root: int, op: ReduceOp, factor: Any, like: Any, steps: Steps,
               depth: int = 0) -> None:
        """Reduce ``t`` into ``t`` on ``root``; other ranks' ``t`` is left unchanged (as NCCL does;
        gloo alone would leave partial sums there)."""
        from vcga.pg import recipes

        recipes.reduce(self, t, root, op, factor, like, steps, depth)

    def reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, factor: Any, like: Any,
                       steps: Steps, depth: int = 0) -> None:
        """Reduce ``ins[j]`` of every rank into ``out`` of rank ``j``."""
        from vcga.pg import recipes

        recipes.reduce_scatter(self, out, ins, op, factor, like, steps, depth)

    def broadcast(self, t: torch.Tensor, root: int, like: Any, steps: Steps, depth: int = 0) -> None:
        from vcga.pg import recipes

        recipes.broadcast(self, t, root, like, steps, depth)

    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor, like: Any, steps: Steps, depth: int = 0) -> None:
        from vcga.pg import recipes

        recipes.all_gather(self, outs, inp, like, steps, depth)

    def gather(self, outs: list[torch.Tensor], inp: torch.Tensor, root: int, like: Any, steps: Steps,
               depth: int = 0) -> None:
        """``outs`` has one tensor per rank on ``root`` and is empty elsewhere."""
        from vcga.pg import recipes

        recipes.gather(self, outs, inp, root, like, steps, depth)

    def scatter(self, out: torch.Tensor, ins: list[torch.Tensor], root: int, like: Any, steps: Steps,
                depth: int = 0) -> None:
        """``ins`` has one tensor per rank on ``root`` and is empty elsewhere."""
        from vcga.pg import recipes

        recipes.scatter(self, out, ins, root, like, steps, depth)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   like: Any, steps: Steps, depth: int = 0) -> None:
        """``all_to_all_single``: split ``inp`` along dim 0 by ``in_splits`` (equal when empty)."""
        from vcga.pg import recipes

        recipes.all_to_all(self, out, inp, out_splits, in_splits, like, steps, depth)

    def send(self, t: torch.Tensor, dst: int, tag: int, steps: Steps, depth: int = 0) -> None:
        from vcga.pg import recipes

        recipes.send(self, t, dst, tag, steps, depth)

    def recv(self, t: torch.Tensor, src: int | None, tag: int, steps: Steps, depth: int = 0) -> None:
        """Receive into ``t`` from ``src`` (None: from any source; ``steps.source`` then tells who)."""
        from vcga.pg import recipes

        recipes.recv(self, t, src, tag, steps, depth)
