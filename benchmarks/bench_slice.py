"""V4.1-Flash-width slice benchmark (one device call).

Builds a few layers of DeepSeek-V4.1-Flash at real width (hidden 5120, 64 heads x 512, 384
experts of 2304, index 32 x 128, window 128) with random weights generated ON the device, one
layer of each kind (window-only + Engram, ratio-2 kv/index source, ratio-1 kv/index/candidate
source), and measures:

* ceilings: device copy bandwidth, bf16 matmul rate;
* decode step time at batch 1, 8, 64 (cache of --ctx tokens already filled);
* prefill throughput at 2k (and 8k when memory allows);
* ViT + aligner at 1024 image tokens;
* compile time of the full 40-layer config from abstract weights.

Each result is printed as one JSON line and collected in $OUT/bench_slice.json.

    python benchmarks/bench_slice.py --layers 3 [--small]     # --small: tiny width, for CPU smoke
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dsv41_jax.config import parse_config, preset  # noqa: E402
from dsv41_jax.numerics import Numerics  # noqa: E402

RESULTS = []


def emit(**kw):
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


def bench(fn, *args, warmup=2, iters=5):
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), out


def ceilings():
    x = jnp.ones((1 << 30) // 2, jnp.bfloat16)  # 1 GiB
    f = jax.jit(lambda a: a * 2)
    t, _ = bench(f, x)
    emit(what="ceiling_copy", bytes=2 * x.nbytes, seconds=t, tb_per_s=2 * x.nbytes / t / 1e12)
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    g = jax.jit(lambda a, b: a @ b)
    t, _ = bench(g, a, a)
    emit(what="ceiling_bf16_matmul", flops=2 * 8192 ** 3, seconds=t, tflop_per_s=2 * 8192 ** 3 / t / 1e12)
    del x, a


def slice_config(n_layers: int, small: bool, engram_rows: int):
    base = preset("v41-flash").raw
    d = json.loads(json.dumps(base))
    t = d["text_config"]
    ratios = [0, 2, 1, 1, 2, 1][:n_layers]
    t.update(num_hidden_layers=n_layers, compress_ratios=ratios, num_nextn_predict_layers=0,
             kv_source_layer_ids=[i for i in range(n_layers) if i in (1, 2)],
             index_source_layer_ids=[i for i in range(n_layers) if i in (1, 2, 3)],
             candidate_source_layer_id=2 if n_layers > 2 else -1,
             engram_layer_ids=[0], dspark_target_layer_ids=[])
    if small:
        t.update(hidden_size=256, moe_intermediate_size=128, num_attention_heads=8, head_dim=128,
                 qk_rope_head_dim=64, q_lora_rank=64, o_lora_rank=64, o_groups=4, n_routed_experts=32,
                 index_n_heads=4, index_head_dim=64, vocab_size=4096)
        d["vision_config"].update(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256)
        d["image_token_id"] = 4000
        t["engram_compressed_vocab_size"] = 3000
    # Engram at a documented fraction of the real table (rows), primes re-derived below
    from dsv41_jax.engram_layout import engram_primes

    t["engram_vocab_size"] = max(engram_rows // ((t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]), 1000)
    t["engram_num_embeddings"] = [0]
    primes = engram_primes(t)
    t["engram_num_embeddings"] = [int(sum(sum(s) for s in layer)) for layer in primes]
    return parse_config(d)


def random_model(cfg, numerics, seed=0):
    """Build the model abstractly and materialise every leaf with random values on the device."""
    from dsv41_jax.model.lm import DeepseekV41

    abstract = nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = jax.random.key(seed)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def init(k, shp, dt):
        if dt == jnp.uint8:
            return jax.random.randint(k, shp, 110, 125).astype(jnp.uint8)
        if dt == jnp.int32:
            return jax.random.randint(k, shp, 0, 1000).astype(jnp.int32)
        return (0.05 * jax.random.normal(k, shp, jnp.float32)).astype(dt)

    out = [init(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype)) for i, leaf in enumerate(leaves)]
    state = jax.tree_util.tree_unflatten(treedef, out)
    model = nnx.merge(graphdef, state)
    if model.engram_hasher is not None:
        rng = np.random.default_rng(0)
        t = cfg.text
        tmap = rng.integers(0, t.engram_compressed_vocab_size, size=t.vocab_size).astype(np.int32)
        tmap[: t.engram_compressed_vocab_size] = np.arange(t.engram_compressed_vocab_size)
        model.engram_hasher.set_token_map(tmap)
    return model


def param_bytes(model):
    st = nnx.state(model, nnx.Param)
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(st))


def bench_decode(model, cfg, batches, ctx, moe_path="auto", tag="engram_table_on_device"):
    from dsv41_jax.generate import _forward, _split

    graphdef, state = _split(model)
    os.environ["DSV41_MOE_PATH"] = moe_path
    fn = jax.jit(functools.partial(_forward, graphdef), donate_argnums=(1,))  # fresh trace per path
    t = cfg.text
    for B in batches:
        try:
            cache = model.init_cache(B, ctx + 64)
            cache = dict(cache, length=jnp.full((B,), ctx, jnp.int32))
            ids = jnp.ones((B, 1), jnp.int32)
            valid = jnp.ones((B, 1), bool)
            t0 = time.perf_counter()
            lg, cache = fn(state, cache, ids, valid, None, None, None)
            jax.block_until_ready(lg)
            compile_s = time.perf_counter() - t0
            ts = []
            for _ in range(5):
                t1 = time.perf_counter()
                lg, cache = fn(state, cache, ids, valid, None, None, None)
                jax.block_until_ready(lg)
                ts.append(time.perf_counter() - t1)
            step = float(np.median(ts))
            emit(what="decode_step", batch=B, ctx=ctx, layers=t.num_hidden_layers, moe_path=moe_path, engram=tag, seconds=step,
                 first_call_s=compile_s, tokens_per_s=B / step)
            del cache
        except Exception as e:  # report and continue (OOM etc.)
            emit(what="decode_step", batch=B, error=f"{type(e).__name__}: {str(e)[:300]}")


def bench_prefill(model, cfg, lengths):
    from dsv41_jax.generate import _jitted, _split

    graphdef, state = _split(model)
    fn = _jitted(graphdef)
    for S in lengths:
        try:
            cache = model.init_cache(1, S)
            ids = jax.random.randint(jax.random.key(1), (1, S), 0, cfg.text.vocab_size).astype(jnp.int32)
            valid = jnp.ones((1, S), bool)
            t0 = time.perf_counter()
            lg, _ = fn(state, cache, ids, valid, None, None, None)
            jax.block_until_ready(lg)
            first = time.perf_counter() - t0
            cache = model.init_cache(1, S)
            t1 = time.perf_counter()
            lg, _ = fn(state, cache, ids, valid, None, None, None)
            jax.block_until_ready(lg)
            run = time.perf_counter() - t1
            emit(what="prefill", tokens=S, layers=cfg.text.num_hidden_layers, seconds=run, first_call_s=first,
                 tokens_per_s=S / run)
        except Exception as e:
            emit(what="prefill", tokens=S, error=f"{type(e).__name__}: {str(e)[:300]}")


def bench_vit(model, cfg, tokens):
    from dsv41_jax import processor
    from dsv41_jax.model.vision import encode_images
    from PIL import Image

    v = cfg.vision
    side = int(np.sqrt(tokens)) * v.patch_size * v.downsample_ratio
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    pi = processor.preprocess_image(img, v)
    try:
        t0 = time.perf_counter()
        out = encode_images(model.vision, model.aligner, model, [pi], model.numerics)
        jax.block_until_ready(out)
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = encode_images(model.vision, model.aligner, model, [pi], model.numerics)
        jax.block_until_ready(out)
        run = time.perf_counter() - t1
        emit(what="vit", image_tokens=int(np.prod(pi.llm_grid)), patches=pi.n_patches, seconds=run, first_call_s=first)
    except Exception as e:
        emit(what="vit", error=f"{type(e).__name__}: {str(e)[:300]}")


def bench_compile_full(numerics):
    """Compile (not run) one decode step of the full 40-layer V4.1-Flash config from abstract weights."""
    from dsv41_jax.cache import init_cache
    from dsv41_jax.generate import _forward
    from dsv41_jax.model.lm import DeepseekV41
    import functools

    cfg = preset("v41-flash")
    t0 = time.perf_counter()
    abstract = nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True, text_only=True))
    graphdef, state = nnx.split(abstract)
    cache = jax.eval_shape(lambda: init_cache(cfg.text, 1, 4096, numerics.dtype))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, 1), jnp.bool_)
    lowered = jax.jit(functools.partial(_forward, graphdef)).lower(state, cache, ids, valid, None, None, None)
    t_lower = time.perf_counter() - t0
    compiled = lowered.compile()
    t_comp = time.perf_counter() - t0 - t_lower
    emit(what="compile_full_40_layers_decode", trace_lower_s=t_lower, compile_s=t_comp)
    del compiled


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--engram-rows", type=int, default=80_000_000)
    ap.add_argument("--skip", default="")
    ap.add_argument("--moe-paths", default="", help="also time decode with these forced MoE paths")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    jax.config.update("jax_default_matmul_precision", "default")
    emit(what="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()])
    if "ceil" not in skip:
        ceilings()
    numerics = Numerics("bfloat16", "reference")
    if "compile" not in skip:
        try:
            bench_compile_full(numerics)
        except Exception as e:
            emit(what="compile_full_40_layers_decode", error=f"{type(e).__name__}: {str(e)[:300]}")
    cfg = slice_config(a.layers, a.small, a.engram_rows)
    t0 = time.perf_counter()
    model = random_model(cfg, numerics)
    jax.block_until_ready(nnx.state(model))
    emit(what="build", layers=a.layers, param_gb=param_bytes(model) / 1e9, seconds=time.perf_counter() - t0,
         engram_rows=cfg.text.engram_num_embeddings)
    if "decode" not in skip:
        bench_decode(model, cfg, [int(b) for b in a.batches.split(",")], a.ctx)
        if a.moe_paths:
            for pth in a.moe_paths.split(","):
                bench_decode(model, cfg, [int(b) for b in a.batches.split(",")], a.ctx, moe_path=pth)
            os.environ["DSV41_MOE_PATH"] = "auto"
    if "engram_host" not in skip and "decode" not in skip:
        from dsv41_jax.model.engram import offload_engram_tables

        t0 = time.perf_counter()
        moved = offload_engram_tables(model)
        emit(what="engram_offload", bytes=moved, seconds=time.perf_counter() - t0)
        bench_decode(model, cfg, [int(b) for b in a.batches.split(",")], a.ctx, moe_path="auto",
                     tag="engram_table_on_host")
    if "prefill" not in skip:
        bench_prefill(model, cfg, [int(s) for s in a.prefill.split(",")])
    if "vit" not in skip and model.vision is not None:
        bench_vit(model, cfg, 1024 if not a.small else 64)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_slice.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
