"""The conformance check interface: what ``vcga verify`` runs (section 5 of :mod:`vcga.contract`,
which re-exports every name here; part of the public core API).

A plugin's ``vcga_conformance_checks`` hook returns :class:`ConformanceCheck` objects; each yields
:class:`CheckResult` rows. Defined apart from :mod:`vcga.contract` so that a process that never
verifies (a training job's ``init_process_group``) does not define them; import them from either module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckResult", "ConformanceCheck"]


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one case of a conformance check.

    :param check: the check's name.
    :param backend: the backend it ran on (or a vendor set like "sim:nccl:2,hccl:2").
    :param case: what exactly ran ("all_reduce SUM float32 n=4097 ws=2").
    :param passed: True when the case met its bound.
    :param dtype: the dtype involved, when one is.
    :param worst_error: the largest error seen (0.0 for exact checks), when numeric.
    :param bound: the bound it was checked against, when numeric.
    :param detail: one line explaining a failure (or a skip).
    :param skipped: True when the case did not apply (e.g. a refused cell).
    :param cell: the capability cell the case exercises, named as :func:`~vcga.capabilities.cell_name` names it
        (``"all_reduce int16 SUM"``), when it exercises one.
    :param derived_from: when that cell is emulated, the native cell its recipe finally runs on
        (:meth:`~vcga.capabilities.CapabilityTable.derived_from`): a wrong native cell makes every cell derived from it
        fail too, and the report says so.
    """

    check: str
    backend: str
    case: str
    passed: bool
    dtype: str | None = None
    worst_error: float | None = None
    bound: float | None = None
    detail: str = ""
    skipped: bool = False
    cell: str | None = None
    derived_from: str | None = None


@runtime_checkable
class ConformanceCheck(Protocol):
    """One conformance check. It runs inside every rank of a world the runner spawned and uses
    only the public API (``torch.distributed`` on the ``vcga`` group, and this contract).

    Three optional members (not part of the protocol, so existing checks stay valid): ``defaults``,
    a dict of the options the check accepts with their defaults (profiles may override exactly
    these); ``compare(exports)``, called once after all worlds ran with ``{world id: {key:
    value}}`` from the context's ``export()``, yielding :class:`CheckResult` rows that compare
    worlds (backend against backend); and ``preload``, the names of heavy modules every rank of
    the check imports (the runner's rank server imports them once, before it forks the ranks).
    See docs/conformance.md.
    """

    #: Unique name, e.g. "exact-reduce".
    name: str
    #: One line: what the check proves.
    description: str

    def run(self, context: Any) -> Iterable[CheckResult]:
        """Run on one rank and yield results. ``context`` carries rank, world size, backend,
        process group and the profile's options (see :mod:`vcga.conformance`)."""
        ...
