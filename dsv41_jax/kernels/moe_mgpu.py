"""Routed-expert GEMMs of a prefill as a Mosaic GPU kernel (Hopper: TMA, warp specialization, wgmma).

``grouped_matmul_t(xt, block_group, n_blocks, codes, scale, bm=...)`` is ``qmatmul.grouped_qmatmul``
in the transposed orientation::

    yt[:, j*bm:(j+1)*bm] = dt(W[block_group[j]] . xt[:, j*bm:(j+1)*bm])     for j < n_blocks

with ``W[e] = codes[e] * mult * 2^(scale[e] - 127)`` per 32 inputs (int8 experts, ``default_mult``),
``xt`` [K, R] the block layout's rows as columns, fp32 accumulation, one rounding to ``out_dtype``.
Columns of blocks ``>= n_blocks`` are not written. The same products and rounding points as
``grouped_qmatmul`` (only the fp32 summation order differs).

Why transposed: the weights are the left operand (``wgmma``'s A may come from registers, so the
int8 codes are dequantized there, 32 inputs at a time with their scale, on the way to the tensor
cores), and the tokens the right one, read from shared memory as [K, tokens] tiles; the result
comes out [out, tokens]. The model's layout is rows, so ``x_rows`` streams [tokens, K] tiles and
gives wgmma a transposed view of them, and ``out_rows`` stores each result tile through a
transposed view: rows in, rows out, no transpose in XLA (run 31: those transposes cost more than
the kernel saved).

A persistent kernel: one CTA per SM walks (row block, 2 x ``tile_m`` output rows) tiles; per tile a
memory warpgroup streams the weight tile, its scale bytes ([K // 32, out], converted in registers) and the token tile
through ``max_concurrent_steps`` shared-memory stages while two compute warpgroups each own
``tile_m`` output rows x ``bm`` tokens of fp32 accumulator. The block's expert is read from
``block_group`` in global memory, so the kernel needs no scalar prefetch.

Implementations: ``"mosaic"`` (a Hopper GPU), ``"interpret"`` (JAX's Mosaic GPU interpreter on
any backend; it cannot take ``wgmma``'s left operand from registers, so there the dequantized
chunk goes through a shared-memory buffer: everything else, indexing and pipeline included, is the
kernel's; ``x_rows`` runs there on transposed tokens, see ``_interpreter_layout``), ``"xla"``
(:func:`grouped_matmul_t_reference`).

:func:`grouped_glu_t` runs w1 and w3 in one launch (two accumulators per compute warpgroup) with
the route-weighted SwiGLU in the epilogue. Selected by ``DSV41_MOE_PREFILL`` (``auto``, ``mgpu``,
``mgpu-glu``, ``mgpu-w2``: ``MoE.routed_mgpu``); ``auto``, the default, takes ``mgpu-glu`` on
Hopper GPUs: 9-13% faster than the Triton path in the 8k prefill (runs 32-34), the same values
(run 34; ``prefill_mode``, docs/kernels.md).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kernels.qmatmul import (KBLOCK, QBLOCK, _check, _grouped, code_dims, default_mult,
                                      grouped_qmatmul_reference, is_kblocked)

F32 = jnp.float32
BF16 = jnp.bfloat16
_IMPLS = ("auto", "mosaic", "interpret", "xla")
_MODES = ("auto", "triton", "mgpu", "mgpu-glu", "mgpu-w2")
DEFAULT_MODE = "auto"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``tile_m`` output rows per compute warpgroup (64 or 128; a CTA owns two of them),
    ``tile_k`` inputs per pipeline step (a multiple of 64 dividing K), ``steps`` shared-memory
    stages. ``DSV41_MGPU_TILES`` (JSON) overrides fields."""
    tile_m: int = 64
    tile_k: int = 64
    steps: int = 4
    # ``chain``: the tiles an SM walks run as one sequence of pipelines (Pallas's
    # ``PipelinePipeline``): the memory warpgroup streams the next tile's first stages while the
    # compute warpgroups finish a tile's epilogue (needs ``steps`` dividing the K steps)
    chain: bool = False
    # ``cluster``: 2 runs CTA pairs (a thread-block cluster) on the two halves of a 4 x ``tile_m``
    # row tile of one block, the token tile multicast to both (half the L2 reads of the tokens)
    cluster: int = 1
    # ``stage``: each dequantized chunk is stored to a double-buffered shared-memory operand and a
    # step's MMAs run on while the next step dequantizes (the stages released one step late,
    # ``BlockSpec(delay_release=1)``); without it a step dequantizes into registers, issues its
    # MMAs and waits for them (a register operand must not change under an asynchronous wgmma)
    stage: bool = False
    # ``lhs``: how a warpgroup's int8 codes reach wgmma's register layout. "" (Mosaic's default:
    # the codes loaded in the WGMMA layout, two bytes per shared-memory load); "8bit" (loaded four
    # bytes at a time in the 2x-upcast layout, moved to the WGMMA layout as bytes: one shuffle
    # and one permute per four codes, then converted); "16bit" (loaded and converted in the
    # 2x-upcast layout, the bf16 values moved to the WGMMA layout)
    lhs: str = ""
    # ``tail``: the last ``tail`` token columns of a row block get their own accumulators, and
    # their MMAs are issued only where the block has rows there (``block_rows``): an 8k prefill's
    # 160-row blocks hold ~128 pairs each, so most blocks skip a fifth of the MMA work. Skipped
    # columns are stored as zeros (the padding rows' values anyway: zero tokens, route weight 0)
    tail: int = 0
    # diagnostics for ``sweep_prefill.py`` only, comma-separated; every one of them gives wrong
    # values: ``const_lhs`` (a constant left operand: no shared-memory read or dequantization of
    # the weights), ``one_expert`` (every block multiplies expert 0, whose weights stay in L2),
    # ``no_store`` (the epilogue's copies to global memory are not issued)
    probe: str = ""


