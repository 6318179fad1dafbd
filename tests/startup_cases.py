"""What each rank of the link-figure cache's world checks (run by tests/test_startup.py; fake-backed:
the vendors are the simulated sim-nccl / sim-hccl, CPU stand-ins on gloo)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _group(cache: str) -> Any:
    from vcga.config import load_config
    from vcga.process_group import VcgaOptions

    return dist.new_group(backend="vcga", pg_options=VcgaOptions(config=replace(load_config(), bridge_figures_cache=cache)))


def _state(g: Any, check: Any) -> dict[str, Any]:
    """This rank's figures, their source and choices, one all_reduce's result per algorithm choice,
    and whether every rank holds the same figures (compared over ``check``)."""
    cal = g.transport.group.reducer.calibration
    mine = json.dumps(cal["figures"], sort_keys=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=check)
    t = torch.full((1 << 20,), float(dist.get_rank() + 1))  # 4 MiB: "auto" asks the figures
    counts = dict(g.transport.group.reducer.counts)
    dist.all_reduce(t, group=g)
    ran = [a for a, n in g.transport.group.reducer.counts.items() if n > counts[a]]
    return {"source": cal["source"], "choice_4MiB": cal["choice"]["4 MiB"]["algorithm"], "ran": ran,
            "same_on_every_rank": len(set(every)) == 1, "figures": cal["figures"],
            "sum_ok": bool((t == sum(range(1, dist.get_world_size() + 1))).all())}


def cache_world(rank: int, size: int, init_method: str, caches: list[str]) -> dict[str, Any]:
    """Every rank has a cache directory of its own (``caches[rank]``). Two ``vcga`` groups over
    the whole world, one after the other:

    1. nothing cached: the group measures; rank 0 stores the entry;
    2. rank 0's entry rewritten with figures that make the leader algorithm win at every size,
       and another rank's cache given, under the same key, figures that make replicated win: every
       rank uses rank 0's (cached) figures, so every rank runs the leader algorithm;

    (A corrupted entry is a miss: tests/test_startup.py checks :func:`vcga.bridge.figcache.load` alone.)
    """
    from vcga.bridge import figcache
    from vcga.bridge.cost import AlphaBeta, LinkFigures

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    check = dist.group.WORLD
    out: dict[str, Any] = {}
    g1 = _group(caches[rank])
    out["first"] = _state(g1, check)
    entries = [str(p) for p in figcache.entries(Path(caches[rank]))]
    out["entries_after_first"] = len(entries)

    # 2. rank 0: leader wins everywhere; the last rank: replicated wins everywhere (same key).
    def rewrite(path: str, fast: str) -> None:
        d = json.loads(Path(path).read_text())
        fig = LinkFigures.from_json(d["figures"])
        slow, quick = AlphaBeta(1.0, 1e6), AlphaBeta(1e-6, 1e12)
        if fast == "leader":  # the leader algorithm's steps fast, every other slow
            fig.groups = [{k: quick if k == "reduce_bcast" else slow for k in g} for g in fig.groups]
            fig.bridge = {k: quick if k == "leaders" else slow for k in fig.bridge}
        else:  # replicated's steps fast, the leader's in-group step and the bandwidth algorithm's slow
            fig.groups = [{k: quick if k == "all_reduce" else slow for k in g} for g in fig.groups]
            fig.bridge = dict.fromkeys(fig.bridge, quick)
        figcache.store(Path(os.path.dirname(path)), d["topology"], fig)

    names = [None] * size
    dist.all_gather_object(names, entries[0] if entries else None, group=check)
    if rank == 0:
        rewrite(names[0], "leader")
    if rank == size - 1:
        os.makedirs(caches[rank], exist_ok=True)
        target = os.path.join(caches[rank], os.path.basename(names[0]))
        Path(target).write_bytes(Path(names[0]).read_bytes())
        rewrite(target, "replicated")
    dist.barrier(group=check)
    g2 = _group(caches[rank])
    out["second"] = _state(g2, check)

    if rank == 0:
        out["leftover_temp_files"] = [p for p in os.listdir(caches[0]) if ".vcga-tmp" in p]
    dist.destroy_process_group()
    return out
