"""Prefill pieces at V4.1-Flash width, one JSON line per measurement (also appended to
$OUT/sweep_prefill.jsonl).

``--part indexer``: the lightning-indexer scores of an 8k prefill chunk (32 heads x 128, bf16):
XLA's formulation per 256-query block (what the model ran before the kernel), XLA on the whole
chunk, and ``kernels.indexer_scores`` over its tiles; FLOPs count the visible (causal) keys only.

``--part moe``: the routed experts of a prefill (2k, 8k, 32k tokens x 6 pairs over 384 int8
experts, random routing) in ``MoE.routed_pallas``' block layout with ``c``-row expert blocks:
the fused w1 + w3 launch and the w2 launch, per block size and tile; FLOPs count the real pairs
(padding rows are waste). Block sizes that are not powers of two run as two row tiles
(``Config.tail``, e.g. 160 = 128 + 32).

``--part moedq``: what the routed prefill kernel's dequantization costs (8k tokens, 160-row
blocks): the same launches on int8 codes with their ue8m0 scales (the model), on int8 codes
without scales (conversion only) and on bf16 weights (no conversion: the kernel's own bound),
each over a few tilings (bf16-arithmetic dequantization, 256-wide weight tiles on 8 warps, other
K steps and stage counts). Outputs of the scaled rows are compared with the default tiling's.

``--part mhc``: one mHC site's mixing sums of an 8k chunk (4 x 5120 bf16 stream, 24 outputs):
XLA's three kernels against ``kernels.hc_mix_sums`` over its tiles.

``--part attn``: the sparse attention of an 8k prefill chunk at V4.1 sizes (64 heads x 512, window
128, 512 selected entries per query from 4096 (ratio 2) or 8192 (ratio 1) compressed entries, and
the window-only layer): the model's XLA form (``Attention._attend``: 256-query blocks, the entries
gathered into HBM) against ``kernels.attn_prefill`` over its tiles (entries gathered inside the
kernel, and by XLA before it); FLOPs count the valid keys only (QK and PV).

``--part glu``: the first half of a prefill's routed experts (8k and 2k tokens, uniform random
routing): ``kernels.moe_glu`` (rows gathered in the kernel, w1 + w3 and SwiGLU in one launch)
over its tiles against the form it replaced (XLA's gather into the block layout, the fused
w1 + w3 launch, XLA's SwiGLU), also with the fp8 quantization of h (reference numerics) in the
epilogue against ``MoE._aq``'s; error columns against the first row of each size and form.

``--part mgpu``: the routed experts' GEMMs of an 8k prefill (160-row blocks) as the Mosaic GPU
kernel ``kernels.moe_mgpu`` (tokens as columns) over its tilings, against the Triton launches on
the same block layout; ``rel_err`` / ``equal_frac`` against the Triton result. Rows with a
``probe`` (``moe_mgpu.Tiles.probe``) give wrong values by design (timing only); rows with
``tiled`` hand the kernel a pre-tiled (``True``) or K-blocked (``"kblocked"``) copy of the codes.

``--part site``: two mHC sites of an 8k chunk: the expansion after a site with the next site's
mixing sums and collapse, and the sums and collapse alone, XLA's form (with ``hc_mix_sums``)
against ``kernels.mhc_mix.hc_site_sums`` over its tiles.

``--part topk``: the indexer's top-512 of a prefill chunk (8192 rows of 4096 or 8192 entries) and
of a batch-64 decode step: ``kernels.topk.topk_select`` against XLA's ``lax.top_k`` + sort
(``equal`` must hold: the selection is exact).

    python3 benchmarks/sweep_prefill.py --part indexer,moe,mhc,attn
    python3 benchmarks/sweep_prefill.py --smoke      # tiny sizes in the Pallas interpreter (CPU)
"""
from __future__ import annotations

import argparse
import functools
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
from dsv41_jax.kernels.indexer import indexer_scores, indexer_scores_reference  # noqa: E402

emit = bs.jsonl_emitter("sweep_prefill.jsonl")
BF16 = jnp.bfloat16
IMPL = "triton"
INDEXER_TILES = ({}, dict(bq=128, bt=128, num_warps=8), dict(bq=64, bt=64), dict(bq=128, bt=64),
                 dict(bq=64, bt=256, num_warps=8), dict(bq=32, bt=128), dict(num_stages=2), dict(num_stages=4))


