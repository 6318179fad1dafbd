"""What the dispatcher does beyond a table lookup: the emulation recipes, the data-moving and
point-to-point calls, and the typed refusals (:mod:`vcga.pg.dispatch` says how a call is routed).

Loaded on a group's first call that the native fast path does not take (an emulated or refused
cell, a staged tensor, a collective other than the process group's hot ones): a job whose calls
all run natively never reads these recipes. Each function takes the
:class:`~vcga.pg.dispatch.Dispatcher` whose table and native group it uses as ``d``.

Each recipe issues exactly one native call, so an emulated collective is one native work plus
completion steps (:class:`~vcga.pg.dispatch.Steps`); the process group wraps them in a
:class:`vcga.pypg.PyWork`. The error bound of every recipe is in ``docs/emulation.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vcga import dtypes as _dtypes
from vcga.contract import Collective, ReduceOp, Support
from vcga.errors import VcgaUnsupportedError
from vcga.pypg import options

if TYPE_CHECKING:
    from vcga.pg.dispatch import Dispatcher, Steps

__all__ = ["MAX_EMULATION_DEPTH", "local_reduce"]

#: Longest chain of recipes one call may go through (a table that loops is refused, not followed).
MAX_EMULATION_DEPTH = 6

_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy (the staging buffer)."""
    return t if t.is_contiguous() else t.contiguous()


def _copy_back(steps: Steps, dst: torch.Tensor, src: torch.Tensor) -> None:
    if src is not dst:
        steps.finish.append(partial(dst.copy_, src))


def _flat_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a 1-D tensor of ``dtype`` (same bytes, no copy)."""
    return t.reshape(-1).view(dtype)


def _flat1d(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as a 1-D view (no copy)."""
    return t if t.dim() == 1 else t.view(-1)


