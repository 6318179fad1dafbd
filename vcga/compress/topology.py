"""Where the slow hop is in a group: its islands (ranks that share a backend and a node) and the
island and peer groups scope ``bridge`` exchanges through (:class:`Topology`).

Creating a group is collective over the whole job (``torch.distributed.new_group``): on the
default group every rank creates every island's and peer set's group; on a data-parallel subgroup
every rank creates every data-parallel group's (:meth:`Topology.build_job_wide`), so that the ranks
of the other groups take part in each creation.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from vcga.compress.layout import Layout
from vcga.errors import VcgaConfigError

__all__ = ["Topology", "discover_layout"]


def _backend_name(group: Any) -> str:
    transport = getattr(group, "transport", None)
    backend = getattr(transport, "backend", None)
    if backend is not None and hasattr(backend, "name"):
        return str(backend.name)
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a group torch does not know by name
        return type(group).__name__


def _device_type(group: Any) -> str:
    transport = getattr(group, "transport", None)
    dt = getattr(getattr(transport, "backend", None), "device_type", None)
    return str(dt) if dt else "cpu"


def _facts(group: Any) -> tuple[str, str, str]:
    """This rank's (backend, node, device type) in ``group``: what decides its island."""
    return _backend_name(group), socket.gethostname(), _device_type(group)


def discover_layout(group: Any) -> Layout:
    """Every rank's (backend, node, device type), gathered over ``group`` (collective)."""
    facts: list[Any] = [None] * group.size()
    dist.all_gather_object(facts, _facts(group), group=group)
    return Layout.from_facts(facts)


@dataclass
class Topology:
    """A group's layout and the subgroups scope ``bridge`` exchanges through (made once, shared by
    every :class:`Reducer` of the group: creating groups is collective and not free).

    :ivar island_group: this rank's island (None when it has one rank).
    :ivar peer_group: this rank's set of peers across islands (None when it exchanges nothing).
    :ivar bridged: the island and peer groups exist (more than one island, and every rank of the
        job took part in creating them), so scope ``bridge`` can run.
    :ivar ranks: the group's global ranks, in group-rank order (``island`` and ``peers`` are group
        ranks; collectives that name a source take a global one).
    """

    group: Any
    layout: Layout
    rank: int
    island: tuple[int, ...]
    local: int
    island_group: Any = None
    peer_group: Any = None
    peers: tuple[int, ...] = ()
    bridged: bool = False
    ranks: tuple[int, ...] = ()

    @classmethod
    def build(cls, group: Any = None) -> Topology:
        """Gather the layout over ``group`` (collective); with more than one island on the default
        group, create the island and peer groups (every rank of the job creates every group, in the
        same order, as ``torch.distributed.new_group`` requires)."""
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        layout = discover_layout(group)
        island = layout.island_of(rank)
        topo = cls(group, layout, rank, island, island.index(rank), ranks=tuple(dist.get_process_group_ranks(group)))
        if len(layout.islands) > 1 and dist.get_world_size() == group.size():
            topo.island_group, topo.peer_group, topo.peers = _bridge_groups(layout, topo.ranks, rank)
            topo.bridged = True
        return topo

    @classmethod
    def build_job_wide(cls, group: Any, data_parallel_groups: Sequence[Sequence[int]], *,
                       duplicate: bool = False) -> Topology:
        """The topology of ``group``, one of the job's data-parallel groups, with scope ``bridge``'s
        groups: collective over the *whole job* -- every rank calls it with the same
        ``data_parallel_groups`` (each a list of global ranks; every rank of the job in exactly
        one), and creates every group's island and peer groups, in the order given, as
        ``torch.distributed.new_group`` requires. ``duplicate``: the topology's group is a new group
        over ``group``'s ranks (every data-parallel group gets one), for collectives that must not
        interleave with what DDP issues on ``group``.

        :raises VcgaConfigError: the ranks disagree about the groups, the groups overlap or leave a
            rank out, or ``group`` is not this rank's group among them (every rank raises alike)."""
        world, me = dist.get_world_size(), dist.get_rank()
        try:
            given = [tuple(sorted(int(r) for r in g)) for g in data_parallel_groups]
        except (TypeError, ValueError) as e:
            raise VcgaConfigError("data_parallel_groups", repr(data_parallel_groups),
                                  "a list of lists of global ranks, e.g. [[0, 2], [1, 3]]") from e
        theirs = tuple(sorted(dist.get_process_group_ranks(group)))
        facts: list[Any] = [None] * world
        # every rank's facts, the groups it was given and its own group's ranks: each rank then checks
        # every rank's view, so all of them raise alike instead of some waiting in new_group
        dist.all_gather_object(facts, (_facts(group), given, theirs, duplicate))
        problem = _check_groups([(f[1], f[2]) for f in facts], world)
        if not problem and len({f[3] for f in facts}) > 1:  # the ranks would create different groups
            problem = "every rank must pass the same overlap= to ddp_hook (it decides which groups are created)"
        if problem:
            raise VcgaConfigError("data_parallel_groups", repr(data_parallel_groups), problem)
        rank = dist.get_rank(group)
        topo: Topology | None = None
        for g in given:
            layout = Layout.from_facts([facts[r][0] for r in g])
            comm = dist.new_group(list(g)) if duplicate else None
            island_group, peer_group, peers = (_bridge_groups(layout, g, rank if me in g else None)
                                               if len(layout.islands) > 1 else (None, None, ()))
            if me in g:
                island = layout.island_of(rank)
                topo = cls(comm if duplicate else group, layout, rank, island, island.index(rank), island_group,
                           peer_group, peers, bridged=len(layout.islands) > 1, ranks=g)
        assert topo is not None  # _check_groups: this rank is in one group
        return topo


