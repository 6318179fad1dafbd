"""Hugging Face Accelerate on backend ``vcga``.

What Accelerate does with a backend (accelerate 1.x, ``PartialState``):

- on an accelerator (CUDA, NPU, MLU) with ``InitProcessGroupKwargs(backend="vcga")`` it calls
  ``init_process_group("vcga")``: nothing else is needed;
- on CPU it forces gloo: given ``backend="vcga"`` it raises ``ValueError: Your assigned backend
  vcga is not available, please use gloo``; given nothing, it creates a gloo group -- unless a
  default group already exists, which it then uses while still reporting ``backend == "gloo"``.

:func:`accelerator` takes the supported way that works everywhere: it creates the ``vcga``
default group first (from the launcher's environment, as :func:`vcga.init` does), then the
``Accelerator``, and sets the state's ``backend`` to the group's real backend, so
``accelerator.state.backend`` and ``PartialState().backend`` say ``"vcga"``.

Gradient compression: Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only
torch's four hooks (fp16, bf16, PowerSGD, batched PowerSGD), by enum. ``accelerator(compression=
"powersgd:rank=4")`` (or the configured ``compression`` / ``VCGA_COMPRESSION``) registers
:func:`vcga.compress.ddp_hook` on every model ``prepare()`` wraps in DDP instead, keeping the
user's other DDP settings; :func:`compression_states` gives the hooks' states.
"""

from __future__ import annotations

from typing import Any

from vcga.errors import VcgaConfigError

__all__ = ["accelerator", "compression_states"]


def accelerator(*args: Any, compression: str | None = None, **kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` whose processes talk through a ``vcga`` group.

    Arguments are the ``Accelerator``'s. Run it under ``accelerate launch`` or ``torchrun`` (their
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); VCGA picks each rank's backend
    (``VCGA_BACKEND``, ``VCGA_SIM_VENDORS``, or the best available).

    :param compression: a compression spec (docs/compression.md) for every model ``prepare()``
        wraps in DDP; None: the configured ``compression`` / ``VCGA_COMPRESSION`` (nothing when
        unset, or when a ``DistributedDataParallelKwargs`` handler already names a ``comm_hook``).
    :raises vcga.errors.VcgaError: the group cannot be created (typed, with what to do).
    :raises vcga.errors.VcgaConfigError: a bad spec, or ``compression`` given together with a
        ``DistributedDataParallelKwargs(comm_hook=...)`` (DDP takes one hook).
    """
    import os

    import accelerate
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    import vcga

    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        vcga.init()  # the default group, backend "vcga", from the launcher's environment
    handler = _compression_handler(kwargs.get("kwargs_handlers"), compression)
    acc = accelerate.Accelerator(*args, **kwargs)
    if dist.is_initialized():
        real = dist.get_backend()
        # Accelerate keeps its state in shared dicts; on CPU it wrote "gloo" there without creating gloo
        PartialState._shared_state["backend"] = real
        AcceleratorState._shared_state["backend"] = real
    if handler is not None:  # Accelerate maps handlers by exact class: put ours in place afterwards
        acc.ddp_handler = handler
    return acc


def compression_states(acc: Any) -> list[Any]:
    """The :class:`~vcga.compress.hook.CompressionState` of every model ``acc.prepare()`` wrapped
    in DDP with compression, in the order they were prepared (empty without compression)."""
    return list(getattr(acc.ddp_handler, "vcga_states", ()))


def _compression_handler(handlers: Any, compression: str | None) -> Any:
    """A DDP kwargs handler whose ``register_comm_hook`` (which ``prepare()`` calls on each model it
    wraps in DDP, on every device) registers vcga's hook; it keeps the settings of the user's
    ``DistributedDataParallelKwargs`` among ``handlers``. None: no compression. Checked before the
    ``Accelerator`` exists, so a refused spec leaves nothing behind."""
    import dataclasses

    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from vcga.compress import configured_spec, parse_spec

    theirs = next((h for h in handlers or () if isinstance(h, DistributedDataParallelKwargs)), None)
    their_hook = theirs is not None and theirs.comm_hook != DDPCommunicationHookType.NO
    if compression is not None:
        if their_hook:
            raise VcgaConfigError("compression", compression, "no DistributedDataParallelKwargs(comm_hook=...) "
                                  "beside it: DDP takes one communication hook; drop comm_hook, or compression "
                                  "to use torch's")
        spec = parse_spec(compression)
    elif their_hook:  # the configured compression gives way to the hook the user named
        return None
    else:
        spec = configured_spec()
    if not spec.enabled:
        return None
    states: list[Any] = []

    # Accelerate's handler is a dataclass whose to_kwargs() deep-copies the instance's __dict__ and
    # builds a default instance to compare with: the spec and the states live on the class.
    class CompressedDDPKwargs(DistributedDataParallelKwargs):
        vcga_spec = spec
        vcga_states = states

        def register_comm_hook(self, model: Any) -> None:
            from vcga.compress import ddp_hook

            state, hook = ddp_hook(self.vcga_spec)
            model.register_comm_hook(state, hook)
            self.vcga_states.append(state)

    fields = {f.name: getattr(theirs, f.name) for f in dataclasses.fields(theirs)} if theirs is not None else {}
    return CompressedDDPKwargs(**fields)
