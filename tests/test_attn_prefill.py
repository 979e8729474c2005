"""``kernels.attn_prefill.sparse_attn_prefill`` (the prefill sparse attention: two launches that
gather the selected entries themselves) in the Pallas interpreter against the model's XLA form
``Attention._attend`` (query blocks, ``attention.sparse_attn``): ring + chunk window keys with
scattered ring slots and invalid keys, blocked and unblocked chunks, window-only layers, padded
heads; the shape errors; and the golden bf16 case end to end with every attention chunk on the
kernel, at the case's own tolerances against the official reference."""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.kernels.attn_prefill import sparse_attn_prefill
from dsv41_jax.model.attention import Attention, query_block, sparse_attn

BF = jnp.bfloat16
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _case(B, S, H, d, W, Tc, K, seed=0, ring_valid=3, start=5):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, S, H, d)).astype(BF)
    kw = jax.random.normal(ks[1], (B, W + S, d)).astype(BF)
    pos = jnp.broadcast_to(start + jnp.arange(S), (B, S)).astype(jnp.int32)
    # ring slots in slot order (not by position), some empty (-1)
    ring = jnp.roll(jnp.where(jnp.arange(W) < ring_valid, start - 1 - jnp.arange(W), -1), 2)
    kpos = jnp.concatenate([jnp.broadcast_to(ring, (B, W)), pos], axis=1).astype(jnp.int32)
    kpos = kpos.at[B - 1, W + 3].set(-1)  # an invalid chunk key (a padding token)
    cmp = jax.random.normal(ks[2], (B, Tc, d)).astype(BF) if K else None
    idx = jax.random.randint(ks[3], (B, S, K), -1, Tc).at[0, 0].set(-1) if K else None  # token 0: no entry
    sink = jax.random.normal(ks[4], (H,))
    return q, pos, kw, kpos, cmp, idx, sink


def _xla(q, pos, kw, kpos, cmp, idx, sink, W, q_block):
    d = q.shape[-1]
    fake = SimpleNamespace(window=W, q_block=q_block, _attend_kernel=lambda *a: None)
    fake._sparse_attn = lambda q_, kw_, ok, kc, kc_ok: sparse_attn(q_, kw_, ok, kc, kc_ok, sink, d ** -0.5, BF)
    return Attention._attend(fake, q, pos, kw, kpos, cmp, idx)


