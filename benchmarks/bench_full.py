"""Full-width V4.1-Flash sharded over the GPUs of one host (issue 10): load, compile, prefill,
decode at several batches, and one image-prompt generation through the full vision tower.

On 8 GPUs this is the whole 40-layer model. On fewer GPUs it is the same model with a subset of
its real layers, ``--layers N`` (default 5 per GPU: 10 on 2 GPUs), chosen so every layer kind is
there: the two ratio-0 layers (one with an Engram table), ratio-2 and ratio-1 compressor / indexer
sources and their consumers, the candidate source and a layer using its candidates, the second
Engram layer; the rest evenly spaced over the remaining layers. Every source id, the candidate
source and the Engram ids are remapped to the subset, so each kept layer reads the same kind of
source as in the full model. The 3 MTP (next-n) layers are not built (generation does not run them).

No real weights exist here: random values generated on the devices straight into the partition
rules' shardings (``bench_slice.random_model(mesh=...)``): int8 routed experts (the lossless
form of the release's fp4), the release's fp8 Linears as e4m3 + ue8m0 scales, Engram tables in fp8.
Engram rows: the real 384M rows per table scaled by ``--engram-fraction`` (default: the device
count over 8, so each GPU holds the share of Engram rows it would hold on 8 GPUs).

Measured: memory per GPU after load; one image-prompt generation; compile time of each
executable; prefill tokens/s at 8k; decode tokens/s in generate's loop at batch 1/8/64/256
against the per-GPU byte roofline (measured router picks, the slowest device) and against the
extrapolation model of ``extrapolate_v41.py`` for the same layers and mesh.

    python3 benchmarks/bench_full.py --mesh 1,8,1                 # 8 x H200: 40 layers
    python3 benchmarks/bench_full.py --mesh 1,2,1                 # 2 x H200: 10 layers
    python3 benchmarks/bench_full.py --small --cpu-devices 2 --mesh 1,2,1 --batches 1,2 --prefill 64

Results: one JSON line per measurement, also written to $OUT/bench_full.jsonl as they come.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--mesh", default="1,8,1", help="data,expert,tensor")
ap.add_argument("--layers", type=int, default=0, help="layers of the real 40 kept (default 5 per device, max 40)")
ap.add_argument("--small", action="store_true", help="small widths (CPU smoke test)")
ap.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
ap.add_argument("--engram-fraction", type=float, default=0.0, help="of the real Engram rows (default devices/8)")
ap.add_argument("--batches", default="1,8,64,256")
ap.add_argument("--ctx", type=int, default=4096, help="cache positions already filled for the timed decode")
ap.add_argument("--loop-tokens", type=int, default=64)
ap.add_argument("--prefill", default="8192")
ap.add_argument("--image-side", type=int, default=1024, help="pixels per side of the image prompt (0: skip)")
ap.add_argument("--image-new-tokens", type=int, default=32)
ap.add_argument("--skip", default="", help="comma list of: ceil,prefill,decode,image")
ap.add_argument("--router", default="balanced", choices=("balanced", "random"),
                help="router biases balanced on a calibration prompt (bench_slice.balance_router; the load time "
                     "includes it) or as drawn")
ARGS = ap.parse_args() if __name__ == "__main__" else None  # importable (tests use the layer plan)
if ARGS is not None and ARGS.loop_tokens <= 8:
    ap.error("--loop-tokens must exceed 8 (the short loop it is compared with)")
if ARGS is not None and ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.cpu_devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import bench_slice as bs  # noqa: E402
import extrapolate_v41 as ex  # noqa: E402
from dsv41_jax import sharding as shd  # noqa: E402
from dsv41_jax.config import parse_config, preset  # noqa: E402
from dsv41_jax.numerics import Numerics  # noqa: E402

emit = bs.jsonl_emitter("bench_full.jsonl")

# every layer kind of the real plan, in an order whose prefixes are valid plans (each kept
# layer's kv / index source kept before it): ratio 0; ratio-2 source + its consumer; ratio-1
# source (also the candidate source) + its consumer; a ratio-1 index source using candidates;
# the ratio-0 Engram layer; the ratio-2 Engram layer (also a source)
KINDS_FIRST = (0, 2, 3, 20, 21, 24, 1, 14)


def layer_subset(n: int, n_real: int = 40) -> list[int]:
    if n >= n_real:
        return list(range(n_real))
    if n < 1:
        raise SystemExit("--layers must be >= 1")
    keep = list(KINDS_FIRST[:n])
    rest = [i for i in range(n_real) if i not in keep]
    if n > len(keep):
        keep += [rest[int(round(j))] for j in np.linspace(0, len(rest) - 1, n - len(keep))]
    return sorted(keep)


def full_config(n_layers: int, small: bool, engram_fraction: float):
    d = json.loads(json.dumps(preset("v41-flash").raw))
    t = d["text_config"]
    L = t["num_hidden_layers"]
    keep = layer_subset(n_layers, L)
    new = {old: i for i, old in enumerate(keep)}

    def remap(ids):
        return [new[i] for i in ids if i in new]

    cand = t["candidate_source_layer_id"]
    t.update(num_hidden_layers=len(keep), compress_ratios=[t["compress_ratios"][i] for i in keep],
             num_nextn_predict_layers=0, kv_source_layer_ids=remap(t["kv_source_layer_ids"]),
             index_source_layer_ids=remap(t["index_source_layer_ids"]),
             candidate_source_layer_id=new.get(cand, -1), engram_layer_ids=remap(t["engram_layer_ids"]),
             dspark_target_layer_ids=[])
    if small:
        bs.shrink_to_small(d)
    # --small: a few thousand rows per table (CPU memory)
    bs.set_engram_vocab(t, 2000 if small else t["engram_vocab_size"] * engram_fraction)
    return parse_config(d), keep


def memory(devs) -> dict:
    out = {}
    for d in devs:
        st = d.memory_stats() or {}
        out[str(d.id)] = dict(in_use_gb=st.get("bytes_in_use", 0) / 1e9, peak_gb=st.get("peak_bytes_in_use", 0) / 1e9,
                              limit_gb=st.get("bytes_limit", 0) / 1e9)
    return out


def selected_experts(model, cfg, B: int, ctx: int) -> list | None:
    """``bench_slice.routed_ids`` (the router's picks for the decode inputs), or None when they
    cannot be captured (the roofline then uses uniform draws)."""
    try:
        return bs.routed_ids(model, cfg, B, ctx)
    except Exception as e:  # report, fall back to uniform routing
        emit(what="selected_experts", batch=B, error=f"{type(e).__name__}: {str(e)[:300]}")
        return None


def roofline_fn(model, cfg, mesh, spec, ctx, copy_tb_s):
    rows = shd.shardings_table(model, mesh)
    L = cfg.text.num_hidden_layers

    def fields(B, per):
        sel = selected_experts(model, cfg, B, ctx)
        mx, mean, parts = ex.step_bytes(rows, cfg, spec, B, ctx, selected=sel)
        umx, _, _ = ex.step_bytes(rows, cfg, spec, B, ctx, draws=200)
        t_b, t_f = ex.step_time(umx, spec, L, **ex.FIT)
        out = dict(routing="measured" if sel is not None else "uniform",
                   distinct_experts=None if sel is None else [int(np.unique(s).size) for s in sel],
                   bytes_per_device_max=mx, bytes_per_device_mean=mean,
                   parts_gb={k: round(v / 1e9, 4) for k, v in parts.items()},
                   predicted_s=t_b + t_f, predicted_bytes_s=t_b, predicted_fixed_s=t_f,
                   measured_over_predicted=per / (t_b + t_f))
        if copy_tb_s:
            out.update(roofline_s=mx / (copy_tb_s * 1e12), roofline_frac=mx / (copy_tb_s * 1e12) / per)
        return out

    return fields


def image_generation(model, cfg, numerics, side: int, new_tokens: int):
    from PIL import Image

    from dsv41_jax.api import DeepseekVL

    rng = np.random.default_rng(0)
    # a smooth image (gradients + noise): the content does not matter for the timing
    yy, xx = np.mgrid[0:side, 0:side]
    img = np.stack([(xx * 255 // side), (yy * 255 // side), rng.integers(0, 255, (side, side))], -1).astype(np.uint8)
    vl = DeepseekVL(model, cfg, None, numerics)
    text = rng.integers(1000, min(5000, cfg.image_token_id), 24).tolist()  # ordinary text ids
    prompt = [cfg.bos_token_id, cfg.image_token_id] + text
    for attempt in ("first", "again"):
        t0 = time.perf_counter()
        g = vl.generate(prompt, [Image.fromarray(img)], max_new_tokens=new_tokens)
        wall = time.perf_counter() - t0
        emit(what="image_generation", attempt=attempt, image=[side, side], image_spans=g.image_spans,
             prompt_tokens=len(prompt), new_tokens=len(g.tokens[0]), finish=g.finish_reasons[0],
             tokens=g.tokens[0][:16], wall_s=wall, timings=g.timings)


def main():
    a = ARGS
    jax.config.update("jax_default_matmul_precision", "default")
    spec = shd.parse_mesh_spec(a.mesh)
    n_dev = int(np.prod(spec))
    n_layers = a.layers or min(40, 5 * n_dev)
    frac = a.engram_fraction or n_dev / 8
    bs._emit_row = emit  # the shared benchmark functions write their rows to the same file
    emit(what="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()], args=vars(a),
         layers=n_layers, engram_fraction=frac)
    skip = set(a.skip.split(","))
    copy_tb_s = mm = None
    if "ceil" not in skip and jax.default_backend() == "gpu":
        copy_tb_s, mm = bs.ceilings()
    mesh = shd.make_mesh(*spec)
    cfg, keep = full_config(n_layers, a.small, frac)
    numerics = Numerics("bfloat16", "reference")
    from dsv41_jax.model.lm import DeepseekV41
    from dsv41_jax.weights import release_fp8_linears

    t0 = time.perf_counter()
    kw = dict(experts_int8=True,
              dense_fp8=release_fp8_linears(nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True))))
    model = bs.random_model(cfg, numerics, mesh=mesh, **kw)
    bs.mark_release_quantized(model)
    if a.router == "balanced":
        bs.balance_router(model, cfg)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    rows = shd.shardings_table(model, mesh)
    emit(what="load", layers=n_layers, real_layer_ids=keep, mesh=list(spec), seconds=load_s,
         param_gb=sum(r["bytes"] for r in rows) / 1e9,
         param_gb_per_device_by_rules=sum(r["bytes_per_device"] for r in rows) / 1e9,
         engram_rows=list(cfg.text.engram_num_embeddings), memory=memory(mesh.devices.flat),
         replicated_over_64mb=[r["name"] for r in rows if r["spec"] == "replicated" and r["bytes"] > 64 * 2**20][:8])
    # the image prompt first: short, and it must not be the part a time limit cuts (run 12b)
    if "image" not in skip and a.image_side:
        try:
            image_generation(model, cfg, numerics, a.image_side, a.image_new_tokens)
        except Exception as e:
            emit(what="image_generation", error=f"{type(e).__name__}: {str(e)[:400]}")
    if "prefill" not in skip:
        bs.bench_prefill(model, cfg, [int(s) for s in a.prefill.split(",") if s], mm)
        emit(what="memory_after_prefill", memory=memory(mesh.devices.flat))
    if "decode" not in skip:
        bs.bench_decode_loop(model, cfg, [int(b) for b in a.batches.split(",") if b], a.ctx, a.loop_tokens,
                             roofline=roofline_fn(model, cfg, mesh, spec, a.ctx, copy_tb_s))
        emit(what="memory_after_decode", memory=memory(mesh.devices.flat))


if __name__ == "__main__":
    main()