def prefill_mode() -> str:
    """``DSV41_MOE_PREFILL`` (read at trace time): ``auto`` (the default: ``mgpu-glu`` where the
    kernel runs on a Hopper GPU, ``kernel_impl() == "mosaic"`` on compute capability 9.x (its
    ``wgmma`` is Hopper's), else ``triton``), ``triton``
    (``kernels.moe_glu`` and the Triton w2 launch), ``mgpu-glu`` (:func:`grouped_glu_t` for w1 +
    w3 + SwiGLU, then :func:`grouped_matmul_t` for w2), ``mgpu`` (:func:`grouped_matmul_t` for w1,
    w3 and w2, XLA's SwiGLU between) or ``mgpu-w2`` (``moe_glu``, then this module's w2).

    ``mgpu-glu`` is 9-13% faster than ``triton`` in the 8k prefill (runs 32-34), and its values
    with the row layouts equal the Triton path's on a GPU (run 34: the same error against XLA's
    ``routed_grouped`` in both numerics, fused GLU rows 100% bit-equal to ``moe_glu``'s)."""
    mode = os.environ.get("DSV41_MOE_PREFILL", DEFAULT_MODE)
    if mode not in _MODES:
        raise ValueError(f"DSV41_MOE_PREFILL={mode!r}: use one of {_MODES} ({DEFAULT_MODE}: the default)")
    if mode == "auto":
        mode = "mgpu-glu" if kernel_impl() == "mosaic" and _has_wgmma() else "triton"
    return mode


def _has_wgmma() -> bool:
    """Whether the device is a Hopper GPU (compute capability 9.x: ``wgmma``); True off the GPU,
    where ``kernel_impl()`` is ``mosaic`` only when ``DSV41_MGPU_IMPL`` asks for it (CUDA lowering)."""
    from dsv41_jax.kernels import compute_capability

    return jax.default_backend() != "gpu" or 9.0 <= compute_capability() < 10.0


# w2 (5120 x 2304 at V4.1-Flash widths) is fastest with 128-row warpgroup tiles and three stages
# (run 32, H200: 2.89 ms against 3.26 ms with the defaults); w1, w3 and the fused GLU with the defaults
W2_TILES = Tiles(tile_m=128, steps=3)
BEST_TILES = {"w2": W2_TILES}
# with K-blocked codes three stages are best for the fused GLU too (run 36, H100: 5.63 ms against
# 5.74 ms with four); w2 keeps W2_TILES (2.83 ms, the same as four stages)
KBLOCKED_TILES = {"glu": Tiles(steps=3), "w2": W2_TILES}


def env_tiles(default: Tiles | None = None) -> Tiles:
    """``default`` (``Tiles()``) with the fields ``DSV41_MGPU_TILES`` (JSON, read at trace time) sets."""
    import json

    default = default or Tiles()
    raw = os.environ.get("DSV41_MGPU_TILES")
    if not raw:
        return default
    try:
        return dataclasses.replace(default, **json.loads(raw))
    except (TypeError, ValueError) as e:
        raise ValueError(f"DSV41_MGPU_TILES={raw!r}: a JSON object of {list(Tiles.__dataclass_fields__)}") from e


