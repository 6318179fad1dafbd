"""The hccl plugin against a FAKE torch_npu (tests/fakes/npu) that follows Ascend/pytorch's API.

Every test here is fake-backed: no Ascend hardware exists on this machine.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from conftest import VENV_BIN
from vendor_fakes import NPU_SMI_TOPO, TIMEOUT, a_store, fake_pythonpath, fake_tool, installed_fake

from vcga.config import load_config
from vcga.errors import VcgaBackendUnavailable, VcgaConfigError
from vcga.plugins import hccl


@pytest.fixture
def fake_npu(monkeypatch):
    """The FAKE torch_npu, importable in this process."""
    with installed_fake(monkeypatch, "torch_npu") as registered:
        yield registered


def _calls(names=None):
    import torch_npu

    return [c for c in torch_npu._fake_calls if names is None or c[0] in names]


def test_fake_probe_reports_devices_and_versions(fake_npu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_NPU_COUNT", "8")
    res = hccl.HcclBackend().probe()
    assert res.available
    assert res.device_count == 8
    assert res.reason == "8 NPU device(s), torch_npu 2.13.0.post1, CANN 8.3.RC1"
    assert dict(res.versions) == {"torch": torch.__version__, "torch_npu": "2.13.0.post1", "cann": "8.3.RC1",
                                  "hccl": "8.3.RC1"}
    # importing torch_npu did what the real one does to torch, and nothing else
    assert fake_npu == {"rename_privateuse1_backend": ["npu"], "register_device_module": ["npu"],
                        "register_backend": [("hccl", True, ("npu",))]}
    assert _calls({"get_cann_version"}) == [("get_cann_version", (), {"module": "CANN"}),
                                            ("get_cann_version", (), {"module": "HCCL"})]


def test_fake_probe_zero_devices(fake_npu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_NPU_COUNT", "0")
    res = hccl.HcclBackend().probe()
    assert (res.available, res.reason) == (False, "no NPU device is visible (torch.npu.device_count() == 0)")


def test_fake_probe_driver_error(fake_npu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_NPU_DRIVER_ERROR", "drvError 87: device is not ready")
    res = hccl.HcclBackend().probe()
    assert (res.available, res.reason) == (False, "NPU driver error: RuntimeError: drvError 87: device is not ready")


def test_fake_probe_import_error_text(fake_npu, monkeypatch):
    """torch_npu without CANN: its import fails on a missing shared library; the reason carries it."""
    monkeypatch.setenv("VCGA_FAKE_TORCH_NPU_IMPORT_ERROR", "libhccl.so: cannot open shared object file: No such file or directory")
    res = hccl.HcclBackend().probe()
    assert not res.available
    assert res.reason == ("import torch_npu failed: ImportError: libhccl.so: cannot open shared object file: "
                          "No such file or directory")


def test_fake_factory_builds_options_as_torch_npu_does(fake_npu):
    """The exact calls of torch_npu's _new_process_group_hccl_helper: Options(), then
    ProcessGroupHCCL(store, rank, size, options) with is_high_priority_stream False and _timeout."""
    import torch_npu

    store = a_store()
    pg = hccl.HcclBackend().create_process_group(store, 1, 4, TIMEOUT)
    ctor = torch_npu._C._distributed_c10d.ProcessGroupHCCL
    assert isinstance(pg, ctor)
    calls = _calls({"ProcessGroupHCCL.Options", "ProcessGroupHCCL"})
    assert [c[0] for c in calls] == ["ProcessGroupHCCL.Options", "ProcessGroupHCCL"]
    (_, (got_store, rank, size, options), _) = calls[1]
    assert (got_store, rank, size) == (store, 1, 4)
    assert isinstance(options, ctor.Options)
    assert options._timeout == TIMEOUT and options.is_high_priority_stream is False
    assert (pg.rank(), pg.size()) == (1, 4)


def test_fake_factory_refuses_bad_arguments_before_the_vendor(fake_npu):
    b = hccl.HcclBackend()
    with pytest.raises(VcgaConfigError, match="rank"):
        b.create_process_group(a_store(), 4, 4, TIMEOUT)
    with pytest.raises(VcgaConfigError, match="timeout"):
        b.create_process_group(a_store(), 0, 4, 30)
    assert _calls({"ProcessGroupHCCL"}) == []


def test_fake_factory_wraps_the_vendor_error(fake_npu):
    with pytest.raises(VcgaBackendUnavailable, match=r"ProcessGroupHCCL\(rank=0, size=2\) failed: TypeError"):
        hccl.HcclBackend().create_process_group(object(), 0, 2, TIMEOUT)


def test_factory_without_torch_npu_says_why():
    with pytest.raises(VcgaBackendUnavailable, match="module torch_npu is not installed"):
        hccl.HcclBackend().create_process_group(a_store(), 0, 1, TIMEOUT)


def test_fake_accelerator_maps_the_contract_onto_torch_npu(fake_npu, monkeypatch):
    """The Accelerator calls torch.npu exactly as torch.cuda would be called (device() itself needs
    the real PrivateUse1 rename and is checked in the subprocess test below)."""
    import torch_npu

    monkeypatch.setenv("VCGA_FAKE_NPU_COUNT", "4")
    acc = hccl.HcclBackend().accelerator()
    assert (acc.device_type, acc.visible_devices_env) == ("npu", "ASCEND_RT_VISIBLE_DEVICES")
    assert acc.is_available() and acc.device_count() == 4
    acc.set_device(2)
    assert acc.current_device() == 2
    torch.npu._allocate(3 << 20)
    stats = acc.memory_stats()
    assert (stats.allocated, stats.reserved, stats.peak_allocated, stats.total) == (3 << 20, 6 << 20, 3 << 20, 64 << 30)
    acc.manual_seed(7)
    state = acc.get_rng_state(1)
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    acc.set_rng_state(state, 3)
    assert torch.equal(acc.get_rng_state(3), state)
    with pytest.raises(TypeError, match="CPU torch.uint8"):
        acc.set_rng_state(state.float(), 0)
    stream = acc.new_stream(1)
    assert stream.device_index == 1
    event = acc.new_event(enable_timing=True)
    event.record(stream)
    assert event.query()
    acc.synchronize()
    with pytest.raises(IndexError, match="npu device index 4 is out of range: 4 device"):
        acc.set_device(4)
    assert acc.supported_dtypes() >= {"bfloat16", "float64", "float8_e4m3fn", "complex128"}
    named = [(c[0], c[1], c[2]) for c in torch_npu._fake_calls
             if c[0] in ("set_device", "manual_seed_all", "get_rng_state", "set_rng_state", "Stream", "Event",
                         "synchronize", "memory_allocated", "memory_reserved", "max_memory_allocated",
                         "get_device_properties")]
    assert named == [
        ("set_device", (2,), {}),
        ("memory_allocated", (2,), {}), ("memory_reserved", (2,), {}), ("max_memory_allocated", (2,), {}),
        ("get_device_properties", (2,), {}),
        ("manual_seed_all", (7,), {}),
        ("get_rng_state", (), {"device": 1}),
        ("set_rng_state", (state,), {"device": 3}),
        ("get_rng_state", (), {"device": 3}),
        ("Stream", (), {"device": 1, "priority": 0}),
        ("Event", (), {"enable_timing": True, "blocking": False, "interprocess": False}),
        ("synchronize", (2,), {}),
    ]


def test_fake_to_host_casts_private_format_first(fake_npu):
    """A FRACTAL_NZ tensor is cast to ND on the NPU (npu_format_cast(t, 2)) before the copy."""
    import torch_npu
    from vcga_fake_device import FakeDeviceTensor

    values = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    t = FakeDeviceTensor(values.t(), "npu", torch_npu._fake_calls, npu_format=int(torch_npu.Format.FRACTAL_NZ))
    torch_npu._fake_calls.clear()
    host = hccl.vcga_tensor_to_host(t)
    assert host.device.type == "cpu" and host.dtype == torch.float16 and host.is_contiguous()
    assert torch.equal(host, values.t())
    names = [(c[0], c[1][1] if c[0] == "npu_format_cast" else c[2].get("npu_format")) for c in torch_npu._fake_calls]
    assert names == [("Tensor.detach", None), ("get_npu_format", None), ("npu_format_cast", 2),
                     ("Tensor.detach", None), ("Tensor.cpu", 2)]


@pytest.mark.parametrize("fmt, base", [(3, 0), (4, 0), (27, 30), (33, 30), (12, 2)])
def test_fake_to_host_casts_each_private_format_to_its_base(fake_npu, fmt, base):
    import torch_npu
    from vcga_fake_device import FakeDeviceTensor

    t = FakeDeviceTensor(torch.ones(2, 3, 4, 5), "npu", torch_npu._fake_calls, npu_format=fmt)
    hccl.vcga_tensor_to_host(t)
    assert [c[1][1] for c in _calls({"npu_format_cast"})] == [base]


def test_fake_to_host_leaves_base_formats_alone(fake_npu):
    import torch_npu
    from vcga_fake_device import FakeDeviceTensor

    t = FakeDeviceTensor(torch.ones(2, 3), "npu", torch_npu._fake_calls, npu_format=int(torch_npu.Format.ND))
    assert torch.equal(hccl.vcga_tensor_to_host(t), torch.ones(2, 3))
    assert _calls({"npu_format_cast"}) == []


def test_to_host_ignores_other_devices():
    assert hccl.vcga_tensor_to_host(torch.ones(2)) is None


def test_vendor_env_maps_the_unified_config():
    env = hccl.HcclBackend().vendor_env(load_config(env={
        "VCGA_TIMEOUT": "300", "VCGA_BUFFER_SIZE_MB": "64", "VCGA_DETERMINISTIC": "1", "VCGA_VISIBLE_DEVICES": "4,5"}))
    assert env == {"HCCL_EXEC_TIMEOUT": "300", "HCCL_CONNECT_TIMEOUT": "300", "TORCH_HCCL_BLOCKING_WAIT": "1",
                   "HCCL_BUFFSIZE": "64", "HCCL_DETERMINISTIC": "true", "ASCEND_RT_VISIBLE_DEVICES": "4,5"}


def test_vendor_env_maps_the_network_section():
    env = hccl.HcclBackend().vendor_env(load_config(env={
        "VCGA_NETWORK_INTERFACE": "eth1", "VCGA_NETWORK_TRAFFIC_CLASS": "100", "VCGA_NETWORK_SERVICE_LEVEL": "0"}))
    assert (env["HCCL_SOCKET_IFNAME"], env["HCCL_RDMA_TC"], env["HCCL_RDMA_SL"]) == ("=eth1", "100", "0")


@pytest.mark.parametrize("timeout_s, exec_s, connect_s", [(0.5, "1", "120"), (30, "30", "120"), (90.2, "91", "120"),
                                                          (9000, "9000", "7200")])
def test_vendor_env_keeps_hccl_timeouts_in_their_ranges(timeout_s, exec_s, connect_s):
    env = hccl.HcclBackend().vendor_env(load_config(env={"VCGA_TIMEOUT": str(timeout_s)}))
    assert (env["HCCL_EXEC_TIMEOUT"], env["HCCL_CONNECT_TIMEOUT"]) == (exec_s, connect_s)
    assert "HCCL_BUFFSIZE" not in env and "HCCL_DETERMINISTIC" not in env and "ASCEND_RT_VISIBLE_DEVICES" not in env


def test_fake_npu_smi_topology(monkeypatch, tmp_path):
    """A FAKE npu-smi printing a recorded `npu-smi info -t topo` matrix."""
    fake_tool(monkeypatch, tmp_path, "npu-smi", NPU_SMI_TOPO)
    topo = hccl.HcclBackend().topology()
    assert (tmp_path / "npu-smi.args").read_text().strip() == "info -t topo"
    assert topo.source == "npu-smi info -t topo" and topo.device_count == 8
    assert topo.matrix[0][0] == "X" and topo.matrix[0][7] == "HCCS" and topo.matrix[5][5] == "X"


def test_fake_npu_smi_timeout_gives_unknown(monkeypatch, tmp_path):
    fake_tool(monkeypatch, tmp_path, "npu-smi", NPU_SMI_TOPO, sleep_s=5)
    b = hccl.HcclBackend()
    b.topology_timeout_s = 0.5
    topo = b.topology()
    assert topo.source == "unknown" and "did not finish within 0.5 s" in topo.detail


def test_topology_without_npu_smi_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    topo = hccl.HcclBackend().topology()
    assert (topo.source, topo.detail) == ("unknown", "npu-smi not found on PATH")


def _run_with_fake(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full.update(PYTHONPATH=fake_pythonpath("torch_npu"), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_fake_accelerator_devices_in_a_process_where_torch_npu_registered_npu():
    """Fake torch_npu renames PrivateUse1 to "npu" for real here (a fresh process), so the
    Accelerator's torch.device values are checked too."""
    code = (
        "import json, torch\n"
        "from vcga.plugins.hccl import HcclBackend\n"
        "b = HcclBackend(); assert b.probe().available\n"
        "a = b.accelerator(); a.set_device(1)\n"
        "print(json.dumps([str(a.device()), str(a.device(5)), a.device(0).type]))\n")
    proc = _run_with_fake(code, VCGA_FAKE_NPU_COUNT="6")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["npu:1", "npu:5", "npu"]


