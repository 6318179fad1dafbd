"""The mlu plugin against a FAKE torch_mlu (tests/fakes/mlu) that follows Cambricon/torch_mlu's API.

Every test here is fake-backed: no Cambricon hardware exists on this machine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import VENV_BIN
from vendor_fakes import CNMON_TOPO, TIMEOUT, a_store, fake_pythonpath, fake_tool, installed_fake

from vcga.config import load_config
from vcga.errors import VcgaBackendUnavailable
from vcga.plugins import mlu


@pytest.fixture
def fake_mlu(monkeypatch):
    """The FAKE torch_mlu, importable in this process."""
    with installed_fake(monkeypatch, "torch_mlu") as registered:
        yield registered


def _calls(names):
    import torch_mlu

    return [c for c in torch_mlu._fake_calls if c[0] in names]


def test_fake_probe_reports_devices_and_versions(fake_mlu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_MLU_COUNT", "4")
    res = mlu.MluBackend().probe()
    assert res.available and res.device_count == 4
    assert res.reason == "4 MLU device(s), torch_mlu 1.22.0-torch2.4.0, CNCL 1.24.1"
    assert dict(res.versions) == {"torch": torch.__version__, "torch_mlu": "1.22.0-torch2.4.0", "cncl": "1.24.1"}
    assert fake_mlu == {"rename_privateuse1_backend": ["mlu"], "register_device_module": ["mlu"],
                        "register_backend": [("cncl", False, ("mlu",))]}


def test_fake_probe_zero_devices(fake_mlu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_MLU_COUNT", "0")
    res = mlu.MluBackend().probe()
    assert (res.available, res.reason) == (False, "no MLU device is visible (torch.mlu.device_count() == 0)")


def test_fake_probe_driver_error(fake_mlu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_MLU_DRIVER_ERROR", "CNRT error: cnrtGetDeviceCount failed (632046)")
    res = mlu.MluBackend().probe()
    assert res.reason == "MLU driver error: RuntimeError: CNRT error: cnrtGetDeviceCount failed (632046)"


def test_fake_probe_import_error_text(fake_mlu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_TORCH_MLU_IMPORT_ERROR", "libcnrt.so: cannot open shared object file: No such file or directory")
    res = mlu.MluBackend().probe()
    assert res.reason == ("import torch_mlu failed: ImportError: libcnrt.so: cannot open shared object file: "
                          "No such file or directory")


def test_fake_factory_calls_the_constructor_torch_mlu_registers(fake_mlu):
    """ProcessGroupCNCL(store, rank, size, timeout): the call torch_mlu/mlu/cncl.py's creator makes;
    the fake builds Options(is_high_priority_stream=False) with that timeout, as the C++ does."""
    import torch_mlu

    store = a_store()
    pg = mlu.MluBackend().create_process_group(store, 2, 3, TIMEOUT)
    assert isinstance(pg, torch_mlu._MLUC.ProcessGroupCNCL)
    calls = _calls({"ProcessGroupCNCL"})
    assert len(calls) == 1 and calls[0][1] == (store, 2, 3, TIMEOUT)
    assert pg.options._timeout == TIMEOUT and pg.options.is_high_priority_stream is False


def test_fake_factory_wraps_the_vendor_error(fake_mlu):
    with pytest.raises(VcgaBackendUnavailable, match=r"ProcessGroupCNCL\(rank=0, size=1\) failed: TypeError"):
        mlu.MluBackend().create_process_group("not a store", 0, 1, TIMEOUT)


def test_factory_without_torch_mlu_says_why():
    with pytest.raises(VcgaBackendUnavailable, match="module torch_mlu is not installed"):
        mlu.MluBackend().create_process_group(a_store(), 0, 1, TIMEOUT)


def test_fake_accelerator_maps_the_contract_onto_torch_mlu(fake_mlu, monkeypatch):
    monkeypatch.setenv("VCGA_FAKE_MLU_COUNT", "2")
    acc = mlu.MluBackend().accelerator()
    assert (acc.device_type, acc.visible_devices_env) == ("mlu", "MLU_VISIBLE_DEVICES")
    assert acc.device_count() == 2
    acc.set_device(1)
    torch.mlu._allocate(1024)
    assert acc.memory_stats().allocated == 1024 and acc.memory_stats(0).allocated == 0
    acc.manual_seed(3)
    assert torch.equal(acc.get_rng_state(0), acc.get_rng_state(0))
    assert acc.current_stream() is not None
    with pytest.raises(IndexError, match="restricted by MLU_VISIBLE_DEVICES"):
        acc.synchronize(2)
    # The MLU holds 64-bit floats as 32-bit on chip: not "held without loss".
    assert "float64" not in acc.supported_dtypes() and "complex128" not in acc.supported_dtypes()
    assert {"bfloat16", "int16", "complex64"} <= acc.supported_dtypes()
    assert [c[0] for c in _calls({"manual_seed_all", "set_device"})] == ["set_device", "manual_seed_all"]


def test_fake_to_host_fp64_caveat_is_logged_once(fake_mlu, caplog):
    """A float64 MLU tensor comes back float64, contiguous, with the values the device holds; the
    fp32-on-chip caveat is logged once per process."""
    import torch_mlu
    from vcga_fake_device import FakeDeviceTensor

    mlu._fp64_warned.clear()
    values = torch.linspace(0, 1, 12, dtype=torch.float64).reshape(4, 3)
    with caplog.at_level(logging.WARNING, logger="vcga.plugins.mlu"):
        a = mlu.vcga_tensor_to_host(FakeDeviceTensor(values[:, ::2], "mlu", torch_mlu._fake_calls))
        b = mlu.vcga_tensor_to_host(FakeDeviceTensor(values, "mlu", torch_mlu._fake_calls))
    assert a.dtype == torch.float64 and a.is_contiguous() and torch.equal(a, values[:, ::2])
    assert torch.equal(b, values)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "float64 tensor holds float32 precision only" in warnings[0]


def test_fake_to_host_float32_is_silent(fake_mlu, caplog):
    import torch_mlu
    from vcga_fake_device import FakeDeviceTensor

    mlu._fp64_warned.clear()
    with caplog.at_level(logging.WARNING, logger="vcga.plugins.mlu"):
        out = mlu.vcga_tensor_to_host(FakeDeviceTensor(torch.ones(3), "mlu", torch_mlu._fake_calls))
    assert torch.equal(out, torch.ones(3)) and caplog.records == []


def test_vendor_env_maps_the_unified_config():
    env = mlu.MluBackend().vendor_env(load_config(env={
        "VCGA_TIMEOUT": "120", "VCGA_BUFFER_SIZE_MB": "64", "VCGA_DETERMINISTIC": "1", "VCGA_VISIBLE_DEVICES": "0,3"}))
    # buffer size and determinism have no CNCL switch in the sources: not translated (docs/vendor-env.md)
    assert env == {"TORCH_CNCL_BLOCKING_WAIT": "1", "MLU_VISIBLE_DEVICES": "0,3"}
    # nor the network section: no CNCL document names its variables (docs/vendor-env.md)
    assert mlu.MluBackend().vendor_env(load_config(env={
        "VCGA_NETWORK_INTERFACE": "eth1", "VCGA_NETWORK_TRAFFIC_CLASS": "104"})) == {"TORCH_CNCL_BLOCKING_WAIT": "1"}


def test_fake_cnmon_topology(monkeypatch, tmp_path):
    """A FAKE cnmon printing a `cnmon topo -m` matrix."""
    fake_tool(monkeypatch, tmp_path, "cnmon", CNMON_TOPO)
    topo = mlu.MluBackend().topology()
    assert (tmp_path / "cnmon.args").read_text().strip() == "topo -m"
    assert topo.source == "cnmon topo -m" and topo.device_count == 4
    assert topo.matrix == [["X", "MLK", "MUL", "CPU"], ["MLK", "X", "MUL", "CPU"],
                           ["MUL", "MUL", "X", "MLK"], ["CPU", "CPU", "MLK", "X"]]


def test_fake_cnmon_failure_gives_unknown(monkeypatch, tmp_path):
    fake_tool(monkeypatch, tmp_path, "cnmon", "", exit_code=3, stderr="cnmon: no MLU device found\n")
    topo = mlu.MluBackend().topology()
    assert topo.source == "unknown"
    assert topo.detail == "`cnmon topo -m` exited with status 3: cnmon: no MLU device found"


def test_vcga_info_shows_mlu_available_with_the_fake():
    """`vcga info --json` with the FAKE torch_mlu on the path: mlu available, devices, versions."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full.update(PYTHONPATH=fake_pythonpath("torch_mlu"), VCGA_FAKE_MLU_COUNT="4")
    proc = subprocess.run([str(VENV_BIN / "vcga"), "info", "--json"], capture_output=True, text=True, env=full,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    b = {x["name"]: x for x in json.loads(proc.stdout)["backends"]}["mlu"]
    assert b["available"] and b["device_count"] == 4
    assert b["versions"] == {"torch": torch.__version__, "torch_mlu": "1.22.0-torch2.4.0", "cncl": "1.24.1"}


def test_fake_accelerator_devices_in_a_process_where_torch_mlu_registered_mlu():
    code = (
        "import json\n"
        "from vcga.plugins.mlu import MluBackend\n"
        "b = MluBackend(); assert b.probe().available\n"
        "a = b.accelerator()\n"
        "print(json.dumps([str(a.device()), str(a.device(3))]))\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full.update(PYTHONPATH=fake_pythonpath("torch_mlu"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["mlu:0", "mlu:3"]


def test_fake_two_vendor_modules_in_one_process_isolate_the_second():
    """Both FAKE vendor modules importable: the first probed (hccl) wins PrivateUse1; the second is
    reported unavailable with torch's own error -- as the real torch_npu and torch_mlu would."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    full.update(PYTHONPATH=fake_pythonpath("torch_npu", "torch_mlu"))
    proc = subprocess.run([str(VENV_BIN / "vcga"), "info", "--json"], capture_output=True, text=True, env=full,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    b = {x["name"]: x for x in json.loads(proc.stdout)["backends"]}
    assert b["hccl"]["available"]
    assert not b["mlu"]["available"]
    assert b["mlu"]["reason"].startswith("import torch_mlu failed: RuntimeError: ")
    assert "npu" in b["mlu"]["reason"]


def test_accelerator_without_torch_mlu_says_why():
    with pytest.raises(VcgaBackendUnavailable, match="module torch_mlu is not installed"):
        mlu.MluBackend().accelerator()
