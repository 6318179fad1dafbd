"""Gradient compression (vcga.compress, docs/compression.md): spec strings, exact error feedback,
the built-in compressors, DDP through the hook on mixed-vendor worlds (every rank bitwise
identical, the plumbing exact), and `vcga verify --check compression` passing on gloo, the
simulated backends and a mixed world while failing deliberately broken compressors."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_vcga

from vcga.compress import compressors, parse_spec
from vcga.compress.ef import ErrorFeedback
from vcga.compress.exact import orthonormalize, outer_sum, tree_sum, two_sum
from vcga.contract import Combine, CompressContext
from vcga.errors import VcgaConfigError

HELPERS = ROOT / "tests" / "helper_plugins"
sys.path.insert(0, str(ROOT / "tests"))


# ---------------------------------------------------------------------------------------------------
# Spec strings and config
# ---------------------------------------------------------------------------------------------------


def test_spec_strings_parse_with_defaults_and_driver_keys():
    s = parse_spec("powersgd:rank=4")
    assert s.name == "powersgd" and s.options["rank"] == 4 and s.options["ef"] is True and s.scope is None
    s = parse_spec(" topk:ratio=0.01,scope=all,when=auto,start=3,seed=9 ")
    assert (s.options["ratio"], s.scope, s.when, s.start, s.seed) == (0.01, "all", "auto", 3, 9)
    assert parse_spec("qsgd:levels=16").options["levels"] == 16
    assert parse_spec("bf16").name == "bf16"
    assert not parse_spec("none").enabled and not parse_spec("").enabled and not parse_spec(None).enabled


@pytest.mark.parametrize("bad, says", [
    ("zip", "registered compressor: bf16, fp16, powersgd, qsgd, sign, topk"),
    ("topk:ratio=0", "topk ratio: a number in (0, 1]"),
    ("topk:ratio=x", "topk ratio: a number in (0, 1]"),
    ("powersgd:rank=0", "powersgd rank: an integer from 1 to 1024"),
    ("powersgd:rnk=4", "keys of powersgd: rank, warm, ef, min_rate, eps, iters, scope, when, start, seed (not 'rnk')"),
    ("qsgd:levels", "key=value pairs"),
    ("sign:scope=node", "sign scope: one of bridge, all"),
    ("fp16:when=sometimes", "one of always, auto"),
    ("topk:ratio=0.1,ratio=0.2", "each key once"),
    ("top k", "name[:key=value,...]"),
])
def test_bad_specs_are_typed_errors_that_say_what_is_allowed(bad, says):
    with pytest.raises(VcgaConfigError) as e:
        parse_spec(bad)
    assert says in str(e.value) and "compression" in str(e.value)


def test_config_and_env_carry_the_spec(tmp_path: Path):
    from vcga.config import load_config

    assert load_config(env={}).compression is None
    assert load_config(env={"VCGA_COMPRESSION": "powersgd:rank=4"}).compression == "powersgd:rank=4"
    assert load_config(env={"VCGA_COMPRESSION": "none"}).compression is None
    with pytest.raises(VcgaConfigError, match="VCGA_COMPRESSION"):
        load_config(env={"VCGA_COMPRESSION": "topk:ratio"})
    f = tmp_path / "c.yaml"
    f.write_text("compression: topk:ratio=0.01\n")
    assert load_config(f, env={}).compression == "topk:ratio=0.01"


# ---------------------------------------------------------------------------------------------------
# Exact arithmetic and error feedback
# ---------------------------------------------------------------------------------------------------


def _rational_identity(sent, hi, lo, x) -> bool:
    return all(Fraction(s) + Fraction(h) + Fraction(lo_) == Fraction(v)
               for s, h, lo_, v in zip(*(t.reshape(-1).double().tolist() for t in (sent, hi, lo, x)), strict=False))


def _adversarial(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from 1e-30 to 1e30: a single-tensor residual loses bits on most of them."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.randint(-30, 30, (n,), generator=g)).float()


def test_two_sum_is_error_free():
    a, b = _adversarial(2000, 1), _adversarial(2000, 2)
    s, e = two_sum(a, b)
    assert all(Fraction(x) + Fraction(y) == Fraction(p) + Fraction(q)
               for x, y, p, q in zip(a.double().tolist(), b.double().tolist(), s.double().tolist(), e.double().tolist(), strict=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 9, 4097, 100_003])
def test_sign_host_path_gives_the_device_paths_bytes(n, dtype):
    """``sign`` encodes and decodes on the host with numpy (packbits) and on a device with torch
    expressions: the same payload bytes and decoded bits -- -0.0 and NaN included, for every
    floating dtype a gradient comes in (numpy has no bfloat16) -- so ranks whose payloads are made
    on different kinds of device still decode alike."""
    from vcga.plugins.compressors import Sign, _packbits, _unpackbits

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    if n > 8:
        x[3], x[5] = -0.0, float("nan")
    state: dict = {}
    bits, scale = Sign(True, True).compress(x, state, CompressContext(2, 0, 0, 0, "worker"))
    assert torch.equal(bits, _packbits(x >= 0))
    assert torch.equal(scale.view(torch.int32), x.abs().to(torch.float64).mean().to(torch.float32).reshape(1).view(torch.int32)) \
        if n else torch.equal(scale, torch.zeros(1))
    decoded = Sign(True, True).decompress([bits, scale], state, CompressContext(2, 0, 0, 0, "worker"))
    torch_way = (_unpackbits(bits, n).to(torch.float32) * 2 - 1) * scale
    assert torch.equal(decoded.view(torch.int32), torch_way.view(torch.int32))


def _same_selection(a: torch.Tensor, idx: torch.Tensor, k: int) -> None:
    """``idx`` is k distinct indices whose values are the k largest of ``a`` (as a multiset: which
    of equal values at the k-th is taken is free)."""
    assert idx.numel() == k and torch.unique(idx).numel() == k
    ref = torch.topk(a, k).values
    got = torch.sort(a[idx], descending=True).values
    assert torch.equal(torch.nan_to_num(got, nan=-1.0), torch.nan_to_num(ref, nan=-1.0))


@pytest.mark.parametrize("case", ["gaussian", "heavy rows", "ties", "nan", "sample misjudges", "small", "large share"])
def test_topk_narrowed_selection_keeps_exactly_the_k_largest(case):
    """The sampled narrowing of top-k's selection (plugins/compressors/__init__.py ``largest``) selects what
    torch.topk does on the whole tensor -- also where its strided sample misjudges the threshold
    (every sampled element tiny, the large ones between the samples: the whole-tensor search)."""
    from vcga.plugins.compressors import largest

    g = torch.Generator().manual_seed(7)
    n, k = 400_000, 4_000
    a = torch.randn(n, generator=g).abs()
    if case == "heavy rows":
        a = a.reshape(800, 500)
        a[:3] *= 100
        a = a.reshape(-1)
    elif case == "ties":
        a = torch.randint(0, 50, (n,), generator=g).float()
    elif case == "nan":
        a[torch.randint(0, n, (5,), generator=g)] = float("nan")
    elif case == "sample misjudges":
        stride = n // min(n // 16, max(4096, 64 * n // k))  # the sample is a[::stride]; its j-th largest the threshold
        j = math.ceil(2 * k * len(range(0, n, stride)) / n)
        a = torch.full((n,), 1e-3)
        a[1::stride] = 2.0  # the large values sit between the samples
        a[::stride] = 0.0
        a[::stride][:j] = 3.0  # the sample's j largest: threshold 3.0, j < k candidates
    elif case == "small":
        n, k = 200_000, 2_000
        a = a[:n]
    elif case == "large share":
        k = n // 10
    whole: list[int] = []
    real_topk = torch.topk

    def counting_topk(t, *args, **kwargs):
        if t.numel() == a.numel():
            whole.append(1)
        return real_topk(t, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "topk", counting_topk)
        idx = largest(a, k)
    _same_selection(a, idx, k)
    # the whole tensor is searched only where narrowing cannot help or the sample misjudged
    assert bool(whole) == (case in ("sample misjudges", "small", "large share")), case


def test_a_residual_restored_on_the_host_is_carried_to_the_gradients_device_not_dropped():
    """A checkpointed residual is read onto the CPU (it may come from another vendor's device); the
    next gradient on another device must carry it there, not start afresh as for a changed layout.
    torch's "meta" device stands in for an accelerator (this host has none): it tracks devices,
    not values, so the test checks where the residual went and that it was kept."""
    ef = ErrorFeedback()
    ef.restore((torch.full((6,), 0.5), torch.zeros(6)))
    x = ef.input(torch.zeros(6, device="meta"))
    assert ef.hi.device.type == ef.lo.device.type == x.device.type == "meta"
    assert not ef._fresh  # carried: a fresh start would have replaced the residual by zeros
    ef.update(x, torch.zeros(6, device="meta"))
    # on the same device, the carried residual is added exactly
    ef = ErrorFeedback()
    ef.restore((torch.full((6,), 0.5, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)))
    assert torch.equal(ef.input(torch.ones(6, dtype=torch.float64)), torch.full((6,), 1.5, dtype=torch.float64))


def test_error_feedback_is_exact_where_a_plain_residual_is_not():
    """sent + residual == input exactly at every step, for sent values far from the input; the
    naive fl(x - sent) residual fails the same rational check (so the check can fail)."""
    ef = ErrorFeedback(record=True)
    naive_fails = 0
    for step in range(4):
        g = _adversarial(3000, 10 + step)
        x = ef.input(g)
        sent = _adversarial(3000, 100 + step)  # what a coarse compressor might decode
        ef.update(x, sent)
        rec = ef.last
        assert _rational_identity(rec.sent, rec.hi, rec.lo, rec.x)
        naive = x - sent
        naive_fails += not _rational_identity(sent, naive, torch.zeros_like(naive), x)
    assert naive_fails == 4


def test_error_feedback_in_blocks_gives_the_bits_of_whole_tensor_passes():
    """The residual works in cache-sized blocks on the host: every element must go through the
    same operations as in one pass over the whole tensor (written out here with two_sum), across
    block edges and a ragged last block, record on and off."""
    from vcga.compress import ef as ef_mod

    n = 2 * ef_mod.BLOCK + 123
    for record in (False, True):
        ef = ErrorFeedback(record=record)
        hi = lo = None
        for step in range(3):
            g = _adversarial(n, 40 + step).reshape(-1, 1)  # 2-D: the blocks run over its flat view
            x = ef.input(g)
            if hi is None:
                want_x, pending = g.clone(), None
            else:
                want_x, e1 = two_sum(g, hi)
                pending = lo + e1  # the low part joins the next residual, not this input
            assert torch.equal(x, want_x)
            sent = _adversarial(n, 200 + step).reshape(g.shape)
            ef.update(x, sent)
            hi, lo = two_sum(want_x, -sent)
            if record:
                assert torch.equal(ef.last.hi, hi) and torch.equal(ef.last.lo, lo), (record, step)
            if pending is not None:
                lo = lo + pending
            assert torch.equal(ef.hi, hi) and torch.equal(ef.lo, lo), (record, step)


def test_two_diff_is_two_sum_of_the_negation():
    """two_diff_ (a − b without forming −b) has the bits of two_sum(a, −b), so it is error free."""
    from vcga.compress.exact import two_diff_

    a, b = _adversarial(3000, 3), _adversarial(3000, 4)
    s, e, t = torch.empty_like(a), torch.empty_like(a), torch.empty_like(a)
    two_diff_(a, b, s, e, t)
    ws, we = two_sum(a, -b)
    assert torch.equal(s, ws) and torch.equal(e, we)
    assert _rational_identity(b, s, e, a)  # b + s + e == a


def test_error_feedback_conserves_across_steps_to_second_order():
    """Σ sent + residual == Σ g up to the rounding of the low parts (order u² per step), while a
    single fp32 residual drifts by order u per step."""
    ef = ErrorFeedback()
    total_g = Fraction(0)
    total_sent = Fraction(0)
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        grad = torch.randn(1, generator=g) * 1e3
        x = ef.input(grad)
        sent = (x * 0.37).float()  # compress to a coarse fraction
        ef.update(x, sent)
        total_g += Fraction(grad.item())
        total_sent += Fraction(sent.item())
    residual = Fraction(ef.hi.item()) + Fraction(ef.lo.item())
    drift = abs(float(total_g - total_sent - residual))
    assert drift <= 50 * 3 * (2.0**-24) ** 2 * 2e3 * 4


def test_tree_sum_and_outer_sum_are_fixed_order():
    x = torch.randn(37, 5)
    assert torch.equal(tree_sum(x), tree_sum(x.clone()))
    assert torch.allclose(tree_sum(x), x.double().sum(0).float(), atol=1e-5)
    # outer_sum is the products added in order k = 0, 1, ..., bit for bit, in one block of rows or
    # several (300 rows of 1024 columns: three blocks and a partial one)
    for n, m, r in ((20, 15, 3), (300, 1024, 4), (5, 7, 1)):
        p, q = torch.randn(n, r), torch.randn(m, r)
        ref = p[:, 0:1] * q[:, 0]
        for k in range(1, r):
            ref = ref + p[:, k:k + 1] * q[:, k]
        assert torch.equal(outer_sum(p, q), ref)
        assert torch.allclose(outer_sum(p, q), p @ q.t(), atol=1e-5)


def test_orthonormalize_gives_orthonormal_columns_and_keeps_zero_columns_zero():
    p = torch.randn(50, 4, dtype=torch.float64)
    q = orthonormalize(p.clone())
    assert torch.allclose(q.t() @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    z = torch.zeros(10, 2)
    assert torch.equal(orthonormalize(z.clone()), z)


# ---------------------------------------------------------------------------------------------------
# The built-in compressors, one process
# ---------------------------------------------------------------------------------------------------


def _make(name: str, **opts):
    spec = parse_spec(name + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else ""))
    return compressors()[spec.name].create(**spec.options)


@pytest.mark.parametrize("name", ["fp16", "bf16", "topk", "sign", "qsgd", "powersgd"])
@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (64, 48), (3, 5, 7)])
def test_payload_bytes_are_what_the_compressor_declares(name, shape):
    c = _make(name)
    x = torch.randn(*shape)
    ctx = CompressContext(2, 0, 0, 3)
    state: dict = {}
    sent = 0
    rounds = c.rounds if c.combine is Combine.SUM else 1
    for rnd in range(rounds):
        pl = c.compress(x, state, ctx, rnd)
        sent += sum(t.numel() * t.element_size() for t in pl)
        out = c.decompress(pl, state, ctx, rnd)
        if out is not None:
            break
    assert sent == c.payload_nbytes(shape, "float32")
    assert out is not None and out.numel() == x.numel()


@pytest.mark.parametrize("name,opts", [("topk", {"ratio": 0.01}), ("topk", {"ratio": 0.3}), ("sign", {}),
                                       ("qsgd", {}), ("qsgd", {"levels": 4})])
def test_adding_a_peers_payload_gives_the_bits_of_its_dense_decode_added(name, opts):
    """The driver adds the peers' decoded payloads in peer order through ``decompress_add``: for
    every built-in GATHER compressor it must give the bits of the dense decode added (top-k adds
    only where the payload has values, in place: a sparse payload, and the k elements' additions
    are the dense sum's). Three peers whose top-k picks overlap and differ."""
    c = _make(name, **opts)
    g = torch.Generator().manual_seed(11)
    base = torch.randn(50_000, generator=g)
    xs = [base + 0.5 * torch.randn(50_000, generator=g) for _ in range(3)]  # overlapping largest entries
    state: dict = {}
    payloads = [c.compress(x, state, CompressContext(3, p, 0, 5)) for p, x in enumerate(xs)]
    ctx = CompressContext(3, 0, 0, 5)
    dense = c.decompress(payloads[0], state, ctx).reshape(-1)
    total = c.decompress(payloads[0], state, ctx).reshape(-1)
    for pl in payloads[1:]:
        dense = dense + c.decompress(pl, state, ctx).reshape(-1)
        total = c.decompress_add(pl, total, state, ctx)
    assert total.dtype == dense.dtype and total.shape == dense.shape
    assert total.view(torch.int32).equal(dense.view(torch.int32))  # the same bits (no zero sums here)
    if name == "topk":  # the picks overlap (some elements were added to) and differ (some were not)
        picked = [set(pl[0].tolist()) for pl in payloads]
        assert picked[0] & picked[1] and picked[0] ^ picked[1]


def test_topk_keeps_the_largest_and_sign_sends_the_mean_magnitude():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 1.0, -2.0])
    c = _make("topk", ratio=0.25)
    st: dict = {}
    out = c.decompress(c.compress(x, st, CompressContext(2, 0, 0, 0)), st, CompressContext(2, 0, 0, 0))
    assert out.tolist() == [0, -5.0, 0, 3.0, 0, 0, 0, 0]
    s = _make("sign")
    st = {}
    out = s.decompress(s.compress(x, st, CompressContext(2, 0, 0, 0)), st, CompressContext(2, 0, 0, 0))
    m = float(x.abs().double().mean())
    assert torch.allclose(out, torch.where(x >= 0, m, -m).float())


