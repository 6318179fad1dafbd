"""Every benchmark script still compiles, and the two collective benchmarks run end to end at a toy
size (figures are not checked: tests assert behaviour, never time). A syntax error in
benchmarks/hybrid.py once surfaced only when someone ran the benchmark.

A benchmark runs in this process (:func:`_run`: its ``main()`` under its command line), its ranks
forked from the worker's rank server: a process of its own would spend about 2 CPU-s importing
torch and 2 more starting a rank server of its own before the toy-sized run, which takes less."""

from __future__ import annotations

import importlib
import json
import os
import py_compile
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_compiles(script: Path, tmp_path: Path) -> None:
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def _run(args: list[str], capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS`` in this process: the script imported as module ``NAME``
    (with benchmarks/ first on ``sys.path``, as running it puts it; its rank functions pickle by that
    name), ``main()`` under ``sys.argv``. stdout and stderr are this process's file descriptors
    (``capfd``), which the ranks write to as well; a warning the parent emits is printed there as
    the interpreter would. The environment and ``sys.path`` are restored after."""
    script, *argv = args
    saved_env, saved_path, saved_argv = dict(os.environ), list(sys.path), list(sys.argv)
    capfd.readouterr()
    code: int | str | None = 0
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        sys.argv = [script, *argv]
        module = importlib.import_module(Path(script).stem)
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # pytest would record them instead of printing them
            warnings.showwarning = lambda msg, cat, fn, ln, *_: print(
                warnings.formatwarning(msg, cat, fn, ln), file=sys.stderr, end="")
            try:
                code = module.main() or 0
            except SystemExit as e:
                code = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:], sys.argv = saved_path, saved_argv
    out, err = capfd.readouterr()
    if not isinstance(code, int):  # sys.exit("message"), as the interpreter prints it
        err, code = err + f"{code}\n", 1
    return subprocess.CompletedProcess(args, code, out, err)


def test_collectives_benchmark_runs_at_a_toy_size(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    r = _run(["benchmarks/collectives.py", "--ops", "all_reduce", "reduce_scatter", "--min-bytes", "4096",
              "--max-bytes", "8192", "--seconds", "0.05", "--rounds", "2", "--quiet", "--json", str(out)], capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [(x["op"], x["bytes"]) for x in rows] == [("all_reduce", 4096), ("all_reduce", 8192),
                                                     ("reduce_scatter", 4096), ("reduce_scatter", 8192)]
    assert all(x["ratio"] > 0 and x["pairs"] >= 2 for x in rows)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_hybrid_benchmark_runs_at_a_toy_size(tmp_path: Path, collective: str,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    r = _run(["benchmarks/hybrid.py", "--min-bytes", "4096", "--max-bytes", "4096", "--reps", "1",
              "--collective", collective, "--json", str(out)], capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [x["bytes"] for x in rows] == [4096], rows
    for variant in ("leader", "bandwidth", "p2p", "replicated"):
        assert rows[0][f"{variant}_ms"] > 0 and rows[0][f"{variant}_ratio"] > 0


def test_host_exchange_benchmark_runs_at_a_toy_size(capfd: pytest.CaptureFixture[str]) -> None:
    r = _run(["benchmarks/host_exchange.py", "--reps", "1"], capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "barrier" in r.stdout and "all_reduce 8 MiB" in r.stdout, r.stdout


def test_compression_benchmark_runs_every_kind_of_variant_at_a_toy_size(capfd: pytest.CaptureFixture[str]) -> None:
    """benchmarks/compression.py's converge mode with vcga's hook, torch's hooks and the reference
    top-k / DGC / EF21 hooks, on an uneven mixed world (an island of two and one of one): every variant
    ends with ranks bitwise identical, the steps-to-target table (``--curve``/``--target-step``)
    lists every variant with exact at its own target step, and no deprecated torch name warns
    (vcga's island collectives use torch 2.13's names)."""
    variants = ["exact", "vcga:topk:ratio=0.1", "vcga:powersgd:rank=2", "ref-topk:0.1", "ref-dgc:0.1:2",
                "ref-ef21:0.1:dense", "ref-ef21m:0.1", "torch-powersgd:2", "torch-fp16"]
    r = _run(["benchmarks/compression.py", "converge", "--vendors", "nccl:2,hccl:1", "--steps", "4", "--warmup", "1",
              "--width", "32", "--depth", "2", "--curve", "1", "--target-step", "2", "--markdown",
              "--variants", ";".join(variants)], capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    main, _, to_target = r.stdout.partition("\n\n")  # the results, then the steps to exact's loss at step 2

    def rows(text: str) -> dict[str, list[str]]:
        return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
                if line.startswith("| ") and not line.startswith("| variant"))}

    assert {v: cells[-1] for v, cells in rows(main).items()} == dict.fromkeys(variants, "yes"), r.stdout
    steps = rows(to_target)
    assert set(steps) == set(variants) and steps["exact"][:2] == ["2", "1.00"], r.stdout
    assert "FutureWarning" not in r.stderr, r.stderr


def test_compression_benchmark_runs_the_language_model_task_at_a_toy_size(capfd: pytest.CaptureFixture[str]) -> None:
    """``converge --task lm`` (a causal transformer on a Markov source, Adam with the cosine
    schedule) on an uneven mixed world: every variant ends with ranks bitwise identical, and the
    table has the loss above the source's entropy floor, 1.000 for exact by definition, and a
    positive figure for the others (a loss below the floor would mean a wrong floor or loss)."""
    variants = ["exact", "vcga:topk:ratio=0.1", "vcga:powersgd:rank=2", "torch-powersgd:2"]
    r = _run(["benchmarks/compression.py", "converge", "--task", "lm", "--vendors", "nccl:2,hccl:1", "--steps", "4",
              "--warmup", "1", "--width", "16", "--batch", "2", "--optim", "adam", "--lr", "1e-2", "--schedule", "cosine",
              "--lr-warmup", "2", "--markdown", "--variants", ";".join(variants)], capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "causal LM width 16" in r.stdout and "cosine to 10%" in r.stdout, r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].split("|")[1:-1]]
    rows = {cells[0]: dict(zip(head, cells, strict=False)) for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[1:])}
    assert set(rows) == set(variants), r.stdout
    assert all(row["ranks identical"] == "yes" for row in rows.values()), r.stdout
    assert rows["exact"]["above floor / exact's"] == "1.000", r.stdout
    assert all(float(row["above floor / exact's"]) > 0 for row in rows.values()), r.stdout


def test_the_cosine_schedule_warms_up_linearly_and_ends_at_a_tenth() -> None:
    """``--schedule cosine``: LambdaLR calls the factor with the number of optimizer steps taken;
    the first step runs at 1/warm-up of the rate, the rate peaks after the warm-up, halves its way
    to 10% at the middle of the decay and reaches 10% at the last step."""
    import argparse

    saved = list(sys.path)  # the benchmark puts its own folder on sys.path too: restore both
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compression
    finally:
        sys.path[:] = saved
        sys.modules.pop("compression", None)
    args = argparse.Namespace(schedule="cosine", lr_warmup=10, steps=110)
    f = [compression.lr_factor(s, args) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.55) and compression.lr_factor(110, args) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert compression.lr_factor(5, argparse.Namespace(schedule="const", lr_warmup=10, steps=110)) == 1.0
