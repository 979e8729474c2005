"""Per-module tests of the JAX decoder against closed forms and direct NumPy (float64)
computations written from docs/decoder_spec.md, at 1e-6 (fp32, fast numerics):

RMSNorm (§3.1); RoPE / YaRN frequency tables and the interleaved tail rotation with its inverse
(§3.3); mHC coefficients with the Sinkhorn order, collapse and expansion (§5.1, §5.3); the ratio-2
gated-pooling and ratio-1 compressors, partial groups carried across calls (§6.4, §6.6); the
candidate-block filter and the indexer scores / top-k with ties to the lower index (§6.4); the
sink softmax over window and compressed keys (§6.2, §6.4); the router (§7.1), clamped SwiGLU
experts and every routed-expert path (§7.4); the Engram gate (§8.5).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import RopeScaling, preset, with_text_overrides
from dsv41_jax.model import rope as R
from dsv41_jax.model.attention import Attention, Compressor, select_candidate_blocks
from dsv41_jax.model.engram import Engram
from dsv41_jax.model.layers import RMSNorm, rms_norm
from dsv41_jax.model.mhc import hc_mixes, hc_post, hc_pre
from dsv41_jax.model.moe import MoE, swiglu
from dsv41_jax.numerics import FAST_F32

TOL = 1e-6


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _set(param, value):
    param.set_value(jnp.asarray(value, param.get_value().dtype))


@pytest.fixture(scope="module")
def tiny():
    """The golden dim-64 text config (7 layers: ratio 0, 2, 2, 1, 1, 1, 1; kv sources 1, 3; index
    sources 1, 3, 5; candidate source 3)."""
    return preset("tiny")


# ----------------------------------------------------------------------------------------------
# numpy references (float64)
# ----------------------------------------------------------------------------------------------

def np_rms(x, w, eps):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, np.float64)


def np_inv_freq(r, base, factor=None, orig=0, beta_fast=32.0, beta_slow=1.0):
    """Spec §3.3 in float64."""
    i = np.arange(r // 2, dtype=np.float64)
    f = base ** (-2.0 * i / r)
    if factor is not None and orig > 0:
        def corr(rot):
            return r * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr(beta_fast)), 0)
        hi = min(math.ceil(corr(beta_slow)), r - 1)
        ramp = np.clip((i - lo) / max(hi - lo, 1e-3), 0.0, 1.0)
        f = f / factor * ramp + f * (1 - ramp)
    return f


def np_rope(x, pos, freqs, inverse=False):
    """Adjacent pairs (2i, 2i+1) of the trailing 2*len(freqs) channels as complex numbers times
    exp(+-i * pos * f_i). pos broadcasts against x.shape[:-1]."""
    x = np.asarray(x, np.float64)
    r = 2 * len(freqs)
    tail = x[..., -r:].reshape(*x.shape[:-1], r // 2, 2)
    z = tail[..., 0] + 1j * tail[..., 1]
    ang = np.asarray(pos, np.float64)[..., None] * np.asarray(freqs, np.float64)
    z = z * np.exp((-1j if inverse else 1j) * ang)
    rot = np.stack([z.real, z.imag], -1).reshape(*x.shape[:-1], r)
    return np.concatenate([x[..., :-r], rot], -1)


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_hc_mixes(h, fn, scale, base, n, iters, norm_eps, hc_eps):
    x = np.asarray(h, np.float64).reshape(*h.shape[:-2], -1)
    rho = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + norm_eps)
    m = (x @ np.asarray(fn, np.float64).T) * rho
    scale, base = np.asarray(scale, np.float64), np.asarray(base, np.float64)
    pre = np_sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * np_sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    c = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return pre, post, c


def np_topk_lower_index(x, k):
    """Indices of the k largest along -1, best first, exact ties to the lower index."""
    return np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")[..., :k]


def np_silu(x):
    return x * np_sigmoid(x)


def np_swiglu(g, u, limit):
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    if limit > 0:
        u = np.clip(u, -limit, limit)
        g = np.minimum(g, limit)
    return np_silu(g) * u


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_rms_norm(eps):
    rng = np.random.default_rng(0)
    x = f32(rng, 3, 5, 64, scale=3.0)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    assert rel_err(rms_norm(jnp.asarray(x), jnp.asarray(w), eps), np_rms(x, w, eps)) <= TOL
    assert rel_err(rms_norm(jnp.asarray(x), None, eps), np_rms(x, None, eps)) <= TOL
    mod = RMSNorm(64, eps)
    _set(mod.weight, w)
    assert rel_err(mod(jnp.asarray(x)), np_rms(x, w, eps)) <= TOL
    # scale invariance (eps negligible) and a zero row stays finite with eps > 0
    assert rel_err(rms_norm(jnp.asarray(x * 1e3), jnp.asarray(w), eps), np_rms(x, w, eps)) <= 1e-5
    if eps >= 1e-6:
        assert np.all(np.asarray(rms_norm(jnp.zeros((2, 64)), jnp.asarray(w), eps)) == 0)


def test_rms_norm_bf16_input_single_rounding():
    """fp32 statistics and weight product, one cast back to the input dtype."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(f32(rng, 4, 64)).astype(jnp.bfloat16)
    w = jnp.asarray((1 + 0.1 * rng.standard_normal(64)).astype(np.float32)).astype(jnp.bfloat16)
    y = rms_norm(x, w, 1e-20)
    assert y.dtype == jnp.bfloat16
    want = np_rms(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), 1e-20)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(jnp.asarray(want.astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32)))


