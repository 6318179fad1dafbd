"""Third-party plugins are imported in a child process first, so one that kills the process
cannot kill VCGA.

An ``except`` in the plugin manager isolates a plugin whose import raises, but not one whose
import ends the interpreter: ``sys.exit`` or ``os._exit`` at import, a segfault or an abort in a
vendor SDK that does not match the driver (the usual case), or an import that never returns.
Before the main process imports an entry-point plugin or a module named in ``VCGA_PLUGINS``, a
child interpreter with the same ``sys.path`` imports it, exits normally, and reports; what it saw
becomes a :class:`Verdict`:

============  =======================================================================  ===========
outcome       what happened in the child                                                imported?
============  =======================================================================  ===========
``ok``        the import finished and the interpreter exited cleanly                    yes
``exception`` the import raised an exception (recorded again by the in-process import)  yes
``exit``      the import raised ``SystemExit`` (``sys.exit``)                           no
``exited``    the process ended during the import with a status (``os._exit``)          no
``signal``    the process was killed by a signal during the import (SIGSEGV, SIGABRT)   no
``at-exit``   the import finished, but the interpreter then died or exited non-zero     no
``hang``      the import (or the exit after it) did not end within the timeout          no
``error``     no child could be started to vet it (not cached; tried again next time)  no
============  =======================================================================  ===========

An ``exception`` is safe to meet in-process (the manager records it with its traceback), so only
the outcomes that end or stall a process keep a plugin out. Built-in plugins are imported directly.

After a clean import the child also asks the plugin what it provides
(:func:`vcga.plugin_manager.manifest.manifest_of`: its hooks, and its backends' names, priorities
and requirements), after the verdict is written; the verdict carries that :class:`Manifest
<vcga.plugin_manager.manifest.Manifest>`, and the manager imports the plugin only when a caller asks
for something it provides. A child that dies while it answers ends with ``at-exit`` (the same
call would end the main process).

Verdicts are cached (:mod:`vcga._usercache`, namespace ``plugins``), keyed by the distribution's
name and version and the entry point for an entry-point plugin, by the module file's path, size and
mtime for a ``VCGA_PLUGINS`` module and for an entry point's module (an editable install keeps its
version while its code changes), and in all cases by the interpreter and the manifest's format. A training job thus
pays for a child only the first time a plugin version meets an interpreter; every rank of a job
may vet at once, and each entry is written atomically. ``VCGA_PLUGIN_RECHECK=1`` (or
``vcga info --recheck-plugins``) vets again, e.g. after a driver update made a crashing SDK work;
a ``hang`` is vetted again whenever the timeout is raised above the one it was judged with.

Environment: ``VCGA_PLUGIN_VET_TIMEOUT`` (seconds, default 60), ``VCGA_PLUGIN_RECHECK``,
``VCGA_PLUGIN_VETTING=0`` (import in-process without a child: for debugging a plugin in a
debugger), ``VCGA_CACHE_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vcga._usercache import EntryCache

__all__ = ["Candidate", "Verdict", "vet", "module_key", "entry_point_key", "interpreter_key",
           "DEFAULT_TIMEOUT_S", "CHILD_ENV", "MANIFEST_FORMAT"]

log = logging.getLogger(__name__)

#: Long enough for a plugin that (against the checklist) imports torch and its vendor SDK on a busy
#: node; short enough that a hanging import does not look like a hung job.
DEFAULT_TIMEOUT_S = 60.0

#: Set in the child: a plugin that loads VCGA's plugins while being vetted imports them directly
#: (a child vetting its own plugins would recurse).
CHILD_ENV = "VCGA_PLUGIN_VETTING_CHILD"

#: The format of the manifest a verdict carries, part of every cache key: a verdict cached without
#: one (or with an older one) is vetted again once.
MANIFEST_FORMAT = 1

SAFE = ("ok", "exception")
OUTCOMES = ("ok", "exception", "exit", "exited", "signal", "at-exit", "hang", "error")

# The child: the verdict goes to the original stdout, everything the plugin prints to stderr;
# faulthandler puts the Python stack of a crash on stderr, whose tail becomes the traceback. After
# a clean import, a second line: the plugin's manifest (or null and why not).
_CHILD = r"""
import faulthandler, json, os, sys, time, traceback
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
faulthandler.enable()
sys.path[:] = json.loads(sys.argv[1])
kind, target = sys.argv[2], sys.argv[3]
plugin = None
t0 = time.perf_counter()
try:
    if kind == "module":
        import importlib
        plugin = importlib.import_module(target)
    else:
        from importlib.metadata import EntryPoint
        plugin = EntryPoint("vetted", target, "vcga").load()
except SystemExit as e:
    v = {"outcome": "exit", "detail": "the import called sys.exit(%r)" % (e.code,), "traceback": traceback.format_exc()}