@pytest.mark.parametrize("ratio", [0.01, 0.05, 0.1, 0.5])
def test_topk_sends_ascending_indices_of_the_largest_with_their_values(ratio):
    """Both ways of ordering the indices (a sort for few, marks read back for many) send the k
    largest magnitudes' indices in ascending order, and the values at them."""
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    c = _make("topk", ratio=ratio)
    idx, val = c.compress(x, {}, CompressContext(2, 0, 0, 0))
    k = c.k(x.numel())
    want = torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), want)
    assert torch.equal(val, x[want])


def test_topk_indices_widen_to_int64_past_two_to_the_31_elements(monkeypatch):
    """Top-k's int32 indices would wrap past 2^31 elements (one bucket of a 2^31-entry embedding),
    and the peers would write every value past the wrap to the wrong element. Past the limit the
    indices travel as int64, the declared payload counts 8 bytes for each, and the decoder puts
    every value back where it was. (The limit is lowered here: 2^31 float32 elements are 8 GiB.)"""
    import vcga.plugins.compressors as pc

    assert pc.index_dtype(2 ** 31) == torch.int32 and pc.index_dtype(2 ** 31 + 1) == torch.int64
    c = _make("topk", ratio=0.1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(5))
    for limit, dtype, width in ((5000, torch.int32, 4), (4999, torch.int64, 8)):
        monkeypatch.setattr(pc, "INT32_INDEXED", limit)
        st: dict = {}
        payload = c.compress(x, st, CompressContext(2, 0, 0, 0))
        assert payload[0].dtype == dtype
        assert sum(t.numel() * t.element_size() for t in payload) == c.payload_nbytes((5000,), "float32") == 500 * (width + 4)
        out = c.decompress(payload, st, CompressContext(2, 0, 0, 0))
        keep = torch.topk(x.abs(), 500).indices
        assert torch.equal(out[keep], x[keep]) and int((out != 0).sum()) == 500


