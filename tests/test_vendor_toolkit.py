"""vcga.vendor (the toolkit the accelerator plugins share) and the three vendor backends here, where
no vendor stack is installed: every reason exact, nothing raised."""

from __future__ import annotations

import sys
import types
from datetime import timedelta

import pytest
import torch
from vendor_fakes import CNMON_TOPO, FAKES, NPU_SMI_TOPO, NVIDIA_SMI_TOPO, fake_tool

from vcga.cli.info import collect
from vcga.errors import VcgaConfigError
from vcga.vendor import (
    DeviceModuleAccelerator,
    check_group_args,
    import_vendor_module,
    parse_link_matrix,
    run_tool,
    to_host_contiguous,
    topology_from_tool,
)

# --- the real situation: no vendor stack -----------------------------------------------------------


def test_vcga_info_here_shows_the_three_vendor_backends_unavailable_with_their_exact_reasons():
    data = collect()
    b = {x["name"]: x for x in data["backends"]}
    assert (b["nccl"]["available"], b["nccl"]["reason"]) == (False, f"torch {torch.__version__} was built without CUDA")
    assert (b["hccl"]["available"], b["hccl"]["reason"]) == (
        False, "module torch_npu is not installed (install torch-npu matching your torch and your Ascend CANN toolkit)")
    assert (b["mlu"]["available"], b["mlu"]["reason"]) == (
        False, "module torch_mlu is not installed (install torch_mlu from Cambricon's Neuware channel, "
               "matching your torch and CNToolkit)")
    for name in ("nccl", "hccl", "mlu"):
        assert b[name]["device_count"] == 0 and b[name]["versions"] == {}
        assert b[name]["capabilities"]["cells"]["native"] > 0  # tables are there without the vendor stack
    assert data["selected_backend"] == "gloo"


# --- parse_link_matrix -----------------------------------------------------------------------------


def test_parse_nvidia_smi_skips_nic_and_affinity_columns():
    devices, matrix = parse_link_matrix(NVIDIA_SMI_TOPO, "GPU")
    assert devices == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert [row[i] for i, row in enumerate(matrix)] == ["X"] * 4
    assert matrix[2][0] == "NV18"


def test_parse_npu_smi_and_cnmon():
    assert parse_link_matrix(NPU_SMI_TOPO, "NPU")[0] == [f"NPU{i}" for i in range(8)]
    assert parse_link_matrix(CNMON_TOPO, "MLU")[1][0] == ["X", "MLK", "MUL", "CPU"]


def test_parse_single_device_and_ansi_colours():
    text = "\x1b[4m\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \t0-47\t0\t\tN/A\n"
    assert parse_link_matrix(text, "GPU") == (["GPU0"], [["X"]])


@pytest.mark.parametrize("text", ["", "No devices were found\n", "\tGPU0\tGPU1\nGPU0\t X \n", NPU_SMI_TOPO])
def test_parse_returns_empty_on_anything_else(text):
    assert parse_link_matrix(text, "GPU") == ([], [])


# --- run_tool / topology_from_tool -----------------------------------------------------------------


def test_run_tool_missing_failing_and_slow(monkeypatch, tmp_path):
    """FAKE tools on PATH: a failing one and a slow one; a missing one."""
    assert run_tool(["vcga-no-such-tool"], 1).error == "vcga-no-such-tool not found on PATH"
    fake_tool(monkeypatch, tmp_path, "failing-tool", "", exit_code=9, stderr="boom\nmore\n")
    assert run_tool(["failing-tool", "-x"], 5).error == "`failing-tool -x` exited with status 9: boom"
    fake_tool(monkeypatch, tmp_path, "slow-tool", "late", sleep_s=10)
    out = run_tool(["slow-tool"], 0.3)
    assert (out.stdout, out.error) == ("", "`slow-tool` did not finish within 0.3 s")


def test_topology_from_a_tool_without_a_matrix_is_unknown(monkeypatch, tmp_path):
    """A FAKE tool that prints no matrix."""
    fake_tool(monkeypatch, tmp_path, "npu-smi", "Error: no device\n")
    topo = topology_from_tool(["npu-smi", "info", "-t", "topo"], "NPU", 5)
    assert (topo.source, topo.detail) == ("unknown", "`npu-smi info -t topo` printed no NPU<n> link matrix")


