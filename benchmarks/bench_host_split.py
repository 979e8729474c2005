"""Host time ``generate`` spends on the model graph per call (CPU is enough: abstract weights).

Builds the 40-layer V4.1-Flash text model with abstract weights and times, per call: a plain
``nnx.split`` (what every ``generate`` call paid before session 7), ``generate._split_flat`` (the
cached split: first call, then later calls), and the hash of the graph key of the executable
table (a fresh ``FlatGraph`` walks the GraphDef; the cached one hashes once).

    python3 benchmarks/bench_host_split.py
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flax import nnx  # noqa: E402

from dsv41_jax import generate as G  # noqa: E402
from dsv41_jax.config import preset  # noqa: E402
from dsv41_jax.model.lm import DeepseekV41  # noqa: E402
from dsv41_jax.numerics import REFERENCE_BF16  # noqa: E402


def ms(fn, n=3):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(round((time.perf_counter() - t) * 1e3, 2))
    return out


def main():
    model = nnx.eval_shape(lambda: DeepseekV41(preset("v41-flash"), REFERENCE_BF16, engram_quantized=True,
                                               text_only=True))
    row = {"what": "host_split", "nnx_split_ms": ms(lambda: nnx.split(model))}
    t = time.perf_counter()
    graph, leaves = G._split_flat(model)
    row["cached_split_first_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    row["cached_split_ms"] = ms(lambda: G._split_flat(model))
    row["graph_hash_uncached_ms"] = ms(lambda: hash(G.FlatGraph(graph.graphdef, graph.treedef)))
    row["graph_hash_cached_ms"] = ms(lambda: hash(graph))
    row["arrays"] = len(leaves)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
