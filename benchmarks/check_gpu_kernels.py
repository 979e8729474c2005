"""GPU-side agreement of the Pallas kernels with their XLA references at V4.1 sizes (one JSON
line per case): the mHC Sinkhorn (relative and per-entry error) and the grouped qmatmul in its
split-K decode configurations (int8 experts: the "chunk" mode, against the "dot" mode too; dense
fp8) and its prefill blocks (128-row expert blocks, 160 = 128 + 32 and 48 = 32 + 16-row blocks as
two row tiles, 64-row dense fp8 blocks: the weights-left operand order, against the other order
too), and fused launches (``grouped_qmatmul_fused``:
routed w1 + w3 at decode and prefill, dense wq_a + wkv and shared w1 + w3 at decode) against one
reference per weight and, with the same split-K, bit for bit against separate launches; and a
multi-problem launch (``grouped_qmatmul_multi``: the decode MoE's routed w1 + w3 beside the
shared expert's fp8 w1 + w3) bit for bit against each problem's own launch; and the indexer-score
kernel (``kernels.indexer_scores``, V4.1's 32 index heads x 128) against its XLA formulation in
bf16 and fp32 (the -inf mask equal, finite scores within the summation-order error); and the
one-pass mHC mixes (``kernels.mhc_mix``) against their XLA formulation; and the fused RMSNorm +
fp8 act-quant (``kernels.norm_quant``) against its jnp form; and the decode mHC pair
(``kernels.mhc_mix.hc_mixes_decode``) against ``hc_mixes``' XLA form.

    python3 benchmarks/check_gpu_kernels.py
    python3 benchmarks/check_gpu_kernels.py split_tail   # only the split-tail launches (run 28)
    python3 benchmarks/check_gpu_kernels.py gemm_out     # only the bf16-result GEMMs (run 29)
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
from dsv41_jax.kernels.indexer import indexer_scores, indexer_scores_reference  # noqa: E402
from dsv41_jax.kernels.sinkhorn import sinkhorn, sinkhorn_reference  # noqa: E402


emit = bs.jsonl_emitter("check_gpu_kernels.jsonl")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_sinkhorn(key):
    """The mHC Sinkhorn kernel against its XLA form: one-token, masked and full token blocks."""
    for T in (1, 3, 8, 64, 100, 8192):
        x = 3.0 * jax.random.normal(jax.random.fold_in(key, T), (T, 16), jnp.float32)
        got = jax.jit(lambda v: sinkhorn(v, 20, 1e-6, "triton"))(x)
        want = jax.jit(lambda v: sinkhorn_reference(v, 20, 1e-6))(x)
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        emit(check="sinkhorn", tokens=T, rel_err=rel(got, want),
             max_elem_rel=float(np.max(np.abs(g - w) / np.maximum(np.abs(w), 1e-30))))


def main():
    key = jax.random.key(0)
    check_sinkhorn(key)
    E, D, I = 384, 5120, 2304
    for name, G, O, K, R, kind, bm in (
            ("routed_w1", E, I, D, 6, "int8", 1), ("routed_w2", E, D, I, 6, "int8", 1),
            ("routed_w1_b8", E, I, D, 48, "int8", 1), ("dense_fp8_b1", 1, 2304, D, 1, "fp8", 1),
            ("dense_fp8_b16", 1, 512, D, 16, "fp8", 16), ("routed_w1_prefill", E, I, D, 512, "int8", 128),
            ("routed_w2_prefill", E, D, I, 512, "int8", 128), ("dense_fp8_prefill", 1, 2304, D, 256, "fp8", 64),
            ("routed_w1_prefill160", E, I, D, 640, "int8", 160), ("routed_w2_prefill48", E, D, I, 192, "int8", 48)):
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
        emit(check="qmatmul", case=name, mode=cfg.mode, splitk=cfg.splitk, bk=cfg.bk, wlhs=cfg.wlhs, tail=cfg.tail,
             rel_err=rel(got, want),
             lowp_rel_err=rel(lowp, want), lowp_vs_f32_max_abs=float(jnp.max(jnp.abs(lowp - f32))),
             other_order_rel_err=rel(other, want))
    for name, G, Os, K, R, kind, bm in (
            ("fused_routed_w1w3", E, (I, I), D, 6, "int8", 1), ("fused_routed_w1w3_b8", E, (I, I), D, 48, "int8", 1),
            ("fused_routed_w1w3_prefill", E, (I, I), D, 512, "int8", 128),
            ("fused_routed_w1w3_prefill160", E, (I, I), D, 640, "int8", 160),
            ("fused_wq_a_wkv", 1, (1280, 512), D, 1, "fp8", 1), ("fused_shared_w1w3", 1, (I, I), D, 1, "fp8", 1)):
        ks = jax.random.split(jax.random.fold_in(key, R * 11 + sum(Os)), 2 + 2 * len(Os))
        ws = []
        for i, O in enumerate(Os):
            if kind == "int8":
                codes = jax.random.randint(ks[2 + 2 * i], (G, O, K), -12, 13).astype(jnp.int8)
            else:
                codes = jax.random.normal(ks[2 + 2 * i], (G, O, K), jnp.float32).astype(jnp.float8_e4m3fn)
            ws.append((codes, jax.random.randint(ks[3 + 2 * i], (G, O, K // 32), 118, 126).astype(jnp.uint8)))
        x = jax.random.normal(ks[0], (R, K), jnp.float32).astype(jnp.bfloat16)
        bg = jax.random.randint(ks[1], (R // bm,), 0, G).astype(jnp.int32)
        cfg = Q.choose_config(bm, max(Os), K, True, nb=R // bm, groups=G, outs=list(Os))
        got = jax.jit(lambda x, bg, ws: Q.grouped_qmatmul_fused(x, bg, R // bm, ws, bm=bm, out_dtype=jnp.float32,
                                                                impl="triton"))(x, bg, ws)
        for i, (c, sc) in enumerate(ws):
            want = jax.jit(lambda *a: Q.grouped_qmatmul_reference(*a, bm=bm, out_dtype=jnp.float32))(
                x, bg, R // bm, c, sc)
            alone = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=jnp.float32, impl="triton",
                                                         splitk=cfg.splitk))(x, bg, R // bm, c, sc)
            emit(check="qmatmul_fused", case=name, weight=i, mode=cfg.mode, splitk=cfg.splitk,
                 rel_err=rel(got[i], want), bits_equal_to_separate=bool(jnp.array_equal(got[i], alone)))
        if name == "fused_routed_w1w3":
            routed = (x, bg, ws)
        if name == "fused_shared_w1w3":
            check_multi(routed, (x, [(c[0], sc[0]) for c, sc in ws]))


def check_indexer(key):
    """Prefill-sized indexer scores (a causal ratio-2 chunk and a ratio-1 chunk after a prefix)."""
    for dt in (jnp.bfloat16, jnp.float32):
        for S, T, m, offset in ((2048, 1024, 2, 0), (1000, 3000, 1, 2000)):
            k1, k2, k3 = jax.random.split(jax.random.fold_in(key, S + T), 3)
            q = jax.random.normal(k1, (1, S, 32, 128), jnp.float32).astype(dt)
            k = jax.random.normal(k2, (1, T, 128), jnp.float32).astype(dt)
            w = (0.01 * jax.random.normal(k3, (1, S, 32), jnp.float32)).astype(dt)
            n_vis = ((offset + jnp.arange(S) + 1) // m)[None].astype(jnp.int32)
            got = np.asarray(jax.jit(lambda *a: indexer_scores(*a, impl="triton"))(q, k, w, n_vis), np.float64)
            want = np.asarray(jax.jit(indexer_scores_reference)(q, k, w, n_vis), np.float64)
            fin = np.isfinite(want)
            emit(check="indexer_scores", dtype=jnp.dtype(dt).name, queries=S, keys=T, ratio=m,
                 mask_equal=bool(np.array_equal(np.isfinite(got), fin)),
                 rel_err=rel(np.where(fin, got, 0), np.where(fin, want, 0)),
                 frac_bits_equal=float(np.mean(got[fin] == want[fin])))


def check_mhc_mix(key):
    """The one-pass mHC mixes (``kernels.mhc_mix``) at V4.1 width (4 x 5120 stream, 24 outputs):
    an 8k prefill chunk and a short one, bf16 and fp32 streams."""
    from dsv41_jax.kernels.mhc_mix import hc_mix_sums, hc_mix_sums_reference

    for dt in (jnp.bfloat16, jnp.float32):
        for T in (8192, 100):
            k1, k2 = jax.random.split(jax.random.fold_in(key, T), 2)
            x = jax.random.normal(k1, (T, 4 * 5120), jnp.float32).astype(dt)
            fn = 0.02 * jax.random.normal(k2, (24, 4 * 5120), jnp.float32)
            mix, ss = jax.jit(lambda *a: hc_mix_sums(*a, impl="triton"))(x, fn)
            rmix, rss = jax.jit(hc_mix_sums_reference)(x, fn)
            emit(check="hc_mix_sums", dtype=jnp.dtype(dt).name, tokens=T, mix_rel_err=rel(mix, rmix),
                 ss_rel_err=rel(ss, rss))


def check_norm_quant(key):
    """The fused RMSNorm + fp8 act-quant kernel (``kernels.norm_quant``) against its jnp form at
    V4.1 widths: an mHC site (4 x 5120 stream collapsed first) and the q norm (1280), 1 and 64
    rows. The quantized rows are compared where the normed rows agree bit for bit (a one-ulp
    difference in the normed value may move a block's scale or code)."""
    from dsv41_jax.kernels.norm_quant import norm_quant, norm_quant_reference

    for D, n in ((5120, 4), (1280, 0)):
        for T in (1, 64):
            k1, k2, k3 = jax.random.split(jax.random.fold_in(key, D + T), 3)
            x = jax.random.normal(k1, (T, n, D) if n else (T, D), jnp.float32).astype(jnp.bfloat16)
            w = (1 + 0.1 * jax.random.normal(k2, (D,), jnp.float32)).astype(jnp.bfloat16)
            mix = jax.random.uniform(k3, (T, n)) + 0.5 if n else None
            xn, xq = jax.jit(lambda *a: norm_quant(*a, impl="triton"), static_argnums=2)(x, w, 1e-6, mix)
            rn, rq = jax.jit(norm_quant_reference, static_argnums=2)(x, w, 1e-6, mix)
            same = np.asarray(jnp.all(xn.reshape(-1, 32) == rn.reshape(-1, 32), axis=1))
            q, r = np.asarray(xq, np.float32).reshape(-1, 32), np.asarray(rq, np.float32).reshape(-1, 32)
            emit(check="norm_quant", width=D, hc=n, rows=T, xn_rel_err=rel(xn, rn),
                 xn_frac_bits_equal=float(np.mean(np.asarray(xn == rn))),
                 xq_blocks_equal_where_xn_equal=bool(np.array_equal(q[same], r[same])), xq_rel_err=rel(xq, rq))


def check_topk(key):
    """The decode indexer's ranking top-k (``kernels.topk``) against ``lax.top_k`` + sort: the same
    indices exactly, at the V4.1 decode shapes (512 of 4160 and of 2080 entries; 1 and 4 rows)
    with ties and -inf entries."""
    from dsv41_jax.kernels.topk import topk_ascending

    for R, T in ((1, 4160), (1, 2080), (4, 4160)):
        x = jnp.round(4 * jax.random.normal(jax.random.fold_in(key, R * T), (R, T))) / 4
        x = jnp.where(jnp.arange(T) >= T - 100, -jnp.inf, x)
        got = jax.jit(lambda a: topk_ascending(a, 512, impl="triton"))(x)
        want = jnp.sort(jax.lax.top_k(x, 512)[1], axis=-1)
        emit(check="topk_ascending", rows=R, entries=T, k=512, equal=bool(jnp.array_equal(got, want)))


def check_sparse_attn(key):
    """The experimental decode attention kernel (``kernels.sparse_attn``, off by default) against the
    model's jnp form at V4.1 decode shapes: 64 heads of 512, the 128-key ring, 512 selected
    entries (and a window-only layer), 1 and 4 tokens."""
    from dsv41_jax.kernels.sparse_attn import sparse_attn_decode
    from dsv41_jax.model.attention import sparse_attn

    bf = jnp.bfloat16
    for T, K in ((1, 512), (1, 0), (4, 512)):
        ks = jax.random.split(jax.random.fold_in(key, T * 1000 + K), 6)
        q = jax.random.normal(ks[0], (T, 1, 64, 512), jnp.float32).astype(bf)
        kw = jax.random.normal(ks[1], (T, 128, 512), jnp.float32).astype(bf)
        kw_ok = jax.random.uniform(ks[2], (T, 1, 128)) < 0.9
        kc = jax.random.normal(ks[3], (T, 1, K, 512), jnp.float32).astype(bf) if K else None
        kc_ok = jax.random.uniform(ks[4], (T, 1, K)) < 0.9 if K else None
        sink = jax.random.normal(ks[5], (64,), jnp.float32)
        want = jax.jit(lambda *a: sparse_attn(*a, 512 ** -0.5, bf))(q, kw, kw_ok, kc, kc_ok, sink)
        got = jax.jit(lambda q, kw, ok, kc, okc, s: sparse_attn_decode(
            q.reshape(T, 64, 512), kw, ok.reshape(T, 128), None if kc is None else kc.reshape(T, K, 512),
            None if kc is None else okc.reshape(T, K), s, 512 ** -0.5, impl="triton"))(q, kw, kw_ok, kc, kc_ok, sink)
        emit(check="sparse_attn_decode", tokens=T, entries=K, rel_err=rel(got.reshape(want.shape), want),
             frac_equal=float(jnp.mean(got.reshape(want.shape) == want)))


def check_mhc_decode(key):
    """The decode mHC pair (``kernels.mhc_mix.hc_mixes_decode``: split-K sums + the per-token
    epilogue with the Sinkhorn) against ``hc_mixes``' XLA path at V4.1 width, 1, 8 and 64 tokens."""
    from dsv41_jax.kernels.mhc_mix import hc_mixes_decode
    from dsv41_jax.kernels.sinkhorn import sinkhorn_reference

    n, D = 4, 5120
    for T in (1, 8, 64):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, T), 3)
        h = jax.random.normal(k1, (T, n * D), jnp.float32).astype(jnp.bfloat16)
        fn = 0.02 * jax.random.normal(k2, (24, n * D), jnp.float32)
        scale, base = jnp.asarray([0.5, 0.7, 1.3]), 0.1 * jax.random.normal(k3, (24,))

        def xla(h, fn, scale, base):
            x = h.astype(jnp.float32)
            m = jnp.einsum("ti,oi->to", x, fn, precision="highest") * jax.lax.rsqrt(
                jnp.mean(x * x, -1, keepdims=True) + 1e-6)
            pre = jax.nn.sigmoid(m[:, :n] * scale[0] + base[:n]) + 1e-6
            post = 2 * jax.nn.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])
            return pre, post, sinkhorn_reference(m[:, 2 * n:] * scale[2] + base[2 * n:], 20, 1e-6)

        got = jax.jit(lambda *a: hc_mixes_decode(*a, n=n, iters=20, norm_eps=1e-6, hc_eps=1e-6, impl="triton"))(
            h, fn, scale, base)
        want = jax.jit(xla)(h, fn, scale, base)
        emit(check="hc_mixes_decode", tokens=T, **{f"{k}_rel_err": rel(g, w) for k, g, w in
                                                    zip(("pre", "post", "comb"), got, want)})
        # with the site's norm rows (inside the FMA sums launch up to 4 tokens)
        w = (1 + 0.1 * jax.random.normal(k3, (D,), jnp.float32)).astype(jnp.bfloat16)
        pre_in = jax.random.uniform(k1, (T, n)) + 0.5
        res = jax.jit(lambda *a: hc_mixes_decode(*a[:4], n=n, iters=20, norm_eps=1e-6, hc_eps=1e-6, impl="triton",
                                                 norm=(a[4], 1e-6, a[5], True)))(h, fn, scale, base, w, pre_in)
        from dsv41_jax.kernels.norm_quant import norm_quant_reference

        rn, rq = jax.jit(lambda *a: norm_quant_reference(a[0].reshape(T, n, D), a[1], 1e-6, a[2]))(h, w, pre_in)
        emit(check="hc_mixes_decode_norm", tokens=T, comb_rel_err=rel(res[2], want[2]), xn_rel_err=rel(res[3], rn),
             xn_frac_bits_equal=float(np.mean(np.asarray(res[3] == rn))), xq_rel_err=rel(res[4], rq))


