"""``kernels.moe_mgpu`` (the routed experts' GEMMs as a Mosaic GPU kernel, transposed layout) in
JAX's Mosaic GPU interpreter against its XLA form, its CUDA lowering at V4.1-Flash shapes, and
``MoE.routed_mgpu`` against the default prefill path."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.kernels import moe_mgpu as MG
from dsv41_jax.kernels import qmatmul as Q
from dsv41_jax.kernels.qmatmul import dequantize

F32 = jnp.float32
BF16 = jnp.bfloat16


def _problem(rng, G, O, K, blocks, bm):
    codes = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8)
    scale = jnp.asarray(rng.integers(118, 132, (G, O, K // 32)), jnp.uint8)
    xt = jnp.asarray(rng.standard_normal((K, blocks * bm)), BF16)
    bg = jnp.asarray(rng.permutation(np.arange(blocks) % G), jnp.int32)
    return xt, bg, codes, scale


CASES = [(MG.Tiles(), 128, 256, 128), (MG.Tiles(tile_m=64, tile_k=128, steps=2), 32, 128, 256),
         (MG.Tiles(tile_m=128, tile_k=64, steps=3), 160, 256, 128)]


# the Mosaic GPU interpreter is new in JAX 0.10; should it ever hang, fail after 10 minutes instead
# of stalling the suite
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tiles,bm,O,K", CASES, ids=[f"tm{t.tile_m}-tk{t.tile_k}-bm{b}" for t, b, _, _ in CASES])
def test_kernel_equals_its_xla_form(tiles, bm, O, K):
    """Row blocks of one (32), two (64: the epilogue's 64-token tiles) and five (160) 32-token
    widths; several K steps; neighbouring blocks on other experts; the last block past
    ``n_blocks`` (not compared: left unwritten). bf16 results: the fp32 summation order may move
    one by an ulp. Each block is also checked against its own expert in numpy, so a block
    multiplied by a neighbour's weights shows."""
    rng = np.random.default_rng(bm + O)
    xt, bg, codes, scale = _problem(rng, G=3, O=O, K=K, blocks=4, bm=bm)
    nb = 3
    got = np.asarray(MG.grouped_matmul_t(xt, bg, nb, codes, scale, bm=bm, impl="interpret", tiles=tiles, num_sms=3),
                     np.float64)[:, :nb * bm]
    want = np.asarray(MG.grouped_matmul_t(xt, bg, nb, codes, scale, bm=bm, impl="xla"), np.float64)[:, :nb * bm]
    ulp = 2.0 ** -7 * np.abs(want)
    assert np.all(np.abs(got - want) <= ulp + 1e-30)
    assert np.mean(got != want) < 1e-3
    x64 = np.asarray(xt, np.float64)
    for j in range(nb):
        wj = np.asarray(dequantize(codes[int(bg[j])], scale[int(bg[j])], F32), np.float64)
        ref = wj @ x64[:, j * bm:(j + 1) * bm]
        tol = 2.0 ** -8 * np.abs(ref) + 1e-6 * np.abs(ref).max()
        assert np.all(np.abs(got[:, j * bm:(j + 1) * bm] - ref) <= tol), j


def test_lowering_at_flash_shapes_and_errors(monkeypatch):
    """The Mosaic GPU kernel lowers for CUDA (no GPU needed) at V4.1-Flash's routed shapes (w1 / w3:
    2304 x 5120, w2: 5120 x 2304; 160-row blocks of an 8k prefill), for both tile_m; shapes or
    dtypes it does not take, bad switches and tiles: one clear error each."""
    SD = jax.ShapeDtypeStruct
    for O, K, tiles in ((2304, 5120, MG.Tiles()), (5120, 2304, MG.Tiles(tile_m=128, tile_k=128, steps=2))):
        f = jax.jit(lambda *a, t=tiles: MG.grouped_matmul_t(*a, bm=160, impl="mosaic", tiles=t, num_sms=132))
        args = (SD((K, 160 * 400), BF16), SD((400,), jnp.int32), SD((), jnp.int32),
                SD((384, O, K), jnp.int8), SD((384, O, K // 32), jnp.uint8))
        assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    rng = np.random.default_rng(0)
    xt, bg, codes, scale = _problem(rng, G=2, O=128, K=128, blocks=2, bm=32)
    with pytest.raises(ValueError, match="multiple of 32"):
        MG.grouped_matmul_t(xt[:, :48], bg[:1], 1, codes, scale, bm=48, impl="mosaic")
    with pytest.raises(ValueError, match="int8 codes"):
        MG.grouped_matmul_t(xt, bg, 1, codes.astype(BF16), scale, bm=32, impl="mosaic")
    with pytest.raises(ValueError, match="bf16 results"):
        MG.grouped_matmul_t(xt, bg, 1, codes, scale, bm=32, impl="mosaic", out_dtype=F32)
    with pytest.raises(ValueError, match="impl"):
        MG.grouped_matmul_t(xt, bg, 1, codes, scale, bm=32, impl="triton")
    monkeypatch.setenv("DSV41_MGPU_TILES", '{"tile_n": 64}')
    with pytest.raises(ValueError, match="DSV41_MGPU_TILES"):
        MG.env_tiles()
    monkeypatch.setenv("DSV41_MOE_PREFILL", "cutlass")
    with pytest.raises(ValueError, match="DSV41_MOE_PREFILL"):
        MG.prefill_mode()
    # the default, auto: the fused Mosaic GPU kernel where it runs on a GPU, else the Triton launches
    monkeypatch.delenv("DSV41_MOE_PREFILL")
    assert MG.DEFAULT_MODE == "auto"
    assert MG.prefill_mode() == ("mgpu-glu" if jax.default_backend() == "gpu" and MG._has_wgmma() else "triton")
    monkeypatch.setenv("DSV41_MOE_PREFILL", "triton")
    assert MG.prefill_mode() == "triton"
    monkeypatch.delenv("DSV41_MOE_PREFILL")
    monkeypatch.setenv("DSV41_MGPU_IMPL", "mosaic")
    assert MG.prefill_mode() == "mgpu-glu"
    # auto on a GPU: the kernel only where wgmma exists (compute capability 9.x), else the Triton launches
    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        for cap, mode in (("9.0", "mgpu-glu"), ("10.0", "triton"), ("8.0", "triton")):
            m.setattr(jax, "devices", lambda cap=cap: [type("Dev", (), {"compute_capability": cap})()])
            assert MG.prefill_mode() == mode, cap
    # per-launch tiles: w2's measured best where it takes the shapes, else the defaults
    monkeypatch.delenv("DSV41_MGPU_TILES")
    assert MG.launch_tiles("w2", 5120, 2304, 160, jnp.int8, BF16) == MG.W2_TILES
    assert MG.launch_tiles("w2", 128, 128, 32, jnp.int8, BF16) == MG.Tiles()
    assert MG.launch_tiles("w1", 2304, 5120, 160, jnp.int8, BF16) == MG.Tiles()
    assert MG.launch_tiles("w1", 96, 128, 32, jnp.int8, BF16) is None
    monkeypatch.setenv("DSV41_MGPU_TILES", '{"steps": 2}')
    assert MG.launch_tiles("w2", 5120, 2304, 160, jnp.int8, BF16) == MG.Tiles(tile_m=128, steps=2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("numerics", ["bfloat16-fast", "bfloat16-reference"])
def test_routed_mgpu_equals_the_default_prefill_path(numerics, monkeypatch):
    """A prefill through ``MoE.routed_pallas`` with ``DSV41_MOE_PREFILL`` mgpu and mgpu-w2 (the
    Mosaic GPU interpreter; 32-row expert blocks, padding rows, unused blocks) against the default
    path (``moe_glu`` + the w2 launch in the Pallas interpreter), and the fp8 quantization of h in
    reference numerics. Shapes the kernel does not take keep the default path."""
    import dsv41_jax.kernels.moe_mgpu as K
    from test_moe_glu import int8_moe

    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MGPU_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MOE_CHUNK", "32")
    calls = []
    real = K.grouped_matmul_t
    monkeypatch.setattr(K, "grouped_matmul_t", lambda *a, **kw: calls.append(kw["bm"]) or real(*a, num_sms=4, **kw))
    moe, rng = int8_moe(numerics, 3, hidden_size=128, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=128)
    x = jnp.asarray(rng.standard_normal((40, 128)), BF16)
    w, ids = moe.gate(x)
    outs = {}
    for mode in ("mgpu", "mgpu-w2", "triton"):
        monkeypatch.setenv("DSV41_MOE_PREFILL", mode)
        outs[mode] = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float64)
    assert calls == [32, 32, 32, 32]  # w1, w3, w2; w2
    # g, u and h are rounded to bf16 on both paths; a different summation order may move one by an ulp
    for mode in ("mgpu", "mgpu-w2"):
        assert np.abs(outs[mode] - outs["triton"]).max() <= 2 ** -7 * np.abs(outs["triton"]).max(), mode
    monkeypatch.setenv("DSV41_MOE_PREFILL", "mgpu")
    monkeypatch.setenv("DSV41_MOE_CHUNK", "48")  # not a multiple of 32: the default path
    jax.jit(moe.routed_pallas)(x, w, ids)
    assert calls == [32, 32, 32, 32]
    # mgpu-glu (w1 + w3 + SwiGLU in one launch) in its XLA form: the chain around it
    glu_calls = []
    real_glu = K.grouped_glu_t
    monkeypatch.setattr(K, "grouped_glu_t", lambda *a, **kw: glu_calls.append(kw["bm"]) or real_glu(*a, impl="xla", **kw))
    monkeypatch.setenv("DSV41_MOE_CHUNK", "32")
    monkeypatch.setenv("DSV41_MOE_PREFILL", "mgpu-glu")
    glu = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float64)
    assert glu_calls == [32] and calls == [32] * 7  # glu's XLA form runs two products; then w2
    assert np.abs(glu - outs["triton"]).max() <= 2 ** -7 * np.abs(outs["triton"]).max()


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_glu_kernel_xla_form_and_lowering(limit):
    """w1 + w3 in one launch with the SwiGLU and the route weights in the epilogue
    (``grouped_glu_t``): its XLA form against numpy (per block, with its own expert; padding columns
    of weight 0 are 0) and its CUDA lowering at V4.1-Flash shapes. The kernel's values: the next
    test (the interpreter) and ``sweep_prefill.py --part mgpu`` (the GPU, against ``moe_glu``)."""
    rng = np.random.default_rng(int(limit * 10))
    xt, bg, c1, s1 = _problem(rng, G=3, O=128, K=128, blocks=3, bm=32)
    c3 = jnp.asarray(rng.integers(-12, 13, c1.shape), jnp.int8)
    s3 = jnp.asarray(rng.integers(118, 132, s1.shape), jnp.uint8)
    ws = jnp.asarray(rng.random(xt.shape[1]) * (rng.random(xt.shape[1]) > 0.2), F32)
    nb = 2
    kw = dict(bm=32, limit=limit)
    got = np.asarray(MG.grouped_glu_t(xt, ws, bg, nb, (c1, s1), (c3, s3), impl="xla", **kw), np.float64)
    x64 = np.asarray(xt, np.float64)
    for j in range(nb):
        cols = slice(j * 32, (j + 1) * 32)
        e = int(bg[j])
        g, u = (np.asarray(jnp.asarray(np.asarray(dequantize(c[e], s[e], F32), np.float64) @ x64[:, cols], F32)
                           .astype(BF16), np.float64) for c, s in ((c1, s1), (c3, s3)))
        if limit > 0:
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        want = np.asarray(ws, np.float64)[cols] * g / (1 + np.exp(-np.maximum(g, -700))) * u
        assert np.all(np.abs(got[:, cols] - want) <= 2.0 ** -6 * np.abs(want) + 1e-3 * np.abs(want).max()), j
        assert np.all(got[:, cols][:, np.asarray(ws)[cols] == 0] == 0)
    with pytest.raises(ValueError, match="route weights"):
        MG.grouped_glu_t(xt, ws[:5], bg, nb, (c1, s1), (c3, s3), impl="mosaic", **kw)
    SD = jax.ShapeDtypeStruct
    f = jax.jit(lambda *a: MG.grouped_glu_t(*a[:4], (a[4], a[5]), (a[6], a[7]), bm=160, limit=10.0, impl="mosaic",
                                            num_sms=132))
    w = (SD((384, 2304, 5120), jnp.int8), SD((384, 2304, 160), jnp.uint8))
    args = (SD((5120, 160 * 400), BF16), SD((160 * 400,), F32), SD((400,), jnp.int32), SD((), jnp.int32), *w, *w)
    assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_glu_kernel_equals_its_xla_form_with_two_stages(limit):
    """The fused w1 + w3 + SwiGLU kernel's values in the interpreter, against its XLA form: two
    shared-memory stages under four K steps (so every stage is refilled), route weights with zeros,
    an unused last block. Two stages and 32-token blocks because JAX 0.10.2's interpreter
    deadlocks on this kernel's five-operand pipeline from three stages on, and with 64-token
    blocks (also with a one-accumulator epilogue and without the route-weight copy: docs/status.md,
    session 21); the GPU rows of ``sweep_prefill.py --part mgpu`` check the other tilings."""
    bm = 32
    rng = np.random.default_rng(bm + int(limit * 10))
    xt, bg, c1, s1 = _problem(rng, G=3, O=128, K=256, blocks=3, bm=bm)
    c3 = jnp.asarray(rng.integers(-12, 13, c1.shape), jnp.int8)
    s3 = jnp.asarray(rng.integers(118, 132, s1.shape), jnp.uint8)
    ws = jnp.asarray(rng.random(xt.shape[1]) * (rng.random(xt.shape[1]) > 0.2), F32)
    nb = 2
    kw = dict(bm=bm, limit=limit)
    want = np.asarray(MG.grouped_glu_t(xt, ws, bg, nb, (c1, s1), (c3, s3), impl="xla", **kw), np.float64)
    got = np.asarray(MG.grouped_glu_t(xt, ws, bg, nb, (c1, s1), (c3, s3), impl="interpret", num_sms=2,
                                      tiles=MG.Tiles(steps=2), **kw), np.float64)
    live = slice(0, nb * bm)
    # g and u are rounded to bf16 before the SwiGLU: a one-ulp move of either (fp32 summation
    # order) moves h by about two ulps
    tol = 2.0 ** -6 * np.abs(want[:, live]) + 1e-30
    assert np.all(np.abs(got[:, live] - want[:, live]) <= tol)
    assert np.mean(got[:, live] != want[:, live]) < 1e-2
    assert np.all(got[:, live][:, np.asarray(ws)[live] == 0] == 0)


ROW_LAYOUTS = [(True, False), (False, True), (True, True)]


@pytest.mark.timeout(600)
def test_row_results_equal_the_transposed_kernel():
    """Results stored as rows [R, O] (``out_rows``: the accumulator stored through a transposed
    view) in the interpreter: bit-equal to the transposed-layout kernel's output (the same products
    and summation), and within an ulp of the XLA form. Two stages and 32-token blocks (the
    interpreter's deadlock-free range, see the glu test). Token tiles read as rows (``x_rows``)
    are not run here: JAX 0.10.2's interpreter cannot take a transposed view as a wgmma operand,
    and with the chunk copied transposed into a scratch buffer instead it deadlocks on some runs
    of the same shapes (docs/kernels.md); the GPU rows of ``sweep_prefill.py --part mgpu`` check
    them against the Triton launches, the next test their lowering."""
    bm = 32
    rng = np.random.default_rng(9)
    xt, bg, codes, scale = _problem(rng, G=3, O=128, K=256, blocks=3, bm=bm)
    nb = 2
    kw = dict(bm=bm, tiles=MG.Tiles(steps=2), num_sms=2)
    base = np.asarray(MG.grouped_matmul_t(xt, bg, nb, codes, scale, impl="interpret", **kw), np.float64)
    got = np.asarray(MG.grouped_matmul_t(xt, bg, nb, codes, scale, impl="interpret", out_rows=True, **kw), np.float64)
    want = np.asarray(MG.grouped_matmul_t(xt, bg, nb, codes, scale, bm=bm, impl="xla", out_rows=True), np.float64)
    assert got.shape == want.shape == (3 * bm, 128)
    live = slice(0, nb * bm)
    assert np.array_equal(got[live], base[:, live].T)
    assert np.all(np.abs(got[live] - want[live]) <= 2.0 ** -7 * np.abs(want[live]) + 1e-30)
    assert np.mean(got[live] != want[live]) < 1e-2


@pytest.mark.parametrize("x_rows,out_rows", ROW_LAYOUTS, ids=[f"x{int(a)}-out{int(b)}" for a, b in ROW_LAYOUTS])
def test_row_layouts_lower_at_flash_shapes(x_rows, out_rows):
    """The row layouts lower for CUDA at V4.1-Flash's w1 and w2 shapes (160-row blocks), both
    tile_m, and the fused GLU kernel rows in and out (the layout ``MoE.routed_mgpu`` uses)."""
    SD = jax.ShapeDtypeStruct
    R = 160 * 400
    for O, K, tiles in ((2304, 5120, MG.Tiles()), (5120, 2304, MG.Tiles(tile_m=128, steps=3))):
        f = jax.jit(lambda *a, t=tiles: MG.grouped_matmul_t(*a, bm=160, impl="mosaic", tiles=t, num_sms=132,
                                                            x_rows=x_rows, out_rows=out_rows))
        args = (SD((R, K) if x_rows else (K, R), BF16), SD((400,), jnp.int32), SD((), jnp.int32),
                SD((384, O, K), jnp.int8), SD((384, O, K // 32), jnp.uint8))
        assert jax.eval_shape(f, *args).shape == ((R, O) if out_rows else (O, R))
        assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    if x_rows and out_rows:
        g = jax.jit(lambda *a: MG.grouped_glu_t(*a[:4], (a[4], a[5]), (a[6], a[7]), bm=160, limit=10.0,
                                                impl="mosaic", num_sms=132, x_rows=True, out_rows=True))
        w = (SD((384, 2304, 5120), jnp.int8), SD((384, 2304, 160), jnp.uint8))
        args = (SD((R, 5120), BF16), SD((R,), F32), SD((400,), jnp.int32), SD((), jnp.int32), *w, *w)
        assert jax.eval_shape(g, *args).shape == (R, 2304)
        assert "mosaic_gpu" in g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_gather_used_rows_lowers_and_falls_back(monkeypatch):
    """The Pallas gather of the used blocks' rows (``moe_glu.gather_used_rows``) lowers for CUDA at
    an 8k prefill of V4.1-Flash (691 blocks of 160 rows, hidden 5120); off the GPU (and in the
    interpreter, which has no pointer gather) it is XLA's gather, equal to numpy's row gather
    (zeros for padding rows). Its kernel values are checked on the GPU by
    ``benchmarks/probe_gather_rows.py`` (run 34: equal on every used row). A bad
    ``DSV41_MOE_GATHER``: one clear error."""
    from dsv41_jax.kernels.moe_glu import gather_kernel, gather_used_rows

    SD = jax.ShapeDtypeStruct
    f = jax.jit(lambda x, r, n: gather_used_rows(x, r, n, bm=160, impl="triton"))
    txt = f.trace(SD((8192, 5120), BF16), SD((691 * 160,), jnp.int32), SD((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "gather_used_rows" in txt
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((40, 512)), BF16)
    rt = jnp.asarray(np.where(rng.random(4 * 48) < 0.8, rng.integers(0, 40, 4 * 48), -1), jnp.int32)
    want = np.where(np.asarray(rt)[:, None] >= 0, np.asarray(x, np.float32)[np.maximum(np.asarray(rt), 0)], 0)
    for impl in ("xla", "interpret"):
        assert np.array_equal(np.asarray(gather_used_rows(x, rt, 3, bm=48, impl=impl), np.float32), want)
    assert gather_kernel()
    monkeypatch.setenv("DSV41_MOE_GATHER", "xla")
    assert not gather_kernel()
    monkeypatch.setenv("DSV41_MOE_GATHER", "pallas")
    with pytest.raises(ValueError, match="DSV41_MOE_GATHER"):
        gather_kernel()


def test_quant_used_rows(monkeypatch):
    """The fp8 quantization of h for the Mosaic GPU w2 launch (``moe_glu.quant_used_rows``) in the
    Pallas interpreter: rows of the used blocks (48-row blocks = a 32-row and a 16-row tile, zero
    padding rows, values across many binades) equal ``quant.act_quant_fp8``'s bit for bit, the
    later rows are left as they were (in place); the XLA form quantizes every row; it lowers for
    CUDA at an 8k prefill of V4.1-Flash (intermediate 2304: 256-column tiles). A bad
    ``DSV41_MOE_HQUANT``: one clear error."""
    from dsv41_jax import quant
    from dsv41_jax.kernels.moe_glu import quant_used_rows
    from dsv41_jax.model.moe import hquant_kernel

    rng = np.random.default_rng(5)
    bm, nb, I = 48, 3, 256
    h = rng.standard_normal((4 * bm, I)) * np.exp2(rng.integers(-20, 12, (4 * bm, 1)))
    h[rng.random(4 * bm) < 0.2] = 0.0
    h = jnp.asarray(h, BF16)
    want = np.asarray(quant.act_quant_fp8(h.astype(F32), 32).astype(BF16), np.float32)
    assert not np.array_equal(want, np.asarray(h, np.float32))  # the quantization moves values
    got = np.asarray(jax.jit(lambda a, n: quant_used_rows(a, n, bm=bm, impl="interpret"))(h, nb), np.float32)
    assert np.array_equal(got[:nb * bm], want[:nb * bm])
    assert np.array_equal(got[nb * bm:], np.asarray(h, np.float32)[nb * bm:])
    assert np.array_equal(np.asarray(quant_used_rows(h, nb, bm=bm, impl="xla"), np.float32), want)
    SD = jax.ShapeDtypeStruct
    f = jax.jit(lambda a, n: quant_used_rows(a, n, bm=160, impl="triton"))
    assert "quant_used_rows" in f.trace(SD((691 * 160, 2304), BF16), SD((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hquant_kernel()
    monkeypatch.setenv("DSV41_MOE_HQUANT", "xla")
    assert not hquant_kernel()
    monkeypatch.setenv("DSV41_MOE_HQUANT", "triton")
    with pytest.raises(ValueError, match="DSV41_MOE_HQUANT"):
        hquant_kernel()


def _fake_mgpu_call(xt, block_group, nb, weights, *, bm, mult, glu=None, x_rows=False, out_rows=False, **_):
    """``moe_mgpu._call`` computed by XLA from the scale operand the kernel would read ([E, K/32, O]):
    a stand-in that shows which scales reach the kernel."""
    from dsv41_jax.model.moe import swiglu

    ys = [MG.grouped_matmul_t_reference(xt, block_group, nb[0], c, jnp.swapaxes(sk, 1, 2), bm=bm, mult=mult,
                                        x_rows=x_rows, out_rows=out_rows) for c, sk in weights]
    if glu is None:
        return ys[0]
    w = glu[0][:, None] if out_rows else glu[0][None, :]
    return (w * swiglu(ys[0], ys[1], glu[1])).astype(BF16)


def test_kept_kernel_scales_reach_the_kernel(monkeypatch):
    """``moe.keep_kernel_scales`` gives every int8 projection its scales in the kernel's layout
    (``scale_t`` of ``scale``, not a Param: not saved); a prefill through ``MoE.routed_mgpu``
    (mgpu-glu, reference numerics, h quantized by ``quant_used_rows`` in the interpreter) hands the
    kernel those copies: with a stand-in kernel that computes from the scale operand it gets, the
    output equals the per-call transposes' (``DSV41_MGPU_SCALES=transpose``, with XLA's h
    quantization, ``DSV41_MOE_HQUANT=xla``) bit for bit, and a corrupted copy changes it.
    ``drop_kernel_scales`` removes them; a copy of the wrong shape: one clear error."""
    from flax import nnx

    from dsv41_jax.model import moe as M
    from test_moe_glu import int8_moe

    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MGPU_IMPL", "mosaic")
    monkeypatch.setenv("DSV41_MOE_CHUNK", "32")
    monkeypatch.setattr(MG, "_call", _fake_mgpu_call)
    moe, rng = int8_moe("bfloat16-reference", 4, hidden_size=128, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=128)
    x = jnp.asarray(rng.standard_normal((40, 128)), BF16)
    w, ids = moe.gate(x)
    assert M.keep_kernel_scales(moe) == 3 * 8 * 128 * 4
    for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        assert np.array_equal(np.asarray(p.scale_k[...]), np.swapaxes(np.asarray(p.scale[...]), 1, 2))
    assert not any("scale_k" in ".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(moe, nnx.Param)))
    assert M.kernel_scales_mode() == "kept"
    kept = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float32)
    monkeypatch.setenv("DSV41_MGPU_SCALES", "transpose")
    monkeypatch.setenv("DSV41_MOE_HQUANT", "xla")
    assert np.array_equal(np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float32), kept)
    monkeypatch.delenv("DSV41_MGPU_SCALES")
    monkeypatch.delenv("DSV41_MOE_HQUANT")
    moe.experts.w2.scale_k.set_value(moe.experts.w2.scale_k[...] + 1)
    assert not np.array_equal(np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float32), kept)
    from dsv41_jax.sharding import match_rule

    assert match_rule("layers.0.ffn.experts.w3.scale_k") == ("experts", None, "expert_ffn")
    assert match_rule("layers.0.ffn.experts.w2.scale_k") == ("experts", "expert_ffn", None)
    assert M.drop_kernel_scales(moe) == 3 and moe.experts.w1.scale_k is None
    c, s = M.kernel_weight(moe.experts.w2)
    with pytest.raises(ValueError, match="kernel-layout scales"):
        MG.grouped_matmul_t(x[:32], jnp.zeros((1,), jnp.int32), 1, c, s, bm=32, x_rows=True, scale_k=s)
    monkeypatch.setenv("DSV41_MGPU_SCALES", "both")
    with pytest.raises(ValueError, match="DSV41_MGPU_SCALES"):
        M.kernel_scales_mode()


@pytest.mark.timeout(600)
def test_chained_tiles_and_blocked_codes_equal_the_plain_kernel():
    """Session 26's kernel options in the interpreter, bit-equal to the plain kernel: ``chain``
    (a CTA's tiles as one sequence of pipelines: three tiles per CTA, so START, STEADY and STOP
    all run, and with one CTA holding a single tile, which runs unchained), and the codes given
    K-blocked [E, K/64, O, 64] or pre-tiled [E, O/128, K/64, 128, 64] (each step's weight tile
    contiguous: the access-pattern measurements of ``sweep_prefill.py``)."""
    from dsv41_jax.kernels.qmatmul import default_mult

    rng = np.random.default_rng(26)
    xt, bg, codes, scale = _problem(rng, G=3, O=256, K=256, blocks=4, bm=32)
    nb = 3
    run = functools.partial(MG.grouped_matmul_t, xt, bg, nb, codes, scale, bm=32, impl="interpret")
    base = np.asarray(run(tiles=MG.Tiles(steps=2), num_sms=2))[:, :nb * 32]
    want = np.asarray(MG.grouped_matmul_t(xt, bg, nb, codes, scale, bm=32, impl="xla"))[:, :nb * 32]
    assert np.all(np.abs(base.astype(np.float64) - want) <= 2.0 ** -7 * np.abs(want.astype(np.float64)) + 1e-30)
    assert np.array_equal(np.asarray(run(tiles=MG.Tiles(steps=2, chain=True), num_sms=2))[:, :nb * 32], base)
    # 128 output rows: one row tile per block, three tiles over two CTAs (one runs alone)
    one = functools.partial(MG.grouped_matmul_t, xt, bg, nb, codes[:, :128], scale[:, :128], bm=32, impl="interpret")
    assert np.array_equal(np.asarray(one(tiles=MG.Tiles(steps=4, chain=True), num_sms=2))[:, :nb * 32],
                          np.asarray(one(tiles=MG.Tiles(steps=4), num_sms=2))[:, :nb * 32])
    E, O, K = codes.shape
    for blocked in (codes.reshape(E, O, K // 64, 64).transpose(0, 2, 1, 3),
                    codes.reshape(E, O // 128, 128, K // 64, 64).transpose(0, 1, 3, 2, 4)):
        got = MG._call(xt, bg, jnp.array([nb], jnp.int32), [(blocked, MG.scale_t(scale))], bm=32,
                       mult=default_mult(jnp.int8), tiles=MG.Tiles(steps=2), num_sms=2, interpret=True)
        assert np.array_equal(np.asarray(got)[:, :nb * 32], base), blocked.ndim
    # the model's K-blocked layout (``qmatmul.kblock``) through the public entry point
    kb = Q.kblock(codes)
    assert np.array_equal(np.asarray(kb), np.asarray(codes.reshape(E, O, K // 64, 64).transpose(0, 2, 1, 3)))
    got = MG.grouped_matmul_t(xt, bg, nb, kb, scale, bm=32, impl="interpret", tiles=MG.Tiles(steps=2), num_sms=2)
    assert np.array_equal(np.asarray(got)[:, :nb * 32], base)
    assert "tile_k=128" in MG.applies(O, K, 32, jnp.int8, BF16, MG.Tiles(tile_k=128), kblocked=True)
    with pytest.raises(ValueError, match="tile_k=128"):
        MG.grouped_matmul_t(xt, bg, nb, kb, scale, bm=32, impl="interpret", tiles=MG.Tiles(tile_k=128))


def test_staged_operands_equal_the_plain_kernel():
    """``Tiles.stage`` (each dequantized chunk stored to a double-buffered shared-memory operand,
    the stages released one step late so that a step's MMAs run on while the next dequantizes):
    bit-equal to the plain kernel in the interpreter, for 64- and 128-row warpgroup tiles, two and
    three stages, rows and K-blocked codes and the fused GLU (the interpreter runs MMAs
    synchronously, so the overlap's hazards only show on the GPU: ``check_gpu_kernels.py``); it
    lowers for CUDA at V4.1-Flash shapes within the shared memory (GLU at three stages, w2 at
    ``W2_TILES``); tiles it cannot take: one clear error."""
    rng = np.random.default_rng(28)
    xt, bg, codes, scale = _problem(rng, G=3, O=256, K=256, blocks=4, bm=32)
    nb = 3
    run = functools.partial(MG.grouped_matmul_t, xt, bg, nb, codes, scale, bm=32, impl="interpret", num_sms=2)
    base = np.asarray(run(tiles=MG.Tiles(steps=2)))[:, :nb * 32]
    for tiles in (MG.Tiles(steps=2, stage=True), MG.Tiles(steps=3, stage=True), MG.Tiles(tile_m=128, steps=2, stage=True)):
        assert np.array_equal(np.asarray(run(tiles=tiles))[:, :nb * 32], base), tiles
    got = MG.grouped_matmul_t(xt, bg, nb, Q.kblock(codes), scale, bm=32, impl="interpret", num_sms=2,
                              tiles=MG.Tiles(steps=2, stage=True))
    assert np.array_equal(np.asarray(got)[:, :nb * 32], base)
    ws = jnp.asarray(rng.uniform(0.1, 1.0, xt.shape[1]).astype(np.float32))
    w3 = (jnp.asarray(rng.integers(-127, 128, codes.shape).astype(np.int8)), scale)
    glu = functools.partial(MG.grouped_glu_t, xt, ws, bg, nb, (codes, scale), w3, bm=32, limit=10.0,
                            impl="interpret", num_sms=2)
    assert np.array_equal(np.asarray(glu(tiles=MG.Tiles(steps=2, stage=True)))[:, :nb * 32],
                          np.asarray(glu(tiles=MG.Tiles(steps=2)))[:, :nb * 32])
    SD = jax.ShapeDtypeStruct
    R = 160 * 400
    w = (SD((384, 80, 2304, 64), jnp.int8), SD((384, 2304, 160), jnp.uint8))
    g = jax.jit(lambda *a: MG.grouped_glu_t(*a[:4], (a[4], a[5]), (a[6], a[7]), bm=160, limit=10.0, impl="mosaic",
                                            num_sms=132, x_rows=True, out_rows=True, tiles=MG.Tiles(steps=3, stage=True)))
    assert "mosaic_gpu" in g.trace(SD((R, 5120), BF16), SD((R,), F32), SD((400,), jnp.int32), SD((), jnp.int32),
                                   *w, *w).lower(lowering_platforms=("cuda",)).as_text()
    f = jax.jit(lambda *a: MG.grouped_matmul_t(*a, bm=160, impl="mosaic", num_sms=132, x_rows=True, out_rows=True,
                                               tiles=dataclasses.replace(MG.W2_TILES, stage=True)))
    assert "mosaic_gpu" in f.trace(SD((R, 2304), BF16), SD((400,), jnp.int32), SD((), jnp.int32),
                                   SD((384, 36, 5120, 64), jnp.int8), SD((384, 5120, 72), jnp.uint8)).lower(
        lowering_platforms=("cuda",)).as_text()
    for bad in (MG.Tiles(steps=1, stage=True), MG.Tiles(steps=2, stage=True, chain=True)):
        assert "staged operands" in MG.applies(2304, 5120, 160, jnp.int8, BF16, bad), bad


@pytest.mark.parametrize("numerics", ["bfloat16-reference", "float32-fast"])
def test_kblocked_experts_reach_every_prefill_and_decode_path(numerics, monkeypatch):
    """``moe.block_expert_codes`` stores the int8 experts K-blocked; every routed path reads them so
    and gives the rows layout's output bit for bit: the Mosaic GPU prefill (mgpu-glu; a stand-in
    ``_call`` computing from the operands it gets shows the blocked codes and the K-blocked tiles
    reach it), the Triton prefill and decode launches (interpreter) and the XLA forms.
    ``unblock_expert_codes`` restores rows; ``DSV41_EXPERT_LAYOUT``: auto / rows / kblocked."""
    from dsv41_jax.model import moe as M
    from test_moe_glu import int8_moe

    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MOE_CHUNK", "32")
    seen = []

    def fake(xt, block_group, nb, weights, *, tiles, **kw):
        seen.append((tuple(c.ndim for c, _ in weights), tiles))
        return _fake_mgpu_call(xt, block_group, nb, weights, **kw)

    monkeypatch.setattr(MG, "_call", fake)
    rows, rng = int8_moe(numerics, 5, hidden_size=128, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=128)
    blk, _ = int8_moe(numerics, 5, hidden_size=128, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=128)
    # the default, auto, is rows off the Hopper kernel (the CPU)
    assert M.DEFAULT_EXPERT_LAYOUT == "auto" and M.expert_layout() == "rows" and M.block_expert_codes(blk) == 0
    monkeypatch.setenv("DSV41_EXPERT_LAYOUT", "auto")
    assert M.block_expert_codes(blk) == 0
    monkeypatch.setenv("DSV41_MGPU_IMPL", "mosaic")
    assert M.expert_layout() == "kblocked"  # where the Mosaic GPU prefill runs
    monkeypatch.delenv("DSV41_MGPU_IMPL")
    monkeypatch.delenv("DSV41_EXPERT_LAYOUT")
    assert M.block_expert_codes(blk, force=True) == 3
    assert M.block_expert_codes(blk, force=True) == 0  # already blocked
    for name in ("w1", "w2", "w3"):
        a, b = getattr(rows.experts, name), getattr(blk.experts, name)
        assert b.kblocked and b.weight.shape == (8, 2, 128, 64) and b.shape == a.shape == (8, 128, 128)
        np.testing.assert_array_equal(np.asarray(b.values(F32)), np.asarray(a.values(F32)))
    dt = rows.numerics.dtype
    x = jnp.asarray(rng.standard_normal((40, 128)), dt)
    w, ids = rows.gate(x)
    cases = [("prefill triton", "triton", x, w, ids), ("decode", "triton", x[:3], w[:3], ids[:3])]
    if dt == BF16:
        monkeypatch.setenv("DSV41_MGPU_IMPL", "mosaic")
        cases.append(("prefill mgpu-glu", "mgpu-glu", x, w, ids))
    for what, mode, xi, wi, ii in cases:
        monkeypatch.setenv("DSV41_MOE_PREFILL", mode)
        seen.clear()
        b = np.asarray(jax.jit(blk.routed_pallas)(xi, wi, ii), np.float32)
        tiles_b = list(seen)
        seen.clear()
        a = np.asarray(jax.jit(rows.routed_pallas)(xi, wi, ii), np.float32)
        np.testing.assert_array_equal(b, a, err_msg=what)
        if mode == "mgpu-glu":  # the glu launch (w1 + w3), then w2, with the K-blocked tiles
            lt = functools.partial(MG.launch_tiles, O=128, K=128, bm=32, codes_dtype=jnp.int8, x_dtype=BF16)
            assert tiles_b == [((4, 4), MG.Tiles(steps=3)), ((4,), lt("w2", kblocked=True))]
            assert seen == [((3, 3), MG.Tiles()), ((3,), lt("w2"))]
    monkeypatch.delenv("DSV41_MOE_PREFILL")
    for path in ("dense", "gather", "grouped", "ragged"):
        monkeypatch.setenv("DSV41_MOE_PATH", path)
        np.testing.assert_array_equal(np.asarray(blk(x)), np.asarray(rows(x)), err_msg=path)
    monkeypatch.setenv("DSV41_EXPERT_LAYOUT", "rows")
    assert M.unblock_expert_codes(blk, via_host=True) == 3 and not blk.experts.w2.kblocked
    assert M.block_expert_codes(blk) == 0
    for name in ("w1", "w2", "w3"):  # through host memory (a device without room for two copies)
        np.testing.assert_array_equal(np.asarray(getattr(blk.experts, name).weight[...]),
                                      np.asarray(getattr(rows.experts, name).weight[...]))
    monkeypatch.setenv("DSV41_EXPERT_LAYOUT", "kblocked")
    assert M.block_expert_codes(blk, via_host=True) == 3
    np.testing.assert_array_equal(np.asarray(blk.experts.w2.weight[...]), np.asarray(Q.kblock(rows.experts.w2.weight[...])))
    assert M.unblock_expert_codes(blk) == 3 and M.block_expert_codes(blk) == 3
    np.testing.assert_array_equal(np.asarray(blk.experts.w1.weight[...]), np.asarray(Q.kblock(rows.experts.w1.weight[...])))
    # on the device a few experts at a time: 7 experts, 3 per chunk (the last chunk, 4-6, overlaps)
    codes = jnp.asarray(rng.integers(-127, 128, (7, 8, 192)), jnp.int8)
    monkeypatch.setattr(M, "_RELAYOUT_CHUNK_BYTES", 3 * 8 * 192)
    got = M._relayout_on_device(codes, Q.kblock)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(codes).reshape(7, 8, 3, 64).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(M._relayout_on_device(got, Q.unblock)), np.asarray(codes))
    monkeypatch.setenv("DSV41_EXPERT_LAYOUT", "tiles")
    with pytest.raises(ValueError, match="DSV41_EXPERT_LAYOUT"):
        M.block_expert_codes(blk)


def test_kernel_options_lower_and_reject_bad_tiles():
    """``chain``, ``cluster`` (CTA pairs sharing the token tile by multicast: the interpreter has no
    cluster barriers, so CUDA lowering only; values on the GPU, ``sweep_prefill.py`` rows 35-36 and
    40), the code loads ``lhs`` (register layouts exist only in the CUDA lowering; values on the GPU,
    rows 63-69), the diagnostics and K-blocked codes lower for CUDA at V4.1-Flash shapes (fused GLU and w2,
    rows in and out); tiles they cannot take: one clear error each."""
    SD = jax.ShapeDtypeStruct
    R = 160 * 400
    w = (SD((384, 2304, 5120), jnp.int8), SD((384, 2304, 160), jnp.uint8))
    glu_args = (SD((R, 5120), BF16), SD((R,), F32), SD((400,), jnp.int32), SD((), jnp.int32), *w, *w)
    for tiles in (MG.Tiles(chain=True), MG.Tiles(cluster=2, chain=True), MG.Tiles(probe="const_lhs,one_expert,no_store"),
                  MG.Tiles(lhs="8bit"), MG.Tiles(lhs="16bit")):
        g = jax.jit(lambda *a, t=tiles: MG.grouped_glu_t(*a[:4], (a[4], a[5]), (a[6], a[7]), bm=160, limit=10.0,
                                                        impl="mosaic", num_sms=132, x_rows=True, out_rows=True, tiles=t))
        assert "mosaic_gpu" in g.trace(*glu_args).lower(lowering_platforms=("cuda",)).as_text(), tiles
    w2_args = (SD((R, 2304), BF16), SD((400,), jnp.int32), SD((), jnp.int32), SD((384, 5120, 2304), jnp.int8),
               SD((384, 5120, 72), jnp.uint8))
    for tiles in (MG.Tiles(tile_m=128, steps=3, chain=True), MG.Tiles(tile_m=128, steps=3, cluster=2)):
        f = jax.jit(lambda *a, t=tiles: MG.grouped_matmul_t(*a, bm=160, impl="mosaic", tiles=t, num_sms=132,
                                                            x_rows=True, out_rows=True))
        assert "mosaic_gpu" in f.trace(*w2_args).lower(lowering_platforms=("cuda",)).as_text(), tiles
    for lhs in ("", "8bit"):  # (K-blocked codes, also with the four-byte code loads)
        kb = jax.jit(lambda x, bg, nb, c, s, lhs=lhs: MG._call(
            x, bg, nb, [(c, s)], bm=160, mult=1.0, tiles=MG.Tiles(tile_m=128, steps=3, lhs=lhs), num_sms=132,
            interpret=False, x_rows=True, out_rows=True))
        assert "mosaic_gpu" in kb.trace(SD((R, 2304), BF16), SD((400,), jnp.int32), SD((1,), jnp.int32),
                                        SD((384, 36, 5120, 64), jnp.int8), SD((384, 72, 5120), jnp.uint8)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "dividing the 80 K steps" in MG.applies(2304, 5120, 160, jnp.int8, BF16, MG.Tiles(steps=3, chain=True))
    assert "cluster=3" in MG.applies(2304, 5120, 160, jnp.int8, BF16, MG.Tiles(cluster=3))
    assert "cluster=2" in MG.applies(2304 - 128, 5120, 160, jnp.int8, BF16, MG.Tiles(cluster=2))
    assert "unknown probes" in MG.applies(2304, 5120, 160, jnp.int8, BF16, MG.Tiles(probe="fast"))
    assert "lhs='4bit'" in MG.applies(2304, 5120, 160, jnp.int8, BF16, MG.Tiles(lhs="4bit"))
    assert MG.applies(2304, 5120, 160, jnp.int8, BF16, MG.Tiles(steps=5, chain=True)) is None


@pytest.mark.timeout(600)
def test_tail_columns_run_only_where_blocks_have_rows(monkeypatch):
    """``Tiles.tail`` in the interpreter (64-row blocks, 32-column tail, two stages): a block with
    rows in its tail gives the plain kernel's values bit for bit, a block without them the same
    main columns and zeros in the tail (what its padding rows hold anyway), for the single-weight
    launch and the fused GLU; the model's mgpu prefill with the tail equals it without, bit for
    bit; it lowers for CUDA at V4.1-Flash shapes (K-blocked codes, rows in and out); a tail without
    ``block_rows`` and tails the blocks cannot take: one clear error each."""
    from test_moe_glu import int8_moe

    rng = np.random.default_rng(31)
    bm, nb = 64, 3
    xt, bg, codes, scale = _problem(rng, G=3, O=256, K=128, blocks=4, bm=bm)
    rows = jnp.asarray([64, 20, 33, 0], jnp.int32)  # tail rows, none, one; the unused block
    ws = jnp.asarray(rng.uniform(0.1, 1.0, xt.shape[1]).astype(np.float32))
    c3 = jnp.asarray(rng.integers(-12, 13, codes.shape), jnp.int8)
    runs = {"w": functools.partial(MG.grouped_matmul_t, xt, bg, nb, codes, scale),
            "glu": functools.partial(MG.grouped_glu_t, xt, ws, bg, nb, (codes, scale), (c3, scale), limit=10.0)}
    for name, run in runs.items():
        kw = dict(bm=bm, impl="interpret", num_sms=2)
        base = np.asarray(run(tiles=MG.Tiles(steps=2), **kw), np.float32)
        got = np.asarray(run(tiles=MG.Tiles(steps=2, tail=32), block_rows=rows, **kw), np.float32)
        for j in range(nb):
            main, tail = slice(j * bm, j * bm + 32), slice(j * bm + 32, (j + 1) * bm)
            np.testing.assert_array_equal(got[:, main], base[:, main], err_msg=f"{name} block {j}")
            want = base[:, tail] if int(rows[j]) > 32 else np.zeros_like(base[:, tail])
            np.testing.assert_array_equal(got[:, tail], want, err_msg=f"{name} block {j} tail")
        assert np.abs(base[:, 32:64]).max() > 0  # (the skipped tail is not zero without the option)
        with pytest.raises(ValueError, match="needs block_rows"):
            run(tiles=MG.Tiles(steps=2, tail=32), **kw)
    # the model: mgpu prefill (w1, w3, w2 launches in the interpreter) on 64-row blocks
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MGPU_IMPL", "interpret")
    monkeypatch.setenv("DSV41_MOE_CHUNK", "64")
    monkeypatch.setenv("DSV41_MOE_PREFILL", "mgpu")
    tails = []
    real = MG._call
    monkeypatch.setattr(MG, "_call", lambda *a, tiles, **kw: tails.append(tiles.tail) or real(
        *a, tiles=dataclasses.replace(tiles, steps=2), **dict(kw, num_sms=2)))
    moe, rng = int8_moe("bfloat16-reference", 3, hidden_size=128, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=128)
    x = jnp.asarray(rng.standard_normal((256, 128)), BF16)  # ~64 pairs per expert: one or two blocks
    w, ids = moe.gate(x)
    plain = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float32)
    monkeypatch.setenv("DSV41_MGPU_TILES", '{"tail": 32}')
    got = np.asarray(jax.jit(moe.routed_pallas)(x, w, ids), np.float32)
    assert tails == [0, 0, 0, 32, 32, 32]
    np.testing.assert_array_equal(got, plain)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=8)
    assert (counts % 64 <= 32).any() and (counts % 64 > 32).any(), counts  # both kinds of blocks ran
    # CUDA lowering at V4.1-Flash shapes, K-blocked codes
    SD = jax.ShapeDtypeStruct
    R = 160 * 400
    w13 = (SD((384, 80, 2304, 64), jnp.int8), SD((384, 2304, 160), jnp.uint8))
    g = jax.jit(lambda *a: MG.grouped_glu_t(*a[:4], (a[4], a[5]), (a[6], a[7]), bm=160, limit=10.0, impl="mosaic",
                                            num_sms=132, x_rows=True, out_rows=True, block_rows=a[8],
                                            tiles=MG.Tiles(steps=3, tail=32)))
    assert "mosaic_gpu" in g.trace(SD((R, 5120), BF16), SD((R,), F32), SD((400,), jnp.int32), SD((), jnp.int32),
                                   *w13, *w13, SD((400,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    f = jax.jit(lambda *a: MG.grouped_matmul_t(*a[:5], bm=160, impl="mosaic", num_sms=132, x_rows=True, out_rows=True,
                                               tiles=dataclasses.replace(MG.W2_TILES, tail=32), block_rows=a[5]))
    assert "mosaic_gpu" in f.trace(SD((R, 2304), BF16), SD((400,), jnp.int32), SD((), jnp.int32),
                                   SD((384, 36, 5120, 64), jnp.int8), SD((384, 5120, 72), jnp.uint8),
                                   SD((400,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    for bad in (MG.Tiles(tail=16), MG.Tiles(tail=160), MG.Tiles(steps=2, tail=32, stage=True)):
        assert "tail=" in MG.applies(2304, 5120, 160, jnp.int8, BF16, bad), bad
    assert MG.applies(2304, 5120, 160, jnp.int8, BF16, MG.Tiles(tail=32)) is None