except BaseException as e:
    text = str(e).strip().splitlines()
    v = {"outcome": "exception", "detail": ("%s: %s" % (type(e).__name__, text[0] if text else "")).rstrip(": "),
         "traceback": traceback.format_exc()}
else:
    v = {"outcome": "ok", "detail": "imported cleanly"}
v["import_s"] = round(time.perf_counter() - t0, 4)
out.write(json.dumps(v) + "\n")
out.flush()
if v["outcome"] == "ok":
    try:
        from vcga.plugin_manager.manifest import manifest_of
        m = {"manifest": manifest_of(plugin).to_json()}
    except BaseException as e:
        m = {"manifest": None, "why": "%s: %s" % (type(e).__name__, e)}
    out.write(json.dumps(m) + "\n")
    out.flush()
"""


@dataclass
class Verdict:
    """What importing one plugin did to a child process."""

    outcome: str  #: one of :data:`OUTCOMES`
    detail: str  #: one line: what happened
    traceback: str | None = None  #: the exception's traceback, or the tail of the child's stderr
    seconds: float = 0.0  #: wall time of the vetting child
    timeout_s: float = DEFAULT_TIMEOUT_S  #: the timeout it was judged with
    cached: bool = False  #: read from the cache in this process, not vetted now
    #: what the plugin provides (:meth:`Manifest.to_json <vcga.plugin_manager.manifest.Manifest.to_json>`),
    #: None where the child could not tell
    manifest: dict[str, Any] | None = None

    @property
    def safe(self) -> bool:
        """May the main process import it (its failure, if any, is an ordinary exception)?"""
        return self.outcome in SAFE

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("traceback")
        d.pop("manifest")
        return d


@dataclass
class Candidate:
    """A plugin to vet: ``kind`` ``"module"`` (target = module name) or ``"entry point"``
    (target = the entry point's value ``module:attr``); ``key`` None means not cacheable."""

    kind: str
    target: str
    key: dict[str, Any] | None


def interpreter_key() -> dict[str, str]:
    return {"executable": sys.executable, "version": sys.version, "cache_tag": str(sys.implementation.cache_tag)}


def entry_point_key(name: str, value: str, dist_name: str, dist_version: str) -> dict[str, Any]:
    key: dict[str, Any] = {"kind": "entry point", "name": name, "value": value, "dist": dist_name,
                           "version": dist_version, "interpreter": interpreter_key(), "manifest": MANIFEST_FORMAT}
    module = module_key(value.partition(":")[0].strip())
    if module is not None:
        key.update(file=module["file"], size=module["size"], mtime_ns=module["mtime_ns"])
    return key


def module_key(module: str) -> dict[str, Any] | None:
    """The cache key of a module found on ``sys.path`` without executing it: its file's path, size and
    mtime. None when it cannot be found that way (then it is vetted every time, never trusted)."""
    origin = _locate(module)
    if origin is None:
        return None
    try:
        st = os.stat(origin)
    except OSError:
        return None
    return {"kind": "module", "module": module, "file": origin, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "interpreter": interpreter_key(), "manifest": MANIFEST_FORMAT}


def _locate(module: str) -> str | None:
    """The file a module would be loaded from, asking the import system's finders exactly as
    ``import`` does but without executing a parent package (``importlib.util.find_spec`` would
    import ``a`` to find ``a.b``, and ``a`` may be the one that crashes)."""
    path: Any = None
    spec = None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            try:
                spec = find(name, path)
            except Exception:  # noqa: BLE001 - a third-party finder that fails must not stop vetting
                spec = None
            if spec is not None:
                break
        if spec is None:
            return None
        path = spec.submodule_search_locations
        if i < len(parts) - 1 and path is None:
            return None  # a parent that is not a package
    if spec is None or not spec.has_location or not spec.origin:
        return None
    return str(spec.origin)


def _cache_check(value: Any) -> bool:
    return (isinstance(value, dict) and value.get("outcome") in OUTCOMES and isinstance(value.get("detail"), str)
            and isinstance(value.get("seconds"), (int, float)) and isinstance(value.get("timeout_s"), (int, float))
            and (value.get("traceback") is None or isinstance(value.get("traceback"), str))
            and (value.get("manifest") is None or isinstance(value.get("manifest"), dict)))


def vet(candidates: Sequence[Candidate], *, timeout_s: float = DEFAULT_TIMEOUT_S, recheck: bool = False,
        env: Mapping[str, str] | None = None) -> list[Verdict]:
    """A verdict for each candidate, from the cache or from a child (all children run at once).

    :param env: the environment of the manager (for ``VCGA_CACHE_DIR``); the children inherit
        ``os.environ``, as the plugin would see it in-process.
    """
    cache = EntryCache("plugins", env=env, check=_cache_check)
    out: list[Verdict | None] = [None] * len(candidates)
    todo: list[int] = []
    for i, c in enumerate(candidates):
        hit = cache.get(c.key) if (c.key is not None and not recheck) else None
        if hit is not None and not (hit["outcome"] == "hang" and timeout_s > hit["timeout_s"]):
            out[i] = Verdict(outcome=hit["outcome"], detail=hit["detail"], traceback=hit.get("traceback"),
                             seconds=hit["seconds"], timeout_s=hit["timeout_s"], cached=True,
                             manifest=hit.get("manifest"))
        else:
            todo.append(i)
    if todo:
        for i, v in zip(todo, _run_children([candidates[i] for i in todo], timeout_s), strict=True):
            out[i] = v
            key = candidates[i].key
            if key is not None and v.outcome != "error":
                stored = asdict(v)
                stored.pop("cached")
                cache.put(key, stored)
    return [v for v in out if v is not None]


def _run_children(cands: Sequence[Candidate], timeout_s: float) -> list[Verdict]:
    child_env = dict(os.environ)
    child_env[CHILD_ENV] = "1"
    paths = json.dumps(sys.path)
    started = []
    with tempfile.TemporaryDirectory(prefix="vcga-vet-") as tmp:
        for i, c in enumerate(cands):
            # files, not pipes: a plugin printing a lot must not block on a full pipe (it would look hung)
            vout = open(os.path.join(tmp, f"{i}.out"), "w+b")  # noqa: SIM115 - closed below
            verr = open(os.path.join(tmp, f"{i}.err"), "w+b")  # noqa: SIM115
            kind = "module" if c.kind == "module" else "entry point"
            t0 = time.monotonic()
            try:
                proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, paths, kind, c.target], stdin=subprocess.DEVNULL, stdout=vout,
                    stderr=verr, env=child_env, start_new_session=True)  # own group: a hang is killed whole
            except OSError as e:
                proc = None
                spawn_error = f"{type(e).__name__}: {e}"
            else:
                spawn_error = ""
            started.append((proc, vout, verr, t0, spawn_error))
        deadline = time.monotonic() + timeout_s
        verdicts = []
        for (proc, vout, verr, t0, spawn_error) in started:
            with vout, verr:
                if proc is None:
                    # cannot vet (no processes left?): nothing unvetted runs in-process
                    verdicts.append(Verdict("error", f"could not start a child to vet the import ({spawn_error}); "
                                            "VCGA_PLUGIN_VETTING=0 imports plugins without vetting",
                                            timeout_s=timeout_s))
                    continue
                verdicts.append(_judge(proc, vout, verr, t0, deadline, timeout_s))
    return verdicts


