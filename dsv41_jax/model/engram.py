"""Engram: hashed n-gram memory injected into the hc stream before the block of an engram layer.

The table stays in its stored form (fp8 e4m3 + ue8m0 scale per 32 columns, or plain bf16/fp32)
and only the looked-up rows are dequantized.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import TextConfig
from dsv41_jax.model.layers import Linear
from dsv41_jax.numerics import Numerics

F32 = jnp.float32


# Host-resident tables: key -> (weight, scale or None) numpy arrays. Kept out of the module
# (a static attribute holding a 100 GB array would be hashed with the graph definition).
_HOST_TABLES: dict[int, tuple] = {}


def _host_rows(key: int, ids):
    w, sc = _HOST_TABLES[int(key)]
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError(f"engram: table row {int(ids.max())} out of range for a table of {w.shape[0]} rows")
    rows = w[ids]
    return (rows, sc[ids]) if sc is not None else (rows, np.zeros(ids.shape + (1,), np.uint8))


class EngramEmbed(nnx.Module):
    """The n-gram table. On the device by default (row-sharded under a mesh); after
    :func:`offload_engram_tables` it lives in host memory and each step fetches only the
    looked-up rows through a host callback."""

    def __init__(self, rows: int, dim: int, dtype, quantized: bool):
        self.rows, self.dim = rows, dim
        self.host_key = -1
        self.weight = nnx.Param(jnp.zeros((rows, dim), dtype))
        self.scale = nnx.Param(jnp.zeros((rows, dim // 32), jnp.uint8)) if quantized else None

    def _gather(self, ids):
        if self.host_key < 0:
            rows = jnp.take(self.weight[...], ids, axis=0)
            sc = None if self.scale is None else jnp.take(self.scale[...], ids, axis=0)
            return rows, sc
        w, sc = _HOST_TABLES[self.host_key]
        shapes = (jax.ShapeDtypeStruct(ids.shape + (self.dim,), w.dtype),
                  jax.ShapeDtypeStruct(ids.shape + ((self.dim // 32) if sc is not None else 1,), jnp.uint8))
        rows, scs = jax.pure_callback(functools.partial(_host_rows, self.host_key), shapes, ids,
                                      vmap_method="sequential")
        return rows, (scs if sc is not None else None)

    def lookup(self, ids, out_dtype):
        rows, sc = self._gather(ids)
        if sc is None:
            return rows.astype(out_dtype)
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


_KEYS = itertools.count()


def offload_engram_tables(model) -> int:
    """Move every Engram table of ``model`` to host memory (numpy); lookups then fetch the needed
    rows per step. Returns the bytes moved off the device. The device keeps a 1-row placeholder."""
    moved = 0
    for layer in model.layers:
        eng = getattr(layer, "engram", None)
        if eng is None or eng.embed.host_key >= 0:
            continue
        emb = eng.embed
        w = np.asarray(jax.device_get(emb.weight[...]))
        sc = None if emb.scale is None else np.asarray(jax.device_get(emb.scale[...]))
        key = next(_KEYS)
        _HOST_TABLES[key] = (w, sc)
        moved += w.nbytes + (0 if sc is None else sc.nbytes)
        emb.host_key = key
        emb.weight = nnx.Param(jnp.zeros((1, emb.dim), w.dtype))
        if sc is not None:
            emb.scale = nnx.Param(jnp.zeros((1, emb.dim // 32), jnp.uint8))
    return moved