# ----------------------------------------------------------------------------------------------
# RoPE / YaRN
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("r,base,factor,orig,bf,bs", [
    (64, 160000.0, 16, 65536, 32, 1),  # released compress rope
    (16, 160000.0, 4, 16, 32, 1),  # golden tiny
    (16, 10000.0, 2, 32, 16, 2),
    (8, 160000.0, 8, 8, 32, 1),
    (32, 10000.0, 4, 1 << 20, 32, 1),  # ramp clipped at r-1
])
def test_yarn_inv_freq_matches_spec(r, base, factor, orig, bf, bs):
    got = R.inv_freq(r, base, RopeScaling(float(factor), orig, float(bf), float(bs)))
    assert got.dtype == np.float32
    assert rel_err(got, np_inv_freq(r, base, factor, orig, bf, bs)) <= TOL
    # elementwise too: the smallest frequencies matter as much as the largest
    want = np_inv_freq(r, base, factor, orig, bf, bs)
    assert np.max(np.abs(got / want - 1)) <= TOL


@pytest.mark.parametrize("r,base", [(64, 10000.0), (16, 10000.0), (16, 160000.0)])
def test_plain_inv_freq(r, base):
    got = R.inv_freq(r, base, None)
    want = np_inv_freq(r, base)
    assert np.max(np.abs(got / want - 1)) <= TOL


def test_layer_inv_freq_picks_base_and_yarn():
    for name in ("v41-flash", "tiny"):
        t = preset(name).text
        sc = t.rope_scaling
        main = R.layer_inv_freq(t, 0)
        comp = R.layer_inv_freq(t, 1)
        np.testing.assert_array_equal(comp, R.layer_inv_freq(t, 2))
        assert np.max(np.abs(main / np_inv_freq(t.qk_rope_head_dim, t.rope_theta) - 1)) <= TOL
        want = np_inv_freq(t.qk_rope_head_dim, t.compress_rope_theta, sc.factor, sc.original_max_position_embeddings,
                           sc.beta_fast, sc.beta_slow)
        assert np.max(np.abs(comp / want - 1)) <= TOL


