"""Closed-form and reference tests for dsv41_jax.quant (codecs and fake-quant operators)."""
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from dsv41_jax import quant as Q

F32 = np.float32
BF16 = ml_dtypes.bfloat16
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

E4M3_POS = np.unique(np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32))  # 0..448
E2M1_TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def _up(x):
    return np.nextafter(F32(x), F32(np.inf))


def _down(x):
    return np.nextafter(F32(x), F32(-np.inf))


def _same_bits(a, b):
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ------------------------------------------------------------------------------------------------
# E8M0, raw bytes, pow2ceil
# ------------------------------------------------------------------------------------------------

def test_e8m0_bytes():
    b = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)
    want = np.array([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127, np.nan], np.float64).astype(F32)
    for got in (Q.e8m0_to_f32(b), np.asarray(Q.e8m0_to_f32_jax(b)), np.asarray(jax.jit(Q.e8m0_to_f32_jax)(b))):
        assert got.dtype == F32
        np.testing.assert_array_equal(got[:-1], want[:-1])
        assert np.isnan(got[-1])
    assert Q.e8m0_to_f32(np.uint8(0)).view(np.uint32) == 0x00400000  # the subnormal 2^-127, not 0
    allb = np.arange(255, dtype=np.uint8)
    np.testing.assert_array_equal(Q.e8m0_to_f32(allb), np.ldexp(1.0, allb.astype(int) - 127).astype(F32))
    np.testing.assert_array_equal(Q.f32_to_e8m0(Q.e8m0_to_f32(allb[1:])), allb[1:])
    with pytest.raises(ValueError):
        Q.f32_to_e8m0(np.float32([3.0]))


def test_raw_u8_reads_bytes_not_values():
    b = np.array([0, 120, 127, 200], np.uint8)
    e = b.view(ml_dtypes.float8_e8m0fnu)
    assert np.array_equal(Q.raw_u8(e), b)
    assert np.array_equal(Q.raw_u8(b.view(np.int8)), b)
    np.testing.assert_array_equal(Q.e8m0_to_f32(e), Q.e8m0_to_f32(b))
    np.testing.assert_array_equal(np.asarray(Q.e8m0_to_f32_jax(jnp.asarray(e))), Q.e8m0_to_f32(b))
    with np.errstate(invalid="ignore"):
        assert not np.array_equal(e.astype(np.uint8), b)  # a numeric cast would be wrong
    with pytest.raises(TypeError):
        Q.raw_u8(np.zeros(3, np.float32))


def test_pow2ceil_powers_and_neighbours():
    ks = np.arange(-120, 120)
    p = np.ldexp(F32(1), ks).astype(F32)
    cases = [(p, p), (_up(p), np.ldexp(F32(1), ks + 1).astype(F32)), (_down(p), p),
             (F32(3.0), F32(4.0)), (F32(0.75), F32(1.0)), (F32(448 * 1.5), F32(1024))]
    for t, want in cases:
        for xp in (np, jnp):
            np.testing.assert_array_equal(np.asarray(Q.pow2ceil(t, xp)), want)
    assert Q.pow2ceil(np.float32(1e-40), np) == F32(2.0**-126)  # subnormal input


# ------------------------------------------------------------------------------------------------
# minifloat rounding
# ------------------------------------------------------------------------------------------------

def test_e4m3_rne_boundaries():
    mids = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2
    v = np.concatenate([E4M3_POS, mids, _up(mids), _down(mids), [449, 464, 480, 1e6, np.inf, 2.0**-10, 1e-40]])
    v = np.concatenate([v, -v]).astype(F32)
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    for got in (Q.e4m3_rne(v, np), np.asarray(Q.e4m3_rne(v)), np.asarray(jax.jit(Q.e4m3_rne)(v))):
        assert _same_bits(got, want)
    # ties to even on the code: 1.0625 -> 1.0, 1.1875 -> 1.25, 2^-10 -> 0, 3*2^-10 -> 2^-8, 464 -> 448
    t = np.array([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 464.0, 240.0 + 8], F32)
    np.testing.assert_array_equal(Q.e4m3_rne(t, np), np.array([1.0, 1.25, 0.0, 2.0**-8, 448, 256], F32))


