"""What creating a group costs the store, and the bridge's link-figure cache.

Discovery runs on threads over one in-process store that counts every request (no world needed);
the cache's world is fake-backed: its vendors are the simulated sim-nccl / sim-hccl (CPU stand-ins
on gloo), laid out with ``VCGA_SIM_VENDORS`` as a user would.
"""

from __future__ import annotations

import json
import statistics
import threading
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vcga.testing import run_world


class CountingStore:
    """A c10d store (a Python subclass of ``torch.distributed.Store``) over a HashStore that counts
    each rank's requests and bytes (keys and values, both ways)."""

    @staticmethod
    def make(inner: Any, log: list[tuple[str, int]]) -> Any:
        import torch.distributed as dist

        class _Counting(dist.Store):
            def __init__(self) -> None:
                super().__init__()

            def set(self, key: str, value: Any) -> None:
                v = value if isinstance(value, bytes) else str(value).encode()
                log.append(("set", len(key) + len(v)))
                inner.set(key, value)

            def get(self, key: str) -> bytes:
                v = inner.get(key)
                log.append(("get", len(key) + len(v)))
                return v

            def add(self, key: str, n: int) -> int:
                log.append(("add", len(key) + 8))
                return inner.add(key, n)

            def check(self, keys: list[str]) -> bool:
                log.append(("check", sum(map(len, keys))))
                return inner.check(keys)

            def wait(self, keys: list[str], timeout: Any = None) -> None:
                log.append(("wait", sum(map(len, keys))))
                inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

            def multi_get(self, keys: list[str]) -> list[bytes]:
                vs = inner.multi_get(keys)
                log.append(("multi_get", sum(map(len, keys)) + sum(map(len, vs))))
                return vs

        return _Counting()


def discover_on_threads(backends: list[Any], timeout_s: float = 20.0, absent: tuple[int, ...] = ()
                        ) -> tuple[dict[int, Any], dict[int, list[tuple[str, int]]]]:
    """Run :func:`vcga.pg.discovery.discover` for every rank (but ``absent``) on threads; returns each
    rank's layout (or the exception it raised) and its requests."""
    import torch.distributed as dist

    from vcga.pg.discovery import discover

    inner = dist.HashStore()
    n = len(backends)
    logs: dict[int, list[tuple[str, int]]] = defaultdict(list)
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        counting = CountingStore.make(inner, logs[r])  # held: the Python object carries the overrides
        store = dist.PrefixStore("g", counting)
        try:
            out[r] = discover(store, r, n, backends[r], timedelta(seconds=timeout_s), list(range(n)))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return out, logs


def _backends() -> tuple[Any, Any]:
    from vcga.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    return pm.backend("sim-nccl"), pm.backend("sim-hccl")


