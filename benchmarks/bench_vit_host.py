"""Host time of one ``encode_images`` call (time until it returns, the GPU/CPU work not waited
for) for the full-width V4.1 vision tower, and the tower dispatched three ways: ``nnx.jit``
(what ``encode_images`` used before session 5), ``nnx.cached_partial`` and the split-once
runner ``vision._Tower`` that it uses now. Zero weights, one 6x6-patch image (the device work is
small; host time does not depend on the image size apart from packing)::

    python benchmarks/bench_vit_host.py          # CPU is enough: this measures the host
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dsv41_jax import processor  # noqa: E402
from dsv41_jax.config import preset  # noqa: E402
from dsv41_jax.model import vision as V  # noqa: E402
from dsv41_jax.numerics import Numerics  # noqa: E402


def host_ms(fn, reps=7):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    return float(np.median(ts)) * 1e3


def main():
    cfg = preset("v41-flash")
    num = Numerics("bfloat16", "reference", vision_attention="bf16")
    vit, al = nnx.eval_shape(lambda: V.build_vision_modules(cfg, num))
    graphdef, state = nnx.split((vit, al))
    vit, al = nnx.merge(graphdef, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state))
    v = vit.cfg
    grid, r, p = (6, 6), v.downsample_ratio, v.patch_size  # 36 patches: the device work stays small
    patches = np.random.default_rng(0).uniform(-1, 1, (grid[0] * grid[1], 3, p, p)).astype(jnp.bfloat16)
    llm = (-(-grid[0] // r), -(-grid[1] // r))
    px = (grid[1] * p, grid[0] * p)
    im = processor.ProcessedImage("host-bench", patches, grid, llm, processor.image_token_types(*llm), (0, 0), px, px)
    vecs = [jnp.zeros((cfg.text.hidden_size,), jnp.bfloat16)] * 3
    g = V.pack_images([im], v, bucket=V.tight_bucket)[0]
    dev = [jnp.asarray(a) for a in (g.patches, g.rows, g.cols, g.n_valid, g.merge)]
    impl = V.attention_impl("bf16")

    @nnx.jit(static_argnames=("impl",))
    def tower_nnx(vision, aligner, patches, rows, cols, n_valid, merge, impl):
        x = vision(patches, rows, cols, n_valid, impl=impl)
        return x, aligner(x, merge)

    cached = nnx.cached_partial(tower_nnx, vit, al)
    rows = dict(
        encode_images=host_ms(lambda: V.encode_images(vit, al, vecs, [im], num)),
        tower_nnx_jit=host_ms(lambda: tower_nnx(vit, al, *dev, impl=impl)),
        tower_cached_partial=host_ms(lambda: cached(*dev, impl=impl)),
        tower_split_once=host_ms(lambda: V._tower(vit, al, *dev, impl=impl)),
    )
    print(json.dumps(dict(what="vit_host_ms", backend=jax.default_backend(), patches=int(g.patches.shape[1]),
                          weights=len(jax.tree.leaves(state)), **{k: round(x, 2) for k, x in rows.items()})))


if __name__ == "__main__":
    main()
