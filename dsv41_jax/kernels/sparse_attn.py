"""Decode sparse attention (window keys + selected compressed entries, K = V, a sink per head) in
one launch. Experimental: off by default (``DSV41_ATTN_KERNEL=1`` turns it on) until measured on
the GPU (docs/status.md queue item 2).

``sparse_attn_decode(q, kw, kw_ok, kc, kc_ok, sink, scale)`` computes, for each token ``t`` (batch
row ``b = t // S``) and head ``h``, what ``attention.sparse_attn`` computes::

    l_j   = scale * (q[t, h] . key_j)            fp32 products of dt operands, -inf where masked
    m     = max(max_j l_j, -1e30)
    p_j   = exp(l_j - m)
    o     = sum_j dt(p_j) * key_j / (sum_j p_j + exp(sink[h] - m))      (fp32 sums, one rounding)

over the keys ``kw[b]`` (the window ring, mask ``kw_ok[t]``) then ``kc[t]`` (the token's gathered
compressed entries, mask ``kc_ok[t]``). The rounding points are the reference's: the
probabilities are rounded to dt relative to the global max (a two-pass walk over the keys, not
the split-key form of flash decoding, whose partial maxima would move them). Only the fp32
summation orders differ from XLA's.

Why: in a batch-1 decode step XLA forms this from ~10 small kernels per layer (two products, the
masks, the max, the exponentials, the sums, the concatenations: ~17 us in a layer with
compressed entries, run-24 profile). Here a program owns ``hb`` heads of one token: it holds
their ``q`` tile and walks the keys in ``bk``-key tiles twice (the max, then the exponentials,
the denominator and the value product).

Implementations (``impl``): ``"triton"`` (GPU), ``"interpret"`` (the Pallas interpreter; CPU
tests). The compressed entries are gathered by XLA before the launch (a gather load inside the
kernel would save that kernel too, but the Pallas interpreter of JAX 0.10 cannot run one).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
_IMPLS = ("triton", "interpret")
MAX_TOKENS = 64  # tokens up to which the model uses the kernel (decode steps)
HB, BK = 16, 64  # heads per program, keys per tile


def _tiles(q, key_ref, ok_ref, row, tok, n: int, bk: int, scale: float):
    """The ``n`` keys of ``key_ref[row]`` in ``bk``-key tiles: ``tile(c) -> (keys [bk, d], logits
    [hb, bk])`` with the masked and missing keys' logits -inf."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    d = q.shape[1]
    dims = (((1,), (1,)), ((), ()))

    def tile(c):
        jj = c * bk + jnp.arange(bk, dtype=jnp.int32)
        inside = jj < n
        keys = plgpu.load(key_ref.at[row, pl.ds(c * bk, bk), :], mask=jnp.broadcast_to(inside[:, None], (bk, d)),
                          other=0)
        ok = plgpu.load(ok_ref.at[tok, pl.ds(c * bk, bk)], mask=inside, other=0) > 0
        l = lax.dot_general(q, keys, dims, preferred_element_type=F32) * scale              # [hb, bk]
        return keys, jnp.where(ok[None, :], l, -jnp.inf)

    return tile, pl.cdiv(n, bk)


