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


def _site_inputs(T, n, D, seed, dyadic=False):
    rng = np.random.default_rng(seed)
    if dyadic:  # every product and sum exact in fp32 (the new stream's values too, |s| <= 3.75 in
        # steps of 1/32: exact in bf16), so any summation order gives the same bits
        h = jnp.asarray(rng.integers(-8, 9, (T, n, D)) / 4, jnp.bfloat16)
        fn = jnp.asarray(rng.integers(-8, 9, ((2 + n) * n, n * D)) / 8, F32)
        y = jnp.asarray(rng.integers(-4, 5, (T, D)) / 4, jnp.bfloat16)
        pre, post = (jnp.asarray(rng.integers(0, 4, (T, n)) / 4, F32) for _ in range(2))
        comb = jnp.asarray(rng.integers(0, 4, (T, n, n)) / 8, F32)
        return h, fn, pre, y, post, comb
    h = jnp.asarray(rng.standard_normal((T, n, D)), jnp.bfloat16)
    fn = jnp.asarray(rng.standard_normal(((2 + n) * n, n * D)) * 0.05, F32)
    y = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    pre = jnp.asarray(rng.random((T, n)) + 0.5, F32)
    post = jnp.asarray(2 * rng.random((T, n)), F32)
    comb = jnp.asarray(rng.random((T, n, n)) / n, F32)
    return h, fn, pre, y, post, comb


@pytest.mark.parametrize("T,n,D,tiles", [
    (70, 4, 128, {"bt": 64, "bd": 32}),               # a partial second token block, 4 column steps
    (64, 4, 256, {"bt": 64, "bd": 64, "splits": 2}),  # two column ranges summed by XLA
    (96, 2, 64, {"bt": 32, "bd": 16}),                # n = 2
    (70, 4, 128, {"bt": 64, "bd": 32, "seq": True}),  # one stream's expansion at a time: the same values
])
def test_site_kernel_matches_the_separate_forms(T, n, D, tiles):
    """``hc_site_sums`` (one pass: the expansion of the previous site, then the mixing sums and
    the collapse of the result) against ``hc_post``, ``hc_mix_sums_reference`` and ``hc_pre``:
    the new stream and the collapse are the same bits (their few-term fp32 sums in the same
    order), the sums the same up to fp32 summation order, and exact on dyadic inputs."""
    from dsv41_jax.model.mhc import hc_post, hc_pre

    for dyadic in (False, True):
        h, fn, pre, y, post, comb = _site_inputs(T, n, D, T + D, dyadic)
        mix, ss, x = M.hc_site_sums(h, fn, pre, impl="interpret", **tiles)
        rmix, rss = M.hc_mix_sums_reference(h.reshape(T, n * D), fn)
        np.testing.assert_array_equal(np.asarray(x, F32), np.asarray(hc_pre(h, pre), F32))
        s, emix, ess, ex = M.hc_site_sums(h, fn, pre, y=y, post=post, comb=comb, impl="interpret", **tiles)
        rs = hc_post(y, h, post, comb)
        np.testing.assert_array_equal(np.asarray(s, F32), np.asarray(rs, F32))
        np.testing.assert_array_equal(np.asarray(ex, F32), np.asarray(hc_pre(rs, pre), F32))
        remix, ress = M.hc_mix_sums_reference(rs.reshape(T, n * D), fn)
        tol = 0 if dyadic else 1e-6
        for g, r in ((mix, rmix), (ss, rss), (emix, remix), (ess, ress)):
            assert g.dtype == F32 and g.shape == r.shape and _rel(g, r) <= tol, (dyadic, _rel(g, r))


def test_site_kernel_refuses_what_it_cannot_take():
    h, fn, pre, y, post, comb = _site_inputs(128, 4, 64, 0)
    with pytest.raises(ValueError, match="expected"):
        M.hc_site_sums(h, fn[:, :128], pre, impl="interpret")
    with pytest.raises(ValueError, match="expected"):
        M.hc_site_sums(h, fn, pre, y=y[:, :32], post=post, comb=comb, impl="interpret")
    with pytest.raises(ValueError, match="at least 128 tokens"):  # one block of the default tiles
        M.hc_site_sums(h[:100], fn, pre[:100], impl="interpret")
    with pytest.raises(ValueError, match="bf16"):
        M.hc_site_sums(h.astype(F32), fn, pre, impl="interpret")
    with pytest.raises(ValueError, match="power of two"):
        M.hc_site_sums(h, fn, pre, impl="interpret", bd=48)
    with pytest.raises(ValueError, match="ranges"):
        M.hc_site_sums(h, fn, pre, impl="interpret", bd=16, splits=3)


