"""The torch peer of the slice benchmark (benchmarks/bench_torch_peer.py) computes the same model
as the torch oracle (tests/torch_ref): tiny width, fp32, CPU.

* prefill logits at every position within 1e-4 (max |diff| / max |oracle|) of ``oracle.forward``;
* incremental decode (prefill a prompt, then one token per step against the cache) within 1e-4
  of the oracle's one-shot forward over prompt + decoded tokens (the oracle's decode == a longer
  prefill);
* fake quant off, on, and on with the release's fp8 activation quantization before the fp8/fp4
  linears (what bench_slice runs by default); the topology has every layer kind of the slice plus an index source
  that uses the candidate mask, a ratio-2 partial group left over after the prompt, and a window
  and top-k small enough that both select.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks import bench_torch_peer as P  # noqa: E402
from benchmarks.bench_slice import slice_config  # noqa: E402
from dsv41_jax.config import with_text_overrides  # noqa: E402
from tests.torch_ref import oracle as O  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is many times faster than several on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _setup():
    cfg = slice_config(4, True, 60_000)  # ratios [0, 2, 1, 1]: L3 uses L2's candidate mask
    cfg = with_text_overrides(cfg, sliding_window=8, index_topk=6, candidate_topk_blocks=3,
                              candidate_block_size=4, hidden_size=128, moe_intermediate_size=64,
                              n_routed_experts=16, engram_compressed_vocab_size=300,
                              q_lora_rank=32, o_lora_rank=32, num_attention_heads=4, head_dim=64,
                              qk_rope_head_dim=32, index_n_heads=2, index_head_dim=32, engram_head_dim=64)
    c = dict(cfg.raw["text_config"])
    topo = O.topology(c)
    assert any(t["uses_candidates"] for t in topo) and topo[1]["ratio"] == 2 and topo[0]["ratio"] == 0
    W = P.random_weights(c, "cpu", torch.float32, seed=3, engram_fp8=False)
    rng = np.random.default_rng(0)
    nc = c["engram_compressed_vocab_size"]
    tmap = rng.integers(0, nc, size=c["vocab_size"]).astype(np.int64)
    tmap[:nc] = np.arange(nc)
    return c, W, tmap


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("fake_quant,release_quant", [(False, False), (True, False), (True, True)])
def test_prefill_and_decode_match_oracle(fake_quant, release_quant):
    torch.manual_seed(0)
    c, W, tmap = _setup()
    S0, n_dec = 33, 6
    ids = torch.randint(0, c["vocab_size"], (2, S0 + n_dec))
    ref = O.forward(c, P.oracle_weights(W, release_quant), ids, token_map=tmap, fake_quant=fake_quant, dtype=torch.float32)

    peer = P.Peer(c, W, tmap, device="cpu", dtype=torch.float32, fake_quant=fake_quant, stable_topk=True,
                  release_quant=release_quant)
    full = peer.prefill(ids, peer.new_cache(2, S0 + n_dec), all_logits=True)
    assert _rel(full, ref) < 1e-4

    cache = peer.new_cache(2, S0 + n_dec)
    lg = peer.prefill(ids[:, :S0], cache)
    assert _rel(lg, ref[:, S0 - 1]) < 1e-4
    for i in range(n_dec):
        lg = peer.decode(ids[:, S0 + i:S0 + i + 1], cache)
        assert _rel(lg, ref[:, S0 + i]) < 1e-4, i
    assert cache["length"] == S0 + n_dec


def test_codecs_match_oracle():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 2, 128)
    # exact e2m1 midpoints (ties) at a few scales
    x[0, :14] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2) * torch.tensor([1.0] * 7 + [-1.0] * 7)
    for mine, ref in ((P.q_fp8_e8, O.qdq_fp8_ue8m0), (P.q_fp4_e8, O.qdq_fp4_ue8m0), (P.q_fp4_e4, O.qdq_fp4_e4m3)):
        assert torch.equal(mine(x), ref(x)), mine.__name__


def test_smoke_bf16_decode():
    """bf16 weights and compute with an fp8 Engram table, the benchmark's own path, stays finite."""
    c, _, tmap = _setup()
    W = P.random_weights(c, "cpu", torch.bfloat16, seed=1, engram_fp8=True)
    peer = P.Peer(c, W, tmap, device="cpu", dtype=torch.bfloat16, fake_quant=True)
    cache = peer.random_cache(3, 40, 64)
    for _ in range(3):
        lg = peer.decode(torch.randint(0, c["vocab_size"], (3, 1)), cache)
    assert lg.shape == (3, c["vocab_size"]) and bool(torch.isfinite(lg).all())
    lg = peer.prefill(torch.randint(0, c["vocab_size"], (1, 40)), peer.new_cache(1, 40))
    assert lg.shape == (1, c["vocab_size"]) and bool(torch.isfinite(lg).all())
