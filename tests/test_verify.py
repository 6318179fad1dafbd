"""`vcga verify`: bounds, test data, profiles, reports, the runner's deadlines, and deliberately
broken backends each caught by the check meant for it.

The end-to-end tests run the installed `vcga` command on real gloo worlds (2-3 processes each)
with the small profile tests/helper_plugins/verify_tiny.yaml, so each takes seconds.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_vcga

from vcga.contract import ReduceOp
from vcga.errors import VcgaConfigError

HELPERS = ROOT / "tests" / "helper_plugins"
TINY = str(HELPERS / "verify_tiny.yaml")


@pytest.fixture(autouse=True)
def _rank_logs_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing `vcga verify` keeps its rank logs; put them under pytest's tmp, not /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _env(*plugins: str) -> dict[str, str]:
    return {"VCGA_PLUGINS": ",".join(plugins), "COLUMNS": "250",
            "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")])}


def _verify(*args: str, plugins: tuple[str, ...] = ("broken_backends",), timeout: float = 240):
    return run_vcga("verify", "--profile", TINY, *args, env=_env(*plugins), timeout=timeout)


def _failures(stdout: str) -> list[str]:
    return [ln.strip() for ln in stdout.splitlines() if ln.strip().startswith("FAIL ")]


# ---------------------------------------------------------------------------------------------------
# Bounds and data (no processes)
# ---------------------------------------------------------------------------------------------------


def test_gamma_and_unit_roundoff_follow_higham():
    from vcga.conformance import bounds

    assert bounds.unit_roundoff("float16") == 2.0**-11
    assert bounds.unit_roundoff("bfloat16") == 2.0**-8
    assert bounds.unit_roundoff("float32") == 2.0**-24
    assert bounds.unit_roundoff("float64") == 2.0**-53
    u = 2.0**-24
    assert bounds.gamma(3, u) == 3 * u / (1 - 3 * u)
    assert bounds.gamma(0, u) == 0.0 and bounds.sum_bound(10.0, 1, "float32") == 0.0  # one rank: exact
    assert bounds.gamma(2**11, 2.0**-11) == math.inf  # no bound exists
    assert bounds.ulp(1.0, "float16") == 2.0**-10 and bounds.ulp(3.0, "bfloat16") == 2.0**-6
    assert bounds.ulp(0.0, "float32") == bounds.tiny("float32") == 2.0**-149
    with pytest.raises(ValueError, match="not a floating dtype"):
        bounds.unit_roundoff("int32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"])
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "PREMUL_SUM"])
def test_exact_data_gives_the_same_bits_in_every_order(dtype, op):
    """The premise of exact-reduce: every summation order, rounding each partial result to the
    dtype, gives exact_reduce's answer (4 ranks, all 24 orders)."""
    from vcga import dtypes
    from vcga.conformance import data

    op = ReduceOp(op)
    if op not in data.ops_for(dtype):
        pytest.skip(f"{op} has no defined value on {dtype}")
    ws, n = 4, 300
    xs = [data.exact_input(op, dtype, n, r, ws) for r in range(ws)]
    want = data.exact_reduce(op, xs, dtype, data.PREMUL_FACTOR_EXACT)
    wide = torch.float64 if dtypes.get(dtype).kind == "f" else torch.int64
    for order in itertools.permutations(range(ws)):
        acc = None
        for r in order:
            term = xs[r].to(wide) * (data.PREMUL_FACTOR_EXACT if op is ReduceOp.PREMUL_SUM else 1)
            term = term.to(xs[r].dtype)  # fl(f * x) in the dtype
            if acc is None:
                acc = term
            elif op is ReduceOp.PRODUCT:
                acc = (acc.to(wide) * term.to(wide)).to(xs[r].dtype)
            else:
                acc = (acc.to(wide) + term.to(wide)).to(xs[r].dtype)
        assert data.same_bits(acc, want), (order, acc[:5], want[:5])


