"""Extrapolate decode throughput of the full V4.1-Flash on one 8 x H200 host from the slice.

No device needed: the per-device bytes a decode step must read come from the abstract shapes of
the full 40-layer model and the partition rules (``dsv41_jax.sharding.shardings_table``); the
achieved bandwidth fraction and the fixed per-layer cost come from the 3-layer slice measured on
one H200 (``bench_slice.py``, docs/performance.md), given as arguments.

Model of one decode step (batch B, context C):

* every device reads its share of every non-expert weight (attention projections split over
  "tensor" where the rules split them, the shared KV projections and mHC replicated), of the head
  (vocabulary split over all model-parallel devices) and the caches it needs (window ring,
  top-k compressed entries, all index keys of index-source layers: the KV latent is shared by all
  heads, so tensor parallelism does not split it);
* routed experts: B tokens pick k experts each, uniformly at random (Monte Carlo); a device reads
  the distinct selected experts it holds; the step waits for the slowest device (max over
  devices, averaged over draws);
* time = max-device bytes / (copy bandwidth x achieved fraction) + layers x (fixed per-layer cost
  + collectives per layer x collective latency).

    python benchmarks/extrapolate_v41.py --fraction 0.5 --layer-overhead-us 150 --copy-tb-s 2.4
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class _Mesh:
    def __init__(self, spec):
        self.shape = dict(zip(("data", "expert", "tensor"), spec))
        self.axis_names = ("data", "expert", "tensor")
        self.devices = np.zeros(spec)


def formats(expert: str, dense: str):
    """bytes_per_element(name, dtype) for the storage formats of the in-memory model."""
    eb = {"bf16": 2.0, "int8": 1 + 1 / 32, "fp4": 0.5 + 1 / 32}[expert]
    db = {"bf16": 2.0, "fp8": 1 + 1 / 32}[dense]

    def bpe(name, dtype):
        if ".ffn.experts." in name:
            return eb
        if name.endswith(".scale"):
            return 0.0  # counted in the per-element figure above
        if name.startswith("layers.") and name.endswith(".weight") and np.dtype(dtype).itemsize == 2 and \
                any(s in name for s in (".attn.wq_a", ".attn.wq_b", ".attn.wkv", ".attn.wo_b", ".attn.wo_a",
                                        ".indexer.wq_b", ".engram.wkv", ".shared_experts.")):
            return db
        return float(np.dtype(dtype).itemsize)

    return bpe


def step_bytes(rows, cfg, spec, B: int, C: int, draws: int = 2000, seed: int = 0, selected=None):
    """(max-device bytes, mean-device bytes, parts) of one decode step. ``selected``: the expert
    ids each layer's router actually picked (one array per layer) in place of uniform draws."""
    t = cfg.text
    E, k = t.n_routed_experts, t.num_experts_per_tok
    n_exp_dev = spec[1]
    per_shard = E // n_exp_dev
    if selected is None:
        # expected max over expert shards of the number of distinct selected local experts
        rng = np.random.default_rng(seed)
        mx, mean = [], []
        for _ in range(draws):
            sel = np.zeros(E, bool)
            for _b in range(B):
                sel[rng.choice(E, k, replace=False)] = True
            cnt = sel.reshape(n_exp_dev, per_shard).sum(1)
            mx.append(cnt.max())
            mean.append(cnt.mean())
        fracs = [(float(np.mean(mx)) / per_shard, float(np.mean(mean)) / per_shard)] * t.num_hidden_layers
    else:
        fracs = []
        for ids in selected:
            cnt = np.bincount(np.unique(np.asarray(ids).ravel()) // per_shard, minlength=n_exp_dev)
            fracs.append((cnt.max() / per_shard, cnt.mean() / per_shard))
    parts = {"experts": 0.0, "other_weights": 0.0, "head": 0.0, "engram_rows": 0.0}
    parts_mean_experts = 0.0
    for r in rows:
        n = r["name"]
        if n.startswith("cache."):
            continue
        if ".ffn.experts." in n:
            frac_max, frac_mean = fracs[int(n.split(".")[1])]
            parts["experts"] += r["bytes_per_device"] * frac_max
            parts_mean_experts += r["bytes_per_device"] * frac_mean
        elif ".engram.embed." in n:
            parts["engram_rows"] += B * t.engram_cols * (t.engram_head_dim + t.engram_head_dim / 32)
        elif n.startswith("head."):
            parts["head"] += r["bytes_per_device"]
        elif n.startswith("layers.") or n.startswith("norm."):
            parts["other_weights"] += r["bytes_per_device"]
    caches = 0.0
    for p in t.layers:
        caches += B * t.sliding_window * t.head_dim * 2
        if p.ratio > 0:
            caches += B * min(t.index_topk, C // p.ratio) * t.head_dim * 2
        if p.owns_indexer:
            caches += B * (C // p.ratio) * t.index_head_dim * 2
    parts["caches"] = caches / spec[0]  # batch split over "data"
    total_max = sum(parts.values())
    total_mean = total_max - parts["experts"] + parts_mean_experts
    return total_max, total_mean, parts


# session 3's fit of the one-GPU slice (run 9): bytes stream at the JAX-measured copy bandwidth,
# plus a fixed cost per layer; one small all-reduce per split per layer
FIT = dict(copy_tb_s=2.58, fraction=1.0, layer_overhead_us=140.0, collective_us=20.0)


def step_time(max_device_bytes: float, spec, n_layers: int, copy_tb_s: float, fraction: float,
              layer_overhead_us: float, collective_us: float) -> tuple[float, float]:
    """(bytes seconds, fixed seconds) of one decode step in the model above. Collectives per
    layer: the MoE combine (psum over expert/tensor), the attention output and the indexer
    scores (psum over tensor) when split."""
    n_coll = (1 if spec[1] > 1 or spec[2] > 1 else 0) + (2 if spec[2] > 1 else 0)
    return (max_device_bytes / (copy_tb_s * 1e12 * fraction),
            n_layers * (layer_overhead_us + n_coll * collective_us) * 1e-6)


def main():
    from flax import nnx

    from dsv41_jax import sharding as shd
    from dsv41_jax.config import preset
    from dsv41_jax.model.lm import DeepseekV41
    from dsv41_jax.numerics import REFERENCE_BF16

    ap = argparse.ArgumentParser()
    ap.add_argument("--copy-tb-s", type=float, default=2.4, help="measured copy bandwidth per GPU")
    ap.add_argument("--fraction", type=float, required=True,
                    help="achieved fraction of the copy roofline on the slice (decode)")
    ap.add_argument("--fraction-64", type=float, default=None, help="same at batch 64 (default: --fraction)")
    ap.add_argument("--layer-overhead-us", type=float, default=0.0,
                    help="fixed per-layer cost not explained by bytes (slice: (step - bytes/BW) / layers)")
    ap.add_argument("--collective-us", type=float, default=20.0, help="latency of one small all-reduce (NVLink)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--experts", default="int8", choices=["bf16", "int8", "fp4"])
    ap.add_argument("--dense", default="fp8", choices=["bf16", "fp8"])
    ap.add_argument("--meshes", default="1,8,1;1,4,2;1,2,4;1,1,8")
    ap.add_argument("--batches", default="1,64")
    a = ap.parse_args()

    cfg = preset("v41-flash")
    model = nnx.eval_shape(lambda: DeepseekV41(cfg, REFERENCE_BF16, engram_quantized=True, text_only=True))
    bpe = formats(a.experts, a.dense)
    L = cfg.text.num_hidden_layers
    out = []
    for ms in a.meshes.split(";"):
        spec = tuple(int(x) for x in ms.split(","))
        rows = shd.shardings_table(model, _Mesh(spec), bytes_per_element=bpe)
        resident = sum(r["bytes_per_device"] for r in rows)
        for B in (int(b) for b in a.batches.split(",")):
            frac = a.fraction if (B == 1 or a.fraction_64 is None) else a.fraction_64
            mx, mean, parts = step_bytes(rows, cfg, spec, B, a.ctx)
            t_bytes, t_fixed = step_time(mx, spec, L, a.copy_tb_s, frac, a.layer_overhead_us, a.collective_us)
            step = t_bytes + t_fixed
            row = dict(mesh=spec, batch=B, experts=a.experts, dense=a.dense, resident_gb_per_device=resident / 1e9,
                       step_bytes_max_device_gb=mx / 1e9, step_bytes_mean_device_gb=mean / 1e9,
                       parts_gb={kk: round(v / 1e9, 4) for kk, v in parts.items()},
                       bytes_ms=t_bytes * 1e3, fixed_ms=t_fixed * 1e3, step_ms=step * 1e3, tokens_per_s=B / step)
            out.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| mesh (d,e,t) | batch | GB/device resident | GB read per step (slowest device) | bytes time | fixed | step | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['mesh']} | {r['batch']} | {r['resident_gb_per_device']:.1f} | {r['step_bytes_max_device_gb']:.2f} | "
              f"{r['bytes_ms']:.2f} ms | {r['fixed_ms']:.2f} ms | {r['step_ms']:.2f} ms | {r['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
