"""Routed experts kept quantized in memory (int8 codes = 2 x e2m1 value + ue8m0 scale bytes):
exactly the dequantized model's results, at a fraction of the bytes, from the original
checkpoint and from an Orbax checkpoint converted with ``--experts int8``."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.numerics import Numerics
from dsv41_jax.weights import WeightError, load_original

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FP8 = os.path.join(GOLDEN, "image_fp8")


def _param_bytes(m):
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))


@pytest.mark.parametrize("numerics", [Numerics("bfloat16", "reference"), Numerics("float32", "fast")],
                         ids=["bf16-reference", "fp32-fast"])
def test_int8_experts_equal_dequantized_every_path(numerics, monkeypatch):
    a = load_original(FP8, numerics, text_only=True)
    b = load_original(FP8, numerics, text_only=True, experts_int8=True)
    ex = b.layers[1].ffn.experts
    assert ex.w1.weight.get_value().dtype == jnp.int8 and ex.w1.scale.get_value().dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(ex.w2.values(jnp.float32)),
                                  np.asarray(a.layers[1].ffn.experts.w2.weight.get_value(), np.float32))
    assert _param_bytes(b) < _param_bytes(a)
    # a jitted prefill (one compile per model instead of the eager forward's hundreds of op
    # compiles); the shapes of test_fp8_dense's prefill, whose executables the cache may hold
    from dsv41_jax.generate import forward_chunk

    ids = jnp.asarray(np.random.default_rng(0).integers(3, 240, (1, 11)), jnp.int32)
    la, _ = forward_chunk(a, ids, a.init_cache(1, 16))
    lb, _ = forward_chunk(b, ids, b.init_cache(1, 16))
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    # every routed-expert implementation reads the quantized storage identically
    x = jax.random.normal(jax.random.key(1), (40, a.config.text.hidden_size)).astype(numerics.dtype)
    moe_a, moe_b = a.layers[2].ffn, b.layers[2].ffn
    for path in ("dense", "gather", "grouped", "ragged"):
        monkeypatch.setenv("DSV41_MOE_PATH", path)
        np.testing.assert_array_equal(np.asarray(moe_a(x)), np.asarray(moe_b(x)), err_msg=path)


def test_int8_needs_fp4_experts():
    with pytest.raises(WeightError, match="fp4"):
        load_original(os.path.join(GOLDEN, "text_fast_fp32"), Numerics("float32", "fast"), experts_int8=True)


def test_restore_converted_int8_keeps_codes(tmp_path):
    from convert import convert_checkpoint
    from dsv41_jax.checkpoint import CheckpointError, restore_model

    dst = str(tmp_path / "int8")
    convert_checkpoint(FP8, dst, experts="int8", progress=False, log=lambda *a, **k: None)
    num = Numerics("bfloat16", "reference")
    q = restore_model(dst, num, text_only=True, experts_int8=True)
    ref = load_original(FP8, num, text_only=True, experts_int8=True)
    for (pa, va), (pb, vb) in zip(nnx.to_flat_state(nnx.state(q, nnx.Param)), nnx.to_flat_state(nnx.state(ref, nnx.Param))):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()), err_msg=str(pa))
    with pytest.raises(CheckpointError, match="--experts int8"):
        bf16 = str(tmp_path / "bf16")
        convert_checkpoint(FP8, bf16, progress=False, log=lambda *a, **k: None)
        restore_model(bf16, num, text_only=True, experts_int8=True)


def test_save_model_of_int8_experts_restores_both_ways(tmp_path):
    """``save_model`` of an ``experts_int8`` model writes the ``--experts int8`` encoding: it
    restores with ``experts_int8=True`` (codes and scales bit for bit) and dequantized (equal to
    the dequantized load)."""
    from dsv41_jax.checkpoint import read_meta, restore_model, save_model

    num = Numerics("bfloat16", "reference")
    q = load_original(FP8, num, text_only=True, experts_int8=True)
    dst = save_model(q, str(tmp_path / "saved"), tokenizer_dir=FP8)
    encs = {k: v["encoding"] for k, v in read_meta(dst)["params"].items() if ".ffn.experts." in k}
    assert encs and all(e == ("fp4x2_int8" if k.endswith(".weight") else "e8m0_per32") for k, e in encs.items())
    for restored, ref in ((restore_model(dst, num, text_only=True, experts_int8=True), q),
                          (restore_model(dst, num, text_only=True), load_original(FP8, num, text_only=True))):
        fa = nnx.to_flat_state(nnx.state(restored, nnx.Param))
        fb = nnx.to_flat_state(nnx.state(ref, nnx.Param))
        assert [p for p, _ in fa] == [p for p, _ in fb]
        for (pa, va), (_, vb) in zip(fa, fb):
            np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()), err_msg=str(pa))


def test_kblocked_experts_forward_and_save(tmp_path):
    """The experts K-blocked (``moe.block_expert_codes``; w2's 32 inputs are not a multiple of 64
    and stay in rows): the jitted prefill's logits equal the rows layout's bit for bit, and
    ``save_model`` writes rows, which restore to the rows model's codes bit for bit;
    ``sharding.shard_model`` restores rows before placing the weights."""
    from dsv41_jax.checkpoint import read_meta, restore_model, save_model
    from dsv41_jax.generate import forward_chunk
    from dsv41_jax.model.moe import StackedWeight, block_expert_codes

    num = Numerics("bfloat16", "reference")
    q = load_original(FP8, num, text_only=True, experts_int8=True)
    b = load_original(FP8, num, text_only=True, experts_int8=True)
    stacked = [m for _, m in nnx.iter_graph(b) if isinstance(m, StackedWeight)]
    assert block_expert_codes(b, force=True) == 2 * len(stacked) // 3
    assert all(m.kblocked == (m.weight.shape[-1] == 64) for m in stacked)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 240, (1, 11)), jnp.int32)
    la, _ = forward_chunk(q, ids, q.init_cache(1, 16))
    lb, _ = forward_chunk(b, ids, b.init_cache(1, 16))
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    dst = save_model(b, str(tmp_path / "saved"), tokenizer_dir=FP8)
    shapes = {k: v["shape"] for k, v in read_meta(dst)["params"].items() if ".ffn.experts.w1.weight" in k}
    assert shapes and all(len(s) == 3 for s in shapes.values())
    r = restore_model(dst, num, text_only=True, experts_int8=True)
    for (pa, va), (_, vb) in zip(nnx.to_flat_state(nnx.state(r, nnx.Param)), nnx.to_flat_state(nnx.state(q, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()), err_msg=str(pa))
    from dsv41_jax.sharding import mesh_from_spec, shard_model

    shard_model(b, mesh_from_spec("1,1,1"))
    assert not any(m.kblocked for m in stacked) and stacked[0].weight.shape == stacked[0].shape
