"""``vcga trace``'s analysis: torch's flight-recorder analyzer over every rank's dump.

:func:`analyze` loads the dumps with torch's loader and matches the ranks' collectives with torch's
own builder (``torch.distributed.flight_recorder.components``, the code behind ``torchfrtrace``),
changed in three places only, each where it would refuse or mislead on VCGA's dumps:

- **library names**: torch's ``Op`` accepts the prefixes nccl, ncclx, xccl, gloo, rccl, rcclx,
  mccl and hccl only; an entry of a library VCGA knows beyond those (cncl, a plugin's) is read as
  any other collective -- only its op and sizes are compared, never its library, so a job whose
  ranks run different libraries matches;
- **alignment**: torch drops, across every group at once, the entries older than the newest first
  ``record_id`` of any rank; VCGA aligns each group on its sequence numbers instead (a rank whose
  ring wrapped loses only that group's oldest calls);
- **state**: VCGA learns that a native asynchronous call ended only when something waits for it,
  so ``scheduled``/``started``/``completed`` say little about agreement between ranks; the matching
  compares ops, sizes and dtypes, and the report shows each rank's real state.

The report names the first collective of each group not every rank joined (and the ranks missing
from it) or that ranks called differently (op, sizes, dtypes), with each rank's vendor and library
from VCGA's keys in the dumps.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vcga.errors import VcgaFormatError
from vcga.pg.recorder import FILE_PREFIX

__all__ = ["analyze", "ANALYZER_LIBRARIES", "load"]

#: The library prefixes torch 2.13's analyzer accepts (flight_recorder/components/types.py, ``Op``).
ANALYZER_LIBRARIES = frozenset({"nccl", "ncclx", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl"})

_KINDS = {"COLLECTIVE_TYPE_MISMATCH": "op mismatch", "SIZE_OR_SYNTAX_MISMATCH": "size mismatch",
          "COLLECTIVE_DTYPE_MISMATCH": "dtype mismatch", "COLLECTIVE_STATE_MISMATCH": "state mismatch",
          "UNDECIDED": "undecided"}


def load(directory: str | os.PathLike[str], prefix: str | None = None) -> tuple[dict[str, dict[str, Any]], str, str]:
    """``(details, version, prefix)`` as torch's ``read_dir`` returns them (one dict per file).

    :raises VcgaFormatError: no directory, no dump in it, or a file that is not a dump."""
    from torch.distributed.flight_recorder.components.loader import read_dir

    path = Path(directory)
    if not path.is_dir():
        raise VcgaFormatError(path, "not a directory; pass the folder that holds every rank's dump")
    if prefix is None:
        names = [f for _, _, files in os.walk(path) for f in files]
        prefix = FILE_PREFIX if any(n.startswith(FILE_PREFIX) for n in names) else None
    try:
        try:
            details, version = read_dir(argparse.Namespace(trace_dir=str(path), prefix=prefix))
        finally:
            gc.enable()  # torch's loader switches the collector off and leaves it so
    except (AssertionError, ValueError) as e:
        raise VcgaFormatError(path, f"no flight-recorder dumps read ({e}); name the files' common prefix with --prefix "
                                    f"(VCGA writes {FILE_PREFIX}<rank>)") from None
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
        raise VcgaFormatError(path, f"a file there is not a flight-recorder dump ({type(e).__name__}: {e})") from None
    return details, version, prefix or ""


@contextlib.contextmanager
def _libraries_accepted(extra: set[str]) -> Iterator[None]:
    """torch's ``Op`` for the duration, reading entries of the libraries ``extra`` as it reads gloo's."""
    from torch.distributed.flight_recorder.components import builder, types, utils

    base = types.Op

    class Op(base):  # type: ignore[misc, valid-type]
        def __init__(self, event: dict[str, Any], memberships: dict[str, set[Any]], pg_name: str) -> None:
            library, _, rest = event["profiling_name"].partition(":")
            if library in extra:
                event = {**event, "profiling_name": f"gloo:{rest}"}
            super().__init__(event, memberships, pg_name)
            self.profiling_name = f"{library}:{rest}"

    patched = [m for m in (types, utils, builder) if getattr(m, "Op", None) is base]
    for m in patched:
        m.Op = Op  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in patched:
            m.Op = base  # type: ignore[attr-defined]


@contextlib.contextmanager
def _captured(lines: list[str]) -> Iterator[None]:
    """torch's analyzer logs its findings to stderr; collect them instead."""
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

    logger = FlightRecorderLogger().logger

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    saved, propagate = list(logger.handlers), logger.propagate
    logger.handlers = [Keep()]
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved, propagate