def test_qsgd_draws_are_reproducible_and_differ_by_peer_and_step():
    c = _make("qsgd", levels=4)
    x = torch.randn(3000)
    def enc(peer, step):
        return c.compress(x, {}, CompressContext(2, peer, step, 11))[0]
    assert torch.equal(enc(0, 0), enc(0, 0))
    assert not torch.equal(enc(0, 0), enc(1, 0)) and not torch.equal(enc(0, 0), enc(0, 1))


def test_powersgd_sent_is_the_projection_of_this_ranks_matrix():
    c = _make("powersgd", rank=3)
    m = torch.randn(40, 30, dtype=torch.float64).float()
    st: dict = {}
    ctx = CompressContext(1, 0, 0, 5)
    c.decompress(c.compress(m, st, ctx, 0), st, ctx, 0)
    q = c.compress(m, st, ctx, 1)
    out = c.decompress(q, st, ctx, 1)
    p = st["p"]
    assert torch.allclose(out, p @ (p.t() @ m), atol=1e-4)
    # what this rank sent is P̂ Q_ownᵀ in the decode's fixed order (its own bookkeeping, read by no
    # other rank): with one peer Q_own is the sum, so the same bits as the decoded sum; and the
    # factors the driver forms it from on the fly give those bits too
    sent = c.sent(m, q, st, ctx)
    assert sent.shape == m.shape and torch.equal(sent, out)
    fp, fq = c.sent_factors(m, q, st, ctx)
    assert torch.equal(outer_sum(fp, fq), sent)
    assert c.decompress(c.compress(torch.randn(9), {}, ctx, 0), {"compressed": False}, ctx, 0) is not None


