"""Prefill sparse attention (window keys + selected compressed entries, K = V, a sink per head) as
two Pallas launches that gather their keys themselves.

``sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink, scale, window=W, block=...)`` computes
what ``Attention._attend`` computes with ``attention.sparse_attn`` for a whole chunk, for each
token ``t`` (batch row ``b``, chunk index ``s``) and head ``h``::

    window keys  j in [lo(s), lo(s) + n)  of kw[b] (ring ++ chunk), valid where
                 kpos[b, j] >= 0 and pos[b, s] - W < kpos[b, j] <= pos[b, s]
    entries      cmp[b, max(idx[b, s, i], 0)], valid where idx[b, s, i] >= 0
    l_j   = scale * (q[t, h] . key_j)            fp32 products of dt operands, -inf where masked
    m     = max(max_j l_j, -1e30)
    p_j   = exp(l_j - m)
    o     = sum_j dt(p_j) * key_j / (sum_j p_j + exp(sink[h] - m))      (fp32 sums, one rounding)

``lo(s)`` and ``n`` are ``_attend``'s query blocks: with ``block`` > 0 (chunks longer than two
blocks) token ``s`` sees ``kw[b, lo : lo + W + block]`` with ``lo = (s // block) * block``,
otherwise all of ``kw[b]``. The rounding points are the reference's: the probabilities are rounded
to dt relative to the row's global maximum, so flash attention's running maximum is out. Hence
two launches over a grid of (token, ``hb`` heads):

1. ``_max_kernel``: every key tile's logits, their row maximum ``m [T, H]`` (exact: a max), and
   by default (``store_logits``, chunks up to ``STORE_MAX_BYTES`` of logits) the logits themselves
   (fp32 ``[T, H, n + K]``);
2. ``_out_kernel`` (a third grid axis over ``dv``-wide slices of the output columns): the stored
   logits (or, past that size, the logits again), ``p = exp(l - m)``, their fp32 sum and
   ``dt(p) @ keys[:, slice]``, then the sink and the division, written as dt.

Only the fp32 summation orders differ from XLA's. The max launch runs on key tiles and warps of
its own (``max_bk``, ``max_warps``: a maximum is exact in any order). ``online=True`` (opt-in,
``DSV41_ATTN_PREFILL_TILES='{"online": true}'``) runs one launch with flash attention's running
maximum instead: about 30% less time, but p is rounded to bf16 against the maximum so far, so its
bf16 roundings are not the reference's (within a few bf16 ulps of the output). What it replaces: XLA's query-block loop
gathers the selected entries of every query into HBM (``[S, K, d]``: 4.3 GB per layer at 8k
tokens and V4.1 sizes), runs batched GEMMs with 64-row operands and ~10 elementwise passes
over the ``[S, H, K]`` logits, and copies each block in and out (run 26: ~18 ms of an 8k
prefill's 99). Here the entries are read from the L2-resident compressed cache per key tile;
window tiles without a valid key are skipped (a branch), so the window's blocked range costs
little more than its valid keys; entry tiles are all computed by default (``skip_entries``).

Implementations (``impl``): ``"triton"`` (GPU; the gather is a pointer gather inside the kernel),
``"interpret"`` (the Pallas interpreter; JAX 0.10's interpreter cannot run a gather load, so XLA
gathers the entries first and the kernel reads them as contiguous tiles: the same code
otherwise). ``gather="xla"`` forces the pre-gathered form on the GPU too (GPU checks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kernels.qmatmul import _largest_pow2_divisor, _load, _pow2_at_least, _store, env_tiles

F32 = jnp.float32
_IMPLS = ("triton", "interpret")
MIN_TOKENS = 64  # the model uses the kernel for chunks of more tokens than this (prefill)
DEFAULT = "1"  # ``DSV41_ATTN_PREFILL_KERNEL`` when unset (kernels.kernel_switch: on where the Pallas kernels are)
# tiles: heads per program, keys per tile, output columns per program of the second launch, and
# whether entry tiles without a valid entry are skipped (a branch in the loop). Measured on one
# H200 at V4.1 sizes, 8k tokens (sweep_prefill.py --part attn, run 26): the whole head dim per
# program on 8 warps, no entry branch, 32-key tiles: 6.5 ms per compressed layer (XLA 10.2 ms);
# 256-wide value slices on 4 warps 7.3, on 8 warps 13.2; 64-key tiles 9.8-11.6 (or over the shared
# memory). ``max_bk`` / ``max_warps`` / ``max_stages``: the max launch's own key tiles, warps and
# stages (None: the output launch's); it holds no [64, 512] accumulator, so 64-key tiles on 4
# warps suit it: 6.54 -> 5.52 ms per compressed layer (run 28; the maximum is exact, so the output
# is the same). ``online``: the one-launch running-maximum form (``_online_kernel``: not the
# reference's rounding points; an opt-in) on its own key tiles ``online_bk``: 3.6 ms with 64 keys,
# 4.5 with 32 (run 28). ``DSV41_ATTN_PREFILL_TILES`` (JSON, e.g.
# '{"dv": 256}') overrides fields for tuning.
# ``lazy``: the row maximum (max launch) and the probabilities' sum (output launch) kept as
# [hb, bk] elementwise partials across key tiles and reduced across the tile once at the end,
# instead of a cross-lane (and, on 8 warps, cross-warpgroup) reduction per tile: the same maximum,
# another fp32 summation order for the sum (run 41, H100, 8k: 5.58 -> 5.60 ms per ratio-2 layer,
# 2.08 -> 2.10 window-only: off). ``window_range``: the window loop over the range of
# tiles holding valid keys (found by a pass over the key positions), without a branch per tile, so
# Triton can pipeline its loads (the branch keeps it from doing so); the same products and sums.
# ``entry_range``: the entry loop likewise over the range of tiles holding a selected entry (ids
# >= 0), instead of all ``K / bk`` tiles (early tokens see fewer entries than ``K``). Both on
# (run 41, H100, 8k): 5.58 -> 5.51 ms per ratio-2 layer, 2.08 -> 2.04 window-only; the window's
# range alone made the ratio-2 layer slower (6.76 ms), so they go together. ``store_logits``: the
# max launch also writes every logit it computes (fp32 ``[T, H, n + K]``: 1.9 GB at 8k tokens, V4.1
# sizes, 256-token query blocks; the bytes moved are only the slots of computed tiles, ~1.4 GB)
# and the output launch reads them instead of recomputing ``q @ keys``: half its MMAs, no queries,
# and with ``dv`` < d no repeated QK per value slice (e.g. ``dv`` 256 on 4 warps: one warpgroup per
# program, p never crosses warpgroups). The same logits, so the same output. On by default since
# run 42 (session 32, H100, 8k): 5.43 -> 4.91 ms per ratio-2 layer, 2.01 -> 1.78 window-only, the
# 2-layer prefill 42.56-42.89 -> 41.62-42.12 ms; its output launch then takes ``store_dv`` value
# columns on ``store_warps`` warps (256 on 4: 4.91 ms; the whole 512 on 8 warps 5.04, 128 on 4
# 6.62), and a chunk whose logits would pass ``STORE_MAX_BYTES`` recomputes them as before
# (``dv`` / ``num_warps``), so long unchunked prompts keep the two launches' small footprint.
# ``max_stages`` 3: the max launch's loop on three pipeline stages, 1.5-3% faster per layer in two sweeps
# (run 28, H200: 5.77 -> 5.62 ms ratio 2, 2.08 -> 2.06 window-only; run 43, H100, with the stored
# logits: 4.89 -> 4.75, 1.70 -> 1.67); the maximum and the stored logits are the same values.
TILES = dict(hb=64, bk=32, dv=512, num_warps=8, num_stages=2, skip_entries=False, max_bk=64, max_warps=4,
             max_stages=3, online=False, online_bk=64, lazy=False, window_range=True, entry_range=True,
             store_logits=True, store_dv=256, store_warps=4)
# the largest stored-logits buffer (fp32 [T, H, slots]); 4 GiB is ~17k tokens of V4.1 (64 heads,
# 384 window slots + 512 entries)
STORE_MAX_BYTES = 4 << 30


def _tiles() -> dict:
    return env_tiles("DSV41_ATTN_PREFILL_TILES", TILES)


def _window_slots(W: int, block: int, J: int) -> int:
    """How many window keys a token scans: its query block's ``W + block`` keys of ``kw`` (all
    ``J`` where chunks are not blocked); the first key is at ``lo = (s // block) * block``."""
    return min(W + block, J) if block else J


def _scan_keys(q, refs, carry, fn, *, S: int, W: int, block: int, J: int, K: int, bk: int, scale: float,
               gathered: bool, skip_entries: bool, window_range: bool = False, entry_range: bool = False,
               v0=None, dv=None, logits_io=None):
    """Fold ``fn(carry, l, vals)`` over this program's key tiles: ``l`` the tile's masked logits
    ``[hb, bk]`` (fp32), ``vals()`` its value columns ``[v0, v0 + dv)`` (``[bk, dv]``, zeros where
    masked). Window tiles without a valid key are skipped, entry tiles too with ``skip_entries``
    (a skip is a branch, which keeps Triton from pipelining the loop's loads). ``window_range`` /
    ``entry_range``: instead of a branch per tile, a first pass over the key positions (entry ids)
    alone finds the first and last tile with a valid key, and the loop runs over that range without
    a branch (dynamic bounds: a loop Triton can pipeline; dead tiles inside the range are computed
    masked). ``refs``: pos, kw, kpos (and, with ``K``, idx and the compressed cache or the
    pre-gathered entries). ``logits_io`` (``store_logits``): ``(ref, "store" | "load", h0, hs)``:
    each tile's logits written to ``ref [T, H, n + K]`` (key slot: window key ``lo + j`` at ``j``,
    entry ``i`` at ``n + i``), or read from it instead of computed (``q`` is then unused)."""
    from jax.experimental import pallas as pl

    pos_ref, kw_ref, kpos_ref = refs[:3]
    t = pl.program_id(0)
    b, s = t // S, t % S
    p_t = pos_ref[t]
    d = kw_ref.shape[-1]
    lanes = jnp.arange(bk, dtype=jnp.int32)
    whole = v0 is None or dv == d
    lg_ref, mode, h0, hs = logits_io or (None, None, None, None)

    def logits(keys, ok, slots):
        lg = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
        if mode == "store":
            _store(lg_ref.at[t, pl.ds(h0, lg.shape[0]), slots], lg, hs[:, None] & ok[None, :])
        return jnp.where(ok[None, :], lg, -jnp.inf)

    def tile(ok, key_at, slot0, carry, skip=True):
        slots = pl.ds(slot0, bk)

        def live(carry):
            if mode == "load":  # the max launch's logits: only the value columns are read here
                lg = _load(lg_ref.at[t, pl.ds(h0, hs.shape[0]), slots], hs[:, None] & ok[None, :], -jnp.inf)
                cols = slice(None) if whole else pl.ds(v0, dv)
                return fn(carry, lg, lambda: _load(key_at(cols), ok[:, None], 0))
            keys = _load(key_at(slice(None)), ok[:, None], 0)
            vals = (lambda: keys) if whole else (lambda: _load(key_at(pl.ds(v0, dv)), ok[:, None], 0))
            return fn(carry, logits(keys, ok, slots), vals)

        return lax.cond(jnp.max(ok.astype(jnp.int32)) > 0, live, lambda c: c, carry) if skip else live(carry)

    def scan(nt, at, carry, skip, ranged):
        """Tiles ``0..nt-1`` (``at(c)``: the tile's mask of valid keys, its key rows and its first
        key slot): all of them, each a branch where ``skip``; or, ``ranged``, those from the first
        to the last holding a valid key, without a branch."""
        if not ranged:
            return lax.fori_loop(0, nt, lambda c, cr: tile(*at(c), cr, skip), carry)

        def bounds(c, fl):
            live = jnp.max(at(c)[0].astype(jnp.int32)) > 0
            return jnp.where(live, jnp.minimum(fl[0], c), fl[0]), jnp.where(live, c, fl[1])

        first, last = lax.fori_loop(0, nt, bounds, (jnp.int32(nt), jnp.int32(-1)))
        return lax.fori_loop(first, jnp.maximum(last + 1, first), lambda c, cr: tile(*at(c), cr, False), carry)

    lo = (s // block) * block if block else 0
    n = _window_slots(W, block, J)

    def window_at(c):
        inside = c * bk + lanes < n
        kp = _load(kpos_ref.at[b, pl.ds(lo + c * bk, bk)], inside, -1)
        ok = inside & (kp >= 0) & (kp <= p_t) & (kp > p_t - W)
        return ok, lambda cols: kw_ref.at[b, pl.ds(lo + c * bk, bk), cols], c * bk

    carry = scan(pl.cdiv(n, bk), window_at, carry, True, window_range)
    if not K:
        return carry
    idx_ref, src_ref = refs[3:5]

    def entry_at(c):
        ids = _load(idx_ref.at[t, pl.ds(c * bk, bk)], c * bk + lanes < K, -1)
        if gathered:
            return ids >= 0, lambda cols: src_ref.at[t, pl.ds(c * bk, bk), cols], n + c * bk
        rows = jnp.maximum(ids, 0)
        return ids >= 0, lambda cols: src_ref.at[b, rows, cols], n + c * bk  # a pointer gather

    return scan(pl.cdiv(K, bk), entry_at, carry, skip_entries, entry_range)


def _heads(q_ref, hb: int, load: bool = True):
    """This program's heads: the first, the mask of those below H (fewer heads than ``hb`` are
    padded with masked rows: the tensor cores' smallest tile is 16) and their queries ``[hb, d]``
    (None unless ``load``)."""
    from jax.experimental import pallas as pl

    t, h0 = pl.program_id(0), pl.program_id(1) * hb
    hs = h0 + jnp.arange(hb, dtype=jnp.int32) < q_ref.shape[1]
    return h0, hs, _load(q_ref.at[t, pl.ds(h0, hb), :], hs[:, None], 0) if load else None


def _max_kernel(q_ref, *refs, hb: int, lazy: bool = False, store_logits: bool = False, **geo):
    """The row maxima ``m [T, H]``; with ``store_logits`` also every computed logit (the last
    output ``[T, H, n + K]``, read by the output launch instead of recomputed)."""
    from jax.experimental import pallas as pl

    h0, hs, q = _heads(q_ref, hb)
    if store_logits:
        refs, (m_ref, lg_ref) = refs[:-2], refs[-2:]
        geo = dict(geo, logits_io=(lg_ref, "store", h0, hs))
    else:
        refs, m_ref = refs[:-1], refs[-1]
    if lazy:  # per-lane maxima across the tiles, one reduction at the end
        m = jnp.max(_scan_keys(q, refs, jnp.full((hb, geo["bk"]), -jnp.inf, F32),
                               lambda m, lg, vals: jnp.maximum(m, lg), **geo), axis=1)
    else:
        m = _scan_keys(q, refs, jnp.full((hb,), -jnp.inf, F32),
                       lambda m, lg, vals: jnp.maximum(m, jnp.max(lg, axis=1)), **geo)
    _store(m_ref.at[pl.program_id(0), pl.ds(h0, hb)], m, hs)


def _out_kernel(q_ref, m_ref, sink_ref, *refs, hb: int, dv: int, lazy: bool = False, store_logits: bool = False,
                **geo):
    """The output; with ``store_logits`` the logits come from the max launch (the input before
    the output), so a program reads its ``dv`` value columns of each key and no queries."""
    from jax.experimental import pallas as pl

    o_ref = refs[-1]
    t, v0 = pl.program_id(0), pl.program_id(2) * dv
    h0, hs, q = _heads(q_ref, hb, load=not store_logits)
    if store_logits:
        refs, lg_ref = refs[:-2], refs[-2]
        geo = dict(geo, logits_io=(lg_ref, "load", h0, hs))
    else:
        refs = refs[:-1]
    m = jnp.maximum(_load(m_ref.at[t, pl.ds(h0, hb)], hs, 0), -1e30)

    def add(carry, lg, vals):
        acc, den = carry
        p = jnp.exp(lg - m[:, None])
        acc = acc + jnp.dot(p.astype(o_ref.dtype), vals(), preferred_element_type=F32)
        return acc, den + (p if lazy else jnp.sum(p, axis=1))

    den0 = jnp.zeros((hb, geo["bk"]) if lazy else (hb,), F32)
    acc, den = _scan_keys(q, refs, (jnp.zeros((hb, dv), F32), den0), add, v0=v0, dv=dv, **geo)
    if lazy:
        den = jnp.sum(den, axis=1)
    den = den + jnp.exp(_load(sink_ref.at[pl.ds(h0, hb)], hs, 0) - m)
    _store(o_ref.at[t, pl.ds(h0, hb), pl.ds(v0, dv)], (acc / den[:, None]).astype(o_ref.dtype), hs[:, None])


def _online_kernel(q_ref, sink_ref, *refs, hb: int, dv: int, **geo):
    """``online``: one launch with a running maximum (flash attention's rescaling): the
    probabilities are rounded to dt relative to the maximum so far, not the row's, so the result
    differs from the two-launch form by bf16 roundings of p (not the reference's rounding points:
    ``Numerics.text_attention`` "online", an opt-in)."""
    from jax.experimental import pallas as pl

    o_ref = refs[-1]
    t, v0 = pl.program_id(0), pl.program_id(2) * dv
    h0, hs, q = _heads(q_ref, hb)

    def add(carry, lg, vals):
        acc, den, m = carry
        m_new = jnp.maximum(m, jnp.max(lg, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(lg - m_new[:, None])
        acc = acc * alpha[:, None] + jnp.dot(p.astype(q.dtype), vals(), preferred_element_type=F32)
        return acc, den * alpha + jnp.sum(p, axis=1), m_new

    init = (jnp.zeros((hb, dv), F32), jnp.zeros((hb,), F32), jnp.full((hb,), -1e30, F32))
    acc, den, m = _scan_keys(q, refs[:-1], init, add, v0=v0, dv=dv, **geo)
    den = den + jnp.exp(_load(sink_ref.at[pl.ds(h0, hb)], hs, 0) - m)
    _store(o_ref.at[t, pl.ds(h0, hb), pl.ds(v0, dv)], (acc / den[:, None]).astype(o_ref.dtype), hs[:, None])


def applies(head_dim: int) -> bool:
    """Whether the kernel takes this head size (its value slices are powers of two >= 16)."""
    return head_dim % 16 == 0


def sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink, scale: float, *, window: int, block: int,
                        impl: str = "triton", gather: str = "kernel", hb: int | None = None, bk: int | None = None,
                        dv: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                        skip_entries: bool | None = None, **more):
    """Attention of a chunk: ``q [B, S, H, d]`` at positions ``pos [B, S]`` over the window keys
    ``kw [B, J, d]`` (ring ++ chunk, positions ``kpos [B, J]``, -1 = empty) and the selected
    entries ``idx [B, S, K]`` (-1 = none) of the compressed cache ``cmp [B, Tc, d]`` (both None for
    window-only layers), sink logits ``sink [H]`` -> ``o [B, S, H, d]`` in ``q.dtype``; see the
    module docstring (``block``: ``_attend``'s query block, 0 = every token sees all of ``kw``).
    Tiles default to ``TILES`` (powers of two >= 16, ``dv`` dividing d; ``hb`` at most the heads
    rounded up to a power of two: heads past H are masked rows)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if impl not in _IMPLS:
        raise ValueError(f"sparse_attn_prefill: impl {impl!r} not in {_IMPLS}")
    if gather not in ("kernel", "xla"):
        raise ValueError(f"sparse_attn_prefill: gather {gather!r} (use kernel or xla)")
    B, S, H, d = q.shape
    J = kw.shape[1]
    K = 0 if idx is None else idx.shape[-1]
    tiles = _tiles()
    unknown = set(more) - set(TILES)
    if unknown:
        raise ValueError(f"sparse_attn_prefill: unknown options {sorted(unknown)}")
    tiles.update(more)
    T = B * S
    slots = _window_slots(window, block, J) + K
    store = bool(tiles["store_logits"]) and not tiles["online"] and T * H * slots * 4 <= STORE_MAX_BYTES
    hb = min(hb or tiles["hb"], max(16, _pow2_at_least(H)))
    bk = bk or tiles["bk"]
    dv = dv or _largest_pow2_divisor(d, (store and tiles["store_dv"]) or tiles["dv"])
    pow2 = lambda v: v >= 16 and not v & (v - 1)  # noqa: E731
    if (kw.shape != (B, J, d) or kpos.shape != (B, J) or pos.shape != (B, S) or sink.shape != (H,)
            or (K and (cmp is None or cmp.shape[0] != B or cmp.shape[2] != d or idx.shape != (B, S, K)))
            or not (pow2(hb) and pow2(bk) and pow2(dv)) or d % dv or (block and S % block)):
        raise ValueError(f"sparse_attn_prefill: q {q.shape}, pos {pos.shape}, kw {kw.shape}, kpos {kpos.shape}, cmp "
                         f"{None if cmp is None else cmp.shape}, idx {None if idx is None else idx.shape}, sink "
                         f"{sink.shape}, hb={hb}, bk={bk}, dv={dv}, block={block}: want [B, S, H, d], [B, S], "
                         "[B, J, d], [B, J], [B, Tc, d], [B, S, K], [H]; hb, bk, dv powers of two >= 16, dv dividing "
                         "d; block dividing S")
    dt = q.dtype
    interpret = impl == "interpret"
    gathered = interpret or gather == "xla"
    ops = [pos.reshape(T).astype(jnp.int32), kw.astype(dt), kpos.astype(jnp.int32)]
    if K:
        ids = idx.reshape(T, K).astype(jnp.int32)
        if gathered:
            src = jax.vmap(lambda c, i: c[i])(cmp.astype(dt), jnp.maximum(idx, 0)).reshape(T, K, d)
        else:
            src = cmp.astype(dt)
        ops += [ids, src]
    geo = dict(S=S, W=window, block=block, J=J, K=K, bk=bk, scale=float(scale), gathered=gathered,
               skip_entries=bool(tiles["skip_entries"] if skip_entries is None else skip_entries),
               window_range=bool(tiles["window_range"]), entry_range=bool(tiles["entry_range"]))
    warps = num_warps or (store and tiles["store_warps"]) or tiles["num_warps"]
    stages = num_stages or tiles["num_stages"]
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))
    qt = q.reshape(T, H, d)
    if tiles["online"]:
        ogeo = dict(geo, bk=tiles["online_bk"] or bk)
        o = pl.pallas_call(functools.partial(_online_kernel, hb=hb, dv=dv, **ogeo),
                           out_shape=jax.ShapeDtypeStruct((T, H, d), dt), grid=(T, pl.cdiv(H, hb), d // dv),
                           interpret=interpret, name="attn_prefill_online", **params)(qt, sink.astype(F32), *ops)
        return o.reshape(B, S, H, d)
    mgeo = dict(geo, bk=tiles["max_bk"] or bk)
    mparams = {} if interpret else dict(compiler_params=plgpu.CompilerParams(
        num_warps=tiles["max_warps"] or warps, num_stages=tiles["max_stages"] or stages))
    lazy = bool(tiles["lazy"])
    m_shape = jax.ShapeDtypeStruct((T, H), F32)
    if store:  # every key slot's logit: the window's n slots of the token's block, then the K entries
        m_shape = (m_shape, jax.ShapeDtypeStruct((T, H, slots), F32))
    m = pl.pallas_call(functools.partial(_max_kernel, hb=hb, lazy=lazy, store_logits=store, **mgeo), out_shape=m_shape,
                       grid=(T, pl.cdiv(H, hb)), interpret=interpret, name="attn_prefill_max", **mparams)(qt, *ops)
    m, lg = m if store else (m, None)
    o = pl.pallas_call(functools.partial(_out_kernel, hb=hb, dv=dv, lazy=lazy, store_logits=store, **geo),
                       out_shape=jax.ShapeDtypeStruct((T, H, d), dt), grid=(T, pl.cdiv(H, hb), d // dv),
                       interpret=interpret, name="attn_prefill_out",
                       **params)(qt, m, sink.astype(F32), *ops, *([lg] if store else []))
    return o.reshape(B, S, H, d)
