"""The whole DeepSeek-V4.1 model: embeddings (+ image spans) -> hc expansion -> blocks ->
collapse with the last FFN pre-mix -> final norm -> fp32 logits."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsv41_jax.cache import init_cache
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.decoder import Block
from dsv41_jax.model.layers import RMSNorm, matmul, set_fp8_storage
from dsv41_jax.numerics import Numerics

F32 = jnp.float32


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype))

    def __call__(self, ids, dtype):
        return jnp.take(self.weight[...], ids, axis=0).astype(dtype)


class Head(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype))

    def __call__(self, x):
        return matmul(x, self.weight[...], F32, compute_dtype=F32)


class DeepseekV41(nnx.Module):
    def __init__(self, config: ModelConfig, numerics: Numerics, *, engram_quantized: bool = False,
                 text_only: bool = False, experts_int8: bool = False, dense_fp8=()):
        """``dense_fp8``: names (dot-joined NNX paths, e.g. ``layers.3.attn.wq_a``) of the Linear
        modules that hold fp8 codes + ue8m0 scales instead of dequantized weights."""
        self.config = config
        self.numerics = numerics
        t = config.text
        dt = numerics.dtype
        vision = config.vision is not None
        self.embed = Embedding(t.vocab_size, t.hidden_size, dt)
        self.layers = nnx.List([Block(t, p, numerics, vision=vision, engram_quantized=engram_quantized,
                                      experts_int8=experts_int8)
                                for p in t.layers])
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=dt)
        if t.engram_layer_ids:
            from dsv41_jax.engram_hash import EngramHasher

            self.engram_hasher = EngramHasher(t)
        else:
            self.engram_hasher = None
        self.head = Head(t.vocab_size, t.hidden_size, dt)
        if vision and not text_only:
            from dsv41_jax.model.vision import build_vision_modules

            self.vision, self.aligner = build_vision_modules(config, numerics)
            self.image_start = nnx.Param(jnp.zeros((t.hidden_size,), F32))
            self.image_newline = nnx.Param(jnp.zeros((t.hidden_size,), F32))
            self.image_end = nnx.Param(jnp.zeros((t.hidden_size,), F32))
        else:
            self.vision = self.aligner = None
            self.image_start = self.image_newline = self.image_end = None
        if dense_fp8:
            set_fp8_storage(self, dense_fp8)

    # ------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int):
        return init_cache(self.config.text, batch, max_len, self.numerics.dtype)

    def run_layers(self, h, pos, valid, cache, *, image_mask=None, engram_hashes=None, engram_mask=None,
                   capture=None, teacher=None):
        """h [B,S,n,D] expanded stream. Returns ((stream [B,S,n,D], pre-mix [B,S,n]), new cache): the
        stream leaving the last layer and its collapse weights (``stream_logits`` forms the logits).

        ``engram_hashes`` [B,S,n_engram_layers,cols]; ``teacher``: optional {l: (block_in, pre_in)}
        replacing the stream entering layer l (teacher-forced checks)."""
        t = self.config.text
        B, S = pos.shape
        pre = jnp.zeros((B, S, t.hc_mult), F32).at[..., 0].set(1.0)
        ctx = {}
        new_layers = []
        for l, layer in enumerate(self.layers):
            if teacher is not None and l in teacher:
                h, pre = teacher[l]
                h = jnp.asarray(h).astype(self.numerics.dtype)
                pre = jnp.asarray(pre, F32)
            cap = None
            if capture is not None:
                capture[f"block_in_L{l}"] = h
                capture[f"pre_mix_in_L{l}"] = pre
                cap = {}
            eh = None
            if layer.engram is not None:
                eh = engram_hashes[:, :, layer.plan.engram_slot]
            h, pre, lc, ctx = layer(h, pre, pos, valid, cache["layers"][l], ctx, image_mask=image_mask,
                                    engram_hashes=eh, engram_mask=engram_mask, capture=cap)
            new_layers.append(lc)
            if capture is not None:
                for k, v in cap.items():
                    capture[f"{k}_L{l}"] = v
                capture[f"block_out_L{l}"] = h
                capture[f"pre_mix_out_L{l}"] = pre
        cache = dict(cache, layers=new_layers)
        return (h, pre), cache

    def logits(self, y):
        return self.head(self.norm(y))

    def stream_logits(self, h, pre):
        """Logits of the last layer's stream ``h [B, S, n, D]`` collapsed with ``pre [B, S, n]``:
        ``logits(hc_pre(h, pre))``, the collapse and norm in one kernel on the decode kernel path
        (``RMSNorm.with_quant``)."""
        return self.head(self.norm.with_quant(h, False, mix=pre)[0])

    def expand(self, emb):
        n = self.config.text.hc_mult
        return jnp.broadcast_to(emb[:, :, None, :], (*emb.shape[:2], n, emb.shape[-1]))

    def __call__(self, input_ids, *, inputs_embeds=None, positions=None, valid=None, cache=None,
                 image_mask=None, engram_hashes=None, capture=None, teacher=None, logits_at=None):
        """Prefill/forward over a chunk. Returns (logits [B,S,V] fp32, cache).

        ``logits_at`` [B] int32: compute the head only at that chunk column per row (logits
        [B,1,V]): a long prefill then never materialises [B,S,V]."""
        B, S = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        if valid is None:
            valid = jnp.ones((B, S), bool)
        if cache is None:
            cache = self.init_cache(B, S)
        emb = self.embed(input_ids, self.numerics.dtype) if inputs_embeds is None else inputs_embeds.astype(self.numerics.dtype)
        engram_mask = valid if image_mask is None else (valid & ~image_mask)
        if engram_hashes is None and self.engram_hasher is not None:
            engram_hashes, hist = self.engram_hasher(input_ids, dead=image_mask, hist=cache["engram_hist"], valid=valid)
            cache = dict(cache, engram_hist=hist)
        (h, pre), cache = self.run_layers(self.expand(emb), positions, valid, cache, image_mask=image_mask,
                                          engram_hashes=engram_hashes, engram_mask=engram_mask, capture=capture,
                                          teacher=teacher)
        if logits_at is not None:
            col = jnp.clip(logits_at, 0, S - 1)[:, None]
            h = jnp.take_along_axis(h, col[:, :, None, None], axis=1)
            pre = jnp.take_along_axis(pre, col[:, :, None], axis=1)
        return self.stream_logits(h, pre), cache