@pytest.mark.parametrize("B,S,H,d,W,Tc,K,q_block", [
    (2, 32, 16, 64, 8, 20, 32, 8),   # blocked (S > 2 blocks): each token sees its block's window slice
    (1, 12, 16, 64, 8, 10, 20, 8),   # unblocked: every token sees all of ring ++ chunk; K not a tile multiple
    (2, 24, 32, 32, 8, 0, 0, 8),     # window-only layer
    (1, 20, 4, 64, 4, 9, 6, 4),      # 4 heads (padded to a 16-row tile), blocked with block 4
])
def test_kernel_matches_the_xla_form(B, S, H, d, W, Tc, K, q_block):
    q, pos, kw, kpos, cmp, idx, sink = _case(B, S, H, d, W, Tc, K)
    want = _xla(q, pos, kw, kpos, cmp, idx, sink, W, q_block)
    want = np.asarray(want, np.float32)
    for skip in (True, False) if K else (True,):  # entry tiles without a valid entry skipped, or computed
        got = sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink, d ** -0.5, window=W,
                                  block=query_block(S, q_block, W), impl="interpret", hb=16, bk=16,
                                  dv=min(32, d), skip_entries=skip)
        assert got.dtype == BF and got.shape == q.shape
        got = np.asarray(got, np.float32)
        # same rounding points; only fp32 summation orders differ: at most one bf16 ulp apart
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
        assert np.mean(got == want) > 0.99
    args = (q, pos, kw, kpos, cmp, idx, sink, d ** -0.5)
    tiles = dict(window=W, block=query_block(S, q_block, W), impl="interpret", hb=16, bk=16, dv=min(32, d))
    # the max launch on key tiles of its own (the default: 64 keys) gives the same maximum
    same = [np.asarray(sparse_attn_prefill(*args, **tiles, max_bk=b), np.float32) for b in (16, 32, None)]
    np.testing.assert_array_equal(same[0], same[1])
    np.testing.assert_array_equal(same[0], same[2])
    # ``lazy``: the maximum and the sum as per-lane partials reduced once per row: the same rounding
    # points (the maximum exact), another fp32 summation order of the sum
    lazy = np.asarray(sparse_attn_prefill(*args, **tiles, lazy=True), np.float32)
    np.testing.assert_allclose(lazy, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(lazy == same[0]) > 0.99
    # ``window_range`` / ``entry_range`` (on by default): a loop over the range of tiles holding a
    # valid key / selected entry, without a branch per tile, against the loops over every tile with
    # a branch per window tile: the same products and sums in the same order (dead tiles add exact
    # zeros and -inf maxima)
    every = np.asarray(sparse_attn_prefill(*args, **tiles, window_range=False, entry_range=False), np.float32)
    np.testing.assert_allclose(every, want, rtol=2 ** -7, atol=1e-6)
    for opts in (dict(window_range=True, entry_range=False), dict(window_range=True, entry_range=True),
                 dict(window_range=False, entry_range=True)):
        ranged = np.asarray(sparse_attn_prefill(*args, **tiles, **opts), np.float32)
        np.testing.assert_array_equal(ranged, every, err_msg=str(opts))
        if not K:
            break
    # ``store_logits`` (the default): the output launch reads the max launch's logits instead of
    # recomputing them: the same values, so the same output (also with other max tiles and value
    # slices), as the recomputing form and as the form past ``STORE_MAX_BYTES`` (which recomputes)
    recomputed = np.asarray(sparse_attn_prefill(*args, **tiles, store_logits=False), np.float32)
    np.testing.assert_array_equal(recomputed, same[0])
    for opts in (dict(store_logits=True), dict(store_logits=True, max_bk=32, dv=16),
                 dict(store_logits=True, window_range=False, entry_range=False)):
        stored = np.asarray(sparse_attn_prefill(*args, **{**tiles, **opts}), np.float32)
        np.testing.assert_array_equal(stored, same[0], err_msg=str(opts))
    # the online form (one launch, running maximum): p rounded to bf16 against the maximum so far,
    # so bf16 roundings of p move; within a few bf16 ulps of the output's scale
    online = np.asarray(sparse_attn_prefill(*args, **tiles, online=True), np.float32)
    assert np.abs(online - want).max() <= 2 ** -6 * np.abs(want).max()
    assert not np.allclose(online, 0)


@pytest.mark.parametrize("window_range,entry_range,K", [(False, False, 0), (True, False, 0), (False, False, 64),
                                                         (True, True, 64)])
def test_triton_lowering_for_cuda(window_range, entry_range, K, triton_modules):
    """Both launches lower to Triton for CUDA (checked without a GPU, the Triton modules captured
    as Pallas lowers them). With ``window_range`` / ``entry_range`` a loop gets a first pass over
    the key positions / entry ids and then dynamic bounds without a branch per tile: each must stay
    an ``scf.for`` (a loop Triton pipelines), never an ``scf.while``, and the window tiles' branch
    (the only ``scf.if``: entry tiles are not skipped by default) goes."""
    f = jax.jit(lambda *a: sparse_attn_prefill(*a, 512 ** -0.5, window=128, block=256, impl="triton",
                                               window_range=window_range, entry_range=entry_range))
    S, H, d, W = 512, 64, 512, 128
    sd = jax.ShapeDtypeStruct
    args = (sd((1, S, H, d), BF), sd((1, S), jnp.int32), sd((1, W + S, d), BF), sd((1, W + S), jnp.int32),
            sd((1, S // 2, d), BF) if K else None, sd((1, S, K), jnp.int32) if K else None, sd((H,), jnp.float32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert [name for name, _ in triton_modules] == ["attn_prefill_max", "attn_prefill_out"]
    loops = 1 + window_range + (1 + entry_range if K else 0)  # each ranged loop adds its first pass
    for name, asm in triton_modules:
        assert asm.count("scf.for") == loops and "scf.while" not in asm, name
        assert ("scf.if" in asm) != window_range, name


def test_stored_logits_lowering_for_cuda(triton_modules):
    """With ``store_logits`` the max launch stores the logits (two stores more: window and entry
    loops) and the output launch makes half the dots (no ``q @ keys``), lowered for CUDA."""
    S, H, d, W, K = 512, 64, 512, 128, 64
    sd = jax.ShapeDtypeStruct
    args = (sd((1, S, H, d), BF), sd((1, S), jnp.int32), sd((1, W + S, d), BF), sd((1, W + S), jnp.int32),
            sd((1, S // 2, d), BF), sd((1, S, K), jnp.int32), sd((H,), jnp.float32))
    for store in (False, True):
        f = jax.jit(lambda *a: sparse_attn_prefill(*a, d ** -0.5, window=W, block=256, impl="triton",
                                                   store_logits=store, dv=256, num_warps=4))
        f.trace(*args).lower(lowering_platforms=("cuda",))
    (n0, max0), (o0, out0), (n1, max1), (o1, out1) = triton_modules
    assert (n0, o0, n1, o1) == ("attn_prefill_max", "attn_prefill_out") * 2
    assert max1.count("tt.store") == max0.count("tt.store") + 2 and max1.count("tt.dot") == max0.count("tt.dot")
    assert out1.count("tt.dot") * 2 == out0.count("tt.dot") > 0


def test_stored_logits_default_and_size_cap(triton_modules, monkeypatch):
    """The default stores the logits and runs the output launch on ``store_dv`` columns and
    ``store_warps`` warps; a chunk whose logits pass ``STORE_MAX_BYTES`` recomputes them on ``dv``
    / ``num_warps`` (the grids and the Triton modules' warp counts show which)."""
    import dsv41_jax.kernels.attn_prefill as AP

    S, H, d, W, K = 512, 64, 512, 128, 64
    sd = jax.ShapeDtypeStruct
    args = (sd((1, S, H, d), BF), sd((1, S), jnp.int32), sd((1, W + S, d), BF), sd((1, W + S), jnp.int32),
            sd((1, S // 2, d), BF), sd((1, S, K), jnp.int32), sd((H,), jnp.float32))
    need = S * H * (W + 256 + K) * 4  # the logits buffer of this chunk
    outs = {}
    for cap in (need, need - 1):  # a fresh jit each: the cap is read when tracing
        monkeypatch.setattr(AP, "STORE_MAX_BYTES", cap)
        f = jax.jit(lambda *a: sparse_attn_prefill(*a, d ** -0.5, window=W, block=256, impl="triton"))
        outs[cap] = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (_, max_s), (_, out_s), (_, max_r), (_, out_r) = triton_modules
    assert max_s.count("tt.store") == max_r.count("tt.store") + 2          # stored only under the cap
    assert out_s.count("tt.dot") * 2 == out_r.count("tt.dot") > 0
    assert f"{S}x{H}x{W + 256 + K}xf32" in outs[need] and f"{S}x{H}x{W + 256 + K}xf32" not in outs[need - 1]

    def out_launch(text):  # the output launch's value slices (grid z) and warps, from its custom call
        call = [ln for ln in text.splitlines() if "custom_call" in ln][-1]
        return (int(re.search(r"grid_z = (\d+)", call).group(1)), int(re.search(r"num_warps = (\d+)", call).group(1)))

    assert out_launch(outs[need]) == (d // AP.TILES["store_dv"], AP.TILES["store_warps"]) == (2, 4)
    assert out_launch(outs[need - 1]) == (d // AP.TILES["dv"], AP.TILES["num_warps"]) == (1, 8)


def test_bad_shapes_are_refused():
    q, pos, kw, kpos, cmp, idx, sink = _case(1, 8, 16, 64, 4, 5, 4)
    kw_args = dict(window=4, block=0, impl="interpret")
    with pytest.raises(ValueError, match="kpos"):
        sparse_attn_prefill(q, pos, kw, kpos[:, 1:], cmp, idx, sink, 1.0, **kw_args)
    with pytest.raises(ValueError, match="powers of two"):
        sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink, 1.0, bk=24, **kw_args)
    with pytest.raises(ValueError, match="block dividing"):
        sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink, 1.0, window=4, block=3, impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        sparse_attn_prefill(q, pos, kw, kpos, cmp, idx, sink, 1.0, window=4, block=0, impl="xla")


@pytest.mark.parametrize("online", [False, True], ids=["two-launch", "online"])
def test_golden_bf16_case_with_attention_on_the_kernel(online, monkeypatch):
    """Every attention chunk of the bf16 golden case (its 40-token prefill and its decode steps)
    through the kernel in the interpreter, checked by ``verify`` against the official outputs;
    also the online opt-in (its other bf16 roundings of p stay within the case's tolerances)."""
    import dsv41_jax.kernels.attn_prefill as AP
    from dsv41_jax.verify import run_case

    case = os.path.join(GOLDEN, "text_bf16")
    if not os.path.isdir(case):
        pytest.fail("golden case text_bf16 missing")
    monkeypatch.setenv("DSV41_ATTN_PREFILL_KERNEL", "interpret")
    if online:
        monkeypatch.setenv("DSV41_ATTN_PREFILL_TILES", '{"online": true}')
    monkeypatch.setattr(AP, "MIN_TOKENS", 0)  # the case's chunks are short: take the kernel for all of them
    calls = []
    real = AP.sparse_attn_prefill
    monkeypatch.setattr(AP, "sparse_attn_prefill", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    jax.clear_caches()  # executables traced with the XLA form must not be reused
    res = run_case(case, ("prefill", "decode"), log=lambda s: None)
    failed = [f"{r.kind} {r.name}: {r.detail}" for r in res if r.ok is False]
    assert res and not failed, "\n".join(failed)
    assert {r.kind for r in res} == {"prefill", "decode"}
    assert any(s[1] >= 40 for s in calls) and any(s[1] == 1 for s in calls), calls


def test_switch_and_tiles_env(monkeypatch):
    """The model takes the kernel for prefill chunks only (more than ``MIN_TOKENS`` tokens per row),
    never by default off the GPU; a bad ``DSV41_ATTN_PREFILL_TILES`` is one clear error."""
    import dsv41_jax.kernels.attn_prefill as AP

    def attend_kernel(S, text_attention="exact"):
        q, pos, kw, kpos, cmp, idx, sink = _case(1, S, 16, 32, 4, 6, 4)
        fake = SimpleNamespace(numerics=SimpleNamespace(dtype=BF, text_attention=text_attention), window=4,
                               head_dim=32, attn_sink=sink)
        return Attention._attend_kernel(fake, q, pos, kw, kpos, cmp, idx, 0)

    monkeypatch.delenv("DSV41_ATTN_PREFILL_KERNEL", raising=False)
    assert attend_kernel(AP.MIN_TOKENS + 1) is None  # default "1": the kernel only where the Pallas kernels run
    monkeypatch.setenv("DSV41_ATTN_PREFILL_KERNEL", "interpret")
    assert attend_kernel(AP.MIN_TOKENS) is None      # decode steps and short chunks keep XLA's form
    monkeypatch.setattr(AP, "MIN_TOKENS", 4)
    assert attend_kernel(5).shape == (1, 5, 16, 32)
    # Numerics.text_attention "online" asks the kernel for its one-launch form; "exact" leaves the tiles' choice
    seen = []
    real = AP.sparse_attn_prefill
    monkeypatch.setattr(AP, "sparse_attn_prefill", lambda *a, **k: seen.append(k.get("online")) or real(*a, **k))
    exact, online = attend_kernel(5), attend_kernel(5, "online")
    assert seen == [None, True] and online.shape == exact.shape and not np.array_equal(online, exact)
    monkeypatch.setattr(AP, "sparse_attn_prefill", real)
    monkeypatch.setenv("DSV41_ATTN_PREFILL_TILES", '{"bq": 8}')
    with pytest.raises(ValueError, match="unknown fields"):
        attend_kernel(5)
    monkeypatch.setenv("DSV41_ATTN_PREFILL_TILES", "dv=64")
    with pytest.raises(ValueError, match="not a JSON object"):
        attend_kernel(5)


def test_text_attention_option(monkeypatch):
    """``Numerics.text_attention`` takes "exact" (default) or "online" (one clear error otherwise);
    ``load(text_attention=...)`` and ``generate --text-attention`` pass it on."""
    import dsv41_jax
    from dsv41_jax import cli
    from dsv41_jax.numerics import Numerics

    assert Numerics().text_attention == "exact"
    with pytest.raises(ValueError, match="text_attention"):
        Numerics("bfloat16", "reference", "fp32", "flash")
    m = dsv41_jax.load(os.path.join(GOLDEN, "text_bf16"), text_attention="online", tokenizer=False)
    assert m.numerics.text_attention == "online"
    from flax import nnx
    layers = [a for _, a in nnx.iter_graph(m.model) if isinstance(a, Attention)]
    assert layers and {a.numerics.text_attention for a in layers} == {"online"}
    seen = {}
    monkeypatch.setattr(dsv41_jax, "load", lambda path, **kw: seen.update(kw))
    cli._load(cli.build_parser().parse_args(["generate", "m", "p", "--text-attention", "online"]))
    assert seen["text_attention"] == "online"
    assert cli.build_parser().parse_args(["generate", "m", "p"]).text_attention == "exact"