def _judge(proc: subprocess.Popen[bytes], vout: Any, verr: Any, t0: float, deadline: float,
           timeout_s: float) -> Verdict:
    timed_out = False
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        rc = proc.wait()
    seconds = round(time.monotonic() - t0, 3)
    vout.seek(0)
    raw = vout.read()
    verr.seek(0, os.SEEK_END)
    size = verr.tell()
    verr.seek(max(0, size - 8192))
    err_tail = verr.read().decode("utf-8", "replace").strip() or None
    report: dict[str, Any] | None
    lines = raw.splitlines()
    try:
        report = json.loads(lines[0]) if lines else None
    except ValueError:
        report = None
    answer: dict[str, Any] | None
    try:
        answer = json.loads(lines[1]) if len(lines) > 1 else None
    except ValueError:
        answer = None
    manifest = answer.get("manifest") if isinstance(answer, dict) else None
    if timed_out:
        if report is None:
            when = "the import"
        elif report.get("outcome") == "ok" and answer is None:
            when = "saying what it provides after the import (its vcga_backends)"
        else:
            when = "exiting after the import"
        return Verdict("hang", f"{when} did not finish within {timeout_s:g} s (the child was killed)",
                       err_tail, seconds, timeout_s)
    if report is None:
        if rc < 0:
            return Verdict("signal", f"the import crashed the process: {_signame(-rc)}", err_tail, seconds, timeout_s)
        return Verdict("exited", f"the process exited with status {rc} during the import", err_tail, seconds,
                       timeout_s)
    tb = report.get("traceback") or err_tail
    if rc != 0 and report.get("outcome") in SAFE:
        how = _signame(-rc) if rc < 0 else f"status {rc}"
        when = ("then, asked what it provides (its vcga_backends), the interpreter ended"
                if report.get("outcome") == "ok" and answer is None else "the interpreter then ended")
        return Verdict("at-exit", f"the import finished, but {when} with {how}", err_tail, seconds, timeout_s)
    return Verdict(str(report.get("outcome")), str(report.get("detail")), tb, seconds, timeout_s,
                   manifest=manifest if isinstance(manifest, dict) else None)


def _signame(num: int) -> str:
    try:
        return f"{signal.Signals(num).name} (signal {num})"
    except ValueError:
        return f"signal {num}"
