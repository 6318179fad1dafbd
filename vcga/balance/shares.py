"""How many samples of a global batch each rank takes: weights into counts, vendor weights, and
the decision of ``shares="auto"`` (no torch here: ``vcga info --plan`` uses these without a group).

Every function is deterministic in its arguments -- the same floats in, the same counts out, on
every rank and every machine -- because every rank of a job computes the shares on its own from
the same gathered figures, and they must agree without another collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vcga.errors import VcgaConfigError

__all__ = ["split_counts", "parse_weights", "for_backend", "weight_of", "counts_from_weights", "micro_sizes",
           "AutoPolicy", "Decision"]


def split_counts(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """``total`` split in proportion to ``weights``, by largest remainder, each count at least ``minimum``.

    The floors of the exact quotas are handed out first, then one more to each of the largest
    remainders (ties: the lower rank). A count below ``minimum`` is raised to it, each unit taken
    from the rank most above its quota (ties: the larger count, then the lower rank): a rank with
    nothing to do would leave its peers waiting in DDP's reduction for gradients it never computes.
    """
    n = len(weights)
    if n == 0:
        raise VcgaConfigError("shares", list(weights), "one weight per rank (got none)", "vcga.balance")
    bad = [w for w in weights if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0)]
    if bad:
        raise VcgaConfigError("shares", list(weights), "finite weights > 0 (a rank that should get nothing "
                              "belongs outside the data-parallel group)", "vcga.balance")
    if total < n * minimum:
        raise VcgaConfigError("global_batch", total, f"at least {minimum} sample(s) per rank: >= {n * minimum} "
                              f"for {n} ranks", "vcga.balance")
    s = math.fsum(weights)
    quotas = [total * w / s for w in weights]
    counts = [int(math.floor(q)) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(n), key=lambda r: (-(quotas[r] - counts[r]), r))
    for r in order[:left]:
        counts[r] += 1
    for r in range(n):
        while counts[r] < minimum:
            donor = max((d for d in range(n) if counts[d] > minimum),
                        key=lambda d: (counts[d] - quotas[d], counts[d], -d))
            counts[donor] -= 1
            counts[r] += 1
    return counts


def parse_weights(text: str, option: str = "weights") -> dict[str, float]:
    """``"nccl=2.5,hccl=1"`` -> ``{"nccl": 2.5, "hccl": 1.0}`` (the command line's form of a weights dict)."""
    out: dict[str, float] = {}
    for part in text.replace(" ", "").split(","):
        name, sep, value = part.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = math.nan
        if not sep or not name or not (math.isfinite(w) and w > 0) or name in out:
            raise VcgaConfigError(option, text, "backend=weight pairs with weights > 0, each backend once, "
                                  "e.g. nccl=2.5,hccl=1", "vcga.balance")
        out[name] = w
    return out


def for_backend(mapping: Mapping[str, Any], backend: str, stands_for: str | None) -> Any:
    """``mapping``'s value for a rank running ``backend``: by its name, or -- for a simulated backend
    (``sim-nccl``) -- by the name of the library it stands for (``nccl``); None when it names neither."""
    for key in (backend, stands_for):
        if key is not None and key in mapping:
            return mapping[key]
    return None


def weight_of(backend: str, stands_for: str | None, weights: Mapping[str, float], key: str = "shares") -> float:
    """The weight ``weights`` gives a rank running ``backend`` (:func:`for_backend`); ``key``: the
    argument's name in the error."""
    w = for_backend(weights, backend, stands_for)
    if w is not None:
        return float(w)
    known = backend + (f" (simulating {stands_for})" if stands_for and stands_for != backend else "")
    raise VcgaConfigError(key, dict(weights), f"a weight for every backend of the job; none for {known}",
                          "vcga.balance")


def counts_from_weights(total: int, weights: Mapping[str, float], backends: Sequence[tuple[str, str | None]],
                        minimum: int = 1, key: str = "shares") -> list[int]:
    """Counts per rank for vendor ``weights``; ``backends``: each rank's (backend, what it simulates or None)."""
    return split_counts(total, [weight_of(b, s, weights, key) for b, s in backends], minimum)


def micro_sizes(count: int, cap: int | None) -> list[int]:
    """``count`` samples as the fewest micro-batches of at most ``cap``, as equal as possible
    (the larger ones first); one micro-batch when there is no cap."""
    if cap is None or count <= cap:
        return [count]
    parts = -(-count // cap)
    q, r = divmod(count, parts)
    return [q + 1] * r + [q] * (parts - r)


@dataclass(frozen=True)
class Decision:
    """What :meth:`AutoPolicy.decide` concluded from one window of gathered figures."""

    shares: list[int]  #: the shares from the next step (the current ones when not changed)
    changed: bool
    speeds: list[float] | None  #: the smoothed samples per second per rank (None: nothing measured yet)
    predicted: float | None  #: seconds per step of the new shares, by the smoothed speeds
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"shares": self.shares, "changed": self.changed, "speeds": self.speeds,
                "predicted_step_s": self.predicted, "reason": self.reason}


@dataclass(frozen=True)
class AutoPolicy:
    """The rule of ``shares="auto"``, a pure function of the figures every rank gathered.

    Each rank's speed in a window is the samples it measured over the seconds it measured
    (:meth:`vcga.balance.Balancer.measure`); the estimate is smoothed across windows
    (``speed <- smoothing * old + (1 - smoothing) * new``), so one noisy window moves it part of
    the way. The candidate shares are the global batch split in proportion to the estimates. They
    replace the current ones only when they are predicted faster by more than ``hysteresis``
    (step time = the slowest rank's share over its speed): noise smaller than that never moves a
    sample, so the shares do not oscillate. Shares proportional to measured speeds converge where
    every rank's step takes the same time, even when a step also has a fixed cost per rank.
    """

    smoothing: float = 0.3
    hysteresis: float = 0.03

    def __post_init__(self) -> None:
        if not 0.0 <= self.smoothing < 1.0:
            raise VcgaConfigError("smoothing", self.smoothing, "a weight of the old estimate in [0, 1)", "vcga.balance")
        if not 0.0 <= self.hysteresis < 1.0:
            raise VcgaConfigError("hysteresis", self.hysteresis, "a fraction of the step time in [0, 1)",
                                  "vcga.balance")

    def decide(self, total: int, shares: Sequence[int], figures: Sequence[tuple[float, int]],
               speeds: Sequence[float] | None) -> Decision:
        """The shares after a window: ``figures`` per rank (seconds measured, samples measured),
        ``speeds`` the estimates after the previous window (None at the first)."""
        if any(s <= 0 or not math.isfinite(t) or t <= 0 for t, s in figures):
            missing = [r for r, (t, s) in enumerate(figures) if s <= 0 or not math.isfinite(t) or t <= 0]
            return Decision(list(shares), False, list(speeds) if speeds else None, None,
                            f"ranks {missing} measured nothing in this window")
        new = [s / t for t, s in figures]
        est = new if speeds is None else [self.smoothing * o + (1 - self.smoothing) * v
                                          for o, v in zip(speeds, new, strict=True)]
        candidate = split_counts(total, est)
        now = max(c / v for c, v in zip(shares, est, strict=True))
        then = max(c / v for c, v in zip(candidate, est, strict=True))
        if candidate != list(shares) and then < now * (1 - self.hysteresis):
            return Decision(candidate, True, est, then, f"predicted {then * 1e3:.3g} ms per step, was {now * 1e3:.3g}")
        return Decision(list(shares), False, est, now, "within the hysteresis of the current shares")
