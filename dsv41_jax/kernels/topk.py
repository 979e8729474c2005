"""Exact top-k indices (ascending): of a few long rows by ranking in two launches
(``topk_ascending``), of many rows by a threshold search in one (``topk_select``, below).

``topk_ascending(x, k)`` returns, for rows ``x [R, T]`` (fp32 or bf16), the ``k`` indices
``lax.top_k(x, k)`` selects (descending IEEE total order, ties to the lower index), sorted
ascending, as int32 ``[R, k]``: what ``layers.top_k_indices_ascending`` forms. It is the decode
indexer's selection (512 of up to a few thousand compressed entries, one row per token).

Why: at batch 1 XLA forms that selection with a sort (``sort_1_0`` 16.5 us + three more sort and
select kernels, 28 us in all for the 512 of 4160 entries in the run-23 profile) or, up to
``layers.RANK_TOPK_MAX`` comparisons, with compare-and-count reductions that run at about one
microsecond per million comparisons. Here:

1. ``_rank_kernel``, grid ``(R, T / bi)``: a program holds ``bi`` entries' keys and counts, over
   the row in ``bj``-wide chunks, the entries ranked before each (larger key, or equal key and
   lower index). Entry ``i`` is selected iff that count is below ``k``: exactly ``k`` entries are.
2. ``_compact_kernel``, grid ``(R,)``: the running count of the selected flags (``cumsum``) is
   each selected entry's output slot; it stores the entry's index there (a scatter store of a
   stable partition: selected entries, then the others; the first ``k`` slots are the result).

Keys: ``layers._total_order_key`` (int32, ordered like the fp32 values under IEEE total order),
formed in the kernel from the scores as loaded (bf16 or fp32). The result equals ``lax.top_k``'s exactly (integer
comparisons only), so the kernel is checked bit-for-bit against the jnp forms.

Implementations (``impl``): ``"triton"`` (GPU), ``"interpret"`` (the Pallas interpreter; CPU
tests), ``"xla"`` (``layers._top_k_indices_ascending_xla``: XLA's ranking or sort).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.kernels.qmatmul import _pow2_at_least

_IMPLS = ("triton", "interpret", "xla")
MAX_ROWS = 4  # rows up to which the model uses the kernel (decode at batch <= 4): R x T^2 compares
# entries per row up to which it does: the compact kernel holds a row in one program (a block of
# the next power of two), and the rank kernel's T^2 comparisons (~25 us at 8192, extrapolated from
# run 24's 6 us at 4160) would lose to a sort somewhere above (long contexts: T = ctx / ratio)
MAX_ENTRIES = 8192
TILE = 8192  # entries per program x keys per step of its loop (the [bi, bj] tile of counts)
INT_MIN = -(2 ** 31)


def _keys(x_ref, r, start, n: int, T: int):
    """(indices, total-order keys) of entries ``start .. start + n - 1`` of row ``r``; past the row
    the smallest key (with an index above every entry's, such a key is never before one)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from dsv41_jax.model.layers import _total_order_key

    idx = start + jnp.arange(n, dtype=jnp.int32)
    v = plgpu.load(x_ref.at[r, pl.ds(start, n)], mask=idx < T, other=0)
    return idx, jnp.where(idx < T, _total_order_key(v), INT_MIN)


def _rank_kernel(x_ref, sel_ref, *, T: int, k: int, bi: int, bj: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r, b = pl.program_id(0), pl.program_id(1)
    i0 = b * bi
    ii, ki = _keys(x_ref, r, i0, bi, T)
    ki = ki[:, None]

    def keys(c):
        jj, kj = _keys(x_ref, r, c * bj, bj, T)
        return jj, kj[None, :]

    # The counts stay per lane ([bi, bj] int32) and are summed once at the end: a cross-lane sum
    # per step made the first version 3-5x slower (run 24). Chunks wholly below the block count the
    # keys >= (their indices are lower), chunks wholly above the keys >, the one or two chunks
    # the block straddles compare the indices too.
    lo, hi = i0 // bj, pl.cdiv(i0 + bi, bj)

    def below(c, acc):
        return acc + (keys(c)[1] >= ki).astype(jnp.int32)

    def around(c, acc):
        jj, kj = keys(c)
        return acc + ((kj > ki) | ((kj == ki) & (jj[None, :] < ii[:, None]))).astype(jnp.int32)

    def above(c, acc):
        return acc + (keys(c)[1] > ki).astype(jnp.int32)

    acc = jnp.zeros((bi, bj), jnp.int32)
    acc = jax.lax.fori_loop(0, lo, below, acc)
    acc = jax.lax.fori_loop(lo, hi, around, acc)
    acc = jax.lax.fori_loop(hi, pl.cdiv(T, bj), above, acc)
    rank = jnp.sum(acc, axis=1)
    plgpu.store(sel_ref.at[r, pl.ds(i0, bi)], (rank < k).astype(jnp.int32), mask=ii < T)


def _compact_kernel(sel_ref, o_ref, *, T: int, k: int, tp: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r = pl.program_id(0)
    ii = jnp.arange(tp, dtype=jnp.int32)
    sel = plgpu.load(sel_ref.at[r, pl.ds(0, tp)], mask=ii < T, other=0)
    c = jnp.cumsum(sel)  # selected entries up to and including each one
    # a stable partition of [0, tp): the selected entries first, then the others (padding last),
    # so every slot is written once and no store needs a mask
    slot = jnp.where(sel > 0, c - 1, k + ii - c)
    plgpu.store(o_ref.at[r, slot], ii)


def _pallas(x, k: int, interpret: bool, bi: int | None, bj: int | None, num_warps: int | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    R, T = x.shape
    if bi is None:  # run 24 (sweep_decode_glue.py): 16 x 512 best at one row, 64 x 128 at four
        bi = min(16 * _pow2_at_least(R), 64)
    bj = bj or TILE // bi
    bi, bj = min(bi, _pow2_at_least(T)), min(bj, _pow2_at_least(T))

    def params(w):
        return {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=w, num_stages=1))

    sel = pl.pallas_call(
        functools.partial(_rank_kernel, T=T, k=k, bi=bi, bj=bj),
        out_shape=jax.ShapeDtypeStruct((R, T), jnp.int32), grid=(R, pl.cdiv(T, bi)), interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=4 * R * T * T, transcendentals=0, bytes_accessed=x.nbytes + 4 * R * T),
        name="topk_rank", **params(num_warps or 4))(x)
    return pl.pallas_call(
        functools.partial(_compact_kernel, T=T, k=k, tp=_pow2_at_least(T)),
        out_shape=jax.ShapeDtypeStruct((R, _pow2_at_least(T)), jnp.int32), grid=(R,), interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * R * T, transcendentals=0, bytes_accessed=8 * R * T),
        name="topk_compact", **params(8))(sel)[:, :k]


# ------------------------------------------------------------------------------ many rows
# Prefill selects 512 of up to a few thousand entries for every query token (thousands of rows):
# the ranking's T^2 comparisons per row are too many there, and XLA's sort of [rows, T] (key,
# index) pairs plus the sort of the picked indices took ~4 ms of an 8k prefill (run 26 profile).
SELECT_MAX_ENTRIES = 16384  # entries per row up to which one program holds a row in registers


def _select_kernel(x_ref, o_ref, *, T: int, k: int, tp: int):
    """One row per program: the threshold key ``t`` (the k-th largest) by a bitwise search (32
    counting passes over the row held in registers), then the entries above ``t`` and the first
    ``k - count(> t)`` entries equal to it (ties to the lower index), stored ascending."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r = pl.program_id(0)
    ii, key = _keys(x_ref, r, 0, tp, T)

    def count_ge(t):
        return jnp.sum((key >= t).astype(jnp.int32))

    # the largest t with count(key >= t) >= k: the sign first, then bits 30..0 greedily (within one
    # sign the int32 order of the keys is that of their low 31 bits)
    t0 = jnp.where(count_ge(jnp.int32(0)) >= k, jnp.int32(0), jnp.int32(INT_MIN))

    def bit(i, t):
        cand = t | jax.lax.shift_left(jnp.int32(1), 30 - i)
        return jnp.where(count_ge(cand) >= k, cand, t)

    t = jax.lax.fori_loop(0, 31, bit, t0)
    above = key > t
    need = k - jnp.sum(above.astype(jnp.int32))  # entries equal to t that are kept: the first `need`
    eq = key == t
    sel = above | (eq & (jnp.cumsum(eq.astype(jnp.int32)) <= need))
    slot = jnp.cumsum(sel.astype(jnp.int32)) - 1  # ascending: the selected entries before this one
    # the others aim at the spare column k (masked; no two lanes of a real slot collide)
    plgpu.store(o_ref.at[r, jnp.where(sel, slot, k)], ii, mask=sel)


def _select_pallas(x, k: int, interpret: bool, num_warps: int | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    R, T = x.shape
    tp = _pow2_at_least(T)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(
        num_warps=num_warps or 4, num_stages=1))  # 4: 0.29 ms vs 0.34 (8) for 8192 rows of 4096 (run 27)
    return pl.pallas_call(
        functools.partial(_select_kernel, T=T, k=k, tp=tp),
        out_shape=jax.ShapeDtypeStruct((R, k + 1), jnp.int32), grid=(R,), interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=70 * R * T, transcendentals=0, bytes_accessed=x.nbytes + 4 * R * k),
        name="topk_select", **params)(x)[:, :k]


def topk_select(x, k: int, *, impl: str = "triton", num_warps: int | None = None):
    """What ``topk_ascending`` returns, for many rows (prefill: one per query token) of up to
    ``SELECT_MAX_ENTRIES`` entries: one launch, a program per row (``_select_kernel``), about 70
    operations per entry instead of a sort. Integer comparisons only: equal to ``lax.top_k``'s
    choice bit for bit."""
    from dsv41_jax.model.layers import _top_k_indices_ascending_xla

    if impl not in _IMPLS:
        raise ValueError(f"topk_select: impl {impl!r} not in {_IMPLS}")
    T = x.shape[-1]
    if not 0 < k <= T:
        raise ValueError(f"topk_select: k={k} for rows of {T} entries: want 0 < k <= {T}")
    if T > SELECT_MAX_ENTRIES:
        raise ValueError(f"topk_select: rows of {T} entries; one program holds at most {SELECT_MAX_ENTRIES}")
    if impl == "xla":
        return _top_k_indices_ascending_xla(x, k)
    lead = x.shape[:-1]
    return _select_pallas(x.reshape(-1, T), k, impl == "interpret", num_warps).reshape(*lead, k)


def topk_ascending(x, k: int, *, impl: str = "triton", bi: int | None = None, bj: int | None = None,
                   num_warps: int | None = None):
    """The ``k`` indices ``lax.top_k(x, k)`` picks from each row of ``x [..., T]``, ascending
    (int32 ``[..., k]``); see the module docstring. ``impl``: ``triton``, ``interpret`` or ``xla``."""
    from dsv41_jax.model.layers import _top_k_indices_ascending_xla

    if impl not in _IMPLS:
        raise ValueError(f"topk_ascending: impl {impl!r} not in {_IMPLS}")
    T = x.shape[-1]
    if not 0 < k <= T:
        raise ValueError(f"topk_ascending: k={k} for rows of {T} entries: want 0 < k <= {T}")
    if impl == "xla":
        return _top_k_indices_ascending_xla(x, k)
    lead = x.shape[:-1]
    return _pallas(x.reshape(-1, T), k, impl == "interpret", bi, bj, num_warps).reshape(*lead, k)
