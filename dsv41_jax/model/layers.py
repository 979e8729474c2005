"""Shared building blocks: Linear (checkpoint [out, in] layout), RMSNorm, exact matmul helper."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import Numerics

HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT = jax.lax.Precision.DEFAULT
F32 = jnp.float32


def einsum(spec, a, b, **kw):
    """``jnp.einsum`` at full fp32 precision whenever an operand is fp32 (TF32 would break the
    1e-5 gate); bf16 operands take the plain bf16 path (exact products, fp32 accumulation)."""
    prec = HIGHEST if (a.dtype == F32 or b.dtype == F32) else DEFAULT
    return jnp.einsum(spec, a, b, precision=prec, **kw)


def matmul(x, w, out_dtype, compute_dtype=None):
    """``x @ w.T`` with ``w`` in [out, in] layout, fp32 accumulation, one rounding to ``out_dtype``.

    ``compute_dtype`` is the dtype both operands are cast to before the product (the dtype the
    reference runs that GEMM in); defaults to ``out_dtype``.
    """
    cd = out_dtype if compute_dtype is None else compute_dtype
    if cd == F32 and x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16:
        # an fp32 GEMM of bf16-valued operands: the products are exact in fp32 either way, so
        # skip materialising fp32 copies (e.g. of the 1.3 GB head) and accumulate in fp32
        y = einsum("...i,oi->...o", x, w, preferred_element_type=F32)
        return y.astype(out_dtype)
    y = einsum("...i,oi->...o", x.astype(cd), w.astype(cd), preferred_element_type=F32)
    return y.astype(out_dtype)


class Linear(nnx.Module):
    """Bias-free (optionally biased) linear layer holding ``weight`` as [out, in].

    ``quantized`` records that the checkpoint stored this weight fp8/fp4; in ``reference``
    numerics the activation then goes through the fp8 per-32 fake quantization first, exactly
    as the official fp8 GEMM path does.
    """

    def __init__(self, in_features: int, out_features: int, *, numerics: Numerics, param_dtype=None,
                 bias: bool = False, quantized: bool = False, rngs: nnx.Rngs | None = None):
        self.in_features, self.out_features = in_features, out_features
        self.numerics = numerics
        self.quantized = quantized
        pd = numerics.dtype if param_dtype is None else param_dtype
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), pd))
        self.bias = nnx.Param(jnp.zeros((out_features,), pd)) if bias else None

    def __call__(self, x, out_dtype=None, compute_dtype=None):
        od = self.numerics.dtype if out_dtype is None else out_dtype
        if self.quantized and self.numerics.fake_quant:
            from dsv41_jax.quant import act_quant_fp8

            w = self.weight[...]
            # e4m3 x power-of-two values are exact in bf16, so a bf16 weight keeps the bf16 GEMM
            # (fp32 accumulation) with the same products as the reference's fp32 block GEMM
            x = act_quant_fp8(x.astype(F32), 32).astype(w.dtype)
            y = matmul(x, w, od, compute_dtype=F32)
        else:
            y = matmul(x, self.weight[...], od, compute_dtype=compute_dtype)
        if self.bias is not None:
            y = (y.astype(F32) + self.bias[...].astype(F32)).astype(od)
        return y


def rms_norm(x, weight, eps: float):
    """Weighted RMSNorm: statistics and the weight product in fp32, cast once to x.dtype."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = weight.astype(F32) * y
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
