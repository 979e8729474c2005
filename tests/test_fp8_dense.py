"""Dense Linear weights kept fp8 in memory (float8_e4m3fn codes + ue8m0 scale bytes [out, in/32]):
exactly the dequantized model's results (prefill and decode logits, both numerics), from the
original checkpoint and from an Orbax checkpoint converted with ``--dense fp8``; the layout, the
exact-range guard, and the partition rules of the new ``scale`` leaves."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.model.layers import Linear, dequant_fp8_weight
from dsv41_jax.numerics import Numerics
from dsv41_jax.weights import WeightError, fp8_row_scales, load_original

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FP8 = os.path.join(GOLDEN, "image_fp8")
QUIET = dict(progress=False, log=lambda *a, **k: None)


def _flat(m):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


def _bytes(m):
    return sum(x.nbytes for x in _flat(m).values())


def _assert_same(x, y, msg=""):
    """Same dtype and bits (1-byte dtypes compared as raw bytes)."""
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype, (msg, x.dtype, y.dtype)
    if x.dtype.itemsize == 1:
        x, y = x.view(np.uint8), y.view(np.uint8)
    np.testing.assert_array_equal(x, y, err_msg=msg)


def _fp8_linears(m):
    return {".".join(map(str, p)): mod for p, mod in nnx.iter_graph(m) if isinstance(mod, Linear) and mod.fp8}


# ------------------------------------------------------------------------------ layout / exactness
def test_row_scales_and_dequant_equal_the_block_decoder():
    rng = np.random.default_rng(0)
    o, i = 96, 128
    codes = rng.integers(0, 256, (o, i), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    w8 = codes.view(ml_dtypes.float8_e4m3fn)
    for block, lo, hi in (((32, 32), 10, 246), ((32, 32), 100, 140), ((64, 128), 90, 130)):
        sc = rng.integers(lo, hi + 1, (-(-o // block[0]), -(-i // block[1])), dtype=np.uint8)
        sc.flat[0], sc.flat[-1] = lo, hi  # the ends of the exact range
        rows = fp8_row_scales(sc, o, i, block)
        assert rows.shape == (o, i // 32) and rows.dtype == np.uint8
        want = quant.dequant_fp8_blocks(w8, sc, block=block)  # fp32, exact (numpy)
        for dt in (jnp.float32, jnp.bfloat16):
            got = jax.jit(dequant_fp8_weight, static_argnums=2)(jnp.asarray(w8), jnp.asarray(rows), dt)
            # the value is exact in bf16 as well: converting the exact fp32 value gives the same bits
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want.astype(dt).astype(np.float32))
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    for bad in (9, 247):
        with pytest.raises(WeightError, match="outside 10..246"):
            fp8_row_scales(np.full((3, 4), bad, np.uint8), o, i)


def _random_fp8_linear(rng, out: int = 64, numerics=None, quantized: bool = False):
    """A 96 -> ``out`` fp8-stored Linear (default bf16 fast numerics) with random e4m3 codes (no
    NaN codes) and scale bytes 110..129."""
    lin = Linear(96, out, numerics=numerics or Numerics("bfloat16", "fast"), quantized=quantized)
    lin.set_fp8()
    c = rng.integers(0, 256, (out, 96), dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] = 0
    lin.weight.set_value(jnp.asarray(c.view(ml_dtypes.float8_e4m3fn)))
    lin.scale.set_value(jnp.asarray(rng.integers(110, 130, (out, 3), dtype=np.uint8)))
    return lin


def test_kernel_route(monkeypatch):
    """``DSV41_KERNELS=pallas`` on a GPU backend sends fp8 Linears to ``grouped_qmatmul`` (G=1);
    here the Pallas interpreter stands in for the GPU: same values up to fp32 summation order,
    for decode-sized (one row block) and prefill-sized (64-row blocks, padded) inputs."""
    pytest.importorskip("dsv41_jax.kernels.qmatmul")
    from dsv41_jax.model import layers

    rng = np.random.default_rng(2)
    lin = _random_fp8_linear(rng)
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    for rows in (3, 70):
        x = jnp.asarray(rng.standard_normal((1, rows, 96)), jnp.bfloat16)
        monkeypatch.setenv("DSV41_KERNELS", "xla")
        want = np.asarray(lin(x, out_dtype=jnp.float32), np.float32)
        monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
        monkeypatch.setenv("DSV41_KERNELS", "pallas")
        assert layers._use_kernel()
        got = np.asarray(lin(x, out_dtype=jnp.float32), np.float32)
        monkeypatch.undo()
        monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("numerics,quantized", [(Numerics("bfloat16", "fast"), False),
                                                 (Numerics("bfloat16", "reference"), True)], ids=["fast", "reference"])
def test_fused_linears_route(numerics, quantized, monkeypatch):
    """``layers.fused_linears`` on the decode kernel path: one ``grouped_qmatmul_fused`` launch
    for fp8 Linears that read the same input (outputs of different sizes), equal to the separate
    XLA-route calls up to fp32 summation order (fake-quantized input in reference numerics);
    separate calls above the row limit, for bf16 weights, and with ``DSV41_FUSED_LAUNCH=0``."""
    import dsv41_jax.kernels as K
    from dsv41_jax.kernels import qmatmul as Q
    from dsv41_jax.model import layers

    rng = np.random.default_rng(7)
    mods = [_random_fp8_linear(rng, o, numerics, quantized) for o in (64, 40, 32)]
    x = jnp.asarray(rng.standard_normal((1, 2, 96)), jnp.bfloat16)
    monkeypatch.setenv("DSV41_KERNELS", "xla")
    want = [np.asarray(m(x, out_dtype=jnp.float32), np.float32) for m in mods]
    assert all(np.abs(w).max() > 0 for w in want)
    calls = []
    real = Q.grouped_qmatmul_fused
    monkeypatch.setattr(K, "grouped_qmatmul_fused", lambda x, bg, n, ws, **kw: calls.append(len(ws)) or real(x, bg, n, ws, **kw))
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("DSV41_KERNELS", "pallas")
    got = layers.fused_linears(x, mods, out_dtype=jnp.float32)
    assert calls == [3]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=1e-5 * np.abs(w).max())
    calls.clear()
    monkeypatch.setenv("DSV41_FUSED_LAUNCH", "0")
    layers.fused_linears(x, mods, out_dtype=jnp.float32)
    assert calls == [1, 1, 1]
    monkeypatch.setenv("DSV41_FUSED_LAUNCH", "1")
    calls.clear()
    layers.fused_linears(jnp.zeros((1, 300, 96), jnp.bfloat16), mods[:2])  # prefill-sized: XLA GEMMs
    assert calls == []
    plain = Linear(96, 16, numerics=numerics)
    got = layers.fused_linears(x, [mods[0], plain], out_dtype=jnp.float32)
    assert calls == [1] and got[1].shape == (1, 2, 16)  # a bf16 weight: separate calls
    monkeypatch.setenv("DSV41_FUSED_LAUNCH", "2")
    with pytest.raises(ValueError, match="DSV41_FUSED_LAUNCH"):
        layers.fused_linears(x, mods)


def test_grouped_wo_a_kernel_route(monkeypatch):
    """An fp8 ``wo_a`` on the kernel path with few tokens runs ``grouped_qmatmul`` with one row
    block per output group (codes read in place); it equals the dequantize + einsum route up to
    one bf16 rounding of differently ordered fp32 sums."""
    from dsv41_jax.config import preset
    from dsv41_jax.model import layers
    from dsv41_jax.model.attention import Attention

    cfg = preset("tiny").text
    plan = cfg.layers[0]
    att = Attention(cfg, plan, Numerics("bfloat16", "fast"))
    att.wo_a.set_fp8()
    rng = np.random.default_rng(5)
    O, K = att.wo_a.out_features, att.wo_a.in_features
    c = rng.integers(0, 256, (O, K), dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] = 0
    att.wo_a.weight.set_value(jnp.asarray(c.view(ml_dtypes.float8_e4m3fn)))
    att.wo_a.scale.set_value(jnp.asarray(rng.integers(118, 126, (O, K // 32), dtype=np.uint8)))
    o = jnp.asarray(rng.standard_normal((3, 1, cfg.o_groups, K)), jnp.bfloat16)
    monkeypatch.setenv("DSV41_KERNELS", "xla")
    want = np.asarray(att._grouped_out(o), np.float32)
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("DSV41_KERNELS", "pallas")
    got = np.asarray(att._grouped_out(o), np.float32)
    assert got.shape == want.shape == (3, 1, cfg.o_groups, cfg.o_lora_rank)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6 * np.abs(want).max())
    assert np.mean(got == want) > 0.9  # mostly bit-identical: only summation order differs


# ------------------------------------------------------------------------------ original checkpoint
@pytest.fixture(scope="module")
def pairs():
    return {}


def _pair(pairs, numerics):
    if numerics not in pairs:
        pairs[numerics] = (load_original(FP8, numerics, text_only=True),
                           load_original(FP8, numerics, text_only=True, dense_fp8=True))
    return pairs[numerics]


def test_fp8_storage_layout_and_bytes(pairs):
    a, b = _pair(pairs, Numerics("bfloat16", "reference"))
    lin = _fp8_linears(b)
    # every Linear the checkpoint stores fp8 (wo_a included: run as a bf16 grouped einsum, exact value)
    assert set(lin) == {n[: -len(".scale")] for n in _checkpoint_scales()} and any(n.endswith("attn.wo_a") for n in lin) and any("shared_experts" in n for n in lin)
    assert any(n.endswith("engram.wkv") for n in lin) and any(n.endswith("indexer.wq_b") for n in lin)
    fa, fb = _flat(a), _flat(b)
    for n, mod in lin.items():
        assert fb[n + ".weight"].dtype == jnp.float8_e4m3fn and fb[n + ".scale"].dtype == jnp.uint8
        assert fb[n + ".scale"].shape == (mod.out_features, mod.in_features // 32)
        np.testing.assert_array_equal(np.asarray(mod.values()), np.asarray(fa[n + ".weight"]), err_msg=n)
        assert mod.quantized == _module(a, n).quantized
    # untouched: head, embeddings, norms, router, compressor (bf16 in the checkpoint)
    for n in ("head.weight", "embed.weight", "norm.weight", "layers.1.ffn.gate.weight",
              "layers.1.attn.compressor.wkv.weight"):
        assert fb[n].dtype == fa[n].dtype
    assert _bytes(b) < _bytes(a)


def _checkpoint_scales():
    from dsv41_jax.safetensors_io import Checkpoint

    ck = Checkpoint(FP8)
    return [n for n in ck.names if n.endswith(".scale") and ck.info(n[:-5] + "weight")[0] == "F8_E4M3"
            and ".engram.embed." not in n]


def _module(m, name):
    for p, mod in nnx.iter_graph(m):
        if ".".join(map(str, p)) == name:
            return mod
    raise KeyError(name)


@pytest.mark.parametrize("mode", ["reference", "fast"])
def test_dense_fp8_logits_identical(pairs, mode):
    """bf16 compute: prefill logits and one decode step's logits are bit-identical."""
    from dsv41_jax.generate import forward_chunk

    a, b = _pair(pairs, Numerics("bfloat16", mode))
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 240, (1, 11)), jnp.int32)
    out = []
    for m in (a, b):
        cache = m.init_cache(1, 16)
        lp, cache = forward_chunk(m, ids, cache)
        ld = None
        if mode == "reference":  # decode against the prefilled cache (the other mode: prefill only)
            ld, _ = forward_chunk(m, jnp.argmax(lp[:, -1:], -1).astype(jnp.int32), cache)
        out.append((lp, ld))
    np.testing.assert_array_equal(np.asarray(out[0][0]), np.asarray(out[1][0]))
    if mode == "reference":
        np.testing.assert_array_equal(np.asarray(out[0][1]), np.asarray(out[1][1]))