def test_fp8_blocks_cast_equals_the_arithmetic_rounding(monkeypatch):
    """``fq_fp8_blocks_cast`` (the kernels' e4m3 rounding by a dtype conversion) gives the bits of
    ``act_quant_fp8`` and of ``_fq_pow2_scaled`` with ``rint_even``: every e4m3 value, the
    midpoints between neighbours and their fp32 neighbours, at block scales from 2^-120 to 2^100,
    signed zeros, blocks of zeros and of fp32 subnormals; ``kernel_fp8_round`` picks the form."""
    mids = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2
    grid = np.concatenate([E4M3_POS, mids, _up(mids), _down(mids)])
    grid = np.concatenate([grid, -grid, [-0.0]]).astype(F32)
    pad = -grid.size % 32
    base = np.concatenate([grid, np.zeros(pad, F32)]).reshape(-1, 32)
    blocks = [base * F32(2.0 ** e) for e in (-120, -60, -9, 0, 7, 100)]
    blocks += [np.zeros((1, 32), F32), np.full((1, 32), 1e-40, F32)]
    xb = jnp.asarray(np.concatenate(blocks))
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    got = np.asarray(jax.jit(Q.fq_fp8_blocks_cast)(xb, amax))
    assert _same_bits(got, np.asarray(Q._fq_pow2_scaled(xb, amax, "fp8", jnp, rint=Q.rint_even)))
    assert _same_bits(got, np.asarray(Q.act_quant_fp8(xb.reshape(-1), 32)).reshape(got.shape))
    monkeypatch.setenv("DSV41_KERNEL_FP8_ROUND", "arith")
    assert _same_bits(np.asarray(Q.kernel_fp8_round()(xb, amax)), got)
    monkeypatch.setenv("DSV41_KERNEL_FP8_ROUND", "cast")
    assert Q.kernel_fp8_round() is Q.fq_fp8_blocks_cast
    monkeypatch.setenv("DSV41_KERNEL_FP8_ROUND", "fast")
    with pytest.raises(ValueError, match="DSV41_KERNEL_FP8_ROUND"):
        Q.kernel_fp8_round()


def test_e2m1_rne_every_tie():
    for tie, want in E2M1_TIES.items():
        lo = F32(max(g for g in Q.FP4_GRID if g < tie))
        hi = F32(min(g for g in Q.FP4_GRID if g > tie))
        for xp in (np, jnp):
            assert float(Q.e2m1_rne(F32(tie), xp)) == want
            assert float(Q.e2m1_rne(-F32(tie), xp)) == -want
            assert float(Q.e2m1_rne(_down(tie), xp)) == lo
            assert float(Q.e2m1_rne(_up(tie), xp)) == hi
    v = np.concatenate([np.linspace(-7, 7, 20001), list(E2M1_TIES), Q.FP4_GRID]).astype(F32)
    want = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    assert _same_bits(Q.e2m1_rne(v, np), want)
    assert _same_bits(np.asarray(jax.jit(Q.e2m1_rne)(v)), want)


def test_div6_exact_under_jit():
    rng = np.random.default_rng(1)
    a = np.concatenate([
        rng.uniform(6 * 2.0**-9, 1e4, 200_000), 6.0 * E4M3_POS[1:], _up(6.0 * E4M3_POS[1:]),
        _down(6.0 * E4M3_POS[1:]), [3.0e38, 6 * 2.0**-9]]).astype(F32)
    got = np.asarray(jax.jit(lambda x: Q._div6(x, jnp))(a))
    assert _same_bits(got, a / F32(6))


# ------------------------------------------------------------------------------------------------
# fp4 packing, dequantization, encoders
# ------------------------------------------------------------------------------------------------

def test_fp4_nibble_order_and_lut():
    packed = Q.pack_fp4(np.array([[0.5, 6.0, -0.5, 1.0, -0.0, -6.0]], F32))
    assert packed.dtype == np.int8
    assert list(packed.view(np.uint8)[0]) == [0x71, 0x29, 0xF8]  # low nibble = even element
    np.testing.assert_array_equal(Q.unpack_fp4(packed), [[0.5, 6.0, -0.5, 1.0, -0.0, -6.0]])
    allb = np.arange(256, dtype=np.uint8).reshape(16, 16)
    vals = Q.unpack_fp4(allb)
    assert vals.shape == (16, 32)
    np.testing.assert_array_equal(vals[:, 0::2], Q.FP4_LUT[allb & 15])
    np.testing.assert_array_equal(vals[:, 1::2], Q.FP4_LUT[allb >> 4])
    assert np.array_equal(Q.pack_fp4(vals).view(np.uint8), allb)  # -0 keeps code 8
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4_jax(allb.view(np.int8))), vals)


