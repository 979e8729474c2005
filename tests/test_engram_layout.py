"""Engram layout: compressed token map, primes/offsets/multipliers and n-gram hashes vs the golden
reference (produced by the official engram.py)."""
import json
import os

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, models

from dsv41_jax import engram_layout as EL

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
CASES = ["text_fast_fp32", "image_fast_fp32", "image_fp8"]


def _case(name):
    d = os.path.join(GOLDEN, name)
    if not os.path.isdir(d):
        pytest.skip(f"tests/golden/{name} missing")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    return cfg, Tokenizer.from_file(os.path.join(d, "tokenizer.json")), np.load(os.path.join(d, "reference.npz"))


@pytest.mark.parametrize("name", CASES)
def test_token_map_and_config_match_golden(name):
    cfg, tok, ref = _case(name)
    t = cfg["text_config"]
    tm = EL.build_compressed_token_map(tok, t["vocab_size"])
    assert tm.dtype == np.int32
    np.testing.assert_array_equal(tm, ref["engram_token_map"])
    assert EL.compressed_vocab_size(tm) == t["engram_compressed_vocab_size"]
    assert EL.engram_num_embeddings(t) == t["engram_num_embeddings"]
    EL.EngramLayout.from_config(t, tm)  # check=True passes


@pytest.mark.parametrize("name", CASES)
def test_hashes_match_golden(name):
    cfg, tok, ref = _case(name)
    t = cfg["text_config"]
    lay = EL.EngramLayout.from_config(t, ref["engram_token_map"])
    ids, dead = ref["input_ids"], ref["types"] >= 0  # image-span positions are DEAD
    h = lay.hashes(ids, dead)
    assert h.dtype == np.int64 and h.shape == ids.shape + (len(lay.layer_ids), lay.cols)
    for i, l in enumerate(lay.layer_ids):
        np.testing.assert_array_equal(h[:, :, i], ref[f"engram_hashes_L{l}"])
        one = EL.ngram_hashes_np(ids, dead, lay.token_map, primes=lay.primes[i], offsets=lay.offsets[i],
                                 multipliers=lay.multipliers[i], pad_id=lay.pad_id)
        np.testing.assert_array_equal(one, ref[f"engram_hashes_L{l}"])
    # chunked (prefill split anywhere, image span included) with the last N-1 compressed ids as history
    n1 = lay.max_ngram_size - 1
    for k in (1, 2, 9, 13, ids.shape[1] - 1):
        hist = EL.compress_ids(ids[:, max(0, k - n1):k], dead[:, max(0, k - n1):k], lay.token_map)
        hist = np.concatenate([np.full((ids.shape[0], n1 - hist.shape[1]), EL.DEAD), hist], axis=1)
        h2 = lay.hashes(ids[:, k:], dead[:, k:], history=hist)
        np.testing.assert_array_equal(np.concatenate([lay.hashes(ids[:, :k], dead[:, :k]), h2], axis=1), h)


def test_config_mismatch_is_reported():
    cfg, tok, ref = _case("text_fast_fp32")
    t = dict(cfg["text_config"], engram_compressed_vocab_size=90)
    with pytest.raises(ValueError, match="compressed vocab"):
        EL.EngramLayout.from_config(t, ref["engram_token_map"])
    EL.EngramLayout.from_config(t, ref["engram_token_map"], check=False)


def test_released_v41_flash_rows():
    t = {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
         "engram_vocab_size": 16000000}
    assert EL.engram_num_embeddings(t) == [384006168, 384016682]
    primes = np.asarray(EL.engram_primes(t))
    assert primes.shape == (2, 3, 8)
    assert len(set(primes.ravel().tolist())) == 48 and primes.min() > 16000000 - 1


def _brute_is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def test_primes_offsets_layout():
    t = {"engram_layer_ids": [3, 5, 9], "engram_max_ngram_size": 4, "engram_n_heads": 3, "engram_vocab_size": 50}
    primes = EL.engram_primes(t)
    seen = set()
    for layer in primes:
        for sizes in layer:
            # restart at V0 - 1 for every (layer, n-gram size): the smallest unseen primes above it
            want, c = [], 49
            while len(want) < len(sizes):
                c += 1
                if _brute_is_prime(c) and c not in seen:
                    want.append(c)
            assert sizes == want
            seen.update(sizes)
    off = EL.engram_offsets(primes)
    flat = np.asarray(primes).reshape(3, -1)
    np.testing.assert_array_equal(off[:, 0], 0)
    np.testing.assert_array_equal(off[:, 1:], np.cumsum(flat, 1)[:, :-1])
    assert [int(x) for x in flat.sum(1)] == EL.engram_num_embeddings(t)
    assert all(EL.is_prime(p) == _brute_is_prime(p) for p in range(2000))
    assert EL.is_prime(2**61 - 1) and not EL.is_prime(2**61 + 1)


