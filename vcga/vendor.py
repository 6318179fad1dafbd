"""Building blocks for accelerator plugins: part of the public core API.

Every vendor's torch device module -- ``torch.cuda``, ``torch.npu`` (torch_npu), ``torch.mlu``
(torch_mlu) -- copies the API of ``torch.cuda``. So the :class:`~vcga.contract.Accelerator`
contract is mapped onto such a module once, here, and each plugin only says which module, which
visible-devices variable and which dtypes (:class:`DeviceModuleAccelerator`). The same holds for
the vendors' topology tools, which all print a ``nvidia-smi topo -m``-style matrix
(:func:`topology_from_tool`), and for a probe: importing the vendor module
(:func:`import_vendor_module`) and counting its devices (:func:`count_devices`).

The built-in nccl, hccl and mlu plugins use these; an out-of-tree plugin for another
``torch.cuda``-like device (``torch.xpu``, ...) can too -- see docs/plugins.md.

Importing this module imports neither torch nor any vendor module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vcga.contract import MemoryStats, Topology
from vcga.errors import VcgaConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceModuleAccelerator",
    "import_vendor_module",
    "count_devices",
    "ToolOutput",
    "run_tool",
    "parse_link_matrix",
    "topology_from_tool",
    "visible_devices_value",
    "to_host_contiguous",
    "check_group_args",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# The Accelerator over a torch.cuda-like device module
# ---------------------------------------------------------------------------------------------------


class DeviceModuleAccelerator:
    """:class:`~vcga.contract.Accelerator` over a device module that follows ``torch.cuda``'s API.

    :param device_type: the torch device type ("cuda", "npu", "mlu").
    :param visible_devices_env: the variable that restricts visible devices.
    :param dtypes: canonical dtype names the device holds without loss.
    :param module: returns the device module (``torch.cuda``, ``torch.npu``, ...); called on
        every use, so the vendor module is imported only when the accelerator is used. Default:
        ``getattr(torch, device_type)`` -- where torch_npu / torch_mlu register their module.

    Calls made on the module (the names every vendor module shares with ``torch.cuda``):
    ``is_available, device_count, set_device, current_device, synchronize, memory_allocated,
    memory_reserved, max_memory_allocated, get_device_properties(i).total_memory,
    manual_seed_all, get_rng_state(device=), set_rng_state(state, device=), current_stream,
    Stream(device=), Event(enable_timing=)``.
    """

    def __init__(self, device_type: str, visible_devices_env: str | None, dtypes: Iterable[str],
                 module: Callable[[], Any] | None = None) -> None:
        self.device_type = device_type
        self.visible_devices_env = visible_devices_env
        self._dtypes = frozenset(dtypes)
        self._module_fn = module

    @property
    def module(self) -> Any:
        """The vendor's device module."""
        if self._module_fn is not None:
            return self._module_fn()
        import torch

        return getattr(torch, self.device_type)

    def is_available(self) -> bool:
        return bool(self.module.is_available())

    def device_count(self) -> int:
        return int(self.module.device_count())

    def device(self, index: int | None = None) -> torch.device:
        import torch

        return torch.device(self.device_type, self._resolve(index))

    def set_device(self, index: int) -> None:
        self.module.set_device(self._check(index))

    def current_device(self) -> int:
        return int(self.module.current_device())

    def synchronize(self, index: int | None = None) -> None:
        self.module.synchronize(self._resolve(index))

    def memory_stats(self, index: int | None = None) -> MemoryStats:
        """The caching allocator's counters: allocated and reserved now, peak allocated since the
        last reset, and the device's total memory."""
        i = self._resolve(index)
        mod = self.module
        return MemoryStats(
            allocated=int(mod.memory_allocated(i)),
            reserved=int(mod.memory_reserved(i)),
            peak_allocated=int(mod.max_memory_allocated(i)),
            total=int(mod.get_device_properties(i).total_memory),
        )

    def manual_seed(self, seed: int) -> None:
        """Seed every device of this type (``manual_seed_all``)."""
        self.module.manual_seed_all(int(seed))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return self.module.get_rng_state(device=self._resolve(index))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        import torch

        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.device.type != "cpu":
            raise TypeError(f"an RNG state is a CPU torch.uint8 tensor (as get_rng_state returns), not {state!r:.80}")
        self.module.set_rng_state(state, device=self._resolve(index))

    def current_stream(self, index: int | None = None) -> Any:
        return self.module.current_stream(self._resolve(index))

    def new_stream(self, index: int | None = None) -> Any:
        return self.module.Stream(device=self._resolve(index))

    def new_event(self, enable_timing: bool = False) -> Any:
        return self.module.Event(enable_timing=enable_timing)

    def supported_dtypes(self) -> frozenset[str]:
        return self._dtypes

    def _resolve(self, index: int | None) -> int:
        return self.current_device() if index is None else self._check(index)

    def _check(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"a {self.device_type} device index is an int, not {type(index).__name__}")
        n = self.device_count()
        if not 0 <= index < n:
            hint = f" (restricted by {self.visible_devices_env})" if self.visible_devices_env else ""
            raise IndexError(f"{self.device_type} device index {index} is out of range: "
                             f"{n} device(s) visible{hint}")
        return index

    def __repr__(self) -> str:
        return f"DeviceModuleAccelerator({self.device_type!r})"


