"""The indexer-score kernel (``dsv41_jax.kernels.indexer_scores``) against its XLA formulation.

The kernel runs in the Pallas interpreter here (the Triton lowering is checked to lower for CUDA
on this CPU, and on the H200 by benchmarks/check_gpu_kernels.py). On dyadic inputs every dot
product, rounding and head sum is exact, so the kernel must equal the reference bit for bit in
fp32 and bf16 whatever its summation order; on normal inputs only that order differs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import preset
from dsv41_jax.kernels import indexer_scores, indexer_scores_reference
from dsv41_jax.model.attention import Attention, scores_on_kernel
from dsv41_jax.numerics import FAST_F32


def _dyadic(key, B, S, T, H, hd, dt):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = (jax.random.randint(k1, (B, S, H, hd), -3, 4) * 0.25).astype(dt)
    k = (jax.random.randint(k2, (B, T, hd), -3, 4) * 0.5).astype(dt)
    sign = jnp.where(jax.random.bernoulli(k4, 0.5, (B, S, H)), 1.0, -1.0)
    w = (2.0 ** jax.random.randint(k3, (B, S, H), -3, 2) * sign).astype(dt)
    return q, k, w


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tiles", [dict(bq=16, bt=16), dict(bq=32, bt=64)])
def test_exact_on_dyadic_inputs(dt, tiles):
    B, S, T, H, hd = 2, 37, 50, 3, 32
    q, k, w = _dyadic(jax.random.key(1), B, S, T, H, hd, dt)
    # causal visibility with an offset per row; row 0 of batch 0 sees nothing at all
    n_vis = jnp.clip(jnp.arange(S)[None] + jnp.array([[0], [9]]), 0, T).astype(jnp.int32)
    got = indexer_scores(q, k, w, n_vis, impl="interpret", **tiles)
    want = indexer_scores_reference(q, k, w, n_vis)
    assert got.dtype == jnp.dtype(dt) and got.shape == (B, S, T)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # masking: -inf exactly at t >= n_vis, finite below
    vis = np.arange(T) < np.asarray(n_vis)[..., None]
    assert np.all(np.isfinite(np.asarray(got, np.float32)[vis]))
    assert np.all(np.asarray(got, np.float32)[~vis] == -np.inf)
    assert not np.all(np.asarray(got, np.float32)[vis] == 0)  # the exact inputs do produce scores


@pytest.mark.parametrize("dt,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_close_on_normal_inputs(dt, tol):
    B, S, T, H, hd = 1, 40, 70, 4, 64
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(k1, (B, S, H, hd)).astype(dt)
    k = jax.random.normal(k2, (B, T, hd)).astype(dt)
    w = jax.random.normal(k3, (B, S, H)).astype(dt)
    n_vis = jnp.minimum(jnp.arange(S) * 2 + 1, T)[None].astype(jnp.int32)
    got = np.asarray(indexer_scores(q, k, w, n_vis, impl="interpret", bq=16, bt=32), np.float32)
    want = np.asarray(indexer_scores_reference(q, k, w, n_vis), np.float32)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    scale = np.max(np.abs(want[fin]))
    assert np.max(np.abs(got[fin] - want[fin])) <= tol * scale
    if dt == jnp.bfloat16:  # only the fp32 summation order differs: almost every element is equal
        assert np.mean(got[fin] == want[fin]) > 0.99


def test_bad_operands_are_refused():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="keys"):
        indexer_scores(q, jnp.zeros((1, 5, 8)), jnp.zeros((1, 8, 2)), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="head weights"):
        indexer_scores(q, jnp.zeros((1, 5, 16)), jnp.zeros((1, 8, 3)), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        indexer_scores(q, jnp.zeros((1, 5, 16)), jnp.zeros((1, 8, 2)), jnp.zeros((1, 8), jnp.int32),
                       impl="interpret", bq=24)


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
def test_triton_lowering_for_cuda(dt):
    """The kernel lowers to a Triton custom call for CUDA (checked without a GPU)."""
    f = jax.jit(lambda q, k, w, nv: indexer_scores(q, k, w, nv, impl="triton"))
    args = (jax.ShapeDtypeStruct((1, 512, 32, 128), dt), jax.ShapeDtypeStruct((1, 1024, 128), dt),
            jax.ShapeDtypeStruct((1, 512, 32), dt), jax.ShapeDtypeStruct((1, 512), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "indexer_scores" in text


@pytest.mark.parametrize("topk_kernel,whole", [("0", "1"), ("interpret", "1"), ("interpret", "0")])
def test_select_of_a_long_chunk_on_the_kernel(monkeypatch, topk_kernel, whole):
    """``Attention._select`` of a chunk long enough for query blocks: on the kernel path the whole
    chunk's scores come from one launch; with XLA's top-k each block takes its slice, with the
    selection kernel (``topk_select``) the whole chunk is selected in one launch, without the
    loop over blocks. The top-k (and candidate blocks) equal the XLA path's either way."""
    import dsv41_jax.kernels as K

    cfg = preset("tiny")
    t = cfg.text
    layer = 3  # ratio 1, index and candidate source
    plan = t.layers[layer]
    att = Attention(t, plan, FAST_F32)
    rng = np.random.default_rng(5)
    for mod in (att.indexer.wq_b, att.indexer.weights_proj):
        mod.weight[...] = jnp.asarray(rng.standard_normal(mod.weight[...].shape) * 0.2, jnp.float32)
    B, S = 1, 768  # > 2 query blocks of 256
    T = S // plan.ratio
    x = jnp.asarray(rng.standard_normal((B, S, t.hidden_size)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((B, S, t.q_lora_rank)), jnp.float32)
    ctx = {"idx_k": jnp.asarray(rng.standard_normal((B, T, t.index_head_dim)), jnp.float32)}
    pos = jnp.arange(S, dtype=jnp.int32)[None]
    want = att._select(x, qr, pos, dict(ctx), None)
    assert not scores_on_kernel(S)  # on the CPU the default is XLA
    calls = []
    import dsv41_jax.kernels.indexer as I

    import dsv41_jax.kernels.topk as TK

    real, real_select = I._pallas, TK._select_pallas
    selects = []
    monkeypatch.setattr(I, "_pallas", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(TK, "_select_pallas", lambda *a, **k: selects.append(a[0].shape) or real_select(*a, **k))
    monkeypatch.setattr(K, "use_pallas", lambda: True)
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    # "0": XLA's top-k per query block ("1" would ask for the Triton top-k on the CPU)
    monkeypatch.setenv("DSV41_TOPK_KERNEL", topk_kernel)
    monkeypatch.setenv("DSV41_TOPK_WHOLE_CHUNK", whole)  # 0: the selection kernel per block too (A/B)
    assert scores_on_kernel(S)
    loops, real_map = [], jax.lax.map
    monkeypatch.setattr(jax.lax, "map", lambda f, xs, **k: loops.append(xs.shape) or real_map(f, xs, **k))
    got = att._select(x, qr, pos, dict(ctx), None)
    assert calls == [(B, S, t.index_n_heads, t.index_head_dim)]  # one launch for the whole chunk
    if topk_kernel == "0":
        assert selects == [] and loops == [(S // 256,)]  # XLA's top-k in a loop over the query blocks
    elif whole == "0":
        assert selects == [(256, T)] and loops == [(S // 256,)]  # traced once, inside the loop
    else:
        assert selects == [(B * S, T)] and loops == []  # every row in one launch, no loop
    np.testing.assert_array_equal(np.asarray(got["topk"]), np.asarray(want["topk"]))
    np.testing.assert_array_equal(np.asarray(got["cand"]), np.asarray(want["cand"]))
    assert np.sum(np.asarray(got["topk"]) >= 0) > S  # entries were selected
