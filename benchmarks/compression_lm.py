"""The language-model task of ``benchmarks/compression.py converge --task lm``: a small causal
transformer learns a fixed random source of tokens, with cross-entropy -- the loss the field
reports for compression on language models (DeepSpeed's 1-bit Adam on BERT and GPT, PowerSGD's
and DGC's LSTM results), beside the teacher-student regression.

The source is an order-2 Markov chain over ``VOCAB`` tokens: each pair of previous tokens picks a
row of next-token probabilities drawn from a Dirichlet(``ALPHA``) (fixed seed), so some
continuations are likely and most are not. No model beats the source's own probabilities in
expectation: :func:`floor` gives their loss on the benchmark's held-out batch, and the report gives
each variant's loss above that floor beside the loss itself.

The model: token and learned position embeddings, ``LAYERS`` pre-norm transformer layers
(``HEADS`` heads, no dropout), a linear head, a causal mask; about 106 k parameters at
``--width 64``. Every sequence is ``CONTEXT + 1`` tokens; the loss is taken on every position
whose two previous tokens are in the sequence.
"""

from __future__ import annotations

from typing import Any

VOCAB = 32
CONTEXT = 32
ORDER = 2
ALPHA = 0.1
LAYERS = 2
HEADS = 4


def source() -> Any:
    """The Markov chain's transition table, ``VOCAB**ORDER x VOCAB`` (rows sum to one): the same
    on every rank and in every run."""
    import torch

    g = torch.Generator().manual_seed(5)
    # Dirichlet rows as normalised Gamma draws, the way torch.distributions.Dirichlet draws them:
    # its sample() takes no generator, and the table must not depend on the global RNG's state
    gam = torch._standard_gamma(torch.full((VOCAB ** ORDER, VOCAB), ALPHA), generator=g)
    return gam / gam.sum(1, keepdim=True)


def sequences(table: Any, n: int, seed: int) -> Any:
    """``n`` sequences of ``CONTEXT + 1`` tokens from the chain, from ``seed`` alone."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = list(torch.randint(0, VOCAB, (n, ORDER), generator=g).unbind(1))
    for _ in range(CONTEXT + 1 - ORDER):
        out.append(torch.multinomial(table[out[-2] * VOCAB + out[-1]], 1, generator=g).squeeze(1))
    return torch.stack(out, 1)


def floor(table: Any, n: int, seed: int) -> float:
    """The loss of the source's own probabilities on the ``n`` sequences of ``seed`` (the batch
    the benchmark evaluates on): no model does better on that batch in expectation, so it is the
    floor to measure each variant's loss above. (The chain's entropy rate, on 4096 other
    sequences, is 1.738 nats; this batch's own figure differs by its sampling, ~0.01.)"""
    seq = sequences(table, n, seed)
    ctx = seq[:, :-2] * VOCAB + seq[:, 1:-1]
    return float(-(table[ctx, seq[:, 2:]].clamp_min(1e-30).log()).mean())


def build(width: int, seed: int = 0) -> Any:
    """The student transformer, the same on every rank (fixed seed, ``--seed`` added)."""
    import torch
    import torch.nn as nn

    class CausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, width)
            self.pos = nn.Parameter(torch.zeros(CONTEXT, width))
            layer = nn.TransformerEncoderLayer(width, HEADS, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(width, VOCAB)
            # a plain attribute, not a buffer: DDP would broadcast a buffer before every step
            self.mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)

        def forward(self, x: Any) -> Any:
            h = self.emb(x) + self.pos[: x.shape[1]]
            return self.head(self.body(h, mask=self.mask, is_causal=True))

    torch.manual_seed(42 + seed)
    return CausalLM()


def batch(table: Any, n: int, seed: int) -> tuple[Any, Any]:
    """(inputs, next tokens) of ``n`` sequences."""
    seq = sequences(table, n, seed)
    return seq[:, :-1], seq[:, 1:]


def loss_fn(out: Any, y: Any) -> Any:
    """Cross-entropy on the positions with a full order-2 context."""
    import torch.nn.functional as F

    return F.cross_entropy(out[:, ORDER - 1:].reshape(-1, VOCAB), y[:, ORDER - 1:].reshape(-1))
