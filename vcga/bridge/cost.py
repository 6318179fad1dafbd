"""The bridge's cost model: α–β figures per link class, measured once per group, and the all_reduce
algorithm they predict fastest at each message size. Pure (no torch): ``vcga info --plan`` evaluates
it for a layout from saved figures, and a cache can store the figures as JSON.

Each step an algorithm takes costs ``α + bytes / β`` (Hockney's model: α the fixed cost of a step --
latency, synchronisation, a thread switch -- and β the bandwidth the step moves bytes at). The
figures are measured at group creation on the steps themselves, as the algorithms run them
(:meth:`vcga.bridge.allreduce.AllReducer.measure_links`), at two sizes each, slowest rank counting:

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
- bandwidth, in ``m`` pipeline segments of ``S = N/m``, ``r`` = the in-group reduce-scatter +
  all-gather of one segment (the cheaper method), ``b = all_sets(S/k)``: one segment ``r + b``;
  pipelined through gloo (a segment crosses while the next is reduce-scattered and the previous
  all-gathered) ``max(r + m·b, m·r + b)``: whichever of the link and the in-group steps is busier
  sets the pace; through shared memory (synchronous) ``m·(r + b)``. ``m`` itself (:func:`segments`)
  is the count with the smallest prediction plus the fixed cost (α) every further segment adds on
  the CPU, which the cores pay in full when they also run the compute (DDP's backward): a slow link
  gets the in-group steps of a large message hidden, a DDP bucket of a few MiB is cut only where
  that saves more than the segments cost, and a fast link is not cut into pieces that cost more α
  than they hide. In a group that pipelines consecutive all_reduces (docs/bridge.md, "Pipelining
  across collectives") the bandwidth algorithm is predicted per all_reduce of such a stream
  (``stream``): ``m·max(r, b)``, each stage busy on its own thread and communicators -- what a DDP
  step's buckets cost, one after the other (from ``STREAM_MIN_BYTES``, 1 MiB); ``m`` stays the
  count chosen for one all_reduce alone (one segment would make a large message alone wait for its
  whole reduce-scatter first).

The chosen algorithm is the cheapest prediction (ties: leader, then bandwidth, then replicated).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from vcga._values import FrozenValue

__all__ = ["AlphaBeta", "LinkFigures", "fit", "fit_past_knee", "LARGE_SIZE", "predict", "choose", "choices",
           "segments", "segment_cost", "bandwidth_time", "FIGURES_VERSION", "SIZES", "GROUP_KINDS", "BRIDGE_KINDS"]

#: Bumped when the figures' meaning changes (a cache keyed on it drops older entries).
FIGURES_VERSION = 1

#: The two message sizes every step is timed at (the α–β line goes through both).
SIZES = (64 << 10, 2 << 20)
#: From this size on, a group that pipelines consecutive all_reduces predicts the bandwidth
#: algorithm per all_reduce of a stream (``stream``); smaller messages are latency-bound and seldom
#: come in streams (DDP's buckets are MiB-sized), so they keep the prediction of one alone.
STREAM_MIN_BYTES = 1 << 20

#: The steps timed inside each vendor group, and on the host between vendor groups.
GROUP_KINDS = ("reduce_bcast", "all_reduce", "rsag_collective", "rsag_p2p")
BRIDGE_KINDS = ("leaders", "all_sets")


class AlphaBeta(FrozenValue):
    """``time(bytes) = alpha_s + bytes / beta_Bps``; past a burst knee (``knee_bytes`` > 0), the
    bytes beyond it at ``sustained_Bps``: a token bucket lets the first bytes through at a burst
    rate, the rest at the link's rate (:func:`fit_past_knee`). Frozen, compared by value."""

    __slots__ = ("alpha_s", "beta_Bps", "knee_bytes", "sustained_Bps")

    alpha_s: float
    beta_Bps: float  # noqa: N815 - B is bytes (bps would be bits); a public field and JSON key
    knee_bytes: float
    sustained_Bps: float  # noqa: N815 - B/s, as beta_Bps

    def __init__(self, alpha_s: float, beta_Bps: float, knee_bytes: float = 0.0,  # noqa: N803 - the fields' names
                 sustained_Bps: float = 0.0) -> None:  # noqa: N803
        self._set(alpha_s, beta_Bps, knee_bytes, sustained_Bps)

    def time(self, nbytes: float) -> float:
        if self.knee_bytes and nbytes > self.knee_bytes:
            return self.alpha_s + self.knee_bytes / self.beta_Bps + (nbytes - self.knee_bytes) / self.sustained_Bps
        return self.alpha_s + nbytes / self.beta_Bps

    def pair(self) -> list[float]:
        """As JSON: ``[α, β]``, or ``[α, β, knee, sustained]`` past a knee."""
        return [self.alpha_s, self.beta_Bps, self.knee_bytes, self.sustained_Bps] if self.knee_bytes else \
            [self.alpha_s, self.beta_Bps]


