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
comes out [out, tokens]. Keeping the whole MoE chain in this layout (``xt`` gathered transposed,
``h`` [I, R], ``y`` [D, R]) needs no transposed stores.

A persistent kernel: one CTA per SM walks (row block, 2 x ``tile_m`` output rows) tiles; per tile a
memory warpgroup streams the weight tile, its scale bytes ([K // 32, out], converted in registers) and the token tile
through ``max_concurrent_steps`` shared-memory stages while two compute warpgroups each own
``tile_m`` output rows x ``bm`` tokens of fp32 accumulator. The block's expert is read from
``block_group`` in global memory, so the kernel needs no scalar prefetch.

Implementations: ``"mosaic"`` (a Hopper GPU), ``"interpret"`` (JAX's Mosaic GPU interpreter on
any backend; it cannot take ``wgmma``'s left operand from registers, so there the dequantized
chunk goes through a shared-memory buffer: everything else, indexing and pipeline included, is the
kernel's), ``"xla"`` (:func:`grouped_matmul_t_reference`).

Selected by ``DSV41_MOE_PREFILL=mgpu`` (``MoE.routed_mgpu``) or ``mgpu-w2`` (w2 only); not the
default until it is measured faster than ``kernels.moe_glu`` (docs/kernels.md).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax.kernels.qmatmul import QBLOCK, _check, _grouped, default_mult, grouped_qmatmul_reference

F32 = jnp.float32
BF16 = jnp.bfloat16
_IMPLS = ("auto", "mosaic", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``tile_m`` output rows per compute warpgroup (64 or 128; a CTA owns two of them),
    ``tile_k`` inputs per pipeline step (a multiple of 32 dividing K), ``steps`` shared-memory
    stages. ``DSV41_MGPU_TILES`` (JSON) overrides fields."""
    tile_m: int = 64
    tile_k: int = 64
    steps: int = 4


def prefill_mode() -> str:
    """``DSV41_MOE_PREFILL`` (read at trace time): ``triton`` (default: ``kernels.moe_glu`` and the
    Triton w2 launch), ``mgpu`` (this module's kernel for w1, w3 and w2, XLA's gather and SwiGLU
    between them) or ``mgpu-w2`` (``moe_glu``, then this module's kernel for w2 on h's transpose)."""
    mode = os.environ.get("DSV41_MOE_PREFILL", "triton")
    if mode not in ("triton", "mgpu", "mgpu-w2"):
        raise ValueError(f"DSV41_MOE_PREFILL={mode!r}: use triton (the default), mgpu or mgpu-w2")
    return mode


def env_tiles() -> Tiles:
    import json

    raw = os.environ.get("DSV41_MGPU_TILES")
    if not raw:
        return Tiles()
    try:
        return dataclasses.replace(Tiles(), **json.loads(raw))
    except (TypeError, ValueError) as e:
        raise ValueError(f"DSV41_MGPU_TILES={raw!r}: a JSON object of {list(Tiles.__dataclass_fields__)}") from e


def applies(O: int, K: int, bm: int, codes_dtype, x_dtype, tiles: Tiles | None = None) -> str | None:
    """None where the kernel takes these shapes, else the reason it does not."""
    t = tiles or Tiles()
    if codes_dtype != jnp.int8 or x_dtype != BF16:
        return f"int8 codes and bf16 tokens only (got {codes_dtype}, {x_dtype})"
    if t.tile_m not in (64, 128) or O % (2 * t.tile_m):
        return f"{O} output rows for tile_m={t.tile_m} (two per CTA)"
    if t.tile_k % 64 or K % t.tile_k:
        return f"K={K} for tile_k={t.tile_k} (a multiple of 64 dividing K)"
    if bm % 32 or not 32 <= bm <= 256:
        return f"row blocks of {bm} rows (a multiple of 32 up to 256)"
    return None


def scale_t(scale):
    """ue8m0 bytes [E, O, K // 32] -> the kernel's scale operand [E, K // 32, O] (the bytes,
    transposed: a row block's scales of one 32-input chunk are contiguous)."""
    return jnp.swapaxes(scale, 1, 2)


def _scale_rows(s8, mult: float):
    """ue8m0 bytes -> bf16 ``mult * 2^(s - 127)`` inside the kernel (integer ops and a bitcast, as
    ``qmatmul.scale_values``; exact)."""
    si = s8.astype(jnp.int32)
    f = lax.bitcast_convert_type(lax.shift_left(si, jnp.int32(23)), F32)
    f = jnp.where(si == 0, jnp.float32(2.0 ** -127), f)
    return (f * jnp.float32(mult)).astype(BF16)


def grouped_matmul_t_reference(xt, block_group, n_blocks, codes, scale, *, bm: int, out_dtype=BF16,
                               mult: float | None = None):
    """XLA form: ``grouped_qmatmul_reference`` on ``xt.T``, transposed."""
    return grouped_qmatmul_reference(xt.T, block_group, n_blocks, codes, scale, bm=bm, out_dtype=out_dtype,
                                     mult=mult).T


def kernel_impl(impl: str = "auto") -> str:
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
                     impl: str = "auto", tiles: Tiles | None = None, num_sms: int | None = None):
    """``xt`` [K, R] (bf16) times the int8 expert ``block_group[j]`` of ``codes`` [E, O, K] / ``scale``
    [E, O, K // 32] for every ``bm``-column block ``j < n_blocks``: [O, R] in ``out_dtype``."""
    codes, scale = _grouped(codes, scale)
    K, R = xt.shape
    _check(jax.ShapeDtypeStruct((R, K), xt.dtype), block_group, codes, scale, bm)
    mult = default_mult(codes.dtype) if mult is None else mult
    impl = kernel_impl(impl)
    if impl == "xla":
        return grouped_matmul_t_reference(xt, block_group, n_blocks, codes, scale, bm=bm, out_dtype=out_dtype,
                                          mult=mult)
    tiles = tiles or env_tiles()
    E, O, _ = codes.shape
    why = applies(O, K, bm, codes.dtype, xt.dtype, tiles)
    if why is None and jnp.dtype(out_dtype) != BF16:
        why = f"bf16 results only (got {jnp.dtype(out_dtype)})"
    if why is not None or scale is None:
        raise ValueError(f"grouped_matmul_t: the Mosaic GPU kernel does not apply: {why or 'unscaled weights'}")
    nb = jnp.reshape(jnp.asarray(n_blocks, jnp.int32), (1,))
    return _call(xt, block_group.astype(jnp.int32), nb, codes, scale_t(scale), bm=bm, out_dtype=out_dtype,
                 mult=mult, tiles=tiles, num_sms=num_sms or _num_sms(), interpret=impl == "interpret")


def _call(xt, block_group, nb, codes, s8, *, bm, out_dtype, mult: float, tiles: Tiles, num_sms: int, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    K, R = xt.shape
    E, O, _ = codes.shape
    NB = R // bm
    tm, tk = tiles.tile_m, tiles.tile_k
    cta_m = 2 * tm
    m_iters = O // cta_m
    chunks = tk // QBLOCK
    epi = 64 if bm % 64 == 0 else 32  # epilogue tile width (tokens)

    def tr(swizzle, itemsize):
        return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    a_tr = tr(plgpu.find_swizzle(tk * 8, "lhs"), 1)
    # 64-byte swizzle on the token tile: wgmma then takes it 32 inputs (one scale chunk) at a time
    b_tr = tr(64, 2)
    o_tr = tr(2 * epi, 2)
    out_dt = jnp.dtype(out_dtype)

    def kernel(bg_gmem, nb_gmem, a_gmem, s_gmem, b_gmem, out_gmem, out_smem, lhs_smem):
        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(K // tk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=tiles.steps, compute_context=context,
                in_specs=[plgpu.BlockSpec((cta_m, tk), lambda k: (0, k), transforms=a_tr, memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((chunks, cta_m), lambda k: (k, 0), memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((tk, bm), lambda k: (k, 0), transforms=b_tr, memory_space=plgpu.SMEM)])

        def ignore(*_, **__):
            return None

        live_blocks = nb_gmem[0]

        @functools.partial(pl.run_scoped, collective_axes="wg",
                           allocs=pipeline(ignore, ignore).get_allocations(a_gmem.at[0], s_gmem.at[0], b_gmem))
        def _scope(allocs):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * tm, tm)  # this warpgroup's output rows within the CTA tile

            @plgpu.nd_loop((m_iters * NB,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                blk, mi = lin // m_iters, lin % m_iters

                @pl.when(blk < live_blocks)
                def _live():
                    e = bg_gmem[blk]
                    m_sl = pl.ds(mi * cta_m, cta_m)
                    n_sl = pl.ds(blk * bm, bm)

                    def context(run):
                        @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, bm), F32))
                        def _acc(acc):
                            run(acc)
                            y = acc[...].astype(out_dt)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for i in range(bm // epi):
                                cols = slice(i * epi, (i + 1) * epi)
                                slot = i % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = y[:, cols]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                                        out_gmem.at[m_sl, n_sl].at[rows].at[:, cols])

                    def body(_, a_smem, s_smem, b_smem, acc):
                        a = a_smem[rows].astype(BF16)
                        for c in range(chunks):
                            scale = lax.broadcast_in_dim(_scale_rows(s_smem[c, rows], mult), (tm, QBLOCK), (0,))
                            lhs = a[:, c * QBLOCK:(c + 1) * QBLOCK] * scale
                            if interpret:  # the interpreter's wgmma reads its left operand from shared memory
                                lhs_smem[wg] = lhs
                                plgpu.commit_smem()
                                lhs = lhs_smem.at[wg]
                            plgpu.wgmma(acc, lhs, b_smem.at[pl.ds(c * QBLOCK, QBLOCK)])
                            if interpret:
                                plgpu.wgmma_wait(0)
                        plgpu.wgmma_wait(0)
                        return acc

                    pipeline(body, context)(a_gmem.at[e, m_sl, :], s_gmem.at[e, :, m_sl], b_gmem.at[:, n_sl],
                                            allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        extra["interpret"] = interpret_params.InterpretGPUParams()
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((O, R), out_dt), grid=(num_sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(out_smem=plgpu.SMEM((2, 2, tm, epi), out_dt, transforms=o_tr),
                           lhs_smem=plgpu.SMEM((2, tm, QBLOCK) if interpret else (2, 8, QBLOCK), BF16,
                                               transforms=tr(64, 2))),
        **extra)
    return f(block_group, nb, codes, s8, xt)