def test_dense_fp8_decode_on_the_kernel_path(pairs, monkeypatch):
    """A decode step of the fp8-stored model on the kernel path (the Pallas interpreter standing
    in for the GPU): the Linears that read the same input run as fused launches (wq_a + wkv and
    the shared expert's w1 + w3 in every layer, wq_b + the indexer's wq_b in the index-source
    layers), and the logits equal the XLA route's up to bf16 roundings of differently ordered
    fp32 sums."""
    import dsv41_jax.kernels as K
    from dsv41_jax.generate import _forward, _split_flat, forward_chunk
    from dsv41_jax.kernels import qmatmul as Q
    from dsv41_jax.model import layers

    _, b = _pair(pairs, Numerics("bfloat16", "reference"))
    ids = jnp.asarray(np.random.default_rng(3).integers(3, 240, (1, 11)), jnp.int32)  # the shapes of
    cache = b.init_cache(1, 16)  # test_dense_fp8_logits_identical: its executables are reused
    lp, cache = forward_chunk(b, ids, cache)
    nxt = jnp.argmax(lp[:, -1:], -1).astype(jnp.int32)
    want, _ = forward_chunk(b, nxt, jax.tree.map(jnp.copy, cache))
    calls = []
    real = Q.grouped_qmatmul_fused
    monkeypatch.setattr(K, "grouped_qmatmul_fused",
                        lambda x, bg, n, ws, **kw: calls.append(tuple(int(c.shape[-2]) for c, _ in ws)) or real(x, bg, n, ws, **kw))
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    monkeypatch.setenv("DSV41_SINKHORN", "xla")  # the jnp Sinkhorn: this test is about the Linears
    # the decode glue kernels the GPU default also runs (their quantized inputs feed the launches)
    monkeypatch.setenv("DSV41_NORM_QUANT", "interpret")
    monkeypatch.setenv("DSV41_MHC_KERNEL", "interpret")
    monkeypatch.setenv("DSV41_TOPK_KERNEL", "interpret")
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("DSV41_KERNELS", "pallas")
    graphdef, state = _split_flat(b)  # a fresh jit: the kernel choices are read at trace time
    got, _ = jax.jit(functools.partial(_forward, graphdef))(state, cache, nxt, jnp.ones(nxt.shape, bool), None, None, None)
    t = b.config.text
    fused = [c for c in calls if len(c) == 2]
    n_index = sum(1 for p in t.layers if p.ratio > 0 and p.owns_indexer)
    assert n_index > 0
    assert fused.count((t.q_lora_rank, t.head_dim)) == t.num_hidden_layers  # wq_a + wkv
    assert fused.count((t.moe_intermediate_size,) * 2) == t.num_hidden_layers  # shared w1 + w3
    assert fused.count((t.num_attention_heads * t.head_dim, t.index_n_heads * t.index_head_dim)) == n_index
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=0, atol=3e-2 * np.abs(w).max())
    assert int(np.argmax(g)) == int(np.argmax(w))


