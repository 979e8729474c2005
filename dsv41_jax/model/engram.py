"""Engram: hashed n-gram memory injected into the hc stream before the block of an engram layer.

The table stays in its stored form (fp8 e4m3 + ue8m0 scale per 32 columns, or plain bf16/fp32)
and only the looked-up rows are dequantized.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import TextConfig
from dsv41_jax.model.layers import Linear
from dsv41_jax.numerics import Numerics

F32 = jnp.float32


class EngramEmbed(nnx.Module):
    def __init__(self, rows: int, dim: int, dtype, quantized: bool):
        self.weight = nnx.Param(jnp.zeros((rows, dim), dtype))
        self.scale = nnx.Param(jnp.zeros((rows, dim // 32), jnp.uint8)) if quantized else None

    def lookup(self, ids, out_dtype):
        w = self.weight[...]
        rows = jnp.take(w, ids, axis=0)
        if self.scale is None:
            return rows.astype(out_dtype)
        sc = jnp.take(self.scale[...], ids, axis=0)
        mult = jax.lax.bitcast_convert_type(sc.astype(jnp.uint32) << 23, F32)
        mult = jnp.where(sc == 0, jnp.float32(2.0 ** -127), mult)
        v = rows.astype(F32).reshape(*rows.shape[:-1], -1, 32) * mult[..., None]
        return v.reshape(rows.shape).astype(out_dtype)


class Engram(nnx.Module):
    def __init__(self, cfg: TextConfig, rows: int, numerics: Numerics, quantized_table: bool = False):
        n, D = cfg.hc_mult, cfg.hidden_size
        self.n, self.D = n, D
        self.eps = cfg.rms_norm_eps
        self.numerics = numerics
        tdt = jnp.float8_e4m3fn if quantized_table else numerics.dtype
        self.embed = EngramEmbed(rows, cfg.engram_head_dim, tdt, quantized_table)
        self.wkv = Linear(cfg.engram_cols * cfg.engram_head_dim, D * (n + 1), numerics=numerics)
        self.q_weight = nnx.Param(jnp.ones((n, D), numerics.dtype))
        self.k_weight = nnx.Param(jnp.ones((n, D), numerics.dtype))

    def __call__(self, h, hashes, mask=None):
        """h [B,S,n,D]; hashes [B,S,cols] table row ids; mask [B,S] True where the gate may open."""
        dt = self.numerics.dtype
        rows = self.embed.lookup(hashes, dt)
        kv = self.wkv(rows.reshape(*rows.shape[:-2], -1))
        n, D = self.n, self.D
        key = kv[..., :n * D].reshape(*kv.shape[:-1], n, D).astype(F32)
        val = kv[..., n * D:].astype(F32)
        w = self.q_weight[...].astype(F32) * self.k_weight[...].astype(F32)
        x = h.astype(F32)
        rstd = jax.lax.rsqrt(jnp.mean(x * x, -1) + self.eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + self.eps)
        dot = jnp.sum(x * w * key, -1) * rstd * (D ** -0.5)
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
        if mask is not None:
            gate = jnp.where(mask[..., None], gate, 0.0)
        return (x + gate[..., None] * val[..., None, :]).astype(h.dtype)
