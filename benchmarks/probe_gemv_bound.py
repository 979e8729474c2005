"""What bounds the batch-1 decode GEMV of ``grouped_qmatmul``: bytes, or per-element work?

Every variant reads a weight of the same element count as one routed w1 at batch 1 (6 experts x
2304 x 5120) except the head-sized rows, and is timed as ``N`` independent calls in one jitted,
unrolled program (no loop, no reduction between calls: only the kernels and their launches), so
the per-call time is the kernel's own plus one launch gap (XLA's own variants read a different
weight copy in every call: it merges dots that share a weight). Variants:

* ``q_routed``: int8 codes + ue8m0 scales, 6 experts picked from a 384-expert stack (the decode
  case); ``q_dense``: the same bytes as one contiguous [13824, 5120] matrix (one block);
* ``q_dense_noscale``: int8 codes without scales; ``q_dense_bf16``: bf16 weights (twice the
  bytes, no conversion at all); ``q_head``: int8 + scales at the head's size [129280, 5120];
* ``xla_bf16``: XLA's own GEMV on the bf16 [13824, 5120] weight; ``xla_head``: on the bf16
  head [129280, 5120]; ``xla_sum_int8``: XLA's column sum of the int8 [13824, 5120] (a pure read).

If the kernel's rate in elements per second is the same for int8 and bf16 weights, the limit is
per-element work, not bytes. One JSON line per variant (also $OUT/probe_gemv_bound.jsonl).

    python3 benchmarks/probe_gemv_bound.py [--n 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_qmatmul as bq  # noqa: E402
import bench_slice as bs  # noqa: E402
from dsv41_jax.kernels import qmatmul as Q  # noqa: E402

emit = bs.jsonl_emitter("probe_gemv_bound.jsonl")
F32 = jnp.float32
O1, K = 2304, 5120
HEAD = 129280


def chain_time(fn, args, n):
    """Seconds per call of ``fn(i, *args)`` for ``n`` independent calls unrolled in one jit."""
    f = jax.jit(lambda *a: tuple(fn(i, *a) for i in range(n)))
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    a = ap.parse_args()
    global O1, K, HEAD
    if a.smoke:
        O1, K, HEAD = 64, 256, 512
    key = jax.random.key(0)
    # one activation row per call: calls differ, so XLA cannot merge identical ones (CSE)
    xs = jax.random.normal(key, (max(a.n, 4), 1, K), F32).astype(jnp.bfloat16)
    only = set(filter(None, a.only.split(",")))
    n = a.n

    def run(name, fn, args, nbytes, elems, reps=n):
        if only and name not in only:
            return
        try:
            t = chain_time(fn, args, reps)
            emit(variant=name, us=round(t * 1e6, 2), TBps=round(nbytes / t / 1e12, 3),
                 Gelem_per_s=round(elems / t / 1e9, 1), bytes=nbytes, calls=reps)
        except Exception as e:  # noqa: BLE001
            emit(variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")

    E = 6 * O1
    codes, scale = bq.make_int8(key, 384, O1, K)

    def routed(i, xs, codes, scale):
        ids = (jnp.arange(6, dtype=jnp.int32) * 61 + i * 37) % 384
        return Q.grouped_qmatmul(jnp.tile(xs[i], (6, 1)), ids, 6, codes, scale, bm=1, out_dtype=jnp.bfloat16)
    run("q_routed", routed, (xs, codes, scale), 6 * O1 * (K + K // 32), E * K)
    del codes, scale

    dc, ds = bq.make_int8(key, 4, E, K)  # four copies: successive calls read different weights
    one = jnp.zeros((1,), jnp.int32)

    def dense(i, xs, c, s):
        return Q.grouped_qmatmul(xs[i], one, 1, c[i % 4][None], None if s is None else s[i % 4][None], bm=1,
                                 out_dtype=jnp.bfloat16)
    run("q_dense", dense, (xs, dc, ds), E * (K + K // 32), E * K)
    run("q_dense_noscale", dense, (xs, dc, None), E * K, E * K)
    wb = dc.astype(jnp.bfloat16)
    del ds
    run("q_dense_bf16", dense, (xs, wb, None), E * K * 2, E * K)

    # XLA merges dots that share a weight into one GEMM and reductions of one input into one
    # fusion, so its variants read a different weight copy in every call (4 calls)
    def xla_gemv(i, xs, w):
        return jnp.einsum("rk,ok->ro", xs[i], w[i], preferred_element_type=F32).astype(jnp.bfloat16)
    run("xla_bf16", xla_gemv, (xs, wb), E * K * 2, E * K, reps=4)

    def xla_sum(i, xs, c):
        return jnp.sum(c[i].astype(F32), axis=0) + xs[i, 0].astype(F32)
    run("xla_sum_int8", xla_sum, (xs, dc), E * K, E * K, reps=4)
    del dc, wb

    hc, hs = bq.make_int8(key, 1, HEAD, K)

    def head_q(i, xs, c, s):
        return Q.grouped_qmatmul(xs[i], one, 1, c, s, bm=1, out_dtype=jnp.bfloat16)
    run("q_head", head_q, (xs, hc, hs), HEAD * (K + K // 32), HEAD * K, reps=4)
    hb = jnp.stack([hc[0].astype(jnp.bfloat16) + jnp.bfloat16(i) for i in range(2)])  # two distinct copies
    del hc, hs

    def head_x(i, xs, w):
        return jnp.einsum("rk,ok->ro", xs[i], w[i], preferred_element_type=F32).astype(jnp.bfloat16)
    run("xla_head", head_x, (xs, hb), HEAD * K * 2, HEAD * K, reps=2)


if __name__ == "__main__":
    main()
