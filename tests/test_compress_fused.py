"""The fused host loops (vcga/compress/fused.py) give the torch operations' bits, or are not used."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import ROOT

from vcga.compress import fused
from vcga.compress.ef import ErrorFeedback
from vcga.compress.exact import outer_sum as _outer_sum_ops
from vcga.compress.fused import outer_sum


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
    for i, (a, b) in enumerate(zip(fused_run, ops_run, strict=False)):
        assert torch.equal(a.view(bits), b.view(bits)), f"step {i // 3}, tensor {['x', 'hi', 'lo'][i % 3]}"


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_factored_error_feedback_and_orthonormalisation_give_the_torch_operations_bits(fresh_kernels, dtype):
    """ErrorFeedback.update_factored (sent formed row by row inside the loop, never stored) keeps
    exactly what update(x, outer_sum(p, q)) keeps, at every step; the compiled Gram-Schmidt gives
    exact.orthonormalize's bits, a zero column included."""
    pytest.importorskip("numba")
    from vcga.compress.exact import orthonormalize as _ortho_ops

    assert fused.factored() is not None
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    runs = []
    for factored in (True, False):
        ef, out = ErrorFeedback(), []
        for step in range(3):  # the first step is the fresh path
            g = _adversarial(60 * 70, 30 + step, dtype).reshape(60, 70)
            p = _adversarial(60 * 4, 40 + step, dtype).reshape(60, 4) * 1e-3
            q = _adversarial(70 * 4, 50 + step, dtype).reshape(70, 4) * 1e-3
            x = ef.input(g)
            if factored:
                ef.update_factored(x, p, q)
            else:
                ef.update(x, _outer_sum_ops(p, q))
            out += [ef.hi.clone(), ef.lo.clone()]
        runs.append(out)
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        same = (a.view(bits) == b.view(bits)) | (torch.isnan(a) & torch.isnan(b))
        assert bool(same.all()), f"step {i // 2}, {('hi', 'lo')[i % 2]}"
    p = torch.cat([torch.zeros(513, 1, dtype=dtype), _adversarial(513 * 4, 7, dtype).reshape(513, 4) * 1e-5], 1)
    got, want = fused.orthonormalize(p.clone()), _ortho_ops(p.clone())
    assert bool(((got.view(bits) == want.view(bits)) | (torch.isnan(got) & torch.isnan(want))).all())
    assert bool((got[:, 0] == 0).all())


def test_a_factored_loop_that_does_not_reproduce_the_bits_is_not_used(fresh_kernels, monkeypatch, caplog):
    """A factored error-feedback loop that forms sent in another order (the last product first)
    fails the self-check: ErrorFeedback keeps forming sent with outer_sum and the two-pass update."""
    pytest.importorskip("numba")
    real = fused._compile_factored

    def reordered():
        _, ortho = real()

        def ef_update_outer(x, pt, qt, hi, lo, fresh):
            import numpy as np

            with np.errstate(all="ignore"):
                sent = np.zeros((pt.shape[1], qt.shape[1]), dtype=x.dtype)
                for k in reversed(range(pt.shape[0])):
                    sent += np.outer(pt[k], qt[k])
                sent = sent.reshape(-1)
                s = x - sent
                bb = s - x
                e = (x - (s - bb)) - (sent + bb)
            hi[:] = s
            lo[:] = e if fresh else e + lo

        return ef_update_outer, ortho

    monkeypatch.setattr(fused, "_compile_factored", reordered)
    with caplog.at_level(logging.WARNING, logger="vcga.compress.fused"):
        assert fused.factored() is None
    assert "does not reproduce" in caplog.text and "factored error feedback" in caplog.text


