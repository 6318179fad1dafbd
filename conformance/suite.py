"""One ``vcga verify`` run: the worlds a profile asks for, run one after the other, plus the
comparisons across worlds (backend against backend)."""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vcga.contract import CheckResult

from .profiles import Profile, plan_checks
from .runner import Event, PlannedCheck, WorldOutcome, WorldSpec, planned_preloads, run_world

__all__ = ["SuiteOutcome", "build_worlds", "run_suite", "rank_preloads", "CROSS_WORLD"]

#: The pseudo-world that results comparing several worlds are filed under.
CROSS_WORLD = "cross-world"


@dataclass
class SuiteOutcome:
    profile: Profile
    plan: list[PlannedCheck]
    descriptions: dict[str, str]
    worlds: list[WorldOutcome] = field(default_factory=list)
    cross: list[CheckResult] = field(default_factory=list)
    started_at: str = ""
    elapsed_s: float = 0.0

    def rows(self) -> list[tuple[str, int | None, CheckResult]]:
        """Every result as (world id, world size, result), worlds in run order, then cross-world."""
        out: list[tuple[str, int | None, CheckResult]] = []
        for w in self.worlds:
            out.extend((w.spec.id, w.spec.world_size, r) for r in w.results)
        out.extend((CROSS_WORLD, None, r) for r in self.cross)
        return out

    @property
    def failed(self) -> int:
        return sum(not r.passed for _, _, r in self.rows())

    @property
    def ok(self) -> bool:
        return self.failed == 0 and any(not r.skipped for _, _, r in self.rows())


def build_worlds(profile: Profile, *, backends: Sequence[str] | None = None, world_sizes: Sequence[int] | None = None,
                 mixed: Sequence[str] | None = None, group: str | None = None) -> list[WorldSpec]:
    """The worlds to spawn: each backend at each world size, then each simulated vendor set.

    Explicit ``backends`` replace the profile's and, unless ``mixed`` is also given, drop its
    vendor sets (``vcga verify --backend X`` certifies X). ``group`` overrides every world's group."""
    from vcga.config import parse_sim_vendors

    chosen = [(b, None) for b in backends] if backends else list(profile.backends)
    sizes = list(world_sizes) if world_sizes else list(profile.world_sizes)
    sets = list(mixed) if mixed is not None else ([] if backends else list(profile.mixed_vendor_sets))
    worlds = [WorldSpec(name, n, group=group or g or profile.group) for name, g in chosen for n in sizes]
    for spec in sets:
        n = sum(count for _, count in parse_sim_vendors(spec))
        worlds.append(WorldSpec(None, n, sim_vendors=spec, group=group or "vcga"))
    return worlds


def rank_preloads(profile: Profile, checks: list[str] | None = None) -> list[str]:
    """The modules the rank server of :func:`run_suite` imports before it forks any rank (the
    planned checks' ``preload``): a caller that starts the server early (``vcga verify``) passes
    them to :func:`vcga.spawn.get_context`, so that no world restarts it."""
    from vcga.plugin_manager import get_plugin_manager

    registered = {c.name: c for c in get_plugin_manager().conformance_checks()}
    return planned_preloads(plan_checks(profile, registered, checks), registered)


def run_suite(profile: Profile, worlds: Sequence[WorldSpec], *, checks: list[str] | None = None,
              timeout_s: float | None = None, on_event: Callable[[Event], None] | None = None,
              log_dir: str | None = None) -> SuiteOutcome:
    """Run the profile's checks in every world, then each check's cross-world comparison."""
    from vcga.plugin_manager import get_plugin_manager

    registered = {c.name: c for c in get_plugin_manager().conformance_checks()}
    plan = plan_checks(profile, registered, checks)
    outcome = SuiteOutcome(profile, plan, {p.name: str(getattr(registered[p.name], "description", ""))
                                          for p in plan})
    outcome.started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    t = timeout_s if timeout_s is not None else profile.collective_timeout_s
    preload = planned_preloads(plan, registered)
    for spec in worlds:
        outcome.worlds.append(run_world(spec, plan, timeout_s=t, stall_s=profile.stall_s, on_event=on_event,
                                        log_dir=log_dir, preload=preload))
    for planned in plan:
        compare = getattr(registered[planned.name], "compare", None)
        if not callable(compare):
            continue
        exports = {w.spec.id: w.exports.get(planned.name, {}) for w in outcome.worlds}
        exports = {k: v for k, v in exports.items() if v}
        if len(exports) < 2:
            continue
        try:
            outcome.cross.extend(compare(exports))
        except Exception as e:  # noqa: BLE001 - a broken comparison is a failed result, not a crashed command
            outcome.cross.append(CheckResult(planned.name, CROSS_WORLD, "compare worlds", False,
                                             detail=f"{type(e).__name__}: {e}"))
    outcome.elapsed_s = time.monotonic() - start
    return outcome


def describe_worlds(worlds: Sequence[WorldSpec]) -> str:
    return ", ".join(w.id for w in worlds)

