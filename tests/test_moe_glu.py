"""``kernels.moe_glu`` (a prefill's gathered rows, routed w1 + w3 and SwiGLU in one launch) in the
Pallas interpreter against its XLA composition, and ``MoE.routed_pallas`` with and without it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from dsv41_jax.kernels.moe_glu import moe_glu, moe_glu_reference
from dsv41_jax.kernels.qmatmul import dequantize
from dsv41_jax.model.moe import swiglu

F32 = jnp.float32


def _problem(rng, dt, scaled: bool, bm: int, G=5, I=80, K=96, T=30, blocks=6):
    R = bm * blocks
    x = jnp.asarray(rng.standard_normal((T, K)), dt)
    tok = jnp.asarray(rng.integers(-1, T, R), jnp.int32)  # -1: padding rows
    rw = jnp.asarray(rng.random(R), F32) * (tok >= 0)
    bg = jnp.asarray(rng.permutation(np.arange(blocks) % G), jnp.int32)  # neighbouring blocks on other experts
    if scaled:
        def w():
            return (jnp.asarray(rng.integers(-12, 13, (G, I, K)), jnp.int8),
                    jnp.asarray(rng.integers(122, 128, (G, I, K // 32)), jnp.uint8))
    else:
        def w():
            return jnp.asarray(rng.standard_normal((G, I, K)) * 0.2, dt), None
    return x, tok, rw, bg, w(), w()


CASES = [(F32, True, 16, False), (jnp.bfloat16, True, 48, False), (F32, True, 40, False), (F32, False, 32, False),
         (jnp.bfloat16, False, 160, False), (jnp.bfloat16, True, 48, True)]


@pytest.mark.parametrize("dt,scaled,bm,aq", CASES, ids=[
    f"{jnp.dtype(d).name}-{'int8' if s else 'float'}-bm{b}{'-actquant' if q else ''}" for d, s, b, q in CASES])
def test_moe_glu_equals_its_xla_form(dt, scaled, bm, aq):
    """Blocks of one tile, of a tile and a tail (48 = 32 + 16, 160 = 128 + 32) and of a padded tile
    (40 in 64); output columns not a multiple of the tile (80 = 64 + 16); padding rows; blocks past
    ``n_blocks`` not compared (left unwritten); the fp8 quantization of h (reference numerics).
    Each row is also checked against a row-by-row numpy form, so a block computed with a
    neighbour's expert shows."""
    rng = np.random.default_rng(bm + scaled)
    x, tok, rw, bg, w1, w3 = _problem(rng, dt, scaled, bm, I=96 if aq else 80)
    nb = 4
    kw = dict(bm=bm, limit=1.5, act_quant=aq)
    got = np.asarray(moe_glu(x, tok, rw, bg, nb, w1, w3, impl="interpret", **kw), np.float64)[:nb * bm]
    want = np.asarray(moe_glu_reference(x, tok, rw, bg, nb, w1, w3, **kw), np.float64)[:nb * bm]
    # fp32: summation order; bf16: g, u and h are rounded to bf16, a different order may move one by an ulp
    tol = 1e-5 if dt == F32 else 2 ** -7
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    assert np.all(got[np.asarray(tok)[:nb * bm] < 0] == 0)
    for r in range(0, nb * bm, 7):
        e, t = int(bg[r // bm]), int(tok[r])
        if t < 0:
            continue
        w1e, w3e = (np.asarray(dequantize(c[e], None if s is None else s[e], F32)) for c, s in (w1, w3))
        xr = np.asarray(x[t], np.float32)
        row = rw[r] * swiglu(jnp.asarray(w1e @ xr).astype(dt), jnp.asarray(w3e @ xr).astype(dt), 1.5)
        row = np.asarray(quant.act_quant_fp8(row.astype(dt).astype(F32), 32) if aq else row)
        # (with the fp8 quantization one ulp of h may move a code by one e4m3 step: 2^-3 relative)
        assert np.abs(got[r] - row).max() <= (2 ** -3 if aq else 4 * tol) * max(np.abs(row).max(), 1e-3), r


def test_moe_glu_errors_and_lowering(monkeypatch):
    """Mismatched weights, a bad gather value, a bad switch or tiles value: one clear error each;
    the Triton form (rows gathered in the kernel) lowers for CUDA (checked without a GPU)."""
    from dsv41_jax.kernels.moe_glu import glu_kernel

    rng = np.random.default_rng(0)
    x, tok, rw, bg, w1, w3 = _problem(rng, jnp.bfloat16, True, 16)
    with pytest.raises(ValueError, match="moe_glu: w1"):
        moe_glu(x, tok, rw, bg, 2, w1, (w3[0][:, :64], w3[1][:, :64]), bm=16, limit=0.0, impl="interpret")
    with pytest.raises(ValueError, match="gather"):
        moe_glu(x, tok, rw, bg, 2, w1, w3, bm=16, limit=0.0, impl="interpret", gather="torch")
    monkeypatch.setenv("DSV41_MOE_GLU_TILES", '{"bq": 32}')
    with pytest.raises(ValueError, match="DSV41_MOE_GLU_TILES"):
        moe_glu(x, tok, rw, bg, 2, w1, w3, bm=16, limit=0.0, impl="interpret")
    monkeypatch.delenv("DSV41_MOE_GLU_TILES")
    monkeypatch.setenv("DSV41_MOE_GLU", "yes")
    with pytest.raises(ValueError, match="DSV41_MOE_GLU"):
        glu_kernel()
    f = jax.jit(lambda *a: moe_glu(*a[:4], 300, *a[4:], bm=160, limit=10.0, impl="triton"))
    SD = jax.ShapeDtypeStruct
    args = (SD((2048, 5120), jnp.bfloat16), SD((160 * 400,), jnp.int32), SD((160 * 400,), F32), SD((400,), jnp.int32),
            (SD((384, 2304, 5120), jnp.int8), SD((384, 2304, 160), jnp.uint8)),
            (SD((384, 2304, 5120), jnp.int8), SD((384, 2304, 160), jnp.uint8)))
    assert "moe_glu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # with the act-quant epilogue (reference numerics), whose e4m3 rounding is a dtype conversion
    fq = jax.jit(lambda *a: moe_glu(*a[:4], 300, *a[4:], bm=160, limit=10.0, impl="triton", act_quant=True))
    assert "moe_glu" in fq.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bm", [16, 48])
def test_moe_glu_on_kblocked_codes(bm):
    """K-blocked codes (``qmatmul.kblock``) give the rows layout's h bit for bit (each program
    reads the same values in the same order), in the interpreter and in the XLA form; the Triton
    form lowers for CUDA."""
    from dsv41_jax.kernels.qmatmul import kblock

    rng = np.random.default_rng(7 + bm)
    x, tok, rw, bg, w1, w3 = _problem(rng, jnp.bfloat16, True, bm, K=128)
    kw = dict(bm=bm, limit=1.5)
    k1, k3 = ((kblock(c), s) for c, s in (w1, w3))
    nb = 4
    for impl in ("interpret", "xla"):
        rows = np.asarray(moe_glu(x, tok, rw, bg, nb, w1, w3, impl=impl, **kw), np.float32)[:nb * bm]
        got = np.asarray(moe_glu(x, tok, rw, bg, nb, k1, k3, impl=impl, **kw), np.float32)[:nb * bm]
        np.testing.assert_array_equal(got, rows)
    f = jax.jit(lambda *a: moe_glu(*a[:4], 300, *a[4:], bm=160, limit=10.0, impl="triton"))
    SD = jax.ShapeDtypeStruct
    wk = (SD((384, 80, 2304, 64), jnp.int8), SD((384, 2304, 160), jnp.uint8))
    args = (SD((2048, 5120), jnp.bfloat16), SD((160 * 400,), jnp.int32), SD((160 * 400,), F32), SD((400,), jnp.int32),
            wk, wk)
    assert "moe_glu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def int8_moe(numerics: str, seed: int, **text_overrides):
    """A tiny-preset ``MoE`` (``numerics`` as "dtype-mode") with random int8 experts (fp4-range
    codes, ue8m0 scales; quantized in reference numerics) and a random gate: (moe, its rng)."""
    from dsv41_jax.config import preset, with_text_overrides
    from dsv41_jax.model import moe as M
    from dsv41_jax.numerics import Numerics

    t = with_text_overrides(preset("tiny"), **text_overrides).text
    dt = jnp.dtype(numerics.split("-")[0])
    moe = M.MoE(t, Numerics(*numerics.split("-")), vision=False, experts_int8=True)
    moe.experts.quantized = moe.numerics.fake_quant
    rng = np.random.default_rng(seed)
    E, D, I = t.n_routed_experts, t.hidden_size, t.moe_intermediate_size
    moe.gate.weight.set_value(jnp.asarray(rng.standard_normal((E, D)) * 0.3, dt))
    for name, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        p = getattr(moe.experts, name)
        p.weight.set_value(jnp.asarray(rng.integers(-12, 13, (E, o, i)), jnp.int8))
        p.scale.set_value(jnp.asarray(rng.integers(122, 126, (E, o, i // 32)), jnp.uint8))
    return moe, rng


@pytest.mark.parametrize("numerics", ["float32-fast", "bfloat16-reference"])
def test_routed_pallas_with_and_without_the_glu_kernel(numerics, monkeypatch):
    """A prefill through ``MoE.routed_pallas`` (interpreter kernels, 32-row expert blocks): the
    one-launch w1 + w3 + SwiGLU (+ the fp8 quantization of h in reference numerics) against XLA's
    gather, the fused w1 + w3 launch, XLA's SwiGLU and ``MoE._aq`` (``DSV41_MOE_GLU=0``); blocks
    below ``GLU_MIN_ROWS`` rows keep the fused launch."""
    import dsv41_jax.kernels.moe_glu as G
    from dsv41_jax.model import moe as M

    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    calls = []
    real = G.moe_glu
    monkeypatch.setattr(G, "moe_glu", lambda *a, **kw: calls.append(kw["bm"]) or real(*a, **kw))
    moe, rng = int8_moe(numerics, 2, n_routed_experts=24, num_experts_per_tok=3, moe_intermediate_size=96)
    dt = jnp.dtype(numerics.split("-")[0])
    x = jnp.asarray(rng.standard_normal((64, moe.experts.w1.weight.shape[2])), dt)
    w, ids = moe.gate(x)
    outs = {}
    monkeypatch.setenv("DSV41_MOE_CHUNK", "32")
    for mode in ("1", "0"):
        monkeypatch.setenv("DSV41_MOE_GLU", mode)
        outs[mode] = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float64)
    assert calls == [32]
    tol = 1e-5 if dt == F32 else 2 ** -7
    assert np.abs(outs["1"] - outs["0"]).max() <= tol * np.abs(outs["0"]).max()
    monkeypatch.setenv("DSV41_MOE_GLU", "1")
    monkeypatch.setenv("DSV41_MOE_CHUNK", str(M.GLU_MIN_ROWS - 16))
    jax.jit(moe.routed_pallas)(x, w, ids)
    assert calls == [32]
    # 48-row blocks (32 + 16): the tail-split launches of moe_glu and w2 against one launch each
    monkeypatch.setenv("DSV41_MOE_CHUNK", "48")
    split = {}
    for mode in ("0", "both"):
        monkeypatch.setenv("DSV41_MOE_SPLIT_TAIL", mode)
        split[mode] = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float64)
    assert np.abs(split["both"] - split["0"]).max() <= tol * np.abs(split["0"]).max()
    assert np.abs(split["0"] - outs["0"]).max() <= tol * np.abs(outs["0"]).max()
    monkeypatch.setenv("DSV41_MOE_SPLIT_TAIL", "yes")
    with pytest.raises(ValueError, match="DSV41_MOE_SPLIT_TAIL"):
        jax.jit(moe.routed_pallas)(x, w, ids)


@pytest.mark.parametrize("bm", [160, 48])
def test_split_tail_launches(bm):
    """``split_tail``: blocks whose pairs fit the main row tile run in a launch without the tail
    tile, the others in a second launch writing into the same output. Blocks filled from their
    start to different extents (padding rows inside some): every row up to a block's last pair
    equals the XLA form; a tail-less block's tail rows are not written (NaN in the interpreter)."""
    from dsv41_jax.kernels.qmatmul import row_tiles, tail_selector

    rng = np.random.default_rng(11 + bm)
    x, _, _, _, w1, w3 = _problem(rng, F32, True, bm)
    tm, tail = row_tiles(bm)
    extents = [3, tm, tm + 1, bm, tm - 5, 1]
    tok = np.full(len(extents) * bm, -1, np.int32)
    for j, n in enumerate(extents):
        tok[j * bm:j * bm + n] = rng.integers(0, x.shape[0], n)
        if n > 4:
            tok[j * bm + n // 2] = -1  # a padding row inside the extent
    tok = jnp.asarray(tok)
    rw = jnp.asarray(rng.random(tok.shape[0]), F32) * (tok >= 0)
    bg = jnp.asarray(rng.integers(0, 5, len(extents)), jnp.int32)
    nb = len(extents) - 1  # the last block is past n_blocks
    kw = dict(bm=bm, limit=1.5)
    sel = tail_selector(tok, bm)
    np.testing.assert_array_equal(np.asarray(sel), [int(n > tm) for n in extents])
    got = np.asarray(moe_glu(x, tok, rw, bg, nb, w1, w3, impl="interpret", split_tail=sel, **kw), np.float64)
    want = np.asarray(moe_glu_reference(x, tok, rw, bg, nb, w1, w3, **kw), np.float64)
    for j, n in enumerate(extents[:nb]):
        rows = slice(j * bm, j * bm + n)
        assert np.abs(got[rows] - want[rows]).max() <= 1e-5 * max(np.abs(want[rows]).max(), 1e-6), j
        assert np.all(got[rows][np.asarray(tok[rows]) < 0] == 0), j
        tail_rows = got[j * bm + tm:(j + 1) * bm]
        assert np.isnan(tail_rows).all() if n <= tm else not np.isnan(tail_rows).any(), j
    assert np.isnan(got[nb * bm:]).all()  # a block past n_blocks is in neither launch
    with pytest.raises(ValueError, match="split_tail"):
        moe_glu(x, tok, rw, bg, nb, w1, w3, impl="interpret", split_tail=True, **kw)
