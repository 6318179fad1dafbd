"""Which installed distributions declare vcga plugins, remembered between starts
(vcga.plugin_manager.entrypoints): a stored answer is used while its stamp holds, and any install,
removal or egg-info edit on sys.path is seen at the next start."""

from __future__ import annotations

import os
import sys
import time

import pytest

from vcga.plugin_manager import VcgaPluginManager
from vcga.plugin_manager import entrypoints as ep_mod

OLD = time.time() - 3600  # a modification time well outside the racy window


def _dist(site, name: str, eps: str, kind: str = "dist-info"):
    info = site / f"{name}-1.0.{kind}"
    info.mkdir()
    (info / ("PKG-INFO" if kind == "egg-info" else "METADATA")).write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(eps)
    return info


def _age(*paths) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD))


def _names() -> list[str]:
    return [e.name for e in VcgaPluginManager(env={})._entry_points()]


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    # sys.path is this folder and the standard library's: the stamp covers every sys.path folder,
    # and the suite's others (the checkout, where coverage writes its data files) may change during
    # the test -- which the cache rightly does not trust, but which made these tests depend on
    # whatever else was running.
    stdlib = [p for p in sys.path if p.startswith(sys.base_prefix) and "-packages" not in p]
    monkeypatch.setattr(sys, "path", [str(site), *stdlib])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return site


def _count_scans(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = ep_mod._scan
    monkeypatch.setattr(ep_mod, "_scan", lambda group: calls.append(group) or real(group))
    return calls


def test_a_stored_answer_is_used_and_an_install_is_seen_at_the_next_start(site, monkeypatch):
    _dist(site, "plug_a", "[vcga]\na = plug_a.plugin\n")
    _age(site)
    assert _names() == ["a"]  # scanned, stored
    with monkeypatch.context() as m:
        scans = _count_scans(m)
        got = VcgaPluginManager(env={})._entry_points()
        assert [(e.name, e.value, e.dist.name, e.dist.version) for e in got] == [("a", "plug_a.plugin", "plug_a", "1.0")]
        assert scans == []
    _dist(site, "plug_b", "[console_scripts]\nx = y:z\n\n[vcga]\nb = plug_b.plugin\n")  # the folder's time moves
    assert _names() == ["a", "b"]
    for f in (site / "plug_a-1.0.dist-info").iterdir():
        f.unlink()
    (site / "plug_a-1.0.dist-info").rmdir()
    assert _names() == ["b"]


def test_an_egg_info_edited_in_place_is_seen(site):
    info = _dist(site, "plug_egg", "[console_scripts]\nx = y:z\n", kind="egg-info")
    _age(site, info, info / "entry_points.txt")
    assert _names() == []
    (info / "entry_points.txt").write_text("[vcga]\nnew = plug_egg.new\n")  # setup.py egg_info rewrites it
    assert _names() == ["new"]


def test_a_folder_changed_just_now_is_not_trusted(site, monkeypatch):
    _dist(site, "plug_a", "[vcga]\na = plug_a.plugin\n")  # the folder's time is now: racy
    assert _names() == ["a"]
    scans = _count_scans(monkeypatch)
    assert _names() == ["a"]
    assert scans == ["vcga"]  # nothing was stored: scanned again


def test_a_replaced_distributions_function_bypasses_the_cache(site, monkeypatch):
    _dist(site, "plug_a", "[vcga]\na = plug_a.plugin\n")
    _age(site)
    assert _names() == ["a"]
    monkeypatch.setattr(ep_mod.importlib.metadata, "distributions", lambda: [])
    assert _names() == []