def test_powersgd_more_power_iterations_approximate_closer_at_the_same_rank():
    """iters=2 runs four rounds (P, Q, P, Q: twice the bytes) and, from the same start, its rank-r
    approximation of a matrix whose spectrum decays slowly is closer than one iteration's; the
    decoded value is still the projection onto the final P̂."""
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    s = 0.9 ** torch.arange(40, dtype=torch.float64)  # slow decay: one iteration leaves a visible gap
    m = (u[:, :40] * s) @ v.t()
    m = m.float()
    ctx = CompressContext(1, 0, 0, 5)
    errs = {}
    for iters in (1, 2):
        c = _make("powersgd", rank=3, warm=0, iters=iters)
        assert c.rounds == 2 * iters and c.payload_nbytes((60, 40), "float32") == (60 + 40) * 3 * 4 * iters
        st: dict = {}
        sent_bytes, out = 0, None
        for rnd in range(c.rounds):
            pl = c.compress(m, st, ctx, rnd)
            sent_bytes += sum(t.numel() * t.element_size() for t in pl)
            out = c.decompress(pl, st, ctx, rnd)
            assert (out is None) == (rnd + 1 < c.rounds)
        assert sent_bytes == c.payload_nbytes((60, 40), "float32")
        p = st["p"]
        assert torch.allclose(out, p @ (p.t() @ m), atol=1e-4)
        errs[iters] = float((m - out).norm())
    assert errs[2] < errs[1], errs


# ---------------------------------------------------------------------------------------------------
# Spawned worlds: DDP through the hook, and the plumbing exact
# ---------------------------------------------------------------------------------------------------

DDP_SPECS = ["powersgd:rank=4", "topk:ratio=0.05", "sign", "qsgd:levels=8", "fp16", "bf16",
             "powersgd:rank=2,scope=all", "topk:ratio=0.05,server=1,scope=all", "powersgd:rank=2,when=auto", "none",
             "sign:scope=all|unused",
             # torch's powerSGD_hook chains all_reduces in future callbacks (the asynchronous bridge
             # runs them on its communication thread: vcga/pg/workqueue.py)
             "torch-powersgd"]


@pytest.fixture(scope="module")
def world_2x2():
    from compression_world import rank_main

    from vcga.spawn import run_ranks

    return run_ranks(rank_main, 4, "nccl:2,hccl:2", DDP_SPECS, timeout=600)


@pytest.fixture(scope="module")
def world_unequal():
    from compression_world import rank_main

    from vcga.spawn import run_ranks

    return run_ranks(rank_main, 4, "nccl:1,hccl:2,cncl:1", ["powersgd:rank=2", "sign", "topk:ratio=0.1",
                                                                        "powersgd:rank=2,iters=2"], timeout=600)


