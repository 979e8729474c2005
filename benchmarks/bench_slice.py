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
import contextlib
import functools
import hashlib
import json
import math
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
TAG = ""
MM_TFLOP_S = None  # measured bf16 matmul rate of this call (set by main)
MOE_PATHS = ("auto",)  # MoE paths the per-part breakdown times (--breakdown-moe-paths)


def _kernels() -> str:
    from dsv41_jax.kernels import use_pallas

    return "pallas" if use_pallas() else "xla"


def jsonl_emitter(filename: str):
    """An ``emit(**row)`` that prints the row as one JSON line and appends it to $OUT/filename
    (when $OUT is set): an incremental copy that survives a time-out of the device call."""
    def emit_row(**row):
        print(json.dumps(row), flush=True)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, filename), "a") as f:
                f.write(json.dumps(row) + "\n")
    return emit_row


_emit_row = jsonl_emitter("bench_slice.jsonl")


def emit(**kw):
    if TAG:
        kw["tag"] = TAG
    RESULTS.append(kw)
    _emit_row(**kw)


def _env_pairs(v: str) -> dict:
    """``'A=1,B=2'`` -> ``{'A': '1', 'B': '2'}`` (one variant of ``--prefill-variants`` /
    ``--loop-variants``; a value may hold ``=``, and ``,`` where no ``NAME=`` follows it: JSON
    such as ``DSV41_MGPU_TILES={"chain":true,"cluster":2}``)."""
    import re

    return dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", v))


@contextlib.contextmanager
def variant(tag: str, env: dict | None = None):
    """Rows emitted inside carry ``tag`` and the environment holds ``env``; both restored after
    (A/B runs in one process: settings read at trace time need a fresh compile)."""
    global TAG
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    old, TAG = TAG, tag
    os.environ.update(env)
    jax.clear_caches()  # module-level jitted helpers (quant.fq_fp8, ...) would replay their old traces
    try:
        yield
    finally:
        TAG = old
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        jax.clear_caches()


def apply_expert_layout(model) -> None:
    """Store the int8 experts as ``DSV41_EXPERT_LAYOUT`` asks now (``rows``: unblocked, else
    ``moe.block_expert_codes``'s choice), so that a variant that sets it (``--prefill-variants``,
    ``--loop-variants``) runs on that layout; emits a row when the layout changes."""
    from dsv41_jax.generate import forget
    from dsv41_jax.model.moe import block_expert_codes, expert_layout, unblock_expert_codes

    n = unblock_expert_codes(model) if expert_layout() == "rows" else block_expert_codes(model)
    if n:
        forget(model)
        jax.block_until_ready(nnx.state(model))
        emit(what="expert_layout", layout=expert_layout(), projections=n)


def bench(fn, *args, warmup=2, iters=5, times=None):
    """Median seconds of ``iters`` calls (after ``warmup``); ``times``: a list that receives every
    call's seconds."""
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
    if times is not None:
        times.extend(ts)
    return float(np.median(ts)), out


