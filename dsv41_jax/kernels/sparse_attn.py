"""Decode sparse attention (window keys + selected compressed entries, K = V, a sink per head) in
two launches split over key tiles. Experimental: off by default (``DSV41_ATTN_KERNEL=1`` turns it
on) until it beats XLA on the GPU (docs/status.md queue item 2).

``sparse_attn_decode(q, kw, kw_ok, kc, kc_ok, sink, scale)`` computes, for each token ``t`` (batch
row ``b = t // S``) and head ``h``, what ``attention.sparse_attn`` computes::

    l_j   = scale * (q[t, h] . key_j)            fp32 products of dt operands, -inf where masked
    m     = max(max_j l_j, -1e30)
    p_j   = exp(l_j - m)
    o     = sum_j dt(p_j) * key_j / (sum_j p_j + exp(sink[h] - m))      (fp32 sums, one rounding)

over the keys ``kw[b]`` (the window ring, mask ``kw_ok[t]``) then ``kc[t]`` (the token's gathered
compressed entries, mask ``kc_ok[t]``). The rounding points are the reference's: the
probabilities are rounded to dt relative to the global max, so the split-key form of flash
decoding (partial maxima, rescaled partial sums) is out. Instead the keys are cut into
``bk``-key tiles (the window's, then the entries'), one program per (token, ``hb`` heads, tile):

1. ``_logits_kernel``: the tile's logits ``[hb, bk]`` and their max, written out (fp32);
2. ``_values_kernel``: the global max from the tiles' maxima, then the tile's exponentials, their
   sum and the value product ``dt(p) @ keys`` as fp32 partials;
3. XLA adds the partials over the tiles and divides (one small fusion).

Only the fp32 summation orders differ from XLA's. Why: in a batch-1 decode step XLA forms this
from ~8 small kernels per layer (13.7 us at V4.1 sizes, run 25); a first one-launch version (one
program per token and 16 heads, walking all keys twice) took 38.8 us: 4 programs cannot draw the
bandwidth, so the keys are spread over programs here.

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


def _sources(refs, K: int):
    """``(key_ref, ok_ref, tiles)`` of the window and, with ``K``, the compressed entries."""
    return [refs[:2]] + ([refs[2:4]] if K else [])


def _tile_keys(key_ref, ok_ref, row, tok, c, n: int, bk: int, d: int):
    """Keys ``[bk, d]`` of tile ``c`` of ``key_ref[row]`` (zeros past ``n``) and their mask ``[bk]``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    inside = c * bk + jnp.arange(bk, dtype=jnp.int32) < n
    keys = plgpu.load(key_ref.at[row, pl.ds(c * bk, bk), :], mask=jnp.broadcast_to(inside[:, None], (bk, d)), other=0)
    ok = plgpu.load(ok_ref.at[tok, pl.ds(c * bk, bk)], mask=inside, other=0) > 0
    return keys, ok


