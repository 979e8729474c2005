"""The routed experts' first half for a prefill, as one launch: gathered rows, w1 and w3, SwiGLU.

``moe_glu(x, row_token, row_weight, block_group, n_blocks, w1, w3, bm=..., limit=...)`` forms,
for every row ``r`` of the expert-sorted block layout (``MoE._rows``: row block ``j`` of ``bm``
rows belongs to expert ``block_group[j]``; ``row_token[r]`` is the token whose pair sits in row
``r``, -1 for a padding row)::

    xr   = x[row_token[r]]                       (zeros for padding rows)
    g    = dt(xr . W1[e]^T),  u = dt(xr . W3[e]^T)     fp32 sums, one rounding each
    h[r] = dt(row_weight[r] * swiglu(g, u, limit))

which is what ``MoE.routed_pallas`` formed with XLA's gather of the rows (``MoE._dispatch``), one
``grouped_qmatmul_fused`` launch for w1 and w3 and XLA's SwiGLU over every row of the layout:
the same rounding points. Differences: the fp32 summation order, and SwiGLU's ``exp`` (Triton's
against XLA's, which may move a rounding of ``h`` by one ulp).

What it saves (an 8k prefill of V4.1-Flash, per layer; the layout is sized for the worst case,
about twice the pairs): the gathered copy of the rows (1.1 GB written), ``g`` and ``u`` (written
and read again by the SwiGLU pass over the whole layout) and the zeros of unused blocks. Rows of
blocks ``>= n_blocks`` are not written at all: the w2 launch never reads them.

A program owns one row block and ``bo`` output columns of both weights: per K step it loads the
rows' inputs once (a pointer gather from ``x``), dequantizes one w1 and one w3 tile (int8 / e4m3
codes x their ue8m0 bytes, as ``qmatmul``'s "dot" mode, weights on the left of the product) and
multiplies both; blocks of ``tm + tail`` rows (``Config.tail``) reuse each weight tile for both
row tiles. Implementations: ``"triton"`` (GPU), ``"interpret"`` (the Pallas interpreter: JAX
0.10's cannot run a gather load, so XLA gathers the rows first there), ``"xla"``
(:func:`moe_glu_reference`, the composition above: the test oracle and the CPU path).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax import quant
from dsv41_jax.kernels.qmatmul import (KBLOCK, QBLOCK, _check, _code_tile, _grouped, _largest_pow2_divisor, _load,
                                      _pow2_at_least, _store, code_dims, default_mult, env_tiles,
                                      grouped_qmatmul_reference, is_kblocked, kernel_impl, row_tiles, scale_values)

F32 = jnp.float32
# Tiles measured on one H200 (sweep_prefill.py --part glu, run 27): ``bo`` output columns of each weight
# per program, ``bk`` inputs per K step. ``DSV41_MOE_GLU_TILES`` (JSON) overrides fields.
TILES = dict(bo=64, bk=64, num_warps=4, num_stages=3)


def glu_kernel() -> bool:
    """Whether ``MoE.routed_pallas`` runs a prefill's w1 + w3 through :func:`moe_glu`
    (``DSV41_MOE_GLU``: 1, the default, or 0: XLA's gather, the ``grouped_qmatmul_fused`` launch
    and XLA's SwiGLU, for A/B runs); read at trace time. Either way the kernels' implementation
    is ``kernel_impl()``'s."""
    from dsv41_jax.kernels import env_switch

    return env_switch("DSV41_MOE_GLU", on="the kernel")


def gather_kernel() -> bool:
    """Whether ``MoE.routed_mgpu`` forms its token rows with :func:`gather_used_rows` on the GPU
    (``DSV41_MOE_GATHER``: ``kernel``, the default, or ``xla``: XLA's gather of every row, for A/B
    runs); read at trace time."""
    import os

    mode = os.environ.get("DSV41_MOE_GATHER", "kernel")
    if mode not in ("kernel", "xla"):
        raise ValueError(f"DSV41_MOE_GATHER={mode!r}: use kernel (the default) or xla")
    return mode == "kernel"


def gather_rows(x, row_token):
    """x's rows by ``row_token`` (zeros for -1): the block layout's inputs as XLA forms them."""
    return jnp.take(x, jnp.where(row_token >= 0, row_token, x.shape[0]), axis=0, mode="fill", fill_value=0)


def gather_used_rows(x, row_token, n_blocks, *, bm: int, impl: str = "auto", cols: int = 512):
    """:func:`gather_rows` for a kernel that reads only the first ``n_blocks`` ``bm``-row blocks
    (``kernels.moe_mgpu``): a Pallas (Triton) gather that writes those blocks' rows (zeros for
    their padding rows) and leaves the rows of the later blocks unwritten. The block layout is
    sized for the worst case (``N // bm + min(E, N)`` blocks: at an 8k prefill of V4.1-Flash
    691 blocks for ~384 used), so XLA's gather wrote ~1.8x the rows any kernel reads. ``impl``:
    ``kernel_impl()``'s; off the GPU, and in the interpreter (which has no pointer gather), the XLA
    gather (every row, the same values in the used ones)."""
    import jax.experimental.pallas as pl
    from jax.experimental.pallas import triton as plgpu

    impl = kernel_impl(impl)
    R, D = row_token.shape[0], x.shape[1]
    main, tail = row_tiles(bm)
    if impl != "triton" or main + tail != bm or R % bm or D % cols:
        return gather_rows(x, row_token)
    parts = [(0, main)] + ([(main, tail)] if tail else [])

    def kernel(nb_ref, tok_ref, x_ref, o_ref):
        j, ci = pl.program_id(0), pl.program_id(1)
        c0 = pl.multiple_of(ci * cols, cols)

        @pl.when(j < nb_ref[0])
        def _used():
            for off, n in parts:
                tok = tok_ref[pl.ds(j * bm + off, n)]
                ok = tok >= 0
                rows = _load(x_ref.at[jnp.maximum(tok, 0), pl.ds(c0, cols)], ok[:, None], 0)  # a pointer gather
                o_ref[pl.ds(j * bm + off, n), pl.ds(c0, cols)] = rows

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((R, D), x.dtype), grid=(R // bm, D // cols),
                          name="gather_used_rows", compiler_params=plgpu.CompilerParams(num_warps=4))(
        jnp.asarray(n_blocks, jnp.int32).reshape(1), row_token.astype(jnp.int32), x)


def quant_used_rows(h, n_blocks, *, bm: int, impl: str = "auto", cols: int = 512):
    """``quant.act_quant_fp8(h, 32)`` (fp8 e4m3 per 32 columns with a ue8m0 scale, returned
    dequantized in ``h.dtype``) of the rows a kernel reading only the first ``n_blocks`` ``bm``-row
    blocks sees (the Mosaic GPU w2 launch of ``MoE.routed_mgpu``, reference numerics): one Pallas
    pass that reads and writes those blocks' rows in place and leaves the later rows as they are.
    XLA's quantization took two reads and a write of every row of the worst-case layout (~0.45 ms
    per V4.1-Flash layer at an 8k prefill, run 34). The e4m3 rounding is ``kernel_fp8_round()``'s,
    the values ``act_quant_fp8``'s. ``impl``: ``kernel_impl()``'s ("triton", "interpret": the
    kernel; "xla": ``act_quant_fp8`` of every row)."""
    import jax.experimental.pallas as pl
    from jax.experimental.pallas import triton as plgpu

    impl = kernel_impl(impl)
    R, I = h.shape
    main, tail = row_tiles(bm)
    cols = _largest_pow2_divisor(I, cols)
    if impl == "xla" or main + tail != bm or R % bm or cols < QBLOCK:
        return quant.act_quant_fp8(h.astype(F32), QBLOCK).astype(h.dtype)
    parts = [(0, main)] + ([(main, tail)] if tail else [])
    fp8_round = quant.kernel_fp8_round()

    def kernel(nb_ref, h_ref, o_ref):
        j, ci = pl.program_id(0), pl.program_id(1)
        c0 = pl.multiple_of(ci * cols, cols)

        @pl.when(j < nb_ref[0])
        def _used():
            for off, n in parts:
                at = (pl.ds(j * bm + off, n), pl.ds(c0, cols))
                hb = h_ref[at].astype(F32).reshape(n, cols // QBLOCK, QBLOCK)
                amax = jnp.max(jnp.abs(hb), axis=-1, keepdims=True)
                o_ref[at] = fp8_round(hb, amax).reshape(n, cols).astype(o_ref.dtype)

    kw = {} if impl == "interpret" else dict(compiler_params=plgpu.CompilerParams(num_warps=4))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((R, I), h.dtype), grid=(R // bm, I // cols),
                          input_output_aliases={1: 0}, interpret=impl == "interpret", name="quant_used_rows",
                          **kw)(jnp.asarray(n_blocks, jnp.int32).reshape(1), h)


def moe_glu_reference(x, row_token, row_weight, block_group, n_blocks, w1, w3, *, bm: int, limit: float,
                      out_dtype=None, mult: float | None = None, act_quant: bool = False):
    """XLA form of :func:`moe_glu`: gather, ``grouped_qmatmul_reference`` for each weight, SwiGLU
    (and ``quant.act_quant_fp8`` of the result)."""
    from dsv41_jax.model.moe import swiglu

    out_dtype = x.dtype if out_dtype is None else out_dtype
    xs = gather_rows(x, row_token)
    g, u = (grouped_qmatmul_reference(xs, block_group, n_blocks, c, s, bm=bm, out_dtype=out_dtype, mult=mult)
            for c, s in (w1, w3))
    h = (row_weight[:, None].astype(F32) * swiglu(g, u, limit)).astype(out_dtype)
    return quant.act_quant_fp8(h.astype(F32), QBLOCK).astype(out_dtype) if act_quant else h


def _kernel(nb_ref, sel_ref, bg_ref, tok_ref, rw_ref, x_ref, *refs, bm: int, tm: int, tail: int, bo: int, bk: int,
            I: int, K: int, scaled: bool, mult: float, limit: float, gathered: bool, act_quant: bool, cd, out_dtype,
            fp8_round=None, want: int = -1, kblocked: bool = False):
    from jax.experimental import pallas as pl

    from dsv41_jax.model.moe import swiglu

    w_refs = (refs[0:2], refs[2:4]) if scaled else ((refs[0],), (refs[1],))
    h_ref = refs[-1]  # (with ``want`` 1 the input before it is the same buffer: the first launch's h)
    oi, j = pl.program_id(0), pl.program_id(1)
    parts = [(0, tm)] + ([(tm, tail)] if tail and want != 0 else [])
    nkb = bk // QBLOCK
    prec = lax.Precision.HIGHEST if cd == F32 else None
    live = j < nb_ref[0]
    if want >= 0:  # a split launch: only the blocks whose row-tile choice is ``want``
        live = live & (sel_ref[j] == want)

    @pl.when(live)
    def _block():
        e = bg_ref[j]
        o0 = pl.multiple_of(oi * bo, bo)
        cols = o0 + jnp.arange(bo, dtype=jnp.int32)
        omask = cols[:, None] < I                                                   # [bo, 1]
        # rows of each part inside the block (a block of bm < tm rows is one padded tile)
        inb = [off + jnp.arange(n, dtype=jnp.int32) < bm for off, n in parts]
        toks = [_load(tok_ref.at[pl.ds(j * bm + off, n)], inb[p], -1) for p, (off, n) in enumerate(parts)]

        def rows(p, k0):  # [n, bk] inputs of part p's rows
            off, n = parts[p]
            if gathered:
                return _load(x_ref.at[pl.ds(j * bm + off, n), pl.ds(k0, bk)], inb[p][:, None], 0)
            ok = toks[p] >= 0
            return _load(x_ref.at[jnp.maximum(toks[p], 0), pl.ds(k0, bk)], ok[:, None], 0)  # a pointer gather

        def weight(w, k0):  # [bo, bk] in cd
            if not scaled:
                return _load(w[0].at[e, pl.ds(o0, bo), pl.ds(k0, bk)], omask, 0).astype(cd)
            b0 = pl.multiple_of(k0 // QBLOCK, nkb)
            c = _code_tile(w[0], e, o0, bo, k0, bk, omask, kblocked, 0)                     # [bo, nkb, 32]
            s = _load(w[1].at[e, pl.ds(o0, bo), pl.ds(b0, nkb)], omask, 0)                  # [bo, nkb]
            return (c.astype(F32) * scale_values(s, mult)[:, :, None]).reshape(bo, bk).astype(cd)

        def dot(w, a):  # w [bo, bk] . a [n, bk]^T -> [bo, n]
            return lax.dot_general(w, a.astype(cd), (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=F32)

        def step(kk, accs):
            k0 = pl.multiple_of(kk * bk, bk)
            w1, w3 = weight(w_refs[0], k0), weight(w_refs[1], k0)
            out = []
            for p in range(len(parts)):
                a = rows(p, k0)
                out += [accs[2 * p] + dot(w1, a), accs[2 * p + 1] + dot(w3, a)]
            return tuple(out)

        zeros = tuple(jnp.zeros((bo, n), F32) for _, n in parts for _ in range(2))
        accs = lax.fori_loop(0, K // bk, step, zeros)
        for p, (off, n) in enumerate(parts):
            g, u = (a.T.astype(out_dtype) for a in accs[2 * p:2 * p + 2])
            rw = _load(rw_ref.at[pl.ds(j * bm + off, n)], inb[p], 0)
            h = rw[:, None] * swiglu(g, u, limit)
            if act_quant:  # the fp8 activation quantization of the rounded h, per 32 columns
                hb = h.astype(out_dtype).astype(F32).reshape(n, bo // QBLOCK, QBLOCK)
                amax = jnp.max(jnp.abs(hb), axis=-1, keepdims=True)
                h = fp8_round(hb, amax).reshape(n, bo)
            _store(h_ref.at[pl.ds(j * bm + off, n), pl.ds(o0, bo)], h.astype(out_dtype),
                   inb[p][:, None] & (cols[None, :] < I))


def moe_glu(x, row_token, row_weight, block_group, n_blocks, w1, w3, *, bm: int, limit: float, out_dtype=None,
            mult: float | None = None, act_quant: bool = False, impl: str = "auto", gather: str = "kernel",
            split_tail=None, **tiles):
    """``x [T, K]`` (the compute dtype), ``row_token [R]`` int32 (-1: padding row),
    ``row_weight [R]`` fp32, ``block_group [R // bm]``, ``n_blocks`` (used blocks), ``w1`` / ``w3``
    as ``(codes [G, I, K], scale [G, I, K // 32] or None)`` (int8 codes may be K-blocked,
    ``qmatmul.kblock``) -> ``h [R, I]`` in ``out_dtype`` (default ``x.dtype``); see the module
    docstring. A block of ``bm`` rows runs as a power of two plus a power-of-two tail >= 16 where
    it is one (160 = 128 + 32), else as one tile of the next power of two (>= 16) with masked
    rows, as ``qmatmul``. ``tiles``: ``TILES`` fields.
    Rows of blocks ``>= n_blocks`` are left unwritten by the kernels (zeros on the XLA route).
    ``split_tail`` (``qmatmul.tail_selector(row_token, bm)``, blocks with a tail tile only): the
    blocks marked 0 run in a launch without the tail tile (their tail rows left unwritten), the
    others in a second launch into the same output, as ``grouped_qmatmul_fused``'s.
    ``act_quant``: ``h`` comes out fp8-quantized per 32 columns (``quant.act_quant_fp8`` of the
    rounded ``h``, what the reference numerics apply before w2), when ``I % 32 == 0`` (otherwise,
    as ``act_quant_fp8``, unquantized)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if gather not in ("kernel", "xla"):
        raise ValueError(f"moe_glu: gather {gather!r} (use kernel or xla)")
    (c1, s1), (c3, s3) = _grouped(*w1), _grouped(*w3)
    R = row_token.shape[0]
    T, K = x.shape
    probe = jax.ShapeDtypeStruct((R, K), x.dtype)
    for c, s in ((c1, s1), (c3, s3)):
        _check(probe, block_group, c, s, bm)
    if c1.shape != c3.shape or c1.dtype != c3.dtype or (s1 is None) != (s3 is None) or row_weight.shape != (R,):
        raise ValueError(f"moe_glu: w1 {c1.shape} {c1.dtype}, w3 {c3.shape} {c3.dtype}, row_weight "
                         f"{row_weight.shape}: want equal weights (both scaled or neither) and [{R}] weights")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    mult = default_mult(c1.dtype) if mult is None else float(mult)
    impl = kernel_impl(impl)
    if impl == "xla":
        return moe_glu_reference(x, row_token, row_weight, block_group, n_blocks, (c1, s1), (c3, s3), bm=bm,
                                 limit=limit, out_dtype=out_dtype, mult=mult, act_quant=act_quant)
    t = env_tiles("DSV41_MOE_GLU_TILES", TILES)
    t.update(tiles)
    tm, tail = row_tiles(bm)
    I = code_dims(c1)[1]
    kblocked = is_kblocked(c1)
    act_quant = act_quant and I % QBLOCK == 0
    bo = min(t["bo"], max(16, _pow2_at_least(I)))
    if act_quant:
        bo = max(bo, QBLOCK)
    bk = _largest_pow2_divisor(K, t["bk"])
    scaled = s1 is not None
    quantum = KBLOCK if kblocked else QBLOCK
    if scaled and bk < quantum:
        raise ValueError(f"moe_glu: K={K} has no power-of-two step >= {quantum}")
    interpret = impl == "interpret"
    gathered = interpret or gather == "xla"
    xin = gather_rows(x, row_token) if gathered else x
    ws = []
    for c, s in ((c1, s1), (c3, s3)):
        ws += [c if kblocked else c.reshape(*c.shape[:2], K // QBLOCK, QBLOCK), s] if scaled else [c]
    nb = R // bm
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=t["num_warps"],
                                                                           num_stages=t["num_stages"]))
    wbytes = 2 * c1.dtype.itemsize * I * K + (2 * I * K // QBLOCK if scaled else 0)
    cost = pl.CostEstimate(flops=4 * R * I * K, transcendentals=R * I,
                           bytes_accessed=nb * wbytes + R * K * x.dtype.itemsize + R * I * out_dtype.itemsize)
    if split_tail is not None and jnp.shape(split_tail) != (nb,):
        raise ValueError(f"moe_glu: split_tail {jnp.shape(split_tail)} for {nb} row blocks (qmatmul.tail_selector)")
    split = bool(tail) and split_tail is not None
    sel = jnp.asarray(split_tail, jnp.int32) if split else jnp.zeros((nb,), jnp.int32)
    ins = [jnp.asarray(n_blocks, jnp.int32).reshape(1), sel, block_group.astype(jnp.int32),
           row_token.astype(jnp.int32), row_weight.astype(F32), xin, *ws]

    def launch(want, prev=None):
        kern = functools.partial(_kernel, bm=bm, tm=tm, tail=tail, bo=bo, bk=bk, I=I, K=K, scaled=scaled, mult=mult,
                                 limit=float(limit), gathered=gathered, act_quant=act_quant, cd=x.dtype,
                                 fp8_round=quant.kernel_fp8_round() if act_quant else None,
                                 out_dtype=out_dtype, want=want, kblocked=kblocked)
        extra = {} if prev is None else dict(input_output_aliases={len(ins): 0})
        return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((R, I), out_dtype), grid=(pl.cdiv(I, bo), nb),
                              interpret=interpret, cost_estimate=cost, name="moe_glu", **params, **extra)(
            *ins, *([] if prev is None else [prev]))

    if not split:
        return launch(-1)
    # blocks whose pairs fit the main row tile, then the others with the tail tile too: each
    # launch one K loop (one kernel with both loops behind a branch ran 8% slower, run 28)
    return launch(1, launch(0))

