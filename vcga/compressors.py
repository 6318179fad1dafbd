"""Gradient compressors: the interface a compressor plugin implements (hook ``vcga_compressors``).

Section 6 of the plugin contract. It lives in its own module, as the capability tables do, so that
:mod:`vcga.contract` stays one readable page; :mod:`vcga.contract` re-exports every name here, and
a plugin imports them from there. What drives a compressor (spec strings, the DDP hook, the
exchange on the slow hop, exact error feedback) is :mod:`vcga.compress`; docs/compression.md
explains the whole design.

Nothing here imports torch at module import time (``vcga --help`` must stay fast).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Combine", "CompressorOption", "CompressContext", "Compressor", "CompressorSpec"]


class Combine(str, enum.Enum):
    """How the payloads of several ranks combine (see :class:`Compressor`)."""

    #: payloads add up element by element: the group sums them (an all_reduce), one decode per round
    SUM = "sum"
    #: each rank's payload decodes on its own: the group gathers them and every rank decodes each
    #: and adds the results in rank order (top-k indices, per-rank scales, ...)
    GATHER = "gather"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CompressorOption:
    """One ``key=value`` of a compression spec (``topk:ratio=0.01``).

    :param default: the value when the spec does not name the key.
    :param parse: ``parse(text) -> value``; raises ``ValueError`` saying what is allowed (the
        parser turns it into a :class:`~vcga.errors.VcgaConfigError` naming the spec).
    :param help: one line for ``vcga info`` and errors.
    """

    default: Any
    parse: Callable[[str], Any]
    help: str = ""


@dataclass(frozen=True)
class CompressContext:
    """What a compressor may know about the exchange it takes part in (same on every rank).

    :param peers: ranks whose payloads combine (2 for two vendor groups under scope ``bridge``).
    :param peer: this rank's index among them.
    :param step: the training step (counted by the driver from 0), for seeds.
    :param seed: a seed every rank shares (the spec's ``seed``) mixed with the tensor's key: draw
        random numbers only from generators seeded with it (and ``peer``/``step``), so every run is
        reproducible and any rank can regenerate any other's draws.
    :param role: ``"worker"``, or ``"server"`` for the second compression of a two-phase
        exchange (:attr:`Compressor.server`).
    """

    peers: int
    peer: int
    step: int
    seed: int
    role: str = "worker"


class Compressor(abc.ABC):
    """One configured gradient compressor (a :class:`CompressorSpec`'s ``create(**options)``).

    The driver (:mod:`vcga.compress`) owns everything around it: which tensors it sees (scope
    ``bridge``: only the part that crosses the slow hop, already reduced exactly inside each vendor
    group or node), the collectives, error feedback (kept by the driver as an exact residual, see
    docs/compression.md), the division by the world size, and the per-tensor ``state`` dict it
    hands back on every call. A compressor only encodes and decodes:

    - :attr:`combine` ``SUM``: for each of :attr:`rounds` rounds the driver calls :meth:`compress`,
      sums the payloads of all peers element by element, and calls :meth:`decompress` with the sums;
      the last round returns the decoded *sum* over peers (PowerSGD: round 0 sends P = MQ, round 1
      sends Q = MᵀP̂).
    - :attr:`combine` ``GATHER`` (one round): the driver gathers every peer's payload and calls
      :meth:`decompress` on each, adding the results in peer order. With :attr:`server` the
      exchange is two-phase, as in 1-bit Adam's compressed allreduce: the tensor is cut into one
      chunk per peer, peer *j* receives every peer's payload of chunk *j* (all_to_all), decodes and
      adds them, compresses the sum again (role ``server``, with its own error feedback), and the
      peers all-gather those payloads -- every peer sends about one payload's worth per phase,
      whatever the number of peers.

    Decoding must give the same bits on every rank: use only element-wise operations (IEEE 754
    correctly rounded) and sums in a fixed order (:mod:`vcga.compress.exact` helpers) on the
    payload bytes -- never a library reduction (matmul, norm, sum) whose order is the library's.
    Payload sizes must depend only on the tensor's shape and dtype and the round (every peer's
    payload then has the same layout; the driver moves them as bytes). ``decompress`` is also
    called on this rank's own payload (``sent``) and, for a GATHER compressor, on each peer's
    with this rank's ``state`` for the same tensor: keep in ``state`` only what any peer's payload
    of that tensor decodes with (its length, the shared Q, ...). ``state`` is saved with the hook's
    state in checkpoints and read back with ``torch.load(weights_only=True)``: keep tensors and
    plain values in it (numbers, strings, tuples, lists, dicts). Read back, its tensors are on the
    host (CPU) -- the checkpoint may come from another vendor's device: move a state tensor to
    ``x``'s device where you use it (``state["q"].to(x.device)``), as the built-ins do.
    """

    #: How payloads of several ranks combine.
    combine: Combine = Combine.SUM
    #: SUM compressors: exchanges per call (PowerSGD: 2).
    rounds: int = 1
    #: True when the compressor may be given any slice of a flattened gradient; False when it needs
    #: each parameter's own tensor with its shape (PowerSGD views it as a matrix).
    elementwise: bool = True
    #: True when the driver should keep an error-feedback residual for this compressor.
    error_feedback: bool = False
    #: GATHER compressors: two-phase exchange with a server-side compression (see above).
    server: bool = False
    #: True when the decoded value's expectation is the input (stochastic rounding): ``vcga verify``
    #: then tests the mean of many draws against a derived statistical bound, which needs
    #: :meth:`step_width`.
    unbiased: bool = False

    @abc.abstractmethod
    def payload_nbytes(self, shape: tuple[int, ...], dtype: str) -> int:
        """The bytes this rank sends for one tensor of ``shape`` and canonical ``dtype`` (all
        rounds, every payload tensor): the declared compression ratio is
        ``numel * itemsize / payload_nbytes``. ``vcga verify`` counts the bytes on the wire and
        fails a compressor that sends more."""

    @abc.abstractmethod
    def compress(self, x: torch.Tensor, state: dict[str, Any], ctx: CompressContext,
                 round: int = 0) -> list[torch.Tensor]:  # noqa: A002 - the round of the exchange
        """Encode ``x`` (this rank's value, error feedback already added) into payload tensors."""

    @abc.abstractmethod
    def decompress(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                   round: int = 0) -> torch.Tensor | None:  # noqa: A002
        """SUM: ``payload`` holds the peers' summed payloads; return the decoded sum (shape and dtype
        of ``x``) after the last round, None before it. GATHER: ``payload`` is one peer's; return
        its decoded value."""

    def decompress_add(self, payload: list[torch.Tensor], total: torch.Tensor, state: dict[str, Any],
                       ctx: CompressContext) -> torch.Tensor:
        """GATHER compressors: ``total`` (flat) plus one peer's decoded ``payload``, the same values as
        ``total + decompress(payload).reshape(-1)``. The driver adds the peers' values in peer order:
        the first it decodes with :meth:`decompress`, each later one with this method, ``total``
        being the sum so far. The default does just that. A compressor whose payload touches few
        elements overrides it and adds into ``total`` in place (top-k: k additions instead of a
        dense decode and a dense addition per peer) -- then its :meth:`decompress` must return a
        tensor of its own (not a view of the payload or of ``state``), since ``total`` may be one.
        Adding only where the payload has values leaves a ``-0.0`` in ``total`` as it is where the
        dense sum would make it ``+0.0``: the same number, and the same bits on every rank."""
        decoded = self.decompress(payload, state, ctx)
        if decoded is None:
            raise TypeError(f"{type(self).__name__} combines by GATHER but its decompress returned None")
        return total + decoded.reshape(-1)

    def sent(self, x: torch.Tensor, payload: list[torch.Tensor], state: dict[str, Any],
             ctx: CompressContext) -> torch.Tensor:
        """What this rank's contribution decodes to (error feedback keeps ``x`` minus it). The
        default decodes this rank's own payload, right for every single-round compressor; a
        multi-round one overrides it (PowerSGD: P̂ Qᵢᵀ, the projection of this rank's matrix).

        SUM compressors: called right after the last round's :meth:`compress`, *before* that
        round's :meth:`decompress` (the driver keeps the residual while the summed payloads
        travel), so it may read only what ``compress`` and the earlier rounds' ``decompress`` left
        in ``state``."""
        out = self.decompress(payload, state, ctx, self.rounds - 1)
        if out is None:  # pragma: no cover - a multi-round compressor must override sent()
            raise NotImplementedError(f"{type(self).__name__} has {self.rounds} rounds and must override sent()")
        return out

    def sent_factors(self, x: torch.Tensor, payload: list[torch.Tensor], state: dict[str, Any],
                     ctx: CompressContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional, SUM compressors whose :meth:`sent` is a sum of r outer products: ``(p, q)``
        (``[n, r]`` and ``[m, r]``, ``x`` viewed as ``[n, m]``) with :meth:`sent` bit for bit
        :func:`vcga.compress.exact.outer_sum` of them (k = 0, 1, ... in order). The driver then keeps
        the residual in one pass that forms each element of ``sent`` as it goes, instead of writing
        the whole of it and reading it back. None (the default): the driver calls :meth:`sent`.
        Called where :meth:`sent` would be."""
        return None

    def decompress_into(self, payload: list[torch.Tensor], state: dict[str, Any], ctx: CompressContext,
                        round: int, out: torch.Tensor, divisor: float = 1.0) -> bool:  # noqa: A002
        """Optional, SUM compressors: :meth:`decompress` writing the decoded sum divided by
        ``divisor`` (the driver's average over the group) into ``out`` (the shape and dtype of
        ``x``, contiguous) instead of returning it -- the same changes to ``state``; True when done
        so, False (the default, and for a round that decodes nothing yet) when the driver is to call
        :meth:`decompress` instead. Saves the driver a copy and a division of every decoded tensor:
        the division may be folded into a small factor (PowerSGD divides the summed Q). Where the
        compressor has a compact form (:meth:`decoded_layout`), the bits written must be those
        :meth:`expand_divided` writes from that form -- or, for a compressor without it, those of
        the decoded value divided -- so that every island rank rebuilds the same."""
        return False

    def expand_divided(self, form: list[torch.Tensor], shape: tuple[int, ...], out: torch.Tensor,
                       divisor: float) -> bool:
        """Optional, with a compact form: :meth:`expand` of ``form`` divided by ``divisor`` into
        ``out``, with :meth:`decompress_into`'s bits; True when done, False (the default) when the
        driver is to expand and divide itself."""
        return False

    def decoded_finite(self, state: dict[str, Any]) -> bool | None:
        """Optional: whether the value the last round decoded is finite, if the compressor can tell
        without reading it (PowerSGD: from P̂ and the summed Q, whose products and sums of r terms
        cannot overflow below a bound); None (the default) when the driver is to read it."""
        return None

    def decoded_layout(self, shape: tuple[int, ...], dtype: str) -> list[tuple[tuple[int, ...], str]] | None:
        """Optional, SUM compressors: the tensors (shape, canonical dtype) of a compact form of the
        decoded sum of a tensor of ``shape`` -- what it is rebuilt from, with the same bits, by
        :meth:`expand` (PowerSGD: P̂ and the summed Q). None (the default): no compact form.

        Scope ``bridge`` then copies the decoded parts inside each island in this form, and every
        island rank rebuilds the parts of the others, instead of copying the decoded values at full
        precision (a rank-4 1024 x 512 part: 24 KiB against 2 MiB)."""
        return None

    def decoded_form(self, decoded: torch.Tensor, state: dict[str, Any]) -> list[torch.Tensor]:
        """The compact form (:meth:`decoded_layout`) of ``decoded``, the value the last round's
        :meth:`decompress` returned with ``state``."""
        raise NotImplementedError(f"{type(self).__name__} declares no compact decoded form")

    def expand(self, form: list[torch.Tensor], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """The decoded sum rebuilt from its compact form, bit for bit what :meth:`decompress`
        returned (the same element-wise operations on the same values); into ``out`` when given."""
        raise NotImplementedError(f"{type(self).__name__} declares no compact decoded form")

    def step_width(self, x: torch.Tensor) -> torch.Tensor | None:
        """For an unbiased compressor: per element of ``x``, the width of the interval its decoded
        value falls in (one quantization step); None when not defined."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"combine": self.combine.value, "rounds": self.rounds, "elementwise": self.elementwise,
                "error_feedback": self.error_feedback, "server": self.server, "unbiased": self.unbiased}


@dataclass(frozen=True)
class CompressorSpec:
    """A gradient compressor a plugin contributes (hook :meth:`HookSpecs.vcga_compressors`).

    :param name: what spec strings name (``"powersgd"`` in ``powersgd:rank=4``).
    :param description: one line for ``vcga info``.
    :param options: the keys the spec may set, with defaults and parsers.
    :param create: ``create(**options) -> Compressor`` with every option given (defaults filled in).
    """

    name: str
    description: str
    options: Mapping[str, CompressorOption]
    create: Callable[..., Compressor]
