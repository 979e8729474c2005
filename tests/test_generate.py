"""dsv41_jax.generate on a tiny random V4.1 (Engram off, text only, fp32 fast numerics).

Every generate call in this file uses one set of shapes (batch bucket 4, prompt bucket 16,
new-token bucket 16, cache 32), so the prefill and the decode loop compile once; the chunked /
embeds variant adds one prefill executable and the reference full forward one more.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import generate as G
from dsv41_jax import tiny
from dsv41_jax.buckets import Buckets, pad_prompts, precompile
from dsv41_jax.numerics import Numerics
from dsv41_jax.sampling import SamplingParams
from dsv41_jax.weights import load_original

BK = Buckets(min_batch=4, max_batch=4, min_len=16, min_new=16)
LENS = (5, 11, 3)
NEW = 8
REF_WIDTH = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_gen") / "ck")
    tiny.write_tiny_checkpoint(d, fmt="bf16", seed=0, vision=False)  # Engram on layers 0 and 1
    return load_original(d, Numerics("float32", "fast"), text_only=True)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(3, 250, n).tolist() for n in LENS]


@pytest.fixture(scope="module")
def greedy(model, prompts):
    return G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK)


def _reference_greedy(model, prompts, n_new, banned=(250,)):
    """Manual loop: one-shot prefill of prompt + generated tokens (fixed width, right padding),
    argmax at the last valid position."""
    seqs = [list(p) for p in prompts]
    for _ in range(n_new):
        ids = np.zeros((len(seqs), REF_WIDTH), np.int32)
        valid = np.zeros((len(seqs), REF_WIDTH), bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
            valid[i, :len(s)] = True
        logits, _ = G.forward_chunk(model, ids, model.init_cache(len(seqs), REF_WIDTH), valid=jnp.asarray(valid))
        lg = np.asarray(logits)
        for i, s in enumerate(seqs):
            row = lg[i, len(s) - 1].copy()
            row[list(banned)] = -np.inf
            s.append(int(np.argmax(row)))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


class _BackendCompiles:
    """Counts every XLA backend compilation (jit, eager ops, AOT) inside the block."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.n = 0

        def cb(event, duration_secs=0.0, **kw):
            if event == self.EVENT:
                self.n += 1

        self._cb = cb
        jax.monitoring.register_event_duration_secs_listener(cb)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._cb)


# ------------------------------------------------------------------------------------------------

def test_precompile_then_generate_compiles_nothing(model, prompts):
    r = precompile(model, [4], [16], new_buckets=[16], buckets=BK)
    assert r["shapes"] == [{"batch": 4, "prompt_len": 16, "chunk": 16, "new_tokens": 16, "max_len": 32}]
    assert precompile(model, [4], [16], new_buckets=[16], buckets=BK)["compiles"] == 0
    out = G.generate(model, prompts, max_new_tokens=3, stop_ids=(), buckets=BK)
    assert out.timings["compiles"] == 0 and out.timings["compile_s"] == 0.0
    assert out.shapes == r["shapes"][0]
    # the filtered-sampling loop (top-p: the vocabulary sort) was precompiled too
    sp = SamplingParams.make(len(prompts), temperature=0.7, top_p=0.9)
    out = G.generate(model, prompts, max_new_tokens=3, stop_ids=(), sampling=sp, buckets=BK)
    assert out.timings["compiles"] == 0


def test_greedy_matches_full_forward_loop(model, prompts, greedy):
    ref = _reference_greedy(model, prompts, NEW)
    assert greedy.tokens == ref
    assert greedy.finish_reasons == ["length"] * 3
    assert greedy.timings["decode_steps"] == NEW


def test_batched_equals_alone(model, prompts, greedy):
    for p, toks in zip(prompts, greedy.tokens):
        alone = G.generate(model, [p], max_new_tokens=NEW, stop_ids=(), buckets=BK)
        assert alone.tokens == [toks]
        assert alone.timings["compiles"] == 0


