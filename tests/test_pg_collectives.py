"""Every collective x dtype x reduce op x layout, on world sizes 1, 2 and 3, through ``vcga``.

One spawned world per world size runs the whole matrix (tests/pg_cases.py) on a ``vcga`` group
per backend: gloo, and the simulated sim-hccl, sim-cncl and sim-nccl (fake-backed: CPU stand-ins
that follow each vendor library's rules), so every native path, every emulation recipe and every
refusal runs. A further world on an in-test plugin whose table forces the recipes no shipped
table needs (bool_as_min, upcast and as_real for data movement) closes the recipe coverage.
"""

from __future__ import annotations

import pytest

from pg_world import run_world
from vcga.contract import EMULATIONS

BACKENDS = ["gloo", "sim-hccl", "sim-cncl", "sim-nccl"]


def matrix_world(rank: int, world_size: int, init_method: str, backends: list[str], extra: bool) -> list[dict]:
    import torch.distributed as dist

    import vcga  # noqa: F401 - registers the backend
    from pg_cases import DTYPES, EXTRA_DTYPES, Matrix
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=VcgaOptions(backend="gloo"))
    out = []
    for b in backends:
        g = dist.new_group(backend="vcga", pg_options=VcgaOptions(backend=b))
        out.append(Matrix(g, b, DTYPES + (EXTRA_DTYPES if extra else [])).run())
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
    results = run_world(matrix_world, world_size, BACKENDS, world_size == 3, timeout=600)
    for k, v in _check(results).items():
        _SEEN[k] = _SEEN.get(k, 0) + v


def emu_world(rank: int, world_size: int, init_method: str) -> list[dict]:
    import torch.distributed as dist

    import vcga  # noqa: F401
    from pg_cases import Matrix
    from vcga.process_group import VcgaOptions

    dist.init_process_group("vcga", init_method=init_method, rank=rank, world_size=world_size,
                            pg_options=VcgaOptions(backend="test-emulations"))
    res = [Matrix(dist.group.WORLD, "test-emulations",
                  ["bool", "uint8", "int16", "float16", "bfloat16", "float32", "float64", "complex64"]).run()]
    dist.destroy_process_group()
    return res


def test_forced_recipes() -> None:
    """A plugin table (tests/pg_emu_plugin.py) that forces every recipe the shipped tables skip."""
    results = run_world(emu_world, 2, env={"VCGA_PLUGINS": "pg_emu_plugin"}, timeout=300)
    for k, v in _check(results).items():
        _SEEN[k] = _SEEN.get(k, 0) + v
    for recipe in ("bool_as_min", "bool_as_max", "upcast", "as_real", "bitcast", "gather_then_reduce",
                   "sum_then_divide", "mul_then_sum"):
        assert results[0][0]["recipes"].get(recipe), f"recipe {recipe} did not run on the forced table"


def test_every_recipe_ran() -> None:
    """Across the worlds above, every recipe in contract.EMULATIONS was exercised."""
    if not _SEEN:
        pytest.skip("runs after the matrix tests in the same session")
    wanted = {k.partition(":")[0] for k in EMULATIONS}
    assert wanted <= set(_SEEN), f"never exercised: {sorted(wanted - set(_SEEN))}"
