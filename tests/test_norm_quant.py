"""kernels.norm_quant (RMSNorm, optionally after the mHC collapse, + the fp8 activation
quantization in one launch) against the model's jnp formulation, run by the Pallas interpreter;
its wiring into the model through the golden bf16 case. The Triton lowering itself is checked on
the GPU (benchmarks/check_gpu_kernels.py)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import quant
from dsv41_jax.kernels.norm_quant import norm_quant, norm_quant_reference

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


def test_rint_even_is_round_half_even_under_jit():
    # halves (ties both ways), near-halves, integers, the e4m3 range of scaled magnitudes (< 16)
    a = np.concatenate([np.arange(0, 40) / 2, np.nextafter(np.float32(2.5), 0) + np.zeros(1),
                        np.random.default_rng(0).uniform(0, 16, 4096)]).astype(np.float32)
    got = jax.jit(quant.rint_even)(jnp.asarray(a))
    np.testing.assert_array_equal(np.asarray(got), np.round(a))


@pytest.mark.parametrize("T,D,n,quantize", [(1, 5120, 4, True), (3, 1280, 0, True), (2, 96, 4, False),
                                             (5, 64, 0, True)])
def test_kernel_equals_the_jnp_formulation(T, D, n, quantize):
    """Same bits as layers.rms_norm (after mhc.hc_pre) and quant.act_quant_fp8 on the interpreter,
    for row widths that are not powers of two (masked blocks) and a wide range of magnitudes."""
    k = jax.random.split(jax.random.key(T * D + n), 4)
    shape = (T, n, D) if n else (T, D)
    mag = jnp.exp2(jax.random.randint(k[3], shape[:-1] + (1,), -20, 20).astype(jnp.float32))
    x = (jax.random.normal(k[0], shape) * mag).astype(jnp.bfloat16)
    w = (1 + 0.2 * jax.random.normal(k[1], (D,))).astype(jnp.bfloat16)
    mix = jax.random.uniform(k[2], (T, n)) + 0.5 if n else None
    ref = norm_quant_reference(x, w, 1e-6, mix, quantize)
    got = norm_quant(x, w, 1e-6, mix, quantize=quantize, impl="interpret")
    np.testing.assert_array_equal(_bits(got[0]), _bits(ref[0]))
    if quantize:
        np.testing.assert_array_equal(_bits(got[1]), _bits(ref[1]))
        # every block of 32 is e4m3 codes times its power-of-two scale pow2ceil(amax / 448)
        xn = np.asarray(got[0], np.float32).reshape(-1, 32)
        s = np.asarray(quant.pow2ceil(np.maximum(np.abs(xn).max(1, keepdims=True), 1e-4) * quant.INV_E4M3_MAX))
        codes = np.asarray(got[1], np.float32).reshape(-1, 32) / s
        np.testing.assert_array_equal(codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), codes)
        assert np.abs(codes).max() <= 448 and np.mean(codes != 0) > 0.9
    else:
        assert got[1] is None


def test_bad_shapes_are_refused():
    x = jnp.zeros((2, 40), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        norm_quant(x, jnp.ones((40,)), 1e-6, impl="interpret")
    with pytest.raises(ValueError, match="want"):
        norm_quant(jnp.zeros((2, 64), jnp.bfloat16), jnp.ones((32,)), 1e-6, impl="interpret")
    with pytest.raises(ValueError, match="want"):  # mix rows that do not match the stream's
        norm_quant(jnp.zeros((2, 4, 64), jnp.bfloat16), jnp.ones((64,)), 1e-6, jnp.ones((3, 4)), impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        norm_quant(jnp.zeros((2, 64), jnp.bfloat16), jnp.ones((64,)), 1e-6, impl="cuda")


def test_env_switch(monkeypatch):
    from dsv41_jax.model.layers import norm_quant_impl

    x = jnp.zeros((1, 64), jnp.bfloat16)
    monkeypatch.setenv("DSV41_NORM_QUANT", "interpret")
    assert norm_quant_impl(x, 1) == "interpret"
    assert norm_quant_impl(x, 65) is None  # prefill-sized: XLA
    assert norm_quant_impl(x.astype(jnp.float32), 1) is None  # fp32 parity numerics: XLA
    monkeypatch.setenv("DSV41_NORM_QUANT", "0")
    assert norm_quant_impl(x, 1) is None
    monkeypatch.setenv("DSV41_NORM_QUANT", "2")
    with pytest.raises(ValueError, match="DSV41_NORM_QUANT"):
        norm_quant_impl(x, 1)


def test_golden_bf16_case_through_the_kernel(monkeypatch):
    """The fp8 golden case (bf16 reference numerics, fp8 Linears: the quantized inputs come from the
    kernel) with the GPU default's kernel paths (the decode mHC pair of ``kernels.mhc_mix`` and the
    decode indexer's ``kernels.topk`` too) and the experimental ``kernels.sparse_attn``, at the
    case's own tolerances."""
    import dsv41_jax.kernels as K
    from dsv41_jax.verify import run_case

    case = os.path.join(GOLDEN, "image_fp8")
    if not os.path.isdir(case):
        pytest.fail("golden case image_fp8 missing")
    import dsv41_jax.kernels.mhc_mix as MM
    import dsv41_jax.kernels.norm_quant as NQ
    import dsv41_jax.kernels.sparse_attn as SA
    import dsv41_jax.kernels.topk as TK

    calls, mixes, picks, attends = [], [], [], []
    real_attn = SA.sparse_attn_decode
    monkeypatch.setattr(SA, "sparse_attn_decode", lambda *a, **k: attends.append(1) or real_attn(*a, **k))
    real_topk = TK._pallas
    monkeypatch.setattr(TK, "_pallas", lambda *a, **k: picks.append(1) or real_topk(*a, **k))
    real, real_mix = NQ._pallas, MM.hc_mixes_decode
    monkeypatch.setattr(NQ, "_pallas", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    monkeypatch.setattr(MM, "hc_mixes_decode", lambda *a, **k: mixes.append(1) or real_mix(*a, **k))
    monkeypatch.setattr(K, "use_pallas", lambda: True)
    monkeypatch.setenv("DSV41_NORM_QUANT", "interpret")
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_SINKHORN", "interpret")
    monkeypatch.setenv("DSV41_MHC_KERNEL", "interpret")  # the decode mHC pair (kernels.mhc_mix) too
    monkeypatch.setenv("DSV41_TOPK_KERNEL", "interpret")
    monkeypatch.setenv("DSV41_ATTN_KERNEL", "interpret")
    monkeypatch.setenv("DSV41_MOE_PATH", "pallas")
    res = run_case(case, ("prefill", "decode"), log=lambda s: None)
    failed = [f"{r.kind} {r.name}: {r.detail}" for r in res if r.ok is False]
    assert res and not failed, "\n".join(failed)
    assert calls and any(calls), "the kernel never ran with quantization"
    assert mixes, "the decode mHC pair never ran"
    assert picks, "the decode top-k kernel never ran"
    assert attends, "the decode attention kernel never ran"


@pytest.mark.parametrize("T,D", [(1, 320), (3, 64), (8, 96)])
def test_site_launches_match_the_separate_forms(T, D, monkeypatch):
    """``mhc.hc_site`` (the mixes, and the collapse + norm + act-quant of the stream with the
    previous pre-mix) on the decode kernel path, against ``hc_mixes`` and ``RMSNorm.with_quant``
    on XLA: up to 4 tokens the norm rows share the FMA sums launch, at 8 they take their own
    launch beside the tensor-core sums. The normed and quantized rows are the same bits."""
    from dsv41_jax.model.layers import RMSNorm
    from dsv41_jax.model.mhc import hc_site

    n = 4
    k = jax.random.split(jax.random.key(T * D), 5)
    h = jax.random.normal(k[0], (T, 1, n, D)).astype(jnp.bfloat16)
    fn = 0.05 * jax.random.normal(k[1], ((2 + n) * n, n * D))
    scale, base = jnp.asarray([0.5, 0.7, 1.3]), 0.1 * jax.random.normal(k[2], ((2 + n) * n,))
    pre_in = jax.random.uniform(k[3], (T, 1, n)) + 0.5
    norm = RMSNorm(D, 1e-6, param_dtype=jnp.bfloat16)
    norm.weight.value = (1 + 0.1 * jax.random.normal(k[4], (D,))).astype(jnp.bfloat16)
    kw = dict(hc_mult=n, iters=20, norm_eps=1e-6, hc_eps=1e-6)
    monkeypatch.setenv("DSV41_MHC_KERNEL", "0")
    monkeypatch.setenv("DSV41_NORM_QUANT", "0")
    monkeypatch.setenv("DSV41_SINKHORN", "xla")
    (rp, rq, rc), (rx, rxq) = hc_site(h, fn, scale, base, pre_in, norm, True, **kw)
    assert rxq is None  # off the kernel path the GEMMs quantize for themselves
    monkeypatch.setenv("DSV41_MHC_KERNEL", "interpret")
    monkeypatch.setenv("DSV41_NORM_QUANT", "interpret")
    (gp, gq, gc), (gx, gxq) = hc_site(h, fn, scale, base, pre_in, norm, True, **kw)
    for g, r in ((gp, rp), (gq, rq), (gc, rc)):
        assert g.shape == r.shape and float(jnp.max(jnp.abs(g - r) / (jnp.abs(r) + 1e-30))) < 2e-5
    np.testing.assert_array_equal(_bits(gx), _bits(rx))
    np.testing.assert_array_equal(_bits(gxq), _bits(quant.act_quant_fp8(rx.astype(jnp.float32), 32).astype(rx.dtype)))
