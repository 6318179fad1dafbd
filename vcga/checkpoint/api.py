"""save / async_save / load_latest: the public verbs of :mod:`vcga.checkpoint` (docs/checkpoint.md)."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from vcga.errors import VcgaCheckpointError, VcgaError
from vcga.testing import fault

from .shard_writer import ShardWriterProcess
from .staging import _Stager, changed, snapshot, versions
from .storage import (
    SafeLoadPlanner,
    VcgaStorageReader,
    VcgaStorageWriter,
    complete_steps,
    read_latest,
    step_dir,
)

__all__ = ["save", "async_save", "load_latest", "wait", "wait_staged", "latest_step", "SaveFuture"]

log = logging.getLogger("vcga.checkpoint")

_BACKGROUND_NICE = 10


# --------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------


def _describe(e: BaseException) -> tuple[str, dict[int, str]]:
    """One line per failing rank, from DCP's CheckpointException (it gathers every rank's error)."""
    if isinstance(e, CheckpointException):
        failures = {}
        for rank, wrapped in sorted(e.failures.items()):
            exc = getattr(wrapped, "exception", wrapped)
            if isinstance(exc, tuple) and exc:  # (exception, stack summary) in some torch versions
                exc = exc[0]
            failures[rank] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        first = next(iter(failures.items()), None)
        text = f"rank {first[0]}: {first[1]}" if first else str(e)
        if len(failures) > 1:
            text += f" (and {len(failures) - 1} more rank(s))"
        return text, failures
    return f"{type(e).__name__}: {e}".splitlines()[0], {}


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------


def _group_and_dist(process_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
    if dist.is_available() and dist.is_initialized():
        return process_group, False
    return None, True


@contextlib.contextmanager
def _quiet(no_dist: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what was asked."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _to_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Stateful values (a model, an optimizer wrapper) become their state dicts, as DCP does."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def _save_now(state_dict: Mapping[str, Any], root: Path, step: int, keep_last: int | None,
              group: dist.ProcessGroup | None, no_dist: bool, planner: Any, **writer_hooks: Any) -> Path:
    writer = VcgaStorageWriter(root, step, keep_last=keep_last,
                               on_rank_written=lambda: fault.point("save", step), **writer_hooks)
    try:
        with _quiet(no_dist):
            dcp.save(dict(state_dict), storage_writer=writer, planner=planner, process_group=group, no_dist=no_dist)
    except BaseException as e:
        writer.abort()  # rank 0 removes this save's directory; nothing was published
        if isinstance(e, CheckpointException):
            text, failures = _describe(e)
            raise VcgaCheckpointError(f"saving checkpoint step {step} under {root} failed: {text}. The previous "
                                      "checkpoint stays the latest", step=step, failures=failures) from None
        raise
    return root / step_dir(step)


def save(state_dict: Mapping[str, Any], root: str | os.PathLike[str], *, step: int, keep_last: int | None = 2,
         process_group: dist.ProcessGroup | None = None, planner: Any = None) -> Path:
    """Save ``state_dict`` as checkpoint ``root/step-<step>`` -- collective: every rank calls it.

    Each rank writes its chunks (DCP's plan: replicated tensors once, shards by their owner) into a
    checksummed vendor-bin file; the checkpoint is published by writing ``root/latest`` only once
    every rank's file is durable. Then all but the newest ``keep_last`` checkpoints are removed.
    A previous :func:`async_save` still running is waited for first; if it failed and nobody
    looked at its future, its error is raised here.

    :returns: the checkpoint directory.
    :raises VcgaCheckpointError: on every rank when any rank failed (disk full, ...); the previous
        checkpoint stays the latest and nothing of this one remains.
    """
    _ASYNC.drain()
    group, no_dist = _group_and_dist(process_group)
    return _save_now(_to_state_dict(state_dict), Path(root), _check_step(step), keep_last, group, no_dist, planner)


def _check_step(step: Any) -> int:
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


# --------------------------------------------------------------------------------------------------
# async_save
# --------------------------------------------------------------------------------------------------


class SaveFuture:
    """The outcome of one :func:`async_save`: :meth:`result` waits and returns the checkpoint
    directory, or raises the save's :class:`~vcga.errors.VcgaCheckpointError`."""

    def __init__(self, step: int, fut: concurrent.futures.Future[Path]) -> None:
        self.step = step
        self._fut = fut
        self.observed = False

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> Path:
        try:
            return self._fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"async save of step {self.step} still running after {timeout} s") from None
        except BaseException:
            self.observed = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = self._fut.exception(timeout)
        if exc is not None:
            self.observed = True
        return exc