def part_indexer(key, S: int = 8192, H: int = 32, hd: int = 128, block: int = 256):
    for T, m in ((S // 2, 2), (S, 1)):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, T), 3)
        q = jax.random.normal(k1, (1, S, H, hd), jnp.float32).astype(BF16)
        k = jax.random.normal(k2, (1, T, hd), jnp.float32).astype(BF16)
        w = (0.01 * jax.random.normal(k3, (1, S, H), jnp.float32)).astype(BF16)
        n_vis = ((jnp.arange(S) + 1) // m)[None].astype(jnp.int32)
        flops = 2.0 * H * hd * float(jnp.sum(n_vis))
        want = jax.jit(indexer_scores_reference)(q, k, w, n_vis)

        def blocks(i, s, q, k, w, n_vis):
            qs = q + s.astype(BF16)

            def one(b):
                sl = lambda a: jax.lax.dynamic_slice_in_dim(a, b * block, block, axis=1)  # noqa: E731
                return indexer_scores_reference(sl(qs), k, sl(w), sl(n_vis))
            return jax.lax.map(one, jnp.arange(S // block))

        def whole(i, s, q, k, w, n_vis):
            return indexer_scores_reference(q + s.astype(BF16), k, w, n_vis)

        rows = [("xla_blocks256", blocks, None), ("xla_whole", whole, None)]
        for tiles in INDEXER_TILES:
            def kern(i, s, q, k, w, n_vis, tiles=tiles):
                return indexer_scores(q + s.astype(BF16), k, w, n_vis, impl=IMPL, **tiles)
            rows.append(("kernel", kern, tiles))
        for name, fn, tiles in rows:
            try:
                t, comp = bq.timeit(fn, q, k, w, n_vis, reps=5)
                extra = {}
                if tiles is not None:
                    got = jax.jit(lambda *a, tiles=tiles: indexer_scores(*a, impl=IMPL, **tiles))(q, k, w, n_vis)
                    fin = np.isfinite(np.asarray(want, np.float32))
                    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
                    extra = dict(mask_equal=bool(np.array_equal(np.isfinite(g), fin)),
                                 rel_err=float(np.max(np.abs(np.where(fin, g, 0) - np.where(fin, r, 0)))
                                               / np.max(np.abs(r[fin]))),
                                 frac_bits_equal=float(np.mean(g[fin] == r[fin])))
                emit(part="indexer", keys=T, ratio=m, form=name, tiles=tiles, ms=round(t * 1e3, 3),
                     TFLOPs=round(flops / t / 1e12, 1), compile_s=round(comp, 1), **extra)
            except Exception as e:  # noqa: BLE001
                emit(part="indexer", keys=T, ratio=m, form=name, tiles=tiles, error=f"{type(e).__name__}: {str(e)[:300]}")


# (tokens, chunk, tiles); chunks that are not powers of two run as two row tiles (Config.tail)
MOE_VARIANTS = ((8192, 128, {}), (8192, 144, {}), (8192, 160, {}), (8192, 192, {}), (8192, 160, dict(num_stages=4)),
                (8192, 160, dict(wlhs=False, num_warps=8)), (2048, 32, {}), (2048, 48, {}), (2048, 64, {}),
                (2048, 40, {}), (32768, 128, {}), (32768, 192, {}))


def part_moe(key, k: int = 6, E: int = 384, D: int = 5120, Ii: int = 2304):
    from dsv41_jax.model.moe import MoE

    k1, k2, k3, k4 = jax.random.split(key, 4)
    w1, w3, w2 = bq.make_int8(k1, E, Ii, D), bq.make_int8(k2, E, Ii, D), bq.make_int8(k3, E, D, Ii)
    for T, c, tiles in MOE_VARIANTS:
        try:
            ids = jax.random.randint(jax.random.fold_in(k4, T), (T, k), 0, E, dtype=jnp.int32)
            counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
            flops = 2.0 * T * k * 3 * Ii * D
            _, _, NC, blocks, n_used = MoE._blocks(types.SimpleNamespace(n_experts=E), ids, c)
            x = jax.random.normal(k1, (NC * c, D), jnp.float32).astype(BF16)
            h = jax.random.normal(k2, (NC * c, Ii), jnp.float32).astype(BF16)

            def fn(i, s, x, h, blocks, n_used, w1, w3, w2, tiles=tiles, c=c):
                g, u = Q.grouped_qmatmul_fused(x + s.astype(BF16), blocks, n_used, [w1, w3], bm=c, out_dtype=BF16,
                                               impl=IMPL, **tiles)
                (y,) = Q.grouped_qmatmul_fused(h + s.astype(BF16) + g[:, :1] * 0, blocks, n_used, [w2], bm=c,
                                               out_dtype=BF16, impl=IMPL, **tiles)
                return jnp.concatenate([u[:, :8], y[:, :8]], axis=1) + jnp.sum(y) * 0

            t, comp = bq.timeit(fn, x, h, blocks, n_used, w1, w3, w2, reps=3)
            reads = int(np.sum(-(-counts // c)))
            cfg = Q.choose_config(c, Ii, D, True, nb=NC, groups=E, **tiles)
            emit(part="moe", tokens=T, chunk=c, tiles=tiles, tm=cfg.tm, tail=cfg.tail, ms=round(t * 1e3, 3),
                 TFLOPs=round(flops / t / 1e12, 1), rows=reads * c, pairs=int(T * k),
                 padded_frac=round(reads * c / (T * k) - 1, 3), expert_reads=reads, compile_s=round(comp, 1))
        except Exception as e:  # noqa: BLE001
            emit(part="moe", tokens=T, chunk=c, tiles=tiles, error=f"{type(e).__name__}: {str(e)[:300]}")


# (weights, tiles): int8 + scales (the model), int8 codes alone, bf16 weights
MOEDQ_VARIANTS = (("int8", {}), ("int8", dict(lowp_dequant=True)), ("int8", dict(bo=256, num_warps=8)),
                  ("int8", dict(bo=64)), ("int8", dict(bk=128)), ("int8", dict(bk=32)), ("int8", dict(num_stages=4)),
                  ("codes", {}), ("codes", dict(bo=256, num_warps=8)), ("bf16", {}), ("bf16", dict(bo=256, num_warps=8)),
                  ("bf16", dict(bk=128)), ("bf16", dict(num_stages=4)))


def part_moedq(key, T: int = 8192, c: int = 160, k: int = 6, E: int = 384, D: int = 5120, Ii: int = 2304):
    from dsv41_jax.model.moe import MoE

    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = {"int8": (bq.make_int8(k1, E, Ii, D), bq.make_int8(k2, E, Ii, D), bq.make_int8(k3, E, D, Ii))}
    q["codes"] = tuple((cw, None) for cw, _ in q["int8"])
    flops = 2.0 * T * k * 3 * Ii * D
    ids = jax.random.randint(k4, (T, k), 0, E, dtype=jnp.int32)
    _, _, NC, blocks, n_used = MoE._blocks(types.SimpleNamespace(n_experts=E), ids, c)
    x = jax.random.normal(k1, (NC * c, D), jnp.float32).astype(BF16)
    h = jax.random.normal(k2, (NC * c, Ii), jnp.float32).astype(BF16)
    want = None
    for kind, tiles in MOEDQ_VARIANTS:
        if kind == "bf16" and "bf16" not in q:
            q.pop("codes", None)  # room for the bf16 copies (3 x 9 GB)
            q["bf16"] = tuple((Q.dequantize(cw, sw, BF16), None) for cw, sw in q["int8"])
        w1, w3, w2 = q[kind]
        try:
            def launches(x, h, blocks, n_used, w1, w3, w2, tiles=tiles):
                g, u = Q.grouped_qmatmul_fused(x, blocks, n_used, [w1, w3], bm=c, out_dtype=BF16, impl=IMPL, **tiles)
                (y,) = Q.grouped_qmatmul_fused(h + g[:, :1] * 0, blocks, n_used, [w2], bm=c, out_dtype=BF16,
                                               impl=IMPL, **tiles)
                return u, y

            def fn(i, s, x, h, blocks, n_used, w1, w3, w2):
                u, y = launches(x + s.astype(BF16), h + s.astype(BF16), blocks, n_used, w1, w3, w2)
                return jnp.concatenate([u[:, :8], y[:, :8]], axis=1) + jnp.sum(y) * 0

            t, comp = bq.timeit(fn, x, h, blocks, n_used, w1, w3, w2, reps=3)
            extra = {}
            if kind == "int8":
                got = jax.jit(launches)(x, h, blocks, n_used, w1, w3, w2)
                if want is None:
                    want = got
                extra = dict(rel_to_default=max(bq.rel_err(a, b) for a, b in zip(got, want)))
            emit(part="moedq", tokens=T, chunk=c, weights=kind, tiles=tiles, ms=round(t * 1e3, 3),
                 TFLOPs=round(flops / t / 1e12, 1), compile_s=round(comp, 1), **extra)
        except Exception as e:  # noqa: BLE001
            emit(part="moedq", tokens=T, chunk=c, weights=kind, tiles=tiles, error=f"{type(e).__name__}: {str(e)[:300]}")


# (tokens, block rows, moe_glu keywords or "xla-path" for the replaced form; "act_quant": the fp8
# quantization of h that reference numerics apply before w2, in the epilogue / by MoE._aq)
GLU_VARIANTS = ((8192, 160, "xla-path"), (8192, 160, {}), (8192, 160, dict(split_tail=True)),
                (8192, 160, "xla-path+act_quant"), (8192, 160, dict(act_quant=True, split_tail=True)),
                (2048, 48, "xla-path"), (2048, 48, {}), (2048, 48, dict(split_tail=True)))


def part_glu(key, k: int = 6, E: int = 384, D: int = 5120, Ii: int = 2304, limit: float = 10.0):
    """The first half of a prefill's routed experts: ``kernels.moe_glu`` (rows gathered, w1 + w3
    and SwiGLU in one launch) against the form it replaced (XLA's gather of the rows into the
    block layout, the fused w1 + w3 ``grouped_qmatmul`` launch, XLA's SwiGLU over the layout)."""
    from dsv41_jax import quant
    from dsv41_jax.kernels.moe_glu import gather_rows, moe_glu
    from dsv41_jax.model.moe import MoE, swiglu

    k1, k2, k4 = jax.random.split(key, 3)
    w1, w3 = bq.make_int8(k1, E, Ii, D), bq.make_int8(k2, E, Ii, D)
    ref = {}
    for T, c, tiles in GLU_VARIANTS:
        try:
            ids = jax.random.randint(jax.random.fold_in(k4, T), (T, k), 0, E, dtype=jnp.int32)
            w = jax.random.uniform(k4, (T, k), jnp.float32)
            ns = types.SimpleNamespace(n_experts=E)
            fake = types.SimpleNamespace(n_experts=E, _blocks=functools.partial(MoE._blocks, ns))
            row_token, ws, _, NC, blocks, n_used = MoE._rows(fake, w, ids, c)
            x = jax.random.normal(k1, (T, D), jnp.float32).astype(BF16)

            xla_path = isinstance(tiles, str)
            aq = tiles == "xla-path+act_quant" or (not xla_path and tiles.get("act_quant", False))
            if xla_path:
                def first_half(x, row_token, ws, blocks, n_used, w1, w3, c=c, aq=aq):
                    xs = gather_rows(x, row_token)
                    g, u = Q.grouped_qmatmul_fused(xs, blocks, n_used, [w1, w3], bm=c, out_dtype=BF16, impl=IMPL)
                    h = (ws[:, None] * swiglu(g, u, limit)).astype(BF16)
                    return quant.act_quant_fp8(h.astype(jnp.float32), 32).astype(BF16) if aq else h
            else:
                def first_half(x, row_token, ws, blocks, n_used, w1, w3, c=c, tiles=tiles):
                    tiles = dict(tiles)
                    if tiles.pop("split_tail", False):
                        tiles["split_tail"] = Q.tail_selector(row_token, c)
                    return moe_glu(x, row_token, ws, blocks, n_used, w1, w3, bm=c, limit=limit, impl=IMPL, **tiles)

            def fn(i, s, *a):
                return first_half(a[0] + s.astype(BF16), *a[1:])[:, :8]

            args = (x, row_token, ws, blocks, n_used, w1, w3)
            t, comp = bq.timeit(fn, *args, reps=3)
            h = jax.jit(first_half)(*args)
            pairs = row_token >= 0  # (split_tail leaves the tail rows of blocks without a tail pair unwritten)
            h = jnp.where(pairs[:, None], h, 0)
            if (T, c, aq) not in ref:
                ref[T, c, aq] = h
            flops = 2.0 * T * k * 2 * Ii * D
            emit(part="glu", tokens=T, chunk=c, form=tiles if xla_path else "moe_glu", act_quant=aq,
                 tiles=None if xla_path else tiles, ms=round(t * 1e3, 3), TFLOPs=round(flops / t / 1e12, 1),
                 rel_err=bq.rel_err(h, ref[T, c, aq]),
                 equal_frac=round(float(jnp.mean((h == ref[T, c, aq])[pairs].astype(jnp.float32))), 5),
                 compile_s=round(comp, 1))
        except Exception as e:  # noqa: BLE001
            emit(part="glu", tokens=T, chunk=c, tiles=str(tiles), error=f"{type(e).__name__}: {str(e)[:300]}")


# (projection, tiles or "triton"): the Mosaic GPU grouped GEMM (kernels.moe_mgpu, tokens as columns) per
# tiling, against the Triton launches on the same block layout; "glu": w1 + w3 + SwiGLU in one launch
# (grouped_glu_t against kernels.moe_glu)
MGPU_VARIANTS = (("w1", "triton"), ("w1", {}), ("w1", dict(steps=3)), ("w1", dict(steps=5)),
                 ("w1", dict(tile_k=128, steps=3)), ("w1", dict(tile_m=128, steps=3)),
                 ("w1", dict(tile_m=128, tile_k=128, steps=2)),
                 ("w2", "triton"), ("w2", {}), ("w2", dict(tile_k=128, steps=3)), ("w2", dict(tile_m=128, steps=3)),
                 # (last: the experimental fused kernel, should it deadlock, costs no other row)
                 ("glu", "triton"), ("glu", dict(steps=2)), ("glu", {}), ("glu", dict(steps=3)),
                 ("glu", dict(tile_k=128, steps=2)),
                 # (16-) the row layouts: tokens read as [rows, K] tiles (x_rows) and results stored
                 # as rows (out_rows), so the model needs no transposes in XLA
                 ("w1", dict(x_rows=True)), ("w1", dict(x_rows=True, tile_k=128, steps=3)),
                 ("w1", dict(x_rows=True, tile_m=128, steps=3)),
                 ("w2", dict(out_rows=True)), ("w2", dict(out_rows=True, tile_m=128, steps=3)),
                 ("w2", dict(x_rows=True, out_rows=True)), ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3)),
                 ("glu", dict(x_rows=True)), ("glu", dict(x_rows=True, steps=3)),
                 # (25-) the layouts routed_mgpu uses: rows in, rows out
                 ("glu", dict(x_rows=True, out_rows=True)), ("w1", dict(x_rows=True, out_rows=True)),
                 ("glu", dict(x_rows=True, out_rows=True, tile_k=128, steps=3)),
                 ("glu", dict(x_rows=True, out_rows=True, tile_m=128, steps=2)),
                 # (29-) longer K steps on the rows layouts (session 24)
                 ("w2", dict(x_rows=True, out_rows=True, tile_k=128, steps=3)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, tile_k=128, steps=2)),
                 ("glu", dict(x_rows=True, out_rows=True, tile_k=128, steps=2)),
                 # (32-) session 26: chained tile pipelines, five stages, CTA pairs sharing the
                 # token tile, then diagnostics (``probe``: wrong values by design, timing only)
                 ("glu", dict(x_rows=True, out_rows=True, chain=True)),
                 ("glu", dict(x_rows=True, out_rows=True, steps=5)),
                 ("glu", dict(x_rows=True, out_rows=True, steps=5, chain=True)),
                 ("glu", dict(x_rows=True, out_rows=True, cluster=2)),
                 ("glu", dict(x_rows=True, out_rows=True, cluster=2, chain=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, chain=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=4)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=4, chain=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, cluster=2, chain=True)),
                 # (41-) probes
                 ("glu", dict(x_rows=True, out_rows=True, probe="const_lhs")),
                 ("glu", dict(x_rows=True, out_rows=True, probe="one_expert")),
                 ("glu", dict(x_rows=True, out_rows=True, probe="const_lhs,one_expert")),
                 ("glu", dict(x_rows=True, out_rows=True, probe="no_store")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, probe="const_lhs")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, probe="one_expert")),
                 # (47-) the weights pre-tiled (each step's tile one contiguous block): is the
                 # weights' strided access (64-byte row pieces 5120 / 2304 bytes apart) the bound?
                 ("glu", dict(x_rows=True, out_rows=True, tiled=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tiled=True)),
                 ("glu", dict(x_rows=True, out_rows=True, tiled=True, probe="const_lhs")),
                 ("glu", dict(x_rows=True, out_rows=True, tile_k=128, steps=2, tiled=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, tile_k=128, steps=2, tiled=True)),
                 # (52-) K-blocked codes, [E, K / 64, O, 64]: one layout for every tile_m
                 ("glu", dict(x_rows=True, out_rows=True, tiled="kblocked")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tiled="kblocked")),
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, tiled="kblocked")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=4, tiled="kblocked")),
                 ("glu", dict(x_rows=True, out_rows=True, tiled="kblocked", chain=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tiled="kblocked", chain=True)),
                 # (58-) session 28: the dequantized operands staged in shared memory, a step's MMAs
                 # running on while the next step dequantizes (``Tiles.stage``)
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, tiled="kblocked", stage=True)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tiled="kblocked", stage=True)),
                 ("glu", dict(x_rows=True, out_rows=True, steps=2, tiled="kblocked", stage=True)),
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, stage=True)),
                 # (62-) session 30: the committed w2 tiles, then the codes loaded four bytes at a
                 # time in the 2x-upcast layout (``Tiles.lhs``), moved to the WGMMA layout as bytes
                 # or as bf16
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3)),
                 ("glu", dict(x_rows=True, out_rows=True, lhs="8bit")),
                 ("glu", dict(x_rows=True, out_rows=True, lhs="16bit")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, lhs="8bit")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, lhs="16bit")),
                 # (67-) the same loads on K-blocked codes (the committed K-blocked tiles)
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, tiled="kblocked", lhs="8bit")),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tiled="kblocked", lhs="8bit")),
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, tiled="kblocked", lhs="16bit")),
                 # (70-) session 31: a block's last 32 token columns computed only where the block
                 # has rows there (``Tiles.tail``; this sweep's uniform routing puts ~128 +- 11 pairs
                 # in each 160-row block), on K-blocked codes, then on rows, then with the 8bit loads
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, tiled="kblocked", tail=32)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tiled="kblocked", tail=32)),
                 ("glu", dict(x_rows=True, out_rows=True, tail=32)),
                 ("w2", dict(x_rows=True, out_rows=True, tile_m=128, steps=3, tail=32)),
                 ("glu", dict(x_rows=True, out_rows=True, steps=3, tiled="kblocked", tail=32, lhs="8bit")),
                 ("glu", dict(x_rows=True, out_rows=True, steps=4, tiled="kblocked", tail=32)))


