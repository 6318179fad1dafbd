"""Online verification of "auto"'s all_reduce choice: what the collectives really take, against the
prediction, and a re-choice where they depart. Pure (no torch): :class:`PlanCheck` is fed numbers;
:class:`~vcga.bridge.allreduce.AllReducer` runs it (docs/bridge.md, "Checked online").

The α–β figures a group measures at creation can be wrong for the sizes it later runs: a token
bucket (a switch buffer, a cloud rate limit with a burst allowance, a link shared with another job)
lets a calibration-sized message through faster than the link's sustained rate, a link's load
changes, a cache entry was measured elsewhere. So the group keeps, per **size class** (the power of
two below the message size, from :data:`VERIFY_MIN_BYTES`), the time each algorithm really took:

- **What is observed.** Each rank times the algorithm on its communication thread, from its own
  start to its end; the observation is the *minimum over ranks*. A rank that arrives late waits
  for nobody, so its time is the algorithm's; an early rank's includes its wait for the late ones.
  An uneven step (ranks with unequal shares of work) is thus not blamed on the algorithm. The first
  call of each algorithm in a group is left out (it connects its gloo pairs).
- **How it travels.** Every rank's time goes to every rank inside the payload of a later all_reduce
  that all ranks take anyway: a *watched* call carries ``world + 1`` more elements -- slot ``r``
  rank r's time of the previous watched call, zero elsewhere, so the SUM is every rank's time, and
  the last slot rank 0's decision (zero from every other rank). No extra collective, no extra
  round trip; the copy into the longer buffer is paid on watched calls only.
- **Who decides.** Rank 0 alone (:meth:`PlanCheck.observe` on agreed figures), one decision per
  watched call at most; every rank applies it when the call that carries it ends, in the group's
  issue order, so every rank switches at the same collective.
- **The rule.** An algorithm's observed time in a class is the least of its last :data:`SAMPLES`
  (a shared machine only ever delays a call: the least is the one least disturbed). A class starts
  on the predicted fastest algorithm. Once :data:`SAMPLES` times of it are in, any other algorithm
  predicted faster than what was observed (by :data:`DEPART`) is tried on the next calls of the
  class; when no untried one is predicted faster than the best observed, the class settles on the
  observed fastest (a challenger must beat the incumbent by :data:`MARGIN`). Settled, one call in
  :data:`MONITOR` is still watched; if the settled algorithm becomes :data:`DRIFT` times slower than
  when it settled, twice running, the class is checked again. A settled class's observed times are
  the corrected figures the cache keeps (:attr:`PlanCheck.observed`), so the next start begins
  settled.

Watched calls are the first of each class (until it settles) and one in :data:`MONITOR`: where
calls are pipelined across collectives, a watched call runs alone (its time is then one
all_reduce's, as predicted). A job that needs run-to-run reproducible sums pins the algorithm
(config ``bridge_algorithm``: switching changes the order of reduction) or switches this off
(``bridge_verify: false``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["PlanCheck", "size_class", "class_bytes", "VERIFY_MIN_BYTES", "SAMPLES", "DEPART", "MARGIN", "MONITOR",
           "DRIFT", "ALGORITHM_CODES"]

#: All_reduces of fewer bytes are not verified (latency-bound: the algorithms differ by little
#: there, and the noise of one call is larger than that).
VERIFY_MIN_BYTES = 256 << 10
#: Observations of an algorithm in a class before it is judged (the least of the last this many counts).
SAMPLES = 3
#: An untried algorithm is tried when its prediction is below the best observed time by this factor.
DEPART = 1.1
#: A challenger replaces the current algorithm only when its median is at most this share of the
#: current one's (noise must not flip a choice).
MARGIN = 0.95
#: A settled class has one call in this many watched.
MONITOR = 16
#: A settled class is checked again when its algorithm takes this many times its settled time, on
#: two watched calls running.
DRIFT = 2.0
#: The algorithms in decision codes (index), in the order the plan names them.
ALGORITHM_CODES = ("leader", "bandwidth", "replicated")
#: Classes a decision code can name: messages below 2^64 bytes.
_CLASSES = 64


def size_class(nbytes: int) -> int:
    """The class of an all_reduce of ``nbytes``: c with 2^c <= nbytes < 2^(c+1)."""
    return max(0, int(nbytes).bit_length() - 1)


def class_bytes(cls: int) -> int:
    """The reference size of class ``cls`` (its lower edge): observations are scaled to it."""
    return 1 << cls


def _encode(cls: int, algorithm: str, watched: bool) -> int:
    return 1 + (cls * len(ALGORITHM_CODES) + ALGORITHM_CODES.index(algorithm)) * 2 + int(watched)


def _decode(code: int) -> tuple[int, str, bool]:
    v = code - 1
    watched, v = bool(v % 2), v // 2
    return v // len(ALGORITHM_CODES), ALGORITHM_CODES[v % len(ALGORITHM_CODES)], watched


class _Class:
    """One size class. ``algorithm``, ``watched`` and ``calls`` are the same on every rank (changed
    only by decisions and by counting calls); the rest is rank 0's judgement. (A plain class: a
    dataclass compiles its methods when defined, at every mixed-vendor start.)"""

    __slots__ = ("algorithm", "watched", "calls", "samples", "tried", "settled_s", "slow", "pending", "switches")

    def __init__(self, algorithm: str, watched: bool = True) -> None:
        self.algorithm = algorithm
        self.watched = watched
        self.calls = 0
        self.samples: dict[str, list[float]] = {}  # rank 0: seconds at the class's size
        self.tried: list[str] = []  # rank 0: in the order tried
        self.settled_s: float | None = None  # rank 0: the settled algorithm's time when it settled
        self.slow = 0  # rank 0: monitoring observations in a row past DRIFT
        self.pending = False  # rank 0: a decision about this class is on its way
        self.switches = 0

    def __repr__(self) -> str:
        return f"_Class({self.algorithm!r}, watched={self.watched}, calls={self.calls})"


class PlanCheck:
    """The verification of one group's all_reduce choice (module docstring).

    :param predict: predicted seconds of each algorithm the figures allow for an all_reduce of N
        bytes run alone (:func:`vcga.bridge.cost.predict`).
    :param initial: the algorithm a class starts on for N bytes (the figures' choice, which in a
        group that pipelines across collectives is made per all_reduce of a stream).
    :param credit: per algorithm, the factor by which a call in a stream costs less than one alone
        (1 where nothing is pipelined): what a watched call's time is multiplied by before algorithms
        are compared.
    :param rank: this rank in the group (0 decides).
    :param world: the group's size (the report's slots).
    :param observed: corrected figures from the cache (:attr:`observed` of an earlier run): classes
        that start settled.
    :param on_settle: called on rank 0 when a class settles or changes (to refresh the cache).
    """

    def __init__(self, predict: Callable[[int], Mapping[str, float]], initial: Callable[[int], str],
                 credit: Callable[[int], Mapping[str, float]], rank: int, world: int,
                 observed: Mapping[str, Mapping[str, Any]] | None = None,
                 on_settle: Callable[[PlanCheck], None] | None = None) -> None:
        self.predict, self.initial, self.credit = predict, initial, credit
        self.rank, self.world = rank, world
        self.on_settle = on_settle
        self.classes: dict[int, _Class] = {}
        #: corrected figures per class (rank 0 keeps them current; every rank starts from the cache's)
        self.observed: dict[str, dict[str, Any]] = {str(k): dict(v) for k, v in (observed or {}).items()}
        for key, entry in self.observed.items():
            alg = entry.get("chosen")
            if alg in ALGORITHM_CODES:
                c = self.classes[int(key)] = _Class(alg, watched=False)
                c.settled_s = entry.get("seconds", {}).get(alg)
                c.samples = {a: [s] for a, s in entry.get("seconds", {}).items() if a in ALGORITHM_CODES}
                c.tried = list(c.samples)
        self._last: tuple[int, str, int] | None = None  # the last watched call: class, algorithm, bytes
        self._mine = 0.0  # this rank's time of it
        self._seen: set[str] = set()  # algorithms that ran once in this group (their first call is left out)
        self._decision = 0  # rank 0: the code the next watched call carries
        #: what every watched call reported, agreed (rank 0 also its decisions): the history
        self.log: list[dict[str, Any]] = []

    # -- every rank, in issue order -------------------------------------------------------------

    def _cls(self, cls: int) -> _Class:
        c = self.classes.get(cls)
        if c is None:
            c = self.classes[cls] = _Class(self.initial(class_bytes(cls)))
        return c

    def algorithm(self, nbytes: int) -> str:
        """The algorithm calls of ``nbytes`` run now (every rank the same)."""
        return self._cls(size_class(nbytes)).algorithm

    def begin(self, nbytes: int) -> tuple[str, bool]:
        """A call of ``nbytes`` starts: its algorithm, and whether it is watched (it then carries the
        report and the decision: :meth:`outgoing` before it runs, :meth:`incoming` after)."""
        c = self._cls(size_class(nbytes))
        c.calls += 1
        return c.algorithm, c.watched or c.calls % MONITOR == 0

    def extra(self) -> int:
        """Elements a watched call carries."""
        return self.world + 1

    def outgoing(self) -> list[float]:
        """What this rank adds to a watched call: its time of the previous watched call in its own
        slot, and (rank 0) the decision."""
        out = [0.0] * self.extra()
        if self._last is not None:
            out[self.rank] = self._mine
        if self.rank == 0:
            out[-1] = float(self._decision)
            self._decision = 0
        return out

    def incoming(self, summed: list[float], nbytes: int, algorithm: str, seconds: float) -> None:
        """A watched call of ``nbytes`` ran ``algorithm`` in ``seconds`` here and brought ``summed``
        (every rank's :meth:`outgoing`, summed): apply rank 0's decision, note the agreed time of the
        previous watched call, remember this one's."""
        code = int(round(summed[-1]))
        if code > 0:
            cls, alg, watched = _decode(code)
            c = self._cls(cls)
            if alg != c.algorithm:
                c.switches += 1
            c.algorithm, c.watched, c.pending = alg, watched, False
        if self._last is not None:
            times = summed[:self.world]
            if all(t > 0 for t in times):
                self._agreed(*self._last, min(times))
        first = algorithm not in self._seen
        self._seen.add(algorithm)
        # the first call of an algorithm connects its pairs: not its time
        self._last = (size_class(nbytes), algorithm, nbytes) if not first else None
        self._mine = seconds

    def _agreed(self, cls: int, algorithm: str, nbytes: int, seconds: float) -> None:
        entry: dict[str, Any] = {"class": cls, "bytes": nbytes, "algorithm": algorithm, "seconds": seconds}
        self.log.append(entry)
        del self.log[:-256]
        if self.rank == 0:
            code = self.observe(cls, algorithm, nbytes, seconds)
            if code:
                entry["decision"] = _decode(code)[1:]
                self._decision = code

    # -- rank 0's judgement ---------------------------------------------------------------------

    def _scaled(self, algorithm: str, nbytes: int, seconds: float, cls: int) -> float:
        """``seconds`` of a call of ``nbytes``, scaled to the class's reference size by the
        prediction's own ratio (the class spans a factor of two)."""
        p = self.predict(nbytes).get(algorithm)
        ref = self.predict(class_bytes(cls)).get(algorithm)
        if p and ref and math.isfinite(p) and math.isfinite(ref):
            return seconds * ref / p
        return seconds

    def _time(self, cls: int, algorithm: str) -> float:
        """The observed time of ``algorithm`` in the class: the least of its last :data:`SAMPLES`."""
        return min(self.classes[cls].samples[algorithm][-SAMPLES:])

    def _effective(self, cls: int, algorithm: str) -> float:
        """The observed time of ``algorithm`` in the class, as a call of the stream the group runs
        would cost (:attr:`credit`)."""
        return self._time(cls, algorithm) * self.credit(class_bytes(cls)).get(algorithm, 1.0)

    def observe(self, cls: int, algorithm: str, nbytes: int, seconds: float) -> int:
        """Rank 0: an agreed observation (the minimum over ranks). Returns the decision to send
        (0: none): a class's next algorithm and whether it stays watched. Tests feed it directly."""
        c = self._cls(cls)
        t = self._scaled(algorithm, nbytes, seconds, cls)
        got = c.samples.setdefault(algorithm, [])
        got.append(t)
        del got[:-SAMPLES]
        # judged: the class's current algorithm, once no decision about it is still on its way (a
        # call that ran before the last decision reached every rank still counts as a sample)
        if algorithm != c.algorithm or c.pending:
            return 0
        code = self._judge(cls, c, algorithm, t)
        c.pending = code != 0
        return code

    def _judge(self, cls: int, c: _Class, algorithm: str, t: float) -> int:
        if not c.watched:  # settled: a monitoring call
            if c.settled_s is not None and t > DRIFT * c.settled_s:
                c.slow += 1
            else:
                c.slow = 0
            if c.slow < 2:
                return 0
            # it got slower than it was: judge the class again from here (the others are tried anew)
            c.samples, c.tried, c.slow, c.settled_s = {algorithm: [t]}, [algorithm], 0, None
            return _encode(cls, algorithm, True)
        if algorithm not in c.tried:
            c.tried.append(algorithm)
        if len(c.samples[algorithm]) < SAMPLES:
            return 0
        ref = class_bytes(cls)
        best = min((a for a in c.tried if len(c.samples.get(a, ())) >= SAMPLES), key=lambda a: self._effective(cls, a))
        best_s = self._effective(cls, best)
        pred = self.predict(ref)
        credit = self.credit(ref)
        untried = sorted((a for a in pred if a not in c.tried and math.isfinite(pred[a])),
                         key=lambda a: pred[a] * credit.get(a, 1.0))
        nxt = next((a for a in untried if pred[a] * credit.get(a, 1.0) * DEPART < best_s), None)
        if nxt is not None:
            return _encode(cls, nxt, True)
        # nothing left predicted faster than the best observed: settle on the observed fastest, the
        # incumbent (the class's first algorithm) unless beaten by the margin
        first = c.tried[0]
        if best != first and best_s > MARGIN * self._effective(cls, first):
            best = first
        c.settled_s = self._time(cls, best)
        self.observed[str(cls)] = {"chosen": best, "bytes": ref,
                                   "seconds": {a: self._time(cls, a) for a in c.tried if c.samples.get(a)},
                                   "predicted": {a: pred[a] for a in pred}}
        if self.on_settle is not None:
            self.on_settle(self)
        return _encode(cls, best, False)

    # -- what describe() and `vcga info --plan --observed` show -------------------------------

    def describe(self) -> dict[str, Any]:
        """Per class: its size, the algorithm its calls run, whether it is still being checked,
        predicted against observed seconds (rank 0's judgement; other ranks know the choice only)."""
        out: dict[str, Any] = {}
        for cls in sorted(self.classes):
            c = self.classes[cls]
            ref = class_bytes(cls)
            out[str(cls)] = {"bytes": ref, "algorithm": c.algorithm, "checking": c.watched, "calls": c.calls,
                             "switches": c.switches, "predicted_s": dict(self.predict(ref)),
                             "observed_s": {a: min(v) for a, v in c.samples.items() if v}}
        return out