def test_stop_ids_and_max_new_per_row(model, prompts, greedy):
    g = greedy.tokens
    stop = g[0][2]
    out = G.generate(model, prompts, max_new_tokens=[NEW, 2, 5], stop_ids=[stop], buckets=BK)
    for i, (toks, reason) in enumerate(zip(out.tokens, out.finish_reasons)):
        lim = [NEW, 2, 5][i]
        ref = g[i][:lim]
        if stop in ref:
            k = ref.index(stop) + 1
            assert toks == ref[:k] and reason == "stop", i
        else:
            assert toks == ref and reason == "length", i
    assert out.finish_reasons[0] == "stop" and len(out.tokens[0]) <= 3
    assert out.tokens[1] == g[1][:2] or out.finish_reasons[1] == "stop"
    # early exit: the loop ran only as long as the longest row
    assert out.timings["decode_steps"] == max(len(t) for t in out.tokens)


def test_stream_equals_generate(model, prompts, greedy):
    samp = SamplingParams.make(3, temperature=[0.0, 1.0, 0.8], top_p=[1.0, 0.9, 1.0], top_k=[0, 0, 20])
    for kw in ({}, {"sampling": samp, "seed": 5, "max_new_tokens": [4, NEW, 6]}):
        kw = {"max_new_tokens": NEW, **kw}
        full = G.generate(model, prompts, stop_ids=(), buckets=BK, **kw)
        got = [[] for _ in prompts]
        reasons = None
        for st in G.generate_stream(model, prompts, stop_ids=(), buckets=BK, **kw):
            for i, t in enumerate(st.tokens):
                if t is not None:
                    got[i].append(t)
            reasons = st.finish_reasons
        assert got == full.tokens
        assert reasons == full.finish_reasons
    assert full.tokens[0] == greedy.tokens[0][:4]  # the greedy row is unaffected by sampled rows


def test_loop_steps_and_branches_same_tokens(model, prompts, greedy, monkeypatch):
    # several decode steps per exit check (the steps after an exit are no-ops) and the sampling
    # branches decided on the device give generate's tokens, reasons and step counts: early stops
    # on different steps, a buffer end that is no multiple of the steps, sampled rows
    g = greedy.tokens
    samp = SamplingParams.make(3, temperature=[0.0, 1.0, 0.8], top_p=[1.0, 0.9, 1.0], top_k=[0, 0, 20])
    runs = ({"max_new_tokens": [NEW, 2, 5], "stop_ids": [g[0][2]]},
            {"max_new_tokens": [4, NEW, 7], "stop_ids": (), "sampling": samp, "seed": 5})
    want = [G.generate(model, prompts, buckets=BK, **kw) for kw in runs]
    streams = [list(G.generate_stream(model, prompts, buckets=BK, **kw)) for kw in runs]
    # new loop executables per run: the sort decided on the device (the default) serves both
    # runs with one loop; decided on the host, the filtered run (top-k / top-p) needs a loop of its own
    for env, compiles in (({"DSV41_LOOP_STEPS": "3"}, (1, 0)), ({"DSV41_LOOP_STEPS": "16"}, (1, 0)),
                          ({"DSV41_SAMPLING_BRANCHES": "host"}, (1, 1)),
                          ({"DSV41_SAMPLING_BRANCHES": "host", "DSV41_LOOP_STEPS": "3"}, (1, 1))):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for kw, w, c, st in zip(runs, want, compiles, streams):
            out = G.generate(model, prompts, buckets=BK, **kw)
            assert out.timings["compiles"] == c, env
            assert (out.tokens, out.finish_reasons) == (w.tokens, w.finish_reasons), (env, kw)
            assert out.timings["decode_steps"] == w.timings["decode_steps"], env
            # streaming yields the same steps (tokens, Nones, reasons as they appear), whatever the chunking
            assert list(G.generate_stream(model, prompts, buckets=BK, **kw)) == st, env
        for k in env:
            monkeypatch.delenv(k)
    for bad in ("0", "two"):
        monkeypatch.setenv("DSV41_LOOP_STEPS", bad)
        with pytest.raises(ValueError, match="DSV41_LOOP_STEPS"):
            G.generate(model, prompts, max_new_tokens=2, buckets=BK)
    monkeypatch.delenv("DSV41_LOOP_STEPS")
    monkeypatch.setenv("DSV41_SAMPLING_BRANCHES", "gpu")
    with pytest.raises(ValueError, match="DSV41_SAMPLING_BRANCHES"):
        G.generate(model, prompts, max_new_tokens=2, buckets=BK)


