"""vcga.spawn.run_ranks: the local world behind the gloo capability measurement and the benchmarks."""

from __future__ import annotations

import pytest

from vcga.spawn import RanksFailed, run_ranks


def _reports(rank: int, world: int, port: int, salt: int, queue) -> None:
    if rank == 0:
        queue.put((world, salt, isinstance(port, int) and port > 0))


def _rank_one_dies(rank: int, world: int, port: int, queue) -> None:
    if rank == 1:
        raise SystemExit(3)
    # rank 0 reports nothing: only rank 1's exit can end the wait before the timeout


def test_returns_what_rank_0_puts() -> None:
    assert run_ranks(_reports, 2, 7, timeout=120) == (2, 7, True)


def test_a_dead_rank_ends_the_wait_at_once_naming_it() -> None:
    with pytest.raises(RanksFailed, match=r"ranks \[1\] failed"):
        run_ranks(_rank_one_dies, 2, timeout=600)  # waiting for the timeout would exceed pytest-timeout (300 s)
