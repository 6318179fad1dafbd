"""Deliberately broken backends for tests (loaded with ``VCGA_PLUGINS=broken_backends``).

Each is gloo underneath with exactly one defect, so a test can show that ``vcga verify`` catches
it with the check meant for it:

- ``broken-sum``: all_reduce adds 1 to every float16 result (a wrong sum in one dtype) ->
  ``exact-reduce`` fails on float16 only;
- ``broken-bf16``: its capability table (gloo's) claims bfloat16, but its library raises on any
  bfloat16 tensor -> ``dtype-matrix`` fails on bfloat16 only;
- ``broken-bits``: all_reduce of floating tensors reduces in a rank-dependent order (every rank's
  result is within the rounding bound, but the ranks hold different bits) -> ``cross-rank-identity``
  fails, while the exact checks pass;
- ``broken-hang``: broadcast never completes on a rank that is not the root -> the runner reports
  the hung rank and case, and the command ends;
- ``broken-create``: its native process group cannot be created.

Their native groups are Python ``torch.distributed.ProcessGroup`` subclasses delegating to a
``ProcessGroupGloo``, the way a vendor plugin written in Python would look.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from vcga.contract import Backend, hookimpl
from vcga.errors import VcgaBackendUnavailable

_GROUP_CLASS: Any = None


def _delegating_group_class() -> Any:
    """A ProcessGroup that forwards every collective to an inner gloo backend (built on first use,
    so importing this plugin does not import torch)."""
    global _GROUP_CLASS
    if _GROUP_CLASS is not None:
        return _GROUP_CLASS
    import torch.distributed as dist

    def _gather_opts() -> Any:
        return dist.distributed_c10d.AllgatherOptions()  # not re-exported by torch.distributed

    class Delegating(dist.ProcessGroup):
        def __init__(self, inner: Any, rank: int, size: int, name: str) -> None:
            super().__init__(rank, size)
            self.inner, self._name = inner, name

        def getBackendName(self) -> str:
            return self._name

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return self.inner.allreduce(tensors, opts if opts is not None else dist.AllreduceOptions())

        def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
            return self.inner.allreduce_coalesced(tensors, opts)

        def reduce(self, tensors: Any, opts: Any) -> Any:
            return self.inner.reduce(tensors, opts)

        def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self.inner.reduce_scatter(outputs, inputs, opts)

        def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
            return self.inner._reduce_scatter_base(output, input, opts if opts is not None
                                                   else dist.ReduceScatterOptions())

        def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
            return self._reduce_scatter_base(output, input, opts)

        def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return self.inner.allgather(outputs, inputs, opts if opts is not None else _gather_opts())

        def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
            return self.inner._allgather_base(output, input, opts if opts is not None else _gather_opts())

        def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
            return self._allgather_base(output, input, opts)

        def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return self.inner.allgather_coalesced(outputs, inputs, opts)

        def gather(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self.inner.gather(outputs, inputs, opts)

        def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self.inner.scatter(outputs, inputs, opts)

        def broadcast(self, tensors: Any, opts: Any) -> Any:
            return self.inner.broadcast(tensors, opts)

        def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return self.inner.alltoall(outputs, inputs, opts if opts is not None else dist.AllToAllOptions())

        def alltoall_base(self, output: Any, input: Any, out_splits: Any, in_splits: Any,  # noqa: A002
                          opts: Any = None) -> Any:
            return self.inner.alltoall_base(output, input, out_splits, in_splits,
                                            opts if opts is not None else dist.AllToAllOptions())

        def all_to_all_single(self, output: Any, input: Any, out_splits: Any, in_splits: Any,  # noqa: A002
                              opts: Any = None) -> Any:
            return self.alltoall_base(output, input, out_splits or [], in_splits or [], opts)

        def send(self, tensors: Any, dst: int, tag: int) -> Any:
            return self.inner.send(tensors, dst, tag)

        def recv(self, tensors: Any, src: int, tag: int) -> Any:
            return self.inner.recv(tensors, src, tag)

        def recv_anysource(self, tensors: Any, tag: int) -> Any:
            return self.inner.recv_anysource(tensors, tag)

        def barrier(self, opts: Any = None) -> Any:
            return self.inner.barrier(opts if opts is not None else dist.BarrierOptions())

        def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
            return self.inner.monitored_barrier(timeout, wait_all_ranks)

    _GROUP_CLASS = Delegating
    return Delegating


class _GlooBased(Backend):
    vendor, device_type, dist_backend = "test", "cpu", "gloo"
    priority = -1000

    def probe(self) -> Any:
        from vcga.contract import ProbeResult

        return ProbeResult(True, "test backend", 1)

    def accelerator(self) -> Any:
        from vcga.cpu import CpuAccelerator

        return CpuAccelerator()

    def capabilities(self) -> Any:
        from vcga.plugin_manager import get_plugin_manager

        return get_plugin_manager().backend("gloo").capabilities()

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        import torch.distributed as dist

        inner = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return self.group_class()(inner, rank, world_size, self.name)

    def group_class(self) -> Any:
        return _delegating_group_class()


class BrokenSum(_GlooBased):
    name = "broken-sum"

    def group_class(self) -> Any:
        import torch

        class WrongFp16Sum(_delegating_group_class()):
            def allreduce(self, tensors: Any, opts: Any = None) -> Any:
                work = super().allreduce(tensors, opts)
                work.wait()
                for t in tensors:
                    if t.dtype == torch.float16:
                        t.add_(1)
                return work

        return WrongFp16Sum


class BrokenBf16(_GlooBased):
    """Claims bfloat16 (gloo's table says native) but the 'library' rejects it."""

    name = "broken-bf16"

    def group_class(self) -> Any:
        import torch

        base = _delegating_group_class()

        def refuse_bf16(method: Any) -> Any:
            def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                stack = list(args)
                while stack:
                    a = stack.pop()
                    if isinstance(a, (list, tuple)):
                        stack.extend(a)
                    elif isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16:
                        raise RuntimeError("broken-bf16: unsupported data type BFloat16 (the library was built "
                                           "without bf16)")
                return method(self, *args, **kwargs)
            return wrapped

        names = ("allreduce", "reduce", "reduce_scatter", "_reduce_scatter_base", "allgather", "_allgather_base",
                 "gather", "scatter", "broadcast", "alltoall", "alltoall_base", "send", "recv", "recv_anysource")
        return type("NoBf16", (base,), {n: refuse_bf16(getattr(base, n)) for n in names})


class BrokenBits(_GlooBased):
    """Each rank sums the gathered contributions starting from its own: a ring implementation that
    forgot to broadcast the final result. Within the rounding bound everywhere; not identical."""

    name = "broken-bits"

    def group_class(self) -> Any:
        import torch
        import torch.distributed as dist

        class RankOrderSum(_delegating_group_class()):
            def allreduce(self, tensors: Any, opts: Any = None) -> Any:
                opts = opts if opts is not None else dist.AllreduceOptions()
                floating = all(t.is_floating_point() for t in tensors)
                if not floating or opts.reduceOp != dist.ReduceOp.SUM:
                    return super().allreduce(tensors, opts)
                work = None
                for t in tensors:
                    parts = [torch.empty_like(t) for _ in range(self.size())]
                    work = self.inner.allgather([parts], [t.clone()], dist.distributed_c10d.AllgatherOptions())
                    work.wait()
                    me = self.rank()
                    acc = parts[me].clone()
                    for k in range(1, self.size()):
                        acc += parts[(me + k) % self.size()]
                    t.copy_(acc)
                return work

        return RankOrderSum


class BrokenHang(_GlooBased):
    """broadcast never completes on ranks other than the root."""

    name = "broken-hang"

    def group_class(self) -> Any:
        import torch.distributed as dist

        class Never(dist.Work):
            def wait(self, timeout: Any = None) -> bool:
                threading.Event().wait()  # forever: the runner must notice and stop the world
                return False

            def is_completed(self) -> bool:
                return False

        class HangingBroadcast(_delegating_group_class()):
            def broadcast(self, tensors: Any, opts: Any) -> Any:
                if self.rank() != opts.rootRank:
                    return Never()
                return super().broadcast(tensors, opts)

        return HangingBroadcast


class BrokenCreate(_GlooBased):
    name = "broken-create"

    def create_process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        raise VcgaBackendUnavailable(self.name, "the vendor library refused to initialise (test)")


@hookimpl
def vcga_backends() -> list[Backend]:
    return [BrokenSum(), BrokenBf16(), BrokenBits(), BrokenHang(), BrokenCreate()]
