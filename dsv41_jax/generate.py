"""Prefill, decode step and on-device generation.

The model is split once (``nnx.split``); the jitted functions are pure functions of
(params state, cache, inputs). Caches are donated. Per-request values (lengths, temperatures,
top-k/top-p/min-p, stop ids, max new tokens, seed) are arrays, so they never trigger a
recompile; shapes are bucketed (``buckets.py``).

``generate`` = pad/bucket the prompts -> prefill (whole prompt, or fixed-size chunks at absolute
positions) -> ONE ``jax.lax.while_loop`` on device over a :class:`DecodeState`. Each loop step
samples one token per sequence from the pending logits (row ``b`` starts from the logits at its
last valid prompt position), records it, updates the done flags (stop id sampled, or the row's
``max_new_tokens`` reached), then runs the model on that token at the row's own position
(``cache['length'][b]``; finished rows feed an invalid token, so their cache does not move).
The loop exits when every row is done or the token buffer is full. ``generate_stream`` runs the
same loop with a step limit per call (one exit check's steps, one step by default), so it yields
exactly the tokens ``generate`` returns for the same inputs and seed.

On a GPU every data-dependent branch inside the loop is a device -> host round trip that idles
the GPU. :func:`loop_options` holds the two choices about them, fixed per executable: whether
the vocabulary sort of top-k / top-p is decided per step on the device (the default: one loop
executable for every request) or per request on the host (``DSV41_SAMPLING_BRANCHES=host``: no
round trip, two loop executables per shape, greedy / plain temperature and filtered), and how
many decode steps run between two checks of the exit condition (``DSV41_LOOP_STEPS``; the extra
steps of a finished loop are no-ops, the tokens are the same).

Compiled executables are kept per (function, options, model graph, argument shapes/dtypes) in a
process-wide table (``compile_stats``, ``clear_compiled``); ``buckets.precompile`` fills it ahead
of time.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import sharding as shd
from dsv41_jax.buckets import DEFAULT_BUCKETS, Buckets, check_prompts, pad_prompts, round_up
from dsv41_jax.sampling import SamplingParams, sample
from dsv41_jax.weights import ValueReader

F32 = jnp.float32
FINISH_REASONS = {1: "stop", 2: "length"}


# ---------------------------------------------------------------------------------------------
# one forward over a chunk (prefill chunk or one decode token)

@dataclasses.dataclass(frozen=True)
class FlatGraph:
    """A model's graph with the pytree structure of its state: the jitted generation functions
    take the state as the flat list of its arrays (a list flattens in C++; an ``nnx.State`` of a
    full model costs milliseconds of Python per call) and rebuild it inside the trace. The hash
    is computed once (hashing a GraphDef walks it: ~18 ms for the 40-layer model on a 2-core
    machine, paid on every executable lookup otherwise)."""

    graphdef: Any
    treedef: Any

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.graphdef, self.treedef))
            object.__setattr__(self, "_hash", h)
        return h


def _merge(graphdef, state):
    if isinstance(graphdef, FlatGraph):
        return nnx.merge(graphdef.graphdef, jax.tree_util.tree_unflatten(graphdef.treedef, state))
    return nnx.merge(graphdef, state)


def _forward(graphdef, state, cache, ids, valid, inputs_embeds, image_mask, engram_hashes, logits_at=None):
    model = _merge(graphdef, state)
    B, S = ids.shape
    pos = cache["length"][:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    logits, cache = model(ids, inputs_embeds=inputs_embeds, positions=pos, valid=valid, cache=cache,
                          image_mask=image_mask, engram_hashes=engram_hashes, logits_at=logits_at)
    cache = dict(cache, length=cache["length"] + jnp.sum(valid, axis=1).astype(jnp.int32))
    return logits, cache


@functools.lru_cache(maxsize=None)
def _jitted(graphdef):
    return jax.jit(functools.partial(_forward, graphdef), donate_argnums=(1,))


def _split(model):
    graphdef, state = nnx.split(model)
    return graphdef, state


class _Split:
    """A model split once for generation: its ``FlatGraph`` and its Variables in state order.

    ``nnx.split`` walks the whole module graph (~100 ms for the 40-layer model on a 2-core
    machine: docs/performance.md run 16), which ``generate`` used to pay on every call. Each call
    now reads the current value of every Variable instead (weights replaced in place, by a loader,
    ``nnx.update`` or the sharding helpers, are seen). A model's structure (its submodules,
    Variable objects and static attributes) is fixed at its first generation call; after changing
    it, call :func:`forget` (or build a new model). The vision tower follows the same contract."""

    def __init__(self, model):
        graphdef, state = nnx.split(model)
        by_path = {p: v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
        self.variables = [by_path[p] for p, _ in state.flat_state()]
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if len(leaves) != len(self.variables) or any(a is not v.get_value() for a, v in zip(leaves, self.variables)):
            raise RuntimeError("generate: the split state does not list the model's Variables in path order")
        self.graph = FlatGraph(graphdef, treedef)
        self.leaves = ValueReader(self.variables)  # () -> the current value of every Variable


_SPLITS: "weakref.WeakKeyDictionary[nnx.Module, _Split]" = weakref.WeakKeyDictionary()


def forget(model) -> None:
    """Drop the generation view cached for ``model`` (call after changing its structure)."""
    _SPLITS.pop(model, None)


def _split_flat(model):
    """(FlatGraph, list of state arrays): the calling convention of the generation executables
    (the graph from the model's cached ``_Split``, the arrays read now)."""
    split = _SPLITS.get(model)
    if split is None:
        split = _SPLITS[model] = _Split(model)
    return split.graph, split.leaves()


def forward_chunk(model, ids, cache, *, valid=None, inputs_embeds=None, image_mask=None, engram_hashes=None,
                  jit: bool = True):
    """Run a chunk of tokens (prefill chunk or one decode token) against ``cache``."""
    graphdef, state = _split_flat(model)
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


# ---------------------------------------------------------------------------------------------
# jitted pieces of generation

@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The while_loop carry. ``tokens`` [B, N] int32 (-1 = not generated), ``logits`` [B, V] fp32
    (pending: the next token of each row is sampled from them), ``step`` int32 scalar (next column
    of ``tokens``; also the RNG fold), ``done`` [B] bool, ``count`` [B] int32 (tokens generated),
    ``finish`` [B] int32 (0 running, 1 stop id, 2 max new tokens), ``cache`` (model decode
    state), ``key`` (the request's base PRNG key)."""

    tokens: Any
    logits: Any
    step: Any
    done: Any
    count: Any
    finish: Any
    cache: Any
    key: Any


jax.tree_util.register_dataclass(
    DecodeState, data_fields=["tokens", "logits", "step", "done", "count", "finish", "cache", "key"],
    meta_fields=[])


def _prefill_chunk(graphdef, state, cache, ids, valid, inputs_embeds, image_mask, start, last_idx, prev):
    """Run one prompt chunk starting at prompt column ``start``; rows whose last valid prompt
    position ``last_idx`` lies in this chunk take their pending logits from it."""
    C = ids.shape[1]
    li = last_idx - start
    inside = (li >= 0) & (li < C)
    logits, cache = _forward(graphdef, state, cache, ids, valid, inputs_embeds, image_mask, None,
                             logits_at=jnp.clip(li, 0, C - 1).astype(jnp.int32))
    got = logits[:, 0]
    return cache, jnp.where(inside[:, None], got, prev)


def _decode_body(graphdef, state, ds: DecodeState, params, stop_mask, banned, max_new, *, sort=None,
                 live=None) -> DecodeState:
    """One decode step. ``live`` (a traced bool, or None for always): False turns the step into a
    no-op on the state (no row is active: nothing recorded, every row fed as invalid, so no
    cache moves; the pending logits and the step are kept)."""
    tok = sample(ds.logits, params, ds.key, ds.step, banned=banned, sort=sort)
    active = ~ds.done if live is None else ~ds.done & live
    tok = jnp.where(active, tok, -1)
    tokens = jax.lax.dynamic_update_slice(ds.tokens, tok[:, None], (jnp.int32(0), ds.step))
    if live is not None:  # past the buffer's end the update would clamp onto the last column
        tokens = jnp.where(live, tokens, ds.tokens)
    count = ds.count + active.astype(jnp.int32)
    hit_stop = active & stop_mask[jnp.maximum(tok, 0)]
    hit_len = active & (count >= max_new)
    finish = jnp.where(hit_stop, 1, jnp.where(hit_len, 2, ds.finish)).astype(jnp.int32)
    done = ds.done | hit_stop | hit_len
    run = ~done if live is None else ~done & live
    feed = jnp.where(run, tok, 0)[:, None]
    logits, cache = _forward(graphdef, state, ds.cache, feed, run[:, None], None, None, None)
    logits, step = logits[:, 0], ds.step + 1
    if live is not None:
        logits, step = jnp.where(live, logits, ds.logits), ds.step + live.astype(jnp.int32)
    return DecodeState(tokens=tokens, logits=logits, step=step, done=done, count=count,
                       finish=finish, cache=cache, key=ds.key)


def _decode_loop(graphdef, state, ds: DecodeState, params, stop_mask, banned, max_new, limit, *, sort=None,
                 steps: int = 1):
    """Decode until every row is done, the buffer is full, or ``step == limit``. ``sort``:
    :func:`sampling.sample`'s (None: decided on the device each step). ``steps``: decode steps
    per loop iteration, i.e. per check of the exit condition (each check is a device -> host
    round trip on a GPU): the iteration runs a fixed-count inner loop whose steps after an exit
    point are no-ops (``_decode_body``'s ``live``), so the tokens are those of ``steps=1``."""
    end = jnp.minimum(limit, ds.tokens.shape[1])

    def cond(s):
        return (s.step < end) & ~jnp.all(s.done)

    body = functools.partial(_decode_body, graphdef, state, params=params, stop_mask=stop_mask, banned=banned,
                             max_new=max_new, sort=sort)
    if steps > 1:
        one = body

        def body(s):  # a fixed trip count: XLA checks no predicate on the host between these steps
            return jax.lax.fori_loop(0, steps, lambda _, t: one(t, live=cond(t)), s)

    return jax.lax.while_loop(cond, body, ds)


# the generation functions and their donated arguments (the cache; prefill's pending logits too)
_FUNCTIONS = {"prefill": _prefill_chunk, "decode_loop": _decode_loop}
_DONATE = {"prefill": (1, 8), "decode_loop": (1,)}


def _generation_jit(kind: str, graphdef, out_shardings=None, opts: tuple = ()):
    return jax.jit(functools.partial(_FUNCTIONS[kind], graphdef, **dict(opts)), donate_argnums=_DONATE[kind],
                   out_shardings=out_shardings)


LOOP_STEPS = 1  # decode steps per exit check of ``generate``'s loop (``DSV41_LOOP_STEPS`` overrides)
SAMPLING_BRANCHES = "device"  # where the sampling sort is decided (``DSV41_SAMPLING_BRANCHES`` overrides)


def loop_options(sort: bool) -> tuple:
    """The decode loop's static options, as ``_executable``'s ``opts``.

    Where the sampling sort (top-k / top-p) is decided: ``SAMPLING_BRANCHES = "device"`` (the
    default) decides it per step on the device, so one executable serves every request, at one
    device -> host round trip per step; ``DSV41_SAMPLING_BRANCHES=host`` takes ``sort`` (the
    request's ``SamplingParams.needs_sort``) at trace time: no round trip (run 25: 35-60 us less
    per batch-1 step of the 3-layer slice than the two round trips of session 14's loop), but a
    request whose sort need differs from the earlier ones' compiles (once) a loop of its own
    (``buckets.precompile`` compiles both). And the decode steps per exit check (``LOOP_STEPS``;
    streaming yields the steps of one check at a time; run 25: 4 steps per check gained nothing
    over 1)."""
    branches = os.environ.get("DSV41_SAMPLING_BRANCHES", SAMPLING_BRANCHES)
    if branches not in ("host", "device"):
        raise ValueError(f"DSV41_SAMPLING_BRANCHES={branches!r}: expected host or device")
    sort = None if branches == "device" else bool(sort)
    steps = str(os.environ.get("DSV41_LOOP_STEPS", LOOP_STEPS)).strip()
    if not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"DSV41_LOOP_STEPS={steps!r}: expected a positive number of steps")
    steps = int(steps)
    return (("sort", sort), ("steps", steps))


_EXECUTABLES: dict = {}
_STATS = {"compiles": 0, "compile_s": 0.0}


def _aval_key(x):
    return tuple(x.shape), str(jnp.dtype(x.dtype)), bool(getattr(x, "weak_type", False))


def _arg_shardings(mesh, kind: str, args: tuple):
    """Shardings of a generation executable's arguments after the state, on ``mesh``: caches by
    the partition rules, per-row arrays with their batch on "data" (replicated when it does not
    divide), the rest (scalars, vocabulary masks, the PRNG key) replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def row(x):
        return None if x is None else NamedSharding(mesh, shd.batch_spec(mesh, x.shape))

    rep = NamedSharding(mesh, P())
    if kind == "prefill":
        cache, ids, valid, emb, im, start, last_idx, prev = args
        return (shd.cache_shardings(cache, mesh), row(ids), row(valid), row(emb), row(im), rep, row(last_idx),
                row(prev))
    ds, params, stop_mask, banned, max_new, limit = args
    ds_sh = DecodeState(tokens=row(ds.tokens), logits=row(ds.logits), step=rep, done=row(ds.done),
                        count=row(ds.count), finish=row(ds.finish), cache=shd.cache_shardings(ds.cache, mesh),
                        key=rep)
    return (ds_sh, jax.tree.map(row, params), rep, rep, row(max_new), rep)


def _placed(mesh, kind: str, args: tuple) -> tuple:
    """``args`` (state first) with everything after the state placed on ``mesh`` (arrays moved,
    ShapeDtypeStructs given the sharding); unchanged without a mesh."""
    if mesh is None:
        return args

    def put(x, s):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return jax.device_put(x, s)

    rest = args[1:]
    return (args[0], *jax.tree.map(put, rest, _arg_shardings(mesh, kind, rest)))


def _executable(kind: str, graphdef, args: tuple, mesh=None, opts: tuple = ()):
    """(compiled executable, compile seconds spent now) for ``kind`` at the shapes of ``args``.

    On a mesh (a sharded model) the arguments must come through :func:`_placed`; the outputs
    (cache, pending logits, decode state) keep the shardings of the matching inputs, so a
    streamed loop feeds its own output back without a reshard, and the MoE traces its
    expert-parallel path under the mesh."""
    leaves, tree = jax.tree.flatten(args)
    copts = _compiler_options(kind, int(np.prod(args[2].shape)) if kind == "prefill" else 0)
    key = (kind, opts, graphdef, tree, tuple(_aval_key(x) for x in leaves), mesh, tuple(sorted(copts.items())))
    ex = _EXECUTABLES.get(key)
    if ex is not None:
        return ex, 0.0
    t0 = time.perf_counter()
    if mesh is None:
        ex = _generation_jit(kind, graphdef, opts=opts).lower(*args).compile(copts or None)
    else:
        out = jax.tree.map(lambda x: x.sharding, (args[1], args[8]) if kind == "prefill" else args[1])
        with shd.use_mesh(mesh):
            ex = _generation_jit(kind, graphdef, out, opts).lower(*args).compile(copts or None)
    dt = time.perf_counter() - t0
    _EXECUTABLES[key] = ex
    _STATS["compiles"] += 1
    _STATS["compile_s"] += dt
    return ex, dt


PREFILL_GRAPHS_BELOW = 2048  # prompt tokens per prefill call (batch x chunk) from which graphs are off


def _compiler_options(kind: str, tokens: int = 0) -> dict:
    """XLA options of one generation executable. On a GPU a prefill of ``tokens`` >=
    ``PREFILL_GRAPHS_BELOW`` (batch x chunk) is compiled without XLA's command buffers (CUDA
    graphs): each call of a graph executable first updates the graph for the call's new buffers
    (the prompt, the fresh cache, the outputs) while the GPU waits, where plain launches let the
    GPU start at once and the host stay ahead of the prefill's long kernels (run 44, H100, 2-layer
    slice: 8k prompt 40.5-41.9 ms against 41.2-43.6 with the graphs, 2k 22.8 against 23.4-23.6).
    Smaller prefills keep the graphs: their short kernels could leave the host behind, and run 44
    measured nothing below 2k. ``DSV41_PREFILL_GRAPHS=1`` keeps the graphs for every prefill, ``0``
    drops them for every prefill. The decode loop always keeps them: its many short kernels need
    them (run 14). Read at compile time (part of the executable cache's key)."""
    mode = os.environ.get("DSV41_PREFILL_GRAPHS", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"DSV41_PREFILL_GRAPHS={mode!r}: use auto (command buffers below "
                         f"{PREFILL_GRAPHS_BELOW} prompt tokens per call), 1 (for every prefill) or 0 (for none)")
    graphs = mode == "1" or (mode == "auto" and tokens < PREFILL_GRAPHS_BELOW)
    if kind == "prefill" and not graphs and jax.default_backend() == "gpu":
        return {"xla_gpu_enable_command_buffer": ""}
    return {}


def compile_stats() -> dict:
    """``{"compiles": executables compiled so far, "compile_s": seconds, "cached": table size}``."""
    return dict(_STATS, cached=len(_EXECUTABLES))


def clear_compiled() -> None:
    """Drop every cached generation executable (the next request compiles again)."""
    _EXECUTABLES.clear()


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _prefill_avals(model, B: int, C: int, max_len: int, with_embeds: bool):
    t = model.config.text
    cache = jax.eval_shape(lambda: model.init_cache(B, max_len))
    emb = _sds((B, C, t.hidden_size), model.numerics.dtype) if with_embeds else None
    im = _sds((B, C), bool) if with_embeds else None
    return (cache, _sds((B, C), jnp.int32), _sds((B, C), bool), emb, im, _sds((), jnp.int32),
            _sds((B,), jnp.int32), _sds((B, t.vocab_size), F32))


def _decode_avals(model, B: int, N: int, max_len: int):
    V = model.config.text.vocab_size
    cache = jax.eval_shape(lambda: model.init_cache(B, max_len))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    ds = DecodeState(tokens=_sds((B, N), jnp.int32), logits=_sds((B, V), F32), step=_sds((), jnp.int32),
                     done=_sds((B,), bool), count=_sds((B,), jnp.int32), finish=_sds((B,), jnp.int32),
                     cache=cache, key=key)
    params = SamplingParams(_sds((B,), F32), _sds((B,), jnp.int32), _sds((B,), F32), _sds((B,), F32))
    return (ds, params, _sds((V,), bool), _sds((V,), bool), _sds((B,), jnp.int32), _sds((), jnp.int32))


def compile_prefill(model, batch: int, chunk: int, max_len: int, *, with_embeds: bool = False) -> float:
    """Compile the prefill chunk function for ids [batch, chunk] and a cache of ``max_len``."""
    graphdef, state = _split_flat(model)
    mesh = shd.mesh_of(state)
    args = _placed(mesh, "prefill", (state, *_prefill_avals(model, batch, chunk, max_len, with_embeds)))
    return _executable("prefill", graphdef, args, mesh)[1]


def compile_decode(model, batch: int, new_tokens: int, max_len: int, *, sort: bool = False) -> float:
    """Compile the decode while_loop for [batch] rows, a [batch, new_tokens] buffer, cache
    ``max_len``, for requests with top-k / top-p on (``sort``) or without (see
    :func:`loop_options`)."""
    graphdef, state = _split_flat(model)
    mesh = shd.mesh_of(state)
    args = _placed(mesh, "decode_loop", (state, *_decode_avals(model, batch, new_tokens, max_len)))
    return _executable("decode_loop", graphdef, args, mesh, loop_options(sort))[1]


# ---------------------------------------------------------------------------------------------
# the user API

@dataclasses.dataclass
class GenerationResult:
    """``tokens[i]``: the new tokens of prompt i (a sampled stop id is included, as the last
    token); ``finish_reasons[i]``: "stop" (a stop id was sampled) or "length" (its
    max_new_tokens reached); ``timings``: compile_s (compilation during this call), prefill_s and
    decode_s (device run time, compilation excluded), total_s, compiles (new executables),
    decode_steps (loop iterations); ``shapes``: the buckets used."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    timings: dict
    shapes: dict


@dataclasses.dataclass
class StreamStep:
    """One decode step of ``generate_stream``: ``tokens[i]`` is the token prompt i produced at this
    step (None once it had finished before the step); ``finish_reasons[i]`` is None while the
    sequence runs, then "stop" / "length"."""

    step: int
    tokens: list[int | None]
    finish_reasons: list[str | None]


@dataclasses.dataclass
class _Run:
    ex: Any
    state: Any
    ds: DecodeState
    args: tuple  # (params, stop_mask, banned, max_new)
    n: int
    N: int
    timings: dict
    shapes: dict
    steps: int = 1  # decode steps per exit check of the loop (``loop_options``)


def _per_row(name: str, v, n: int) -> np.ndarray:
    a = np.asarray(v)
    if a.ndim == 0:
        a = np.full((n,), a)
    if a.shape != (n,) or not np.all(np.equal(np.mod(a, 1), 0)):
        raise ValueError(f"generate: {name} must be an integer or {n} integers, got {v!r}")
    return a.astype(np.int64)


def _id_mask(ids, V: int, what: str) -> np.ndarray:
    m = np.zeros((V,), bool)
    ids = [int(i) for i in (ids or ())]
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise ValueError(f"generate: {what} {bad} outside the vocabulary [0, {V})")
    m[ids] = True
    return m


def _pad_rows(x, B: int, L: int, dtype, name: str, n: int, longest: int):
    a = np.asarray(x)
    if a.shape[0] != n or a.ndim < 2 or a.shape[1] < longest:
        raise ValueError(f"generate: {name} must have shape [{n}, >= {longest}, ...] (one row per prompt, "
                         f"covering the longest prompt), got {list(a.shape)}")
    a = a[:, :L].astype(dtype)
    out = np.zeros((B, L, *a.shape[2:]), dtype)
    out[:n, :a.shape[1]] = a
    return out


def _prepare(model, prompts, *, max_new_tokens, sampling, stop_ids, seed, max_len, inputs_embeds, image_mask,
             prefill_chunk, banned_ids, buckets: Buckets) -> _Run:
    t_start = time.perf_counter()
    cfg = model.config
    V = cfg.text.vocab_size
    prompts = check_prompts(prompts, V)
    n = len(prompts)
    max_new = _per_row("max_new_tokens", max_new_tokens, n)
    if np.any(max_new < 1):
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new.tolist()}")
    chunk = prefill_chunk or buckets.prefill_chunk
    if chunk is not None and chunk < 1:
        raise ValueError(f"generate: prefill_chunk must be >= 1, got {chunk}")
    B = buckets.batch(n)
    longest = max(len(p) for p in prompts)
    Lb = buckets.prompt_len(longest)
    C = chunk or Lb
    L = round_up(Lb, C)  # host padding only: the compiled shapes are [B, C] and the cache
    N = buckets.new_tokens(int(max_new.max()))
    cap = int(max_len) if max_len is not None else buckets.cache_len(Lb, N)
    for i, p in enumerate(prompts):
        if len(p) + max_new[i] > cap:
            raise ValueError(f"generate: prompt {i} ({len(p)} tokens) + max_new_tokens {int(max_new[i])} exceeds the "
                             f"cache capacity max_len={cap}")
    if sampling is None:
        sampling = SamplingParams.greedy(n)
    if not isinstance(sampling, SamplingParams):
        raise ValueError("generate: sampling must be a SamplingParams (see SamplingParams.make)")
    sampling.validate()
    if sampling.batch != n:
        raise ValueError(f"generate: sampling parameters are for {sampling.batch} rows, got {n} prompts")
    params = sampling.pad(B)
    stop_mask = _id_mask((cfg.eos_token_id,) if stop_ids is None else stop_ids, V, "stop ids")
    banned = _id_mask((cfg.image_token_id,) if banned_ids is None else banned_ids, V, "banned ids")

    pb = pad_prompts(prompts, length=L, batch=B, pad_id=cfg.pad_token_id, buckets=buckets)
    emb = im = None
    if inputs_embeds is not None:
        emb = _pad_rows(inputs_embeds, B, L, np.dtype(model.numerics.dtype), "inputs_embeds", n, longest)
        if emb.ndim != 3 or emb.shape[-1] != cfg.text.hidden_size:
            raise ValueError(f"generate: inputs_embeds must be [n, L, {cfg.text.hidden_size}]")
    if image_mask is not None or emb is not None:
        im = (np.zeros((B, L), bool) if image_mask is None
              else _pad_rows(image_mask, B, L, bool, "image_mask", n, longest))
        im &= pb.valid

    graphdef, state = _split_flat(model)
    mesh = shd.mesh_of(state)  # a sharded model: the cache and inputs are placed by the rules
    timings = {"compile_s": 0.0, "compiles": 0}

    def get(kind, args, opts=()):
        ex, dt = _executable(kind, graphdef, args, mesh, opts)
        timings["compile_s"] += dt
        timings["compiles"] += int(dt > 0)
        return ex

    # ---- prefill
    cache = model.init_cache(B, cap)
    prev = jnp.zeros((B, V), F32)
    last_idx = jnp.asarray(pb.lengths - 1, jnp.int32)
    n_chunks = -(-longest // C)
    t_run = 0.0
    for c in range(n_chunks):
        sl = slice(c * C, (c + 1) * C)
        args = _placed(mesh, "prefill", (
            state, cache, jnp.asarray(pb.ids[:, sl]), jnp.asarray(pb.valid[:, sl]),
            None if emb is None else jnp.asarray(emb[:, sl]), None if im is None else jnp.asarray(im[:, sl]),
            jnp.asarray(c * C, jnp.int32), last_idx, prev))
        ex = get("prefill", args)
        t0 = time.perf_counter()
        cache, prev = ex(*args)
        t_run += time.perf_counter() - t0
    t0 = time.perf_counter()
    prev.block_until_ready()
    timings["prefill_s"] = t_run + time.perf_counter() - t0

    # ---- decode state
    real = np.arange(B) < n
    mn = np.zeros((B,), np.int32)
    mn[:n] = max_new
    ds = DecodeState(tokens=jnp.asarray(np.full((B, N), -1, np.int32)), logits=prev,
                     step=jnp.asarray(0, jnp.int32), done=jnp.asarray(~real), count=jnp.zeros((B,), jnp.int32),
                     finish=jnp.asarray(np.where(real, 0, 2).astype(np.int32)), cache=cache,
                     key=jax.random.PRNGKey(seed))
    _, ds, *args, limit = _placed(mesh, "decode_loop", (state, ds, params, jnp.asarray(stop_mask),
                                                         jnp.asarray(banned), jnp.asarray(mn), jnp.asarray(N, jnp.int32)))
    opts = loop_options(sampling.needs_sort(V))
    ex = get("decode_loop", (state, ds, *args, limit), opts)
    timings["setup_s"] = time.perf_counter() - t_start - timings["compile_s"] - timings["prefill_s"]
    shapes = {"batch": B, "prompt_len": Lb, "chunk": C, "new_tokens": N, "max_len": cap}
    return _Run(ex=ex, state=state, ds=ds, args=args, n=n, N=N, timings=timings, shapes=shapes,
                steps=dict(opts)["steps"])


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens, sampling: SamplingParams | None = None,
             stop_ids: Sequence[int] | None = None, seed: int = 0, max_len: int | None = None, inputs_embeds=None,
             image_mask=None, prefill_chunk: int | None = None, banned_ids: Sequence[int] | None = None,
             buckets: Buckets = DEFAULT_BUCKETS) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens for each prompt (a batch of token-id lists).

    ``max_new_tokens``: int or one per prompt. ``sampling``: :class:`SamplingParams` for the
    ``len(prompts)`` rows (default greedy). ``stop_ids``: ids that end a sequence (default the
    config's eos id; ``()`` for none). ``banned_ids``: ids never sampled (default the image
    placeholder id). ``seed``: PRNG seed (row b's draw at step t uses
    ``fold_in(fold_in(PRNGKey(seed), t), b)``). ``max_len``: cache capacity (default the bucket
    ``buckets.cache_len``; a shape, so keep it fixed across requests). ``inputs_embeds`` [n, >=L,
    hidden] / ``image_mask`` [n, >=L] bool: prompt embeddings with image spans (prefill only; the
    decode embeds the sampled ids). ``prefill_chunk``: prefill in chunks of this many tokens.

    Raises ValueError for an empty batch or prompt, ids outside the vocabulary, a batch larger
    than ``buckets.max_batch``, a prompt longer than the largest length bucket, prompt +
    max_new_tokens beyond ``max_len``, and invalid sampling values.
    """
    run = _prepare(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed,
                   max_len=max_len, inputs_embeds=inputs_embeds, image_mask=image_mask, prefill_chunk=prefill_chunk,
                   banned_ids=banned_ids, buckets=buckets)
    t0 = time.perf_counter()
    ds = run.ex(run.state, run.ds, *run.args, jnp.asarray(run.N, jnp.int32))
    tokens, count, finish, step = jax.device_get((ds.tokens, ds.count, ds.finish, ds.step))
    tm = run.timings
    tm["decode_s"] = time.perf_counter() - t0
    tm["decode_steps"] = int(step)
    tm["total_s"] = tm["compile_s"] + tm["prefill_s"] + tm["setup_s"] + tm["decode_s"]
    n = run.n
    return GenerationResult(tokens=[tokens[i, :count[i]].tolist() for i in range(n)],
                            finish_reasons=[FINISH_REASONS[int(f)] for f in finish[:n]],
                            timings=tm, shapes=run.shapes)


def generate_stream(model, prompts: Sequence[Sequence[int]], *, max_new_tokens,
                    sampling: SamplingParams | None = None, stop_ids: Sequence[int] | None = None, seed: int = 0,
                    max_len: int | None = None, inputs_embeds=None, image_mask=None,
                    prefill_chunk: int | None = None, banned_ids: Sequence[int] | None = None,
                    buckets: Buckets = DEFAULT_BUCKETS) -> Iterator[StreamStep]:
    """Same arguments and tokens as :func:`generate`, yielded one :class:`StreamStep` per decode
    step. Validation and the prefill happen at the call; the returned iterator runs the same
    compiled decode loop, one exit check's steps (``loop_options``) per call."""
    run = _prepare(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed,
                   max_len=max_len, inputs_embeds=inputs_embeds, image_mask=image_mask, prefill_chunk=prefill_chunk,
                   banned_ids=banned_ids, buckets=buckets)
    return _stream(run)


def _stream(run: _Run) -> Iterator[StreamStep]:
    """Each call of the loop runs up to ``run.steps`` steps (one exit check: the loop's own
    granularity), then its steps are yielded one by one: row ``i`` produced a token at step ``s``
    iff ``s < count[i]`` (rows run from step 0 until they finish), and its finish reason shows
    from its last step on."""
    ds, n = run.ds, run.n
    step = 0
    while step < run.N:
        ds = run.ex(run.state, ds, *run.args, jnp.asarray(min(step + run.steps, run.N), jnp.int32))
        tokens, done, finish, count, end = jax.device_get((ds.tokens, ds.done, ds.finish, ds.count, ds.step))
        for s in range(step, int(end)):
            yield StreamStep(step=s, tokens=[int(tokens[i, s]) if s < count[i] else None for i in range(n)],
                             finish_reasons=[FINISH_REASONS.get(int(finish[i])) if s >= count[i] - 1 else None
                                             for i in range(n)])
        step = int(end)
        if np.all(done):
            return
