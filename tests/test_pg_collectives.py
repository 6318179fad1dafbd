"""Every collective x dtype x reduce op x layout, on world sizes 1, 2 and 3, through ``vcga``.

One spawned world per world size runs the whole matrix (tests/pg_cases.py) on a ``vcga`` group
per backend: gloo, and the simulated sim-hccl, sim-cncl and sim-nccl (fake-backed: CPU stand-ins
that follow each vendor library's rules), so every native path, every emulation recipe and every
refusal runs. A further world on an in-test plugin whose table forces the recipes no shipped
table needs (bool_as_min, upcast and as_real for data movement) closes the recipe coverage.
"""

from __future__ import annotations

import os

import pytest

from vcga.contract import EMULATIONS
from vcga.testing import run_world

BACKENDS = ["gloo", "sim-hccl", "sim-cncl", "sim-nccl"]
#: ``VCGA_TEST_EXHAUSTIVE=1``: every backend x every dtype on every world size (several minutes).
EXHAUSTIVE = os.environ.get("VCGA_TEST_EXHAUSTIVE", "") == "1"


def plan(world_size: int) -> list[tuple[str, list[str]]]:
    """(backend, dtypes) per world. The CI-sized default still runs the eight dtypes of pg_cases.DTYPES on
    gloo, sim-hccl and sim-cncl at every world size; sim-nccl joins at 1 and 2 ranks, and the
    extra dtypes (upcast / bitcast / as_real paths) run on gloo at 2 ranks."""
    from pg_cases import DTYPES, EXTRA_DTYPES

    if EXHAUSTIVE:
        return [(b, DTYPES + EXTRA_DTYPES) for b in BACKENDS]
    out = [(b, list(DTYPES)) for b in BACKENDS if world_size < 3 or b != "sim-nccl"]
    if world_size == 2:
        out[0] = ("gloo", DTYPES + EXTRA_DTYPES)
    return out


def matrix_world(rank: int, world_size: int, init_method: str, todo: list[tuple[str, list[str]]]) -> list[dict]:
    import torch.distributed as dist
    from pg_cases import Matrix

    import vcga  # noqa: F401 - registers the backend
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=VcgaOptions(backend="gloo"))
    out = []
    for backend, dts in todo:
        g = dist.new_group(backend="vcga", pg_options=VcgaOptions(backend=backend))
        out.append(Matrix(g, backend, dts).run())
    dist.destroy_process_group()
    return out


def _check(results: list[list[dict]]) -> dict[str, int]:
    failures = [f for per_rank in results for r in per_rank for f in r["failures"]]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:60])
    recipes: dict[str, int] = {}
    for r in results[0]:
        assert r["cases"] > 0
        for k, v in r["recipes"].items():
            recipes[k] = recipes.get(k, 0) + v
    return recipes


_SEEN: dict[str, int] = {}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_matrix(world_size: int) -> None:
    """Native, emulated and refused cells on gloo and the simulated vendors (fake-backed)."""
    results = run_world(matrix_world, world_size, plan(world_size), timeout=600)
    for k, v in _check(results).items():
        _SEEN[k] = _SEEN.get(k, 0) + v


def emu_world(rank: int, world_size: int, init_method: str) -> list[dict]:
    import sys

    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helper_plugins"))  # minimal_plugins
    from pg_cases import Matrix

    import vcga  # noqa: F401
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=VcgaOptions(backend="test-emulations"))
    res = [Matrix(dist.group.WORLD, "test-emulations",
                  ["bool", "uint8", "int16", "float16", "bfloat16", "float32", "float64", "complex64"]).run()]
    # The minimal table (float32 moved natively, nothing else): every other dtype moves through
    # float32 -- padded byte views for 1- and 2-byte dtypes, views for wider ones -- in every
    # variant, layout (strided, empty) and uneven all_to_all split, and point-to-point.
    g = dist.new_group(backend="vcga", pg_options=VcgaOptions(backend="minimal"))
    res.append(Matrix(g, "minimal", ["bool", "int16", "float16", "int64", "complex128"]).run())
    dist.destroy_process_group()
    return res


def test_forced_recipes() -> None:
    """A plugin table (tests/pg_emu_plugin.py) that forces every recipe the shipped tables skip,
    and the minimal table (tests/helper_plugins/minimal_plugins.py) whose data movement is all derived."""
    results = run_world(emu_world, 2, env={"VCGA_PLUGINS": "pg_emu_plugin,minimal_plugins"}, timeout=300)
    for k, v in _check(results).items():
        _SEEN[k] = _SEEN.get(k, 0) + v
    for recipe in ("bool_as_min", "bool_as_max", "upcast", "as_real", "bitcast", "gather_then_reduce",
                   "sum_then_divide", "mul_then_sum"):
        assert results[0][0]["recipes"].get(recipe), f"recipe {recipe} did not run on the forced table"
    assert results[0][1]["recipes"].get("bitcast")  # the minimal table: every other dtype moved as float32


def test_every_recipe_ran() -> None:
    """Across the worlds above, every recipe in contract.EMULATIONS was exercised."""
    if not _SEEN:
        pytest.skip("runs after the matrix tests in the same session")
    wanted = {k.partition(":")[0] for k in EMULATIONS}
    assert wanted <= set(_SEEN), f"never exercised: {sorted(wanted - set(_SEEN))}"