def test_nothing_is_compressed_where_nothing_crosses_a_link():
    """A world of one rank (scope all and scope bridge on its one island): the hook reduces
    exactly -- every gradient equals plain DDP's, bit for bit -- and counts the buckets as plain."""
    from compression_world import alone_main

    from vcga.spawn import run_ranks

    specs = ["topk:ratio=0.01", "topk:ratio=0.01,scope=bridge", "powersgd:rank=1", "sign", "qsgd:levels=4"]
    got = run_ranks(alone_main, 1, "nccl:1", specs, timeout=300)
    for spec in specs:
        assert got[spec]["same"], spec
        assert got[spec]["stats"]["compressed"] == 0 and got[spec]["stats"]["plain"] == 3, (spec, got[spec])


def test_bfloat16_and_float16_models_train_through_every_compressor_on_a_mixed_world():
    """Half-precision gradients on two vendors: where the bridge cannot sum a payload's dtype
    natively it gathers and adds in float32, and PowerSGD then got float32 sums to multiply with
    its bfloat16 matrices (it raised). Every compressor runs, every rank holds the same bits."""
    from compression_world import narrow_main

    from vcga.spawn import run_ranks

    specs = ["powersgd:rank=2", "powersgd:rank=2,scope=all", "fp16", "bf16", "sign", "topk:ratio=0.05", "qsgd:levels=8"]
    got = run_ranks(narrow_main, 2, "nccl:1,hccl:1", specs, timeout=300)
    assert len(got) == 2 * len(specs)
    for case, r in got.items():
        assert "error" not in r, (case, r.get("error"))
        assert r["identical"] and r["finite"] and r["stats"]["compressed"] == 4, (case, r)


def test_an_overflowed_step_is_skipped_and_training_goes_on_with_every_error_feedback_compressor():
    """Fake-backed (nccl:2,hccl:2 simulated). One rank's gradients overflow at step 3, as float16
    training's do now and then: torch.amp's GradScaler skips that step and halves its scale. The
    overflow went into every residual and PowerSGD warm start it reached (``inf - inf`` is NaN), so
    every later sum was NaN and the scaler skipped every step to the end. The buffers' state now
    starts afresh after a non-finite sum: one step skipped, then training goes on, the same bits on
    every rank."""
    from compression_world import overflow_main

    from vcga.spawn import run_ranks

    specs = ["powersgd:rank=2,min_rate=0", "powersgd:rank=2,min_rate=0,scope=all", "topk:ratio=0.1",
             "topk:ratio=0.1,server=1", "sign"]
    got = run_ranks(overflow_main, 4, "nccl:2,hccl:2", specs, timeout=300)
    for spec in specs:
        r = got[spec]
        assert r["scales"] == [1024.0] * 3 + [512.0] * 5, (spec, r["scales"])  # step 3 alone skipped
        assert r["finite"] and r["identical"], (spec, r)
        assert r["describe"]["restarted"] >= 1 and r["describe"]["stats"]["compressed"] > 0, (spec, r["describe"])


def test_on_a_data_parallel_subgroup_the_default_scope_is_all_and_bridge_is_refused_typed():
    """Fake-backed (nccl:2,hccl:2 simulated). DDP over a subgroup of the job, each spanning both
    vendors: scope bridge would create island and peer groups that every rank of the job must
    join, and the other ranks never come. Without a scope the hook compresses the whole all_reduce
    there (not a refusal naming a scope the user had not given); an explicit ``scope=bridge``
    is refused with a typed error that says what to use. The groups come from a ``DeviceMesh``;
    passing every data-parallel group read from it (docs/compression.md's line) makes scope bridge
    the default."""
    from compression_world import subgroup_main

    from vcga.spawn import run_ranks

    got = run_ranks(subgroup_main, 4, "nccl:2,hccl:2", ["powersgd:rank=2,min_rate=0", "topk:ratio=0.1",
                                                        "powersgd:rank=2,scope=bridge", "topk:ratio=0.1+mesh"],
                    timeout=300)
    for rank, out in enumerate(got):
        assert out["mesh groups"] == [[0, 2], [1, 3]], out
        # every data-parallel group read from the DeviceMesh: scope bridge, the pair identical
        r = out["topk:ratio=0.1+mesh"]
        assert r.get("scope") == "bridge" and r["stats"] == {"compressed": 3, "plain": 0}, (rank, r)
        assert r["identical"] and r["finite"], (rank, r)
        for spec in ("powersgd:rank=2,min_rate=0", "topk:ratio=0.1"):
            r = out[spec]
            assert r.get("scope") == "all" and r["stats"] == {"compressed": 3, "plain": 0}, (rank, spec, r)
            assert r["identical"] and r["finite"], (rank, spec, r)
        err = out["powersgd:rank=2,scope=bridge"].get("error", "")
        assert err.startswith("VcgaConfigError") and "scope=all (or no scope) on a subgroup" in err, (rank, err)