# --- import_vendor_module --------------------------------------------------------------------------


def test_import_vendor_module_reasons(monkeypatch, tmp_path):
    assert import_vendor_module("vcga_no_such_vendor", "pip install it") == (
        None, "module vcga_no_such_vendor is not installed (pip install it)")
    (tmp_path / "vcga_broken_vendor.py").write_text("raise OSError('libascendcl.so: cannot open shared object file')\n")
    (tmp_path / "vcga_exiting_vendor.py").write_text("raise SystemExit('vendor gave up')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_vendor_module("vcga_broken_vendor", "") == (
        None, "import vcga_broken_vendor failed: OSError: libascendcl.so: cannot open shared object file")
    assert import_vendor_module("vcga_exiting_vendor", "")[1] == "import vcga_exiting_vendor failed: SystemExit: vendor gave up"
    fake = types.ModuleType("vcga_specless_vendor")  # __spec__ None: find_spec raises ValueError
    monkeypatch.setitem(sys.modules, "vcga_specless_vendor", fake)
    assert import_vendor_module("vcga_specless_vendor", "") == (fake, "")


# --- DeviceModuleAccelerator -----------------------------------------------------------------------


@pytest.fixture
def fake_module(monkeypatch):
    """A FAKE torch.cuda-like device module with 3 devices."""
    monkeypatch.syspath_prepend(str(FAKES / "common"))
    from vcga_fake_device import make_device_module

    mod = types.ModuleType("fake_xpu")
    make_device_module(mod, "xpu", "VCGA_FAKE_XPU_COUNT", "VCGA_FAKE_XPU_ERROR", 3, "Fake", [])
    yield mod
    sys.modules.pop("vcga_fake_device", None)


def test_accelerator_checks_indices_before_the_vendor(fake_module):
    acc = DeviceModuleAccelerator("xpu", "ZE_AFFINITY_MASK", ["float32"], module=lambda: fake_module)
    with pytest.raises(TypeError, match="an int"):
        acc.set_device(True)
    with pytest.raises(IndexError, match="xpu device index -1 is out of range: 3 device"):
        acc.memory_stats(-1)
    assert acc.device(2) == torch.device("xpu", 2)
    assert acc.supported_dtypes() == frozenset({"float32"})


def test_accelerator_satisfies_the_contract_protocol(fake_module):
    from vcga.contract import Accelerator, EventLike, StreamLike

    acc = DeviceModuleAccelerator("xpu", None, [], module=lambda: fake_module)
    assert isinstance(acc, Accelerator)
    assert isinstance(acc.new_stream(), StreamLike) and isinstance(acc.new_event(), EventLike)


# --- check_group_args, to_host_contiguous ------------------------------------------------------------


@pytest.mark.parametrize("rank, size, timeout, key", [
    (0, 0, timedelta(seconds=1), "world_size"), (2, 2, timedelta(seconds=1), "rank"),
    (True, 2, timedelta(seconds=1), "rank"), (0, 2, timedelta(0), "timeout"), (0, 2, 5.0, "timeout")])
def test_check_group_args(rank, size, timeout, key):
    with pytest.raises(VcgaConfigError) as e:
        check_group_args(rank, size, timeout)
    assert e.value.key == key


def test_to_host_contiguous_materialises_views_and_lazy_bits():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    out = to_host_contiguous(z.conj())
    assert not out.is_conj() and torch.equal(out.view(torch.float32), torch.tensor([1.0, -2.0, 3.0, 4.0]))
    neg = to_host_contiguous(torch._neg_view(torch.tensor([1.0, -2.0])))
    assert not neg.is_neg() and neg.tolist() == [-1.0, 2.0]
    base = torch.arange(6.0, requires_grad=True).reshape(2, 3)
    t = to_host_contiguous(base.t())
    assert t.is_contiguous() and not t.requires_grad and torch.equal(t, base.detach().t())
