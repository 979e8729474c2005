"""Manifold-constrained hyper-connections: coefficients (fp32 Sinkhorn), collapse and expansion."""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from dsv41_jax.model.layers import einsum

F32 = jnp.float32


def sinkhorn_kernel_impl():
    """``DSV41_SINKHORN`` (read at trace time): ``auto`` (default): the Pallas kernel
    (``dsv41_jax.kernels.sinkhorn``) where ``kernels.use_pallas()`` holds (GPUs of compute
    capability >= 9, as the other kernels; ``DSV41_KERNELS=xla`` turns it off), else the jnp
    code; ``xla``: always the jnp code; ``pallas``: the kernel on any GPU backend, the jnp code
    elsewhere; ``interpret``: the kernel in the Pallas interpreter on any backend (tests).
    Returns the kernel ``impl`` to use, or None for the jnp code."""
    mode = os.environ.get("DSV41_SINKHORN", "auto") or "auto"
    if mode not in ("auto", "xla", "pallas", "interpret"):
        raise ValueError(f"DSV41_SINKHORN={mode!r}: use auto, xla, pallas or interpret")
    if mode == "interpret":
        return "interpret"
    if mode == "auto":
        from dsv41_jax.kernels import use_pallas

        return "triton" if use_pallas() else None
    if mode == "pallas" and jax.default_backend() == "gpu":
        return "triton"
    return None


def mix_kernel_impl():
    """``DSV41_MHC_KERNEL`` (read at trace time): ``1`` (default): the one-pass kernel
    (``kernels.mhc_mix``) where ``kernels.use_pallas()`` holds and no mesh partitioner would
    have to gather its operands (``kernels.auto_split``), else XLA; ``0``: always XLA (A/B
    runs); ``interpret``: the kernel in the Pallas interpreter on any backend (tests). Returns
    the kernel ``impl``, or None for the XLA formulation. ``hc_mixes`` applies it to bf16
    streams: decode steps (``kernels.mhc_mix.DECODE_MAX`` tokens or fewer: ``hc_mixes_decode``)
    and chunks of at least one token block (``kernels.mhc_mix.MIN_BLOCK`` tokens)."""
    from dsv41_jax.kernels import kernel_switch

    return kernel_switch("DSV41_MHC_KERNEL")


def _decode_pair_applies(h, fn, n: int, impl) -> bool:
    """Whether ``hc_mixes`` of the stream ``h [..., n, D]`` takes ``kernels.mhc_mix.hc_mixes_decode``:
    a kernel ``impl``, a bf16 stream of 1..``DECODE_MAX`` tokens, ``n`` a power of two with
    ``2n + n^2`` mixes, ``n * D`` a multiple of 64."""
    from dsv41_jax.kernels.mhc_mix import DECODE_MAX

    T, K = math.prod(h.shape[:-2]), h.shape[-2] * h.shape[-1]
    return (impl is not None and h.dtype == jnp.bfloat16 and 0 < T <= DECODE_MAX and not n & (n - 1)
            and fn.shape[0] == 2 * n + n * n and K % 64 == 0)