def test_scope_bridge_runs_on_data_parallel_subgroups_the_job_creates_together(tmp_path):
    """Fake-backed (nccl:2,hccl:2 simulated). A job that also splits its model passes every
    data-parallel group (``data_parallel_groups=[[0, 2, 3], [1]]``) and every rank calls
    ``ddp_hook`` together: scope bridge is then the default on each group spanning islands. In
    {0, 2, 3} the hccl island {2, 3} sums exactly, its first rank exchanges compressed with rank 0
    and broadcasts to rank 3 (a source that is group rank 1 and job rank 2): rank 3 sends nothing
    across, rank 0 nothing inside an island, and the group ends with identical gradients. Every
    rank's checkpoint entry has its own key, and a new hook loaded from a checkpoint of the whole
    job holds that rank's own state (keyed by group rank, ranks 0 and 1 -- rank 0 of each group --
    would share one entry, and one of them would lose its state). Groups that
    differ between ranks, leave a rank out or do not hold the DDP group are refused, typed, on every
    rank -- none waits in a group creation."""
    from compression_world import subgroup_bridge_main

    from vcga.spawn import run_ranks

    specs = ["powersgd:rank=2,min_rate=0", "topk:ratio=0.1", "topk:ratio=0.1,scope=all"]
    got = run_ranks(subgroup_bridge_main, 4, "nccl:2,hccl:2", specs, str(tmp_path), timeout=300)
    for rank, out in enumerate(got):
        for spec in specs:
            r = out[spec]
            assert r["identical"] and r["finite"], (rank, spec, r)
            assert r["entries"] == [f"vcga-compression-rank{rank}"] and r["reloaded"], (rank, spec, r)
            if rank == 1:  # a group of one: nothing crosses a link, nothing is compressed
                assert r["stats"] == {"compressed": 0, "plain": 3} and r["sent"] == {"island": 0, "cross": 0}, r
                continue
            assert r["stats"] == {"compressed": 3, "plain": 0}, (rank, spec, r)
            assert r["islands"] == [[0], [1, 2]], (rank, spec, r)  # group ranks: {0} nccl, {2, 3} hccl
            bridge = "scope=all" not in spec
            assert r["scope"] == ("bridge" if bridge else "all"), (rank, spec, r)
            if bridge:
                assert (r["sent"]["island"] > 0) == (rank in (2, 3)), (rank, spec, r)
                assert (r["sent"]["cross"] > 0) == (rank in (0, 2)), (rank, spec, r)
            else:
                assert r["sent"]["cross"] > 0 and r["sent"]["island"] == 0, (rank, spec, r)
        errors = {what: out[what]["error"] for what in ("groups differ between ranks", "a rank left out",
                                                         "not the process group")}
        for what, err in errors.items():
            assert err.startswith("VcgaConfigError") and "data_parallel_groups" in err, (rank, what, err)
        assert "every rank of the job must pass the same groups" in errors["groups differ between ranks"], errors
        assert "ranks [1] are in none" in errors["a rank left out"], errors
        assert "pass the group DDP reduces over" in errors["not the process group"], errors


def test_the_layout_is_islands_by_backend_and_node(world_2x2, world_unequal):
    lay = world_2x2["layout"]
    assert [i["ranks"] for i in lay["islands"]] == [[0, 1], [2, 3]] and lay["equal"]
    assert lay["peer_sets"] == [[0, 2], [1, 3]] and lay["hop"] == "cross-vendor"
    lay = world_unequal["layout"]
    assert [i["ranks"] for i in lay["islands"]] == [[0], [1, 2], [3]] and not lay["equal"]
    assert lay["peer_sets"] == [[0, 1, 3]]


@pytest.mark.parametrize("world", ["world_2x2", "world_unequal"])
def test_scope_bridge_and_all_add_exactly_where_the_compressor_is_lossless(world, request):
    """bf16 of small integers loses nothing: the reduce-scatter / exchange / all-gather (or the
    island all_reduce / leaders / broadcast) must then give the exact sum, bitwise, on every rank."""
    res = request.getfixturevalue(world)["exact"]
    for scope in ("bridge", "all"):
        assert res[f"bf16 {scope}"] is True, res
        assert res[f"bf16 {scope} identical"] and res[f"powersgd:rank=64,min_rate=0 {scope} identical"], res
        # full rank: the reconstruction equals the sum up to float32 rounding of values <= 4*8*64
        assert res[f"powersgd:rank=64,min_rate=0 {scope}"] < 1e-2, res


def test_a_bucket_of_one_matrix_is_compressed_by_every_island_rank(world_2x2):
    """DDP's usual bucket is one large matrix and its bias: cutting it only between parameters gave
    the whole matrix to one rank of each island (all of PowerSGD's work, the others idle) and padded
    the other ranks' reduce-scatter parts to its size. Each rank must send its share, compressed."""
    shares = world_2x2["one_matrix"]
    sent = [s["payload"] for s in shares]
    assert all(s > 0 for s in sent), sent
    assert max(sent) <= 1.5 * min(sent), sent  # parameter cuts: 768 B against 128 B
    assert all(s["payload"] < s["plain"] / 2 for s in shares), shares
    # the island copies the decoded parts back as PowerSGD's P̂ and summed Q (576 B a rank here, with
    # the cut bias row) instead of the decoded values (4160 B), and every rank rebuilds the other
    # parts to the same bits as their owners decoded
    assert all(0 < s["island_gather"] < s["plain"] / 4 for s in shares), shares
    assert len({s["digest"] for s in shares}) == 1, shares


def test_buckets_are_cut_into_equal_parts_of_whole_rows_and_cut_rows():
    """A compressor that needs shapes sees, for each island rank's equal part of a bucket, whole
    parameters, the whole rows of a matrix the part cuts (a matrix of their own) and the elements
    of a cut row (1-D): together exactly the part, in order."""
    import random

    from vcga.compress import Reducer

    rnd = random.Random(3)
    for _ in range(500):
        shapes = [tuple(rnd.choice([1, 2, 3, 5, 8]) for _ in range(rnd.choice([1, 2, 3])))
                  for _ in range(rnd.randint(1, 5))]
        n, k = sum(math.prod(s) for s in shapes), rnd.randint(1, 4)
        offsets, cuts = Reducer.offsets(shapes), Reducer.cuts(n, k, None)
        covered = []
        for i in range(k):
            for j, start, shape in Reducer.pieces(shapes, offsets, cuts[i], cuts[i + 1]):
                m = math.prod(shape)
                assert cuts[i] <= start and start + m <= cuts[i + 1]
                if len(shape) >= 2:  # whole rows of parameter j, in its shape
                    row = math.prod(shapes[j]) // shapes[j][0]
                    assert (start - offsets[j]) % row == 0 and m % row == 0 and shape[1:] == shapes[j][1:]
                covered.extend(range(start, start + m))
        assert covered == list(range(n)), (shapes, k)
    one = Reducer.pieces([(1024, 1024), (1024,)], [0, 1 << 20], 0, 524800)
    assert one == [(0, 0, (512, 1024)), (0, 524288, (512,))]