def test_vcga_info_shows_hccl_available_with_the_fake():
    """`vcga info --json` with the FAKE torch_npu on the path: hccl available, devices, versions."""
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full.update(PYTHONPATH=fake_pythonpath("torch_npu"), VCGA_FAKE_NPU_COUNT="8")
    proc = subprocess.run([str(VENV_BIN / "vcga"), "info", "--json"], capture_output=True, text=True, env=full,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    b = {x["name"]: x for x in data["backends"]}["hccl"]
    assert b["available"] and b["device_count"] == 8
    assert b["versions"]["torch_npu"] == "2.13.0.post1" and b["versions"]["cann"] == "8.3.RC1"
    assert data["selected_backend"] == "hccl"


def test_import_vcga_and_plugins_never_imports_torch_npu():
    """Even with torch_npu importable (the fake), importing vcga and its plugins, listing backends
    and building tables must not import it -- only probe() may."""
    code = (
        "import sys, vcga\n"
        "from vcga.plugin_manager import get_plugin_manager\n"
        "pm = get_plugin_manager(); recs = pm.backend_records()\n"
        "[r.backend.capabilities() for r in recs]\n"
        "assert 'torch_npu' not in sys.modules, 'imported early'\n"
        "pm.backend_record('hccl').probe()\n"
        "assert 'torch_npu' in sys.modules\n"
        "print('ok')\n")
    proc = _run_with_fake(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_fake_warning_free_probe_logs_nothing(fake_npu, caplog):
    with caplog.at_level(logging.WARNING):
        assert hccl.HcclBackend().probe().available
    assert caplog.records == []


def test_timedelta_passes_through_unchanged(fake_npu):
    pg = hccl.HcclBackend().create_process_group(a_store(), 0, 1, timedelta(milliseconds=1500))
    assert pg.options._timeout == timedelta(milliseconds=1500)


def test_accelerator_without_torch_npu_says_why():
    with pytest.raises(VcgaBackendUnavailable, match="module torch_npu is not installed"):
        hccl.HcclBackend().accelerator()
