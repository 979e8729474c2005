"""The ViT's attention at V4.1 size (one 1024-token image: 8704 padded patches, 16 heads x 64,
bf16, no causal mask) on the GPU: cuDNN's flash attention (what ``vision.attention_bf16`` runs,
with the padded keys masked by sequence length) against JAX's Mosaic GPU attention kernel
(``jax.experimental.pallas.ops.gpu.attention_mgpu``: float16 only and no key mask, so it runs
in float16 over the padded keys too: timing only). Each cuDNN and kernel row also gives
``chain_ms``: per call of ``PROBE_VIT_ATTN_CHAIN`` (32) calls chained in one executable, as the
tower runs them (the single-call ``ms`` includes the dispatch and the host's wait). The key
lengths are an argument of every call (run 39's single-call rows had them as a constant). One JSON
line per row::

    python3 benchmarks/probe_vit_attention.py
"""
from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_slice import bench, jsonl_emitter  # noqa: E402

emit = jsonl_emitter("probe_vit_attention.jsonl")


CHAIN = int(os.environ.get("PROBE_VIT_ATTN_CHAIN", "32"))


def timeit(f, *a):
    return bench(f, *a, warmup=1, iters=10)[0]


def chained_ms(fn, q, k, v, n):
    """ms per call of ``CHAIN`` calls in one executable, each call's output the next one's q (as
    the tower's 32 layers run: no per-call dispatch or host sync in the time; the key lengths a
    traced argument as in the tower)."""
    f = jax.jit(lambda q, k, v, n: jax.lax.fori_loop(0, CHAIN, lambda i, o: fn(o, k, v, n).astype(o.dtype), q))
    return round(timeit(f, q, k, v, n) * 1e3 / CHAIN, 3)


def main():
    from jax.experimental.pallas.ops.gpu import attention_mgpu as A

    N, n_valid, H, d = 8704, 8649, 16, 64
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, N, H, d), jnp.float32).astype(jnp.bfloat16) for kk in (k1, k2, k3))
    flops = 4.0 * n_valid * n_valid * H * d
    lens = jnp.array([n_valid], jnp.int32)
    sc = 1.0 / np.sqrt(d)
    dpa = functools.partial(jax.nn.dot_product_attention, scale=sc)
    forms = {  # cuDNN as vision.attention_bf16 calls it (key lengths only), variants of the call; the
        # lengths an argument (traced, as in the tower); chained only where ``chain`` is set
        "cudnn_kv_lengths": (lambda q, k, v, n: dpa(q, k, v, implementation="cudnn", key_value_seq_lengths=n), True),
        "cudnn_q_and_kv_lengths": (lambda q, k, v, n: dpa(q, k, v, implementation="cudnn", query_seq_lengths=n,
                                                          key_value_seq_lengths=n), False),
        "cudnn_unmasked": (lambda q, k, v, n: dpa(q, k, v, implementation="cudnn"), True),
        "xla_kv_lengths": (lambda q, k, v, n: dpa(q, k, v, implementation="xla", key_value_seq_lengths=n), False),
    }
    for name, (fn, chain) in forms.items():
        try:
            t = timeit(jax.jit(fn), q, k, v, lens)
            row = dict(form=name, ms=round(t * 1e3, 3), tflop_s=round(flops / t / 1e12, 1))
            if chain and CHAIN:
                row["chain_ms"] = chained_ms(fn, q, k, v, lens)
                row["chain_tflop_s"] = round(flops / row["chain_ms"] / 1e9, 1)
            emit(**row)
        except Exception as e:  # noqa: BLE001
            emit(form=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    # this project's kernel (kernels.vit_attn): bf16 with the key mask, checked against cuDNN's values
    from dsv41_jax.kernels import vit_attn

    want = jax.jit(forms["cudnn_kv_lengths"][0])(q, k, v, lens).astype(jnp.float32)
    variants = [dict(block_kv=128), dict(block_kv=128, turns=False), dict(block_kv=128, mask="cond"),
                dict(block_kv=128, mask="cond", early=True), dict(block_kv=128, turns=False, mask="cond", early=True),
                dict(block_kv=128, steps=3, mask="cond", early=True), dict(block_kv=256, mask="cond", early=True),
                dict(block_q=128, block_kv=128, turns=False, mask="cond", early=True),
                dict(block_q=128, block_kv=64, mask="cond", early=True), dict(block_kv=64, turns=False)]
    for var in variants:
        cfg = {**vit_attn.DEFAULT_CONFIG, **var}
        try:
            f = jax.jit(lambda q, k, v, cfg=cfg: vit_attn.attention(q, k, v, lens, impl="mosaic", **cfg))
            err = float(jnp.abs(f(q, k, v).astype(jnp.float32) - want).max())
            t = timeit(f, q, k, v)
            row = dict(form="vit_attn_mgpu", **cfg, ms=round(t * 1e3, 3), tflop_s=round(flops / t / 1e12, 1),
                       max_abs_vs_cudnn=err)
            if CHAIN:
                row["chain_ms"] = chained_ms(lambda q, k, v, n, cfg=cfg: vit_attn.attention(
                    q, k, v, n, impl="mosaic", **cfg), q, k, v, lens)
                row["chain_tflop_s"] = round(flops / row["chain_ms"] / 1e9, 1)
            emit(**row)
        except Exception as e:  # noqa: BLE001
            emit(form="vit_attn_mgpu", **cfg, error=f"{type(e).__name__}: {str(e)[:600]}")
    if os.environ.get("PROBE_VIT_ATTN_ONLY_KERNEL"):
        return
    # JAX's Mosaic GPU flash attention takes float16 only (run 36: bf16 fails inside it): timed
    # in float16, unmasked, as a measure of what a Hopper kernel reaches at head_dim 64
    qh, kh, vh = (t.astype(jnp.float16) for t in (q, k, v))
    for bq, bkv, st in ((64, 64, 2), (128, 64, 2), (64, 128, 2), (128, 128, 2), (128, 64, 3)):
        cfg = A.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st)
        try:
            f = jax.jit(lambda q, k, v, cfg=cfg: A.attention(q, k, v, cfg))
            t = timeit(f, qh, kh, vh)
            emit(form="mosaic_fp16_unmasked", block_q=bq, block_kv=bkv, stages=st, ms=round(t * 1e3, 3),
                 tflop_s_if_unpadded=round(flops / t / 1e12, 1))
        except Exception as e:  # noqa: BLE001
            emit(form="mosaic_fp16_unmasked", block_q=bq, block_kv=bkv, stages=st,
                 error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
