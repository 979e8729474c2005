"""The layer plans of benchmarks/bench_full.py (issue 10's script): every subset of the real 40
layers it builds is a valid V4.1 plan whose kept layers read the same kind of source as in the
full model; 8 or more layers cover every layer kind."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.fixture(scope="module")
def bench_full():
    import bench_full as bf

    return bf


@pytest.mark.parametrize("n", [1, 3, 5, 8, 10, 20, 40])
def test_layer_subsets_are_valid_plans(bench_full, n):
    from dsv41_jax.config import preset

    full = preset("v41-flash").text.layers
    cfg, keep = bench_full.full_config(n, small=True, engram_fraction=0.25)
    assert len(keep) == n == len(cfg.text.layers) and keep == sorted(set(keep))
    for new, (old, p) in enumerate(zip(keep, cfg.text.layers)):
        q = full[old]
        assert p.ratio == q.ratio, (n, old)
        assert (p.owns_compressor, p.owns_indexer, p.is_candidate_source) == \
            (q.owns_compressor, q.owns_indexer, q.is_candidate_source), (n, old)
        assert (p.engram_slot >= 0) == (q.engram_slot >= 0), (n, old)
        if p.ratio > 0:  # reads a kept source, which is the same real layer or one of the same kind
            src = keep[p.kv_source]
            assert full[src].owns_compressor and full[src].ratio == q.ratio and src <= old, (n, old, src)
            assert keep[p.index_source] <= old and full[keep[p.index_source]].owns_indexer
    if n >= 8:
        kinds = {(p.ratio, p.owns_compressor, p.owns_indexer, p.is_candidate_source, p.uses_candidates,
                  p.engram_slot >= 0) for p in cfg.text.layers}
        assert len(kinds) >= 7, kinds
    if n == 40:
        assert keep == list(range(40))