def _bridge_groups(layout: Layout, ranks: Sequence[int], rank: int | None) -> tuple[Any, Any, tuple[int, ...]]:
    """Create the island and peer groups of a group whose global ranks are ``ranks`` (in group-rank
    order) and whose layout is ``layout`` (collective over the job: every rank creates every one);
    return ``rank``'s island group, peer group and peers (group ranks), or nothing for a rank
    outside the group (None)."""
    island_group = peer_group = None
    peers: tuple[int, ...] = ()
    for isl in layout.islands:
        g = dist.new_group([ranks[r] for r in isl]) if len(isl) > 1 else None
        if rank in isl:
            island_group = g
    for ps in layout.peer_sets():
        g = dist.new_group([ranks[r] for r in ps])
        if rank in ps:
            peer_group, peers = g, ps
    return island_group, peer_group, peers


def _check_groups(views: Sequence[tuple[Sequence[tuple[int, ...]], tuple[int, ...]]], world: int) -> str:
    """What is wrong with the data-parallel groups every rank gave (``(groups, its own group's ranks)``
    per rank), or ""."""
    first = views[0][0]
    for r, (groups, _) in enumerate(views):
        if list(groups) != list(first):
            return (f"every rank of the job must pass the same groups, in the same order: rank 0 passed "
                    f"{[list(g) for g in first]}, rank {r} {[list(g) for g in groups]}")
    seen: dict[int, int] = {}
    for i, g in enumerate(first):
        for r in g:
            if not 0 <= r < world:
                return f"rank {r} is not a rank of this job of {world}"
            if r in seen:
                return f"rank {r} is in two groups ({list(first[seen[r]])} and {list(g)}): the groups must not overlap"
            seen[r] = i
    missing = [r for r in range(world) if r not in seen]
    if missing:
        return f"every rank of the job must be in one group; ranks {missing} are in none"
    for r, (_, own) in enumerate(views):
        if tuple(first[seen[r]]) != tuple(own):
            return (f"rank {r}'s process_group has ranks {list(own)}, but its group among data_parallel_groups is "
                    f"{list(first[seen[r]])}: pass the group DDP reduces over, and every such group")
    return ""
