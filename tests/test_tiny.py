"""dsv41_jax.tiny: tiny random V4.1 checkpoints in the original on-disk format."""
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dsv41_jax import quant as Q
from dsv41_jax import tiny
from dsv41_jax.engram_layout import EngramLayout, build_compressed_token_map, compressed_vocab_size, engram_num_embeddings

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
BF16 = ml_dtypes.bfloat16


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in h.items()}


def _golden(name):
    d = os.path.join(GOLDEN, name)
    if not os.path.isdir(d):
        pytest.skip(f"tests/golden/{name} missing")
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f), _header(os.path.join(d, "model.safetensors"))


def _raw(path):
    """Read with the safetensors package (independent of our writer): fp8/int8 as bytes, rest fp32."""
    out = {}
    for k, v in load_file(path).items():
        if v.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            out[k] = (str(v.dtype), v.view(torch.uint8).numpy())
        else:
            out[k] = (str(v.dtype), v.float().numpy())
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    cfgs = {fmt: tiny.write_tiny_checkpoint(str(root / fmt), fmt=fmt, seed=3) for fmt in ("fp8", "bf16")}
    return root, cfgs


def test_inventory_matches_golden():
    for name in ("image_fp8", "text_fast_fp32", "image_fast_fp32"):
        cfg, hdr = _golden(name)
        assert tiny.tensor_inventory(cfg) == hdr, name


def test_written_files_match_golden_layout(ckpts):
    root, cfgs = ckpts
    for fmt, golden in (("fp8", "image_fp8"), ("bf16", "text_fast_fp32")):
        gcfg, ghdr = _golden(golden)
        assert _header(str(root / fmt / "model.safetensors")) == ghdr
        with open(root / fmt / "config.json") as f:
            cfg = json.load(f)
        assert cfg == cfgs[fmt]
        assert set(cfg) == set(gcfg) and set(cfg["text_config"]) == set(gcfg["text_config"])
        assert set(cfg["vision_config"]) == set(gcfg["vision_config"])
        assert ("quantization_config" in cfg) == (fmt == "fp8")
        if fmt == "fp8":
            assert cfg["quantization_config"] == gcfg["quantization_config"]


def test_tokenizer_and_derived_engram_keys(ckpts):
    root, cfgs = ckpts
    cfg = cfgs["fp8"]
    t = cfg["text_config"]
    tok = Tokenizer.from_file(str(root / "fp8" / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == t["vocab_size"]
    assert tok.token_to_id(tiny.IMAGE_PLACEHOLDER) == cfg["image_token_id"]
    assert [tok.token_to_id(s) for s in (tiny.BOS, tiny.EOS, tiny.PAD)] == [cfg["bos_token_id"], cfg["eos_token_id"],
                                                                             cfg["pad_token_id"]]
    tm = build_compressed_token_map(tok, t["vocab_size"])
    assert compressed_vocab_size(tm) == t["engram_compressed_vocab_size"]
    assert t["engram_num_embeddings"] == engram_num_embeddings(t) == [272, 348]
    lay = EngramLayout.from_config(t, tm)  # consistency check passes
    ids = np.arange(t["vocab_size"])[None]
    h = lay.hashes(ids)
    for i, rows in enumerate(lay.num_embeddings):
        assert 0 <= h[:, :, i].min() and h[:, :, i].max() < rows


def test_fp8_round_trips_to_bf16(ckpts):
    root, cfgs = ckpts
    q = _raw(str(root / "fp8" / "model.safetensors"))
    b = _raw(str(root / "bf16" / "model.safetensors"))
    seen = {"fp8": 0, "fp4": 0, "table": 0, "plain": 0}
    for name, (dt, val) in b.items():
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if base + ".scale" in q:
            w, s = q[base + ".weight"][1], q[base + ".scale"][1]
            if ".experts." in name:
                deq, kind = Q.dequant_fp4_experts(w, s), "fp4"
            elif ".engram.embed" in name:
                deq, kind = Q.dequant_engram_rows(w, s), "table"
            else:
                deq, kind = Q.dequant_fp8_blocks(w, s, 32), "fp8"
            assert dt == "torch.bfloat16"
            np.testing.assert_array_equal(deq, val)  # the bf16 file is the exact dequantization
            assert np.array_equal(deq.astype(BF16).astype(np.float32), deq)
            assert 0.02 < deq.std() < 0.1 and np.abs(deq).max() < 1.0, name
        else:
            kind = "plain"
            assert q[name][0] == dt
            np.testing.assert_array_equal(q[name][1], val)
        seen[kind] += 1
    assert seen == {"fp8": 7 * 8 + 3 + 2, "fp4": 7 * 6 * 3, "table": 2, "plain": seen["plain"]}


def test_quantized_tensors_follow_the_release_encoder(ckpts):
    root, _ = ckpts
    q = _raw(str(root / "fp8" / "model.safetensors"))
    for name, (dt, s) in q.items():
        if not name.endswith(".scale"):
            continue
        w = q[name[: -len(".scale")] + ".weight"][1]
        if ".experts." in name:
            v = np.abs(Q.unpack_fp4(w)).reshape(w.shape[0], -1, 32).max(-1)
            assert np.all((v >= 3) & (v <= 6)), name
        else:
            bi = 32
            bo = 1 if ".engram.embed" in name else 32
            a = np.abs(w.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
            ro, ri = s.shape
            pad = np.zeros((ro * bo, ri * bi), np.float32)
            pad[: a.shape[0], : a.shape[1]] = a
            m = pad.reshape(ro, bo, ri, bi).max(axis=(1, 3))
            assert np.all((m >= 224) & (m <= 448)), name


def test_vision_false_and_overrides(tmp_path):
    cfg = tiny.write_tiny_checkpoint(str(tmp_path / "a"), fmt="fp8", seed=1, vision=False, config={
        "image_token_id": 299,
        "text_config": {"vocab_size": 300, "engram_vocab_size": 101, "engram_layer_ids": [0, 2, 5]}})
    hdr = _header(str(tmp_path / "a" / "model.safetensors"))
    assert "vision_config" not in cfg
    assert not any(k.startswith(("vision.", "aligner.", "image_")) or k.endswith("bias_vl") for k in hdr)
    t = cfg["text_config"]
    assert hdr == tiny.tensor_inventory(cfg)
    assert hdr["embed.weight"] == ("BF16", (300, 64))
    assert t["engram_num_embeddings"] == engram_num_embeddings(t) and len(t["engram_num_embeddings"]) == 3
    for l, rows in zip((0, 2, 5), t["engram_num_embeddings"]):
        assert hdr[f"layers.{l}.engram.embed.weight"] == ("F8_E4M3", (rows, 32))
        assert hdr[f"layers.{l}.engram.embed.scale"] == ("F8_E8M0", (rows, 1))
    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert tok.token_to_id(tiny.IMAGE_PLACEHOLDER) == 299
    EngramLayout.from_config(t, build_compressed_token_map(tok, 300))


def test_deterministic(tmp_path):
    for d, seed in (("a", 5), ("b", 5), ("c", 6)):
        tiny.write_tiny_checkpoint(str(tmp_path / d), fmt="fp8", seed=seed, vision=False)
    data = {d: (tmp_path / d / "model.safetensors").read_bytes() for d in "abc"}
    assert data["a"] == data["b"] != data["c"]
    with pytest.raises(ValueError):
        tiny.write_tiny_checkpoint(str(tmp_path / "x"), fmt="int4")