def fit(sizes: Sequence[int], seconds: Sequence[float]) -> AlphaBeta:
    """The α–β line through two timed sizes. A slope that noise made flat or negative counts as
    infinitely fast bytes (β = inf, all α); a negative intercept as α = 0."""
    (s1, s2), (t1, t2) = sizes, seconds
    if t2 <= t1:
        return AlphaBeta(max(t1, t2, 0.0), float("inf"))
    beta = (s2 - s1) / (t2 - t1)
    return AlphaBeta(max(0.0, t1 - s1 / beta), beta)


#: The size the host steps between vendor groups are also timed at (:data:`BRIDGE_KINDS`), past the
#: burst a token bucket of a few MiB lets through (:func:`fit_past_knee`).
LARGE_SIZE = 8 << 20
#: A knee: the rate from the larger timed size to :data:`LARGE_SIZE` below the rate of the smaller
#: pair by this factor.
KNEE_FACTOR = 1.25


def fit_past_knee(sizes: Sequence[int], seconds: Sequence[float]) -> AlphaBeta:
    """The α–β line through the first two of three timed sizes, and past the second a *sustained*
    rate, where the third shows one: a link shaped by a token bucket (tc tbf's ``burst``, a switch
    buffer, a cloud rate limit with a burst allowance) lets a message that fits in the bucket through
    at the burst rate, and only what exceeds it at the link's rate. Measured at the first two sizes
    alone, 2 MiB through a 1 MB bucket at 1 Gbit/s looked twice as fast as the link. Where the rate
    from the second size to the third is below the first line's β by :data:`KNEE_FACTOR`, the time
    past the second size follows that lower rate (``knee_bytes`` = the second size); otherwise the
    first line holds."""
    (s1, s2, s3), (t1, t2, t3) = sizes, seconds
    ab = fit((s1, s2), (t1, t2))
    if t3 <= t2:
        return ab
    sustained = (s3 - s2) / (t3 - t2)
    if sustained * KNEE_FACTOR >= ab.beta_Bps:
        return ab
    return AlphaBeta(ab.alpha_s, ab.beta_Bps, float(s2), sustained)


def bandwidth_time(fig: LinkFigures, nbytes: int, m: int, stream: bool = False) -> float:
    """Predicted seconds of the bandwidth algorithm on ``nbytes`` in ``m`` pipeline segments.
    ``stream``: per all_reduce of a stream of them in a group that pipelines across collectives
    (docs/bridge.md): each stage is busy on its own, so the busier of the in-group steps and the
    link sets the pace, ``m * max(r, b)``."""
    s = nbytes / m
    r = max(g["rsag_" + fig.group_method(i)].time(s) for i, g in enumerate(fig.groups))
    b = fig.bridge["all_sets"].time(s / fig.group_size)
    if fig.exchange == "shared memory":
        return m * (r + b)
    if stream:
        return m * max(r, b)
    # Two resources, each serial: the thread's in-group steps and the link's exchanges (gloo runs a
    # group's works in order). Segment j's exchange starts when its reduce-scatter is done and the
    # previous exchange has left; its all-gather when its exchange arrived. Link-bound: the first
    # reduce-scatter, m exchanges, the last all-gather; thread-bound: m segments' steps and one
    # exchange. (m = 1: r + b either way.)
    return max(r + m * b, m * r + b)