def hc_mixes(h, fn, scale, base, *, hc_mult: int, iters: int, norm_eps: float, hc_eps: float):
    """h: [..., n, D] stream -> (pre [..., n], post [..., n], comb [..., n, n]), all fp32.

    One RMS statistic per token over the flattened n*D stream; Sinkhorn = row softmax (+eps),
    one column normalisation, then iters-1 (row, column) pairs. On Hopper-class GPUs
    (``mix_kernel_impl``) a bf16 stream of at most ``kernels.mhc_mix.DECODE_MAX`` tokens (decode)
    runs as two Pallas launches (``hc_mixes_decode``: split-K sums, then the epilogue with the
    Sinkhorn per token); longer ones take the one-pass sums kernel, XLA's epilogue and the
    Sinkhorn kernel (``DSV41_SINKHORN``, see :func:`sinkhorn_kernel_impl`).
    """
    n = hc_mult
    from dsv41_jax.kernels.mhc_mix import MIN_BLOCK, hc_mix_sums, hc_mixes_decode

    impl = mix_kernel_impl()
    T, K = math.prod(h.shape[:-2]), h.shape[-2] * h.shape[-1]
    if _decode_pair_applies(h, fn, n, impl):
        # decode: split-K sums + the epilogue (sigmoids, Sinkhorn) per token, two launches
        pre, post, c = hc_mixes_decode(h.reshape(T, K), fn, scale, base, n=n, iters=iters, norm_eps=norm_eps,
                                       hc_eps=hc_eps, impl=impl)
        lead = h.shape[:-2]
        return pre.reshape(*lead, n), post.reshape(*lead, n), c.reshape(*lead, n, n)
    if impl is None or T < MIN_BLOCK or h.dtype != jnp.bfloat16:
        x = h.reshape(*h.shape[:-2], -1).astype(F32)
        rs = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
        m = einsum("...i,oi->...o", x, fn.astype(F32), preferred_element_type=F32) * rs
    else:  # one pass over the stored stream (kernels.mhc_mix): the same sums in another order
        mix, ss = hc_mix_sums(h.reshape(-1, K), fn, impl=impl)
        return _mixes_from_sums(mix, ss, K, h.shape[:-2], scale, base, n=n, iters=iters, norm_eps=norm_eps,
                                hc_eps=hc_eps)
    return _epilogue(m, scale, base, n, iters, hc_eps)


def _epilogue(m, scale, base, n: int, iters: int, hc_eps: float):
    """The normalized mixing logits ``m [..., 2n + n^2]`` -> ``(pre, post, comb)``: sigmoids and
    the Sinkhorn normalization (the Pallas kernel where ``sinkhorn_kernel_impl`` says)."""
    scale, base = scale.astype(F32), base.astype(F32)
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    from dsv41_jax.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    logits = m[..., 2 * n:] * scale[2] + base[2 * n:]
    impl = sinkhorn_kernel_impl()
    if impl is None:  # the jnp formulation (unrolled pairs): CPU, older GPUs, DSV41_SINKHORN=xla
        c = sinkhorn_reference(logits, iters, hc_eps)
    else:  # the Pallas kernel, same math
        c = sinkhorn(logits, iters, hc_eps, impl)
    return pre, post, c


def hc_site(h, fn, scale, base, pre_in, norm, quantize: bool, *, hc_mult: int, iters: int, norm_eps: float,
            hc_eps: float):
    """One mHC site's inputs: ``(hc_mixes(h, fn, scale, base, ...), norm.with_quant(h, quantize,
    mix=pre_in))``, i.e. ``((pre, post, comb), (x, xq))``. On the decode kernel path (a bf16
    stream of at most ``kernels.mhc_mix.DECODE_MAX`` tokens with both the mHC and the
    ``norm_quant`` kernels on) the norm rows share the mixes' sums launch
    (``hc_mixes_decode(norm=...)``): one launch fewer per site. Same values either way."""
    from dsv41_jax.kernels.mhc_mix import hc_mixes_decode
    from dsv41_jax.model.layers import norm_quant_impl

    n = hc_mult
    T, K = math.prod(h.shape[:-2]), h.shape[-2] * h.shape[-1]
    impl = mix_kernel_impl()
    if _decode_pair_applies(h, fn, n, impl) and impl == norm_quant_impl(h, T):
        pre, post, c, x, xq = hc_mixes_decode(h.reshape(T, K), fn, scale, base, n=n, iters=iters, norm_eps=norm_eps,
                                              hc_eps=hc_eps, impl=impl,
                                              norm=(norm.weight[...], norm.eps, pre_in.reshape(T, n), quantize))
        lead, D = h.shape[:-2], h.shape[-1]
        return ((pre.reshape(*lead, n), post.reshape(*lead, n), c.reshape(*lead, n, n)),
                (x.reshape(*lead, D), None if xq is None else xq.reshape(*lead, D)))
    site = site_kernel_impl(h, n)
    if site is not None:  # prefill: the sums and the collapse in one pass
        from dsv41_jax.kernels.mhc_mix import hc_site_sums

        lead, D = h.shape[:-2], h.shape[-1]
        mix, ss, x = hc_site_sums(h.reshape(T, n, D), fn, pre_in.reshape(T, n), impl=site)
        return (_mixes_from_sums(mix, ss, K, lead, scale, base, n=n, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps),
                norm.with_quant(x.reshape(*lead, D), quantize))
    mixes = hc_mixes(h, fn, scale, base, hc_mult=n, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps)
    return mixes, norm.with_quant(h, quantize, mix=pre_in)


