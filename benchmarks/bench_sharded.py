"""Sharded V4.1-Flash-width slice vs one device (issue 7: the 2-GPU run).

Builds the slice of ``bench_slice.py`` (random weights, one layer of each kind, 384 experts) on
the first device, runs a prefill + greedy decode there as the reference, then places the SAME
weights on each mesh (``sharding.shard_model``) and runs the same prompt under it: prefill logits,
decode logits and tokens are compared with the one-device run, and the decode step is timed on
both (with ``ctx`` tokens of context in the cache): ``decode_step_s`` per jitted call of one
step (includes the host's per-call work), ``decode_token_s`` per token inside generate's loop.

    python benchmarks/bench_sharded.py --meshes "1,2,1;1,1,2" --experts int8     # 2 GPUs
    python benchmarks/bench_sharded.py --small --cpu-devices 2                   # CPU smoke test

Parity: in bf16 with the reference fake-quant points this random-weight slice is chaotic: any
change of summation order (a sharded sum, the XLA MoE path instead of the kernel, even on one
GPU) flips fp8 activation roundings and top-k router near-ties, and layer 1 already differs by
~40% (docs/performance.md run 12). Matching is therefore checked in fp32 without fake-quant,
where only summation order differs:

    python benchmarks/bench_sharded.py --dtype float32 --numerics fast --experts int8

Results: one JSON line per measurement, collected in $OUT/bench_sharded.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--meshes", default="1,2,1;1,1,2")
ap.add_argument("--small", action="store_true")
ap.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
ap.add_argument("--layers", type=int, default=3)
ap.add_argument("--experts", default="int8", choices=["bf16", "int8"])
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--ctx", type=int, default=4096, help="cache positions already filled for the timed steps")
ap.add_argument("--engram-rows", type=int, default=20_000_000)
ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                help="compute dtype; float32 + --numerics fast is the parity setting (see below)")
ap.add_argument("--numerics", default="reference", choices=["reference", "fast"])
ap.add_argument("--router", default="balanced", choices=["balanced", "random"],
                help="router biases balanced on a calibration prompt (bench_slice.balance_router) or as drawn")
ARGS = ap.parse_args()
if ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.cpu_devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_slice as bs  # noqa: E402
from dsv41_jax import sharding as shd  # noqa: E402
from dsv41_jax.generate import forward_chunk  # noqa: E402
from dsv41_jax.numerics import Numerics  # noqa: E402

RESULTS = []


def emit(**kw):
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


def greedy(model, ids, steps, mesh=None):
    """Prefill ``ids`` then ``steps`` greedy tokens; returns (prefill last logits, step logits, tokens)."""
    B, S = ids.shape
    cache = model.init_cache(B, S + steps + 1)
    if mesh is not None:
        cache = shd.shard_cache(cache, mesh)
        ids = shd.shard_batch(ids, mesh)
    lg, cache = forward_chunk(model, ids, cache)
    pre = np.asarray(lg[:, -1], np.float32)
    nxt = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None]
    toks, outs = [], []
    for _ in range(steps):
        toks.append(np.asarray(nxt))
        lg, cache = forward_chunk(model, nxt, cache)
        outs.append(np.asarray(lg[:, -1], np.float32))
        nxt = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None]
    return pre, np.stack(outs, 1), np.concatenate(toks, 1)


def time_decode(model, B, ctx, mesh=None, iters=7):
    cache = model.init_cache(B, ctx + 64)
    cache = dict(cache, length=jnp.full((B,), ctx, jnp.int32))
    tok = jnp.ones((B, 1), jnp.int32)
    if mesh is not None:
        cache = shd.shard_cache(cache, mesh)
        tok = shd.shard_batch(tok, mesh)
    lg, cache = forward_chunk(model, tok, cache)  # compile
    jax.block_until_ready(lg)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        lg, cache = forward_chunk(model, tok, cache)
        jax.block_until_ready(lg)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_token(model, cfg, B, ctx):
    """Seconds per generated token inside generate's while_loop (bench_slice.bench_decode_loop:
    one dispatch per request, the sharded model placed and run as generate runs it)."""
    bs.bench_decode_loop(model, cfg, [B], ctx, n_tokens=32)
    row = bs.RESULTS[-1]
    return row.get("seconds_per_step", float("nan"))


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main():
    a = ARGS
    jax.config.update("jax_default_matmul_precision", "default")
    emit(what="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()], args=vars(a))
    cfg = bs.slice_config(a.layers, a.small, a.engram_rows)
    num = Numerics(a.dtype, a.numerics)
    with jax.default_device(jax.devices()[0]):
        model = bs.random_model(cfg, num, experts_int8=a.experts == "int8")
        if a.numerics == "reference":
            bs.mark_release_quantized(model)
        if a.router == "balanced":
            bs.balance_router(model, cfg)
        ids = jax.random.randint(jax.random.key(7), (a.batch, a.prompt), 0, cfg.text.vocab_size).astype(jnp.int32)
        ref_pre, ref_dec, ref_tok = greedy(model, ids, a.steps)
        t1 = time_decode(model, a.batch, a.ctx)
        k1 = time_token(model, cfg, a.batch, a.ctx)
    emit(what="single_device", batch=a.batch, prompt=a.prompt, decode_step_s=t1, decode_token_s=k1,
         tokens=ref_tok.tolist(), param_gb=bs.param_bytes(model) / 1e9)
    scale = float(np.max(np.abs(ref_pre)))
    for ms in a.meshes.split(";"):
        spec = shd.parse_mesh_spec(ms)
        try:
            mesh = shd.make_mesh(*spec)
            notes: list[str] = []
            shd.shard_model(model, mesh, notes=notes)
            with shd.use_mesh(mesh):
                pre, dec, tok = greedy(model, ids, a.steps, mesh)
                ts = time_decode(model, a.batch, a.ctx, mesh)
            ks = time_token(model, cfg, a.batch, a.ctx)  # placed under the mesh by generate's machinery
            # the sharded sums run in another order: errors in units of the reference logits' max and
            # the token match (fp32 fast: summation order only; bf16 reference: chaotic, see above)
            emit(what="sharded", mesh=spec, batch=a.batch, prompt=a.prompt, decode_step_s=ts,
                 speedup_vs_single=t1 / ts, decode_token_s=ks, token_speedup_vs_single=k1 / ks,
                 prefill_rel_err=rel(pre, ref_pre), decode_rel_err=rel(dec, ref_dec),
                 max_abs_err=float(max(np.max(np.abs(pre - ref_pre)), np.max(np.abs(dec - ref_dec)))),
                 logit_scale=scale, tokens_equal=bool(np.array_equal(tok, ref_tok)),
                 first_token_mismatch=int(np.argmax(np.any(tok != ref_tok, 0))) if not np.array_equal(tok, ref_tok) else -1,
                 notes=notes[:5])
        except Exception as e:
            emit(what="sharded", mesh=spec, error=f"{type(e).__name__}: {str(e)[:400]}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_sharded.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