def test_dequant_fp4_experts():
    rng = np.random.default_rng(2)
    packed = rng.integers(-128, 128, (3, 8, 32), dtype=np.int8)  # [E, out, in/2], in = 64
    scale = rng.integers(110, 135, (3, 8, 2), dtype=np.uint8)
    w = Q.dequant_fp4_experts(packed, scale)
    codes = Q.fp4_codes(packed)
    for o in range(8):
        for i in range(64):
            assert w[1, o, i] == Q.FP4_LUT[codes[1, o, i]] * 2.0 ** (int(scale[1, o, i // 32]) - 127)
    np.testing.assert_array_equal(np.asarray(jax.jit(Q.dequant_fp4_experts_jax)(packed, scale)), w)


@pytest.mark.parametrize("shape,block", [((64, 64), 32), ((40, 70), 32), ((33, 31), 32), ((130, 300), 128),
                                         ((5, 64), (1, 32))])
def test_fp8_blocks_edges_and_round_trip(shape, block):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(shape) * rng.choice([1e-3, 0.05, 30.0])).astype(F32)
    w[0, : min(5, shape[1])] = 0.0
    q, s = Q.quantize_fp8_blocks(w, block)
    bo, bi = (block, block) if isinstance(block, int) else block
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.uint8
    assert s.shape == (-(-shape[0] // bo), -(-shape[1] // bi))
    deq = Q.dequant_fp8_blocks(q, s, block)
    ref = np.empty(shape, F32)  # elementwise reference
    qf = q.astype(F32)
    for o in range(shape[0]):
        for i in range(shape[1]):
            ref[o, i] = qf[o, i] * np.ldexp(1.0, int(s[o // bo, i // bi]) - 127)
    np.testing.assert_array_equal(deq, ref)
    np.testing.assert_array_equal(Q.dequant_fp8_blocks(q.view(np.uint8), s.view(ml_dtypes.float8_e8m0fnu), block), deq)
    np.testing.assert_array_equal(np.asarray(Q.dequant_fp8_blocks_jax(q, s, block)), deq)
    # re-encoding is lossless; the error is at most half an e4m3 ulp
    np.testing.assert_array_equal(Q.dequant_fp8_blocks(*Q.quantize_fp8_blocks(deq, block), block), deq)
    _check_fp8_tile_rule(q, s, block)
    assert np.all(np.abs(deq - w) <= np.abs(w) * 2.0**-4 + 2.0**-9 * np.max(Q.e8m0_to_f32(s)))
    if bo == 1:
        np.testing.assert_array_equal(deq, Q.fq_fp8_np(w, bi))
    with pytest.raises(ValueError):
        Q.dequant_fp8_blocks(q, s[:-1], block)


def _check_fp8_tile_rule(q, s, block):
    """The encoder's signature: every tile's max |code value| is in [224, 448] (exactly 224 only when
    amax/s rounded down to it), or the tile is all zero with the 1e-4 amax floor's scale."""
    bo, bi = (block, block) if isinstance(block, int) else block
    qf = np.abs(q.astype(F32))
    ro, ri = s.shape
    pad = np.zeros((ro * bo, ri * bi), F32)
    pad[: qf.shape[0], : qf.shape[1]] = qf
    tmax = pad.reshape(ro, bo, ri, bi).max(axis=(1, 3))
    ok = ((tmax >= 224) & (tmax <= 448)) | ((tmax == 0) & (s == 127 - 22))
    assert np.all(ok), (tmax[~ok], s[~ok])


def _check_fp4_block_rule(packed, s):
    """Every 32-block's max |e2m1| is in [3, 6], or the block is zero with the floor's scale 2^-126."""
    v = np.abs(Q.unpack_fp4(packed))
    bmax = v.reshape(*v.shape[:-1], -1, 32).max(-1)
    ok = ((bmax >= 3) & (bmax <= 6)) | ((bmax == 0) & (s == 1))
    assert np.all(ok), (bmax[~ok], s[~ok])


def test_fp4_blocks_round_trip():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((2, 16, 96)) * 0.05).astype(F32)
    w[0, 0, :32] = 0.0
    packed, s = Q.quantize_fp4_blocks(w)
    assert packed.shape == (2, 16, 48) and packed.dtype == np.int8 and s.shape == (2, 16, 3)
    deq = Q.dequant_fp4_experts(packed, s)
    np.testing.assert_array_equal(deq, Q.fq_fp4_e8_np(w, 32))
    np.testing.assert_array_equal(np.asarray(Q.fq_fp4_e8(w, 32)), deq)
    np.testing.assert_array_equal(Q.dequant_fp4_experts(*Q.quantize_fp4_blocks(deq)), deq)
    _check_fp4_block_rule(packed, s)


def test_engram_rows_numpy_and_jax():
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, (7, 64), dtype=np.uint8)
    rows[rows & 0x7F == 0x7F] = 0  # no NaN codes
    sc = rng.integers(100, 130, (7, 2), dtype=np.uint8)
    got = Q.dequant_engram_rows(rows, sc)
    want = rows.view(ml_dtypes.float8_e4m3fn).astype(F32) * np.repeat(np.ldexp(1.0, sc.astype(int) - 127), 32, 1)
    np.testing.assert_array_equal(got, want.astype(F32))
    f = jax.jit(Q.dequant_engram_rows_jax)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(rows), jnp.asarray(sc))), got)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(rows.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(sc))), got)
    # gathered rows [B, S, cols, D] as in the lookup
    idx = rng.integers(0, 7, (2, 3, 4))
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(rows)[idx], jnp.asarray(sc)[idx])), got[idx])


