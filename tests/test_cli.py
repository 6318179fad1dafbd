"""The `vcga` command as a user runs it: --help without torch, info and its JSON, verify. The checks of
what a command imports (`python -X importtime`) are all here."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, run_vcga, run_vcga_process

HELPERS = ROOT / "tests" / "helper_plugins"


def test_help_does_not_import_torch():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "vcga", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Usage: vcga" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "vcga.cli" in imported  # the importtime output is what we think it is
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "numpy", "rich", "yaml", "h5py")}
    assert not heavy, heavy


def test_info_plan_does_not_import_torch():
    """The plan is a pure function of the layout (vcga/bridge/plan.py): showing it needs no torch."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "vcga", "info", "--plan", "--json",
                        "--vendors", "nccl:2,hccl:2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [g["backend"] for g in json.loads(r.stdout)["plan"]["groups"]] == ["sim-nccl", "sim-hccl"]
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "vcga.bridge.plan" in imported  # the importtime output is what we think it is
    assert not {m for m in imported if m.split(".")[0] == "torch"}


def test_bench_help_does_not_import_torch():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "vcga", "bench", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--stepfactor" in r.stdout and "--warmup_iters" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "vcga.bench.runner" in imported  # the command was loaded (its options are in the help) ...
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy", "matplotlib")}  # ... without torch


def test_console_script_and_module_agree():
    """The two real processes of this module: the installed console script and ``python -m vcga``
    (every other test runs the command in-process, conftest.run_vcga)."""
    a = run_vcga_process("--version")
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