def test_rope_tail_rotation_and_inverse():
    rng = np.random.default_rng(2)
    freqs = np_inv_freq(16, 160000.0, 4, 16).astype(np.float32)
    x = f32(rng, 2, 7, 3, 40)  # [B, S, H, d]: 24 nope channels, 16 rope channels
    pos = rng.integers(0, 5000, size=(2, 7)).astype(np.int32)
    y = R.rope_tail(jnp.asarray(x), jnp.asarray(pos)[..., None], freqs)
    want = np_rope(x, pos[..., None], freqs.astype(np.float64))
    # fp32 angles pos*f: an angle of ~5000 rad carries ~2.4e-4 absolute error in fp32 — compare
    # against the rotation by the fp32-rounded angle, which is what the spec prescribes
    ang32 = (pos[..., None, None].astype(np.float32) * freqs).astype(np.float64)
    tail = x[..., -16:].astype(np.float64).reshape(2, 7, 3, 8, 2)
    z = (tail[..., 0] + 1j * tail[..., 1]) * np.exp(1j * ang32)
    want32 = np.concatenate([x[..., :-16], np.stack([z.real, z.imag], -1).reshape(2, 7, 3, 16)], -1)
    assert rel_err(y, want32) <= TOL
    assert rel_err(y, want) <= 1e-3
    np.testing.assert_array_equal(np.asarray(y)[..., :-16], x[..., :-16])  # nope part untouched
    back = R.rope_tail(y, jnp.asarray(pos)[..., None], freqs, inverse=True)
    assert rel_err(back, x) <= TOL
    # the in-place form (the tail written back by a dynamic_update_slice) gives the same bits
    for inv, src in ((False, jnp.asarray(x)), (True, y)):
        same = jax.jit(lambda a, inv=inv: R.rope_tail(a, jnp.asarray(pos)[..., None], freqs, inverse=inv,
                                                      in_place=True))(src)
        ref = R.rope_tail(src, jnp.asarray(pos)[..., None], freqs, inverse=inv)
        np.testing.assert_array_equal(np.asarray(same), np.asarray(ref))
    # norms of each rotated pair are preserved
    pairs = lambda a: np.linalg.norm(np.asarray(a)[..., -16:].reshape(*a.shape[:-1], 8, 2), axis=-1)  # noqa: E731
    assert rel_err(pairs(y), pairs(x)) <= TOL
    # adjacent-pair convention: rotating e_0 of the tail by angle a gives (cos a, sin a) in (0, 1)
    e = np.zeros((1, 1, 16), np.float32)
    e[..., 0] = 1
    yy = np.asarray(R.rope_tail(jnp.asarray(e), jnp.asarray([[3]], jnp.int32), freqs))
    np.testing.assert_allclose(yy[0, 0, :2], [math.cos(3 * freqs[0]), math.sin(3 * freqs[0])], atol=1e-6)
    np.testing.assert_array_equal(yy[0, 0, 2:], 0)


def test_rope_positions_per_row_on_kv_shape():
    rng = np.random.default_rng(3)
    freqs = np_inv_freq(8, 10000.0).astype(np.float32)
    x = f32(rng, 3, 5, 32)  # [B, S, d] (window kv / compressed entries)
    pos = np.array([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [7, 7, 7, 7, 7]], np.int32)
    y = R.rope_tail(jnp.asarray(x), jnp.asarray(pos), freqs)
    assert rel_err(y, np_rope(x, pos, freqs.astype(np.float64))) <= TOL
    np.testing.assert_array_equal(np.asarray(y)[0, 0], x[0, 0])  # position 0 is the identity


# ----------------------------------------------------------------------------------------------
# mHC
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,iters,D", [(4, 20, 64), (2, 3, 32), (3, 10, 48), (4, 1, 16)])
def test_hc_mixes_sinkhorn(n, iters, D):
    rng = np.random.default_rng(n * 100 + iters)
    mix = (2 + n) * n
    h = f32(rng, 2, 5, n, D)
    fn = f32(rng, mix, n * D, scale=0.05)
    scale = (1 + 0.1 * rng.standard_normal(3)).astype(np.float32)
    base = f32(rng, mix, scale=0.5)
    eps = 1e-6
    pre, post, comb = hc_mixes(jnp.asarray(h), jnp.asarray(fn), jnp.asarray(scale), jnp.asarray(base),
                               hc_mult=n, iters=iters, norm_eps=1e-20, hc_eps=eps)
    wp, wq, wc = np_hc_mixes(h, fn, scale, base, n, iters, 1e-20, eps)
    assert pre.dtype == post.dtype == comb.dtype == jnp.float32
    assert comb.shape == (2, 5, n, n)
    assert rel_err(pre, wp) <= TOL and rel_err(post, wq) <= TOL and rel_err(comb, wc) <= TOL
    comb = np.asarray(comb, np.float64)
    # the last normalisation is over columns (axis -2): column sums are 1 up to eps
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=n * eps + 1e-6)
    if iters >= 10:
        np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-3)  # rows near-stochastic too
    assert np.all(comb > 0)
    assert np.all((np.asarray(pre) > eps) & (np.asarray(pre) < 1 + 2 * eps))
    assert np.all((np.asarray(post) > 0) & (np.asarray(post) < 2))


def test_hc_sinkhorn_order_is_column_first():
    """With a single iteration only the column normalisation runs after the row softmax: the
    column sums are 1 but the row sums are not (a row-first or transposed Sinkhorn fails)."""
    rng = np.random.default_rng(5)
    n, D = 4, 16
    h = f32(rng, 1, 3, n, D)
    fn = f32(rng, (2 + n) * n, n * D, scale=0.5)
    _, _, comb = hc_mixes(jnp.asarray(h), jnp.asarray(fn), jnp.ones(3), jnp.zeros((2 + n) * n),
                          hc_mult=n, iters=1, norm_eps=1e-20, hc_eps=1e-6)
    comb = np.asarray(comb, np.float64)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-3)  # 1 - eps / colsum
    assert np.max(np.abs(comb.sum(-1) - 1)) > 1e-2