def test_exact_reduce_on_bool_is_the_logical_reduction_for_every_op():
    """bool has no arithmetic: SUM/MAX/BOR are "any", PRODUCT/MIN/BAND "all", BXOR odd parity --
    checked on every combination of three ranks' values; ops without a meaning on bool refuse."""
    from vcga.conformance import data

    combos = list(itertools.product([False, True], repeat=3))
    xs = [torch.tensor([c[r] for c in combos]) for r in range(3)]
    want = {"any": [any(c) for c in combos], "all": [all(c) for c in combos], "odd": [sum(c) % 2 == 1 for c in combos]}
    meaning = {ReduceOp.SUM: "any", ReduceOp.MAX: "any", ReduceOp.BOR: "any", ReduceOp.PRODUCT: "all",
               ReduceOp.MIN: "all", ReduceOp.BAND: "all", ReduceOp.BXOR: "odd"}
    assert set(data.ops_for("bool")) == set(meaning)
    for op, m in meaning.items():
        out = data.exact_reduce(op, xs, "bool")
        assert out.dtype == torch.bool and out.tolist() == want[m], op
    with pytest.raises(ValueError, match="no defined result on bool"):
        data.exact_reduce(ReduceOp.AVG, xs, "bool")


def test_random_reference_bound_holds_for_every_order_and_is_tight():
    """A float16 sum in any order stays within the bound, and the bound is not vacuous: at two
    ranks it is half an ulp of the sum's magnitude, so a result two ulps off fails."""
    from vcga.conformance import data
    from vcga.conformance.base import compare_reference

    for ws in (2, 3, 4):
        xs = [data.random_input(ReduceOp.SUM, "float16", 2000, r, "t") for r in range(ws)]
        ref = data.random_reference(ReduceOp.SUM, xs, "float16")
        for order in itertools.permutations(range(ws)):
            acc = xs[order[0]].clone()
            for r in order[1:]:
                acc = acc + xs[r]  # float16 arithmetic, one rounding per step
            assert compare_reference(acc, ref.value, ref.bound).passed, (ws, order)
    for dtype in ("float32", "float64"):  # float64: the reference's own error matters here
        for ws in (3, 4):
            xs = [data.random_input(ReduceOp.SUM, dtype, 2000, r, ("t64", ws)) for r in range(ws)]
            ref = data.random_reference(ReduceOp.SUM, xs, dtype)
            for order in itertools.permutations(range(ws)):
                acc = xs[order[0]].clone()
                for r in order[1:]:
                    acc = acc + xs[r]
                assert compare_reference(acc, ref.value, ref.bound).passed, (dtype, ws, order)
    xs = [data.random_input(ReduceOp.SUM, "float32", 2000, r, "t") for r in range(2)]
    ref = data.random_reference(ReduceOp.SUM, xs, "float32")
    good = xs[0] + xs[1]
    assert compare_reference(good, ref.value, ref.bound).passed
    bad = torch.nextafter(torch.nextafter(good, torch.full_like(good, math.inf)), torch.full_like(good, math.inf))
    assert not compare_reference(bad, ref.value, ref.bound).passed


def test_avg_and_product_bounds_cover_premultiplying_implementations():
    """NCCL-style AVG (each term times fl(1/n), then a sum) stays inside the AVG bound."""
    from vcga.conformance import data
    from vcga.conformance.base import compare_reference

    for ws in (3, 4):
        xs = [data.random_input(ReduceOp.AVG, "bfloat16", 3000, r, "a") for r in range(ws)]
        ref = data.random_reference(ReduceOp.AVG, xs, "bfloat16")
        inv = torch.tensor(1 / ws, dtype=torch.bfloat16)
        acc = xs[0] * inv
        for x in xs[1:]:
            acc = acc + x * inv
        assert compare_reference(acc, ref.value, ref.bound).passed
        ps = [data.random_input(ReduceOp.PRODUCT, "float16", 3000, r, "p") for r in range(ws)]
        pref = data.random_reference(ReduceOp.PRODUCT, ps, "float16")
        prod = ps[0].clone()
        for p in ps[1:]:
            prod = prod * p
        assert compare_reference(prod, pref.value, pref.bound).passed