def test_vcga_fused_0_turns_the_loops_off_and_other_tensors_never_take_them(fresh_kernels, monkeypatch):
    monkeypatch.setenv("VCGA_FUSED", "0")
    assert fused.kernels() is None
    assert not fused.usable(torch.zeros(4, dtype=torch.bfloat16))
    assert not fused.usable(torch.zeros(4, 4).t())  # not contiguous
    assert not fused.usable(torch.zeros(4), torch.zeros(4, dtype=torch.float64))  # mixed dtypes
    assert not fused.usable(torch.zeros(4, requires_grad=True))  # numpy cannot view it
    assert not fused.usable(torch.zeros(4)._neg_view())  # a lazy negation: numpy would see the wrong sign
    assert fused.usable(torch.zeros(4), torch.zeros(2, 2))


# -- QSGD's host loops (plugins/compressors.py) ------------------------------------------------------


def _qsgd(levels: int, bucket: int = 512, norm: str = "max"):
    from vcga.plugins.compressors import QSGD

    return QSGD(levels, bucket, norm, ef=False, server=False)


@pytest.mark.parametrize("levels,bucket,n,norm", [
    (16, 512, 200_003, "max"),  # 8-bit levels, a partial last bucket
    (7, 100, 4_001, "max"),     # 4-bit levels, an odd count: the last byte's low nibble is padding
    (1, 3, 1_000, "max"),
    (300, 64, 5_000, "l2"),     # 16-bit levels, the paper's norm
    (127, 512, 511, "l2"),      # fewer elements than one bucket
])
def test_qsgd_host_loops_give_the_torch_operations_payload_and_decode(fresh_kernels, monkeypatch, levels, bucket, n, norm):
    """The one-pass loops send the torch operations' bytes and decode to their bits; the torch
    operations are not run at all on this host path (they would raise here)."""
    pytest.importorskip("numba")
    from vcga.contract import CompressContext

    q = _qsgd(levels, bucket, norm)
    x = _adversarial(n, levels) * 1e-20  # magnitudes 1e-50..1e10: subnormals, zeros, cancellations
    x[n // 2] = -0.0
    x[: min(n, bucket)] = torch.randn(min(n, bucket))  # one bucket of ordinary gradients
    ctx = CompressContext(peers=3, peer=2, step=11, seed=5)
    want = q._compress_ops(x, ctx)
    dec_want = q._decompress_ops(want[0], want[1], n)

    import vcga.plugins.compressors.qsgd as pc

    assert fused.checked("qsgd", pc._qsgd_loops, pc._qsgd_self_check) is not None  # compiled and self-checked

    def not_here(*a, **k):
        raise AssertionError("the torch operations ran on the host path")

    monkeypatch.setattr(type(q), "_compress_ops", not_here)
    monkeypatch.setattr(type(q), "_decompress_ops", not_here)
    state: dict = {}
    got = q.compress(x, state, ctx)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=False))
    assert torch.equal(q.decompress(want, state, ctx).view(torch.int32), dec_want.view(torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_qsgd_leaves_a_tensor_with_nan_or_inf_to_the_torch_operations(fresh_kernels, bad):
    pytest.importorskip("numba")
    from vcga.contract import CompressContext

    q, ctx = _qsgd(16, 8), CompressContext(peers=2, peer=0, step=1, seed=3)
    x = torch.randn(100)
    x[17] = bad
    got, want = q.compress(x, {}, ctx), q._compress_ops(x, ctx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))  # NaN: bits
    import vcga.plugins.compressors.qsgd as pc

    assert fused.checked("qsgd", pc._qsgd_loops, pc._qsgd_self_check) is not None  # the loops were there


@pytest.mark.parametrize("flaw", ["decode reassociated", "nibbles swapped"])
def test_qsgd_loops_that_do_not_reproduce_the_bits_are_not_used(fresh_kernels, monkeypatch, caplog, flaw):
    """A decode that divides the scale first (``val * (sc / s)``, a reassociation) or packs the
    4-bit levels low nibble first fails the self-check: the torch operations stay in use."""
    pytest.importorskip("numba")
    import numpy as np

    import vcga.plugins.compressors.qsgd as pc
    from vcga.contract import CompressContext

    absmax, quantize, dequantize = pc._qsgd_loops()

    def dequantize_reassociated(packed, scale, s, bucket, n, bits, out):
        if bits == 4:
            lv = np.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n].astype(np.float32) - np.float32(s)
        else:
            lv = packed[:n].astype(np.float32)
        out[:] = lv * np.repeat(scale / np.float32(s), bucket)[:n]

    def quantize_swapped(x, scale, u, s, bucket, bits, out):
        quantize(x, scale, u, s, bucket, bits, out)
        if bits == 4:
            out[:] = (out % 16) * 16 + out // 16

    loops = (absmax, quantize, dequantize_reassociated) if flaw.startswith("decode") else (absmax, quantize_swapped, dequantize)
    monkeypatch.setattr(pc, "_qsgd_loops", lambda: loops)
    with caplog.at_level(logging.WARNING, logger="vcga.compress.fused"):
        assert fused.checked("qsgd", pc._qsgd_loops, pc._qsgd_self_check) is None
    assert "does not reproduce" in caplog.text and "qsgd" in caplog.text
    q, ctx = _qsgd(7, 16), CompressContext(peers=2, peer=0, step=1, seed=3)
    x = torch.randn(999)
    assert all(torch.equal(a, b) for a, b in zip(q.compress(x, {}, ctx), q._compress_ops(x, ctx), strict=False))