def _align(entries: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Per group, drop the sequence numbers older than some rank's oldest (its ring wrapped);
    renumber ``record_id`` so torch's own alignment keeps the rest."""
    first: dict[str, int] = {}
    for rows in entries.values():
        oldest: dict[str, int] = {}
        for e in rows:
            g = e["process_group"][0]
            oldest[g] = min(oldest.get(g, e["collective_seq_id"]), e["collective_seq_id"])
        for g, s in oldest.items():
            first[g] = max(first.get(g, s), s)
    out = {}
    for rank, rows in entries.items():
        kept = [e for e in rows if e["collective_seq_id"] >= first[e["process_group"][0]]]
        out[rank] = [{**e, "record_id": i} for i, e in enumerate(sorted(kept, key=lambda e: e["record_id"]))]
    return out


def _signature(e: dict[str, Any]) -> tuple[Any, ...]:
    """What every rank's call must agree on: the op, and what every rank passes alike (the root of
    a gather alone has outputs, of a scatter alone inputs)."""
    op = e["profiling_name"].partition(":")[2]
    side = "output" if op == "scatter" else "input"
    return op, str(e[f"{side}_sizes"]), str(e[f"{side}_dtypes"])


def _user_frame(frames: list[dict[str, Any]]) -> str | None:
    """The innermost frame outside VCGA and torch: where the program made the call."""
    for f in frames:
        name = f.get("filename", "")
        if f"{os.sep}vcga{os.sep}" in name or f"{os.sep}torch{os.sep}" in name:
            continue
        return f"{f.get('name')} at {name}:{f.get('line')}"
    return None


def analyze(directory: str | os.PathLike[str], prefix: str | None = None) -> dict[str, Any]:
    """The report ``vcga trace`` prints (see the module docstring); a dict of plain values."""
    log_lines: list[str] = []
    with _captured(log_lines):  # the builder logs a warning as it is imported
        from torch.distributed.flight_recorder.components.builder import build_db

    details, version, prefix = load(directory, prefix)
    raw: dict[int, list[dict[str, Any]]] = {}
    facts: dict[int, dict[str, Any]] = {}
    ranks: dict[int, dict[str, Any]] = {}
    for name, d in sorted(details.items(), key=lambda kv: kv[1]["rank"]):
        r = d["rank"]
        raw[r] = list(d["entries"])
        v = _vcga_keys(Path(directory), name)
        facts[r] = v
        groups = v.get("groups", {})
        one: dict[str, Any] = next(iter(groups.values()), {})
        ranks[r] = {"file": name, "entries": len(raw[r]), "backend": one.get("backend"), "vendor": one.get("vendor"),
                    "library": one.get("library") or _library_of(raw[r]), "reason": v.get("reason"),
                    "groups": {g: {k: f.get(k) for k in ("backend", "vendor", "library", "transport")}
                               for g, f in groups.items()}}
    # what each rank's dump is missing: ranks of its groups that left no file
    members: dict[str, set[int]] = {}
    for d in details.values():
        for g, cfg in d["pg_config"].items():
            members.setdefault(g, set()).update(_ranks(cfg["ranks"]))
    missing_dumps = sorted(set().union(*members.values()) - set(raw)) if members else []

    libraries = {e["profiling_name"].partition(":")[0] for rows in raw.values() for e in rows}
    extra = libraries - ANALYZER_LIBRARIES
    aligned = _align(raw)
    matching = {r: [{**e, "state": "scheduled"} for e in rows] for r, rows in aligned.items()}
    prepared = copy.deepcopy(details)
    for d in prepared.values():
        d["entries"] = matching[d["rank"]]
    args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10,
                              selected_ranks=None, pg_filters=None, print_stack_trace=False)
    with _libraries_accepted(extra), _captured(log_lines):
        try:
            db = build_db(prepared, args, version)
        except (AssertionError, KeyError, ValueError) as e:  # the analyzer asserts what it expects
            raise VcgaFormatError(directory, f"torch's flight-recorder analyzer refused the dumps: "
                                             f"{type(e).__name__}: {e}") from None

    by_seq: dict[tuple[str, int], dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for r, rows in aligned.items():
        for entry in rows:
            by_seq[(entry["process_group"][0], entry["collective_seq_id"])][r] = entry
    group_of = {g.id: g for g in db.groups}
    problems: list[dict[str, Any]] = []
    seen_groups: set[str] = set()
    matched = 0
    for c in db.collectives:
        if c.pass_check and not c.missing_ranks:  # torch passes a collective some rank left out, naming them
            matched += 1
            continue
        name = c.pg_desc.split(":")[0]
        if name in seen_groups:
            continue  # torch stops pairing a group's collectives after its first problem
        seen_groups.add(name)
        problems.append(_problem(c, name, by_seq.get((name, c.collective_seq_id), {}), ranks, group_of))
    problems.sort(key=lambda p: (p["first_created_ns"] or 0))
    return {
        "directory": str(directory),
        "prefix": prefix,
        "version": version,
        "ranks": ranks,
        "missing_dumps": missing_dumps,
        "groups": [{"name": g, "desc": next((d["pg_config"][g]["desc"] for d in details.values()
                                             if g in d["pg_config"]), ""), "ranks": sorted(m)}
                   for g, m in sorted(members.items())],
        "matched": matched,
        "problems": problems,
        "libraries": sorted(libraries),
        "torchfrtrace_reads": not extra and not missing_dumps,
        "analyzer_log": log_lines,
    }


def _vcga_keys(directory: Path, name: str) -> dict[str, Any]:
    """VCGA's own keys of one dump (torch's loader keeps only its schema's); {} for a dump torch wrote."""
    for root, _, files in os.walk(directory):
        if name in files:
            with open(os.path.join(root, name), "rb") as f:
                data = pickle.load(f)
            return data.get("vcga") or {} if isinstance(data, dict) else {}
    return {}


def _ranks(text: Any) -> list[int]:
    import ast

    value = ast.literal_eval(text) if isinstance(text, str) else text
    return [int(x) for x in value]


def _library_of(rows: list[dict[str, Any]]) -> str | None:
    return rows[0]["profiling_name"].partition(":")[0] if rows else None


def _problem(c: Any, group: str, at_seq: dict[int, dict[str, Any]], ranks: dict[int, dict[str, Any]],
             groups: dict[str, Any]) -> dict[str, Any]:
    """One collective torch's builder did not pass, with what each rank's dump says of it."""
    expected = sorted(c.expected_ranks)
    missing = sorted(c.missing_ranks or set())
    mismatches = []
    for r, other in sorted((c.mismatch_collectives or {}).items()):
        info = other.type_of_mismatch
        state = getattr(getattr(info, "state", None), "name", "")
        mismatches.append({"rank": r, "kind": _KINDS.get(state, state.lower()),
                           "detail": getattr(info, "culprit", None), "op": other.collective_name,
                           "input_sizes": other.input_sizes, "output_sizes": other.output_sizes})
    # who differs from whom: the ranks whose call differs from the most common one at this sequence number
    signatures = {r: _signature(e) for r, e in at_seq.items()}
    common = collections.Counter(signatures.values()).most_common(1)
    odd = (sorted(r for r, s in signatures.items() if s != common[0][0])
           if common and len(set(signatures.values())) > 1 else [])
    if missing:
        kind = "missing ranks"
    elif mismatches:
        kind = next((m["kind"] for m in mismatches if m["kind"] not in ("state mismatch", "undecided")),
                    mismatches[0]["kind"])
    else:
        kind = "unknown"
    per_rank = {}
    for r in expected:
        e = at_seq.get(r)
        info = ranks.get(r, {})
        library = (info.get("groups", {}).get(group) or {}).get("library") or info.get("library")
        row: dict[str, Any] = {"vendor": info.get("vendor"), "backend": info.get("backend"), "library": library}
        if e is None:
            row["joined"] = False
            row["dump"] = r in ranks
        else:
            row.update(joined=True, op=e["profiling_name"], input_sizes=e["input_sizes"],
                       output_sizes=e["output_sizes"], input_dtypes=e["input_dtypes"], state=e["state"],
                       stage=e.get("vcga_stage"),
                       error=e.get("vcga_error"), called_from=_user_frame(e.get("frames", [])))
        per_rank[r] = row
    desc = c.pg_desc.split(":", 1)[1] if ":" in c.pg_desc else ""  # torch's "<name>:<desc>"
    return {"group": group, "desc": desc, "seq": c.collective_seq_id, "op": c.collective_name.partition(":")[2],
            "kind": kind, "missing_ranks": missing, "odd_ranks": odd, "mismatches": mismatches,
            "expected_ranks": expected, "ranks": per_rank,
            "first_created_ns": min((e["time_created_ns"] for e in at_seq.values()), default=None)}
