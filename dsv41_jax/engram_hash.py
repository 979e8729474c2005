"""Device-side Engram n-gram hashes, exact without int64 (decoder spec §8.4, §8.6).

``EngramLayout.hashes`` (``engram_layout.py``) is the int64 NumPy reference. This module computes the
same row ids inside ``jax.jit`` / ``lax.scan`` / ``lax.while_loop`` with 32-bit integers only, so it
runs without ``jax_enable_x64``:

* a 64-bit value is a pair of uint32 words ``(hi, lo)``;
* ``v * mult`` (``v`` a compressed id, ``mult`` an odd int64 multiplier) is a schoolbook product of
  16-bit limbs held in uint32 (every partial product is below 2^32), reduced modulo 2^64. The
  multipliers are chosen so that the exact product is below 2^63, so this equals NumPy's int64;
* XOR is done per word;
* ``x mod p`` is Horner's rule over ``w``-bit chunks of ``x``, most significant first:
  ``r = (r * 2^w + chunk) mod p``, with ``w`` the largest width such that ``max(p) * 2^w <= 2^32``
  (8 for the released primes, which are just above 16e6), so every intermediate fits in uint32.
  Any prime below 2^31 works;
* the per-column offsets are added in int32 (every table has fewer than 2^31 rows; checked).

History (§8.6): ``hist [B, N-1]`` holds the compressed ids of the ``N-1`` positions before the chunk,
oldest first, ``DEAD`` (-1) for "before the sequence start" and for masked (image-span) positions.
``EngramHasher`` maps raw token ids and keeps that history across chunks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import engram_layout as EL

DEAD = EL.DEAD
U32 = jnp.uint32
I32 = jnp.int32
_M16 = 0xFFFF


# ----------------------------------------------------------------------------------------------
# constants
# ----------------------------------------------------------------------------------------------

def mult_limbs(multipliers: np.ndarray) -> np.ndarray:
    """int64 ``[..., N]`` multipliers -> uint32 ``[..., N, 4]`` 16-bit limbs, least significant first."""
    m = np.asarray(multipliers, dtype=np.int64)
    if np.any(m < 0):
        raise ValueError("engram multipliers must be non-negative")
    u = m.astype(np.uint64)
    return np.stack([((u >> np.uint64(16 * k)) & np.uint64(_M16)).astype(np.uint32) for k in range(4)], axis=-1)


def horner_chunk_bits(max_prime: int) -> int:
    """Largest chunk width ``w`` (<= 31) with ``max_prime * 2^w <= 2^32``: Horner steps stay in uint32."""
    max_prime = int(max_prime)
    if not 2 <= max_prime < 2 ** 31:
        raise ValueError(f"engram primes must lie in [2, 2^31), got a maximum of {max_prime}")
    w = 1
    while w < 31 and max_prime << (w + 1) <= 2 ** 32:
        w += 1
    return w


@dataclasses.dataclass(frozen=True)
class EngramHashConsts:
    """Hash constants of all engram layers (layer order of ``engram_layer_ids``); a pytree whose only
    static field is ``chunk_bits``.

    ``mult_limbs`` uint32 ``[nL, N, 4]``; ``primes`` uint32 ``[nL, N-1, H]``; ``offsets`` int32
    ``[nL, (N-1)*H]``; ``pad_id`` int32 ``[]`` (compressed id of ``engram_pad_token_id``).
    """

    mult_limbs: Any
    primes: Any
    offsets: Any
    pad_id: Any
    chunk_bits: int

    @property
    def max_ngram_size(self) -> int:
        return int(self.mult_limbs.shape[-2])

    @property
    def n_heads(self) -> int:
        return int(self.primes.shape[-1])

    @property
    def n_layers(self) -> int:
        return int(self.primes.shape[0])

    @property
    def cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @staticmethod
    def build(primes, offsets, multipliers, pad_id) -> "EngramHashConsts":
        """From the host layout values (``primes [nL, N-1, H]``, ``offsets [nL, cols]``,
        ``multipliers [nL, N]`` int64, ``pad_id`` int)."""
        primes = np.asarray(primes, dtype=np.int64)
        multipliers = np.asarray(multipliers, dtype=np.int64)
        n_layers, n = multipliers.shape
        primes = primes.reshape(n_layers, n - 1, -1)
        offsets = np.asarray(offsets, dtype=np.int64).reshape(n_layers, -1)
        rows = (offsets + primes.reshape(n_layers, -1)).max(initial=0)
        if rows >= 2 ** 31:
            raise ValueError(f"engram table with {rows} rows: row ids do not fit int32")
        chunk = horner_chunk_bits(primes.max()) if primes.size else 16
        return EngramHashConsts(
            mult_limbs=jnp.asarray(mult_limbs(multipliers)),
            primes=jnp.asarray(primes.astype(np.uint32)),
            offsets=jnp.asarray(offsets.astype(np.int32)),
            pad_id=jnp.asarray(int(pad_id), dtype=I32),
            chunk_bits=chunk,
        )

    @staticmethod
    def from_layout(layout: EL.EngramLayout) -> "EngramHashConsts":
        return EngramHashConsts.build(layout.primes, layout.offsets, layout.multipliers, layout.pad_id)


jax.tree_util.register_dataclass(EngramHashConsts, data_fields=["mult_limbs", "primes", "offsets", "pad_id"],
                                 meta_fields=["chunk_bits"])


def host_layout_values(cfg_text: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(primes [nL, N-1, H], offsets [nL, cols], multipliers [nL, N])`` int64 from a text config
    (dict or ``TextConfig``); the multipliers use ``engram_compressed_vocab_size``."""
    layer_ids = [int(x) for x in (EL._get(cfg_text, "engram_layer_ids", ()) or ())]
    n = int(EL._get(cfg_text, "engram_max_ngram_size"))
    heads = int(EL._get(cfg_text, "engram_n_heads"))
    vocab_c = int(EL._get(cfg_text, "engram_compressed_vocab_size"))
    primes = EL.engram_primes(cfg_text)
    p = np.asarray(primes, dtype=np.int64).reshape(len(layer_ids), n - 1, heads)
    off = EL.engram_offsets(primes) if layer_ids else np.zeros((0, (n - 1) * heads), np.int64)
    mult = (np.stack([EL.engram_multipliers(l, vocab_c, n) for l in layer_ids]) if layer_ids
            else np.zeros((0, n), np.int64))
    return p, off, mult