def test_hc_collapse_and_expand_directions():
    rng = np.random.default_rng(6)
    n, D = 3, 8
    h = f32(rng, 2, 4, n, D)
    mix = np.abs(f32(rng, 2, 4, n))
    y = f32(rng, 2, 4, D)
    post = np.abs(f32(rng, 2, 4, n))
    comb = np.abs(f32(rng, 2, 4, n, n))
    got = hc_pre(jnp.asarray(h), jnp.asarray(mix))
    assert rel_err(got, np.einsum("bsk,bskd->bsd", mix.astype(np.float64), h)) <= TOL
    got = hc_post(jnp.asarray(y), jnp.asarray(h), jnp.asarray(post), jnp.asarray(comb))
    # out_k = post_k * y + sum_j comb[j, k] * residual_j  (comb transposed)
    want = post[..., :, None].astype(np.float64) * y[..., None, :] + np.einsum("bsjk,bsjd->bskd", comb.astype(np.float64), h)
    assert rel_err(got, want) <= TOL
    wrong = post[..., :, None] * y[..., None, :] + np.einsum("bskj,bsjd->bskd", comb.astype(np.float64), h)
    assert rel_err(got, wrong) > 1e-3


# ----------------------------------------------------------------------------------------------
# compressor
# ----------------------------------------------------------------------------------------------

