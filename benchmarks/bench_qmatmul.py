"""Grouped quantized matmul (dsv41_jax.kernels.qmatmul) on the GPU: correctness at real sizes and
timings against the XLA paths. Prints one JSON line per measurement (also to --out).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/bench_qmatmul.py [--budget 200] [--out F]

Sections (in priority order; the script stops starting new ones after --budget seconds):
  check   kernel vs XLA reference at V4.1-Flash expert sizes (int8 + ue8m0, bf16) and dense fp8
  gemv    decode: batch 1 / 8 tokens x 6 experts, int8 experts [384, 2304, 5120] / [384, 5120, 2304];
          effective TB/s of bytes read (codes + scales + x) vs the XLA gather path (gather +
          dequantize + einsum) and vs bf16 experts
  gemm    prefill: 8192 tokens x 6 slots sorted into 128-row expert blocks; TFLOP/s vs the
          fori_loop over blocks of MoE.routed_grouped (one projection)
  dense   fp8 e4m3 [32768, 5120] with ue8m0 scales, batch 1..64, vs XLA dequantize + matmul
  moe     the whole routed MoE (int8 experts): pallas vs gather / grouped
  sweep   tile / warp / stage variants of the gemv and gemm kernels
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax.kernels import qmatmul as Q  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
E, D, I, K_TOP = 384, 5120, 2304, 6
TOKENS, DENSE_O = 8192, 32768
IMPL = "triton"
T0 = time.time()
OUT = None


def emit(**row):
    row["t"] = round(time.time() - T0, 1)
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if OUT:
        with open(OUT, "a") as f:
            f.write(line + "\n")


def guarded(section, **tags):
    """Run a measurement; a failure (e.g. a Triton lowering error) becomes an error row."""
    def deco(fn):
        try:
            fn()
        except Exception as ex:  # noqa: BLE001 - report and continue
            tb = traceback.format_exc()
            emit(section=section, error=f"{type(ex).__name__}: {str(ex)[:3000]}", tb=tb[-3000:], **tags)
        return fn
    return deco


def timeit(fn, *args, reps: int):
    """Seconds per call of ``fn(i, *args)`` run ``reps`` times inside one jit (a data dependence
    between iterations keeps XLA from hoisting the call; ``i`` lets callers vary inputs)."""
    def loop(*a):
        def body(i, s):
            y = fn(i, s, *a)
            return s + y.reshape(-1)[0].astype(F32) * 0.0
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
    f = jax.jit(loop)
    t = time.time()
    jax.block_until_ready(f(*args))
    compile_s = time.time() - t
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best / reps, compile_s


def rel_err(a, b):
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def make_int8(key, G, O, K):
    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (G, O, K), -12, 13, dtype=jnp.int8)
    scale = jax.random.randint(k2, (G, O, K // 32), 118, 127, dtype=jnp.int32).astype(jnp.uint8)
    return codes, scale


def main():
    global OUT, E, D, I, TOKENS, DENSE_O, IMPL
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=200.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    OUT = args.out
    if args.smoke:  # CPU check of this script: small sizes through the Pallas interpreter
        E, D, I, TOKENS, DENSE_O, IMPL = 8, 256, 128, 64, 96, "interpret"
    skip = set(args.skip.split(",")) - {""}
    dev = jax.devices()[0]
    emit(section="env", jax=jax.__version__, device=str(dev), kind=getattr(dev, "device_kind", "?"))

    def left():
        return args.budget - (time.time() - T0)

    key = jax.random.key(0)
    ka, kb, kx = jax.random.split(key, 3)
    W13 = make_int8(ka, E, I, D)   # w1 / w3 shape [E, 2304, 5120]
    W2 = make_int8(kb, E, D, I)    # w2 shape [E, 5120, 2304]
    jax.block_until_ready(W2)
    shapes = {"w1": (W13, I, D), "w2": (W2, D, I)}

    # ceiling: device copy (read + write)
    @guarded("ceiling")
    def _():
        a = jnp.ones((1 << 30,), jnp.uint16)  # 2 GiB
        t, _c = timeit(lambda i, s, a: a + s.astype(jnp.uint16), a, reps=10)
        emit(section="ceiling", what="copy", TBps=round(2 * a.nbytes / t / 1e12, 3))

    # ---------------------------------------------------------------- check (real sizes)
    if "check" not in skip:
        rng = np.random.default_rng(0)
        for name, ((codes, scale), O, K) in shapes.items():
            for bm, nb, mode in ((1, 12, "auto"), (8, 2, "auto"), (128, 4, "auto"), (128, 4, "dot-split")):
                @guarded("check", proj=name, bm=bm, mode=mode)
                def _():
                    x = jax.random.normal(kx, (nb * bm, K), F32).astype(BF16)
                    bg = jnp.asarray(rng.integers(0, E, nb), jnp.int32).at[0].set(E - 1)
                    used = nb - 1
                    kw = dict(mode="dot", split=True) if mode == "dot-split" else dict(mode=mode)
                    t = time.time()
                    got = jax.jit(lambda x, bg: Q.grouped_qmatmul(x, bg, used, codes, scale, bm=bm, out_dtype=F32,
                                                                  impl=IMPL, **kw))(x, bg)
                    got = jax.block_until_ready(got)
                    ref = Q.grouped_qmatmul_reference(x, bg, used, codes, scale, bm=bm, out_dtype=F32)
                    emit(section="check", proj=name, bm=bm, mode=mode, rel_err=rel_err(got, ref),
                         tail_zero=bool(jnp.all(got[used * bm:] == 0)), compile_s=round(time.time() - t, 1))

        @guarded("check", proj="dense-fp8")
        def _():
            O, K = DENSE_O + 96, D  # an output width no tile divides
            w = (jax.random.normal(kx, (O, K), F32) * 4).astype(jnp.float8_e4m3fn)
            s = jax.random.randint(ka, (O, K // 32), 120, 127, dtype=jnp.int32).astype(jnp.uint8)
            for B in (1, 8, 16, 64):
                x = jax.random.normal(kb, (B, K), F32).astype(BF16)
                got = Q.grouped_qmatmul(x, jnp.zeros((1,), jnp.int32), 1, w, s, bm=B, out_dtype=F32, impl=IMPL)
                ref = Q.grouped_qmatmul_reference(x, jnp.zeros((1,), jnp.int32), 1, w, s, bm=B, out_dtype=F32)
                emit(section="check", proj="dense-fp8", O=O, bm=B, rel_err=rel_err(got, ref))

        @guarded("check", proj="bf16-experts")
        def _():
            wb = jax.random.normal(kx, (8, I, D), F32).astype(BF16)
            x = jax.random.normal(kb, (256, D), F32).astype(BF16)
            bg = jnp.asarray([7, 3], jnp.int32)
            for bm, xx, bgg in ((128, x, bg), (1, x[:6], jnp.asarray([1, 2, 3, 4, 5, 7], jnp.int32))):
                got = Q.grouped_qmatmul(xx, bgg, bgg.shape[0], wb, None, bm=bm, out_dtype=F32, impl=IMPL)
                ref = Q.grouped_qmatmul_reference(xx, bgg, bgg.shape[0], wb, None, bm=bm, out_dtype=F32)
                emit(section="check", proj="bf16-experts", bm=bm, rel_err=rel_err(got, ref))

    # ---------------------------------------------------------------- gemv (decode)
    def gemv_bytes(O, K, pairs, x_rows):
        return pairs * (O * K + O * K // 32) + x_rows * K * 2

    def gemv_case(name, batch, impl, cfg=None, wts=None):
        (codes, scale), O, K = shapes[name]
        if wts is not None:
            codes, scale = wts, None
        pairs = batch * K_TOP
        x = jax.random.normal(kx, (pairs, K), F32).astype(BF16)
        ids0 = jnp.asarray(np.random.default_rng(batch).integers(0, E, pairs), jnp.int32)
        cfg = cfg or {}

        def fn(i, s, x, codes, scale):
            ids = (ids0 + i * 37) % E  # other experts every iteration: weights come from HBM
            xi = x + s.astype(BF16)
            if impl == "xla-gather":
                return Q.grouped_qmatmul_reference(xi, ids, pairs, codes, scale, bm=1, out_dtype=BF16)
            return Q.grouped_qmatmul(xi, ids, pairs, codes, scale, bm=1, out_dtype=BF16, impl=IMPL, **cfg)

        t, c = timeit(fn, x, codes, scale, reps=50)
        nbytes = gemv_bytes(O, K, pairs, pairs) if scale is not None else pairs * O * K * 2 + pairs * K * 2
        emit(section="gemv", proj=name, batch=batch, pairs=pairs, impl=impl, weights="bf16" if scale is None else "int8",
             cfg=cfg, us=round(t * 1e6, 1), TBps=round(nbytes / t / 1e12, 3), compile_s=round(c, 1))

    if "gemv" not in skip:
        for name in ("w1", "w2"):
            for batch in (1, 8):
                for impl in ("triton", "xla-gather"):
                    guarded("gemv", proj=name, batch=batch, impl=impl)(lambda: gemv_case(name, batch, impl))
        # bf16 experts (the default model today) through the same kernel and through XLA
        @guarded("gemv", weights="bf16")
        def _():
            wb = jax.random.normal(kx, (E, I, D), F32).astype(BF16)
            for impl in ("triton", "xla-gather"):
                shapes["w1b"] = ((None, None), I, D)
                for batch in (1, 8):
                    guarded("gemv", proj="w1", batch=batch, impl=impl, weights="bf16")(
                        lambda: gemv_case("w1b", batch, impl, wts=wb))
            del wb

    # ---------------------------------------------------------------- gemm (prefill)
    from dsv41_jax.model.moe import MoE

    def gemm_layout(c, tokens=None):
        tokens = TOKENS if tokens is None else tokens
        ids = jax.random.randint(kx, (tokens, K_TOP), 0, E, dtype=jnp.int32)
        order, pidx, NC, blocks, n_used = MoE._blocks(types.SimpleNamespace(n_experts=E), ids, c)
        return NC, blocks, n_used, tokens * K_TOP

    def gemm_case(name, impl, c=128, cfg=None):
        (codes, scale), O, K = shapes[name]
        NC, blocks, n_used, N = gemm_layout(c)
        x = jax.random.normal(kx, (NC * c, K), F32).astype(BF16)
        cfg = cfg or {}

        def fn(i, s, x, blocks, n_used, codes, scale):
            xi = x + s.astype(BF16)
            if impl == "xla-fori":  # MoE.routed_grouped's loop for one projection
                def body(j, out):
                    e = blocks[j]
                    xc = jax.lax.dynamic_slice_in_dim(xi, j * c, c)
                    w = Q.dequantize(codes[e], scale[e], BF16)
                    y = jnp.einsum("td,id->ti", xc, w, preferred_element_type=F32).astype(BF16)
                    return jax.lax.dynamic_update_slice_in_dim(out, y, j * c, 0)
                return jax.lax.fori_loop(0, n_used, body, jnp.zeros((NC * c, O), BF16))
            return Q.grouped_qmatmul(xi, blocks, n_used, codes, scale, bm=c, out_dtype=BF16, impl=IMPL, **cfg)

        t, comp = timeit(fn, x, blocks, n_used, codes, scale, reps=3)
        emit(section="gemm", proj=name, tokens=TOKENS, pairs=N, chunk=c, blocks_used=int(n_used), impl=impl, cfg=cfg,
             ms=round(t * 1e3, 3), TFLOPs=round(2 * N * O * K / t / 1e12, 1),
             TFLOPs_padded=round(2 * int(n_used) * c * O * K / t / 1e12, 1), compile_s=round(comp, 1))

    if "gemm" not in skip:
        for name in ("w1", "w2"):
            for impl in ("triton", "xla-fori"):
                if left() > 0:
                    guarded("gemm", proj=name, impl=impl)(lambda: gemm_case(name, impl))

    # ---------------------------------------------------------------- dense fp8 GEMV
    if "dense" not in skip and left() > 0:
        @guarded("dense")
        def _():
            O, K = DENSE_O, D
            w = (jax.random.normal(kx, (O, K), F32) * 4).astype(jnp.float8_e4m3fn)
            s = jax.random.randint(ka, (O, K // 32), 120, 127, dtype=jnp.int32).astype(jnp.uint8)
            wb = jax.random.normal(kx, (O, K), F32).astype(BF16)
            g0 = jnp.zeros((1,), jnp.int32)
            for B in (1, 8, 16, 64):
                x = jax.random.normal(kb, (B, K), F32).astype(BF16)
                variants = [("triton", {})] + ([("triton", {"mode": "dot"})] if B < 16 else []) + \
                           [("xla-dequant", {}), ("xla-bf16", {})]
                for impl, cfg in variants:
                    if left() < 0:
                        return

                    def fn(i, s_, x, w, s, wb, impl=impl, cfg=cfg):
                        xi = x + s_.astype(BF16)
                        if impl == "xla-dequant":
                            return Q.grouped_qmatmul_reference(xi, g0, 1, w, s, bm=B, out_dtype=BF16)
                        if impl == "xla-bf16":
                            return jnp.einsum("bk,ok->bo", xi, wb, preferred_element_type=F32).astype(BF16)
                        return Q.grouped_qmatmul(xi, g0, 1, w, s, bm=B, out_dtype=BF16, impl=IMPL, **cfg)

                    t, c = timeit(fn, x, w, s, wb, reps=20)
                    nbytes = O * K * (2 if impl == "xla-bf16" else 1) + (O * K // 32 if impl != "xla-bf16" else 0) + B * K * 2
                    emit(section="dense", O=O, K=K, batch=B, impl=impl, cfg=cfg, us=round(t * 1e6, 1),
                         TBps=round(nbytes / t / 1e12, 3), compile_s=round(c, 1))

    # ---------------------------------------------------------------- whole routed MoE
    if "moe" not in skip and left() > 20:
        @guarded("moe")
        def _():
            from dsv41_jax.config import preset
            from dsv41_jax.numerics import Numerics

            t = preset("v41-flash").text
            assert args.smoke or (t.n_routed_experts, t.hidden_size, t.moe_intermediate_size) == (E, D, I)

            class View:  # what MoE.routed_* read, without zero-initialised parameters
                def __getattr__(self, name):
                    return getattr(MoE, name).__get__(self, View)

            moe = View()
            moe.numerics, moe.limit, moe.n_experts = Numerics("bfloat16", "reference"), t.swiglu_limit, E
            sw = types.SimpleNamespace
            moe.experts = sw(quantized=True,
                             w1=sw(int8=True, weight=W13[0], scale=W13[1]), w3=sw(int8=True, weight=W13[0], scale=W13[1]),
                             w2=sw(int8=True, weight=W2[0], scale=W2[1]))
            for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
                p.take = (lambda p: lambda ids, dt: Q.dequantize(p.weight[ids], p.scale[ids], dt))(p)
            for T in (1, 8, TOKENS):
                paths = ("pallas", "gather") if T * K_TOP < E else ("pallas", "grouped")
                x = jax.random.normal(kx, (T, D), F32).astype(BF16)
                ids0 = jax.random.randint(kb, (T, K_TOP), 0, E, dtype=jnp.int32)
                w = jax.random.uniform(ka, (T, K_TOP), F32)
                for path in paths:
                    if left() < 0:
                        return

                    def fn(i, s, x, w, ids0, path=path):
                        return getattr(moe, "routed_" + path)(x + s.astype(BF16), w, (ids0 + i * 37) % E)

                    tt, c = timeit(fn, x, w, ids0, reps=20 if T < 100 else 2)
                    emit(section="moe", tokens=T, path=path, numerics="bf16-reference", experts="int8",
                         ms=round(tt * 1e3, 3), compile_s=round(c, 1))

    # ---------------------------------------------------------------- sweeps
    if "sweep" not in skip:
        for cfg in ({"bo": 16, "bk": 256}, {"bo": 64, "bk": 256}, {"bo": 32, "bk": 512}, {"bo": 32, "bk": 128},
                    {"bo": 32, "bk": 256, "num_warps": 8}, {"bo": 64, "bk": 512, "num_warps": 8},
                    {"bo": 32, "bk": 256, "num_stages": 4}, {"bo": 16, "bk": 512, "num_warps": 2}):
            for name in ("w1", "w2"):
                if left() > 0:
                    guarded("sweep-gemv", proj=name, cfg=cfg)(lambda: gemv_case(name, 1, "triton", cfg=cfg))
        for cfg in ({"bo": 128, "bk": 128}, {"bo": 64, "bk": 64}, {"bo": 128, "bk": 64, "split": True},
                    {"bo": 128, "bk": 64, "num_warps": 4}, {"bo": 128, "bk": 64, "num_stages": 4},
                    {"bo": 256, "bk": 64, "num_warps": 8}):
            for name in ("w1", "w2"):
                if left() > 0:
                    guarded("sweep-gemm", proj=name, cfg=cfg)(lambda: gemm_case(name, "triton", cfg=cfg))
    emit(section="done", elapsed_s=round(time.time() - T0, 1))


if __name__ == "__main__":
    main()