def site_kernel_impl(h, n: int):
    """``DSV41_MHC_SITE`` (read at trace time): ``1``: a prefill chunk's mHC site in one pass
    over its stream (``kernels.mhc_mix.hc_site_sums``: the mixing sums and the collapse, and
    in ``hc_post_site`` the previous site's expansion) where the kernels run
    (``kernels.kernel_switch``) and the stream is a bf16 chunk of whole kernel blocks
    (``kernels.mhc_mix.site_applies``); ``0`` (default): XLA's expansion and collapse and the
    ``hc_mix_sums`` kernel, each reading the stream; ``interpret``: the kernel in the Pallas
    interpreter (tests). Off by default: slower than XLA's form (run 42, H100, 8k tokens: 1.00
    against 0.61 ms per site with the expansion; the 2-layer prefill +1.7 ms). Returns the
    kernel ``impl`` or None."""
    from dsv41_jax.kernels import kernel_switch
    from dsv41_jax.kernels.mhc_mix import DECODE_MAX, site_applies

    impl = kernel_switch("DSV41_MHC_SITE", default="0")
    T = math.prod(h.shape[:-2])
    if impl is None or h.shape[-2] != n or T <= DECODE_MAX:
        return None
    return impl if site_applies(h.reshape(T, n, h.shape[-1]), h.shape[-1]) else None


def _mixes_from_sums(mix, ss, K: int, lead, scale, base, *, n: int, iters: int, norm_eps: float, hc_eps: float):
    """``hc_mixes`` from a kernel's sums ``mix [T, O]`` and statistic ``ss [T]`` over ``K`` inputs
    (``lead``: the token dims to restore)."""
    m = (mix * jax.lax.rsqrt(ss / K + norm_eps)[:, None]).reshape(*lead, -1)
    return _epilogue(m, scale, base, n, iters, hc_eps)


def hc_post_site(y, h, post, comb, fn, scale, base, pre_in, norm, quantize: bool, *, hc_mult: int, iters: int,
                 norm_eps: float, hc_eps: float):
    """``hc_post(y, h, post, comb)`` and the next site's ``hc_site`` of its result, i.e.
    ``(h_new, (pre, post, comb), (x, xq))``. On a prefill chunk with ``DSV41_MHC_SITE``
    (``site_kernel_impl``) one kernel reads the old stream once, writes the new one and forms
    the new one's mixing sums and collapse (XLA's form reads the new stream twice more)."""
    n = hc_mult
    hc = dict(hc_mult=n, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps)
    impl = site_kernel_impl(h, n)
    if impl is None:
        h = hc_post(y, h, post, comb)
        return (h, *hc_site(h, fn, scale, base, pre_in, norm, quantize, **hc))
    from dsv41_jax.kernels.mhc_mix import hc_site_sums

    lead, D = h.shape[:-2], h.shape[-1]
    T = math.prod(lead)
    s, mix, ss, x = hc_site_sums(h.reshape(T, n, D), fn, pre_in.reshape(T, n), y=y.reshape(T, D),
                                 post=post.reshape(T, n), comb=comb.reshape(T, n, n), impl=impl)
    mixes = _mixes_from_sums(mix, ss, n * D, lead, scale, base, n=n, iters=iters, norm_eps=norm_eps,
                             hc_eps=hc_eps)
    return s.reshape(h.shape), mixes, norm.with_quant(x.reshape(*lead, D), quantize)


def hc_pre(h, mix):
    """Collapse [..., n, D] with weights [..., n] (fp32 sum), cast to the stream dtype."""
    return jnp.sum(mix[..., None].astype(F32) * h.astype(F32), axis=-2).astype(h.dtype)


def hc_post(y, residual, post, comb):
    """out_k = post_k * y + sum_j comb[j, k] * residual_j, fp32, cast to y.dtype."""
    out = post[..., :, None] * y[..., None, :].astype(F32) + jnp.sum(
        comb[..., :, :, None] * residual[..., :, None, :].astype(F32), axis=-3)
    return out.astype(y.dtype)