# ---------------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------------


def test_builtin_profiles_load_and_name_every_builtin_check():
    from vcga.conformance.checks import BUILTIN_CHECKS
    from vcga.conformance.profiles import load_profile, plan_checks
    from vcga.plugin_manager import get_plugin_manager

    registered = {c.name: c for c in get_plugin_manager().conformance_checks()}
    assert list(BUILTIN_CHECKS) == list(registered)[: len(BUILTIN_CHECKS)] and len(BUILTIN_CHECKS) == 14
    for name in ("quick", "full"):
        prof = load_profile(name)
        assert list(prof.checks) == list(BUILTIN_CHECKS), name
        plan = plan_checks(prof, registered)
        assert [p.name for p in plan] == list(BUILTIN_CHECKS)
    full = load_profile("full")
    assert full.world_sizes == [1, 2, 3, 4] and len(full.mixed_vendor_sets) == 2
    assert {b for b, _ in full.backends} == {"gloo", "sim-nccl", "sim-hccl", "sim-cncl"}


def test_profile_errors_are_typed_and_name_the_key(tmp_path: Path):
    from vcga.conformance.profiles import load_profile, plan_checks
    from vcga.plugin_manager import get_plugin_manager

    registered = {c.name: c for c in get_plugin_manager().conformance_checks()}
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("name: a\nworld_size: [2]\n")
    with pytest.raises(VcgaConfigError, match="world_size"):
        load_profile(bad_key)
    typo = tmp_path / "b.yaml"
    typo.write_text("extends: quick\nchecks:\n  exact-reduce: {sizez: [1]}\n")
    with pytest.raises(VcgaConfigError, match=r"checks\.exact-reduce\.sizez.*sizes"):
        plan_checks(load_profile(typo), registered)
    unknown = tmp_path / "c.yaml"
    unknown.write_text("checks:\n  no-such-check: {}\n")
    with pytest.raises(VcgaConfigError, match="no-such-check"):
        plan_checks(load_profile(unknown), registered)
    with pytest.raises(VcgaConfigError, match="profile"):
        load_profile(tmp_path / "missing.yaml")
    sets = tmp_path / "d.yaml"
    sets.write_text("mixed_vendor_sets: ['nccl:2,xpu:1']\n")
    with pytest.raises(VcgaConfigError):
        load_profile(sets)


def test_profile_extends_merges_check_options_and_can_drop_checks(tmp_path: Path):
    from vcga.conformance.profiles import load_profile

    child = tmp_path / "child.yaml"
    child.write_text("extends: quick\nname: child\nworld_sizes: [2]\n"
                     "checks:\n  exact-reduce: {sizes: [3]}\n  gradients: {enabled: false}\n")
    prof = load_profile(child)
    assert prof.name == "child" and prof.world_sizes == [2]
    assert prof.checks["exact-reduce"]["sizes"] == [3]
    assert prof.checks["exact-reduce"]["forms"] == ["all_reduce", "reduce_scatter_single"]  # from quick
    assert "gradients" not in prof.checks and "collectives" in prof.checks


def test_plain_verify_plans_gloo_and_the_mixed_vendor_world():
    from vcga.conformance.profiles import load_profile
    from vcga.conformance.suite import build_worlds

    quick = load_profile("quick")
    ids = [w.id for w in build_worlds(quick)]
    assert ids == ["gloo ws=1", "gloo ws=2", "gloo ws=3", "sim:nccl:2,hccl:2 ws=4"]
    only = build_worlds(quick, backends=["sim-hccl"], world_sizes=[2])
    assert [w.id for w in only] == ["sim-hccl ws=2"]  # --backend certifies that backend alone


