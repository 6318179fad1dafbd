"""The same-node shared-memory bridge (vcga/hostbridge.py) on spawned gloo worlds: real shared
memory, real pipes, no vendor."""

from __future__ import annotations

import pytest
from pg_world import run_world


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


@pytest.mark.parametrize("how", ["no-dir", "no-space", "attach", "unwanted"])
def test_one_peer_unable_means_gloo_on_every_peer(how: str) -> None:
    from hostbridge_cases import fallback_world

    results = run_world(fallback_world, 3, how, timeout=120)
    assert [r["bridge"] for r in results] == [False] * 3, results
    assert all(r["left"] == [] for r in results), results


def test_config_key() -> None:
    from vcga.config import load_config
    from vcga.errors import VcgaConfigError

    assert load_config(env={}).bridge_shm is True
    assert load_config(env={"VCGA_BRIDGE_SHM": "0"}).bridge_shm is False
    with pytest.raises(VcgaConfigError, match="bridge_shm"):
        load_config(env={"VCGA_BRIDGE_SHM": "sometimes"})