def segment_cost(fig: LinkFigures) -> float:
    """Seconds of fixed cost one more pipeline segment adds on the ranks' CPUs beyond what
    :func:`bandwidth_time` counts: its in-group reduce-scatter + all-gather's α (the slowest vendor
    group's, in the method it uses), which the pipeline hides in wall time when the link is the
    busier resource. (The exchange's α is in the link's term already, once per segment.)"""
    return max(g["rsag_" + fig.group_method(i)].alpha_s for i, g in enumerate(fig.groups))


def segments(fig: LinkFigures, nbytes: int) -> int:
    """How many pipeline segments make the bandwidth algorithm cheapest on ``nbytes``: the count (a
    power of two up to ``fig.max_segments``, segments of at least ``fig.min_segment_bytes``) with the
    smallest prediction plus the fixed cost the segments add, ``(m - 1) * segment_cost``.

    More segments overlap more of the in-group steps with the exchange; each also costs its steps'
    fixed cost once more, and that cost is CPU work (Python, syscalls, thread wake-ups of the host
    bridge) which the pipeline hides in wall time only when the cores are otherwise idle. Under
    DDP they are not: backward runs on the same cores while its buckets are reduced, so every
    segment's fixed cost is paid in full (measured on two nodes at 1 Gbit/s: docs/benchmarks.md,
    "DDP steps: pipelined and in order"). Ties: fewer segments."""
    extra = segment_cost(fig)
    best, best_t, m = 1, bandwidth_time(fig, nbytes, 1), 2
    while m <= fig.max_segments and nbytes / m >= fig.min_segment_bytes:
        t = bandwidth_time(fig, nbytes, m) + (m - 1) * extra
        if t < best_t:
            best, best_t = m, t
        m *= 2
    return best


class LinkFigures:
    """What one group measured: α–β per step kind, per vendor group, and the link classes.

    JSON round-trips through :meth:`to_json` / :meth:`from_json` (what rank 0 could broadcast and a
    cache store; :meth:`key` names the topology it belongs to). Compared by value. A plain class
    rather than a dataclass: a mixed-vendor start defines it, and a dataclass compiles its
    methods when defined.

    :param groups: per vendor group (plan order): step kind -> AlphaBeta; kinds "reduce_bcast",
        "all_reduce", "rsag_collective", "rsag_p2p" (the last three only on equal groups).
    :param bridge: "leaders" (the leaders' set alone) and, on equal groups, "all_sets" (every set at once).
    :param classes: link class of each: "in-vendor" per vendor group (with its nodes), and the bridge's class.
    :param exchange: the shard peers' exchange: "gloo" (pipelined) or "shared memory" (synchronous).
    :param min_segment_bytes: / :param max_segments: the bandwidth algorithm's pipeline: segments
        of at least this many bytes, at most this many.
    :param seconds: the raw seconds behind the fits (slowest rank), for the record.
    :param observed: what the group observed its all_reduces take, per size class
        (:mod:`vcga.bridge.verify`): ``{class: {"chosen", "bytes", "seconds": {algorithm: s},
        "predicted": {algorithm: s}}}`` -- the corrected figures a cache entry carries to the next start.
    """

    #: the fields, in the order :meth:`__init__` takes them and :meth:`to_json` writes them
    FIELDS = ("groups", "bridge", "classes", "exchange", "group_size", "equal_groups", "min_segment_bytes",
              "max_segments", "sizes", "seconds", "version", "observed")

    def __init__(self, groups: list[dict[str, AlphaBeta]], bridge: dict[str, AlphaBeta], classes: dict[str, str],
                 exchange: str, group_size: int, equal_groups: bool, min_segment_bytes: int, max_segments: int,
                 sizes: tuple[int, int] = SIZES, seconds: dict[str, Any] | None = None,
                 version: int = FIGURES_VERSION, observed: dict[str, Any] | None = None) -> None:
        self.groups = groups
        self.bridge = bridge
        self.classes = classes
        self.exchange = exchange
        self.group_size = group_size
        self.equal_groups = equal_groups
        self.min_segment_bytes = min_segment_bytes
        self.max_segments = max_segments
        self.sizes = sizes
        self.seconds: dict[str, Any] = {} if seconds is None else seconds
        self.version = version
        self.observed: dict[str, Any] = {} if observed is None else observed

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.FIELDS)

    # mutable, so unhashable (as a dataclass without frozen=True)
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "LinkFigures(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS) + ")"

    def group_method(self, g: int) -> str:
        """Vendor group ``g``'s in-group method for the bandwidth algorithm: the cheaper at the
        larger timed size."""
        f = self.groups[g]
        n = self.sizes[1]
        return "p2p" if f["rsag_p2p"].time(n) < f["rsag_collective"].time(n) else "collective"

    def to_json(self) -> dict[str, Any]:
        """Every field, copied deeply (as ``dataclasses.asdict`` would), each α–β as its :meth:`~AlphaBeta.pair`."""
        import copy

        d = {f: copy.deepcopy(getattr(self, f)) for f in self.FIELDS if f not in ("groups", "bridge")}
        d["groups"] = [{k: v.pair() for k, v in g.items()} for g in self.groups]
        d["bridge"] = {k: v.pair() for k, v in self.bridge.items()}
        return {f: d[f] for f in self.FIELDS}

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