# ----------------------------------------------------------------------------------------------
# 64-bit arithmetic on uint32 words
# ----------------------------------------------------------------------------------------------

def _mul_u64(v, limbs):
    """``v * m mod 2^64`` as ``(hi, lo)`` uint32. ``v`` uint32 ``[...]``; ``limbs`` uint32 ``[..., 4]``
    (16-bit limbs of ``m``, broadcast against ``v``)."""
    vl = (v & _M16, v >> 16)
    ml = [limbs[..., j] for j in range(4)]
    col = [None] * 4

    def add(k, x):
        col[k] = x if col[k] is None else col[k] + x

    for i in range(2):
        for j in range(4):
            k = i + j
            if k >= 4:
                continue
            prod = vl[i] * ml[j]  # < 2^32
            add(k, prod & _M16)
            if k + 1 < 4:
                add(k + 1, prod >> 16)
    # each column is a sum of at most 5 values below 2^16 plus a carry: no overflow
    r = []
    carry = None
    for k in range(4):
        c = col[k] if carry is None else col[k] + carry
        r.append(c & _M16)
        carry = c >> 16
    lo = r[0] | (r[1] << 16)
    hi = r[2] | (r[3] << 16)
    return hi, lo


def _bits(hi, lo, start: int, width: int):
    """Bits ``[start, start+width)`` of the 64-bit value ``(hi, lo)`` (static ``start``/``width``)."""
    mask = np.uint32((1 << width) - 1)
    if start >= 32:
        x = hi >> (start - 32) if start > 32 else hi
    elif start + width <= 32:
        x = lo >> start if start else lo
    else:  # straddles the word boundary; 0 < start < 32
        x = (lo >> start) | (hi << (32 - start))
    return x & mask if width < 32 else x