def _for_tile(refs, *, S: int, Wn: int, K: int, bk: int, body):
    """Run ``body(key_ref, ok_ref, row, c, n)`` for this program's tile: window tiles first
    (``row`` the batch row ``t // S``), then the token's compressed-entry tiles."""
    from jax.experimental import pallas as pl

    t, c = pl.program_id(0), pl.program_id(2)
    nw = pl.cdiv(Wn, bk)
    srcs = _sources(refs, K)

    @pl.when(c < nw)
    def _window():
        body(*srcs[0], t // S, c, Wn)

    if K:
        @pl.when(c >= nw)
        def _entries():
            body(*srcs[1], t, c - nw, K)


def _heads(H: int, hb: int):
    from jax.experimental import pallas as pl

    h0 = pl.program_id(1) * hb
    return h0, h0 + jnp.arange(hb, dtype=jnp.int32) < H  # heads past H (fewer than hb): masked rows


def _logits_kernel(q_ref, *refs, S: int, H: int, Wn: int, K: int, hb: int, bk: int, scale: float):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    l_ref, m_ref = refs[-2:]
    t, c = pl.program_id(0), pl.program_id(2)
    h0, hs = _heads(H, hb)
    d = q_ref.shape[-1]
    q = plgpu.load(q_ref.at[t, pl.ds(h0, hb), :], mask=jnp.broadcast_to(hs[:, None], (hb, d)), other=0)

    def body(key_ref, ok_ref, row, ci, n):
        keys, ok = _tile_keys(key_ref, ok_ref, row, t, ci, n, bk, d)
        l = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale    # [hb, bk]
        l = jnp.where(ok[None, :], l, -jnp.inf)
        plgpu.store(l_ref.at[t, pl.ds(h0, hb), pl.ds(c * bk, bk)], l,
                    mask=jnp.broadcast_to(hs[:, None], (hb, bk)))
        plgpu.store(m_ref.at[t, pl.ds(h0, hb), c], jnp.max(l, axis=1), mask=hs)

    _for_tile(refs[:-2], S=S, Wn=Wn, K=K, bk=bk, body=body)


def _values_kernel(l_ref, m_ref, *refs, S: int, H: int, Wn: int, K: int, hb: int, bk: int, nt: int, ntp: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    acc_ref, den_ref = refs[-2:]
    t, c = pl.program_id(0), pl.program_id(2)
    h0, hs = _heads(H, hb)
    tiles_in = jnp.arange(ntp, dtype=jnp.int32) < nt
    mx = plgpu.load(m_ref.at[t, pl.ds(h0, hb), pl.ds(0, ntp)], mask=hs[:, None] & tiles_in[None, :],
                    other=-jnp.inf)
    m = jnp.maximum(jnp.max(mx, axis=1), -1e30)                                                  # [hb]
    hmask = jnp.broadcast_to(hs[:, None], (hb, bk))
    l = plgpu.load(l_ref.at[t, pl.ds(h0, hb), pl.ds(c * bk, bk)], mask=hmask, other=-jnp.inf)
    p = jnp.exp(l - m[:, None])
    plgpu.store(den_ref.at[c, t, pl.ds(h0, hb)], jnp.sum(p, axis=1), mask=hs)

    def body(key_ref, ok_ref, row, ci, n):
        d = key_ref.shape[-1]
        keys, _ = _tile_keys(key_ref, ok_ref, row, t, ci, n, bk, d)
        acc = jnp.dot(p.astype(keys.dtype), keys, preferred_element_type=F32)                      # [hb, d]
        plgpu.store(acc_ref.at[c, t, pl.ds(h0, hb), :], acc, mask=jnp.broadcast_to(hs[:, None], (hb, d)))

    _for_tile(refs[:-2], S=S, Wn=Wn, K=K, bk=bk, body=body)


def sparse_attn_decode(q, kw, kw_ok, kc, kc_ok, sink, scale: float, *, impl: str = "triton", hb: int = HB,
                       bk: int = BK, num_warps: int = 4):
    """Attention of ``q [T, H, d]`` (T = B * S tokens, batch row ``t // S``) over the window keys
    ``kw [B, Wn, d]`` (``kw_ok [T, Wn]``) and the gathered compressed entries ``kc [T, K, d]``
    (``kc_ok [T, K]``; both None for window-only layers), sink logits ``sink [H]`` -> ``o [T, H,
    d]`` in ``q.dtype``; see the module docstring. ``hb`` heads per program (a power of two >= 16:
    the tensor cores' smallest tile; fewer heads are padded with masked rows), ``bk`` keys per
    tile (a power of two >= 16)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from dsv41_jax.kernels.qmatmul import _pow2_at_least

    if impl not in _IMPLS:
        raise ValueError(f"sparse_attn_decode: impl {impl!r} not in {_IMPLS}")
    T, H, d = q.shape
    B, Wn = kw.shape[0], kw.shape[1]
    K = 0 if kc is None else kc.shape[1]
    if T % B or hb < 16 or hb & (hb - 1) or bk < 16 or bk & (bk - 1) or kw_ok.shape != (T, Wn) or kw.shape[2] != d or (
            K and (kc.shape != (T, K, d) or kc_ok.shape != (T, K))) or sink.shape != (H,):
        raise ValueError(f"sparse_attn_decode: q {q.shape}, kw {kw.shape}, kw_ok {kw_ok.shape}, kc "
                         f"{None if kc is None else kc.shape}, kc_ok {None if kc_ok is None else kc_ok.shape}, sink "
                         f"{sink.shape}, hb={hb}, bk={bk}: want [T, H, d], [B, Wn, d], [T, Wn], [T, K, d], [T, K], "
                         "[H] with B dividing T, hb and bk powers of two >= 16")
    ops = [kw.astype(q.dtype), kw_ok.astype(jnp.int8)]
    if K:
        ops += [kc.astype(q.dtype), kc_ok.astype(jnp.int8)]
    interpret = impl == "interpret"
    kw_ = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
    nt = pl.cdiv(Wn, bk) + pl.cdiv(K, bk)
    ntp = max(16, _pow2_at_least(nt))
    grid = (T, pl.cdiv(H, hb), nt)
    geo = dict(S=T // B, H=H, Wn=Wn, K=K, hb=hb, bk=bk)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)  # noqa: E731
    # the maxima's tile axis padded to a power of two (loads of whole rows); unwritten tiles are masked
    l, mx = pl.pallas_call(functools.partial(_logits_kernel, scale=float(scale), **geo),
                           out_shape=(f32(T, H, nt * bk), f32(T, H, ntp)), grid=grid, interpret=interpret,
                           name="sparse_attn_logits", **kw_)(q, *ops)
    acc, den = pl.pallas_call(functools.partial(_values_kernel, nt=nt, ntp=ntp, **geo),
                              out_shape=(f32(nt, T, H, d), f32(nt, T, H)), grid=grid, interpret=interpret,
                              name="sparse_attn_values", **kw_)(l, mx, *ops)
    m = jnp.maximum(jnp.max(mx[:, :, :nt], axis=-1), -1e30)
    den = jnp.sum(den, axis=0) + jnp.exp(sink.astype(F32)[None, :] - m)
    return (jnp.sum(acc, axis=0) / den[..., None]).astype(q.dtype)
