"""ViT performance mode (``Numerics.vision_attention = "bf16"``) against the fp32 parity path.

Tolerances. The performance mode adds bf16 roundings the parity path does not have: q, k, v stay
bf16 (instead of fp32 upcasts), the softmax probabilities are rounded to bf16 before P·V (as in
flash attention kernels) and each GEMM rounds its fp32 accumulator to bf16 before the fp32 bias
add. Each rounding is <= 2^-9 relative; on the tiny golden towers (2 layers + final norm +
aligner) they add up to ~8e-3 of the largest output (measured 8.3e-3 on ``image_fp8``). The gate
is the same 2e-2 max-abs-relative bound the golden case and the bf16 torch oracle use for the
bf16 compute path (2.5x headroom). With fp32 compute only the attention inputs are rounded
(measured 3.8e-4 / 5.7e-4): gated at 2e-3.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import vision as V
from dsv41_jax.model.vision import attention, attention_bf16, encode_images, exact_bucket, tight_bucket
from dsv41_jax.numerics import FAST_F32, REFERENCE_BF16, Numerics
from tests.test_vision import IMAGE_CASES, get_case, rel_err, synthetic_image

KEYS = ("vit_out", "aligner_rows", "span_embeds")


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def bf16_numerics(c):
    return dataclasses.replace(c.numerics, vision_attention="bf16")


def test_numerics_field():
    assert Numerics().vision_attention == "fp32"
    assert Numerics("float32", "fast") == FAST_F32 and hash(Numerics("float32", "fast")) == hash(FAST_F32)
    perf = Numerics("bfloat16", "reference", "bf16")
    assert perf != REFERENCE_BF16 and hash(perf) != hash(REFERENCE_BF16)  # distinct static jit keys
    with pytest.raises(ValueError, match="vision_attention"):
        Numerics("bfloat16", "reference", "fp16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        perf.vision_attention = "fp32"


def test_attention_impl_selection(monkeypatch):
    monkeypatch.setattr(V, "_CUDNN_FAILED", [])
    assert V.attention_impl("fp32", "gpu") == "fp32"
    assert V.attention_impl("bf16", "cpu") == "xla"
    assert V.attention_impl("bf16", "gpu") == "cudnn"
    V._CUDNN_FAILED.append("x")
    assert V.attention_impl("bf16", "gpu") == "xla"
    with pytest.raises(ValueError):
        V.attention_impl("fp16", "gpu")


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_bf16_mode_vs_parity_golden(name):
    """The performance mode stays within bf16-level error of the parity path and the golden."""
    c = get_case(name)
    parity = c.encode()
    fast = encode_images(c.vision, c.aligner, c.vectors, c.batch.images, bf16_numerics(c), return_details=True)
    limit = 2e-2 if c.numerics.compute_dtype == "bfloat16" else 2e-3
    errs = {}
    for key in KEYS:
        got = getattr(fast, key)
        assert got.dtype == c.numerics.dtype and got.shape == getattr(parity, key).shape
        errs[key] = rel_err(f32(got), f32(getattr(parity, key)))[0]
        assert rel_err(f32(got), c.ref[key])[0] <= limit, (key, rel_err(f32(got), c.ref[key])[0])
    print(f"{name} bf16 mode vs parity: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert max(errs.values()) <= limit, errs
    assert errs["vit_out"] > 0  # the mode is really a different path


def test_default_path_unchanged():
    """Without the field set, the bf16 golden case still matches the reference bit for bit."""
    c = get_case("image_fp8")
    assert c.numerics.vision_attention == "fp32" and c.vision.numerics.vision_attention == "fp32"
    out = c.encode()
    for key in KEYS:
        np.testing.assert_array_equal(f32(getattr(out, key)), c.ref[key], err_msg=key)


def test_per_call_and_load_time_selection():
    """The mode comes from the call's numerics when given, else from the tower's (load time)."""
    c = get_case("image_fp8")
    per_call = encode_images(c.vision, c.aligner, c.vectors, c.batch.images, bf16_numerics(c))
    from dsv41_jax.model.vision import build_vision, load_vision_weights
    from dsv41_jax.safetensors_io import Checkpoint

    vision, aligner = build_vision(c.cfg.vision, c.cfg.text.hidden_size, bf16_numerics(c))
    load_vision_weights(vision, aligner, Checkpoint(c.dir))
    at_load = encode_images(vision, aligner, c.vectors, c.batch.images)
    np.testing.assert_array_equal(f32(per_call), f32(at_load))
    # a per-call fp32 numerics overrides a bf16 tower
    back = encode_images(vision, aligner, c.vectors, c.batch.images, c.numerics)
    np.testing.assert_array_equal(f32(back), c.ref["span_embeds"])


def test_bf16_multi_image_padding():
    """Images batched with padding (shared bucket groups, one-patch dummies, 200-row pads) give
    each image's exact-size single-image result: the padded keys are excluded by
    ``key_value_seq_lengths``. Bit-identical on CPU; the bound leaves room for blocking noise only
    (a missing mask moves outputs by > 1e-1, see test_attention_bf16_masking)."""
    c = get_case("image_fp8")
    nb = bf16_numerics(c)
    ims = [synthetic_image(g, c.cfg.vision, i) for i, g in enumerate([(5, 8), (1, 1), (9, 2), (12, 11)])]
    ims.insert(1, c.batch.images[0])
    together = encode_images(c.vision, c.aligner, c.vectors, ims, nb, return_details=True)
    padded = encode_images(c.vision, c.aligner, c.vectors, ims, nb, return_details=True, bucket=lambda n: 200)
    alone = [encode_images(c.vision, c.aligner, c.vectors, [im], nb, return_details=True, bucket=exact_bucket)
             for im in ims]
    for key in KEYS:
        want = np.concatenate([f32(getattr(a, key)) for a in alone])
        for run in (together, padded):
            np.testing.assert_allclose(f32(getattr(run, key)), want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=key)
    assert f32(together.span_embeds).shape[0] == sum(im.span_len for im in ims)


def _qkv(b=2, n=96, h=4, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16) for _ in range(3)]


def test_attention_bf16_vs_fp32():
    """bf16 attention vs the fp32 parity attention on the same bf16 inputs: only P (and the
    output) are rounded to bf16, so the error is a few bf16 ulps of the output scale."""
    q, k, v = _qkv()
    n_valid = jnp.asarray([70, 96], jnp.int32)
    mask = jnp.arange(96)[None, :] < n_valid[:, None]
    ref = f32(attention(q, k, v, mask))
    got = attention_bf16(q, k, v, n_valid)
    assert got.dtype == jnp.bfloat16
    assert rel_err(f32(got).reshape(2, -1), ref.reshape(2, -1))[0] <= 1e-2
    # query blocks (the XLA path's memory bound) give the same rows
    np.testing.assert_array_equal(f32(attention_bf16(q, k, v, n_valid, q_block=32)), f32(got))


def test_attention_bf16_masking():
    """Keys past n_valid have no effect, whatever they hold; without the lengths they would."""
    q, k, v = _qkv(b=1, n=64)
    n = 40
    k2 = k.at[:, n:].set(30.0)
    v2 = v.at[:, n:].set(-50.0)
    full = f32(attention_bf16(q, k, v, jnp.asarray([n])))
    junk = f32(attention_bf16(q, k2, v2, jnp.asarray([n])))
    np.testing.assert_array_equal(junk, full)
    alone = f32(attention_bf16(q[:, :n], k[:, :n], v[:, :n], jnp.asarray([n])))
    np.testing.assert_allclose(full[:, :n], alone, rtol=0, atol=1e-6 * np.abs(alone).max())
    unmasked = f32(attention_bf16(q, k2, v2, jnp.asarray([64])))
    assert np.abs(unmasked[:, :n] - alone).max() > 1e-1 * np.abs(alone).max()


def test_cudnn_fallback_off_gpu(monkeypatch):
    """impl="cudnn" where cuDNN is missing (CPU) falls back to XLA with a warning, same result."""
    monkeypatch.setattr(V, "_CUDNN_FAILED", [])
    q, k, v = _qkv(b=1, n=64)
    n_valid = jnp.asarray([50])
    with pytest.warns(RuntimeWarning, match="cuDNN unavailable"):
        got = attention_bf16(q, k, v, n_valid, impl="cudnn")
    np.testing.assert_array_equal(f32(got), f32(attention_bf16(q, k, v, n_valid, impl="xla")))
    assert V._CUDNN_FAILED and V.attention_impl("bf16", "gpu") == "xla"


def _dots(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dots(inner)


def _tower_dots(c, numerics, n=64):
    from flax import nnx

    im = synthetic_image((8, 8), c.cfg.vision, 0)
    g = V.pack_images([im], c.cfg.vision, bucket=exact_bucket)[0]
    impl = V.attention_impl(numerics.vision_attention)
    graph, state = nnx.split(c.vision)

    def run(state, patches):
        return nnx.merge(graph, state)(patches, jnp.asarray(g.rows), jnp.asarray(g.cols), jnp.asarray(g.n_valid),
                                       impl=impl)

    return list(_dots(jax.make_jaxpr(run)(state, jnp.asarray(g.patches)).jaxpr))


def test_performance_path_has_no_fp32_gemm(monkeypatch):
    """bf16 mode: every GEMM (projections and both attention products) takes bf16 operands, the
    projections write bf16 (the GPU formulation, forced here); the parity path keeps its fp32
    attention products."""
    monkeypatch.setattr(V, "_GEMM_BF16_OUT", True)
    c = get_case("image_fp8")
    dots = _tower_dots(c, bf16_numerics(c))
    assert len(dots) >= 1 + 2 * 6  # patch embed + per layer: wqkv, wo, w1, w2, QK^T, PV
    for e in dots:
        assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e
        if e.outvars[0].aval.ndim == 3:  # [B, N, out] projections
            assert e.outvars[0].aval.dtype == jnp.bfloat16, e
    parity = _tower_dots(c, c.numerics)
    assert any(all(v.aval.dtype == jnp.float32 for v in e.invars) for e in parity)


def test_tight_bucket():
    assert tight_bucket(8649) == 8704 and V.default_bucket(8649) == 9216
    assert tight_bucket(1) == 64 and tight_bucket(64) == 64
    for n in range(65, 12000, 7):
        b = tight_bucket(n)
        assert n <= b < n * 1.032 + 128, (n, b)
        if n > 2048:
            assert b % 128 == 0
    shapes = {tight_bucket(n) for n in range(4097, 8193)}
    assert len(shapes) == 32


def test_api_and_cli_option(monkeypatch):
    """``dsv41_jax.load(..., vit_attention="bf16")`` builds the tower in the performance mode;
    ``generate --vit-attention bf16`` passes it through."""
    import dsv41_jax
    from dsv41_jax import cli
    from dsv41_jax.model.span import encode_and_merge

    c = get_case("image_fp8")
    m = dsv41_jax.load(c.dir, vit_attention="bf16")
    assert m.numerics.vision_attention == "bf16" and m.model.vision.numerics.vision_attention == "bf16"
    cap = {}
    encode_and_merge(m.model, c.batch.input_ids, c.batch.types, list(c.batch.images), capture=cap)
    want = encode_images(c.vision, c.aligner, c.vectors, c.batch.images, bf16_numerics(c))
    np.testing.assert_array_equal(f32(cap["span_embeds"]), f32(want))

    args = cli.build_parser().parse_args(["generate", "m", "p", "--vit-attention", "bf16"])
    seen = {}
    monkeypatch.setattr(dsv41_jax, "load", lambda path, **kw: seen.update(kw))
    cli._load(args)
    assert seen["vit_attention"] == "bf16"
    assert cli.build_parser().parse_args(["generate", "m", "p"]).vit_attention == "fp32"


def test_gemm_output_formulations_agree(monkeypatch):
    """The GPU formulation (GEMM writes bf16) and the CPU one (fp32 out, then rounded) give the
    same tower output: both are one rounding of the fp32 accumulator."""
    c = get_case("image_fp8")
    g = V.pack_images(list(c.batch.images), c.cfg.vision, bucket=exact_bucket)[0]
    args = [jnp.asarray(a) for a in (g.patches, g.rows, g.cols, g.n_valid)]
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(V, "_GEMM_BF16_OUT", flag)
        outs.append(f32(c.vision(*args, impl="xla")))
    np.testing.assert_array_equal(outs[0], outs[1])
