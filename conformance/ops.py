"""Collectives as a user calls them: the public ``torch.distributed`` API on the group under test.

Each *form* is one public entry point (``all_reduce``, ``reduce_scatter_single``, ``gather`` ...).
:func:`run_form` calls it on this rank with every rank's input known (the data is generated from
seeds), and returns what this rank received together with what it should have received, expressed
in terms of the inputs -- so the exact checks and the rounding checks share one driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vcga.contract import Collective, ReduceOp

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "FORMS",
    "REDUCING_FORMS",
    "ROOTED_FORMS",
    "SPLIT_INPUT_FORMS",
    "COLLECTIVE_OF",
    "Received",
    "torch_op",
    "input_numel",
    "run_form",
    "p2p",
]

#: Every form, in the order the checks run them.
FORMS: tuple[str, ...] = (
    "all_reduce",
    "reduce",
    "reduce_scatter_single",
    "reduce_scatter",
    "all_gather_single",
    "all_gather",
    "gather",
    "scatter",
    "broadcast",
    "all_to_all_single",
    "all_to_all",
)
REDUCING_FORMS = ("all_reduce", "reduce", "reduce_scatter_single", "reduce_scatter")
ROOTED_FORMS = ("reduce", "gather", "scatter", "broadcast")
#: Forms whose per-rank input holds one block of ``n`` elements per rank.
SPLIT_INPUT_FORMS = ("reduce_scatter_single", "reduce_scatter", "scatter", "all_to_all_single", "all_to_all")

COLLECTIVE_OF: dict[str, Collective] = {
    "all_reduce": Collective.ALL_REDUCE,
    "reduce": Collective.REDUCE,
    "reduce_scatter_single": Collective.REDUCE_SCATTER,
    "reduce_scatter": Collective.REDUCE_SCATTER,
    "all_gather_single": Collective.ALL_GATHER,
    "all_gather": Collective.ALL_GATHER,
    "gather": Collective.GATHER,
    "scatter": Collective.SCATTER,
    "broadcast": Collective.BROADCAST,
    "all_to_all_single": Collective.ALL_TO_ALL,
    "all_to_all": Collective.ALL_TO_ALL,
}

#: The form each capability-table row is checked through (the single-tensor entry points).
FORM_OF: dict[Collective, str] = {
    Collective.ALL_REDUCE: "all_reduce",
    Collective.REDUCE: "reduce",
    Collective.REDUCE_SCATTER: "reduce_scatter_single",
    Collective.ALL_GATHER: "all_gather_single",
    Collective.GATHER: "gather",
    Collective.SCATTER: "scatter",
    Collective.BROADCAST: "broadcast",
    Collective.ALL_TO_ALL: "all_to_all_single",
}


def torch_op(op: ReduceOp | str, premul_factor: float) -> Any:
    """The ``torch.distributed`` reduce op for ``op``.

    PREMUL_SUM exists only as ``torch.distributed._make_nccl_premul_sum(factor)``: the one private
    name the checks use, because torch offers no public spelling of that op."""
    import torch.distributed as dist

    op = ReduceOp(op)
    if op is ReduceOp.PREMUL_SUM:
        return dist._make_nccl_premul_sum(premul_factor)
    return getattr(dist.ReduceOp, op.value)


def p2p(work: dist.Work | None) -> dist.Work:
    """The work of an ``isend``/``irecv``: torch returns None only to a rank outside the group."""
    if work is None:
        raise ValueError("this rank is not in the group of the point-to-point call")
    return work


def input_numel(form: str, n: int, world_size: int) -> int:
    """Elements in one rank's input when each rank contributes or receives blocks of ``n``."""
    return n * world_size if form in SPLIT_INPUT_FORMS else n


@dataclass
class Received:
    """What this rank got from one call and what it should have got.

    :param got: the received elements, flattened in order (None: this rank receives nothing,
        e.g. a non-root rank of ``reduce``).
    :param reduce_slice: for reducing forms, the slice of the element-wise reduction of all ranks'
        inputs that ``got`` must equal.
    :param want: for moving forms, the exact expected elements.
    """

    got: torch.Tensor | None
    reduce_slice: slice | None = None
    want: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        """``got``, of a form that gives this rank a result."""
        if self.got is None:
            raise ValueError("this rank received nothing (a non-root rank of a rooted form)")
        return self.got

    def expected(self) -> torch.Tensor:
        """``want``, of a moving form (a reducing form's expectation is the reduction's ``reduce_slice``)."""
        if self.want is None:
            raise ValueError("a reducing form: its expectation is the reduction over reduce_slice")
        return self.want


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)


