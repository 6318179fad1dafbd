"""``backend="vcga"`` is available after ``import vcga`` (before or after torch) or through torch's
own ``torch.backends`` autoload -- without ``import vcga`` importing torch, and without any way for
the autoload to break ``import torch``. Each import check runs in a fresh interpreter; the checks of
``vcga.init`` run in a rank forked from the rank server (a fresh process, torch already imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BACKEND", "VCGA_BACKEND")


def _py(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in _WORLD_VARS}  # only what the test sets
    e = {**base, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1", **env}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def _init_rank(rank: int, world_size: int, init_method: str, code: str, drop: list[str]) -> str:
    import contextlib
    import io

    for k in drop:
        os.environ.pop(k, None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(textwrap.dedent(code), "<test>", "exec"), {})  # the test's own code
    return out.getvalue().strip()


def _forked(code: str, **env: str) -> str:
    """:func:`_py`, in a process forked from the rank server: ``code``'s stdout, run with this
    process's environment but the world variables and run_world's own, plus ``env``."""
    from vcga.testing import WORLD_ENV, run_world

    drop = [k for k in (*_WORLD_VARS, *WORLD_ENV, "VCGA_BRIDGE_FIGURES_CACHE") if k not in env]
    return run_world(_init_rank, 1, code, drop, env={**env, "VCGA_DISABLE_PLUGIN_AUTOLOAD": "1"})[0]


def test_import_vcga_does_not_import_torch() -> None:
    assert _py("import sys, vcga; print('torch' in sys.modules)") == "False"


@pytest.mark.parametrize("order", ["vcga-first", "torch-first"])
def test_registered_after_import_vcga(order: str) -> None:
    first, second = ("vcga", "torch.distributed") if order == "vcga-first" else ("torch.distributed", "vcga")
    out = _py(f"""
        import {first}, {second}
        import torch.distributed as dist
        print('VCGA' in dist.Backend._plugins, 'vcga' in dist.Backend.backend_list)
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out == "True True"


def test_registered_by_torch_autoload_without_importing_vcga() -> None:
    """The entry point in group torch.backends (installed with the package) registers the backend."""
    out = _py("""
        import torch.distributed as dist
        print('VCGA' in dist.Backend._plugins)
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    assert out == "True"


def test_autoload_can_be_turned_off() -> None:
    out = _py("""
        import vcga, torch.distributed as dist
        before = 'VCGA' in dist.Backend._plugins
        from vcga.process_group import register
        register(); register()  # explicit, idempotent
        print(before, 'VCGA' in dist.Backend._plugins)
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="1", VCGA_TORCH_AUTOLOAD="0")
    assert out == "False True"


def test_autoload_never_raises() -> None:
    """A broken registration is logged, never raised: a raising torch.backends plugin breaks import torch."""
    from vcga import _autoload

    class Broken:
        class Backend:
            _plugins: dict = {}

            @staticmethod
            def register_backend(*a: object, **k: object) -> None:
                raise RuntimeError("boom")

    _autoload._register(Broken)  # logs a warning

    original = _autoload.install
    try:
        def explode() -> None:
            raise RuntimeError("install failed")

        _autoload.install = explode
        _autoload.torch_autoload()  # swallowed
    finally:
        _autoload.install = original


def test_devices_match_the_process_group() -> None:
    from vcga import _autoload
    from vcga.process_group import DEVICES

    assert _autoload._DEVICES == DEVICES


def test_init_single_process_and_communicator() -> None:
    """vcga.init() without torchrun: a world of one; the Communicator runs real collectives, and
    under torch's current names (no FutureWarning from vcga's own calls)."""
    out = _forked("""
        import torch, vcga
        comm = vcga.init("gloo")
        x = torch.arange(4.0)
        comm.all_reduce(x, op="avg")
        parts = comm.all_gather(x)
        comm.barrier(); comm.monitored_barrier(timeout_s=5)
        print(comm.rank, comm.world_size, comm.backend, comm.device, x.tolist(), len(parts))
        import warnings
        warnings.simplefilter("error", FutureWarning)  # torch's deprecated names warn from inside vcga
        g, s = torch.empty(4), torch.empty(4)
        comm.all_gather_into(g, x)
        comm.reduce_scatter(s, torch.full((4,), 2.0))
        print(g.tolist(), s.tolist())
        import torch.distributed as dist
        print(type(dist.group.WORLD).__name__, dist.get_backend())
        comm.close()
        print(dist.is_initialized())
    """)
    assert out.splitlines() == ["0 1 gloo cpu [0.0, 1.0, 2.0, 3.0] 1", "[0.0, 1.0, 2.0, 3.0] [2.0, 2.0, 2.0, 2.0]",
                                "VcgaProcessGroup vcga", "False"]


def test_init_reads_torchrun_environment() -> None:
    from vcga.testing import free_port

    out = _forked("""
        import vcga
        comm = vcga.init()
        print(comm.rank, comm.world_size, comm.backend)
        comm.close()
    """, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        VCGA_BACKEND="sim-cncl")
    assert out == "0 1 sim-cncl"


def test_init_rejects_a_malformed_environment() -> None:
    out = _forked("""
        import vcga
        from vcga.errors import VcgaConfigError
        try:
            vcga.init()
        except VcgaConfigError as e:
            print(e.key)
    """, RANK="one", WORLD_SIZE="2")
    assert out == "RANK"