def _units(t: torch.Tensor, target: torch.dtype, fill: bool = True) -> tuple[torch.Tensor, Callable[[], Any] | None]:
    """The bytes of ``t`` as a 1-D tensor of whole ``target`` elements, for a library that moves
    ``target`` but not ``t.dtype`` (the ``bitcast`` recipe of a moving collective).

    Returns ``(units, back)``. When ``target``'s width divides ``t``'s, ``units`` is a view of the
    same bytes (no copy for a contiguous tensor). Otherwise the bytes are copied (``fill``) into a
    buffer padded with zero bytes to a whole number of ``target`` elements -- the same length on
    every rank, since it depends only on the element count and dtype -- and the library moves the
    padded buffer. ``back()`` (None when nothing is to do) puts received bytes into ``t``, cut back
    to its length. Either way the library only moves bytes: the result is exact."""
    b = _dense(t)
    width = target.itemsize
    if t.element_size() % width == 0:
        return _flat_view(b, target), (None if b is t else partial(t.copy_, b))
    raw = b.reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    buf = torch.empty(-(-nbytes // width) * width, dtype=torch.uint8, device=t.device)
    buf[nbytes:].zero_()  # deterministic padding: no stale memory goes on the wire
    if fill:
        buf[:nbytes].copy_(raw)

    def back() -> None:
        raw.copy_(buf[:nbytes])
        if b is not t:
            t.copy_(b)

    return buf.view(target), back


def _then(steps: Steps, back: Callable[[], Any] | None) -> None:
    if back is not None:
        steps.finish.append(back)


def _is_complex_factor(factor: Any) -> bool:
    if isinstance(factor, torch.Tensor):
        return factor.is_complex()
    return isinstance(factor, complex)


def local_reduce(stacked: torch.Tensor, op: ReduceOp, factor: Any, group_size: int) -> torch.Tensor:
    """Reduce ``stacked[0], stacked[1], ...`` (one row per rank) in rank order, in their own dtype.

    Every rank runs the same operations in the same order, so every rank gets the same bits.
    """
    rows = stacked.unbind(0)
    if op is ReduceOp.PREMUL_SUM:
        acc = rows[0] * factor
        for r in rows[1:]:
            acc = acc + r * factor
        return acc
    acc = rows[0].clone()
    for r in rows[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc += r
        elif op is ReduceOp.PRODUCT:
            acc *= r
        elif op is ReduceOp.MIN:
            acc = torch.minimum(acc, r)
        elif op is ReduceOp.MAX:
            acc = torch.maximum(acc, r)
        elif op is ReduceOp.BAND:
            acc &= r
        elif op is ReduceOp.BOR:
            acc |= r
        elif op is ReduceOp.BXOR:
            acc ^= r
        else:  # pragma: no cover - every ReduceOp is handled above
            raise AssertionError(op)
    if op is ReduceOp.AVG:
        acc = acc / group_size
    return acc


def refuse(d: Dispatcher, coll: Collective, dtype: torch.dtype, op: ReduceOp | None,
           reason: str) -> VcgaUnsupportedError:
    """The typed error for a refused cell, with a hint built from the table."""
    name = str(dtype).removeprefix("torch.")
    return VcgaUnsupportedError(d.backend, coll.value, name, op.value if op else None, reason,
                                hint(d, coll, name, op))


def hint(d: Dispatcher, coll: Collective, dtype: str, op: ReduceOp | None) -> str:
    def ok(c: Collective, name: str, o: ReduceOp | None) -> bool:
        return d.table.lookup(c, name, o).support is not Support.REFUSED

    if coll.reduces and op is not None:
        ops = [o.value for o in ReduceOp if ok(coll, dtype, o)]
        dts = [name for name in _dtypes.ALL if ok(coll, name, op)]
        parts = [f"{coll.value} on {dtype} works here with: {', '.join(ops) or 'no op'}",
                 f"{op.value} works here on: {', '.join(dts) or 'no dtype'}"]
    else:
        dts = [name for name in _dtypes.ALL if ok(coll, name, None)]
        parts = [f"{coll.value} works here on: {', '.join(dts) or 'no dtype'}"]
    return ("; ".join(parts) + ". Cast the tensor or change the op, or run this collective on a group "
            "of a backend that supports it (e.g. torch.distributed.new_group(backend='gloo') for CPU tensors)"
            "; `vcga info --json` lists every cell")


def recipe(d: Dispatcher, coll: Collective, dtype: torch.dtype, op: ReduceOp | None, depth: int) -> tuple[str, str]:
    """``(recipe, argument)`` of an emulated cell; raises for refused cells and runaway chains."""
    cell = d.cell(coll, dtype, op)
    if cell.support is Support.REFUSED:
        raise refuse(d, coll, dtype, op, cell.note or "refused")
    if depth >= MAX_EMULATION_DEPTH:
        raise refuse(d, coll, dtype, op, f"emulation chain longer than {MAX_EMULATION_DEPTH} steps "
                                           f"(the capability table loops at recipe {cell.via!r})")
    assert cell.via is not None
    base, _, arg = cell.via.partition(":")
    return base, arg


def bad_recipe(d: Dispatcher, coll: Collective, dtype: torch.dtype, op: ReduceOp | None,
               via: str) -> VcgaUnsupportedError:
    return refuse(d, coll, dtype, op, f"the capability table names emulation {via!r}, which does not apply "
                                        f"to {coll.value}{' with ' + op.value if op else ''} on {dtype}")


def all_reduce(d: Dispatcher, t: torch.Tensor, op: ReduceOp, factor: Any, like: Any, steps: Steps,
               depth: int = 0) -> None:
    """All-reduce ``t`` in place."""
    if d.is_native(Collective.ALL_REDUCE, t.dtype, op):
        b = _dense(t)
        steps.works.append(d.group.allreduce([b], options("allreduce", like=like, op=op, factor=factor)))
        _copy_back(steps, t, b)
        return
    via, arg = recipe(d, Collective.ALL_REDUCE, t.dtype, op, depth)
    deeper = depth + 1
    if via == "sum_then_divide":
        d.all_reduce(t, ReduceOp.SUM, None, like, steps, deeper)
        steps.finish.append(partial(t.div_, d.size))
    elif via == "mul_then_sum":
        t.mul_(factor)  # the tensor is overwritten by the result anyway
        d.all_reduce(t, ReduceOp.SUM, None, like, steps, deeper)
    elif via in ("bool_as_max", "bool_as_min"):
        d.all_reduce(t, ReduceOp.MAX if via == "bool_as_max" else ReduceOp.MIN, None, like, steps, deeper)
    elif via == "upcast":
        w = t.to(_dtypes.to_torch(arg), memory_format=torch.contiguous_format)
        d.all_reduce(w, op, factor, like, steps, deeper)
        steps.finish.append(partial(t.copy_, w))
    elif via in ("bitcast", "as_real"):
        if via == "as_real" and op is ReduceOp.PREMUL_SUM and _is_complex_factor(factor):
            t.mul_(factor)  # a complex factor mixes real and imaginary parts: apply it first
            op, factor = ReduceOp.SUM, None
        b = _dense(t)
        view = _flat_view(b, _REAL_OF[t.dtype] if via == "as_real" else _dtypes.to_torch(arg))
        d.all_reduce(view, op, factor, like, steps, deeper)
        _copy_back(steps, t, b)
    elif via == "gather_then_reduce":
        b = _dense(t)
        buf = torch.empty((d.size, *t.shape), dtype=t.dtype, device=t.device)
        d.all_gather(list(buf.unbind(0)), b, like, steps, deeper)
        steps.finish.append(lambda: t.copy_(local_reduce(buf, op, factor, d.size).reshape(t.shape)))
    else:
        raise bad_recipe(d, Collective.ALL_REDUCE, t.dtype, op, f"{via}:{arg}" if arg else via)


def reduce(d: Dispatcher, t: torch.Tensor, root: int, op: ReduceOp, factor: Any, like: Any, steps: Steps,
           depth: int = 0) -> None:
    """Reduce ``t`` into ``t`` on ``root``; other ranks' ``t`` is left unchanged (as NCCL does;
    gloo alone would leave partial sums there)."""
    at_root = d.rank == root
    if d.is_native(Collective.REDUCE, t.dtype, op):
        # Libraries may use a non-root rank's buffer as scratch (gloo does): hand them a copy there.
        b = _dense(t) if at_root else t.clone(memory_format=torch.contiguous_format)
        steps.works.append(d.group.reduce([b], options("reduce", like=like, op=op, factor=factor, root=root)))
        if at_root:
            _copy_back(steps, t, b)
        return
    via, arg = recipe(d, Collective.REDUCE, t.dtype, op, depth)
    deeper = depth + 1
    if via == "sum_then_divide":
        d.reduce(t, root, ReduceOp.SUM, None, like, steps, deeper)
        if at_root:
            steps.finish.append(partial(t.div_, d.size))
    elif via == "mul_then_sum":
        s = t.mul(factor)  # a copy: a non-root rank's tensor must stay as it was
        d.reduce(s, root, ReduceOp.SUM, None, like, steps, deeper)
        if at_root:
            steps.finish.append(partial(t.copy_, s))
    elif via in ("bool_as_max", "bool_as_min"):
        d.reduce(t, root, ReduceOp.MAX if via == "bool_as_max" else ReduceOp.MIN, None, like, steps, deeper)
    elif via == "upcast":
        w = t.to(_dtypes.to_torch(arg), memory_format=torch.contiguous_format)
        d.reduce(w, root, op, factor, like, steps, deeper)
        if at_root:
            steps.finish.append(partial(t.copy_, w))
    elif via in ("bitcast", "as_real"):
        if via == "as_real" and op is ReduceOp.PREMUL_SUM and _is_complex_factor(factor):
            b = t.mul(factor)
            op, factor = ReduceOp.SUM, None
        else:
            b = _dense(t)
        view = _flat_view(b, _REAL_OF[t.dtype] if via == "as_real" else _dtypes.to_torch(arg))
        d.reduce(view, root, op, factor, like, steps, deeper)
        if at_root:
            _copy_back(steps, t, b)
    elif via == "gather_then_reduce":
        b = _dense(t)
        if at_root:
            buf = torch.empty((d.size, *t.shape), dtype=t.dtype, device=t.device)
            d.gather(list(buf.unbind(0)), b, root, like, steps, deeper)
            steps.finish.append(lambda: t.copy_(local_reduce(buf, op, factor, d.size).reshape(t.shape)))
        else:
            d.gather([], b, root, like, steps, deeper)
    else:
        raise bad_recipe(d, Collective.REDUCE, t.dtype, op, f"{via}:{arg}" if arg else via)


def reduce_scatter(d: Dispatcher, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, factor: Any, like: Any,
                   steps: Steps, depth: int = 0) -> None:
    """Reduce ``ins[j]`` of every rank into ``out`` of rank ``j``."""
    if d.is_native(Collective.REDUCE_SCATTER, out.dtype, op):
        b = _dense(out)
        steps.works.append(d.group.reduce_scatter(
            [b], [[_dense(x) for x in ins]], options("reduce_scatter", like=like, op=op, factor=factor)))
        _copy_back(steps, out, b)
        return
    via, arg = recipe(d, Collective.REDUCE_SCATTER, out.dtype, op, depth)
    deeper = depth + 1
    if via == "sum_then_divide":
        d.reduce_scatter(out, ins, ReduceOp.SUM, None, like, steps, deeper)
        steps.finish.append(partial(out.div_, d.size))
    elif via == "mul_then_sum":
        d.reduce_scatter(out, [x.mul(factor) for x in ins], ReduceOp.SUM, None, like, steps, deeper)
    elif via in ("bool_as_max", "bool_as_min"):
        d.reduce_scatter(out, ins, ReduceOp.MAX if via == "bool_as_max" else ReduceOp.MIN, None, like, steps, deeper)
    elif via == "upcast":
        wide = _dtypes.to_torch(arg)
        w = torch.empty(out.shape, dtype=wide, device=out.device)
        d.reduce_scatter(w, [x.to(wide) for x in ins], op, factor, like, steps, deeper)
        steps.finish.append(partial(out.copy_, w))
    elif via in ("bitcast", "as_real"):
        if via == "as_real" and op is ReduceOp.PREMUL_SUM and _is_complex_factor(factor):
            ins = [x.mul(factor) for x in ins]
            op, factor = ReduceOp.SUM, None
        target = _REAL_OF[out.dtype] if via == "as_real" else _dtypes.to_torch(arg)
        b = _dense(out)
        d.reduce_scatter(_flat_view(b, target), [_flat_view(_dense(x), target) for x in ins], op, factor,
                            like, steps, deeper)
        _copy_back(steps, out, b)
    elif via == "gather_then_reduce":
        # Each rank needs everyone's chunk for it: an all-to-all moves exactly that, then every
        # rank reduces its rows in rank order in the dtype itself.
        send = torch.stack([x.reshape(out.shape) for x in ins]) if ins else torch.empty(0, dtype=out.dtype)
        recv = torch.empty((d.size, *out.shape), dtype=out.dtype, device=out.device)
        d.all_to_all(recv, send, [], [], like, steps, deeper)
        steps.finish.append(lambda: out.copy_(local_reduce(recv, op, factor, d.size).reshape(out.shape)))
    else:
        raise bad_recipe(d, Collective.REDUCE_SCATTER, out.dtype, op, f"{via}:{arg}" if arg else via)


def moving_recipe(d: Dispatcher, coll: Collective, dtype: torch.dtype, depth: int) -> tuple[str, torch.dtype]:
    via, arg = recipe(d, coll, dtype, None, depth)
    if via == "bitcast":
        return via, _dtypes.to_torch(arg)
    if via == "as_real" and dtype in _REAL_OF:
        return "bitcast", _REAL_OF[dtype]
    if via == "upcast":
        return via, _dtypes.to_torch(arg)
    raise bad_recipe(d, coll, dtype, None, f"{via}:{arg}" if arg else via)


def broadcast(d: Dispatcher, t: torch.Tensor, root: int, like: Any, steps: Steps, depth: int = 0) -> None:
    if d.is_native(Collective.BROADCAST, t.dtype):
        b = _dense(t)
        steps.works.append(d.group.broadcast([b], options("broadcast", like=like, root=root)))
        _copy_back(steps, t, b)
        return
    via, target = moving_recipe(d, Collective.BROADCAST, t.dtype, depth)
    if via == "bitcast":
        at_root = d.rank == root
        units, back = _units(t, target, fill=at_root)
        d.broadcast(units, root, like, steps, depth + 1)
        if not at_root:
            _then(steps, back)
    else:
        w = t.to(target, memory_format=torch.contiguous_format)
        d.broadcast(w, root, like, steps, depth + 1)
        steps.finish.append(partial(t.copy_, w))


def all_gather(d: Dispatcher, outs: list[torch.Tensor], inp: torch.Tensor, like: Any, steps: Steps,
               depth: int = 0) -> None:
    if d.is_native(Collective.ALL_GATHER, inp.dtype):
        bufs = [_dense(o) for o in outs]
        steps.works.append(d.group.allgather([bufs], [_dense(inp)], options("allgather", like=like)))
        for o, b in zip(outs, bufs, strict=True):
            _copy_back(steps, o, b)
        return
    via, target = moving_recipe(d, Collective.ALL_GATHER, inp.dtype, depth)
    _gather_as(via, target, outs, inp, steps, lambda o, i: d.all_gather(o, i, like, steps, depth + 1))


def gather(d: Dispatcher, outs: list[torch.Tensor], inp: torch.Tensor, root: int, like: Any, steps: Steps,
           depth: int = 0) -> None:
    """``outs`` has one tensor per rank on ``root`` and is empty elsewhere."""
    if d.is_native(Collective.GATHER, inp.dtype):
        # Flat views: every rank's element count was checked equal (process group); libraries
        # compare shapes, which may legitimately differ (e.g. (2, 3) into (6,)).
        bufs = [_dense(o) for o in outs]
        steps.works.append(d.group.gather([[_flat1d(b) for b in bufs]] if d.rank == root else [],
                                             [_flat1d(_dense(inp))], options("gather", like=like, root=root)))
        for o, b in zip(outs, bufs, strict=True):
            _copy_back(steps, o, b)
        return
    via, target = moving_recipe(d, Collective.GATHER, inp.dtype, depth)
    _gather_as(via, target, outs, inp, steps, lambda o, i: d.gather(o, i, root, like, steps, depth + 1))


def _gather_as(via: str, target: torch.dtype, outs: list[torch.Tensor], inp: torch.Tensor, steps: Steps,
               gather: Callable[[list[torch.Tensor], torch.Tensor], None]) -> None:
    """all_gather's and gather's emulation: ``gather(outs, inp)`` on stand-ins of dtype ``target``
    (``via`` "bitcast": the same bytes as ``target`` units; else widened to it), copied back into
    ``outs`` when the works end."""
    if via == "bitcast":
        src, _ = _units(inp, target)
        staged = [_units(o, target, fill=False) for o in outs]
        gather([u for u, _ in staged], src)
        for _, back in staged:
            _then(steps, back)
    else:
        wide = [torch.empty(o.shape, dtype=target, device=o.device) for o in outs]
        gather(wide, inp.to(target))
        for o, w in zip(outs, wide, strict=True):
            steps.finish.append(partial(o.copy_, w))


def scatter(d: Dispatcher, out: torch.Tensor, ins: list[torch.Tensor], root: int, like: Any, steps: Steps,
            depth: int = 0) -> None:
    """``ins`` has one tensor per rank on ``root`` and is empty elsewhere."""
    if d.is_native(Collective.SCATTER, out.dtype):
        b = _dense(out)
        steps.works.append(d.group.scatter([_flat1d(b)],
                                              [[_flat1d(_dense(x)) for x in ins]] if d.rank == root else [],
                                              options("scatter", like=like, root=root)))
        _copy_back(steps, out, b)
        return
    via, target = moving_recipe(d, Collective.SCATTER, out.dtype, depth)
    if via == "bitcast":
        dst, back = _units(out, target, fill=False)
        d.scatter(dst, [_units(x, target)[0] for x in ins], root, like, steps, depth + 1)
        _then(steps, back)
    else:
        w = torch.empty(out.shape, dtype=target, device=out.device)
        d.scatter(w, [x.to(target) for x in ins], root, like, steps, depth + 1)
        steps.finish.append(partial(out.copy_, w))


def all_to_all(d: Dispatcher, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               like: Any, steps: Steps, depth: int = 0) -> None:
    """``all_to_all_single``: split ``inp`` along dim 0 by ``in_splits`` (equal when empty)."""
    if d.is_native(Collective.ALL_TO_ALL, inp.dtype):
        b = _dense(out)
        steps.works.append(d.group.alltoall_base(b, _dense(inp), list(out_splits), list(in_splits),
                                                    options("alltoall", like=like)))
        _copy_back(steps, out, b)
        return
    via, target = moving_recipe(d, Collective.ALL_TO_ALL, inp.dtype, depth)
    if via != "bitcast":
        w = torch.empty(out.shape, dtype=target, device=out.device)
        d.all_to_all(w, inp.to(target), out_splits, in_splits, like, steps, depth + 1)
        steps.finish.append(partial(out.copy_, w))
        return

    def chunk_bytes(splits: list[int], t: torch.Tensor) -> list[int]:
        """Bytes of each rank's chunk: ``splits`` rows of dim 0, or equal parts when empty."""
        if not splits:
            return [t.numel() * t.element_size() // d.size] * d.size
        row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 1
        return [s * row * t.element_size() for s in splits]

    width = target.itemsize
    if inp.element_size() % width == 0:
        # Flat views of the same bytes; each chunk is a whole number of target elements.
        b = _dense(out)
        d.all_to_all(_flat_view(b, target), _flat_view(_dense(inp), target),
                        [n // width for n in chunk_bytes(out_splits, out)] if out_splits else [],
                        [n // width for n in chunk_bytes(in_splits, inp)] if in_splits else [],
                        like, steps, depth + 1)
        _copy_back(steps, out, b)
        return
    # Narrower than the target: every chunk is padded to whole target elements on its own (the
    # sender and the receiver of a chunk agree on its byte count, so on its padded length), the
    # padded chunks travel with explicit splits, and each received chunk is cut back.
    send_bytes, recv_bytes = chunk_bytes(in_splits, inp), chunk_bytes(out_splits, out)
    pad = [-(-n // width) * width for n in send_bytes]
    rpad = [-(-n // width) * width for n in recv_bytes]
    src = _dense(inp).reshape(-1).view(torch.uint8)
    send = torch.zeros(sum(pad), dtype=torch.uint8, device=inp.device)
    at = off = 0
    for n, p in zip(send_bytes, pad, strict=True):
        send[at:at + n].copy_(src[off:off + n])
        at, off = at + p, off + n
    recv = torch.empty(sum(rpad), dtype=torch.uint8, device=out.device)
    d.all_to_all(recv.view(target), send.view(target), [p // width for p in rpad], [p // width for p in pad],
                    like, steps, depth + 1)
    b = _dense(out)
    dst = b.reshape(-1).view(torch.uint8)

    def cut_back() -> None:
        at = off = 0
        for n, p in zip(recv_bytes, rpad, strict=True):
            dst[off:off + n].copy_(recv[at:at + n])
            at, off = at + p, off + n
        if b is not out:
            out.copy_(b)

    steps.finish.append(cut_back)


def empty_p2p(d: Dispatcher, t: torch.Tensor, depth: int) -> torch.Tensor | None:
    """The one-element stand-in for an empty message, or None when ``t`` is not empty.

    gloo's receive from any source fails an enforce on an empty message (the sender then
    waits out the timeout), so every empty message travels as one element of
    ``_p2p_unit``, sent and received alike: both ends hold empty tensors, both swap them.
    The tensor's own dtype is still looked up first, so a refused dtype is refused even when
    empty (on both ends alike: the table is shared)."""
    if depth or t.numel():
        return None
    cell = d.cell(Collective.SEND_RECV, t.dtype)
    if cell.support is Support.REFUSED:
        raise refuse(d, Collective.SEND_RECV, t.dtype, None, cell.note or "refused")
    unit = p2p_unit(d) or t.dtype
    return torch.zeros(1, dtype=unit, device=t.device)


def send(d: Dispatcher, t: torch.Tensor, dst: int, tag: int, steps: Steps, depth: int = 0) -> None:
    stand_in = empty_p2p(d, t, depth)
    if stand_in is not None:
        t, depth = stand_in, depth + 1
    if d.is_native(Collective.SEND_RECV, t.dtype):
        steps.works.append(d.group.send([_dense(t)], dst, tag))
        return
    via, target = moving_recipe(d, Collective.SEND_RECV, t.dtype, depth)
    if via == "bitcast":
        d.send(_units(t, target)[0], dst, tag, steps, depth + 1)
    else:
        d.send(t.to(target), dst, tag, steps, depth + 1)


def recv(d: Dispatcher, t: torch.Tensor, src: int | None, tag: int, steps: Steps, depth: int = 0) -> None:
    """Receive into ``t`` from ``src`` (None: from any source; ``steps.source`` then tells who)."""
    stand_in = empty_p2p(d, t, depth)
    if stand_in is not None:
        t, depth = stand_in, depth + 1  # the element lands in the stand-in; ``t`` has nothing to fill
    if d.is_native(Collective.SEND_RECV, t.dtype):
        b = _dense(t)
        if src is None:
            w = d.group.recv_anysource([b], tag)
            steps.source = w
        else:
            w = d.group.recv([b], src, tag)
        steps.works.append(w)
        _copy_back(steps, t, b)
        return
    via, target = moving_recipe(d, Collective.SEND_RECV, t.dtype, depth)
    if via == "bitcast":
        units, back = _units(t, target, fill=False)
        d.recv(units, src, tag, steps, depth + 1)
        _then(steps, back)
    else:
        w = torch.empty(t.shape, dtype=target, device=t.device)
        d.recv(w, src, tag, steps, depth + 1)
        steps.finish.append(partial(t.copy_, w))



def p2p_unit(d: Dispatcher) -> torch.dtype | None:
    """What an empty message travels as: the first dtype the library sends natively, so it
    depends only on the table -- sender and receiver pick the same, whatever the message's dtype."""
    if not d.p2p_unit_known:
        native = [n for n in _dtypes.ALL if d.table.lookup(Collective.SEND_RECV, n).support is Support.NATIVE]
        d.p2p_unit = _dtypes.to_torch(native[0]) if native else None
        d.p2p_unit_known = True
    return d.p2p_unit
