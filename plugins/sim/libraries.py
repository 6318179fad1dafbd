"""The vendor libraries' behaviour, as their torch process groups expose it: what each refuses,
performs natively, or mangles (no torch here; :mod:`vcga.plugins.sim.group` applies it)."""

from __future__ import annotations

from vcga.contract import BITWISE, ReduceOp

__all__ = ["LIBRARIES", "SCALAR_TYPE", "VendorLibrary"]

#: c10 ScalarType names, as vendor error messages print them.
SCALAR_TYPE = {
    "bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short", "uint16": "UInt16", "int32": "Int",
    "uint32": "UInt32", "int64": "Long", "uint64": "UInt64", "float16": "Half", "bfloat16": "BFloat16",
    "float32": "Float", "float64": "Double", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
    "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2",
}


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

    Read-only after ``__init__``; a plain class, not a frozen dataclass, because a job's rank
    defines it whenever the simulated vendors are chosen, and the dataclass machinery compiled
    its methods at every start (about 1.4 ms).
    """

    __slots__ = ("name", "moves", "reduces", "dtype_error", "reduce_dtype_error", "op_errors", "avg", "premul",
                 "premul_error", "int_avg_trunc", "as_float32", "as_bytes", "reduce_wide", "source")

    name: str
    moves: frozenset[str]
    reduces: frozenset[str]
    dtype_error: tuple[type[Exception], str]
    reduce_dtype_error: tuple[type[Exception], str] | None
    op_errors: dict[ReduceOp, tuple[type[Exception], str]]
    avg: str
    premul: frozenset[str]
    premul_error: tuple[type[Exception], str]
    int_avg_trunc: bool
    as_float32: frozenset[str]
    as_bytes: frozenset[str]
    reduce_wide: dict[str, str]
    source: str

    def __init__(self, *, name: str, moves: frozenset[str], reduces: frozenset[str],
                 dtype_error: tuple[type[Exception], str], reduce_dtype_error: tuple[type[Exception], str] | None,
                 op_errors: dict[ReduceOp, tuple[type[Exception], str]], avg: str, premul: frozenset[str],
                 premul_error: tuple[type[Exception], str], int_avg_trunc: bool = False,
                 as_float32: frozenset[str] = frozenset(), as_bytes: frozenset[str] = frozenset(),
                 reduce_wide: dict[str, str] | None = None, source: str = "") -> None:
        values = (name, moves, reduces, dtype_error, reduce_dtype_error, op_errors, avg, premul, premul_error,
                  int_avg_trunc, as_float32, as_bytes, dict(reduce_wide or {}), source)
        for slot, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, slot, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"VendorLibrary is read-only: cannot set {name!r}")

    def __repr__(self) -> str:
        return f"VendorLibrary({self.name})"


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
        op_errors={**_bitwise_errors(ValueError, "CNCL"),
                   ReduceOp.AVG: (ValueError, "Cannot use ReduceOp.AVG with CNCL")},
        avg="refuse",
        premul=frozenset(),
        premul_error=(ValueError, "Unhandled ReduceOp"),
        as_float32=frozenset({"float64"}),
        source="Cambricon/torch_mlu torch_mlu/csrc/framework/distributed/process_group_cncl.cpp "
               "(cncl_data_type: kDouble -> cnclFloat, getCnclReduceOp)",
    ),
}
