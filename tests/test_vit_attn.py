"""``kernels.vit_attn`` (the vision tower's attention as a Mosaic GPU kernel): its values in JAX's
Mosaic GPU interpreter against a float64 numpy oracle and against its XLA form, its CUDA lowering
at V4.1's ViT shape, and its errors. Its speed and its values on a GPU against cuDNN:
``benchmarks/probe_vit_attention.py``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.kernels import vit_attn as VA

BF16 = jnp.bfloat16


def _oracle(q, k, v, n_valid, scale):
    """Float64 softmax attention over the first ``n_valid[b]`` keys, from the bf16 inputs."""
    qf, kf, vf = (np.asarray(t, np.float64) for t in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    for b, n in enumerate(np.asarray(n_valid)):
        s[b, :, :, int(n):] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, vf)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block_kv,steps,opts", [(64, 2, {}), (128, 3, {}),
                                                 (128, 2, dict(mask="cond", early=True)),
                                                 (256, 2, dict(mask="cond", early=True))])
def test_interpreter_matches_oracle(block_kv, steps, opts):
    """Two images (one with every key valid, one with 139 of 256: a partly masked key block and a
    fully masked one), two heads, several key steps, two query tiles per (image, head). The
    probabilities are rounded to bf16 before P.V and the output to bf16: the tolerance is a few
    bf16 ulps of the output's scale. The two compute warpgroups' turn barrier is off here (JAX
    0.10.2's interpreter hangs on it; it is on in the lowering test and on the GPU). The schedule
    options (the bias only in blocks with padded keys, K released early) change no value."""
    B, N, H, d = 2, 256, 2, 64
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (B, N, H, d), jnp.float32).astype(BF16) for kk in ks)
    q = q * 2  # sharper softmax rows than unit logits
    nv = jnp.array([256, 139], jnp.int32)
    got = np.asarray(VA.attention(q, k, v, nv, block_kv=block_kv, steps=steps, impl="interpret", turns=False,
                                  **opts), np.float64)
    want = _oracle(q, k, v, nv, 1 / 8)
    assert np.abs(got - want).max() < 4 * 2.0 ** -8 * np.abs(want).max()
    xla = np.asarray(VA.attention(q, k, v, nv, impl="xla"), np.float64)
    assert np.abs(xla - want).max() < 4 * 2.0 ** -8 * np.abs(want).max()
    # the masked keys do not leak: moving them changes nothing
    k2 = k.at[1, 139:].set(100.0)
    v2 = v.at[1, 139:].set(-50.0)
    got2 = np.asarray(VA.attention(q, k2, v2, nv, block_kv=block_kv, steps=steps, impl="interpret", turns=False,
                                   **opts), np.float64)
    assert np.array_equal(got2[1], got[1])


def test_lowering_at_vit_shape_and_errors():
    """The kernel lowers for CUDA (no GPU needed) at the V4.1 tower's shape (one 1024-token image:
    8704 padded patches, 16 heads x 64), with the turn barrier, and with the default schedule; unsupported shapes and a bad impl
    give one clear error each; off the GPU ``auto`` takes the XLA form."""
    SD = jax.ShapeDtypeStruct
    x = SD((1, 8704, 16, 64), BF16)
    for cfg in (dict(block_kv=64), dict(block_kv=128), VA.DEFAULT_CONFIG):
        f = jax.jit(lambda q, k, v, n, cfg=cfg: VA.attention(q, k, v, n, impl="mosaic", **cfg))
        assert "mosaic_gpu" in f.trace(x, x, x, SD((1,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    q = jnp.zeros((1, 96, 2, 64), BF16)
    with pytest.raises(ValueError, match="sequence length 96"):
        VA.attention(q, q, q, jnp.array([90]), impl="mosaic")
    q = jnp.zeros((1, 128, 2, 32), BF16)
    with pytest.raises(ValueError, match="head_dim 32"):
        VA.attention(q, q, q, jnp.array([90]), impl="mosaic")
    with pytest.raises(ValueError, match=r"\[B, N, H, d\]"):
        VA.attention(q[0], q[0], q[0], jnp.array([90]), impl="xla")
    with pytest.raises(ValueError, match="one shape"):
        VA.attention(q, q[:, :64], q, jnp.array([90]), impl="xla")
    with pytest.raises(ValueError, match="impl"):
        VA.attention(q, q, q, jnp.array([90]), impl="cudnn")
    if jax.default_backend() != "gpu":
        assert VA.resolve_impl("auto") == "xla"


def test_config_and_selection(monkeypatch):
    """``DSV41_VIT_ATTN_CFG`` overrides ``DEFAULT_CONFIG`` field by field (bad JSON or an unknown
    field: one clear error); ``DSV41_VIT_ATTN`` picks the GPU attention (a bad value: one clear
    error; off the GPU the bf16 mode runs XLA whatever it says)."""
    from dsv41_jax.model import vision as V

    monkeypatch.setenv("DSV41_VIT_ATTN_CFG", '{"block_kv": 64, "mask": "cond"}')
    assert VA.config() == {**VA.DEFAULT_CONFIG, "block_kv": 64, "mask": "cond"}
    monkeypatch.setenv("DSV41_VIT_ATTN_CFG", "{block_kv: 64}")
    with pytest.raises(ValueError, match="not JSON"):
        VA.config()
    monkeypatch.setenv("DSV41_VIT_ATTN_CFG", '{"tile": 64}')
    with pytest.raises(ValueError, match="unknown fields"):
        VA.config()
    monkeypatch.delenv("DSV41_VIT_ATTN_CFG")
    assert VA.config() == VA.DEFAULT_CONFIG
    with pytest.raises(ValueError, match="mask"):
        VA.attention(*(jnp.zeros((1, 128, 1, 64), BF16),) * 3, jnp.array([5]), mask="none")
    monkeypatch.setenv("DSV41_VIT_ATTN", "flash")
    with pytest.raises(ValueError, match="DSV41_VIT_ATTN"):
        V.attention_impl("bf16", backend="gpu")
    monkeypatch.setenv("DSV41_VIT_ATTN", "mgpu")
    assert V.attention_impl("bf16", backend="cpu") == "xla"
    assert V.attention_impl("fp32", backend="gpu") == "fp32"
