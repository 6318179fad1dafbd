"""``when=auto`` checked against real steps: per bucket, the observed cost of reducing it compressed
and plainly, and the choice the observations make (pure: :class:`AutoChoice` is fed numbers;
:class:`vcga.compress.CompressionState` drives it; docs/compression.md, "when=auto").

The cost model (:mod:`vcga.compress.cost`) decides a bucket's mode from figures measured when the
hook was created -- the link's α–β and the compressor's cost on an idle core -- which do not see
what a step really costs: ranks sharing cores during backward, a link whose burst allowance made it
look fast, a CPU busy with other work. So each bucket's reduction is timed in real steps (its
island stage and its share of the step's compressed exchange by elements, or its plain all_reduce)
during a **trial**: the bucket alternates between the two modes step by step, so that both are
timed under the same load (a machine whose load changes would otherwise favour whichever mode ran
in its quieter minutes), until each has :data:`WINDOW` observations (a mode's first one, which
allocates and warms up, not counted). The comparison is paired: each compressed step against the
plain step next to it, the median of those ratios -- a load that changes during the trial changes
both sides of a pair alike. The bucket keeps the cost model's mode unless the other one is faster
by :data:`MARGIN`. Settled, a bucket is checked every :data:`MONITOR`
steps and tried again if its mode has become :data:`DRIFT` times slower than when it settled.
While alternating, a bucket keeps its error-feedback residual across its plain steps (they leave it
alone); a bucket that settles plain takes it along into its next plain sum (nothing compression
held back is lost).

Every rank changes modes at the same step boundary: the alternation is a function of the step,
the checks fall on the same steps everywhere (:meth:`AutoChoice.due`), and there every rank's
medians are summed in one small all_reduce over the group (:meth:`AutoChoice.table` /
:meth:`AutoChoice.agree`), so every rank decides from the same numbers, the mean over ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AutoChoice", "WINDOW", "MARGIN", "DRIFT", "MONITOR"]

#: Observations of each mode a trial collects (their median counts).
WINDOW = 4
#: The mode the cost model chose (or the settled one, when tried again) is kept unless the other's
#: median is below this share of its own.
MARGIN = 0.95
#: A settled bucket is tried again when its mode takes this many times its settled median at a
#: check (a shared machine's noise alone stays below it).
DRIFT = 2.0
#: Steps between checks once every bucket has settled.
MONITOR = 32


@dataclass
class _Bucket:
    compress: bool  # the mode its reductions use now (the same on every rank)
    first: bool  # the mode the cost model chose
    incumbent: bool  # the mode a trial keeps unless the other wins by the margin
    phase: str = "trial"  # "trial" (alternating) or "settled"
    seen: set[bool] = field(default_factory=set)  # modes observed once already (the first is left out)
    samples: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    agreed: dict[bool, float] = field(default_factory=dict)  # mean over ranks of each mode's median
    settled_s: float | None = None
    predicted: dict[str, float] = field(default_factory=dict)
    agreed_ratio: float | None = None  # compressed / plain over the last trial's paired steps
    trials: int = 1


class AutoChoice:
    """Per bucket key, the mode (compress or not) and what decided it (module docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[Hashable, _Bucket] = {}
        self._order: list[Hashable] = []  # keys in the order first seen: the same on every rank
        self._next = 2 * WINDOW + 2  # the step boundary of the next check
        #: checks run so far (the all_reduces they cost)
        self.checks = 0

    def known(self, key: Hashable) -> bool:
        return key in self.buckets

    def add(self, key: Hashable, compress: bool, predicted: Mapping[str, float] | None = None) -> None:
        """A bucket the cost model decided for (every rank alike): its trial starts."""
        self.buckets[key] = _Bucket(compress, compress, compress, predicted=dict(predicted or {}))
        self._order.append(key)

    def compress(self, key: Hashable) -> bool:
        return self.buckets[key].compress

    def forget(self, keep: Callable[[Any], bool]) -> None:
        """Drop the buckets ``keep(key)`` rejects (DDP rebuilt its buckets: the old layout's keys
        come no more, and would hold every later check back from the settled pace)."""
        for key in [k for k in self._order if not keep(k)]:
            del self.buckets[key]
        self._order = [k for k in self._order if k in self.buckets]

    def observe(self, key: Hashable, compress: bool, seconds: float) -> None:
        """This rank reduced bucket ``key`` in mode ``compress`` in ``seconds`` this step."""
        b = self.buckets.get(key)
        if b is None or compress != b.compress:
            return
        if compress not in b.seen:
            b.seen.add(compress)
            return
        got = b.samples[compress]
        got.append(seconds)
        del got[:-WINDOW]

    def due(self, step: int) -> bool:
        """Whether the boundary after ``step`` steps is a check (the same on every rank)."""
        return bool(self.buckets) and step >= self._next

    #: figures per bucket in :meth:`table`
    WIDTH = 5

    def table(self) -> list[float]:
        """This rank's figures for the check: per bucket (in :attr:`_order`), the median of each
        mode's recent observations and whether it has :data:`WINDOW` of them (as 1.0 / 0.0), and
        the median over the recent pairs of steps of compressed / plain (0.0 without a full window
        of pairs)."""
        out: list[float] = []
        for key in self._order:
            b = self.buckets[key]
            for mode in (True, False):
                s = b.samples[mode]
                out += [statistics.median(s) if s else 0.0, 1.0 if len(s) >= WINDOW else 0.0]
            c, p = b.samples[True], b.samples[False]
            pairs = [x / y for x, y in zip(c, p, strict=False) if y > 0]  # the i-th of each: adjacent steps of a trial
            out.append(statistics.median(pairs) if b.phase == "trial" and len(pairs) >= WINDOW else 0.0)
        return out

    def agree(self, summed: list[float], world: int, step: int) -> list[tuple[Any, bool]]:
        """Apply the check: ``summed`` is :meth:`table` summed over every rank (the same numbers on
        every rank). Returns the buckets that settled this time, with their mode."""
        self.checks += 1
        settled = []
        for i, key in enumerate(self._order):
            b = self.buckets[key]
            row = summed[self.WIDTH * i:self.WIDTH * (i + 1)]
            ready = {True: row[1] >= world, False: row[3] >= world}  # every rank has its window
            for mode, mean in ((True, row[0] / world), (False, row[2] / world)):
                if ready[mode]:
                    b.agreed[mode] = mean
            if b.phase == "trial" and ready[True] and ready[False] and row[4] > 0:
                ratio = row[4] / world  # compressed over plain, paired steps: the mean over ranks
                b.agreed_ratio = ratio
                faster = ratio < MARGIN if not b.incumbent else 1 / ratio < MARGIN
                chosen = (not b.incumbent) if faster else b.incumbent
                b.phase, b.compress, b.incumbent, b.settled_s = "settled", chosen, chosen, b.agreed[chosen]
                b.samples = {True: [], False: []}
                settled.append((key, chosen))
            elif b.phase == "settled" and ready[b.compress] and b.settled_s is not None \
                    and b.agreed[b.compress] > DRIFT * b.settled_s:
                b.phase, b.trials = "trial", b.trials + 1  # slower than it was: time both modes again
                b.samples = {True: [], False: []}
                b.agreed.clear()
        trying = any(b.phase == "trial" for b in self.buckets.values())
        self._next = step + (2 if trying else MONITOR)
        return settled

    def advance(self) -> None:
        """The step boundary after a check (or none): a bucket in its trial changes mode."""
        for b in self.buckets.values():
            if b.phase == "trial":
                b.compress = not b.compress

    def describe(self) -> list[dict[str, Any]]:
        """Per bucket: its mode, what the model predicted, the observed medians (mean over ranks,
        seconds per step), how it got there."""
        out = []
        for key in self._order:
            b = self.buckets[key]
            out.append({"bucket": _name(key), "compress": b.compress, "model_chose": b.first, "phase": b.phase,
                        "predicted_s": dict(b.predicted),
                        "observed_s": {("compressed" if m else "plain"): s for m, s in b.agreed.items()},
                        "compressed_over_plain": b.agreed_ratio, "trials": b.trials})
        return out


def _name(key: Hashable) -> str:
    n, shapes, dtype = key if isinstance(key, tuple) and len(key) == 3 else (key, (), "")
    return f"{n} x {dtype} ({len(shapes)} tensors)" if shapes else f"{n} x {dtype}"