def applies(O: int, K: int, bm: int, codes_dtype, x_dtype, tiles: Tiles | None = None,
            kblocked: bool = False) -> str | None:
    """None where the kernel takes these shapes (``kblocked``: K-blocked codes, ``qmatmul.kblock``),
    else the reason it does not."""
    t = tiles or Tiles()
    if codes_dtype != jnp.int8 or x_dtype != BF16:
        return f"int8 codes and bf16 tokens only (got {codes_dtype}, {x_dtype})"
    if t.tile_m not in (64, 128) or O % (2 * t.tile_m):
        return f"{O} output rows for tile_m={t.tile_m} (two per CTA)"
    if t.tile_k % 64 or K % t.tile_k:
        return f"K={K} for tile_k={t.tile_k} (a multiple of 64 dividing K)"
    if kblocked and t.tile_k != KBLOCK:
        return f"K-blocked codes for tile_k={t.tile_k} (their blocks are {KBLOCK} inputs)"
    if bm % 32 or not 32 <= bm <= 256:
        return f"row blocks of {bm} rows (a multiple of 32 up to 256)"
    if t.cluster not in (1, 2) or O % (2 * t.cluster * t.tile_m):
        return f"{O} output rows for cluster={t.cluster} (1 or 2) x 2 x tile_m={t.tile_m}"
    if t.chain and (K // t.tile_k) % min(t.steps, K // t.tile_k):
        return f"chained tiles need steps={t.steps} dividing the {K // t.tile_k} K steps"
    if t.stage and (t.chain or t.steps < 2 or K // t.tile_k < 2):
        return (f"staged operands (released one step late) need steps >= 2 and two K steps, "
                f"and no chain (got steps={t.steps}, {K // t.tile_k} K steps, chain={t.chain})")
    if t.tail and (t.tail % 32 or not 0 < t.tail < bm or t.stage):
        return f"tail={t.tail} for {bm}-row blocks (a multiple of 32 below the block, not staged: stage={t.stage})"
    if t.lhs not in LHS_LOADS:
        return f"lhs={t.lhs!r} (use one of {LHS_LOADS})"
    bad = set(filter(None, t.probe.split(","))) - set(PROBES)
    if bad:
        return f"unknown probes {sorted(bad)} (use {PROBES})"
    return None


PROBES = ("const_lhs", "one_expert", "no_store")
LHS_LOADS = ("", "8bit", "16bit")


def launch_tiles(proj: str, O: int, K: int, bm: int, codes_dtype, x_dtype, kblocked: bool = False) -> Tiles | None:
    """A launch's tiles: the measured best for ``proj`` ("w1", "w3", "glu", "w2": ``W2_TILES``;
    with K-blocked codes ``KBLOCKED_TILES``) where they take the shapes, else the defaults,
    ``DSV41_MGPU_TILES`` overriding fields of either; None where the kernel takes neither."""
    best = (KBLOCKED_TILES if kblocked else BEST_TILES).get(proj)
    for base in ((best,) if best else ()) + (Tiles(),):
        t = env_tiles(base)
        if applies(O, K, bm, codes_dtype, x_dtype, t, kblocked) is None:
            return t
    return None


def scale_t(scale):
    """ue8m0 bytes [E, O, K // 32] -> the kernel's scale operand [E, K // 32, O] (the bytes,
    transposed: a row block's scales of one 32-input chunk are contiguous)."""
    return jnp.swapaxes(scale, 1, 2)


def _kernel_scale(scale, scale_k):
    """The kernel's scale operand: ``scale_k`` (a copy already in its layout, ``MoE``'s
    ``keep_kernel_scales``) where given, else :func:`scale_t` of ``scale`` (an XLA transpose per
    call: 0.42 ms per V4.1-Flash layer at an 8k prefill, run 34)."""
    if scale_k is None:
        return scale_t(scale)
    want = (scale.shape[0], scale.shape[2], scale.shape[1])
    if tuple(scale_k.shape) != want or scale_k.dtype != scale.dtype:
        raise ValueError(f"moe_mgpu: kernel-layout scales {tuple(scale_k.shape)} {scale_k.dtype} for scales "
                         f"{tuple(scale.shape)} (expected {want} {scale.dtype})")
    return scale_k


def _scale_rows(s8, mult: float):
    """ue8m0 bytes -> bf16 ``mult * 2^(s - 127)`` inside the kernel (integer ops and a bitcast, as
    ``qmatmul.scale_values``; exact)."""
    si = s8.astype(jnp.int32)
    f = lax.bitcast_convert_type(lax.shift_left(si, jnp.int32(23)), F32)
    f = jnp.where(si == 0, jnp.float32(2.0 ** -127), f)
    return (f * jnp.float32(mult)).astype(BF16)


def grouped_matmul_t_reference(xt, block_group, n_blocks, codes, scale, *, bm: int, out_dtype=BF16,
                               mult: float | None = None, x_rows: bool = False, out_rows: bool = False):
    """XLA form: ``grouped_qmatmul_reference`` on the tokens' rows (``xt.T``, or ``xt`` with
    ``x_rows``); the result transposed unless ``out_rows``."""
    y = grouped_qmatmul_reference(xt if x_rows else xt.T, block_group, n_blocks, codes, scale, bm=bm,
                                  out_dtype=out_dtype, mult=mult)
    return y if out_rows else y.T


def kernel_impl(impl: str = "auto") -> str:
    """Resolve ``impl``: ``auto`` -> ``DSV41_MGPU_IMPL`` if set, else the kernel on a GPU and the
    XLA form elsewhere (``interpret`` only when asked for: tests, smoke runs)."""
    if impl not in _IMPLS:
        raise ValueError(f"grouped_matmul_t: impl {impl!r} not in {_IMPLS}")
    if impl == "auto":
        impl = os.environ.get("DSV41_MGPU_IMPL", "auto")
        if impl not in _IMPLS:
            raise ValueError(f"DSV41_MGPU_IMPL={impl!r}: use one of {_IMPLS}")
    if impl == "auto":
        impl = "mosaic" if jax.default_backend() == "gpu" else "xla"
    return impl


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except (RuntimeError, TypeError, ValueError):
        return 132


def grouped_matmul_t(xt, block_group, n_blocks, codes, scale, *, bm: int, out_dtype=BF16, mult: float | None = None,
                     impl: str = "auto", tiles: Tiles | None = None, num_sms: int | None = None,
                     x_rows: bool = False, out_rows: bool = False, scale_k=None, block_rows=None):
    """``xt`` [K, R] (bf16) times the int8 expert ``block_group[j]`` of ``codes`` [E, O, K] / ``scale``
    [E, O, K // 32] for every ``bm``-column block ``j < n_blocks``: [O, R] in ``out_dtype``.
    ``x_rows``: ``xt`` is given as rows, [R, K]; ``out_rows``: the result as rows, [R, O] (the
    kernel reads / stores its tiles transposed: no transpose in XLA). ``scale_k``: ``scale`` in
    the kernel's layout [E, K // 32, O] if the caller keeps it (else transposed here per call).
    ``block_rows`` [n blocks] int32: how many leading columns of each block hold rows (needed by
    ``Tiles.tail``: a block's tail columns are computed only where it has rows there, else stored
    as zeros; the XLA form computes every column)."""
    codes, scale = _grouped(codes, scale)
    K, R = xt.shape[::-1] if x_rows else xt.shape
    _check(jax.ShapeDtypeStruct((R, K), xt.dtype), block_group, codes, scale, bm)
    mult = default_mult(codes.dtype) if mult is None else mult
    impl = kernel_impl(impl)
    if impl == "xla":
        return grouped_matmul_t_reference(xt, block_group, n_blocks, codes, scale, bm=bm, out_dtype=out_dtype,
                                          mult=mult, x_rows=x_rows, out_rows=out_rows)
    tiles = tiles or env_tiles()
    E, O, _ = code_dims(codes)
    why = applies(O, K, bm, codes.dtype, xt.dtype, tiles, is_kblocked(codes))
    if why is None and jnp.dtype(out_dtype) != BF16:
        why = f"bf16 results only (got {jnp.dtype(out_dtype)})"
    if why is not None or scale is None:
        raise ValueError(f"grouped_matmul_t: the Mosaic GPU kernel does not apply: {why or 'unscaled weights'}")
    nb = jnp.reshape(jnp.asarray(n_blocks, jnp.int32), (1,))
    xt, x_rows = _interpreter_layout(xt, x_rows, impl)
    return _call(xt, block_group.astype(jnp.int32), nb, [(codes, _kernel_scale(scale, scale_k))], bm=bm, mult=mult,
                 tiles=tiles, block_rows=_block_rows(block_rows, block_group, tiles, "grouped_matmul_t"),
                 num_sms=num_sms or _num_sms(), interpret=impl == "interpret", x_rows=x_rows, out_rows=out_rows)


def _block_rows(block_rows, block_group, tiles: Tiles, who: str):
    """``block_rows`` as the kernel's int32 operand where ``tiles.tail`` uses it (else None)."""
    if not tiles.tail:
        return None
    if block_rows is None:
        raise ValueError(f"{who}: tiles.tail={tiles.tail} needs block_rows (the rows each block holds)")
    if tuple(block_rows.shape) != tuple(block_group.shape):
        raise ValueError(f"{who}: block_rows {tuple(block_rows.shape)} for {tuple(block_group.shape)} blocks")
    return block_rows.astype(jnp.int32)


def _interpreter_layout(xt, x_rows: bool, impl: str):
    """The interpreter reads the tokens as [K, R] tiles: JAX 0.10.2's Mosaic GPU interpreter takes no
    transposed view as a wgmma operand, and with each chunk copied transposed into a scratch buffer
    instead it deadlocks on some runs of one shape (docs/kernels.md). So ``x_rows`` is checked by
    its CUDA lowering and on the GPU (``sweep_prefill.py --part mgpu``), not in the interpreter."""
    return (xt.T, False) if x_rows and impl == "interpret" else (xt, x_rows)


def grouped_glu_t(xt, ws, block_group, n_blocks, w1, w3, *, bm: int, limit: float, impl: str = "auto",
                  tiles: Tiles | None = None, num_sms: int | None = None, x_rows: bool = False,
                  out_rows: bool = False, block_rows=None):
    """w1 and w3 in one launch with the SwiGLU in the epilogue: ``dt(ws * swiglu(dt(g), dt(u), limit))``
    [I, R] for ``g``, ``u`` = :func:`grouped_matmul_t` of ``w1`` / ``w3`` ((codes, scale) pairs) and
    ``ws`` [R] the route weight of each column (0 for padding columns). The compute warpgroups hold
    both accumulators, so each token tile is read once for the two weights and g, u never reach
    memory. XLA form: the two products and ``model.moe.swiglu``. ``x_rows`` / ``out_rows``: ``xt``
    given as rows [R, K] / the result as rows [R, I] (as :func:`grouped_matmul_t`). ``w1`` / ``w3``
    may carry a third item, their scales in the kernel's layout (``scale_k`` of
    :func:`grouped_matmul_t`; None: transposed here). ``block_rows``: as :func:`grouped_matmul_t`'s.

    Checked in the interpreter with two stages and 32-token blocks only: JAX 0.10.2's Mosaic GPU
    interpreter deadlocks on this five-operand pipeline from three stages on (K steps at least as
    many as stages) and with 64-token blocks, also with a one-accumulator epilogue and without the
    route-weight copy, so the deadlock is the interpreter's. The other tilings are checked on the
    GPU by ``sweep_prefill.py --part mgpu`` (rel_err / equal_frac against ``moe_glu``)."""
    from dsv41_jax.model.moe import swiglu

    impl = kernel_impl(impl)
    k1, k3 = (w[2] if len(w) > 2 else None for w in (w1, w3))
    (c1, s1), (c3, s3) = (_grouped(*w[:2]) for w in (w1, w3))
    if c1.shape != c3.shape or s1 is None or s3 is None:
        raise ValueError(f"grouped_glu_t: w1 {c1.shape} and w3 {c3.shape} must be scaled int8 weights of one shape")
    K, R = xt.shape[::-1] if x_rows else xt.shape
    if ws.shape != (R,):
        raise ValueError(f"grouped_glu_t: route weights {ws.shape} for {R} columns")
    if impl == "xla":
        g, u = (grouped_matmul_t(xt, block_group, n_blocks, c, sc, bm=bm, impl="xla", x_rows=x_rows,
                                 out_rows=out_rows) for c, sc in ((c1, s1), (c3, s3)))
        w = ws[:, None] if out_rows else ws[None, :]
        return (w.astype(F32) * swiglu(g, u, limit)).astype(BF16)
    tiles = tiles or env_tiles()
    _check(jax.ShapeDtypeStruct((R, K), xt.dtype), block_group, c1, s1, bm)
    why = applies(code_dims(c1)[1], K, bm, c1.dtype, xt.dtype, tiles, is_kblocked(c1))
    if why is not None:
        raise ValueError(f"grouped_glu_t: the Mosaic GPU kernel does not apply: {why}")
    nb = jnp.reshape(jnp.asarray(n_blocks, jnp.int32), (1,))
    xt, x_rows = _interpreter_layout(xt, x_rows, impl)
    return _call(xt, block_group.astype(jnp.int32), nb, [(c1, _kernel_scale(s1, k1)), (c3, _kernel_scale(s3, k3))],
                 bm=bm,
                 mult=default_mult(c1.dtype), tiles=tiles, num_sms=num_sms or _num_sms(),
                 interpret=impl == "interpret", glu=(ws.astype(F32), float(limit)), x_rows=x_rows,
                 out_rows=out_rows, block_rows=_block_rows(block_rows, block_group, tiles, "grouped_glu_t"))


def _codes_ref(ref, e, mi, cta_m: int, layout: str):
    """Expert ``e``'s codes of CTA row tile ``mi`` (``2 tile_m`` rows), as the pipeline streams them."""
    import jax.experimental.pallas as pl

    if layout == "tiled":
        return ref.at[e, mi]
    if layout == "kblocked":
        return ref.at[e, :, pl.ds(mi * cta_m, cta_m), :]
    return ref.at[e, pl.ds(mi * cta_m, cta_m), :]


def _load_codes(ref, how: str, interpret: bool):
    """A warpgroup's [tile_m, tile_k] int8 codes as bf16 in the WGMMA register layout (``Tiles.lhs``;
    the interpreter has no register layouts: a plain load there)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not how or interpret:
        return ref[...].astype(BF16)
    q = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
    if how == "8bit":
        return plgpu.layout_cast(q, plgpu.Layout.WGMMA).astype(BF16)
    return plgpu.layout_cast(q.astype(BF16), plgpu.Layout.WGMMA)


def _call(xt, block_group, nb, weights, *, bm, mult: float, tiles: Tiles, num_sms: int, interpret: bool, glu=None,
          x_rows: bool = False, out_rows: bool = False, block_rows=None):
    """The kernel. ``weights``: [(codes, scale bytes as ``scale_t``)], or two of them (w1, w3) with
    ``glu`` = (route weights [R] fp32, swiglu limit): then each compute warpgroup keeps both
    accumulators and its epilogue writes ``dt(w * swiglu(dt(g), dt(u)))``. ``block_rows``: the
    rows of each block (``Tiles.tail``)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    R, K = xt.shape if x_rows else xt.shape[::-1]
    # codes as stored ([E, O, K]: a step's weight tile is 2 tile_m pieces of tile_k bytes, K bytes
    # apart), or for measurements of that access pattern (``sweep_prefill.py``; no model path
    # stores them so yet) pre-tiled, [E, O / (2 tile_m), K / tile_k, 2 tile_m, tile_k], or
    # K-blocked, [E, K / tile_k, O, tile_k]: each step's tile one contiguous block
    layout = {3: "rows", 4: "kblocked", 5: "tiled"}[weights[0][0].ndim]
    shp = weights[0][0].shape
    E, O = shp[0], (shp[1] * shp[3] if layout == "tiled" else shp[2] if layout == "kblocked" else shp[1])
    nw = len(weights)
    NB = R // bm
    tm, tk = tiles.tile_m, tiles.tile_k
    cta_m = 2 * tm
    cl = tiles.cluster
    m_iters = O // (cl * cta_m)  # row tiles of a block per CTA (pair)
    chunks = tk // QBLOCK
    tail = tiles.tail
    nm = bm - tail  # the columns every block computes; the tail's only where the block has rows there
    parts = [(0, nm)] + ([(nm, tail)] if tail else [])
    epi = 64 if nm % 64 == 0 and tail % 64 == 0 else 32  # epilogue tile width (tokens)
    probes = set(filter(None, tiles.probe.split(",")))

    def tr(swizzle, itemsize):
        return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    a_tr = tr(plgpu.find_swizzle(tk * 8, "lhs"), 1)
    # 64-byte swizzle on the token tile: wgmma then takes it 32 inputs (one scale chunk) at a time
    b_tr = tr(64, 2)
    o_tr = tr(128, 2) if out_rows else tr(2 * epi, 2)
    stage = tiles.stage
    n_ops = nw * chunks  # left operands (and wgmma groups) per K step
    # staged: a step's MMAs still read its stage when the body returns; it is released one step late
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM, **(dict(delay_release=1) if stage else {}))
    specs = []
    for _ in range(nw):  # (a spec object per operand: the pipeline keeps per-spec state)
        specs += [spec((None, cta_m, tk), lambda k: (k, 0, 0), transforms=a_tr) if layout != "rows" else
                  spec((cta_m, tk), lambda k: (0, k), transforms=a_tr),
                  spec((chunks, cta_m), lambda k: (k, 0))]
    multicast = dict(collective_axes=("cluster",)) if cl > 1 else {}
    if x_rows:  # [bm, tk] token tiles, given to wgmma as a transposed view, 32 inputs at a time
        specs.append(spec((bm, tk), lambda k: (0, k), transforms=b_tr, **multicast))
    else:
        specs.append(spec((tk, bm), lambda k: (k, 0), transforms=b_tr, **multicast))

    def kernel(bg_gmem, nb_gmem, *refs, out_smem, lhs_smem, ws_smem=None, ws_bar=None):
        rows_gmem, refs = (refs[0], refs[1:]) if tail else (None, refs)
        ws_gmem, refs = (refs[0], refs[1:]) if glu is not None else (None, refs)
        w_gmem, b_gmem, out_gmem = refs[:2 * nw], refs[2 * nw], refs[2 * nw + 1]

        def pipeline(body, context, state=None):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(K // tk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=tiles.steps, compute_context=context, in_specs=specs,
                pipeline_state=state)

        def ignore(*_, **__):
            return None

        live_blocks = nb_gmem[0]

        @functools.partial(pl.run_scoped, collective_axes="wg", allocs=pipeline(ignore, ignore).get_allocations(
            *(_codes_ref(r, 0, 0, cta_m, layout) if i % 2 == 0 else r.at[0] for i, r in enumerate(w_gmem)), b_gmem))
        def _scope(allocs):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * tm, tm)  # this warpgroup's output rows within the CTA tile

            # only the live blocks' tiles (a prefix of the tile order): a CTA knows its first and
            # last tile, which a chain of pipelines needs
            @plgpu.nd_loop((jnp.minimum(live_blocks, NB) * m_iters,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                blk, mi = lin // m_iters, lin % m_iters
                if cl > 1:
                    mi = mi * cl + lax.axis_index("cluster")
                e = jnp.int32(0) if "one_expert" in probes else bg_gmem[blk]
                m_sl = pl.ds(mi * cta_m, cta_m)
                n_sl = pl.ds(blk * bm, bm)
                has_tail = rows_gmem[blk] > nm if tail else None

                def result(accs, c0: int, n: int):
                    """Columns [c0, c0 + n) of the block from their accumulators ``accs``."""
                    if glu is None:
                        return accs[0][...].astype(BF16)
                    g, u = (a[...].astype(BF16).astype(F32) for a in accs)
                    limit = glu[1]
                    if limit > 0:
                        u = jnp.clip(u, -limit, limit)
                        g = jnp.minimum(g, limit)
                    w = ws_smem[wg] if n == bm else ws_smem[wg, pl.ds(c0, n)]
                    wcol = lax.broadcast_in_dim(w, (tm, n), (1,))
                    return (wcol * (g / (1.0 + jnp.exp(-g))) * u).astype(BF16)

                def context(run):
                    # per part (all columns, or the main columns and the tail), an accumulator per weight
                    shapes = [(tm, n) for _, n in parts for _ in range(nw)]

                    @functools.partial(pl.run_scoped, accs=[plgpu.ACC(sh, F32) for sh in shapes])
                    def _acc(accs):
                        if glu is not None:  # this block's route weights, for the epilogue
                            plgpu.copy_gmem_to_smem(ws_gmem.at[n_sl], ws_smem.at[wg], ws_bar.at[wg])
                        run(tuple(accs))
                        if stage:  # (the last step's wait is inside a branch; the reads need one here)
                            plgpu.wgmma_wait(0)
                        if glu is not None:
                            plgpu.barrier_wait(ws_bar.at[wg])
                        ys = [(c0, result(accs[p * nw:(p + 1) * nw], c0, n)) for p, (c0, n) in enumerate(parts)]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        chunks_out = [(c0 + j * epi, y[:, j * epi:(j + 1) * epi]) for c0, y in ys
                                      for j in range(y.shape[1] // epi)]
                        for i, (col, yc) in enumerate(chunks_out):
                            cols = slice(col, col + epi)
                            slot = i % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            if out_rows:  # the tile stored transposed: [tokens, out] in shared memory
                                if interpret:  # (no transposed views, no register layouts there)
                                    out_smem[wg, slot] = yc.T
                                else:  # a register relayout, then a store through a transposed view
                                    yt = plgpu.layout_cast(yc, plgpu.Layout.WGMMA_TRANSPOSED)
                                    plgpu.transpose_ref(out_smem.at[wg, slot], (1, 0))[...] = yt
                                dst = out_gmem.at[n_sl, m_sl].at[cols, rows]
                            else:
                                out_smem[wg, slot] = yc
                                dst = out_gmem.at[m_sl, n_sl].at[rows].at[:, cols]
                            plgpu.commit_smem()
                            if "no_store" not in probes:
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst)

                def body(idx, *refs):
                    *smem, accs = refs
                    b_smem = smem[-1]
                    # every chunk dequantized before the first MMA is issued: a register operand
                    # must not change while its asynchronous wgmma runs
                    lhs = []
                    for w in range(nw):
                        if "const_lhs" in probes:
                            const = plgpu.layout_cast(jnp.full((tm, QBLOCK), 1.0, BF16), plgpu.Layout.WGMMA)
                            lhs += [(w, c, const) for c in range(chunks)]
                            continue
                        a = _load_codes(smem[2 * w].at[rows], tiles.lhs, interpret)
                        for c in range(chunks):
                            scale = lax.broadcast_in_dim(_scale_rows(smem[2 * w + 1][c, rows], mult),
                                                         (tm, QBLOCK), (0,))
                            lhs.append((w, c, a[:, c * QBLOCK:(c + 1) * QBLOCK] * scale))
                    def rhs(c, c0: int = 0, n: int = bm):
                        """Input chunk ``c`` of the token tile, columns [c0, c0 + n)."""
                        if x_rows:
                            toks = slice(None) if n == bm else pl.ds(c0, n)
                            return plgpu.transpose_ref(b_smem.at[toks, pl.ds(c * QBLOCK, QBLOCK)], (1, 0))
                        if n == bm:
                            return b_smem.at[pl.ds(c * QBLOCK, QBLOCK)]
                        return b_smem.at[pl.ds(c * QBLOCK, QBLOCK), pl.ds(c0, n)]

                    def mma(w, c, op):
                        """Chunk ``c`` of weight ``w``'s MMAs: every column, or the main columns and,
                        where the block has rows there, the tail's."""
                        if not tail:
                            plgpu.wgmma(accs[w], op, rhs(c))
                            return
                        plgpu.wgmma(accs[w], op, rhs(c, 0, nm))

                        @pl.when(has_tail)
                        def _tail():
                            plgpu.wgmma(accs[nw + w], op, rhs(c, nm, tail))

                    if stage:
                        # this step's operands into its half of the buffer (the half whose MMAs,
                        # two steps back, the previous step waited for), then its MMAs, left to
                        # run while the next step dequantizes; the previous step's are waited
                        # for, so that its stage (released after this body) is free. The last
                        # step waits for all: nothing releases its stage later.
                        half = lax.rem(idx[0], 2)
                        for j, (_, _, op) in enumerate(lhs):
                            lhs_smem[wg, half, j] = op
                        plgpu.commit_smem()
                        for j, (w, c, _) in enumerate(lhs):
                            plgpu.wgmma(accs[w], lhs_smem.at[wg, half, j], rhs(c))
                        plgpu.wgmma_wait(n_ops)

                        @pl.when(idx[0] == K // tk - 1)
                        def _last():
                            plgpu.wgmma_wait(0)

                        return accs
                    for w, c, op in lhs:
                        if interpret:  # the interpreter's wgmma reads its left operand from shared memory
                            lhs_smem[wg, 0, 0] = op
                            plgpu.commit_smem()
                            op = lhs_smem.at[wg, 0, 0]
                        mma(w, c, op)
                        if interpret:
                            plgpu.wgmma_wait(0)
                    plgpu.wgmma_wait(0)
                    return accs

                operands = []
                for w in range(nw):
                    operands += [_codes_ref(w_gmem[2 * w], e, mi, cta_m, layout), w_gmem[2 * w + 1].at[e, :, m_sl]]
                operands.append(b_gmem.at[n_sl, :] if x_rows else b_gmem.at[:, n_sl])
                if not tiles.chain:
                    pipeline(body, context)(*operands, allocations=allocs)
                    return
                # a chain: the first tile fills the stages, the last one drains them (the memory
                # warpgroup waits for the last releases: a cluster partner may still signal);
                # a CTA with one tile runs it unchained
                PP = plgpu.PipelinePipeline
                first, n_local = info.local_index == 0, info.num_local_steps
                state = jnp.where(first, jnp.int32(PP.START),
                                  jnp.where(info.local_index == n_local - 1, jnp.int32(PP.STOP), jnp.int32(PP.STEADY)))

                @pl.when(n_local == 1)
                def _alone():
                    pipeline(body, context)(*operands, allocations=allocs)

                @pl.when(n_local > 1)
                def _chained():
                    pipeline(body, context, state)(*operands, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        extra["interpret"] = interpret_params.InterpretGPUParams()
    if tail and block_rows is None:
        raise ValueError(f"moe_mgpu: tiles.tail={tail} needs block_rows")
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((R, O) if out_rows else (O, R), BF16), grid=(num_sms // cl,),
        grid_names=("sm",), **(dict(cluster=(cl,), cluster_names=("cluster",)) if cl > 1 else {}),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(out_smem=plgpu.SMEM((2, 2, epi, tm) if out_rows else (2, 2, tm, epi), BF16, transforms=o_tr),
                           lhs_smem=plgpu.SMEM((2, 2, n_ops, tm, QBLOCK) if stage else
                                               (2, 1, 1, tm, QBLOCK) if interpret else (2, 1, 1, 8, QBLOCK), BF16,
                                               transforms=tr(64, 2)),
                           **({} if glu is None else dict(ws_smem=plgpu.SMEM((2, bm), F32),
                                                          ws_bar=plgpu.Barrier(num_barriers=2)))),
        **extra)
    flat = [a for cw in weights for a in cw]
    return f(block_group, nb, *(() if not tail else (block_rows,)), *(() if glu is None else (glu[0],)), *flat, xt)
