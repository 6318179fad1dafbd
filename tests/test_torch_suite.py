"""PyTorch's own backend suite (distributed_test.py, shipped in the torch wheel) on ``vcga``.

The selection in tests/torch_suite/selection.py runs in two passes (see that file); every selected
test must pass -- a skip counts as a failure, so a torch upgrade that gates a test away is noticed.
``VCGA_TORCH_SUITE=full`` runs every test of both passes instead (several minutes; pass B without
the tests listed in ``GLOO_GATES_CANNOT_PASS``) and then only requires that nothing fails. docs/torch-suite.md has every test's outcome and skip reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_suite"))

import selection
import suite

FULL = os.environ.get("VCGA_TORCH_SUITE") == "full"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("gates,tests", [(None, selection.PASS_VCGA), ("gloo", selection.PASS_GLOO_GATES)],
                         ids=["BACKEND=vcga", "gloo-gates"])
def test_distributed_test_selection(gates: str | None, tests: tuple[str, ...]) -> None:
    outcomes = suite.run(None if FULL else list(tests), gates,
                         exclude=tuple(selection.GLOO_GATES_CANNOT_PASS) if gates else ())
    failed = {k: v[1] for k, v in outcomes.items() if v[0] == "failed"}
    assert not failed, "torch distributed_test.py failures:\n" + "\n".join(f"{k}: {v}" for k, v in failed.items())
    if not FULL:
        missing = sorted(set(tests) - set(outcomes))
        skipped = {k: v[1] for k, v in outcomes.items() if v[0] == "skipped"}
        assert not missing, f"not collected: {missing}"
        assert not skipped, f"selected tests skipped: {skipped}"