def test_dense_fp8_needs_fp8_weights():
    with pytest.raises(WeightError, match="dense_fp8"):
        load_original(os.path.join(GOLDEN, "text_bf16"), Numerics("bfloat16", "fast"), dense_fp8=True)


# ------------------------------------------------------------------------------ Orbax round trip
def test_convert_dense_fp8_then_restore(tmp_path):
    from convert import convert_checkpoint
    from dsv41_jax.checkpoint import CheckpointError, info, read_meta, restore_model

    num = Numerics("bfloat16", "reference")
    dst = str(tmp_path / "fp8")
    rep = convert_checkpoint(FP8, dst, dense="fp8", experts="int8", text_only=True, **QUIET)
    assert rep["dense"] == "fp8"
    meta = read_meta(dst)
    encs = {k: v["encoding"] for k, v in meta["params"].items()}
    assert encs["layers.0.attn.wq_a.weight"] == "fp8_e4m3" and encs["layers.0.attn.wq_a.scale"] == "e8m0_rows"
    assert encs["layers.1.attn.compressor.wkv.weight"] == "float"  # bf16 in the checkpoint
    info(dst)  # the summary reads the new encodings
    q = restore_model(dst, num, text_only=True, dense_fp8=True, experts_int8=True)
    ref = load_original(FP8, num, text_only=True, dense_fp8=True, experts_int8=True)
    fq, fr = _flat(q), _flat(ref)
    assert fq.keys() == fr.keys()
    for n in fr:
        _assert_same(fq[n], fr[n], n)
    assert set(_fp8_linears(q)) == set(_fp8_linears(ref))
    # without the flag the same checkpoint restores dequantized, equal to the plain loader
    d = restore_model(dst, num, text_only=True)
    plain = _flat(load_original(FP8, num, text_only=True))
    fd = _flat(d)
    assert fd.keys() == plain.keys()
    for n in plain:
        _assert_same(fd[n], plain[n], n)
    # an in-memory fp8 model saves and restores as the same encodings
    from dsv41_jax.checkpoint import save_model

    ref = load_original(FP8, num, text_only=True, dense_fp8=True)
    again = save_model(ref, str(tmp_path / "saved"), tokenizer_dir=FP8)
    assert read_meta(again)["params"]["layers.0.attn.wq_a.scale"]["encoding"] == "e8m0_rows"
    fr, fs = _flat(ref), _flat(restore_model(again, num, text_only=True, dense_fp8=True))
    assert fs.keys() == fr.keys()
    for n in fr:
        _assert_same(fs[n], fr[n], n)
    with pytest.raises(CheckpointError, match="--dense fp8"):
        bf16 = str(tmp_path / "bf16")
        convert_checkpoint(FP8, bf16, text_only=True, **QUIET)
        restore_model(bf16, num, text_only=True, dense_fp8=True)


