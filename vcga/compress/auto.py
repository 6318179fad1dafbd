"""``when=auto`` checked against real steps: per bucket, the observed cost of reducing it compressed
and plainly, and the choice the observations make (pure: :class:`AutoChoice` is fed numbers;
:class:`vcga.compress.CompressionState` drives it; docs/compression.md, "when=auto").

The cost model (:mod:`vcga.compress.cost`) decides a bucket's first mode from figures measured when
the hook was created -- the link's α–β and the compressor's cost on an idle core -- which do not see
what a step really costs: ranks sharing cores during backward, a link whose burst allowance made it
look fast, a CPU busy with other work. So each bucket's reduction is timed in real steps (the
island stage, its share of the step's compressed exchange by elements, or its plain all_reduce),
and after :data:`WINDOW` steps of the first mode (the first step after a change not counted: it
allocates and warms up) the other mode is tried for as many; the bucket then keeps the faster --
compressed only where its median is below :data:`MARGIN` times the plain one, or the other way
round for a bucket that started compressed. Settled, a bucket whose mode gets :data:`DRIFT` times
slower than when it settled is tried the other way again.

Every rank changes modes at the same step boundary: the checks fall on the same steps everywhere
(:meth:`AutoChoice.due`), and there every rank's medians are summed in one small all_reduce over
the group (:meth:`AutoChoice.table` / :meth:`AutoChoice.agree`): every rank decides from the same
numbers, the mean over ranks. A bucket that goes back to plain takes its error-feedback residual
with it (nothing compression held back is lost).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AutoChoice", "WINDOW", "MARGIN", "DRIFT", "MONITOR"]

#: Steps of a mode observed before it is judged (the median counts).
WINDOW = 4
#: Compression is kept only where its median is below this share of the plain median (and plain
#: replaces compression only where it is below this share of the compressed median).
MARGIN = 0.95
#: A settled bucket is tried the other way again when its mode takes this many times its settled
#: median at a check (a shared machine's noise alone stays below it).
DRIFT = 2.0
#: Steps between checks once every bucket has settled.
MONITOR = 32


@dataclass
class _Bucket:
    compress: bool  # the mode its reductions use now (the same on every rank)
    first: bool  # the mode the cost model chose
    phase: str = "first"  # "first" (observing the model's mode), "trial" (the other one), "settled"
    skip: int = 1  # observations still to leave out (the first after a change)
    samples: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    agreed: dict[bool, float] = field(default_factory=dict)  # mean over ranks of each mode's median
    settled_s: float | None = None
    predicted: dict[str, float] = field(default_factory=dict)
    changes: int = 0


class AutoChoice:
    """Per bucket key, the mode (compress or not) and what decided it (module docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[Hashable, _Bucket] = {}
        self._order: list[Hashable] = []  # keys in the order first seen: the same on every rank
        self._next = WINDOW  # the step boundary of the next check
        #: checks run so far (the all_reduces they cost)
        self.checks = 0

    def known(self, key: Hashable) -> bool:
        return key in self.buckets

    def add(self, key: Hashable, compress: bool, predicted: Mapping[str, float] | None = None) -> None:
        """A bucket the cost model decided for (every rank alike)."""
        self.buckets[key] = _Bucket(compress, compress, predicted=dict(predicted or {}))
        self._order.append(key)

    def compress(self, key: Hashable) -> bool:
        return self.buckets[key].compress

    def forget(self, keep: Any) -> None:
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
        if b.skip:
            b.skip -= 1
            return
        got = b.samples[compress]
        got.append(seconds)
        del got[:-WINDOW]

    def due(self, step: int) -> bool:
        """Whether the boundary after ``step`` steps is a check (the same on every rank)."""
        return bool(self.buckets) and step >= self._next

    def table(self) -> list[float]:
        """This rank's figures for the check: per bucket (in :attr:`_order`), the median of each
        mode's recent observations and whether it has :data:`WINDOW` of them (as 1.0 / 0.0)."""
        out: list[float] = []
        for key in self._order:
            b = self.buckets[key]
            for mode in (True, False):
                s = b.samples[mode]
                out += [statistics.median(s) if s else 0.0, 1.0 if len(s) >= WINDOW else 0.0]
        return out

    def agree(self, summed: list[float], world: int, step: int) -> list[tuple[Hashable, bool]]:
        """Apply the check: ``summed`` is :meth:`table` summed over every rank (the same numbers on
        every rank). Returns the buckets whose mode changed, with the new mode."""
        self.checks += 1
        changed = []
        settling = False
        for i, key in enumerate(self._order):
            b = self.buckets[key]
            row = summed[4 * i:4 * i + 4]
            ready = {True: row[1] >= world, False: row[3] >= world}  # every rank has its window
            mean = {True: row[0] / world, False: row[2] / world}
            for mode in (True, False):
                if ready[mode]:
                    b.agreed[mode] = mean[mode]
            new = self._judge(b, ready)
            if new is not None and new != b.compress:
                b.compress, b.skip, b.changes = new, 1, b.changes + 1
                b.samples[new] = []
                changed.append((key, new))
            settling |= b.phase != "settled"
        self._next = step + (WINDOW + 1 if settling else MONITOR)
        return changed

    @staticmethod
    def _judge(b: _Bucket, ready: Mapping[bool, bool]) -> bool | None:
        mode = b.compress
        if b.phase == "first":
            if not ready[mode]:
                return None
            b.phase = "trial"
            return not mode
        if b.phase == "trial":
            if not ready[mode]:
                return None
            other = not mode  # the first mode, observed before the trial
            b.phase = "settled"
            keep = b.agreed[mode] < MARGIN * b.agreed[other]  # the trial mode must win by the margin
            chosen = mode if keep else other
            b.settled_s = b.agreed[chosen]
            return chosen
        # settled: a mode that got much slower than it was is tried the other way again
        if ready[mode] and b.settled_s is not None and b.agreed[mode] > DRIFT * b.settled_s:
            b.phase = "trial"
            b.agreed.pop(not mode, None)
            return not mode
        return None

    def describe(self) -> list[dict[str, Any]]:
        """Per bucket: its mode, what the model predicted, the observed medians (mean over ranks,
        seconds per step), how it got there."""
        out = []
        for key in self._order:
            b = self.buckets[key]
            out.append({"bucket": _name(key), "compress": b.compress, "model_chose": b.first, "phase": b.phase,
                        "predicted_s": dict(b.predicted),
                        "observed_s": {("compressed" if m else "plain"): s for m, s in b.agreed.items()},
                        "changes": b.changes})
        return out


def _name(key: Hashable) -> str:
    n, shapes, dtype = key if isinstance(key, tuple) and len(key) == 3 else (key, (), "")
    return f"{n} x {dtype} ({len(shapes)} tensors)" if shapes else f"{n} x {dtype}"
