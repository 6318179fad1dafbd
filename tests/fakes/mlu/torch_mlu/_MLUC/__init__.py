"""FAKE torch_mlu._MLUC (the compiled extension in the real package; see tests/fakes/README.md).

``ProcessGroupCNCL`` as torch_mlu/csrc/python/ProcessGroupCNCL.cpp binds it (there a subclass of
``torch._C._distributed_c10d.Backend``; here a plain class with ``rank()`` / ``size()``), with two
constructors -- ``(store, rank, size, Options)`` and ``(store, rank, size,
timeout=kProcessGroupDefaultTimeout)``, the latter building ``Options::create()`` with
``is_high_priority_stream = false`` -- and ``Options(is_high_priority_stream=False)``.
``_cncl_version()`` returns ``cnclGetLibVersion``'s (major, minor, patch).
"""

from datetime import timedelta

import torch.distributed as dist

import torch_mlu

_DEFAULT_TIMEOUT = timedelta(minutes=30)  # kProcessGroupDefaultTimeout


def _get_version():
    return "1.22.0-torch2.4.0"


def _cncl_version():
    torch_mlu._fake_calls.append(("_cncl_version", (), {}))
    return (1, 24, 1)


class ProcessGroupCNCL:
    class Options:
        __slots__ = ("backend", "_timeout", "is_high_priority_stream")

        def __init__(self, is_high_priority_stream=False):  # py::init<bool>()
            torch_mlu._fake_calls.append(("ProcessGroupCNCL.Options", (), {"is_high_priority_stream": is_high_priority_stream}))
            self.backend = "cncl"
            self._timeout = _DEFAULT_TIMEOUT
            self.is_high_priority_stream = is_high_priority_stream

    def __init__(self, store, rank, size, options_or_timeout=_DEFAULT_TIMEOUT):
        if not isinstance(store, dist.Store):
            raise TypeError("__init__(): incompatible constructor arguments (store must be a torch.distributed.Store)")
        if not isinstance(rank, int) or not isinstance(size, int):
            raise TypeError("__init__(): incompatible constructor arguments (rank, size must be int)")
        if isinstance(options_or_timeout, ProcessGroupCNCL.Options):
            self.options = options_or_timeout
        elif isinstance(options_or_timeout, timedelta):
            # ProcessGroupCNCL.cpp: Options::create(); is_high_priority_stream = false; timeout = timeout
            self.options = ProcessGroupCNCL.Options(is_high_priority_stream=False)
            self.options._timeout = options_or_timeout
        else:
            raise TypeError("__init__(): incompatible constructor arguments (Options or timeout)")
        self._rank, self._size = rank, size
        self.store = store
        torch_mlu._fake_calls.append(("ProcessGroupCNCL", (store, rank, size, options_or_timeout), {}))

    def rank(self):
        return self._rank

    def size(self):
        return self._size
