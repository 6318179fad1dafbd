"""Verification profiles: which worlds to spawn and which checks to run there, with what options.

A profile is a YAML file. ``quick`` and ``full`` ship with VCGA (``quick.yaml`` and ``full.yaml``
beside this module); ``vcga verify --profile my.yaml`` takes any file of the same shape::

    name: nightly
    extends: quick              # optional: a built-in profile or another file (relative paths
                                # are relative to this file); keys below replace or extend it
    description: what this profile is for
    collective_timeout_s: 30    # the timeout every rank's group is created with
    stall_s: null               # seconds without progress before a world counts as hung
                                #   (null: 2 * collective_timeout_s + 10)
    group: auto                 # vcga | native | auto (vcga when this build registers it)
    backends: [gloo, {name: sim-hccl, group: vcga}]   # backends under test when no --backend is
                                # given; an entry may override the group
    world_sizes: [1, 2, 3]      # worlds spawned for each backend under test
    mixed_vendor_sets: ["nccl:2,hccl:2"]   # simulated vendor sets, run when no --backend is given
    other_checks: true          # checks from plugins that this file does not name run with defaults
    checks:                     # checks to run, in this order, with option overrides
      exact-reduce: {sizes: [1, 33]}
      gradients: {steps: 2, world_sizes: [2, 4]}   # world_sizes: only in worlds of these sizes
      faults: null              # run with its defaults (an empty mapping works too)

Options a check does not define are rejected, so a typo cannot silently weaken a profile. Under
``extends``, a check's options are merged into the parent's; ``enabled: false`` drops a check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vcga.config import parse_sim_vendors
from vcga.errors import VcgaConfigError

from .runner import PlannedCheck

__all__ = ["Profile", "BUILTIN_PROFILES", "load_profile", "plan_checks"]

_HERE = Path(__file__).resolve().parent
#: Profiles shipped with VCGA, by name.
BUILTIN_PROFILES: dict[str, Path] = {"quick": _HERE / "quick.yaml", "full": _HERE / "full.yaml"}

_KEYS = {"name", "extends", "description", "collective_timeout_s", "stall_s", "group", "backends", "world_sizes",
         "mixed_vendor_sets", "other_checks", "checks"}
_GROUPS = ("auto", "vcga", "native")


@dataclass
class Profile:
    """A loaded, validated profile."""

    name: str
    source: str
    description: str = ""
    collective_timeout_s: float = 30.0
    stall_s: float | None = None
    group: str = "auto"
    #: (backend name, group or None for the profile's group), when no --backend is given
    backends: list[tuple[str, str | None]] = field(default_factory=lambda: [("gloo", None)])
    world_sizes: list[int] = field(default_factory=lambda: [2])
    mixed_vendor_sets: list[str] = field(default_factory=list)
    other_checks: bool = True
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "description": self.description,
                "collective_timeout_s": self.collective_timeout_s, "stall_s": self.stall_s, "group": self.group,
                "backends": [{"name": b, "group": g} for b, g in self.backends],
                "world_sizes": list(self.world_sizes), "mixed_vendor_sets": list(self.mixed_vendor_sets),
                "other_checks": self.other_checks, "checks": {k: dict(v) for k, v in self.checks.items()}}


def _read(path: Path, source: str) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise VcgaConfigError("profile", str(path), "quick, full, or a readable YAML file", source) from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise VcgaConfigError("profile", str(path), f"valid YAML ({str(e).splitlines()[0]})", source) from e
    if not isinstance(raw, dict):
        raise VcgaConfigError("profile", str(path), "a YAML mapping with keys " + ", ".join(sorted(_KEYS)), source)
    unknown = set(raw) - _KEYS
    if unknown:
        raise VcgaConfigError(sorted(unknown)[0], raw[sorted(unknown)[0]],
                              "one of the profile keys " + ", ".join(sorted(_KEYS)), str(path))
    return raw


def _resolve(name_or_path: str | Path, relative_to: Path | None = None, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw mapping of a profile with its ``extends`` chain merged in."""
    key = str(name_or_path)
    if key in BUILTIN_PROFILES:
        path = BUILTIN_PROFILES[key]
    else:
        path = Path(key)
        if relative_to is not None and not path.is_absolute():
            path = relative_to / path
    where = str(path)
    if where in seen:
        raise VcgaConfigError("extends", key, "a chain of profiles without cycles", " -> ".join(seen))
    raw = _read(path, where)
    raw["__source__"] = key if key in BUILTIN_PROFILES else where
    parent_name = raw.pop("extends", None)
    if parent_name is None:
        return raw
    parent = _resolve(str(parent_name), path.parent, seen + (where,))
    merged = {**parent, **{k: v for k, v in raw.items() if k != "checks"}}
    checks = dict(parent.get("checks") or {})
    for name, opts in (raw.get("checks") or {}).items():
        base = dict(checks.get(name) or {})
        base.update(opts or {})
        checks[name] = base
    merged["checks"] = checks
    return merged


