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
    ("int8", 6, 40, 256, 1, 7, 5, "auto", {"wlhs": True}),
    ("fp8", 1, 72, 256, 1, 3, 3, "auto", {"wlhs": True, "splitk": 2}),
    ("int8", 3, 72, 128, 64, 3, 2, "auto", {"wlhs": True}),
    ("int8", 3, 72, 128, 64, 3, 2, "dot", {"wlhs": True, "split": True}),
    ("bf16", 6, 40, 96, 1, 6, 5, "auto", {"wlhs": True}),
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
    cfg = Q.choose_config(bm, O, K, sw is not None, mode, **tiles)
    assert cfg.mode == ("dot" if mode == "auto" else mode)
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
    assert pallas_chunk(12288, 384) == 32 and pallas_chunk(49152, 384) == 128 and pallas_chunk(384, 384) == 16


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
    monkeypatch.setenv("DSV41_QMATMUL_TUNING", '{"large": {"warps": 8}}')
    with pytest.raises(ValueError, match="unknown Config fields"):
        Q.choose_config(128, 2304, 5120, True)
    for bad in ("[1, 2]", '{"large": 5}', "{large"):
        monkeypatch.setenv("DSV41_QMATMUL_TUNING", bad)
        with pytest.raises(ValueError, match="not a JSON object"):
            Q.choose_config(128, 2304, 5120, True)


