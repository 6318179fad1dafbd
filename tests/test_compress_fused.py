"""The fused host loops (vcga/compress/fused.py) give the torch operations' bits, or are not used."""

from __future__ import annotations

import logging

import pytest
import torch

from vcga.compress import fused
from vcga.compress.ef import ErrorFeedback
from vcga.compress.exact import _outer_sum_ops, outer_sum


def _adversarial(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Magnitudes 1e-30..1e30 (both signs), some exact cancellations and zeros."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (n,), generator=g)).to(dtype)
    v[::7] = 0
    return v


@pytest.fixture
def fresh_kernels(monkeypatch):
    """kernels() decides again in this test (its answer is cached per process)."""
    monkeypatch.setattr(fused, "_state", {})
    yield
    fused._state.clear()


def _run_ef(on: bool, monkeypatch, dtype: torch.dtype) -> list[torch.Tensor]:
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setenv("VCGA_FUSED", "1" if on else "0")
    assert (fused.kernels() is not None) == on
    ef, out = ErrorFeedback(), []
    for step in range(4):  # the first step is the fresh path, then the pending low part joins
        g = _adversarial(5000, 10 + step, dtype).reshape(50, 100)
        x = ef.input(g)
        ef.update(x, _adversarial(5000, 100 + step, dtype).reshape(50, 100))
        out += [x.clone(), ef.hi.clone(), ef.lo.clone()]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_error_feedback_gives_the_bits_of_the_torch_operations(monkeypatch, dtype):
    pytest.importorskip("numba")  # a test extra: installed by `make venv`
    fused_run = _run_ef(True, monkeypatch, dtype)
    ops_run = _run_ef(False, monkeypatch, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    for i, (a, b) in enumerate(zip(fused_run, ops_run)):
        assert torch.equal(a.view(bits), b.view(bits)), f"step {i // 3}, tensor {'x hi lo'.split()[i % 3]}"


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_fused_outer_sum_gives_the_bits_of_the_torch_operations(fresh_kernels, rank):
    pytest.importorskip("numba")
    assert fused.kernels() is not None
    p = _adversarial(300 * rank, rank).reshape(300, rank) * 1e-4
    q = _adversarial(257 * rank, 50 + rank).reshape(257, rank) * 1e-4
    got, want = outer_sum(p, q), _outer_sum_ops(p, q, None)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all())


def test_a_loop_that_does_not_reproduce_the_bits_is_not_used(fresh_kernels, monkeypatch, caplog):
    """A compiled loop that sums the outer products in another order (as a contracting or
    reassociating compiler would) fails the self-check: the torch operations stay in use."""
    pytest.importorskip("numba")
    real = fused._compile

    def reordered():
        ef_in, ef_up, _ = real()

        def outer(pt, qt, out):
            import numpy as np

            acc = np.zeros_like(out)
            with np.errstate(all="ignore"):  # the probe's extreme magnitudes overflow some products
                for k in reversed(range(pt.shape[0])):  # last product first
                    acc += np.outer(pt[k], qt[k])
            out[...] = acc

        return ef_in, ef_up, outer

    monkeypatch.setattr(fused, "_compile", reordered)
    with caplog.at_level(logging.WARNING, logger="vcga.compress.fused"):
        assert fused.kernels() is None
    assert "does not reproduce" in caplog.text and "outer sum" in caplog.text
    p, q = torch.randn(64, 4), torch.randn(80, 4)
    assert torch.equal(outer_sum(p, q), _outer_sum_ops(p, q, None))


def test_vcga_fused_0_turns_the_loops_off_and_other_tensors_never_take_them(fresh_kernels, monkeypatch):
    monkeypatch.setenv("VCGA_FUSED", "0")
    assert fused.kernels() is None
    assert not fused.usable(torch.zeros(4, dtype=torch.bfloat16))
    assert not fused.usable(torch.zeros(4, 4).t())  # not contiguous
    assert not fused.usable(torch.zeros(4), torch.zeros(4, dtype=torch.float64))  # mixed dtypes
    assert not fused.usable(torch.zeros(4, requires_grad=True))  # numpy cannot view it
    assert not fused.usable(torch.zeros(4)._neg_view())  # a lazy negation: numpy would see the wrong sign
    assert fused.usable(torch.zeros(4), torch.zeros(2, 2))
