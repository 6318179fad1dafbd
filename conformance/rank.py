"""The rank side of a spawned world: create the group, run the planned checks in order, and report
every step to the runner over a pipe (:mod:`vcga.conformance.runner` is the parent side)."""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

from .world import NATIVE_DIST_BACKEND, PlannedCheck, WorldSpec

# ---------------------------------------------------------------------------------------------------
# The rank side
# ---------------------------------------------------------------------------------------------------


def _worker(rank: int, spec: WorldSpec, group_kind: str, port: int, plan: list[PlannedCheck],
            timeout_s: float, store_timeout_s: float, results: Any, log_path: str | None, trace_dir: str) -> None:
    def emit(kind: str, payload: Any) -> None:
        results.send((kind, rank, payload))  # synchronous: delivered even if this process dies next

    _die_with_parent()
    if log_path:  # native libraries write to fd 1/2 directly; keep that out of the user's terminal
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        # the faults check times collectives out on purpose, and each timeout writes a flight-recorder
        # dump: into the run's own folder, never over a job's dumps in the default one
        env = {"VCGA_TIMEOUT": str(timeout_s), "VCGA_TRACE_DIR": trace_dir}
        if spec.sim_vendors:
            env["VCGA_SIM_VENDORS"] = spec.sim_vendors
            os.environ.pop("VCGA_BACKEND", None)
        else:
            env["VCGA_BACKEND"] = spec.backend or ""
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        from vcga.config import load_config
        from vcga.plugin_manager import get_plugin_manager

        from .context import Context

        torch.set_num_threads(1)  # ranks share the machine's cores; oversubscription only adds noise
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, spec.world_size, rank == 0,
                              timeout=timedelta(seconds=store_timeout_s))
        pm = get_plugin_manager()
        if group_kind == "native":
            backend = pm.backend(spec.backend or "")
            probe = pm.backend_record(backend.name).probe()
            if not probe.available:
                from vcga.errors import VcgaBackendUnavailable

                raise VcgaBackendUnavailable(backend.name, probe.reason)

            def create(s: Any, r: int, n: int, t: timedelta) -> Any:
                return backend.create_process_group(s, r, n, t)

            dist.Backend.register_backend(NATIVE_DIST_BACKEND, create, devices=[backend.device_type])
            dist_backend = NATIVE_DIST_BACKEND
        else:
            import vcga  # noqa: F401 - registers the vcga backend

            backend = pm.select_backend(load_config(), rank=rank, world_size=spec.world_size)
            dist_backend = "vcga"

        generation = [0]

        def init_group() -> None:
            dist.init_process_group(dist_backend, store=dist.PrefixStore(f"pg{generation[0]}", store),
                                    rank=rank, world_size=spec.world_size, timeout=timeout)

        def reinit() -> None:
            generation[0] += 1
            dist.destroy_process_group()
            init_group()

        init_group()
        ctx = Context(rank=rank, world_size=spec.world_size, backend=backend, backend_label=spec.label,
                      group_kind=group_kind, dist_backend=dist_backend, timeout=timeout,
                      store=dist.PrefixStore("verify", store), vendor_set=spec.sim_vendors, emit=emit,
                      reinit=reinit)
        checks = {c.name: c for c in pm.conformance_checks()}
        emit("ready", {"backend": backend.name, "vendor": backend.vendor})
    except BaseException as e:  # noqa: BLE001 - reported to the runner (KeyboardInterrupt included), then the rank ends
        if spec.sim_vendors and _group_cannot_mix(e):
            emit("setup-unsupported", str(_group_cannot_mix(e)))
        else:
            emit("setup-error", f"{type(e).__name__}: {e}")
        return
    for planned in plan:
        check = checks.get(planned.name)
        ctx.check, ctx.options = planned.name, dict(planned.options)
        emit("check", planned.name)
        try:
            if check is None:
                raise LookupError(f"no check named {planned.name!r} is registered")
            for res in check.run(ctx):
                emit("result", res)
            ctx.waiting(f"end of {planned.name}")
            ctx.exchange(f"end:{planned.name}", b"")
        except BaseException as e:  # noqa: BLE001 - reported to the runner, which restarts the rest in a fresh world
            # A check that raises past its cases leaves the ranks out of step: report and stop this
            # world; the runner restarts the checks that remain in a fresh one.
            emit("fatal", (planned.name, f"{type(e).__name__}: {e}", traceback.format_exc()))
            return
        emit("check-done", planned.name)
    emit("done", {"group_resets": ctx.group_resets})
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the results are in; a failing teardown must not turn them into an error
        pass
    _leave(store, rank, spec.world_size, store_timeout_s)


def _leave(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 0 hosts the store, so it leaves last: a rank still inside its last exchange would lose
    its connection (DistNetworkError: connection reset) if rank 0's process ended first. The
    results are in by now, so a failing goodbye changes nothing and nothing here raises."""
    try:
        if rank:
            store.set(f"left/{rank}", b"")
        else:
            store.wait([f"left/{r}" for r in range(1, world_size)], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a rank that died is the runner's to report
        pass


def _die_with_parent() -> None:
    """A rank must not outlive the runner (killed, or interrupted before its cleanup ran): on Linux
    the kernel kills it when the parent exits (PR_SET_PDEATHSIG); elsewhere a watchdog thread does."""
    parent = os.getppid()
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:  # PR_SET_PDEATHSIG = 1
            if os.getppid() != parent:  # the parent died before the call took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)  # a watchdog, not synchronisation: nothing waits on it
        os._exit(1)

    threading.Thread(target=watch, name="vcga-verify-parent-watch", daemon=True).start()


def _bridge_in_this_build() -> bool:
    """Whether this build has the mixed-vendor bridge (``vcga.bridge``)."""
    import importlib.util

    return importlib.util.find_spec("vcga.bridge") is not None


def _group_cannot_mix(e: BaseException, has_bridge: bool | None = None) -> BaseException | None:
    """The vcga group's own refusal to build a mixed-vendor world (a build without the bridge):
    a VcgaBackendUnavailable naming the group itself, possibly wrapped by torch. A vendor backend
    failing inside a mixed world names that vendor instead, and stays a failure -- and once the
    build has the bridge, every failure to build a mixed world is a failure (the bridge names
    'vcga' too when its own host group cannot be created)."""
    from vcga.errors import VcgaBackendUnavailable

    if has_bridge if has_bridge is not None else _bridge_in_this_build():
        return None
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, VcgaBackendUnavailable) and seen.name == "vcga":
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
