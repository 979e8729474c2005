"""The mHC mixing logits and the stream's RMS statistic in one pass over the stream.

``hc_mix_sums(x, fn)`` returns, for ``x [T, K]`` (the hyper-connection stream of each token
flattened to ``K = n * D`` values, any float dtype) and ``fn [O, K]`` fp32::

    mix[t, o] = sum_k float32(x[t, k]) * fn[o, k]          (fp32 products and sums)
    ss[t]     = sum_k float32(x[t, k]) ** 2

from which ``hc_mixes`` forms ``mix * rsqrt(ss / K + eps)``. XLA runs this as three kernels per
mHC site: a conversion writing the stream in fp32 (4 x 5120 values per token: 671 MB at an 8k
prefill), a reduction for the statistic and an fp32 GEMM with 24 outputs, each reading it again
(0.72-0.85 ms per site at 8k, six sites per three layers; docs/performance.md session 11). The
kernel reads the stored stream once (prefill chunks: at least one block of ``bt`` tokens; a
decode step's few tokens keep XLA's form, where the kernel's split-K partial sums and the padded
weights would cost more launches than they save): a program owns ``bt`` tokens and one K range,
adds the squares of each ``[bt, bk]`` tile to the statistic and multiplies the tile by the
``[O, bk]`` slice of ``fn``. A bf16 stream is multiplied on the tensor cores as three bf16
products against ``fn = hi + mid + lo`` (an exact split of each fp32 weight into three bf16
values; bf16 x bf16 products are exact in the fp32 accumulator), so the result is the fp32
product up to summation order. An fp32 dot at full precision (FMAs) ran 1.6 ms per site at 8k,
slower than XLA (run 20): fp32 streams (the parity numerics) use that form in the kernel but
``hc_mixes`` keeps them on XLA.

Output layout: one fp32 array ``[splits, T, OP]`` of partial sums per K range (``OP``: a power
of two > ``O``), column ``O`` holding the statistic; XLA adds the ranges. Split-K keeps enough
programs in flight when there are few token blocks.

Implementations (``impl``): ``"triton"`` (GPU), ``"interpret"`` (the Pallas interpreter; CPU
tests), ``"xla"`` (:func:`hc_mix_sums_reference`), ``"auto"`` (``kernel_impl``). Only the fp32
summation order differs between them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kernels.qmatmul import _load_or, _pow2_at_least, _store, env_tiles, kernel_impl, offsets_fit

F32 = jnp.float32
# programs to aim for (two per SM of a 132-SM H200): fewer tokens get more K ranges
TARGET_PROGRAMS = 2 * 132
# the token block for chunks below 128 tokens, and the fewest tokens the kernel takes
MIN_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class MixConfig:
    """``bt`` tokens x ``bk`` inputs per step (powers of two >= 16; ``bt`` 0: 128, or
    ``MIN_BLOCK`` for chunks of fewer than 128 tokens); ``splits`` K ranges (0: chosen from the
    token count, see :func:`choose_splits`). Defaults: the fastest of nine tilings at 8k tokens
    on the H200 (``sweep_prefill.py --part mhc``, run 20: 0.199 ms per site against 0.225 ms for
    64 x 128 tiles and 0.72 ms for XLA)."""
    bt: int = 0
    bk: int = 64
    splits: int = 0
    num_warps: int = 8
    num_stages: int = 3


def _check_pow2(who: str, cfg, names) -> None:
    """One clear error for a tile field of ``cfg`` that is not a power of two >= 16."""
    for name in names:
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{who}: {name}={v} must be a power of two >= 16")


def hc_mix_sums_reference(x, fn):
    """``(mix [T, O], ss [T])`` fp32 in XLA: the formulation ``hc_mixes`` used before the kernel."""
    xf = x.astype(F32)
    mix = jnp.einsum("tk,ok->to", xf, fn.astype(F32), precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    return mix, jnp.sum(xf * xf, axis=-1)


def out_width(O: int) -> int:
    """Columns of the kernel's output: a power of two >= 16 with room for the statistic."""
    p = 16
    while p <= O:
        p *= 2
    return p


