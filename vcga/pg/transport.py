"""The seam under the ``vcga`` process group: what actually moves the bytes.

The ``vcga`` process group (:mod:`vcga.process_group`) does everything that does not depend on how
bytes travel: argument checks, sequence numbers, debug fingerprints, typed errors and timeouts, and
capability-aware dispatch with its emulations (:mod:`vcga.pg.dispatch`). Underneath it sits one
:class:`Transport`:

- :class:`NativeTransport` -- every rank of the group runs the same backend: the group is that
  backend's native process group (``Backend.create_process_group`` over a prefixed store) and the
  table is that backend's :class:`~vcga.contract.CapabilityTable`.
- a bridge transport (mixed vendors in one group, built on this seam later) -- native groups per
  vendor plus a host-staged bridge between them, presented through the same two attributes.

The contract of a transport is deliberately small:

``table``
    a :class:`~vcga.contract.CapabilityTable` saying what ``group`` does natively, correctly, for
    each (collective, dtype, reduce op). The dispatcher sends ``group`` only native cells; for every
    other cell it composes native calls (emulation) or refuses before any rank starts.
``group``
    an object with the c10d methods in :data:`TRANSPORT_METHODS`, each taking and returning what
    ``torch.distributed.ProcessGroup``'s method of that name takes and returns (tensor lists, c10d
    options, a ``Work``). A ``ProcessGroupGloo`` qualifies as is; so does any Python
    ``dist.ProcessGroup`` subclass implementing them (see :mod:`vcga.pypg`). Tensors handed to
    ``group`` are always contiguous and of a dtype the table calls native for that call.
``backend_name``, ``device_type``, :meth:`describe`
    for error messages, ``vcga info`` and debug logs.

A transport is created once per ``vcga`` group by :func:`make_transport`, after
every rank published which backend it runs (the discovery step a bridge extends with vendor, node
and table).
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from vcga.errors import VcgaBackendUnavailable, VcgaError

if TYPE_CHECKING:
    from vcga.config import Config
    from vcga.contract import Backend, CapabilityTable

__all__ = ["TRANSPORT_METHODS", "Transport", "NativeTransport", "ClosedGroup", "StartupClock", "shut_down", "abort_now",
           "release_later", "make_transport"]

#: The c10d methods the dispatcher calls on ``Transport.group`` (names as on ``ProcessGroupGloo``).
TRANSPORT_METHODS: tuple[str, ...] = (
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
)


class StartupClock:
    """Where this rank's group creation spent its time, per phase (``describe()["startup"]``).

    Phases: "backend selection" (loading the plugins, choosing and probing this rank's backend),
    "discovery" (publishing and reading what every rank runs), "native groups" (the vendor
    library's own group), "bridge sub-groups" (the shard peers' gloo groups and their shared
    memory), "whole-group gloo" (the bridge's group over every rank), "calibration" (the bridge's
    link figures: measured, or read from the cache). A phase that runs later, on the first
    collective that needs it, adds to its entry then. Wall seconds in :attr:`seconds`, this
    process's CPU seconds (all its threads) in :attr:`cpu_seconds`; benchmarks/startup.py reports
    both (docs/benchmarks.md).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, time.process_time() - c0)

    def add(self, name: str, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu_seconds

    def to_json(self) -> dict[str, dict[str, float]]:
        return {name: {"s": s, "cpu_s": self.cpu_seconds.get(name, 0.0)} for name, s in self.seconds.items()}


class Transport(abc.ABC):
    """What the ``vcga`` process group drives (see the module docstring for the contract)."""

    #: What ``group`` does natively.
    table: CapabilityTable
    #: The c10d-method object the dispatcher calls.
    group: Any
    #: A name for messages: the backend, or e.g. "bridge(sim-nccl:2,sim-hccl:2)".
    backend_name: str
    #: The torch device type tensors must be on when handed to ``group`` ("cpu", "cuda", ...).
    device_type: str

    #: where creating this group spent its time (set by :func:`make_transport`)
    startup: StartupClock | None = None

    def describe(self) -> dict[str, Any]:
        """Facts for logs and ``vcga info``."""
        d: dict[str, Any] = {"transport": type(self).__name__, "backend": self.backend_name,
                             "device_type": self.device_type}
        if self.startup is not None:
            d["startup"] = self.startup.to_json()
        return d

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release native resources (called when the ``vcga`` group shuts down).

        When it returns, the native groups' threads must have stopped, as they have after
        ``destroy_process_group`` on a plain gloo group: a thread left running may release a Python
        object (the last reference to a tensor, a future's value) after the interpreter began to
        finalize, and the process aborts (see :class:`NativeTransport`)."""

    def abort(self) -> None:
        """Stop communicating now (``abort()`` on the ``vcga`` group): later calls raise, and nothing
        waits for a collective still running. Transports with native threads override this to abort
        their groups and release them in the background (:func:`release_later`)."""
        self.close()


class NativeTransport(Transport):
    """A single-vendor group: the backend's native process group, used directly."""

    def __init__(self, backend: Backend, group: Any) -> None:
        self.backend = backend
        self.group = group
        self.table = backend.capabilities()
        self.backend_name = backend.name
        self.device_type = backend.device_type

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["vendor"] = self.backend.vendor
        d["dist_backend"] = self.backend.dist_backend
        return d

    def close(self) -> None:
        """Shut the native group down and drop this transport's reference to it.

        ``ProcessGroupGloo.shutdown()`` does nothing; only its destructor stops and joins its worker
        threads. A worker that completed a work still holds it for a moment, and dropping it there
        can release the last reference to a tensor whose Python object torch keeps alive, which
        takes the GIL. Once the interpreter is finalizing, Python ends a thread that asks for the
        GIL, inside a ``noexcept`` destructor, and the process aborts ("terminate called without an
        active exception"). So the group must be gone when ``destroy_process_group`` returns, as a
        plain gloo group is; the ``vcga`` group drops its own references too
        (:meth:`vcga.process_group.VcgaProcessGroup.shutdown`)."""
        group, self.group = self.group, ClosedGroup(self.backend_name)
        shut_down(group)

    def abort(self) -> None:
        """Abort the native group (NCCL/HCCL abort their communicators: what is in flight fails) and
        return without joining its threads: a worker may sit in a collective until the library's
        timeout (gloo cannot abort one), and its destructor waits for that. The group is shut down
        and released in a background thread instead (:func:`release_later`)."""
        groups, self.group = [self.group], ClosedGroup(self.backend_name, "aborted")
        abort_now(groups[0])
        release_later(groups)  # no other reference here: a local one would destroy it on return


class ClosedGroup:
    """What a closed transport's ``group`` becomes: every c10d method raises a typed error instead of
    reaching a native group that no longer exists. ``shutdown`` and ``abort`` do nothing."""

    def __init__(self, name: str, how: str = "shut down by destroy_process_group()") -> None:
        self._name = name
        self._how = how

    def shutdown(self) -> None:
        pass

    abort = shutdown

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        from vcga.errors import VcgaCollectiveError

        raise VcgaCollectiveError(f"{attr}: this group ({self._name}) was {self._how}; "
                                  "create a new group to communicate again")


def shut_down(group: Any) -> None:
    """Call ``group.shutdown()`` (or ``close()``) if it has one; teardown is best effort. The caller
    then drops its reference: a native group stops its threads when the last one goes."""
    if group is None:
        return
    shutdown = getattr(group, "shutdown", None) or getattr(group, "close", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


def abort_now(group: Any) -> None:
    """Call ``group.abort()`` if it has one (best effort: gloo's does nothing, a Python group may
    have none)."""
    abort = getattr(group, "abort", None)
    if callable(abort):
        try:
            abort()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


def release_later(groups: list[Any], teardown: Callable[[], None] | None = None) -> None:
    """Shut ``groups`` down and drop them in a daemon thread counted by the exit drain
    (:func:`vcga.pypg.run_counted`): their destructors join worker threads that may still be in a
    collective. The caller must hold no other reference. ``teardown`` runs there first."""
    from vcga.pypg import run_counted  # torch is loaded by now: a transport exists

    box = [groups]

    def release() -> None:
        if teardown is not None:
            teardown()
        gs = box.pop()
        while gs:
            g = gs.pop()
            shut_down(g)
            del g  # the last reference: the destructor runs here, before the drain's count drops

    run_counted(release, "vcga-abort-release")


# ===================================================================================================
# Creation
# ===================================================================================================


def _apply_vendor_env(backend: Backend, config: Config) -> None:
    for key, value in backend.vendor_env(config).items():
        os.environ.setdefault(key, value)  # never override what the user set


def make_transport(store: Any, rank: int, size: int, backend: Backend, timeout: timedelta, config: Config,
                   global_ranks: Sequence[int], clock: StartupClock | None = None) -> Transport:
    """Discover every rank's backend through ``store`` and build the group's transport.

    Discovery (:func:`vcga.pg.discovery.discover`): every rank publishes its backend, vendor, device
    type, node and capability-table digest, rank 0 gathers them into one compact layout, and
    every rank reads it, so every rank reaches the same decision. One backend: a
    :class:`~vcga.pg.transport.NativeTransport` over the backend's native group. Several: the
    mixed-vendor bridge (:func:`vcga.bridge.create_bridge_transport`).
    """
    import torch.distributed as dist  # here: importing this module stays torch-free

    from vcga.pg.discovery import discover

    clock = clock or StartupClock()
    with clock.phase("discovery"):
        layout = discover(store, rank, size, backend, timeout, global_ranks)
    if len(layout.backends) == 1:
        _apply_vendor_env(backend, config)
        with clock.phase("native groups"):
            try:
                native = backend.create_process_group(dist.PrefixStore("vcga/native", store), rank, size, timeout)
            except VcgaError:
                raise
            except Exception as e:
                raise VcgaBackendUnavailable(backend.name, f"creating its native process group failed: "
                                                           f"{type(e).__name__}: {e}") from e
        transport = NativeTransport(backend, native)
        transport.startup = clock
        return transport
    # Several backends: native groups per vendor plus the host bridge between them (vcga/bridge/).
    # The bridge's exchange between nodes is gloo, whatever the vendors: it follows the network
    # section (GLOO_SOCKET_IFNAME; torch's ProcessGroupGloo reads it when each group is made).
    from vcga.bridge import create_bridge_transport
    from vcga.config import gloo_env

    for key, value in gloo_env(config).items():
        os.environ.setdefault(key, value)  # never override what the user set

    return create_bridge_transport(store, rank, size, backend, layout.peers(global_ranks), timeout,
                                   config.bridge_algorithm,
                                   apply_env=partial(_apply_vendor_env, config=config), shared_memory=config.bridge_shm,
                                   async_ops=config.bridge_async, clock=clock, layout=layout,
                                   calibration=config.bridge_calibration, figures_cache=config.bridge_figures_cache,
                                   pipeline=config.bridge_pipeline, verify=config.bridge_verify)
