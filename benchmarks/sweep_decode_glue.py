"""Kernel times of the decode glue kernels' variants on the GPU, from the profiler (one JSON line
per variant: each kernel's mean microseconds per call, and their sum). Decode-step glue kernels
are latency-bound (1-5 us), so their durations come from the trace, not from wall clocks around
Python dispatch.

    python3 benchmarks/sweep_decode_glue.py [--tokens 1,8,64] [--tag TAG]

Parts: the decode mHC pair (``kernels.mhc_mix.hc_mixes_decode``: the sums kernel's mode, inputs
per program and warps; run 23 also timed a scalar form of the epilogue, since removed) against ``hc_mixes``' XLA form; the fused norm +
act-quant (``kernels.norm_quant``) at its two V4.1 widths and several warp counts against the jnp
form. V4.1 widths: a 4 x 5120 stream, 24 mixes, q rank 1280. The decode indexer's top-k
(``kernels.topk``: entries per program, keys per loop step, warps) against XLA's sort and ranking
forms at 512 of 4160 and of 2080 entries (``--parts topk``; its rows are the tokens, up to 4). The
experimental decode attention kernel (``kernels.sparse_attn``: heads per program, keys per tile,
warps) against XLA's form at V4.1 decode shapes (``--parts attn``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_slice as bs  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import profile_step as ps  # noqa: E402
from dsv41_jax.kernels.mhc_mix import hc_mixes_decode  # noqa: E402
from dsv41_jax.kernels.norm_quant import norm_quant, norm_quant_reference  # noqa: E402
from dsv41_jax.kernels.sparse_attn import sparse_attn_decode  # noqa: E402
from dsv41_jax.kernels.topk import MAX_ROWS, topk_ascending  # noqa: E402
from dsv41_jax.model.attention import sparse_attn  # noqa: E402

emit = bs.jsonl_emitter("sweep_decode_glue.jsonl")
STEPS = 20


def kernel_times(fn, args) -> dict:
    """Mean microseconds per call of each kernel ``fn(*args)`` launches (``STEPS`` calls)."""
    summ, _ = ps.profile(fn, args, STEPS, "sweep", None, "", False)
    return {name: us for name, us, _ in summ["top_kernels"]}


def report(part: str, variant: dict, times: dict, tag: str):
    emit(part=part, **variant, kernels=times, total_us=round(sum(times.values()), 2), n_kernels=len(times), tag=tag)


def part_mhc(T: int, tag: str, n: int = 4, D: int = 5120):
    k = jax.random.split(jax.random.key(T), 3)
    h = jax.random.normal(k[0], (T, n * D), jnp.float32).astype(jnp.bfloat16)
    fn = 0.02 * jax.random.normal(k[1], (24, n * D), jnp.float32)
    scale, base = jnp.asarray([0.5, 0.7, 1.3]), 0.1 * jax.random.normal(k[2], (24,))
    hc = dict(n=n, iters=20, norm_eps=1e-6, hc_eps=1e-6)
    os.environ["DSV41_MHC_KERNEL"] = "0"  # the XLA form (hc_mixes) as the baseline
    from dsv41_jax.model.mhc import hc_mixes

    xla = jax.jit(lambda h, *a: hc_mixes(h.reshape(T, n, D), *a, hc_mult=n, iters=20, norm_eps=1e-6, hc_eps=1e-6))
    report("mhc", dict(tokens=T, impl="xla"), kernel_times(xla, (h, fn, scale, base)), tag)
    os.environ.pop("DSV41_MHC_KERNEL")
    variants = [dict(mode="dot", bk=64, num_warps=4)]
    if T <= 16:
        variants += [dict(mode="fma", bk=bk, num_warps=w) for bk in (128, 256, 512) for w in (4, 8)]
    for v in variants:
        f = jax.jit(lambda *a, v=v: hc_mixes_decode(*a, impl="triton", **v, **hc))
        report("mhc", dict(tokens=T, **v), kernel_times(f, (h, fn, scale, base)), tag)


def part_norm(T: int, tag: str):
    for D, n in ((5120, 4), (1280, 0)):
        k = jax.random.split(jax.random.key(D + T), 3)
        x = jax.random.normal(k[0], (T, n, D) if n else (T, D), jnp.float32).astype(jnp.bfloat16)
        w = (1 + 0.1 * jax.random.normal(k[1], (D,), jnp.float32)).astype(jnp.bfloat16)
        mix = jax.random.uniform(k[2], (T, n)) + 0.5 if n else None
        ref = jax.jit(lambda x, w, m: norm_quant_reference(x, w, 1e-6, m))
        report("norm_quant", dict(tokens=T, width=D, hc=n, impl="xla"), kernel_times(ref, (x, w, mix)), tag)
        for nw in (2, 4, 8, 16):
            f = jax.jit(lambda x, w, m, nw=nw: norm_quant(x, w, 1e-6, m, impl="triton", num_warps=nw))
            report("norm_quant", dict(tokens=T, width=D, hc=n, num_warps=nw), kernel_times(f, (x, w, mix)), tag)


def part_topk(T: int, tag: str, k: int = 512):
    if T > MAX_ROWS:
        return
    for n in (4160, 2080):
        x = jax.random.normal(jax.random.key(n + T), (T, n), jnp.float32)
        for limit in ("0", str(1 << 26)):  # XLA: lax.top_k + sort, then the compare-and-count ranking
            os.environ["DSV41_RANK_TOPK_MAX"] = limit
            f = jax.jit(lambda x: topk_ascending(x, k, impl="xla"))
            report("topk", dict(tokens=T, entries=n, impl="xla", rank_max=int(limit)), kernel_times(f, (x,)), tag)
        os.environ.pop("DSV41_RANK_TOPK_MAX")
        for bi, bj, nw in ((32, 256, 4), (16, 256, 4), (64, 128, 4), (32, 128, 4), (16, 128, 2), (64, 256, 8), (16, 512, 4)):
            f = jax.jit(lambda x, v=(bi, bj, nw): topk_ascending(x, k, impl="triton", bi=v[0], bj=v[1], num_warps=v[2]))
            report("topk", dict(tokens=T, entries=n, bi=bi, bj=bj, num_warps=nw), kernel_times(f, (x,)), tag)


def part_attn(T: int, tag: str, H: int = 64, d: int = 512, W: int = 128, K: int = 512):
    bf = jnp.bfloat16
    ks = jax.random.split(jax.random.key(T + 7), 6)
    q = jax.random.normal(ks[0], (T, 1, H, d), jnp.float32).astype(bf)
    kw = jax.random.normal(ks[1], (T, W, d), jnp.float32).astype(bf)
    kw_ok = jax.random.uniform(ks[2], (T, 1, W)) < 0.9
    kc = jax.random.normal(ks[3], (T, 1, K, d), jnp.float32).astype(bf)
    kc_ok = jax.random.uniform(ks[4], (T, 1, K)) < 0.9
    sink = jax.random.normal(ks[5], (H,), jnp.float32)
    args = (q, kw, kw_ok, kc, kc_ok, sink)
    ref = jax.jit(lambda *a: sparse_attn(*a, d ** -0.5, bf))
    report("sparse_attn", dict(tokens=T, impl="xla"), kernel_times(ref, args), tag)
    for hb, bk, nw in ((16, 64, 4), (16, 32, 4), (16, 128, 4), (32, 64, 4), (64, 32, 4), (16, 64, 8)):
        f = jax.jit(lambda q, kw, ok, kc, okc, s, v=(hb, bk, nw): sparse_attn_decode(
            q.reshape(T, H, d), kw, ok.reshape(T, W), kc.reshape(T, K, d), okc.reshape(T, K), s, d ** -0.5,
            impl="triton", hb=v[0], bk=v[1], num_warps=v[2]))
        try:  # a tile over the shared-memory limit fails alone
            report("sparse_attn", dict(tokens=T, hb=hb, bk=bk, num_warps=nw), kernel_times(f, args), tag)
        except Exception as e:  # noqa: BLE001
            report("sparse_attn", dict(tokens=T, hb=hb, bk=bk, num_warps=nw, error=str(e)[:200]), {}, tag)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--parts", default="mhc,norm,topk,attn")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    for T in [int(t) for t in a.tokens.split(",") if t]:
        if "mhc" in a.parts:
            part_mhc(T, a.tag)
        if "norm" in a.parts:
            part_norm(T, a.tag)
        if "topk" in a.parts:
            part_topk(T, a.tag)
        if "attn" in a.parts:
            part_attn(T, a.tag)


if __name__ == "__main__":
    main()