def test_api_and_cli_flags(monkeypatch):
    import dsv41_jax
    from dsv41_jax import cli

    m = dsv41_jax.load(FP8, text_only=True, dense_fp8=True, tokenizer=False)
    assert _fp8_linears(m.model)
    args = cli.build_parser().parse_args(["generate", "m", "p", "--dense-fp8"])
    seen = {}
    monkeypatch.setattr(dsv41_jax, "load", lambda path, **kw: seen.update(kw))
    cli._load(args)
    assert seen["dense_fp8"] is True
    assert cli.build_parser().parse_args(["convert", "s", "d", "--dense", "fp8"]).dense == "fp8"
    from convert.__main__ import _convert_parser

    assert _convert_parser().parse_args(["s", "d", "--dense", "fp8"]).dense == "fp8"


# ------------------------------------------------------------------------------ sharding rules
def test_release_fp8_scales_shard_like_their_weights():
    """V4.1-Flash with the release fp8 Linears in fp8 storage: every new ``scale`` leaf has a rule
    and is split like its weight on the out dim (and on the in dim where the weight's split
    divides in/32); the per-device bytes of the dense weights drop to ~1.03/2."""
    from dsv41_jax import sharding as shd
    from dsv41_jax.config import preset
    from dsv41_jax.model.lm import DeepseekV41
    from dsv41_jax.numerics import REFERENCE_BF16
    from dsv41_jax.weights import release_fp8_linears

    cfg = preset("v41-flash")
    plain = nnx.eval_shape(lambda: DeepseekV41(cfg, REFERENCE_BF16, engram_quantized=True, text_only=True))
    names = release_fp8_linears(plain)
    assert len(names) == sum(8 + p.owns_indexer + p.has_engram for p in cfg.text.layers)
    kinds = {n.split(".", 2)[2] for n in names}
    assert kinds == {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
                     "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "engram.wkv"}
    fp8 = nnx.eval_shape(lambda: DeepseekV41(cfg, REFERENCE_BF16, engram_quantized=True, text_only=True,
                                             dense_fp8=names))

    class _Mesh:
        def __init__(self, spec):
            self.shape = dict(zip(shd.AXES, spec))

    for spec in ((1, 8, 1), (1, 4, 2), (1, 1, 8)):
        mesh = _Mesh(spec)
        pl = {p.name: p for p in shd.param_placements(fp8, mesh, strict=False)}
        assert all(p.logical is not None for p in pl.values())
        for n in names:
            w, s = pl[n + ".weight"], pl[n + ".scale"]
            assert s.shape[0] == w.shape[0] and s.shape[1] * 32 == w.shape[1]
            ws, ss = tuple(w.spec) + (None,) * 2, tuple(s.spec) + (None,) * 2
            assert ss[0] == ws[0], (n, spec, w.spec, s.spec)
            assert ss[1] in (ws[1], None), (n, spec, w.spec, s.spec)
        rows_a = shd.shardings_table(plain, mesh)
        rows_b = shd.shardings_table(fp8, mesh)
        dense = lambda rows: sum(r["bytes_per_device"] for r in rows  # noqa: E731
                                 if any(r["name"].startswith(n + ".") for n in names))
        assert dense(rows_b) < 0.52 * dense(rows_a)


# ------------------------------------------------------------------------------ sharded (2 CPU devices)
def test_sharded_restore_and_matmuls_on_2_devices(tmp_path):
    """Child process with 2 simulated CPU devices, mesh (1,1,2): an Orbax ``--dense fp8``
    checkpoint restored straight onto the mesh keeps codes and scales, each scale split like its
    weight's out dim, and the sharded fp8 Linears (column- and row-parallel) give the bf16 model's
    bits."""
    import json
    import subprocess
    import sys

    from convert import convert_checkpoint

    dst = str(tmp_path / "fp8")
    convert_checkpoint(FP8, dst, dense="fp8", text_only=True, **QUIET)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), dst], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "RESULT " in p.stdout, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads(p.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert res["n_fp8"] > 0 and res["split_scales"] > 0 and not res["bad"], res


def _child(dst):
    import json

    from dsv41_jax.checkpoint import restore_model
    from dsv41_jax.sharding import make_mesh, shard_model, use_mesh

    assert len(jax.devices()) >= 2
    mesh = make_mesh(1, 1, 2)
    num = Numerics("bfloat16", "reference")
    q = restore_model(dst, num, text_only=True, dense_fp8=True, mesh=mesh)
    ref = shard_model(load_original(FP8, num, text_only=True), mesh)
    lin_q, flat_r = _fp8_linears(q), _flat(ref)
    bad, split = [], 0
    x = jax.random.normal(jax.random.key(0), (3, 5, 256)).astype(jnp.bfloat16)
    apply = nnx.jit(lambda m, v: m(v))  # one jitted function: Linears of equal structure share its compiles
    with use_mesh(mesh):
        for n, mod in lin_q.items():
            w, s = mod.weight.get_value(), mod.scale.get_value()
            ws, ss = tuple(w.sharding.spec) + (None, None), tuple(s.sharding.spec) + (None, None)
            if ws[0] != ss[0]:
                bad.append(f"{n}: weight {w.sharding.spec} scale {s.sharding.spec}")
            split += ss[0] is not None or ss[1] is not None
            if not np.array_equal(np.asarray(mod.values()).astype(np.float32),
                                  np.asarray(flat_r[n + ".weight"]).astype(np.float32)):
                bad.append(f"{n}: values differ")
            r = _module(ref, n)
            xi = x[..., : mod.in_features]
            yq = apply(mod, xi)
            yr = apply(r, xi)
            if not np.array_equal(np.asarray(yq).astype(np.float32), np.asarray(yr).astype(np.float32)):
                bad.append(f"{n}: sharded matmul differs")
    print("RESULT " + json.dumps({"n_fp8": len(lin_q), "split_scales": int(split), "bad": bad}))


def test_kernel_route_row_limit(monkeypatch):
    """Above ``fp8_kernel_max_rows()`` rows (prefill) an fp8 Linear on the kernel path takes the
    XLA dequantize + GEMM route (bit-identical to ``DSV41_KERNELS=xla``); the environment moves the
    limit, and a bad value is one clear error."""
    from dsv41_jax.model import layers

    rng = np.random.default_rng(4)
    lin = _random_fp8_linear(rng)
    x = jnp.asarray(rng.standard_normal((2, 150, 96)), jnp.bfloat16)  # 300 rows > 256
    monkeypatch.setenv("DSV41_KERNELS", "xla")
    want = np.asarray(lin(x, out_dtype=jnp.float32))
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("DSV41_KERNELS", "pallas")
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")
    calls = []
    real = layers.fp8_matmul_kernel
    monkeypatch.setattr(layers, "fp8_matmul_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert layers.fp8_kernel_max_rows() == layers.FP8_KERNEL_MAX_ROWS == 256
    np.testing.assert_array_equal(np.asarray(lin(x, out_dtype=jnp.float32)), want)
    assert not calls
    monkeypatch.setenv("DSV41_FP8_KERNEL_MAX_ROWS", "300")
    got = np.asarray(lin(x, out_dtype=jnp.float32))
    # the kernel ran (``calls``); whether its fp32 summation order gives other bits than XLA's
    # depends on the jax version (equal on jax 0.10.2's CPU backend), so closeness is what is asserted
    assert calls
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    monkeypatch.setenv("DSV41_FP8_KERNEL_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="DSV41_FP8_KERNEL_MAX_ROWS"):
        lin(x)


if __name__ == "__main__":
    import sys

    _child(sys.argv[1])


def test_gemm_bf16_out_option(monkeypatch):
    """``DSV41_GEMM_BF16_OUT``: ``matmul`` / ``einsum_rounded`` with a bf16 result either let the
    GEMM write bf16 (one dot with a bf16 result) or round an fp32 result in a second pass; both
    give the fp32 sums rounded once (bit for bit on XLA:CPU), fp32 results never take the bf16
    form, and a bad value is one clear error."""
    from dsv41_jax.model.layers import einsum_rounded, gemm_bf16_out, matmul

    kx, kw = jax.random.split(jax.random.key(3))
    x = quant.act_quant_fp8(jax.random.normal(kx, (2, 24, 256)), 32).astype(jnp.bfloat16)
    w = quant.act_quant_fp8(jax.random.normal(kw, (96, 256)) * 0.02, 32).astype(jnp.bfloat16)
    want = jnp.einsum("bsi,oi->bso", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)
    got, prims = {}, {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DSV41_GEMM_BF16_OUT", mode)
        f = functools.partial(matmul, out_dtype=jnp.bfloat16, compute_dtype=jnp.float32)
        got[mode] = jax.jit(f)(x, w)
        prims[mode] = jax.make_jaxpr(f)(x, w).eqns[-1].primitive.name
        assert got[mode].dtype == jnp.bfloat16
        g = einsum_rounded("bsi,oi->bso", x, w, jnp.float32)  # fp32 results: always the fp32 GEMM
        assert g.dtype == jnp.float32
    assert prims == {"0": "convert_element_type", "1": "dot_general"}
    np.testing.assert_array_equal(np.asarray(got["1"], np.float32), np.asarray(got["0"], np.float32))
    # the fp32 sums of exact products: within one bf16 rounding of the fp32-operand product
    np.testing.assert_allclose(np.asarray(got["1"], np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-6)
    monkeypatch.setenv("DSV41_GEMM_BF16_OUT", "auto")
    assert gemm_bf16_out() == (jax.default_backend() == "gpu")
    monkeypatch.setenv("DSV41_GEMM_BF16_OUT", "yes")
    with pytest.raises(ValueError, match="DSV41_GEMM_BF16_OUT"):
        gemm_bf16_out()


def test_gemm_bf16_out_in_the_model(pairs, monkeypatch):
    """The fp8-stored tiny model's bf16 prefill logits with the bf16-result GEMMs (``matmul`` and
    the grouped ``wo_a`` einsum) equal those of the fp32 results rounded by a second pass (XLA:CPU;
    the GPU check is ``check_gpu_kernels.py gemm_out``)."""
    from dsv41_jax.generate import forward_chunk

    _, b = _pair(pairs, Numerics("bfloat16", "reference"))
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 240, (1, 9)), jnp.int32)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DSV41_GEMM_BF16_OUT", mode)
        out[mode], _ = forward_chunk(b, ids, b.init_cache(1, 16), jit=False)  # traced afresh: the flag is read
    np.testing.assert_array_equal(np.asarray(out["1"]), np.asarray(out["0"]))
