"""The link-figure cache: a group's measured α–β figures (:class:`~vcga.bridge.cost.LinkFigures`),
kept on disk so that the next start on the same topology does not measure them again.

An entry belongs to one *topology* (:func:`topology`): the vendor groups (backend, vendor,
capability-table digest, library versions, size), the ranks' places (which backend and which node
each rank is on), the node names, the link classes, the shard peers' exchange, and the versions of
vcga and of the figures' format. Anything in it changes, the key changes, and the entry is not used.

One file per topology, ``bridge-figures-<key>.json`` in the cache directory (config
``bridge_figures_cache``; default the folder ``bridge`` of VCGA's user cache, :mod:`vcga._usercache`), written
atomically (:mod:`vcga.atomic`). It is checked on load: its key, the topology it names, a checksum
of its content, and that the figures parse and fit the layout (one set per vendor group, α >= 0,
β > 0). An entry that fails a check is logged and treated as missing: measured again, replaced.

Only rank 0 reads or writes the cache; it hands the figures to every rank through the group's
store (:func:`vcga.bridge.create.create_bridge_transport`), so ranks whose own caches differ -- or
that have none -- still choose alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vcga.bridge.cost import FIGURES_VERSION, LinkFigures

__all__ = ["cache_dir", "topology", "entry_path", "load", "store", "entries", "calibrate_here"]

log = logging.getLogger("vcga.bridge")

#: Bumped when an entry's layout on disk changes.
ENTRY_VERSION = 1


def cache_dir(configured: str | None = None) -> Path:
    """The cache directory: ``configured`` (config ``bridge_figures_cache``), else the folder
    ``bridge`` of VCGA's user cache (:func:`vcga._usercache.cache_dir`: ``$VCGA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/vcga``, else ``~/.cache/vcga``)."""
    if configured:
        return Path(configured).expanduser()
    from vcga._usercache import cache_dir as user_cache_dir

    return user_cache_dir() / "bridge"


def topology(layout: Any, plan: Any, classes: Mapping[str, str], exchange: str) -> dict[str, Any]:
    """What the figures of a group depend on (``layout``: :class:`vcga.pg.discovery.Layout`; ``plan``:
    its :class:`~vcga.bridge.plan.Plan`; ``classes``: the link classes; ``exchange``: how shard
    peers reduce, "shared memory" or "gloo"). JSON-able; the same on every rank."""
    from vcga import __version__
    from vcga.pg.discovery import encode_indices

    by_name = {f.name: f for f in layout.backends}
    return {
        "figures_version": FIGURES_VERSION,
        "vcga": __version__,
        "groups": [[g.backend, by_name[g.backend].vendor, by_name[g.backend].digest, by_name[g.backend].stack, g.size]
                   for g in plan.groups],
        "rank_backend": encode_indices(layout.rank_backend),
        "rank_node": encode_indices(layout.rank_node),
        "nodes": hashlib.sha256(json.dumps(layout.node_names()).encode()).hexdigest()[:16],
        "classes": dict(sorted(classes.items())),
        "exchange": exchange,
    }


def _key(topo: Mapping[str, Any]) -> str:
    return LinkFigures.key(topo)


def entry_path(directory: Path, topo: Mapping[str, Any]) -> Path:
    return directory / f"bridge-figures-{_key(topo)}.json"


def _checksum(topo: Mapping[str, Any], figures: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps([topo, figures], sort_keys=True).encode()).hexdigest()


def _check(fig: LinkFigures, groups: int) -> None:
    if len(fig.groups) != groups:
        raise ValueError(f"figures of {len(fig.groups)} vendor groups, the layout has {groups}")
    for ab in [*(v for g in fig.groups for v in g.values()), *fig.bridge.values()]:
        if not (math.isfinite(ab.alpha_s) and ab.alpha_s >= 0 and ab.beta_Bps > 0):
            raise ValueError(f"implausible figure α={ab.alpha_s!r} s, β={ab.beta_Bps!r} B/s")
        if ab.knee_bytes and not (ab.knee_bytes > 0 and ab.sustained_Bps > 0):
            raise ValueError(f"implausible knee {ab.knee_bytes!r} B, sustained {ab.sustained_Bps!r} B/s")


