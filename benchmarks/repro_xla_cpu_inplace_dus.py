"""A minimal reproducer of the XLA:CPU miscompile behind the in-place RoPE failures (sessions 17-19).

A GEMM output viewed as ``[B, 1, H, d]`` (one token per row), its last 16 channels rotated
pairwise (RoPE) and written back with a ``dynamic_update_slice``, then consumed by another dot:
jitted on XLA:CPU (jax 0.10.2) the result is wrong (errors ~30 on O(10) values); eagerly, with a
concatenation instead, or with more than one token per row it is right.

What the optimized HLO shows (``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``): one loop
fusion computes the rotated tail and the ``dynamic-update-slice`` in place on the GEMM's output
buffer, and reads that same buffer through a layout-changing ``bitcast`` + ``copy`` (the size-1
axis) at the pair partner of each element it writes: element 2i is overwritten before element
2i + 1's rotation reads it. XLA's in-place check does not see through the copy. An
``optimization_barrier`` around the rotated tail does not help (it is expanded away before
fusion on CPU).

The model therefore rotates in place only where this pattern cannot arise: the attention output
(not a GEMM output) and a prefill chunk's queries (more than one token per row); one-token decode
steps keep the concatenation (``attention.rope_in_place``, ``rope.rope_tail``).

    python3 benchmarks/repro_xla_cpu_inplace_dus.py        # prints one row per case; exit 1 if the bug shows
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def rope(q, pos, freqs, in_place: bool):
    r = 2 * freqs.shape[0]
    ang = pos.astype(jnp.float32)[:, :, None, None] * freqs
    c, s = jnp.cos(ang), jnp.sin(ang)
    tail = q[..., -r:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(tail.shape)
    if in_place:
        return lax.dynamic_update_slice_in_dim(q, rot, q.shape[-1] - r, axis=-1)
    return jnp.concatenate([q[..., :-r], rot], axis=-1)


def model(x, w, k, pos, in_place: bool, tokens: int, consumer: bool):
    q = (x @ w.T).reshape(3, tokens, 4, 64)  # a GEMM output viewed per head
    q = rope(q, pos, jnp.asarray(10000.0 ** (-np.arange(8) / 8), jnp.float32), in_place)
    return jnp.einsum("bshd,bjd->bshj", q, k) if consumer else q


def main() -> int:
    rng = np.random.default_rng(0)
    bad = False
    for tokens in (1, 2, 16):
        for consumer in (True, False):
            x = jnp.asarray(rng.standard_normal((3 * tokens, 32)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
            k = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
            pos = jnp.asarray(rng.integers(0, 100, (3, tokens)), jnp.int32)
            want = model(x, w, k, pos, False, tokens, consumer)
            got = jax.jit(lambda *a, t=tokens, c=consumer: model(*a, True, t, c))(x, w, k, pos)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            bad |= err > 1e-4
            print(f"jax {jax.__version__} {jax.default_backend()}: tokens {tokens}, consumed by a dot {consumer}: "
                  f"relative error {err:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