# ---------------------------------------------------------------------------------------------------
# Probing: importing a vendor module, counting its devices
# ---------------------------------------------------------------------------------------------------


def import_vendor_module(name: str, install_hint: str) -> tuple[Any | None, str]:
    """Import a vendor module for :meth:`Backend.probe`, never raising.

    :returns: ``(module, "")`` or ``(None, reason)`` where the reason says whether the module is
        missing or why its import failed (the exception's type and first line: a missing
        ``libhccl.so``, torch_npu refusing a second accelerator, ...).
    """
    err: ImportError | ValueError | None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:  # ValueError: a sys.modules entry without __spec__
        spec, err = None, e
    else:
        err = None
    if spec is None and err is None:
        return None, f"module {name} is not installed ({install_hint})"
    try:
        return importlib.import_module(name), ""
    except BaseException as e:  # a vendor import may raise anything, even SystemExit
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, f"import {name} failed: {_first_line(e)}"


def count_devices(device_type: str, kind: str, visible_devices_env: str) -> tuple[int, str]:
    """How many devices ``torch.<device_type>`` sees, or why none: the device half of a probe.

    :param kind: how messages name the device ("CUDA", "NPU", "MLU").
    :returns: ``(n, "")`` with ``n >= 1``, or ``(0, reason)``: "<kind> driver error: ..." when
        ``device_count()`` raises, or returns 0 with a warning naming the device (that is how
        torch.cuda reports a driver that is too old: it does not initialise the device to count,
        so probing never poisons a later fork); otherwise "no <kind> device is visible (...)",
        with the visible-devices variable when it is set.
    """
    import os
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch

            n = int(getattr(torch, device_type).device_count())
        except Exception as e:  # noqa: BLE001 - driver / runtime errors surface here
            return 0, f"{kind} driver error: {type(e).__name__}: {e}"
    if n > 0:
        return n, ""
    for w in caught:
        text = str(w.message).strip()
        if kind in text:
            return 0, f"{kind} driver error: {text.splitlines()[0]}"
    visible = os.environ.get(visible_devices_env)
    hint = f"; {visible_devices_env}={visible!r}" if visible is not None else ""
    return 0, f"no {kind} device is visible (torch.{device_type}.device_count() == 0{hint})"


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------------
# Vendor command-line tools and their link matrices
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolOutput:
    """What a tool printed, or why it could not run (``error`` set, ``stdout`` empty)."""

    stdout: str = ""
    error: str = ""


