"""The installed distributions that declare entry points of a group, remembered between starts.

Finding them means listing every folder on ``sys.path`` and opening every distribution's
``entry_points.txt``: 1 to 2.5 ms of CPU on every rank of every job for about a hundred
distributions (more where ``sys.path`` starts with a crowded working folder), while a node's ranks
start at once on the same cores. The answer rarely changes, so it is kept in the user cache
(:mod:`vcga._usercache`, namespace ``entry-points``): one entry per interpreter, ``sys.path`` and
group, holding the folders of the distributions that declare the group and a stamp of where they
were found, the modification time of each ``sys.path`` entry.

Why those times tell: installing, reinstalling or removing a distribution adds or removes its
``.dist-info`` folder in a ``sys.path`` folder, and that changes the folder's time; pip and uv never
edit an installed distribution's metadata in place. An ``.egg-info`` folder is (``setup.py
develop`` and ``egg_info`` rewrite its files), so each one found is stamped too, with its
``entry_points.txt``. A stamp taken within :data:`RACY_S` of a change is not trusted (a change in
the same tick of a coarse file-system clock would not show; git treats its index the same way):
then nothing is stored and the next start looks again. Where anything but the standard path finder
provides distributions (a custom finder, a replaced ``importlib.metadata.distributions``), or a
matching distribution is not a folder, every start scans, as before.

A stored answer is read back through ``importlib.metadata`` (``PathDistribution`` of each folder),
so callers get the same distribution objects, with the same entry points, as a scan gives.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import pathlib
import sys
import time
from typing import Any

__all__ = ["RACY_S", "declaring", "entry_points_text"]

#: How recent a folder's modification may be and still be trusted as a stamp (seconds).
RACY_S = 2.0

_NAMESPACE = "entry-points"


def entry_points_text(dist: importlib.metadata.Distribution) -> str | None:
    """A distribution's ``entry_points.txt``, or None. For a distribution in a folder (nearly all),
    one ``open`` of the file ``Distribution.read_text`` opens, at half its cost: that goes through
    pathlib and an exception for each of the ~70% of distributions without the file, about 0.5 ms
    per rank for a hundred of them. Any other kind (a zip file, a custom finder's) through
    ``read_text``."""
    path = _folder(dist)
    if path is None:
        return dist.read_text("entry_points.txt")
    try:
        with open(os.path.join(path, "entry_points.txt"), encoding="utf-8") as f:
            return f.read()
    except OSError:  # none (FileNotFoundError), or unreadable: read_text gives None for both
        return None


def _folder(dist: importlib.metadata.Distribution) -> pathlib.Path | None:
    """The metadata folder of a distribution in a folder; None for any other kind."""
    path = getattr(dist, "_path", None)  # what PathDistribution.read_text joins the name to
    if type(dist) is not importlib.metadata.PathDistribution or not isinstance(path, pathlib.Path):
        return None
    return path


def declaring(group: str, env: Any = None) -> list[importlib.metadata.Distribution]:
    """The distributions whose ``entry_points.txt`` declares ``group``, in ``sys.path`` order
    (:func:`importlib.metadata.distributions`' order), from the cache when its stamp still holds."""
    key = _key(group)
    if key is None:
        return _scan(group)[0]
    from vcga._usercache import EntryCache

    cache = EntryCache(_NAMESPACE, env=env, check=_valid, quiet=True)
    hit = cache.get(key)
    if hit is not None and _stamp([path for path, _ in hit["stamp"]]) == hit["stamp"]:
        return [importlib.metadata.PathDistribution(pathlib.Path(p)) for p in hit["dists"]]
    dists, folders = _scan(group)
    if folders is not None:
        stamp = _stamp(key["path"] + folders)
        if all(t is None or time.time_ns() - t > RACY_S * 1e9 for _, t in stamp):
            cache.put(key, {"stamp": stamp, "dists": [str(_folder(d)) for d in dists]})
    return dists


def _key(group: str) -> dict[str, Any] | None:
    """The cache key, or None where the cache must not be used (see the module docstring)."""
    if getattr(importlib.metadata.distributions, "__module__", None) != "importlib.metadata":
        return None
    for finder in sys.meta_path:
        if hasattr(finder, "find_distributions") and finder is not importlib.machinery.PathFinder:
            return None
    if not all(isinstance(p, str) for p in sys.path):
        return None
    path = [os.path.abspath(p or os.curdir) for p in sys.path]  # "" is the working folder
    return {"group": group, "python": sys.executable, "version": sys.version, "path": path}


def _scan(group: str) -> tuple[list[importlib.metadata.Distribution], list[str] | None]:
    """Every distribution declaring ``group``, and the ``.egg-info`` folders (with their
    ``entry_points.txt``) to stamp; None instead of those when the answer may not be cached."""
    header = f"[{group}]"
    out: list[importlib.metadata.Distribution] = []
    eggs: list[str] | None = []
    for dist in importlib.metadata.distributions():
        folder = _folder(dist)
        if folder is None:
            eggs = None
        elif eggs is not None and folder.name.lower().endswith(".egg-info"):
            eggs += [str(folder), os.path.join(folder, "entry_points.txt")]
        text = entry_points_text(dist)
        if text and header in text:
            out.append(dist)
    return out, eggs


def _stamp(paths: list[str]) -> list[list[Any]]:
    """Each path with its modification time in ns, None where it does not exist."""
    out = []
    for path in paths:
        try:
            mtime: int | None = os.stat(path).st_mtime_ns
        except OSError:
            mtime = None
        out.append([path, mtime])
    return out


def _valid(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("dists"), list)
            and all(isinstance(p, str) for p in value["dists"]) and isinstance(value.get("stamp"), list)
            and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)
                    and (s[1] is None or isinstance(s[1], int)) for s in value["stamp"]))