def _number(raw: Mapping[str, Any], key: str, default: Any, src: str, *, allow_none: bool = False) -> Any:
    value = raw.get(key, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise VcgaConfigError(key, value, "a number of seconds > 0" + (" or null" if allow_none else ""), src)
    return float(value)


def load_profile(name_or_path: str | Path) -> Profile:
    """Load ``quick``, ``full`` or a YAML file, validated.

    :raises VcgaConfigError: unreadable file, bad YAML, an unknown key or a bad value."""
    raw = _resolve(name_or_path)
    src = raw.pop("__source__")
    name = str(raw.get("name") or Path(str(name_or_path)).stem)
    group = raw.get("group", "auto")
    if group not in _GROUPS:
        raise VcgaConfigError("group", group, "auto, vcga or native", src)
    backends: list[tuple[str, str | None]] = []
    for entry in raw.get("backends", ["gloo"]) or []:
        if isinstance(entry, str):
            backends.append((entry, None))
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str) and set(entry) <= {"name", "group"} \
                and entry.get("group", "auto") in _GROUPS:
            backends.append((entry["name"], entry.get("group")))
        else:
            raise VcgaConfigError("backends", entry, "a backend name or {name: NAME, group: auto|vcga|native}", src)
    sizes = raw.get("world_sizes", [2])
    if not isinstance(sizes, list) or not sizes or not all(isinstance(n, int) and 1 <= n <= 64 for n in sizes):
        raise VcgaConfigError("world_sizes", sizes, "a non-empty list of integers from 1 to 64", src)
    mixed = raw.get("mixed_vendor_sets") or []
    if not isinstance(mixed, list):
        raise VcgaConfigError("mixed_vendor_sets", mixed, 'a list of vendor sets like "nccl:2,hccl:2"', src)
    for spec in mixed:
        parse_sim_vendors(str(spec))  # raises VcgaConfigError with the allowed form
    checks_raw = raw.get("checks") or {}
    if not isinstance(checks_raw, dict):
        raise VcgaConfigError("checks", checks_raw, "a mapping from check name to its options", src)
    checks: dict[str, dict[str, Any]] = {}
    for cname, opts in checks_raw.items():
        if opts is not None and not isinstance(opts, dict):
            raise VcgaConfigError(f"checks.{cname}", opts, "a mapping of option overrides (or null)", src)
        opts = dict(opts or {})
        if opts.pop("enabled", True) is False:
            continue
        checks[str(cname)] = opts
    return Profile(
        name=name, source=src, description=str(raw.get("description", "")),
        collective_timeout_s=_number(raw, "collective_timeout_s", 30.0, src),
        stall_s=_number(raw, "stall_s", None, src, allow_none=True),
        group=group, backends=backends, world_sizes=list(sizes), mixed_vendor_sets=[str(s) for s in mixed],
        other_checks=bool(raw.get("other_checks", True)), checks=checks)


def plan_checks(profile: Profile, registered: Mapping[str, Any], only: list[str] | None = None) -> list[PlannedCheck]:
    """The checks to run, in profile order, with options validated against each check's defaults.

    :param registered: name -> check object, every check the plugins register.
    :param only: run just these (``vcga verify --check``), still with the profile's options.
    :raises VcgaConfigError: a check no plugin registers, or an option a check does not define."""
    names = list(profile.checks)
    if profile.other_checks:
        names += [n for n in registered if n not in profile.checks]
    if only:
        unregistered = [n for n in only if n not in registered]
        if unregistered:
            raise VcgaConfigError("check", unregistered[0], "a registered check: " + ", ".join(registered), "--check")
        names = [n for n in names if n in only] + [n for n in only if n not in names]
    out = []
    for name in names:
        check = registered.get(name)
        if check is None:
            raise VcgaConfigError(f"checks.{name}", name, "a registered check: " + ", ".join(registered),
                                  profile.source)
        defaults = dict(getattr(check, "defaults", {}) or {})
        opts = dict(profile.checks.get(name, {}))
        sizes = opts.pop("world_sizes", None)
        if sizes is not None and (not isinstance(sizes, list) or not all(isinstance(n, int) for n in sizes)):
            raise VcgaConfigError(f"checks.{name}.world_sizes", sizes, "a list of world sizes", profile.source)
        unknown = set(opts) - set(defaults)
        if unknown:
            bad = sorted(unknown)[0]
            allowed = ", ".join(sorted(defaults) + ["world_sizes"])
            raise VcgaConfigError(f"checks.{name}.{bad}", opts[bad], f"an option of {name}: {allowed}",
                                  profile.source)
        out.append(PlannedCheck(name, {**defaults, **opts}, tuple(sizes) if sizes is not None else None))
    return out
