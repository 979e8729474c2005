"""Grouped matmul against quantized weights (dsv41_jax.kernels.qmatmul): the Pallas kernel run by
the Pallas interpreter against the XLA reference, the reference against a float64 loop, and the
MoE "pallas" path against ``MoE.routed_dense``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import preset, with_text_overrides
from dsv41_jax.kernels import qmatmul as Q
from dsv41_jax.model.moe import MoE, StackedWeight, pallas_chunk
from dsv41_jax.numerics import Numerics

F32 = jnp.float32


def _weights(rng, kind, G, O, K):
    if kind == "int8":
        codes = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8)
    elif kind == "fp8":
        codes = jnp.asarray(rng.standard_normal((G, O, K)) * 4, F32).astype(jnp.float8_e4m3fn)
    else:
        return jnp.asarray(rng.standard_normal((G, O, K)) * 0.3, jnp.bfloat16), None
    scale = rng.integers(118, 136, (G, O, K // 32))
    scale[0, 0, 0] = 0  # byte 0 means 2^-127, not zero
    return codes, jnp.asarray(scale, jnp.uint8)


def _np_grouped(x, block_group, n_blocks, codes, scale, bm, mult):
    """float64 loop: the definition in the module docstring."""
    x = np.asarray(x, np.float64)
    c = np.asarray(codes.astype(F32), np.float64)
    if scale is not None:
        s = np.exp2(np.asarray(scale, np.float64) - 127.0)
        c = c * mult * np.repeat(s, 32, axis=-1)
    out = np.zeros((x.shape[0], c.shape[1]))
    for j, g in enumerate(np.asarray(block_group)):
        if j < n_blocks:
            out[j * bm:(j + 1) * bm] = x[j * bm:(j + 1) * bm] @ c[g].T
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_dequantize_matches_stacked_weight():
    rng = np.random.default_rng(0)
    codes, scale = _weights(rng, "int8", 3, 8, 64)
    scale = scale.at[1, 2, 1].set(0).at[2, 3, 0].set(255 - 1)
    for dt in (F32, jnp.bfloat16):
        np.testing.assert_array_equal(np.asarray(Q.dequantize(codes, scale, dt), np.float32),
                                      np.asarray(StackedWeight._dequant(codes, scale, dt), np.float32))


@pytest.mark.parametrize("kind", ["int8", "fp8", "bf16"])
def test_reference_matches_float64_loop(kind):
    rng = np.random.default_rng(1)
    G, O, K, bm, nb = 4, 24, 96, 2, 5
    codes, scale = _weights(rng, kind, G, O, K)
    x = jnp.asarray(rng.standard_normal((nb * bm, K)), F32)
    bg = jnp.asarray(rng.integers(0, G, nb), jnp.int32)
    got = Q.grouped_qmatmul_reference(x, bg, 4, codes, scale, bm=bm)
    want = _np_grouped(x, bg, 4, codes, scale, bm, Q.default_mult(codes.dtype))
    assert _rel(got, want) < 1e-6
    assert np.all(np.asarray(got[4 * bm:]) == 0)


# (kind, G, O, K, bm, n_blocks, used, mode, tiles): decode GEMV blocks, padded dot blocks,
# prefill blocks of 64 / 128 rows with unused blocks, one group with output widths that no
# tile divides
CASES = [
    ("int8", 6, 40, 256, 1, 7, 7, "auto", {}),
    ("int8", 6, 40, 256, 1, 7, 7, "reduce", {}),
    ("int8", 6, 40, 256, 1, 7, 5, "reduce", {"acc": False}),
    ("int8", 5, 48, 128, 4, 4, 3, "auto", {}),
    ("int8", 5, 48, 128, 4, 4, 3, "reduce", {}),
    ("int8", 3, 72, 128, 64, 3, 2, "auto", {}),
    ("int8", 3, 72, 128, 64, 3, 2, "dot", {"split": True}),
    ("int8", 2, 40, 64, 128, 3, 1, "auto", {"bo": 32}),
    ("fp8", 1, 72, 256, 1, 3, 3, "auto", {}),
    ("fp8", 1, 72, 256, 1, 3, 3, "reduce", {"bo": 32}),
    ("fp8", 1, 40, 128, 8, 2, 2, "auto", {}),
    ("fp8", 1, 96, 128, 32, 2, 2, "auto", {"bo": 64}),
    ("fp8", 1, 72, 64, 16, 7, 7, "auto", {"bo": 32, "group_rows": 3}),
    ("int8", 4, 40, 64, 16, 5, 4, "auto", {"bo": 32, "group_rows": 2}),
    ("bf16", 6, 40, 96, 1, 6, 5, "auto", {}),
    ("bf16", 6, 40, 96, 1, 6, 5, "reduce", {}),
    ("bf16", 3, 48, 128, 64, 3, 2, "auto", {}),
    # split-K: automatic above (small problems), explicit here, and off
    ("int8", 6, 40, 256, 1, 7, 5, "auto", {"splitk": 1}),
    ("int8", 6, 40, 256, 1, 7, 5, "auto", {"splitk": 8}),
    ("fp8", 1, 72, 256, 1, 3, 3, "reduce", {"splitk": 2}),
    ("int8", 3, 72, 128, 64, 3, 2, "dot", {"split": True, "splitk": 2}),
    ("bf16", 6, 40, 96, 1, 6, 5, "auto", {"splitk": 1}),
    ("int8", 6, 40, 256, 1, 7, 5, "auto", {"lowp_dequant": True}),
    ("fp8", 1, 72, 256, 1, 3, 3, "auto", {"lowp_dequant": True}),
    # the weight tile as the dot's left operand: decode, split-K, prefill blocks, split, unscaled
    ("int8", 6, 40, 256, 1, 7, 5, "dot", {"wlhs": True}),
    ("fp8", 1, 72, 256, 1, 3, 3, "auto", {"wlhs": True, "splitk": 2}),
    ("int8", 3, 72, 128, 64, 3, 2, "auto", {"wlhs": True}),
    ("int8", 3, 72, 128, 64, 3, 2, "dot", {"wlhs": True, "split": True}),
    ("bf16", 6, 40, 96, 1, 6, 5, "auto", {"wlhs": True}),
    # the chunk mode (the default for one-row blocks of grouped scaled weights; the auto rows
    # above with bm=1 and int8 weights run it too): whole 512-input steps, split-K ranges with
    # a masked tail step, K below one step, fp8 codes read as bytes, one dense group on request
    ("int8", 6, 40, 1024, 1, 7, 5, "auto", {"splitk": 2}),
    ("int8", 6, 40, 1056, 1, 7, 7, "auto", {}),
    ("int8", 6, 72, 2304, 1, 5, 4, "chunk", {"splitk": 4, "bo": 64}),
    ("fp8", 4, 40, 800, 1, 6, 6, "auto", {}),
    ("fp8", 1, 72, 1600, 1, 3, 3, "chunk", {"splitk": 2}),
    # blocks of a power of two plus a smaller one (Config.tail: two row tiles per weight tile):
    # 48 = 32 + 16, 160 = 128 + 32 (the 8k prefill's blocks), either operand order, split-K, unscaled
    ("int8", 3, 72, 128, 48, 3, 2, "auto", {}),
    ("int8", 3, 72, 128, 160, 2, 2, "auto", {"wlhs": False}),
    ("int8", 3, 72, 256, 96, 3, 3, "auto", {"splitk": 2}),
    ("bf16", 3, 40, 96, 48, 3, 2, "auto", {}),
]


def _case_id(c):
    flags = "".join(f"-{k}{v}" for k, v in sorted(c[8].items()))
    return f"{c[0]}-G{c[1]}-O{c[2]}-bm{c[4]}-used{c[6]}-{c[7]}{flags}"


@pytest.mark.parametrize("kind,G,O,K,bm,nb,used,mode,tiles", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_interpret_matches_reference(kind, G, O, K, bm, nb, used, mode, tiles):
    rng = np.random.default_rng(2)
    codes, scale = _weights(rng, kind, G, O, K)
    x = jnp.asarray(rng.standard_normal((nb * bm, K)), jnp.bfloat16)
    bg = jnp.asarray(rng.integers(0, G, nb), jnp.int32)
    if G > 1:
        bg = bg.at[0].set(G - 1)  # the last group's offset is reached
    dense = G == 1 and kind == "fp8"
    cw, sw = (codes[0], scale[0]) if dense else (codes, scale)  # dense weights: [O, K] + [O, K/32]
    cfg = Q.choose_config(bm, O, K, sw is not None, mode, groups=G, **tiles)
    one_row = bm == 1 and sw is not None and G > 1
    assert cfg.mode == (("chunk" if one_row else "dot") if mode == "auto" else mode)
    assert cfg.tm + cfg.tail >= bm and (cfg.tail == 0) == (bm in (1, 2, 4, 8, 16, 32, 64, 128))
    got = Q.grouped_qmatmul(x, bg, used, cw, sw, bm=bm, out_dtype=F32, impl="interpret", mode=mode, **tiles)
    ref = Q.grouped_qmatmul_reference(x, bg, used, cw, sw, bm=bm, out_dtype=F32)
    assert got.shape == (nb * bm, O)
    assert _rel(got, ref) < 1e-6  # fp32 outputs: only the summation order differs
    assert np.all(np.asarray(got[used * bm:]) == 0)
    assert np.max(np.abs(np.asarray(got[: used * bm]))) > 0
    # bf16 output: one rounding of the fp32 sum, so at most one bf16 ulp apart
    got16 = Q.grouped_qmatmul(x, bg, used, cw, sw, bm=bm, out_dtype=jnp.bfloat16, impl="interpret", mode=mode, **tiles)
    ref32 = np.asarray(ref, np.float64)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref32), 1e-30))) - 7)
    assert np.all(np.abs(np.asarray(got16, np.float64) - ref32) <= ulp + 1e-30)


# K-blocked codes (``Q.kblock``): the int8 cases above whose K is a multiple of 64, in every mode
# but "reduce" (which does not take them), plus a fused launch
KBLOCKED = [c for c in CASES if c[0] == "int8" and (c[3] // c[8].get("splitk", 1)) % Q.KBLOCK == 0
            and c[7] != "reduce"]


@pytest.mark.parametrize("kind,G,O,K,bm,nb,used,mode,tiles", KBLOCKED, ids=[_case_id(c) for c in KBLOCKED])
def test_kblocked_codes_give_the_rows_results(kind, G, O, K, bm, nb, used, mode, tiles):
    """The kernel on K-blocked codes equals the kernel on the same codes in rows: bit for bit where
    both choose the same tiles and split-K (each program reads the same values in the same
    order), else up to fp32 summation order; the XLA form unblocks."""
    rng = np.random.default_rng(2)
    codes, scale = _weights(rng, kind, G, O, K)
    kb = Q.kblock(codes)
    assert kb.shape == (G, K // 64, O, 64) and Q.code_dims(kb) == (G, O, K)
    np.testing.assert_array_equal(np.asarray(Q.unblock(kb)), np.asarray(codes))
    # closed form: block b of output row o holds inputs [64 b, 64 b + 64) of that row
    np.testing.assert_array_equal(np.asarray(kb[1, K // 64 - 1, 3]), np.asarray(codes[1, 3, K - 64:]))
    x = jnp.asarray(rng.standard_normal((nb * bm, K)), jnp.bfloat16)
    bg = jnp.asarray(rng.integers(0, G, nb), jnp.int32).at[0].set(G - 1)
    rows_cfg = Q.choose_config(bm, O, K, True, mode, groups=G, nb=nb, **tiles)
    blk_cfg = Q.choose_config(bm, O, K, True, mode, groups=G, nb=nb, kblocked=True, **tiles)
    assert blk_cfg.bk % Q.KBLOCK == 0 and (K // blk_cfg.splitk) % Q.KBLOCK == 0
    got = Q.grouped_qmatmul(x, bg, used, kb, scale, bm=bm, out_dtype=F32, impl="interpret", mode=mode, **tiles)
    rows = Q.grouped_qmatmul(x, bg, used, codes, scale, bm=bm, out_dtype=F32, impl="interpret", mode=mode, **tiles)
    if rows_cfg == blk_cfg:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))
    assert _rel(got, rows) < 1e-6
    assert np.all(np.asarray(got[used * bm:]) == 0) and np.max(np.abs(np.asarray(got[: used * bm]))) > 0
    xla = Q.grouped_qmatmul(x, bg, used, kb, scale, bm=bm, out_dtype=F32, impl="xla")
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(Q.grouped_qmatmul_reference(
        x, bg, used, codes, scale, bm=bm, out_dtype=F32)))


def test_kblocked_codes_in_fused_and_multi_launches():
    rng = np.random.default_rng(12)
    ws = [_weights(rng, "int8", 6, O, 1024) for O in (40, 72)]
    kws = [(Q.kblock(c), s) for c, s in ws]
    x = jnp.asarray(rng.standard_normal((5, 1024)), jnp.bfloat16)
    bg = jnp.asarray([5, 0, 3, 3, 1], jnp.int32)
    got = Q.grouped_qmatmul_fused(x, bg, 4, kws, bm=1, out_dtype=F32, impl="interpret")
    rows = Q.grouped_qmatmul_fused(x, bg, 4, ws, bm=1, out_dtype=F32, impl="interpret")
    for a, b in zip(got, rows):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dense = [(c[0], s[0]) for c, s in (_weights(rng, "fp8", 1, O, 1024) for O in (64, 40))]
    xd = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
    problems = [dict(x=x, block_group=bg, n_blocks=4, weights=kws, bm=1, out_dtype=F32),
                dict(x=xd, block_group=jnp.zeros((1,), jnp.int32), n_blocks=1, weights=dense, bm=1, out_dtype=F32)]
    multi = Q.grouped_qmatmul_multi(problems, impl="interpret")
    for a, b in zip(multi[0], rows):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="layout"):  # one launch takes one layout
        Q.grouped_qmatmul_fused(x, bg, 4, [kws[0], ws[1]], bm=1, impl="interpret")
    with pytest.raises(ValueError, match="reduce"):
        Q.grouped_qmatmul(x, bg, 4, *kws[0], bm=1, impl="interpret", mode="reduce")
    with pytest.raises(ValueError, match="64-input ranges"):  # K ranges of whole 64-input blocks
        Q.choose_config(1, 40, 256, True, groups=6, kblocked=True, splitk=8)
    with pytest.raises(ValueError, match="K-blocked"):  # blocks of another width
        Q.grouped_qmatmul(x, bg, 4, ws[0][0].reshape(6, 40, 32, 32).swapaxes(1, 2), ws[0][1], bm=1, impl="interpret")


@pytest.mark.parametrize("bm,mode,tiles", [(1, "auto", {}), (8, "auto", {}), (160, "auto", {}),
                                            (128, "dot", {"split": True})], ids=["chunk", "small", "large", "split"])
def test_kblocked_codes_lower_for_cuda(bm, mode, tiles):
    """The Triton kernel's K-blocked reads (a 3-D tile transposed in registers) lower for CUDA at
    V4.1-Flash widths (checked without a GPU)."""
    SD = jax.ShapeDtypeStruct
    R = bm * 6 if bm > 1 else 8
    args = (SD((R, 5120), jnp.bfloat16), SD((R // bm,), jnp.int32), SD((384, 80, 2304, 64), jnp.int8),
            SD((384, 2304, 160), jnp.uint8))
    f = jax.jit(lambda x, bg, c, sc: Q.grouped_qmatmul(x, bg, 3, c, sc, bm=bm, impl="triton", mode=mode, **tiles))
    assert "grouped_qmatmul" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_auto_splitk_policy():
    # decode GEMVs get enough programs; K ranges stay whole 32-input scale blocks
    assert Q.auto_splitk(36 * 6, 5120) == 4      # routed w1/w3, one token: 216 programs
    assert Q.auto_splitk(36, 5120) == 16         # one-row dense projection [2304, 5120]
    assert Q.auto_splitk(36 * 408, 5120) == 1    # prefill blocks: plenty of programs already
    assert Q.auto_splitk(8, 96) == 1             # K = 96 cannot be cut into two 64-input ranges
    cfg = Q.choose_config(1, 2304, 5120, True, nb=6)
    assert cfg.splitk == 4 and (5120 // 4) % cfg.bk == 0
    assert Q.choose_config(1, 2304, 5120, True, nb=6, splitk=1).splitk == 1
    assert Q.choose_config(16, 72, 64, True, nb=7, group_rows=3).splitk == 1
    # the chunk mode's split-K keeps every K range at least one 512-input step long
    w1, w2 = Q.choose_config(1, 2304, 5120, True, nb=6, groups=384), Q.choose_config(1, 5120, 2304, True, nb=6,
                                                                                      groups=384)
    assert (w1.mode, w1.bo, w1.bk, w1.splitk) == ("chunk", 32, 512, 2)
    assert (w2.mode, w2.splitk) == ("chunk", 1)  # 960 programs already
    assert Q.choose_config(1, 2304, 5120, True, nb=6).mode == "dot"  # one dense weight: the dot mode
    with pytest.raises(ValueError, match="splitk"):
        Q.choose_config(1, 40, 96, True, splitk=2)


def test_kernel_interpret_fp32_compute():
    rng = np.random.default_rng(3)
    codes, scale = _weights(rng, "int8", 4, 40, 128)
    x = jnp.asarray(rng.standard_normal((32, 128)), F32)
    bg = jnp.asarray([3, 1], jnp.int32)
    want = _np_grouped(x, bg, 2, codes, scale, 16, 0.5)
    for mode, tiles in (("dot", {}), ("reduce", {}), ("reduce", {"acc": True})):
        got = Q.grouped_qmatmul(x, bg, 2, codes, scale, bm=16, impl="interpret", mode=mode, **tiles)
        assert got.dtype == F32
        assert _rel(got, want) < 2e-6, mode
    xr = jnp.asarray(rng.standard_normal((3, 128)), F32)  # one-row blocks: the chunk mode in fp32
    bgr = jnp.asarray([3, 0, 2], jnp.int32)
    got = Q.grouped_qmatmul(xr, bgr, 3, codes, scale, bm=1, impl="interpret")
    assert got.dtype == F32 and _rel(got, _np_grouped(xr, bgr, 3, codes, scale, 1, 0.5)) < 2e-6
    wf = jnp.asarray(rng.standard_normal((4, 40, 128)), F32)  # fp32 weights, no scale
    got = Q.grouped_qmatmul(x, bg, 2, wf, None, bm=16, impl="interpret")
    assert _rel(got, _np_grouped(x, bg, 2, wf, None, 16, 1.0)) < 2e-6


def test_kernel_rejects_bad_shapes():
    rng = np.random.default_rng(4)
    codes, scale = _weights(rng, "int8", 2, 8, 64)
    x = jnp.zeros((6, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of bm"):
        Q.grouped_qmatmul(x, jnp.zeros((1,), jnp.int32), 1, codes, scale, bm=4, impl="interpret")
    with pytest.raises(ValueError, match="scale"):
        Q.grouped_qmatmul(x, jnp.zeros((6,), jnp.int32), 1, codes, scale[:, :, :1], bm=1, impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        Q.grouped_qmatmul(x, jnp.zeros((6,), jnp.int32), 1, codes, scale, bm=1, impl="cuda")


# ------------------------------------------------------------------------------ fused launches
# (kind, G, output sizes, K, bm, n_blocks, used, tiles): decode chunk blocks, dense one-row and
# padded blocks, prefill blocks, the 1-D launch order, unscaled weights, explicit split-K
FUSED = [
    ("int8", 6, (40, 72), 1024, 1, 7, 5, {}),
    ("int8", 6, (40, 40), 256, 1, 7, 5, {"splitk": 4}),
    ("fp8", 1, (72, 40, 32), 256, 1, 3, 3, {}),
    ("fp8", 1, (40, 96), 128, 8, 2, 2, {}),
    ("int8", 3, (72, 40), 128, 64, 3, 2, {}),
    ("fp8", 1, (72, 40), 64, 16, 7, 7, {"bo": 32, "group_rows": 3}),
    ("bf16", 6, (40, 24), 96, 1, 6, 5, {}),
]


@pytest.mark.parametrize("kind,G,Os,K,bm,nb,used,tiles", FUSED,
                         ids=[f"{c[0]}-G{c[1]}-O{'x'.join(map(str, c[2]))}-bm{c[4]}-{len(c[7])}" for c in FUSED])
def test_fused_launch_matches_separate_calls(kind, G, Os, K, bm, nb, used, tiles):
    """One launch over several weights gives each weight's own result: against the XLA reference
    (fp32 outputs, summation order only), and bit for bit against one call per weight when both
    use the same tiles and split-K."""
    rng = np.random.default_rng(5)
    ws = [_weights(rng, kind, G, O, K) for O in Os]
    if G == 1 and kind == "fp8":
        ws = [(c[0], s[0]) for c, s in ws]  # dense weights: [O, K] + [O, K/32]
    x = jnp.asarray(rng.standard_normal((nb * bm, K)), jnp.bfloat16)
    bg = jnp.asarray(rng.integers(0, G, nb), jnp.int32).at[0].set(G - 1)
    got = Q.grouped_qmatmul_fused(x, bg, used, ws, bm=bm, out_dtype=F32, impl="interpret", **tiles)
    assert len(got) == len(Os)
    cfg = Q.choose_config(bm, max(Os), K, ws[0][1] is not None, groups=G, nb=nb, outs=list(Os), **tiles)
    for (c, s), O, y in zip(ws, Os, got):
        ref = Q.grouped_qmatmul_reference(x, bg, used, c, s, bm=bm, out_dtype=F32)
        assert y.shape == (nb * bm, O)
        assert _rel(y, ref) < 1e-6
        assert np.all(np.asarray(y[used * bm:]) == 0) and np.max(np.abs(np.asarray(y[: used * bm]))) > 0
        same = Q.grouped_qmatmul(x, bg, used, c, s, bm=bm, out_dtype=F32, impl="interpret",
                                 **{**tiles, "splitk": cfg.splitk, "bo": cfg.bo})
        np.testing.assert_array_equal(np.asarray(y), np.asarray(same))
    xla = Q.grouped_qmatmul_fused(x, bg, used, ws, bm=bm, out_dtype=F32, impl="xla")
    for y, r in zip(got, xla):
        assert _rel(y, r) < 1e-6


def test_fused_launch_split_k_counts_all_tiles():
    # two routed weights of one token: 2 x 72 x 6 programs need no split-K, one alone needs 2
    assert Q.choose_config(1, 2304, 5120, True, nb=6, groups=384).splitk == 2
    assert Q.choose_config(1, 2304, 5120, True, nb=6, groups=384, outs=[2304, 2304]).splitk == 1


def test_fused_launch_rejects_mixed_weights():
    rng = np.random.default_rng(6)
    a, b = _weights(rng, "int8", 2, 8, 64), _weights(rng, "fp8", 2, 8, 64)
    x = jnp.zeros((2, 64), jnp.bfloat16)
    bg = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="differ"):
        Q.grouped_qmatmul_fused(x, bg, 2, [a, b], bm=1, impl="interpret")
    with pytest.raises(ValueError, match="differ"):
        Q.grouped_qmatmul_fused(x, bg, 2, [a, (a[0][:1], a[1][:1])], bm=1, impl="interpret")
    with pytest.raises(ValueError, match="no weights"):
        Q.grouped_qmatmul_fused(x, bg, 2, [], bm=1, impl="interpret")
    with pytest.raises(ValueError, match="x has K"):
        Q.grouped_qmatmul_fused(x, bg, 2, [a, _weights(rng, "int8", 2, 8, 96)], bm=1, impl="interpret")


def test_multi_launch_equals_each_problem_alone():
    """Independent problems in one launch (``grouped_qmatmul_multi``): routed-style int8 one-row
    blocks (chunk mode, two weights), a dense fp8 weight pair on one row (dot mode, split-K), and
    unscaled bf16 weights in 4-row blocks with another K. Each result equals its problem's own
    ``grouped_qmatmul_fused`` call bit for bit, and the XLA reference up to summation order."""
    rng = np.random.default_rng(8)
    routed = [_weights(rng, "int8", 6, O, 1024) for O in (40, 72)]
    dense = [(c[0], s[0]) for c, s in (_weights(rng, "fp8", 1, O, 1024) for O in (64, 40))]
    plain = [_weights(rng, "bf16", 3, 24, 96)]
    xr = jnp.asarray(rng.standard_normal((5, 1024)), jnp.bfloat16)
    xd = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
    xp = jnp.asarray(rng.standard_normal((8, 96)), jnp.bfloat16)
    problems = [dict(x=xr, block_group=jnp.asarray([5, 0, 3, 3, 1], jnp.int32), n_blocks=4, weights=routed, bm=1,
                     out_dtype=F32),
                dict(x=xd, block_group=jnp.zeros((1,), jnp.int32), n_blocks=1, weights=dense, bm=1, out_dtype=F32),
                dict(x=xp, block_group=jnp.asarray([2, 0], jnp.int32), n_blocks=2, weights=plain, bm=4)]
    modes = [Q.choose_config(p["bm"], max(c.shape[-2] for c, _ in p["weights"]), p["x"].shape[1], True,
                             groups=p["weights"][0][0].shape[0] if p["weights"][0][0].ndim == 3 else 1,
                             nb=p["x"].shape[0] // p["bm"], outs=[c.shape[-2] for c, _ in p["weights"]]).mode
             for p in problems[:2]]
    assert modes == ["chunk", "dot"]
    got = Q.grouped_qmatmul_multi(problems, impl="interpret")
    assert len(got) == 3 and [len(g) for g in got] == [2, 2, 1]
    for p, outs in zip(problems, got):
        kw = {k: v for k, v in p.items() if k not in ("x", "block_group", "n_blocks", "weights")}
        alone = Q.grouped_qmatmul_fused(p["x"], p["block_group"], p["n_blocks"], p["weights"], impl="interpret", **kw)
        for y, a, (c, s) in zip(outs, alone, p["weights"]):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(a))
            ref = Q.grouped_qmatmul_reference(p["x"], p["block_group"], p["n_blocks"], c, s, bm=p["bm"],
                                              out_dtype=y.dtype)
            assert y.dtype == ref.dtype and _rel(y, ref) < (1e-6 if y.dtype == F32 else 1e-2)
            assert np.all(np.asarray(y[p["n_blocks"] * p["bm"]:]) == 0)
    xla = Q.grouped_qmatmul_multi(problems, impl="xla")
    assert [len(g) for g in xla] == [2, 2, 1]


def test_multi_launch_rejects_bad_problems():
    rng = np.random.default_rng(9)
    w = [_weights(rng, "int8", 2, 8, 64)]
    p = dict(x=jnp.zeros((2, 64), jnp.bfloat16), block_group=jnp.zeros((2,), jnp.int32), n_blocks=2, weights=w, bm=1)
    with pytest.raises(ValueError, match="unknown problem keys"):
        Q.grouped_qmatmul_multi([dict(p, rows=2)], impl="interpret")
    q = dict(p, x=jnp.zeros((32, 64), jnp.bfloat16), block_group=jnp.zeros((2,), jnp.int32), bm=16,
             tiles={"group_rows": 2, "bo": 8})
    with pytest.raises(ValueError, match="group_rows"):
        Q.grouped_qmatmul_multi([p, q], impl="interpret")


# ------------------------------------------------------------------------------ MoE integration
def _moe(numerics, int8: bool, seed: int = 0):
    cfg = with_text_overrides(preset("tiny"), n_routed_experts=24, num_experts_per_tok=3, moe_intermediate_size=96)
    t = cfg.text
    moe = MoE(t, numerics, vision=False, experts_int8=int8)
    rng = np.random.default_rng(seed)
    E, D, I = t.n_routed_experts, t.hidden_size, t.moe_intermediate_size
    moe.gate.weight.set_value(jnp.asarray(rng.standard_normal((E, D)) * 0.3, numerics.dtype))
    moe.gate.bias.set_value(jnp.asarray(rng.standard_normal(E) * 0.1, F32))
    for name, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        p = getattr(moe.experts, name)
        if int8:
            p.weight.set_value(jnp.asarray(rng.integers(-12, 13, (E, o, i)), jnp.int8))
            p.scale.set_value(jnp.asarray(rng.integers(122, 126, (E, o, i // 32)), jnp.uint8))
        else:
            p.weight.set_value(jnp.asarray(rng.standard_normal((E, o, i)) * 0.15, numerics.dtype))
    moe.experts.quantized = numerics.fake_quant  # the act fake-quant points run in reference numerics
    return t, moe


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float"])
@pytest.mark.parametrize("numerics", [Numerics("float32", "fast"), Numerics("bfloat16", "reference")],
                         ids=["fp32-fast", "bf16-reference"])
def test_moe_pallas_path_matches_dense(numerics, int8, monkeypatch):
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    t, moe = _moe(numerics, int8)
    rng = np.random.default_rng(5)
    dense, pallas, grouped = jax.jit(moe.routed_dense), jax.jit(moe.routed_pallas), jax.jit(moe.routed_grouped)
    # bf16: g, u, h and each expert output are rounded to bf16; a different fp32 summation order
    # may move one of those roundings by one ulp (2^-8 relative)
    tol = 1e-5 if numerics.dtype == F32 else 2 ** -7
    for T in (3, 40):  # 9 pairs < 24 experts: GEMV per pair; 120 pairs: sorted 16-row blocks
        x = jnp.asarray(rng.standard_normal((T, t.hidden_size)), numerics.dtype)
        w, ids = moe.gate(x)
        want = np.asarray(dense(x, w, ids))
        got = np.asarray(pallas(x, w, ids))
        assert _rel(got, want) <= tol, T
        # the grouped XLA loop has the same per-pair structure: equal up to fp32 summation order
        assert _rel(got, grouped(x, w, ids)) <= (1e-5 if numerics.dtype == F32 else 2 ** -8), T
        assert _rel(pallas(x, w, (ids + 1) % t.n_routed_experts), want) > 100 * tol  # a wrong expert shows
    # the forced path through MoE.__call__ (plus the shared expert)
    monkeypatch.setenv("DSV41_MOE_PATH", "pallas")
    y_p = np.asarray(jax.jit(lambda a: moe(a))(x), np.float64)
    monkeypatch.setenv("DSV41_MOE_PATH", "dense")
    y_d = np.asarray(jax.jit(lambda a: moe(a))(x), np.float64)
    assert _rel(y_p, y_d) <= 2 * tol


@pytest.mark.parametrize("numerics", [Numerics("float32", "fast"), Numerics("bfloat16", "reference")],
                         ids=["fp32-fast", "bf16-reference"])
def test_moe_decode_shares_launches_with_the_shared_expert(numerics, monkeypatch):
    """Decode on the kernel path with an fp8 shared expert: its w1 + w3 run in the routed w1 + w3
    launch and its w2 in the routed w2 launch (two ``grouped_qmatmul_multi`` launches), bit for
    bit ``routed_pallas`` plus the shared expert's own fused launches, and MoE.__call__ takes
    that route; the dense XLA route agrees up to summation order."""
    import ml_dtypes

    import dsv41_jax.kernels as K
    from dsv41_jax.model import layers

    t, moe = _moe(numerics, True)
    rng = np.random.default_rng(12)
    for lin in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
        lin.quantized = numerics.fake_quant
        lin.set_fp8()
        c = rng.integers(0, 256, (lin.out_features, lin.in_features), dtype=np.uint8)
        c[(c & 0x7F) == 0x7F] = 0
        lin.weight.set_value(jnp.asarray(c.view(ml_dtypes.float8_e4m3fn)))
        lin.scale.set_value(jnp.asarray(rng.integers(118, 126, (lin.out_features, lin.in_features // 32)), jnp.uint8))
    x = jnp.asarray(rng.standard_normal((2, t.hidden_size)), numerics.dtype)
    w, ids = moe.gate(x)
    monkeypatch.setenv("DSV41_MOE_PATH", "dense")
    want = np.asarray(jax.jit(lambda a: moe(a))(x), np.float64)
    calls = []
    real = Q.grouped_qmatmul_multi
    monkeypatch.setattr(K, "grouped_qmatmul_multi", lambda ps, **kw: calls.append(len(ps)) or real(ps, **kw))
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("DSV41_KERNELS", "pallas")
    monkeypatch.setenv("DSV41_MOE_PATH", "pallas")
    both = np.asarray(jax.jit(moe.routed_pallas_with_shared)(x, w, ids))
    assert calls == [2, 2]
    apart = jax.jit(lambda a, b, c: moe.routed_pallas(a, b, c) + moe.shared_experts(a).astype(F32))(x, w, ids)
    np.testing.assert_array_equal(both, np.asarray(apart))
    calls.clear()
    got = np.asarray(jax.jit(lambda a: moe(a))(x), np.float64)
    assert calls == [2, 2]
    np.testing.assert_array_equal(got, both.astype(numerics.dtype).astype(np.float64))
    assert _rel(got, want) <= (1e-5 if numerics.dtype == F32 else 2 ** -6)
    assert moe.routed_pallas_with_shared(jnp.tile(x, (8, 1)), *moe.gate(jnp.tile(x, (8, 1)))) is None  # 48 pairs


def test_moe_pallas_path_on_the_expert_parallel_local_view(monkeypatch):
    """``moe_ep``'s per-device view (local expert shards, no shared expert) runs ``routed_pallas``
    as the module does: the same result on the same experts, decode and prefill layouts."""
    from dsv41_jax.model import moe_ep

    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    t, moe = _moe(Numerics("float32", "fast"), True)
    ex = moe.experts
    view = moe_ep._Local(moe, *(moe_ep._Local._P(p.weight[...], p.scale[...]) for p in (ex.w1, ex.w3, ex.w2)))
    rng = np.random.default_rng(13)
    for T in (3, 40):
        x = jnp.asarray(rng.standard_normal((T, t.hidden_size)), F32)
        w, ids = moe.gate(x)
        np.testing.assert_array_equal(np.asarray(view.routed_pallas(x, w, ids)), np.asarray(moe.routed_pallas(x, w, ids)))
    # the Mosaic GPU prefill's tile choice reads the view's projections as the module's
    for proj in ("glu", "w2"):
        assert view._mgpu_tiles(proj, 32) == moe._mgpu_tiles(proj, 32)


def test_moe_path_selection(monkeypatch):
    t, moe = _moe(Numerics("float32", "fast"), True)
    monkeypatch.setenv("DSV41_KERNELS", "pallas")
    # the automatic choice switches to the kernels only on a GPU backend
    assert moe._path(100, 3) == ("pallas" if jax.default_backend() == "gpu" else "grouped")
    monkeypatch.setenv("DSV41_KERNELS", "triton")
    with pytest.raises(ValueError, match="DSV41_KERNELS"):
        moe._path(100, 3)
    monkeypatch.setenv("DSV41_MOE_PATH", "pallas")
    assert moe._path(1, 3) == "pallas"
    # blocks hold a typical expert's pairs under balanced routing: 2k / 8k / 32k-token prefills of
    # V4.1-Flash (6 of 384 experts), a short prompt
    assert [pallas_chunk(6 * T, 384) for T in (2048, 8192, 32768, 512)] == [48, 160, 192, 16]
    monkeypatch.setenv("DSV41_MOE_CHUNK", "128")
    assert pallas_chunk(49152, 384) == 128
    monkeypatch.setenv("DSV41_MOE_CHUNK", "12")
    with pytest.raises(ValueError, match="DSV41_MOE_CHUNK"):
        pallas_chunk(49152, 384)


@pytest.mark.parametrize("chunk", ["48", "40"])  # two row tiles per block (32 + 16); one padded 64-row tile
def test_moe_prefill_blocks_of_other_sizes_match_dense(chunk, monkeypatch):
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MOE_CHUNK", chunk)
    t, moe = _moe(Numerics("float32", "fast"), True)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((200, t.hidden_size)), F32)
    w, ids = moe.gate(x)
    assert np.bincount(np.asarray(ids).ravel()).max() > 2 * int(chunk) // 3  # rows in the 48-row blocks' second tile
    assert _rel(np.asarray(jax.jit(moe.routed_pallas)(x, w, ids)), np.asarray(jax.jit(moe.routed_dense)(x, w, ids))) <= 1e-5


def test_kernels_default_by_device(monkeypatch):
    """``DSV41_KERNELS`` unset = auto: the Pallas kernels only on a GPU of compute capability >= 9
    (where they were measured); ``xla`` never, ``pallas`` on any GPU; off the GPU never."""
    from dsv41_jax.kernels import use_pallas

    class Dev:
        def __init__(self, cap):
            self.compute_capability = cap

    monkeypatch.delenv("DSV41_KERNELS", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not use_pallas()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for cap, want in (("9.0", True), ("10.0", True), ("8.0", False), ("8.9", False)):
        monkeypatch.setattr(jax, "devices", lambda cap=cap: [Dev(cap)])
        assert use_pallas() is want, cap
        monkeypatch.setenv("DSV41_KERNELS", "pallas")
        assert use_pallas()
        monkeypatch.setenv("DSV41_KERNELS", "xla")
        assert not use_pallas()
        monkeypatch.delenv("DSV41_KERNELS")


def test_offsets_guard_for_the_triton_lowering():
    """An operand of more than 2**31 elements but <= 2**32 bytes is misaddressed by the Triton lowering
    (32-bit signed offsets): one device's half of the V4.1 int8 experts on a 2-way expert mesh.
    ``offsets_fit`` flags exactly that range; an explicit ``impl="triton"`` call refuses it with a
    clear error (auto falls back to XLA), checked abstractly (no memory)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.kernels import grouped_qmatmul, offsets_fit

    assert not offsets_fit((192, 2304, 5120), jnp.int8)      # 2.26 GB: the broken range
    assert offsets_fit((384, 2304, 5120), jnp.int8)          # 4.5 GB: 64-bit offsets
    assert offsets_fit((48, 2304, 5120), jnp.int8)           # 0.57 GB: 32-bit offsets suffice
    assert offsets_fit((1 << 30, 2), jnp.bfloat16)           # 2**31 elements: largest offset 2**31 - 1
    assert offsets_fit((1 << 31,), jnp.uint8)
    assert not offsets_fit(((1 << 31) + 32,), jnp.uint8)
    codes = jax.ShapeDtypeStruct((192, 2304, 5120), jnp.int8)
    scale = jax.ShapeDtypeStruct((192, 2304, 160), jnp.uint8)
    x = jax.ShapeDtypeStruct((4, 5120), jnp.bfloat16)
    bg = jax.ShapeDtypeStruct((4,), jnp.int32)
    with pytest.raises(ValueError, match="32-bit offsets"):
        jax.eval_shape(lambda x, bg, c, s: grouped_qmatmul(x, bg, 4, c, s, bm=1, impl="triton"), x, bg, codes, scale)
    out = jax.eval_shape(lambda x, bg, c, s: grouped_qmatmul(x, bg, 4, c, s, bm=1), x, bg, codes, scale)
    assert out.shape == (4, 2304)



