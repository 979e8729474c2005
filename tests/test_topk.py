"""The rank-based top-k helpers of ``dsv41_jax.model.layers`` against ``jax.lax.top_k``: the same
indices (ties to the lower index, IEEE total order: -0 < +0, -inf ties) and values, through the
ranking route (small problems) and through the sort route (above ``RANK_TOPK_MAX``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import layers as L
from dsv41_jax.model.attention import select_candidate_blocks

SHAPES = [((3, 17), 5), ((2, 4, 64), 64), ((5, 384), 6), ((1, 1024), 512), ((2, 3), 3), ((4, 40), 1),
          ((16, 1024), 512)]


def _scores(rng, shape):
    """Small integers (many ties), -inf entries, and zeros of both signs."""
    x = rng.integers(-4, 4, size=shape).astype(np.float32)
    x[..., ::7] = -np.inf
    x[..., 1::11] = -0.0
    x[..., 2::13] = 0.0
    return jnp.asarray(x)


def _check_all(x, k):
    v, i = jax.lax.top_k(x, k)
    v2, i2 = jax.jit(lambda a: L.top_k(a, k))(x)
    np.testing.assert_array_equal(np.asarray(i2), np.asarray(i))
    np.testing.assert_array_equal(np.asarray(v2).view(np.int32), np.asarray(v).view(np.int32))  # -0 stays -0
    assert i2.dtype == jnp.int32
    m = jax.jit(lambda a: L.top_k_mask(a, k))(x)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(jnp.any(jax.nn.one_hot(i, x.shape[-1], dtype=bool), -2)))
    a = jax.jit(lambda a: L.top_k_indices_ascending(a, k))(x)
    np.testing.assert_array_equal(np.asarray(a), np.sort(np.asarray(i), axis=-1))


@pytest.mark.parametrize("shape,k", SHAPES, ids=[f"{s}-k{k}" for s, k in SHAPES])
def test_rank_topk_equals_lax_top_k(shape, k):
    x = _scores(np.random.default_rng(sum(shape) + k), shape)
    assert L._rank_route(x, k)
    _check_all(x, k)


def test_total_order_ties_and_signed_zeros():
    x = jnp.asarray([[-0.0, 0.0, -1.0, 0.0], [0.0, -0.0, -np.inf, -np.inf], [3.0, 3.0, 3.0, -0.0]], jnp.float32)
    _check_all(x, 2)
    np.testing.assert_array_equal(np.asarray(L.top_k(x, 2)[1]), [[1, 3], [0, 1], [0, 1]])


def test_sort_route_above_the_limit(monkeypatch):
    x = _scores(np.random.default_rng(7), (6, 96))
    monkeypatch.setattr(L, "RANK_TOPK_MAX", 6 * 96 * 96 - 1)
    assert not L._rank_route(x, 10)
    _check_all(x, 10)
    monkeypatch.setattr(L, "RANK_TOPK_MAX", 6 * 96 * 96)
    assert L._rank_route(x, 10)
    monkeypatch.setenv("DSV41_RANK_TOPK_MAX", "0")  # the environment turns the rank route off
    assert not L._rank_route(x, 10)
    monkeypatch.setenv("DSV41_RANK_TOPK_MAX", "many")
    with pytest.raises(ValueError, match="DSV41_RANK_TOPK_MAX"):
        L.top_k(x, 10)


def test_candidate_blocks_keep_the_same_blocks():
    """``select_candidate_blocks`` (level one of the two-level top-k) through the rank route
    equals its lax.top_k formulation, unseen blocks (all -inf) never kept."""
    rng = np.random.default_rng(3)
    s = _scores(rng, (2, 3, 200))
    n_vis = jnp.asarray(rng.integers(1, 201, size=(2, 3)), jnp.int32)
    s = jnp.where(jnp.arange(200) >= n_vis[..., None], -jnp.inf, s)
    got = select_candidate_blocks(s, n_vis, 4, 16)
    blocks = jnp.max(jnp.pad(s, [(0, 0), (0, 0), (0, 8)], constant_values=-jnp.inf).reshape(2, 3, 13, 16), -1)
    blocks = jnp.where(jnp.arange(13) == ((n_vis - 1) // 16)[..., None], jnp.inf, blocks)
    vals, idx = jax.lax.top_k(blocks, 4)
    keep = jnp.any(jax.nn.one_hot(idx, 13, dtype=bool) & (vals > -jnp.inf)[..., None], axis=-2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.repeat(keep, 16, -1)[..., :200]))


# ------------------------------------------------------------------------------ the ranking kernel
KERNEL_SHAPES = [((1, 4160), 512), ((2, 300), 64), ((3, 17), 17), ((1, 1, 33), 5), ((4, 40), 1), ((2, 2080), 512)]


@pytest.mark.parametrize("shape,k", KERNEL_SHAPES, ids=[f"{s}-k{k}" for s, k in KERNEL_SHAPES])
def test_topk_kernel_equals_lax_top_k(shape, k):
    """``kernels.topk.topk_ascending`` in the Pallas interpreter picks exactly lax.top_k's
    indices (ties to the lower index, -0 < +0, -inf entries), ascending; rows and lengths that
    are not multiples of its tiles."""
    from dsv41_jax.kernels.topk import topk_ascending

    x = _scores(np.random.default_rng(sum(shape) + k), shape)
    got = topk_ascending(x, k, impl="interpret", bi=32, bj=64)
    assert got.dtype == jnp.int32 and got.shape == (*shape[:-1], k)
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(jax.lax.top_k(x, k)[1]), axis=-1))
    xb = x.astype(jnp.bfloat16)  # bf16 scores (the reference numerics' compute dtype), default tiles
    got = topk_ascending(xb, k, impl="interpret")
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(jax.lax.top_k(xb, k)[1]), axis=-1))


def test_topk_kernel_switch(monkeypatch):
    """``top_k_indices_ascending`` takes the kernel up to ``MAX_ROWS`` rows of ``MAX_ENTRIES``
    entries where the switch says so (interpret here), XLA above either or with
    ``DSV41_TOPK_KERNEL=0``; a bad value is one error."""
    from dsv41_jax.kernels import topk

    calls, selects = [], []
    real, real_select = topk._pallas, topk._select_pallas
    monkeypatch.setattr(topk, "_pallas", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setattr(topk, "_select_pallas", lambda *a, **kw: selects.append(a[0].shape) or real_select(*a, **kw))
    few, many = _scores(np.random.default_rng(1), (topk.MAX_ROWS, 50)), _scores(np.random.default_rng(2), (9, 50))
    monkeypatch.setenv("DSV41_TOPK_KERNEL", "interpret")
    for x in (few, many):
        np.testing.assert_array_equal(np.asarray(L.top_k_indices_ascending(x, 7)),
                                      np.sort(np.asarray(jax.lax.top_k(x, 7)[1]), axis=-1))
    assert calls == [(topk.MAX_ROWS, 50)] and selects == [(9, 50)]  # more rows: the select kernel
    long = _scores(np.random.default_rng(3), (1, topk.MAX_ENTRIES + 1))  # a long context's entries: XLA
    np.testing.assert_array_equal(np.asarray(L.top_k_indices_ascending(long, 7)),
                                  np.sort(np.asarray(jax.lax.top_k(long, 7)[1]), axis=-1))
    assert len(calls) == 1
    monkeypatch.setattr(topk, "SELECT_MAX_ENTRIES", 40)  # rows longer than one program holds: XLA
    np.testing.assert_array_equal(np.asarray(L.top_k_indices_ascending(many, 7)),
                                  np.sort(np.asarray(jax.lax.top_k(many, 7)[1]), axis=-1))
    assert len(selects) == 1
    monkeypatch.setenv("DSV41_TOPK_KERNEL", "0")
    L.top_k_indices_ascending(few, 7)
    assert len(calls) == 1
    monkeypatch.setenv("DSV41_TOPK_KERNEL", "yes")
    with pytest.raises(ValueError, match="DSV41_TOPK_KERNEL"):
        L.top_k_indices_ascending(few, 7)
    with pytest.raises(ValueError, match="k=51"):
        topk.topk_ascending(few, 51, impl="interpret")


# ------------------------------------------------------------------------------ the select kernel (many rows)
SELECT_SHAPES = [((6, 2080), 512), ((2, 300), 64), ((5, 17), 17), ((1, 2, 33), 5), ((9, 40), 1), ((3, 4096), 512)]


@pytest.mark.parametrize("shape,k", SELECT_SHAPES, ids=[f"{s}-k{k}" for s, k in SELECT_SHAPES])
def test_select_kernel_equals_lax_top_k(shape, k):
    """``kernels.topk.topk_select`` (threshold search + compaction, one program per row) in the
    Pallas interpreter picks exactly lax.top_k's indices, ascending: many ties at the threshold
    (small integers), -inf entries, zeros of both signs, NaNs (IEEE total order puts them at the
    ends), rows that are not powers of two; bf16 and fp32 scores."""
    from dsv41_jax.kernels.topk import topk_select

    rng = np.random.default_rng(sum(shape) + k)
    x = _scores(rng, shape)
    x = x.at[..., 3::17].set(jnp.nan).at[..., 4::19].set(-jnp.nan)
    normal = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for xs in (x, x.astype(jnp.bfloat16), normal):
        got = topk_select(xs, k, impl="interpret")
        assert got.dtype == jnp.int32 and got.shape == (*shape[:-1], k)
        np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(jax.lax.top_k(xs, k)[1]), axis=-1))


def test_select_kernel_errors_and_lowering():
    """Bad k, too long rows, unknown impl: one clear error each; the Triton form lowers for CUDA
    (checked without a GPU)."""
    from dsv41_jax.kernels import topk

    x = jnp.zeros((8, 50), jnp.float32)
    with pytest.raises(ValueError, match="k=51"):
        topk.topk_select(x, 51, impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        topk.topk_select(x, 5, impl="cuda")
    with pytest.raises(ValueError, match="at most"):
        topk.topk_select(jnp.zeros((2, topk.SELECT_MAX_ENTRIES + 1)), 5, impl="interpret")
    f = jax.jit(lambda a: topk.topk_select(a, 512, impl="triton"))
    text = f.trace(jax.ShapeDtypeStruct((64, 4160), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "topk_select" in text
