"""RMSNorm and the fp8 activation quantization of its output in one launch (decode rows).

``norm_quant(x, weight, eps)`` returns, for rows ``x [T, D]`` (bf16), the two arrays the model
otherwise forms in three XLA kernels (the norm's sum of squares, its scaling, the per-32 block
amax and quantization)::

    xn = bf16(weight * (x * rsqrt(mean(x^2) + eps)))          # layers.rms_norm
    xq = bf16(act_quant_fp8(float32(xn), 32))                 # quant.act_quant_fp8

``norm_quant(h, weight, eps, mix=pre)`` first collapses a hyper-connection stream ``h [T, n, D]``
with the fp32 weights ``pre [T, n]`` (``mhc.hc_pre``: fp32 products and sum, one bf16 rounding),
so an mHC site's collapse + norm + quantization is one kernel instead of four.

Why: a batch-1 decode step is ~250 kernels, most of them ~1.7 us glue (docs/performance.md run
22); the norm -> quantized-GEMV sites (the attention's input and q norms, the FFN's input norm)
are nine of those chains per three layers. A program owns one row: it loads the row as
``[D/32, 32]`` blocks (rows padded to a power of two and masked), keeps it in registers, and
stores both results.

Numerics: the quantization forms ``quant.act_quant_fp8``'s values (``quant.kernel_fp8_round``:
the e4m3 rounding by the dtype conversion, or ``quant._fq_pow2_scaled`` with ``quant.rint_even``),
so equal inputs give equal codes. Only the fp32 sums (the statistic, the
collapse's n terms) may run in another order than XLA's; on the interpreter (CPU tests) the
results match the jnp formulation to the last bf16 bit but for rare rounding-boundary rows.

Implementations (``impl``): ``"triton"`` (GPU), ``"interpret"`` (the Pallas interpreter; CPU
tests), ``"xla"`` (:func:`norm_quant_reference`, the model's jnp formulation).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.kernels.qmatmul import _pow2_at_least

F32 = jnp.float32
BLOCK = 32  # inputs per fp8 activation scale
_IMPLS = ("triton", "interpret", "xla")
MAX_ROWS = 64  # rows (tokens) up to which the model uses the kernel: decode steps


def norm_quant_reference(x, weight, eps: float, mix=None, quantize: bool = True):
    """The jnp formulation (``mhc.hc_pre``, ``layers.rms_norm``, ``quant.act_quant_fp8``):
    ``(xn, xq)``, ``xq`` None without ``quantize``."""
    from dsv41_jax.model.layers import rms_norm
    from dsv41_jax.model.mhc import hc_pre

    if mix is not None:
        x = hc_pre(x, mix)
    xn = rms_norm(x, weight, eps)
    return xn, (quant.act_quant_fp8(xn.astype(F32), BLOCK).astype(xn.dtype) if quantize else None)


def row(t, refs, *, n: int, nb: int, nbp: int, D: int, eps: float, hc: bool, quantize: bool):
    """Row ``t`` of the launch: ``refs`` = the operands then the outputs of ``launch_parts``.
    Also the norm rows inside the decode mHC sums launch (``kernels.mhc_mix.hc_mixes_decode``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if hc:
        x_ref, mix_ref, w_ref, *outs = refs
    else:
        x_ref, w_ref, *outs = refs
    mask = jnp.broadcast_to((jnp.arange(nbp) < nb)[:, None], (nbp, BLOCK))
    blocks = pl.ds(0, nbp)
    if hc:  # hc_pre: fp32 products, the n terms summed in order, one rounding to the stream dtype
        x = None
        for k in range(n):
            hk = plgpu.load(x_ref.at[t * n + k, blocks, :], mask=mask, other=0).astype(F32)  # [T * n, nb, 32]
            term = mix_ref[t, k] * hk
            x = term if x is None else x + term
        x = x.astype(x_ref.dtype).astype(F32)
    else:
        x = plgpu.load(x_ref.at[t, blocks, :], mask=mask, other=0).astype(F32)
    w = plgpu.load(w_ref.at[blocks, :], mask=mask, other=0).astype(F32)
    ss = jnp.sum(jnp.sum(x * x, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
    y = w * (x * jax.lax.rsqrt(ss / D + eps))
    xn = y.astype(outs[0].dtype)
    plgpu.store(outs[0].at[t, blocks, :], xn, mask=mask)
    if quantize:
        xb = xn.astype(F32)
        amax = jnp.max(jnp.abs(xb), axis=1, keepdims=True)
        xq = quant.kernel_fp8_round()(xb, amax)
        plgpu.store(outs[1].at[t, blocks, :], xq.astype(outs[1].dtype), mask=mask)


def _kernel(*refs, **kw):
    from jax.experimental import pallas as pl

    row(pl.program_id(0), refs, **kw)


def launch_parts(x, weight, eps, mix, quantize: bool):
    """(operands, output shapes, ``row`` keywords, ``finish``) of the rows of ``x``: ``finish``
    maps the launch's outputs to ``(xn, xq or None)``."""
    hc = mix is not None
    T, D = x.shape[0], x.shape[-1]
    nb = D // BLOCK
    n = x.shape[1] if hc else 1
    ops = [x.reshape(T * n, nb, BLOCK)] + ([mix.astype(F32)] if hc else []) + [weight.reshape(nb, BLOCK)]
    out = jax.ShapeDtypeStruct((T, nb, BLOCK), x.dtype)
    kw = dict(n=n, nb=nb, nbp=_pow2_at_least(nb), D=D, eps=float(eps), hc=hc, quantize=quantize)

    def finish(ys):
        ys = [y.reshape(T, D) for y in ys]
        return ys[0], (ys[1] if quantize else None)

    return ops, ((out, out) if quantize else (out,)), kw, finish


def _pallas(x, weight, eps, mix, quantize: bool, interpret: bool, num_warps: int | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    ops, outs, rkw, finish = launch_parts(x, weight, eps, mix, quantize)
    T, D, n = x.shape[0], x.shape[-1], rkw["n"]
    cost = pl.CostEstimate(flops=T * D * (2 * n + 12), transcendentals=T,
                           bytes_accessed=x.nbytes + weight.nbytes + len(outs) * T * D * x.dtype.itemsize)
    if num_warps is None:  # run 23 (sweep_decode_glue.py): 8 warps were fastest or within 0.2 us at 1-64 rows
        num_warps = 8
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
    return finish(pl.pallas_call(functools.partial(_kernel, **rkw), out_shape=outs, grid=(T,), interpret=interpret,
                                 cost_estimate=cost, name="norm_quant", **kw)(*ops))


def norm_quant(x, weight, eps: float, mix=None, *, quantize: bool = True, impl: str = "triton",
               num_warps: int | None = None):
    """``(xn, xq)`` for rows ``x [T, D]`` (or a stream ``[T, n, D]`` collapsed with ``mix [T, n]``
    first); see the module docstring. ``D`` must be a multiple of 32 (``xq`` is None without
    ``quantize``). ``impl``: ``triton``, ``interpret`` or ``xla``."""
    if impl not in _IMPLS:
        raise ValueError(f"norm_quant: impl {impl!r} not in {_IMPLS}")
    D = x.shape[-1]
    if D % BLOCK:
        raise ValueError(f"norm_quant: last axis {D} is not a multiple of {BLOCK}")
    bad_mix = mix is not None and (x.ndim != 3 or mix.shape != x.shape[:2])
    if bad_mix or (mix is None and x.ndim != 2) or weight.shape != (D,):
        raise ValueError(f"norm_quant: x {x.shape}, weight {weight.shape}, mix "
                         f"{None if mix is None else mix.shape}: want [T, D] (or [T, n, D] with mix [T, n]), [D]")
    if impl == "xla":
        return norm_quant_reference(x, weight, eps, mix, quantize)
    return _pallas(x, weight, eps, mix, quantize, impl == "interpret", num_warps)
