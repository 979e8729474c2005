"""Probe: the token gather of a prefill's routed experts (``moe_glu.gather_rows``: [rows, D] bf16
of the expert-sorted block layout, zeros for padding rows) against a gather without the fill
(padding rows clamped to token 0, ``promise_in_bounds``), at an 8k prefill of V4.1-Flash (8192
tokens x 6, 384 experts, 160-row blocks, hidden 5120), and ``gather_used_rows`` (a Pallas gather
that writes only the blocks the kernels read; its values checked against ``gather_rows``). Each result is materialized (an
optimization barrier, as the kernel that reads it in the model needs it in memory) and summed by
the timing loop; the same for an elementwise copy of a ready [rows, D] array (the same bytes
read and written) is the reference. One JSON line per variant (appended to
$OUT/probe_gather_rows.jsonl when $OUT is set).

    python3 benchmarks/probe_gather_rows.py
"""
from __future__ import annotations

import functools
import os
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_qmatmul as bq  # noqa: E402
from dsv41_jax.kernels.moe_glu import gather_rows, gather_used_rows  # noqa: E402
from dsv41_jax.model.moe import MoE, pallas_chunk  # noqa: E402


def main(T: int = 8192, k: int = 6, E: int = 384, D: int = 5120, reps: int = 20):
    if os.environ.get("OUT"):
        bq.OUT = os.path.join(os.environ["OUT"], "probe_gather_rows.jsonl")
    k1, k2 = jax.random.split(jax.random.key(0))
    c = pallas_chunk(T * k, E)
    ids = jax.random.randint(k1, (T, k), 0, E, dtype=jnp.int32)
    fake = types.SimpleNamespace(n_experts=E, _blocks=functools.partial(MoE._blocks, types.SimpleNamespace(n_experts=E)))
    row_token, *_, n_used = MoE._rows(fake, jnp.ones((T, k), jnp.float32), ids, c)
    x = jax.random.normal(k2, (T, D), jnp.float32).astype(jnp.bfloat16)
    R = row_token.shape[0]
    gb = 2 * R * D * 2 / 1e9  # rows written + read, bf16
    ready = gather_rows(x, row_token)
    bar = jax.lax.optimization_barrier
    variants = {
        "copy of a ready [rows, D] (reference)": (lambda i, s, a: bar(a + s.astype(a.dtype)), (ready,)),
        "gather_rows (fill zeros)": (lambda i, s, a, r: bar(gather_rows(a + s.astype(a.dtype), r)), (x, row_token)),
        "clamped, promise_in_bounds": (lambda i, s, a, r: bar((a + s.astype(a.dtype)).at[jnp.maximum(r, 0)].get(
            mode="promise_in_bounds")), (x, row_token)),
        "clamped, clip": (lambda i, s, a, r: bar(jnp.take(a + s.astype(a.dtype), jnp.maximum(r, 0), axis=0,
                                                          mode="clip")), (x, row_token)),
        "gather_used_rows (kernel: the used blocks only)": (
            lambda i, s, a, r, n: bar(gather_used_rows(a + s.astype(a.dtype), r, n, bm=c)), (x, row_token, n_used)),
    }
    used = int(n_used) * c
    got = jax.jit(functools.partial(gather_used_rows, bm=c))(x, row_token, n_used)[:used]
    bq.emit(variant="gather_used_rows values", used_rows=used, equal=bool(jnp.array_equal(got, ready[:used])))
    for name, (fn, args) in variants.items():
        t, comp = bq.timeit(fn, *args, reps=reps)
        bq.emit(variant=name, ms=round(t * 1e3, 3), tb_per_s=round(gb / t / 1e3, 2), rows=R, chunk=c,
                compile_s=round(comp, 1))

if __name__ == "__main__":
    main()
