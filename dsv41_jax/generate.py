"""Prefill, decode step and on-device generation.

The model is split once (``nnx.split``); the jitted functions are pure functions of
(params state, cache, inputs). Caches are donated. Per-request values (lengths, temperatures,
top-k/top-p/min-p, stop ids, max new tokens) are arrays, so they never trigger a recompile;
shapes are bucketed (``buckets.py``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

F32 = jnp.float32


def _forward(graphdef, state, cache, ids, valid, inputs_embeds, image_mask, engram_hashes):
    model = nnx.merge(graphdef, state)
    B, S = ids.shape
    pos = cache["length"][:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    logits, cache = model(ids, inputs_embeds=inputs_embeds, positions=pos, valid=valid, cache=cache,
                          image_mask=image_mask, engram_hashes=engram_hashes)
    cache = dict(cache, length=cache["length"] + jnp.sum(valid, axis=1).astype(jnp.int32))
    return logits, cache


@functools.lru_cache(maxsize=None)
def _jitted(graphdef):
    return jax.jit(functools.partial(_forward, graphdef), donate_argnums=(1,))


def _split(model):
    graphdef, state = nnx.split(model)
    return graphdef, state


def forward_chunk(model, ids, cache, *, valid=None, inputs_embeds=None, image_mask=None, engram_hashes=None,
                  jit: bool = True):
    """Run a chunk of tokens (prefill chunk or one decode token) against ``cache``."""
    graphdef, state = _split(model)
    ids = jnp.asarray(ids, jnp.int32)
    if valid is None:
        valid = jnp.ones(ids.shape, bool)
    fn = _jitted(graphdef) if jit else functools.partial(_forward, graphdef)
    return fn(state, cache, ids, valid, inputs_embeds, image_mask, engram_hashes)


def prefill_fn(model, ids, cache, *, inputs_embeds=None, image_mask=None, engram_hashes=None, valid=None):
    return forward_chunk(model, ids, cache, valid=valid, inputs_embeds=inputs_embeds, image_mask=image_mask,
                         engram_hashes=engram_hashes)


def decode_step_fn(model, tok, cache, *, engram_hashes=None, valid=None):
    return forward_chunk(model, tok, cache, valid=valid, engram_hashes=engram_hashes)