def run_tool(argv: Sequence[str], timeout_s: float) -> ToolOutput:
    """Run a vendor tool with a timeout; never raises, never hangs past ``timeout_s``."""
    exe = shutil.which(argv[0])
    if exe is None:
        return ToolOutput(error=f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        return ToolOutput(error=f"`{' '.join(argv)}` did not finish within {timeout_s:g} s")
    except OSError as e:
        return ToolOutput(error=f"`{' '.join(argv)}` could not run: {e.strerror or e}")
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        return ToolOutput(error=f"`{' '.join(argv)}` exited with status {proc.returncode}"
                                + (f": {msg[0].strip()}" if msg else ""))
    return ToolOutput(stdout=proc.stdout)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_link_matrix(text: str, prefix: str) -> tuple[list[str], list[list[str]]]:
    """Parse a device link matrix as ``nvidia-smi topo -m``, ``npu-smi info -t topo`` and
    ``cnmon topo -m`` print it: a header row of device labels (``GPU0 GPU1 ... CPU Affinity``),
    then one row per device starting with its label, ``X`` on the diagonal.

    Columns that are not devices (``NIC0``, ``CPU Affinity``, ...) and rows of other kinds are
    skipped. :returns: (device labels, matrix); empty when no matrix is found.
    """
    label = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    header: list[str] | None = None
    rows: dict[str, list[str]] = {}
    for raw in _ANSI.sub("", text).splitlines():
        cells = raw.split()
        if not cells:
            continue
        if header is None:
            if label.match(cells[0]):
                header = cells  # the header precedes the rows and starts directly with a device label
            continue
        if label.match(cells[0]) and cells[0] in header:
            rows[cells[0]] = cells[1:]
    if header is None:
        return [], []
    cols = [i for i, c in enumerate(header) if label.match(c)]
    devices = [header[i] for i in cols]
    matrix = []
    for dev in devices:
        row = rows.get(dev)
        if row is None or len(row) <= max(cols):
            return [], []
        matrix.append([row[i] for i in cols])
    return devices, matrix


def topology_from_tool(argv: Sequence[str], prefix: str, timeout_s: float = 10.0) -> Topology:
    """Run a vendor topology tool and parse its matrix; :meth:`Topology.unknown` with the reason
    when the tool is missing, fails, times out or prints no matrix."""
    out = run_tool(argv, timeout_s)
    source = " ".join(argv)
    if out.error:
        return Topology.unknown(out.error)
    devices, matrix = parse_link_matrix(out.stdout, prefix)
    if not devices:
        return Topology.unknown(f"`{source}` printed no {prefix}<n> link matrix")
    return Topology(source=source, device_count=len(devices), matrix=matrix, detail=out.stdout.strip())


# ---------------------------------------------------------------------------------------------------
# Small shared translations
# ---------------------------------------------------------------------------------------------------


def visible_devices_value(indices: Sequence[int]) -> str:
    """``(0, 2)`` -> ``"0,2"``: the form CUDA_/ASCEND_RT_/MLU_VISIBLE_DEVICES take."""
    return ",".join(str(int(i)) for i in indices)


def to_host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor as a CPU tensor in the neutral layout: same dtype and values, C-contiguous,
    with torch's lazy conjugate / negative bits materialised (their raw bytes are otherwise not
    the values)."""
    host = tensor.detach().cpu()
    if host.is_conj():
        host = host.resolve_conj()
    if host.is_neg():
        host = host.resolve_neg()
    return host.contiguous()


def check_group_args(rank: int, world_size: int, timeout: timedelta) -> None:
    """Refuse impossible process-group arguments before a vendor library sees them.

    :raises VcgaConfigError: naming the argument and what is allowed.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise VcgaConfigError("world_size", world_size, "an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise VcgaConfigError("rank", rank, f"an int in [0, {world_size})")
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise VcgaConfigError("timeout", timeout, "a datetime.timedelta > 0")