def choose_splits(T: int, K: int, bt: int, bk: int, target: int = TARGET_PROGRAMS) -> int:
    """The largest number of equal K ranges (whole ``bk`` steps) with at most ``target``
    programs in all; at least 1."""
    steps = K // bk
    blocks = -(-T // bt)
    best = 1
    for d in range(1, steps + 1):
        if steps % d == 0 and blocks * d <= target:
            best = d
    return best


def _split3(w):
    """fp32 ``w`` as three bf16 arrays whose sum is ``w`` exactly (each rounding to nearest
    leaves a remainder of at most 16, then 8 significant bits; fp32 and bf16 share the exponent
    range, so nothing underflows but remainders below bf16's smallest normal, ~1e-38; weights
    above bf16's largest finite value, 3.39e38, would round to infinity)."""
    hi = w.astype(jnp.bfloat16)
    r = w - hi.astype(F32)
    mid = r.astype(jnp.bfloat16)
    lo = (r - mid.astype(F32)).astype(jnp.bfloat16)
    return hi, mid, lo


def _kernel(x_ref, f_ref, o_ref, *, cfg: MixConfig, T: int, O: int, OP: int, kr: int):
    from jax.experimental import pallas as pl

    bt, bk = cfg.bt, cfg.bk
    i, ks = pl.program_id(0), pl.program_id(1)
    t0, kbase = i * bt, ks * kr
    rmask = (t0 + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)) < T
    fmask = lax.broadcasted_iota(jnp.int32, (OP, 1), 0) < O
    dims = (((1,), (1,)), ((), ()))
    split = x_ref.dtype == jnp.bfloat16

    def step(kk, carry):
        acc, ss = carry
        k0 = pl.multiple_of(kbase + kk * bk, bk)
        xt = _load_or(x_ref.at[pl.ds(t0, bt), pl.ds(k0, bk)], rmask)                   # [bt, bk]
        w = _load_or(f_ref.at[pl.ds(0, OP), pl.ds(k0, bk)], fmask)                     # [OP, bk] fp32
        if split:  # bf16 stream: three bf16 MMAs against the exact split w = hi + mid + lo
            d = None
            for part in reversed(_split3(w)):  # smallest first
                p = lax.dot_general(xt, part, dims, preferred_element_type=F32)
                d = p if d is None else d + p
            # the step's sum joins the running sum in an fp32 add of its own: added to the dot
            # directly, Triton makes the running sum the MMA's accumulator, whose additions on
            # Hopper do not round to nearest (run 20: 2.8e-5 relative error over 20480 inputs)
            acc = acc + d
        else:
            acc = acc + lax.dot_general(xt.astype(F32), w, dims, precision=lax.Precision.HIGHEST,
                                        preferred_element_type=F32)
        xf = xt.astype(F32)
        return acc, ss + jnp.sum(xf * xf, axis=1, keepdims=True)

    acc, ss = lax.fori_loop(0, kr // bk, step, (jnp.zeros((bt, OP), F32), jnp.zeros((bt, 1), F32)))
    col = lax.broadcasted_iota(jnp.int32, (1, OP), 1)
    _store(o_ref.at[pl.ds(ks, 1), pl.ds(t0, bt), :], jnp.where(col == O, ss, acc)[None], rmask[None])


def _fma_sums(ks, x_ref, f_ref, o_ref, *, T: int, O: int, OP: int, bk: int):
    """Decode partial sums without the tensor cores: program ``ks`` owns one ``bk``-input range,
    loads its ``[OP, bk]`` fp32 weight slice once and, token by token, adds fp32 products (and the
    squares for the statistic): one step, no padded token rows."""
    from jax.experimental import pallas as pl

    k0 = pl.multiple_of(ks * bk, bk)
    w = _load_or(f_ref.at[pl.ds(0, OP), pl.ds(k0, bk)], lax.broadcasted_iota(jnp.int32, (OP, 1), 0) < O)
    col = lax.broadcasted_iota(jnp.int32, (OP,), 0)

    def row(t, carry):
        x = x_ref[t, pl.ds(k0, bk)].astype(F32)                                        # [bk]
        o_ref[ks, t, :] = jnp.where(col == O, jnp.sum(x * x), jnp.sum(w * x[None, :], axis=1))
        return carry

    lax.fori_loop(0, T, row, 0)


def _fma_kernel(x_ref, f_ref, o_ref, **kw):
    from jax.experimental import pallas as pl

    _fma_sums(pl.program_id(0), x_ref, f_ref, o_ref, **kw)


def _fma_norm_kernel(*refs, splits: int, n_norm_in: int, n_norm_out: int, sums_kw: dict, norm_kw: dict):
    """The FMA sums' ``splits`` programs, then one program per token for the collapse + norm (+
    act-quant) of ``kernels.norm_quant`` (independent work reading the same stream: it runs on
    other SMs beside the sums instead of in a launch of its own). ``refs``: the sums' x and fn,
    the norm's operands, the sums' output, the norm's outputs."""
    from jax.experimental import pallas as pl

    from dsv41_jax.kernels.norm_quant import row

    x_ref, f_ref = refs[:2]
    norm_in = refs[2:2 + n_norm_in]
    o_ref = refs[2 + n_norm_in]
    norm_out = refs[3 + n_norm_in:3 + n_norm_in + n_norm_out]
    pid = pl.program_id(0)

    @pl.when(pid < splits)
    def _sums():
        _fma_sums(pid, x_ref, f_ref, o_ref, **sums_kw)

    @pl.when(pid >= splits)
    def _norm():
        row(pid - splits, tuple(norm_in) + tuple(norm_out), **norm_kw)


def _partials(x, fn, cfg: MixConfig, interpret: bool, pad: bool = True, mode: str = "dot", norm=None):
    """The kernel's ``[splits, T, OP]`` partial sums (column ``O``: the statistic). ``mode``
    ``"fma"``: ``_fma_kernel`` (one ``cfg.bk`` range per program; decode); with ``norm``
    (``kernels.norm_quant.launch_parts`` of the tokens) the norm rows ride in that launch and the
    result is ``(partials, (xn, xq))``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    T, K = x.shape
    O = fn.shape[0]
    OP = out_width(O)
    if mode == "fma":
        splits = K // cfg.bk
        kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1))
        out = jax.ShapeDtypeStruct((splits, T, OP), F32)
        sums_kw = dict(T=T, O=O, OP=OP, bk=cfg.bk)
        if norm is None:
            return pl.pallas_call(functools.partial(_fma_kernel, **sums_kw), out_shape=out, grid=(splits,),
                                  interpret=interpret, name="hc_mix_sums_fma", **kw)(x, fn)
        ops, outs, norm_kw, finish = norm
        ys = pl.pallas_call(functools.partial(_fma_norm_kernel, splits=splits, n_norm_in=len(ops),
                                              n_norm_out=len(outs), sums_kw=sums_kw, norm_kw=norm_kw),
                            out_shape=(out, *outs), grid=(splits + T,), interpret=interpret,
                            name="hc_mix_sums_norm", **kw)(x, fn, *ops)
        return ys[0], finish(ys[1:])
    splits = cfg.splits or choose_splits(T, K, cfg.bt, cfg.bk)
    kr = K // splits
    grid = (pl.cdiv(T, cfg.bt), splits)
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                                                       num_stages=cfg.num_stages))
    cost = pl.CostEstimate(flops=2 * T * K * (O + 1), transcendentals=0,
                           bytes_accessed=x.nbytes + fn.nbytes * grid[0] + splits * T * OP * 4)
    if pad:
        # zero rows up to OP (2.6 MB for V4.1-Flash, next to the stream's 335 MB at 8k tokens); the
        # kernel's masked loads do not need them (``pad=False``: the decode pair, where the copy
        # would be a kernel launch of its own)
        fn = jnp.pad(fn, ((0, OP - O), (0, 0)))
    return pl.pallas_call(functools.partial(_kernel, cfg=cfg, T=T, O=O, OP=OP, kr=kr),
                          out_shape=jax.ShapeDtypeStruct((splits, T, OP), F32), grid=grid,
                          interpret=interpret, cost_estimate=cost, name="hc_mix_sums", **kw)(x, fn)


def _pallas(x, fn, cfg: MixConfig, interpret: bool):
    O = fn.shape[0]
    tot = jnp.sum(_partials(x, fn, cfg, interpret), axis=0)
    return tot[:, :O], tot[:, O]


# ------------------------------------------------------------------------------ decode pair
# tokens up to which ``hc_mixes`` runs ``hc_mixes_decode`` (decode steps); larger chunks take
# ``hc_mix_sums`` and XLA's epilogue
DECODE_MAX = 64


def _finish_kernel(p_ref, s_ref, b_ref, pre_ref, post_ref, comb_ref, *, S: int, SP: int, n: int, K: int,
                   iters: int, norm_eps: float, hc_eps: float):
    """One token: add the split partial sums (``p_ref``: [splits, T, OP / n, n], row 0 the pre
    logits, row 1 the post logits, rows 2 .. n + 1 the n x n comb logits, row n + 2 column 0 the
    statistic), then ``hc_mixes``' epilogue: sigmoids and the Sinkhorn normalisation."""
    from jax.experimental import pallas as pl

    t = pl.program_id(0)
    smask = lax.broadcasted_iota(jnp.int32, (SP, 1, 1), 0) < S

    def rows(r0, nr, nc):  # [nr, nc] sums over the splits of rows r0 .. r0 + nr - 1
        return jnp.sum(_load_or(p_ref.at[pl.ds(0, SP), t, pl.ds(r0, nr), pl.ds(0, nc)], smask), axis=0)

    rs = lax.rsqrt(rows(n + 2, 1, 1) / K + norm_eps)                       # [1, 1]

    def logits(r0, nr, which):  # mix * rs * scale[which] + base, as hc_mixes
        return rows(r0, nr, n) * rs * s_ref[which] + b_ref[pl.ds(r0, nr), :]

    pre_ref[pl.ds(t, 1), :] = jax.nn.sigmoid(logits(0, 1, 0)) + hc_eps     # [1, n]
    post_ref[pl.ds(t, 1), :] = 2.0 * jax.nn.sigmoid(logits(1, 1, 1))
    c = logits(2, n, 2)                                                     # [n, n]: sinkhorn_reference
    c = jnp.exp(c - jnp.max(c, axis=1, keepdims=True))
    c = c / jnp.sum(c, axis=1, keepdims=True) + hc_eps
    c = c / (jnp.sum(c, axis=0, keepdims=True) + hc_eps)

    def pair(_, c):
        c = c / (jnp.sum(c, axis=1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=0, keepdims=True) + hc_eps)

    comb_ref[pl.ds(t, 1), :, :] = lax.fori_loop(0, iters - 1, pair, c)[None]


# the decode pair's sums kernel, from benchmarks/sweep_decode_glue.py on the H200 (docs/performance.md
# run 23: with the epilogue, 5.5 us per site at 1 token against 8.6 us for the tensor-core kernel and
# 10.8 us for XLA's eight kernels; at 8 tokens the tensor-core kernel wins, 8.8 against 9.9 us)
DECODE_FMA_MAX = 4      # tokens up to which the sums take the FMA kernel (crossover between 1 and 8)
DECODE_FMA_BK = 256     # inputs per FMA program (V4.1: 80 programs; 128 and 512 were slower)


def hc_mixes_decode(x, fn, scale, base, *, n: int, iters: int, norm_eps: float, hc_eps: float, impl: str,
                    bk: int | None = None, mode: str | None = None, num_warps: int | None = None, norm=None):
    """``mhc.hc_mixes`` of a decode step's few tokens in two launches: ``x [T, n * D]`` (bf16
    stream), ``fn [O, n * D]``, ``scale [3]``, ``base [O]`` (``O = 2n + n^2``) -> ``(pre [T, n],
    post [T, n], comb [T, n, n])`` fp32. The first launch writes split-K partial sums (no XLA sum
    of the splits, no padded weights); the second adds the splits and runs the epilogue per token
    (``_finish_kernel``). XLA's form is five small kernels and the Sinkhorn kernel per site. Same
    math; only fp32 summation orders differ. ``impl``: ``triton`` or ``interpret``; ``n`` a power
    of two, ``n * D`` a multiple of ``bk``. ``mode``: the sums' kernel, ``"fma"`` (``_fma_sums``,
    ``bk`` inputs per program, default ``DECODE_FMA_BK``; the default mode up to
    ``DECODE_FMA_MAX`` tokens) or ``"dot"`` (``hc_mix_sums``' tensor-core kernel over one token
    block, ``bk`` per step, default 64). (An epilogue holding each entry as a scalar,
    ``sinkhorn.normalize_lists``, was 1.5-3 us slower per site: run 23.)

    ``norm``: ``(weight, eps, pre_in, quantize)`` of the site's collapse + norm
    (``kernels.norm_quant`` with ``mix=pre_in`` on the stream ``x`` viewed as [T, n, D]); the result
    is then ``(pre, post, comb, xn, xq)``. In the FMA mode the norm rows run inside the sums
    launch (one launch fewer per site), otherwise in a ``norm_quant`` launch of their own."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    T, K = x.shape
    O = fn.shape[0]
    OP = out_width(O)
    mode = mode or ("fma" if T <= DECODE_FMA_MAX else "dot")
    if not bk:  # the FMA ranges: DECODE_FMA_BK inputs, or the largest power of two below it that divides K
        bk = DECODE_FMA_BK if mode == "fma" else 64
        while mode == "fma" and K % bk and bk > 16:
            bk //= 2
    if O != 2 * n + n * n or n & (n - 1) or K % bk or not 0 < T <= DECODE_MAX or mode not in ("fma", "dot"):
        raise ValueError(f"hc_mixes_decode: {T} tokens of {K} inputs, {O} outputs, n={n}, mode {mode!r} (want "
                         f"O = 2n + n^2, n a power of two, K a multiple of {bk}, 1..{DECODE_MAX} tokens, mode fma "
                         "or dot)")
    interpret = impl == "interpret"
    bt = max(16, _pow2_at_least(T))
    if num_warps is None:  # run 23: the FMA sums 5.5 us with 4 or 8 warps; the norm rows want 8
        num_warps = 8 if (mode == "fma" and norm is not None) else 4
    cfg = MixConfig(bt=bt, bk=bk, num_warps=num_warps, num_stages=2)
    normed = None
    if norm is not None:
        from dsv41_jax.kernels.norm_quant import launch_parts, norm_quant

        weight, eps, pre_in, quantize = norm
        xs = x.reshape(T, n, K // n)
        if mode == "fma":
            parts, normed = _partials(x, fn.astype(F32), cfg, interpret, pad=False, mode=mode,
                                      norm=launch_parts(xs, weight, eps, pre_in, quantize))
        else:
            normed = norm_quant(xs, weight, eps, pre_in, quantize=quantize, impl=impl)
    if normed is None or mode != "fma":
        parts = _partials(x, fn.astype(F32), cfg, interpret, pad=False, mode=mode)
    S = parts.shape[0]
    SP = _pow2_at_least(S)
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)  # noqa: E731
    hc = dict(S=S, SP=SP, n=n, K=K, iters=iters, norm_eps=float(norm_eps), hc_eps=float(hc_eps))
    base_rows = base.astype(F32).reshape(O // n, n)  # free views: no XLA kernel besides the two launches
    mixes = pl.pallas_call(functools.partial(_finish_kernel, **hc), out_shape=(f32(T, n), f32(T, n), f32(T, n, n)),
                           grid=(T,), interpret=interpret, name="hc_mix_finish",
                           **kw)(parts.reshape(S, T, OP // n, n), scale.astype(F32), base_rows)
    return mixes if normed is None else (*mixes, *normed)


def hc_mix_sums(x, fn, *, impl: str = "auto", **tiles):
    """``(mix [T, O], ss [T])`` fp32 for ``x [T, K]`` and ``fn [O, K]`` (module docstring).
    ``tiles``: ``MixConfig`` fields; ``K`` must be a multiple of ``bk`` on the kernel paths."""
    if x.ndim != 2 or fn.ndim != 2 or fn.shape[1] != x.shape[1]:
        raise ValueError(f"hc_mix_sums: stream {x.shape} and weights {fn.shape} (expected [T, K] and [O, K])")
    fn = fn.astype(F32)
    impl = kernel_impl(impl)
    T, K = x.shape
    cfg = MixConfig(**tiles)
    if not cfg.bt:
        cfg = dataclasses.replace(cfg, bt=128 if T >= 128 else MIN_BLOCK)
    _check_pow2("hc_mix_sums", cfg, ("bt", "bk"))
    if impl == "triton" and (K % cfg.bk or not offsets_fit(x.shape, x.dtype)):
        impl = "xla"  # a K with no whole steps, or an operand the Triton lowering would misaddress
    if impl == "xla" or T == 0:
        return hc_mix_sums_reference(x, fn)
    if T < cfg.bt:
        raise ValueError(f"hc_mix_sums: {T} tokens, fewer than one token block of {cfg.bt} (use the XLA form)")
    if K % cfg.bk or (cfg.splits and (K // cfg.bk) % cfg.splits):
        raise ValueError(f"hc_mix_sums: K={K} is not {cfg.splits or 'some number of'} ranges of whole {cfg.bk}-input steps")
    return _pallas(x, fn, cfg, interpret=impl == "interpret")


# ------------------------------------------------------------------------------ fused site (prefill)
@dataclasses.dataclass(frozen=True)
class SiteConfig:
    """``hc_site_sums``' tiles: ``bt`` tokens x ``bd`` model columns per step (each step reads
    all ``n`` streams' ``bd`` columns), ``splits`` column ranges (0: ``choose_splits`` over
    ``D``). Powers of two >= 16. Defaults: the best of seven tilings at 8k tokens on an H100
    (run 42: 1.00 ms with the expansion, 0.325 without; XLA's form 0.608 / 0.308, so the kernel
    is an opt-in, ``mhc.site_kernel_impl``)."""
    bt: int = 128
    bd: int = 32
    splits: int = 0
    num_warps: int = 8
    num_stages: int = 2
    # with the expansion: each stream's new tile formed, stored and summed before the next (fewer
    # fp32 tiles live per step; session 32, untimed) instead of all four expansions first
    seq: bool = False


# DSV41_MHC_SITE_TILES (JSON, e.g. '{"bt": 128}') overrides fields for tuning
SITE_TILES = SiteConfig()


def _site_kernel(*refs, cfg: SiteConfig, T: int, D: int, n: int, O: int, OP: int, dr: int, post: bool):
    """One program: ``bt`` tokens x one ``dr``-wide range of the model columns, all ``n`` streams.
    ``refs``: h, fn [OP, n * D], pre [T, n] (, y, post [T, n], comb [T, n * n]), then the
    outputs: the partial sums [splits, T, OP] (column ``O``: the statistic), the collapse x [T, D]
    (, the new stream [T, n * D])."""
    from jax.experimental import pallas as pl

    if post:
        h_ref, f_ref, pre_ref, y_ref, po_ref, co_ref, o_ref, x_ref, s_ref = refs
    else:
        h_ref, f_ref, pre_ref, o_ref, x_ref = refs
    bt, bd = cfg.bt, cfg.bd
    i, ds = pl.program_id(0), pl.program_id(1)
    t0, dbase = i * bt, ds * dr
    rows = pl.ds(t0, bt)
    rmask = (t0 + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)) < T
    dims = (((1,), (1,)), ((), ()))

    def col(ref, c):  # [bt, 1] fp32: column c of a per-token table [T, cols]
        return _load_or(ref.at[rows, pl.ds(c, 1)], rmask)

    pre = [col(pre_ref, k) for k in range(n)]
    if post:
        po = [col(po_ref, k) for k in range(n)]
        co = [[col(co_ref, j * n + k) for k in range(n)] for j in range(n)]   # co[j][k] = comb[t, j, k]

    def step(dd, carry):
        acc, ss = carry
        d0 = pl.multiple_of(dbase + dd * bd, bd)
        hs = [_load_or(h_ref.at[rows, pl.ds(k * D + d0, bd)], rmask) for k in range(n)]   # [bt, bd] each
        y = _load_or(y_ref.at[rows, pl.ds(d0, bd)], rmask) if post else None

        def expand(k, hf):  # hc_post: post_k y + sum_j comb[j, k] h_j in fp32, rounded to the stream dtype
            r = co[0][k] * hf[0]
            for j in range(1, n):
                r = r + co[j][k] * hf[j]
            out = (po[k] * y.astype(F32) + r).astype(h_ref.dtype)
            _store(s_ref.at[rows, pl.ds(k * D + d0, bd)], out, rmask)
            return out

        if post and not cfg.seq:  # every stream's expansion first (four fp32 tiles live)
            hf = [v.astype(F32) for v in hs]
            hs = [expand(k, hf) for k in range(n)]
        xacc = None
        for k in range(n):
            if post and cfg.seq:  # one stream at a time, the old stream converted where used
                hs_k = expand(k, [hs[j].astype(F32) for j in range(n)])
            else:
                hs_k = hs[k]
            w = _load_or(f_ref.at[pl.ds(0, OP), pl.ds(k * D + d0, bd)], jnp.ones((OP, 1), jnp.bool_))
            dsum = None
            for part in reversed(_split3(w)):  # as _kernel: exact bf16 split, smallest first
                p = lax.dot_general(hs_k, part, dims, preferred_element_type=F32)
                dsum = p if dsum is None else dsum + p
            acc = acc + dsum
            hf = hs_k.astype(F32)
            ss = ss + jnp.sum(hf * hf, axis=1, keepdims=True)
            xacc = pre[k] * hf if xacc is None else xacc + pre[k] * hf
        _store(x_ref.at[rows, pl.ds(d0, bd)], xacc.astype(x_ref.dtype), rmask)
        return acc, ss

    acc, ss = lax.fori_loop(0, dr // bd, step, (jnp.zeros((bt, OP), F32), jnp.zeros((bt, 1), F32)))
    c = lax.broadcasted_iota(jnp.int32, (1, OP), 1)
    _store(o_ref.at[pl.ds(ds, 1), rows, :], jnp.where(c == O, ss, acc)[None], rmask[None])


def site_config(**tiles) -> SiteConfig:
    """``SITE_TILES`` with ``DSV41_MHC_SITE_TILES`` (read at trace time) and then ``tiles`` over it."""
    env = env_tiles("DSV41_MHC_SITE_TILES", dataclasses.asdict(SITE_TILES))
    return SiteConfig(**{**env, **tiles})


def site_applies(h, D: int, cfg: SiteConfig | None = None) -> bool:
    """Whether ``hc_site_sums`` takes the stream ``h [T, n, D]``: bf16, at least one token block
    (``MIN_BLOCK``), ``D`` whole ``bd`` steps, offsets the Triton lowering addresses."""
    cfg = cfg or site_config()
    T = h.shape[0]
    return (h.dtype == jnp.bfloat16 and T >= max(MIN_BLOCK, cfg.bt) and D % cfg.bd == 0
            and offsets_fit(h.shape, h.dtype))


def hc_site_sums(h, fn, pre_in, *, y=None, post=None, comb=None, impl: str, **tiles):
    """One pass over an mHC site's stream for a prefill chunk: ``h [T, n, D]`` (bf16), ``fn [O,
    n * D]``, ``pre_in [T, n]`` (the previous site's pre-mix) -> ``(mix [T, O], ss [T], x [T, D])``
    with ``mix, ss = hc_mix_sums(s.reshape(T, n * D), fn)`` and ``x = mhc.hc_pre(s, pre_in)``, where
    ``s`` is ``h``, or, given the previous site's output ``y [T, D]`` and its ``post [T, n]``,
    ``comb [T, n, n]``, the stream after that site, ``mhc.hc_post(y, h, post, comb)``, which is
    then returned too: ``(s, mix, ss, x)``.

    XLA's form reads the stream three times per site (the expansion, the sums, the collapse:
    ~0.2 ms each at 8k tokens of V4.1); this reads the old stream once and writes the new one.
    The same values up to fp32 summation order (the mixing sums as ``hc_mix_sums``; the
    expansion's and the collapse's few-term sums in ascending stream order)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    T, n, D = h.shape
    O = fn.shape[0]
    expand = y is not None
    if fn.shape[1] != n * D or pre_in.shape != (T, n) or (expand and (
            y.shape != (T, D) or post.shape != (T, n) or comb.shape != (T, n, n))):
        raise ValueError(f"hc_site_sums: stream {h.shape}, weights {fn.shape}, pre {pre_in.shape}"
                         + (f", y {y.shape}, post {post.shape}, comb {comb.shape}" if expand else "")
                         + " (expected [T, n, D], [O, n * D], [T, n], [T, D], [T, n], [T, n, n])")
    cfg = site_config(**tiles)
    _check_pow2("hc_site_sums", cfg, ("bt", "bd"))
    if not site_applies(h, D, cfg):
        raise ValueError(f"hc_site_sums: a {h.dtype} stream {h.shape} (want bf16, at least {max(MIN_BLOCK, cfg.bt)} "
                         f"tokens, D a multiple of {cfg.bd})")
    OP = out_width(O)
    splits = cfg.splits or choose_splits(T, D, cfg.bt, cfg.bd)
    if (D // cfg.bd) % splits:
        raise ValueError(f"hc_site_sums: D={D} is not {splits} ranges of whole {cfg.bd}-column steps")
    interpret = impl == "interpret"
    fnp = jnp.pad(fn.astype(F32), ((0, OP - O), (0, 0)))
    table = lambda a: a.astype(F32).reshape(T, -1)  # noqa: E731  [T, cols]
    ops = [h.reshape(T, n * D), fnp, table(pre_in)]
    outs = [jax.ShapeDtypeStruct((splits, T, OP), F32), jax.ShapeDtypeStruct((T, D), h.dtype)]
    if expand:
        ops += [y.astype(h.dtype), table(post), table(comb)]
        outs.append(jax.ShapeDtypeStruct((T, n * D), h.dtype))
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                                                       num_stages=cfg.num_stages))
    grid = (pl.cdiv(T, cfg.bt), splits)
    nbytes = h.nbytes * (2 if expand else 1) + T * D * 2 * (2 if expand else 1) + splits * T * OP * 4
    cost = pl.CostEstimate(flops=2 * T * n * D * (3 * OP + 4 + (2 * n if expand else 0)), transcendentals=0,
                           bytes_accessed=nbytes)
    res = pl.pallas_call(functools.partial(_site_kernel, cfg=cfg, T=T, D=D, n=n, O=O, OP=OP, dr=D // splits,
                                           post=expand),
                         out_shape=tuple(outs), grid=grid, interpret=interpret, cost_estimate=cost,
                         name="hc_site_sums" + ("_post" if expand else ""), **kw)(*ops)
    tot = jnp.sum(res[0], axis=0)
    mix, ss, x = tot[:, :O], tot[:, O], res[1]
    return (res[2].reshape(T, n, D), mix, ss, x) if expand else (mix, ss, x)
