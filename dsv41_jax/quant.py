"""Exact fp8 / fp4 / ue8m0 codecs and the QAT fake-quant operators of DeepSeek-V4.1.

Everything here is exact: decoding is a table lookup or a power-of-two multiply, and every
rounding is done with integer bit manipulation or with an fp32 multiply by an exact power of two
followed by round-half-to-even. Nothing relies on the backend's float8 conversion, on ``log2``,
or on ``x / const`` (XLA rewrites a division by a constant into a multiply by its rounded
reciprocal, which changes results).

Formats (decoder_spec §10, golden README):

* E8M0 scale byte ``b``: ``2^(b-127)``; ``b = 0`` is ``2^-127`` (an fp32 subnormal), ``b = 255`` NaN.
* FP8 weight: E4M3 ``[out, in]`` times one E8M0 scale per ``B x B`` tile, ``[ceil(out/B), ceil(in/B)]``.
* FP4 expert: int8 ``[out, in/2]``, element ``2c`` in the low nibble of byte ``c``, code bit 3 is
  the sign, magnitudes ``FP4_GRID``; one E8M0 scale per 32 inputs, ``[out, in/32]``.
* Engram table row: E4M3 ``[.., D]`` times one E8M0 scale per 32 columns, ``[.., D/32]``.

Fake-quant operators (decoder_spec §3.4, REF41 ``kernel_cpu`` and HF41 ``_fake_quant_*``) work on
blocks of ``block`` consecutive elements of the last axis, compute in fp32 and return ``x.dtype``:

* ``fq_fp8``  : ``amax = max(|blk|, 1e-4)``;      ``s = pow2ceil(amax * f32(1/448))``; ``q = e4m3(clip(blk/s, ±448))``
* ``fq_fp4_e8``: ``amax = max(|blk|, 6*2^-126)``; ``s = pow2ceil(amax * f32(1/6))``;   ``q = e2m1(clip(blk/s, ±6))``
* ``fq_fp4_e4``: ``amax = max(|blk|, 6*2^-9)``;   ``s = e4m3(clip(amax / 6, ±448))``;  ``q = e2m1(clip(blk/s, ±6))``

The power-of-two scales multiply ``amax`` by the fp32 reciprocal constant (``1/448``, ``1/6``), as
the kernels and both references do; the e4m3 scale divides by 6 (correctly rounded). Rounding onto
e4m3 / e2m1 is round-to-nearest-even on the code (e2m1 ties 0.25, 1.25, 2.5, 5 go down; 0.75,
1.75, 3.5 go up). If the last axis is not a multiple of ``block`` the operator is the identity
(HF41's rule for tiny configs; the official kernels assert instead). Caveat: XLA flushes fp32
subnormal inputs to zero on CPU and GPU, while the torch reference keeps them; this can only change
blocks whose amax is below ~2^-100.

NumPy twins (suffix ``_np``) run the same algorithm on the host; they back the encoders used to
write test checkpoints.
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

F32 = np.float32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# fp32 reciprocal constants, exactly as the kernels use them (K41 fp8_max_inv / fp4_max_inv)
INV_E4M3_MAX = np.float32(1.0 / E4M3_MAX)
INV_E2M1_MAX = np.float32(1.0 / E2M1_MAX)
FP8_AMAX_FLOOR = 1e-4
FP4_E8_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4_AMAX_FLOOR = 6.0 * 2.0**-9

# e2m1 magnitudes by 3-bit code; the 4-bit table has the sign in bit 3 (-0 at code 8)
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F32)
FP4_LUT = np.concatenate([FP4_GRID, -FP4_GRID]).astype(F32)

_E4M3 = ml_dtypes.float8_e4m3fn
_E8M0 = ml_dtypes.float8_e8m0fnu
# minifloat parameters: (mantissa bits, minimum normal exponent)
_E4M3_FMT = (3, -6)
_E2M1_FMT = (1, 0)


# ----------------------------------------------------------------------------------------------
# raw bytes and E8M0
# ----------------------------------------------------------------------------------------------

def raw_u8(arr) -> np.ndarray:
    """View a 1-byte array (uint8, int8, ml_dtypes float8_*) as uint8, without a numeric cast."""
    a = np.asarray(arr)
    if a.dtype.itemsize != 1:
        raise TypeError(f"raw_u8: expected a 1-byte dtype, got {a.dtype}")
    return a.view(np.uint8)


def _u8_jax(arr) -> jax.Array:
    """The jnp twin of ``raw_u8`` (bitcast, never a numeric cast)."""
    a = jnp.asarray(arr)
    if a.dtype == jnp.uint8:
        return a
    if a.dtype.itemsize != 1:
        raise TypeError(f"expected a 1-byte dtype, got {a.dtype}")
    return lax.bitcast_convert_type(a, jnp.uint8)


def _e8m0_bits(b, xp):
    b = b.astype(xp.uint32)
    bits = b << 23
    bits = xp.where(b == 0, xp.uint32(0x00400000), bits)  # 2^-127 is the subnormal 0x00400000
    return xp.where(b == 255, xp.uint32(0x7FC00000), bits)  # 0xFF is NaN in E8M0


def e8m0_to_f32(b) -> np.ndarray:
    """E8M0 bytes (uint8, or ml_dtypes float8_e8m0fnu read raw) -> float32 ``2^(b-127)``, exact."""
    return _e8m0_bits(raw_u8(b), np).view(F32)


@jax.jit
def e8m0_to_f32_jax(b) -> jax.Array:
    """jnp twin of ``e8m0_to_f32``. Byte 0 gives the fp32 subnormal 2^-127; a backend that flushes
    subnormals will turn products with it into 0 (no released scale is that small)."""
    return lax.bitcast_convert_type(_e8m0_bits(_u8_jax(b), jnp), jnp.float32)


def f32_to_e8m0(s) -> np.ndarray:
    """Power-of-two fp32 scales (normal, 2^-126..2^127) -> E8M0 bytes (uint8)."""
    s = np.asarray(s, dtype=F32)
    bits = s.view(np.uint32)
    if np.any(bits & 0x807FFFFF) or np.any(bits == 0):
        raise ValueError("f32_to_e8m0: every scale must be a positive normal power of two")
    return (bits >> 23).astype(np.uint8)


def e4m3_to_f32(w) -> np.ndarray:
    """E4M3 values (ml_dtypes float8_e4m3fn, or its raw uint8 bits) -> float32, exact."""
    return raw_u8(w).view(_E4M3).astype(F32)


@jax.jit
def e4m3_to_f32_jax(w) -> jax.Array:
    """jnp twin of ``e4m3_to_f32`` (input float8_e4m3fn, or uint8 / int8 bits)."""
    w = jnp.asarray(w)
    if w.dtype != jnp.float8_e4m3fn:
        w = lax.bitcast_convert_type(_u8_jax(w), jnp.float8_e4m3fn)
    return w.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# exact scalar building blocks (shared by the numpy and jnp paths through ``xp``)
# ----------------------------------------------------------------------------------------------

def _bits_i32(x, xp):
    return x.view(np.int32) if xp is np else lax.bitcast_convert_type(x, jnp.int32)


def _from_bits_i32(b, xp):
    b = b.astype(xp.int32)
    return b.view(F32) if xp is np else lax.bitcast_convert_type(b, jnp.float32)


def _pow2(k, xp):
    """2^k as fp32 for integer k in [-126, 127], built from the exponent field."""
    return _from_bits_i32((k + 127) << 23, xp)


def _pow2ceil_exp(t, xp):
    """ceil(log2 t) from the fp32 bits of t > 0: exponent - 127 + (mantissa != 0) (K41 fast_round_scale)."""
    bits = _bits_i32(t, xp)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    return e - 127 + (m != 0).astype(xp.int32)


def pow2ceil(t, xp=jnp):
    """2^ceil(log2 t) for fp32 t > 0, from the bits (never log2). ``xp`` is jnp or numpy."""
    t = xp.asarray(t, dtype=xp.float32)
    return _pow2(_pow2ceil_exp(t, xp), xp)


def rint_even(a):
    """Round-half-even of fp32 ``0 <= a < 2^23`` to an integer (as fp32) without a rounding op
    (Pallas' Triton lowering has none): the truncation ``t`` is exact, so is ``a - t``; round up
    above one half, and at one half when ``t`` is odd. Same values as ``jnp.round`` there. (The
    ``(a + 2^23) - 2^23`` trick is no good: XLA's simplifier folds it to ``a``.)"""
    t = a.astype(jnp.int32)
    f = a - t.astype(jnp.float32)
    up = (f > 0.5) | ((f == 0.5) & ((t & 1) == 1))
    return (t + up.astype(jnp.int32)).astype(jnp.float32)


def _round_minifloat(v, fmt, xp, rint=None):
    """Round fp32 ``v`` (already clipped into the format's range) to the nearest value of a
    minifloat with ``mbits`` mantissa bits and minimum normal exponent ``emin``, ties to even.

    The quantum at |v| is 2^(max(e, emin) - mbits); scaling by its inverse is exact, so
    round-half-even on the scaled value is RNE on the code. The sign (also of zero) is kept.
    ``rint``: the round-half-even of the scaled magnitude (default ``xp.round``; kernels pass
    :func:`rint_even`: the scaled magnitudes are below 2^(mbits + 1)).
    """
    mbits, emin = fmt
    a = xp.abs(v)
    e = ((_bits_i32(a, xp) >> 23) & 0xFF) - 127
    k = xp.maximum(e, emin) - mbits
    r = (xp.round if rint is None else rint)(a * _pow2(-k, xp)) * _pow2(k, xp)
    return xp.copysign(r, v)


def e4m3_rne(v, xp=jnp):
    """fp32 -> nearest float8_e4m3fn value (as fp32), RNE, saturating at ±448."""
    v = xp.asarray(v, dtype=xp.float32)
    return _round_minifloat(xp.clip(v, -E4M3_MAX, E4M3_MAX), _E4M3_FMT, xp)


def e2m1_rne(v, xp=jnp):
    """fp32 -> nearest e2m1 value (as fp32), RNE on the code, saturating at ±6."""
    v = xp.asarray(v, dtype=xp.float32)
    return _round_minifloat(xp.clip(v, -E2M1_MAX, E2M1_MAX), _E2M1_FMT, xp)


def _div6(a, xp):
    """Correctly rounded fp32 ``a / 6`` for positive normal fp32 ``a`` with a/6 normal.

    numpy divides directly; under XLA ``a / 6.0`` becomes ``a * f32(1/6)`` (off by an ulp for a
    third of inputs), so the quotient is formed in integers: a/6 = (4M/3) * 2^(E-153) with the
    24-bit significand M, quotient Q and remainder R, then rounded to 24 bits, ties to even.
    """
    if xp is np:
        return (np.asarray(a, dtype=F32) / F32(6.0)).astype(F32)
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    e = (bits >> 23) & 0xFF
    n = ((bits & 0x7FFFFF) | 0x800000) << 2  # 4M < 2^26
    q = n // 3
    r = n - 3 * q
    big = q >= (1 << 24)  # 25-bit quotient: drop one bit
    tie_or_above = (q & 1) == 1
    round_up_big = tie_or_above & ((r != 0) | (((q >> 1) & 1) == 1))
    mant_big = (q >> 1) + round_up_big.astype(jnp.uint32)
    mant_small = q + (r == 2).astype(jnp.uint32)  # remainder 2/3 of an ulp rounds up, 1/3 down
    mant = jnp.where(big, mant_big, mant_small)
    k = e.astype(jnp.int32) - 153 + big.astype(jnp.int32)
    return mant.astype(jnp.float32) * _pow2(k, jnp)


def _div_by_e4m3(x, s, xp):
    """``fp32(x / s)`` for an e4m3-valued scale ``s > 0``, exact where it matters for e2m1 rounding.

    numpy divides directly. XLA turns ``x / broadcast(s)`` into ``x * broadcast(1/s)`` (off by an
    ulp, which moves e2m1 ties), so the quotient of the 24-bit significand of |x| by the 4-bit
    significand of s is formed in integers and rounded to 24 bits, ties to even. Quotients below
    0.25 are returned as 0 and above 6 as 8 (both round to the same e2m1 code as the exact value).
    """
    if xp is np:
        return (np.asarray(x, dtype=F32) / s).astype(F32)
    xb = lax.bitcast_convert_type(jnp.abs(x), jnp.uint32)
    sb = lax.bitcast_convert_type(s, jnp.uint32)
    ex = ((xb >> 23) & 0xFF).astype(jnp.int32)
    es = ((sb >> 23) & 0xFF).astype(jnp.int32)
    ms = ((sb & 0x7FFFFF) | 0x800000) >> 20  # 8..15: e4m3 values have at most 4 significant bits
    n = ((xb & 0x7FFFFF) | 0x800000) << 5  # < 2^29
    q = n // ms  # 25 or 26 bits: x/s = q * 2^(ex - es - 25) (+ remainder)
    r = n - q * ms
    d = jnp.where(q >= (1 << 25), jnp.uint32(2), jnp.uint32(1))
    mant = q >> d
    rem = q & ((jnp.uint32(1) << d) - 1)
    half = jnp.uint32(1) << (d - 1)
    up = (rem > half) | ((rem == half) & ((r != 0) | ((mant & 1) == 1)))
    mant = mant + up.astype(jnp.uint32)
    de = ex - es
    k = jnp.clip(de - 25 + d.astype(jnp.int32), -126, 127)
    val = mant.astype(jnp.float32) * _pow2(k, jnp)
    val = jnp.where(de >= 4, jnp.float32(8.0), jnp.where(de <= -3, jnp.float32(0.0), val))
    return jnp.copysign(val, x)


# ----------------------------------------------------------------------------------------------
# fake-quant operators (jnp, jit-able) and their numpy twins
# ----------------------------------------------------------------------------------------------

def _fq_blocks(x, block: int, kind: str, xp):
    n = x.shape[-1]
    if n % block:
        return x  # shapes the reference cannot block (tiny configs) pass through unquantized
    xb = xp.asarray(x).astype(xp.float32).reshape(*x.shape[:-1], n // block, block)
    amax = xp.max(xp.abs(xb), axis=-1, keepdims=True)
    if kind == "fp4_e4":
        amax = xp.maximum(amax, xp.float32(FP4_E4_AMAX_FLOOR))
        s = e4m3_rne(_div6(amax, xp), xp)
        q = e2m1_rne(_div_by_e4m3(xb, s, xp), xp)
        return (q * s).reshape(x.shape).astype(x.dtype)
    return _fq_pow2_scaled(xb, amax, kind, xp).reshape(x.shape).astype(x.dtype)


def _fq_pow2_scaled(xb, amax, kind: str, xp, rint=None):
    """The power-of-two-scale fake quant (``kind`` "fp8" or "fp4_e8") of fp32 blocks ``xb``
    [..., block] given each block's ``max(|xb|)`` ``amax`` [..., 1]: dequantized fp32 values.
    Shared with the kernels' fused act-quant (``kernel_fp8_round``): ``rint`` replaces the
    round-half-even of the scaled magnitudes, or is ``"cast"`` (fp8 only): the clipped scaled
    block cast to float8_e4m3fn and back, the same values."""
    if kind == "fp8":
        floor, inv, fmt, lim = FP8_AMAX_FLOOR, INV_E4M3_MAX, _E4M3_FMT, E4M3_MAX
    else:
        floor, inv, fmt, lim = FP4_E8_AMAX_FLOOR, INV_E2M1_MAX, _E2M1_FMT, E2M1_MAX
    amax = xp.maximum(amax, xp.float32(floor))
    k = _pow2ceil_exp(amax * xp.float32(inv), xp)
    # dividing by a power of two == multiplying by its exact inverse
    v = xp.clip(xb * _pow2(-k, xp), -lim, lim)
    if isinstance(rint, str):
        if rint != "cast" or kind != "fp8" or xp is np:
            raise ValueError(f"_fq_pow2_scaled: rint={rint!r} is for kind 'fp8' on jnp only")
        q = v.astype(jnp.float8_e4m3fn).astype(F32)
    else:
        q = _round_minifloat(v, fmt, xp, rint)
    return q * _pow2(k, xp)


def fq_fp8_blocks_cast(xb, amax):
    """``_fq_pow2_scaled(xb, amax, "fp8", jnp)`` with the e4m3 rounding done by a dtype
    conversion: the scaled block, clipped into the e4m3 range, is cast to float8_e4m3fn (round to
    nearest even: XLA's conversion, or one ``cvt.rn.satfinite`` per two values in a Triton kernel)
    and back. The same values; far fewer instructions than the arithmetic rounding, which is what
    the kernels' epilogues use it for (``kernel_fp8_round``)."""
    return _fq_pow2_scaled(xb, amax, "fp8", jnp, rint="cast")


def kernel_fp8_round():
    """How the Pallas kernels' fused fp8 activation quantizations (``moe_glu``'s epilogue,
    ``norm_quant``) round to e4m3, as a function ``(blocks fp32 [..., 32], amax [..., 1]) ->
    values``: ``DSV41_KERNEL_FP8_ROUND`` = ``cast`` (default: :func:`fq_fp8_blocks_cast`) or
    ``arith`` (``_fq_pow2_scaled`` with :func:`rint_even`, the session-17 form; A/B runs). Both
    give the values of ``act_quant_fp8``. Read at trace time."""
    mode = os.environ.get("DSV41_KERNEL_FP8_ROUND", "cast")
    if mode not in ("cast", "arith"):
        raise ValueError(f"DSV41_KERNEL_FP8_ROUND={mode!r}: use cast or arith")
    if mode == "cast":
        return fq_fp8_blocks_cast
    return lambda xb, amax: _fq_pow2_scaled(xb, amax, "fp8", jnp, rint=rint_even)


@functools.partial(jax.jit, static_argnames=("block",))
def fq_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """fp8 e4m3 fake quant with a ue8m0 scale per ``block`` along the last axis (window-KV QDQ).

    Returns ``x.dtype``; identity when ``x.shape[-1] % block != 0``.
    """
    return _fq_blocks(jnp.asarray(x), block, "fp8", jnp)


@functools.partial(jax.jit, static_argnames=("block",))
def fq_fp4_e8(x: jax.Array, block: int = 32) -> jax.Array:
    """fp4 e2m1 fake quant with a ue8m0 scale per ``block`` (indexer q/k QDQ).

    Returns ``x.dtype``; identity when ``x.shape[-1] % block != 0``.
    """
    return _fq_blocks(jnp.asarray(x), block, "fp4_e8", jnp)


@functools.partial(jax.jit, static_argnames=("block",))
def fq_fp4_e4(x: jax.Array, block: int = 16) -> jax.Array:
    """fp4 e2m1 fake quant with an e4m3 scale per ``block`` (compressed-KV QDQ).

    Returns ``x.dtype``; identity when ``x.shape[-1] % block != 0``.
    """
    return _fq_blocks(jnp.asarray(x), block, "fp4_e4", jnp)


@functools.partial(jax.jit, static_argnames=("block",))
def act_quant_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """Activation quantization before an fp8/fp4 GEMM (REF41 ``act_quant`` with ue8m0 scales),
    returned dequantized: same values as ``fq_fp8``. The GEMM against the dequantized weight then
    equals the block-scaled kernel up to fp32 summation order.

    Returns ``x.dtype`` (the values are exact in bf16); identity when ``x.shape[-1] % block != 0``.
    """
    return _fq_blocks(jnp.asarray(x), block, "fp8", jnp)


def fq_fp8_np(x: np.ndarray, block: int = 32) -> np.ndarray:
    """NumPy twin of ``fq_fp8``."""
    return _fq_blocks(np.asarray(x), block, "fp8", np)


def fq_fp4_e8_np(x: np.ndarray, block: int = 32) -> np.ndarray:
    """NumPy twin of ``fq_fp4_e8``."""
    return _fq_blocks(np.asarray(x), block, "fp4_e8", np)


def fq_fp4_e4_np(x: np.ndarray, block: int = 16) -> np.ndarray:
    """NumPy twin of ``fq_fp4_e4``."""
    return _fq_blocks(np.asarray(x), block, "fp4_e4", np)


# ----------------------------------------------------------------------------------------------
# checkpoint dequantization
# ----------------------------------------------------------------------------------------------

def _block2(block) -> tuple[int, int]:
    if isinstance(block, (int, np.integer)):
        return int(block), int(block)
    bo, bi = block
    return int(bo), int(bi)


def _expand_tiles(s, shape, bo: int, bi: int, xp):
    out, inn = shape[-2], shape[-1]
    want = (-(-out // bo), -(-inn // bi))
    if tuple(s.shape[-2:]) != want:
        raise ValueError(f"scale shape {tuple(s.shape)} does not tile weight {tuple(shape)} by {bo}x{bi} "
                         f"(expected {want})")
    s = xp.repeat(xp.repeat(s, bo, axis=-2), bi, axis=-1)
    return s[..., :out, :inn]


def dequant_fp8_blocks(w_e4m3, scale_e8m0, block: int | Sequence[int] = 32) -> np.ndarray:
    """FP8 block weight -> float32: ``W[o, i] = e4m3(w[o, i]) * 2^(s[o//Bo, i//Bi] - 127)``.

    ``w_e4m3``: float8_e4m3fn (or uint8 bits) ``[..., out, in]``; ``scale_e8m0``: uint8 (or
    float8_e8m0fnu) ``[..., ceil(out/Bo), ceil(in/Bi)]``. ``block`` is 32 (V4.1), 128 (V4) or
    ``(Bo, Bi)``. Exact.
    """
    bo, bi = _block2(block)
    w = e4m3_to_f32(w_e4m3)
    return w * _expand_tiles(e8m0_to_f32(scale_e8m0), w.shape, bo, bi, np)


@functools.partial(jax.jit, static_argnames=("block",))
def dequant_fp8_blocks_jax(w_e4m3, scale_e8m0, block: int | Sequence[int] = 32) -> jax.Array:
    """jnp twin of ``dequant_fp8_blocks``."""
    bo, bi = _block2(block)
    w = e4m3_to_f32_jax(w_e4m3)
    return w * _expand_tiles(e8m0_to_f32_jax(scale_e8m0), w.shape, bo, bi, jnp)


def fp4_codes(packed) -> np.ndarray:
    """int8/uint8 ``[..., n/2]`` -> uint8 4-bit codes ``[..., n]`` (low nibble = element 2c)."""
    u = raw_u8(packed)
    return np.stack([u & 0x0F, u >> 4], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])


def unpack_fp4(packed) -> np.ndarray:
    """Packed e2m1 bytes ``[..., n/2]`` (int8 / uint8) -> float32 values ``[..., n]``."""
    return FP4_LUT[fp4_codes(packed)]


@jax.jit
def unpack_fp4_jax(packed) -> jax.Array:
    """jnp twin of ``unpack_fp4``."""
    u = _u8_jax(packed)
    codes = jnp.stack([u & 0x0F, u >> 4], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])
    return jnp.asarray(FP4_LUT)[codes.astype(jnp.int32)]


def dequant_fp4_experts(packed, scale_e8m0, block: int = 32) -> np.ndarray:
    """FP4 expert weight -> float32: ``W[o, i] = LUT[code(o, i)] * 2^(s[o, i//32] - 127)``.

    ``packed``: int8 ``[..., out, in/2]``; ``scale_e8m0``: uint8 ``[..., out, in/32]``. Exact.
    """
    w = unpack_fp4(packed)
    s = e8m0_to_f32(scale_e8m0)
    if s.shape[:-1] != w.shape[:-1] or s.shape[-1] * block != w.shape[-1]:
        raise ValueError(f"fp4 scale shape {s.shape} does not match weight {w.shape} (block {block})")
    return w * np.repeat(s, block, axis=-1)


@functools.partial(jax.jit, static_argnames=("block",))
def dequant_fp4_experts_jax(packed, scale_e8m0, block: int = 32) -> jax.Array:
    """jnp twin of ``dequant_fp4_experts``."""
    w = unpack_fp4_jax(packed)
    s = e8m0_to_f32_jax(scale_e8m0)
    if s.shape[:-1] != w.shape[:-1] or s.shape[-1] * block != w.shape[-1]:
        raise ValueError(f"fp4 scale shape {s.shape} does not match weight {w.shape} (block {block})")
    return w * jnp.repeat(s, block, axis=-1)


def dequant_engram_rows(rows_e4m3, rows_scale_u8, block: int = 32) -> np.ndarray:
    """Engram table rows -> float32: ``row[j] = e4m3(w[j]) * 2^(s[j//32] - 127)``.

    ``rows_e4m3``: float8_e4m3fn or uint8 bits ``[..., D]``; ``rows_scale_u8``: ``[..., D/32]``.
    """
    w = e4m3_to_f32(rows_e4m3)
    s = e8m0_to_f32(rows_scale_u8)
    d = w.shape[-1]
    if d % block or s.shape != w.shape[:-1] + (d // block,):
        raise ValueError(f"engram scale shape {s.shape} does not match rows {w.shape} (block {block})")
    return (w.reshape(*w.shape[:-1], d // block, block) * s[..., None]).reshape(w.shape)


@functools.partial(jax.jit, static_argnames=("block",))
def dequant_engram_rows_jax(rows_e4m3, rows_scale_u8, block: int = 32) -> jax.Array:
    """jnp twin of ``dequant_engram_rows`` (for the jitted lookup; gather the rows first).

    ``rows_e4m3``: jnp float8_e4m3fn or uint8 bits; ``rows_scale_u8``: uint8 (or float8_e8m0fnu).
    """
    w = e4m3_to_f32_jax(rows_e4m3)
    s = e8m0_to_f32_jax(rows_scale_u8)
    d = w.shape[-1]
    if d % block or tuple(s.shape) != tuple(w.shape[:-1]) + (d // block,):
        raise ValueError(f"engram scale shape {s.shape} does not match rows {w.shape} (block {block})")
    return (w.reshape(*w.shape[:-1], d // block, block) * s[..., None]).reshape(w.shape)


# ----------------------------------------------------------------------------------------------
# encoders (numpy; for writing test checkpoints)
# ----------------------------------------------------------------------------------------------

def quantize_fp8_blocks(w, block: int | Sequence[int] = 32) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[out, in]`` -> (float8_e4m3fn ``[out, in]``, uint8 E8M0 ``[ceil(out/Bo), ceil(in/Bi)]``).

    Per tile: ``amax = max(|tile|, 1e-4)``, ``s = pow2ceil(amax * f32(1/448))``,
    ``q = e4m3_rne(clip(w / s, ±448))``. Edge tiles (ceil-div) use only their real elements.
    With ``block=(1, B)`` the dequantized result equals ``fq_fp8_np(w, B)``.
    """
    bo, bi = _block2(block)
    w = np.asarray(w).astype(F32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_blocks: expected a 2-D weight, got shape {w.shape}")
    out, inn = w.shape
    ro, ri = -(-out // bo), -(-inn // bi)
    padded = np.zeros((ro * bo, ri * bi), F32)
    padded[:out, :inn] = np.abs(w)
    amax = padded.reshape(ro, bo, ri, bi).max(axis=(1, 3))
    amax = np.maximum(amax, F32(FP8_AMAX_FLOOR))
    k = _pow2ceil_exp(amax * INV_E4M3_MAX, np)
    inv = _expand_tiles(_pow2(-k, np), w.shape, bo, bi, np)
    q = e4m3_rne(w * inv, np)
    return q.astype(_E4M3), (k + 127).astype(np.uint8)


def e2m1_codes_np(v) -> np.ndarray:
    """fp32 values -> 4-bit e2m1 codes (uint8, sign in bit 3), rounding RNE and saturating at ±6."""
    r = e2m1_rne(np.asarray(v, dtype=F32), np)
    mag = np.searchsorted(FP4_GRID, np.abs(r)).astype(np.uint8)
    return mag | (np.signbit(r).astype(np.uint8) << 3)


def pack_fp4(values) -> np.ndarray:
    """e2m1 values ``[..., n]`` (rounded RNE onto the grid) -> int8 ``[..., n/2]``, element 2c in
    the low nibble."""
    codes = e2m1_codes_np(values)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {codes.shape[-1]} is odd")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)


def quantize_fp4_blocks(w, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[..., out, in]`` -> (int8 packed ``[..., out, in/2]``, uint8 E8M0 ``[..., out, in/32]``).

    Per 32 inputs: ``amax = max(|blk|, 6*2^-126)``, ``s = pow2ceil(amax * f32(1/6))``,
    ``q = e2m1_rne(clip(w / s, ±6))``; the dequantized result equals ``fq_fp4_e8_np(w, 32)``.
    """
    w = np.asarray(w).astype(F32)
    n = w.shape[-1]
    if n % block:
        raise ValueError(f"quantize_fp4_blocks: last dim {n} is not a multiple of {block}")
    wb = w.reshape(*w.shape[:-1], n // block, block)
    amax = np.maximum(np.abs(wb).max(axis=-1, keepdims=True), F32(FP4_E8_AMAX_FLOOR))
    k = _pow2ceil_exp(amax * INV_E2M1_MAX, np)
    q = e2m1_rne(wb * _pow2(-k, np), np).reshape(w.shape)
    return pack_fp4(q), (k[..., 0] + 127).astype(np.uint8)