# ---------------------------------------------------------------------------------------------------
# End to end on gloo: reports
# ---------------------------------------------------------------------------------------------------


def test_verify_on_gloo_writes_a_report_that_follows_the_schema_and_junit_xml(tmp_path: Path):
    import jsonschema
    from junitparser import Failure, JUnitXml, Skipped

    report, junit = tmp_path / "out.json", tmp_path / "out.xml"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_vcga("verify", "--profile", TINY, "--backend", "gloo", "--report", str(report), "--junit", str(junit),
                 env={**_env("broken_backends"), "TMPDIR": str(tmp)}, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    # the faults check's timeouts dumped the flight recorder into the run's own folder, which a
    # passing run removes: nothing in the temporary folder, where a job's own dumps go by default
    assert not [p.name for p in tmp.rglob("*") if "vcga" in p.name], list(tmp.rglob("*"))
    assert "0 failed" in r.stdout and "vcga verify summary" in r.stdout
    data = json.loads(report.read_text())
    schema = json.loads((ROOT / "conformance" / "report.schema.json").read_text())
    jsonschema.validate(data, schema)
    assert data["summary"]["ok"] and data["summary"]["failed"] == 0
    assert data["worlds"][0]["id"] == "gloo ws=2" and data["worlds"][0]["status"] == "completed"
    checks = {x["check"] for x in data["results"]}
    assert checks == {"collectives", "exact-reduce", "cross-rank-identity", "dtype-matrix", "faults"}
    missing = [x for x in data["results"] if x["case"].startswith("missing rank")]
    assert missing and missing[0]["status"] == "pass" and 2.0 <= missing[0]["worst_error"] <= missing[0]["bound"]

    xml = JUnitXml.fromfile(str(junit))
    suites = list(xml)
    assert [s.name for s in suites] == ["gloo ws=2"]
    cases = list(suites[0])
    assert len(cases) == data["summary"]["total"] == suites[0].tests
    assert not any(isinstance(res, Failure) for c in cases for res in c.result)
    skipped = sum(any(isinstance(res, Skipped) for res in c.result) for c in cases)
    assert skipped == data["summary"]["skipped"] == suites[0].skipped
    assert all(c.classname.startswith("vcga.verify.gloo_ws_2.") for c in cases)
    # a broken report would fail the schema: the test can fail
    data["results"][0]["status"] = "ok"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)


@pytest.fixture(scope="module")
def broken_sum(tmp_path_factory: pytest.TempPathFactory):
    """One `vcga verify` run on broken-sum that two tests read: its JUnit XML and its table. It runs
    on the plugin's native group (``--group native``: the path a build without the vcga process
    group takes), which the other runs here, through the vcga group, leave out."""
    tmp = tmp_path_factory.mktemp("broken-sum")
    junit = tmp / "broken.xml"
    r = run_vcga("verify", "--profile", TINY, "--backend", "broken-sum", "--group", "native", "--check", "exact-reduce",
                 "--check", "collectives", "--junit", str(junit),
                 env={**_env("broken_backends"), "TMPDIR": str(tmp)}, timeout=240)  # its rank logs: tmp
    return r, junit


def test_junit_marks_failures_for_a_junit_parser(broken_sum):
    from junitparser import Failure, JUnitXml

    r, junit = broken_sum
    assert r.returncode == 1, r.stdout + r.stderr
    xml = JUnitXml.fromfile(str(junit))
    failed = [c for s in xml for c in s if any(isinstance(res, Failure) for res in c.result)]
    assert failed and all("float16" in c.name for c in failed)
    assert xml.failures == len(failed)


# ---------------------------------------------------------------------------------------------------
# Broken backends, each caught by the check meant for it
# ---------------------------------------------------------------------------------------------------


