"""Shape buckets: every shape the jitted prefill / decode functions see is decided here.

* batch: the next power of two >= max(n, ``min_batch``), at most ``max_batch``;
* prompt length: the next power of two >= max(n, ``min_len``), at most ``max_len`` (whole
  prefill compiles ``[batch, bucket]``; chunked prefill compiles ``[batch, chunk]`` whatever the
  prompt length, the prompts being padded on the host to a multiple of the chunk);
* new-token buffer: the next power of two >= max(max_new_tokens, ``min_new``); the per-row
  ``max_new_tokens`` themselves are values inside that buffer;
* cache capacity (when the caller gives no ``max_len``): the next power of two >= prompt
  bucket + new-token bucket.

Requests whose shapes fall in the same buckets reuse the same compiled executables; every
per-request value (lengths, sampling parameters, stop ids, max new tokens, seed) is an array.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Buckets:
    min_len: int = 16
    max_len: int | None = None  # longest prompt bucket (None: no limit but the cache)
    min_batch: int = 1
    max_batch: int = 64
    min_new: int = 16
    prefill_chunk: int | None = None  # default chunk for chunked prefill (None: whole prompt)

    def batch(self, n: int) -> int:
        if n < 1:
            raise ValueError("generate: empty batch (no prompts)")
        if n > self.max_batch:
            raise ValueError(f"generate: batch of {n} prompts is larger than the largest batch bucket "
                             f"({self.max_batch}); split the request or raise Buckets.max_batch")
        b = next_pow2(max(n, self.min_batch))
        return min(b, self.max_batch)

    def prompt_len(self, n: int, chunk: int | None = None) -> int:
        L = next_pow2(max(n, self.min_len))
        if chunk:
            L = round_up(L, chunk)
        if self.max_len is not None and L > self.max_len:
            if n > self.max_len:
                raise ValueError(f"generate: prompt of {n} tokens is longer than the longest prompt bucket "
                                 f"({self.max_len})")
            L = round_up(self.max_len, chunk) if chunk else self.max_len
        return L

    def new_tokens(self, n: int) -> int:
        return next_pow2(max(n, self.min_new, 1))

    def cache_len(self, prompt_bucket: int, new_bucket: int) -> int:
        return next_pow2(prompt_bucket + new_bucket)


DEFAULT_BUCKETS = Buckets()


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """Right-padded prompts: ``ids``/``valid`` [B, L] (B, L bucketed); ``lengths`` [B]; the first
    ``n`` rows are the real prompts, the others are one pad token each (kept numerically sane,
    their outputs are dropped)."""

    ids: np.ndarray
    valid: np.ndarray
    lengths: np.ndarray
    n: int


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int | None = None) -> list[list[int]]:
    """The prompts as lists, or one ValueError for an empty batch, an empty prompt, or ids outside
    ``[0, vocab)``."""
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("generate: empty batch (no prompts)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (every prompt needs at least one token)")
        if vocab is not None and (min(p) < 0 or max(p) >= vocab):
            raise ValueError(f"generate: prompt {i} has token ids outside the vocabulary [0, {vocab})")
    return prompts


def pad_prompts(prompts: Sequence[Sequence[int]], *, length: int | None = None, batch: int | None = None,
                pad_id: int = 0, buckets: Buckets = DEFAULT_BUCKETS, chunk: int | None = None) -> PaddedBatch:
    """Right-pad ``prompts`` to ``[batch, length]`` (default: their buckets) with a valid mask."""
    prompts = check_prompts(prompts)
    n = len(prompts)
    longest = max(len(p) for p in prompts)
    B = buckets.batch(n) if batch is None else batch
    L = buckets.prompt_len(longest, chunk) if length is None else length
    if B < n:
        raise ValueError(f"generate: batch of {n} prompts does not fit the batch bucket {B}")
    if L < longest:
        raise ValueError(f"generate: prompt of {longest} tokens does not fit the length bucket {L}")
    ids = np.full((B, L), pad_id, np.int32)
    valid = np.zeros((B, L), bool)
    lengths = np.ones((B,), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
        valid[i, :len(p)] = True
        lengths[i] = len(p)
    valid[n:, 0] = True
    return PaddedBatch(ids=ids, valid=valid, lengths=lengths, n=n)


def precompile(model, batch_buckets: Sequence[int], len_buckets: Sequence[int], max_len: int | None = None, *,
               new_buckets: Sequence[int] | None = None, prefill_chunk: int | None = None,
               with_embeds: bool = False, sort: Sequence[bool] = (False, True),
               buckets: Buckets = DEFAULT_BUCKETS) -> dict:
    """Lower and compile the prefill and the decode loop ahead of time for every combination of
    ``batch_buckets`` x ``len_buckets`` x ``new_buckets`` (default ``(buckets.min_new,)``).

    ``max_len``: the cache capacity ``generate`` will be called with (None: the bucket default
    ``buckets.cache_len(len, new)``). ``prefill_chunk``: compile the chunk shape instead of the
    whole prompt. ``with_embeds``: also the variant with ``inputs_embeds`` + ``image_mask``
    (image prompts). ``sort``: with the sampling sort decided on the host
    (``DSV41_SAMPLING_BRANCHES=host``, ``generate.loop_options``) the decode loops to compile,
    for requests without top-k / top-p (False: greedy, plain temperature, min-p) and with them
    (True); by default one loop serves both. The executables land in the cache
    ``generate``/``generate_stream`` use.
    Returns ``{"compiles": new compilations, "compile_s": seconds, "shapes": [...]}``.
    """
    from dsv41_jax import generate as gen

    chunk = prefill_chunk or buckets.prefill_chunk
    new_buckets = tuple(new_buckets) if new_buckets else (buckets.min_new,)
    before = gen.compile_stats()
    shapes = []
    for B in batch_buckets:
        for L in len_buckets:
            for N in new_buckets:
                cap = max_len if max_len is not None else buckets.cache_len(L, N)
                C = chunk or L
                variants = (False, True) if with_embeds else (False,)
                for emb in variants:
                    gen.compile_prefill(model, B, C, cap, with_embeds=emb)
                for srt in sort:
                    gen.compile_decode(model, B, N, cap, sort=srt)
                shapes.append({"batch": B, "prompt_len": L, "chunk": C, "new_tokens": N, "max_len": cap})
    after = gen.compile_stats()
    return {"compiles": after["compiles"] - before["compiles"],
            "compile_s": after["compile_s"] - before["compile_s"], "shapes": shapes}
