"""The `vcga` command as a user runs it: --help without torch, info and its JSON, verify."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import VENV_BIN, run_vcga


def test_help_does_not_import_torch():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "vcga", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Usage: vcga" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "vcga.cli" in imported  # the importtime output is what we think it is
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "numpy", "rich", "yaml", "h5py")}
    assert not heavy, heavy


def test_console_script_and_module_agree():
    a = run_vcga("--version")
    b = subprocess.run([sys.executable, "-m", "vcga", "--version"], capture_output=True, text=True, timeout=60)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout


def test_info_json_lists_every_backend_with_reasons():
    r = run_vcga("info", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    b = {x["name"]: x for x in data["backends"]}
    assert b["gloo"]["available"] and b["gloo"]["device_count"] == 1
    for name in ("sim-nccl", "sim-hccl", "sim-cncl"):
        assert b[name]["available"] and b[name]["simulated"]
    assert not b["nccl"]["available"] and "without CUDA" in b["nccl"]["reason"]
    assert not b["hccl"]["available"] and "torch_npu" in b["hccl"]["reason"]
    assert not b["mlu"]["available"] and "torch_mlu" in b["mlu"]["reason"]
    assert b["sim-hccl"]["vendor"] == "huawei" and b["sim-cncl"]["stands_for"] == "cncl"
    assert b["gloo"]["capabilities"]["cells"]["native"] > 0
    assert data["selected_backend"] == "gloo"
    assert all(p["status"] == "loaded" for p in data["plugins"])


def test_info_table_mentions_the_same_facts():
    r = run_vcga("info", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    for word in ("gloo", "sim-hccl", "nccl", "hccl", "mlu", "without CUDA", "torch_npu"):
        assert word in r.stdout


def test_info_reports_a_bad_config_in_one_line():
    r = run_vcga("info", env={"VCGA_TIMEOUT": "never"})
    assert r.returncode != 0
    assert "collective_timeout_s" in r.stderr and "Traceback" not in r.stderr


def _vcga_group_registered() -> bool:
    from vcga.conformance.runner import vcga_group_status

    return vcga_group_status()[0]


@pytest.mark.skipif(not _vcga_group_registered(),
                    reason="plain `vcga verify` certifies through the vcga process group (issue #3), which this "
                           "build does not register yet; tests/test_verify.py covers the native group")
def test_plain_verify_passes_and_prints_a_table():
    """What `make verify` runs: the quick profile on gloo and the simulated mixed-vendor world."""
    r = run_vcga("verify", timeout=400, env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vcga verify summary" in r.stdout and "FAIL" not in r.stdout and " 0 failed" in r.stdout
    for check in ("collectives", "exact-reduce", "random-reduce", "gradients"):
        assert check in r.stdout