def test_tuning_env_override(monkeypatch):
    """``DSV41_QMATMUL_TUNING`` overrides ``TUNING`` fields per size; bad input is one clear error."""
    assert Q.choose_config(128, 2304, 5120, True, nb=400).wlhs  # prefill blocks: weights on the left
    assert not Q.choose_config(1, 2304, 5120, True, nb=6).wlhs  # decode GEMVs: the other order
    monkeypatch.setenv("DSV41_QMATMUL_TUNING", '{"large": {"wlhs": false, "num_warps": 8}, "small": {"bo": 32}}')
    big, small = Q.choose_config(128, 2304, 5120, True, nb=400), Q.choose_config(1, 2304, 5120, True, nb=6)
    assert (big.wlhs, big.num_warps, big.bo) == (False, 8, 128) and small.bo == 32
    monkeypatch.setenv("DSV41_QMATMUL_TUNING", '{"one_row": {"mode": "dot", "bk": 128}}')  # the pre-chunk GEMV
    old = Q.choose_config(1, 2304, 5120, True, nb=6, groups=384)
    assert (old.mode, old.tm, old.bk, old.bo) == ("dot", 16, 128, 32)
    with pytest.raises(ValueError, match="one-row blocks"):
        Q.choose_config(4, 2304, 5120, True, mode="chunk")
    monkeypatch.setenv("DSV41_QMATMUL_TUNING", '{"large": {"warps": 8}}')
    with pytest.raises(ValueError, match="unknown Config fields"):
        Q.choose_config(128, 2304, 5120, True)
    for bad in ("[1, 2]", '{"large": 5}', "{large"):
        monkeypatch.setenv("DSV41_QMATMUL_TUNING", bad)
        with pytest.raises(ValueError, match="not a JSON object"):
            Q.choose_config(128, 2304, 5120, True)