def test_ddp_with_every_compressor_keeps_ranks_bitwise_identical(world_2x2, world_unequal):
    for res in (world_2x2["ddp"], world_unequal["ddp"]):
        for spec, r in res.items():
            assert r["identical"] and r["finite"], (spec, r)
    d = world_2x2["ddp"]
    assert d["powersgd:rank=4"]["scope"] == "bridge" and d["powersgd:rank=2,scope=all"]["scope"] == "all"
    assert d["powersgd:rank=4"]["stats"]["compressed"] > 0 and d["none"]["stats"]["compressed"] == 0
    # tiny buckets on a same-node link: the cost model says plain transfer wins -- with the figures
    # the bridge measured (or cached) for the hop when the group was created; the trial then times
    # compression on alternate steps (vcga.compress.auto), the same buckets as plain DDP in all
    auto = d["powersgd:rank=2,when=auto"]
    assert auto["auto"]["buckets"] and not any(b["model_chose"] for b in auto["auto"]["buckets"]), auto["auto"]
    assert sum(auto["stats"].values()) == d["none"]["stats"]["plain"] and auto["stats"]["compressed"] > 0
    assert auto["link"]["source"] == "bridge α–β" and auto["link"]["name"] == "cross-vendor", auto["link"]
    assert 0 < d["topk:ratio=0.05"]["cross_sent"] < d["fp16"]["cross_sent"]
    # a step's buckets share one compressed exchange: PowerSGD's two rounds are two collectives across
    # the hop per step (3 steps), however many buckets the tiny bucket cap made
    ps = d["powersgd:rank=4"]
    assert ps["buckets"] > 3 and ps["cross_calls"] == 2 * 3, ps


# ---------------------------------------------------------------------------------------------------
# vcga verify --check compression
# ---------------------------------------------------------------------------------------------------


