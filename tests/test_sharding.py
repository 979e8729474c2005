"""Sharding: partition rules, expert-parallel MoE, sharded prefill/decode and verify on meshes.

The multi-device checks run in a subprocess with 8 simulated CPU devices
(``--xla_force_host_platform_device_count=8``), because the pytest process may already have
initialised jax with one device. This file is also that subprocess' entry point
(``python tests/test_sharding.py CHILD_TASK``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
N_DEV = 8

# tiny config sized to divide the 8-device meshes: 8 query heads, 8 output groups, 8 indexer
# heads, 16 experts, vocab 256; 3 layers (CPU compile time dominates) still cover a ratio-2 kv and
# index source (0), a ratio-1 kv, index and candidate source (1), a layer reading layer 1's
# compressed KV and index keys and using its candidates (2), and two Engram layers.
MESH_CONFIG = {"text_config": {
    "num_attention_heads": 8, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32,
    "o_groups": 8, "o_lora_rank": 16, "n_routed_experts": 16, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "compress_ratios": [2, 1, 1],
    "kv_source_layer_ids": [0, 1], "index_source_layer_ids": [0, 1, 2], "candidate_source_layer_id": 1,
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 6, "engram_layer_ids": [0, 1],
}}
# 8-way tensor, 8-way expert and all three axes at once; (8, 1, 1) and (1, 4, 2) ran here until
# session 11 (they passed every run) and still run with DSV41_SHARDING_MESHES="8,1,1;1,4,2"
# (about 13 s of CPU each), added to these
MESHES = ((1, 1, 8), (1, 8, 1), (2, 2, 2)) + tuple(
    tuple(int(v) for v in m.split(",")) for m in os.environ.get("DSV41_SHARDING_MESHES", "").split(";") if m.strip())
# the golden dim-64 family has 4 heads, 2 output groups, 6 experts, batch 1: (1,3,2) splits
# experts 3 ways and heads/groups/intermediate 2 ways (and pads the Engram tables). More meshes
# (e.g. 1,2,2 / 1,6,1) via DSV41_SHARDING_GOLDEN_MESHES="1,2,2;1,6,1" (each costs ~25 s of CPU).
GOLDEN_MESHES = tuple(tuple(int(v) for v in m.split(","))
                      for m in os.environ.get("DSV41_SHARDING_GOLDEN_MESHES", "1,3,2").split(";") if m.strip())
TOL = 1e-5


def _run_child(task: str, *args: str, timeout: int = 600) -> dict:
    env = dict(os.environ)
    # optimization level 0 halves the CPU compile time (which dominates); both sides of every
    # comparison run in the child under the same flags
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEV}"
                        " --xla_backend_optimization_level=0").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), task, *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    out = p.stdout
    if p.returncode != 0 or "RESULT " not in out:
        raise AssertionError(f"child {task} failed (rc {p.returncode}):\n{out[-4000:]}\n{p.stderr[-6000:]}")
    print(out)
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0])


# ============================================================================ in-process tests
def test_rules_cover_every_leaf_and_split_the_large_ones():
    """Every parameter/cache leaf of the V4.1-Flash model matches a rule; every tensor over 64 MiB
    is split on the 8-device meshes; per-device bytes with fp4 experts fit 8 x 141 GB."""
    import jax
    from flax import nnx
    from dsv41_jax import sharding as shd
    from dsv41_jax.cache import init_cache
    from dsv41_jax.config import preset
    from dsv41_jax.model.lm import DeepseekV41
    from dsv41_jax.numerics import REFERENCE_BF16

    from dsv41_jax.weights import release_fp8_linears

    cfg = preset("v41-flash")
    plain = nnx.eval_shape(lambda: DeepseekV41(cfg, REFERENCE_BF16, engram_quantized=True, text_only=True))
    # the release fp8 Linears in fp8 storage (dense_fp8): e4m3 codes + their ue8m0 ``scale`` leaves
    model = nnx.eval_shape(lambda: DeepseekV41(cfg, REFERENCE_BF16, engram_quantized=True, text_only=True,
                                               dense_fp8=release_fp8_linears(plain)))
    cache = jax.eval_shape(lambda: init_cache(cfg.text, 8, 65536, jax.numpy.bfloat16))

    def bpe(name, dtype):  # the release fp4 experts (+ ue8m0 per 32); everything else as stored
        if ".ffn.experts." in name:
            return 0.5 + 1 / 32
        return np.dtype(dtype).itemsize

    for spec in ((1, 8, 1), (1, 4, 2), (2, 4, 1)):
        mesh = _fake_mesh(spec)
        pls = shd.param_placements(model, mesh, strict=False) + shd.cache_placements(cache, mesh)
        unmatched = [p.name for p in pls if p.logical is None]
        assert not unmatched, f"no partition rule for {unmatched[:10]}"
        rows = shd.shardings_table(model, mesh, cache=cache, bytes_per_element=bpe)
        big = [r for r in rows if r["bytes"] > 64 * 2**20 and r["spec"] == "replicated"
               and not r["name"].startswith("cache.")]
        assert not big, f"large replicated tensors on {spec}: {[(r['name'], r['bytes']) for r in big[:5]]}"
        per_dev = sum(r["bytes_per_device"] for r in rows)
        print(f"mesh {spec}: {per_dev / 1e9:.1f} GB per device (params + 8x64k cache)")
        if spec[0] == 1:
            assert per_dev < 141e9, f"{spec}: {per_dev / 1e9:.1f} GB per device does not fit 141 GB"
    print(shd.format_table(shd.shardings_table(model, _fake_mesh((1, 8, 1)), bytes_per_element=bpe), max_rows=60))


class _fake_mesh:
    """Just enough of a mesh (``.shape``) for the placement/table functions (no devices needed)."""

    def __init__(self, spec):
        from dsv41_jax.sharding import AXES

        self.shape = dict(zip(AXES, spec))


def test_divisibility_fallback_and_strict_error():
    from dsv41_jax import sharding as shd

    mesh = _fake_mesh((1, 4, 2))
    p = shd.placement("layers.0.ffn.experts.w1.weight", (6, 32, 64), mesh)
    assert tuple(p.spec) == (None, "tensor") and "experts" in p.notes[0] and "expert(4)" in p.notes[0]
    p = shd.placement("layers.1.engram.embed.weight", (272, 32), _fake_mesh((1, 3, 2)))
    assert tuple(p.spec) == (("expert", "tensor"),) and p.padded_shape == (276, 32) and not p.notes
    p = shd.placement("layers.1.engram.embed.weight", (384, 32), _fake_mesh((1, 3, 2)))
    assert tuple(p.spec) == (("expert", "tensor"),) and p.padded_shape is None and not p.notes
    p = shd.placement("embed.weight", (256, 64), _fake_mesh((1, 3, 2)))
    assert tuple(p.spec) == ("tensor",) and "expert(3)" in p.notes[0]
    p = shd.placement("cache.layers.2.cmp_kv", (1, 16, 64), _fake_mesh((2, 1, 1)))
    assert tuple(p.spec) == () and "batch" in p.notes[0]
    with pytest.raises(shd.ShardingError, match=r"experts.*expert\(4\)"):
        shd.placement("layers.0.ffn.experts.w1.weight", (6, 32, 64), mesh, strict=True)
    with pytest.raises(shd.ShardingError, match="no partition rule"):
        shd.placement("layers.0.attn.new_thing.weight", (4, 4), mesh, strict=True)
    assert tuple(shd.placement("layers.0.attn.wq_b.weight", (256, 32), mesh).spec) == ("tensor",)
    assert tuple(shd.placement("layers.0.attn.wo_b.weight", (64, 128), mesh).spec) == (None, "tensor")
    assert tuple(shd.placement("layers.0.attn.wkv.weight", (64, 64), mesh).spec) == ()
    with pytest.raises(shd.ShardingError, match="three positive integers"):
        shd.parse_mesh_spec("2,2")
    assert shd.parse_mesh_spec("1,3,2") == (1, 3, 2)


def test_sharded_model_and_moe_on_8_devices():
    """Child: EP MoE alone (fp32 and bf16 reference numerics) and the 5-layer model (text + image
    prompts, prefill + greedy decode) on every mesh of MESHES against one device."""
    res = _run_child("model")
    bad = {k: v for k, v in res.items() if not v["ok"]}
    assert not bad, bad


def test_generate_on_a_mesh_equals_one_device():
    """Child: ``load(path, mesh=...)`` then ``generate`` (whole and chunked prefill), the stream
    and a repeat call (no recompile) with a text and an image prompt, for meshes (1,8,1) and
    (2,2,2): the same greedy tokens as the unsharded model."""
    res = _run_child("generate")
    bad = {k: v for k, v in res.items() if not v["ok"]}
    assert not bad, bad
    assert len(res) == len(GENERATE_MESHES) + 1


def test_mesh_from_spec_creates_simulated_devices_before_init():
    """A fresh process: mesh_from_spec adds simulated CPU devices; once jax is initialised a larger
    mesh is a clear error that names XLA_FLAGS."""
    code = ("from dsv41_jax import sharding as s; m = s.mesh_from_spec('1,3,2'); "
            "print(dict(m.shape), m.devices.size)\n"
            "try:\n    s.mesh_from_spec('2,4,2')\nexcept s.ShardingError as e:\n    print('ERR', e)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "{'data': 1, 'expert': 3, 'tensor': 2} 6" in p.stdout, p.stdout
    assert "ERR" in p.stdout and "16 devices" in p.stdout and "xla_force_host_platform_device_count=16" in p.stdout


@pytest.mark.skipif(not os.path.isdir(os.path.join(GOLDEN, "text_fast_fp32")), reason="golden case missing")
def test_verify_golden_on_meshes():
    res = _run_child("verify")
    bad = {k: v for k, v in res.items() if not v["ok"]}
    assert not bad, bad


# ============================================================================ child side
def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check_placed(model, mesh) -> list[str]:
    """Every variable's sharding is the rule's (names of the ones that are not)."""
    from flax import nnx

    from dsv41_jax import sharding as shd

    bad = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = ".".join(str(p) for p in path)
        v = var.get_value()
        want = shd.spec_for(name, v.shape, mesh)
        got = v.sharding
        if not got.is_equivalent_to(jax_named(mesh, want), v.ndim):
            bad.append(f"{name}: {got.spec} != {want}")
    return bad


def jax_named(mesh, spec):
    from jax.sharding import NamedSharding

    return NamedSharding(mesh, spec)


def _child_moe(out: dict):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax import sharding as shd
    from dsv41_jax.config import preset, with_text_overrides
    from dsv41_jax.model.moe import MoE
    from dsv41_jax.numerics import Numerics

    rng = np.random.default_rng(0)
    # (compute dtype, mode, experts, tokens, meshes). Every multi-device mesh runs the routed
    # experts in shard_map, "tensor"-only and "data"-only ones included. 8 experts: T=2 is the decode path (only the
    # selected local experts' weights), T=24 dense over local experts; 64 experts, T=48: the
    # unsharded grouped matmul on the local experts (fp32 with the intermediate split; bf16
    # without), or dense (bf16 with the split, where the "tensor" psum precedes the rounding).
    cases = (
        ("float32", "fast", 8, (2, 24), ((1, 2, 2), (2, 4, 1), (1, 4, 2), (1, 1, 2), (2, 1, 1))),
        ("float32", "reference", 8, (2, 24), ((1, 4, 2),)),  # fake-quant blocks of h, split intermediate
        ("bfloat16", "reference", 8, (2, 24), ((1, 2, 2),)),
        ("float32", "fast", 64, (48,), ((1, 2, 2),)),
        ("bfloat16", "reference", 64, (48,), ((2, 2, 1), (1, 2, 2))),
    )
    # int8 experts (codes + ue8m0 scales go into shard_map sharded like the weights; each shard
    # dequantizes what it reads): decode gather, local dense with the intermediate split, grouped
    cases = tuple((*c, False) for c in cases) + (
        ("float32", "fast", 8, (2, 24), ((1, 2, 2), (1, 4, 2)), True),
        ("bfloat16", "reference", 64, (48,), ((1, 2, 2), (1, 1, 2)), True),
    )
    for cdt, mode, E, Ts, meshes, int8 in cases:
        num, quantized = Numerics(cdt, mode), mode == "reference"
        cfg = with_text_overrides(preset("tiny"), n_routed_experts=E, moe_intermediate_size=64)
        m = MoE(cfg.text, num, vision=True, experts_int8=int8)
        st = nnx.state(m)
        for _, v in nnx.to_flat_state(st):
            a = v.get_value()
            if a.dtype == jnp.int8:
                v.set_value(jnp.asarray(rng.integers(-12, 13, a.shape), jnp.int8))
            elif a.dtype == jnp.uint8:
                v.set_value(jnp.asarray(rng.integers(122, 129, a.shape), jnp.uint8))
            else:
                v.set_value(jnp.asarray(rng.normal(0, 0.2, a.shape), a.dtype))
        nnx.update(m, st)
        m.experts.quantized = quantized
        for T in Ts:
            x = jnp.asarray(rng.normal(0, 1, (2, T // 2, 64)), num.dtype)
            im = jnp.asarray((np.arange(T).reshape(2, T // 2) % 3) == 0)
            gd, st = nnx.split(m)
            ref = jax.jit(lambda s, x, im: nnx.merge(gd, s)(x, im))(st, x, im)
            ref = np.asarray(ref.astype(jnp.float32))
            for spec in meshes:
                mesh = shd.make_mesh(*spec)
                m2 = shd.shard_model(nnx.clone(m), mesh)
                gd2, st2 = nnx.split(m2)
                with shd.use_mesh(mesh):
                    f = jax.jit(lambda s, x, im: nnx.merge(gd2, s)(x, im))
                    got = f(st2, x, im)
                    ep = "shard_map" in str(jax.make_jaxpr(lambda s, x, im: nnx.merge(gd2, s)(x, im))(st2, x, im))
                    from dsv41_jax.model import moe_ep

                    path = moe_ep.plan(m2, mesh, T)[2]
                err = _rel(np.asarray(got.astype(jnp.float32)), ref)
                # fp32: 1e-5; bf16: two bf16 ulps of the largest output (fp32 summation order
                # inside the matmuls may flip a rounding of an expert output)
                tol = TOL if num.dtype == jnp.float32 else 2.0 ** -6
                out[f"moe {cdt}/{mode}{' int8' if int8 else ''} E={E} T={T} mesh={spec} ({path})"] = dict(
                    ok=bool(err <= tol and ep), err=err, expert_parallel=ep)


def _greedy(model, ids, embeds, image_mask, n_dec, max_len, mesh=None):
    import jax.numpy as jnp

    from dsv41_jax import sharding as shd
    from dsv41_jax.generate import forward_chunk

    B = ids.shape[0]
    cache = model.init_cache(B, max_len)
    if mesh is not None:
        cache = shd.shard_cache(cache, mesh)
        ids, embeds, image_mask = (shd.shard_batch(a, mesh) for a in (ids, embeds, image_mask))
    logits, cache = forward_chunk(model, ids, cache, inputs_embeds=embeds, image_mask=image_mask)
    pre = np.asarray(logits)
    toks, steps = [], []
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    for _ in range(n_dec):
        toks.append(np.asarray(nxt))
        lg, cache = forward_chunk(model, nxt, cache)
        steps.append(np.asarray(lg[:, -1]))
        nxt = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)[:, None]
    return pre, np.concatenate(toks, 1), np.stack(steps, 1), cache


def _child_model(out: dict, tmp: str):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax import sharding as shd
    from dsv41_jax.numerics import FAST_F32
    from dsv41_jax.tiny import write_tiny_checkpoint
    from dsv41_jax.weights import load_original

    jax.config.update("jax_default_matmul_precision", "highest")
    d = os.path.join(tmp, "mesh8")
    cfg = write_tiny_checkpoint(d, fmt="bf16", seed=5, config=MESH_CONFIG, vision=True)
    model = load_original(d, FAST_F32, text_only=True)
    B, S, n_dec = 8, 12, 3
    rng = np.random.default_rng(1)
    img_tok = cfg["image_token_id"]
    ids = rng.integers(3, 240, (B, S)).astype(np.int32)
    ids[:, 0] = 0
    image_mask = np.zeros((B, S), bool)
    image_mask[1::2, 2:7] = True  # odd rows are image prompts (a 5-row span), even rows text
    ids[image_mask] = img_tok
    ids, image_mask = jnp.asarray(ids), jnp.asarray(image_mask)
    embeds = model.embed(ids, jnp.float32)
    embeds = jnp.where(image_mask[..., None], jnp.asarray(rng.normal(0, 1, embeds.shape), jnp.float32), embeds)
    ref_pre, ref_tok, ref_dec, _ = _greedy(model, ids, embeds, image_mask, n_dec, S + n_dec + 1)
    for spec in MESHES:
        t0 = time.time()
        mesh = shd.make_mesh(*spec)
        notes: list[str] = []
        m = shd.shard_model(nnx.clone(model), mesh, notes=notes)
        misplaced = _check_placed(m, mesh)
        with shd.use_mesh(mesh):
            pre, tok, dec, cache = _greedy(m, ids, embeds, image_mask, n_dec, S + n_dec + 1, mesh)
        e_pre, e_dec = _rel(pre, ref_pre), _rel(dec, ref_dec)
        same = bool(np.array_equal(tok, ref_tok))
        # the cache coming out of the decode steps still has the rule's layout (no drift, no recompiles)
        want = jax.tree_util.tree_leaves(shd.cache_shardings(cache, mesh))
        drift = [jax.tree_util.keystr(p) for (p, a), w in zip(jax.tree_util.tree_flatten_with_path(cache)[0], want)
                 if not a.sharding.is_equivalent_to(w, a.ndim)]
        ok = e_pre <= TOL and e_dec <= TOL and same and not misplaced and not notes and not drift
        out[f"model mesh={spec}"] = dict(ok=bool(ok), prefill=e_pre, decode=e_dec, tokens_equal=same,
                                         misplaced=misplaced[:5], cache_drift=drift[:5], notes=notes[:5],
                                         seconds=round(time.time() - t0, 1))


def _child_verify(out: dict):
    from dsv41_jax import sharding as shd
    from dsv41_jax.verify import run_case

    case = os.path.join(GOLDEN, "text_fast_fp32")
    for spec in GOLDEN_MESHES:
        t0 = time.time()
        # "decode" runs the one-shot prefill and every decode step through generate.forward_chunk
        res = run_case(case, ("decode",), mesh=shd.mesh_from_spec(",".join(map(str, spec))),
                       log=lambda s: None)
        failed = [f"{r.name}: {r.detail}" for r in res if r.ok is not True]
        out[f"verify text_fast_fp32 mesh={spec}"] = dict(ok=bool(res) and not failed, checks=len(res),
                                                         failed=failed[:5], seconds=round(time.time() - t0, 1))


GENERATE_MESHES = ((1, 8, 1), (2, 2, 2))


def _check_auto_split(out: dict):
    """Where the Pallas kernels may run: outside shard_map only where their weights are not
    split (fp8 Linears: no "tensor" split), inside shard_map always (manual axes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from dsv41_jax import sharding as shd
    from dsv41_jax.kernels import auto_split
    from dsv41_jax.model.moe_ep import shard_map

    seen = {"no mesh": auto_split()}
    with shd.use_mesh(shd.make_mesh(1, 1, 1)):
        seen["one device"] = auto_split()
    for spec in ((1, 8, 1), (1, 1, 8), (2, 2, 2)):
        mesh = shd.make_mesh(*spec)
        with shd.use_mesh(mesh):
            seen[f"{spec} tensor"] = auto_split("tensor")
            seen[f"{spec} any"] = auto_split()
            inside = {}

            def body(x):
                inside["v"] = auto_split()
                return x

            jax.jit(shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.zeros(4))
            seen[f"{spec} in shard_map"] = inside["v"]
    want = {"no mesh": False, "one device": False, "(1, 8, 1) tensor": False, "(1, 8, 1) any": True, "(1, 8, 1) in shard_map": False,
            "(1, 1, 8) tensor": True, "(1, 1, 8) any": True, "(1, 1, 8) in shard_map": False,
            "(2, 2, 2) tensor": True, "(2, 2, 2) any": True, "(2, 2, 2) in shard_map": False}
    out["kernels.auto_split"] = dict(ok=seen == want, seen=seen)


def _child_generate(out: dict, tmp: str):
    """The user path: ``load(..., mesh=)`` then ``generate`` / ``generate_stream`` with a text
    and an image prompt, against the same checkpoint on one device."""
    import jax
    from PIL import Image

    from dsv41_jax import api
    from dsv41_jax.generate import compile_stats
    from dsv41_jax.tiny import write_tiny_checkpoint

    jax.config.update("jax_default_matmul_precision", "highest")
    _check_auto_split(out)
    d = os.path.join(tmp, "gen8")
    cfg = write_tiny_checkpoint(d, fmt="bf16", seed=6, config=MESH_CONFIG, vision=True)
    img = Image.fromarray(np.random.default_rng(3).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    prompts = [[0, 11, 12, 13, 14, 15, 16], [0, 21, cfg["image_token_id"], 22, 23]]
    images = [[], [img]]
    kw = dict(max_new_tokens=5)
    ref = api.load(d, numerics="fast", dtype="float32").generate(prompts, images, **kw).tokens
    for spec in GENERATE_MESHES:
        t0 = time.time()
        m = api.load(d, numerics="fast", dtype="float32", mesh=",".join(map(str, spec)))
        got = m.generate(prompts, images, **kw).tokens
        chunked = m.generate(prompts, images, prefill_chunk=4, **kw).tokens
        streamed = [s.tokens for s in m.generate(prompts, images, stream=True, **kw)]
        streamed = [[t for t in col if t is not None] for col in zip(*streamed)]
        before = compile_stats()["compiles"]
        again = m.generate(prompts, images, **kw).tokens
        recompiles = compile_stats()["compiles"] - before
        ok = got == ref and chunked == ref and streamed == ref and again == ref and recompiles == 0
        out[f"generate mesh={spec}"] = dict(ok=bool(ok), tokens=got, chunked=chunked, streamed=streamed, ref=ref,
                                            recompiles=recompiles, seconds=round(time.time() - t0, 1))


def _child(task: str):
    import tempfile

    import jax

    assert jax.device_count() >= N_DEV, f"expected {N_DEV} simulated devices, got {jax.devices()}"
    out: dict = {}
    t0 = time.time()
    if task == "model":
        _child_moe(out)
        with tempfile.TemporaryDirectory() as tmp:
            _child_model(out, tmp)
    elif task == "generate":
        with tempfile.TemporaryDirectory() as tmp:
            _child_generate(out, tmp)
    elif task == "verify":
        _child_verify(out)
    else:
        raise SystemExit(f"unknown task {task}")
    for k, v in out.items():
        print(("ok  " if v["ok"] else "BAD ") + k, {a: b for a, b in v.items() if a != "ok"})
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{task}: {time.time() - t0:.1f}s wall, {ru.ru_utime + ru.ru_stime:.1f}s cpu")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    _child(sys.argv[1])
