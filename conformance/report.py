"""Reports of a ``vcga verify`` run: the JSON report, JUnit XML, and the summary table's rows.

The JSON report follows ``report.schema.json`` (JSON Schema draft 2020-12, shipped beside this
module and documented in docs/conformance.md). The JUnit XML has one ``<testsuite>`` per world and
one ``<testcase>`` per case, so CI systems show a conformance run like a test run. Both are written
atomically.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcga.atomic import atomic_write_bytes
from vcga.contract import CheckResult

from .suite import CROSS_WORLD, SuiteOutcome

__all__ = ["SCHEMA_ID", "SCHEMA_FILE", "build_report", "write_report", "write_junit", "summary_rows", "SummaryRow"]

#: The value of the report's ``schema`` field; bumped on any incompatible change.
SCHEMA_ID = "vcga-verify-report/1"
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")


def _number(x: float | None) -> float | str | None:
    """JSON has no infinity or NaN: those become the strings "inf", "-inf", "nan"."""
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _status(r: CheckResult) -> str:
    return "skip" if r.skipped else ("pass" if r.passed else "fail")


def build_report(outcome: SuiteOutcome, command: Sequence[str] | None = None) -> dict[str, Any]:
    """The report as a JSON-ready dict (see report.schema.json)."""
    from vcga import __version__

    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:  # pragma: no cover - verify needs torch; the report says so rather than crash
        torch_version = None
    rows = outcome.rows()
    results = [{
        "world": world, "world_size": size, "check": r.check, "backend": r.backend, "case": r.case,
        "dtype": r.dtype, "status": _status(r), "worst_error": _number(r.worst_error), "bound": _number(r.bound),
        "detail": r.detail, "cell": r.cell, "derived_from": r.derived_from,
    } for world, size, r in rows]
    counts = {s: sum(1 for x in results if x["status"] == s) for s in ("pass", "fail", "skip")}
    return {
        "schema": SCHEMA_ID,
        "vcga_version": __version__,
        "torch_version": torch_version,
        "python": platform.python_version(),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count() or 1},
        "started_at": outcome.started_at,
        "elapsed_s": round(outcome.elapsed_s, 3),
        "command": list(command) if command is not None else list(sys.argv),
        "profile": outcome.profile.to_json(),
        "checks": [{"name": p.name, "description": outcome.descriptions.get(p.name, ""), "options": p.options,
                    "world_sizes": list(p.world_sizes) if p.world_sizes is not None else None}
                   for p in outcome.plan],
        "worlds": [{
            "id": w.spec.id, "backend": w.spec.backend, "sim_vendors": w.spec.sim_vendors,
            "world_size": w.spec.world_size, "group": w.group_kind, "status": w.status, "detail": w.detail,
            "elapsed_s": round(w.elapsed_s, 3), "attempts": w.attempts, "group_resets": w.group_resets,
            "check_seconds": {k: round(v, 3) for k, v in w.check_seconds.items()},
        } for w in outcome.worlds],
        "results": results,
        "summary": {"passed": counts["pass"], "failed": counts["fail"], "skipped": counts["skip"],
                    "total": len(results), "ok": outcome.ok},
    }


def validate_report(report: dict[str, Any]) -> None:
    """Validate against report.schema.json (needs the optional ``jsonschema`` package).

    :raises jsonschema.ValidationError: the report does not follow the schema."""
    import jsonschema

    jsonschema.validate(report, json.loads(SCHEMA_FILE.read_text()))


def write_report(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(report, indent=1, allow_nan=False) + "\n").encode())


def write_junit(path: str | os.PathLike[str], outcome: SuiteOutcome) -> None:
    """JUnit XML: ``<testsuites>`` with one ``<testsuite>`` per world (and one for the cross-world
    comparisons); a failed case carries ``<failure>``, a skipped one ``<skipped>``."""
    root = ET.Element("testsuites", name="vcga verify")
    groups: list[tuple[str, Any, list[CheckResult]]] = [(w.spec.id, w, w.results) for w in outcome.worlds]
    if outcome.cross:
        groups.append((CROSS_WORLD, None, outcome.cross))
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for name, world, results in groups:
        suite = ET.SubElement(root, "testsuite", name=name, tests=str(len(results)),
                              failures=str(sum(not r.passed for r in results)), errors="0",
                              skipped=str(sum(r.skipped for r in results)),
                              time=f"{world.elapsed_s:.3f}" if world is not None else "0",
                              timestamp=outcome.started_at.replace("+00:00", ""), hostname=socket.gethostname())
        props = ET.SubElement(suite, "properties")
        if world is not None:
            for key, value in (("backend", world.spec.label), ("world_size", world.spec.world_size),
                               ("group", world.group_kind), ("status", world.status)):
                ET.SubElement(props, "property", name=key, value=str(value))
        ET.SubElement(props, "property", name="profile", value=outcome.profile.name)
        safe = "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
        for r in results:
            case = ET.SubElement(suite, "testcase", classname=f"vcga.verify.{safe}.{r.check}", name=r.case, time="0")
            numbers = ""
            if r.worst_error is not None:
                numbers = f" (worst error {r.worst_error:.6g}, bound {r.bound:.6g})" if r.bound is not None \
                    else f" (worst error {r.worst_error:.6g})"
            if r.skipped:
                ET.SubElement(case, "skipped", message=r.detail or "skipped")
            elif not r.passed:
                failure = ET.SubElement(case, "failure", message=(r.detail or "failed")[:500], type=r.check)
                failure.text = f"{r.detail}{numbers}\nbackend: {r.backend}\ndtype: {r.dtype}"
                if r.cell:
                    failure.text += (f"\ncell: {r.cell}"
                                     + (f"\nderived from: {r.derived_from}" if r.derived_from else ""))
            elif r.detail or numbers:
                ET.SubElement(case, "system-out").text = f"{r.detail}{numbers}".strip()
        totals["tests"] += len(results)
        totals["failures"] += sum(not r.passed for r in results)
        totals["skipped"] += sum(r.skipped for r in results)
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("errors", "0")
    root.set("time", f"{outcome.elapsed_s:.3f}")
    ET.indent(root)
    atomic_write_bytes(path, ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n")


@dataclass
class SummaryRow:
    """One line of the summary table: a check on one world for one dtype, over all its cases."""

    check: str
    backend: str
    dtype: str
    cases: int
    failed: int
    skipped: int
    worst_error: float | None
    bound: float | None

    @property
    def verdict(self) -> str:
        if self.failed:
            return "FAIL"
        return "skip" if self.skipped == self.cases else "pass"


def _ratio(r: CheckResult) -> float:
    e, b = r.worst_error, r.bound
    if e is None:
        return -1.0
    if not b:
        return 0.0 if e == 0 else math.inf
    return e / b


def summary_rows(outcome: SuiteOutcome) -> list[SummaryRow]:
    """Results grouped by (check, backend, dtype) over every world size, in run order; the worst
    error shown is that of the case closest to (or furthest past) its bound."""
    rows: dict[tuple[str, str, str], SummaryRow] = {}
    worst_case: dict[tuple[str, str, str], CheckResult] = {}
    for _, _, r in outcome.rows():
        key = (r.check, r.backend, r.dtype or "-")
        row = rows.get(key)
        if row is None:
            row = rows[key] = SummaryRow(r.check, key[1], key[2], 0, 0, 0, None, None)
        row.cases += 1
        row.failed += not r.passed
        row.skipped += r.skipped
        if r.worst_error is not None and not r.skipped:
            prev = worst_case.get(key)
            if prev is None or _ratio(r) > _ratio(prev):
                worst_case[key] = r
                row.worst_error, row.bound = r.worst_error, r.bound
    return list(rows.values())
