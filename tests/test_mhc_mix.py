"""The one-pass mHC mixing kernel (``kernels.mhc_mix``) against its XLA formulation, in the
Pallas interpreter: the same fp32 sums in another order, so agreement to ~1e-6 relative, exact
on inputs whose products and sums are exact in fp32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.kernels import mhc_mix as M
from dsv41_jax.model.mhc import hc_mixes

F32 = jnp.float32


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)


@pytest.mark.parametrize("T,K,O,dtype,tiles", [
    (16, 512, 24, jnp.bfloat16, {"bt": 16}),               # one token block: split-K over many ranges
    (37, 256, 24, jnp.bfloat16, {"bt": 16}),               # masked rows of the last token block
    (70, 512, 8, F32, {"splits": 2, "bk": 64, "bt": 64}),  # fp32 stream, two K ranges, n = 2
])
def test_kernel_matches_reference(T, K, O, dtype, tiles):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, K)) * 3, dtype)
    fn = jnp.asarray(rng.standard_normal((O, K)) * 0.05, F32)
    mix, ss = M.hc_mix_sums(x, fn, impl="interpret", **tiles)
    rmix, rss = M.hc_mix_sums_reference(x, fn)
    assert mix.shape == (T, O) and ss.shape == (T,) and mix.dtype == ss.dtype == F32
    assert _rel(mix, rmix) < 1e-6 and _rel(ss, rss) < 1e-6
    # dyadic inputs: every product and partial sum is exact in fp32, so any order gives the same bits
    xd = jnp.asarray(rng.integers(-8, 9, (T, K)) / 4, dtype)
    fd = jnp.asarray(rng.integers(-8, 9, (O, K)) / 8, F32)
    for got, ref in zip(M.hc_mix_sums(xd, fd, impl="interpret", **tiles), M.hc_mix_sums_reference(xd, fd)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_three_way_bf16_split_is_exact():
    rng = np.random.default_rng(3)
    w = jnp.asarray(np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096),
                                    [0.0, -0.0, 1.0, 3.3e38, -1e-30]]), F32)
    hi, mid, lo = M._split3(w)
    assert hi.dtype == mid.dtype == lo.dtype == jnp.bfloat16
    back = (hi.astype(F32) + mid.astype(F32)) + lo.astype(F32)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(w))


def test_split_choice_and_bad_shapes():
    assert M.choose_splits(1, 20480, 16, 128) == 160           # one decode token: 160 one-step ranges
    assert M.choose_splits(8192, 20480, 64, 128) == 2          # 128 token blocks x 2 ranges
    assert M.choose_splits(100000, 20480, 64, 128) == 1
    assert M.out_width(24) == 32 and M.out_width(8) == 16 and M.out_width(16) == 32
    with pytest.raises(ValueError, match="stream"):
        M.hc_mix_sums(jnp.zeros((4, 64)), jnp.zeros((24, 32)))
    with pytest.raises(ValueError, match="power of two"):
        M.hc_mix_sums(jnp.zeros((4, 64)), jnp.zeros((24, 64)), impl="interpret", bt=24)
    with pytest.raises(ValueError, match="fewer than one token block"):
        M.hc_mix_sums(jnp.zeros((4, 64)), jnp.zeros((24, 64)), impl="interpret")
    mix, ss = M.hc_mix_sums(jnp.ones((4, 64)), jnp.ones((24, 64)))  # the XLA form takes any count
    assert np.all(np.asarray(mix) == 64) and np.all(np.asarray(ss) == 64)


def test_hc_mixes_through_the_kernel(monkeypatch):
    """``hc_mixes`` on the kernel path (DSV41_MHC_KERNEL=interpret) against its XLA path: the
    pre / post weights and the Sinkhorn matrix of [B, S, n, D] streams."""
    n, D = 4, 64
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((2, 35, n, D)), jnp.bfloat16)  # 70 tokens: one block + a partial one
    fn = jnp.asarray(rng.standard_normal(((2 + n) * n, n * D)) * 0.05, F32)
    scale = jnp.asarray([0.5, 0.7, 0.9], F32)
    base = jnp.asarray(rng.standard_normal((2 + n) * n) * 0.1, F32)
    kw = dict(hc_mult=n, iters=20, norm_eps=1e-6, hc_eps=1e-6)
    monkeypatch.setenv("DSV41_MHC_KERNEL", "0")
    ref = hc_mixes(h, fn, scale, base, **kw)
    monkeypatch.setenv("DSV41_MHC_KERNEL", "interpret")
    got = jax.jit(lambda *a: hc_mixes(*a, **kw))(h, fn, scale, base)
    for g, r, name in zip(got, ref, ("pre", "post", "comb")):
        assert g.shape == r.shape and _rel(g, r) < 2e-6, name
    monkeypatch.setenv("DSV41_MHC_KERNEL", "2")
    with pytest.raises(ValueError, match="DSV41_MHC_KERNEL"):
        hc_mixes(h, fn, scale, base, **kw)


@pytest.mark.parametrize("B,S,D", [(1, 1, 5120), (3, 1, 64), (2, 32, 256), (1, 1, 80)])
def test_decode_pair_through_hc_mixes(B, S, D, monkeypatch):
    """Decode-sized streams (1, 3 and 64 tokens; a stream of 4 x 80, whose FMA ranges fall back to
    64 inputs) take ``hc_mixes_decode`` (split-K sums, then the per-token epilogue with the
    Sinkhorn in one launch): the same pre / post / comb as the XLA
    path up to fp32 summation order, and exactly the same on dyadic inputs; two launches, no XLA
    op between them but free reshapes."""
    n = 4
    rng = np.random.default_rng(B * S)
    kw = dict(hc_mult=n, iters=20, norm_eps=1e-6, hc_eps=1e-6)
    scale = jnp.asarray([0.5, 0.7, 1.3], F32)
    base = jnp.asarray(rng.standard_normal((2 + n) * n) * 0.1, F32)
    for dyadic in (False, True):
        if dyadic:  # products and sums exact in fp32: only the epilogue's fp32 rounding is left
            h = jnp.asarray(rng.integers(-8, 9, (B, S, n, D)) / 4, jnp.bfloat16)
            fn = jnp.asarray(rng.integers(-8, 9, ((2 + n) * n, n * D)) / 64, F32)
        else:
            h = jnp.asarray(rng.standard_normal((B, S, n, D)), jnp.bfloat16)
            fn = jnp.asarray(rng.standard_normal(((2 + n) * n, n * D)) * 0.05, F32)
        monkeypatch.setenv("DSV41_MHC_KERNEL", "0")
        monkeypatch.setenv("DSV41_SINKHORN", "xla")
        ref = jax.jit(lambda *a: hc_mixes(*a, **kw))(h, fn, scale, base)
        monkeypatch.setenv("DSV41_MHC_KERNEL", "interpret")
        got = jax.jit(lambda *a: hc_mixes(*a, **kw))(h, fn, scale, base)
        for g, r, name in zip(got, ref, ("pre", "post", "comb")):
            assert g.shape == r.shape and g.dtype == F32, name
            assert _rel(g, r) < (1e-6 if dyadic else 2e-5), (name, dyadic, _rel(g, r))
    with pytest.raises(ValueError, match="hc_mixes_decode"):
        M.hc_mixes_decode(jnp.zeros((65, 64), jnp.bfloat16), jnp.zeros((24, 64)), scale, base, n=4, iters=2,
                          norm_eps=1e-6, hc_eps=1e-6, impl="interpret")
