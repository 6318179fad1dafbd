"""Simulated vendors: CPU stand-ins for NCCL, HCCL and CNCL that run on gloo.

``sim-nccl``, ``sim-hccl`` and ``sim-cncl`` report their vendor and device type "cpu", and carry
exactly the capability table of their real counterpart (the facts in design.md, cross-checked
against the real plugins' tables by tests/test_vendor_tables.py). Their native process group
behaves like the vendor library seen through its torch process group: it refuses what the vendor
refuses, with the vendor's message; performs natively what the vendor performs even where gloo
cannot (NCCL's PREMUL_SUM and fp8 data movement, HCCL's AVG); and mangles what the vendor mangles
(CNCL moves and reduces fp64 as fp32) -- so VCGA's dispatch is tested against the library's real
behaviour, not against gloo's. Each rule cites the vendor source it mirrors (:data:`LIBRARIES`).

``VCGA_SIM_VENDORS=nccl:2,hccl:2`` (config key ``sim_vendors``) gives ranks 0-1 ``sim-nccl`` and
ranks 2-3 ``sim-hccl``: how mixed-vendor jobs are tested on one CPU machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from vcga import dtypes
from vcga.config import Config, gloo_env, parse_sim_vendors
from vcga.contract import (
    BITWISE,
    MOVING,
    REDUCING,
    Backend,
    CapabilityTable,
    ProbeResult,
    ReduceOp,
    hookimpl,
)
from vcga.cpu import CpuAccelerator
from vcga.errors import VcgaConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

FLOATS_NO_FP8 = ("float16", "bfloat16", "float32", "float64")

# --- the vendors' facts (design.md "Facts to start from"; sources cited in plugins/{nccl,hccl,mlu}.py) ---

def nccl_table(name: str = "sim-nccl") -> CapabilityTable:
    """NCCL through torch's ProcessGroupNCCL."""
    moved = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
             "float8_e4m3fn", "float8_e5m2")
    reduced = ("uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
    return (
        CapabilityTable.builder(name)
        .native(MOVING, moved, note="ProcessGroupNCCL getNcclDataType")
        .native(REDUCING, reduced, [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                note="ncclSum/ncclProd/ncclMin/ncclMax")
        .native(REDUCING, FLOATS_NO_FP8, [ReduceOp.AVG, ReduceOp.PREMUL_SUM], note="ncclAvg; ncclRedOpCreatePreMulSum")
        .native(REDUCING, ["bool"], [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.MIN],
                note="ProcessGroupNCCL maps bool SUM to ncclMax and PRODUCT to ncclMin")
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="NCCL has no bitwise reduce ops "
                "(torch: 'Cannot use ReduceOp.BAND with NCCL'); use gloo, or MAX/MIN for bool")
        .build()
    )


def hccl_table(name: str = "sim-hccl") -> CapabilityTable:
    """HCCL through torch_npu's ProcessGroupHCCL."""
    native_dt = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32")
    return (
        CapabilityTable.builder(name)
        .native(MOVING, native_dt, note="ProcessGroupHCCL getHcclDataType (bool/uint8 cast to int32)")
        .native(REDUCING, native_dt, [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                note="HcclReduceOp SUM/PROD/MIN/MAX; bool SUM mapped to MAX")
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="HCCL has no bitwise reduce ops "
                "(ProcessGroupHCCL rejects BAND/BOR/BXOR); use gloo, or MAX/MIN for bool")
        .build()
    )


def cncl_table(name: str = "sim-cncl") -> CapabilityTable:
    """CNCL through torch_mlu's ProcessGroupCNCL."""
    native_dt = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32")
    return (
        CapabilityTable.builder(name)
        .native(MOVING, native_dt, note="process_group_cncl getCnclDataType (bool as uint8)")
        .native(REDUCING, native_dt, [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                note="cnclSum/cnclProd/cnclMin/cnclMax; bool SUM mapped to MAX")
        .refuse(REDUCING, dtypes.ALL, BITWISE, note="CNCL has no bitwise reduce ops; use gloo, or MAX/MIN for bool")
        # CNCL maps double to cnclFloat: fp64 would silently be reduced (and moved) as fp32.
        .emulate(MOVING, ["float64"], via="bitcast:int64",
                 note="CNCL maps double to cnclFloat; VCGA moves fp64 bytes as int64")
        .emulate(REDUCING, ["float64"], [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG,
                                          ReduceOp.PREMUL_SUM],
                 via="gather_then_reduce", note="CNCL reduces double as float; VCGA reduces fp64 on the host")
        .build()
    )


VENDORS = {
    # key in VCGA_SIM_VENDORS: (backend name, vendor, dist backend it stands for, table)
    "nccl": ("sim-nccl", "nvidia", "nccl", nccl_table),
    "hccl": ("sim-hccl", "huawei", "hccl", hccl_table),
    "cncl": ("sim-cncl", "cambricon", "cncl", cncl_table),
}


class SimBackend(Backend):
    """A simulated vendor: the vendor's capability table and behaviour, gloo underneath."""

    device_type = "cpu"
    dist_backend = "gloo"
    priority = -100
    simulated = True

    def __init__(self, key: str) -> None:
        self.key = key
        self.name, self.vendor, self.stands_for, self._table_fn = VENDORS[key]
        self._table: CapabilityTable | None = None

    def probe(self) -> ProbeResult:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as e:
            return ProbeResult(False, f"torch is not importable: {e}")
        if not (dist.is_available() and dist.is_gloo_available()):
            return ProbeResult(False, "simulated vendors run on gloo, which this torch build lacks")
        return ProbeResult(True, f"simulated {self.stands_for.upper()} on gloo (CPU)", 1,
                           {"torch": torch.__version__})

    def accelerator(self) -> CpuAccelerator:
        return CpuAccelerator()

    def capabilities(self) -> CapabilityTable:
        if self._table is None:
            self._table = self._table_fn(self.name)
        return self._table

    def create_process_group(self, store: dist.Store, rank: int, world_size: int,
                             timeout: timedelta) -> dist.ProcessGroup:
        """A gloo group behind the vendor library's rules (see :class:`VendorLibrary`)."""
        import torch.distributed as dist

        gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return vendor_group_class()(LIBRARIES[self.key], gloo, rank, world_size)

    def vendor_env(self, config: Config) -> dict[str, str]:
        # The bytes move through gloo, whichever library is simulated: gloo's variables.
        return gloo_env(config)

    def describe(self) -> dict:
        d = super().describe()
        d["stands_for"] = self.stands_for
        return d


def rank_layout(spec: str, world_size: int) -> list[str]:
    """Backend name per rank for a ``sim_vendors`` spec; counts must add up to the world size."""
    parts = parse_sim_vendors(spec)
    layout = [VENDORS[v][0] for v, n in parts for _ in range(n)]
    if len(layout) != world_size:
        raise VcgaConfigError("sim_vendors", spec,
                              f"vendor counts that add up to the world size ({world_size}); they add up to {len(layout)}")
    return layout


@hookimpl
def vcga_backends() -> list[Backend]:
    return [SimBackend(k) for k in VENDORS]


@hookimpl
def vcga_rank_backend(rank: int, world_size: int, config: Config) -> str | None:
    if not config.sim_vendors:
        return None
    return rank_layout(config.sim_vendors, world_size)[rank]


# ---------------------------------------------------------------------------------------------------
# The vendor libraries' behaviour, as their torch process groups expose it
# ---------------------------------------------------------------------------------------------------

#: c10 ScalarType names, as vendor error messages print them.
_SCALAR_TYPE = {
    "bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short", "uint16": "UInt16", "int32": "Int",
    "uint32": "UInt32", "int64": "Long", "uint64": "UInt64", "float16": "Half", "bfloat16": "BFloat16",
    "float32": "Float", "float64": "Double", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
    "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2",
}


@dataclass(frozen=True)
class VendorLibrary:
    """How one vendor library, through its torch process group, treats each call.

    :param name: "NCCL", "HCCL" or "CNCL" (as in the vendor's error messages).
    :param moves: dtypes the library accepts at all (data movement).
    :param reduces: dtypes it accepts in reductions.
    :param dtype_error: ``(exception type, message)`` for a dtype it does not accept;
        ``{type}`` in the message is replaced by the c10 ScalarType name.
    :param reduce_dtype_error: the same for a movable dtype it will not reduce, or None.
    :param op_errors: reduce op -> ``(exception type, message)`` for ops it rejects.
    :param avg: "native" (the library averages), "sum_div" (the torch plugin sums, then divides
        with true division) or "refuse".
    :param premul: dtypes PREMUL_SUM works on (the plugin scales, the library sums); others raise
        ``premul_error``.
    :param int_avg_trunc: integer AVG divides with truncation (NCCL's ncclAvg on integers).
    :param as_float32: dtypes the library silently handles as fp32 (CNCL maps double to cnclFloat).
    :param as_bytes: dtypes the library moves that gloo cannot: moved as uint8 bytes here.
    :param reduce_wide: dtypes the library reduces that gloo cannot: reduced here in a wider dtype
        gloo has and cast back (exact for integers, wrap-around included).
    :param source: where these facts come from.
    """

    name: str
    moves: frozenset[str]
    reduces: frozenset[str]
    dtype_error: tuple[type[Exception], str]
    reduce_dtype_error: tuple[type[Exception], str] | None
    op_errors: dict[ReduceOp, tuple[type[Exception], str]]
    avg: str
    premul: frozenset[str]
    premul_error: tuple[type[Exception], str]
    int_avg_trunc: bool = False
    as_float32: frozenset[str] = frozenset()
    as_bytes: frozenset[str] = frozenset()
    reduce_wide: dict[str, str] = field(default_factory=dict)
    source: str = ""


def _bitwise_errors(exc: type[Exception], lib: str) -> dict[ReduceOp, tuple[type[Exception], str]]:
    return {op: (exc, f"Cannot use ReduceOp.{op.value} with {lib}") for op in BITWISE}


_PREMUL_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

LIBRARIES: dict[str, VendorLibrary] = {
    "nccl": VendorLibrary(
        name="NCCL",
        moves=frozenset({"bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                         "float8_e4m3fn", "float8_e5m2"}),
        reduces=frozenset({"bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32",
                           "float64"}),
        dtype_error=(TypeError, "Input tensor data type is not supported for NCCL process group: {type}"),
        reduce_dtype_error=(RuntimeError, "Float8 dtypes are not currenlty supported for NCCL reductions"),
        op_errors=_bitwise_errors(ValueError, "NCCL"),
        avg="native",
        premul=_PREMUL_FLOATS,
        premul_error=(TypeError, "PreMulSum Data type must be half, float, bfloat16 or double"),
        int_avg_trunc=True,
        as_bytes=frozenset({"float8_e4m3fn", "float8_e5m2"}),
        source="pytorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (getNcclDataType, getNcclReduceOp, "
               "unpackPreMulSum), NCCL ncclAvg",
    ),
    "hccl": VendorLibrary(
        name="HCCL",
        moves=frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32"}),
        reduces=frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32"}),
        dtype_error=(RuntimeError, "Unsupported data type for HCCL process group"),
        reduce_dtype_error=None,
        op_errors=_bitwise_errors(RuntimeError, "HCCL"),
        avg="sum_div",
        premul=_PREMUL_FLOATS,
        premul_error=(RuntimeError, "PreMulSum Data type must be half, float, bfloat16 or double"),
        as_bytes=frozenset({"int16"}),
        reduce_wide={"int16": "int32"},
        source="Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp (getHcclReduceOp, "
               "checkSupportedDataType, allreduce: bool/uint8 via int32, AVG as sum then div_)",
    ),
    "cncl": VendorLibrary(
        name="CNCL",
        moves=frozenset({"bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"}),
        reduces=frozenset({"bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"}),
        dtype_error=(RuntimeError, "Unsupported data type for CNCL process group"),
        reduce_dtype_error=None,
        op_errors={**_bitwise_errors(ValueError, "CNCL"), ReduceOp.AVG: (ValueError, "Cannot use ReduceOp.AVG with CNCL")},
        avg="refuse",
        premul=frozenset(),
        premul_error=(ValueError, "Unhandled ReduceOp"),
        as_float32=frozenset({"float64"}),
        source="Cambricon/torch_mlu torch_mlu/csrc/framework/distributed/process_group_cncl.cpp "
               "(cncl_data_type: kDouble -> cnclFloat, getCnclReduceOp)",
    ),
}

_VENDOR_GROUP: type | None = None


def _keep_rows(t: Any, staged: Any) -> Any:
    """``staged`` (``t`` as the library sees it) with ``t``'s dim 0: all-to-all splits count rows.

    Moving a multi-byte dtype as bytes lengthens the last dimension; for a 1-D tensor that is
    dim 0, so view each row as bytes instead.
    """
    if staged.dim() == t.dim() and (t.dim() == 0 or staged.shape[0] == t.shape[0]):
        return staged
    import torch

    return t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def vendor_group_class() -> type:
    """The simulated vendor process group class (built on first use: it needs torch)."""
    global _VENDOR_GROUP
    if _VENDOR_GROUP is None:
        _VENDOR_GROUP = _build_vendor_group()
    return _VENDOR_GROUP


def _build_vendor_group() -> type:  # one class, one method per c10d collective
    import torch
    import torch.distributed as dist

    from vcga.pypg import PyWork, options, reduce_op_of

    class SimVendorGroup(dist.ProcessGroup):
        """A vendor library on gloo: its dtype and op rules, its conversions, its mangling.

        Implements the c10d methods a :mod:`vcga.pg.transport` group needs. A call the vendor
        rejects raises the vendor's exception type and message; a call it mangles returns the
        mangled result, silently, as the vendor does.
        """

        def __init__(self, lib: VendorLibrary, gloo: Any, rank: int, size: int) -> None:
            super().__init__(rank, size)
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
                    raise exc(msg.format(type=_SCALAR_TYPE.get(name, name)))
                if reducing and name not in self.lib.reduces:
                    exc, msg = self.lib.reduce_dtype_error or self.lib.dtype_error
                    raise exc(msg.format(type=_SCALAR_TYPE.get(name, name)))

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

        def allreduce(self, tensors: list[Any], opts: Any = None) -> Any:
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

        def reduce(self, tensors: list[Any], opts: Any = None) -> Any:
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

        def reduce_scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:
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

        def broadcast(self, tensors: list[Any], opts: Any = None) -> Any:
            opts = opts if opts is not None else options("broadcast")
            (t,) = tensors
            self._check([t], reducing=False)
            after: list[Any] = []
            work = self.gloo.broadcast([self._out(t, after)], options("broadcast", like=opts, root=opts.rootRank))
            return self._done(work, after, tensors)

        def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
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

        def gather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
            opts = opts if opts is not None else options("gather")
            (inp,) = inputs
            outs = outputs[0] if outputs else []
            self._check([inp, *outs], reducing=False)
            after: list[Any] = []
            bufs = [self._out(o, after) for o in outs]
            work = self.gloo.gather([bufs] if outputs else [], [self._in(inp)],
                                    options("gather", like=opts, root=opts.rootRank))
            return self._done(work, after, outs)

        def scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:
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

    return SimVendorGroup
