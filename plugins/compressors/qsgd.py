"""QSGD: stochastic quantization to s levels per bucket scale, and its host loops (numba)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vcga.contract import Combine, CompressContext, Compressor

from ._shapes import compressed_numel
from ._shapes import numel as _numel

if TYPE_CHECKING:
    import torch


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
        v = (torch.cat([flat, flat.new_zeros(nb * self.bucket - n)]).view(nb, self.bucket) if n
             else flat.view(0, self.bucket))
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
        g.manual_seed(ctx.seed ^ (ctx.step * 0x9E3779B1 + ctx.peer * 0x85EBCA77 + (ctx.role == "server"))
                      & 0x7FFFFFFFFFFFFFFF)
        return torch.rand(count, generator=g, dtype=torch.float32)

    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext,
                 round: int = 0) -> list[torch.Tensor]:  # noqa: A002
        import torch

        from vcga.compress import fused

        flat = x.reshape(-1).to(torch.float32)
        state["numel"] = flat.numel()
        if flat.numel() and fused.usable(flat) and (loops := _loops()):
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
        """The same payload from the host loops (docs/compression.md: the encode in half the torch
        operations' time, the draws included); None for a tensor with a NaN or an infinity, whose
        integer conversion the torch operations leave to the platform: they handle it."""
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
        n = compressed_numel(state, "qsgd")
        if n and fused.usable(scale) and packed.device.type == "cpu" and packed.is_contiguous() \
                and bool(torch.isfinite(scale).all()) and (loops := _loops()):
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


def _loops() -> tuple[Any, Any, Any] | None:
    """The host loops, compiled and self-checked once per process; None: use the torch operations."""
    from vcga.compress import fused

    return fused.checked("qsgd", _qsgd_loops, _qsgd_self_check)


def _qsgd_loops() -> tuple[Any, Any, Any]:
    """QSGD's host path as numba loops: ``QSGD._compress_ops`` and ``_decompress_ops``, element by
    element -- the same IEEE 754 float32 operations in the same order (a division, then a product,
    each correctly rounded; no fused multiply-add: numba's ``fastmath`` is off)."""
    import numba
    import numpy as np

    # numba's on-disk cache records the module's import name, and a checkout can import this file
    # as ``plugins.compressors.qsgd`` too (tests run from the repository root): a cache written under
    # that name fails to load in a process that has only ``vcga.plugins``. Cache under the
    # installed name only; under any other, compile (about 2 s) without caching.
    cache = __name__ == "vcga.plugins.compressors.qsgd"
    jit = numba.njit(cache=cache, nogil=True, boundscheck=False, fastmath=False, error_model="numpy")

    @jit
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

    @jit
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

    @jit
    def dequantize(packed: Any, scale: Any, s: int, bucket: int, n: int, bits: int,
                   out: Any) -> None:  # pragma: no cover - compiled
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

    from vcga.compress.fused import probe_values

    ctx = CompressContext(peers=3, peer=1, step=5, seed=77)
    for levels, bucket, n, norm in ((1, 3, 1001, "max"), (7, 5, 999, "max"), (16, 512, 1500, "max"),
                                    (127, 64, 700, "l2"), (1000, 1, 33, "max"), (32767, 256, 600, "l2")):
        q = QSGD(levels, bucket, norm, ef=False, server=False)
        x = probe_values(torch.float32, n, levels)
        x[n // 3: n // 3 + bucket] = 0  # a bucket of zeros (or part of one)
        x[n // 2] = -0.0
        x[: n // 4] *= 1e-30  # buckets whose largest magnitude is tiny
        want = q._compress_ops(x, ctx)
        got = q._compress_loops(loops, x, ctx)
        if (got is None or len(got) != len(want)
                or any(a.dtype != b.dtype or not torch.equal(a, b) for a, b in zip(got, want, strict=True))):
            return f"qsgd payload (levels {levels}, bucket {bucket}, norm {norm})"
        dec_want = q._decompress_ops(want[0], want[1], n)
        dec = torch.empty(n, dtype=torch.float32)
        loops[2](want[0].numpy(), want[1].numpy(), levels, bucket, n, q.bits, dec.numpy())
        if not torch.equal(dec.view(torch.int32), dec_want.view(torch.int32)):
            return f"qsgd decode (levels {levels}, bucket {bucket})"
    return None
