"""Run PyTorch's own backend suite (torch/testing/_internal/distributed/distributed_test.py, shipped
in the torch wheel) against ``backend="vcga"``, the way pytorch's test_distributed_spawn.py runs it
for gloo and nccl.

Usage::

    python tests/torch_suite/runner.py [unittest args, e.g. -k test_all_reduce_sum]
    python tests/torch_suite/runner.py --list      # every test name it would collect

A plugin backend takes part by being named in ``DistTestCases.backend_feature["plugin"]`` (and in
the feature sets whose tests it should run: "ddp", "subgroup"); BACKEND, WORLD_SIZE and TEMP_DIR
must be set before distributed_test is imported, which this script does. Each test spawns
WORLD_SIZE processes that re-import this file, so ``import vcga`` here registers the backend in
every rank.
"""

from __future__ import annotations

import os
import sys
import tempfile

#: ``VCGA_TORCH_SUITE_GATES=gloo``: evaluate the suite's skip gates as for gloo (many tests are
#: gated on the backend *name* -- "Test requires backend ... {'gloo'}", "Only gloo backend supports
#: timeouts") while every process group the tests create with the default or "gloo" backend is a
#: ``vcga`` group. Tests that assert the backend's name cannot pass this way and are not selected.
GATES_AS_GLOO = os.environ.get("VCGA_TORCH_SUITE_GATES") == "gloo"
if GATES_AS_GLOO:
    os.environ["BACKEND"] = "gloo"
os.environ.setdefault("BACKEND", "vcga")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="vcga-torch-suite-"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vcga  # noqa: E402,F401 - registers backend "vcga" (in every spawned rank too)

if not dist.is_available():
    sys.exit(0)

if GATES_AS_GLOO:
    _init_process_group = dist.init_process_group
    _new_group = dist.new_group

    def _as_vcga(backend: object) -> object:
        return "vcga" if backend in (None, "gloo", dist.Backend.GLOO) else backend

    def init_process_group(*args: object, backend: object = None, **kwargs: object) -> object:
        return _init_process_group(*args, backend=_as_vcga(backend), **kwargs)

    def new_group(*args: object, backend: object = None, **kwargs: object) -> object:
        return _new_group(*args, backend=_as_vcga(backend), **kwargs)

    dist.init_process_group = init_process_group  # type: ignore[assignment]
    dist.new_group = new_group  # type: ignore[assignment]

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("vcga")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
    """The ranks are forked from this (CPU-only) process instead of spawned: a spawned rank
    re-imports torch and distributed_test (~7 s on a loaded 2-core machine), which would make
    each test cost 15-20 s; a forked one starts at once. pytorch ran this suite forked too
    (test_distributed_fork.py) before CUDA made spawn the default. No process group exists in
    the parent, so every rank builds its own after the fork."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        for name in sorted(n for n in dir(TestDistBackendWithFork) if n.startswith("test_")):
            print(name)
        sys.exit(0)
    run_tests()
