"""Device-side Engram hashes (dsv41_jax.engram_hash) vs the exact int64 host reference
(engram_layout.EngramLayout.hashes), without jax_enable_x64."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer

from dsv41_jax import engram_hash as EH
from dsv41_jax import engram_layout as EL
from dsv41_jax.config import parse_config

HERE = os.path.dirname(__file__)
GOLDEN = os.path.join(HERE, "golden")
PRESET = os.path.join(HERE, os.pardir, "dsv41_jax", "presets", "v41_flash.json")
FLASH_CV = 99092


def _golden(name):
    d = os.path.join(GOLDEN, name)
    if not os.path.isdir(d):
        pytest.skip(f"tests/golden/{name} missing")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    return cfg, os.path.join(d, "tokenizer.json"), np.load(os.path.join(d, "reference.npz"))


def _flash():
    with open(PRESET) as f:
        cfg = json.load(f)
    t = cfg["text_config"]
    assert t["engram_compressed_vocab_size"] == FLASH_CV and t["engram_max_ngram_size"] == 4
    rng = np.random.default_rng(1234)
    tm = rng.integers(0, FLASH_CV, t["vocab_size"]).astype(np.int32)  # synthetic map (no real tokenizer here)
    tm[2] = FLASH_CV - 1  # pad id = the largest compressed id: blocked slots hit the extreme too
    tm[5] = FLASH_CV - 1
    tm[7] = 0
    return cfg, tm


@pytest.fixture(scope="module")
def flash():
    cfg, tm = _flash()
    t = parse_config(cfg).text
    return t, tm, EL.EngramLayout.from_config(cfg["text_config"], tm), EH.EngramHasher(t, tm)


def _no_64bit(fn, *args):
    """No 64-bit value anywhere in the jaxpr of fn(*args) (sub-jaxprs included)."""
    bad = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in list(eqn.invars) + list(eqn.outvars):
                dt = getattr(getattr(v, "aval", None), "dtype", None)
                if dt is not None and np.dtype(dt).itemsize > 4:
                    bad.append((eqn.primitive.name, dt))
            for p in eqn.params.values():
                for q in (p if isinstance(p, (tuple, list)) else (p,)):
                    q = getattr(q, "jaxpr", q)  # ClosedJaxpr -> Jaxpr
                    if hasattr(q, "eqns"):
                        walk(q)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return bad


# ------------------------------------------------------------------------------------------------
# arithmetic primitives
# ------------------------------------------------------------------------------------------------

def test_u64_primitives_vs_python_ints():
    rng = np.random.default_rng(0)
    # products: v < 2^32, m < 2^64 (mod 2^64); includes the extremes
    v = np.concatenate([[0, 1, 2 ** 16 - 1, 2 ** 16, 2 ** 17 - 1, 2 ** 32 - 1], rng.integers(0, 2 ** 32, 200)])
    m = np.concatenate([np.array([1, 2 ** 63 - 1, 2 ** 64 - 1, 2 ** 48 + 1, 0xFFFF, 3], np.uint64),
                        rng.integers(0, 2 ** 64 - 1, 200, dtype=np.uint64, endpoint=True)])
    limbs = np.stack([((m >> np.uint64(16 * k)) & np.uint64(0xFFFF)).astype(np.uint32) for k in range(4)], -1)
    hi, lo = jax.jit(EH._mul_u64)(jnp.asarray(v.astype(np.uint32)), jnp.asarray(limbs))
    got = [(int(h) << 32) | int(l) for h, l in zip(np.asarray(hi), np.asarray(lo))]
    assert got == [(int(a) * int(b)) % 2 ** 64 for a, b in zip(v, m)]
    # Horner mod for small primes, the released sizes and primes just below 2^31 (1-bit chunks)
    x = [0, 1, 2 ** 64 - 1, 2 ** 63 - 1, 2 ** 32, 2 ** 32 - 1] + [int(a) for a in rng.integers(0, 2 ** 63, 40)]
    x += [(a << 1) | 1 for a in x[-10:]]
    xh = jnp.asarray(np.array([a >> 32 for a in x], np.uint32))[:, None]
    xl = jnp.asarray(np.array([a & 0xFFFFFFFF for a in x], np.uint32))[:, None]
    for primes in ([2, 3, 61, 67], [16000057, 16000069, 16000889], [2 ** 31 - 1, 2147483629, 65537]):
        w = EH.horner_chunk_bits(max(primes))
        assert max(primes) << w <= 2 ** 32 < max(primes) << (w + 1) or w == 31
        r = jax.jit(EH._mod_u64, static_argnums=3)(xh, xl, jnp.asarray(np.array(primes, np.uint32)), w)
        assert np.asarray(r).tolist() == [[a % p for p in primes] for a in x]
    assert EH.horner_chunk_bits(16000889) == 8
    with pytest.raises(ValueError):
        EH.horner_chunk_bits(2 ** 31)


# ------------------------------------------------------------------------------------------------
# golden tiny config (built with the official engram.py)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["text_fast_fp32", "image_fast_fp32"])
def test_golden_hashes_bit_exact(name):
    cfg, tok_path, ref = _golden(name)
    t = cfg["text_config"]
    tm = EL.build_compressed_token_map(Tokenizer.from_file(tok_path), t["vocab_size"])
    np.testing.assert_array_equal(tm, ref["engram_token_map"])
    lay = EL.EngramLayout.from_config(t, tm)
    hasher = EH.EngramHasher(parse_config(cfg).text, tm)
    assert hasher.chunk_bits == EH.horner_chunk_bits(lay.primes.max())
    ids, dead = ref["input_ids"], ref["types"] >= 0
    h, hist = jax.jit(lambda i, d: hasher(i, d))(ids, dead)
    assert h.dtype == jnp.int32 and h.shape == ids.shape + (len(lay.layer_ids), lay.cols)
    for i, l in enumerate(lay.layer_ids):
        np.testing.assert_array_equal(np.asarray(h[:, :, i]), ref[f"engram_hashes_L{l}"])
    # random ids and dead masks, batch > 1, dead at the start / end / whole rows
    rng = np.random.default_rng(7)
    ids = rng.integers(0, t["vocab_size"], (4, 37))
    dead = rng.random(ids.shape) < 0.25
    dead[1, :3] = True
    dead[2, -4:] = True
    dead[3] = True
    h, _ = hasher(ids, dead)
    np.testing.assert_array_equal(np.asarray(h), lay.hashes(ids, dead))
    consts = EH.EngramHashConsts.from_layout(lay)
    comp = EL.compress_ids(ids, dead, tm).astype(np.int32)
    h2 = EH.ngram_hashes_jax(comp, EH.initial_history(4, lay.max_ngram_size), consts)
    np.testing.assert_array_equal(np.asarray(h2), lay.hashes(ids, dead))


# ------------------------------------------------------------------------------------------------
# released V4.1-Flash layout (16M buckets, 8 heads, N=4, compressed vocab 99092), synthetic token map
# ------------------------------------------------------------------------------------------------

def _flash_batch(rng, S=40):
    ids = rng.integers(0, 129280, (6, S))
    ids[0] = 5  # compressed 99091 everywhere: the largest products
    ids[1] = 7  # compressed 0 everywhere
    ids[2, ::2], ids[2, 1::2] = 5, 7
    dead = rng.random(ids.shape) < 0.2
    dead[0] = dead[1] = False
    dead[2, 10:13] = True
    dead[3] = True  # whole row masked (all pad)
    dead[4, ::2] = True  # alternating
    dead[5, :] = False
    dead[5, 0] = dead[5, -1] = True
    return ids, dead


def test_flash_hashes_bit_exact(flash):
    t, tm, lay, hasher = flash
    assert lay.pad_id == FLASH_CV - 1 and lay.num_embeddings == (384006168, 384016682)
    assert hasher.chunk_bits == 8 and hasher.cols == 24 and hasher.n_layers == 2
    rng = np.random.default_rng(3)
    ids, dead = _flash_batch(rng)
    h, hist = jax.jit(lambda i, d: hasher(i, d))(ids, dead)
    want = lay.hashes(ids, dead)
    assert want.max() < 2 ** 31
    np.testing.assert_array_equal(np.asarray(h), want)
    np.testing.assert_array_equal(np.asarray(hist), EL.compress_ids(ids[:, -3:], dead[:, -3:], tm))
    # arbitrary histories (extreme ids, DEAD mixed in) vs the reference's history argument
    hist0 = rng.integers(0, FLASH_CV, (6, 3)).astype(np.int32)
    hist0[0] = FLASH_CV - 1
    hist0[1] = 0
    hist0[2, 1] = EL.DEAD
    hist0[4, 2] = EL.DEAD
    h, _ = hasher(ids, dead, jnp.asarray(hist0))
    np.testing.assert_array_equal(np.asarray(h), lay.hashes(ids, dead, history=hist0))


def test_flash_compressed_extremes_direct(flash):
    """ngram_hashes_jax on compressed ids covering [0, 99091] and DEAD, vs the int64 reference."""
    t, tm, lay, _ = flash
    consts = EH.EngramHashConsts.from_layout(lay)
    rng = np.random.default_rng(11)
    comp = rng.integers(0, FLASH_CV, (3, 64)).astype(np.int32)
    comp[0, :20] = FLASH_CV - 1
    comp[1, :20] = 0
    comp[rng.random(comp.shape) < 0.1] = EL.DEAD
    hist = np.array([[EL.DEAD, EL.DEAD, EL.DEAD], [FLASH_CV - 1, 0, FLASH_CV - 1], [0, EL.DEAD, 12345]], np.int32)
    got = jax.jit(EH.ngram_hashes_jax)(comp, hist, consts)
    ident = np.arange(FLASH_CV, dtype=np.int32)
    want = np.stack([EL.ngram_hashes_np(np.maximum(comp, 0), comp < 0, ident, primes=lay.primes[i],
                                        offsets=lay.offsets[i], multipliers=lay.multipliers[i], pad_id=lay.pad_id,
                                        history=hist) for i in range(2)], axis=2)
    np.testing.assert_array_equal(np.asarray(got), want)


# ------------------------------------------------------------------------------------------------
# history: chunked prefill, decode, padding
# ------------------------------------------------------------------------------------------------

def test_chunked_and_decode_equal_one_shot(flash):
    t, tm, lay, hasher = flash
    rng = np.random.default_rng(5)
    ids, dead = _flash_batch(rng, S=24)
    want = lay.hashes(ids, dead)
    step = jax.jit(lambda i, d, h: hasher(i, d, h))
    for cuts in ((1,), (2, 3), (5, 13, 14), (23,)):
        hist, parts = hasher.initial_history(ids.shape[0]), []
        for a, b in zip((0,) + cuts, cuts + (ids.shape[1],)):
            h, hist = step(ids[:, a:b], dead[:, a:b], hist)
            parts.append(np.asarray(h))
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), want)

    # token-by-token decode after a prefill, inside lax.scan (pure function of the state)
    k = 9
    h0, hist = hasher(ids[:, :k], dead[:, :k])
    token_map, consts = hasher.token_map[...], hasher.consts

    def body(hist, x):
        i, d = x
        h, hist = EH.engram_hash_step(i[:, None], d[:, None], None, hist, token_map, consts)
        return hist, h[:, 0]

    hist_end, hs = jax.jit(lambda hist, xs: jax.lax.scan(body, hist, xs))(
        hist, (jnp.asarray(ids[:, k:].T), jnp.asarray(dead[:, k:].T)))
    got = np.concatenate([np.asarray(h0), np.asarray(hs).transpose(1, 0, 2, 3)], axis=1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(hist_end), EL.compress_ids(ids[:, -3:], dead[:, -3:], tm))


def test_padding_is_removed_from_the_sequence(flash):
    """valid=False positions are not part of the sequence: valid positions hash exactly as the compacted
    sequence does (one shot), invalid ones hash as DEAD, and the history skips them."""
    t, tm, lay, hasher = flash
    rng = np.random.default_rng(9)
    B, S = 5, 21
    ids, dead = _flash_batch(rng, S=S)
    ids, dead = ids[:B], dead[:B]
    valid = rng.random((B, S)) < 0.7
    valid[0] = True
    valid[1, :6] = False  # left padding
    valid[2, -7:] = False  # right padding
    valid[3] = False  # nothing valid: history unchanged
    hist0 = rng.integers(0, FLASH_CV, (B, 3)).astype(np.int32)
    hist0[4, 0] = EL.DEAD
    h, hist = jax.jit(lambda i, d, v, hh: hasher(i, d, hh, valid=v))(ids, dead, valid, hist0)
    h, hist = np.asarray(h), np.asarray(hist)
    dead_row = lay.hashes(ids[:1, :1], np.ones((1, 1), bool))[0, 0]
    for b in range(B):
        sel = np.flatnonzero(valid[b])
        want = lay.hashes(ids[b:b + 1, sel], dead[b:b + 1, sel], history=hist0[b:b + 1])[0]
        np.testing.assert_array_equal(h[b, sel], want)
        np.testing.assert_array_equal(h[b, ~valid[b]], np.broadcast_to(dead_row, h[b, ~valid[b]].shape))
        seq = np.concatenate([hist0[b], EL.compress_ids(ids[b:b + 1, sel], dead[b:b + 1, sel], tm)[0]])
        np.testing.assert_array_equal(hist[b], seq[-3:])

    # right-padded chunked prefill (per-row lengths) then decode with finished rows == one shot
    lens = np.array([21, 4, 13, 1, 17])
    full = lay.hashes(ids, dead)
    step = jax.jit(lambda i, d, hh, v: hasher(i, d, hh, valid=v))
    hist = hasher.initial_history(B)
    got = np.zeros(full.shape, np.int32)
    pos = np.zeros(B, int)
    for chunk in (6, 6, 1, 1, 8):
        cols = [np.clip(pos + j, 0, S - 1) for j in range(chunk)]
        ci = np.stack([ids[np.arange(B), c] for c in cols], 1)
        cd = np.stack([dead[np.arange(B), c] for c in cols], 1)
        cv = np.stack([pos + j < lens for j in range(chunk)], 1)
        h, hist = step(ci, cd, hist, cv)
        h = np.asarray(h)
        for b in range(B):
            for j in range(chunk):
                if cv[b, j]:
                    got[b, pos[b] + j] = h[b, j]
        pos = np.minimum(pos + chunk, lens)
    for b in range(B):
        np.testing.assert_array_equal(got[b, :lens[b]], full[b, :lens[b]])


# ------------------------------------------------------------------------------------------------
# module, jit / scan / while_loop without x64
# ------------------------------------------------------------------------------------------------

def test_module_state_and_jit_without_x64(flash):
    assert not jax.config.jax_enable_x64
    t, tm, lay, hasher = flash
    assert len(nnx.state(hasher, nnx.Param)) == 0  # the weight loader never sees the constants
    consts = nnx.state(hasher, EH.EngramConst)
    assert {"token_map", "pad_id", "primes", "offsets", "mult_limbs"} <= set(dict(consts).keys())
    rng = np.random.default_rng(2)
    ids, dead = _flash_batch(rng, S=8)
    want = lay.hashes(ids, dead)

    graphdef, state = nnx.split(hasher)

    @jax.jit
    def run(state, ids, dead):
        m = nnx.merge(graphdef, state)

        def cond(c):
            return c[0] < ids.shape[1]

        def body(c):  # decode one position per iteration inside lax.while_loop
            i, hist, out = c
            tok = jax.lax.dynamic_slice_in_dim(ids, i, 1, axis=1)
            dd = jax.lax.dynamic_slice_in_dim(dead, i, 1, axis=1)
            h, hist = m(tok, dd, hist)
            return i + 1, hist, jax.lax.dynamic_update_slice_in_dim(out, h, i, axis=1)

        out0 = jnp.zeros(ids.shape + (m.n_layers, m.cols), jnp.int32)
        return jax.lax.while_loop(cond, body, (jnp.int32(0), m.initial_history(ids.shape[0]), out0))[2]

    np.testing.assert_array_equal(np.asarray(run(state, jnp.asarray(ids, jnp.int32), jnp.asarray(dead))), want)
    bad = _no_64bit(lambda s, i, d, v, hh: nnx.merge(graphdef, s)(i, d, hh, valid=v), state,
                    jnp.asarray(ids, jnp.int32), jnp.asarray(dead), jnp.ones(ids.shape, bool),
                    hasher.initial_history(ids.shape[0]))
    assert not bad, bad


def test_token_map_errors(flash):
    t, tm, lay, _ = flash
    h = EH.EngramHasher(t)  # zeros until set_token_map
    assert not h.token_map_loaded and int(np.asarray(h.token_map[...]).max()) == 0
    bad = tm.copy()
    bad[bad >= 1000] = 0
    with pytest.raises(ValueError, match=rf"compressed vocab of {int(bad.max()) + 1},.* is {FLASH_CV}"):
        h.set_token_map(bad)
    with pytest.raises(ValueError, match="more than vocab_size"):
        h.set_token_map(np.zeros(t.vocab_size + 1, np.int32))
    h.set_token_map(tm)
    assert h.token_map_loaded and int(h.pad_id[...]) == FLASH_CV - 1


def test_load_or_build_token_map_cache(tmp_path, monkeypatch):
    cfg, tok_path, ref = _golden("text_fast_fp32")
    t = cfg["text_config"]
    cache = tmp_path / EH.TOKEN_MAP_FILE
    tm = EH.load_or_build_token_map(tok_path, t["vocab_size"], cache, t["engram_compressed_vocab_size"])
    np.testing.assert_array_equal(tm, ref["engram_token_map"])
    assert cache.exists() and os.path.exists(str(cache) + ".json")

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(EL, "build_compressed_token_map", boom)
    tm2 = EH.load_or_build_token_map(tok_path, t["vocab_size"], cache, t["engram_compressed_vocab_size"])
    assert tm2.dtype == np.int32
    np.testing.assert_array_equal(tm2, tm)
    want = t["engram_compressed_vocab_size"]
    with pytest.raises(ValueError, match=rf"compressed vocab of {want}.*is {want + 1}"):
        EH.load_or_build_token_map(tok_path, t["vocab_size"], cache, want + 1)
    monkeypatch.undo()
    # a different vocab_size invalidates the cache (rebuilt, padding ids map to 0)
    tm3 = EH.load_or_build_token_map(tok_path, t["vocab_size"] + 4, cache, want)
    assert tm3.shape == (t["vocab_size"] + 4,) and np.all(tm3[-4:] == 0)
    with pytest.raises(ValueError, match=rf"compressed vocab of {want}.*is 99092"):
        EH.load_or_build_token_map(tok_path, t["vocab_size"], None, 99092)
