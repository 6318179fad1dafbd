"""The same-node shared-memory bridge (vcga/bridge/host.py) on spawned gloo worlds: real shared
memory, real pipes, no vendor."""

from __future__ import annotations

import os

import pytest

from vcga.testing import run_world


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_reduction_is_exact_in_peer_order(size: int) -> None:
    from hostbridge_cases import exact_world

    results = run_world(exact_world, size, timeout=180)
    for r in results:
        assert not r["failures"], r["failures"]
        assert r["left"] == [], f"segment or pipes still named in /dev/shm: {r['left']}"
    assert len({r["path"] for r in results}) == 1  # one segment, shared


def test_disagreeing_or_missing_peers_fail_typed_and_bounded() -> None:
    from hostbridge_cases import misuse_world

    results = run_world(misuse_world, 2, timeout=120)
    for r in results:
        assert r["mismatch"] and "disagree" in r["mismatch"], r
    assert "did not arrive within 1.5 s" in results[0]["timeout"], results[0]
    assert 1.4 < results[0]["waited_s"] < 30, results[0]


@pytest.mark.parametrize("how", ["all", "writes"])
def test_a_peer_that_lets_go_of_its_pipes_fails_the_others_at_once(how: str) -> None:
    from hostbridge_cases import gone_world

    results = run_world(gone_world, 3, how, timeout=120)
    for r in results[:-1]:
        assert r["error"] and "the process of rank 2 is gone" in r["error"], r
        assert r["seconds"] < 30, r  # the timeout is 60 s


@pytest.mark.parametrize("with_child", [False, True], ids=["alone", "forked-child-lives-on"])
def test_a_killed_peer_fails_the_other_at_once(with_child: bool) -> None:
    """Rank 1's process exits (os._exit) after the segment is open: rank 0's next reduction raises
    a typed error naming it, well before the 60 s collective timeout -- also when rank 1 forked a
    child that lives on for 45 s (a DataLoader worker): the child lets go of the inherited pipes."""
    import signal

    from hostbridge_cases import killed_peer

    from vcga.spawn import get_context
    from vcga.testing import free_port

    ctx = get_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=killed_peer, args=(r, port, queue, with_child), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    said: dict[str, tuple] = {}
    try:
        while len(said) < (3 if with_child else 1):
            tag, *rest = queue.get(timeout=120)
            said[tag] = tuple(rest)
    finally:
        if "child" in said:  # first: it holds rank 1's gloo connection, which rank 0's exit waits for
            try:
                os.kill(said["child"][0], signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    error, seconds = said["rank 0"]
    if with_child:
        assert said["child refused"] == (True,)
    assert procs[1].exitcode == 3
    assert error and error.startswith("VcgaPeerLostError") and "rank 1 is gone" in error, error
    assert seconds < 30, seconds


def test_one_peer_unable_means_gloo_on_every_peer() -> None:
    from hostbridge_cases import FALLBACKS, fallback_world

    results = run_world(fallback_world, 3, timeout=120)
    for how in FALLBACKS:
        assert [r[how]["bridge"] for r in results] == [False] * 3, (how, results)
        assert all(r[how]["left"] == [] for r in results), (how, results)
    assert [r["none"]["bridge"] for r in results] == [True] * 3, results


def test_config_key() -> None:
    from vcga.config import load_config
    from vcga.errors import VcgaConfigError

    assert load_config(env={}).bridge_shm is True
    assert load_config(env={"VCGA_BRIDGE_SHM": "0"}).bridge_shm is False
    with pytest.raises(VcgaConfigError, match="bridge_shm"):
        load_config(env={"VCGA_BRIDGE_SHM": "sometimes"})