def check_multi(routed, shared):
    """The decode MoE's two w1 + w3 problems in one launch, against each alone and the reference."""
    f32 = jnp.float32

    def problems(xr, bgr, wr, xd, wd):
        return [dict(x=xr, block_group=bgr, n_blocks=xr.shape[0], weights=wr, bm=1, out_dtype=f32),
                dict(x=xd, block_group=jnp.zeros((1,), jnp.int32), n_blocks=1, weights=wd, bm=1, out_dtype=f32)]

    multi = jax.jit(lambda *a: Q.grouped_qmatmul_multi(problems(*a), impl="triton"))(*routed, *shared)
    for pi in range(2):
        def alone(*a, pi=pi):
            p = problems(*a)[pi]
            return Q.grouped_qmatmul_fused(p["x"], p["block_group"], p["n_blocks"], p["weights"], bm=1,
                                           out_dtype=f32, impl="triton")

        single = jax.jit(alone)(*routed, *shared)
        p = problems(*routed, *shared)[pi]
        for i, (c, sc) in enumerate(p["weights"]):
            want = jax.jit(lambda *a: Q.grouped_qmatmul_reference(*a, bm=1, out_dtype=f32))(
                p["x"], p["block_group"], p["n_blocks"], c, sc)
            emit(check="qmatmul_multi", problem=pi, weight=i, rel_err=rel(multi[pi][i], want),
                 bits_equal_to_alone=bool(jnp.array_equal(multi[pi][i], single[i])))


