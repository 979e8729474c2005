"""Tile sweep of the decode GEMVs of ``grouped_qmatmul`` (batch-1 decode shapes of V4.1-Flash):
split-K x output tile first, then K step / pipeline stages / warps around the best. One JSON
line per config (also appended to $OUT/sweep_gemv.jsonl); the last line per case is the best.

``--grid wlhs`` compares the weight tile on the left of the dot (``Config.wlhs``: weights as
the MMA's A operand, in registers) with the default operand order, on the decode cases and on
the prefill MoE blocks (``prefill_w1`` / ``prefill_w2``: 8192 tokens x 6 pairs sorted into
128-row blocks, as ``MoE.routed_pallas`` lays them out).

    python3 benchmarks/sweep_gemv.py [--cases routed_w1,routed_w2,dense_2304x5120,dense_5120x8192]
    python3 benchmarks/sweep_gemv.py --grid wlhs --cases routed_w1,routed_w2,dense_2304x5120,prefill_w1,prefill_w2
    python3 benchmarks/sweep_gemv.py --grid xla --cases routed_w1,dense_2304x5120,dense_5120x8192
    python3 benchmarks/sweep_gemv.py --grid chunk --cases routed_w1,routed_w2,dense_2304x5120,dense_5120x8192

``--grid chunk`` compares the one-row "chunk" mode (unscaled codes against a block-diagonal
activation tile, per-32 partial sums scaled after the MMA) with the "dot" mode it replaced
(``mode=dot, bk=128``) and sweeps its output tile, warps, stages and split-K.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_qmatmul as bq  # noqa: E402
import bench_slice as bs  # noqa: E402
from dsv41_jax.kernels import qmatmul as Q  # noqa: E402

IMPL = "triton"
CASES = {  # name: (groups, O, K, pairs (rows; one row block each when groups > 1), codes dtype)
    "routed_w1": (384, 2304, 5120, 6, "int8"),
    "routed_w2": (384, 5120, 2304, 6, "int8"),
    "dense_2304x5120": (1, 2304, 5120, 1, "fp8"),
    "dense_5120x8192": (1, 5120, 8192, 1, "fp8"),
}
PREFILL = {"prefill_w1": (384, 2304, 5120, 8192), "prefill_w2": (384, 5120, 2304, 8192)}  # G, O, K, tokens
GRID = "tiles"


emit = bs.jsonl_emitter("sweep_gemv.jsonl")


def grid_configs(prefill: bool):
    """``wlhs``: the default operand order and the weights-left order over the tiles that matter
    for each (``{}`` is the default, whatever ``TUNING`` says; ``wlhs=False`` rows pin the old one)."""
    yield {}
    if prefill:
        yield dict(wlhs=False, bo=128, bk=64, num_warps=8)
        for bo, bk, w in ((128, 64, None), (64, 64, 4), (128, 64, 4), (128, 128, 8), (256, 64, 8)):
            yield dict(wlhs=True, bo=bo, bk=bk, num_warps=w)
        return
    if GRID == "chunk":
        yield dict(mode="dot", bk=128)
        yield dict(mode="chunk", bo=64)
        for extra in (dict(bo=16), dict(num_stages=2), dict(splitk=1), dict(splitk=2), dict(splitk=4),
                      dict(splitk=1, num_stages=2), dict(splitk=2, num_stages=2), dict(num_warps=2)):
            yield dict(mode="chunk", **extra)
        return
    yield dict(wlhs=True)
    for s in (2, 4, 8, 16):
        for bo in (64, 128):
            yield dict(wlhs=True, splitk=s, bo=bo)
    for extra in (dict(bk=256), dict(bk=64), dict(num_stages=4), dict(num_warps=8, bo=128)):
        yield dict(wlhs=True, **extra)


def run_prefill(name, key):
    from dsv41_jax.model.moe import MoE

    G, O, K, T = PREFILL[name]
    k1, k2 = jax.random.split(key)
    codes, scale = bq.make_int8(k1, G, O, K)
    ids = jax.random.randint(k2, (T, 6), 0, G, dtype=jnp.int32)
    c = 128
    _, _, NC, blocks, n_used = MoE._blocks(types.SimpleNamespace(n_experts=G), ids, c)
    x = jax.random.normal(k1, (NC * c, K), jnp.float32).astype(jnp.bfloat16)
    flops = 2 * T * 6 * O * K
    results = []
    base = None
    for cfg in grid_configs(True):
        def fn(i, s, x, blocks, n_used, codes, scale, cfg=cfg):
            return Q.grouped_qmatmul(x + s.astype(jnp.bfloat16), blocks, n_used, codes, scale, bm=c,
                                     out_dtype=jnp.bfloat16, impl=IMPL, **cfg)
        try:
            t, comp = bq.timeit(fn, x, blocks, n_used, codes, scale, reps=3)
            results.append((t, cfg))
            # against the default operand order (checked against the XLA reference in bench_qmatmul)
            y = Q.grouped_qmatmul(x, blocks, n_used, codes, scale, bm=c, out_dtype=jnp.float32, impl=IMPL, **cfg)
            base = y if base is None else base
            emit(case=name, cfg=cfg, ms=round(t * 1e3, 3), TFLOPs=round(flops / t / 1e12, 1), compile_s=round(comp, 1),
                 rel_to_default=bq.rel_err(y, base))
        except Exception as e:  # noqa: BLE001
            emit(case=name, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
    if results:
        t, cfg = min(results, key=lambda r: r[0])
        emit(case=name, best=cfg, ms=round(t * 1e3, 3), TFLOPs=round(flops / t / 1e12, 1))


def run_xla(name, x, ids0, codes, scale, nbytes, one):
    """The kernel's default against XLA on the same GEMV: the dequantizing einsum
    (``grouped_qmatmul_reference``: XLA fuses what it can) and a plain bf16 weight (twice the
    bytes; what XLA's own GEMM reaches). The optimized HLO of the dequantizing form goes to
    $OUT/sweep_xla_<case>.hlo.txt (which fusions read the codes)."""
    R = x.shape[0]
    G = codes.shape[0]
    one({})
    w16 = Q.dequantize(codes, scale, jnp.bfloat16)
    for form in ("xla_dequant", "xla_bf16"):
        def fn(i, s, x, codes, scale, w16, form=form):
            ids = (ids0 + i * 37) % G
            xs = x + s.astype(jnp.bfloat16)
            if form == "xla_dequant":
                return Q.grouped_qmatmul_reference(xs, ids, R, codes, scale, bm=1, out_dtype=jnp.bfloat16)
            if G == 1:
                return jnp.einsum("rk,ok->ro", xs, w16[0], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return jnp.einsum("rk,rok->ro", xs, w16[ids], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        try:
            t, c = bq.timeit(fn, x, codes, scale, w16, reps=50)
            nb = nbytes if form == "xla_dequant" else R * codes.shape[1] * codes.shape[2] * 2 + R * x.shape[1] * 2
            emit(case=name, cfg=form, us=round(t * 1e6, 2), TBps=round(nb / t / 1e12, 3), compile_s=round(c, 1))
        except Exception as e:  # noqa: BLE001
            emit(case=name, cfg=form, error=f"{type(e).__name__}: {str(e)[:200]}")
    out = os.environ.get("OUT")
    if out:
        hlo = jax.jit(lambda x, c, s: Q.grouped_qmatmul_reference(x, ids0, R, c, s, bm=1, out_dtype=jnp.bfloat16)
                      ).lower(x, codes, scale).compile().as_text()
        with open(os.path.join(out, f"sweep_xla_{name}.hlo.txt"), "w") as f:
            f.write(hlo)


def run_case(name, key):
    if name in PREFILL:
        return run_prefill(name, key)
    G, O, K, R, kind = CASES[name]
    k1, k2, k3 = jax.random.split(key, 3)
    if kind == "int8":
        codes, scale = bq.make_int8(k1, G, O, K)
    else:
        codes = jax.random.normal(k1, (G, O, K), jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jax.random.randint(k2, (G, O, K // 32), 118, 126).astype(jnp.uint8)
    x = jax.random.normal(k3, (R, K), jnp.float32).astype(jnp.bfloat16)
    ids0 = jnp.asarray(np.random.default_rng(0).integers(0, G, R), jnp.int32)
    nbytes = R * (O * K + O * K // 32) + R * K * 2
    results = []

    def one(cfg):
        def fn(i, s, x, codes, scale):
            ids = (ids0 + i * 37) % G
            return Q.grouped_qmatmul(x + s.astype(jnp.bfloat16), ids, R, codes, scale, bm=1, out_dtype=jnp.bfloat16,
                                     impl=IMPL, **cfg)
        try:
            t, c = bq.timeit(fn, x, codes, scale, reps=50)
            row = dict(case=name, cfg=cfg, us=round(t * 1e6, 2), TBps=round(nbytes / t / 1e12, 3), compile_s=round(c, 1))
            if GRID != "tiles":  # against the XLA reference, fp32 outputs
                got = Q.grouped_qmatmul(x, ids0, R, codes, scale, bm=1, out_dtype=jnp.float32, impl=IMPL, **cfg)
                row["rel_err"] = bq.rel_err(got, Q.grouped_qmatmul_reference(x, ids0, R, codes, scale, bm=1,
                                                                            out_dtype=jnp.float32))
            results.append((t, cfg))
        except Exception as e:  # noqa: BLE001
            row = dict(case=name, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
        emit(**row)

    if GRID == "xla":
        return run_xla(name, x, ids0, codes, scale, nbytes, one)
    if GRID != "tiles":
        for cfg in grid_configs(False):
            one(cfg)
        t, cfg = min(results, key=lambda r: r[0])
        emit(case=name, best=cfg, us=round(t * 1e6, 2), TBps=round(nbytes / t / 1e12, 3))
        return
    one({})  # the defaults (auto split-K)
    for s in (1, 2, 4, 8, 16):
        for bo in (32, 64, 128):
            if K % (s * 32) == 0:
                one(dict(splitk=s, bo=bo))
    best = min(results, key=lambda r: r[0])[1]
    for extra in (dict(bk=64), dict(bk=256), dict(num_stages=4), dict(num_stages=2), dict(num_warps=2),
                  dict(num_warps=8), dict(split=True)):
        one({**best, **extra})
    t, cfg = min(results, key=lambda r: r[0])
    emit(case=name, best=cfg, us=round(t * 1e6, 2), TBps=round(nbytes / t / 1e12, 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--grid", choices=("tiles", "wlhs", "xla", "chunk"), default="tiles")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the Pallas interpreter (CPU check)")
    a = ap.parse_args()
    global IMPL, GRID
    GRID = a.grid
    if a.smoke:
        IMPL = "interpret"
        CASES.update({"routed_w1": (8, 64, 256, 2, "int8"), "dense_2304x5120": (1, 64, 256, 1, "fp8")})
        PREFILL.update({"prefill_w1": (8, 64, 256, 64)})
        a.cases = "routed_w1,dense_2304x5120" + (",prefill_w1" if GRID != "tiles" else "")
    for i, name in enumerate(a.cases.split(",")):
        run_case(name, jax.random.key(i))


if __name__ == "__main__":
    main()
