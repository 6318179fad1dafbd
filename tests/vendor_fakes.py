"""Helpers for the FAKE-backed vendor tests: install a fake vendor module, fake vendor tools.

Every test that uses these says "fake" in its name or docstring (tests/fakes/README.md says what
the fakes are and which vendor source each follows).
"""

from __future__ import annotations

import os
import stat
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
FAKE_PATHS = {"torch_npu": [FAKES / "common", FAKES / "npu"], "torch_mlu": [FAKES / "common", FAKES / "mlu"]}


def fake_pythonpath(*modules: str) -> str:
    """PYTHONPATH that puts the fake vendor module(s) on a subprocess's path."""
    paths: list[str] = []
    for m in modules:
        paths += [str(p) for p in FAKE_PATHS[m] if str(p) not in paths]
    return os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])


@contextmanager
def installed_fake(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[dict]:
    """Make ``import <name>`` load the fake, in this process, reversibly.

    The fake does what the real module does to torch at import -- rename PrivateUse1, register the
    device module, register its distributed backend. Those calls cannot be undone in a process, so
    here they are recorded (and asserted by tests) instead of reaching torch; ``torch.<device>``
    is set through monkeypatch and removed afterwards.
    """
    import torch
    import torch.distributed as dist

    registered: dict = {"rename_privateuse1_backend": [], "register_device_module": [], "register_backend": []}

    def _rename(backend_name: str) -> None:
        registered["rename_privateuse1_backend"].append(backend_name)

    def _register_device_module(device_type: str, module: types.ModuleType) -> None:
        registered["register_device_module"].append(device_type)
        monkeypatch.setattr(torch, device_type, module, raising=False)
        monkeypatch.setitem(sys.modules, f"torch.{device_type}", module)

    def _register_backend(name_: str, func, extended_api: bool = False, devices=None) -> None:
        registered["register_backend"].append((name_, extended_api, tuple(devices or ())))

    monkeypatch.setattr(torch.utils, "rename_privateuse1_backend", _rename)
    monkeypatch.setattr(torch, "_register_device_module", _register_device_module)
    monkeypatch.setattr(dist.Backend, "register_backend", _register_backend)
    for p in FAKE_PATHS[name]:
        monkeypatch.syspath_prepend(str(p))
    try:
        yield registered
    finally:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".") or m == "vcga_fake_device"]:
            del sys.modules[mod]


def fake_tool(monkeypatch: pytest.MonkeyPatch, bindir: Path, name: str, stdout: str = "", *, exit_code: int = 0,
              stderr: str = "", sleep_s: float = 0.0) -> Path:
    """Put a FAKE vendor command-line tool (nvidia-smi, npu-smi, cnmon) first on PATH; it prints
    ``stdout`` and records its arguments in ``<bindir>/<name>.args``."""
    bindir.mkdir(parents=True, exist_ok=True)
    (bindir / f"{name}.out").write_text(stdout)
    (bindir / f"{name}.err").write_text(stderr)
    script = bindir / name
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > "{bindir}/{name}.args"\n'
        + (f"sleep {sleep_s}\n" if sleep_s else "")
        + f'cat "{bindir}/{name}.out"\n'
        + f'cat "{bindir}/{name}.err" >&2\n'
        + f"exit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return script


# ---------------------------------------------------------------------------------------------------
# Recorded tool outputs
# ---------------------------------------------------------------------------------------------------

#: `nvidia-smi topo -m` on a 4-GPU NVLink node with two NICs, in the shape the tool prints
#: (tab-separated, ` X ` on the diagonal, NIC columns, affinity columns, then legends).
NVIDIA_SMI_TOPO = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tNV18\tNV18\tPXB\tSYS\t0-55,112-167\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tNV18\tNV18\tSYS\tPXB\t0-55,112-167\t0\t\tN/A\n"
    "GPU2\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A\n"
    "GPU3\tNV18\tNV18\tNV18\t X \tSYS\tSYS\t56-111,168-223\t1\t\tN/A\n"
    "NIC0\tPXB\tSYS\tSYS\tSYS\t X \tSYS\n"
    "NIC1\tSYS\tPXB\tSYS\tSYS\tSYS\t X \n"
    "\n"
    "Legend:\n\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n\n"
    "NIC Legend:\n\n"
    "  NIC0: mlx5_0\n"
    "  NIC1: mlx5_1\n"
)

#: `npu-smi info -t topo` on an 8-NPU Atlas node (as published in ModelScope's swift NPU guide).
NPU_SMI_TOPO = (
    "\t   NPU0       NPU1       NPU2       NPU3       NPU4       NPU5       NPU6       NPU7       CPU Affinity\n"
    + "".join(
        f"NPU{i}       " + "       ".join("X   " if j == i else "HCCS" for j in range(8))
        + f"       {['144-167', '144-167', '96-119', '96-119', '0-23', '0-23', '48-71', '48-71'][i]}\n"
        for i in range(8))
    + "\nLegend:\n\n  X    = Self\n  HCCS = Connection traversing HCCS.\n"
)

#: `cnmon topo -m` on a 4-MLU node, in the documented shape (matrix of MLU<n> with MLK = MLU-Link,
#: MUL = multiple PCIe switches, CPU = through the CPU; then CPU Affinity).
CNMON_TOPO = (
    "        MLU0    MLU1    MLU2    MLU3    CPU Affinity\n"
    "MLU0    X       MLK     MUL     CPU     0-31\n"
    "MLU1    MLK     X       MUL     CPU     0-31\n"
    "MLU2    MUL     MUL     X       MLK     32-63\n"
    "MLU3    CPU     CPU     MLK     X       32-63\n"
)


def a_store():
    import torch.distributed as dist

    return dist.PrefixStore("vcga-test", dist.HashStore())


TIMEOUT = timedelta(seconds=42)