def _kernel(q_ref, kw_ref, okw_ref, *refs, S: int, H: int, Wn: int, K: int, hb: int, bk: int, scale: float):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if K:
        kc_ref, okc_ref, sink_ref, o_ref = refs
    else:
        sink_ref, o_ref = refs
    t, hblk = pl.program_id(0), pl.program_id(1)
    h0 = hblk * hb
    hs = h0 + jnp.arange(hb, dtype=jnp.int32) < H  # heads past H (fewer than hb heads): zero rows, not stored
    d = q_ref.shape[-1]
    hmask = jnp.broadcast_to(hs[:, None], (hb, d))
    q = plgpu.load(q_ref.at[t, pl.ds(h0, hb), :], mask=hmask, other=0)                      # [hb, d]
    parts = [_tiles(q, kw_ref, okw_ref, t // S, t, Wn, bk, scale)]
    if K:
        parts.append(_tiles(q, kc_ref, okc_ref, t, t, K, bk, scale))

    m = jnp.full((hb,), -1e30, F32)
    for tile, n_tiles in parts:
        m = lax.fori_loop(0, n_tiles, lambda c, m, tile=tile: jnp.maximum(m, jnp.max(tile(c)[1], axis=1)), m)

    def step(c, carry, tile):
        den, acc = carry
        keys, l = tile(c)
        p = jnp.exp(l - m[:, None])
        return den + jnp.sum(p, axis=1), acc + jnp.dot(p.astype(keys.dtype), keys, preferred_element_type=F32)

    carry = (jnp.zeros((hb,), F32), jnp.zeros(q.shape, F32))
    for tile, n_tiles in parts:
        carry = lax.fori_loop(0, n_tiles, functools.partial(step, tile=tile), carry)
    den, acc = carry
    den = den + jnp.exp(plgpu.load(sink_ref.at[pl.ds(h0, hb)], mask=hs, other=0) - m)
    plgpu.store(o_ref.at[t, pl.ds(h0, hb), :], (acc / den[:, None]).astype(o_ref.dtype), mask=hmask)


def sparse_attn_decode(q, kw, kw_ok, kc, kc_ok, sink, scale: float, *, impl: str = "triton", hb: int = HB,
                       bk: int = BK, num_warps: int = 4):
    """Attention of ``q [T, H, d]`` (T = B * S tokens, batch row ``t // S``) over the window keys
    ``kw [B, Wn, d]`` (``kw_ok [T, Wn]``) and the gathered compressed entries ``kc [T, K, d]``
    (``kc_ok [T, K]``; both None for window-only layers), sink logits ``sink [H]`` -> ``o [T, H,
    d]`` in ``q.dtype``; see the module docstring. ``hb`` heads per program (a power of two >= 16:
    the tensor cores' smallest tile; fewer heads are padded with masked rows)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if impl not in _IMPLS:
        raise ValueError(f"sparse_attn_decode: impl {impl!r} not in {_IMPLS}")
    T, H, d = q.shape
    B, Wn = kw.shape[0], kw.shape[1]
    K = 0 if kc is None else kc.shape[1]
    if T % B or hb < 16 or hb & (hb - 1) or kw_ok.shape != (T, Wn) or kw.shape[2] != d or (
            K and (kc.shape != (T, K, d) or kc_ok.shape != (T, K))) or sink.shape != (H,):
        raise ValueError(f"sparse_attn_decode: q {q.shape}, kw {kw.shape}, kw_ok {kw_ok.shape}, kc "
                         f"{None if kc is None else kc.shape}, kc_ok {None if kc_ok is None else kc_ok.shape}, sink "
                         f"{sink.shape}, hb={hb}: want [T, H, d], [B, Wn, d], [T, Wn], [T, K, d], [T, K], [H] with "
                         "B dividing T, hb a power of two >= 16")
    ops = [q, kw.astype(q.dtype), kw_ok.astype(jnp.int8)]
    if K:
        ops += [kc.astype(q.dtype), kc_ok.astype(jnp.int8)]
    ops.append(sink.astype(F32))
    interpret = impl == "interpret"
    kw_ = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2))
    keys = Wn + K
    cost = pl.CostEstimate(flops=6 * T * H * keys * d, transcendentals=T * H * keys,
                           bytes_accessed=2 * T * pl.cdiv(H, hb) * keys * d * q.dtype.itemsize + 2 * q.nbytes)
    return pl.pallas_call(
        functools.partial(_kernel, S=T // B, H=H, Wn=Wn, K=K, hb=hb, bk=bk, scale=float(scale)),
        out_shape=jax.ShapeDtypeStruct((T, H, d), q.dtype), grid=(T, pl.cdiv(H, hb)), interpret=interpret,
        cost_estimate=cost, name="sparse_attn_decode", **kw_)(*ops)
