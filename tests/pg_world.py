"""Start a small world of processes for the ``vcga`` process-group tests.

:func:`run_world` starts ``world_size`` rank processes (:func:`vcga.spawn.get_context`: forked
from a server that has imported torch), each calling ``target(rank, world_size, init_method,
*args)`` with a fresh TCP rendezvous, and returns every rank's return value. A rank that raises,
dies, or outlives the deadline fails the test with its traceback; leftover processes are killed,
so a hang in the code under test becomes a failure, never a hung suite.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vcga.spawn import get_context

__all__ = ["run_world", "free_port", "WorldFailed"]


class WorldFailed(AssertionError):
    """One or more ranks failed; the message carries each failing rank's traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target: Callable[..., Any], rank: int, world_size: int, init_method: str, args: tuple[Any, ...],
           env: Mapping[str, str], results: Any) -> None:
    try:
        os.environ.update(env)
        value = target(rank, world_size, init_method, *args)
        results.put(("ok", rank, value))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_world(target: Callable[..., Any], world_size: int, *args: Any, env: Mapping[str, str] | None = None,
              timeout: float = 240.0, preload: Sequence[str] = ()) -> list[Any]:
    """Run ``target`` on ``world_size`` rank processes; return the per-rank results in rank order.

    ``preload`` names modules beyond torch for the ranks' forkserver to import once (e.g.
    ``torch.distributed.checkpoint``) instead of each rank importing them anew; see
    :func:`vcga.spawn.get_context`."""
    ctx = get_context(preload)
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    # A short collective timeout: a desynchronised test fails in a minute instead of hanging.
    # A link-figure cache of the world's own (removed after): a mixed world measures its links as
    # a first start does, and nothing is written to the user's cache directory.
    figcache = tempfile.TemporaryDirectory(prefix="vcga-test-figures-")
    child_env = {"VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", "VCGA_TIMEOUT": "60",
                 "VCGA_BRIDGE_FIGURES_CACHE": figcache.name, **(env or {})}
    procs = [ctx.Process(target=_child, args=(target, r, world_size, init_method, args, child_env, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out) - set(errors))
                errors.update({r: f"did not finish within {timeout:g} s" for r in missing})
                break
            try:
                kind, rank, value = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in out and r not in errors]
                if dead:
                    try:  # a rank that just exited may still have its last message in flight
                        kind, rank, value = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        errors.update({r: f"exited with code {procs[r].exitcode} without reporting" for r in dead})
                        continue
                else:
                    continue
            if kind == "ok":
                out[rank] = value
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        figcache.cleanup()
    if errors:
        raise WorldFailed("\n".join(f"--- rank {r}:\n{msg}" for r, msg in sorted(errors.items())))
    return [out[r] for r in range(world_size)]