def test_no_recompile_between_requests(model, prompts):
    G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK)  # warm (shapes of this file)
    rs = np.random.RandomState(1)
    other = [rs.randint(3, 250, n).tolist() for n in (16, 1)]
    samp = SamplingParams.make(2, temperature=[0.7, 1.3], top_k=[5, 0], top_p=[0.8, 0.95], min_p=[0.0, 0.05])
    with _BackendCompiles() as c:
        out = G.generate(model, other, max_new_tokens=[16, 3], sampling=samp, stop_ids=[7, 9], seed=123, buckets=BK)
    assert c.n == 0, f"{c.n} backend compilations"
    assert out.timings["compiles"] == 0
    assert len(out.tokens[1]) <= 3 and len(out.tokens[0]) <= 16


def test_seeded_sampling_reproducible_and_top_k1_is_greedy(model, prompts, greedy):
    samp = SamplingParams.make(3, temperature=1.0)
    a = G.generate(model, prompts, max_new_tokens=NEW, sampling=samp, stop_ids=(), seed=11, buckets=BK)
    b = G.generate(model, prompts, max_new_tokens=NEW, sampling=samp, stop_ids=(), seed=11, buckets=BK)
    c = G.generate(model, prompts, max_new_tokens=NEW, sampling=samp, stop_ids=(), seed=12, buckets=BK)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    k1 = G.generate(model, prompts, max_new_tokens=NEW, sampling=SamplingParams.make(3, temperature=1.0, top_k=1),
                    stop_ids=(), seed=11, buckets=BK)
    assert k1.tokens == greedy.tokens


def test_banned_ids_never_generated(model, prompts, greedy):
    ban = sorted({t for row in greedy.tokens for t in row})
    out = G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), banned_ids=ban, buckets=BK,
                     sampling=SamplingParams.make(3, temperature=[0.0, 1.0, 2.0]))
    assert not set(ban) & {t for row in out.tokens for t in row}


def test_chunked_prefill_with_embeds_matches(model, prompts, greedy):
    # chunked prefill (chunk 5: the 11-token prompt spans 3 chunks, a ratio-2 compressor group
    # straddles the boundary at 5) fed with inputs_embeds equal to the token embeddings gives
    # the whole-prompt greedy tokens; the cache shape (and so the decode loop) is unchanged
    table = np.asarray(model.embed.weight[...])
    emb = np.zeros((3, 12, table.shape[1]), np.float32)
    for i, p in enumerate(prompts):
        emb[i, :len(p)] = table[p]
    out = G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK, prefill_chunk=5,
                     inputs_embeds=emb, image_mask=np.zeros((3, 12), bool))
    assert out.shapes["chunk"] == 5 and out.shapes["max_len"] == 32
    assert out.timings["compiles"] == 1  # the [4, 5] prefill chunk only
    assert out.tokens == greedy.tokens