def _mod_u64(hi, lo, p, w: int):
    """``(hi, lo) mod p``, uint32, by Horner over ``w``-bit chunks; needs ``p * 2^w <= 2^32``."""
    n_chunks = -(-64 // w)
    r = None
    for i in range(n_chunks - 1, -1, -1):
        start = i * w
        chunk = _bits(hi, lo, start, min(w, 64 - start))
        r = chunk % p if r is None else ((r << w) + chunk) % p
    return r


# ----------------------------------------------------------------------------------------------
# hashes
# ----------------------------------------------------------------------------------------------

def hashes_from_lookback(srcs, consts: EngramHashConsts):
    """Row ids from the look-back ids. ``srcs``: sequence of ``N`` int32 arrays ``[B, S]``, ``srcs[s]``
    = compressed id at look-back distance ``s`` (``DEAD``, i.e. any negative value, where the position
    is masked or before the start). Returns int32 ``[B, S, nL, (N-1)*H]``."""
    n = consts.max_ngram_size
    if len(srcs) != n:
        raise ValueError(f"expected {n} look-back arrays, got {len(srcs)}")
    pad = jnp.asarray(consts.pad_id, I32)
    blocked = None
    hi = lo = None
    rolled = []
    for s in range(n):
        src = jnp.asarray(srcs[s], I32)
        dead = src < 0
        blocked = dead if blocked is None else blocked | dead
        v = jnp.where(blocked, pad, src).astype(U32)[..., None]  # [B,S,1]
        ph, pl = _mul_u64(v, consts.mult_limbs[:, s, :])  # [B,S,nL]
        if s == 0:
            hi, lo = ph, pl
        else:
            hi, lo = hi ^ ph, lo ^ pl
            rolled.append((hi, lo))
    rh = jnp.stack([h for h, _ in rolled], axis=-1)[..., None]  # [B,S,nL,N-1,1]
    rl = jnp.stack([l for _, l in rolled], axis=-1)[..., None]
    r = _mod_u64(rh, rl, consts.primes, consts.chunk_bits)  # [B,S,nL,N-1,H]
    r = r.reshape(*r.shape[:-2], -1).astype(I32)
    return r + consts.offsets


def ngram_hashes_jax(comp_ids, hist, consts: EngramHashConsts):
    """Exact device version of ``EngramLayout.hashes`` on compressed ids.

    ``comp_ids`` int32 ``[B, S]`` (``DEAD`` = -1 where masked); ``hist`` int32 ``[B, N-1]`` (the
    compressed ids of the ``N-1`` previous positions, oldest first; ``DEAD`` before the sequence start
    or masked). Returns int32 ``[B, S, n_layers, (N-1)*H]``, equal to the int64 reference.
    """
    comp_ids = jnp.asarray(comp_ids, I32)
    n1 = consts.max_ngram_size - 1
    S = comp_ids.shape[1]
    full = jnp.concatenate([jnp.asarray(hist, I32).reshape(comp_ids.shape[0], n1), comp_ids], axis=1)
    srcs = [full[:, n1 - s: n1 - s + S] for s in range(n1 + 1)]
    return hashes_from_lookback(srcs, consts)


def engram_hash_step(ids, dead, valid, hist, token_map, consts: EngramHashConsts):
    """Hashes of one chunk from raw token ids, and the history after it (pure function).

    ``ids`` int32 ``[B, S]`` raw token ids; ``dead`` bool ``[B, S]`` or None (masked positions: image
    spans); ``valid`` bool ``[B, S]`` or None (False = padding / not a position of the sequence);
    ``hist`` int32 ``[B, N-1]``; ``token_map`` int32 ``[vocab]``.

    Invalid positions are removed from the sequence: a valid position looks back over the previous
    *valid* positions (in ``hist`` and in the chunk), and invalid positions are not appended to the
    history. An invalid position's own hashes are those of a ``DEAD`` position (all slots ``pad_id``);
    they are in range but meaningless, and the engram gate is zero there anyway. So the hashes of a
    sequence do not depend on how it is padded or split into chunks (prefill, chunked prefill, decode).
    ``dead`` positions are positions of the sequence: they are appended to the history as ``DEAD``.

    Returns ``(hashes int32 [B, S, nL, (N-1)*H], new_hist int32 [B, N-1])``.
    """
    ids = jnp.asarray(ids, I32)
    B, S = ids.shape
    n1 = consts.max_ngram_size - 1
    hist = jnp.asarray(hist, I32).reshape(B, n1)
    comp = jnp.take(jnp.asarray(token_map, I32), ids, axis=0, mode="clip")
    if dead is not None:
        comp = jnp.where(jnp.asarray(dead, bool), I32(DEAD), comp)
    if valid is None:
        full = jnp.concatenate([hist, comp], axis=1)
        return ngram_hashes_jax(comp, hist, consts), full[:, S:]
    valid = jnp.asarray(valid, bool)
    T = n1 + S
    full = jnp.concatenate([hist, comp], axis=1)  # [B, T]
    vfull = jnp.concatenate([jnp.ones((B, n1), bool), valid], axis=1)
    cnt = jnp.cumsum(vfull.astype(I32), axis=1)  # valid elements up to and including t
    dest = jnp.where(vfull, cnt - 1, T)  # compacted slot; T = dropped
    compact = jax.vmap(lambda d, x: jnp.full((T,), DEAD, I32).at[d].set(x, mode="drop"))(dest, full)
    at = cnt[:, n1:] - 1  # compacted index of each chunk position (valid ones: >= n1)
    srcs = [jnp.where(valid, comp, I32(DEAD))]
    for s in range(1, n1 + 1):
        srcs.append(jnp.take_along_axis(compact, jnp.maximum(at - s, 0), axis=1))
    total = cnt[:, -1:]  # >= n1
    new_hist = jnp.take_along_axis(compact, total - n1 + jnp.arange(n1, dtype=I32)[None], axis=1)
    return hashes_from_lookback(srcs, consts), new_hist


def initial_history(batch: int, max_ngram_size: int):
    """History at the sequence start: ``[batch, N-1]`` all ``DEAD``."""
    return jnp.full((batch, max_ngram_size - 1), DEAD, I32)


# ----------------------------------------------------------------------------------------------
# module
# ----------------------------------------------------------------------------------------------

class EngramConst(nnx.Variable):
    """Engram hash constant derived from the config / tokenizer (not a checkpoint weight: the weight
    loader, which fills ``nnx.Param`` only, leaves it alone)."""


class EngramHasher(nnx.Module):
    """Token ids -> engram table row ids for every engram layer, with the per-sequence history.

    Constants (``EngramConst`` variables): ``token_map`` int32 ``[vocab_size]`` (zeros until
    ``set_token_map``), ``pad_id`` int32 ``[]`` (``token_map[engram_pad_token_id]``), ``mult_limbs``
    uint32 ``[nL, N, 4]``, ``primes`` uint32 ``[nL, N-1, H]``, ``offsets`` int32 ``[nL, cols]``.
    Static: ``chunk_bits``, ``max_ngram_size``, ``n_layers``, ``cols``, ``compressed_vocab_size``.
    """

    def __init__(self, cfg: Any, token_map: np.ndarray | None = None):
        """``cfg``: ``TextConfig`` (or a dict with the same keys)."""
        self.layer_ids = tuple(int(x) for x in (EL._get(cfg, "engram_layer_ids", ()) or ()))
        self.max_ngram_size = int(EL._get(cfg, "engram_max_ngram_size"))
        self.n_heads = int(EL._get(cfg, "engram_n_heads"))
        if self.max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {self.max_ngram_size}")
        self.n_layers = len(self.layer_ids)
        self.cols = (self.max_ngram_size - 1) * self.n_heads
        self.vocab_size = int(EL._get(cfg, "vocab_size"))
        self.compressed_vocab_size = int(EL._get(cfg, "engram_compressed_vocab_size"))
        self.pad_token_id = int(EL._get(cfg, "engram_pad_token_id", 2))
        primes, offsets, mult = host_layout_values(cfg)
        rows = tuple(int(x) for x in (EL._get(cfg, "engram_num_embeddings", ()) or ()))
        derived = tuple(int(x) for x in primes.reshape(self.n_layers, -1).sum(1))
        if rows and rows != derived:
            raise ValueError(f"engram config mismatch: engram_num_embeddings {rows} vs derived {derived}")
        c = EngramHashConsts.build(primes, offsets, mult, 0)
        self.chunk_bits = c.chunk_bits
        self.mult_limbs = EngramConst(c.mult_limbs)
        self.primes = EngramConst(c.primes)
        self.offsets = EngramConst(c.offsets)
        self.pad_id = EngramConst(jnp.zeros((), I32))
        self.token_map = EngramConst(jnp.zeros((self.vocab_size,), I32))
        self.token_map_loaded = False
        if token_map is not None:
            self.set_token_map(token_map)

    def set_token_map(self, token_map: np.ndarray) -> None:
        """Install the compressed token map (int ``[vocab_size]``, or shorter: the rest maps to 0)."""
        tm = np.asarray(token_map)
        if tm.ndim != 1 or not np.issubdtype(tm.dtype, np.integer):
            raise ValueError(f"engram token map must be a 1-D integer array, got {tm.dtype} {tm.shape}")
        if tm.shape[0] > self.vocab_size:
            raise ValueError(f"engram token map has {tm.shape[0]} entries, more than vocab_size {self.vocab_size}")
        if tm.size == 0 or tm.min() < 0:
            raise ValueError("engram token map must be non-empty with non-negative ids")
        got = int(tm.max()) + 1
        if got != self.compressed_vocab_size:
            raise ValueError(f"engram token map has a compressed vocab of {got}, but the config's "
                             f"engram_compressed_vocab_size is {self.compressed_vocab_size}")
        full = np.zeros(self.vocab_size, np.int32)
        full[: tm.shape[0]] = tm
        self.token_map[...] = jnp.asarray(full)
        self.pad_id[...] = jnp.asarray(int(full[self.pad_token_id]), I32)
        self.token_map_loaded = True

    @property
    def consts(self) -> EngramHashConsts:
        return EngramHashConsts(mult_limbs=self.mult_limbs[...], primes=self.primes[...],
                                offsets=self.offsets[...], pad_id=self.pad_id[...], chunk_bits=self.chunk_bits)

    def initial_history(self, batch: int):
        return initial_history(batch, self.max_ngram_size)

    def compress(self, ids, dead=None):
        """Raw ids ``[B, S]`` -> compressed ids (``DEAD`` where ``dead``)."""
        comp = jnp.take(self.token_map[...], jnp.asarray(ids, I32), axis=0, mode="clip")
        return comp if dead is None else jnp.where(jnp.asarray(dead, bool), I32(DEAD), comp)

    def __call__(self, ids, dead=None, hist=None, valid=None):
        """``ids`` int32 ``[B, S]`` raw token ids; ``dead`` bool ``[B, S]`` (image-span positions) or None;
        ``hist`` int32 ``[B, N-1]`` or None (= sequence start); ``valid`` bool ``[B, S]`` or None (all
        valid). See ``engram_hash_step`` for the padding rule. Returns ``(hashes int32 [B, S, nL, cols],
        new_hist int32 [B, N-1])``."""
        ids = jnp.asarray(ids, I32)
        if hist is None:
            hist = self.initial_history(ids.shape[0])
        return engram_hash_step(ids, dead, valid, hist, self.token_map[...], self.consts)


# ----------------------------------------------------------------------------------------------
# token map cache
# ----------------------------------------------------------------------------------------------

TOKEN_MAP_FILE = "engram_token_map.npy"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_size(tm: np.ndarray, compressed_vocab_size: int | None, where: str) -> None:
    if compressed_vocab_size is None:
        return
    got = int(tm.max()) + 1 if tm.size else 0
    if got != int(compressed_vocab_size):
        raise ValueError(f"engram token map ({where}) has a compressed vocab of {got}, but "
                         f"engram_compressed_vocab_size is {int(compressed_vocab_size)}: "
                         "the tokenizer does not belong to this checkpoint")


def load_or_build_token_map(tokenizer_path: str | os.PathLike, vocab_size: int,
                            cache_path: str | os.PathLike | None,
                            compressed_vocab_size: int | None = None) -> np.ndarray:
    """The compressed token map (int32 ``[vocab_size]``), built once and cached.

    ``cache_path``: the ``.npy`` file (by convention ``<converted checkpoint>/engram_token_map.npy``;
    None = no cache). A sidecar ``<cache_path>.json`` records the tokenizer's sha256 and ``vocab_size``;
    the cache is rebuilt when they differ. A cache that cannot be written (read-only checkpoint
    directory) only warns. ``compressed_vocab_size``: the config's ``engram_compressed_vocab_size``;
    a ValueError naming both numbers is raised when the map's size differs.
    """
    tokenizer_path = os.fspath(tokenizer_path)
    vocab_size = int(vocab_size)
    digest = _sha256(tokenizer_path)
    meta = {"tokenizer_sha256": digest, "vocab_size": vocab_size}
    if cache_path is not None:
        cache_path = os.fspath(cache_path)
        side = cache_path + ".json"
        tm = None
        try:
            with open(side) as f:
                old = json.load(f)
            if old == meta:
                tm = np.load(cache_path)
        except (OSError, ValueError):  # missing / unreadable cache (JSONDecodeError is a ValueError)
            tm = None
        if tm is not None and tm.dtype == np.int32 and tm.shape == (vocab_size,):
            _check_size(tm, compressed_vocab_size, f"cached in {cache_path}")
            return tm
    from tokenizers import Tokenizer

    tm = EL.build_compressed_token_map(Tokenizer.from_file(tokenizer_path), vocab_size)
    _check_size(tm, compressed_vocab_size, f"built from {tokenizer_path}")
    if cache_path is not None:
        tmp = f"{cache_path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                np.save(f, tm)
            os.replace(tmp, cache_path)
            with open(tmp, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, cache_path + ".json")
        except OSError as e:
            warnings.warn(f"could not cache the engram token map at {cache_path}: {e}")
            try:
                os.remove(tmp)
            except OSError:
                pass
    return tm
