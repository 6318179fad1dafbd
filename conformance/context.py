"""What a conformance check sees on one rank: :class:`Context`.

A check receives a :class:`Context` in :meth:`~vcga.contract.ConformanceCheck.run`. It calls
collectives on the default group (``torch.distributed`` with ``group=None``, or ``ctx.group``),
and uses the context for everything that must *not* go through the group under test:

- :meth:`Context.exchange` swaps a few bytes between ranks through the job's TCP store (hashes,
  verdicts, gradients): a broken backend cannot corrupt the evidence against it;
- :meth:`Context.run_case` runs one case and makes every rank agree on its outcome; if any rank
  raised, every rank rebuilds the default group, so one bad case cannot poison the next;
- :meth:`Context.progress` and :meth:`Context.export` talk to the runner (live progress, values
  compared across worlds).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from vcga.contract import Backend, CapabilityTable, CheckResult, Collective, cell_name

#: A capability cell as checks pass it: (collective, canonical dtype, reduce op or None).
CellRef = tuple[Collective, str, Any]

__all__ = ["Context", "Verdict", "CaseAborted", "CellRef", "first_line"]

_ABORT_POLL = timedelta(milliseconds=200)


class CaseAborted(Exception):
    """Raised in a case on ranks still waiting to exchange when another rank's case already failed."""


def tag_of(key: str) -> str:
    return key.split("/", 2)[-1]


