"""Deliberately broken gradient compressors, each caught by one case of the `compression` check
(tests/test_compression.py). Plugins of the same shape as vcga.plugins.compressors."""

from __future__ import annotations

import math
from typing import Any

from vcga.contract import Combine, CompressContext, Compressor, CompressorOption, CompressorSpec, hookimpl


def _flag(v: str) -> bool:
    return v in ("1", "true")


class ClaimsAll(Compressor):
    """Sends bfloat16 but says it sent the exact input: error feedback then keeps nothing."""

    combine = Combine.SUM
    error_feedback = True

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = math.prod(shape)
        return 2 * n

    def compress(self, x: Any, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[Any]:  # noqa: A002
        import torch

        return [x.reshape(-1).to(torch.bfloat16).contiguous()]

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        import torch

        return payload[0].to(torch.float32)

    def sent(self, x: Any, payload: list[Any], state: dict[str, Any], ctx: CompressContext) -> Any:
        return x  # the lie


class RankNoise(Compressor):
    """Decodes with a rank-dependent last bit: every rank's result differs."""

    combine = Combine.GATHER

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = math.prod(shape)
        return 4 * n

    def compress(self, x: Any, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[Any]:  # noqa: A002
        state["shape"] = tuple(x.shape)
        return [x.reshape(-1).contiguous()]

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        import torch
        import torch.distributed as dist

        return payload[0] * (1 + dist.get_rank() * torch.finfo(torch.float32).eps)


class Oversize(ClaimsAll):
    """Declares 2 bytes per element and sends 4."""

    def compress(self, x: Any, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[Any]:  # noqa: A002
        return [x.reshape(-1).contiguous()]

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        return payload[0]

    def sent(self, x: Any, payload: list[Any], state: dict[str, Any], ctx: CompressContext) -> Any:
        return self.decompress(payload, state, ctx)


class FloorQuant(Compressor):
    """Quantizes by truncation toward zero but declares itself unbiased."""

    combine = Combine.GATHER
    unbiased = True
    levels = 4

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = math.prod(shape)
        return n + 4

    def compress(self, x: Any, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[Any]:  # noqa: A002
        import torch

        flat = x.reshape(-1).float()
        scale = flat.abs().max().reshape(1) if flat.numel() else torch.ones(1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.trunc(flat / safe * self.levels).to(torch.int8)
        return [q, scale]

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        q, scale = payload
        return q.float() * scale / self.levels

    def step_width(self, x: Any) -> Any:
        flat = x.reshape(-1).float()
        return (flat.abs().max() / self.levels).expand(flat.numel()).clone()


class Raises(RankNoise):
    """Raises while decoding, on every rank: the case fails and every rank rebuilds the default
    group; the checks of the compressors after it must not inherit the old group's islands."""

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        raise RuntimeError("broken-raise: decoding failed on purpose")


class Sticky(Compressor):
    """Sends a decaying sum of its inputs, kept on the instance -- out of the driver's reach, so the
    driver cannot make it forget an overflow: once an inf went in, every later sum is inf."""

    combine = Combine.SUM

    def __init__(self) -> None:
        self.memory: dict[tuple[int, ...], Any] = {}

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        n = math.prod(shape)
        return 4 * n

    def compress(self, x: Any, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[Any]:  # noqa: A002
        import torch

        flat = x.reshape(-1).to(torch.float32)
        old = self.memory.get(tuple(x.shape))
        self.memory[tuple(x.shape)] = m = flat.clone() if old is None else old * 0.5 + flat
        return [m.contiguous()]

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        return payload[0]


class Overwrites(Compressor):
    """A top-k (an eighth of the elements, error feedback) whose ``decompress_add`` writes a peer's
    values where it should add them: an element two peers both send ends up with the later peer's."""

    combine = Combine.GATHER
    error_feedback = True

    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return 8 * max(1, math.prod(shape) // 8)

    def compress(self, x: Any, state: dict[str, Any], ctx: CompressContext, round: int = 0) -> list[Any]:  # noqa: A002
        import torch

        flat = x.reshape(-1)
        state["n"] = flat.numel()
        idx = torch.topk(flat.abs(), max(1, flat.numel() // 8), sorted=False).indices
        return [idx.to(torch.int32), flat[idx].contiguous()]

    def decompress(self, payload: list[Any], state: dict[str, Any], ctx: CompressContext, round: int = 0) -> Any:  # noqa: A002
        import torch

        idx, val = payload
        out = torch.zeros(state["n"], dtype=val.dtype)
        out[idx.long()] = val
        return out

    def decompress_add(self, payload: list[Any], total: Any, state: dict[str, Any], ctx: CompressContext) -> Any:
        idx, val = payload
        total[idx.long()] = val  # the fault: a write, not an addition
        return total


@hookimpl
def vcga_compressors() -> list[CompressorSpec]:
    return [
        CompressorSpec("broken-sent", "says it sent more than it did", {}, lambda: ClaimsAll()),
        CompressorSpec("broken-identity", "rank-dependent decoding", {}, lambda: RankNoise()),
        CompressorSpec("broken-wire", "sends more than it declares", {"ef": CompressorOption(False, _flag)},
                       lambda ef: Oversize()),
        CompressorSpec("broken-bias", "biased, declared unbiased", {}, lambda: FloorQuant()),
        CompressorSpec("broken-raise", "raises while decoding", {}, lambda: Raises()),
        CompressorSpec("broken-sticky", "keeps an overflow in state of its own", {}, lambda: Sticky()),
        CompressorSpec("broken-overwrite", "writes a peer's values where it should add them", {}, lambda: Overwrites()),
    ]
