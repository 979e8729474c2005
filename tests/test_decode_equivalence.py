"""Decode equivalence (issue 5): for random tiny V4.1 configs, the one-shot prefill of N tokens equals

* chunked prefill with fixed chunk sizes (odd sizes put ratio-2 groups across chunk boundaries,
  sizes above the window and partial last chunks padded with ``valid=False``) followed by
  token-by-token decode up to N,
* token-by-token decode at every position from 0,
* a batch of two sequences of different lengths (right padding via ``valid``), each row equal to
  the same sequence run alone, through prefill and lock-step decode,

at 1e-5 (fp32, fast numerics), on configs that have every layer kind (ratio 0, ratio-2 and
ratio-1 kv sources and their consumers, index sources with and without their own keys, the
candidate source and an index source filtered by it, Engram), a window that wraps the ring and an
active candidate filter. Everything goes through ``generate.forward_chunk`` and the cache from
``model.init_cache``. Engram hashes are computed on the host for the whole sequence and sliced;
one run instead lets the model hash on device from its cached history.
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

import jax.numpy as jnp  # noqa: E402

from dsv41_jax.generate import forward_chunk  # noqa: E402
from dsv41_jax.numerics import FAST_F32  # noqa: E402
from tests.test_random_parity import make_model, max_abs_rel, random_config, random_inputs  # noqa: E402
from tests.torch_ref import oracle as O  # noqa: E402

TOL = 1e-5
N_TOKENS = 34
# one chunk size keeps the number of compiled shapes down: odd, so ratio-2 groups straddle chunk
# ends, and longer than the window (the ring is overwritten within one chunk); the partial last
# chunk of a prefix is padded with valid=False
CHUNK = 5


def _find_seed(need, **pins) -> int:
    for seed in range(2000):
        cfg, feats = random_config(seed, **pins)
        t = cfg["text_config"]
        if not all(feats.get(k) for k in need):
            continue
        # the candidate filter must be able to drop positions within N_TOKENS
        if feats.get("candidate_user") and \
                t["candidate_topk_blocks"] * t["candidate_block_size"] >= N_TOKENS // 2 - 2:
            continue
        return seed
    raise AssertionError(f"no random config with {need} {pins}")


EVERY_KIND = ("ratio0", "ratio1", "ratio2", "consumer_reuses_kv", "index_source_without_keys",
              "candidate_user", "engram")
CASES = {
    # every layer kind in one model, explicit topology keys
    "every_kind": dict(need=EVERY_KIND, pins=dict(n_layers=5, window=4, fallback="none", vision=False), image=False),
    # every kind again, candidate source from the fallback, image spans routed with bias_vl
    "every_kind_image": dict(need=EVERY_KIND, pins=dict(n_layers=5, window=3, fallback="cand", vision=True),
                             image=True),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("decode_eq")


class _Runner:
    """One random model plus its host-side inputs for a sequence of N_TOKENS tokens per row."""

    def __init__(self, name, root):
        spec = CASES[name]
        self.seed = _find_seed(spec["need"], **spec["pins"])
        self.rm = make_model(self.seed, Path(root) / name, **spec["pins"])
        self.model = self.rm.load(FAST_F32)
        self.t = self.rm.text
        assert self.t["sliding_window"] < CHUNK < N_TOKENS  # the ring wraps, also inside one chunk
        rng = np.random.default_rng(self.seed)
        self.ids, self.mask, self.emb = random_inputs(self.rm, rng, 2, N_TOKENS, image=spec["image"])
        lay = self.rm.layout()
        self.hashes = None if lay is None else lay.hashes(self.ids, self.mask)

    def _slice(self, a, rows, lo, hi, pad_to):
        """a[rows, lo:hi] right-padded with zeros to pad_to positions (None stays None)."""
        if a is None:
            return None
        x = a[rows, lo:hi]
        pad = pad_to - x.shape[1]
        if pad:
            x = np.concatenate([x, np.zeros((x.shape[0], pad) + x.shape[2:], x.dtype)], axis=1)
        return x

    def run(self, rows, schedule, *, device_hashes=False):
        """Feed rows of the sequences through forward_chunk: ``schedule`` is a list of chunk sizes
        (sum <= N_TOKENS). Returns logits [len(rows), sum(schedule), V] of the valid positions."""
        rows = list(rows)
        B = len(rows)
        cache = self.model.init_cache(B, N_TOKENS)
        out, pos = [], 0
        for c in schedule:
            hi = min(pos + c, N_TOKENS)
            valid = np.zeros((B, c), bool)
            valid[:, : hi - pos] = True
            kw = {"valid": jnp.asarray(valid)}
            if self.mask is not None:
                kw["image_mask"] = jnp.asarray(self._slice(self.mask, rows, pos, hi, c))
                kw["inputs_embeds"] = jnp.asarray(self._slice(self.emb, rows, pos, hi, c))
            if self.hashes is not None and not device_hashes:
                kw["engram_hashes"] = jnp.asarray(self._slice(self.hashes, rows, pos, hi, c), jnp.int32)
            logits, cache = forward_chunk(self.model, self._slice(self.ids, rows, pos, hi, c), cache, **kw)
            out.append(np.asarray(logits)[:, : hi - pos])
            pos = hi
        assert int(np.asarray(cache["length"])[0]) == pos
        return np.concatenate(out, axis=1)


_RUNNERS = {}


def _runner(name, root) -> _Runner:
    if name not in _RUNNERS:
        _RUNNERS[name] = _Runner(name, root)
    return _RUNNERS[name]


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_prefill_and_decode_equal_one_shot(name, root):
    r = _runner(name, root)
    one_shot = r.run([0], [N_TOKENS])
    # the one-shot prefill itself against the torch oracle
    eh = None if r.hashes is None else {l: r.hashes[:1, :, j] for j, l in enumerate(r.t["engram_layer_ids"])}
    cap = {}
    ref = O.forward(r.t, r.rm.torch_weights(), torch.from_numpy(r.ids[:1]),
                    image_mask=None if r.mask is None else torch.from_numpy(r.mask[:1]),
                    inputs_embeds=None if r.emb is None else torch.from_numpy(r.emb[:1]), engram_hashes=eh,
                    capture=cap).numpy()
    assert max_abs_rel(one_shot, ref) <= TOL
    # the candidate filter really drops visible positions on this sequence
    for key, cand in cap.items():
        if key.startswith("candidates_L"):
            m = r.t["compress_ratios"][int(key[len("candidates_L"):])]
            visible = np.arange(cand.shape[-1]) < ((np.arange(N_TOKENS) + 1) // m)[:, None]
            assert (visible & ~cand[0]).sum() > 0, key

    fails = []
    prefix = 2 * N_TOKENS // 3
    n_chunks = -(-prefix // CHUNK)
    got = r.run([0], [CHUNK] * n_chunks + [1] * (N_TOKENS - n_chunks * CHUNK))
    err = max_abs_rel(got, one_shot)
    if err > TOL:
        rows = np.abs(got - one_shot).max(-1)[0] / np.abs(one_shot).max()
        fails.append(f"chunks of {CHUNK} then decode: max_abs_rel {err:.3g}; first bad position "
                     f"{int(np.argmax(rows > TOL))}")
    got = r.run([0], [1] * N_TOKENS)
    err = max_abs_rel(got, one_shot)
    if err > TOL:
        rows = np.abs(got - one_shot).max(-1)[0] / np.abs(one_shot).max()
        fails.append(f"token by token: max_abs_rel {err:.3g}; first bad position {int(np.argmax(rows > TOL))}")
    assert not fails, f"{name} (seed {r.seed}, ratios {r.t['compress_ratios']}):\n" + "\n".join(fails)


@pytest.mark.parametrize("name", ["every_kind_image"])
def test_device_side_engram_hashes_across_chunks(name, root):
    """No hashes passed: the model hashes on device and carries the n-gram history in the cache."""
    r = _runner(name, root)
    assert r.hashes is not None
    one_shot = r.run([0], [N_TOKENS])
    got = r.run([0], [CHUNK] * -(-N_TOKENS // CHUNK), device_hashes=True)
    assert max_abs_rel(got, one_shot) <= TOL


@pytest.mark.parametrize("name", ["every_kind", "every_kind_image"])
def test_batch_with_different_lengths_matches_rows_alone(name, root):
    """Rows of lengths P0 > P1 prefilled together (right padding, valid mask) in chunks, then
    decoded in lock step: every logit row equals the row's own one-shot prefill."""
    r = _runner(name, root)
    alone = [r.run([b], [N_TOKENS])[0] for b in (0, 1)]
    P = (N_TOKENS - 8, N_TOKENS - 8 - 9)  # prompt lengths; 8 decode steps each
    c = CHUNK
    B = 2
    cache = r.model.init_cache(B, N_TOKENS)
    got = [[], []]
    for lo in range(0, P[0], c):
        ids = np.zeros((B, c), np.int64)
        valid = np.zeros((B, c), bool)
        mask = np.zeros((B, c), bool)
        emb = np.zeros((B, c, r.t["hidden_size"]), np.float32)
        hashes = None if r.hashes is None else np.zeros((B, c) + r.hashes.shape[2:], np.int64)
        for b in range(B):
            n = max(0, min(c, P[b] - lo))
            ids[b, :n] = r.ids[b, lo:lo + n]
            valid[b, :n] = True
            if r.mask is not None:
                mask[b, :n] = r.mask[b, lo:lo + n]
                emb[b, :n] = r.emb[b, lo:lo + n]
            if hashes is not None:
                hashes[b, :n] = r.hashes[b, lo:lo + n]
        kw = {"valid": jnp.asarray(valid)}
        if r.mask is not None:
            kw["image_mask"], kw["inputs_embeds"] = jnp.asarray(mask), jnp.asarray(emb)
        if hashes is not None:
            kw["engram_hashes"] = jnp.asarray(hashes, jnp.int32)
        logits, cache = forward_chunk(r.model, ids, cache, **kw)
        logits = np.asarray(logits)
        for b in range(B):
            got[b].append(logits[b, : int(valid[b].sum())])
    np.testing.assert_array_equal(np.asarray(cache["length"]), P)
    for k in range(8):
        ids = np.array([[r.ids[b, P[b] + k]] for b in range(B)])
        kw = {}
        if r.mask is not None:
            kw["image_mask"] = jnp.asarray(np.array([[r.mask[b, P[b] + k]] for b in range(B)]))
            kw["inputs_embeds"] = jnp.asarray(np.stack([r.emb[b, P[b] + k][None] for b in range(B)]))
        if r.hashes is not None:
            kw["engram_hashes"] = jnp.asarray(np.stack([r.hashes[b, P[b] + k][None] for b in range(B)]), jnp.int32)
        logits, cache = forward_chunk(r.model, ids, cache, **kw)
        for b in range(B):
            got[b].append(np.asarray(logits)[b])
    fails = []
    for b in range(B):
        g = np.concatenate(got[b], axis=0)
        want = alone[b][: P[b] + 8]
        assert g.shape == want.shape
        err = max_abs_rel(g, want)
        if err > TOL:
            rows = np.abs(g - want).max(-1) / np.abs(want).max()
            fails.append(f"row {b} (prompt {P[b]}): max_abs_rel {err:.3g}; first bad position "
                         f"{int(np.argmax(rows > TOL))}")
    assert not fails, f"{name} (seed {r.seed}):\n" + "\n".join(fails)


@pytest.mark.parametrize("name", list(CASES))
def test_query_blocked_prefill_equals_unblocked(name, root):
    """Long chunks run attention and the indexer/top-k in query blocks (``Attention.q_block``):
    with a block of 4 (the window), a 32-token prefill runs 8 blocks and must equal the one-shot
    unblocked prefill (default block 256), logits at every position."""
    from flax import nnx

    r = _runner(name, root)
    n = 32
    assert n % 4 == 0 and n > 2 * max(4, r.t["sliding_window"])
    want = r.run([0, 1], [n])
    blocked = nnx.clone(r.model)
    for layer in blocked.layers:
        layer.attn.q_block = 4
    model, r.model = r.model, blocked
    try:
        got = r.run([0, 1], [n])
    finally:
        r.model = model
    assert max_abs_rel(got, want) <= 1e-6