def test_a_wrong_sum_in_one_dtype_fails_exact_reduce_on_that_dtype_only(broken_sum):
    r, _ = broken_sum
    assert r.returncode == 1, r.stdout + r.stderr
    assert "broken-sum ws=2: native group" in r.stdout, r.stdout  # the plugin's own group
    fails = _failures(r.stdout)
    assert fails and all(f.startswith("FAIL exact-reduce") and "float16" in f for f in fails), fails
    assert any("expected bit-exact" in f for f in fails)


def test_a_table_that_claims_bf16_but_fails_on_it_fails_dtype_matrix_on_bf16_only():
    r = _verify("--backend", "broken-bf16", "--check", "dtype-matrix")
    assert r.returncode == 1, r.stdout + r.stderr
    fails = _failures(r.stdout)
    assert len(fails) >= 9 and all(" bfloat16 " in f and "the table claims this cell" in f for f in fails), fails
    collectives = {f.split("] ", 1)[1].split()[0] for f in fails}
    assert {"all_reduce", "broadcast", "all_gather", "send_recv"} <= collectives


def test_a_rank_that_returns_different_bits_fails_cross_rank_identity():
    """Every rank's result is within the rounding bound (random-reduce passes) and exact data still
    comes out exact, but the ranks hold different bits."""
    r = _verify("--backend", "broken-bits", "--world-size", "3", "--check", "cross-rank-identity",
                "--check", "exact-reduce")
    assert r.returncode == 1, r.stdout + r.stderr
    fails = _failures(r.stdout)
    assert fails and all(f.startswith("FAIL cross-rank-identity") and "results differ across ranks" in f
                         for f in fails), fails