@dataclass(frozen=True)
class Verdict:
    """One rank's outcome of one case (what a case body returns to :meth:`Context.run_case`)."""

    passed: bool
    worst_error: float | None = None
    bound: float | None = None
    detail: str = ""
    skipped: bool = False
    #: the body swallowed an exception from the group under test (a refusal): rebuild the group,
    #: since a library may refuse on one rank after the others advanced their sequence numbers
    reset: bool = False

    @classmethod
    def ok(cls, worst_error: float | None = None, bound: float | None = None, detail: str = "") -> Verdict:
        return cls(True, worst_error, bound, detail)

    @classmethod
    def fail(cls, detail: str, worst_error: float | None = None, bound: float | None = None) -> Verdict:
        return cls(False, worst_error, bound, detail)

    @classmethod
    def skip(cls, detail: str) -> Verdict:
        return cls(True, detail=detail, skipped=True)


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``, printable and short (torch prints raw op bytes)."""
    text = (str(e).strip().splitlines() or [""])[0]
    text = "".join(ch if ch.isprintable() else "?" for ch in text)[:300]
    return f"{type(e).__name__}: {text}".rstrip(": ")


class Context:
    """One rank's view of the world a check runs in.

    :ivar rank: this process's rank.
    :ivar world_size: ranks in the world.
    :ivar backend: this rank's :class:`~vcga.contract.Backend` (in a mixed-vendor world, each rank's
        own vendor).
    :ivar backend_label: what results are reported under: the backend name, or ``sim:<vendor set>``.
    :ivar group_kind: ``"vcga"`` (the ``vcga`` process group dispatching to the backend) or
        ``"native"`` (the backend's own process group from its factory, no VCGA dispatch).
    :ivar dist_backend: the backend string the default group was created with.
    :ivar timeout: the collective timeout the group was created with.
    :ivar vendor_set: the simulated vendor set (``"nccl:2,hccl:2"``) or None.
    :ivar options: the running check's options (its defaults updated by the profile).
    :ivar check: the running check's name.
    """

    def __init__(self, *, rank: int, world_size: int, backend: Backend, backend_label: str, group_kind: str,
                 dist_backend: str, timeout: timedelta, store: Any, vendor_set: str | None = None,
                 emit: Callable[[str, Any], None] | None = None,
                 reinit: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.backend_label = backend_label
        self.group_kind = group_kind
        self.dist_backend = dist_backend
        self.timeout = timeout
        self.vendor_set = vendor_set
        self.options: dict[str, Any] = {}
        self.check = ""
        self._store = store
        self._emit = emit or (lambda kind, payload: None)
        self._reinit = reinit
        self._seq = 0
        self._case: int | None = None  # the running case's number (same on every rank)
        self._cases = 0
        self._inner = 0
        self.group_resets = 0
        self._table: CapabilityTable | None | bool = False  # not looked up yet

    # -- the group under test ----------------------------------------------------------------------

    @property
    def group(self) -> Any:
        """The default process group (checks may also pass ``group=None``)."""
        import torch.distributed as dist

        return dist.group.WORLD

    @property
    def pg(self) -> Any:  # an alias of ``group``, kept for checks written against it
        return self.group

    @property
    def timeout_s(self) -> float:
        return self.timeout.total_seconds()

    @property
    def through_vcga(self) -> bool:
        """True when collectives go through the ``vcga`` process group (dispatch, typed errors)."""
        return self.group_kind == "vcga"

    def capabilities(self) -> CapabilityTable | None:
        """The capability table collectives on the default group follow.

        The group's own table when it exposes one (``capabilities()`` on the process group: a
        mixed-vendor group's effective table), else this rank's backend's table in a single-vendor
        world, else None (a mixed-vendor group that does not say). Looked up once: a group rebuilt
        after a failed case has the same table."""
        if self._table is False:
            self._table = self._lookup_table()
        return self._table  # type: ignore[return-value]

    def _lookup_table(self) -> CapabilityTable | None:
        group_table = getattr(self.group, "capabilities", None)  # the vcga group: a property
        if callable(group_table):
            group_table = group_table()
        if isinstance(group_table, CapabilityTable):
            return group_table
        if self.vendor_set:
            return None
        return self.backend.capabilities()

    def reset_group(self) -> None:
        """Destroy and re-create the default group (every rank must call it, in the same place)."""
        if self._reinit is not None:
            self._reinit()
            self.group_resets += 1

    # -- talking to the other ranks, around the group under test -----------------------------------

    def exchange(self, tag: str, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` for this call, in rank order, through the TCP store.

        Every rank must call :meth:`exchange` the same number of times in the same order. Inside
        :meth:`run_case`, keys are scoped to the case and a wait gives up (raising
        :class:`CaseAborted`) as soon as another rank reports that the case raised: a rank that
        failed before reaching an exchange cannot leave the others waiting for it."""
        if self._case is None:
            self._seq += 1
            return self._swap(f"g{self._seq}/{tag[:60]}", payload, abort_key=None)
        self._inner += 1
        return self._swap(f"c{self._case}/{self._inner}/{tag[:60]}", payload, abort_key=f"c{self._case}/abort")

    def _swap(self, key: str, payload: bytes, abort_key: str | None) -> list[bytes]:
        self._store.set(f"{key}/{self.rank}", payload)
        out = []
        for r in range(self.world_size):
            if r == self.rank:
                out.append(payload)
                continue
            k = f"{key}/{r}"
            if abort_key is not None:
                while True:  # wait in short slices so an abort from another rank is noticed
                    try:
                        self._store.wait([k], _ABORT_POLL)
                        break
                    except RuntimeError:  # torch's DistStoreError on timeout
                        if self._store.check([abort_key]):
                            raise CaseAborted(f"another rank failed this case before exchange "
                                              f"{tag_of(key)!r}") from None
            out.append(self._store.get(k))
        return out

    def exchange_json(self, tag: str, value: Any) -> list[Any]:
        return [json.loads(b) for b in self.exchange(tag, json.dumps(value).encode())]

    # -- talking to the runner ---------------------------------------------------------------------

    def progress(self, case: str) -> None:
        """Tell the runner which case starts (live progress; names the case if a rank hangs)."""
        self._emit("case", (self.check, case))

    def waiting(self, what: str) -> None:
        """Tell the runner this rank now waits for the others (so a hang is blamed on the right rank)."""
        self._emit("wait", (self.check, what))

    def export(self, key: str, value: Any) -> None:
        """Hand a JSON-ready value to the runner for comparisons across worlds (rank 0's is kept)."""
        if self.rank == 0:
            self._emit("export", (self.check, key, value))

    # -- results -----------------------------------------------------------------------------------

    def result(self, case: str, passed: bool, *, cell: CellRef | None = None, **kw: Any) -> CheckResult:
        """One result; ``cell`` names the capability cell the case exercises, and the report then
        says which native cell an emulated one is derived from."""
        return CheckResult(self.check, self.backend_label, case, passed, **self._cell_fields(cell), **kw)

    def _cell_fields(self, cell: CellRef | None) -> dict[str, Any]:
        if cell is None:
            return {}
        table = self.capabilities()
        if table is None:
            coll, dt, op = cell
            return {"cell": cell_name((Collective(coll), dt, op if Collective(coll).reduces else None))}
        key = table.route(*cell)[0][0]
        src = table.derived_from(*key)
        return {"cell": cell_name(key), "derived_from": cell_name(src) if src is not None else None}

    def run_unless(self, case: str, skip: str | None, body: Callable[[], Verdict | None], *,
                   dtype: str | None = None, cell: CellRef | None = None) -> CheckResult:
        """:meth:`run_case`, or -- when ``skip`` says why (:func:`conformance.base.runnable`'s answer)
        -- the case reported as skipped for that reason, without running it."""
        if skip:
            return self.result(case, True, dtype=dtype, skipped=True, detail=skip, cell=cell)
        return self.run_case(case, body, dtype=dtype, cell=cell)

    def run_case(self, case: str, body: Callable[[], Verdict | None], *, dtype: str | None = None,
                 cell: CellRef | None = None) -> CheckResult:
        """Run one case on every rank and agree on its outcome.

        ``body`` returns a :class:`Verdict` (None means passed, exact). An exception in ``body`` is
        a failure of the case on that rank. All ranks then swap their verdicts through the store; the
        case passes only if it passed everywhere, its worst error is the worst any rank saw, and if
        any rank raised, every rank rebuilds the default group before the next case."""
        self.progress(case)
        self._cases += 1
        self._case, self._inner = self._cases, 0
        try:
            verdict = body() or Verdict.ok()
            mine: dict[str, Any] = {"p": verdict.passed, "e": verdict.worst_error, "b": verdict.bound,
                                    "d": verdict.detail, "s": verdict.skipped, "r": verdict.reset}
        except CaseAborted:
            mine = {"a": True}  # another rank's failure is the story; do not report this as one
        except Exception as e:  # noqa: BLE001 - the case failed on this rank; the others must learn it
            self._store.set(f"c{self._case}/abort", b"1")
            mine = {"x": first_line(e)}
        finally:
            case_no, self._case = self._case, None
        self.waiting(case)
        everyone = [json.loads(b) for b in self._swap(f"c{case_no}/status", json.dumps(mine).encode(), None)]
        if any("x" in v or "a" in v or v.get("r") for v in everyone):
            self.reset_group()
        return self._combine(case, everyone, dtype, cell)

    def _combine(self, case: str, everyone: list[dict[str, Any]], dtype: str | None,
                 cell: CellRef | None = None) -> CheckResult:
        failures: dict[str, list[int]] = {}  # failure text -> ranks, so identical failures read as one
        for r, v in enumerate(everyone):
            if "x" in v:
                failures.setdefault(f"raised {v['x']}", []).append(r)
            elif "a" in v:
                continue
            elif not v["p"]:
                failures.setdefault(v["d"] or "failed", []).append(r)
        worst, bound, ratio = None, None, -1.0
        for v in everyone:
            e, b = v.get("e"), v.get("b")
            if e is None:
                continue
            share = (0.0 if e == 0 else math.inf) if not b else e / b
            if share > ratio:
                worst, bound, ratio = e, b, share
        if failures:
            detail = "; ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))}: {text}"
                for text, ranks in failures.items())
        else:
            detail = "; ".join(sorted({v["d"] for v in everyone if v.get("d")}))
        skipped = all(v.get("s") for v in everyone) and not failures
        return self.result(case, not failures, dtype=dtype, worst_error=worst, bound=bound, detail=detail,
                           skipped=skipped, cell=cell)
