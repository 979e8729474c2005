"""Host-side Engram layout: compressed token map, hash primes/offsets/multipliers, n-gram hashes.

Exact restatement of the official ``inference/engram.py`` (REF41; V41E and HF41 agree), decoder
spec §8.2-8.4. Everything is NumPy int64 on the host; the model only consumes the resulting row
ids (``[B, S, n_engram_layers, cols]``), so no int64 is needed inside jit.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

DEAD = -1  # compressed id of a masked position (image span); blocks every n-gram through it
_INT64_MAX = np.iinfo(np.int64).max


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


# ----------------------------------------------------------------------------------------------
# compressed token map (§8.2)
# ----------------------------------------------------------------------------------------------

def _normalizer():
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a single-space token from collapsing to "" under Strip
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


def build_compressed_token_map(tokenizer, vocab_size: int | None = None) -> np.ndarray:
    """Token id -> compressed id (int32 ``[vocab_size]``); ids are handed out by first appearance.

    ``tokenizer``: a ``tokenizers.Tokenizer`` (the raw Rust backend). Each id is decoded on its own
    (``skip_special_tokens=False``) and keyed by its normalized text (NFKC, NFD, StripAccents,
    Lowercase, whitespace runs -> " ", a lone " " survives Strip), the raw text when that is empty,
    and ``id_to_token(id)`` when the text contains U+FFFD. The compressed vocab size is
    ``map.max() + 1``. ``vocab_size`` defaults to the tokenizer's size (added tokens included);
    ids past the tokenizer's size (model vocab padding, never produced) map to 0.
    """
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is None:
        vocab_size = n_tok
    norm = _normalizer()
    key_to_new: dict[str, int] = {}
    out = np.zeros(vocab_size, dtype=np.int32)
    for tid in range(min(n_tok, vocab_size)):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = key_to_new.setdefault(key, len(key_to_new))
    return out


def compressed_vocab_size(token_map: np.ndarray) -> int:
    return int(np.max(token_map)) + 1


# ----------------------------------------------------------------------------------------------
# primes, offsets, multipliers (§8.3)
# ----------------------------------------------------------------------------------------------

def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 0 <= n < 3.3e24 (every engram size fits)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg_text: Any) -> list[list[list[int]]]:
    """Bucket primes ``[n_engram_layers][max_ngram-1][n_heads]``.

    One ``seen`` set spans all layers in order; for every (layer, n-gram size) the search restarts
    at ``engram_vocab_size - 1`` and takes the next unseen primes, one per head.
    """
    layer_ids = list(_get(cfg_text, "engram_layer_ids", ()) or ())
    n = int(_get(cfg_text, "engram_max_ngram_size"))
    heads = int(_get(cfg_text, "engram_n_heads"))
    start = int(_get(cfg_text, "engram_vocab_size")) - 1
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_layer = []
        for _ in range(n - 1):
            cur, sizes = start, []
            for _ in range(heads):
                cur += 1
                while cur in seen or not is_prime(cur):
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per_layer.append(sizes)
        out.append(per_layer)
    return out


def engram_num_embeddings(cfg_text: Any) -> list[int]:
    """Table rows per engram layer = the sum of that layer's primes."""
    return [int(sum(sum(s) for s in layer)) for layer in engram_primes(cfg_text)]


def engram_offsets(primes: Sequence) -> np.ndarray:
    """Per-layer bucket offsets ``[n_layers, cols]``: exclusive cumsum of the flattened primes."""
    flat = np.asarray(primes, dtype=np.int64).reshape(len(primes), -1)
    return np.cumsum(flat, axis=1) - flat