def test_unused_blocks_left_unwritten_on_request():
    """``dead_zeros=False`` (a prefill's routed w2): the used blocks are the same, the unused ones
    are not written (the default zero-fills them)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4 * 16, 64)), F32)
    codes = jnp.asarray(rng.integers(-12, 13, (3, 48, 64)), jnp.int8)
    scale = jnp.asarray(rng.integers(122, 128, (3, 48, 2)), jnp.uint8)
    bg = jnp.asarray([2, 0, 1, 1], jnp.int32)
    full = np.asarray(Q.grouped_qmatmul(x, bg, 2, codes, scale, bm=16, impl="interpret"))
    part = np.asarray(Q.grouped_qmatmul(x, bg, 2, codes, scale, bm=16, impl="interpret", dead_zeros=False))
    np.testing.assert_array_equal(part[:32], full[:32])
    assert np.all(full[32:] == 0)


def test_split_tail_launches():
    """``split_tail`` (160-row blocks = 128 + 32): blocks marked 0 run without the tail tile (its
    rows left unwritten: NaN in the interpreter), the others on both tiles in a second launch into
    the same outputs; with the default zero-filling, blocks past ``n_blocks`` are still zeros."""
    rng = np.random.default_rng(5)
    bm, nb, K = 160, 5, 64
    x = jnp.asarray(rng.standard_normal((nb * bm, K)), F32)
    ws = [_weights(rng, "int8", 3, O, K) for O in (48, 80)]
    bg = jnp.asarray(rng.integers(0, 3, nb), jnp.int32)
    sel = jnp.asarray([0, 1, 1, 0, 1], jnp.int32)
    want = [_np_grouped(x, bg, 4, c, s, bm, 0.5) for c, s in ws]
    for dead_zeros in (False, True):
        got = Q.grouped_qmatmul_fused(x, bg, 4, ws, bm=bm, impl="interpret", split_tail=sel, dead_zeros=dead_zeros)
        for g, w in zip(got, want):
            g = np.asarray(g)
            for j in range(4):
                main, tail = slice(j * bm, j * bm + 128), slice(j * bm + 128, (j + 1) * bm)
                assert _rel(g[main], w[main]) < 1e-5, j
                if int(sel[j]):
                    assert _rel(g[tail], w[tail]) < 1e-5, j
                else:
                    assert np.isnan(g[tail]).all(), j
            assert np.all(g[4 * bm:] == 0) if dead_zeros else np.isnan(g[4 * bm:]).all()
    with pytest.raises(ValueError, match="split_tail"):
        Q.grouped_qmatmul_fused(x, bg, 4, ws, bm=bm, impl="interpret", split_tail=sel[:3])