@pytest.mark.parametrize("n", [5, 4097, 300_000])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5, 1.0])
def test_topk_selection_loop_sends_the_torch_paths_payload(fresh_kernels, monkeypatch, n, ratio):
    """The radix-select loop (float32 on the host) sends the indices, ascending, and the values
    that the torch path (``largest`` and an ordering) sends -- the torch path does not run (it
    would raise here). Magnitudes 10^-30..10^30, zeros of both signs, an infinity and a NaN."""
    pytest.importorskip("numba")
    import vcga.plugins.compressors as pc
    from vcga.contract import CompressContext

    g = torch.Generator().manual_seed(n)
    x = torch.unique(_adversarial(n, n).abs())  # no two equal magnitudes: one set is the k largest
    x = x[torch.randperm(x.numel(), generator=g)] * torch.where(torch.rand(x.numel(), generator=g) < 0.5, -1.0, 1.0)
    if x.numel() > 4:
        x[1], x[-2] = float("inf"), float("nan")
    c = pc.TopK(ratio, ef=True, server=False)
    k = c.k(x.numel())
    want = torch.sort(pc.largest(x.abs(), k)).values
    assert pc._select_loop() is not None  # compiled and self-checked

    def not_here(*a, **kw):
        raise AssertionError("the torch path ran on the host")

    monkeypatch.setattr(pc, "largest", not_here)
    idx, val = c.compress(x, {}, CompressContext(2, 0, 0, 0))
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), want)
    assert torch.equal(val.view(torch.int32), x[want].view(torch.int32))


def test_topk_selection_loop_takes_the_first_of_equal_magnitudes_at_the_kth(fresh_kernels):
    """Where many elements share the k-th largest magnitude, the loop takes every larger one and
    the first of the equal ones in index order, k in all."""
    pytest.importorskip("numba")
    import vcga.plugins.compressors as pc

    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 2.0, 5.0, -2.0, 0.0, 2.0])
    idx, val = pc._select(pc._select_loop(), x, 4)  # 5, -3 and the first two of the four 2s
    assert idx.tolist() == [1, 2, 3, 5] and val.tolist() == [-3.0, 2.0, -2.0, 5.0]