def test_site_paths_through_mhc(monkeypatch):
    """``mhc.hc_site`` and ``mhc.hc_post_site`` with ``DSV41_MHC_SITE=interpret`` (the one-pass
    kernel) against their XLA forms on [B, S, n, D] streams of a prefill chunk: the new stream
    and the normed collapse within one bf16 rounding (nearly all the same bits), the same mixes
    up to the sums' fp32 order; decode-sized
    chunks keep the XLA form; a bad switch value is one clear error."""
    from dsv41_jax.model.layers import RMSNorm
    from dsv41_jax.model.mhc import hc_post_site, hc_site, site_kernel_impl

    n, D = 4, 64
    h, fn, pre, y, post, comb = _site_inputs(2 * 80, n, D, 5)  # a full 128-token block and a partial one
    h, pre, y, post, comb = (a.reshape(2, 80, *a.shape[1:]) for a in (h, pre, y, post, comb))
    scale = jnp.asarray([0.5, 0.7, 1.3], F32)
    base = jnp.asarray(np.random.default_rng(6).standard_normal((2 + n) * n) * 0.1, F32)
    norm = RMSNorm(D, 1e-6, param_dtype=jnp.bfloat16)
    norm.weight.value = jnp.asarray(1 + 0.1 * np.random.default_rng(7).standard_normal(D), jnp.bfloat16)
    kw = dict(hc_mult=n, iters=20, norm_eps=1e-6, hc_eps=1e-6)
    monkeypatch.setenv("DSV41_SINKHORN", "xla")
    monkeypatch.setenv("DSV41_MHC_KERNEL", "0")
    calls = []
    real = M.hc_site_sums
    monkeypatch.setattr(M, "hc_site_sums", lambda *a, **k: calls.append("y" in k) or real(*a, **k))
    outs = {}
    for mode in ("0", "interpret"):
        monkeypatch.setenv("DSV41_MHC_SITE", mode)
        site = jax.jit(lambda *a: hc_site(*a, norm, False, **kw))(h, fn, scale, base, pre)
        post_site = jax.jit(lambda *a: hc_post_site(*a, norm, False, **kw))(y, h, post, comb, fn, scale, base, pre)
        outs[mode] = (site, post_site)
    assert calls == [False, True]
    (rm, (rx, _)), (rs, rm2, (rx2, _)) = outs["0"]
    (gm, (gx, gxq)), (gs, gm2, (gx2, _)) = outs["interpret"]
    assert gxq is None
    for a, b in ((gx, rx), (gs, rs), (gx2, rx2)):  # XLA may add the few-term sums in another order
        # under jit: at most one bf16 rounding apart, nearly all the same bits
        assert a.shape == b.shape and a.dtype == b.dtype
        a, b = np.asarray(a, F32), np.asarray(b, F32)
        np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=0)
        assert np.mean(a == b) > 0.999
    for g, r in zip((*gm, *gm2), (*rm, *rm2)):  # the sums' order, and the few differing stream bits
        assert g.shape == r.shape and _rel(g, r) < 2e-5
    assert site_kernel_impl(h[:1, :8], n) is None  # 8 tokens: the decode forms
    monkeypatch.setenv("DSV41_MHC_SITE", "2")
    with pytest.raises(ValueError, match="DSV41_MHC_SITE"):
        hc_site(h, fn, scale, base, pre, norm, False, **kw)


@pytest.mark.parametrize("expand,seq", [(False, False), (True, False), (True, True)])
def test_site_kernel_lowers_for_cuda(expand, seq, triton_modules):
    """``hc_site_sums`` at V4.1 sizes (8k tokens, 4 x 5120 stream, 24 outputs) lowers to one
    Triton launch for CUDA (checked without a GPU): three bf16 MMAs per stream per step, and
    with the expansion the new stream's stores (all streams first, or one at a time)."""
    T, n, D, O = 8192, 4, 5120, 24
    sd = jax.ShapeDtypeStruct
    kw = dict(y=sd((T, D), jnp.bfloat16), post=sd((T, n), F32), comb=sd((T, n, n), F32)) if expand else {}
    f = jax.jit(lambda h, fn, pre, **k: M.hc_site_sums(h, fn, pre, impl="triton", seq=seq, **k))
    f.trace(sd((T, n, D), jnp.bfloat16), sd((O, n * D), F32), sd((T, n), F32), **kw).lower(
        lowering_platforms=("cuda",))
    assert [name for name, _ in triton_modules] == ["hc_site_sums" + ("_post" if expand else "")]
    text = triton_modules[0][1]
    assert text.count("tt.dot") == 3 * n
    assert text.count("tt.store") == 2 + (n if expand else 0)  # x, the sums (, the new stream)
