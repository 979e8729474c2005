"""GPU-side agreement of the Pallas kernels with their XLA references at V4.1 sizes (one JSON
line per case): the mHC Sinkhorn (relative and per-entry error) and the grouped qmatmul in its
split-K decode configurations (int8 experts: the "chunk" mode, against the "dot" mode too; dense
fp8) and its prefill blocks (128-row expert blocks, 64-row dense fp8 blocks: the weights-left
operand order, against the other order too).

    python3 benchmarks/check_gpu_kernels.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_slice as bs  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax.kernels import qmatmul as Q  # noqa: E402
from dsv41_jax.kernels.sinkhorn import sinkhorn, sinkhorn_reference  # noqa: E402


emit = bs.jsonl_emitter("check_gpu_kernels.jsonl")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main():
    key = jax.random.key(0)
    for T in (1, 64, 8192):
        x = 3.0 * jax.random.normal(jax.random.fold_in(key, T), (T, 16), jnp.float32)
        got = jax.jit(lambda v: sinkhorn(v, 20, 1e-6, "triton"))(x)
        want = jax.jit(lambda v: sinkhorn_reference(v, 20, 1e-6))(x)
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        emit(check="sinkhorn", tokens=T, rel_err=rel(got, want),
             max_elem_rel=float(np.max(np.abs(g - w) / np.maximum(np.abs(w), 1e-30))))
    E, D, I = 384, 5120, 2304
    for name, G, O, K, R, kind, bm in (
            ("routed_w1", E, I, D, 6, "int8", 1), ("routed_w2", E, D, I, 6, "int8", 1),
            ("routed_w1_b8", E, I, D, 48, "int8", 1), ("dense_fp8_b1", 1, 2304, D, 1, "fp8", 1),
            ("dense_fp8_b16", 1, 512, D, 16, "fp8", 16), ("routed_w1_prefill", E, I, D, 512, "int8", 128),
            ("routed_w2_prefill", E, D, I, 512, "int8", 128), ("dense_fp8_prefill", 1, 2304, D, 256, "fp8", 64)):
        k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, R * 7 + O), 4)
        if kind == "int8":
            codes = jax.random.randint(k1, (G, O, K), -12, 13).astype(jnp.int8)
        else:
            codes = jax.random.normal(k1, (G, O, K), jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jax.random.randint(k2, (G, O, K // 32), 118, 126).astype(jnp.uint8)
        x = jax.random.normal(k3, (R, K), jnp.float32).astype(jnp.bfloat16)
        bg = jax.random.randint(k4, (R // bm,), 0, G).astype(jnp.int32)
        cfg = Q.choose_config(bm, O, K, True, nb=R // bm, groups=G)
        got = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=jnp.float32, impl="triton"))(
            x, bg, R // bm, codes, scale)
        dot = dict(mode="dot") if cfg.mode == "chunk" else {}  # the lowp / order variants are "dot" options
        want = jax.jit(lambda *a: Q.grouped_qmatmul_reference(*a, bm=bm, out_dtype=jnp.float32))(
            x, bg, R // bm, codes, scale)
        lowp = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=jnp.float32, impl="triton",
                                                    lowp_dequant=True, **dot))(x, bg, R // bm, codes, scale)
        f32 = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=jnp.float32, impl="triton",
                                                   lowp_dequant=False, **dot))(x, bg, R // bm, codes, scale)
        other = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=jnp.float32, impl="triton",
                                                     wlhs=not cfg.wlhs, **dot))(x, bg, R // bm, codes, scale)
        emit(check="qmatmul", case=name, mode=cfg.mode, splitk=cfg.splitk, bk=cfg.bk, wlhs=cfg.wlhs,
             rel_err=rel(got, want),
             lowp_rel_err=rel(lowp, want), lowp_vs_f32_max_abs=float(jnp.max(jnp.abs(lowp - f32))),
             other_order_rel_err=rel(other, want))


if __name__ == "__main__":
    main()
