"""Probe for the next prefill-MoE kernel: JAX's own Mosaic GPU mixed-type matmul (int8 weights
upcast in registers, TMA + warp-specialized pipeline, wgmma; ``jax.experimental.pallas.ops.gpu.
hopper_mixed_type_matmul_mgpu``) on the routed-expert shapes, beside this project's Triton kernel
(``grouped_qmatmul``, one group, 128-row blocks, ue8m0 scales) and XLA's bf16 GEMM on the
dequantized weight. The Mosaic kernel has no per-32 scales, so its number is the ceiling a scaled
version could approach (the scales add one multiply per weight in registers). One JSON line per
(shape, implementation); appended to $OUT/probe_mgpu_mixed.jsonl when $OUT is set.

    python3 benchmarks/probe_mgpu_mixed.py                 # on a Hopper GPU
    python3 benchmarks/probe_mgpu_mixed.py --gemv          # decode shapes (8-64 activation columns)
    python3 benchmarks/probe_mgpu_mixed.py --lower-only    # any machine: the Mosaic kernels lower

Measured in run 17 (docs/performance.md): 1.5-1.6x the Triton kernel at 2048-8192 rows of one
weight, no gain at 128-row blocks or at decode shapes.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_qmatmul as bq  # noqa: E402
import bench_slice as bs  # noqa: E402
from dsv41_jax.kernels import qmatmul as Q  # noqa: E402

emit = bs.jsonl_emitter("probe_mgpu_mixed.jsonl")
SHAPES = [(2304, 5120), (5120, 2304)]  # routed w1 / w3 and w2: (out, in)
TOKENS = (128, 512, 2048, 8192)  # rows through one weight (128: one MoE block at 8k prefill)


def configs(H):
    for tm, tn, tk, dim in itertools.product((128,), (64, 128), (64, 128), tuple(H.MatmulDimension)):
        yield H.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=4, grid_minor_dim=H.MatmulDimension.N,
                             grid_tile_width=4, wg_dimension=dim)


def gemv_configs(H, T):
    """Decode-sized right-hand sides (``T`` <= 64 columns): one N tile, the two warpgroups split M."""
    for tm, tk, steps in itertools.product((64, 128), (128, 256), (4, 8)):
        yield H.TuningConfig(tile_m=tm, tile_n=T, tile_k=tk, max_concurrent_steps=steps, epi_tile_n=None,
                             epi_tile_m=64, grid_minor_dim=H.MatmulDimension.M, grid_tile_width=1,
                             wg_dimension=H.MatmulDimension.M)


def main():
    global SHAPES, TOKENS
    ap = argparse.ArgumentParser()
    ap.add_argument("--lower-only", action="store_true", help="lower the Mosaic kernels for CUDA, run nothing")
    ap.add_argument("--gemv", action="store_true",
                    help="decode shapes instead: six routed experts' rows as one weight, 8-64 activation columns")
    a = ap.parse_args()
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as H

    if a.gemv:
        SHAPES = [(6 * 2304, 5120), (5120, 6 * 2304)]
        TOKENS = (8, 16, 64)

    if a.lower_only and jax.default_backend() != "gpu":  # the kernel asks the device for its SM count
        H.backend = types.SimpleNamespace(get_default_device=lambda: types.SimpleNamespace(core_count=132))
    key = jax.random.key(0)
    for (O, K), T in itertools.product(SHAPES, TOKENS):
        flops = 2 * O * K * T
        shape = dict(out=O, k=K, tokens=T)
        rate = lambda t: dict(TFLOPs=round(flops / t / 1e12, 1), int8_TBps=round(O * K / t / 1e12, 3))  # noqa: E731
        for cfg in (gemv_configs(H, T) if a.gemv else configs(H)):
            if O % (cfg.tile_m * (2 if cfg.wg_dimension == H.MatmulDimension.M else 1)) or \
                    T % (cfg.tile_n * (2 if cfg.wg_dimension == H.MatmulDimension.N else 1)):
                continue
            name = f"mgpu tm{cfg.tile_m} tn{cfg.tile_n} tk{cfg.tile_k} st{cfg.max_concurrent_steps} wg{cfg.wg_dimension}"
            f = jax.jit(lambda w, xt, cfg=cfg: H.mixed_matmul_kernel(w, xt, out_dtype=jnp.bfloat16, config=cfg))
            try:
                if a.lower_only:
                    f.trace(jax.ShapeDtypeStruct((O, K), jnp.int8),
                            jax.ShapeDtypeStruct((K, T), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
                    emit(**shape, impl=name, lowered=True)
                    continue
                w = jax.random.randint(key, (O, K), -12, 13, dtype=jnp.int8)
                xt = jax.random.normal(key, (K, T), jnp.float32).astype(jnp.bfloat16)
                t, c = bq.timeit(lambda i, s, w, xt, f=f: f(w, xt + s.astype(jnp.bfloat16)), w, xt, reps=20)
                ref = jnp.dot(w.astype(jnp.bfloat16), xt, preferred_element_type=jnp.float32)
                emit(**shape, impl=name, us=round(t * 1e6, 1), **rate(t),
                     rel_err=bq.rel_err(f(w, xt), ref))
            except Exception as e:  # noqa: BLE001
                emit(**shape, impl=name, error=f"{type(e).__name__}: {str(e)[:200]}")
        if a.lower_only:
            continue
        codes, scale = bq.make_int8(key, 1, O, K)
        x = jax.random.normal(key, (T, K), jnp.float32).astype(jnp.bfloat16)
        bm = min(T, 128)
        blocks = jnp.zeros((T // bm,), jnp.int32)
        t, _ = bq.timeit(lambda i, s, x, c, sc: Q.grouped_qmatmul(x + s.astype(jnp.bfloat16), blocks, T // bm, c, sc,
                                                                   bm=bm, out_dtype=jnp.bfloat16), x, codes, scale, reps=20)
        emit(**shape, impl=f"triton grouped_qmatmul bm{bm}", us=round(t * 1e6, 1), **rate(t))
        w16 = Q.dequantize(codes[0], scale[0], jnp.bfloat16)
        t, _ = bq.timeit(lambda i, s, x, w: jnp.dot(x + s.astype(jnp.bfloat16), w.T,
                                                    preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                         x, w16, reps=20)
        emit(**shape, impl="xla bf16 dot (weight dequantized beforehand)", us=round(t * 1e6, 1), **rate(t))


if __name__ == "__main__":
    main()
