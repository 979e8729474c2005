"""Decode state: a fixed-capacity pytree for the whole model, donated between steps.

Per layer: the window ring (``win_kv`` [B, W, head_dim] post-RoPE, fake-quantized in reference
numerics, ``win_pos`` [B, W] absolute position per slot, -1 empty). kv-source layers add the
compressed KV and index keys (``cmp_kv`` [B, max_len/ratio, head_dim], ``idx_k`` [B,
max_len/ratio, index_head_dim]) and, for ratio 2, the partial group (``st_kv``/``st_score``
[B, ratio, head_dim] fp32, scores -inf when empty). Engram history: the
compressed ids of the last ``max_ngram-1`` valid positions per sequence (-1 = DEAD). ``length`` [B]: tokens consumed.
"""
from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.config import TextConfig

F32 = jnp.float32


def init_layer_cache(cfg: TextConfig, plan, batch: int, max_len: int, dtype):
    W, d = cfg.sliding_window, cfg.head_dim
    c = {"win_kv": jnp.zeros((batch, W, d), dtype), "win_pos": jnp.full((batch, W), -1, jnp.int32)}
    if plan.owns_compressor:
        T = max(max_len // plan.ratio, 1)
        c["cmp_kv"] = jnp.zeros((batch, T, d), dtype)
        c["idx_k"] = jnp.zeros((batch, T, cfg.index_head_dim), dtype)
        if plan.ratio > 1:
            c["st_kv"] = jnp.zeros((batch, plan.ratio, d), F32)
            c["st_score"] = jnp.full((batch, plan.ratio, d), -jnp.inf, F32)
    return c


def init_cache(cfg: TextConfig, batch: int, max_len: int, dtype) -> dict:
    lb = max(cfg.engram_max_ngram_size - 1, 0)
    return {
        "layers": [init_layer_cache(cfg, p, batch, max_len, dtype) for p in cfg.layers],
        "length": jnp.zeros((batch,), jnp.int32),
        # engram look-back: compressed ids of the previous lb valid positions, oldest first, -1 = DEAD
        "engram_hist": jnp.full((batch, lb), -1, jnp.int32),
    }

