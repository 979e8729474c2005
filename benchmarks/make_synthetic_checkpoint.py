"""Write a large synthetic DeepSeek-V4.1 checkpoint in the release on-disk format, streaming.

    python benchmarks/make_synthetic_checkpoint.py OUT_DIR --target-gb 8.5 [--hidden 4096]
        [--moe-intermediate 1536] [--experts N] [--shard-gb 1.5] [--engram-vocab 500000] [--seed 0]

The layout is the one the converter reads from the official release: ``config.json`` (composite
HF form with ``quantization_config`` fp8 32x32 ue8m0, ``expert_dtype`` fp4), ``tokenizer.json``,
``model.safetensors.index.json`` and ``model-000XX-of-000NN.safetensors`` shards of about
``--shard-gb`` each. Tensor names, dtypes and shapes come from ``dsv41_jax.tiny.tensor_inventory``
of the scaled config (the tiny checkpoint's 7-layer schedule: compressors, indexers, 2 Engram
layers, a small vision tower), so the checkpoint passes the converter's validation:

* linears (attention, shared experts, Engram ``wkv``): ``F8_E4M3`` codes + ``F8_E8M0`` 32x32 block
  scales; routed experts: fp4 e2m1 packed in ``I8`` + ``F8_E8M0`` per-32 scales; Engram tables:
  ``F8_E4M3`` rows + per-32 scales; norms, router, compressor/indexer, embed/head: ``BF16``;
  ``hc_*``, sinks, gate biases, vision norms: ``F32``.
* values: uniformly random codes; the e4m3 NaN codes ``0x7F``/``0xFF`` never occur, scale bytes
  are 120..130 (2^-7 .. 2^3), bf16/f32 tensors are N(0, 0.05) (so the NaN scan passes and every
  dequantized value is exact in bf16).
* ``vocab_size`` stays the tiny tokenizer's 256 (the Engram compressed vocabulary is derived from
  that tokenizer); the size comes from hidden / expert dimensions and the number of experts.
  ``engram_num_embeddings`` is derived from ``--engram-vocab`` exactly as the official code does
  (``dsv41_jax.engram_layout.engram_primes``).

Nothing larger than one chunk (``CHUNK_BYTES``) of one tensor is held in memory, so any size can
be written on a small machine. ``--experts`` fixes the number of routed experts; otherwise it is
chosen so that the shards total about ``--target-gb`` (10^9 bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_jax.tiny import build_tiny_tokenizer, tensor_inventory, tiny_config  # noqa: E402

CHUNK_BYTES = 32 << 20
ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F32": 4}


def synthetic_overrides(*, hidden: int, moe_intermediate: int, experts: int, engram_vocab: int) -> dict:
    """Overrides on the tiny DEFAULT_CONFIG: V4.1 attention shapes scaled to ``hidden``."""
    return {
        "text_config": {
            "hidden_size": hidden,
            "moe_intermediate_size": moe_intermediate,
            "n_routed_experts": experts,
            "num_experts_per_tok": min(6, experts),
            "num_attention_heads": 16,
            "head_dim": 256,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1024,
            "o_lora_rank": 512,
            "o_groups": 4,
            "index_n_heads": 16,
            "index_head_dim": 128,
            "engram_vocab_size": engram_vocab,
            "engram_n_heads": 2,
            "engram_head_dim": 128,
            "engram_max_ngram_size": 3,
        }
    }


def make_config(*, hidden: int, moe_intermediate: int, experts: int, engram_vocab: int, tokenizer) -> dict:
    over = synthetic_overrides(hidden=hidden, moe_intermediate=moe_intermediate, experts=experts,
                               engram_vocab=engram_vocab)
    return tiny_config(fmt="fp8", config=over, vision=True, tokenizer=tokenizer)


def inventory_bytes(inv) -> int:
    return sum(ITEMSIZE[dt] * int(np.prod(shape, dtype=np.int64)) for dt, shape in inv.values())


def choose_experts(target_bytes: int, **kw) -> int:
    """Smallest expert count whose checkpoint reaches ``target_bytes`` (size is linear in E)."""
    b8 = inventory_bytes(tensor_inventory(make_config(experts=8, **kw)))
    b16 = inventory_bytes(tensor_inventory(make_config(experts=16, **kw)))
    per_expert = (b16 - b8) / 8
    return max(8, int(np.ceil((target_bytes - (b8 - 8 * per_expert)) / per_expert)))


def plan_shards(inv, shard_bytes: int) -> list[list[str]]:
    """Tensors in inventory order (layer by layer), cut into shards of about ``shard_bytes``."""
    shards, cur, size = [], [], 0
    for name, (dt, shape) in inv.items():
        n = ITEMSIZE[dt] * int(np.prod(shape, dtype=np.int64))
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        shards.append(cur)
    return shards


def random_chunk(rng: np.random.Generator, dt: str, count: int) -> np.ndarray:
    """``count`` elements of safetensors dtype ``dt`` as a contiguous array (uint8 view for 1-byte types)."""
    if dt == "F8_E4M3":  # 0..253 with 0x7F and 0xFF skipped: every finite e4m3 code except 0xFE
        x = rng.integers(0, 254, count, dtype=np.uint8)
        x += x >= 0x7F
        return x
    if dt == "F8_E8M0":
        return rng.integers(120, 131, count, dtype=np.uint8)
    if dt in ("I8", "U8"):  # fp4 pairs: every byte is two finite e2m1 codes
        return rng.integers(0, 256, count, dtype=np.uint8)
    x = rng.standard_normal(count, dtype=np.float32)
    x *= 0.05
    if dt == "BF16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    if dt == "F32":
        return x
    raise ValueError(dt)


def write_shard(path: str, names: list[str], inv, rng: np.random.Generator) -> int:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name in names:
        dt, shape = inv[name]
        n = ITEMSIZE[dt] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name in names:
            dt, shape = inv[name]
            left = int(np.prod(shape, dtype=np.int64))
            step = max(1, CHUNK_BYTES // ITEMSIZE[dt])
            while left:
                k = min(step, left)
                f.write(memoryview(random_chunk(rng, dt, k)).cast("B"))
                left -= k
    os.replace(path + ".tmp", path)
    return 8 + len(h) + off


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("--target-gb", type=float, default=8.5, help="approximate total shard size (10^9 bytes)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (overrides --target-gb)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--moe-intermediate", type=int, default=1536)
    ap.add_argument("--engram-vocab", type=int, default=500_000,
                    help="engram_vocab_size: each Engram table has about 4x this many rows")
    ap.add_argument("--shard-gb", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.time()
    tok = build_tiny_tokenizer(256, bos_id=0, eos_id=1, pad_id=2, image_token_id=250)
    kw = dict(hidden=args.hidden, moe_intermediate=args.moe_intermediate, engram_vocab=args.engram_vocab,
              tokenizer=tok)
    experts = args.experts or choose_experts(int(args.target_gb * 1e9), **kw)
    cfg = make_config(experts=experts, **kw)
    inv = tensor_inventory(cfg)
    shards = plan_shards(inv, int(args.shard_gb * 1e9))
    total = inventory_bytes(inv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(f"{args.out}: {len(inv)} tensors, {experts} experts/layer, {total / 1e9:.2f} GB in {len(shards)} shards",
          flush=True)

    rng = np.random.default_rng(args.seed)
    weight_map, written = {}, 0
    for i, names in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        written += write_shard(os.path.join(args.out, fn), names, inv, rng)
        weight_map.update({n: fn for n in names})
        print(f"  {fn}: {len(names)} tensors, {written / 1e9:.2f} GB written, {time.time() - t0:.0f}s", flush=True)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    t = cfg["text_config"]
    summary = {"dir": os.path.abspath(args.out), "tensors": len(inv), "shards": len(shards), "bytes": written,
               "tensor_bytes": total, "experts": experts, "hidden": t["hidden_size"],
               "moe_intermediate": t["moe_intermediate_size"], "layers": t["num_hidden_layers"],
               "engram_num_embeddings": t["engram_num_embeddings"], "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
