"""The collectives of the ``vcga`` process group but ``all_reduce``: reductions, data movement and
their argument checks.

A :class:`~vcga.process_group.VcgaProcessGroup` makes one :class:`Collectives` at the first call of
one of them and hands it each with torch's c10d signature; ``all_reduce``, a training job's first
and most frequent call, has a module of its own (:mod:`vcga.pg.allreduce`), so a job that has
only all-reduced so far has not loaded this one. Each checks its arguments and runs on the group's
:class:`~vcga.pg.calls.CallPath`: the hot path straight to the native group when the table calls
the cell native and the tensors are contiguous, otherwise the dispatcher (:mod:`vcga.pg.dispatch`).
Point to point, barriers and coalescing stay in :mod:`vcga.process_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from vcga import dtypes as _dtypes
from vcga.contract import Collective
from vcga.pg.allreduce import complex_again, one_tensor
from vcga.pg.calls import CallPath
from vcga.pg.dispatch import Steps
from vcga.pg.recorder import described, one, stacked
from vcga.pypg import options, reduce_op_of

__all__ = ["Collectives", "one_tensor"]

#: dtype -> small integer, for exchanging dtypes in an int64 tensor (gather/scatter size checks).
_DTYPE_CODES: dict[torch.dtype, int] = {_dtypes.to_torch(name): i for i, name in enumerate(_dtypes.ALL)}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as 1-D (gloo's *_base collectives compare shapes chunk by chunk)."""
    return t if t.dim() == 1 else t.view(-1)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any byte of storage (conservatively: their spans intersect)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


