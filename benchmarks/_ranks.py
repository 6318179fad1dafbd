"""What the multi-process benchmarks share: spawning their ranks, printing their tables.

Not a benchmark (the leading underscore keeps it out of the list of scripts to run); imported by
``collectives.py``, ``hybrid.py`` and ``host_exchange.py``, which run as scripts with this folder
first on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vcga import spawn


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> Any:
    """:func:`vcga.spawn.run_ranks`; a failed rank ends the benchmark with its message."""
    try:
        return spawn.run_ranks(target, world, *args, timeout=timeout)
    except spawn.RanksFailed as e:
        raise SystemExit(f"benchmark {e}") from None


def table(head: Sequence[str], lines: Sequence[Sequence[str]], markdown: bool) -> str:
    """``lines`` under ``head``: a markdown table, or right-aligned plain columns."""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines])