def _compressor(tiny, ratio, rng):
    t = tiny.text
    comp = Compressor(t, ratio, FAST_F32)
    D, d = t.hidden_size, t.head_dim
    w = {"wkv": f32(rng, d, D, scale=0.1), "wgate": f32(rng, d, D, scale=0.3) if ratio > 1 else None,
         "norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)}
    _set(comp.wkv.weight, w["wkv"])
    if ratio > 1:
        _set(comp.wgate.weight, w["wgate"])
    _set(comp.norm.weight, w["norm"])
    return comp, w


def np_pool2(x, w, eps):
    """Spec §6.4, m = 2: entry t pools tokens 2t, 2t+1 with a per-channel softmax of the gate."""
    x = np.asarray(x, np.float64)
    kv = x @ w["wkv"].astype(np.float64).T
    z = x @ w["wgate"].astype(np.float64).T
    T = x.shape[1] // 2
    kv = kv[:, : 2 * T].reshape(x.shape[0], T, 2, -1)
    z = z[:, : 2 * T].reshape(x.shape[0], T, 2, -1)
    p = np.exp(z - z.max(2, keepdims=True))
    p = p / p.sum(2, keepdims=True)
    return np_rms((kv * p).sum(2), w["norm"], eps)


def test_compressor_ratio2_pooling_and_partial_group(tiny):
    rng = np.random.default_rng(7)
    comp, w = _compressor(tiny, 2, rng)
    t = tiny.text
    B, S, d = 2, 9, t.head_dim
    x = f32(rng, B, S + 3, t.hidden_size)
    want = np_pool2(x, w, t.rms_norm_eps)  # 6 entries from 12 tokens
    state = (jnp.zeros((B, 2, d), jnp.float32), jnp.full((B, 2, d), -jnp.inf, jnp.float32))
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    lat, gids, ok, state = comp(jnp.asarray(x[:, :S]), pos, jnp.ones((B, S), bool), state)
    lat, gids, ok = np.asarray(lat), np.asarray(gids), np.asarray(ok)
    assert ok[0].tolist() == [True, True, True, True, False]  # token 8 waits for token 9
    np.testing.assert_array_equal(gids[0, :4], np.arange(4))
    assert rel_err(lat[:, :4], want[:, :4]) <= TOL
    # the partial group is carried: kv/score of token 8 in slot 0, slot 1 still empty (-inf score)
    assert np.all(np.isneginf(np.asarray(state[1])[:, 1]))
    # next chunk: tokens 9, 10, 11 and one padding position (valid=False)
    pos2 = jnp.broadcast_to(jnp.arange(S, S + 4, dtype=jnp.int32), (B, 4))
    valid2 = jnp.asarray(np.array([[True, True, True, False]] * B))
    x2 = np.concatenate([x[:, S:], np.full((B, 1, t.hidden_size), 7.0, np.float32)], 1)
    lat2, gids2, ok2, _ = comp(jnp.asarray(x2), pos2, valid2, state)
    lat2, gids2, ok2 = np.asarray(lat2), np.asarray(gids2), np.asarray(ok2)
    done = {int(g): lat2[:, j] for j, g in enumerate(gids2[0]) if ok2[0, j]}
    assert sorted(done) == [4, 5]
    assert rel_err(np.stack([done[4], done[5]], 1), want[:, 4:6]) <= TOL


def test_compressor_ratio1_is_normed_projection(tiny):
    rng = np.random.default_rng(8)
    comp, w = _compressor(tiny, 1, rng)
    t = tiny.text
    x = f32(rng, 2, 6, t.hidden_size)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    lat, gids, ok, _ = comp(jnp.asarray(x), pos, jnp.ones((2, 6), bool), None)
    want = np_rms(x.astype(np.float64) @ w["wkv"].astype(np.float64).T, w["norm"], t.rms_norm_eps)
    assert rel_err(lat, want) <= TOL
    np.testing.assert_array_equal(np.asarray(gids), np.asarray(pos))
    assert np.all(np.asarray(ok))


# ----------------------------------------------------------------------------------------------
# candidate blocks and the indexer top-k
# ----------------------------------------------------------------------------------------------

def np_candidate_blocks(score, n_vis, topk_blocks, block):
    """Spec §6.4 select_candidate_blocks, one query row at a time; ties to the lower block."""
    T = score.shape[-1]
    nb = -(-T // block)
    out = np.zeros(score.shape, bool)
    for idx in np.ndindex(score.shape[:-1]):
        s = np.full(nb * block, -np.inf)
        s[:T] = score[idx]
        bl = s.reshape(nb, block).max(-1)
        newest = (int(n_vis[idx]) - 1) // block
        if newest >= 0:
            bl[newest] = np.inf
        top = np_topk_lower_index(bl, min(topk_blocks, nb))
        keep = np.zeros(nb, bool)
        keep[top[bl[top] > -np.inf]] = True
        out[idx] = np.repeat(keep, block)[:T]
    return out


@pytest.mark.parametrize("T,block,topk_blocks,seed", [(13, 4, 2, 0), (16, 4, 3, 1), (20, 3, 4, 2), (7, 8, 2, 3),
                                                      (24, 2, 5, 4), (12, 4, 3, 5), (10, 4, 9, 6)])
def test_select_candidate_blocks_with_ties(T, block, topk_blocks, seed):
    rng = np.random.default_rng(seed)
    S = 12
    # small integers: many exactly tied block maxima
    score = rng.integers(0, 4, size=(2, S, T)).astype(np.float32)
    n_vis = np.tile(np.minimum(np.arange(S) * T // S + 1, T), (2, 1)).astype(np.int32)
    n_vis[1, :3] = 0  # nothing visible yet for the first queries of row 1
    score = np.where(np.arange(T) >= n_vis[..., None], -np.inf, score).astype(np.float32)
    got = np.asarray(select_candidate_blocks(jnp.asarray(score), jnp.asarray(n_vis), topk_blocks, block))
    np.testing.assert_array_equal(got, np_candidate_blocks(score, n_vis, topk_blocks, block))
    assert not got[1, :3].any()


def _index_attention(tiny, layer, rng):
    t = tiny.text
    plan = t.layers[layer]
    att = Attention(t, plan, FAST_F32)
    ih, ihd = t.index_n_heads, t.index_head_dim
    w = {"wq_b": f32(rng, ih * ihd, t.q_lora_rank, scale=0.2), "proj": f32(rng, ih, t.hidden_size, scale=0.2)}
    _set(att.indexer.wq_b.weight, w["wq_b"])
    _set(att.indexer.weights_proj.weight, w["proj"])
    return att, plan, w


def np_index_scores(x, qr, pos, idx_k, w, t, freqs):
    ih, ihd = t.index_n_heads, t.index_head_dim
    q = (qr.astype(np.float64) @ w["wq_b"].astype(np.float64).T).reshape(*qr.shape[:2], ih, ihd)
    q = np_rope(q, pos[..., None], freqs)
    wt = (x.astype(np.float64) @ w["proj"].astype(np.float64).T) * ihd ** -0.5 * ih ** -0.5
    dots = np.einsum("bshd,btd->bsht", q, idx_k.astype(np.float64))
    return (np.maximum(dots, 0) * wt[..., None]).sum(2)


def np_select(scores, n_vis, k, cand=None):
    s = np.where(np.arange(scores.shape[-1]) >= n_vis[..., None], -np.inf, scores.astype(np.float64))
    if cand is not None:
        s = np.where(cand, s, -np.inf)
    idx = np.sort(np_topk_lower_index(s, min(k, s.shape[-1])), -1)
    return np.where(idx < n_vis[..., None], idx, -1)


@pytest.mark.parametrize("layer", [1, 3, 5])  # ratio-2 source; ratio-1 candidate source; candidate user
def test_indexer_scores_and_topk_with_ties(tiny, layer):
    t = tiny.text
    rng = np.random.default_rng(10 + layer)
    att, plan, w = _index_attention(tiny, layer, rng)
    m = plan.ratio
    B, S = 2, 20
    T = S // m
    x = f32(rng, B, S, t.hidden_size)
    qr = f32(rng, B, S, t.q_lora_rank)
    idx_k = f32(rng, B, T, t.index_head_dim)
    idx_k[:, 4] = idx_k[:, 1]  # identical keys: exactly tied scores for every query
    idx_k[:, 7] = idx_k[:, 2]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    freqs = R.layer_inv_freq(t, m)
    got_s = np.asarray(att.indexer.scores(jnp.asarray(x), jnp.asarray(qr), pos, jnp.asarray(idx_k), jnp.asarray(freqs)))
    want_s = np_index_scores(x, qr, np.asarray(pos), idx_k, w, t, freqs.astype(np.float64))
    assert rel_err(got_s, want_s) <= TOL
    np.testing.assert_array_equal(got_s[..., 4], got_s[..., 1])
    n_vis = (np.asarray(pos) + 1) // m
    ctx = {"idx_k": jnp.asarray(idx_k)}
    cand = None
    if plan.uses_candidates:
        cand = rng.random((B, S, T)) < 0.5
        cand[..., 1] = cand[..., 4] = True
        ctx["cand"] = jnp.asarray(cand)
    cap = {}
    out = att._select(jnp.asarray(x), jnp.asarray(qr), pos, ctx, cap)
    # selection from the model's own fp32 scores: the tie-breaking is what is tested here
    np.testing.assert_array_equal(np.asarray(out["topk"]), np_select(got_s, n_vis, t.index_topk, cand))
    if plan.is_candidate_source:
        masked = np.where(np.arange(T) >= n_vis[..., None], -np.inf, got_s)
        np.testing.assert_array_equal(np.asarray(out["cand"]),
                                      np_candidate_blocks(masked, n_vis, t.candidate_topk_blocks, t.candidate_block_size))
    # ties resolve to the lower index: key 1 beats its duplicate 4 whenever exactly one is picked
    picks = np.asarray(out["topk"])
    one = (picks == 1).any(-1) ^ (picks == 4).any(-1)
    assert not ((picks == 4).any(-1) & one).any()


# ----------------------------------------------------------------------------------------------
# sink softmax
# ----------------------------------------------------------------------------------------------

def test_sparse_attention_with_sink(tiny):
    t = tiny.text
    rng = np.random.default_rng(12)
    att = Attention(t, t.layers[2], FAST_F32)
    H, d = t.num_attention_heads, t.head_dim
    sink = f32(rng, H, scale=0.5)
    _set(att.attn_sink, sink)
    B, S, J, K = 2, 5, 9, 3
    q = f32(rng, B, S, H, d)
    kw = f32(rng, B, J, d)
    kw_ok = rng.random((B, S, J)) < 0.6
    kw_ok[:, :, 0] = True
    kc = f32(rng, B, S, K, d)
    kc_ok = rng.random((B, S, K)) < 0.5
    kc_ok[0, 0] = False  # a query with no compressed entries
    got = np.asarray(att._sparse_attn(jnp.asarray(q), jnp.asarray(kw), jnp.asarray(kw_ok), jnp.asarray(kc),
                                      jnp.asarray(kc_ok)))
    q64 = q.astype(np.float64)
    lw = np.einsum("bshd,bjd->bshj", q64, kw) * d ** -0.5
    lc = np.einsum("bshd,bskd->bshk", q64, kc) * d ** -0.5
    logits = np.concatenate([np.where(kw_ok[:, :, None], lw, -np.inf), np.where(kc_ok[:, :, None], lc, -np.inf)], -1)
    vals = np.concatenate([np.broadcast_to(kw[:, None], (B, S, J, d)), kc], 2).astype(np.float64)
    e = np.exp(logits)
    den = e.sum(-1) + np.exp(sink.astype(np.float64))[None, None]
    want = np.einsum("bshk,bskd->bshd", e, vals) / den[..., None]
    assert rel_err(got, want) <= TOL


# ----------------------------------------------------------------------------------------------
# router and experts
# ----------------------------------------------------------------------------------------------

def _moe(tiny, rng, **over):
    cfg = with_text_overrides(tiny, **over) if over else tiny
    t = cfg.text
    moe = MoE(t, FAST_F32, vision=True)
    E, D, I = t.n_routed_experts, t.hidden_size, t.moe_intermediate_size
    w = {"gate": f32(rng, E, D, scale=0.3), "bias": f32(rng, E, scale=0.1), "bias_vl": f32(rng, E, scale=0.3),
         "w1": f32(rng, E, I, D, scale=0.2), "w2": f32(rng, E, D, I, scale=0.2), "w3": f32(rng, E, I, D, scale=0.2),
         "s1": f32(rng, I, D, scale=0.2), "s2": f32(rng, D, I, scale=0.2), "s3": f32(rng, I, D, scale=0.2)}
    _set(moe.gate.weight, w["gate"])
    _set(moe.gate.bias, w["bias"])
    _set(moe.gate.bias_vl, w["bias_vl"])
    for k in ("w1", "w2", "w3"):
        _set(getattr(moe.experts, k).weight, w[k])
        _set(getattr(moe.shared_experts, k).weight, w["s" + k[1]])
    return t, moe, w


def np_gate(x, w, t, image_mask):
    z = (x.astype(np.float64) @ w["gate"].astype(np.float64).T) / t.gate_temp
    s = np.sqrt(np.logaddexp(0.0, z))
    b = np.where(image_mask[..., None], w["bias_vl"], w["bias"]) if image_mask is not None else \
        np.broadcast_to(w["bias"], s.shape)
    ids = np_topk_lower_index(s + b, t.num_experts_per_tok)
    wt = np.take_along_axis(s, ids, -1)
    if t.norm_topk_prob and t.num_experts_per_tok > 1:
        wt = wt / (wt.sum(-1, keepdims=True) + 1e-20)
    return wt * t.routed_scaling_factor, ids, s + b


@pytest.mark.parametrize("over", [
    {},
    {"n_routed_experts": 8, "num_experts_per_tok": 3, "gate_temp": 0.7, "routed_scaling_factor": 2.5},
    {"n_routed_experts": 5, "num_experts_per_tok": 1},
    {"norm_topk_prob": False, "num_experts_per_tok": 3},
])
def test_router(tiny, over):
    rng = np.random.default_rng(len(over))
    t, moe, w = _moe(tiny, rng, **over)
    w["gate"][3] = w["gate"][1]  # two identical experts: exactly tied scores, lower id first
    w["bias"][3] = w["bias"][1]
    w["bias_vl"][3] = w["bias_vl"][1]
    _set(moe.gate.weight, w["gate"])
    _set(moe.gate.bias, w["bias"])
    _set(moe.gate.bias_vl, w["bias_vl"])
    x = f32(rng, 40, t.hidden_size)
    img = rng.random(40) < 0.4
    for mask in (None, img):
        gw, gids = moe.gate(jnp.asarray(x), None if mask is None else jnp.asarray(mask))
        ww, wids, biased = np_gate(x, w, t, mask)
        # no accidental near-ties in the random part (the comparison is exact on ids)
        srt = np.sort(biased, -1)[:, ::-1]
        gaps = np.abs(srt[:, t.num_experts_per_tok - 1] - srt[:, t.num_experts_per_tok])
        assert np.all((gaps == 0) | (gaps > 1e-5))
        np.testing.assert_array_equal(np.asarray(gids), wids)
        assert rel_err(gw, ww) <= TOL
    # the bias steers selection only: a huge bias forces expert 0 in, its weight stays unbiased
    w2 = dict(w, bias=w["bias"].copy())
    w2["bias"][0] = 100.0
    _set(moe.gate.bias, w2["bias"])
    gw, gids = moe.gate(jnp.asarray(x))
    ww, wids, _ = np_gate(x, w2, t, None)
    assert np.all(np.asarray(gids)[:, 0] == 0)
    np.testing.assert_array_equal(np.asarray(gids), wids)
    assert rel_err(gw, ww) <= TOL
    if t.num_experts_per_tok > 1 and t.norm_topk_prob:
        np.testing.assert_allclose(np.asarray(gw).sum(-1), t.routed_scaling_factor, rtol=1e-6)


@pytest.mark.parametrize("limit", [10.0, 0.5, 0.0])
def test_swiglu_clamp(limit):
    g = np.linspace(-4, 4, 81).astype(np.float32)
    u = np.linspace(3, -3, 81).astype(np.float32)
    got = np.asarray(swiglu(jnp.asarray(g), jnp.asarray(u), limit))
    assert rel_err(got, np_swiglu(g, u, limit)) <= TOL
    if limit == 0.5:
        # the gate is clamped from above only, the up projection on both sides
        assert got[0] == pytest.approx(float(np_silu(-4.0) * 0.5), rel=1e-6)
        assert got[-1] == pytest.approx(float(np_silu(0.5) * -0.5), rel=1e-6)


def np_expert(x, w1, w2, w3, limit, route_w=None):
    x = x.astype(np.float64)
    h = np_swiglu(x @ w1.astype(np.float64).T, x @ w3.astype(np.float64).T, limit)
    if route_w is not None:
        h = route_w[:, None] * h  # the route weight goes in before w2
    return h @ w2.astype(np.float64).T


@pytest.mark.parametrize("limit", [10.0, 0.3])
def test_experts_every_routed_path(tiny, limit):
    rng = np.random.default_rng(20)
    t, moe, w = _moe(tiny, rng, swiglu_limit=limit)
    T = 37
    x = f32(rng, T, t.hidden_size)
    gw, gids = moe.gate(jnp.asarray(x))
    gw_np, gids_np = np.asarray(gw, np.float64), np.asarray(gids)
    want = np.zeros((T, t.hidden_size))
    for r in range(T):
        for j in range(t.num_experts_per_tok):
            e = gids_np[r, j]
            want[r] += np_expert(x[r:r + 1], w["w1"][e], w["w2"][e], w["w3"][e], limit, gw_np[r, j:j + 1])[0]
    xj = jnp.asarray(x)
    paths = {"dense": moe.routed_dense, "gather": moe.routed_gather, "ragged": moe.routed_ragged,
             "grouped": lambda a, b, c: moe.routed_grouped(a, b, c, chunk=4)}
    for name, fn in paths.items():
        y = jax.jit(fn)(xj, gw, gids)  # one compile instead of many eager op compiles
        assert rel_err(y, want) <= TOL, name
    shared = np_expert(x, w["s1"], w["s2"], w["s3"], limit)
    assert rel_err(moe(xj), want + shared) <= TOL
    # few tokens take the gather path inside __call__
    assert rel_err(moe(xj[:1]), (want + shared)[:1]) <= TOL
    assert rel_err(moe.shared_experts(xj), shared) <= TOL


# ----------------------------------------------------------------------------------------------
# Engram
# ----------------------------------------------------------------------------------------------

def test_engram_gate(tiny):
    t = tiny.text
    rng = np.random.default_rng(30)
    rows = t.engram_num_embeddings[0]
    eng = Engram(t, rows, FAST_F32)
    n, D, cols, hd = t.hc_mult, t.hidden_size, t.engram_cols, t.engram_head_dim
    w = {"embed": f32(rng, rows, hd, scale=0.5), "wkv": f32(rng, D * (n + 1), cols * hd, scale=0.05),
         "q": (1 + 0.1 * rng.standard_normal((n, D))).astype(np.float32),
         "k": (1 + 0.1 * rng.standard_normal((n, D))).astype(np.float32)}
    _set(eng.embed.weight, w["embed"])
    _set(eng.wkv.weight, w["wkv"])
    _set(eng.q_weight, w["q"])
    _set(eng.k_weight, w["k"])
    B, S = 2, 6
    h = f32(rng, B, S, n, D)
    hashes = rng.integers(0, rows, size=(B, S, cols))
    mask = rng.random((B, S)) < 0.7
    got = np.asarray(eng(jnp.asarray(h), jnp.asarray(hashes, jnp.int32), jnp.asarray(mask)))
    eps = t.rms_norm_eps
    kv = w["embed"][hashes].reshape(B, S, -1).astype(np.float64) @ w["wkv"].astype(np.float64).T
    key, val = kv[..., : n * D].reshape(B, S, n, D), kv[..., n * D:]
    h64 = h.astype(np.float64)
    dot = (h64 * (w["q"] * w["k"]).astype(np.float64) * key).sum(-1)
    dot = dot / np.sqrt((h64 ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps) * D ** -0.5
    gate = np_sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot))
    gate = np.where(mask[..., None], gate, 0.0)
    want = h64 + gate[..., None] * val[..., None, :]
    assert rel_err(got, want) <= TOL
    np.testing.assert_array_equal(got[~mask], h[~mask])  # gate off: the stream is unchanged