def test_multipliers():
    for lid, vocab, n in ((0, 89, 3), (1, 89, 3), (14, 99092, 4)):
        m = EL.engram_multipliers(lid, vocab, n)
        bound = (np.iinfo(np.int64).max // vocab) // 2
        vals = np.random.default_rng(10007 * lid).integers(0, bound, size=n, dtype=np.int64)
        np.testing.assert_array_equal(m, 2 * vals + 1)
        assert m.dtype == np.int64 and np.all(m % 2 == 1)
        assert all(int(x) * (vocab - 1) <= np.iinfo(np.int64).max for x in m)  # no overflow


def _spec_hashes(ids, dead, tm, primes, offsets, mult, pad):
    """Direct transcription of decoder_spec §8.4 with Python ints (one row, one layer)."""
    n = len(mult)
    c = [-1 if dead[p] else int(tm[ids[p]]) for p in range(len(ids))]
    out = []
    for p in range(len(ids)):
        blocked, v = False, []
        for s in range(n):
            blocked = blocked or p - s < 0 or c[p - s] == -1
            v.append(pad if blocked else c[p - s])
        rolling, row = v[0] * int(mult[0]), []
        for s in range(1, n):
            rolling ^= v[s] * int(mult[s])
            row += [rolling % int(pr) for pr in primes[s - 1]]
        out.append([r + int(o) for r, o in zip(row, offsets)])
    return np.array(out, dtype=np.int64)


def test_hashes_vs_spec_transcription():
    rng = np.random.default_rng(0)
    t = {"engram_layer_ids": [2, 7], "engram_max_ngram_size": 4, "engram_n_heads": 3, "engram_vocab_size": 1000,
         "engram_pad_token_id": 2}
    tm = rng.permutation(np.arange(60) % 41).astype(np.int32)
    tm[:41] = np.arange(41)  # first appearance order, 41 compressed ids
    t["engram_num_embeddings"] = EL.engram_num_embeddings(t)
    t["engram_compressed_vocab_size"] = 41
    lay = EL.EngramLayout.from_config(t, tm)
    ids = rng.integers(0, 60, (3, 23))
    dead = rng.random((3, 23)) < 0.2
    dead[0] = False
    h = lay.hashes(ids, dead)
    for i in range(2):
        for b in range(3):
            want = _spec_hashes(ids[b], dead[b], tm, lay.primes[i], lay.offsets[i], lay.multipliers[i], lay.pad_id)
            np.testing.assert_array_equal(h[b, :, i], want)
        lo = lay.offsets[i]
        assert np.all(h[:, :, i] >= lo) and np.all(h[:, :, i] < lo + lay.primes[i].reshape(-1))
    assert h.max() < max(lay.num_embeddings)


def test_normalization_groups():
    words = ["<s>", "</s>", "<pad>", "Hello", "hello", " hello", "HELLO", "héllo", " ", "\n", " \t\n ", "x y",
             "x \n y", "ﬁ", "fi", "\u0301", "\ufffd", "\ufffd\ufffd", "  padded ", "padded", "Ａ", "a"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in words[:3]])
    tm = EL.build_compressed_token_map(tok)
    g = {w: int(tm[i]) for i, w in enumerate(words)}
    assert [g["<s>"], g["</s>"], g["<pad>"]] == [0, 1, 2]
    assert g["Hello"] == g["hello"] == g[" hello"] == g["HELLO"] == g["héllo"] == 3
    assert g[" "] == g["\n"] == g[" \t\n "] == 4  # whitespace-only tokens collapse to " "
    assert g["x y"] == g["x \n y"] and g["ﬁ"] == g["fi"] and g["Ａ"] == g["a"]
    assert g["  padded "] == g["padded"]
    assert len({g["\u0301"], g["\ufffd"], g["\ufffd\ufffd"]}) == 3  # raw-text / raw-token keys
    assert EL.compressed_vocab_size(tm) == len(set(g.values())) == int(tm.max()) + 1
    # first-appearance numbering
    assert list(np.unique(tm, return_index=True)[1]) == sorted(np.unique(tm, return_index=True)[1])
    # model vocab larger than the tokenizer: the padding ids map to 0
    tm2 = EL.build_compressed_token_map(tok, len(words) + 3)
    np.testing.assert_array_equal(tm2[: len(words)], tm)
    np.testing.assert_array_equal(tm2[len(words):], 0)


def _straightforward_map(tok, vocab_size):
    """Spec §8.2 written out plainly (independent of engram_layout): decode each id alone,
    NFKC -> NFD -> drop combining marks -> lowercase -> collapse [ \\t\\r\\n]+ -> ' ' ->
    a lone ' ' becomes U+E000 -> strip -> U+E000 back to ' '; empty -> raw text; text with
    U+FFFD -> keyed by the token string; numbered by first appearance."""
    import re
    import unicodedata

    keys, out = {}, []
    for i in range(vocab_size):
        raw = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in raw:
            key = ("tok", tok.id_to_token(i))
        else:
            t = unicodedata.normalize("NFKC", raw)
            t = unicodedata.normalize("NFD", t)
            t = "".join(c for c in t if unicodedata.category(c) != "Mn")
            t = t.lower()
            t = re.sub(r"[ \t\r\n]+", " ", t)
            t = "\ue000" if t == " " else t
            t = t.strip().replace("\ue000", " ")
            key = ("txt", t if t else raw)
        out.append(keys.setdefault(key, len(keys)))
    return np.asarray(out, np.int32)


def test_byte_level_bpe_with_invalid_utf8_pieces_matches_straightforward_map():
    """A real byte-level BPE: single ids that are partial UTF-8 sequences decode to U+FFFD."""
    from tokenizers import decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Héllo wörld, HELLO world!", "Ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ ａｂｃ", "café  naïve\tTAB\nnewline",
              "日本語のテキスト 漢字", "ﬁne ﬂow ½ Ⅸ ²", "   spaces   and\r\nCRLF", "emoji 😀😃 ok"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    V = tok.get_vocab_size()
    got = EL.build_compressed_token_map(tok, V)
    want = _straightforward_map(tok, V)
    np.testing.assert_array_equal(got, want)
    # the vocabulary really contains partial UTF-8 pieces and merged case/width variants
    assert any("\ufffd" in tok.decode([i]) for i in range(V))
    assert EL.compressed_vocab_size(got) < V
