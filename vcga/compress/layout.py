"""Where the slow hop is, and what a compressed exchange declares it sends (no torch here:
``vcga info --plan`` uses both without creating a group)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vcga.compress.meter import sent_bytes
from vcga.contract import Combine

__all__ = ["Layout", "declared_sent", "chunks"]


@dataclass(frozen=True)
class Layout:
    """The islands of a group (group ranks), in order of their first rank, and each rank's facts."""

    facts: tuple[tuple[str, str, str], ...]  #: per group rank: (backend, node, device type)
    islands: tuple[tuple[int, ...], ...]

    @classmethod
    def from_facts(cls, facts: Sequence[Sequence[str]]) -> Layout:
        f = tuple((str(b), str(n), str(d)) for b, n, d in facts)
        by: dict[tuple[str, str], list[int]] = {}
        for r, (b, n, _) in enumerate(f):
            by.setdefault((b, n), []).append(r)
        islands = tuple(sorted((tuple(v) for v in by.values()), key=lambda rs: rs[0]))
        return cls(f, islands)

    @property
    def equal(self) -> bool:
        return len({len(i) for i in self.islands}) == 1

    @property
    def hop(self) -> str | None:
        """The slow hop's link class: "cross-node", "cross-vendor" (same node), or None (one island)."""
        if len(self.islands) < 2:
            return None
        nodes = {self.facts[i[0]][1] for i in self.islands}
        return "cross-node" if len(nodes) > 1 else "cross-vendor"

    def island_of(self, rank: int) -> tuple[int, ...]:
        for isl in self.islands:
            if rank in isl:
                return isl
        raise ValueError(rank)

    def peer_sets(self) -> list[tuple[int, ...]]:
        """Sets of ranks that exchange compressed: local rank i of every island (equal islands),
        else the islands' first ranks."""
        if len(self.islands) < 2:
            return []
        if self.equal:
            return [tuple(isl[i] for isl in self.islands) for i in range(len(self.islands[0]))]
        return [tuple(isl[0] for isl in self.islands)]

    def describe(self) -> dict[str, Any]:
        return {"islands": [{"ranks": list(i), "backend": self.facts[i[0]][0], "node": self.facts[i[0]][1]}
                            for i in self.islands],
                "equal": self.equal, "hop": self.hop, "peer_sets": [list(p) for p in self.peer_sets()]}


def chunks(n: int, peers: int) -> list[tuple[int, int]]:
    """The two-phase exchange's chunk j of n elements: [j·c, (j+1)·c), c = ⌈n/peers⌉."""
    c = -(-n // peers) if n else 0
    return [(min(j * c, n), min((j + 1) * c, n)) for j in range(peers)]


def declared_sent(c: Any, shapes: Sequence[tuple[int, ...]], dtype: str, peers: int, native_sum: bool) -> float:
    """Bytes one peer sends for tensors of ``shapes`` through compressor ``c``'s exchange among
    ``peers``, from its declared payload sizes: SUM payloads by all_reduce where the group sums the
    payload dtype natively (``native_sum``), else gathered; GATHER payloads gathered, or all_to_all
    plus all_gather in the two-phase exchange (padded to the widest chunk's payload)."""
    if peers <= 1:
        return 0.0
    if c.combine is Combine.SUM:
        total = sum(c.payload_nbytes(tuple(s), dtype) for s in shapes)
        return sent_bytes("all_reduce" if native_sum else "all_gather", total, peers)
    if not c.server:
        return sent_bytes("all_gather", sum(c.payload_nbytes(tuple(s), dtype) for s in shapes), peers)
    widths = [[c.payload_nbytes((b - a,), dtype) if b > a else 0 for a, b in chunks(math.prod(s), peers)]
              for s in shapes]
    row = max((sum(w[j] for w in widths) for j in range(peers)), default=0)
    return sent_bytes("all_to_all", sum(sum(w) for w in widths), peers) + sent_bytes("all_gather", row, peers)