def test_bad_inputs(model, prompts):
    def gen(p=prompts, **kw):
        kw = {"max_new_tokens": 4, "buckets": BK, **kw}
        return G.generate(model, p, **kw)

    with pytest.raises(ValueError, match="empty batch"):
        gen([])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen([[5], []])
    with pytest.raises(ValueError, match="cache capacity"):
        gen([list(range(3, 30))], max_len=32, max_new_tokens=8)
    with pytest.raises(ValueError, match="larger than the largest batch bucket"):
        gen([[5]] * 5)
    with pytest.raises(ValueError, match="temperature"):
        gen(sampling=SamplingParams(jnp.asarray([-1.0, 0, 0]), jnp.zeros(3, jnp.int32), jnp.ones(3), jnp.zeros(3)))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.make(3, top_p=1.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen([[5, 256]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen(max_new_tokens=[1, 0, 2])
    with pytest.raises(ValueError, match="sampling parameters are for 2 rows"):
        gen(sampling=SamplingParams.greedy(2))
    with pytest.raises(ValueError, match="longest prompt bucket"):
        G.generate(model, [[5] * 20], max_new_tokens=2, buckets=Buckets(max_len=16))


def test_pad_prompts():
    pb = pad_prompts([[4, 5, 6], [7]], pad_id=2, buckets=Buckets(min_len=4, min_batch=4))
    np.testing.assert_array_equal(pb.ids, [[4, 5, 6, 2], [7, 2, 2, 2], [2, 2, 2, 2], [2, 2, 2, 2]])
    np.testing.assert_array_equal(pb.valid[:2], [[1, 1, 1, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(pb.lengths, [3, 1, 1, 1])
    assert pb.n == 2
    b = Buckets(min_len=16, prefill_chunk=None)
    assert [b.prompt_len(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert b.prompt_len(17, chunk=24) == 48 and b.new_tokens(1) == 16 and b.cache_len(16, 16) == 32
    assert [Buckets(max_batch=64).batch(n) for n in (1, 3, 64)] == [1, 4, 64]


def test_executables_take_the_state_as_a_flat_list(model, prompts):
    """The generation executables take the weights as the list of their arrays (flattened in C++
    per call; an nnx.State of the full model costs milliseconds of Python per call) and the
    graph + tree structure as the static part; the model merged back is the same model."""
    from flax import nnx

    fg, leaves = G._split_flat(model)
    assert isinstance(fg, G.FlatGraph) and isinstance(leaves, list)
    gd, st = nnx.split(model)
    assert fg.graphdef == gd and len(leaves) == len(jax.tree_util.tree_leaves(st))
    merged = G._merge(fg, leaves)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(merged)), jax.tree_util.tree_leaves(st)):
        assert a is b or np.array_equal(np.asarray(a), np.asarray(b))
    hash(fg)  # the executable cache key


def test_split_once_per_model_and_weights_read_per_call(model, prompts, greedy):
    """``generate`` splits a model once (``_Split``) and reads the Variables' current values on
    every call: a weight replaced in place changes the output exactly as a model built with that
    weight does; ``forget`` drops the cached view."""
    from flax import nnx

    fg1, leaves1 = G._split_flat(model)
    fg2, leaves2 = G._split_flat(model)
    assert fg1 is fg2 and all(a is b for a, b in zip(leaves1, leaves2))
    head = model.head.weight
    old = head.get_value()
    other = nnx.clone(model)  # same structure and values, its own Variables
    new = old[::-1]  # another valid head: the rows of the vocabulary reversed
    try:
        head.set_value(new)
        assert G._split_flat(model)[1][[i for i, a in enumerate(leaves1) if a is old][0]] is new
        changed = G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK).tokens
        other.head.weight.set_value(new)
        want = G.generate(other, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK).tokens
        assert changed == want and changed != greedy.tokens
    finally:
        head.set_value(old)
    assert G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK).tokens == greedy.tokens
    G.forget(model)
    assert G._split_flat(model)[0] is not fg1 and G._split_flat(model)[0] == fg1


def test_value_reader_reads_what_get_value_gives(model):
    """``weights.ValueReader`` (the per-call reads of ``generate`` and ``encode_images``): for every
    Variable of the model the same object ``get_value()`` returns, after an in-place
    ``set_value`` too; a Variable with an ``on_get_value`` hook keeps ``get_value()`` (its hook
    runs), and so does a Variable class with its own ``get_value``; the model's own Variables all
    take the direct read."""
    from flax import nnx

    from dsv41_jax.weights import ValueReader

    split = G._Split(model)
    reader = split.leaves
    assert all(reader.plain) and len(reader.plain) == len(split.variables)
    assert all(a is v.get_value() for a, v in zip(reader(), split.variables))
    head = model.head.weight
    old = head.get_value()
    try:
        head.set_value(old + 1)
        i = [j for j, v in enumerate(split.variables) if v is head][0]
        assert reader()[i] is head.get_value()
    finally:
        head.set_value(old)
    class Doubled(nnx.Param):
        def get_value(self, **kw):
            return super().get_value(**kw) * 2

    import warnings

    with warnings.catch_warnings():  # (flax deprecates hooks; users may still set them)
        warnings.simplefilter("ignore", UserWarning)
        hooked = nnx.Param(jnp.ones(3), on_get_value=lambda var, x: x * 3)
    r = ValueReader([nnx.Param(jnp.ones(3)), Doubled(jnp.ones(3)), hooked])
    assert r.plain == [True, False, False]
    got = r()
    np.testing.assert_array_equal(np.asarray(got[1]), 2 * np.ones(3))
    np.testing.assert_array_equal(np.asarray(got[2]), 3 * np.ones(3))


def test_query_rope_in_place_prefill_only(model, prompts, monkeypatch):
    """``DSV41_ROPE_Q_IN_PLACE``: a prefill chunk's queries get their RoPE tail written back in
    place (one more ``dynamic_update_slice`` per attention layer in the traced forward) with the
    logits of the concatenation, bit for bit; one-token decode steps keep the concatenation (the
    in-place form there broke ``test_greedy_matches_full_forward_loop`` on XLA:CPU, session 19)."""
    ids = np.zeros((3, 16), np.int32)
    valid = np.zeros((3, 16), bool)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], valid[i, :len(p)] = p, True

    def run(n):
        return G.forward_chunk(model, ids[:, :n], model.init_cache(3, 16), valid=jnp.asarray(valid[:, :n]), jit=False)

    def dus_count(n):
        jaxpr = jax.make_jaxpr(lambda: run(n))()
        return str(jaxpr).count("dynamic_update_slice")

    out, count = {}, {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DSV41_ROPE_Q_IN_PLACE", mode)
        out[mode] = np.asarray(run(16)[0])
        count[mode] = (dus_count(16), dus_count(1))
    np.testing.assert_array_equal(out["1"], out["0"])
    assert count["1"][0] - count["0"][0] == len(model.layers)  # prefill: one per attention layer
    assert count["1"][1] == count["0"][1]  # decode: unchanged
    monkeypatch.setenv("DSV41_ROPE_Q_IN_PLACE", "2")
    with pytest.raises(ValueError, match="DSV41_ROPE_Q_IN_PLACE"):
        run(16)


def test_prefill_graph_switch(model, prompts, greedy, monkeypatch):
    """On a GPU a prefill of ``PREFILL_GRAPHS_BELOW`` or more prompt tokens per call is compiled
    without command buffers by default, a smaller one with them (``DSV41_PREFILL_GRAPHS=1``: always
    with, ``0``: always without); nothing is asked elsewhere, nor for the decode loop; the other
    setting is a separate cache entry with the same tokens."""
    big, small = G.PREFILL_GRAPHS_BELOW, G.PREFILL_GRAPHS_BELOW - 1
    no_graphs = {"xla_gpu_enable_command_buffer": ""}
    monkeypatch.delenv("DSV41_PREFILL_GRAPHS", raising=False)
    assert G._compiler_options("prefill", big) == {} and G._compiler_options("loop") == {}  # on the CPU: no GPU option
    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        assert G._compiler_options("prefill", big) == no_graphs
        assert G._compiler_options("prefill", small) == {}
        assert G._compiler_options("loop") == {}
        m.setenv("DSV41_PREFILL_GRAPHS", "1")
        assert G._compiler_options("prefill", big) == {} and G._compiler_options("prefill", small) == {}
        m.setenv("DSV41_PREFILL_GRAPHS", "0")
        assert G._compiler_options("prefill", big) == no_graphs == G._compiler_options("prefill", small)
        assert G._compiler_options("loop") == {}
        m.setenv("DSV41_PREFILL_GRAPHS", "off")
        with pytest.raises(ValueError, match="DSV41_PREFILL_GRAPHS"):
            G._compiler_options("prefill", big)
    with monkeypatch.context() as m:  # generate asks with the prefill call's batch x chunk: 4 x 16 here
        seen = []
        real = G._compiler_options
        m.setattr(G, "_compiler_options", lambda kind, tokens=0: seen.append((kind, tokens)) or real(kind, tokens))
        G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK)
        assert ("prefill", 4 * 16) in seen and all(t == 0 for k, t in seen if k != "prefill")
    # the executable's cache key holds the options: switching them compiles again; the same tokens
    monkeypatch.setattr(G, "_compiler_options", lambda kind, tokens=0: no_graphs if kind == "prefill" else {})
    before = G.compile_stats()["compiles"]
    out = G.generate(model, prompts, max_new_tokens=NEW, stop_ids=(), buckets=BK)
    assert G.compile_stats()["compiles"] > before  # not the cached executable of the default
    assert out.tokens == greedy.tokens
