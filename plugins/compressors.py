"""Built-in gradient compressors, contributed through the contract like any plugin's.

===========  =======  ======================================================================
 name        combine  what crosses the hop per tensor of n float32 elements
===========  =======  ======================================================================
 fp16        sum      n half floats, pre-divided by the number of peers (torch's fp16 hook)
 bf16        sum      n bfloat16
 topk        gather   the k = ⌈ratio·n⌉ largest magnitudes: k int32 indices + k values
 sign        gather   1 bit per element + one float32 scale (mean |x|), two-phase with a
                      server-side compression, as 1-bit Adam's compressed allreduce
 qsgd        gather   a signed level in [-s, s] per element (4, 8 or 16 bits) + one float32
                      scale per bucket, stochastic rounding (unbiased)
 powersgd    sum      P (rows × rank) then Q (cols × rank); 1-D tensors and matrices too small
                      to gain (torch's min_compression_rate) travel uncompressed
===========  =======  ======================================================================

Error feedback (topk, sign, powersgd by default; ``ef=0/1`` on each) is kept by the driver
(:mod:`vcga.compress`), exactly. Decoders use only element-wise operations and fixed-order sums
(:mod:`vcga.compress.exact`), so every rank decodes the same bits. This module imports only the
public core API (``vcga.contract``, ``vcga.compress``) and torch only inside methods.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vcga import dtypes as _dtypes
from vcga.contract import Combine, CompressContext, Compressor, CompressorOption, CompressorSpec, hookimpl

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


def _itemsize(dtype: str) -> int:
    return _dtypes.get(dtype).itemsize


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# -- fp16 / bf16 --------------------------------------------------------------------------------------


class Cast(Compressor):
    """Send the tensor in a narrower float (torch's fp16_compress_hook / bf16_compress_hook)."""

    combine = Combine.SUM

    def __init__(self, dtype: str, ef: bool, prescale: bool) -> None:
        self.dtype, self.error_feedback, self.prescale = dtype, ef, prescale  # dtype: canonical name

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return _numel(shape) * _dtypes.get(self.dtype).itemsize

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[torch.Tensor]:  # noqa: A002
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


#: Where narrowing first pays (benchmarks/topk_select.py, one CPU thread): from 2^18 elements when
#: at most 1/32 of them are kept; a larger share (10%) only from 2^22 elements on.
_NARROW_MIN_N, _NARROW_MAX_SHARE, _NARROW_ANY_SHARE_N = 1 << 18, 1 / 32, 1 << 22


def largest(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest elements of the flat tensor ``a`` (in no particular order), the
    same set ``torch.topk(a, k)`` selects (up to which of equal values at the k-th are taken;
    a NaN counts as largest, as in ``torch.topk``).

    ``torch.topk`` over millions of elements costs ~100 ms on one CPU thread for 1% of 4.2 M
    (benchmarks/topk_select.py). Deep Gradient Compression estimates the threshold from a sample
    (Lin et al. 2018, sec. 3.4, "hierarchical top-k"); here the estimate only narrows the search and
    the result stays exact: a strided sample (deterministic: every rank, every run the same) gives
    a threshold ``t`` expected to keep about 2k elements; when at least k are not below ``t``,
    every element of the k largest is among them (the k-th largest is then ≥ ``t``), and
    ``torch.topk`` over those candidates picks them. When the sample misjudged (fewer than k
    candidates), the whole tensor is searched, as before."""
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


class TopK(Compressor):
    """The k largest magnitudes and their indices (Aji & Heafield 2017; Lin et al. 2018)."""

    combine = Combine.GATHER

    def __init__(self, ratio: float, ef: bool, server: bool) -> None:
        self.ratio, self.error_feedback, self.server = ratio, ef, server

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n))) if n else 0

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return self.k(_numel(shape)) * (4 + _itemsize(dtype))

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        flat = x.reshape(-1)
        state["numel"] = flat.numel()
        k = self.k(flat.numel())
        idx = largest(flat.abs(), k)
        # ascending: the decoder's writes never depend on the library's order. Sorting k indices
        # costs k log k; marking them and reading the marks back costs n: from k > n/16 on, less
        # (at 10% of 4.2 M elements 14 ms against 38; benchmarks/topk_select.py)
        if k > flat.numel() // 16:
            mark = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
            mark[idx] = True
            idx = mark.nonzero().squeeze(1)
        else:
            idx, _ = torch.sort(idx)
        return [idx.to(torch.int32), flat[idx].contiguous()]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor:  # noqa: A002
        import torch

        idx, val = payload
        n = state.get("numel")
        if n is None:
            raise KeyError("topk: decompress before compress on this tensor")
        out = torch.zeros(n, dtype=val.dtype, device=val.device)
        out[idx.long()] = val  # indices are distinct: a plain write, no accumulation order
        return out


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

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        flat = x.reshape(-1)
        state["numel"] = flat.numel()
        # mean |x| minimises ||x - s·sign(x)||²; 1-bit Adam uses the RMS, which overshoots. Summed in
        # float64 by the kernel (the bits of .to(float64).mean(), without the float64 copy)
        scale = (flat.abs().sum(dtype=torch.float64) / flat.numel()).to(torch.float32).reshape(1) if flat.numel() \
            else torch.zeros(1, dtype=torch.float32, device=flat.device)
        if flat.device.type == "cpu":  # numpy's packbits has _packbits' bit order (first element high)
            import numpy as np  # and takes ~1 ms for 4 M elements where the torch expressions take ~20

            # numpy has no bfloat16: the test in torch then (8 ms more for 4 M elements)
            ge = (flat >= 0).numpy() if flat.dtype == torch.bfloat16 else flat.detach().numpy() >= 0
            return [torch.from_numpy(np.packbits(ge)), scale]
        return [_packbits(flat >= 0), scale]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor:  # noqa: A002
        import torch

        bits, scale = payload
        n = state.get("numel")
        if n is None:
            raise KeyError("sign: decompress before compress on this tensor")
        if bits.device.type == "cpu":  # the same operations in numpy, in place: one buffer, not four
            import numpy as np

            out = np.unpackbits(bits.numpy(), count=n).astype(np.float32)
            out *= 2
            out -= 1  # exact: ±1
            out *= scale.numpy()  # element-wise: the same bits on every rank
            return torch.from_numpy(out)
        pm = _unpackbits(bits, n).to(torch.float32) * 2 - 1  # exact: ±1
        return pm * scale  # element-wise: the same bits on every rank


# -- QSGD --------------------------------------------------------------------------------------------


class QSGD(Compressor):
    """Stochastic quantization to s levels per bucket scale (Alistarh et al. 2017), unbiased.

    Random draws come from a generator seeded by the shared seed, the step, the tensor and the
    sending peer: reproducible, and any rank can regenerate any other's draws."""

    combine = Combine.GATHER
    unbiased = True

    def __init__(self, levels: int, bucket: int, norm: str, ef: bool, server: bool) -> None:
        self.s, self.bucket, self.norm = levels, bucket, norm
        self.error_feedback, self.server = ef, server
        self.bits = 4 if 2 * levels + 1 <= 16 else 8 if levels <= 127 else 16

    def _buckets(self, n: int) -> int:
        return -(-n // self.bucket) if n else 0

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = _numel(shape)
        return (-(-n // 2) if self.bits == 4 else n * self.bits // 8) + 4 * self._buckets(n)

    def _scales(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        n = flat.numel()
        nb = self._buckets(n)
        v = torch.cat([flat, flat.new_zeros(nb * self.bucket - n)]).view(nb, self.bucket) if n else flat.view(0, self.bucket)
        if self.norm == "max":
            return v, v.abs().amax(1)
        return v, v.to(torch.float64).pow(2).sum(1).sqrt().to(torch.float32)

    def step_width(self, x: torch.Tensor) -> torch.Tensor:
        """One quantization step per element: its bucket's scale / s."""
        import torch

        flat = x.reshape(-1).to(torch.float32)
        _, scale = self._scales(flat)
        return (scale / self.s).repeat_interleave(self.bucket)[:flat.numel()]

    def _draws(self, ctx: CompressContext, count: int) -> torch.Tensor:
        """``count`` uniform draws in [0, 1), from the shared seed, the step and the sending peer."""
        import torch

        g = torch.Generator(device="cpu")
        g.manual_seed(ctx.seed ^ (ctx.step * 0x9E3779B1 + ctx.peer * 0x85EBCA77 + (ctx.role == "server")) & 0x7FFFFFFFFFFFFFFF)
        return torch.rand(count, generator=g, dtype=torch.float32)

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        from vcga.compress import fused

        flat = x.reshape(-1).to(torch.float32)
        state["numel"] = flat.numel()
        if flat.numel() and fused.usable(flat) and (loops := fused.checked("qsgd", _qsgd_loops, _qsgd_self_check)):
            got = self._compress_loops(loops, flat, ctx)
            if got is not None:
                return got
        return self._compress_ops(flat, ctx)

    def _compress_ops(self, flat: torch.Tensor, ctx: CompressContext) -> list[torch.Tensor]:
        """The torch operations: the definition of the payload's bits (on every device)."""
        import torch

        n = flat.numel()
        v, scale = self._scales(flat)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        lv = v.abs() / safe.unsqueeze(1) * self.s  # in [0, s]
        u = self._draws(ctx, lv.numel()).view(lv.shape).to(lv.device)
        low = lv.floor()
        q = (low + (u < (lv - low)).to(lv.dtype)).clamp_(max=self.s)
        signed = (q * torch.sign(v)).to(torch.int16).reshape(-1)[:n]
        if self.bits == 4:
            off = (signed + self.s).to(torch.uint8)
            if off.numel() % 2:
                off = torch.cat([off, off.new_zeros(1)])
            packed = (off[0::2] * 16 + off[1::2]).to(torch.uint8)
        elif self.bits == 8:
            packed = signed.to(torch.int8)
        else:
            packed = signed
        return [packed.contiguous(), scale.contiguous()]

    def _compress_loops(self, loops: Any, flat: torch.Tensor, ctx: CompressContext) -> list[torch.Tensor] | None:
        """The same payload from one pass on the host (about 4x faster at 4 M elements); None for a
        tensor with a NaN or an infinity, whose integer conversion the torch operations leave to the
        platform: they handle it."""
        import torch

        absmax, quantize, _ = loops
        n = flat.numel()
        nb = self._buckets(n)
        if self.norm == "max":
            scale = torch.empty(nb, dtype=torch.float32)
            if not absmax(flat.numpy(), self.bucket, scale.numpy()):
                return None
        else:
            scale = self._scales(flat)[1]
            if not bool(torch.isfinite(scale).all()):
                return None
        u = self._draws(ctx, nb * self.bucket)  # the draws of the padded buckets too: the same stream
        out = torch.empty(-(-n // 2) if self.bits == 4 else n,
                          dtype={4: torch.uint8, 8: torch.int8, 16: torch.int16}[self.bits])
        quantize(flat.numpy(), scale.numpy(), u.numpy(), self.s, self.bucket, self.bits, out.numpy())
        return [out, scale]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor:  # noqa: A002
        import torch

        from vcga.compress import fused

        packed, scale = payload
        n = state.get("numel")
        if n is None:
            raise KeyError("qsgd: decompress before compress on this tensor")
        if n and fused.usable(scale) and packed.device.type == "cpu" and packed.is_contiguous() \
                and bool(torch.isfinite(scale).all()) \
                and (loops := fused.checked("qsgd", _qsgd_loops, _qsgd_self_check)):
            out = torch.empty(n, dtype=torch.float32)
            loops[2](packed.numpy(), scale.numpy(), self.s, self.bucket, n, self.bits, out.numpy())
            return out
        return self._decompress_ops(packed, scale, n)

    def _decompress_ops(self, packed: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        import torch

        if self.bits == 4:
            hi, lo = packed // 16, packed % 16
            signed = torch.stack([hi, lo], 1).reshape(-1)[:n].to(torch.float32) - self.s
        else:
            signed = packed.to(torch.float32)
        sc = scale.repeat_interleave(self.bucket)[:n] if n else scale[:0]
        return signed * sc / self.s  # element-wise, correctly rounded: the same bits on every rank


def _qsgd_loops() -> tuple[Any, Any, Any]:
    """QSGD's host path as numba loops: ``QSGD._compress_ops`` and ``_decompress_ops``, element by
    element -- the same IEEE 754 float32 operations in the same order (a division, then a product,
    each correctly rounded; no fused multiply-add: numba's ``fastmath`` is off)."""
    import numba
    import numpy as np

    # numba's on-disk cache records the module's import name, and a checkout can import this file
    # as ``plugins.compressors`` too (tests run from the repository root): a cache written under
    # that name fails to load in a process that has only ``vcga.plugins``. Cache under the
    # installed name only; under any other, compile (about 2 s) without caching.
    cache = __name__ == "vcga.plugins.compressors"
    opts = dict(cache=cache, nogil=True, boundscheck=False, fastmath=False, error_model="numpy")

    @numba.njit(**opts)
    def absmax(x: Any, bucket: int, scale: Any) -> bool:  # pragma: no cover - compiled
        # each bucket's largest magnitude; False if an element is NaN or infinite
        n = x.shape[0]
        big = np.float32(3.4028234663852886e38)
        finite = True
        for b in range(scale.shape[0]):
            m = np.float32(0.0)
            for i in range(b * bucket, min(n, (b + 1) * bucket)):
                a = abs(x[i])
                if not a <= big:
                    finite = False
                if a > m:
                    m = a
            scale[b] = m
        return finite

    @numba.njit(**opts)
    def quantize(x: Any, scale: Any, u: Any, s: int, bucket: int, bits: int, out: Any) -> None:  # pragma: no cover
        n = x.shape[0]
        sf = np.float32(s)
        one = np.float32(1.0)
        for b in range(scale.shape[0]):
            sc = scale[b]
            safe = sc if sc > 0 else one
            for i in range(b * bucket, min(n, (b + 1) * bucket)):
                v = x[i]
                lv = abs(v) / safe * sf  # in [0, s]
                low = np.float32(int(lv))  # floor: lv >= 0
                q = low + one if u[i] < lv - low else low
                if q > sf:
                    q = sf
                level = int(q)
                if v < 0:
                    level = -level
                if bits == 4:  # two levels per byte, offset by s, first in the high nibble
                    if i & 1:
                        out[i >> 1] += level + s
                    else:
                        out[i >> 1] = (level + s) * 16
                else:
                    out[i] = level

    @numba.njit(**opts)
    def dequantize(packed: Any, scale: Any, s: int, bucket: int, n: int, bits: int, out: Any) -> None:  # pragma: no cover
        sf = np.float32(s)
        for b in range(scale.shape[0]):
            sc = scale[b]
            for i in range(b * bucket, min(n, (b + 1) * bucket)):
                if bits == 4:
                    byte = packed[i >> 1]
                    val = np.float32(byte & 15 if i & 1 else byte >> 4) - sf
                else:
                    val = np.float32(packed[i])
                out[i] = val * sc / sf

    return absmax, quantize, dequantize


def _qsgd_self_check(loops: Any) -> str | None:
    """None when the loops give the torch operations' payload and decoded bits on probing values
    (magnitudes 1e-30..1e30, subnormals, zeros of both signs, odd lengths, partial buckets, every
    level width and both norms), else what differed."""
    import torch

    from vcga.compress.fused import _probe_values

    ctx = CompressContext(peers=3, peer=1, step=5, seed=77)
    for levels, bucket, n, norm in ((1, 3, 1001, "max"), (7, 5, 999, "max"), (16, 512, 1500, "max"),
                                    (127, 64, 700, "l2"), (1000, 1, 33, "max"), (32767, 256, 600, "l2")):
        q = QSGD(levels, bucket, norm, ef=False, server=False)
        x = _probe_values(torch.float32, n, levels)
        x[n // 3: n // 3 + bucket] = 0  # a bucket of zeros (or part of one)
        x[n // 2] = -0.0
        x[: n // 4] *= 1e-30  # buckets whose largest magnitude is tiny
        want = q._compress_ops(x, ctx)
        got = q._compress_loops(loops, x, ctx)
        if got is None or any(a.dtype != b.dtype or not torch.equal(a, b) for a, b in zip(got, want)):
            return f"qsgd payload (levels {levels}, bucket {bucket}, norm {norm})"
        dec_want = q._decompress_ops(want[0], want[1], n)
        dec = torch.empty(n, dtype=torch.float32)
        loops[2](want[0].numpy(), want[1].numpy(), levels, bucket, n, q.bits, dec.numpy())
        if not torch.equal(dec.view(torch.int32), dec_want.view(torch.int32)):
            return f"qsgd decode (levels {levels}, bucket {bucket})"
    return None


# -- PowerSGD ------------------------------------------------------------------------------------------


def _buffer(state: dict[str, Any], name: str, q: torch.Tensor, rows: int) -> torch.Tensor:
    """A rows x len(q) buffer kept in ``state`` across steps (a fresh 4 MiB matrix per call costs
    the allocator and the page faults as much as filling it)."""
    import torch

    shape = (rows, q.shape[0])
    buf = state.get(name)
    if buf is None or tuple(buf.shape) != shape or buf.dtype != q.dtype or buf.device != q.device:
        buf = state[name] = torch.empty(shape, dtype=q.dtype, device=q.device)
    return buf


class PowerSGD(Compressor):
    """Rank-r power iteration per matrix with warm start and error feedback (Vogels et al. 2019).

    Round 0 sends P = M Q (Q shared: drawn from the shared seed, or last step's), round 1 sends
    Q = Mᵀ P̂ with P̂ the orthonormalised sum of the Ps. What this rank sent is P̂ Qᵢᵀ, the
    projection of its own matrix (the paper's error feedback; torch's hook keeps the input minus
    the *averaged* approximation instead, which mixes the other ranks' gradients into the residual).

    ``iters`` > 1 runs that many power (subspace) iterations per step: after round 2i + 1 the
    summed Q is orthonormalised and round 2i + 2 sends P = M Q̂ again -- each iteration sends P and
    Q once more (bytes × iters), and the rank-r subspace gets closer to the top-r singular subspace
    of this step's summed matrix instead of relying on the warm start alone to track it."""

    combine = Combine.SUM
    elementwise = False

    def __init__(self, rank: int, warm: bool, ef: bool, min_rate: float, eps: float, iters: int = 1) -> None:
        self.rank, self.warm, self.error_feedback, self.min_rate, self.eps = rank, warm, ef, min_rate, eps
        self.iters = iters
        self.rounds = 2 * iters

    def _plan(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(rows, cols, rank) when the tensor is compressed, None when it travels as it is."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = _numel(shape) // n if n else 0
        r = min(n, m, self.rank)
        if r == 0 or (n + m) * r * self.iters * self.min_rate >= n * m:
            return None
        return n, m, r

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        p = self._plan(shape)
        if p is None:
            return _numel(shape) * _itemsize(dtype)
        n, m, r = p
        return (n + m) * r * self.iters * _itemsize(dtype)

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        from vcga.compress.exact import orthonormalize

        p = self._plan(tuple(x.shape))
        state["compressed"] = p is not None
        if p is None:
            return [x.reshape(-1).contiguous()] if round == 0 else []
        n, m, r = p
        mat = x.reshape(n, m)
        if round == 0:
            q = state.get("q") if self.warm else None
            if q is None or q.shape != (m, r):
                g = torch.Generator(device="cpu")
                g.manual_seed(ctx.seed)  # the same Q on every peer
                q = torch.randn(m, r, generator=g, dtype=torch.float64).to(x.dtype).to(x.device)
            q = orthonormalize(q.clone(), self.eps)  # where the shared Q lives (the host, when decoding there)
            state["q"] = q
            return [(mat @ q.to(mat.device)).contiguous()]
        if round % 2 == 0:  # a further iteration: P = M Q̂, Q̂ the last round's orthonormalised sum
            return [(mat @ state["q_hat"].to(mat.device)).contiguous()]
        q_own = (mat.t() @ state["p"].to(mat.device)).contiguous()
        state["q_own"] = q_own
        return [q_own]

    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor | None:  # noqa: A002
        from vcga.compress.exact import orthonormalize, outer_sum

        if not state.get("compressed", True):
            return payload[0]  # an uncompressed tensor: its sum, done in round 0
        if round % 2 == 0:
            state["p"] = orthonormalize(payload[0].clone(), self.eps)
            return None
        q = payload[0]
        if round + 1 < self.rounds:  # another iteration follows: it multiplies by the summed Q, orthonormalised
            state["q_hat"] = orthonormalize(q.clone(), self.eps)
            return None
        if self.warm:
            state["q"] = q.clone()
        state["q_sum"] = q  # with P̂, the compact form of the decoded sum (decoded_form)
        # the decoded matrix is read once by the driver before the next call: reuse its buffer
        return outer_sum(state["p"], q, out=_buffer(state, "decoded", q, state["p"].shape[0]))

    def decoded_layout(self, shape: tuple[int, ...], dtype: str) -> list[tuple[tuple[int, ...], str]] | None:
        p = self._plan(tuple(shape))
        if p is None:
            return [((_numel(shape),), dtype)]
        n, m, r = p
        return [((n, r), dtype), ((m, r), dtype)]

    def decoded_form(self, decoded: torch.Tensor, state: dict[str, Any]) -> list[torch.Tensor]:
        if not state.get("compressed", True):
            return [decoded.reshape(-1)]
        return [state["p"], state["q_sum"]]

    def expand(self, form: list[torch.Tensor], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        from vcga.compress.exact import outer_sum

        if len(form) == 1:
            got = form[0].reshape(shape)
            return got if out is None else out.copy_(got)
        p, q = form
        return outer_sum(p, q, out=out)

    def sent(self, x: torch.Tensor, payload: list[torch.Tensor], state: dict[str, Any],
             ctx: CompressContext) -> torch.Tensor:
        import torch

        if self._plan(tuple(x.shape)) is None:
            return x
        # P̂ Q_ownᵀ by the library's matmul, on this rank's device: unlike the decoded sum, what this
        # rank sent is its own bookkeeping -- no other rank reads it, so it need not have the same
        # bits everywhere; error feedback keeps x - sent exactly for whatever bits it has (one
        # matmul instead of r element-wise products and additions)
        q = state["q_own"]
        p = state["p"].to(q.device)
        return torch.mm(p, q.t(), out=_buffer(state, "sent", q, p.shape[0])).reshape(x.shape)


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
