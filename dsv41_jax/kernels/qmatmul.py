"""Grouped matmul against quantized weights that stay quantized in HBM.

``grouped_qmatmul(x, block_group, n_blocks, codes, scale, bm=...)`` multiplies row block ``j``
of ``x`` (rows ``j*bm .. j*bm+bm-1``) by the weight of group ``block_group[j]``::

    y[j*bm + r, o] = sum_k x[j*bm + r, k] * W[block_group[j], o, k]
    W[g, o, k]     = codes[g, o, k] * mult * 2^(scale[g, o, k // 32] - 127)    (scale byte 0: 2^-127)

with ``mult`` = 0.5 for int8 codes (the routed experts' layout: twice the e2m1 value, see
``StackedWeight``) and 1 for float8_e4m3fn codes; without ``scale`` the codes are the weight
itself (bf16 / fp32 experts). Products accumulate in fp32 and are rounded once to
``out_dtype``. Row blocks ``j >= n_blocks`` are not computed and come out as zeros.

The same call serves

* MoE decode: every (token, slot) pair is its own row block (``bm`` = 1) naming its expert;
* MoE prefill: (token, slot) pairs sorted by expert into ``bm``-row blocks (the layout
  ``MoE.routed_grouped`` builds), ``n_blocks`` = the used blocks;
* dense fp8 projections: one group (``codes [1, O, K]`` or ``[O, K]``), every block names it.

``grouped_qmatmul_fused`` runs several weights that read the same rows as one launch (a grid over
all their output tiles), ``grouped_qmatmul_multi`` independent problems as one launch (a 1-D grid
over all their programs): small decode GEMVs then share one ramp-up and tail (docs/kernels.md).

Implementations (``impl``): ``"triton"`` (the Pallas kernel compiled by Triton; GPU),
``"interpret"`` (the same kernel in the Pallas interpreter; tests on CPU), ``"xla"``
(:func:`grouped_qmatmul_reference`: dequantizes the selected groups and runs one einsum; the
test oracle and the CPU path; it materializes one dequantized weight per row block, so it is
meant for small problems). ``"auto"`` (default) reads ``DSV41_QMATMUL_IMPL`` and otherwise picks
``"triton"`` on a GPU backend and ``"xla"`` elsewhere.

The kernel never writes a dequantized weight to memory: a program owns one (row block, output
tile) pair, loads code tiles and the matching scale bytes, turns them into values in registers
and accumulates over K in fp32. Three inner modes:

* ``"dot"`` (the default, except for the chunk mode's case below): the tile is dequantized in
  registers to the compute dtype and fed to the tensor cores (``tl.dot``), fp32 accumulation.
  Blocks of fewer than 16 rows (decode: one row per (token, slot) pair) are padded to 16 rows in
  registers (masked loads and stores: no extra memory traffic).
* ``"chunk"`` (the default for one-row blocks of several groups' scaled weights: the decode MoE
  experts): the raw codes go to the tensor cores unscaled, against a block-diagonal activation
  tile whose row ``c`` holds only the inputs of the ``c``-th 32-wide scale block of the step
  (``bk`` = 512: 16 rows, the MMA's minimum). The product is the 16 per-block partial sums of
  every output at once; each is scaled by its ue8m0 byte (exact: a power of two) and
  accumulated, and the 16 rows are added after the K loop. No per-weight scale multiply or
  in-register reshape remains; the rows the "dot" mode pads with zeros do the work. K need not
  be a multiple of 512 (the last step is masked).
* ``"reduce"`` (opt-in; CUDA-core GEMV): elementwise products of the dequantized tile and the
  rows, either accumulated in a product-shaped fp32 accumulator and reduced once after the K
  loop (``acc=True``, the one-row default) or summed per 32-wide scale block, scaled once per
  32 weights and accumulated. Codes are converted to fp32 without a round trip through the
  compute dtype: int8 codes times 0.5 and e4m3 codes are exact in bf16 for any power-of-two
  scale in the normal range, so the products are the ones the reference forms. Measured
  slower than "dot" on the H200 (kept for other GPUs and as a second formulation in tests).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
QBLOCK = 32  # inputs per scale byte
CHUNK_ROWS = 16  # "chunk" mode: scale blocks per K step = rows of the block-diagonal activation tile
_IMPLS = ("auto", "triton", "interpret", "xla")


# ------------------------------------------------------------------------------ numerics
def default_mult(codes_dtype) -> float:
    """Code multiplier: 0.5 for int8 codes (2 x e2m1 values), 1 for fp8 / float codes."""
    return 0.5 if jnp.dtype(codes_dtype) == jnp.int8 else 1.0


def scale_values(scale, mult: float = 1.0):
    """ue8m0 bytes -> fp32 powers of two ``2^(s - 127)`` (byte 0 -> 2^-127) times ``mult``.

    Built from integer ops and a bitcast only, so it lowers in XLA and inside the kernel alike."""
    s = scale.astype(jnp.int32)
    f = lax.bitcast_convert_type(lax.shift_left(s, jnp.int32(23)), F32)
    f = jnp.where(s == 0, jnp.float32(2.0 ** -127), f)
    return f * jnp.float32(mult) if mult != 1.0 else f


def dequantize(codes, scale, dtype, mult: float | None = None):
    """Values of ``codes`` [..., O, K] with per-32-input ``scale`` [..., O, K // 32] (or None)."""
    if scale is None:
        return codes.astype(dtype)
    mult = default_mult(codes.dtype) if mult is None else mult
    K = codes.shape[-1]
    v = codes.astype(F32).reshape(*codes.shape[:-1], K // QBLOCK, QBLOCK)
    v = v * scale_values(scale, mult)[..., None]
    return v.reshape(codes.shape).astype(dtype)


# ------------------------------------------------------------------------------ code layouts
# Grouped int8 codes come in two layouts: rows, ``[G, O, K]`` (as checkpoints store them), and
# K-blocked, ``[G, K // KBLOCK, O, KBLOCK]`` (``kblock``): the KBLOCK inputs of every output row
# of one K block lie together, so a kernel's (output rows x KBLOCK inputs) tile is one contiguous
# piece of memory instead of rows K bytes apart (runs 36 and 38: the Mosaic GPU prefill kernel
# ~10% faster per launch; run 40: the model's 8k prefill 1.5 ms less kernel time, but decode batch
# 1 was 7.5% slower in run 38 through the chunk mode's register transpose, replaced since by
# per-64 slab dots and not yet timed, so it is opt-in). The layout is told by the number of
# dimensions (3 or 4).
KBLOCK = 64


def kblock(codes):
    """Codes ``[..., O, K]`` -> K-blocked ``[..., K // KBLOCK, O, KBLOCK]`` (numpy or jax)."""
    *lead, O, K = codes.shape
    if K % KBLOCK:
        raise ValueError(f"kblock: K={K} is not a multiple of {KBLOCK}")
    return codes.reshape(*lead, O, K // KBLOCK, KBLOCK).swapaxes(-3, -2)


def unblock(codes):
    """Inverse of :func:`kblock`: ``[..., K // KBLOCK, O, KBLOCK]`` -> ``[..., O, K]``."""
    *lead, nk, O, kb = codes.shape
    return codes.swapaxes(-3, -2).reshape(*lead, O, nk * kb)


def is_kblocked(codes) -> bool:
    """Whether grouped codes are K-blocked (4 dimensions) rather than rows (2 or 3)."""
    return codes.ndim == 4


def code_dims(codes) -> tuple:
    """(G, O, K) of grouped codes in either layout."""
    if is_kblocked(codes):
        G, nk, O, kb = codes.shape
        return G, O, nk * kb
    return tuple(codes.shape)


def rows_view(codes):
    """Grouped codes in the rows layout (an XLA transpose of K-blocked ones; for the XLA forms)."""
    return unblock(codes) if is_kblocked(codes) else codes


def _grouped(codes, scale):
    """Accept dense ``[O, K]`` / ``[O, K // 32]`` weights as one group."""
    if codes.ndim == 2:
        codes = codes[None]
    if scale is not None and scale.ndim == 2:
        scale = scale[None]
    return codes, scale


def _check(x, block_group, codes, scale, bm):
    R, K = x.shape
    G, O, Kc = code_dims(codes)
    if Kc != K:
        raise ValueError(f"grouped_qmatmul: x has K={K}, weights {codes.shape}")
    if is_kblocked(codes) and (codes.shape[-1] != KBLOCK or scale is None):
        raise ValueError(f"grouped_qmatmul: K-blocked codes {codes.shape} need blocks of {KBLOCK} inputs and scales")
    if bm < 1 or R % bm:
        raise ValueError(f"grouped_qmatmul: {R} rows are not a multiple of bm={bm}")
    if block_group.shape != (R // bm,):
        raise ValueError(f"grouped_qmatmul: block_group {block_group.shape} for {R // bm} row blocks")
    if scale is not None:
        if K % QBLOCK:
            raise ValueError(f"grouped_qmatmul: scaled weights need K % {QBLOCK} == 0, got {K}")
        if scale.shape != (G, O, K // QBLOCK):
            raise ValueError(f"grouped_qmatmul: scale {scale.shape} for codes {codes.shape}")
    return R, K, G, O


def grouped_qmatmul_reference(x, block_group, n_blocks, codes, scale=None, *, bm: int,
                              out_dtype=None, mult: float | None = None):
    """XLA reference: dequantize each row block's group to ``x.dtype``, one einsum with fp32
    accumulation (``HIGHEST`` for fp32 operands), zeros for blocks ``>= n_blocks``."""
    codes, scale = _grouped(codes, scale)
    R, K, G, O = _check(x, block_group, codes, scale, bm)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    nb = R // bm
    bg = jnp.clip(block_group.astype(jnp.int32), 0, G - 1)
    w = dequantize(rows_view(codes[bg]), None if scale is None else scale[bg], x.dtype, mult)  # [nb, O, K]
    prec = lax.Precision.HIGHEST if x.dtype == F32 else lax.Precision.DEFAULT
    y = jnp.einsum("brk,bok->bro", x.reshape(nb, bm, K), w, precision=prec, preferred_element_type=F32)
    live = jnp.arange(nb) < jnp.asarray(n_blocks, jnp.int32)
    y = jnp.where(live[:, None, None], y, 0.0)
    return y.reshape(R, O).astype(out_dtype)


# ------------------------------------------------------------------------------ kernel config
@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters. ``tm``: rows per program (a power of two >= bm; 16 at
    least in "dot" mode); ``bo``: output columns per program; ``bk``: inputs per loop step
    (a power of two dividing K); ``split``: "dot" mode dequantizes and multiplies each 32-wide
    scale block separately (no in-register reshape) instead of the whole ``bk`` step at once;
    ``acc``: "reduce" mode keeps an accumulator of the product's shape and reduces it once after
    the K loop (no cross-lane reduction per step); ``group_rows`` > 0: a 1-D launch order that
    walks ``group_rows`` row blocks x all output tiles at a time (x and weight tiles both reused
    from L2; for many row blocks on one group, e.g. dense prefill), 0: output tiles of one row
    block run next to each other (the x tile is reused; weights once per row block). ``splitk``
    > 1: K is cut into that many equal ranges, each run by its own program into an fp32 partial
    sum ``[splitk, R, O]`` that XLA adds up and rounds once (small problems, e.g. decode GEMVs:
    enough programs in flight to stream the weights at full bandwidth). ``lowp_dequant``: "dot"
    mode dequantizes in the compute dtype (codes and power-of-two scales convert exactly, so the
    weights are the same values) instead of through fp32 (experiment; ``DSV41_QMATMUL_DEQUANT``).
    ``wlhs``: "dot" mode puts the dequantized weight tile on the left of the product
    (``w [bo, bk] . x^T [bk, tm]`` -> ``[bo, tm]``, transposed once before the store): the
    weights can then stay in registers as the MMA's A operand instead of being written to
    shared memory as its B operand; the same products and fp32 sums (the default for prefill
    blocks: 6-7% faster there; 1-14% slower for decode GEMVs). ``tail`` > 0 ("dot" mode, not
    ``split``): a row block holds ``tm + tail`` rows (``bm``, not a power of two, e.g. 160 =
    128 + 32) and each K step multiplies the one dequantized weight tile by both row tiles (two
    MMAs): an expert block slightly larger than a power of two costs one weight read and few
    padded rows instead of a second block. ``dead_zeros`` False: row blocks ``>= n_blocks`` are
    left unwritten instead of zero-filled (callers that never read them: a prefill's routed w2,
    whose unused blocks are about 40% of the layout). ``select`` >= 0 (set by ``split_tail``): a
    launch over the blocks whose selector equals it only (the others are left as they are)."""
    mode: str
    tm: int
    bo: int
    bk: int
    num_warps: int
    num_stages: int
    split: bool = False
    acc: bool = False
    group_rows: int = 0
    splitk: int = 1
    lowp_dequant: bool = False
    wlhs: bool = False
    tail: int = 0
    dead_zeros: bool = True
    select: int = -1


# split-K target: about this many programs in flight (4 per SM of a 132-SM H200)
SPLITK_PROGRAMS = 4 * 132
SPLITK_MAX = 16


def auto_splitk(n_programs: int, K: int, quantum: int = QBLOCK, target: int | None = None,
                min_range: int | None = None) -> int:
    """Smallest power of two s <= SPLITK_MAX with ``n_programs * s >= target`` such that every
    K range stays a multiple of ``quantum`` and holds at least ``min_range`` inputs (default:
    two quanta)."""
    target = SPLITK_PROGRAMS if target is None else target
    min_range = 2 * quantum if min_range is None else min_range
    s = 1
    while (s < SPLITK_MAX and n_programs * s < target and K % (2 * s * quantum) == 0
           and K // (2 * s) >= min_range):
        s *= 2
    return s


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def row_tiles(bm: int) -> tuple:
    """(tm, tail) of a ``bm``-row block in the tensor-core modes: ``bm`` itself when a power of two
    (16 at least: the MMA's smallest tile), a power of two plus a power-of-two tail >= 16 where
    ``bm`` is one (160 = 128 + 32: both row tiles share each weight tile), else one tile of the
    next power of two with masked rows (40 -> 64)."""
    p = _pow2_at_least(bm)
    rest = bm - p // 2
    if bm != p and rest >= 16 and not rest & (rest - 1):
        return p // 2, rest
    return max(p, 16), 0


def tail_selector(row_token, bm: int):
    """``split_tail``'s selector of a ``bm``-row block layout (``row_token`` -1 for a padding row;
    pairs fill a block from its start): 1 where a block has a pair in its tail tile (past the
    main tile of ``row_tiles(bm)``), else 0; int32 ``[R // bm]``."""
    tm = row_tiles(bm)[0]
    last = jnp.max(jnp.where(row_token.reshape(-1, bm) >= 0, jnp.arange(1, bm + 1, dtype=jnp.int32), 0), axis=1)
    return (last > tm).astype(jnp.int32)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


# Default tiles, measured on one H200 (JAX 0.11.2; benchmarks/bench_qmatmul.py, raw rows in
# benchmarks/results/qmatmul_2026-12-01_run3.jsonl). Blocks of up to 16 rows (decode, batched
# dense GEMV) run on the tensor cores with the rows padded to 16 in registers: 64 x 128 tiles
# beat the elementwise "reduce" forms (1.2-2.4 vs 0.9-2.0 TB/s). 128-row prefill blocks: 128 x 64
# tiles (bk 128 was 20-40% slower); since session 6 with the weight tile on the left of the dot
# and 4 warps (6-7% faster on the routed w1 / w2 blocks of an 8k prefill, benchmarks/sweep_gemv.py
# --grid wlhs). One-row blocks of grouped scaled weights (decode experts) since session 8: the
# "chunk" mode with 32-wide output tiles (routed w1 / w2 19-22% faster than the "dot" mode,
# sweep_gemv.py --grid chunk; 64-wide tiles gained nothing). ``num_warps`` None: 8 for 128-row
# tiles, else 4. ``DSV41_QMATMUL_TUNING`` (JSON, e.g. '{"large": {"wlhs": false, "num_warps": 8}}')
# overrides fields for tuning on other GPUs.
TUNING = {
    "small": dict(mode="dot", bo=64, bk=128, num_warps=4, num_stages=3),
    "one_row": dict(mode="chunk", bo=32, bk=CHUNK_ROWS * QBLOCK, num_warps=4, num_stages=3),
    "large": dict(mode="dot", bo=128, bk=64, num_warps=4, num_stages=3, wlhs=True),
}


def env_tiles(var: str, defaults: dict) -> dict:
    """``defaults`` updated by the JSON object in the environment variable ``var`` (tuning runs);
    a malformed value or an unknown field is one clear error."""
    tiles = dict(defaults)
    env = os.environ.get(var)
    if env:
        try:
            extra = json.loads(env)
            bad = set(extra) - set(defaults)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{var}={env!r}: not a JSON object ({e})") from None
        if bad:
            raise ValueError(f"{var}: unknown fields {sorted(bad)} (known: {sorted(defaults)})")
        tiles.update(extra)
    return tiles


def _tuning(size: str) -> dict:
    cfg = dict(TUNING[size])
    env = os.environ.get("DSV41_QMATMUL_TUNING")
    if env:
        try:
            extra = json.loads(env).get(size, {})
            bad = set(extra) - {f.name for f in dataclasses.fields(Config)}
        except (ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"DSV41_QMATMUL_TUNING={env!r}: not a JSON object of objects ({e})") from None
        if bad:
            raise ValueError(f"DSV41_QMATMUL_TUNING: unknown Config fields {sorted(bad)}")
        cfg.update(extra)
    return cfg


def choose_config(bm: int, O: int, K: int, scaled: bool, mode: str = "auto", nb: int = 1, groups: int = 1,
                  outs=None, kblocked: bool = False, **override) -> Config:
    """Tiles for a problem: ``TUNING`` for ``mode`` "auto" ("one_row" for one-row blocks of
    scaled weights of several groups: the decode MoE experts, "small" for other blocks of up to
    16 rows, "large" above), "dot" ("small" / "large") or "chunk"; "reduce" takes its own
    defaults (one-row blocks: the accumulate-then-reduce form); ``override``: any ``Config``
    field (tuning sweeps). ``nb`` (row blocks) sizes the automatic split-K (``auto_splitk``;
    ``splitk=1`` turns it off); ``outs``: the output sizes of a fused launch (``O`` is their
    largest), whose tiles together size the split-K. ``kblocked``: K-blocked codes (``kblock``):
    K ranges and steps are then multiples of ``KBLOCK``, and the "reduce" mode does not take them."""
    if mode == "auto" and bm == 1 and scaled and groups > 1:
        cfg = _tuning("one_row")
    elif mode in ("auto", "dot"):
        cfg = _tuning("small" if bm <= 16 else "large")
    elif mode == "reduce":
        tm = _pow2_at_least(bm)
        cfg = dict(mode="reduce", bo=16, bk=256 if tm <= 2 else 128, num_warps=4, num_stages=3,
                   acc=tm == 1)
    elif mode == "chunk":
        cfg = _tuning("one_row")
        cfg["mode"] = "chunk"
    else:
        raise ValueError(f"grouped_qmatmul: mode {mode!r} (use auto, dot, chunk or reduce)")
    cfg.setdefault("lowp_dequant", os.environ.get("DSV41_QMATMUL_DEQUANT", "f32") == "lowp")
    cfg.update(override)
    chunk = cfg["mode"] == "chunk"
    if chunk and (bm != 1 or not scaled):
        raise ValueError(f"grouped_qmatmul: the chunk mode takes one-row blocks of scaled weights (bm={bm})")
    tm = _pow2_at_least(bm)
    cfg["tm"] = CHUNK_ROWS if chunk else (max(tm, 16) if cfg["mode"] == "dot" else tm)
    cfg["tail"] = 0
    if cfg["mode"] == "dot" and not cfg.get("split"):
        cfg["tm"], cfg["tail"] = row_tiles(bm)  # e.g. 160 = 128 + 32: two row tiles, one weight tile
    if cfg.get("num_warps") is None:
        cfg["num_warps"] = 8 if cfg["tm"] >= 128 else 4
    cfg["bo"] = min(cfg["bo"], _pow2_at_least(O))
    if chunk:
        cfg["bk"] = CHUNK_ROWS * QBLOCK  # one MMA row per 32-input scale block; K ranges need not divide by it
    if cfg.get("group_rows"):
        cfg["splitk"] = 1
    elif cfg.get("splitk") is None:
        n_o = sum(-(-o // cfg["bo"]) for o in (outs or [O]))
        cfg["splitk"] = auto_splitk(n_o * nb, K, quantum=KBLOCK if kblocked else QBLOCK,
                                    min_range=cfg["bk"] if chunk else 2 * QBLOCK)
    quantum = KBLOCK if kblocked else QBLOCK
    if K % cfg["splitk"] or (scaled and (K // cfg["splitk"]) % quantum):
        raise ValueError(f"grouped_qmatmul: splitk={cfg['splitk']} does not cut K={K} into {quantum}-input ranges")
    if not chunk:
        cfg["bk"] = _largest_pow2_divisor(K // cfg["splitk"], cfg["bk"])
    if scaled and cfg["bk"] < quantum:
        raise ValueError(f"grouped_qmatmul: K={K} has no power-of-two step >= {quantum}")
    if kblocked and cfg["mode"] == "reduce":
        raise ValueError("grouped_qmatmul: the reduce mode does not take K-blocked codes (use dot or chunk)")
    if cfg.get("wlhs") and cfg["mode"] != "dot":
        raise ValueError("grouped_qmatmul: wlhs applies to the dot mode only")
    if cfg["tm"] + cfg["tail"] < bm or cfg["tm"] & (cfg["tm"] - 1):
        raise ValueError(f"grouped_qmatmul: tm={cfg['tm']} must be a power of two >= bm={bm}")
    return Config(**cfg)


# ------------------------------------------------------------------------------ kernel
def _load(ref, mask, other=None):
    """``ref``'s block with ``mask`` broadcast to its shape; masked elements read ``other``."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=other)


def _code_tile(c_ref, g, o0, bo: int, k0, bk: int, omask, kblocked: bool, other=None):
    """Scaled codes of group ``g``, outputs ``[o0, o0 + bo)`` (``omask`` [bo, 1]), inputs
    ``[k0, k0 + bk)`` as ``[bo, bk // 32, 32]``. ``c_ref``: the rows layout viewed as
    ``[G, O, K // 32, 32]``, or K-blocked codes ``[G, K // 64, O, 64]`` (``k0``, ``bk``: multiples
    of 64), whose ``[bk // 64, bo, 64]`` tile is transposed in registers."""
    from jax.experimental import pallas as pl

    nkb = bk // QBLOCK
    if not kblocked:
        b0 = pl.multiple_of(k0 // QBLOCK, nkb)
        return _load(c_ref.at[g, pl.ds(o0, bo), pl.ds(b0, nkb), :], omask[:, :, None], other)
    nkk = bk // KBLOCK
    c = _load(c_ref.at[g, pl.ds(pl.multiple_of(k0 // KBLOCK, nkk), nkk), pl.ds(o0, bo), :], omask[None], other)
    return jnp.swapaxes(c, 0, 1).reshape(bo, nkb, QBLOCK)


def _store(ref, val, mask):
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref, val, mask=jnp.broadcast_to(mask, val.shape))


def _kernel(nb_ref, bg_ref, x_ref, *refs, cfg: Config, bm: int, nb: int, Os: tuple, K: int,
            scaled: bool, mult: float, cd, out_dtype, codes_dtype=None, kblocked: bool = False):
    """One program: output tile ``oi`` of the weights' concatenated output tiles (weight ``i``
    owns tiles ``starts[i] .. starts[i + 1] - 1``), row block ``j``, K range ``ks``. ``refs``:
    each weight's codes (and scale) ref, then each weight's output ref."""
    from jax.experimental import pallas as pl

    if cfg.group_rows:
        n_o = _tile_starts(Os, cfg.bo)[-1]
        per_group = cfg.group_rows * n_o
        pid = pl.program_id(0)
        first = (pid // per_group) * cfg.group_rows
        size = jnp.minimum(nb - first, cfg.group_rows)
        local = pid % per_group
        oi, j = local // size, first + local % size
    else:
        oi, j = pl.program_id(0), pl.program_id(1)
    ks = pl.program_id(2) if cfg.splitk > 1 else 0  # K range (read here: outside the weight branches)
    sel_ref = None
    if cfg.select >= 0:  # split_tail: the blocks' selector, and in the second launch the first one's outputs
        sel_ref, refs = refs[0], refs[1:]
        if cfg.select == 1:
            refs = refs[:-2 * len(Os)] + refs[-len(Os):]
    _weights_program(nb_ref, bg_ref, x_ref, refs, oi=oi, j=j, ks=ks, cfg=cfg, bm=bm, nb=nb, Os=Os, K=K,
                     scaled=scaled, mult=mult, cd=cd, out_dtype=out_dtype, codes_dtype=codes_dtype, sel_ref=sel_ref,
                     kblocked=kblocked)


def _tile_starts(Os, bo: int) -> list:
    """First output tile of each weight in a launch over the weights' concatenated tiles."""
    starts = [0]
    for O in Os:
        starts.append(starts[-1] + -(-O // bo))
    return starts


def _weights_program(nb_ref, bg_ref, x_ref, refs, *, oi, Os, scaled: bool, **kw):
    """Run tile ``oi`` of the concatenated output tiles on the weight that owns it (``refs``: each
    weight's codes (and scale) ref, then each weight's output ref)."""
    from jax.experimental import pallas as pl

    n_w = len(Os)
    per = 2 if scaled else 1
    w_refs = [refs[i * per:(i + 1) * per] for i in range(n_w)]
    o_refs = refs[n_w * per:]
    if n_w == 1:
        _program(nb_ref, bg_ref, x_ref, *w_refs[0], o_refs[0], oi=oi, O=Os[0], scaled=scaled, **kw)
        return
    starts = _tile_starts(Os, kw["cfg"].bo)
    for i in range(n_w):
        @pl.when((oi >= starts[i]) & (oi < starts[i + 1]))
        def _weight_i(i=i):
            _program(nb_ref, bg_ref, x_ref, *w_refs[i], o_refs[i], oi=oi - starts[i], O=Os[i], scaled=scaled, **kw)


def _program(nb_ref, bg_ref, x_ref, c_ref, *rest, oi, j, ks, cfg: Config, bm: int, nb: int, O: int, K: int,
             scaled: bool, mult: float, cd, out_dtype, codes_dtype, sel_ref=None, kblocked: bool = False):
    """The work of one program on one weight: output tile ``oi`` (of this weight), row block ``j``,
    K range ``ks``. ``kblocked``: ``c_ref`` holds K-blocked codes (``kblock``; scaled, not "reduce")."""
    from jax.experimental import pallas as pl

    s_ref, o_ref = rest if scaled else (None, rest[0])
    tm, bo, bk = cfg.tm, cfg.bo, cfg.bk
    nkb = bk // QBLOCK
    kr = K // cfg.splitk                                               # inputs of this program
    kbase = ks * kr

    def put(val, off=0):  # output rows r0 + off ... (an fp32 partial-sum slice under split-K)
        rows = val.shape[0]  # tm, the tail's rows (all valid), or 1 (the chunk mode's one row)
        mask = smask if rows == tm else (o0 + lax.broadcasted_iota(jnp.int32, (1, bo), 1) < O)
        if cfg.splitk > 1:
            _store(o_ref.at[pl.ds(ks, 1), pl.ds(r0 + off, rows), pl.ds(o0, bo)], val.astype(F32)[None], mask[None])
        else:
            _store(o_ref.at[pl.ds(r0 + off, rows), pl.ds(o0, bo)], val.astype(out_dtype), mask)

    o0 = pl.multiple_of(oi * bo, bo)
    r0 = j * bm
    rmask = lax.broadcasted_iota(jnp.int32, (tm, 1), 0) < bm          # rows of this block
    ocol = o0 + lax.broadcasted_iota(jnp.int32, (bo, 1), 0)           # output columns, [bo, 1]
    omask = ocol < O
    smask = rmask & (o0 + lax.broadcasted_iota(jnp.int32, (1, bo), 1) < O)  # [tm, bo] store mask
    live = j < nb_ref[0]
    if cfg.select >= 0:
        live = live & (sel_ref[j] == cfg.select)
    prec = lax.Precision.HIGHEST if cd == F32 else None
    dims = (((1,), (1,)), ((), ()))

    def dot(a, w):  # a [tm, kk], w [bo, kk] -> [tm, bo] fp32 ([bo, tm] with wlhs)
        lhs, rhs = (w, a) if cfg.wlhs else (a, w)
        return lax.dot_general(lhs.astype(cd), rhs.astype(cd), dims, precision=prec, preferred_element_type=F32)

    def add_dots(acc, w, k0):  # acc + this K step's weight tile times the block's row tile(s)
        if not cfg.tail:
            return acc + dot(_load(x_ref.at[pl.ds(r0, tm), pl.ds(k0, bk)], rmask), w)
        main, tail = acc  # bm = tm + tail rows, all of them valid
        return (main + dot(_load(x_ref.at[pl.ds(r0, tm), pl.ds(k0, bk)], True), w),
                tail + dot(_load(x_ref.at[pl.ds(r0 + tm, cfg.tail), pl.ds(k0, bk)], True), w))

    if cfg.mode == "chunk":
        _chunk_program(bg_ref, x_ref, c_ref, s_ref, live=live, j=j, o0=o0, kbase=kbase, kr=kr, omask=omask,
                       cfg=cfg, mult=mult, cd=cd, prec=prec, put=put, codes_dtype=codes_dtype, kblocked=kblocked)
        return

    @pl.when(live)
    def _compute():
        g = bg_ref[j]

        def step(kk, acc):
            k0 = pl.multiple_of(kbase + kk * bk, bk)
            if not scaled:
                w = _load(c_ref.at[g, pl.ds(o0, bo), pl.ds(k0, bk)], omask)             # [bo, bk]
                if cfg.mode == "dot":
                    return add_dots(acc, w, k0)
                xt = _load(x_ref.at[pl.ds(r0, tm), pl.ds(k0, bk)], rmask)              # [tm, bk]
                wf = w.astype(cd).astype(F32)
                if cfg.acc:
                    return acc + xt.astype(F32)[:, None, :] * wf[None, :, :]                # [tm, bo, bk]
                return acc + jnp.sum(xt.astype(F32)[:, None, :] * wf[None, :, :], axis=-1)
            b0 = pl.multiple_of(k0 // QBLOCK, nkb)
            if cfg.mode == "reduce" and cfg.acc:
                c = _load(c_ref.at[g, pl.ds(o0, bo), pl.ds(b0, nkb), :], omask[:, :, None])  # [bo, nkb, 32]
                s = _load(s_ref.at[g, pl.ds(o0, bo), pl.ds(b0, nkb)], omask)               # [bo, nkb]
                xt = _load(x_ref.at[pl.ds(r0, tm), pl.ds(b0, nkb), :], rmask[:, :, None])  # [tm, nkb, 32]
                w = c.astype(F32) * scale_values(s, mult)[:, :, None]
                return acc + xt.astype(F32)[:, None] * w[None]                             # [tm, bo, nkb, 32]
            if cfg.mode == "reduce":
                c = _load(c_ref.at[g, pl.ds(o0, bo), pl.ds(b0, nkb), :], omask[:, :, None])  # [bo, nkb, 32]
                s = _load(s_ref.at[g, pl.ds(o0, bo), pl.ds(b0, nkb)], omask)               # [bo, nkb]
                xt = _load(x_ref.at[pl.ds(r0, tm), pl.ds(b0, nkb), :], rmask[:, :, None])  # [tm, nkb, 32]
                part = jnp.sum(xt.astype(F32)[:, None] * c.astype(F32)[None], axis=-1)    # [tm, bo, nkb]
                return acc + jnp.sum(part * scale_values(s, mult)[None], axis=-1)
            if cfg.split:  # one 32-wide scale block at a time: 2-D tiles only
                for i in range(nkb):
                    if kblocked:  # block (k0 + 32 i) // 64, its half i % 2 (k0 is a multiple of 64)
                        kb = k0 // KBLOCK + i // 2
                        c = _load(c_ref.at[g, kb, pl.ds(o0, bo), pl.ds((i % 2) * QBLOCK, QBLOCK)], omask)
                    else:
                        c = _load(c_ref.at[g, pl.ds(o0, bo), pl.ds(k0 + i * QBLOCK, QBLOCK)], omask)  # [bo, 32]
                    s = _load(s_ref.at[g, pl.ds(o0, bo), pl.ds(b0 + i, 1)], omask)             # [bo, 1]
                    xt = _load(x_ref.at[pl.ds(r0, tm), pl.ds(k0 + i * QBLOCK, QBLOCK)], rmask)
                    acc = acc + dot(xt, c.astype(F32) * scale_values(s, mult))
                return acc
            c = _code_tile(c_ref, g, o0, bo, k0, bk, omask, kblocked)                      # [bo, nkb, 32]
            s = _load(s_ref.at[g, pl.ds(o0, bo), pl.ds(b0, nkb)], omask)                  # [bo, nkb]
            if cfg.lowp_dequant and cd != F32:  # codes and the power-of-two scale in cd: exact products
                w = (c.astype(cd) * scale_values(s, mult).astype(cd)[:, :, None]).reshape(bo, bk)
            else:
                w = (c.astype(F32) * scale_values(s, mult)[:, :, None]).reshape(bo, bk)
            return add_dots(acc, w, k0)

        if cfg.mode == "reduce" and cfg.acc:
            shape = (tm, bo, nkb, QBLOCK) if scaled else (tm, bo, bk)
            acc = lax.fori_loop(0, kr // bk, step, jnp.zeros(shape, F32))
            while acc.ndim > 2:
                acc = jnp.sum(acc, axis=-1)
        else:
            zero = lambda r: jnp.zeros((bo, r) if cfg.wlhs else (r, bo), F32)  # noqa: E731
            acc = lax.fori_loop(0, kr // bk, step, (zero(tm), zero(cfg.tail)) if cfg.tail else zero(tm))
            if cfg.tail:
                main, tail = (a.T for a in acc) if cfg.wlhs else acc
                put(tail, off=tm)
                acc = main
            elif cfg.wlhs:
                acc = acc.T
        put(acc)

    if not cfg.dead_zeros:
        return

    @pl.when(j >= nb_ref[0])  # (not the blocks a split launch leaves to the other one)
    def _skip():
        put(jnp.zeros((tm, bo), F32))
        if cfg.tail:
            put(jnp.zeros((cfg.tail, bo), F32), off=tm)


def _chunk_program(bg_ref, x_ref, c_ref, s_ref, *, live, j, o0, kbase, kr, omask, cfg: Config, mult: float, cd,
                   prec, put, codes_dtype, kblocked: bool = False):
    """The "chunk" mode's program: row ``j`` of ``x`` times the codes of its group over the K
    range ``[kbase, kbase + kr)``, one output tile (see the module docstring). fp8 codes arrive
    as their bytes (``c_ref`` uint8), so that the reads past a range's end can be zero-filled."""
    from jax.experimental import pallas as pl

    tm, bo, bk = cfg.tm, cfg.bo, cfg.bk                                # tm == bk // 32 rows
    kcol = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    sel = lax.broadcasted_iota(jnp.int32, (tm, bk), 1) // QBLOCK == lax.broadcasted_iota(jnp.int32, (tm, bk), 0)
    scol = lax.broadcasted_iota(jnp.int32, (1, tm), 1)
    kend = kbase + kr
    tail = kr % bk != 0  # the last step reads past the range: masked, zero-filled
    dims = (((1,), (1,)), ((), ()))

    @pl.when(live)
    def _compute():
        g = bg_ref[j]

        def codes(c):
            return lax.bitcast_convert_type(c, codes_dtype) if c.dtype != codes_dtype else c

        def slab_sums(k0):
            """K-blocked codes: the step's [tm, bo] partial sums as one dot per 64-input block,
            each block's [bo, 64] codes read as they lie (one contiguous piece; no transpose of
            the step's tile in registers) against its two rows of the block-diagonal tile."""
            kcol64 = lax.broadcasted_iota(jnp.int32, (1, KBLOCK), 1)
            row = lax.broadcasted_iota(jnp.int32, (tm, KBLOCK), 0)
            p = jnp.zeros((tm, bo), F32)
            for i in range(bk // KBLOCK):
                ki = k0 + i * KBLOCK
                kin = (ki + kcol64 < kend) if tail else True
                c = codes(_load_or(c_ref.at[g, ki // KBLOCK, pl.ds(o0, bo), :], omask & kin))   # [bo, 64]
                xr = _load_or(x_ref.at[pl.ds(j, 1), pl.ds(ki, KBLOCK)], kin)                    # [1, 64]
                sel_i = (i * KBLOCK + lax.broadcasted_iota(jnp.int32, (tm, KBLOCK), 1)) // QBLOCK == row
                xb = jnp.where(sel_i, xr, jnp.zeros((), xr.dtype))
                p = p + lax.dot_general(xb.astype(cd), c.astype(cd), dims, precision=prec,
                                        preferred_element_type=F32)
            return p

        def step(kk, acc):
            k0 = pl.multiple_of(kbase + kk * bk, QBLOCK)
            if kblocked:  # (k0: a multiple of 64)
                p = slab_sums(pl.multiple_of(k0, KBLOCK))
            else:
                kin = (k0 + kcol < kend) if tail else True                   # [1, bk] inputs of this range
                c = codes(_load_or(c_ref.at[g, pl.ds(o0, bo), pl.ds(k0, bk)], omask & kin))  # [bo, bk] codes
                xr = _load_or(x_ref.at[pl.ds(j, 1), pl.ds(k0, bk)], kin)                     # [1, bk]
                xb = jnp.where(sel, xr, jnp.zeros((), xr.dtype))                              # [tm, bk] block-diagonal
                p = lax.dot_general(xb.astype(cd), c.astype(cd), dims, precision=prec,
                                    preferred_element_type=F32)                               # [tm, bo] partial sums
            b0 = k0 // QBLOCK
            sb = _load_or(s_ref.at[g, pl.ds(o0, bo), pl.ds(b0, tm)], (omask & (b0 + scol < kend // QBLOCK)) if tail
                          else omask)
            return acc + p * scale_values(sb, mult).T                                     # [tm, bo]

        acc = lax.fori_loop(0, pl.cdiv(kr, bk), step, jnp.zeros((tm, bo), F32))
        put(jnp.sum(acc, axis=0, keepdims=True))

    @pl.when(jnp.logical_not(live))
    def _skip():
        put(jnp.zeros((1, bo), F32))


def _load_or(ref, mask):
    """Masked load with zeros where ``mask`` is False (the chunk mode reads past K ranges)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def _operands(x, block_group, n_blocks, weights, cfg: Config, select=None) -> list:
    """The kernel operands of one problem: n_blocks, block_group, x, then each weight's codes
    (and scale), in the views the inner mode reads."""
    R, K = x.shape
    x_v = x
    ops = []
    for codes, scale in weights:
        G, O, _ = code_dims(codes)
        if is_kblocked(codes):
            codes_v = codes  # the kernel reads K-blocked tiles as they are
        elif scale is not None and not (cfg.mode == "dot" and cfg.split) and cfg.mode != "chunk":
            # 32-input scale blocks as their own axis (free views of contiguous arrays)
            codes_v = codes.reshape(G, O, K // QBLOCK, QBLOCK)
            x_v = x.reshape(R, K // QBLOCK, QBLOCK) if cfg.mode == "reduce" else x
        elif cfg.mode == "chunk" and jnp.issubdtype(codes.dtype, jnp.floating) and codes.dtype.itemsize == 1:
            codes_v = lax.bitcast_convert_type(codes, jnp.uint8)  # fp8 codes as bytes (zero-filled reads)
        else:
            codes_v = codes
        ops += [codes_v] + ([scale] if scale is not None else [])
    sel = [] if select is None else [jnp.asarray(select, jnp.int32)]
    return [jnp.asarray(n_blocks, jnp.int32).reshape(1), block_group.astype(jnp.int32), x_v] + sel + ops


def _out_shapes(R: int, Os, cfg: Config, out_dtype) -> list:
    return [jax.ShapeDtypeStruct((cfg.splitk, R, O), F32) if cfg.splitk > 1 else jax.ShapeDtypeStruct((R, O), out_dtype)
            for O in Os]


def _cost(x, weights, bm: int, out_dtype):
    from jax.experimental import pallas as pl

    R, K = x.shape
    Os = [code_dims(c)[1] for c, _ in weights]
    wbytes = sum(jnp.dtype(c.dtype).itemsize * o * K + (o * K // QBLOCK if s is not None else 0)
                 for o, (c, s) in zip(Os, weights))
    return pl.CostEstimate(flops=2 * R * sum(Os) * K, transcendentals=0,
                           bytes_accessed=R // bm * wbytes + x.nbytes + R * sum(Os) * jnp.dtype(out_dtype).itemsize)


def _finish(ys, cfg: Config, out_dtype) -> tuple:
    if cfg.splitk > 1:  # fp32 partials of the K ranges: one fp32 sum, one rounding
        return tuple(jnp.sum(y, axis=0).astype(out_dtype) for y in ys)
    return tuple(ys)


def _pallas(x, block_group, n_blocks, weights, *, bm, out_dtype, mult, cfg: Config, interpret: bool,
            split_tail=None, prev=()):
    """One ``pallas_call`` for the weights ``[(codes [G, O_i, K], scale or None), ...]`` (same G, K,
    dtypes): their output tiles form one launch. Returns one output per weight. ``split_tail``
    (a ``[R // bm]`` selector, "dot" mode with a tail tile): two launches, the blocks with
    selector 0 on the main row tile only, then those with 1 on both tiles, into the same outputs
    (``prev``: the first launch's outputs, aliased to the second's)."""
    if split_tail is not None and cfg.select < 0 and cfg.tail and cfg.mode == "dot" and cfg.splitk == 1:
        kw = dict(bm=bm, out_dtype=out_dtype, mult=mult, interpret=interpret, split_tail=split_tail)
        first = _pallas(x, block_group, n_blocks, weights, cfg=dataclasses.replace(cfg, tail=0, select=0), **kw)
        return _pallas(x, block_group, n_blocks, weights, cfg=dataclasses.replace(cfg, select=1), prev=first, **kw)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    R, K = x.shape
    codes0 = weights[0][0]
    Os = tuple(int(code_dims(c)[1]) for c, _ in weights)
    nb = R // bm
    kernel = functools.partial(_kernel, cfg=cfg, bm=bm, nb=nb, Os=Os, K=K, scaled=weights[0][1] is not None,
                               mult=mult, cd=x.dtype, out_dtype=out_dtype, codes_dtype=codes0.dtype,
                               kblocked=is_kblocked(codes0))
    n_o = _tile_starts(Os, cfg.bo)[-1]
    grid = (n_o * nb,) if cfg.group_rows else (n_o, nb, cfg.splitk)
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                                                       num_stages=cfg.num_stages))
    ops = _operands(x, block_group, n_blocks, weights, cfg, split_tail if cfg.select >= 0 else None)
    if prev:
        kw["input_output_aliases"] = {len(ops) + i: i for i in range(len(prev))}
    ys = pl.pallas_call(kernel, out_shape=tuple(_out_shapes(R, Os, cfg, out_dtype)), grid=grid, interpret=interpret,
                        cost_estimate=_cost(x, weights, bm, out_dtype), name="grouped_qmatmul",
                        **kw)(*ops, *prev)
    return _finish(ys, cfg, out_dtype)


def _multi_kernel(*refs, metas):
    """A launch over several problems (``grouped_qmatmul_multi``): program ``pid`` of the 1-D
    grid belongs to the problem whose program range holds it and is decoded into that problem's
    (output tile, row block, K range), output tiles fastest, as ``_kernel``'s 3-D grid orders
    them. ``refs``: every problem's operands (``_operands``), then every problem's outputs."""
    from jax.experimental import pallas as pl

    pid = pl.program_id(0)
    ins = sum(m["n_in"] for m in metas)
    i_at, o_at, first = 0, ins, 0
    for m in metas:
        p_in = refs[i_at:i_at + m["n_in"]]
        p_out = refs[o_at:o_at + len(m["Os"])]
        i_at, o_at = i_at + m["n_in"], o_at + len(m["Os"])
        n_o, nb, count = m["n_o"], m["nb"], m["count"]

        @pl.when((pid >= first) & (pid < first + count))
        def _problem(p_in=p_in, p_out=p_out, m=m, first=first, n_o=n_o, nb=nb):
            local = pid - first
            oi, rest = local % n_o, local // n_o
            _weights_program(p_in[0], p_in[1], p_in[2], tuple(p_in[3:]) + tuple(p_out), oi=oi, j=rest % nb,
                             ks=rest // nb, **m["kw"])

        first += count


def _pallas_multi(problems, interpret: bool) -> list:
    """One ``pallas_call`` for several prepared problems (each: x, block_group, n_blocks, weights,
    bm, out_dtype, mult, cfg); one tuple of outputs per problem."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    metas, args, outs, flops, nbytes = [], [], [], 0, 0
    for x, bg, n_blocks, weights, bm, out_dtype, mult, cfg in problems:
        if cfg.group_rows:
            raise ValueError("grouped_qmatmul_multi: the 1-D group_rows launch order runs alone")
        R, K = x.shape
        Os = tuple(int(code_dims(c)[1]) for c, _ in weights)
        nb = R // bm
        n_o = _tile_starts(Os, cfg.bo)[-1]
        ops = _operands(x, bg, n_blocks, weights, cfg)
        kw = dict(cfg=cfg, bm=bm, nb=nb, Os=Os, K=K, scaled=weights[0][1] is not None, mult=mult, cd=x.dtype,
                  out_dtype=out_dtype, codes_dtype=weights[0][0].dtype, kblocked=is_kblocked(weights[0][0]))
        metas.append(dict(n_in=len(ops), Os=Os, n_o=n_o, nb=nb, count=n_o * nb * cfg.splitk, kw=kw))
        args += ops
        outs += _out_shapes(R, Os, cfg, out_dtype)
        c = _cost(x, weights, bm, out_dtype)
        flops, nbytes = flops + c.flops, nbytes + c.bytes_accessed
    cfgs = [p[-1] for p in problems]
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(
        num_warps=max(c.num_warps for c in cfgs), num_stages=max(c.num_stages for c in cfgs)))
    ys = pl.pallas_call(functools.partial(_multi_kernel, metas=tuple(metas)), out_shape=tuple(outs),
                        grid=(sum(m["count"] for m in metas),), interpret=interpret,
                        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=nbytes),
                        name="grouped_qmatmul_multi", **kw)(*args)
    res, at = [], 0
    for p, m in zip(problems, metas):  # p[5]: out dtype, p[7]: Config
        res.append(_finish(ys[at:at + len(m["Os"])], p[7], p[5]))
        at += len(m["Os"])
    return res


def offsets_fit(shape, dtype) -> bool:
    """Whether the Triton lowering addresses an operand of ``shape`` / ``dtype`` correctly.

    JAX's Pallas Triton lowering indexes an operand with 32-bit element offsets unless the
    operand is larger than 2**32 bytes, and Triton adds those offsets to the base pointer as
    signed numbers: an operand of more than 2**31 elements but at most 2**32 bytes is addressed
    wrongly past element 2**31 (an illegal memory access). That is the case of one device's
    half of the V4.1 routed experts on a 2-way expert mesh (192 x 2304 x 5120 int8 = 2.26 GB);
    the whole stack (4.5 GB: 64-bit offsets) and smaller shards are fine."""
    n = math.prod(int(d) for d in shape)
    return not (n > 2**31 and n * jnp.dtype(dtype).itemsize <= 2**32)  # largest offset n - 1 >= 2**31


def kernel_impl(impl: str = "auto") -> str:
    """Resolve ``impl``: ``auto`` -> ``DSV41_QMATMUL_IMPL`` if set, else triton on GPU, xla elsewhere."""
    if impl == "auto":
        impl = os.environ.get("DSV41_QMATMUL_IMPL", "auto")
    if impl not in _IMPLS:
        raise ValueError(f"grouped_qmatmul: impl {impl!r} not in {_IMPLS}")
    if impl == "auto":
        impl = "triton" if jax.default_backend() == "gpu" else "xla"
    return impl


def grouped_qmatmul(x, block_group, n_blocks, codes, scale=None, *, bm: int, out_dtype=None,
                    mult: float | None = None, impl: str = "auto", mode: str = "auto", **tiles):
    """``x`` [R, K] times the weight of group ``block_group[j]`` for every ``bm``-row block ``j``.

    ``codes`` [G, O, K] (or [O, K]): int8 / float8_e4m3fn codes with ``scale`` [G, O, K // 32]
    uint8 ue8m0 bytes (scaled codes may also come K-blocked, [G, K // 64, O, 64]: ``kblock``;
    the same results), or plain float weights with ``scale=None``; the compute dtype is
    ``x.dtype`` (weights are dequantized to it), accumulation fp32, result ``out_dtype``
    (default ``x.dtype``) [R, O]; blocks ``>= n_blocks`` are zeros. ``mode`` / ``tiles``
    (``Config`` fields) tune the kernel; see the module docstring."""
    return grouped_qmatmul_fused(x, block_group, n_blocks, [(codes, scale)], bm=bm, out_dtype=out_dtype,
                                 mult=mult, impl=impl, mode=mode, **tiles)[0]


def _prepare(x, block_group, weights, *, bm: int, out_dtype, mult, impl: str, mode: str, tiles: dict):
    """Checks of one problem -> (weights as [G, O, K] groups, out dtype, code multiplier, impl
    resolved, Config or None on the XLA route)."""
    if not weights:
        raise ValueError("grouped_qmatmul_fused: no weights")
    weights = [_grouped(c, s) for c, s in weights]
    (codes0, scale0) = weights[0]
    R, K, G, O0 = _check(x, block_group, codes0, scale0, bm)
    for codes, scale in weights[1:]:
        _check(x, block_group, codes, scale, bm)
        if (codes.shape[0] != G or codes.dtype != codes0.dtype or (scale is None) != (scale0 is None)
                or is_kblocked(codes) != is_kblocked(codes0)):
            raise ValueError(f"grouped_qmatmul_fused: weights {codes.shape} {codes.dtype} and {codes0.shape} "
                             f"{codes0.dtype} differ in groups, code dtype, scaling or layout")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    mult = default_mult(codes0.dtype) if mult is None else float(mult)
    requested, impl = impl, kernel_impl(impl)
    if impl == "triton" and not (all(offsets_fit(c.shape, c.dtype) for c, _ in weights)
                                 and offsets_fit(x.shape, x.dtype)):
        if requested == "triton":
            bad = next((c for c, _ in weights if not offsets_fit(c.shape, c.dtype)), x)
            raise ValueError(f"grouped_qmatmul: operand {bad.shape} {bad.dtype} falls in the range the Triton "
                             "lowering addresses with overflowing 32-bit offsets (see offsets_fit)")
        impl = "xla"
    cfg = None
    if impl != "xla":
        Os = [code_dims(c)[1] for c, _ in weights]
        cfg = choose_config(bm, max(Os), K, scale0 is not None, mode, nb=R // bm, groups=G, outs=Os,
                            kblocked=is_kblocked(codes0), **tiles)
    return weights, out_dtype, mult, impl, cfg


def _reference_all(x, block_group, n_blocks, weights, bm, out_dtype, mult) -> tuple:
    return tuple(grouped_qmatmul_reference(x, block_group, n_blocks, c, s, bm=bm, out_dtype=out_dtype, mult=mult)
                 for c, s in weights)


def grouped_qmatmul_fused(x, block_group, n_blocks, weights, *, bm: int, out_dtype=None,
                          mult: float | None = None, impl: str = "auto", mode: str = "auto", split_tail=None,
                          **tiles):
    """``grouped_qmatmul`` of one ``x`` against several weights in one kernel launch.

    ``weights``: ``[(codes, scale), ...]``, each as ``grouped_qmatmul`` takes them, all with the
    same groups, K, code dtype and scaling (e.g. an expert's w1 and w3, or the projections that
    read the same normalized hidden state); their output sizes may differ. Returns a tuple with
    one [R, O_i] result per weight, each equal to its own ``grouped_qmatmul`` call (the same
    kernel tiles run on each weight's tiles; only the split-K choice, and so the fp32 summation
    order, may differ). The launch is one grid over all weights' output tiles: small GEMVs
    stream together instead of paying each kernel's ramp-up and tail. ``split_tail`` ``[R // bm]``
    int32 (optional, ``tail_selector``; blocks of a tail tile, e.g. 160 = 128 + 32): 0 marks a
    block whose rows past the main tile are unused: those blocks run in a launch without the tail tile and their tail
    rows are left unwritten; the others follow in a second launch (the XLA route computes all)."""
    weights, out_dtype, mult, impl, cfg = _prepare(x, block_group, weights, bm=bm, out_dtype=out_dtype, mult=mult,
                                                   impl=impl, mode=mode, tiles=tiles)
    if split_tail is not None and jnp.shape(split_tail) != block_group.shape:
        raise ValueError(f"grouped_qmatmul_fused: split_tail {jnp.shape(split_tail)} for {block_group.shape[0]} "
                         "row blocks (tail_selector)")
    if impl == "xla":
        return _reference_all(x, block_group, n_blocks, weights, bm, out_dtype, mult)
    return _pallas(x, block_group, n_blocks, weights, bm=bm, out_dtype=out_dtype, mult=mult, cfg=cfg,
                   interpret=impl == "interpret", split_tail=split_tail)


def grouped_qmatmul_multi(problems, *, impl: str = "auto") -> list:
    """Several independent ``grouped_qmatmul_fused`` problems in one kernel launch.

    ``problems``: a sequence of dicts with the keys ``x``, ``block_group``, ``n_blocks``,
    ``weights``, ``bm`` and optionally ``out_dtype``, ``mult``, ``mode`` and ``tiles`` (a dict of
    ``Config`` fields), each as ``grouped_qmatmul_fused`` takes them. Problems may differ in
    everything: rows, groups, code dtypes, scaling, inner mode (e.g. the decode MoE's routed
    int8 experts in the chunk mode beside the shared expert's fp8 weights in the dot mode).
    Returns one tuple of outputs per problem, each equal to that problem's own
    ``grouped_qmatmul_fused`` call bit for bit (same configuration, same programs). The launch is
    a 1-D grid over all problems' programs, so the small problems stream inside the large one
    instead of paying their own kernel's ramp-up and tail. Problems the Triton kernel cannot
    address (``offsets_fit``) and the XLA route run separately."""
    prepared, results = [], [None] * len(problems)
    for i, p in enumerate(problems):
        unknown = set(p) - {"x", "block_group", "n_blocks", "weights", "bm", "out_dtype", "mult", "mode", "tiles"}
        if unknown:
            raise ValueError(f"grouped_qmatmul_multi: unknown problem keys {sorted(unknown)}")
        weights, out_dtype, mult, p_impl, cfg = _prepare(p["x"], p["block_group"], p["weights"], bm=p["bm"],
                                                         out_dtype=p.get("out_dtype"), mult=p.get("mult"), impl=impl,
                                                         mode=p.get("mode", "auto"), tiles=p.get("tiles", {}))
        args = (p["x"], p["block_group"], p["n_blocks"], weights, p["bm"], out_dtype, mult)
        if p_impl == "xla":
            results[i] = _reference_all(*args)
        else:
            prepared.append((i, p_impl, args + (cfg,)))
    impls = {m for _, m, _ in prepared}
    if len(prepared) == 1 or len(impls) > 1:
        for i, m, args in prepared:
            results[i] = _pallas(*args[:4], bm=args[4], out_dtype=args[5], mult=args[6], cfg=args[7],
                                 interpret=m == "interpret")
    elif prepared:
        outs = _pallas_multi([a for _, _, a in prepared], interpret=impls == {"interpret"})
        for (i, _, _), o in zip(prepared, outs):
            results[i] = o
    return results