def test_plain_verify_prints_a_table_and_a_summary_and_runs_the_mixed_world():
    """`vcga verify` as `make verify` runs it -- gloo and a simulated mixed-vendor world -- on a profile
    that keeps a case or two of each family (CI runs the whole quick profile in `make verify`)."""
    r = run_vcga("verify", "--profile", str(HELPERS / "verify_plain_tiny.yaml"), env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vcga verify summary" in r.stdout and "FAIL" not in r.stdout and " 0 failed" in r.stdout
    for check in ("collectives", "exact-reduce", "random-reduce", "gradients", "mixed-vendors"):
        assert check in r.stdout
    assert "sim:nccl:1,hccl:1" in r.stdout  # the mixed world is in the table
    assert "not verified" not in r.stdout  # the mixed world ran through the bridge, it was not skipped


# ---------------------------------------------------------------------------------------------------
# vcga info --plan (the mixed-vendor plan; docs/bridge.md)
# ---------------------------------------------------------------------------------------------------

def test_info_plan_json_for_two_and_three_simulated_vendors():
    r = run_vcga("info", "--plan", "--json", "--vendors", "nccl:2,hccl:2", "--nodes", "2")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["plan"]
    assert [(g["backend"], g["ranks"], g["leader"], g["nodes"]) for g in p["groups"]] == [
        ("sim-nccl", [0, 1], 0, ["node0"]), ("sim-hccl", [2, 3], 2, ["node1"])]
    assert p["shard_peers"] == [[0, 2], [1, 3]]
    assert json.loads(r.stdout)["shard_exchange"] == ["gloo", "gloo"]  # each set spans the two nodes
    sizes = list(p["collectives"]["all_reduce"])
    assert sizes[0] == "4 KiB" and sizes[-1] == "64 MiB" and len(sizes) == 8
    routes = {x["dtype"]: x for x in p["routes"]}
    assert routes["float16"]["via"] == "upcast:float32" and routes["bfloat16"]["reduced_as"] == "float32"
    assert [g["route"] for g in routes["float64"]["groups"]] == ["library", "host"] and routes["float64"]["leader_only"]

    r = run_vcga("info", "--plan", "--json", env={"VCGA_SIM_VENDORS": "nccl:1,hccl:2,cncl:1",
                                                   "VCGA_BRIDGE_ALGORITHM": "bandwidth"})
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["plan"]
    assert p["algorithm"] == "bandwidth" and p["leaders"] == [0, 1, 3]
    assert json.loads(r.stdout)["shard_exchange"] == ["shared memory"]  # the leaders, all on this host
    r = run_vcga("info", "--plan", "--json", env={"VCGA_SIM_VENDORS": "nccl:2,hccl:2", "VCGA_BRIDGE_SHM": "0"})
    assert r.returncode == 0 and json.loads(r.stdout)["shard_exchange"] == ["gloo", "gloo"], r.stderr
    assert set(p["collectives"]["all_reduce"].values()) == {"leader"}  # unequal groups: leader at every size
    cncl = {x["dtype"]: x for x in p["routes"]}["float64"]["groups"][2]
    assert (cncl["backend"], cncl["route"], cncl["library_via"]) == ("sim-cncl", "library", "gather_then_reduce")


def test_info_plan_shows_link_classes_and_what_measured_figures_choose(tmp_path):
    """Two nodes: the steps between vendor groups are cross-node. With --figures (α–β per step, as a
    group measures them: here a 1 Gbit/s link shared by two shard-peer sets), the algorithm they
    predict fastest at each size: the leaders while the fixed cost dominates, the shard peers in
    parallel (bandwidth, pipelined) for large messages."""
    from vcga.bridge.cost import AlphaBeta, LinkFigures

    fast = AlphaBeta(100e-6, 2e9)
    fig = LinkFigures(groups=[dict.fromkeys(("reduce_bcast", "all_reduce", "rsag_collective", "rsag_p2p"), fast)] * 2,
                      bridge={"leaders": AlphaBeta(500e-6, 125e6), "all_sets": AlphaBeta(500e-6, 62.5e6)},
                      classes={"bridge": "cross-node"}, exchange="gloo", group_size=2, equal_groups=True,
                      min_segment_bytes=256 << 10, max_segments=16)
    f = tmp_path / "links.json"
    f.write_text(json.dumps({"figures": fig.to_json(), "choice": {}}))  # a group's describe()["calibration"]
    args = ["info", "--plan", "--vendors", "nccl:2,hccl:2", "--nodes", "2", "--figures", str(f)]
    r = run_vcga(*args, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["link_classes"] == {"sim-nccl": "in-vendor, one node", "sim-hccl": "in-vendor, one node",
                                 "bridge": "cross-node"}
    choice = d["figures"]["choice"]
    assert choice["4 KiB"]["algorithm"] == "leader" and choice["64 MiB"]["algorithm"] == "bandwidth"
    assert set(choice["1 MiB"]["predicted_s"]) == {"leader", "bandwidth", "replicated"}
    r = run_vcga(*args)
    assert r.returncode == 0 and "between vendor groups: cross-node" in r.stdout, r.stderr
    assert "all_sets α 500 µs β 62 MB/s" in r.stdout and "64 MiB  bandwidth" in r.stdout, r.stdout
    f.write_text("{}")
    r = run_vcga(*args)
    assert r.returncode == 2 and "not a file of bridge link figures" in r.stderr and "Traceback" not in r.stderr
    f.write_text(json.dumps(fig.to_json()))
    r = run_vcga("info", "--plan", "--vendors", "nccl:1,hccl:2,cncl:1", "--figures", str(f))
    assert r.returncode == 2 and "unequal" in r.stderr, r.stderr


def test_info_plan_text_is_the_sample_in_the_docs():
    """docs/bridge.md shows this command's output literally; the doc must follow the code."""
    from conftest import ROOT

    cmd = ["info", "--plan", "--vendors", "nccl:2,hccl:2", "--nodes", "1"]
    r = run_vcga(*cmd)
    assert r.returncode == 0, r.stderr
    doc = (ROOT / "docs" / "bridge.md").read_text()
    start = doc.index("$ vcga " + " ".join(cmd) + "\n")
    block = doc[start:doc.index("```", start)].split("\n", 1)[1]
    assert block == r.stdout


def test_info_plan_single_backend_and_bad_layouts_in_one_line():
    r = run_vcga("info", "--plan", "--vendors", "hccl:2")
    assert r.returncode == 0 and "no bridge" in r.stdout
    for args, words in [(("--vendors", "foo:2"), "sim_vendors"), (("--vendors", "nccl:2,hccl:1", "--nodes", "2"), "--nodes"),
                        ((), "no layout to plan"), (("--backends", "nccl:2,tpu:2"), "tpu")]:
        r = run_vcga("info", "--plan", *args)
        assert r.returncode != 0, (args, r.stdout, r.stderr)
        assert words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = run_vcga("info", "--nodes", "2")
    assert r.returncode == 2 and "go with --plan" in r.stderr