def check_split_tail(key):
    """The prefill's split-tail launches (``split_tail``: blocks whose pairs fit the 128-row tile
    without the 32-row tail, the others on both tiles, into the same output) for the routed w2 at
    V4.1 sizes: every written row against the reference, and the rows the one-launch form writes
    bit for bit."""
    E, D, I, bm, nb = 384, 5120, 2304, 160, 96
    k1, k2, k3, k4 = jax.random.split(key, 4)
    codes = jax.random.randint(k1, (E, D, I), -12, 13).astype(jnp.int8)
    scale = jax.random.randint(k2, (E, D, I // 32), 118, 130).astype(jnp.uint8)
    x = jax.random.normal(k3, (nb * bm, I), jnp.float32).astype(jnp.bfloat16)
    bg = jax.random.randint(k4, (nb,), 0, E).astype(jnp.int32)
    sel = (jnp.arange(nb) % 3 == 0).astype(jnp.int32)
    f32 = jnp.float32
    split = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=f32, impl="triton", split_tail=sel,
                                                 dead_zeros=False))(x, bg, nb - 4, codes, scale)
    one = jax.jit(lambda *a: Q.grouped_qmatmul(*a, bm=bm, out_dtype=f32, impl="triton"))(x, bg, nb - 4, codes, scale)
    want = jax.jit(lambda *a: Q.grouped_qmatmul_reference(*a, bm=bm, out_dtype=f32))(x, bg, nb - 4, codes, scale)
    r = jnp.arange(nb * bm)
    written = ((r % bm < 128) | (sel[r // bm] == 1)) & (r // bm < nb - 4)
    emit(check="qmatmul_split_tail", rel_err=rel(jnp.where(written[:, None], split, 0), jnp.where(written[:, None], want, 0)),
         bits_equal_to_one_launch=bool(jnp.array_equal(split[written], one[written])))


def check_gemm_out(key):
    """``layers.matmul``'s bf16-result GEMM (``DSV41_GEMM_BF16_OUT``) against the fp32 result
    rounded by a second pass, bit for bit, at the shapes of the V4.1-Flash Linears (out, in) and
    the row counts of a prefill and of decode steps; bf16 operands holding fp8-quantized inputs
    and dequantized fp8 weights, as in reference numerics."""
    from dsv41_jax.quant import act_quant_fp8

    shapes = [(1280, 5120), (512, 5120), (32768, 1280), (36864, 1280), (4096, 1280), (5120, 8192), (2304, 5120),
              (4608, 5120), (5120, 2304), (1024, 5120)]
    one = jax.jit(lambda a, b: jnp.einsum("ti,oi->to", a, b, preferred_element_type=jnp.bfloat16))
    two = jax.jit(lambda a, b: jnp.einsum("ti,oi->to", a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    for n, (O, K) in enumerate(shapes):
        kw, kx = jax.random.split(jax.random.fold_in(key, n))
        w = act_quant_fp8(jax.random.normal(kw, (O, K), jnp.float32) * 0.02, 32).astype(jnp.bfloat16)
        for T in (8192, 2048, 64, 1):
            x = jax.random.normal(jax.random.fold_in(kx, T), (T, K), jnp.float32)
            x = act_quant_fp8(x, 32).astype(jnp.bfloat16)
            a, b = one(x, w), two(x, w)
            emit(check="gemm_bf16_out", out=O, inp=K, rows=T, bits_equal=bool(jnp.array_equal(a, b)),
                 equal_frac=float(jnp.mean(a == b)), rel_err=rel(a, b))
    # the grouped wo_a einsum (8 groups of 4096 inputs -> 1024) at prefill row counts
    g1 = jax.jit(lambda a, b: jnp.einsum("tgd,grd->tgr", a, b, preferred_element_type=jnp.bfloat16))
    g2 = jax.jit(lambda a, b: jnp.einsum("tgd,grd->tgr", a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    w = act_quant_fp8(jax.random.normal(key, (8, 1024, 4096), jnp.float32) * 0.02, 32).astype(jnp.bfloat16)
    for T in (8192, 2048):
        o = jax.random.normal(jax.random.fold_in(key, T), (T, 8, 4096), jnp.float32).astype(jnp.bfloat16)
        a, b = g1(o, w), g2(o, w)
        emit(check="gemm_bf16_out", out="8x1024", inp=4096, rows=T, bits_equal=bool(jnp.array_equal(a, b)),
             equal_frac=float(jnp.mean(a == b)), rel_err=rel(a, b))


def _flash_moes(D, I, E, T, chunk):
    """(numerics, moe, x, w, ids) for fast and reference numerics: ``test_moe_glu.int8_moe`` at
    the given widths with T random tokens and their routing; sets ``DSV41_MOE_CHUNK``."""
    import importlib

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    int8_moe = importlib.import_module("test_moe_glu").int8_moe
    os.environ["DSV41_MOE_CHUNK"] = str(chunk)
    for numerics in ("bfloat16-fast", "bfloat16-reference"):
        moe, rng = int8_moe(numerics, 5, hidden_size=D, n_routed_experts=E, num_experts_per_tok=6,
                            moe_intermediate_size=I)
        x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
        yield (numerics, moe, x, *moe.gate(x))


def check_moe_mgpu(D=5120, I=2304, E=64, T=4096, chunk=160):
    """A prefill's routed experts through ``MoE.routed_pallas`` under each ``DSV41_MOE_PREFILL``
    (the Mosaic GPU kernels with the row layouts, and the Triton launches) against
    ``MoE.routed_grouped`` (XLA), in fast and reference numerics: int8 experts at V4.1-Flash widths
    (5120 -> 2304), 64 of them, 4096 tokens x 6 (160-row blocks, padded and unused blocks)."""
    from flax import nnx

    for numerics, moe, x, w, ids in _flash_moes(D, I, E, T, chunk):
        # the weights as arguments (a jitted bound method would capture them as constants)
        gdef, state = nnx.split(moe)

        def run(name):
            return jax.jit(lambda st, *a: getattr(nnx.merge(gdef, st), name)(*a))(state, x, w, ids)
        want = run("routed_grouped")
        for mode in ("triton", "mgpu-glu", "mgpu", "mgpu-w2"):
            os.environ["DSV41_MOE_PREFILL"] = mode
            got = run("routed_pallas")
            emit(check="moe_mgpu", numerics=numerics, mode=mode, rel_err=rel(got, want))
        # the scales kept in the kernel's layout (moe.keep_kernel_scales) and h's quantization of
        # the used rows (quant_used_rows): the same values as the per-call transposes and XLA's
        os.environ["DSV41_MOE_PREFILL"] = "mgpu-glu"
        os.environ.update(DSV41_MGPU_SCALES="transpose", DSV41_MOE_HQUANT="xla")
        base = run("routed_pallas")
        from dsv41_jax.model.moe import keep_kernel_scales

        keep_kernel_scales(moe, force=True)
        gdef, state = nnx.split(moe)
        os.environ.update(DSV41_MGPU_SCALES="kept", DSV41_MOE_HQUANT="kernel")
        got = run("routed_pallas")
        emit(check="moe_mgpu_kept_scales", numerics=numerics, equal_frac=float(jnp.mean(got == base)),
             rel_err=rel(got, want))
    from dsv41_jax import quant
    from dsv41_jax.kernels.moe_glu import quant_used_rows

    h = jax.random.normal(jax.random.key(4), (691 * chunk, I), jnp.float32)
    h = (h * jnp.exp2(jax.random.randint(jax.random.key(5), (691 * chunk, 1), -20, 12))).astype(jnp.bfloat16)
    nb = 400
    q = jax.jit(lambda a, n: quant_used_rows(a, n, bm=chunk))(h, nb)
    ref = quant.act_quant_fp8(h.astype(jnp.float32), 32).astype(jnp.bfloat16)
    emit(check="quant_used_rows", used_equal_frac=float(jnp.mean(q[:nb * chunk] == ref[:nb * chunk])),
         rest_unchanged_frac=float(jnp.mean(q[nb * chunk:] == h[nb * chunk:])))
    for k in ("DSV41_MOE_PREFILL", "DSV41_MOE_CHUNK", "DSV41_MGPU_SCALES", "DSV41_MOE_HQUANT"):
        os.environ.pop(k)


def check_kblocked(D=5120, I=2304, E=64, T=4096, chunk=160):
    """K-blocked expert codes (``moe.block_expert_codes``) against the same codes in rows, through
    ``MoE.routed_pallas`` at V4.1-Flash widths: the prefill under each ``DSV41_MOE_PREFILL`` (the
    Mosaic GPU kernels with their K-blocked tiles, the Triton launches) and decode steps of 1 and 8
    tokens (the Triton chunk-mode GEMVs, split-K) in fast and reference numerics: bit-equal where
    the launches' tiles and split-K match (equal_frac), and the error against XLA's
    ``routed_grouped`` on the rows (rel_err)."""
    from flax import nnx

    from dsv41_jax.model.moe import block_expert_codes, keep_kernel_scales

    for numerics, moe, x, w, ids in _flash_moes(D, I, E, T, chunk):
        keep_kernel_scales(moe, force=True)
        rows = nnx.split(moe)

        def run(split, name, n):
            gdef, state = split
            return jax.jit(lambda st, *a: getattr(nnx.merge(gdef, st), name)(*a))(state, x[:n], w[:n], ids[:n])
        want = {n: run(rows, "routed_grouped", n) for n in (T, 8, 1)}
        base = {}
        for mode in ("triton", "mgpu-glu"):
            os.environ["DSV41_MOE_PREFILL"] = mode
            base[mode] = run(rows, "routed_pallas", T)
        for n in (8, 1):
            base[n] = run(rows, "routed_pallas", n)
        blocked = block_expert_codes(moe, force=True)
        kb = nnx.split(moe)
        for key, y in base.items():
            n = key if isinstance(key, int) else T
            if not isinstance(key, int):
                os.environ["DSV41_MOE_PREFILL"] = key
            got = run(kb, "routed_pallas", n)
            emit(check="kblocked", numerics=numerics, what=f"prefill {key}" if n == T else f"decode {n}",
                 projections=blocked, equal_frac=float(jnp.mean(got == y)), rel_err=rel(got, want[n]),
                 rows_rel_err=rel(y, want[n]))
    for k in ("DSV41_MOE_PREFILL", "DSV41_MOE_CHUNK"):
        os.environ.pop(k, None)


if __name__ == "__main__":
    if sys.argv[1:] == ["moe_mgpu"]:
        check_moe_mgpu()
        sys.exit(0)
    if sys.argv[1:] == ["kblocked"]:
        check_kblocked()
        sys.exit(0)
    if sys.argv[1:] == ["split_tail"]:
        check_split_tail(jax.random.key(9))
        sys.exit(0)
    if sys.argv[1:] == ["gemm_out"]:
        check_gemm_out(jax.random.key(10))
        sys.exit(0)
    main()
    check_kblocked()
    check_gemm_out(jax.random.key(10))
    check_split_tail(jax.random.key(9))
    check_indexer(jax.random.key(3))
    check_mhc_mix(jax.random.key(4))
    check_norm_quant(jax.random.key(5))
    check_mhc_decode(jax.random.key(6))
    check_topk(jax.random.key(7))
    check_sparse_attn(jax.random.key(8))