def predict(fig: LinkFigures, nbytes: int, stream: bool = False) -> dict[str, float]:
    """Predicted seconds of each algorithm the figures allow for an all_reduce of ``nbytes``
    (``stream``: from :data:`STREAM_MIN_BYTES` on, the bandwidth algorithm's per all_reduce of a
    pipelined stream, :func:`bandwidth_time`)."""
    def worst(kind: str, n: float) -> float:
        return max(g[kind].time(n) for g in fig.groups)

    out = {"leader": worst("reduce_bcast", nbytes) + fig.bridge["leaders"].time(nbytes)}
    if not fig.equal_groups or "all_sets" not in fig.bridge:
        return out
    out["replicated"] = worst("all_reduce", nbytes) + fig.bridge["all_sets"].time(nbytes)
    # the segments of one all_reduce alone (a large one still overlaps its own steps), in either case
    out["bandwidth"] = bandwidth_time(fig, nbytes, segments(fig, nbytes), stream and nbytes >= STREAM_MIN_BYTES)
    return out


def choices(fig: LinkFigures, sizes: Sequence[int], label: Any = str,
            stream: bool = False) -> dict[str, dict[str, Any]]:
    """:func:`choose` at each of ``sizes``: ``{label(size): {"algorithm", "predicted_s", "segments"}}``
    (segments: the bandwidth algorithm's pipeline depth, where it is a choice; what
    ``describe()["calibration"]["choice"]`` and ``vcga info --plan --figures`` show)."""
    out: dict[str, dict[str, Any]] = {}
    for n in sizes:
        alg, predicted = choose(fig, n, stream)
        out[label(n)] = {"algorithm": alg, "predicted_s": predicted}
        if "bandwidth" in predicted:
            out[label(n)]["segments"] = segments(fig, n)  # the bandwidth algorithm's pipeline depth
    return out


def choose(fig: LinkFigures, nbytes: int, stream: bool = False) -> tuple[str, dict[str, float]]:
    """The algorithm with the cheapest prediction for ``nbytes``, and every prediction (``stream``:
    in a group that pipelines across collectives, :func:`bandwidth_time`)."""
    p = predict(fig, nbytes, stream)
    order = {"leader": 0, "bandwidth": 1, "replicated": 2}
    return min(p, key=lambda a: (p[a], order[a])), p
