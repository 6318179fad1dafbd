"""What the runner spawns and reports: a world's description, the checks planned in it, progress
events and a world's outcome; which group kind (``vcga`` or native) a world can use in this build."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vcga.contract import CheckResult

#: The name the runner registers a backend's native group factory under in torch.distributed.
NATIVE_DIST_BACKEND = "vcga_native"


@dataclass(frozen=True)
class WorldSpec:
    """One world to spawn.

    :param backend: a backend name (every rank runs it), or None for a simulated vendor set.
    :param world_size: ranks.
    :param sim_vendors: ``"nccl:2,hccl:2"``: ranks get simulated vendors (needs the ``vcga`` group).
    :param group: ``"vcga"``, ``"native"`` or ``"auto"`` (``vcga`` when this VCGA build registers it).
    """

    backend: str | None
    world_size: int
    sim_vendors: str | None = None
    group: str = "auto"

    @property
    def label(self) -> str:
        """What results are reported under: the backend name, or ``sim:<vendor set>``."""
        return self.backend if self.backend else f"sim:{self.sim_vendors}"

    @property
    def id(self) -> str:
        return f"{self.label} ws={self.world_size}"


@dataclass(frozen=True)
class PlannedCheck:
    """A check to run, with its options (its defaults updated by the profile).

    :param world_sizes: run only in worlds of these sizes (None: every world)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    world_sizes: tuple[int, ...] | None = None

    def applies_to(self, spec: WorldSpec) -> bool:
        return self.world_sizes is None or spec.world_size in self.world_sizes


@dataclass
class Event:
    """Something the runner reports while it runs (the CLI shows these as live progress).

    kinds: ``world-start``, ``check-start``, ``case``, ``check-done``, ``world-problem``, ``world-done``.
    """

    kind: str
    world: WorldSpec
    check: str | None = None
    case: str | None = None
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorldOutcome:
    """What happened in one world.

    :ivar status: ``completed``; ``stopped`` (a rank hung or died; remaining checks reran in a fresh
        world); ``setup-failed`` (the group could not be created); ``skipped`` (cannot run in this
        build, with the reason in ``detail``).
    """

    spec: WorldSpec
    group_kind: str
    status: str = "completed"
    detail: str = ""
    elapsed_s: float = 0.0
    attempts: int = 0
    results: list[CheckResult] = field(default_factory=list)
    check_seconds: dict[str, float] = field(default_factory=dict)
    exports: dict[str, dict[str, Any]] = field(default_factory=dict)
    group_resets: int = 0


def vcga_group_status() -> tuple[bool, str]:
    """Whether ``init_process_group(backend="vcga")`` can work in this build, and why not."""
    try:
        import torch.distributed as dist

        import vcga  # noqa: F401 - importing vcga registers its process group where the build has one
    except ImportError as e:
        return False, f"torch.distributed is not importable: {e}"
    registered = "vcga" in getattr(dist.Backend, "backend_list", [])
    if not registered:
        try:  # a build may register lazily, on first use of its process-group module
            import importlib

            importlib.import_module("vcga.process_group")
            registered = "vcga" in dist.Backend.backend_list
        except ImportError:
            pass
    if registered:
        return True, "the vcga process group is registered with torch.distributed"
    return False, ("this VCGA build does not register the `vcga` torch.distributed backend; "
                   "only native groups can be verified")


def resolve_group_kind(spec: WorldSpec) -> tuple[str | None, str]:
    """``("vcga" | "native", reason)``, or ``(None, why this world cannot run)``."""
    available, why = vcga_group_status()
    if spec.sim_vendors:
        if spec.group == "native":
            return None, "a simulated vendor set needs the vcga process group; it has no native group"
        if not available:
            return None, f"mixed-vendor worlds run through the vcga process group and its bridge: {why}"
        return "vcga", why
    if spec.group == "vcga" and not available:
        return None, why
    if spec.group == "native" or (spec.group == "auto" and not available):
        return "native", why
    return "vcga", why
