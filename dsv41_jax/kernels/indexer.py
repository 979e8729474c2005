"""Lightning-indexer scores without the per-head score tensor.

``indexer_scores(q, k, w, n_vis)`` computes, for queries ``s`` and index keys ``t``::

    raw[b, s, h, t] = round(q[b, s, h] . k[b, t])                   (fp32 sum, rounded to dt)
    out[b, s, t]    = round(sum_h round(relu(raw[b, s, h, t]) * w[b, s, h]))   (fp32 sum over heads)
    out[b, s, t]    = -inf where t >= n_vis[b, s]

with ``dt`` = ``q.dtype`` (the model's compute dtype), i.e. the rounding points of
``Indexer.scores`` in the reference. XLA forms the [S, heads, T] tensor of ``raw`` in memory
(32 heads x 8192 keys x 2 bytes per query at an 8k prefill: 0.5 MB per query) and reads it back
twice; the kernel keeps one [bq, bt] tile of it in registers per head and writes only the [S, T]
result the top-k needs. Key tiles wholly past every query's ``n_vis`` (the causal upper triangle
of a prefill) are not computed; they are written as -inf.

Implementations (``impl``, as ``grouped_qmatmul``'s): ``"triton"`` (GPU), ``"interpret"`` (the
Pallas interpreter; CPU tests), ``"xla"`` (:func:`indexer_scores_reference`, the model's XLA
formulation), ``"auto"`` (``DSV41_QMATMUL_IMPL``, else triton on a GPU and xla elsewhere). Only
the fp32 summation orders differ between them (inside each head's dot product and over heads).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kernels.qmatmul import _load_or, _store, kernel_impl, offsets_fit

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """``bq`` queries x ``bt`` keys per program (powers of two >= 16), launch parameters."""
    bq: int = 64
    bt: int = 128
    num_warps: int = 4
    num_stages: int = 3


def indexer_scores_reference(q, k, w, n_vis):
    """The XLA formulation (``Indexer.scores`` and the caller's visibility mask)."""
    dt = q.dtype
    prec = lax.Precision.HIGHEST if dt == F32 else lax.Precision.DEFAULT
    raw = jnp.einsum("bshd,btd->bsht", q, k.astype(dt), precision=prec, preferred_element_type=F32).astype(dt)
    s = (jnp.maximum(raw, 0) * w.astype(dt)[..., None]).astype(dt)
    s = jnp.sum(s.astype(F32), axis=2).astype(dt)
    return jnp.where(jnp.arange(k.shape[1]) >= n_vis[..., None], -jnp.inf, s)


def _kernel(nv_ref, q_ref, k_ref, w_ref, o_ref, *, cfg: IndexerConfig, S: int, T: int, H: int, dt):
    from jax.experimental import pallas as pl

    bq, bt = cfg.bq, cfg.bt
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s0, t0 = i * bq, j * bt
    rows = s0 + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    cols = t0 + lax.broadcasted_iota(jnp.int32, (1, bt), 1)
    rmask, cmask = rows < S, cols < T
    nv = _load_or(nv_ref.at[b, pl.ds(s0, bq)], rows[:, 0] < S)[:, None]           # [bq, 1]; 0 past S
    live = t0 < jnp.max(nv)
    out_ref = o_ref.at[b, pl.ds(s0, bq), pl.ds(t0, bt)]
    prec = lax.Precision.HIGHEST if dt == F32 else None
    dims = (((1,), (1,)), ((), ()))

    @pl.when(live)
    def _compute():
        kt = _load_or(k_ref.at[b, pl.ds(t0, bt), :], cmask.T)                      # [bt, hd]

        def head(h, acc):
            qh = _load_or(q_ref.at[b, pl.ds(s0, bq), h, :], rmask)                 # [bq, hd]
            wh = _load_or(w_ref.at[b, pl.ds(s0, bq), pl.ds(h, 1)], rmask)          # [bq, 1]
            raw = lax.dot_general(qh, kt, dims, precision=prec, preferred_element_type=F32).astype(dt)
            p = (jnp.maximum(raw, jnp.zeros((), dt)).astype(F32) * wh.astype(F32)).astype(dt)
            return acc + p.astype(F32)

        acc = lax.fori_loop(0, H, head, jnp.zeros((bq, bt), F32))
        val = jnp.where(cols < nv, acc.astype(dt), jnp.asarray(-jnp.inf, dt))
        _store(out_ref, val, rmask & cmask)

    @pl.when(jnp.logical_not(live))
    def _dead():
        _store(out_ref, jnp.full((bq, bt), -jnp.inf, dt), rmask & cmask)


def _pallas(q, k, w, n_vis, cfg: IndexerConfig, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, S, H, hd = q.shape
    T = k.shape[1]
    dt = q.dtype
    grid = (B, pl.cdiv(S, cfg.bq), pl.cdiv(T, cfg.bt))
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                                                       num_stages=cfg.num_stages))
    cost = pl.CostEstimate(flops=2 * B * S * T * H * hd, transcendentals=0,
                           bytes_accessed=q.nbytes + k.nbytes * grid[1] + w.nbytes + B * S * T * dt.itemsize)
    return pl.pallas_call(functools.partial(_kernel, cfg=cfg, S=S, T=T, H=H, dt=dt),
                          out_shape=jax.ShapeDtypeStruct((B, S, T), dt), grid=grid, interpret=interpret,
                          cost_estimate=cost, name="indexer_scores", **kw)(n_vis, q, k, w)


def indexer_scores(q, k, w, n_vis, *, impl: str = "auto", **tiles):
    """Masked indexer scores [B, S, T] in ``q.dtype`` (see the module docstring).

    ``q`` [B, S, heads, hd] (after RoPE and any fake quantization), ``k`` [B, T, hd] index keys,
    ``w`` [B, S, heads] head weights (already scaled, in ``q.dtype``), ``n_vis`` [B, S] int32:
    keys ``t >= n_vis`` are masked to -inf. ``tiles``: ``IndexerConfig`` fields."""
    B, S, H, hd = q.shape
    if k.ndim != 3 or k.shape[0] != B or k.shape[2] != hd:
        raise ValueError(f"indexer_scores: keys {k.shape} for queries {q.shape}")
    if w.shape != (B, S, H) or n_vis.shape != (B, S):
        raise ValueError(f"indexer_scores: head weights {w.shape} / n_vis {n_vis.shape} for queries {q.shape}")
    k, w, n_vis = k.astype(q.dtype), w.astype(q.dtype), n_vis.astype(jnp.int32)
    impl = kernel_impl(impl)
    shapes = [(a.shape, a.dtype) for a in (q, k, w)] + [((B, S, k.shape[1]), q.dtype)]
    if impl == "triton" and not all(offsets_fit(shape, dtype) for shape, dtype in shapes):
        impl = "xla"  # an operand the Triton lowering would misaddress (see qmatmul.offsets_fit)
    if impl == "xla":
        return indexer_scores_reference(q, k, w, n_vis)
    cfg = IndexerConfig(**tiles)
    for name in ("bq", "bt"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"indexer_scores: {name}={v} must be a power of two >= 16")
    return _pallas(q, k, w, n_vis, cfg, interpret=impl == "interpret")