_STAGING = ("background", "blocking")
_WRITERS = ("process", "thread")


class _AsyncSaver:
    """At most one save in flight per process; its failure is kept until someone sees it."""

    def __init__(self) -> None:
        self.pending: SaveFuture | None = None
        self.thread: threading.Thread | None = None
        self.staged = threading.Event()
        self.staged.set()
        self.groups: dict[Any, dist.ProcessGroup] = {}
        # One stager per writer kind (plain buffers, or the writer process's shared arena), so a
        # job that uses both keeps both warm instead of reallocating at every switch.
        self.stagers = {False: _Stager(), True: _Stager()}
        self.writer: ShardWriterProcess | None = None
        self.hooked = False

    def wait_staged(self) -> None:
        # No timeout needed: the stager's thread sets the event whatever happens (finally), and
        # a copy to host memory does not wait on any peer.
        self.staged.wait()

    def drain(self) -> None:
        """Wait for the save in flight; raise its failure unless its future already showed it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        exc = pending._fut.exception()  # waits
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if exc is not None and not pending.observed:
            pending.observed = True
            if isinstance(exc, VcgaError):
                raise VcgaCheckpointError(f"the previous async save (step {pending.step}) failed: {exc}",
                                          step=pending.step,
                                          failures=getattr(exc, "failures", None)) from exc
            raise VcgaCheckpointError(f"the previous async save (step {pending.step}) failed: "
                                      f"{type(exc).__name__}: {exc}", step=pending.step) from exc

    def group_for(self, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        """A gloo group over the same ranks, for the background thread's collectives: they must
        never interleave with the training's collectives on the training's group, and gloo moves
        the host-staged data of every vendor alike. Created on first use (collective, called by
        every rank at the same async_save)."""
        key = process_group if process_group is not None else "WORLD"
        grp = self.groups.get(key)
        if grp is None:
            from datetime import timedelta

            from vcga.config import load_config

            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            # VCGA's collective timeout, not torch's default of 30 minutes: a peer that dies
            # mid-save must fail the save (and let this process exit) as soon as a collective would.
            timeout = timedelta(seconds=load_config().collective_timeout_s)
            grp = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self.groups[key] = grp
        return grp

    def _writer_process(self) -> ShardWriterProcess:
        """The writer child, (re)started when missing or dead, told about the current arena."""
        if self.writer is not None and not self.writer.alive():
            self.writer.close()
            self.writer = None
        if self.writer is None:
            self.writer = ShardWriterProcess()
        stager = self.stagers[True]
        arena = stager.arena
        for old in stager.retired:
            self.writer.drop_arena(old.id)
            old.close()
        stager.retired.clear()
        if arena is not None and arena.id not in self.writer.arenas:
            self.writer.send_arena(arena.id, arena.fd, arena.size)
        return self.writer

    def _shard_writer(self) -> Any:
        """The VcgaStorageWriter hook that hands this rank's shard to the writer process: every
        tensor lying in the arena goes as (offset, length); anything else (DCP's pickled values, a
        tensor the planner made) as bytes."""
        proc = self._writer_process()
        arena = self.stagers[True].arena

        def write(path: Path, metadata: dict[str, str], entries: list[Any]) -> dict[str, tuple[str, int]]:
            import numpy as np

            items = []
            for e in entries:
                where = None
                if arena is not None and e.nbytes:
                    addr = np.frombuffer(e.data, dtype=np.uint8).ctypes.data
                    offset = addr - arena.base
                    if offset >= 0 and offset + e.nbytes <= arena.size:
                        where = ("arena", arena.id, offset, e.nbytes)
                items.append((e.name, e.dtype, e.shape, dict(e.metadata), where or ("bytes", bytes(e.data))))
            return proc.write(path, metadata, items)

        return write

    def start(self, state: dict[str, Any], root: Path, step: int, keep_last: int | None,
              group: dist.ProcessGroup | None, no_dist: bool, planner: Any, *, staging: str,
              writer: str) -> SaveFuture:
        fut: concurrent.futures.Future[Path] = concurrent.futures.Future()
        shared = writer == "process"
        staged: dict[str, Any] | None = None
        recorded: list[Any] = []
        after = None
        if staging == "blocking":
            staged = self.stagers[shared].stage(state, shared=shared)
        else:
            recorded = versions(state)
            after = _training_stream_event(state)
            self.staged.clear()
            self._hook_optimizers()

        def run() -> None:
            try:
                copy = staged
                stale: list[str] = []
                if copy is None:
                    # At the training's priority: its next optimizer step waits for this copy.
                    # A failure here is this rank's alone: it must fail the save inside DCP, on
                    # every rank (before_write), not leave the others waiting in its collectives.
                    try:
                        copy = self.stagers[shared].stage(state, shared=shared, after=after)
                    except Exception as e:  # noqa: BLE001 - reported through before_write
                        stale.append(f"copying the state to host memory failed: {type(e).__name__}: {e}")
                        copy = state  # DCP still plans (metadata only); nothing is written
                    finally:
                        self.staged.set()
                    i = changed(recorded)
                    if i is not None and not stale:
                        stale.append(f"a tensor of the state ({_describe_tensor(recorded[i][0])}) was changed in "
                                     "place while async_save was copying it, so the copy may mix two steps. "
                                     "optimizer.step() waits for the copy by itself; call "
                                     "vcga.checkpoint.wait_staged() before any other in-place change (a "
                                     "BatchNorm forward, an EMA update), or pass staging='blocking'")

                def refuse_stale() -> None:
                    if stale:
                        raise VcgaCheckpointError(stale[0], step=step)

                # Then below the training threads in the CPU scheduler's eyes (Linux threads are
                # tasks: this renices only this one; the writer process renices itself): where
                # cores are short, training keeps them. Never back up: that needs privilege.
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICE)
                except (OSError, AttributeError):
                    pass
                hooks: dict[str, Any] = {"before_write": refuse_stale}
                if shared:
                    try:
                        hooks["shard_writer"] = self._shard_writer()
                    except Exception as e:  # noqa: BLE001 - reported through before_write, as above
                        stale.append(f"starting the checkpoint writer process failed: {type(e).__name__}: {e}")
                fut.set_result(_save_now(copy, root, step, keep_last, group, no_dist, planner, **hooks))
            except BaseException as e:  # noqa: BLE001 - it belongs to the future
                log.error("async save of step %d failed: %s", step, e)
                fut.set_exception(e)

        # Not a daemon: an interpreter exiting normally waits for the checkpoint being written.
        self.thread = threading.Thread(target=run, name=f"vcga-checkpoint-{step}", daemon=False)
        self.pending = SaveFuture(step, fut)
        self.thread.start()
        return self.pending

    def _hook_optimizers(self) -> None:
        """Every optimizer's step() waits for the staging copy in flight: it is what changes the
        state in a training loop, and forward and backward (which do not) overlap the copy."""
        if not self.hooked:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(lambda opt, args, kwargs: self.wait_staged())
            self.hooked = True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def _training_stream_event(state: dict[str, Any]) -> Any:
    """On an accelerator: an event on the training's current stream, for the staging stream to
    wait on (the copies must see every kernel queued before async_save). None on the host."""
    from .staging import _device_type

    dev = _device_type(state)
    if dev is None:
        return None
    ev = torch.Event(device=dev)
    ev.record(torch.accelerator.current_stream())
    return ev


_ASYNC = _AsyncSaver()


def async_save(state_dict: Mapping[str, Any], root: str | os.PathLike[str], *, step: int,
               keep_last: int | None = 2, process_group: dist.ProcessGroup | None = None,
               planner: Any = None, staging: str = "background", writer: str = "process") -> SaveFuture:
    """Like :func:`save`, but returns at once; the state is copied to host memory and written in
    the background while training goes on. Collective (every rank calls it).

    ``staging="background"`` (default): the copy runs in a background thread too. Until it is done
    the state must not change: every ``optimizer.step()`` waits for it by itself (a global
    optimizer step pre-hook), forward and backward overlap it. Any other in-place change of the
    state must call :func:`wait_staged` first; one seen while the copy ran fails the save
    (``VcgaCheckpointError``; nothing is published). ``staging="blocking"``: the call returns once
    the copy is done.

    ``writer="process"`` (default): the shard is hashed, written and fsynced by a helper process
    (started at the first call, reading the staged tensors from shared memory), so the writing
    never holds this process's GIL; ``"thread"``: by the background thread itself.

    At most one save is in flight: a second call first waits for the first (and raises its error
    if it failed and its future was never asked). Call :func:`wait` before destroying the process
    group.

    :returns: a :class:`SaveFuture`; ``result()`` gives the checkpoint directory or raises.
    """
    if staging not in _STAGING:
        raise ValueError(f"staging must be one of {', '.join(_STAGING)}, got {staging!r}")
    if writer not in _WRITERS:
        raise ValueError(f"writer must be one of {', '.join(_WRITERS)}, got {writer!r}")
    _ASYNC.drain()
    step = _check_step(step)
    group, no_dist = _group_and_dist(process_group)
    bg_group = None if no_dist else _ASYNC.group_for(group)
    state = snapshot(_to_state_dict(state_dict))
    return _ASYNC.start(state, Path(root), step, keep_last, bg_group, no_dist, planner, staging=staging,
                        writer=writer)


def wait_staged() -> None:
    """Wait until the async save in flight has copied the state (at once when none is copying).
    After it, the state may change: the save holds its own copy."""
    _ASYNC.wait_staged()


def wait() -> Path | None:
    """Wait for the async save in flight, if any; return its directory or raise its error."""
    pending = _ASYNC.pending
    _ASYNC.drain()
    return pending._fut.result() if pending is not None else None


def _wait_at_exit() -> None:
    pending = _ASYNC.pending
    try:
        _ASYNC.drain()  # raises only a failure nobody has seen
        if pending is not None and not pending.observed:
            pending._fut.result()
    except Exception as e:  # noqa: BLE001 - nobody is left to raise to; say it
        log.error("the last async checkpoint save failed: %s", e)
    _ASYNC.close()


atexit.register(_wait_at_exit)


# --------------------------------------------------------------------------------------------------
# load_latest
# --------------------------------------------------------------------------------------------------


def latest_step(root: str | os.PathLike[str]) -> int | None:
    """The step ``root/latest`` names (None when nothing was published). Local; not collective."""
    return read_latest(Path(root))


def _candidates(root: Path) -> list[int]:
    """The published checkpoint, then every older complete one, newest first."""
    try:
        latest = read_latest(root)
    except VcgaError as e:
        log.warning("%s; trying every complete checkpoint under %s, newest first", e, root)
        return complete_steps(root)
    if latest is None:
        return []
    return [latest] + [s for s in complete_steps(root) if s < latest]


def load_latest(state_dict: dict[str, Any], root: str | os.PathLike[str], *,
                process_group: dist.ProcessGroup | None = None, planner: Any = None) -> int | None:
    """Load the newest complete checkpoint under ``root`` into ``state_dict``, in place -- collective.

    Every file read is verified (each tensor's checksum, every padding byte, the metadata and
    manifest checksums). A damaged checkpoint is skipped for the previous one with a warning
    naming the file and the tensor. DCP's planner reshards: the checkpoint may come from another
    world size or vendor mix (DDP, FSDP2 and DTensor state dicts, optimizer state included).

    :returns: the step loaded, or None when ``root`` holds no published checkpoint.
    :raises VcgaCheckpointError: checkpoints exist but none could be loaded.
    """
    _ASYNC.drain()
    root = Path(root)
    group, no_dist = _group_and_dist(process_group)
    if no_dist:
        candidates = _candidates(root)
    else:
        # Rank 0 decides, so every rank tries the same checkpoints in the same order.
        box: list[Any] = [_candidates(root) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        candidates = box[0]
    tried: dict[int, str] = {}
    for step in candidates:
        reader = VcgaStorageReader(root / step_dir(step))
        try:
            with _quiet(no_dist):
                dcp.load(state_dict, storage_reader=reader, planner=planner or SafeLoadPlanner(),
                         process_group=group, no_dist=no_dist)
        except CheckpointException as e:  # every rank gets it, with every rank's error
            text, _ = _describe(e)
            tried[step] = text
        except VcgaError as e:  # single process: the reader's own error
            if not no_dist:
                raise
            tried[step] = f"{type(e).__name__}: {e}"
        else:
            return step
        log.warning("checkpoint %s is damaged or incomplete, skipped: %s", root / step_dir(step), tried[step])
    if tried:
        raise VcgaCheckpointError(f"no checkpoint under {root} could be loaded: "
                                  + "; ".join(f"step {s}: {t}" for s, t in tried.items()),
                                  failures={})
    return None
