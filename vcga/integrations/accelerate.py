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
"""

from __future__ import annotations

from typing import Any

__all__ = ["accelerator"]


def accelerator(*args: Any, **kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` whose processes talk through a ``vcga`` group.

    Arguments are the ``Accelerator``'s. Run it under ``accelerate launch`` or ``torchrun`` (their
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); VCGA picks each rank's backend
    (``VCGA_BACKEND``, ``VCGA_SIM_VENDORS``, or the best available).

    :raises vcga.errors.VcgaError: the group cannot be created (typed, with what to do).
    """
    import os

    import accelerate
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    import vcga

    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        vcga.init()  # the default group, backend "vcga", from the launcher's environment
    acc = accelerate.Accelerator(*args, **kwargs)
    if dist.is_initialized():
        real = dist.get_backend()
        # Accelerate keeps its state in shared dicts; on CPU it wrote "gloo" there without creating gloo
        PartialState._shared_state["backend"] = real
        AcceleratorState._shared_state["backend"] = real
    return acc
