"""The nccl plugin: on this CPU-only torch (the real situation) and against a FAKE CUDA torch.

The fake replaces ``torch.cuda`` with a module that has torch.cuda's API (tests/fakes/common),
``torch.version.cuda``, ``dist.is_nccl_available`` and ``dist.ProcessGroupNCCL`` (with the
``Options`` of torch's ``_C/_distributed_c10d.pyi``). Fake-backed tests say so in their names.
"""

from __future__ import annotations

import sys
import types
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from vendor_fakes import FAKES, NVIDIA_SMI_TOPO, TIMEOUT, a_store, fake_tool

from vcga.config import load_config
from vcga.contract import Support
from vcga.errors import VcgaBackendUnavailable
from vcga.plugins import nccl


class FakeProcessGroupNCCL:
    """torch._C._distributed_c10d.ProcessGroupNCCL as its .pyi declares it:
    ``__init__(store, rank, size, options)``, ``Options(is_high_priority_stream=False)``."""

    calls: list = []

    class Options:
        __slots__ = ("backend", "_timeout", "config", "is_high_priority_stream", "split_from", "split_color",
                     "global_ranks_in_group", "group_name")

        def __init__(self, is_high_priority_stream: bool = False) -> None:
            FakeProcessGroupNCCL.calls.append(("Options", {"is_high_priority_stream": is_high_priority_stream}))
            self.backend = "nccl"
            self._timeout = timedelta(minutes=10)
            self.is_high_priority_stream = is_high_priority_stream

    def __init__(self, store, rank: int, size: int, options: FakeProcessGroupNCCL.Options) -> None:
        if not isinstance(store, dist.Store) or not isinstance(options, FakeProcessGroupNCCL.Options):
            raise TypeError("__init__(): incompatible constructor arguments")
        FakeProcessGroupNCCL.calls.append(("ProcessGroupNCCL", (store, rank, size, options)))
        self.options = options


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FAKE CUDA build of torch with 2 GPUs and NCCL 2.27.5."""
    monkeypatch.syspath_prepend(str(FAKES / "common"))
    from vcga_fake_device import make_device_module

    calls: list = []
    cuda = types.ModuleType("torch.cuda")
    make_device_module(cuda, "cuda", "VCGA_FAKE_CUDA_COUNT", "VCGA_FAKE_CUDA_DRIVER_ERROR", 2, "NVIDIA H200", calls)
    cuda.nccl = types.SimpleNamespace(version=lambda: (2, 27, 5))
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL, raising=False)
    FakeProcessGroupNCCL.calls = []
    yield calls
    sys.modules.pop("vcga_fake_device", None)


# --- the real situation: CPU torch -----------------------------------------------------------------


def test_probe_on_cpu_torch_says_why():
    res = nccl.NcclBackend().probe()
    assert (res.available, res.reason) == (False, f"torch {torch.__version__} was built without CUDA")


def test_probe_on_rocm_torch_says_why(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.1", raising=False)
    res = nccl.NcclBackend().probe()
    assert res.reason == (f"torch {torch.__version__} is a ROCm build (HIP 6.4.1); "
                          "the nccl plugin drives NVIDIA CUDA only")


# --- fake CUDA -------------------------------------------------------------------------------------


def test_fake_probe_reports_devices_and_versions(fake_cuda):
    res = nccl.NcclBackend().probe()
    assert res.available and res.device_count == 2
    assert res.reason == "2 CUDA device(s), NCCL 2.27.5"
    assert dict(res.versions) == {"torch": torch.__version__, "cuda": "12.8", "nccl": "2.27.5"}


def test_fake_probe_without_nccl(fake_cuda, monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert nccl.NcclBackend().probe().reason == f"torch {torch.__version__} (CUDA 12.8) was built without NCCL"


def test_fake_probe_zero_devices_names_the_visible_devices_variable(fake_cuda, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_CUDA_COUNT", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nccl.NcclBackend().probe().reason == ("no CUDA device is visible (torch.cuda.device_count() == 0; "
                                                 "CUDA_VISIBLE_DEVICES='')")


def test_fake_probe_driver_error_from_torch_warning(fake_cuda, monkeypatch):
    """torch.cuda.device_count() returns 0 and warns "CUDA initialization: ..." on a broken driver."""
    def device_count():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).",
                      UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    res = nccl.NcclBackend().probe()
    assert res.reason == ("CUDA driver error: CUDA initialization: The NVIDIA driver on your system is too old "
                          "(found version 11040).")


def test_fake_probe_nccl_library_error(fake_cuda, monkeypatch):
    def version():
        raise RuntimeError("libnccl.so.2: cannot open shared object file")

    monkeypatch.setattr(torch.cuda, "nccl", types.SimpleNamespace(version=version))
    assert nccl.NcclBackend().probe().reason == "NCCL library error: RuntimeError: libnccl.so.2: cannot open shared object file"


@pytest.mark.parametrize("v, s", [((2, 27, 5), "2.27.5"), ((2, 21, 5, "+cuda12.4"), "2.21.5+cuda12.4"), (2708, "2708")])
def test_nccl_version_strings(v, s):
    assert nccl._nccl_version_string(v) == s


def test_fake_factory_builds_options_as_torch_does(fake_cuda):
    """The calls of torch's _new_process_group_helper (NCCL branch): Options(), then
    ProcessGroupNCCL(store, rank, size, options) with is_high_priority_stream False and _timeout."""
    store = a_store()
    pg = nccl.NcclBackend().create_process_group(store, 0, 2, TIMEOUT)
    assert isinstance(pg, FakeProcessGroupNCCL)
    assert [c[0] for c in FakeProcessGroupNCCL.calls] == ["Options", "ProcessGroupNCCL"]
    _, (got_store, rank, size, options) = FakeProcessGroupNCCL.calls[1]
    assert (got_store, rank, size) == (store, 0, 2)
    assert options._timeout == TIMEOUT and options.is_high_priority_stream is False


def test_factory_on_cpu_torch_is_unavailable():
    with pytest.raises(VcgaBackendUnavailable, match="no ProcessGroupNCCL"):
        nccl.NcclBackend().create_process_group(a_store(), 0, 1, TIMEOUT)


def test_fake_accelerator_on_cuda(fake_cuda, monkeypatch):
    acc = nccl.NcclBackend().accelerator()
    assert acc.device() == torch.device("cuda", 0)
    acc.set_device(1)
    assert acc.device() == torch.device("cuda", 1) and acc.current_device() == 1
    assert acc.memory_stats().total == 64 << 30
    assert acc.supported_dtypes() == frozenset(__import__("vcga.dtypes").dtypes.ALL)
    with pytest.raises(IndexError, match="restricted by CUDA_VISIBLE_DEVICES"):
        acc.device(2)
    assert ("set_device", (1,), {}) in fake_cuda


def test_fake_to_host_for_cuda_tensors(fake_cuda):
    from vcga_fake_device import FakeDeviceTensor

    base = torch.arange(20, dtype=torch.int64).reshape(4, 5)
    out = nccl.vcga_tensor_to_host(FakeDeviceTensor(base[:, 1::2], "cuda", fake_cuda))
    assert out.is_contiguous() and torch.equal(out, base[:, 1::2])
    assert nccl.vcga_tensor_to_host(torch.ones(1)) is None


def test_vendor_env_maps_the_unified_config():
    env = nccl.NcclBackend().vendor_env(load_config(env={
        "VCGA_BUFFER_SIZE_MB": "8", "VCGA_DETERMINISTIC": "yes", "VCGA_VISIBLE_DEVICES": "1,0"}))
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_BUFFSIZE": str(8 << 20), "CUDA_VISIBLE_DEVICES": "1,0",
                   "NCCL_ALGO": "Ring"}
    assert nccl.NcclBackend().vendor_env(load_config(env={})) == {"TORCH_NCCL_BLOCKING_WAIT": "1"}


def test_vendor_env_maps_the_network_section():
    env = nccl.NcclBackend().vendor_env(load_config(env={
        "VCGA_NETWORK_INTERFACE": "eth1,eth2", "VCGA_NETWORK_TRAFFIC_CLASS": "104", "VCGA_NETWORK_SERVICE_LEVEL": "3"}))
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_SOCKET_IFNAME": "=eth1,eth2", "NCCL_IB_TC": "104",
                   "NCCL_IB_SL": "3"}


def test_fake_nvidia_smi_topology(monkeypatch, tmp_path):
    """A FAKE nvidia-smi printing a recorded `nvidia-smi topo -m` (GPU and NIC columns, legends)."""
    fake_tool(monkeypatch, tmp_path, "nvidia-smi", NVIDIA_SMI_TOPO)
    topo = nccl.NcclBackend().topology()
    assert (tmp_path / "nvidia-smi.args").read_text().strip() == "topo -m"
    assert topo.source == "nvidia-smi topo -m" and topo.device_count == 4
    assert topo.matrix == [["X", "NV18", "NV18", "NV18"], ["NV18", "X", "NV18", "NV18"],
                           ["NV18", "NV18", "X", "NV18"], ["NV18", "NV18", "NV18", "X"]]


def test_topology_without_nvidia_smi_or_nvml_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    topo = nccl.NcclBackend().topology()
    assert (topo.source, topo.detail) == ("unknown", "nvidia-smi not found on PATH")


def test_fake_nvml_topology_when_nvidia_smi_is_missing(monkeypatch, tmp_path):
    """A FAKE pynvml (nvidia-ml-py's names): NVLink pairs are "NV", the rest by common ancestor."""
    monkeypatch.setenv("PATH", str(tmp_path))
    calls = []
    fake = types.SimpleNamespace(
        NVML_P2P_CAPS_INDEX_NVLINK=2, NVML_P2P_STATUS_OK=0,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 3, nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetP2PStatus=lambda a, b, idx: 0 if {a, b} == {"h0", "h1"} and idx == 2 else 4,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 50 if "h2" in (a, b) else 10,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    topo = nccl.NcclBackend().topology()
    assert topo.source == "nvml" and topo.matrix == [["X", "NV", "SYS"], ["NV", "X", "SYS"], ["SYS", "SYS", "X"]]
    assert calls == ["init", "shutdown"]


def test_table_cells_the_library_rejects_are_never_native():
    """Cells whose dtype getNcclDataType rejects, or fp8 reductions, are emulated or refused."""
    t = nccl.NcclBackend().capabilities()
    for dt in ("int16", "uint16", "uint32", "uint64"):
        assert t.support_of("all_gather", dt) is not Support.NATIVE
        assert t.support_of("all_reduce", dt, "SUM") is not Support.NATIVE
    assert t.lookup("all_reduce", "float8_e4m3fn", "SUM").via == "upcast:float32"


def test_fake_vcga_info_shows_nccl_available_with_devices_and_versions(fake_cuda):
    """`vcga info` (its collect()) on the FAKE CUDA torch: nccl available and selected."""
    from vcga.cli.info import collect

    data = collect()
    b = {x["name"]: x for x in data["backends"]}["nccl"]
    assert (b["available"], b["device_count"]) == (True, 2)
    assert b["versions"] == {"torch": torch.__version__, "cuda": "12.8", "nccl": "2.27.5"}
    assert data["selected_backend"] == "nccl"