def run_form(form: str, inputs: Callable[[int], torch.Tensor], rank: int, world_size: int, n: int, *,
             op: ReduceOp | str | None = None, root: int = 0, group: Any = None,
             premul_factor: float = 0.5, async_op: bool = False) -> Received:
    """Call ``form`` on this rank.

    :param inputs: ``inputs(r)`` is rank ``r``'s input (``input_numel(form, n, world_size)``
        elements, 1-D); called for this rank and, to build expectations, for others.
    :param n: block size: elements per rank of the result (reductions: of the whole result for
        ``all_reduce``/``reduce``).
    :returns: a :class:`Received`; the call has completed (async work is waited on).
    """
    import torch
    import torch.distributed as dist

    x = inputs(rank).clone()
    dt = x.dtype
    rop = torch_op(op, premul_factor) if op is not None else None

    def wait(work: Any) -> None:
        if async_op:
            work.wait()

    if form == "all_reduce":
        wait(dist.all_reduce(x, op=rop, group=group, async_op=async_op))
        return Received(x, reduce_slice=slice(None))
    if form == "reduce":
        wait(dist.reduce(x, dst=root, op=rop, group=group, async_op=async_op))
        return Received(x if rank == root else None, reduce_slice=slice(None))
    if form == "reduce_scatter_single":
        out = torch.empty(n, dtype=dt)
        wait(dist.reduce_scatter_single(out, x, op=rop, group=group, async_op=async_op))
        return Received(out, reduce_slice=slice(rank * n, (rank + 1) * n))
    if form == "reduce_scatter":
        out = torch.empty(n, dtype=dt)
        wait(dist.reduce_scatter(out, list(x.split(n)) if n else [x[:0]] * world_size, op=rop, group=group,
                                 async_op=async_op))
        return Received(out, reduce_slice=slice(rank * n, (rank + 1) * n))
    if form == "all_gather_single":
        out = torch.empty(n * world_size, dtype=dt)
        wait(dist.all_gather_single(out, x, group=group, async_op=async_op))
        return Received(out, want=_flat([inputs(r) for r in range(world_size)]))
    if form == "all_gather":
        outs = [torch.empty(n, dtype=dt) for _ in range(world_size)]
        wait(dist.all_gather(outs, x, group=group, async_op=async_op))
        return Received(_flat(outs), want=_flat([inputs(r) for r in range(world_size)]))
    if form == "gather":
        gathered = [torch.empty(n, dtype=dt) for _ in range(world_size)] if rank == root else None
        wait(dist.gather(x, gathered, dst=root, group=group, async_op=async_op))
        if gathered is None:  # not the root
            return Received(None)
        return Received(_flat(gathered), want=_flat([inputs(r) for r in range(world_size)]))
    if form == "scatter":
        out = torch.empty(n, dtype=dt)
        parts = (list(x.split(n)) if n else [x[:0]] * world_size) if rank == root else None
        wait(dist.scatter(out, parts, src=root, group=group, async_op=async_op))
        return Received(out, want=inputs(root)[rank * n:(rank + 1) * n])
    if form == "broadcast":
        wait(dist.broadcast(x, src=root, group=group, async_op=async_op))
        return Received(x, want=inputs(root))
    if form == "all_to_all_single":
        out = torch.empty(n * world_size, dtype=dt)
        wait(dist.all_to_all_single(out, x, group=group, async_op=async_op))
        return Received(out, want=_flat([inputs(r)[rank * n:(rank + 1) * n] for r in range(world_size)]))
    if form == "all_to_all":
        outs = [torch.empty(n, dtype=dt) for _ in range(world_size)]
        ins = list(x.split(n)) if n else [x[:0]] * world_size
        wait(dist.all_to_all(outs, ins, group=group, async_op=async_op))
        return Received(_flat(outs), want=_flat([inputs(r)[rank * n:(rank + 1) * n] for r in range(world_size)]))
    raise ValueError(f"unknown collective form {form!r}; known: {', '.join(FORMS)}")

