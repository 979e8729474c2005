"""Interleaved partial RoPE (adjacent pairs on the trailing ``rope_dim`` channels) with YaRN.

Ratio-0 layers use plain RoPE at ``rope_theta``; layers with a compress ratio use
``compress_rope_theta`` with the YaRN frequency ramp (no attention-scale correction).
Angles and rotations are computed in fp32 from absolute positions; the result is cast back to
the input dtype, as the reference's in-place rotation does.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv41_jax.config import RopeScaling, TextConfig


def inv_freq(rope_dim: int, base: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair frequencies (float32), YaRN-blended when ``scaling`` is given."""
    f = (1.0 / (np.float32(base) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)))).astype(np.float32)
    if scaling is not None and scaling.original_max_position_embeddings > 0:
        orig = scaling.original_max_position_embeddings

        def corr(rot):
            return rope_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr(scaling.beta_fast)), 0)
        hi = min(math.ceil(corr(scaling.beta_slow)), rope_dim - 1)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(lo)) / np.float32(max(hi - lo, 1e-3)), 0, 1)
        ramp = ramp.astype(np.float32)
        smooth = (np.float32(1) - ramp).astype(np.float32)
        f = (f / np.float32(scaling.factor) * (np.float32(1) - smooth) + f * smooth).astype(np.float32)
    return f


def layer_inv_freq(cfg: TextConfig, ratio: int) -> np.ndarray:
    if ratio > 0:
        return inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    return inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None)


def rope_tail(x, pos, freqs, inverse: bool = False, in_place: bool = False):
    """Rotate the last ``2*len(freqs)`` channels of ``x`` by position ``pos``.

    x: [..., S, (heads,) d] with ``pos`` broadcastable to x.shape[:-1] after dropping the head
    axis; pass ``pos`` already shaped to x.shape[:-1]. ``in_place``: the rotated tail goes back
    with a ``dynamic_update_slice`` (XLA may then write only the tail into ``x``'s buffer) instead
    of a concatenation (a copy of all of ``x``). Not for a one-token ``x`` that is a GEMM's output
    viewed with a size-1 axis and read by another dot: XLA:CPU (jax 0.10.2) then fuses the rotation
    and the update in place on the GEMM's buffer and reads each pair partner after overwriting it
    (``benchmarks/repro_xla_cpu_inplace_dus.py``); nor for one slice of a fused projection's output
    (the queries and window KV after ``fused_linears``; session 18).
    """
    r = 2 * freqs.shape[-1]
    ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    tail = x[..., -r:].astype(jnp.float32)
    a, b = tail[..., 0::2], tail[..., 1::2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    rot = jnp.stack([ra, rb], axis=-1).reshape(tail.shape).astype(x.dtype)
    if in_place:
        return lax.dynamic_update_slice_in_dim(x, rot, x.shape[-1] - r, axis=-1)
    return jnp.concatenate([x[..., :-r], rot], axis=-1)