def engram_multipliers(layer_id: int, compressed_vocab: int, max_ngram_size: int) -> np.ndarray:
    """Odd int64 hash multipliers ``[max_ngram_size]`` of model layer ``layer_id``.

    ``2 * default_rng(10007 * layer_id).integers(0, bound, N) + 1`` with
    ``bound = max(1, (INT64_MAX // compressed_vocab) // 2)``, so ``id * mult`` cannot overflow.
    """
    bound = max(1, (_INT64_MAX // int(compressed_vocab)) // 2)
    vals = np.random.default_rng(10007 * int(layer_id)).integers(0, bound, size=(int(max_ngram_size),),
                                                                 dtype=np.int64)
    return vals * 2 + 1


# ----------------------------------------------------------------------------------------------
# per-position hashes (§8.4)
# ----------------------------------------------------------------------------------------------

def compress_ids(ids: np.ndarray, dead: np.ndarray | None, token_map: np.ndarray) -> np.ndarray:
    """int64 compressed ids ``[B, S]``, ``DEAD`` where ``dead`` is True."""
    c = np.asarray(token_map, dtype=np.int64)[np.asarray(ids, dtype=np.int64)]
    if dead is not None:
        c = np.where(np.asarray(dead, dtype=bool), DEAD, c)
    return c


def ngram_hashes_np(ids: np.ndarray, dead: np.ndarray | None, token_map: np.ndarray, *,
                    primes: Sequence, offsets: np.ndarray, multipliers: np.ndarray, pad_id: int,
                    history: np.ndarray | None = None) -> np.ndarray:
    """Hash row ids of one engram layer: int64 ``[B, S, (N-1) * n_heads]``, offsets included.

    ``ids``: token ids ``[B, S]``; ``dead``: bool ``[B, S]``, True = masked (image span; padding);
    ``primes``: ``[N-1][n_heads]``; ``offsets``: ``[cols]``; ``multipliers``: ``[N]``;
    ``pad_id``: the compressed id that fills blocked slots (``token_map[engram_pad_token_id]``).
    ``history``: compressed ids (``DEAD`` allowed) of the ``N-1`` positions before ``ids[:, 0]``,
    ``[B, N-1]``, oldest first; None = sequence start (equivalent to all ``DEAD``).

    Look-back ``s`` is blocked once any of positions ``p, p-1, .., p-s`` is before the start or
    DEAD (cumulative); blocked slots use ``pad_id``. ``rolling_s = rolling_{s-1} ^ (v_s * mult_s)``,
    column ``(s-1)*H + h`` is ``rolling_s % prime[s-1][h] + offset``.
    """
    mult = np.asarray(multipliers, dtype=np.int64)
    n = mult.shape[0]
    p = np.asarray(primes, dtype=np.int64).reshape(n - 1, -1)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    c = compress_ids(ids, dead, token_map)
    b, s = c.shape
    if history is None:
        history = np.full((b, n - 1), DEAD, dtype=np.int64)
    full = np.concatenate([np.asarray(history, dtype=np.int64).reshape(b, n - 1), c], axis=1)
    blocked = np.zeros((b, s), dtype=bool)
    rolling = None
    cols = []
    for shift in range(n):
        src = full[:, n - 1 - shift: n - 1 - shift + s]
        blocked |= src == DEAD
        v = np.where(blocked, np.int64(pad_id), src)
        prod = v * mult[shift]
        if rolling is None:
            rolling = prod
        else:
            rolling = rolling ^ prod
            cols.append(rolling[..., None] % p[shift - 1])
    return np.concatenate(cols, axis=-1) + off


@dataclasses.dataclass(frozen=True)
class EngramLayout:
    """Everything the hashes need, for all engram layers (layer order of ``engram_layer_ids``)."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: np.ndarray  # int64 [n_layers, N-1, n_heads]
    offsets: np.ndarray  # int64 [n_layers, cols]
    multipliers: np.ndarray  # int64 [n_layers, N]
    num_embeddings: tuple[int, ...]
    token_map: np.ndarray  # int32 [vocab]
    compressed_vocab: int
    pad_id: int  # compressed id of engram_pad_token_id

    @property
    def cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @classmethod
    def from_config(cls, cfg_text: Any, token_map: np.ndarray, *, check: bool = True) -> "EngramLayout":
        """``cfg_text``: the text config (dict or attributes). ``check``: assert that the config's
        ``engram_num_embeddings`` / ``engram_compressed_vocab_size`` match the derived values."""
        layer_ids = tuple(int(x) for x in (_get(cfg_text, "engram_layer_ids", ()) or ()))
        n = int(_get(cfg_text, "engram_max_ngram_size"))
        heads = int(_get(cfg_text, "engram_n_heads"))
        primes = engram_primes(cfg_text)
        rows = tuple(int(sum(sum(s) for s in layer)) for layer in primes)
        vocab_c = compressed_vocab_size(token_map)
        if check:
            want_rows = tuple(int(x) for x in (_get(cfg_text, "engram_num_embeddings", ()) or ()))
            want_c = int(_get(cfg_text, "engram_compressed_vocab_size", vocab_c))
            if want_rows != rows or want_c != vocab_c:
                raise ValueError(f"engram config mismatch: num_embeddings {want_rows} vs derived {rows}, "
                                 f"compressed vocab {want_c} vs derived {vocab_c}")
        pad_tok = int(_get(cfg_text, "engram_pad_token_id", _get(cfg_text, "engram_pad_id", 2)))
        return cls(
            layer_ids=layer_ids, max_ngram_size=n, n_heads=heads,
            primes=np.asarray(primes, dtype=np.int64).reshape(len(layer_ids), n - 1, heads),
            offsets=engram_offsets(primes) if layer_ids else np.zeros((0, (n - 1) * heads), np.int64),
            multipliers=np.stack([engram_multipliers(l, vocab_c, n) for l in layer_ids]) if layer_ids
            else np.zeros((0, n), np.int64),
            num_embeddings=rows, token_map=np.asarray(token_map, dtype=np.int32),
            compressed_vocab=vocab_c, pad_id=int(token_map[pad_tok]),
        )

    def hashes(self, ids: np.ndarray, dead: np.ndarray | None = None,
               history: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[B, S, n_layers, cols]`` (see ``ngram_hashes_np``)."""
        per = [ngram_hashes_np(ids, dead, self.token_map, primes=self.primes[i], offsets=self.offsets[i],
                               multipliers=self.multipliers[i], pad_id=self.pad_id, history=history)
               for i in range(len(self.layer_ids))]
        ids = np.asarray(ids)
        if not per:
            return np.zeros(ids.shape + (0, self.cols), np.int64)
        return np.stack(per, axis=2)
