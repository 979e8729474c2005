"""Grouped quantized matmul (dsv41_jax.kernels.qmatmul) on the GPU: correctness at real sizes and
timings against the XLA paths. Prints one JSON line per measurement (also to --out).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/bench_qmatmul.py [--budget 200] [--out F]

Sections (in priority order; the script stops starting new ones after --budget seconds):
  check   kernel vs XLA reference at V4.1-Flash expert sizes (int8 + ue8m0) and dense fp8
  sweep   tile / mode / warp variants of the gemv, gemm and dense-fp8 kernels
  gemv    decode: batch 1 / 8 tokens x 6 experts, int8 experts [384, 2304, 5120] / [384, 5120, 2304];
          effective TB/s of bytes read (codes + scales + x) vs the XLA gather path (gather +
          dequantize + einsum) and vs bf16 experts
  gemm    prefill: 8192 tokens x 6 slots sorted into 128-row expert blocks; TFLOP/s vs the
          fori_loop over blocks of MoE.routed_grouped (one projection)
  dense   fp8 e4m3 [32768, 5120] with ue8m0 scales, batch 1..64, vs XLA dequantize + matmul
  moe     the whole routed MoE (int8 experts): pallas (decode tile variants) vs gather / grouped
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types
import warnings

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

# A benchmark that closes over its weights bakes them into the executable as constants: the
# compile then takes minutes (session 21 lost a device call to 9.3 GB of them). Fail at once instead:
# every timed input must be an argument.
jax.config.update("jax_captured_constants_warn_bytes", 64 << 20)
warnings.filterwarnings("error", message="A large amount of constants were captured")


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
            # the whole output feeds the next iteration: nothing can be sliced away or hoisted
            return s + jnp.sum(y.astype(F32)) * 0.0
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

    # ceiling: device read bandwidth
    @guarded("ceiling")
    def _():
        if "ceiling" in skip:
            return
        a = jnp.ones((1 << 30,), jnp.uint16)  # 2 GiB
        t, _c = timeit(lambda i, s, a: a + s.astype(jnp.uint16), a, reps=10)  # read + sum; write fused away
        emit(section="ceiling", what="read", TBps=round(a.nbytes / t / 1e12, 3))

    # ---------------------------------------------------------------- check (real sizes)
    if "check" not in skip:
        rng = np.random.default_rng(0)
        acc = dict(mode="reduce", acc=True)
        cases = {"w1": ((1, 12, {}), (1, 12, acc), (1, 12, {"mode": "dot"}), (8, 2, {}), (128, 4, {}),
                        (128, 4, {"mode": "dot", "split": True})),
                 "w2": ((1, 12, acc), (1, 12, {"mode": "dot"}), (128, 4, {}))}
        for name, ((codes, scale), O, K) in shapes.items():
            for bm, nb, kw in cases[name]:
                if left() < 0:
                    break

                @guarded("check", proj=name, bm=bm, cfg=kw)
                def _():
                    x = jax.random.normal(kx, (nb * bm, K), F32).astype(BF16)
                    bg = jnp.asarray(rng.integers(0, E, nb), jnp.int32).at[0].set(E - 1)
                    used = nb - 1
                    t = time.time()
                    got = jax.jit(lambda x, bg, c, s: Q.grouped_qmatmul(x, bg, used, c, s, bm=bm, out_dtype=F32,
                                                                        impl=IMPL, **kw))(x, bg, codes, scale)
                    got = jax.block_until_ready(got)
                    ref = Q.grouped_qmatmul_reference(x, bg, used, codes, scale, bm=bm, out_dtype=F32)
                    emit(section="check", proj=name, bm=bm, cfg=kw, rel_err=rel_err(got, ref),
                         tail_zero=bool(jnp.all(got[used * bm:] == 0)), compile_s=round(time.time() - t, 1))

        @guarded("check", proj="dense-fp8")
        def _():
            O, K = DENSE_O + 96, D  # an output width no tile divides
            w = (jax.random.normal(kx, (O, K), F32) * 4).astype(jnp.float8_e4m3fn)
            s = jax.random.randint(ka, (O, K // 32), 120, 127, dtype=jnp.int32).astype(jnp.uint8)
            for B, kw in ((1, {}), (1, {"mode": "dot"}), (8, {}), (64, {})):
                x = jax.random.normal(kb, (B, K), F32).astype(BF16)
                got = Q.grouped_qmatmul(x, jnp.zeros((1,), jnp.int32), 1, w, s, bm=B, out_dtype=F32, impl=IMPL, **kw)
                ref = Q.grouped_qmatmul_reference(x, jnp.zeros((1,), jnp.int32), 1, w, s, bm=B, out_dtype=F32)
                emit(section="check", proj="dense-fp8", O=O, bm=B, cfg=kw, rel_err=rel_err(got, ref))

    # ---------------------------------------------------------------- gemv (decode)
    def gemv_case(name, batch, impl, cfg=None, wts=None, section="gemv"):
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
        nbytes = pairs * (O * K + O * K // 32) + pairs * K * 2 if scale is not None else pairs * O * K * 2 + pairs * K * 2
        emit(section=section, proj=name, batch=batch, pairs=pairs, impl=impl,
             weights="bf16" if scale is None else "int8", cfg=cfg, us=round(t * 1e6, 1),
             TBps=round(nbytes / t / 1e12, 3), compile_s=round(c, 1))

    # ---------------------------------------------------------------- gemm (prefill)
    from dsv41_jax.model.moe import MoE

    def gemm_layout(c, tokens=None):
        tokens = TOKENS if tokens is None else tokens
        ids = jax.random.randint(kx, (tokens, K_TOP), 0, E, dtype=jnp.int32)
        order, pidx, NC, blocks, n_used = MoE._blocks(types.SimpleNamespace(n_experts=E), ids, c)
        return NC, blocks, n_used, tokens * K_TOP

    def gemm_case(name, impl, c=128, cfg=None, section="gemm"):
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
        emit(section=section, proj=name, tokens=TOKENS, pairs=N, chunk=c, blocks_used=int(n_used), impl=impl,
             cfg=cfg, ms=round(t * 1e3, 3), TFLOPs=round(2 * N * O * K / t / 1e12, 1),
             TFLOPs_padded=round(2 * int(n_used) * c * O * K / t / 1e12, 1), compile_s=round(comp, 1))

    # ---------------------------------------------------------------- dense fp8 GEMV
    dense_w = {}

    def dense_case(B, impl, cfg=None, section="dense", bm=None):
        O, K = DENSE_O, D
        if not dense_w:
            dense_w["w"] = (jax.random.normal(kx, (O, K), F32) * 4).astype(jnp.float8_e4m3fn)
            dense_w["s"] = jax.random.randint(ka, (O, K // 32), 120, 127, dtype=jnp.int32).astype(jnp.uint8)
            dense_w["wb"] = jax.random.normal(kx, (O, K), F32).astype(BF16)
        bm = B if bm is None else bm
        g0 = jnp.zeros((B // bm,), jnp.int32)
        x = jax.random.normal(kb, (B, K), F32).astype(BF16)
        cfg = cfg or {}

        def fn(i, s_, x, w, s, wb):
            xi = x + s_.astype(BF16)
            if impl == "xla-dequant":
                return Q.grouped_qmatmul_reference(xi, g0, B // bm, w, s, bm=bm, out_dtype=BF16)
            if impl == "xla-bf16":
                return jnp.einsum("bk,ok->bo", xi, wb, preferred_element_type=F32).astype(BF16)
            return Q.grouped_qmatmul(xi, g0, B // bm, w, s, bm=bm, out_dtype=BF16, impl=IMPL, **cfg)

        t, c = timeit(fn, x, dense_w["w"], dense_w["s"], dense_w["wb"], reps=20 if B <= 64 else 3)
        nbytes = O * K * (2 if impl == "xla-bf16" else 1) + (O * K // 32 if impl != "xla-bf16" else 0) + B * K * 2
        emit(section=section, O=O, K=K, batch=B, bm=bm, impl=impl, cfg=cfg, us=round(t * 1e6, 1),
             TBps=round(nbytes / t / 1e12, 3), TFLOPs=round(2 * B * O * K / t / 1e12, 1), compile_s=round(c, 1))

    # ---------------------------------------------------------------- sweeps (tile / mode variants)
    gemv_cfgs = [dict(mode="reduce", acc=True, bo=32, bk=256), dict(mode="reduce", acc=True, bo=16, bk=256),
                 dict(mode="reduce", acc=True, bo=64, bk=256, num_warps=8), dict(mode="reduce", acc=True, bo=32, bk=512, num_warps=8),
                 dict(mode="reduce", acc=True, bo=16, bk=512), dict(mode="dot", bo=64, bk=128), dict(mode="dot", bo=128, bk=128),
                 dict(mode="dot", bo=64, bk=256), dict(mode="dot", bo=128, bk=64), dict(mode="dot", bo=32, bk=256),
                 dict(mode="dot", bo=64, bk=128, num_warps=8)]
    if "sweep" not in skip:
        for cfg in gemv_cfgs:
            for name in ("w1", "w2"):
                for batch in (1, 8):
                    if left() > 0:
                        guarded("sweep-gemv", proj=name, cfg=cfg)(
                            lambda: gemv_case(name, batch, "triton", cfg=cfg, section="sweep-gemv"))
        for c, cfg in ((128, dict(bo=128, bk=64, num_warps=4)), (128, dict(bo=64, bk=64, num_warps=4)),
                       (128, dict(bo=64, bk=128, num_warps=4)), (64, dict(bo=128, bk=64)), (64, dict(bo=64, bk=64)),
                       (64, dict(bo=128, bk=128)), (64, dict(bo=128, bk=64, num_warps=8))):
            for name in ("w1", "w2"):
                if left() > 0:
                    guarded("sweep-gemm", proj=name, c=c, cfg=cfg)(
                        lambda: gemm_case(name, "triton", c=c, cfg=cfg, section="sweep-gemm"))
        for B in (1, 8, 64):
            for cfg in ([dict(mode="reduce", acc=True, bo=32, bk=256), dict(mode="reduce", acc=True, bo=16, bk=512)]
                        if B == 1 else []) + [dict(mode="dot", bo=64, bk=128), dict(mode="dot", bo=128, bk=128),
                                             dict(mode="dot", bo=64, bk=256), dict(mode="dot", bo=256, bk=64),
                                             dict(mode="dot", bo=32, bk=256)]:
                if left() > 0:
                    guarded("sweep-dense", batch=B, cfg=cfg)(lambda: dense_case(B, "triton", cfg=cfg, section="sweep-dense"))
        for cfg in ({}, dict(group_rows=8), dict(group_rows=16), dict(bo=128, bk=128, group_rows=8)):
            if left() > 0:  # dense prefill: 2048 rows in 64-row blocks on one weight (launch order)
                guarded("sweep-dense", batch=2048, cfg=cfg)(
                    lambda: dense_case(2048, "triton", cfg=cfg, section="sweep-dense", bm=64))
        for cfg in (dict(mode="reduce", acc=True, bo=32, bk=256), dict(mode="dot", bo=64, bk=128)):
            if left() > 0:
                @guarded("sweep-gemv", weights="bf16")
                def _():
                    wb = jax.random.normal(kx, (E, I, D), F32).astype(BF16)
                    shapes["w1b"] = ((None, None), I, D)
                    for batch in (1, 8):
                        gemv_case("w1b", batch, "triton", cfg=cfg, wts=wb, section="sweep-gemv")

    # ---------------------------------------------------------------- baselines
    if "gemv" not in skip:
        for name in ("w1", "w2"):
            for batch in (1, 8):
                for impl in ("triton", "xla-gather"):
                    if left() > 0:
                        guarded("gemv", proj=name, batch=batch, impl=impl)(lambda: gemv_case(name, batch, impl))
    if "gemm" not in skip:
        for name in ("w1", "w2"):
            for impl in ("triton", "xla-fori"):
                if left() > 0:
                    guarded("gemm", proj=name, impl=impl)(lambda: gemm_case(name, impl))
    if "dense" not in skip:
        for B in (1, 8, 16, 64):
            for impl in ("triton", "xla-dequant", "xla-bf16"):
                if left() > 0:
                    guarded("dense", batch=B, impl=impl)(lambda: dense_case(B, impl))

    # ---------------------------------------------------------------- whole routed MoE
    if "moe" not in skip and left() > 0:
        @guarded("moe")
        def _():
            import dsv41_jax.model.moe as M
            from dsv41_jax.config import preset
            from dsv41_jax.numerics import Numerics

            t = preset("v41-flash").text
            assert args.smoke or (t.n_routed_experts, t.hidden_size, t.moe_intermediate_size) == (E, D, I)

            class View:  # what MoE.routed_* read, without zero-initialised parameters
                def __getattr__(self, name):
                    return getattr(MoE, name).__get__(self, View)

            sw = types.SimpleNamespace

            def view(w13c, w13s, w2c, w2s):
                moe = View()
                moe.numerics, moe.limit, moe.n_experts = Numerics("bfloat16", "reference"), t.swiglu_limit, E
                moe.experts = sw(quantized=True, w1=sw(int8=True, weight=w13c, scale=w13s),
                                 w3=sw(int8=True, weight=w13c, scale=w13s), w2=sw(int8=True, weight=w2c, scale=w2s))
                for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
                    p.take = (lambda p: lambda ids, dt: Q.dequantize(p.weight[ids], p.scale[ids], dt))(p)
                return moe

            gemv_default = dict(Q.TUNING["small"])
            chunk_default = M.pallas_chunk
            variants = {"pallas": None, "pallas-dot128x128": dict(mode="dot", bo=128, bk=128, num_warps=4, num_stages=3),
                        "pallas-acc16x256": dict(mode="reduce", acc=True, bo=16, bk=256, num_warps=4, num_stages=3),
                        "pallas-c64": 64}
            for T in (1, 8, TOKENS):
                decode = T * K_TOP < E
                paths = (["pallas", "pallas-dot128x128", "pallas-acc16x256", "gather"] if decode
                         else ["pallas", "pallas-c64", "grouped"])
                x = jax.random.normal(kx, (T, D), F32).astype(BF16)
                ids0 = jax.random.randint(kb, (T, K_TOP), 0, E, dtype=jnp.int32)
                w = jax.random.uniform(ka, (T, K_TOP), F32)
                for path in paths:
                    if left() < 0:
                        return
                    v = variants.get(path)
                    Q.TUNING["small"] = v if isinstance(v, dict) else gemv_default
                    M.pallas_chunk = (lambda n, e, v=v: v) if isinstance(v, int) else chunk_default
                    meth = "routed_" + path.split("-")[0]

                    def fn(i, s, x, w, ids0, *ws, meth=meth):
                        return getattr(view(*ws), meth)(x + s.astype(BF16), w, (ids0 + i * 37) % E)

                    tt, c = timeit(fn, x, w, ids0, *W13, *W2, reps=20 if T < 100 else 2)
                    emit(section="moe", tokens=T, path=path, numerics="bf16-reference", experts="int8",
                         ms=round(tt * 1e3, 3), compile_s=round(c, 1))
                Q.TUNING["small"], M.pallas_chunk = gemv_default, chunk_default

    emit(section="done", elapsed_s=round(time.time() - T0, 1))


if __name__ == "__main__":
    main()
