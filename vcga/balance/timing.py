"""A rank's compute time, without the time it waits for its peers (:meth:`Balancer.measure`).

Under DDP a rank's backward ends in a wait: the reducer's final callback blocks until every
bucket's all_reduce is done, and that is done only when the slowest rank has produced its
gradients. Timing the whole ``forward + backward`` would give every rank the slowest one's time.
What separates the two: the rank's own work ends when autograd accumulates its last gradient.
Every parameter gets a post-accumulate-grad hook that stamps the time; the compute time is from
entering the context to the last stamp. DDP's bucket all_reduces are launched asynchronously
(gloo's and the vcga bridge's worker threads, NCCL's streams) and its wait runs in the engine's
final callbacks, after every gradient hook -- so the wait falls after the last stamp. When no
hook fired inside the context (no module given, or FSDP2, whose sharded parameters receive their
gradients by assignment after the reduce-scatter), the whole context is timed.

On an accelerator the stamps are device events recorded on the current stream (the hooks run when
the kernels are queued, not when they finish); their elapsed times are read when the balancer
collects the figures, by then long complete, so timing never makes the training wait.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ComputeClock"]


class ComputeClock:
    """Seconds and samples measured since the last :meth:`take`."""

    def __init__(self) -> None:
        self._hooked: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        self._active = False
        self._device: torch.device | None = None
        self._last: float | None = None  # host stamp of the last gradient (CPU)
        self._end: Any = None  # device event re-recorded at every gradient (accelerator)
        self._fired = False
        self._pending: list[tuple[Any, Any, int]] = []  # device (start, end, samples), read at take()
        self.seconds = 0.0
        self.samples = 0
        self.device: torch.device | None = None  #: the measured module's device (None: none measured)

    def _hook(self, module: torch.nn.Module) -> None:
        if module in self._hooked:
            return
        me = weakref.ref(self)

        def stamp(_p: torch.Tensor) -> None:
            clock = me()
            if clock is not None and clock._active:
                clock._stamp()

        self._hooked[module] = [p.register_post_accumulate_grad_hook(stamp)
                                for p in module.parameters() if p.requires_grad]

    def _stamp(self) -> None:
        self._fired = True
        if self._end is not None:
            self._end.record()
        else:
            self._last = time.perf_counter()

    @contextmanager
    def measure(self, module: torch.nn.Module | None, samples: int) -> Iterator[None]:
        device = None
        if module is not None:
            self._hook(module)
            device = next((p.device for p in module.parameters()), None)
            if device is not None and device.type != "meta":
                self.device = device
        on_device = device is not None and device.type not in ("cpu", "meta")
        self._fired, self._last = False, None
        start = None
        if on_device:
            start = torch.Event(device=device, enable_timing=True)
            self._end = torch.Event(device=device, enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        self._active = True
        try:
            yield
        finally:
            self._active = False
            if on_device:
                if not self._fired:
                    self._end.record()
                self._pending.append((start, self._end, samples))
                self._end = None
            else:
                end = self._last if self._fired and self._last is not None else time.perf_counter()
                self.seconds += end - t0
                self.samples += samples

    def take(self) -> tuple[float, int]:
        """The figures since the last call (device timings read now), and start afresh."""
        for start, end, n in self._pending:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3
            self.samples += n
        out = (self.seconds, self.samples)
        self._pending, self.seconds, self.samples = [], 0.0, 0
        return out
