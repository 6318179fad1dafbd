"""FAKE torch_npu._C._distributed_c10d (see tests/fakes/README.md).

``ProcessGroupHCCL`` as torch_npu/csrc/distributed/Init.cpp binds it (there a subclass of
``torch._C._distributed_c10d.Backend``, which cannot be constructed from Python, so here a plain
class with ``rank()`` / ``size()``), with two constructors -- ``(store, rank, size, options)``
and ``(store, rank, size, timeout=kProcessGroupDefaultTimeout)`` -- and a nested ``Options``
(``py::init<>()``; ``op_timeout``, ``is_high_priority_stream``, ``global_ranks_in_group``,
``hccl_config``, ``group_id``; ``backend`` and ``_timeout`` from ``Backend.Options``). pybind
classes reject unknown attributes; ``__slots__`` does the same here.
"""

from datetime import timedelta

import torch.distributed as dist

import torch_npu

_BACKEND_DEFAULT_TIMEOUT = timedelta(minutes=30)  # c10d kBackendDefaultTimeout


class ProcessGroupHCCL:
    class Options:
        __slots__ = ("backend", "_timeout", "op_timeout", "is_high_priority_stream", "global_ranks_in_group",
                     "hccl_config", "group_id")

        def __init__(self):  # py::init<>(): no arguments
            torch_npu._fake_calls.append(("ProcessGroupHCCL.Options", (), {}))
            self.backend = "hccl"
            self._timeout = _BACKEND_DEFAULT_TIMEOUT
            self.op_timeout = timedelta(0)
            self.is_high_priority_stream = False
            self.global_ranks_in_group = []
            self.hccl_config = {}
            self.group_id = ""

        def __setattr__(self, name, value):
            if name == "_timeout" and not isinstance(value, timedelta):
                raise TypeError("_timeout: incompatible type; expected datetime.timedelta")
            object.__setattr__(self, name, value)

    def __init__(self, store, rank, size, options_or_timeout=_BACKEND_DEFAULT_TIMEOUT):
        if not isinstance(store, dist.Store):
            raise TypeError("__init__(): incompatible constructor arguments (store must be a torch.distributed.Store)")
        if not isinstance(rank, int) or not isinstance(size, int):
            raise TypeError("__init__(): incompatible constructor arguments (rank, size must be int)")
        if isinstance(options_or_timeout, ProcessGroupHCCL.Options):
            self.options = options_or_timeout
        elif isinstance(options_or_timeout, timedelta):
            self.options = ProcessGroupHCCL.Options()
            self.options._timeout = options_or_timeout
        else:
            raise TypeError("__init__(): incompatible constructor arguments (options or timeout)")
        self._rank, self._size = rank, size
        torch_npu._fake_calls.append(("ProcessGroupHCCL", (store, rank, size, options_or_timeout), {}))
        self.store = store

    def rank(self):
        return self._rank

    def size(self):
        return self._size
