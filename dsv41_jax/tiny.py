"""Tiny random DeepSeek-V4.1 checkpoints in the ORIGINAL on-disk format, for tests.

``write_tiny_checkpoint(out_dir)`` writes ``config.json`` (composite HF form), ``model.safetensors``
(original DeepSeek tensor names; fp8 flavour: F8_E4M3 + F8_E8M0 32x32 tiles, fp4 experts packed in
I8, fp8 Engram tables with per-32 scales; bf16 flavour: the exact dequantization of the same draw)
and ``tokenizer.json`` (a ``tokenizers`` WordLevel model). The tensor inventory is derived from the
config (``tensor_inventory``), and the derived config keys (``engram_num_embeddings``,
``engram_compressed_vocab_size``) are computed exactly as the official code computes them.
"""
from __future__ import annotations

import copy
import json
import os
import struct
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from dsv41_jax import quant
from dsv41_jax.engram_layout import build_compressed_token_map, compressed_vocab_size, engram_num_embeddings

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"

FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

# The golden ``image_fp8`` family (dim 64, 7 layers, released layer schedule scaled down).
# ``engram_num_embeddings`` / ``engram_compressed_vocab_size`` are recomputed on write.
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "transformers_version": "5.6.0",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 250,
    "quantization_config": FP8_QUANT_CONFIG,
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 16},
        "n_routed_experts": 6,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 1],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 5],
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 6,
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": [0, 1],
        "engram_num_embeddings": [272, 348],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 61,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 89,
        "num_nextn_predict_layers": 0,
        "dspark_block_size": 0,
        "dspark_noise_token_id": 0,
        "dspark_target_layer_ids": [],
        "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 0,
        "dspark_num_experts_per_tok": 0,
    },
    "vision_config": {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 64,
        "min_pixels": 7056,
        "max_wh_ratio": None,
    },
}

# ----------------------------------------------------------------------------------------------
# safetensors writer (raw bytes; F8_E8M0 included)
# ----------------------------------------------------------------------------------------------