def test_discovery_costs_each_rank_a_constant_and_the_store_linear_in_the_world() -> None:
    """Every rank but 0 makes the same few requests of the same size at 4 and at 32 ranks; rank 0
    reads every record once, so the store carries O(n) bytes (reading every record on every rank
    would make that O(n²))."""
    nccl, hccl = _backends()
    per_rank, totals = {}, {}
    for n in (4, 32):
        layouts, logs = discover_on_threads([nccl] * (n // 2) + [hccl] * (n // 2))
        assert all(not isinstance(v, Exception) for v in layouts.values()), layouts
        first = layouts[0]
        assert all(lay.rank_backend == first.rank_backend for lay in layouts.values())
        assert [f.name for f in first.backends] == ["sim-nccl", "sim-hccl"]
        assert first.peers(list(range(n)))[n - 1]["backend"] == "sim-hccl"
        # (the rank whose arrival completes the count makes one request more: it says so)
        per_rank[n] = (max(len(logs[r]) for r in range(1, n)), statistics.median(len(logs[r]) for r in range(1, n)),
                       statistics.median(sum(b for _, b in logs[r]) for r in range(1, n)))
        totals[n] = sum(b for r in range(n) for _, b in logs[r])
    assert per_rank[32][0] <= 5 and per_rank[32][1] == per_rank[4][1], per_rank
    assert per_rank[32][2] <= per_rank[4][2] + 16, per_rank  # the compressed layout barely grows
    assert totals[32] <= 9 * totals[4], totals  # 8x the ranks: about 8x the bytes, not 64x


def test_discovery_errors_reach_every_rank() -> None:
    """A rank whose backend has another capability table: every rank raises the same typed error.
    A rank that never comes: every other rank raises a timeout naming it."""
    from vcga.errors import VcgaConfigError, VcgaTimeoutError

    nccl, hccl = _backends()
    table = nccl.capabilities()
    cells = dict(table.cells())
    (key, cell), *_ = cells.items()
    cells[key] = type(cell)(cell.support, cell.via, (cell.note or "") + " (another plugin version)")
    odd = SimpleNamespace(name=nccl.name, vendor=nccl.vendor, device_type=nccl.device_type,
                          capabilities=lambda: type(table)(table.backend, cells))
    layouts, _ = discover_on_threads([nccl, odd, hccl, hccl])
    assert all(isinstance(v, VcgaConfigError) for v in layouts.values()), layouts
    assert len({str(v) for v in layouts.values()}) == 1 and "rank 1" in str(layouts[0])

    layouts, _ = discover_on_threads([nccl, nccl, hccl], timeout_s=1.0, absent=(2,))
    assert set(layouts) == {0, 1}
    assert all(isinstance(v, VcgaTimeoutError) and v.missing_ranks == (2,) for v in layouts.values()), layouts


def test_figure_cache_round_trip_and_checks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An entry is read back only for its own topology, intact and plausible; anything else is a
    miss (logged), never an error."""
    from test_bridge_cost import figures

    from vcga.bridge import figcache
    from vcga.bridge.cost import AlphaBeta

    fig = figures(bridge_all=AlphaBeta(1e-4, 1e9), bridge_one=AlphaBeta(1e-4, 2e9), in_group=AlphaBeta(1e-5, 1e10))
    topo = {"groups": [["sim-nccl", "nvidia", "abc", "s1", 2], ["sim-hccl", "huawei", "def", "s2", 2]], "x": 1}
    path = figcache.store(tmp_path, topo, fig)
    assert path is not None and figcache.load(tmp_path, topo) == fig
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written atomically: no temp file left
    assert figcache.load(tmp_path, {**topo, "x": 2}) is None  # another topology: another key, no entry
    d = json.loads(path.read_text())
    d["figures"]["bridge"]["leaders"][0] = 0.5  # tampered: the checksum no longer matches
    path.write_text(json.dumps(d))
    assert figcache.load(tmp_path, topo) is None and "checksum" in caplog.text
    bad = figures(bridge_all=AlphaBeta(-1.0, 1e9), bridge_one=AlphaBeta(1e-4, 2e9), in_group=AlphaBeta(1e-5, 1e10))
    figcache.store(tmp_path, topo, bad)
    assert figcache.load(tmp_path, topo) is None and "implausible" in caplog.text
    path.write_text("{not json")
    assert figcache.load(tmp_path, topo) is None
    assert figcache.cache_dir("/x/y") == Path("/x/y") and figcache.cache_dir(None).parent.name == "vcga"


def test_ranks_with_different_cached_figures_agree(tmp_path: Path) -> None:
    """Each rank has a cache of its own; one rank's holds, under the same key, figures that choose
    another algorithm than rank 0's. Every rank uses rank 0's figures and runs the same algorithm;
    a first start measures and stores, a later one reads the cache and measures nothing."""
    from startup_cases import cache_world

    caches = [str(tmp_path / f"cache{r}") for r in range(4)]
    ranks = run_world(cache_world, 4, caches, env={"VCGA_SIM_VENDORS": "nccl:2,hccl:2"}, timeout=300)
    first, second = ([r[k] for r in ranks] for k in ("first", "second"))
    assert all(s["source"] == "measured" and s["same_on_every_rank"] and s["sum_ok"] for s in first), first
    assert ranks[0]["entries_after_first"] == 1 and all(r["entries_after_first"] == 0 for r in ranks[1:])
    # rank 0's rewritten entry: leader everywhere; the last rank's own cache says replicated
    assert all(s["source"] == "cache" and s["same_on_every_rank"] and s["sum_ok"] for s in second), second
    assert {s["choice_4MiB"] for s in second} == {"leader"} and all(s["ran"] == ["leader"] for s in second), second
    assert ranks[0]["leftover_temp_files"] == []


def test_startup_benchmark_runs_and_counts_the_store_at_a_toy_size(tmp_path: Path) -> None:
    """benchmarks/startup.py end to end on 2 ranks (figures are not checked): every variant's start
    is counted on the wire with no request the relay could not parse (its parser follows torch's
    TCPStore protocol), and vcga's discovery shows as its own part of the load."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "startup.json"
    r = subprocess.run([sys.executable, "benchmarks/startup.py", "--launch", "forkserver", "--ranks", "2", "--reps", "1", "--variants",
                        "gloo,vcga,mixed", "--timeout", "120", "--json", str(out)], cwd=root, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    (summary,) = json.loads(out.read_text())["summaries"]
    for v in ("gloo", "vcga", "mixed"):
        store = summary["variants"][v]["store"]
        assert store["errors"] == [] and store["requests_total"] > 0, (v, store)
    mixed = summary["variants"]["mixed"]["store"]["by_category"]
    assert "discovery" in mixed and "discovery" not in summary["variants"]["gloo"]["store"]["by_category"]
    # the bridge's whole-group gloo group connects lazily: creating it is one address per rank
    # (connected at creation, gloo's rendezvous reads every other rank's: 3n² + n requests)
    assert mixed["whole-group gloo"][0] <= 2 * 2, mixed


def test_calibrate_refuses_what_it_cannot_measure_here() -> None:
    """``vcga info --plan --calibrate`` measures on this host only, and only where there is a bridge."""
    from click.testing import CliRunner

    from vcga.cli.info import info

    r = CliRunner().invoke(info, ["--plan", "--vendors", "nccl:2,hccl:2", "--nodes", "2", "--calibrate"])
    assert r.exit_code == 2 and "VCGA_BRIDGE_CALIBRATION" in r.output, r.output
    r = CliRunner().invoke(info, ["--plan", "--vendors", "nccl:4", "--calibrate"])
    assert r.exit_code == 2 and "mixed-vendor layout" in r.output, r.output
    r = CliRunner().invoke(info, ["--calibrate"])
    assert r.exit_code == 2 and "go with --plan" in r.output, r.output