class Collectives:
    """The collectives of one :class:`~vcga.process_group.VcgaProcessGroup` (see the module docstring).

    :param calls: the group's call path (sequence numbers, hot path, dispatch, typed failures).
    """

    def __init__(self, calls: CallPath) -> None:
        self.calls = calls

    # ===========================================================================================
    # Reductions
    # ===========================================================================================

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("allreduce_coalesced")
        op, factor = reduce_op_of(opts.reduceOp)
        seq = self.calls.next("all_reduce_coalesced", list(tensors), op)
        call = self.calls.record(seq, "allreduce_coalesced", described(tensors), None, tensors)
        same = len({t.dtype for t in tensors}) == 1
        if same and tensors and all(self.calls.fast_native(Collective.ALL_REDUCE, t, opts.reduceOp)
                                    for t in tensors):
            return self.calls.native_call("all_reduce_coalesced", seq, self.calls.native.allreduce_coalesced, tensors,
                                          opts, async_op=opts.asyncOp, result=tensors, call=call)

        def build(s: Steps) -> None:
            for t in tensors:
                self.calls.d.all_reduce(complex_again(t), op, factor, opts, s)

        return self.calls.issue("all_reduce_coalesced", seq, build, tensors, opts.asyncOp, call)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("reduce")
        t = one_tensor(tensors, "reduce")
        op, factor = reduce_op_of(opts.reduceOp)
        seq = self.calls.next("reduce", t, op, opts.rootRank)
        call = self.calls.record(seq, "reduce", one(t), None, tensors)
        if self.calls.rank == opts.rootRank and self.calls.fast_native(Collective.REDUCE, t, opts.reduceOp):
            return self.calls.native_call("reduce", seq, self.calls.native.reduce, tensors, opts, async_op=opts.asyncOp,
                                          result=tensors, call=call)
        return self.calls.issue("reduce", seq, lambda s: self.calls.d.reduce(t, opts.rootRank, op, factor, opts, s),
                                tensors, opts.asyncOp, call)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        opts = opts if opts is not None else options("reduce_scatter")
        out = one_tensor(output_tensors, "reduce_scatter")
        ins = one_tensor(input_tensors, "reduce_scatter")
        self._check_count(ins, "reduce_scatter input list")
        op, factor = reduce_op_of(opts.reduceOp)
        seq = self.calls.next("reduce_scatter", out, op)
        call = self.calls.record(seq, "reduce_scatter", stacked(ins), one(out), ins)
        if (all(x.dtype == out.dtype for x in ins)
                and self.calls.fast_native(Collective.REDUCE_SCATTER, out, opts.reduceOp)
                and all(x.is_contiguous() for x in ins)):
            return self.calls.native_call("reduce_scatter", seq, self.calls.native.reduce_scatter, output_tensors,
                                          input_tensors, opts, async_op=opts.asyncOp, result=output_tensors, call=call)
        return self.calls.issue("reduce_scatter", seq,
                                lambda s: self.calls.d.reduce_scatter(out, list(ins), op, factor, opts, s),
                                output_tensors, opts.asyncOp, call)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else options("reduce_scatter")
        if input.numel() != output.numel() * self.calls.size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, expected the output's "
                             f"{output.numel()} times the group size {self.calls.size}")
        if (self.calls.debug is None and input.dtype == output.dtype and input.is_contiguous()
                and self.calls.fast_native(Collective.REDUCE_SCATTER, output, opts.reduceOp)):
            seq = next(self.calls.seqs)
            return self.calls.native_call("reduce_scatter_tensor", seq, self.calls.native._reduce_scatter_base,
                                          _flat(output), _flat(input), opts, async_op=opts.asyncOp, result=[output],
                                          call=self.calls.record(seq, "_reduce_scatter_base",
                                                                 one(input),
                                                                 one(output), (input,)))
        op, factor = reduce_op_of(opts.reduceOp)
        seq = self.calls.next("reduce_scatter_tensor", output, op)
        call = self.calls.record(seq, "_reduce_scatter_base", one(input),
                                 one(output), (input,))

        def build(s: Steps) -> None:
            chunks = list(input.reshape(self.calls.size, *output.shape).unbind(0)) if self.calls.size else []
            self.calls.d.reduce_scatter(output, chunks, op, factor, opts, s)

        return self.calls.issue("reduce_scatter_tensor", seq, build, [output], opts.asyncOp, call)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = opts if opts is not None else options("reduce_scatter")
        op, factor = reduce_op_of(opts.reduceOp)
        seq = self.calls.next("reduce_scatter_tensor_coalesced", list(outputs), op)
        call = self.calls.record(seq, "reduce_scatter_tensor_coalesced", described(inputs), described(outputs), inputs)

        def build(s: Steps) -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                if inp.numel() != out.numel() * self.calls.size:
                    raise ValueError("reduce_scatter_tensor_coalesced: each input needs group size times its "
                                     "output's elements")
                chunks = list(inp.reshape(self.calls.size, *out.shape).unbind(0))
                self.calls.d.reduce_scatter(out, chunks, op, factor, opts, s)

        return self.calls.issue("reduce_scatter_tensor_coalesced", seq, build, outputs, opts.asyncOp, call)

    # ===========================================================================================
    # Data movement
    # ===========================================================================================

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("broadcast")
        t = one_tensor(tensors, "broadcast")
        root = opts.rootRank
        if self.calls.debug is None and self.calls.fast_native(Collective.BROADCAST, t):
            seq = next(self.calls.seqs)
            call = self.calls.record(seq, "broadcast", one(t), None, tensors)
            return self.calls.native_call("broadcast", seq, self.calls.native.broadcast, tensors, opts,
                                          async_op=opts.asyncOp, result=tensors, call=call)
        seq = self.calls.next("broadcast", t, root=root)
        call = self.calls.record(seq, "broadcast", one(t), None, tensors)
        return self.calls.issue("broadcast", seq, lambda s: self.calls.d.broadcast(t, root, opts, s), tensors,
                                opts.asyncOp, call)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        opts = opts if opts is not None else options("allgather")
        inp = one_tensor(input_tensors, "all_gather")
        outs = one_tensor(output_tensors, "all_gather")
        self._check_count(outs, "all_gather output list")
        seq = self.calls.next("all_gather", inp)
        call = self.calls.record(seq, "all_gather", one(inp), stacked(outs), input_tensors)
        if (self.calls.fast_native(Collective.ALL_GATHER, inp)
                and all(o.is_contiguous() and o.dtype == inp.dtype for o in outs)):
            return self.calls.native_call("all_gather", seq, self.calls.native.allgather, output_tensors, input_tensors,
                                          opts, async_op=opts.asyncOp, result=outs, call=call)
        return self.calls.issue("all_gather", seq, lambda s: self.calls.d.all_gather(list(outs), inp, opts, s), outs,
                                opts.asyncOp, call)

    def allgather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else options("allgather")
        if output.numel() != input.numel() * self.calls.size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, expected the input's "
                             f"{input.numel()} times the group size {self.calls.size}")
        if (self.calls.debug is None and output.dtype == input.dtype and output.is_contiguous()
                and self.calls.fast_native(Collective.ALL_GATHER, input)):
            seq = next(self.calls.seqs)
            return self.calls.native_call("all_gather_into_tensor", seq, self.calls.native._allgather_base,
                                          _flat(output), _flat(input), opts, async_op=opts.asyncOp, result=[output],
                                          call=self.calls.record(seq, "_all_gather_base", one(input),
                                                                 one(output), (input,)))
        seq = self.calls.next("all_gather_into_tensor", input)
        call = self.calls.record(seq, "_all_gather_base", one(input),
                                 one(output), (input,))

        def build(s: Steps) -> None:
            buf = output if output.is_contiguous() else output.contiguous()
            self.calls.d.all_gather(list(buf.view(self.calls.size, *input.shape).unbind(0)), input, opts, s)
            if buf is not output:
                s.finish.append(partial(output.copy_, buf))

        return self.calls.issue("all_gather_into_tensor", seq, build, [output], opts.asyncOp, call)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> Any:
        opts = opts if opts is not None else options("allgather")
        seq = self.calls.next("all_gather_coalesced", list(input_list))
        call = self.calls.record(seq, "all_gather_into_tensor_coalesced", described(input_list),
                                 tuple(((len(output_lists), *t.shape), t.dtype) for t in input_list), input_list)
        for outs in output_lists:
            if len(outs) != len(input_list):
                raise ValueError("all_gather_coalesced: every output list needs one tensor per input tensor")
        self._check_count(output_lists, "all_gather_coalesced output lists")

        def build(s: Steps) -> None:
            for i, inp in enumerate(input_list):
                self.calls.d.all_gather([outs[i] for outs in output_lists], inp, opts, s)

        flat = [t for outs in output_lists for t in outs]
        return self.calls.issue("all_gather_coalesced", seq, build, flat, opts.asyncOp, call)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = opts if opts is not None else options("allgather")
        seq = self.calls.next("all_gather_into_tensor_coalesced", list(inputs))
        call = self.calls.record(seq, "all_gather_into_tensor_coalesced", described(inputs), described(outputs), inputs)

        def build(s: Steps) -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                if out.numel() != inp.numel() * self.calls.size:
                    raise ValueError("all_gather_into_tensor_coalesced: each output needs group size times its "
                                     "input's elements")
                buf = out if out.is_contiguous() else out.contiguous()
                self.calls.d.all_gather(list(buf.view(self.calls.size, *inp.shape).unbind(0)), inp, opts, s)
                if buf is not out:
                    s.finish.append(partial(out.copy_, buf))

        return self.calls.issue("all_gather_into_tensor_coalesced", seq, build, outputs, opts.asyncOp, call)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> Any:
        opts = opts if opts is not None else options("gather")
        inp = one_tensor(input_tensors, "gather")
        root = opts.rootRank
        if self.calls.rank == root:
            outs = one_tensor(output_tensors, "gather")
            self._check_count(outs, "gather output list")
        else:
            if output_tensors and any(len(o) for o in output_tensors):
                raise ValueError(f"gather: only the destination rank ({root}) passes output tensors")
            outs = []
        seq = self.calls.next("gather", inp, root=root)
        call = self.calls.record(seq, "gather", one(inp), stacked(outs), input_tensors)
        self._agree_on_sizes_recorded(call, "gather", seq, inp, outs, root, "gather_list")
        return self.calls.issue("gather", seq, lambda s: self.calls.d.gather(list(outs), inp, root, opts, s),
                                list(outs), opts.asyncOp, call)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        opts = opts if opts is not None else options("scatter")
        out = one_tensor(output_tensors, "scatter")
        root = opts.rootRank
        if self.calls.rank == root:
            ins = one_tensor(input_tensors, "scatter")
            self._check_count(ins, "scatter input list")
        else:
            if input_tensors and any(len(i) for i in input_tensors):
                raise ValueError(f"scatter: only the source rank ({root}) passes input tensors")
            ins = []
        seq = self.calls.next("scatter", out, root=root)
        call = self.calls.record(seq, "scatter", stacked(ins), one(out), ins)
        self._agree_on_sizes_recorded(call, "scatter", seq, out, ins, root, "scatter_list")
        return self.calls.issue("scatter", seq, lambda s: self.calls.d.scatter(out, list(ins), root, opts, s), [out],
                                opts.asyncOp, call)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("alltoall")
        out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)
        for splits, t, what in ((out_splits, output, "output"), (in_splits, input, "input")):
            if splits and (len(splits) != self.calls.size or sum(splits) != (t.shape[0] if t.dim() else 1)):
                raise ValueError(f"all_to_all_single: {what}_split_sizes {splits} must have one entry per rank "
                                 f"({self.calls.size}) adding up to the {what}'s dim 0 "
                                 f"({t.shape[0] if t.dim() else 1})")
        seq = self.calls.next("all_to_all_single")
        if input.dtype != output.dtype:
            raise ValueError(f"all_to_all_single: input is {input.dtype} but output is {output.dtype}")
        call = self.calls.record(seq, "all_to_all", one(input), one(output),
                                 (input,))
        if _overlap(input, output):
            # In place (nccl-tests' in-place all_to_all): libraries read the input while peers' chunks
            # land in the output, so an aliased input would be overwritten before it is sent.
            input = input.clone()  # noqa: A001
        return self.calls.issue("all_to_all_single", seq,
                                lambda s: self.calls.d.all_to_all(output, input, out_splits, in_splits, opts, s),
                                [output], opts.asyncOp, call)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("alltoall")
        self._check_count(output_tensors, "all_to_all output list")
        self._check_count(input_tensors, "all_to_all input list")
        seq = self.calls.next("all_to_all")
        dtypes_ = {t.dtype for t in [*output_tensors, *input_tensors]}
        if len(dtypes_) > 1:
            raise ValueError(f"all_to_all: every tensor must have one dtype, got {sorted(map(str, dtypes_))}")
        call = self.calls.record(seq, "all_to_all", described(input_tensors), described(output_tensors), input_tensors)

        def build(s: Steps) -> None:
            # One flat all_to_all_single: the lists become contiguous buffers split by element counts.
            dt = input_tensors[0].dtype if input_tensors else output_tensors[0].dtype
            dev = input_tensors[0].device if input_tensors else output_tensors[0].device
            send = torch.cat([x.reshape(-1) for x in input_tensors]) if input_tensors else torch.empty(0, dtype=dt)
            recv = torch.empty(sum(o.numel() for o in output_tensors), dtype=dt, device=dev)
            self.calls.d.all_to_all(recv, send, [o.numel() for o in output_tensors], [x.numel() for x in input_tensors],
                               opts, s)

            def scatter_back() -> None:
                offset = 0
                for o in output_tensors:
                    o.copy_(recv[offset:offset + o.numel()].view(o.shape))
                    offset += o.numel()

            s.finish.append(scatter_back)

        return self.calls.issue("all_to_all", seq, build, list(output_tensors), opts.asyncOp, call)

    # -- argument checks -------------------------------------------------------------------------

    def _agree_on_sizes_recorded(self, call: Any, *args: Any) -> None:
        """:meth:`_agree_on_sizes`, a refusal also ending ``call``'s flight-recorder entry."""
        try:
            self._agree_on_sizes(*args)
        except BaseException as e:
            if call is not None:
                call.end(e)
            raise

    def _agree_on_sizes(self, name: str, seq: int, mine: torch.Tensor, listed: Sequence[torch.Tensor], root: int,
                        list_name: str) -> None:
        """gather / scatter: every rank's tensor and every entry of the root's list must hold the
        same number of elements of the same dtype (torch's rule), checked on every rank at once.

        Only the root sees the list, so a root-only check (gloo's, NCCL's) refuses on the root
        while the other ranks wait for the timeout. Instead every rank contributes its element
        count and dtype -- the root also its list's -- in one small all_gather through the
        transport, and every rank reaches the same verdict: proceed, or raise
        :class:`~vcga.errors.VcgaMismatchError` before any data moves.
        """
        from vcga.errors import VcgaMismatchError

        def code(dt: torch.dtype) -> int:
            return _DTYPE_CODES.get(dt, -1)

        row = [mine.numel(), code(mine.dtype)] + [-1] * (2 * self.calls.size)
        if self.calls.rank == root:
            for r, t in enumerate(listed):
                row[2 + 2 * r], row[3 + 2 * r] = t.numel(), code(t.dtype)
        if self.calls.size == 1:
            rows = [row]
        else:
            vec = torch.tensor(row, dtype=torch.int64, device=mine.device)
            table = torch.empty((self.calls.size, len(row)), dtype=torch.int64, device=mine.device)
            steps = self.calls.translated(name, seq, lambda s: self.calls.d.all_gather(list(table.unbind(0)), vec,
                                                                                     options("allgather"), s))
            self.calls.wrap(name, seq, steps, [table], False)
            rows = table.cpu().tolist()
        want_n, want_dt = rows[root][0], rows[root][1]
        listed_n = [rows[root][2 + 2 * r] for r in range(self.calls.size)]
        listed_dt = [rows[root][3 + 2 * r] for r in range(self.calls.size)]
        differences: dict[str, dict[int, Any]] = {}
        if any(r[0] != want_n for r in rows):
            differences["numel"] = {r: rows[r][0] for r in range(self.calls.size)}
        if any(n != want_n for n in listed_n):
            differences[f"numel of the {list_name} entries (rank {root} is the root)"] = {root: listed_n}
        if any(r[1] != want_dt for r in rows) or any(d != want_dt for d in listed_dt):
            names = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
            differences["dtype"] = {r: names.get(rows[r][1], "?") for r in range(self.calls.size)}
            if any(d != want_dt for d in listed_dt):
                differences[f"dtype of the {list_name} entries"] = {root: [names.get(d, "?") for d in listed_dt]}
        if differences:
            raise VcgaMismatchError(seq, differences, rank=self.calls.rank)

    def _check_count(self, items: Sequence[Any], what: str) -> None:
        if len(items) != self.calls.size:
            raise ValueError(f"{what} must have one entry per rank ({self.calls.size}), got {len(items)}")
