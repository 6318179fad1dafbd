"""The bridge's cost model: α–β figures per link class, measured once per group, and the all_reduce
algorithm they predict fastest at each message size. Pure (no torch): ``vcga info --plan`` evaluates
it for a layout from saved figures, and a cache can store the figures as JSON.

Each step an algorithm takes costs ``α + bytes / β`` (Hockney's model: α the fixed cost of a step --
latency, synchronisation, a thread switch -- and β the bandwidth the step moves bytes at). The
figures are measured at group creation on the steps themselves, as the algorithms run them
(:meth:`vcga.bridge.group.BridgeGroup.measure_links`), at two sizes each, slowest rank counting:

- in each vendor group (link class *in-vendor*): the library's reduce + broadcast (what the leader
  algorithm runs in the group), its all-reduce (replicated), and its reduce-scatter + all-gather
  through the library's collectives and through rings of its send/recv (bandwidth);
- between vendor groups, on the host (class *cross-vendor same node* when every set of shard peers
  sits on one node, *cross-node* when every set spans nodes, *mixed* otherwise): the leaders' set
  alone (the leader algorithm), and every shard-peer set at once (bandwidth and replicated: several
  shard peers per node cross the link in parallel, and share it -- the figure is what each gets).

Predictions for ``N`` bytes on vendor groups of ``k`` ranks (max over vendor groups of each
in-group step, since every group must finish it):

- leader: reduce+broadcast(N) + leaders(N);
- replicated: all_reduce(N) + all_sets(N);
- bandwidth, in ``m`` pipeline segments of ``S = N/m`` (:func:`segments`), ``r`` = the in-group
  reduce-scatter + all-gather of one segment (the cheaper method), ``b = all_sets(S/k)``: one
  segment ``r + b``; pipelined through gloo (a segment crosses while the next is reduce-scattered
  and the previous all-gathered) ``r/2 + m·r/2 + (m-1)·max(b, r/2) + b``; through shared memory
  (synchronous) ``m·(r + b)``.

The chosen algorithm is the cheapest prediction (ties: leader, then bandwidth, then replicated).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AlphaBeta", "LinkFigures", "fit", "predict", "choose", "choices", "segments", "FIGURES_VERSION", "SIZES",
           "GROUP_KINDS", "BRIDGE_KINDS"]

#: Bumped when the figures' meaning changes (a cache keyed on it drops older entries).
FIGURES_VERSION = 1

#: The two message sizes every step is timed at (the α–β line goes through both).
SIZES = (64 << 10, 2 << 20)
#: The steps timed inside each vendor group, and on the host between vendor groups.
GROUP_KINDS = ("reduce_bcast", "all_reduce", "rsag_collective", "rsag_p2p")
BRIDGE_KINDS = ("leaders", "all_sets")


@dataclass(frozen=True)
class AlphaBeta:
    """``time(bytes) = alpha_s + bytes / beta_Bps``."""

    alpha_s: float
    beta_Bps: float

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps


def fit(sizes: Sequence[int], seconds: Sequence[float]) -> AlphaBeta:
    """The α–β line through two timed sizes. A slope that noise made flat or negative counts as
    infinitely fast bytes (β = inf, all α); a negative intercept as α = 0."""
    (s1, s2), (t1, t2) = sizes, seconds
    if t2 <= t1:
        return AlphaBeta(max(t1, t2, 0.0), float("inf"))
    beta = (s2 - s1) / (t2 - t1)
    return AlphaBeta(max(0.0, t1 - s1 / beta), beta)


def segments(nbytes: int, segment_bytes: int, max_segments: int) -> int:
    """How many pipeline segments the bandwidth algorithm cuts ``nbytes`` into (its own rule)."""
    return max(1, min(max_segments, nbytes // segment_bytes))


@dataclass
class LinkFigures:
    """What one group measured: α–β per step kind, per vendor group, and the link classes.

    JSON round-trips through :meth:`to_json` / :meth:`from_json` (what rank 0 could broadcast and a
    cache store; :meth:`key` names the topology it belongs to)."""

    #: per vendor group (plan order): step kind -> AlphaBeta; kinds "reduce_bcast", "all_reduce",
    #: "rsag_collective", "rsag_p2p" (the last three only on equal groups)
    groups: list[dict[str, AlphaBeta]]
    #: "leaders" (the leaders' set alone) and, on equal groups, "all_sets" (every set at once)
    bridge: dict[str, AlphaBeta]
    #: link class of each: "in-vendor" per vendor group (with its nodes), and the bridge's class
    classes: dict[str, str]
    #: the shard peers' exchange: "gloo" (pipelined) or "shared memory" (synchronous)
    exchange: str
    group_size: int
    equal_groups: bool
    segment_bytes: int
    max_segments: int
    sizes: tuple[int, int] = SIZES
    #: the raw seconds behind the fits (slowest rank), for the record
    seconds: dict[str, Any] = field(default_factory=dict)
    version: int = FIGURES_VERSION

    def group_method(self, g: int) -> str:
        """Vendor group ``g``'s in-group method for the bandwidth algorithm: the cheaper at the
        larger timed size."""
        f = self.groups[g]
        n = self.sizes[1]
        return "p2p" if f["rsag_p2p"].time(n) < f["rsag_collective"].time(n) else "collective"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [{k: [v.alpha_s, v.beta_Bps] for k, v in g.items()} for g in self.groups]
        d["bridge"] = {k: [v.alpha_s, v.beta_Bps] for k, v in self.bridge.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LinkFigures:
        d = dict(d)
        d["groups"] = [{k: AlphaBeta(*v) for k, v in g.items()} for g in d["groups"]]
        d["bridge"] = {k: AlphaBeta(*v) for k, v in d["bridge"].items()}
        d["sizes"] = tuple(d["sizes"])
        return cls(**d)

    @staticmethod
    def key(topology: Mapping[str, Any]) -> str:
        """A stable name for a topology (backends, ranks per node, link classes): the cache key."""
        return hashlib.sha256(json.dumps(topology, sort_keys=True).encode()).hexdigest()[:16]


def predict(fig: LinkFigures, nbytes: int) -> dict[str, float]:
    """Predicted seconds of each algorithm the figures allow for an all_reduce of ``nbytes``."""
    def worst(kind: str, n: float) -> float:
        return max(g[kind].time(n) for g in fig.groups)

    out = {"leader": worst("reduce_bcast", nbytes) + fig.bridge["leaders"].time(nbytes)}
    if not fig.equal_groups or "all_sets" not in fig.bridge:
        return out
    k = fig.group_size
    out["replicated"] = worst("all_reduce", nbytes) + fig.bridge["all_sets"].time(nbytes)
    m = segments(nbytes, fig.segment_bytes, fig.max_segments)
    s = nbytes / m
    r = max(g["rsag_" + fig.group_method(i)].time(s) for i, g in enumerate(fig.groups))
    b = fig.bridge["all_sets"].time(s / k)
    if m == 1:
        out["bandwidth"] = r + b
    elif fig.exchange == "shared memory":
        out["bandwidth"] = m * (r + b)
    else:
        out["bandwidth"] = r / 2 + m * r / 2 + (m - 1) * max(b, r / 2) + b
    return out


def choices(fig: LinkFigures, sizes: Sequence[int], label: Any = str) -> dict[str, dict[str, Any]]:
    """:func:`choose` at each of ``sizes``: ``{label(size): {"algorithm", "predicted_s"}}`` (what
    ``describe()["calibration"]["choice"]`` and ``vcga info --plan --figures`` show)."""
    out = {}
    for n in sizes:
        alg, predicted = choose(fig, n)
        out[label(n)] = {"algorithm": alg, "predicted_s": predicted}
    return out


def choose(fig: LinkFigures, nbytes: int) -> tuple[str, dict[str, float]]:
    """The algorithm with the cheapest prediction for ``nbytes``, and every prediction."""
    p = predict(fig, nbytes)
    order = {"leader": 0, "bandwidth": 1, "replicated": 2}
    return min(p, key=lambda a: (p[a], order[a])), p