def test_a_backend_that_hangs_on_one_collective_is_reported_and_the_command_ends():
    r = _verify("--backend", "broken-hang", "--check", "collectives", "--check", "exact-reduce", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    fails = _failures(r.stdout)
    assert len(fails) == 1, fails
    assert fails[0].startswith("FAIL collectives") and "broadcast" in fails[0]
    assert "rank 1 made no progress" in fails[0] and "(hung)" in fails[0]
    # the checks after the hang ran in a fresh world and passed
    assert "attempt 2" in r.stdout and "exact-reduce" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_a_rank_that_dies_is_a_failed_result_naming_rank_and_case():
    r = _verify("--backend", "gloo", "--check", "dies", "--check", "collectives",
                plugins=("broken_backends", "dying_check"))
    assert r.returncode == 1, r.stdout + r.stderr
    fails = _failures(r.stdout)
    assert len(fails) == 1 and "rank 1 died during 'second case'" in fails[0] and "exit code 3" in fails[0], fails


def test_verify_fails_cleanly_when_the_group_cannot_be_created():
    r = _verify("--backend", "broken-create", "--check", "collectives")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused to initialise" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_a_bad_profile_is_a_usage_error_not_a_traceback(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("checks:\n  exact-reduce: {sizez: [1]}\n")
    r = run_vcga("verify", "--profile", str(bad), timeout=120)
    assert r.returncode == 2 and "sizez" in r.stderr and "Traceback" not in r.stderr


def test_list_shows_every_check():
    r = run_vcga("verify", "--list", env={"COLUMNS": "250"}, timeout=120)
    assert r.returncode == 0
    for name in ("collectives", "exact-reduce", "random-reduce", "cross-rank-identity", "dtype-matrix", "layouts",
                 "sizes", "uneven", "async", "faults", "send-recv", "gradients", "mixed-vendors"):
        assert name in r.stdout


def test_gradient_worlds_are_compared_pairwise_within_the_sum_of_their_bounds():
    from vcga.conformance.training import Gradients

    g = [0.5, -1.25, 3.0]
    exports = {
        "a ws=2": {"step1": {"world_size": 2, "grad_times_n": g, "bound_times_n": [1e-6] * 3}},
        "b ws=3": {"step1": {"world_size": 3, "grad_times_n": [0.5 + 1.5e-6, -1.25, 3.0], "bound_times_n": [1e-6] * 3}},
        "c ws=4": {"step1": {"world_size": 4, "grad_times_n": [0.5 + 3e-6, -1.25, 3.0], "bound_times_n": [1e-6] * 3}},
    }
    rows = {r.backend: r for r in Gradients().compare(exports)}
    assert rows["a ws=2 vs b ws=3"].passed and rows["b ws=3 vs c ws=4"].passed
    bad = rows["a ws=2 vs c ws=4"]
    assert not bad.passed and bad.worst_error == pytest.approx(3e-6) and bad.bound == pytest.approx(2e-6)


def test_only_the_vcga_groups_own_refusal_marks_a_mixed_world_unsupported():
    """A build without the bridge refuses mixed worlds naming the group ('vcga'): skipped, not
    verified. A vendor backend failing inside a mixed world names the vendor: a failure."""
    from vcga.conformance.rank import _group_cannot_mix
    from vcga.errors import VcgaBackendUnavailable

    def wrapped(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as e:
                raise RuntimeError("torch wrapped the creator's error") from e
        except RuntimeError as outer:
            return outer

    no_bridge = VcgaBackendUnavailable("vcga", "this group mixes backends")
    assert _group_cannot_mix(wrapped(no_bridge), has_bridge=False) is not None
    assert _group_cannot_mix(wrapped(VcgaBackendUnavailable("sim-hccl", "native group failed")), has_bridge=False) is None
    assert _group_cannot_mix(ValueError("anything else"), has_bridge=False) is None
    # with the bridge in the build, a mixed world that cannot be built is a failure, whoever is named
    assert _group_cannot_mix(wrapped(no_bridge), has_bridge=True) is None


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return -1


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the ranks")
def test_ranks_do_not_outlive_a_killed_runner():
    """SIGKILL the `vcga verify` process while a rank hangs: no rank process survives it."""
    import signal
    import subprocess
    import time

    from conftest import VENV_BIN

    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env.update(_env("broken_backends"))
    proc = subprocess.Popen([str(VENV_BIN / "vcga"), "verify", "--profile", TINY, "--backend", "broken-hang",
                             "--check", "collectives"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)

    def children(parent: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                out += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    servers: list[int] = []

    def rank_pids() -> list[int]:
        """The ranks, not multiprocessing's resource tracker: spawned children of the runner, or
        the children of its forkserver (vcga.spawn.get_context)."""
        pids = []
        for pid in children(proc.pid):
            if b"spawn_main" in cmdline(pid):
                pids.append(pid)
            elif b"multiprocessing.forkserver" in cmdline(pid):
                servers[:] = [pid]
                pids += children(pid)
        return pids

    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = rank_pids()
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks never started"
        # wait until both ranks sit idle (rank 1 in the hung broadcast, rank 0 waiting for it): CPU
        # time unchanged for two seconds, well before the runner's 15 s stall deadline
        last, still_since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = [_cpu_ticks(p) for p in ranks]
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since > 2:
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in ranks + servers):
        time.sleep(0.2)
    assert not any(alive(p) for p in ranks), f"ranks {ranks} outlived the runner"
    assert not any(alive(p) for p in servers), f"the forkserver {servers} outlived the runner"


def test_the_rank_server_imports_what_the_planned_checks_preload_and_nothing_else():
    """DDP's constructor imports torch._dynamo (about 1.2 CPU-s): the gradients check names it in
    ``preload``, so `vcga verify` starts its rank server with it, once, instead of every rank
    importing it; a plan without the check preloads nothing."""
    from vcga.conformance.profiles import load_profile
    from vcga.conformance.runner import PlannedCheck, planned_preloads
    from vcga.conformance.suite import rank_preloads

    quick = load_profile("quick")
    assert rank_preloads(quick) == ["torch._dynamo", "vcga.compress.preload"]
    assert rank_preloads(quick, ["exact-reduce", "send-recv"]) == []
    assert planned_preloads([PlannedCheck("gradients"), PlannedCheck("no-such-check")]) == ["torch._dynamo"]