def load(directory: Path, topo: Mapping[str, Any]) -> LinkFigures | None:
    """The cached figures of ``topo``, or None: no entry, or one that fails a check (logged)."""
    path = entry_path(directory, topo)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("vcga bridge: cannot read the link-figure cache %s (%s); measuring instead", path, e)
        return None
    try:
        d = json.loads(raw)
        if d.get("entry_version") != ENTRY_VERSION:
            raise ValueError(f"entry version {d.get('entry_version')!r}, not {ENTRY_VERSION}")
        if d.get("key") != _key(topo) or d.get("topology") != json.loads(json.dumps(topo)):
            raise ValueError("it belongs to another topology")
        if d.get("checksum") != _checksum(d["topology"], d["figures"]):
            raise ValueError("its checksum does not match its content")
        fig = LinkFigures.from_json(d["figures"])
        _check(fig, len(topo["groups"]))
    except Exception as e:  # noqa: BLE001 - any malformed entry is a miss, never a failed start
        log.warning("vcga bridge: ignoring the link-figure cache entry %s (%s: %s); measuring again",
                    path, type(e).__name__, e)
        return None
    return fig


def store(directory: Path, topo: Mapping[str, Any], fig: LinkFigures) -> Path | None:
    """Write ``fig`` as the entry of ``topo`` (atomically; replacing any). Returns the path, or None
    when the directory cannot be written (logged: the group runs on, the next start measures)."""
    from vcga.atomic import atomic_write_bytes

    figures = fig.to_json()
    d = {"entry_version": ENTRY_VERSION, "key": _key(topo), "topology": topo, "figures": figures,
         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "checksum": _checksum(json.loads(json.dumps(topo)), json.loads(json.dumps(figures)))}
    path = entry_path(directory, topo)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(d, indent=1, allow_nan=True).encode())
    except OSError as e:
        log.warning("vcga bridge: cannot write the link-figure cache %s (%s)", path, e)
        return None
    return path


def entries(directory: Path) -> Sequence[Path]:
    """The cache entries in ``directory`` (``vcga info``)."""
    return sorted(directory.glob("bridge-figures-*.json")) if directory.is_dir() else []


# ===================================================================================================
# vcga info --plan --calibrate: measure a layout on this host now and refresh its entry
# ===================================================================================================


def _calibrate_rank(rank: int, world: int, port: int, env: Mapping[str, str], backends: Sequence[str] | None,
                    queue: Any) -> None:
    """One rank of :func:`calibrate_here` (spawned): create the layout's ``vcga`` group with
    ``bridge_calibration: measure``; rank 0 reports what was measured and where it is cached."""
    os.environ.update(env)
    if backends is not None:
        os.environ["VCGA_BACKEND"] = backends[rank]
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers the backend

    dist.init_process_group("vcga", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        transport = dist.group.WORLD.transport  # type: ignore[union-attr]  # the vcga group's own attribute
        if rank == 0:
            group = getattr(transport, "group", None)
            cal = getattr(group, "calibration", None)
            from vcga.config import load_config

            queue.put({"calibration": cal, "cache": str(cache_dir(load_config().bridge_figures_cache))})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def calibrate_here(size: int, env: Mapping[str, str], backends: Sequence[str] | None = None,
                   timeout: float = 600.0) -> dict[str, Any]:
    """Run a layout's ``size`` ranks on this host (``env``: the VCGA_* settings that lay it out;
    ``backends``: each rank's backend, or None for the layout the settings give), measuring the
    bridge's links and replacing the cache entry of that topology. Returns rank 0's calibration
    (None when there was nothing to measure) and the cache directory."""
    from vcga.spawn import run_ranks

    full = {**env, "VCGA_BRIDGE_CALIBRATION": "measure"}
    return run_ranks(_calibrate_rank, size, full, list(backends) if backends is not None else None, timeout=timeout)