def _env(*plugins: str) -> dict[str, str]:
    env = {"COLUMNS": "250", "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    if plugins:
        env["VCGA_PLUGINS"] = ",".join(plugins)
    return env


def test_verify_compression_passes_on_gloo_the_sim_backends_and_a_mixed_world(tmp_path: Path):
    r = run_vcga("verify", "--profile", str(HELPERS / "verify_compression.yaml"),
                 env={**_env(), "TMPDIR": str(tmp_path)}, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    for backend in ("gloo", "sim-nccl", "sim-hccl", "sim-cncl", "sim:nccl:2,hccl:2"):
        assert f"compression │ {backend}" in r.stdout, r.stdout


def _verify_broken(tmp_path: Path, world: str, compression: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``vcga verify`` of the compression family alone with the broken compressors' plugin, on
    ``world`` (profile lines), failing; its output and its FAIL lines."""
    prof = tmp_path / "p.yaml"
    prof.write_text(f"name: broken\ncollective_timeout_s: 10\n{world}world_sizes: [2]\nother_checks: false\n"
                    f"checks:\n  compression: {{{compression}}}\n")
    r = run_vcga("verify", "--profile", str(prof), env={**_env("broken_compressors"), "TMPDIR": str(tmp_path)},
                 timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    return r, [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("FAIL ")]


def test_verify_compression_fails_each_broken_compressor_on_its_own_case(tmp_path: Path):
    _, fails = _verify_broken(tmp_path, "backends: [gloo]\nmixed_vendor_sets: []\n",
                              "compressors: [broken-sent, broken-identity, broken-wire, broken-bias, broken-sticky, "
                              "broken-overwrite, topk], n: 256, steps: 2, trials: 32")

    def failed(name: str) -> list[str]:
        return [f.split(f"{name} scope=all: ", 1)[1].split(":")[0] for f in fails if f" {name} scope=" in f]

    assert failed("broken-sent") == ["sent is what the others receive"], fails
    # every case that compares ranks' bits
    assert failed("broken-identity") == ["ranks identical", "an overflow is seen, then forgotten"], fails
    assert failed("broken-wire") == ["bytes on the wire <= declared"], fails
    assert failed("broken-bias") == ["unbiased (Hoeffding bound)"], fails
    assert any("biased beyond the bound" in f for f in fails)
    assert any("more bytes on the wire than declared" in f for f in fails)
    assert failed("broken-sticky") == ["an overflow is seen, then forgotten"], fails
    assert failed("broken-overwrite") == ["the sum is every peer's sent, added in peer order"], fails
    assert len(fails) == 7, fails
    assert not any("topk" in f for f in fails)


def test_verify_compression_confines_a_compressor_that_raises_to_its_own_cases(tmp_path: Path):
    """On a world with islands (two vendors): a compressor that raises fails its case, every rank
    rebuilds the default group, and the checks after it build their island and peer groups again
    -- before, every later case failed on the destroyed group's islands."""
    r, fails = _verify_broken(tmp_path, "backends: []\nmixed_vendor_sets: [\"nccl:1,hccl:1\"]\n",
                              "compressors: [broken-raise, topk], scopes: default, n: 256, steps: 2")
    assert any("broken-raise" in f and "decoding failed on purpose" in f for f in fails), r.stdout
    assert not any("topk" in f for f in fails), fails
    summary = re.search(r"(\d+) passed, (\d+) failed", r.stdout)
    assert summary is not None and int(summary[2]) == len(fails), r.stdout
    assert int(summary[1]) >= 5, r.stdout  # the layout and topk's own cases ran, and passed


# ---------------------------------------------------------------------------------------------------
# when=auto: the cost model
# ---------------------------------------------------------------------------------------------------


def test_the_cost_model_compresses_above_the_crossover_and_never_on_a_link_faster_than_the_compressor():
    from vcga.compress.cost import CompressCost, LinkCost, crossover, should_compress
    from vcga.compress.meter import sent_bytes

    link = LinkCost("1 Gbit/s", 100e-6, 125e6)
    cost = CompressCost(1e-3, 2e-9)
    n_star = crossover(link, cost, wire_ratio=100, peers=2, collectives=2)
    # N* = (c0 + (m-1)α) / (f(1 - 1/R)/β - c1), f = 1 for two peers
    assert n_star == pytest.approx((1e-3 + 100e-6) / ((1 - 1 / 100) / 125e6 - 2e-9))
    for n, want in ((n_star * 0.9, False), (n_star * 1.1, True)):
        plain = sent_bytes("all_reduce", n, 2)
        assert should_compress(n, plain, plain / 100, 2, link, cost) is want
    fast = LinkCost("100 Gbit/s", 20e-6, 12.5e9)
    assert crossover(fast, cost, wire_ratio=100, peers=2, collectives=2) is None


def test_link_figures_come_from_the_transport_in_either_form():
    from vcga.compress.cost import link_from_transport

    class G:
        def __init__(self, d):
            self.transport = type("T", (), {"describe": lambda _self: d})()

    got = link_from_transport(G({"link_classes": {"cross-node": {"alpha_s": 1e-4, "beta_Bps": 1e8}}}), "cross-node")
    assert (got.alpha_s, got.beta_Bps, got.source) == (1e-4, 1e8, "transport α–β")
    bridge = {"calibration": {"figures": {"bridge": {"all_sets": [1e-4, 1e8], "leaders": [2e-4, 5e7]}}}}
    got = link_from_transport(G(bridge), "cross-node", equal=True, peers=2)
    assert (got.alpha_s, got.beta_Bps) == (1e-4, 1e8)  # two peers: bytes sent == bytes reduced
    got = link_from_transport(G(bridge), "cross-node", equal=False, peers=4)
    assert (got.alpha_s, got.beta_Bps) == (2e-4, 5e7 * 1.5)  # leaders; 2(P-1)/P bytes sent per byte
    assert link_from_transport(G({"calibration": None}), "cross-node") is None
    assert link_from_transport(object(), "cross-node") is None


@pytest.mark.parametrize("fault,overlap", [("injected", True), ("injected", False), ("peer-absent", True)],
                         ids=["injected-worker-thread", "injected-inline", "peer-absent"])
def test_a_failed_compressed_exchange_reaches_backward_as_a_typed_vcga_error(fault: str, overlap: bool):
    """The compressed exchange fails at DDP's third step -- a fault injected into the reducer on
    every rank, or a peer that never starts the step (rank 0 times out): ``loss.backward()`` raises
    torch's callback wrapper, whose text names the failure and from which ``vcga.errors.typed``
    recovers the VcgaError -- not torch's "Unable to cast <exception> to Tensor", which a future
    completed with ``set_exception`` gives DDP's C++ reducer."""
    from compression_world import failing_main

    from vcga.spawn import run_ranks

    out = run_ranks(failing_main, 2, "nccl:1,hccl:1", overlap, fault, timeout=300)
    assert out["step 0"] == out["step 1"] == "ok", out
    got = out["step 2"]
    assert got["raised"] == "RuntimeError" and "Unable to cast" not in got["text"], got
    if fault == "injected":
        assert "VcgaError: compressed reduction failed: ValueError('injected fault')" in got["text"], got
        assert got["typed"] == "VcgaError" and got["cause"] == "ValueError('injected fault')", got
    else:
        assert "VcgaTimeoutError: rank 0: all_reduce" in got["text"], got
        assert got["typed"] == "VcgaTimeoutError" and "did not complete within 3 s" in got["typed_text"], got


def test_a_job_resumed_from_a_checkpoint_with_the_compression_state_ends_bitwise_like_the_straight_run(tmp_path):
    """Simulated vendors (nccl:2,hccl:2, scope bridge: every island rank keeps its part's residual).
    Three steps, ``vcga.checkpoint.save`` of the model and the hook's state (for ``sign``
    ``async_save``, with a fourth step taken while it is in flight), a resume in fresh objects
    from another initialisation, three more steps.

    With DDP's buckets the same from its first step (``find_unused_parameters=True``) the
    parameters equal the straight six steps' bit for bit -- residuals, PowerSGD's warm start and
    its ``start=`` count, QSGD's per-step seeds and the two-phase exchange's server residuals all
    carried over; resumed without the state they differ (what the state carries matters). With
    DDP's default (one bucket of all parameters in a new process's first step, rebuilt after it)
    the loaded residuals outlive that step and carry on: the resumed run ends with the straight
    run's buckets and differs from a resume without them. A state kept for another spec is not
    applied: a warning, or with ``strict`` a VcgaCheckpointError. The state's bytes as if saved on
    CUDA (which ``torch.load`` cannot read on this host) resume bit for bit as well."""
    from compression_world import resume_main

    from vcga.spawn import run_ranks

    runs = [("powersgd:rank=2,start=2", True), ("topk:ratio=0.1", True), ("qsgd:levels=16", True), ("sign", True),
            ("topk:ratio=0.1", False)]
    relocate = ("powersgd:rank=2,start=2", "sign")
    out = run_ranks(resume_main, 4, "nccl:2,hccl:2", runs, str(tmp_path), relocate, timeout=600)
    for spec, unused in runs:
        got = out[f"{spec} {unused}"]
        assert got["entry"] == ["vcga-compression-rank0"], (spec, got)
        assert got["loaded step"] == got["loaded step, no state"] == 3, (spec, got)
        assert "ranks differ" not in (got["straight"], got["resumed"], got["resumed without the state"]), (spec, got)
        assert got["resumed without the state"] != got["straight"], (spec, got)
        if unused:
            assert got["resumed"] == got["straight"], (spec, got)
        else:
            assert got["resumed"] != got["resumed without the state"], (spec, got)
        assert got["resumed keys"] == got["straight keys"] and got["straight keys"], (spec, got)
        assert got["other spec step"] == 0, (spec, got)
        assert len(got["other spec warned"]) == 1 and "another compression or layout" in got["other spec warned"][0] \
            and "start afresh" in got["other spec warned"][0], (spec, got)
        assert got["other spec strict"] is not None and "strict=False" in got["other spec strict"], (spec, got)
        if spec in relocate:  # saved on a GPU, resumed here: read onto the host, carried on bit for bit
            assert got["cuda bytes load here"] is False, (spec, got)
            assert got["resumed from cuda bytes"] == got["straight"], (spec, got)
