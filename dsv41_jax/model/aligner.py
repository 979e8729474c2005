"""Aligner: 3x3 merge of the ViT grid (channel-major, zero padded bottom/right) and a GELU MLP.

Checkpoint names: ``aligner.w1.{weight,bias}`` [D, C*r*r], ``aligner.w2.{weight,bias}`` [D, D].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import VisionConfig
from dsv41_jax.model.layers import F32, Linear
from dsv41_jax.numerics import Numerics


def merge_index(vit_grid: tuple[int, int], ratio: int, zero_row: int) -> np.ndarray:
    """Source patch of every (output row, window cell): [rows * cols, r * r] int32.

    Output row ``bi * cols + bj`` (reading order) reads the window cell ``ki * r + kj`` from
    patch ``(r*bi + ki) * n_w + (r*bj + kj)``; cells that fall in the bottom/right zero padding
    read ``zero_row`` (an all-zero row appended after the ViT output).
    """
    n_h, n_w = vit_grid
    rows, cols = -(-n_h // ratio), -(-n_w // ratio)
    gy = np.arange(rows)[:, None, None, None] * ratio + np.arange(ratio)[None, None, :, None]
    gx = np.arange(cols)[None, :, None, None] * ratio + np.arange(ratio)[None, None, None, :]
    gy, gx = np.broadcast_arrays(gy, gx)  # [rows, cols, r, r]
    idx = np.where((gy < n_h) & (gx < n_w), gy * n_w + gx, zero_row)
    return idx.reshape(rows * cols, ratio * ratio).astype(np.int32)


def merge_windows(x, index):
    """x [B, N, C], index [B, R, r*r] (values <= N; N = the zero row) -> [B, R, C*r*r].

    Channel-major flatten (torch ``F.unfold`` order): ``m[c * r*r + k] = x[index[k], c]``.
    """
    b, _, c = x.shape
    x = jnp.concatenate([x, jnp.zeros((b, 1, c), x.dtype)], axis=1)
    _, r_out, k = index.shape
    g = jnp.take_along_axis(x, index.reshape(b, r_out * k, 1), axis=1).reshape(b, r_out, k, c)
    return jnp.swapaxes(g, -1, -2).reshape(b, r_out, c * k)


class Aligner(nnx.Module):
    """``w2 · gelu_erf(w1 · merge(x) + b1) + b2`` with each Linear rounded once to the compute dtype."""

    def __init__(self, cfg: VisionConfig, out_dim: int, *, numerics: Numerics):
        self.ratio = cfg.downsample_ratio
        self.numerics = numerics
        in_dim = cfg.hidden_size * self.ratio ** 2
        self.w1 = Linear(in_dim, out_dim, numerics=numerics, bias=True)
        self.w2 = Linear(out_dim, out_dim, numerics=numerics, bias=True)

    def __call__(self, x, index):
        """x: ViT output [B, N, C] (compute dtype); index: [B, R, r*r] from ``merge_index``."""
        cd = self.numerics.dtype
        m = merge_windows(x.astype(cd), index)
        h = self.w1(m, out_dtype=F32, compute_dtype=cd).astype(cd)
        h = jax.nn.gelu(h.astype(F32), approximate=False).astype(cd)
        return self.w2(h, out_dtype=F32, compute_dtype=cd).astype(cd)