_ST_NAMES = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2", np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None):
    """Write ``tensors`` (dtype -> safetensors dtype by ``_ST_NAMES``; use a float8_e8m0fnu view for
    E8M0 scales) as one little-endian safetensors file, tensors in name order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, off = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = _ST_NAMES.get(a.dtype)
        if dt is None:
            raise TypeError(f"write_safetensors: tensor {name} has unsupported dtype {a.dtype}")
        raw = a.tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------

# Words that exercise every step of the compressed-token-map normalization.
_SPECIAL_WORDS = [
    " ", "  ", "\n", "\t", " \n", "\r\n", "a", "A", " a", "Ａ", "é", "e", "É", " é", "x\u0301", "ﬁ", "fi",
    "Hello", "hello", " hello", "HELLO", "héllo", "Straße", "strasse", "\u0301", "\ufffd", "\ufffd\ufffd",
    "a\ufffd", "½", "1/2", "Ⅸ", "ix", "  padded  ", "padded", "x y", "x  y", "²", "2",
]


def _tiny_words(n: int) -> list[str]:
    words = list(_SPECIAL_WORDS[:n])
    i = 1
    while len(words) < n:
        for w in (f"t{i}", f"T{i}", f" t{i}"):
            if len(words) < n:
                words.append(w)
        i += 1
    return words


def build_tiny_tokenizer(vocab_size: int = 256, *, bos_id: int = 0, eos_id: int = 1, pad_id: int = 2,
                         image_token_id: int = 250):
    """A ``tokenizers`` WordLevel tokenizer with exactly ``vocab_size`` ids: BOS/EOS/PAD and
    ``<｜deepseek_image｜>`` as special tokens at the given ids, words everywhere else."""
    from tokenizers import AddedToken, Tokenizer, models

    specials = {bos_id: BOS, eos_id: EOS, pad_id: PAD, image_token_id: IMAGE_PLACEHOLDER}
    if len(specials) != 4 or max(specials) >= vocab_size or min(specials) < 0:
        raise ValueError(f"special ids {sorted(specials)} must be distinct and inside vocab_size={vocab_size}")
    words = iter(_tiny_words(vocab_size - len(specials)))
    vocab = {specials[i] if i in specials else next(words): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


# ----------------------------------------------------------------------------------------------
# config and inventory
# ----------------------------------------------------------------------------------------------

def _merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def tiny_config(*, fmt: str = "fp8", config: Mapping | None = None, vision: bool = True,
                tokenizer=None) -> dict:
    """The composite config written by ``write_tiny_checkpoint``: ``DEFAULT_CONFIG`` deep-merged with
    ``config``; ``quantization_config`` only for fp8; no ``vision_config`` when ``vision`` is False;
    engram row counts and compressed vocab derived (from ``tokenizer``, default the tiny one)."""
    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt must be 'fp8' or 'bf16', got {fmt!r}")
    cfg = _merge(DEFAULT_CONFIG, config or {})
    if fmt == "bf16":
        cfg.pop("quantization_config", None)
    elif "quantization_config" not in cfg:
        cfg["quantization_config"] = copy.deepcopy(FP8_QUANT_CONFIG)
    if not vision:
        cfg.pop("vision_config", None)
    t = cfg["text_config"]
    if tokenizer is None:
        tokenizer = build_tiny_tokenizer(t["vocab_size"], bos_id=cfg["bos_token_id"], eos_id=cfg["eos_token_id"],
                                         pad_id=cfg["pad_token_id"], image_token_id=cfg["image_token_id"])
    if t.get("engram_layer_ids"):
        t["engram_num_embeddings"] = engram_num_embeddings(t)
        t["engram_compressed_vocab_size"] = compressed_vocab_size(
            build_compressed_token_map(tokenizer, t["vocab_size"]))
    return cfg


def _param_specs(cfg: Mapping) -> list[tuple[str, str, tuple[int, ...], str]]:
    """Logical tensors ``(name, kind, [out, in] or shape, init)`` in a fixed order.

    kind: ``linear`` (fp8 in the fp8 flavour), ``expert`` (fp4 or fp8 per expert_dtype), ``table``
    (Engram embedding: fp8 rows with per-32 scales), ``bf16``, ``f32``.
    init: ``normal`` N(0, .05), ``one`` 1+N(0, .1), ``sink`` N(0, .5), ``bias`` N(0, .1), ``base`` N(0, .5).
    """
    t = cfg["text_config"]
    D, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    H, hd, qr = t["num_attention_heads"], t["head_dim"], t["q_lora_rank"]
    G, R = t["o_groups"], t["o_lora_rank"]
    n = t["hc_mult"]
    mix = (2 + n) * n
    E, I, ns = t["n_routed_experts"], t["moe_intermediate_size"], t.get("n_shared_experts", 1)
    ih, ihd = t["index_n_heads"], t["index_head_dim"]
    ratios = list(t["compress_ratios"])
    from dsv41_jax.config import parse_text_config

    plans = parse_text_config(t).layers  # the topology with config.py's fallbacks
    kv_src = {p.index for p in plans if p.owns_compressor}
    idx_src = {p.index for p in plans if p.owns_indexer}
    eng = list(t.get("engram_layer_ids") or [])
    vl = cfg.get("vision_config") is not None and cfg["vision_config"].get("num_hidden_layers", 0) > 0

    specs = [("embed.weight", "bf16", (V, D), "normal")]
    for l in range(L):
        p = f"layers.{l}."
        specs += [(p + "attn_norm.weight", "bf16", (D,), "one"), (p + "ffn_norm.weight", "bf16", (D,), "one")]
        for site in ("attn", "ffn"):
            specs += [(p + f"hc_{site}_fn", "f32", (mix, n * D), "normal"),
                      (p + f"hc_{site}_base", "f32", (mix,), "base"),
                      (p + f"hc_{site}_scale", "f32", (3,), "one")]
        a = p + "attn."
        specs += [(a + "wq_a", "linear", (qr, D), "normal"), (a + "q_norm.weight", "bf16", (qr,), "one"),
                  (a + "wq_b", "linear", (H * hd, qr), "normal"), (a + "wkv", "linear", (hd, D), "normal"),
                  (a + "kv_norm.weight", "bf16", (hd,), "one"),
                  (a + "wo_a", "linear", (G * R, H * hd // G), "normal"),
                  (a + "wo_b", "linear", (D, G * R), "normal"), (a + "attn_sink", "f32", (H,), "sink")]
        if l in kv_src:
            specs.append((a + "compressor.wkv.weight", "bf16", (hd, D), "normal"))
            if ratios[l] > 1:
                specs.append((a + "compressor.wgate.weight", "bf16", (hd, D), "normal"))
            specs += [(a + "compressor.norm.weight", "bf16", (hd,), "one"),
                      (a + "indexer.wk.weight", "bf16", (ihd, hd), "normal"),
                      (a + "indexer.k_norm.weight", "bf16", (ihd,), "one")]
        if l in idx_src:
            specs += [(a + "indexer.wq_b", "linear", (ih * ihd, qr), "normal"),
                      (a + "indexer.weights_proj.weight", "bf16", (ih, D), "normal")]
        f = p + "ffn."
        specs += [(f + "gate.weight", "bf16", (E, D), "normal"), (f + "gate.bias", "f32", (E,), "bias")]
        if vl:
            specs.append((f + "gate.bias_vl", "f32", (E,), "bias"))
        for e in range(E):
            specs += [(f + f"experts.{e}.w1", "expert", (I, D), "normal"),
                      (f + f"experts.{e}.w2", "expert", (D, I), "normal"),
                      (f + f"experts.{e}.w3", "expert", (I, D), "normal")]
        specs += [(f + "shared_experts.w1", "linear", (I * ns, D), "normal"),
                  (f + "shared_experts.w2", "linear", (D, I * ns), "normal"),
                  (f + "shared_experts.w3", "linear", (I * ns, D), "normal")]
        if l in eng:
            rows = t["engram_num_embeddings"][eng.index(l)]
            ehd = t["engram_head_dim"]
            cols = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
            g = p + "engram."
            specs += [(g + "embed", "table", (rows, ehd), "normal"),
                      (g + "wkv", "linear", (D * (n + 1), cols * ehd), "normal"),
                      (g + "q_weight", "bf16", (n, D), "one"), (g + "k_weight", "bf16", (n, D), "one")]
    specs += [("norm.weight", "bf16", (D,), "one"), ("head.weight", "bf16", (V, D), "normal")]
    if vl:
        v = cfg["vision_config"]
        vd, vi, ps, ds = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["downsample_ratio"]
        specs += [("vision.patch_embed.proj.weight", "bf16", (vd, 3 * ps * ps), "normal"),
                  ("vision.patch_embed.proj.bias", "bf16", (vd,), "normal")]
        for j in range(v["num_hidden_layers"]):
            b = f"vision.blocks.{j}."
            specs += [(b + "norm1.weight", "f32", (vd,), "one"), (b + "norm2.weight", "f32", (vd,), "one"),
                      (b + "attn.wqkv.weight", "bf16", (3 * vd, vd), "normal"),
                      (b + "attn.wqkv.bias", "bf16", (3 * vd,), "normal"),
                      (b + "attn.wo.weight", "bf16", (vd, vd), "normal"),
                      (b + "attn.wo.bias", "bf16", (vd,), "normal"),
                      (b + "mlp.w1.weight", "bf16", (2 * vi, vd), "normal"),
                      (b + "mlp.w2.weight", "bf16", (vd, vi), "normal")]
        specs += [("vision.norm.weight", "f32", (vd,), "one"),
                  ("aligner.w1.weight", "bf16", (D, vd * ds * ds), "normal"), ("aligner.w1.bias", "bf16", (D,), "normal"),
                  ("aligner.w2.weight", "bf16", (D, D), "normal"), ("aligner.w2.bias", "bf16", (D,), "normal"),
                  ("image_start", "bf16", (D,), "normal"), ("image_end", "bf16", (D,), "normal"),
                  ("image_newline", "bf16", (D,), "normal")]
    return specs


def _quant_setup(cfg: Mapping) -> tuple[bool, tuple[int, int], str]:
    qc = cfg.get("quantization_config")
    if not qc:
        return False, (32, 32), "fp4"
    bo, bi = qc.get("weight_block_size", [32, 32])
    return True, (int(bo), int(bi)), qc.get("expert_dtype", "fp4") or "fp8"


def tensor_inventory(cfg: Mapping) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every on-disk tensor of a checkpoint with composite config ``cfg``: name -> (dtype, shape).

    fp8 flavour (``quantization_config`` present): linears F8_E4M3 + F8_E8M0 ``[ceil(o/B), ceil(i/B)]``;
    fp4 experts I8 ``[o, i/2]`` + F8_E8M0 ``[o, i/32]``; Engram tables F8_E4M3 + F8_E8M0 ``[rows, hd/32]``.
    bf16 flavour: all of those BF16 at their logical shape. Other tensors BF16 or F32.
    """
    fp8, (bo, bi), expert_dtype = _quant_setup(cfg)
    inv: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, kind, shape, _ in _param_specs(cfg):
        if kind in ("bf16", "f32"):
            inv[name] = ("BF16" if kind == "bf16" else "F32", shape)
        elif not fp8:
            inv[name + ".weight"] = ("BF16", shape)
        elif kind == "expert" and expert_dtype == "fp4":
            inv[name + ".weight"] = ("I8", (shape[0], shape[1] // 2))
            inv[name + ".scale"] = ("F8_E8M0", (shape[0], shape[1] // 32))
        elif kind == "table":
            inv[name + ".weight"] = ("F8_E4M3", shape)
            inv[name + ".scale"] = ("F8_E8M0", (shape[0], shape[1] // bi))
        else:
            inv[name + ".weight"] = ("F8_E4M3", shape)
            inv[name + ".scale"] = ("F8_E8M0", (-(-shape[0] // bo), -(-shape[1] // bi)))
    return inv


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------

def _draw(rng: np.random.Generator, shape, init: str) -> np.ndarray:
    if init == "normal":
        return rng.normal(0.0, 0.05, shape).astype(np.float32)
    if init == "one":
        return (1.0 + rng.normal(0.0, 0.1, shape)).astype(np.float32)
    if init in ("sink", "base"):
        return rng.normal(0.0, 0.5, shape).astype(np.float32)
    if init == "bias":
        return rng.normal(0.0, 0.1, shape).astype(np.float32)
    raise ValueError(init)


def tiny_weights(cfg: Mapping, seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors of ``tensor_inventory(cfg)``, drawn in the release format and, for a bf16
    config, stored as their exact dequantization (the same draw for a given seed and shapes)."""
    fp8, blk, expert_dtype = _quant_setup(cfg)
    rng = np.random.default_rng(seed)
    e8m0 = ml_dtypes.float8_e8m0fnu
    out: dict[str, np.ndarray] = {}
    for name, kind, shape, init in _param_specs(cfg):
        w = _draw(rng, shape, init)
        if kind == "f32":
            out[name] = w
            continue
        if kind == "bf16":
            out[name] = w.astype(ml_dtypes.bfloat16)
            continue
        if kind == "expert" and expert_dtype == "fp4":
            q, s = quant.quantize_fp4_blocks(w, 32)
            deq = quant.dequant_fp4_experts(q, s)
        else:
            b = (1, blk[1]) if kind == "table" else blk
            q, s = quant.quantize_fp8_blocks(w, b)
            deq = quant.dequant_fp8_blocks(q, s, b)
        if fp8:
            out[name + ".weight"], out[name + ".scale"] = q, s.view(e8m0)
        else:
            out[name + ".weight"] = deq.astype(ml_dtypes.bfloat16)
    return out


def write_tiny_checkpoint(out_dir: str, *, fmt: str = "fp8", seed: int = 0, config: Mapping | None = None,
                          vision: bool = True) -> dict:
    """Write a tiny random V4.1 checkpoint (config.json, model.safetensors, tokenizer.json) into
    ``out_dir`` and return the composite config written.

    ``fmt``: ``"fp8"`` (release format) or ``"bf16"`` (the exact dequantization of the same draw).
    ``config``: overrides deep-merged onto ``DEFAULT_CONFIG`` (e.g. ``{"text_config": {...}}``);
    ``engram_num_embeddings`` and ``engram_compressed_vocab_size`` are always derived.
    ``vision``: False drops ``vision_config`` and every ``vision.*``/``aligner.*``/``image_*`` tensor
    and ``ffn.gate.bias_vl``.
    """
    base = _merge(DEFAULT_CONFIG, config or {})
    tok = build_tiny_tokenizer(base["text_config"]["vocab_size"], bos_id=base["bos_token_id"],
                               eos_id=base["eos_token_id"], pad_id=base["pad_token_id"],
                               image_token_id=base["image_token_id"])
    cfg = tiny_config(fmt=fmt, config=config, vision=vision, tokenizer=tok)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tiny_weights(cfg, seed))
    return cfg