# ------------------------------------------------------------------------------------------------
# fake-quant operators
# ------------------------------------------------------------------------------------------------

FQ = [("fp8", Q.fq_fp8, Q.fq_fp8_np, 32), ("fp4_e8", Q.fq_fp4_e8, Q.fq_fp4_e8_np, 32),
      ("fp4_e4", Q.fq_fp4_e4, Q.fq_fp4_e4_np, 16)]


def _boundary_inputs(kind: str, rng) -> np.ndarray:
    """Rows of blocks whose scaled values land exactly on rounding boundaries (and 1 ulp off)."""
    B = 16 if kind == "fp4_e4" else 32
    if kind == "fp8":
        amaxes = [448.0, 300.0, _up(448.0), 1e-4, 5e-5, 448 * 2.0**-20]
        mids = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2
        pool = np.concatenate([mids, _up(mids), _down(mids), E4M3_POS])
    else:
        amaxes = [6.0, 5.0, _up(6.0), 6 * 1.0625, 6 * 1.1875, _up(6 * 1.0625), _down(6 * 1.0625), 6 * 2.0**-9,
                  1e-3, 6 * 2.0**-126, 6 * 3.0 * 2.0**-12]
        ties = np.array(list(E2M1_TIES), F32)
        pool = np.concatenate([ties, _up(ties), _down(ties), Q.FP4_GRID])
    rows = []
    for amax in amaxes:
        a = F32(amax)
        if kind == "fp8":
            s = Q.pow2ceil(np.maximum(a, F32(1e-4)) * Q.INV_E4M3_MAX, np)
        elif kind == "fp4_e8":
            s = Q.pow2ceil(np.maximum(a, F32(6 * 2.0**-126)) * Q.INV_E2M1_MAX, np)
        else:
            s = Q.e4m3_rne(np.maximum(a, F32(6 * 2.0**-9)) / F32(6), np)
        for _ in range(4):
            # the scaled values x/s hit the boundaries exactly (s is what the block will get)
            vals = pool[pool * s <= a]
            blk = (rng.choice(vals, B) * s * rng.choice([1.0, -1.0], B)).astype(F32)
            blk[rng.integers(B)] = a * rng.choice([1.0, -1.0])
            rows.append(blk)
    return np.stack(rows).reshape(-1, 2 * B)


def _random_inputs(rng, width: int) -> np.ndarray:
    x = rng.standard_normal((24, width)).astype(F32)
    x *= np.array([1e-30, 1e-6, 1e-3, 0.05, 1.0, 7.0, 300.0, 1e5] * 3, F32)[:, None]
    x[0] = 0.0
    x[1, ::3] = 0.0
    return x