# ------------------------------------------------------------------------------ Config.dequant "bits"
def _run_ptx(asm: str, regs: dict) -> dict:
    """Execute the PTX subset ``bits_asm`` uses (xor / and / shr.s32 / prmt on .b32, sub / mul
    .f32 with 0f immediates, mov) on numpy uint32 vectors: ``regs`` maps "$N" and local names to
    arrays; returns the registers afterwards."""
    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return np.uint32(int(tok[2:], 16))
        return np.uint32(int(tok, 0))

    f = lambda v: np.asarray(v, np.uint32).view(np.float32)  # noqa: E731
    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "shr.s32":
            r = (np.asarray(a[0], np.uint32).view(np.int32) >> int(a[1])).view(np.uint32)
        elif op == "mov.b32":
            r = a[0]
        elif op in ("sub.f32", "mul.f32"):
            x, y = f(np.broadcast_to(a[0], np.shape(a[0]) or (1,))), np.asarray(a[1], np.uint32).view(np.float32)
            with np.errstate(over="ignore"):
                r = (x - y if op == "sub.f32" else x * y).astype(np.float32).view(np.uint32)
        elif op == "prmt.b32":
            srcb = [(np.asarray(a[i // 4], np.uint32) >> np.uint32(8 * (i % 4))) & np.uint32(0xFF) for i in range(8)]
            sel = int(a[2])
            r = sum(srcb[(sel >> (4 * i)) & 7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)
        else:
            raise AssertionError(f"PTX op {op} not modelled")
        regs[d] = np.asarray(r, np.uint32)
    return regs


@pytest.mark.parametrize("kind", ["int8", "e4m3"])
def test_bits_dequant_asm_equals_conversion(kind):
    """The inline PTX of ``Config.dequant="bits"`` (executed here instruction by instruction)
    gives exactly ``dequantize``'s values for every code byte, scale byte and output form."""
    codes = np.arange(256, dtype=np.uint8)
    if kind == "e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes: finite by design (no checkpoint holds them)
    codes = codes[np.random.default_rng(0).permutation(codes.size)][: codes.size // 4 * 4]
    words = codes.view(np.uint32)
    dt = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    # products that are fp32 normals (real scale bytes are ~110-130); below, the XLA reference on
    # the CPU flushes subnormals to zero while the PTX keeps them
    sbytes = range(2, 255) if kind == "int8" else range(10, 255)
    for out in ("bf16", "f32"):
        asm, cons = Q.bits_asm(kind, out)
        nout = 2 if out == "bf16" else 4
        assert cons.split(",") == ["=r"] * nout + ["r"] * 5
        for sb in sbytes:
            cj = jnp.asarray(codes.view(np.int8) if kind == "int8" else codes.view(jnp.float8_e4m3fn))
            sj = jnp.full((codes.size // 32 + 1,), sb, jnp.uint8)
            sv = np.asarray(Q.scale_values(sj[:1], Q.default_mult(dt)), np.float32).view(np.uint32)[0]
            regs = {f"${nout}": words, **{f"${nout + 1 + j}": np.full(words.shape, sv, np.uint32) for j in range(4)}}
            regs = _run_ptx(asm, regs)
            if out == "bf16":
                lanes = [regs[f"${i // 2}"] >> np.uint32(16 * (i % 2)) & np.uint32(0xFFFF) for i in range(4)]
                got = np.stack(lanes, 1).reshape(-1).astype(np.uint16).view(jnp.bfloat16).astype(np.float32)
            else:
                got = np.stack([regs[f"${i}"] for i in range(4)], 1).reshape(-1).view(np.float32)
            want_dt = jnp.bfloat16 if out == "bf16" else F32
            pad = (-codes.size) % 32
            c2 = jnp.concatenate([cj, jnp.zeros((pad,), cj.dtype)]).reshape(1, -1)
            want = np.asarray(Q.dequantize(c2, sj[None, : c2.shape[1] // 32], want_dt), np.float32)[0, : codes.size]
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} -> {out}, scale byte {sb}")


@pytest.mark.parametrize("extra", [dict(dequant="bits"), dict(act_quant=True), dict(act_quant=True, wlhs=True),
                                   dict(act_quant=True, mode="reduce"), dict(act_quant=True, split=True, bm=64)],
                         ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()))
def test_kernel_lowers_for_cuda(extra):
    """The Triton forms the interpreter cannot check (inline PTX, the e4m3 conversion inside the
    kernel, the grouped reductions) lower for the CUDA platform from any machine, and the PTX
    reaches the Triton module (the GPU run checks the numbers: benchmarks/check_gpu_kernels.py and
    the gpu-marked test below)."""
    extra = dict(extra)
    bm = extra.pop("bm", 1)
    for dt in (jnp.int8, jnp.float8_e4m3fn):
        args = (jax.ShapeDtypeStruct((2 * bm, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32),
                jax.ShapeDtypeStruct((4, 128, 256), dt), jax.ShapeDtypeStruct((4, 128, 8), jnp.uint8))
        fn = jax.jit(lambda x, bg, c, s: Q.grouped_qmatmul(x, bg, 2, c, s, bm=bm, impl="triton", **extra))
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "grouped_qmatmul" in text
        if extra.get("dequant") == "bits":
            kind = "int8" if dt == jnp.int8 else "e4m3"
            assert Q.bits_asm(kind, "bf16")[0].split("\n")[2] in text.replace("\\0A", "\n")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,bm,mode,wlhs", [("int8", 1, "dot", False), ("fp8", 1, "dot", False),
                                               ("int8", 1, "reduce", False), ("int8", 128, "dot", True),
                                               ("fp8", 16, "dot", True)])
def test_bits_dequant_on_gpu(kind, bm, mode, wlhs):
    """Compiled kernel with ``dequant="bits"``: the same sums as ``"cvt"`` and the reference."""
    rng = np.random.default_rng(5)
    codes, scale = _weights(rng, kind, 8, 384, 1024)
    nb = 6 if bm == 1 else 3
    x = jnp.asarray(rng.standard_normal((nb * bm, 1024)), jnp.bfloat16)
    bg = jnp.asarray(rng.integers(0, 8, nb), jnp.int32)
    kw = dict(bm=bm, out_dtype=F32, impl="triton", mode=mode, **({"wlhs": True} if wlhs else {}))
    bits = Q.grouped_qmatmul(x, bg, nb, codes, scale, dequant="bits", **kw)
    cvt = Q.grouped_qmatmul(x, bg, nb, codes, scale, dequant="cvt", **kw)
    ref = Q.grouped_qmatmul_reference(x, bg, nb, codes, scale, bm=bm, out_dtype=F32)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(cvt))
    assert _rel(bits, ref) < 1e-6


# ------------------------------------------------------------------------------ fused act_quant
AQ_CASES = [  # kind, G, O, K, bm, nb, mode, tiles, x dtype, compute dtype
    ("int8", 6, 40, 256, 1, 7, "auto", {}, jnp.bfloat16, None),
    ("fp8", 1, 72, 256, 1, 3, "auto", {"wlhs": True, "splitk": 2}, jnp.bfloat16, None),
    ("int8", 3, 72, 128, 64, 3, "auto", {}, jnp.bfloat16, None),
    ("int8", 3, 72, 128, 64, 3, "dot", {"split": True}, jnp.bfloat16, None),
    ("fp8", 1, 72, 256, 1, 3, "reduce", {}, jnp.bfloat16, None),
    ("int8", 6, 40, 256, 2, 3, "reduce", {}, jnp.bfloat16, None),
    ("bf16", 6, 40, 96, 1, 6, "auto", {}, jnp.bfloat16, None),
    ("int8", 6, 40, 256, 1, 7, "auto", {}, F32, None),
    ("fp8", 1, 72, 256, 1, 3, "auto", {}, F32, jnp.bfloat16),
]


@pytest.mark.parametrize("kind,G,O,K,bm,nb,mode,tiles,xdt,cdt", AQ_CASES,
                         ids=[f"{c[0]}-bm{c[4]}-{c[6]}{''.join(f'-{k}{v}' for k, v in c[7].items())}-"
                              f"{jnp.dtype(c[8]).name}-{c[9] and jnp.dtype(c[9]).name}" for c in AQ_CASES])
def test_kernel_act_quant_matches_separate_quantization(kind, G, O, K, bm, nb, mode, tiles, xdt, cdt):
    """``act_quant=True`` (x quantized per tile inside the kernel) gives what quantizing x first
    with ``quant.act_quant_fp8`` and running the kernel on it gives, bit for bit; the reference
    with ``act_quant`` agrees within the fp32 summation order."""
    from dsv41_jax.quant import act_quant_fp8

    rng = np.random.default_rng(7)
    codes, scale = _weights(rng, kind, G, O, K)
    # rows of very different magnitudes: the per-32 scales differ across the row
    x = rng.standard_normal((nb * bm, K)) * np.exp2(rng.integers(-6, 6, (nb * bm, K // 32))).repeat(32, 1)[:, :K]
    x = jnp.asarray(x, xdt)
    bg = jnp.asarray(rng.integers(0, G, nb), jnp.int32)
    cd = xdt if cdt is None else cdt
    kw = dict(bm=bm, out_dtype=F32, impl="interpret", mode=mode, **tiles)
    fused = Q.grouped_qmatmul(x, bg, nb, codes, scale, act_quant=True, compute_dtype=cdt, **kw)
    xq = act_quant_fp8(x.astype(F32), 32).astype(cd)
    assert not np.array_equal(np.asarray(xq, np.float32), np.asarray(x.astype(cd), np.float32))  # quantization acts
    separate = Q.grouped_qmatmul(xq, bg, nb, codes, scale, **kw)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(separate))
    ref = Q.grouped_qmatmul_reference(x, bg, nb, codes, scale, bm=bm, out_dtype=F32, act_quant=True, compute_dtype=cdt)
    assert _rel(fused, ref) < 1e-6


def test_act_quant_groups_equals_act_quant_fp8():
    """The kernels' form of the fp8 activation quantization (rounding by the e4m3 conversion)
    equals ``act_quant_fp8`` (integer RNE) bit for bit, ties and subnormal codes included."""
    from dsv41_jax.quant import act_quant_fp8, act_quant_fp8_groups

    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 32)) * np.exp2(rng.integers(-30, 30, (512, 1)))
    x[:8] = 0.0
    x[8:16, 0] = 448.0 * np.exp2(rng.integers(-20, 20, 8))  # amax exactly at a power-of-two scale
    grid = np.unique(np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32))
    grid = grid[np.isfinite(grid) & (grid >= 0)]
    mids = (grid[1:] + grid[:-1]) / 2  # ties between neighbouring codes (scale 1: amax 448 in the row)
    ties = np.concatenate([mids, np.full(32 - mids.size % 32, 448.0)])[: (mids.size // 31 + 1) * 32]
    ties = np.resize(ties, (-(-ties.size // 32), 32))
    ties[:, 0] = 448.0
    x = np.concatenate([x, ties]).astype(np.float32)
    got = np.asarray(jax.jit(act_quant_fp8_groups)(jnp.asarray(x)))
    want = np.asarray(act_quant_fp8(jnp.asarray(x), 32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,bm,tiles", [("int8", 1, {}), ("fp8", 1, {}), ("int8", 128, {}), ("fp8", 16, {}),
                                           ("int8", 1, {"mode": "reduce"}), ("int8", 1, {"dequant": "bits"})])
def test_act_quant_on_gpu(kind, bm, tiles):
    """Compiled kernel: x quantized inside (Triton's e4m3 conversion) equals quantizing x first."""
    from dsv41_jax.quant import act_quant_fp8

    rng = np.random.default_rng(9)
    codes, scale = _weights(rng, kind, 8, 384, 1024)
    nb = 6 if bm == 1 else 3
    x = rng.standard_normal((nb * bm, 1024)) * np.exp2(rng.integers(-6, 6, (nb * bm, 32))).repeat(32, 1)
    x = jnp.asarray(x, jnp.bfloat16)
    bg = jnp.asarray(rng.integers(0, 8, nb), jnp.int32)
    kw = dict(bm=bm, out_dtype=F32, impl="triton", **tiles)
    fused = Q.grouped_qmatmul(x, bg, nb, codes, scale, act_quant=True, **kw)
    separate = Q.grouped_qmatmul(act_quant_fp8(x.astype(F32), 32).astype(jnp.bfloat16), bg, nb, codes, scale, **kw)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(separate))