def ceilings():
    """The copy and bf16-matmul ceilings. The copy ceiling (median of 20 host-timed 1 GiB copies)
    read 2.04-2.61 TB/s across the processes of one session (docs/performance.md run 16); the row
    also gives the fastest and slowest of the 20 so the spread inside a process shows."""
    x = jnp.ones((1 << 30) // 2, jnp.bfloat16)  # 1 GiB
    f = jax.jit(lambda a: a * 2)
    ts = []
    t, _ = bench(f, x, warmup=5, iters=20, times=ts)
    copy = 2 * x.nbytes / t / 1e12
    emit(what="ceiling_copy", bytes=2 * x.nbytes, seconds=t, tb_per_s=copy,
         tb_per_s_fastest=2 * x.nbytes / min(ts) / 1e12, tb_per_s_slowest=2 * x.nbytes / max(ts) / 1e12)
    del x
    return copy, matmul_ceiling()


def matmul_ceiling(n: int = 8192, **row) -> float:
    """The bf16 matmul ceiling (TFLOP/s) of ``n``^3 products, as the highest of three readings:
    the median of twenty host-timed products, the fastest of them, and the rate inside one jitted
    chain of eight dependent products (no host dispatch between them). Until session 25 it was
    the median of five, which read 556-693 on H100s whose robust reading is 723-737 (run 35):
    the MFU of the rows that divide by it was overstated. The prefill rows are also compared
    with a second reading after them (``when="after_prefill"``)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    g = jax.jit(lambda a, b: a @ b)
    ts = []
    t, _ = bench(g, a, a, iters=20, times=ts)
    b = a * (1.0 / math.sqrt(n))  # (unit-scale products along the chain)
    chain = jax.jit(lambda x, b: jax.lax.fori_loop(0, 8, lambda _, y: y @ b, x))
    tc, _ = bench(chain, a, b, iters=5)
    fl = 2 * n ** 3
    rates = dict(tflop_per_s=fl / t / 1e12, tflop_per_s_fastest=fl / min(ts) / 1e12,
                 tflop_per_s_chain8=8 * fl / tc / 1e12)
    used = max(rates.values())
    emit(what="ceiling_bf16_matmul", flops=fl, seconds=t, **rates, tflop_per_s_used=used, **row)
    return used


def shrink_to_small(d: dict) -> None:
    """The --small widths (CPU smoke tests): hidden 256, 32 experts, vocab 4096, a 2-layer ViT."""
    t = d["text_config"]
    t.update(hidden_size=256, moe_intermediate_size=128, num_attention_heads=8, head_dim=128,
             qk_rope_head_dim=64, q_lora_rank=64, o_lora_rank=64, o_groups=4, n_routed_experts=32,
             index_n_heads=4, index_head_dim=64, vocab_size=4096)
    d["vision_config"].update(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256)
    d["image_token_id"] = 4000
    t["engram_compressed_vocab_size"] = 3000


def set_engram_vocab(t: dict, vocab: int) -> None:
    """Engram tables of ``vocab`` n-gram ids per head and order (the release: 16M -> 384M rows
    per table); the per-head primes and table sizes re-derived like the release's."""
    from dsv41_jax.engram_layout import engram_primes

    t["engram_vocab_size"] = max(int(vocab), 1000)
    t["engram_num_embeddings"] = [0]
    primes = engram_primes(t)
    t["engram_num_embeddings"] = [int(sum(sum(s) for s in layer)) for layer in primes]


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
        shrink_to_small(d)
    # Engram at a documented fraction of the real table (rows)
    set_engram_vocab(t, engram_rows // ((t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]))
    return parse_config(d)


def _random_bytes(k, shp):
    """Uniform random uint8 of ``shp`` from 32-bit words (no [shp] uint32 temporary)."""
    if shp and shp[-1] % 4 == 0:
        r = jax.random.bits(k, (*shp[:-1], shp[-1] // 4), jnp.uint32)
        return jax.lax.bitcast_convert_type(r, jnp.uint8).reshape(shp)
    return jax.random.bits(k, shp, jnp.uint8)


def random_leaf(k, shp, dt):
    """Random values for one leaf: int8 codes in -12..12 (twice the e2m1 values), ue8m0 scale
    bytes 110..124, int32 in 0..999, fp8 codes of magnitude < 2 with a random sign, floats
    0.05 x normal. The byte-sized ones come from random bytes, so a large table (an Engram
    table, a layer's experts) needs little temporary memory."""
    if dt == jnp.uint8:
        return (110 + _random_bytes(k, shp) % 15).astype(jnp.uint8)
    if dt == jnp.int32:
        return jax.random.randint(k, shp, 0, 1000).astype(jnp.int32)
    if dt == jnp.int8:
        return (_random_bytes(k, shp) % 25).astype(jnp.int8) - 12
    if dt == jnp.float8_e4m3fn:
        r = _random_bytes(k, shp)
        return jax.lax.bitcast_convert_type((r & 0x3F) | ((r & 0x40) << 1), jnp.float8_e4m3fn)
    return (0.05 * jax.random.normal(k, shp, jnp.float32)).astype(dt)


def random_model(cfg, numerics, seed=0, mesh=None, **model_kw):
    """Build the model abstractly and materialise every leaf with random values on the device;
    with ``mesh``, each leaf is generated straight into its partition rule's sharding (placed
    shape, so Engram tables come out padded like ``shard_model`` pads them): no host copy and
    no one-device staging, so a model larger than one GPU can be built.

    ``model_kw`` go to ``DeepseekV41`` (e.g. ``experts_int8=True``)."""
    from dsv41_jax.model.lm import DeepseekV41

    abstract = nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True, **model_kw))
    graphdef, state = nnx.split(abstract)
    if mesh is not None:
        from dsv41_jax import sharding as shd

        state = shd.abstract_params(abstract, mesh)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = jax.random.key(seed)
    fns = {}

    def init(i, leaf):
        sh = getattr(leaf, "sharding", None) if mesh is not None else None
        sig = (tuple(leaf.shape), jnp.dtype(leaf.dtype), sh)
        if sig not in fns:
            fns[sig] = jax.jit(functools.partial(random_leaf, shp=sig[0], dt=sig[1]), out_shardings=sh)
        return fns[sig](jax.random.fold_in(key, i))

    # largest first: their generation temporaries meet an empty device
    order = sorted(range(len(leaves)), key=lambda i: -int(np.prod(leaves[i].shape)) * jnp.dtype(leaves[i].dtype).itemsize)
    out = [None] * len(leaves)
    for i in order:
        out[i] = init(i, leaves[i])
    state = jax.tree_util.tree_unflatten(treedef, out)
    model = nnx.merge(graphdef, state)
    if model.engram_hasher is not None:
        rng = np.random.default_rng(0)
        t = cfg.text
        tmap = rng.integers(0, t.engram_compressed_vocab_size, size=t.vocab_size).astype(np.int32)
        tmap[: t.engram_compressed_vocab_size] = np.arange(t.engram_compressed_vocab_size)
        model.engram_hasher.set_token_map(tmap)
        if mesh is not None:  # the new map onto the mesh (the placed leaves are left as they are)
            from dsv41_jax import sharding as shd

            shd.shard_model(model, mesh)
    return model


# Linears the V4.1 release stores fp8 (with a ``.scale``): in reference numerics their inputs go
# through the per-32 fp8 activation quantization, as after a real checkpoint load (weights.py)
RELEASE_FP8 = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "engram.wkv",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")


def mark_release_quantized(model):
    for layer in model.layers:
        for name in RELEASE_FP8:
            mod = layer
            for part in name.split("."):
                mod = getattr(mod, part, None)
                if mod is None:
                    break
            if mod is not None:
                mod.quantized = True
        layer.ffn.experts.quantized = True


def _leaves_by_path(model):
    st = nnx.state(model, nnx.Param)
    out = {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(st)[0]:
        key = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p).replace("..value", "")
        out[key] = leaf
    return out


def _router_picks(model, cfg, B: int, S: int, start: int = 0, capacity: int | None = None):
    """A ``picks(state, ids)``: every layer's routed expert ids [B, S, k] for ``ids`` [B, S] at
    positions ``start ..`` over a cache of ``capacity`` (default S) filled up to ``start`` (one
    jitted forward with capture, run under the model's mesh when it is sharded; the state is an
    argument, so new router biases reuse the executable)."""
    from dsv41_jax import sharding as shd

    graphdef, state0 = nnx.split(model)
    L = cfg.text.num_hidden_layers
    mesh = shd.mesh_of(jax.tree_util.tree_leaves(state0))
    cache = model.init_cache(B, capacity or S)
    if start:
        cache = dict(cache, length=jnp.full((B,), start, jnp.int32))
    if mesh is not None:
        cache = shd.shard_cache(cache, mesh)
    positions = jnp.broadcast_to(start + jnp.arange(S, dtype=jnp.int32), (B, S))

    @jax.jit
    def routed(state, cache, ids):
        cap = {}
        nnx.merge(graphdef, state)(ids, positions=positions, valid=jnp.ones((B, S), bool), cache=cache, capture=cap)
        return [cap[f"moe_topk_L{l}"] for l in range(L)]

    def picks(state, ids):
        if mesh is None:
            return routed(state, cache, ids)
        with shd.use_mesh(mesh):
            return routed(state, cache, ids)

    return picks


def routed_ids(model, cfg, B: int, ctx: int, seed: int = 11) -> list:
    """The expert ids each layer's router picks in one decode step of B random tokens at ``ctx``
    (the benchmark's inputs): with random weights the router need not spread tokens uniformly, so
    the byte roofline uses these picks, not the uniform expectation."""
    ids = jax.random.randint(jax.random.key(seed + B), (B, 1), 0, cfg.text.vocab_size).astype(jnp.int32)
    picks = _router_picks(model, cfg, B, 1, start=ctx, capacity=ctx + 64)(nnx.state(model), ids)
    return [np.asarray(x) for x in picks]


def prefill_routing(model, cfg, S: int, chunks=(128, 160)) -> None:
    """Per-layer expert loads of one prefill of S random tokens (``bench_prefill``'s prompt): how
    many experts are used, the largest count, the share of the 8 busiest experts, and the expert
    blocks (weight reads of the routed kernel) and padded rows of ``MoE.routed_pallas``' layout at
    each block size in ``chunks``."""
    ids = jax.random.randint(jax.random.key(1), (1, S), 0, cfg.text.vocab_size).astype(jnp.int32)
    picks = _router_picks(model, cfg, 1, S)(nnx.state(model), ids)
    E = cfg.text.n_routed_experts
    for l, p in enumerate(picks):
        counts = np.bincount(np.asarray(p).ravel(), minlength=E)
        row = dict(what="prefill_routing", tokens=S, layer=l, router=ROUTER, pairs=int(counts.sum()),
                   experts_used=int((counts > 0).sum()), max_count=int(counts.max()),
                   uniform_mean=round(counts.sum() / E, 1),
                   top8_share=round(float(np.sort(counts)[-8:].sum() / counts.sum()), 3))
        for c in chunks:
            blocks = int(np.sum(-(-counts // c)))
            row[f"blocks_c{c}"], row[f"padded_c{c}"] = blocks, round(blocks * c / counts.sum() - 1, 3)
        emit(**row)


ROUTER = "random"


def balance_router(model, cfg, S: int | None = None, iters: int = 40, step: float = 0.02, seed: int = 7) -> None:
    """Give the random routers the balanced loads of a trained one. Random gate weights and
    biases route most tokens to a few experts (the biases dominate the scores and the hidden
    states of random tokens are alike), which makes a MoE benchmark read few experts' weights.
    Training balances the loads with the router bias (DeepSeek's auxiliary-loss-free rule:
    raise the bias of under-loaded experts, lower the over-loaded ones); this runs that rule on
    a calibration prompt of S random tokens (not the benchmark's prompts; default: 32 pairs per
    expert on average, at most 2048 tokens) from zero biases, with a step that shrinks
    geometrically. Emits the loads before and after."""
    global ROUTER
    t = cfg.text
    if S is None:
        S = 16
        while S < 2048 and S * t.num_experts_per_tok < 32 * t.n_routed_experts:
            S *= 2
    picks = _router_picks(model, cfg, 1, S)
    ids = jax.random.randint(jax.random.key(seed), (1, S), 0, t.vocab_size).astype(jnp.int32)
    gates = [layer.ffn.gate for layer in model.layers]
    for g in gates:
        g.bias[...] = jnp.zeros_like(g.bias[...])
    mean = S * t.num_experts_per_tok / t.n_routed_experts
    loads = []
    for it in range(iters + 1):
        counts = [np.bincount(np.asarray(p).ravel(), minlength=t.n_routed_experts) for p in picks(nnx.state(model), ids)]
        loads.append([round(float(c.max() / mean), 2) for c in counts])
        if it == iters:
            break
        for g, c in zip(gates, counts):
            g.bias[...] = g.bias[...] + jnp.asarray(step * 0.9 ** it * np.sign(mean - c), jnp.float32)
    for g in gates:
        if g.bias_vl is not None:
            g.bias_vl[...] = g.bias[...]
    ROUTER = "balanced"
    emit(what="router_balanced", calibration_tokens=S, iters=iters, max_over_mean_first=loads[0],
         max_over_mean_last=loads[-1])


def measured_distinct(model, cfg, B: int, ctx: int) -> list:
    """Distinct routed experts per layer that one decode step of the benchmark selects."""
    return [int(np.unique(ids).size) for ids in routed_ids(model, cfg, B, ctx)]


def decode_bytes(model, cfg, B: int, ctx: int, distinct_per_layer=None) -> dict:
    """Bytes one decode step must read (the roofline numerator), by part.

    Weights: every layer parameter except the routed experts and the Engram table; of the
    routed experts the expected number of distinct experts B tokens select (uniform routing:
    E * (1 - (1 - k/E)^B)); the head. Caches: the window ring, the top-k compressed entries
    gathered per token, all index keys an index source scores. Engram: the table rows the
    tokens hash to. Activations are ignored (KBs). ``distinct_per_layer``: measured distinct
    experts per layer (``measured_distinct``) in place of the uniform expectation."""
    t = cfg.text
    E, k = t.n_routed_experts, t.num_experts_per_tok
    leaves = _leaves_by_path(model)
    parts = {"attention+mhc+norms": 0, "routed_experts": 0, "shared_expert+gate": 0, "engram_proj": 0,
             "engram_rows": 0, "head": 0, "caches": 0}
    distinct = E * (1 - (1 - k / E) ** B)
    for key, leaf in leaves.items():
        if not key.startswith("layers."):
            if key.startswith("head."):
                parts["head"] += leaf.nbytes
            continue
        if ".ffn.experts." in key:
            d = distinct if distinct_per_layer is None else distinct_per_layer[int(key.split(".")[1])]
            parts["routed_experts"] += leaf.nbytes / E * d
        elif ".ffn." in key:
            parts["shared_expert+gate"] += leaf.nbytes
        elif ".engram.embed." in key:
            row = leaf.nbytes / leaf.shape[0]
            parts["engram_rows"] += B * t.engram_cols * row
        elif ".engram." in key:
            parts["engram_proj"] += leaf.nbytes
        else:
            parts["attention+mhc+norms"] += leaf.nbytes
    esz = jnp.dtype(model.numerics.dtype).itemsize
    for p in t.layers:
        parts["caches"] += B * t.sliding_window * t.head_dim * (esz + 4 / t.head_dim)
        if p.ratio > 0:
            parts["caches"] += B * min(t.index_topk, ctx // p.ratio) * t.head_dim * esz
        if p.owns_indexer:
            parts["caches"] += B * (ctx // p.ratio) * t.index_head_dim * esz
    parts = {kk: float(v) for kk, v in parts.items()}
    parts["total"] = float(sum(parts.values()))
    return parts


def bench_breakdown(model, cfg, B, ctx, copy_tb_s, prefill: int = 0, mm_tflop_s=None):
    """Time the pieces of a decode step in isolation (batch B): each layer's attention (with its
    cache at ``ctx`` tokens), each layer's MoE, the Engram layer, one mHC site, the head.
    ``prefill`` > 0: the same pieces for a one-row prefill of that many tokens (MoE rows report
    TFLOP/s and the fraction of the matmul ceiling)."""
    from dsv41_jax.model.mhc import hc_mixes, hc_post, hc_pre

    t = cfg.text
    D, n = t.hidden_size, t.hc_mult
    S = prefill or 1
    if prefill:
        B = 1
    x = (0.1 * jax.random.normal(jax.random.key(3), (B, S, D), jnp.float32)).astype(model.numerics.dtype)
    if prefill:
        pos = jnp.arange(S, dtype=jnp.int32)[None]
        cache = model.init_cache(1, S)
    else:
        pos = jnp.full((B, 1), ctx, jnp.int32)
        cache = model.init_cache(B, ctx + 64)
    valid = jnp.ones((B, S), bool)

    what = "prefill_part" if prefill else "decode_part"

    def run(name, module, fn, *args, nbytes=None, flops=None):
        g, st = nnx.split(module)
        f = jax.jit(lambda st, *a: fn(nnx.merge(g, st), *a))
        try:
            sec, _ = bench(f, st, *args, iters=10 if not prefill else 3)
            row = dict(what=what, part=name, batch=B, tokens=S, seconds=sec, kernels=_kernels())
            if nbytes and not prefill:
                row.update(bytes=nbytes, roofline_s=nbytes / (copy_tb_s * 1e12), tb_per_s=nbytes / sec / 1e12)
            if flops and prefill:
                row.update(flops=flops, tflop_per_s=flops / sec / 1e12)
                if mm_tflop_s:
                    row.update(mfu=flops / sec / 1e12 / mm_tflop_s)
            emit(**row)
        except Exception as e:
            emit(what=what, part=name, batch=B, tokens=S, error=f"{type(e).__name__}: {str(e)[:300]}")

    def nbytes(module):
        return sum(v.nbytes for v in jax.tree_util.tree_leaves(nnx.state(module, nnx.Param)))

    E, k = t.n_routed_experts, t.num_experts_per_tok
    distinct = E * (1 - (1 - k / E) ** B)
    for l, layer in enumerate(model.layers):
        run(f"attn_L{l}_ratio{layer.plan.ratio}", layer.attn,
            lambda m, c: m(x, pos, valid, c, {})[0], cache["layers"][l], nbytes=nbytes(layer.attn))
        ex = layer.ffn.experts
        moe_b = nbytes(layer.ffn) - nbytes(ex) + nbytes(ex) / E * distinct
        moe_f = 2.0 * S * (k + 1) * 3 * t.moe_intermediate_size * D
        for pth in MOE_PATHS:
            os.environ["DSV41_MOE_PATH"] = pth
            run(f"moe_L{l}[{pth}]", layer.ffn, lambda m: m(x), nbytes=moe_b, flops=moe_f)
        os.environ["DSV41_MOE_PATH"] = "auto"
        if prefill:  # the MoE of the other layers costs the same
            break
        if layer.engram is not None:
            h = jnp.broadcast_to(x[:, :, None], (B, S, n, D))
            rows = layer.engram.embed.weight.get_value().shape[0]
            hashes = jax.random.randint(jax.random.key(4), (B, S, t.engram_cols), 0, rows)
            eb = nbytes(layer.engram.wkv) + B * t.engram_cols * (layer.engram.embed.dim + layer.engram.embed.dim // 32)
            run(f"engram_L{l}", layer.engram, lambda m, hh, hs: m(hh, hs), h, hashes, nbytes=eb)
    layer = model.layers[0]
    h = jnp.broadcast_to(x[:, :, None], (B, S, n, D))
    pre = jnp.full((B, S, n), 1.0 / n, jnp.float32)

    def mhc_site(m, hh, pr):
        p2, post, comb = hc_mixes(hh, m.hc_attn_fn[...], m.hc_attn_scale[...], m.hc_attn_base[...], **m._hc())
        y = m.attn_norm(hc_pre(hh, pr))
        return hc_post(y, hh, post, comb), p2

    run("mhc_site(x2 per layer)", layer, mhc_site, h, pre)
    run("head", model, lambda m, y: m.logits(y[:, -1:]), x, nbytes=model.head.weight.get_value().nbytes)


def param_bytes(model):
    st = nnx.state(model, nnx.Param)
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(st))


def bench_decode(model, cfg, batches, ctx, moe_path="auto", tag="engram_table_on_device", copy_tb_s=None):
    from dsv41_jax.generate import _forward, _split

    graphdef, state = _split(model)
    os.environ["DSV41_MOE_PATH"] = moe_path
    fn = jax.jit(functools.partial(_forward, graphdef), donate_argnums=(1,))  # fresh trace per path
    t = cfg.text
    for B in batches:
        try:
            cache = model.init_cache(B, ctx + 64)
            cache = dict(cache, length=jnp.full((B,), ctx, jnp.int32))
            # a different token per row: rows route to different experts, as in a real batch
            # (identical rows would all read the same 6 experts per layer)
            ids = jax.random.randint(jax.random.key(11 + B), (B, 1), 0, t.vocab_size).astype(jnp.int32)
            valid = jnp.ones((B, 1), bool)
            t0 = time.perf_counter()
            lowered = fn.lower(state, cache, ids, valid, None, None, None)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            lg, cache = compiled(state, cache, ids, valid, None, None, None)
            jax.block_until_ready(lg)
            first_run = time.perf_counter() - t2
            ts = []
            for _ in range(7):
                t3 = time.perf_counter()
                lg, cache = compiled(state, cache, ids, valid, None, None, None)
                jax.block_until_ready(lg)
                ts.append(time.perf_counter() - t3)
            step = float(np.median(ts))
            row = dict(what="decode_step", batch=B, ctx=ctx, layers=t.num_hidden_layers, moe_path=moe_path,
                       kernels=_kernels(), engram=tag, seconds=step,
                       lower_s=t1 - t0, compile_s=t2 - t1, first_run_s=first_run, tokens_per_s=B / step)
            if copy_tb_s:
                nb = decode_bytes(model, cfg, B, ctx)
                row.update(bytes=nb["total"], roofline_s=nb["total"] / (copy_tb_s * 1e12),
                           roofline_frac=nb["total"] / (copy_tb_s * 1e12) / step)
            emit(**row)
            del cache, compiled
        except Exception as e:  # report and continue (OOM etc.)
            emit(what="decode_step", batch=B, moe_path=moe_path, error=f"{type(e).__name__}: {str(e)[:300]}")


WARM_S = 2.0  # seconds of decode loops before each timed batch size (bench_decode_loop)


def _sha(text) -> str:
    """A short fingerprint of an executable's optimized HLO: two rows of the same code compiled
    alike (kernels, autotuned configs, fusions) show the same value."""
    return hashlib.sha1((text or "").encode()).hexdigest()[:12]


def decode_loop_runner(model, cfg, B: int, ctx: int, n_tokens: int):
    """``(compiled, fresh, compile_s)``: ``generate``'s decode-loop executable for batch ``B`` at
    context ``ctx`` (``n_tokens`` slots of output) and ``fresh(limit)``, its arguments with a new
    cache (the loop donates it) that stop after ``limit`` tokens. Shared with
    ``profile_step.py --targets loop:B``."""
    from dsv41_jax.generate import DecodeState, _executable, _placed, _split_flat, loop_options
    from dsv41_jax.sampling import SamplingParams
    from dsv41_jax.sharding import mesh_of

    graphdef, state = _split_flat(model)
    mesh = mesh_of(state)
    V = cfg.text.vocab_size

    def fresh(limit):
        cache = model.init_cache(B, ctx + n_tokens + 64)
        cache = dict(cache, length=jnp.full((B,), ctx, jnp.int32))
        logits = jax.random.normal(jax.random.key(5 + B), (B, V), jnp.float32)
        ds = DecodeState(tokens=jnp.full((B, n_tokens), -1, jnp.int32), logits=logits,
                         step=jnp.asarray(0, jnp.int32), done=jnp.zeros((B,), bool),
                         count=jnp.zeros((B,), jnp.int32), finish=jnp.zeros((B,), jnp.int32),
                         cache=cache, key=jax.random.PRNGKey(0))
        return _placed(mesh, "decode_loop", (state, ds, SamplingParams.greedy(B).pad(B), jnp.zeros((V,), bool),
                                             jnp.zeros((V,), bool), jnp.full((B,), n_tokens, jnp.int32),
                                             jnp.asarray(limit, jnp.int32)))

    # the loop generate runs for greedy rows (its options follow DSV41_SAMPLING_BRANCHES / DSV41_LOOP_STEPS)
    compiled, compile_s = _executable("decode_loop", graphdef, fresh(n_tokens), mesh, loop_options(False))
    return compiled, fresh, compile_s


def bench_decode_loop(model, cfg, batches, ctx, n_tokens: int = 64, copy_tb_s=None, roofline=None):
    """Per-token decode time as users get it: ``generate``'s on-device while_loop (sampling,
    stop checks and the model step per iteration; one dispatch per request). Times the loop
    for ``n_tokens`` and for 8 tokens from the same compiled executable (the step count is an
    array) and reports the difference per token, so dispatch and setup cancel out. A sharded
    model runs as ``generate`` runs it (cache and inputs placed by the rules, under the mesh).
    ``roofline(B, seconds_per_step)``: extra fields for the row (e.g. per-device bytes on a
    mesh), in place of the one-device byte roofline at ``copy_tb_s``."""
    if n_tokens <= 8:
        raise ValueError(f"decode loop: {n_tokens} tokens per timed loop; it must exceed the 8-token loop it is "
                         "compared with (--loop-tokens)")
    from dsv41_jax.generate import _split_flat, clear_compiled
    from dsv41_jax.sharding import mesh_of

    mesh = mesh_of(_split_flat(model)[1])
    t = cfg.text
    for B in batches:
        try:
            compiled, fresh, compile_s = decode_loop_runner(model, cfg, B, ctx, n_tokens)

            def run(limit):
                args = fresh(limit)
                jax.block_until_ready(args[1:])
                t1 = time.perf_counter()
                out = compiled(*args)
                steps = int(out.step)
                return time.perf_counter() - t1, steps

            # warm-up: loops for at least WARM_S seconds, so the GPU leaves its idle clocks (after the
            # compile) before timing. Run 24 measured the first of three same-process variants of
            # batch 1 35-60 us slower than a later repeat of the same code after one warm-up loop.
            t_warm = time.perf_counter() + WARM_S
            while time.perf_counter() < t_warm:
                run(n_tokens)
            long = [run(n_tokens) for _ in range(3)]
            short = [run(8) for _ in range(3)]
            tl = float(np.median([x[0] for x in long]))
            ts = float(np.median([x[0] for x in short]))
            per = (tl - ts) / (long[0][1] - short[0][1])
            row = dict(what="decode_loop", batch=B, ctx=ctx, layers=t.num_hidden_layers, tokens=n_tokens,
                       kernels=_kernels(), seconds_per_step=per, tokens_per_s=B / per, loop_s=tl,
                       short_loop_s=ts, compile_s=compile_s, hlo_sha=_sha(compiled.as_text()),
                       mesh=None if mesh is None else list(mesh.shape.values()))
            if roofline is not None:
                row.update(roofline(B, per))
            elif copy_tb_s:
                nb = decode_bytes(model, cfg, B, ctx)
                row.update(bytes_uniform=nb["total"], roofline_frac_uniform=nb["total"] / (copy_tb_s * 1e12) / per)
                dist = measured_distinct(model, cfg, B, ctx)
                nb = decode_bytes(model, cfg, B, ctx, dist)
                row.update(distinct_experts=dist, bytes=nb["total"], roofline_s=nb["total"] / (copy_tb_s * 1e12),
                           roofline_frac=nb["total"] / (copy_tb_s * 1e12) / per)
            emit(**row)
            compiled = None
            clear_compiled()  # free the executable before the next batch
        except Exception as e:  # report and continue
            emit(what="decode_loop", batch=B, error=f"{type(e).__name__}: {str(e)[:300]}")


def prefill_flops(model, cfg, S: int) -> float:
    """Matmul FLOPs of a prefill of S tokens (2 per multiply-add): every dense layer weight once
    per token, k routed experts per token, attention over min(W, pos) window keys + min(top-k,
    pos/ratio) entries (q.k and p.v), the indexer over pos/ratio index keys, the head once."""
    t = cfg.text
    leaves = _leaves_by_path(model)
    dense = sum(int(np.prod(v.shape)) for kk, v in leaves.items()
                if kk.startswith("layers.") and v.ndim == 2 and ".experts." not in kk and ".embed." not in kk
                and ".hc_" not in kk)
    routed = t.num_experts_per_tok * 3 * t.moe_intermediate_size * t.hidden_size * t.num_hidden_layers
    mhc = sum(int(np.prod(v.shape)) for kk, v in leaves.items() if ".hc_" in kk and v.ndim == 2)
    pos = np.arange(S)
    att = 0.0
    for p in t.layers:
        keys = np.minimum(pos + 1, t.sliding_window).sum()
        if p.ratio > 0:
            keys += np.minimum((pos + 1) // p.ratio, t.index_topk).sum()
        att += 4.0 * t.num_attention_heads * t.head_dim * keys
        if p.owns_indexer:
            att += 2.0 * t.index_n_heads * t.index_head_dim * ((pos + 1) // p.ratio).sum()
    return 2.0 * S * (dense + routed + mhc) + att + 2.0 * t.vocab_size * t.hidden_size


def bench_prefill(model, cfg, lengths, mm_tflop_s=None, batch: int = 1, reuse: bool = False):
    """One prompt of S tokens through ``generate``'s prefill executable (the whole prompt as one
    chunk, logits at the last position only); a sharded model runs as ``generate`` runs it.
    ``first_call_s`` includes the compile (``compile_s``). ``reuse``: also a ``prefill_reused``
    row (:func:`_prefill_reused`)."""
    from dsv41_jax.generate import _executable, _placed, _split_flat, clear_compiled
    from dsv41_jax.sharding import mesh_of

    graphdef, state = _split_flat(model)
    mesh = mesh_of(state)
    V = cfg.text.vocab_size
    for S in lengths:
        try:
            ids = jax.random.randint(jax.random.key(1), (batch, S), 0, V).astype(jnp.int32)

            def args():
                return _placed(mesh, "prefill", (state, model.init_cache(batch, S), ids, jnp.ones((batch, S), bool),
                                                 None, None, jnp.asarray(0, jnp.int32),
                                                 jnp.full((batch,), S - 1, jnp.int32), jnp.zeros((batch, V), jnp.float32)))

            t0 = time.perf_counter()
            fn, compile_s = _executable("prefill", graphdef, args(), mesh)
            _, lg = fn(*args())
            jax.block_until_ready(lg)
            first = time.perf_counter() - t0
            ts = []
            for _ in range(5):  # the median of five, every call kept in the row (each_s)
                a = args()
                jax.block_until_ready(a[1:])
                t1 = time.perf_counter()
                _, lg = fn(*a)
                jax.block_until_ready(lg)
                ts.append(time.perf_counter() - t1)
            run = float(np.median(ts))
            fl = batch * prefill_flops(model, cfg, S)
            row = dict(what="prefill", tokens=S, batch=batch, layers=cfg.text.num_hidden_layers, seconds=run,
                       each_s=[round(t, 6) for t in ts], first_call_s=first, compile_s=compile_s,
                       tokens_per_s=batch * S / run, flops=fl,
                       kernels=_kernels(), mesh=None if mesh is None else list(mesh.shape.values()))
            if mm_tflop_s:
                n_dev = 1 if mesh is None else mesh.size
                row.update(mfu=fl / run / (mm_tflop_s * 1e12 * n_dev))
            emit(**row)
            if reuse:
                _prefill_reused(fn, args(), row, lambda: model.init_cache(batch, S), lg)
            fn = None
            clear_compiled()
        except Exception as e:
            emit(what="prefill", tokens=S, error=f"{type(e).__name__}: {str(e)[:300]}")


def _prefill_reused(fn, a, row, fresh_cache, logits):
    """The same prefill with every argument at the same device address in each timed call: the
    prompt's arrays kept, the donated cache and pending logits refilled in place (a donated reset
    outside the timing) from the previous call's outputs. Against the ``prefill`` row (new buffers
    per call) it shows what XLA's command buffers cost when their CUDA graphs must be updated for
    new addresses (session 34's question); the emitted row copies ``row``'s sizes, and says whether
    the addresses held (``cache_addresses``: distinct address tuples, 1 when they did) and whether
    the refilled cache gave the fresh cache's ``logits`` (``same_logits``)."""
    def refill(old, new):  # written into the donated buffer (a plain new value would get a new one)
        return jax.lax.dynamic_update_slice(old, new.astype(old.dtype), (0,) * old.ndim)

    reset = jax.jit(lambda c, p: (jax.tree.map(refill, c, fresh_cache()), refill(p, jnp.zeros_like(p))),
                    donate_argnums=(0, 1))
    cache, prev = a[1], a[8]
    ts, addrs = [], set()
    for i in range(4):
        cache, prev = reset(cache, prev)
        jax.block_until_ready((cache, prev))
        addrs.add(tuple(x.unsafe_buffer_pointer() for x in jax.tree.leaves((cache, prev))))
        t1 = time.perf_counter()
        cache, prev = fn(a[0], cache, *a[2:8], prev)
        jax.block_until_ready(prev)
        if i:  # the first call may still move a buffer
            ts.append(time.perf_counter() - t1)
    run = float(np.median(ts))
    same = bool(np.array_equal(np.asarray(prev), np.asarray(logits)))
    out = dict(row, what="prefill_reused", seconds=run, each_s=[round(t, 6) for t in ts],
               tokens_per_s=row["tokens_per_s"] * row["seconds"] / run, cache_addresses=len(addrs),
               same_logits=same, first_call_s=None, compile_s=None)
    if "mfu" in row:
        out["mfu"] = row["mfu"] * row["seconds"] / run
    emit(**out)


def bench_vit(model, cfg, tokens, modes=("fp32", "bf16")):
    """ViT + aligner on one image of about ``tokens`` LLM tokens, per vision attention mode:
    "fp32" = the parity path (the reference's fp32 attention), "bf16" = the performance mode
    ("bf16:mgpu": with ``DSV41_VIT_ATTN=mgpu``, the Mosaic GPU kernel ``kernels.vit_attn``)."""
    import dataclasses

    from dsv41_jax import processor
    from dsv41_jax.model import vision as V
    from dsv41_jax.model.vision import encode_images
    from PIL import Image

    v = cfg.vision
    side = int(np.sqrt(tokens)) * v.patch_size * v.downsample_ratio
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    pi = processor.preprocess_image(img, v)
    # FLOPs of the real patches: 2 x linear params per patch per layer + q.k and p.v per layer
    N, Dv, L = pi.n_patches, v.hidden_size, v.num_hidden_layers
    lin = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model.vision, nnx.Param))
              if x.ndim == 2)
    flops = 2.0 * N * lin + 4.0 * N * N * Dv * L
    user_attn = os.environ.get("DSV41_VIT_ATTN")
    for spec in modes:
        # "bf16:mgpu" / "bf16:cudnn": the bf16 mode with DSV41_VIT_ATTN set for this row (a plain
        # mode keeps the caller's setting)
        mode, _, gpu_attn = spec.partition(":")
        gpu_attn = gpu_attn or user_attn
        if gpu_attn:
            os.environ["DSV41_VIT_ATTN"] = gpu_attn
        else:
            os.environ.pop("DSV41_VIT_ATTN", None)
        num = dataclasses.replace(model.numerics, vision_attention=mode)
        try:
            t0 = time.perf_counter()
            out = encode_images(model.vision, model.aligner, model, [pi], num)
            jax.block_until_ready(out)
            first = time.perf_counter() - t0
            ts, rets = [], []  # each call's time, and its host time (until it returns, the device running)
            for _ in range(3):
                t1 = time.perf_counter()
                out = encode_images(model.vision, model.aligner, model, [pi], num)
                rets.append(time.perf_counter() - t1)
                jax.block_until_ready(out)
                ts.append(time.perf_counter() - t1)
            run = float(np.median(ts))
            # where the call's time beyond the tower goes (host work before the GPU starts): packing
            # and sending the bf16 patches, or (what encode_images does since session 26) the uint8
            # pixels, normalized on the device; then the tower + aligner executable alone on inputs
            # already on the device
            impl = V.attention_impl(mode)
            bk = V.tight_bucket if mode != "fp32" else V.default_bucket
            row = dict(what="vit_host", vit_attention=mode, encode_return_s=float(np.median(rets)))
            for form, px in (("bf16", False), ("uint8", True)):
                row[f"pack_{form}_s"], gp = bench(lambda px=px: V.pack_images([pi], v, bucket=bk, pixels=px),
                                                  warmup=1, iters=5)
                host = (gp[0].patches, gp[0].rows, gp[0].cols, gp[0].n_valid, gp[0].merge)
                row[f"put_{form}_s"], devp = bench(lambda host=host: [jnp.asarray(a) for a in host], warmup=1, iters=5)
                row[f"tower_{form}_s"], _ = bench(lambda devp=devp, gp=gp: V._tower(
                    model.vision, model.aligner, *devp, q_block=V._query_block(gp[0].patches.shape[1]), impl=impl),
                    warmup=1, iters=3)
                row[f"patch_bytes_{form}"] = int(gp[0].patches.nbytes)
            tower_s = row["tower_bf16_s"]
            emit(**row)
            emit(what="vit", vit_attention=mode, attention_impl=impl, vit_parts=len(V.tower_parts(v.num_hidden_layers)),
                 tower_s=tower_s,
                 cudnn_error=V._CUDNN_FAILED[0][:200] if V._CUDNN_FAILED else None,
                 image_tokens=int(np.prod(pi.llm_grid)), patches=N, flops=flops, seconds=run, first_call_s=first,
                 tflop_per_s=flops / run / 1e12, mfu=(flops / run / 1e12 / MM_TFLOP_S) if MM_TFLOP_S else None)
        except Exception as e:
            emit(what="vit", vit_attention=spec, error=f"{type(e).__name__}: {str(e)[:300]}")


def bench_compile_full(numerics, shapes, experts_int8=False):
    """Compile (not run) the full 40-layer V4.1-Flash config from abstract weights, for each
    ("decode", batch) / ("prefill", tokens) in ``shapes``."""
    from dsv41_jax.cache import init_cache
    from dsv41_jax.generate import _forward
    from dsv41_jax.model.lm import DeepseekV41

    cfg = preset("v41-flash")
    t0 = time.perf_counter()
    abstract = nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True, text_only=True,
                                                  experts_int8=experts_int8))
    graphdef, state = nnx.split(abstract)
    t_build = time.perf_counter() - t0
    for kind, n in shapes:
        B, S, cap = (n, 1, 4096) if kind == "decode" else (1, n, n)
        try:
            t0 = time.perf_counter()
            cache = jax.eval_shape(lambda: init_cache(cfg.text, B, cap, numerics.dtype))
            ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
            valid = jax.ShapeDtypeStruct((B, S), jnp.bool_)
            la = None if kind == "decode" else jax.ShapeDtypeStruct((B,), jnp.int32)
            lowered = jax.jit(functools.partial(_forward, graphdef), donate_argnums=(1,)).lower(
                state, cache, ids, valid, None, None, None, la)
            t_lower = time.perf_counter() - t0
            compiled = lowered.compile()
            t_comp = time.perf_counter() - t0 - t_lower
            emit(what="compile_full_40_layers", kind=kind, batch=B, tokens=S, experts_int8=experts_int8,
                 build_abstract_s=t_build, trace_lower_s=t_lower, compile_s=t_comp)
            del compiled
        except Exception as e:
            emit(what="compile_full_40_layers", kind=kind, batch=B, tokens=S, error=f"{type(e).__name__}: {str(e)[:300]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--engram-rows", type=int, default=80_000_000)
    ap.add_argument("--skip", default="", help="comma list of: ceil,compile,decode,engram_host,prefill,vit")
    ap.add_argument("--moe-paths", default="", help="also time decode with these forced MoE paths")
    ap.add_argument("--experts", default="bf16", choices=["bf16", "int8"], help="routed expert storage")
    ap.add_argument("--dense", default="bf16", choices=["bf16", "fp8"], help="storage of the release's fp8 Linears")
    ap.add_argument("--kernels", default=None, choices=["xla", "pallas"], help="sets DSV41_KERNELS")
    ap.add_argument("--breakdown", default="", help="batches for the per-part decode breakdown, e.g. 1,64")
    ap.add_argument("--breakdown-prefill", type=int, default=0, help="per-part breakdown of a prefill of N tokens")
    ap.add_argument("--breakdown-moe-paths", default="auto", help="MoE paths timed in the breakdown, e.g. auto,pallas")
    ap.add_argument("--compare-kernels", action="store_true",
                    help="after everything, decode and prefill again with the other DSV41_KERNELS setting")
    ap.add_argument("--vit-modes", default="bf16,fp32", help="vision attention modes timed")
    ap.add_argument("--no-release-quant", action="store_true",
                    help="do not mark the release's fp8/fp4 linears quantized (no activation fake-quant)")
    ap.add_argument("--compile-shapes", default="decode:1,decode:64,prefill:8192",
                    help="full 40-layer compiles to time: decode:BATCH / prefill:TOKENS")
    ap.add_argument("--compile-last", action="store_true", help="time the full-config compiles at the end")
    ap.add_argument("--tag", default="", help="free text copied into every result row")
    ap.add_argument("--prefill-variants", default="",
                    help="';'-separated env settings (e.g. 'DSV41_MOE_CHUNK=128;DSV41_INDEXER_KERNEL=0'): the "
                         "prefill again under each, in this process")
    ap.add_argument("--prefill-reuse", action="store_true",
                    help="also time each prefill with its arguments at the same addresses in every call")
    ap.add_argument("--prefill-routing", default="", help="prompt lengths whose per-layer expert loads to report")
    ap.add_argument("--router", default="balanced", choices=("balanced", "random", "ab"),
                    help="balanced (default since run 19): the random routers' biases balanced on a calibration "
                         "prompt (balance_router), as a trained router's are; random: the random biases as drawn; "
                         "ab: the decode loops with the random biases, then balanced, in one process")
    ap.add_argument("--decode-loop", default="", help="batches timed through generate's while_loop (per token)")
    ap.add_argument("--loop-variants", default="",
                    help="';'-separated env settings ('A=1,B=2;C=3') under which the --decode-loop batches run again")
    ap.add_argument("--loop-tokens", type=int, default=64, help="tokens per timed decode loop")
    ap.add_argument("--loop-rounds", type=int, default=1,
                    help="times the default + --loop-variants list runs (rows tagged roundN when > 1)")
    a = ap.parse_args()
    if a.loop_tokens <= 8:
        ap.error("--loop-tokens must exceed 8 (the short loop it is compared with)")
    if a.kernels:
        os.environ["DSV41_KERNELS"] = a.kernels
    if a.tag:
        global TAG
        TAG = a.tag
    skip = set(a.skip.split(","))
    jax.config.update("jax_default_matmul_precision", "default")
    emit(what="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()], args=vars(a))
    copy_tb_s, mm_tflop_s = ceilings() if "ceil" not in skip else (None, None)
    global MM_TFLOP_S, MOE_PATHS
    MM_TFLOP_S = mm_tflop_s
    MOE_PATHS = tuple(a.breakdown_moe_paths.split(","))
    numerics = Numerics("bfloat16", "reference")
    compile_shapes = [(k, int(n)) for k, n in (x.split(":") for x in a.compile_shapes.split(",") if x)]
    if "compile" not in skip and not a.compile_last:
        bench_compile_full(numerics, compile_shapes, a.experts == "int8")
    cfg = slice_config(a.layers, a.small, a.engram_rows)
    needs_model = bool(a.breakdown or a.breakdown_prefill or a.decode_loop or a.prefill_routing) \
        or not {"decode", "prefill", "vit"} <= skip
    if not needs_model:
        if "compile" not in skip and a.compile_last:
            bench_compile_full(numerics, compile_shapes, a.experts == "int8")
        return _write_out()
    t0 = time.perf_counter()
    kw = dict(experts_int8=a.experts == "int8")
    if a.dense == "fp8":  # the Linears the release stores fp8 keep e4m3 codes + ue8m0 row scales
        from dsv41_jax.model.lm import DeepseekV41
        from dsv41_jax.weights import release_fp8_linears

        kw["dense_fp8"] = release_fp8_linears(nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True)))
    model = random_model(cfg, numerics, **kw)
    if not a.no_release_quant:
        mark_release_quantized(model)
    if a.router == "balanced":
        balance_router(model, cfg)
    from dsv41_jax.model.moe import keep_kernel_scales

    keep_kernel_scales(model)  # as api.load does on one device: the prefill kernel's scale layout (3%)
    apply_expert_layout(model)  # and the K-blocked codes (moe.block_expert_codes) where the kernels want them
    jax.block_until_ready(nnx.state(model))
    emit(what="build", layers=a.layers, router=a.router, param_gb=param_bytes(model) / 1e9, seconds=time.perf_counter() - t0,
         engram_rows=cfg.text.engram_num_embeddings, experts=a.experts, dense=a.dense)
    batches = [int(b) for b in a.batches.split(",")] if a.batches else []
    if a.decode_loop:
        # the default settings, then each variant (same process, same weights; each compiles afresh),
        # the whole list --loop-rounds times: run 24 found the first loop a process times 35-60 us
        # slower than the same code timed later, so compare variants across rounds, not one pass
        for r in range(a.loop_rounds):
            rnd = f"round{r}" if a.loop_rounds > 1 else ""
            for v in [""] + [v for v in a.loop_variants.split(";") if v]:
                with variant(" ".join(w for w in (a.tag, v, rnd) if w), _env_pairs(v) if v else {}):
                    apply_expert_layout(model)
                    bench_decode_loop(model, cfg, [int(b) for b in a.decode_loop.split(",")], a.ctx, a.loop_tokens,
                                      copy_tb_s)
        apply_expert_layout(model)  # the default layout again
        if a.router == "ab":  # the same decode loops after balancing, in this process: the routers' A/B
            with variant(f"{a.tag} balanced".strip()):
                balance_router(model, cfg)
                bench_decode_loop(model, cfg, [int(b) for b in a.decode_loop.split(",")], a.ctx, a.loop_tokens,
                                  copy_tb_s)
    if "decode" not in skip:
        bench_decode(model, cfg, batches, a.ctx, copy_tb_s=copy_tb_s)
        if a.moe_paths:
            for pth in a.moe_paths.split(","):
                bench_decode(model, cfg, batches, a.ctx, moe_path=pth, copy_tb_s=copy_tb_s)
            os.environ["DSV41_MOE_PATH"] = "auto"
    if "prefill" not in skip:
        bench_prefill(model, cfg, [int(s) for s in a.prefill.split(",")], mm_tflop_s, reuse=a.prefill_reuse)
        for v in [v for v in a.prefill_variants.split(";") if v]:  # same process, same weights
            with variant(f"{a.tag} {v}".strip(), _env_pairs(v)):
                apply_expert_layout(model)
                bench_prefill(model, cfg, [int(s) for s in a.prefill.split(",")], mm_tflop_s,
                              reuse=a.prefill_reuse)  # compiles afresh
            apply_expert_layout(model)  # the default layout again
        if mm_tflop_s:
            matmul_ceiling(when="after_prefill")
    for S in [int(s) for s in a.prefill_routing.split(",") if s]:
        prefill_routing(model, cfg, S)
    if "vit" not in skip and model.vision is not None:
        bench_vit(model, cfg, 1024 if not a.small else 64, modes=tuple(a.vit_modes.split(",")))
    for B in [int(b) for b in a.breakdown.split(",") if b]:
        bench_breakdown(model, cfg, B, a.ctx, copy_tb_s or 2.4)
    if a.breakdown_prefill:
        bench_breakdown(model, cfg, 1, a.ctx, copy_tb_s or 2.4, prefill=a.breakdown_prefill, mm_tflop_s=mm_tflop_s)
    if a.compare_kernels:  # the same decode / prefill with the other kernel setting
        other = "xla" if _kernels() == "pallas" else "pallas"
        os.environ["DSV41_KERNELS"] = other
        if "decode" not in skip:
            bench_decode(model, cfg, batches, a.ctx, copy_tb_s=copy_tb_s)
        if "prefill" not in skip:  # bench_prefill compiles afresh (clear_compiled): traced under the new setting
            bench_prefill(model, cfg, [int(s) for s in a.prefill.split(",")], mm_tflop_s)
    if "engram_host" not in skip and "decode" not in skip:
        from dsv41_jax.model.engram import offload_engram_tables

        t0 = time.perf_counter()
        moved = offload_engram_tables(model)
        emit(what="engram_offload", bytes=moved, seconds=time.perf_counter() - t0)
        bench_decode(model, cfg, batches, a.ctx, moe_path="auto", tag="engram_table_on_host")
    if "compile" not in skip and a.compile_last:
        del model
        bench_compile_full(numerics, compile_shapes, a.experts == "int8")
    _write_out()


def _write_out():
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_slice.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
