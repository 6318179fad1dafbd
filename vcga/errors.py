"""Every error VCGA raises on purpose, in one place.

Each error says what was wrong, which object, and what to do about it. All derive from
:class:`VcgaError`, so ``except vcga.errors.VcgaError`` catches everything VCGA raises
deliberately; each also derives from the builtin that fits (``ValueError``, ``TimeoutError``, ...)
so code written against torch.distributed's exceptions keeps working.

This module imports nothing heavy: the CLI imports it to turn errors into one-line messages.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "VcgaError",
    "VcgaConfigError",
    "VcgaPluginError",
    "VcgaBackendNotFound",
    "VcgaBackendUnavailable",
    "VcgaUnsupportedError",
    "VcgaCollectiveError",
    "VcgaTimeoutError",
    "VcgaPeerLostError",
    "VcgaMismatchError",
    "VcgaFormatError",
    "VcgaChecksumError",
    "VcgaConversionError",
    "VcgaCheckpointError",
    "VcgaDiskFullError",
    "typed",
    "adopt_torch_bases",
]

#: The VCGA errors created most recently in this process (weak references), for :func:`typed`.
_RECENT: deque[weakref.ref[VcgaError]] = deque(maxlen=64)
_RECENT_LOCK = threading.Lock()


class VcgaError(Exception):
    """Base of every error VCGA raises deliberately.

    Picklable whatever the subclass's constructor takes: torch.distributed.checkpoint gathers a
    rank's exception to the other ranks by pickling it, and the default (calling the class with
    the message alone) fails for every error here that takes more than a message."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        with _RECENT_LOCK:  # for typed(): torch's futures may hand the caller a wrapper instead
            _RECENT.append(weakref.ref(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def typed(error: BaseException) -> BaseException:
    """The VCGA error behind ``error``, else ``error`` itself.

    torch's futures wrap an exception raised in a ``then()`` callback into a plain ``RuntimeError``
    ("Got the following error when running the callback: VcgaTimeoutError: ..."), and the code
    that waits on them -- DDP's reducer, FSDP, DDP communication hooks -- hands the caller that
    wrapper: a collective that failed with a :class:`VcgaTimeoutError` on the asynchronous bridge
    reaches ``loss.backward()`` as a ``RuntimeError``. Its text still holds the original's; this
    finds the VCGA error this process created whose message the wrapper (or its causes) carries::

        except Exception as e:
            err = vcga.errors.typed(e)   # the VcgaTimeoutError itself, when that is what failed
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, VcgaError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    text = str(error)
    with _RECENT_LOCK:
        recent = [r() for r in reversed(_RECENT)]
    for err in recent:
        if err is not None and f"{type(err).__name__}: {err}" in text:
            return err
    return error


def adopt_torch_bases(dist_backend_error: type[BaseException]) -> None:
    """Make :class:`VcgaCollectiveError` and :class:`VcgaTimeoutError` also torch's
    ``torch.distributed.DistBackendError`` (and so ``DistError``), what torch's own backends raise
    when a collective fails: code written against torch catches ours. Called when torch.distributed
    is loaded (:mod:`vcga.pypg`): this module imports nothing heavy. Idempotent."""
    for cls in (VcgaCollectiveError, VcgaTimeoutError):
        if issubclass(cls, dist_backend_error):
            continue
        cls.__bases__ = tuple(dist_backend_error if b is RuntimeError else b for b in cls.__bases__)


def _rebuild_error(cls: type[VcgaError], args: tuple[Any, ...], state: dict[str, Any]) -> VcgaError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class VcgaConfigError(VcgaError, ValueError):
    """A configuration value (YAML file or environment variable) is invalid.

    :param key: the configuration key, e.g. ``collective_timeout_s``.
    :param value: the offending value as given.
    :param allowed: a human description of the allowed values.
    :param source: where the value came from (a file path or ``env VCGA_TIMEOUT``).
    """

    def __init__(self, key: str, value: Any, allowed: str, source: str = "") -> None:
        self.key, self.value, self.allowed, self.source = key, value, allowed, source
        where = f" (from {source})" if source else ""
        super().__init__(f"invalid config {key}={value!r}{where}: allowed values are {allowed}")


class VcgaPluginError(VcgaError):
    """A plugin could not be loaded or does not follow the contract."""

    def __init__(self, plugin: str, message: str) -> None:
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r}: {message}")


class VcgaBackendNotFound(VcgaError, LookupError):
    """No backend of that name is registered by any loaded plugin."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name, self.known = name, tuple(known)
        super().__init__(
            f"no backend named {name!r}; registered backends: {', '.join(self.known) or '(none)'}. "
            "Run `vcga info` to see every plugin and why a backend may be missing."
        )


class VcgaBackendUnavailable(VcgaError, RuntimeError):
    """A backend exists but cannot run here (no device, vendor module missing, ...)."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        super().__init__(f"backend {name!r} is unavailable: {reason}")


class VcgaUnsupportedError(VcgaError, ValueError):
    """A (collective, dtype, reduce-op) combination the backend refuses.

    Raised *before* the call reaches the vendor library, so no rank has started the collective.
    """

    def __init__(
        self,
        backend: str,
        collective: str,
        dtype: str,
        op: str | None,
        reason: str,
        hint: str = "",
    ) -> None:
        self.backend, self.collective, self.dtype, self.op = backend, collective, dtype, op
        self.reason, self.hint = reason, hint
        what = f"{collective} on {dtype}" + (f" with {op}" if op else "")
        msg = f"backend {backend!r} cannot run {what}: {reason}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class VcgaCollectiveError(VcgaError, RuntimeError):
    """A collective failed inside the native library or while creating a group.

    Once torch.distributed is loaded also a ``torch.distributed.DistBackendError`` (:func:`adopt_torch_bases`)."""

    def __init__(self, message: str, *, rank: int | None = None, backend: str | None = None) -> None:
        self.rank, self.backend = rank, backend
        prefix = ""
        if backend is not None:
            prefix += f"[{backend}] "
        if rank is not None:
            prefix += f"rank {rank}: "
        super().__init__(prefix + message)


class VcgaTimeoutError(VcgaError, TimeoutError, RuntimeError):
    """A collective did not complete within the configured timeout.

    Also a ``RuntimeError``: torch.distributed's own backends raise ``RuntimeError`` subclasses
    (``DistBackendError``) on timeouts, and code written against them keeps catching ours; once
    torch.distributed is loaded, a ``torch.distributed.DistBackendError`` itself (:func:`adopt_torch_bases`).
    """

    def __init__(
        self,
        collective: str,
        timeout_s: float,
        *,
        rank: int | None = None,
        seq: int | None = None,
        missing_ranks: Sequence[int] = (),
        detail: str = "",
    ) -> None:
        self.collective, self.timeout_s, self.rank, self.seq = collective, timeout_s, rank, seq
        self.missing_ranks = tuple(missing_ranks)
        msg = f"{collective}"
        if seq is not None:
            msg += f" (#{seq})"
        msg += f" did not complete within {timeout_s:g} s"
        if rank is not None:
            msg = f"rank {rank}: " + msg
        if self.missing_ranks:
            msg += f"; ranks that never joined: {list(self.missing_ranks)}"
        if detail:
            msg += f"; {detail}"
        msg += ". Check that every rank calls the same collectives in the same order, or raise collective_timeout_s."
        super().__init__(msg)


class VcgaPeerLostError(VcgaTimeoutError, VcgaCollectiveError):
    """A peer's process or connection went away during a collective: it can never complete.

    Both a :class:`VcgaTimeoutError` and a :class:`VcgaCollectiveError`. A training loop meets a
    lost peer in two ways, depending on how it was lost: a process that stops (a frozen node, a
    partitioned network) makes the others time out; a process that dies (killed, out of memory)
    closes its connections, and the library reports that at once, long before any timeout. For the
    loop both mean the same -- a rank is missing and the group is unusable -- so
    ``except VcgaTimeoutError`` handles both, as NCCL's users expect from its watchdog, and code that
    catches collective failures keeps catching this one.

    :param collective: the collective that failed; :param detail: what the library said.
    """

    def __init__(self, collective: str, timeout_s: float, *, rank: int | None = None, seq: int | None = None,
                 backend: str | None = None, detail: str = "") -> None:
        self.collective, self.timeout_s, self.rank, self.seq, self.backend = collective, timeout_s, rank, seq, backend
        self.missing_ranks = ()
        msg = f"{collective}" + (f" (#{seq})" if seq is not None else "")
        msg += " cannot complete: a peer's process or connection is gone"
        if detail:
            msg += f" ({detail})"
        msg += (". Check the other ranks' logs for why it ended; the group cannot be used any more: "
                "restart the job from its last checkpoint (or let vcga.elastic do it)")
        prefix = (f"[{backend}] " if backend is not None else "") + (f"rank {rank}: " if rank is not None else "")
        VcgaError.__init__(self, prefix + msg)


class VcgaMismatchError(VcgaError, RuntimeError):
    """Ranks called different collectives (debug mode compares fingerprints before each call).

    :param differences: field -> {rank: value} for every field that differs.
    """

    def __init__(self, seq: int, differences: Mapping[str, Mapping[int, Any]], *, rank: int | None = None) -> None:
        self.seq, self.rank = seq, rank
        self.differences = {k: dict(v) for k, v in differences.items()}
        parts = []
        for field, by_rank in self.differences.items():
            vals = ", ".join(f"rank {r}: {v}" for r, v in sorted(by_rank.items()))
            parts.append(f"{field} differs ({vals})")
        who = f"rank {rank}: " if rank is not None else ""
        super().__init__(
            f"{who}collective #{seq} mismatch across ranks: " + "; ".join(parts)
            + ". Every rank must call the same collective with the same dtype, shape and op."
        )


class VcgaFormatError(VcgaError, ValueError):
    """A checkpoint file is malformed, truncated or not of the expected format.

    :param path: the file.
    :param message: what is wrong.
    :param offset: the byte offset where the problem was found, when known.
    :param expected: what was expected there, when it helps.
    """

    def __init__(self, path: Any, message: str, *, offset: int | None = None, expected: str | None = None) -> None:
        self.path, self.offset, self.expected = str(path), offset, expected
        msg = f"{self.path}"
        if offset is not None:
            msg += f" @ byte {offset}"
        msg += f": {message}"
        if expected:
            msg += f" (expected {expected})"
        super().__init__(msg)


class VcgaChecksumError(VcgaFormatError):
    """Stored and computed checksums differ: the data was damaged after it was written."""


class VcgaCheckpointError(VcgaError, RuntimeError):
    """A distributed checkpoint could not be saved or loaded (:mod:`vcga.checkpoint`).

    :param step: the checkpoint's step, when known.
    :param failures: rank -> what went wrong there (the first line of each rank's error).
    """

    def __init__(self, message: str, *, step: int | None = None, failures: Mapping[int, str] | None = None) -> None:
        self.step = step
        self.failures = dict(failures or {})
        super().__init__(message)


class VcgaConversionError(VcgaError, ValueError):
    """A conversion cannot be done losslessly (e.g. the target format lacks a dtype).

    :param tensor: the tensor's name; :param dtype: its dtype; :param target: the target format.
    """

    def __init__(self, message: str, *, tensor: str | None = None, dtype: str | None = None,
                 target: str | None = None) -> None:
        self.tensor, self.dtype, self.target = tensor, dtype, target
        super().__init__(message)


class VcgaDiskFullError(VcgaError, OSError):
    """The destination's filesystem ran out of space while writing; the partial output was removed.

    Also an ``OSError`` with ``errno.ENOSPC`` (or ``EDQUOT`` for a quota), so code that handles a
    full disk keeps working.

    :param destination: what was being written; :param needed: bytes the output needs in all, at
        least (its tensor data); :param free: bytes free for this user on that filesystem, after the
        partial output was removed; :param mount: the filesystem's mount point. Raised only once
        the partial output is gone. :attr:`missing` is ``needed - free`` (0 when the data alone fits).
    """

    def __init__(self, destination: Any, needed: int, free: int, mount: str = "", *, quota: bool = False) -> None:
        import errno

        self.destination, self.needed, self.free, self.mount = str(destination), int(needed), int(free), mount
        self.quota = quota
        self.missing = max(self.needed - self.free, 0)
        where = f" on {mount}" if mount else ""
        what = "disk quota exceeded" if quota else "no space left on device"
        if self.missing:
            short = (f"it needs at least {_human(self.needed)}, {_human(self.free)} are free{where}; "
                     f"free at least {_human(self.missing)} more")
        else:
            short = (f"it needs more than the {_human(self.free)} free{where} ({_human(self.needed)} of tensor data "
                     "plus the format's own bytes, or something else used the space meanwhile); free more space")
        msg = f"{what} writing {self.destination}: {short} or write elsewhere. Nothing was left behind."
        super().__init__(errno.EDQUOT if quota else errno.ENOSPC, msg, self.destination)

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt through __init__: OSError keeps errno and strerror outside __dict__
        return (_rebuild_disk_full, (type(self), self.destination, self.needed, self.free, self.mount, self.quota))


def _rebuild_disk_full(cls: type[VcgaDiskFullError], destination: str, needed: int, free: int, mount: str,
                       quota: bool) -> VcgaDiskFullError:
    return cls(destination, needed, free, mount, quota=quota)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit} ({n} bytes)"
        value /= 1024
    return f"{n} B"