def test_a_topk_selection_loop_that_does_not_select_the_largest_is_not_used(fresh_kernels, monkeypatch, caplog):
    """A loop that orders the raw bits (the sign not cleared: a negative element's bits are the
    largest integers) fails the self-check; the torch path stays in use."""
    pytest.importorskip("numba")
    import numpy as np

    import vcga.plugins.compressors as pc
    from vcga.contract import CompressContext

    def signed(bits, k, idx, val, x):
        order = np.argsort(-(bits.astype(np.int64) & 0xFFFFFFFF), kind="stable")[:k]
        order.sort()
        idx[:] = order
        val[:] = x[order]
        return k

    monkeypatch.setattr(pc, "_build_select", lambda: signed)
    with caplog.at_level(logging.WARNING, logger="vcga.compress.fused"):
        assert pc._select_loop() is None
    assert "topk selection" in caplog.text
    x = torch.randn(1000)
    idx, _ = pc.TopK(0.01, ef=True, server=False).compress(x, {}, CompressContext(2, 0, 0, 0))
    assert torch.equal(idx.long(), torch.sort(torch.topk(x.abs(), 10).indices).values)


def test_ranks_that_start_together_compile_the_fused_loops_once_and_load_them_from_numbas_cache(
        tmp_path, monkeypatch):
    """Each rank is a new process: a loop that misses numba's on-disk cache is compiled again in
    every one of them. Two processes that ask for every loop at the same moment, with an empty
    cache (a fresh install's first job; benchmarks/fused_first_start.py's ranks): one compiles and
    writes the cache, the other waits for it (vcga.compress.fused's machine-wide lock) and compiles
    nothing. Without the lock both would compile; and a loop that calls another jitted closure is
    compiled anew in every process, cache or not."""
    pytest.importorskip("numba")
    import os

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from fused_first_start import run

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "VCGA_CACHE_DIR": str(tmp_path / "vcga"),
           "VCGA_FUSED": "1"}
    _, compiled = run(2, env)
    assert sorted(compiled)[0] == 0 and sorted(compiled)[1] > 0, compiled
    assert list((tmp_path / "numba").rglob("*.nbc")), "nothing was cached"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthonormalize_takes_correctly_rounded_square_roots_whatever_torchs_kernel_gives(monkeypatch, dtype):
    """exact.orthonormalize's bits are those of its element-wise operations with IEEE square roots
    (numpy's, written out here in the same order), also where torch's host ``sqrt`` is not
    correctly rounded: MKL's on AMD Zen 4 is one ulp off for float64, made here on every CPU by
    a ``Tensor.sqrt`` that returns the next float up. Ranks on different hosts then agree."""
    import numpy as np

    from vcga.compress.exact import orthonormalize, sqrt1

    def tree(x: np.ndarray) -> np.ndarray:  # exact.tree_sum's order
        while x.shape[0] > 1:
            h = x.shape[0] // 2
            y = x[:h] + x[h:2 * h]
            x = np.concatenate([y, x[2 * h:]]) if x.shape[0] % 2 else y
        return x[0]

    real_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda t: torch.nextafter(real_sqrt(t), torch.full_like(t, np.inf)))
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    for r, n in ((1, 31), (4, 97), (8, 13), (8, 513)):
        p = fused.probe_values(dtype, n * r, 20 + r).reshape(n, r) * 1e-5
        want = p.numpy().copy()
        with np.errstate(all="ignore"):  # float32 squares of the probe's largest values overflow, as in torch
            for i in range(r):
                d = tree(want[:, i:i + 1] * want[:, i:])
                norm = np.sqrt(d[:1])
                want[:, i:i + 1] /= norm
                want[:, i + 1:] -= (d[1:] / norm) * want[:, i:i + 1]
        got = orthonormalize(p.clone())
        assert torch.equal(got.view(bits), torch.from_numpy(want).view(bits)), (r, n)
    x = torch.tensor([2.0], dtype=dtype)
    assert sqrt1(x).item() == np.sqrt(np.array(2.0, dtype=x.numpy().dtype))
    for v in (-1.0, float("nan"), float("inf"), -0.0):  # as torch's sqrt: NaN below 0, -0 stays -0
        assert torch.equal(sqrt1(torch.tensor([v], dtype=dtype)).isnan(), torch.tensor([v]).sqrt().isnan())
        assert str(sqrt1(torch.tensor([v], dtype=dtype)).item()) == str(real_sqrt(torch.tensor([v], dtype=dtype)).item())