def part_mgpu(key, T: int = 8192, c: int = 160, k: int = 6, E: int = 384, D: int = 5120, Ii: int = 2304,
              limit: float = 10.0):
    """The routed experts' GEMMs of a prefill as ``kernels.moe_mgpu`` (Mosaic GPU: TMA, warp
    specialization, wgmma with the dequantized weights from registers) over its tilings, against
    the Triton launches on the same layout (``grouped_qmatmul_fused``: w1 + w3 in one launch, w2;
    ``moe_glu`` for the fused first half). FLOPs count the real pairs; the w1 row is one projection
    (w1 + w3: twice its work)."""
    from dsv41_jax.kernels import moe_mgpu as MG
    from dsv41_jax.kernels.moe_glu import gather_rows, moe_glu
    from dsv41_jax.model.moe import MoE

    impl = "interpret" if IMPL == "interpret" else "mosaic"
    sms = 4 if impl == "interpret" else None  # (the interpreter runs one thread per simulated SM)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    w = {"w1": bq.make_int8(k1, E, Ii, D), "w3": bq.make_int8(k2, E, Ii, D), "w2": bq.make_int8(k3, E, D, Ii)}
    ids = jax.random.randint(k4, (T, k), 0, E, dtype=jnp.int32)
    route = jax.random.uniform(k4, (T, k), jnp.float32)
    ns = types.SimpleNamespace(n_experts=E)
    fake = types.SimpleNamespace(n_experts=E, _blocks=functools.partial(MoE._blocks, ns))
    row_token, ws, _, NC, blocks, n_used = MoE._rows(fake, route, ids, c)
    xtok = jax.random.normal(k1, (T, D), jnp.float32).astype(BF16)
    x = {"w1": gather_rows(xtok, row_token), "w2": jax.random.normal(k2, (NC * c, Ii), jnp.float32).astype(BF16)}
    x["glu"] = x["w1"]
    pairs = np.asarray(row_token >= 0)
    brows = jnp.sum((row_token >= 0).reshape(-1, c), axis=1, dtype=jnp.int32)  # (``Tiles.tail``)
    ref = {}
    for proj, tiles in MGPU_VARIANTS:
        try:
            O, K = w["w2" if proj == "w2" else "w1"][0].shape[1:]
            n_proj = 2 if proj == "glu" else 1
            if tiles == "triton" and proj == "glu":
                def fn(i, s, a, row_token, ws, blocks, n_used, w1, w3):
                    return moe_glu(a + s.astype(BF16), row_token, ws, blocks, n_used, w1, w3, bm=c,
                                   limit=limit, impl=IMPL)[:, :8]
                args = (xtok, row_token, ws, blocks, n_used, w["w1"], w["w3"])
                ref[proj] = moe_glu(xtok, row_token, ws, blocks, n_used, w["w1"], w["w3"], bm=c, limit=limit, impl=IMPL)
            elif tiles == "triton":
                wl = [w["w1"], w["w3"]] if proj == "w1" else [w["w2"]]
                n_proj = len(wl)

                def fn(i, s, a, blocks, n_used, wl):
                    return Q.grouped_qmatmul_fused(a + s.astype(BF16), blocks, n_used, wl, bm=c, out_dtype=BF16,
                                                   impl=IMPL)[0][:, :8]
                args = (x[proj], blocks, n_used, wl)
                ref[proj] = Q.grouped_qmatmul_fused(x[proj], blocks, n_used, wl[:1], bm=c, out_dtype=BF16, impl=IMPL)[0]
            else:
                tl = dict(tiles)
                lay = dict(x_rows=tl.pop("x_rows", False), out_rows=tl.pop("out_rows", False))
                tiled = tl.pop("tiled", False)
                tl = MG.Tiles(**tl)
                wts = (w["w1"], w["w3"]) if proj == "glu" else (w[proj],)
                if tiled:  # each step's weight tile contiguous in memory, the scales in the kernel's layout
                    cm, tk_ = 2 * tl.tile_m, tl.tile_k
                    if tiled == "kblocked":  # [E, K / tile_k, O, tile_k]
                        wts = tuple((cd.reshape(E, cd.shape[1], cd.shape[2] // tk_, tk_).transpose(0, 2, 1, 3),
                                     MG.scale_t(sc)) for cd, sc in wts)
                    else:  # [E, O / 2 tile_m, K / tile_k, 2 tile_m, tile_k]
                        wts = tuple((cd.reshape(E, cd.shape[1] // cm, cm, cd.shape[2] // tk_, tk_)
                                     .transpose(0, 1, 3, 2, 4), MG.scale_t(sc)) for cd, sc in wts)

                    def run(a, wts, tl=tl, lay=lay, glu=proj == "glu"):  # (the kernel itself: rows in, rows out)
                        return MG._call(a, blocks.astype(jnp.int32), jnp.reshape(n_used, (1,)).astype(jnp.int32),
                                        list(wts), bm=c, mult=Q.default_mult(jnp.int8), tiles=tl,
                                        num_sms=sms or MG._num_sms(), interpret=impl == "interpret",
                                        glu=(ws.astype(jnp.float32), limit) if glu else None, block_rows=brows,
                                        **lay)
                elif proj == "glu":
                    # the scales in the kernel's layout too, as the model keeps them
                    # (``moe.keep_kernel_scales``; before session 28 these rows timed a transpose
                    # of the scales per call that the tiled rows did not)
                    wts = tuple((cd, sc, MG.scale_t(sc)) for cd, sc in wts)

                    def run(a, wts, tl=tl, lay=lay):  # the result as rows [rows, I]
                        h = MG.grouped_glu_t(a, ws, blocks, n_used, *wts, bm=c, limit=limit,
                                             impl=impl, tiles=tl, num_sms=sms, block_rows=brows, **lay)
                        return h if lay["out_rows"] else h.T
                else:
                    wts = tuple((cd, sc, MG.scale_t(sc)) for cd, sc in wts)

                    def run(a, wts, tl=tl, lay=lay):  # the result as rows [rows, O]
                        (cd, sc, sk), = wts
                        y = MG.grouped_matmul_t(a, blocks, n_used, cd, sc, scale_k=sk, bm=c, impl=impl, tiles=tl,
                                                num_sms=sms, block_rows=brows, **lay)
                        return y if lay["out_rows"] else y.T

                def fn(i, s, a, wts, run=run):
                    return run(a + s.astype(BF16), wts)[:8]
                xin = x[proj] if lay["x_rows"] else x[proj].T
                args = (xin, wts)
            # (the Mosaic GPU interpreter hangs inside the timing loop: the smoke run only checks values)
            timed = impl == "mosaic" or tiles == "triton"
            t, comp = bq.timeit(fn, *args, reps=3) if timed else (float("nan"), 0.0)
            extra = {}
            if tiles != "triton" and proj in ref:
                got, want = run(xin, wts)[pairs], ref[proj][pairs]
                extra = dict(rel_err=bq.rel_err(got, want),
                             equal_frac=round(float(jnp.mean((got == want).astype(jnp.float32))), 5))
            flops = 2.0 * T * k * O * K * n_proj
            emit(part="mgpu", tokens=T, chunk=c, proj="w1+w3" if proj == "w1" and n_proj == 2 else proj,
                 tiles=tiles, ms=round(t * 1e3, 3), TFLOPs=round(flops / t / 1e12, 1), compile_s=round(comp, 1),
                 **extra)
        except Exception as e:  # noqa: BLE001
            emit(part="mgpu", tokens=T, chunk=c, proj=proj, tiles=tiles, error=f"{type(e).__name__}: {str(e)[:300]}")


# (rows, entries, k, form): the indexer's selection of a prefill chunk (8k tokens: 4096 ratio-2
# entries, 8192 ratio-1 entries) and of a batch-64 decode step
TOPK_VARIANTS = ((8192, 4096, 512, "xla"), (8192, 4096, 512, {}), (8192, 4096, 512, dict(num_warps=4)),
                 (8192, 4096, 512, dict(num_warps=16)), (8192, 8192, 512, "xla"), (8192, 8192, 512, {}),
                 (8192, 8192, 512, dict(num_warps=16)), (64, 4160, 512, "xla"), (64, 4160, 512, {}),
                 (2048, 1024, 512, "xla"), (2048, 1024, 512, {}))


def part_topk(key):
    """``kernels.topk.topk_select`` against XLA's ``lax.top_k`` + sort of the indices (exact: the
    ``equal`` column must be true)."""
    from dsv41_jax.kernels.topk import topk_select
    from dsv41_jax.model.layers import _top_k_indices_ascending_xla

    for R, T, k, form in TOPK_VARIANTS:
        try:
            x = jax.random.normal(jax.random.fold_in(key, R + T), (R, T), jnp.float32).astype(BF16)
            x = jnp.where(jnp.arange(T) < T - 7, x, -jnp.inf)  # a few masked entries, many bf16 ties
            if form == "xla":
                def sel(x):
                    return _top_k_indices_ascending_xla(x, k)
            else:
                def sel(x, form=form):
                    return topk_select(x, k, impl=IMPL, **form)

            t, comp = bq.timeit(lambda i, s, x: sel(x + s.astype(BF16)), x, reps=5)
            got = jax.jit(sel)(x)
            want = jax.jit(lambda x: _top_k_indices_ascending_xla(x, k))(x)
            emit(part="topk", rows=R, entries=T, k=k, form="xla" if form == "xla" else "topk_select",
                 tiles=None if form == "xla" else form, ms=round(t * 1e3, 4),
                 equal=bool(jnp.all(got == want)), compile_s=round(comp, 1))
        except Exception as e:  # noqa: BLE001
            emit(part="topk", rows=R, entries=T, k=k, form=str(form), error=f"{type(e).__name__}: {str(e)[:300]}")


MHC_TILES = ({}, dict(bt=64, bk=128, num_warps=4), dict(bt=128, bk=128), dict(bt=128, bk=32),
             dict(num_stages=4), dict(num_stages=2), dict(splits=1), dict(splits=4))


def part_mhc(key, S: int = 8192, K: int = 4 * 5120, O: int = 24):
    """One mHC site's mixing sums of an S-token chunk (bf16 stream): XLA's formulation (the
    conversion, the statistic's reduction and the fp32 GEMM: what the model ran before) against
    ``kernels.hc_mix_sums`` over its tiles; bandwidth counts the stream's bytes read once."""
    from dsv41_jax.kernels.mhc_mix import hc_mix_sums, hc_mix_sums_reference

    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, (S, K), jnp.float32).astype(BF16)
    fn = 0.02 * jax.random.normal(k2, (O, K), jnp.float32)
    want = jax.jit(hc_mix_sums_reference)(x, fn)

    def both(f):  # the loop's data dependence goes through the small weights, so x is read as stored
        return lambda i, s, x, fn: jnp.concatenate([a.reshape(x.shape[0], -1) for a in f(x, fn + s)], axis=1)

    rows = [("xla", both(hc_mix_sums_reference), None)]
    for tiles in MHC_TILES:
        rows.append(("kernel", both(lambda x, fn, tiles=tiles: hc_mix_sums(x, fn, impl=IMPL, **tiles)), tiles))
    for name, f, tiles in rows:
        try:
            t, comp = bq.timeit(f, x, fn, reps=5)
            extra = {}
            if tiles is not None:
                got = jax.jit(lambda *a, tiles=tiles: hc_mix_sums(*a, impl=IMPL, **tiles))(x, fn)
                extra = dict(mix_rel_err=bq.rel_err(got[0], want[0]), ss_rel_err=bq.rel_err(got[1], want[1]))
            emit(part="mhc", tokens=S, form=name, tiles=tiles, ms=round(t * 1e3, 4),
                 TBps=round(x.nbytes / t / 1e12, 3), compile_s=round(comp, 1), **extra)
        except Exception as e:  # noqa: BLE001
            emit(part="mhc", tokens=S, form=name, tiles=tiles, error=f"{type(e).__name__}: {str(e)[:300]}")


# session 32: the site kernel's tiles (``kernels.mhc_mix.SiteConfig`` fields; {} = SITE_TILES)
# (rows 0-6 measured in run 42 while the defaults were bt 64 x bd 64; 7-10: one stream's expansion
# at a time, ``seq``)
SITE_TILES = (dict(bt=64, bd=64), dict(bt=128, bd=64), dict(bt=64, bd=128), dict(bt=128, bd=32),
              dict(bt=64, bd=64, num_stages=3), dict(bt=32, bd=128), dict(bt=128, bd=64, num_warps=4),
              dict(seq=True), dict(seq=True, bd=64), dict(seq=True, bt=64, bd=64), dict(seq=True, num_stages=3))


def part_site(key, S: int = 8192, n: int = 4, D: int = 5120, O: int = 24):
    """Two mHC sites of an S-token chunk (bf16 stream ``[S, n, D]``): the expansion after a site
    and the next site's mixing sums and collapse (``mhc.hc_post_site``), and a site's sums and
    collapse alone (``mhc.hc_site`` without the expansion). XLA's expansion and collapse with the
    ``hc_mix_sums`` kernel (the model's form before session 32) against ``hc_site_sums`` over its
    tiles; bandwidth counts the stream's bytes the fused form must move (read once; written once
    with the expansion)."""
    from dsv41_jax.kernels.mhc_mix import hc_mix_sums, hc_site_sums
    from dsv41_jax.model.mhc import hc_post, hc_pre

    ks = jax.random.split(key, 6)
    h = jax.random.normal(ks[0], (S, n, D), jnp.float32).astype(BF16)
    y = jax.random.normal(ks[1], (S, D), jnp.float32).astype(BF16)
    fn = 0.02 * jax.random.normal(ks[2], (O, n * D), jnp.float32)
    pre = jax.random.uniform(ks[3], (S, n), jnp.float32)
    post = 2 * jax.random.uniform(ks[4], (S, n), jnp.float32)
    comb = jax.random.uniform(ks[5], (S, n, n), jnp.float32) / n

    def xla(expand):
        def f(i, s, h, y, fn, pre, post, comb):
            st = hc_post(y, h, post + s, comb) if expand else h
            mix, ss = hc_mix_sums(st.reshape(S, n * D), fn + s, impl=IMPL)
            out = (mix, ss, hc_pre(st, pre))
            return (st, *out) if expand else out
        return f

    def fused(expand, tiles):
        def f(i, s, h, y, fn, pre, post, comb):
            kw = dict(y=y, post=post + s, comb=comb) if expand else {}
            return hc_site_sums(h, fn + s, pre, impl=IMPL, **kw, **tiles)
        return f

    def timed(f):  # one scalar: all of the small outputs and of x, one element of the new stream (the
        # XLA form's sums kernel reads all of it, so none of it can be skipped), no extra pass over it
        def g(i, s, *a):
            out = f(i, s, *a)
            st = out[0] if len(out) == 4 else None
            tot = sum(jnp.sum(o.astype(jnp.float32)) for o in out[-3:])
            return tot if st is None else tot + st[0, 0, 0].astype(jnp.float32)
        return g

    args = (h, y, fn, pre, post, comb)
    for expand in (True, False):
        nbytes = h.nbytes * (2 if expand else 1) + y.nbytes * (2 if expand else 1)
        want = None
        for tiles in (None,) + SITE_TILES:
            form = "xla" if tiles is None else "kernel"
            f = xla(expand) if tiles is None else fused(expand, tiles)
            try:
                t, comp = bq.timeit(timed(f), *args, reps=5)
                got = jax.jit(lambda *a, f=f: f(0, jnp.float32(0), *a))(*args)
                if want is None:
                    want = got
                err = {f"{k}_rel_err": bq.rel_err(g, w) for k, g, w in zip(
                    ("stream", "mix", "ss", "x") if expand else ("mix", "ss", "x"), got, want)}
                emit(part="site", tokens=S, expand=expand, form=form, tiles=tiles, ms=round(t * 1e3, 4),
                     TBps=round(nbytes / t / 1e12, 3), compile_s=round(comp, 1), **err)
            except Exception as e:  # noqa: BLE001
                emit(part="site", tokens=S, expand=expand, form=form, tiles=tiles,
                     error=f"{type(e).__name__}: {str(e)[:300]}")


# run 26 (calls 2-3) measured these and more around the default (docs/performance.md); each row
# overrides ``attn_prefill.TILES``, so rows 0-16, measured while ``store_logits`` was off (before
# session 32), now run on top of the stored logits; row 21 is the form without them
ATTN_TILES = ({}, dict(max_bk=32, max_warps=8), dict(max_bk=128), dict(max_stages=3), dict(max_warps=8),
              dict(online=True), dict(online=True, bk=64), dict(online=True, num_stages=3),
              # (8-) session 31: the max and the sum reduced once per row at the end (``lazy``)
              dict(lazy=True), dict(lazy=True, max_bk=128), dict(lazy=True, num_stages=3),
              # (11-) the window loop over the live tiles' range, no branch per tile (``window_range``)
              dict(window_range=True), dict(window_range=True, lazy=True), dict(window_range=True, num_stages=3),
              dict(window_range=True, lazy=True, max_stages=3),
              # (15-) the entry loop over its live tiles' range too (``entry_range``)
              dict(window_range=True, entry_range=True), dict(window_range=True, entry_range=True, lazy=True),
              # (17-) the output launch reads the max launch's logits (``store_logits``), whole or
              # in value slices on one warpgroup
              dict(store_logits=True, dv=512, num_warps=8), dict(store_logits=True, dv=256, num_warps=4),
              dict(store_logits=True, dv=128, num_warps=4), dict(store_logits=True, dv=256, num_warps=4, bk=64),
              # (21) the logits recomputed by the output launch (the default before session 32)
              dict(store_logits=False),
              # (22-) session 33: the max launch's tiles again, now that it also stores the logits
              dict(max_bk=32), dict(max_bk=128, max_warps=8), dict(max_bk=32, max_stages=3))


def part_attn(key, S: int = 8192, H: int = 64, d: int = 512, W: int = 128, K: int = 512, block: int = 256,
              ratios=(2, 1, 0)):
    """One attention layer's core of an S-token chunk (fresh prefill: empty ring) for each
    compression ratio (0: window only): XLA's form against the kernel's tiles."""
    from types import SimpleNamespace

    from dsv41_jax.kernels.attn_prefill import sparse_attn_prefill
    from dsv41_jax.model.attention import Attention, query_block, sparse_attn

    ks = jax.random.split(key, 4)
    q = (0.05 * jax.random.normal(ks[0], (1, S, H, d), jnp.float32)).astype(BF16)
    kv = jax.random.normal(ks[1], (1, S, d), jnp.float32).astype(BF16)
    pos = jnp.arange(S, dtype=jnp.int32)[None]
    kw = jnp.concatenate([jnp.zeros((1, W, d), BF16), kv], axis=1)
    kpos = jnp.concatenate([jnp.full((1, W), -1, jnp.int32), pos], axis=1)
    blk = query_block(S, block, W)
    for ratio in ratios:
        cmp = idx = None
        n_entries = 0
        if ratio:
            Tc = S // ratio
            cmp = jax.random.normal(ks[2], (1, Tc, d), jnp.float32).astype(BF16)
            n_vis = (pos[0] + 1) // ratio                                            # entries visible to each query
            draw = jax.random.randint(ks[3], (S, K), 0, 1 << 30) % jnp.maximum(n_vis, 1)[:, None]
            idx = jnp.where(jnp.arange(K)[None] < n_vis[:, None], draw, -1)[None].astype(jnp.int32)
            n_entries = int(jnp.sum(idx >= 0))
        n_keys = n_entries + int(jnp.sum(jnp.minimum(pos[0] + 1, W)))
        flops = 4 * H * d * n_keys

        def xla(i, s, q, sink, kw, kpos, cmp, idx):
            fake = SimpleNamespace(window=W, q_block=block, _attend_kernel=lambda *a: None)
            fake._sparse_attn = lambda q_, kw_, ok, kc, kc_ok: sparse_attn(q_, kw_, ok, kc, kc_ok, sink + s, d ** -0.5,
                                                                          BF16)
            return Attention._attend(fake, q, pos, kw, kpos, cmp, idx)

        def kern(i, s, q, sink, kw, kpos, cmp, idx, tiles=None):
            return sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink + s, d ** -0.5, window=W, block=blk,
                                       impl=IMPL, **tiles)

        sink = jax.random.normal(ks[3], (H,), jnp.float32)
        args = (q, sink, kw, kpos, cmp, idx)
        want = None
        for tiles in (None,) + ATTN_TILES:
            form = "xla" if tiles is None else "kernel"
            f = xla if tiles is None else functools.partial(kern, tiles=tiles)
            try:
                t, comp = bq.timeit(f, *args, reps=3)
                got = jax.jit(lambda *a, f=f: f(0, jnp.float32(0), *a))(*args)
                if want is None:
                    want = got
                extra = dict(rel_err=bq.rel_err(got, want), equal=float(jnp.mean(got == want)))
                emit(part="attn", tokens=S, ratio=ratio, form=form, tiles=tiles, ms=round(t * 1e3, 4),
                     TFLOPs=round(flops / t / 1e12, 1), compile_s=round(comp, 1), **extra)
            except Exception as e:  # noqa: BLE001
                emit(part="attn", tokens=S, ratio=ratio, form=form, tiles=tiles,
                     error=f"{type(e).__name__}: {str(e)[:300]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="indexer,moe",
                    help="indexer, moe, moedq, mhc, attn, glu, topk, mgpu, site (comma-separated)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mgpu-rows", default="", help="indices into MGPU_VARIANTS to run (default: all)")
    ap.add_argument("--attn-rows", default="", help="indices into ATTN_TILES to run (default: all)")
    ap.add_argument("--site-rows", default="", help="indices into SITE_TILES to run (default: all)")
    ap.add_argument("--attn-ratios", default="2,1,0", help="compression ratios of the attn part (0: window only)")
    a = ap.parse_args()
    emit(what="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()], args=vars(a))
    key = jax.random.key(0)
    parts = {"indexer": part_indexer, "moe": part_moe, "moedq": part_moedq, "mhc": part_mhc, "attn": part_attn,
             "glu": part_glu, "topk": part_topk, "mgpu": part_mgpu, "site": part_site}
    if a.smoke:
        global IMPL, INDEXER_TILES, MOE_VARIANTS, MHC_TILES, MOEDQ_VARIANTS, ATTN_TILES, GLU_VARIANTS, TOPK_VARIANTS
        global MGPU_VARIANTS, SITE_TILES
        IMPL, INDEXER_TILES = "interpret", ({}, dict(bq=16, bt=32))
        MHC_TILES = ({}, dict(bt=16, bk=64))
        SITE_TILES = ({}, dict(bt=16, bd=32, splits=2), dict(bt=16, bd=32, seq=True))
        ATTN_TILES = (dict(hb=16, bk=16, dv=32), dict(hb=16, bk=16, dv=32, max_bk=32), dict(hb=16, bk=16, online=True))
        MOE_VARIANTS = ((32, 16, {}), (32, 48, dict(bo=32)), (64, 24, {}))
        MOEDQ_VARIANTS = (("int8", {}), ("int8", dict(lowp_dequant=True)), ("codes", {}), ("bf16", {}))
        GLU_VARIANTS = ((32, 16, "xla-path"), (32, 16, {}), (32, 24, dict(bo=16)), (32, 16, "xla-path+act_quant"),
                        (32, 16, dict(act_quant=True)), (32, 48, dict(split_tail=True)))
        TOPK_VARIANTS = ((16, 100, 20, "xla"), (16, 100, 20, {}))
        MGPU_VARIANTS = (("w1", "triton"), ("w1", {}), ("w2", "triton"), ("w2", dict(tile_k=128, steps=2)))
        parts = {"indexer": lambda k: part_indexer(k, S=64, H=2, hd=32, block=16),
                 "moe": lambda k: part_moe(k, k=2, E=4, D=64, Ii=32),
                 "moedq": lambda k: part_moedq(k, T=32, c=24, k=2, E=4, D=64, Ii=32),
                 "mhc": lambda k: part_mhc(k, S=160, K=512),
                 "attn": lambda k: part_attn(k, S=40, H=16, d=64, W=8, K=16, block=8),
                 "glu": lambda k: part_glu(k, k=2, E=4, D=64, Ii=32),
                 "topk": part_topk,
                 "mgpu": lambda k: part_mgpu(k, T=48, c=32, k=2, E=4, D=256, Ii=128),
                 "site": lambda k: part_site(k, S=160, D=64)}
    if a.mgpu_rows:
        MGPU_VARIANTS = tuple(MGPU_VARIANTS[int(i)] for i in a.mgpu_rows.split(","))
    if a.attn_rows:
        ATTN_TILES = tuple(ATTN_TILES[int(i)] for i in a.attn_rows.split(","))
    if a.site_rows:
        SITE_TILES = tuple(SITE_TILES[int(i)] for i in a.site_rows.split(","))
    if not a.smoke:
        parts["attn"] = functools.partial(part_attn, ratios=tuple(int(r) for r in a.attn_ratios.split(",")))
    for part in a.part.split(","):
        parts[part](key)


if __name__ == "__main__":
    main()
