"""Built-in gradient compressors, contributed through the contract like any plugin's.

===========  =======  ======================================================================
 name        combine  what crosses the hop per tensor of n float32 elements
===========  =======  ======================================================================
 fp16        sum      n half floats, pre-divided by the number of peers (torch's fp16 hook)
 bf16        sum      n bfloat16
 topk        gather   the k = ⌈ratio·n⌉ largest magnitudes: k int32 indices + k values (int64
                      indices for a tensor of more than 2^31 elements)
 sign        gather   1 bit per element + one float32 scale (mean |x|), two-phase with a
                      server-side compression, as 1-bit Adam's compressed allreduce
 qsgd        gather   a signed level in [-s, s] per element (4, 8 or 16 bits) + one float32
                      scale per bucket, stochastic rounding (unbiased)
 powersgd    sum      P (rows × rank) then Q (cols × rank); 1-D tensors and matrices too small
                      to gain (torch's min_compression_rate) travel uncompressed
===========  =======  ======================================================================

Error feedback (topk, sign, powersgd by default; ``ef=0/1`` on each) is kept by the driver
(:mod:`vcga.compress`), exactly. Decoders use only element-wise operations and fixed-order sums
(:mod:`vcga.compress.exact`), so every rank decodes the same bits. This package imports only the
public core API (``vcga.contract``, ``vcga.compress``) and torch only inside methods. fp16, bf16,
top-k, sign and the registration live here; QSGD (with its host loops) in :mod:`.qsgd`, PowerSGD
in :mod:`.powersgd`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vcga import dtypes as _dtypes
from vcga.contract import Combine, CompressContext, Compressor, CompressorOption, CompressorSpec, hookimpl

from ._shapes import compressed_numel
from ._shapes import itemsize as _itemsize
from ._shapes import numel as _numel
from .powersgd import PowerSGD
from .qsgd import QSGD

if TYPE_CHECKING:
    import torch

__all__ = ["vcga_compressors"]


# -- option parsers (each raises ValueError saying what is allowed) --------------------------------


def _flag(v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("0 or 1")


def _checked(cast: Any, ok: Any, what: str) -> Any:
    """An option parser: ``cast(v)`` if it parses and ``ok`` accepts it, else ValueError(``what``)."""
    def parse(v: str) -> Any:
        try:
            x = cast(v)
        except ValueError:
            raise ValueError(what) from None
        if not ok(x):
            raise ValueError(what)
        return x
    return parse


def _int_range(lo: int, hi: int) -> Any:
    return _checked(int, lambda i: lo <= i <= hi, f"an integer from {lo} to {hi}")


_ratio = _checked(float, lambda f: 0 < f <= 1, "a number in (0, 1]")
_pos_float = _checked(float, lambda f: f >= 0 and math.isfinite(f), "a number >= 0")


def _choice(*names: str) -> Any:
    def parse(v: str) -> str:
        if v not in names:
            raise ValueError("one of " + ", ".join(names))
        return v
    return parse


def _ef(default: bool) -> CompressorOption:
    return CompressorOption(default, _flag, "error feedback: keep what was not sent, add it to the next step (0/1)")


# -- fp16 / bf16 --------------------------------------------------------------------------------------


class Cast(Compressor):
    """Send the tensor in a narrower float (torch's fp16_compress_hook / bf16_compress_hook)."""

    combine = Combine.SUM

    def __init__(self, dtype: str, ef: bool, prescale: bool) -> None:
        self.dtype, self.error_feedback, self.prescale = dtype, ef, prescale  # dtype: canonical name

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return _numel(shape) * _itemsize(self.dtype)

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext,
                 round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        # fp16 holds at most 65504: divide by the peers first so that their sum cannot overflow
        y = x / ctx.peers if self.prescale else x
        return [y.to(_dtypes.to_torch(self.dtype)).contiguous()]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor:  # noqa: A002
        import torch

        y = payload[0].to(torch.float32) if payload[0].dtype != torch.float64 else payload[0]
        return y * ctx.peers if self.prescale else y


def _cast(name: str, dtype: str, prescale: bool) -> CompressorSpec:
    return CompressorSpec(
        name, f"send {dtype} (2 bytes per element){', pre-divided by the peers' if prescale else ''}",
        {"ef": _ef(False)}, lambda ef: Cast(dtype, ef, prescale))


# -- top-k ------------------------------------------------------------------------------------------


#: Where narrowing first pays (benchmarks/topk_select.py, one CPU thread; docs/benchmarks.md, "Top-k's
#: selection"): from 2^18 elements when
#: at most 1/32 of them are kept; a larger share (10%) only from 2^22 elements on.
_NARROW_MIN_N, _NARROW_MAX_SHARE, _NARROW_ANY_SHARE_N = 1 << 18, 1 / 32, 1 << 22


def largest(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest elements of the flat tensor ``a`` (in no particular order), the
    same set ``torch.topk(a, k)`` selects (up to which of equal values at the k-th are taken;
    a NaN counts as largest, as in ``torch.topk``).

    ``torch.topk`` over millions of elements on one CPU thread costs more than a slow link saves
    (docs/benchmarks.md, "Top-k's selection"). Deep Gradient Compression estimates the threshold
    from a sample (Lin et al. 2018, sec. 3.4, "hierarchical top-k"); here the estimate only narrows
    the search and the result stays exact: a strided sample (deterministic: every rank, every run
    the same) gives a threshold ``t`` expected to keep about 2k elements; when at least k are not
    below ``t``, every element of the k largest is among them (the k-th largest is then ≥ ``t``),
    and ``torch.topk`` over those candidates picks them. When the sample misjudged (fewer than k
    candidates), the whole tensor is searched."""
    import torch

    n = a.numel()
    if n < _NARROW_MIN_N or k > n / 8 or (k > n * _NARROW_MAX_SHARE and n < _NARROW_ANY_SHARE_N):
        return torch.topk(a, k, sorted=False).indices
    # 64 samples per 1/k of the tensor (6400 at 1%), at most a 16th of it: the sample's j-th largest
    # (j = 128 at 1%) keeps 2k ± 2k/sqrt(j), 2k ± 18%, of the whole tensor
    m = min(n // 16, max(4096, 64 * n // k))
    sample = a[::n // m]
    j = min(sample.numel(), math.ceil(2 * k * sample.numel() / n))
    t = torch.topk(sample, j, sorted=False).values.min()
    candidates = torch.lt(a, t).logical_not_().nonzero().squeeze(1)  # not below: NaNs are candidates
    if candidates.numel() < k:
        return torch.topk(a, k, sorted=False).indices
    return candidates[torch.topk(a[candidates], k, sorted=False).indices]


#: The most elements a tensor may have for its indices to travel as int32 (the largest index is
#: n - 1). Past it they travel as int64: int32 would wrap, and the peers would write the values
#: to the wrong elements without a word (one bucket past 2^31 elements: a 2^31-entry embedding).
INT32_INDEXED = 2 ** 31


def index_dtype(n: int) -> torch.dtype:
    """The dtype of top-k's indices into a tensor of ``n`` elements: every peer of an exchange
    compresses a share of the same size, so all of them choose the same one."""
    import torch

    return torch.int32 if n <= INT32_INDEXED else torch.int64


class TopK(Compressor):
    """The k largest magnitudes and their indices (Aji & Heafield 2017; Lin et al. 2018)."""

    combine = Combine.GATHER

    def __init__(self, ratio: float, ef: bool, server: bool) -> None:
        self.ratio, self.error_feedback, self.server = ratio, ef, server

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n))) if n else 0

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = _numel(shape)
        return self.k(n) * ((4 if n <= INT32_INDEXED else 8) + _itemsize(dtype))

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext,
                 round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        from vcga.compress import fused

        flat = x.reshape(-1)
        state["numel"] = flat.numel()
        k = self.k(flat.numel())
        if k and flat.dtype == torch.float32 and fused.usable(flat) and (select := _select_loop()):
            return _select(select, flat, k)
        return self._compress_ops(flat, k)

    @staticmethod
    def _compress_ops(flat: torch.Tensor, k: int) -> list[torch.Tensor]:
        """The payload through torch operations (any device, any dtype): the definition the host
        loop is checked against."""
        import torch

        idx = largest(flat.abs(), k)
        # ascending: the decoder's writes never depend on the library's order. Sorting k indices
        # costs k log k; marking them and reading the marks back costs n: from k > n/16 on, less
        # (benchmarks/topk_select.py times both)
        if k > flat.numel() // 16:
            mark = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
            mark[idx] = True
            idx = mark.nonzero().squeeze(1)
        else:
            idx, _ = torch.sort(idx)
        return [idx.to(index_dtype(flat.numel())), flat[idx].contiguous()]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor:  # noqa: A002
        import torch

        idx, val = payload
        n = compressed_numel(state, "topk")
        out = torch.zeros(n, dtype=val.dtype, device=val.device)
        out[idx.long()] = val  # indices are distinct: a plain write, no accumulation order
        return out

    def decompress_add(self, payload: list[torch.Tensor], total: torch.Tensor, state: dict[str, Any],
                       ctx: CompressContext) -> torch.Tensor:
        # k additions where the peer's payload has values, in place (decompress returns a tensor of
        # its own); a dense decode and addition would pass over every element twice per peer
        idx, val = payload
        idx, val = idx.long(), val.to(total.dtype)
        if total.device.type == "cpu":
            total.index_add_(0, idx, val)  # distinct indices: one addition each (the fastest on the host)
        else:  # index_add_ refuses torch.use_deterministic_algorithms on CUDA; this one is deterministic
            total.index_put_((idx,), val, accumulate=True)
        return total


def _select(select: Any, flat: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Top-k's payload through the host loop (float32 on the CPU): ascending indices and values."""
    import torch

    idx = torch.empty(k, dtype=index_dtype(flat.numel()))
    val = torch.empty(k, dtype=torch.float32)
    x = flat.numpy()
    if select(x.view("int32"), k, idx.numpy(), val.numpy(), x) != k:  # pragma: no cover - a broken loop
        raise RuntimeError("topk: the selection loop did not select k elements")
    return [idx, val]


def _select_loop() -> Any:
    """The selection loop, compiled and self-checked once per process; None: the torch path."""
    from vcga.compress import fused

    return fused.checked("topk", _build_select, _select_self_check)


def _build_select() -> Any:
    """Top-k of a float32 tensor by a radix select on its magnitudes' bits, in linear time.

    Clearing the sign bit of an IEEE 754 float32 leaves an integer that orders as the magnitude
    does (a NaN above infinity: largest, as in ``torch.topk``). Three histogram passes (11, 10 and
    10 bits) find the k-th largest magnitude ``t`` exactly; a last pass, in index order, takes every
    element above ``t`` and, of those equal to it, the first ones, until k are taken -- the indices
    come out ascending, with no sort: a fraction of the time of ``torch.topk`` plus the ordering on
    one CPU thread (docs/benchmarks.md, "Top-k's selection"). It selects what the torch path selects
    (up to which of equal magnitudes at the k-th it takes)."""
    import numba
    import numpy as np

    # numba's on-disk cache records the module's import name (see qsgd._qsgd_loops)
    jit = numba.njit(cache=__name__ == "vcga.plugins.compressors", nogil=True, boundscheck=False, error_model="numpy")

    # One function, calling no other jitted one: numba's cache keys a closure by what it refers to,
    # and a call to another closure's dispatcher missed the cache in every new process (a 1.5 s
    # compile per rank).
    @jit
    def select(bits: Any, k: int, idx: Any, val: Any, x: Any) -> int:  # pragma: no cover - compiled
        n = bits.shape[0]
        need = k
        t = 0  # the k-th largest magnitude's bits found so far, most significant first
        for shift in (20, 10, 0):  # the top 11 bits (exponent, 3 mantissa bits), then 10, then 10
            width = 2048 if shift == 20 else 1024
            above = 31 if shift == 20 else shift + 10  # the bits already found: none at first
            h = np.zeros(width, np.int64)
            for i in range(n):
                m = bits[i] & 0x7FFFFFFF
                if (m >> above) == t:
                    h[(m >> shift) & (width - 1)] += 1
            d = width - 1  # the bucket, from the top, that holds the need-th largest
            while h[d] < need:
                need -= h[d]
                d -= 1
            t = (t << 10) | d
        j = 0  # t is the k-th largest magnitude; ``need`` of the elements equal to it are taken
        for i in range(n):
            m = bits[i] & 0x7FFFFFFF
            if m > t or (m == t and need > 0):
                if m == t:
                    need -= 1
                idx[j] = i
                val[j] = x[i]
                j += 1
        return j

    return select


def _select_self_check(select: Any) -> str | None:
    """None when the loop selects the torch path's elements, in its order, else what differed:
    magnitudes 10^-30..10^30, subnormals, zeros of both signs, an infinity and a NaN (no two equal
    magnitudes, so that both paths must take the same set), at shares from one element to all."""
    import torch

    from vcga.compress.fused import probe_values

    for n in (1, 7, 4096, 70_001):
        g = torch.Generator().manual_seed(n)
        v = probe_values(torch.float32, n, seed=n)
        v = torch.unique(v.abs())  # distinct magnitudes
        v = v[torch.randperm(v.numel(), generator=g)] * torch.where(torch.rand(v.numel(), generator=g) < 0.5, -1.0, 1.0)
        if v.numel() > 8:
            v[3], v[5] = float("inf"), float("nan")
        for k in sorted({min(2, v.numel()), 1, max(1, v.numel() // 100), max(1, v.numel() // 10), v.numel()}):
            want = TopK._compress_ops(v, k)
            got = _select(select, v, k)
            if not torch.equal(got[0], want[0]) or not torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)):
                return f"topk selection, n={v.numel()} k={k}"
    return None


# -- sign (1-bit) ------------------------------------------------------------------------------------


_BITS = (128, 64, 32, 16, 8, 4, 2, 1)


def _packbits(b: torch.Tensor) -> torch.Tensor:
    import torch

    n = b.numel()
    pad = (-n) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = torch.tensor(_BITS, dtype=torch.uint8, device=b.device)
    return (b.view(-1, 8).to(torch.uint8) * w).sum(1, dtype=torch.uint8) if b.numel() else b.to(torch.uint8)


def _unpackbits(p: torch.Tensor, n: int) -> torch.Tensor:
    import torch

    w = torch.tensor(_BITS, dtype=torch.uint8, device=p.device)
    return (p.view(-1, 1).bitwise_and(w) != 0).reshape(-1)[:n]


class Sign(Compressor):
    """1 bit per element and one scale (the mean magnitude), with error feedback on the workers
    and, in the two-phase exchange, on the servers (Seide et al. 2014; 1-bit Adam, Tang et al. 2021)."""

    combine = Combine.GATHER

    def __init__(self, ef: bool, server: bool) -> None:
        self.error_feedback, self.server = ef, server

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = _numel(shape)
        return -(-n // 8) + 4

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext,
                 round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        flat = x.reshape(-1)
        state["numel"] = flat.numel()
        # mean |x| minimises ||x - s·sign(x)||²; 1-bit Adam uses the RMS, which overshoots. Summed in
        # float64 by the kernel (the bits of .to(float64).mean(), without the float64 copy)
        scale = (flat.abs().sum(dtype=torch.float64) / flat.numel()).to(torch.float32).reshape(1) if flat.numel() \
            else torch.zeros(1, dtype=torch.float32, device=flat.device)
        if flat.device.type == "cpu":  # numpy's packbits has _packbits' bit order (first element high)
            import numpy as np  # and is many times faster than the torch expressions

            # numpy has no bfloat16: the test in torch then (slower)
            ge = (flat >= 0).numpy() if flat.dtype == torch.bfloat16 else flat.detach().numpy() >= 0
            return [torch.from_numpy(np.packbits(ge)), scale]
        return [_packbits(flat >= 0), scale]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor:  # noqa: A002
        import torch

        bits, scale = payload
        n = compressed_numel(state, "sign")
        if bits.device.type == "cpu":  # the same operations in numpy, in place: one buffer, not four
            import numpy as np

            out = np.unpackbits(bits.numpy(), count=n).astype(np.float32)
            out *= 2
            out -= 1  # exact: ±1
            out *= scale.numpy()  # element-wise: the same bits on every rank
            return torch.from_numpy(out)
        pm = _unpackbits(bits, n).to(torch.float32) * 2 - 1  # exact: ±1
        return pm * scale  # element-wise: the same bits on every rank


# -- registration ----------------------------------------------------------------------------------------


def _specs() -> list[CompressorSpec]:
    server = CompressorOption(False, _flag, "two-phase exchange with a server-side compression (0/1)")
    return [
        _cast("fp16", "float16", prescale=True),
        _cast("bf16", "bfloat16", prescale=False),
        CompressorSpec("topk", "the largest ratio·n magnitudes with their indices, error feedback",
                       {"ratio": CompressorOption(0.01, _ratio, "fraction of elements sent, in (0, 1]"),
                        "ef": _ef(True), "server": server},
                       lambda ratio, ef, server: TopK(ratio, ef, server)),
        CompressorSpec("sign", "1 bit per element and a scale; worker and server error feedback (1-bit Adam)",
                       {"ef": _ef(True),
                        "server": CompressorOption(True, _flag, "two-phase exchange with server-side compression "
                                                   "and error feedback, as 1-bit Adam (0/1)")},
                       lambda ef, server: Sign(ef, server)),
        CompressorSpec("qsgd", "stochastic quantization to s levels per bucket, unbiased",
                       {"levels": CompressorOption(16, _int_range(1, 32767), "quantization levels s per sign"),
                        "bucket": CompressorOption(512, _int_range(1, 1 << 24), "elements per scale"),
                        "norm": CompressorOption("max", _choice("max", "l2"), "the bucket's scale: max or l2 "
                                                 "(the paper's)"),
                        "ef": _ef(False), "server": server},
                       lambda levels, bucket, norm, ef, server: QSGD(levels, bucket, norm, ef, server)),
        CompressorSpec("powersgd", "rank-r power iteration per matrix, warm start, error feedback",
                       {"rank": CompressorOption(1, _int_range(1, 1024), "approximation rank"),
                        "warm": CompressorOption(True, _flag, "reuse last step's Q (0/1)"),
                        "ef": _ef(True),
                        "min_rate": CompressorOption(2.0, _pos_float, "compress a matrix only when it shrinks "
                                                     "by more than this (torch's min_compression_rate)"),
                        "eps": CompressorOption(0.0, _pos_float, "added to column norms when orthonormalising"),
                        "iters": CompressorOption(1, _int_range(1, 16), "power iterations per step (each sends P "
                                                  "and Q once more: bytes x iters)")},
                       lambda rank, warm, ef, min_rate, eps, iters: PowerSGD(rank, warm, ef, min_rate, eps, iters)),
    ]


@hookimpl
def vcga_compressors() -> list[CompressorSpec]:
    return _specs()
