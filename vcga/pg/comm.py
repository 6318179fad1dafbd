"""``vcga.init()`` and the :class:`Communicator`: VCGA for code that does not call torch.distributed.

::

    import vcga, torch

    comm = vcga.init()                      # torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    x = torch.ones(4, device=comm.device)
    comm.all_reduce(x)                      # SUM over every rank
    parts = comm.all_gather(x)              # one tensor per rank
    comm.barrier()
    comm.close()

:func:`init` picks this rank's backend through the plugin manager (the config's ``backend``, a
simulated vendor layout, or the best available), sets this rank's device
(``LOCAL_RANK`` modulo the devices the backend sees), and creates the default
``torch.distributed`` group with backend ``vcga`` -- so a script may mix both APIs freely.
The communicator's methods are thin: each is one ``torch.distributed`` call on its group, with
the same semantics and the same typed errors.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vcga.config import Config, load_config
from vcga.errors import VcgaConfigError
from vcga.spawn import free_port

if TYPE_CHECKING:
    import torch

__all__ = ["init", "Communicator", "all_gather_single", "reduce_scatter_single"]

_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


@functools.cache
def _current(name: str, old: str) -> Any:
    """torch.distributed's function ``name``, else (older torch) ``old``; looked up once."""
    import torch.distributed as dist

    return getattr(dist, name, None) or getattr(dist, old)


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``torch.distributed``'s one-tensor all-gather under its current name.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and deprecated the old
    name: calling it prints a FutureWarning from inside vcga into the user's log. Older torch has
    only the old name."""
    return _current("all_gather_single", "all_gather_into_tensor")(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor, op: Any = None, group: Any = None,
                          async_op: bool = False) -> Any:
    """``torch.distributed``'s one-tensor reduce-scatter under its current name (torch 2.13:
    ``reduce_scatter_single``, formerly ``reduce_scatter_tensor``; see :func:`all_gather_single`)."""
    import torch.distributed as dist

    return _current("reduce_scatter_single", "reduce_scatter_tensor")(
        output, tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


def _env_int(env: dict[str, str] | os._Environ[str], key: str, default: int | None) -> int | None:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise VcgaConfigError(key, raw, "an integer >= 0 (as torchrun sets it)", f"env {key}") from None
    if value < 0:
        raise VcgaConfigError(key, raw, "an integer >= 0 (as torchrun sets it)", f"env {key}")
    return value


def init(backend: str | None = None, *, rank: int | None = None, world_size: int | None = None,
         local_rank: int | None = None, init_method: str | None = None, timeout_s: float | None = None,
         config: Config | None = None) -> Communicator:
    """Set up this process for VCGA and return its :class:`Communicator`.

    Every argument defaults to torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``); without it, a single-process world on a free local port.

    :param backend: a backend name (``gloo``, ``nccl``, ``sim-hccl``, ...) overriding the config.
    :param init_method: a torch init method (``tcp://host:port``, ``file://...``, ``env://``).
    :param timeout_s: the collective timeout, overriding the config's ``collective_timeout_s``.
    :param config: the unified config (default: :func:`vcga.config.load_config`).
    :raises vcga.errors.VcgaConfigError: a malformed environment variable or config value.
    :raises vcga.errors.VcgaBackendUnavailable: the chosen backend cannot run here.
    """
    import torch.distributed as dist

    from vcga.plugin_manager import get_plugin_manager
    from vcga.process_group import BACKEND_NAME, VcgaOptions

    env = os.environ
    cfg = config or load_config()
    if backend:
        cfg = replace(cfg, backend=backend)
    if timeout_s is not None:
        cfg = replace(cfg, collective_timeout_s=float(timeout_s))
    rank = rank if rank is not None else _env_int(env, "RANK", 0)
    world_size = world_size if world_size is not None else _env_int(env, "WORLD_SIZE", 1)
    local_rank = local_rank if local_rank is not None else _env_int(env, "LOCAL_RANK", rank)
    assert rank is not None and world_size is not None and local_rank is not None
    if not 0 <= rank < world_size:
        raise VcgaConfigError("RANK", rank, f"an integer in [0, WORLD_SIZE={world_size})", "env RANK")

    chosen = get_plugin_manager().select_backend(cfg, rank=rank, world_size=world_size)
    acc = chosen.accelerator()
    count = acc.device_count()
    index = local_rank % count if count else 0
    acc.set_device(index)
    device = acc.device(index)

    if not dist.is_initialized():
        if init_method is None:
            if "MASTER_ADDR" in env and "MASTER_PORT" in env:
                init_method = "env://"
            elif world_size == 1:
                init_method = f"tcp://127.0.0.1:{free_port()}"
            else:
                raise VcgaConfigError("MASTER_ADDR/MASTER_PORT", None,
                                      "set by torchrun, or pass init_method= to vcga.init()", "environment")
        dist.init_process_group(BACKEND_NAME, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg.collective_timeout_s), pg_options=VcgaOptions(cfg))
    return Communicator(dist.group.WORLD, device=device, backend=chosen.name)


class Communicator:
    """Collectives on one ``vcga`` group, without the torch.distributed call boilerplate.

    :param group: a process group created with backend ``vcga`` (default: the world group).
    :param device: the device this rank's tensors live on.
    :param backend: the VCGA backend name this rank runs.
    """

    def __init__(self, group: Any = None, *, device: torch.device | None = None, backend: str | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        # duck-typed: a vcga group (VcgaProcessGroup, or a plugin's stand-in) with its own methods
        self.group: Any = group if group is not None else dist.group.WORLD
        self.device = device if device is not None else torch.device("cpu")
        transport = getattr(self.group, "transport", None)
        self.backend = backend or (transport.backend_name if transport is not None else dist.get_backend(self.group))

    @property
    def rank(self) -> int:
        return self._dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return self._dist.get_world_size(self.group)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device})")

    def _op(self, op: Any) -> Any:
        if isinstance(op, str):
            if op.lower() not in _OPS:
                raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(_OPS)} "
                                 "or a torch.distributed.ReduceOp")
            return getattr(self._dist.ReduceOp, op.upper())
        return op

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False) -> Any:
        """Reduce ``tensor`` across ranks in place (``op``: "sum", "avg", ... or a ``ReduceOp``)."""
        return self._dist.all_reduce(tensor, op=self._op(op), group=self.group, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: Any = "sum", async_op: bool = False) -> Any:
        return self._dist.reduce(tensor, dst, op=self._op(op), group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
        return self._dist.broadcast(tensor, src, group=self.group, async_op=async_op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order (same shape on every rank)."""
        import torch

        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(out, tensor, group=self.group)
        return out

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Any:
        return all_gather_single(output, tensor, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: Any = "sum",
                       async_op: bool = False) -> Any:
        """Reduce ``tensor`` (world_size chunks along dim 0) and keep this rank's chunk in ``output``."""
        return reduce_scatter_single(output, tensor, op=self._op(op), group=self.group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None, async_op: bool = False) -> Any:
        return self._dist.all_to_all_single(output, tensor, output_splits, input_splits, group=self.group,
                                            async_op=async_op)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._dist.send(tensor, dst, group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor``; returns the sender's rank."""
        return self._dist.recv(tensor, src, group=self.group, tag=tag)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def monitored_barrier(self, timeout_s: float | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive (rank 0 raises, others follow).

        ``torch.distributed.monitored_barrier`` accepts only gloo groups by name; this calls the
        ``vcga`` group's implementation directly.
        """
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        self.group.monitored_barrier(timeout, wait_all_ranks)

    def close(self) -> None:
        """Destroy the default group if this communicator owns it."""
        if self._dist.is_initialized() and self.group is self._dist.group.WORLD:
            self._dist.destroy_process_group()