def _torch_reference(x: np.ndarray, kind: str, block: int) -> np.ndarray:
    """Independent torch implementation of the REF41 kernel semantics (kernel_cpu / HF41)."""
    t = torch.from_numpy(np.asarray(x, F32))
    n = t.shape[-1]
    if n % block:
        return x
    g = t.unflatten(-1, (-1, block))
    amax = g.abs().amax(-1)

    def round_scale(a, inv):
        bits = (a * torch.tensor(inv, dtype=torch.float32)).contiguous().view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        return ((e + 127) << 23).view(torch.float32)

    def e2m1(v):
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        up = torch.tensor([False, True, False, True, False, True, False])
        m = v.abs().unsqueeze(-1)
        code = (m > mids).sum(-1) + ((m == mids) & up).sum(-1)
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        return torch.where(torch.signbit(v), -grid[code], grid[code])

    if kind == "fp8":
        s = round_scale(amax.clamp_min(1e-4), 1.0 / 448.0)
        q = (g / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    elif kind == "fp4_e8":
        s = round_scale(amax.clamp_min(6 * 2.0**-126), 1.0 / 6.0)
        q = e2m1((g / s.unsqueeze(-1)).clamp(-6, 6))
    else:
        s = (amax.clamp_min(6 * 2.0**-9) / 6.0).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        q = e2m1((g / s.unsqueeze(-1)).clamp(-6, 6))
    return (q * s.unsqueeze(-1)).flatten(-2).numpy()


@pytest.mark.parametrize("kind,fq,fq_np,block", FQ)
def test_fake_quant_matches_torch_reference(kind, fq, fq_np, block):
    rng = np.random.default_rng(6)
    jfq = jax.jit(fq, static_argnums=1)
    for x in (_random_inputs(rng, 4 * block), _boundary_inputs(kind, rng)):
        want = _torch_reference(x, kind, block)
        assert _same_bits(fq_np(x, block), want)
        # XLA flushes fp32 subnormal inputs (FTZ): rows whose scale is ~2^-126 are numpy-only
        ok = np.abs(x).max(-1) >= 2.0**-100
        assert ok.sum() >= len(ok) - 4
        assert _same_bits(np.asarray(jfq(x[ok], block)), want[ok])
        assert _same_bits(np.asarray(fq(x[ok], block)), want[ok])


@pytest.mark.parametrize("kind,fq,fq_np,block", FQ)
def test_fake_quant_bf16_inputs(kind, fq, fq_np, block):
    rng = np.random.default_rng(7)
    x32 = _random_inputs(rng, 2 * block)
    x16 = x32.astype(BF16)
    got = jax.jit(fq, static_argnums=1)(jnp.asarray(x16), block)
    assert got.dtype == jnp.bfloat16
    want32 = _torch_reference(x16.astype(F32), kind, block)
    assert np.array_equal(want32.astype(BF16).astype(F32), want32)  # results are exact in bf16
    assert _same_bits(np.asarray(got).astype(F32), want32)
    assert fq_np(x16, block).dtype == BF16
    assert _same_bits(fq_np(x16, block).astype(F32), want32)


@pytest.mark.parametrize("kind,fq,fq_np,block", FQ)
def test_fake_quant_identity_when_not_divisible(kind, fq, fq_np, block):
    x = np.random.default_rng(8).standard_normal((3, block + block // 2)).astype(F32)
    assert np.array_equal(np.asarray(fq(x, block)), x)
    assert np.array_equal(fq_np(x, block), x)
    y = fq(x[:, :block], block)  # divisible: it does quantize
    assert not np.array_equal(np.asarray(y), x[:, :block])


def test_fake_quant_grid_and_scale_properties():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((64, 64)) * 3).astype(F32)
    y8 = np.asarray(Q.fq_fp8(x)).reshape(64, 2, 32)
    s8 = Q.pow2ceil(np.maximum(np.abs(x).reshape(64, 2, 32).max(-1), 1e-4) * Q.INV_E4M3_MAX, np)
    assert np.all(np.isin(np.abs(y8 / s8[..., None]), E4M3_POS))
    y4 = np.asarray(Q.fq_fp4_e8(x)).reshape(64, 2, 32)
    s4 = Q.pow2ceil(np.abs(x).reshape(64, 2, 32).max(-1) * Q.INV_E2M1_MAX, np)
    assert np.all(np.isin(np.abs(y4 / s4[..., None]), Q.FP4_GRID))
    y4e = np.asarray(Q.fq_fp4_e4(x)).reshape(64, 4, 16)
    s4e = Q.e4m3_rne(np.abs(x).reshape(64, 4, 16).max(-1) / F32(6), np)
    assert np.all(np.isin(np.abs(y4e / s4e[..., None]), Q.FP4_GRID))
    # act_quant_fp8 is fq_fp8
    assert _same_bits(np.asarray(Q.act_quant_fp8(x)), np.asarray(Q.fq_fp8(x)))
    # an all-zero block stays zero
    assert np.all(np.asarray(Q.fq_fp4_e4(np.zeros((2, 16), F32))) == 0)


# ------------------------------------------------------------------------------------------------
# the golden release-format checkpoint
# ------------------------------------------------------------------------------------------------

def _load_raw(path):
    from safetensors.torch import load_file

    out = {}
    for k, v in load_file(path).items():
        if v.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            out[k] = v.view(torch.uint8).numpy()
        else:
            out[k] = v.float().numpy()
    return out


@pytest.fixture(scope="module")
def golden_fp8():
    path = os.path.join(GOLDEN, "image_fp8", "model.safetensors")
    if not os.path.exists(path):
        pytest.skip("tests/golden/image_fp8 missing")
    return _load_raw(path)


def _exact_in_bf16(w):
    return np.array_equal(w.astype(BF16).astype(F32), w)


def test_golden_fp8_dense_weights(golden_fp8):
    names = [k[: -len(".scale")] for k in golden_fp8 if k.endswith(".scale") and ".experts." not in k
             and ".engram.embed." not in k]
    assert len(names) >= 7 * 7
    for n in names:
        w, s = golden_fp8[n + ".weight"], golden_fp8[n + ".scale"]
        deq = Q.dequant_fp8_blocks(w, s, 32)
        assert deq.shape == w.shape and np.all(np.isfinite(deq)) and _exact_in_bf16(deq)
        assert 0.02 < deq.std() < 0.1 and np.abs(deq).max() < 1.0, n
        np.testing.assert_array_equal(Q.dequant_fp8_blocks(*Q.quantize_fp8_blocks(deq, 32), 32), deq)
        _check_fp8_tile_rule(w.view(ml_dtypes.float8_e4m3fn), s, 32)  # same encoder as the release draw


def test_golden_fp4_experts(golden_fp8):
    names = [k[: -len(".weight")] for k in golden_fp8 if ".experts." in k and k.endswith(".weight")]
    assert len(names) == 7 * 6 * 3
    for n in names:
        p, s = golden_fp8[n + ".weight"], golden_fp8[n + ".scale"]
        deq = Q.dequant_fp4_experts(p, s)
        assert deq.shape == (p.shape[0], 2 * p.shape[1]) and _exact_in_bf16(deq)
        assert 0.02 < deq.std() < 0.1 and np.abs(deq).max() < 1.0, n
        np.testing.assert_array_equal(Q.dequant_fp4_experts(*Q.quantize_fp4_blocks(deq)), deq)
        _check_fp4_block_rule(p, s)  # same encoder as the release draw


def test_golden_engram_tables(golden_fp8):
    for l in (0, 1):
        w, s = golden_fp8[f"layers.{l}.engram.embed.weight"], golden_fp8[f"layers.{l}.engram.embed.scale"]
        deq = Q.dequant_engram_rows(w, s)
        assert _exact_in_bf16(deq) and 0.02 < deq.std() < 0.1
        np.testing.assert_array_equal(np.asarray(Q.dequant_engram_rows_jax(w, s)), deq)
        np.testing.assert_array_equal(Q.dequant_fp8_blocks(*Q.quantize_fp8_blocks(deq, (1, 32)), (1, 32)), deq)
        _check_fp8_tile_rule(w.view(ml_dtypes.float8_e4m3fn), s, (1, 32))


def test_golden_bf16_weights_lie_on_the_fp8_grid():
    path = os.path.join(GOLDEN, "text_fast_fp32", "model.safetensors")
    if not os.path.exists(path):
        pytest.skip("tests/golden/text_fast_fp32 missing")
    d = _load_raw(path)
    for n in ("layers.0.attn.wq_a.weight", "layers.3.attn.wo_b.weight", "layers.1.engram.wkv.weight"):
        q, s = Q.quantize_fp8_blocks(d[n], 32)
        np.testing.assert_array_equal(Q.dequant_fp8_blocks(q, s, 32), d[n])
    w = d["layers.2.ffn.experts.4.w2.weight"]
    np.testing.assert_array_equal(Q.dequant_fp4_experts(*Q.quantize_fp4_blocks(w)), w)
