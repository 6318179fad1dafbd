"""The simulated vendor's native process group: a vendor library's rules on top of gloo.

:class:`SimVendorGroup` is what :meth:`SimBackend.create_process_group
<vcga.plugins.sim.SimBackend.create_process_group>` returns. It imports torch, so the plugin loads it
only when a group is made.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from vcga import dtypes
from vcga.contract import ReduceOp
from vcga.pypg import PyWork, options, reduce_op_of

from .libraries import SCALAR_TYPE, VendorLibrary

__all__ = ["SimVendorGroup"]


def _keep_rows(t: Any, staged: Any) -> Any:
    """``staged`` (``t`` as the library sees it) with ``t``'s dim 0: all-to-all splits count rows.

    Moving a multi-byte dtype as bytes lengthens the last dimension; for a 1-D tensor that is
    dim 0, so view each row as bytes instead.
    """
    if staged.dim() == t.dim() and (t.dim() == 0 or staged.shape[0] == t.shape[0]):
        return staged
    return t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


class SimVendorGroup(dist.ProcessGroup):
    """A vendor library on gloo: its dtype and op rules, its conversions, its mangling.

    Implements the c10d methods a :mod:`vcga.pg.transport` group needs. A call the vendor
    rejects raises the vendor's exception type and message; a call it mangles returns the
    mangled result, silently, as the vendor does.
    """

    def __init__(self, lib: VendorLibrary, gloo: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub omits the (rank, size) form
        self.lib, self.gloo, self._rank, self._size = lib, gloo, rank, size

    def getBackendName(self) -> str:  # noqa: N802
        return f"sim-{self.lib.name.lower()}"

    def __repr__(self) -> str:
        return f"SimVendorGroup({self.lib.name}, rank={self._rank}, size={self._size})"

    # -- the library's rules ------------------------------------------------------------------

    def _check(self, tensors: list[Any], reducing: bool) -> None:
        for t in tensors:
            name = dtypes.from_torch(t.dtype)
            if name not in self.lib.moves:
                exc, msg = self.lib.dtype_error
                raise exc(msg.format(type=SCALAR_TYPE.get(name, name)))
            if reducing and name not in self.lib.reduces:
                exc, msg = self.lib.reduce_dtype_error or self.lib.dtype_error
                raise exc(msg.format(type=SCALAR_TYPE.get(name, name)))

    def _op(self, t: Any, torch_op: Any) -> tuple[ReduceOp, Any, str | None]:
        """(op gloo runs, factor to scale inputs by first, post step) for one reduction."""
        op, factor = reduce_op_of(torch_op)
        name = dtypes.from_torch(t.dtype)
        if op in self.lib.op_errors:
            exc, msg = self.lib.op_errors[op]
            raise exc(msg)
        if name == "bool":
            if op is ReduceOp.AVG:
                raise TypeError("Cannot use ReduceOp.AVG with boolean inputs")
            if op is ReduceOp.SUM:  # every vendor maps bool SUM to MAX (bitwise or)
                return ReduceOp.MAX, None, None
        if op is ReduceOp.PREMUL_SUM:
            if name not in self.lib.premul:
                exc, msg = self.lib.premul_error
                raise exc(msg)
            return ReduceOp.SUM, factor, None
        if op is ReduceOp.AVG:
            integer = dtypes.get(name).kind in "ui"
            if self.lib.avg == "native" and not integer:
                return ReduceOp.AVG, None, None
            if self.lib.avg == "native" and self.lib.int_avg_trunc:
                return ReduceOp.SUM, None, "trunc_div"
            return ReduceOp.SUM, None, "div"
        return op, None, None

    # -- staging: what the library does to the bytes --------------------------------------------

    def _in(self, t: Any, reducing: bool = False) -> Any:
        """An input as the library reads it."""
        name = dtypes.from_torch(t.dtype)
        if name in self.lib.as_float32:
            return t.to(torch.float32)
        if reducing and name in self.lib.reduce_wide:
            return t.to(dtypes.to_torch(self.lib.reduce_wide[name]))
        if name in self.lib.as_bytes:
            return t.contiguous().view(torch.uint8)
        return t

    def _out(self, t: Any, after: list[Any], reducing: bool = False) -> Any:
        """An output buffer as the library writes it; ``after`` gets the write-back."""
        name = dtypes.from_torch(t.dtype)
        wide = torch.float32 if name in self.lib.as_float32 else (
            dtypes.to_torch(self.lib.reduce_wide[name]) if reducing and name in self.lib.reduce_wide else None)
        if wide is not None:
            buf = t.to(wide)
            after.append(partial(t.copy_, buf))
            return buf
        if name in self.lib.as_bytes:
            return t.view(torch.uint8)
        return t

    def _done(self, work: Any, after: list[Any], result: list[Any]) -> Any:
        return PyWork([work], after, result) if after else work

    def _post(self, t: Any, post: str | None, after: list[Any]) -> None:
        if post == "div":
            after.append(partial(t.div_, self._size))
        elif post == "trunc_div":
            after.append(partial(t.div_, self._size, rounding_mode="trunc"))

    # -- reductions ------------------------------------------------------------------------------

    # c10d calls the collectives as (tensors, opts); torch's type stub also declares the other forms
    # of its Python helpers as overloads, so these overrides name [override].
    def allreduce(self, tensors: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("allreduce")
        (t,) = tensors
        self._check([t], reducing=True)
        op, factor, post = self._op(t, opts.reduceOp)
        after: list[Any] = []
        buf = self._out(t, after, reducing=True)
        if factor is not None:
            buf.mul_(factor)
        self._post(t, post, after)
        work = self.gloo.allreduce([buf], options("allreduce", like=opts, op=op))
        return self._done(work, after, tensors)

    def allreduce_coalesced(self, tensors: list[Any], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("allreduce_coalesced")
        works = []
        for t in tensors:
            o = options("allreduce", like=opts)
            o.reduceOp = opts.reduceOp
            works.append(self.allreduce([t], o))
        return PyWork(works, (), tensors)

    def reduce(self, tensors: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("reduce")
        (t,) = tensors
        self._check([t], reducing=True)
        op, factor, post = self._op(t, opts.reduceOp)
        after: list[Any] = []
        buf = self._out(t, after, reducing=True)
        if factor is not None:
            scaled = buf.mul(factor)  # the library scales a copy: non-root inputs stay as they were
            if self._rank == opts.rootRank:
                after.insert(0, partial(buf.copy_, scaled))
            buf = scaled
        if self._rank == opts.rootRank:
            self._post(t, post, after)
        work = self.gloo.reduce([buf], options("reduce", like=opts, op=op, root=opts.rootRank))
        return self._done(work, after, tensors)

    def reduce_scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("reduce_scatter")
        (out,), (ins,) = outputs, inputs
        self._check([out, *ins], reducing=True)
        op, factor, post = self._op(out, opts.reduceOp)
        after: list[Any] = []
        buf = self._out(out, after, reducing=True)
        staged = [self._in(x, reducing=True) for x in ins]
        if factor is not None:
            staged = [x.mul(factor) for x in staged]
        self._post(out, post, after)
        work = self.gloo.reduce_scatter([buf], [staged], options("reduce_scatter", like=opts, op=op))
        return self._done(work, after, outputs)

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else options("reduce_scatter")
        chunks = list(input.reshape(self._size, *output.shape).unbind(0))
        return self.reduce_scatter([output], [chunks], opts)

    # -- data movement ---------------------------------------------------------------------------

    def broadcast(self, tensors: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("broadcast")
        (t,) = tensors
        self._check([t], reducing=False)
        after: list[Any] = []
        work = self.gloo.broadcast([self._out(t, after)], options("broadcast", like=opts, root=opts.rootRank))
        return self._done(work, after, tensors)

    def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("allgather")
        (outs,), (inp,) = outputs, inputs
        self._check([inp, *outs], reducing=False)
        after: list[Any] = []
        bufs = [self._out(o, after) for o in outs]
        work = self.gloo.allgather([bufs], [self._in(inp)], options("allgather", like=opts))
        return self._done(work, after, outs)

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else options("allgather")
        outs = list(output.view(self._size, *input.shape).unbind(0))
        return self.allgather([outs], [input], opts)

    def allgather_coalesced(self, output_lists: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("allgather")
        works = [self.allgather([[outs[i] for outs in output_lists]], [inp], opts) for i, inp in enumerate(inputs)]
        return PyWork(works, (), [t for outs in output_lists for t in outs])

    def gather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("gather")
        (inp,) = inputs
        outs = outputs[0] if outputs else []
        self._check([inp, *outs], reducing=False)
        after: list[Any] = []
        bufs = [self._out(o, after) for o in outs]
        work = self.gloo.gather([bufs] if outputs else [], [self._in(inp)],
                                options("gather", like=opts, root=opts.rootRank))
        return self._done(work, after, outs)

    def scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:  # type: ignore[override]
        opts = opts if opts is not None else options("scatter")
        (out,) = outputs
        ins = inputs[0] if inputs else []
        self._check([out, *ins], reducing=False)
        after: list[Any] = []
        buf = self._out(out, after)
        work = self.gloo.scatter([buf], [[self._in(x) for x in ins]] if inputs else [],
                                 options("scatter", like=opts, root=opts.rootRank))
        return self._done(work, after, outputs)

    def alltoall_base(self, output: Any, input: Any, out_splits: list[int], in_splits: list[int],  # noqa: A002
                      opts: Any = None) -> Any:
        opts = opts if opts is not None else options("alltoall")
        self._check([output, input], reducing=False)
        after: list[Any] = []
        buf, src = _keep_rows(output, self._out(output, after)), _keep_rows(input, self._in(input))
        work = self.gloo.alltoall_base(buf, src, out_splits, in_splits, options("alltoall", like=opts))
        return self._done(work, after, [output])

    def alltoall(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> Any:
        opts = opts if opts is not None else options("alltoall")
        self._check([*outputs, *inputs], reducing=False)
        after: list[Any] = []
        bufs = [self._out(o, after) for o in outputs]
        work = self.gloo.alltoall(bufs, [self._in(x) for x in inputs], options("alltoall", like=opts))
        return self._done(work, after, outputs)

    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        (t,) = tensors
        self._check([t], reducing=False)
        return self.gloo.send([self._in(t).contiguous()], dst, tag)

    def recv(self, tensors: list[Any], src: int, tag: int) -> Any:
        (t,) = tensors
        self._check([t], reducing=False)
        after: list[Any] = []
        work = self.gloo.recv([self._out(t, after)], src, tag)
        return self._done(work, after, tensors)

    def recv_anysource(self, tensors: list[Any], tag: int) -> Any:
        (t,) = tensors
        self._check([t], reducing=False)
        after: list[Any] = []
        work = self.gloo.recv_anysource([self._out(t, after)], tag)
        if not after:
            return work
        return PyWork([work], after, tensors, source_rank=work._source_rank)

    def barrier(self, opts: Any = None) -> Any:
        return self.gloo.barrier(opts if opts is not None else options("barrier"))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        return self.gloo.monitored_barrier(timeout, wait_all_ranks)

    def shutdown(self) -> None:
        # Drop the gloo group, not only shut it down: its destructor is what stops its threads.
        gloo, self.gloo = self.gloo, None
        if gloo is not None:
            gloo.shutdown()

    def abort(self) -> None:
        # gloo cannot abort a collective; whoever drops this group waits for its threads
        if self.gloo is not None:
            self.gloo.abort()

