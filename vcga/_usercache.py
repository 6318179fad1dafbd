"""Small facts VCGA remembers between runs, in the user's cache directory.

Where: ``$VCGA_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/vcga``, else ``~/.cache/vcga``.
Each namespace is a folder (``plugins/`` holds the plugin verdicts of :mod:`vcga.plugin_manager.vetting`), each
entry one small JSON file named by a hash of its key. One file per entry, because several ranks of
a job start at once and may each store an entry: with one file each, a write replaces one whole
file atomically (temporary file + rename, :mod:`vcga.atomic`) and no writer can lose another's entry.

Every entry is checked on load -- the schema number, the full key stored inside it (a hash
collision or a hand-copied file does not match), and the value's shape through the caller's
``check``. An entry that fails any check is discarded and deleted, as pytest's cache treats a
corrupt file: a cache is never a reason to fail. A directory that cannot be written (a read-only
home in a container) is logged once and the caller simply pays the cost again next time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "EntryCache", "SCHEMA"]

log = logging.getLogger(__name__)

#: Bumped when the layout of an entry changes: older entries are then discarded, not misread.
SCHEMA = 1


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The user's VCGA cache directory (not created here)."""
    env = os.environ if env is None else env
    if env.get("VCGA_CACHE_DIR"):
        return Path(env["VCGA_CACHE_DIR"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vcga"


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


class EntryCache:
    """A folder of checked JSON entries, each keyed by a JSON-able mapping.

    :param namespace: the sub-folder, e.g. ``"plugins"``.
    :param check: returns True when a loaded value has the shape the caller expects.
    :param quiet: a folder that cannot be written is logged at debug level, not as a warning: for
        a cache every job consults, where a read-only home only costs time.
    """

    def __init__(self, namespace: str, *, env: Mapping[str, str] | None = None,
                 check: Callable[[Any], bool] = lambda v: True, quiet: bool = False) -> None:
        self.dir = cache_dir(env) / namespace
        self._check = check
        self._warned = quiet

    def path_for(self, key: Mapping[str, Any]) -> Path:
        return self.dir / (hashlib.sha256(_canonical(key).encode()).hexdigest()[:32] + ".json")

    def get(self, key: Mapping[str, Any]) -> Any | None:
        """The stored value for ``key``, or None when absent or discarded as corrupt."""
        path = self.path_for(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cache entry %s cannot be read (%s); ignoring it", path, e)
            return None
        try:
            doc = json.loads(raw)
            ok = (isinstance(doc, dict) and doc.get("schema") == SCHEMA
                  and _canonical(doc.get("key", {})) == _canonical(key) and self._check(doc.get("value")))
        except (ValueError, TypeError, RecursionError):
            ok = False
        if not ok:
            log.warning("cache entry %s is corrupt or from another version; discarding it", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return doc["value"]

    def put(self, key: Mapping[str, Any], value: Any) -> bool:
        """Store ``value`` under ``key`` atomically; False (logged) when the folder is not writable."""
        from vcga.atomic import atomic_write_bytes

        data = json.dumps({"schema": SCHEMA, "key": key, "value": value}, sort_keys=True, indent=1).encode()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path_for(key), data)
            return True
        except OSError as e:
            if self._warned:
                log.debug("cannot write the VCGA cache in %s (%s)", self.dir, e)
            else:
                self._warned = True
                log.warning("cannot write the VCGA cache in %s (%s); set VCGA_CACHE_DIR to a writable "
                            "folder to keep results between runs", self.dir, e)
            return False
