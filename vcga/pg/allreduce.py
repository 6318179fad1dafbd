"""``all_reduce``, the collective a training job's first calls are: its argument checks and the
hot path (:mod:`vcga.pg.collectives` holds the others, loaded at the first call of one).

The call runs on the group's :class:`~vcga.pg.calls.CallPath`: straight to the native group when
the table calls the cell native and the tensor is contiguous, otherwise through the dispatcher
(:mod:`vcga.pg.dispatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from vcga.contract import Collective
from vcga.pg.calls import CallPath
from vcga.pg.recorder import one
from vcga.pypg import options, reduce_op_of

__all__ = ["all_reduce", "complex_again", "one_tensor"]

_COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def complex_again(t: torch.Tensor) -> torch.Tensor:
    """The complex tensor behind ``t`` when ``t`` is ``torch.view_as_real`` of one, else ``t``.

    ``torch.distributed.all_reduce`` (and ``all_reduce_coalesced``) hand backends complex tensors
    as ``view_as_real`` views. Dispatching the view would consult the table's real cell and name
    the real dtype in a refusal; the user passed a complex tensor, so the complex cell decides
    (its ``as_real`` recipe views the pairs again) and a refusal names complex128. The view shares
    the storage: the result lands in ``t``."""
    base = t._base
    if (base is None or not base.is_complex() or t.dim() == 0 or t.shape[-1] != 2
            or _COMPLEX_OF.get(t.dtype) != base.dtype):
        return t
    try:
        return torch.view_as_complex(t)
    except RuntimeError:  # strides that no complex tensor has: not torch's view after all
        return t


_T = TypeVar("_T")


def one_tensor(tensors: Sequence[_T], what: str) -> _T:
    """The one entry of a per-process list (a tensor, or a list of tensors)."""
    if len(tensors) != 1:
        raise ValueError(f"vcga {what} takes exactly one tensor per process, got {len(tensors)} "
                         "(several tensors per process are deprecated in torch.distributed)")
    return tensors[0]


def all_reduce(calls: CallPath, tensors: list[torch.Tensor], opts: Any = None) -> Any:
    """``ProcessGroup.allreduce``: the hot path when the table calls the cell native, else dispatch."""
    opts = opts if opts is not None else options("allreduce")
    t = one_tensor(tensors, "all_reduce")
    red = opts.reduceOp
    if t.layout is not torch.strided:
        # Sparse tensors (DDP's sparse embedding gradients): capability tables describe dense
        # tensors; the library itself decides (gloo sums sparse COO tensors, NCCL refuses).
        seq = calls.next("all_reduce")
        return calls.native_call("all_reduce", seq, calls.native.allreduce, tensors, opts,
                                 async_op=opts.asyncOp, result=tensors,
                                 call=calls.record(seq, "all_reduce", one(t)))
    if calls.debug is None and calls.fast_native(Collective.ALL_REDUCE, t, red):
        seq = next(calls.seqs)
        call = calls.record(seq, "all_reduce", one(t), None, tensors)
        return calls.native_call("all_reduce", seq, calls.native.allreduce, tensors, opts,
                                 async_op=opts.asyncOp, result=tensors, call=call)
    op, factor = reduce_op_of(red)
    seq = calls.next("all_reduce", t, op)
    call = calls.record(seq, "all_reduce", one(t), None, tensors)
    c = complex_again(t)
    return calls.issue("all_reduce", seq, lambda s: calls.d.all_reduce(c, op, factor, opts, s), tensors,
                       opts.asyncOp, call)
