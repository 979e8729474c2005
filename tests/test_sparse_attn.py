"""``kernels.sparse_attn.sparse_attn_decode`` (the experimental decode attention, two launches
split over key tiles) in the Pallas interpreter against the model's jnp formulation
``attention.sparse_attn``: window keys, gathered compressed entries, masks (rows with every key
masked too), the sink; and the switch that routes ``Attention._sparse_attn`` to it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.kernels.sparse_attn import sparse_attn_decode
from dsv41_jax.model.attention import sparse_attn

BF = jnp.bfloat16


def _case(B, S, H, d, Wn, K, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, S, H, d), jnp.float32).astype(BF)
    kw = jax.random.normal(ks[1], (B, Wn, d), jnp.float32).astype(BF)
    kw_ok = jax.random.uniform(ks[2], (B, S, Wn)) < 0.7
    kc = jax.random.normal(ks[3], (B, S, K, d), jnp.float32).astype(BF) if K else None
    kc_ok = (jax.random.uniform(ks[4], (B, S, K)) < 0.8) if K else None
    sink = jax.random.normal(ks[5], (H,), jnp.float32)
    return q, kw, kw_ok, kc, kc_ok, sink


@pytest.mark.parametrize("B,S,H,d,Wn,K", [(1, 1, 16, 64, 40, 96), (2, 1, 32, 32, 16, 0), (2, 2, 16, 64, 70, 33),
                                         (1, 1, 4, 64, 8, 6), (1, 1, 20, 32, 8, 6)])
def test_kernel_matches_the_jnp_form(B, S, H, d, Wn, K):
    q, kw, kw_ok, kc, kc_ok, sink = _case(B, S, H, d, Wn, K)
    kw_ok = kw_ok.at[0, 0].set(False)  # token 0 sees no window key
    if K:
        kc_ok = kc_ok.at[0, 0].set(False)  # nor any compressed entry: only the sink (output 0)
    scale = d ** -0.5
    want = sparse_attn(q, kw, kw_ok, kc, kc_ok, sink, scale, BF)
    T = B * S
    got = sparse_attn_decode(q.reshape(T, H, d), kw, kw_ok.reshape(T, Wn),
                             None if kc is None else kc.reshape(T, K, d),
                             None if kc is None else kc_ok.reshape(T, K), sink, scale, impl="interpret", bk=32)
    assert got.dtype == BF and got.shape == (T, H, d)
    got, want = np.asarray(got, np.float32).reshape(want.shape), np.asarray(want, np.float32)
    # same rounding points; only fp32 summation orders differ: at most one bf16 ulp apart
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.95
    if K:
        np.testing.assert_array_equal(got[0, 0], 0.0)


def test_bad_shapes_are_refused():
    q, kw, kw_ok, kc, kc_ok, sink = _case(1, 1, 24, 32, 8, 0)
    with pytest.raises(ValueError, match="powers of two"):
        sparse_attn_decode(q.reshape(1, 24, 32), kw, kw_ok.reshape(1, 8), None, None, sink, 1.0, impl="interpret",
                           hb=24)
    with pytest.raises(ValueError, match="kw_ok"):
        sparse_attn_decode(q.reshape(1, 24, 32), kw, kw_ok.reshape(1, 8)[:, :5], None, None, sink, 1.0,
                           impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        sparse_attn_decode(q.reshape(1, 24, 32), kw, kw_ok.reshape(1, 8), None, None, sink, 1.0, impl="xla")


def test_attention_takes_the_kernel_only_when_switched_on(monkeypatch):
    """``DSV41_ATTN_KERNEL``: off by default (not yet measured on the GPU), ``interpret`` here."""
    import dsv41_jax.kernels.sparse_attn as SA
    from dsv41_jax.kernels import kernel_switch

    assert kernel_switch("DSV41_ATTN_KERNEL", default="0") is None
    monkeypatch.setenv("DSV41_ATTN_KERNEL", "interpret")
    assert kernel_switch("DSV41_ATTN_KERNEL", default="0") == "interpret"
    calls = []
    real = SA.sparse_attn_decode
    monkeypatch.setattr(SA, "sparse_attn_decode", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    from types import SimpleNamespace

    from dsv41_jax.model.attention import Attention

    q, kw, kw_ok, kc, kc_ok, sink = _case(1, 1, 16, 32, 8, 16)
    fake = SimpleNamespace(numerics=SimpleNamespace(dtype=BF), head_dim=32, attn_sink=sink)
    got = Attention._sparse_attn(fake, q, kw, kw_ok, kc, kc_ok)
    assert calls == [(1, 16, 32)]
    want = sparse_attn(q, kw, kw_ok, kc, kc_ok, sink, 32 ** -0.5, BF)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-6)
