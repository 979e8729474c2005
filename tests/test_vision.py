"""Vision tower, aligner and span assembly: golden cases, a torch oracle, padding, batching, DP."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import processor as P
from dsv41_jax.config import ModelConfig, VisionConfig
from dsv41_jax.model.aligner import merge_index, merge_windows
from dsv41_jax.model.span import assemble_spans, merge_spans
from dsv41_jax.model.vision import build_vision, encode_images, exact_bucket, load_vision_weights
from dsv41_jax.numerics import Numerics
from dsv41_jax.safetensors_io import Checkpoint
from tests.torch_ref.vision import torch_tower

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
IMAGE_CASES = ["image_fast_fp32", "image_fp32", "image_fp8"]
VECTOR_NAMES = ("image_start", "image_newline", "image_end")


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = np.abs(ref).max()
    return np.abs(got - ref).max() / scale, np.abs(got - ref).reshape(len(ref), -1).max(-1) / scale


def check_tolerance(name, got, ref, tol):
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    worst, per_row = rel_err(got, ref)
    if "max_abs_rel" in tol:
        assert worst <= tol["max_abs_rel"], f"{name}: max_abs_rel {worst:.3g} > {tol['max_abs_rel']}"
    if "frac_rows_within" in tol:
        fr = tol["frac_rows_within"]
        frac = float(np.mean(per_row <= fr["rel"]))
        assert frac >= fr["min_frac"], f"{name}: {frac:.3f} of rows within {fr['rel']} < {fr['min_frac']}"
    return worst


# ------------------------------------------------------------------------------ golden cases


class Case:
    def __init__(self, name):
        d = os.path.join(GOLDEN, name)
        self.dir = d
        self.case = json.load(open(os.path.join(d, "case.json")))
        self.cfg = ModelConfig.from_file(d)
        self.numerics = Numerics(self.case["compute_dtype"], self.case["numerics"])
        self.ref = np.load(os.path.join(d, "reference.npz"))
        ck = Checkpoint(d)
        self.vision, self.aligner = build_vision(self.cfg.vision, self.cfg.text.hidden_size, self.numerics)
        load_vision_weights(self.vision, self.aligner, ck)
        self.vectors = {n: ck.get(n).astype(np.float32) for n in VECTOR_NAMES}
        self.prompts = [P.prepare_inputs(row["prompt_ids"], [os.path.join(d, f) for f in row["images"]], self.cfg)
                        for row in self.case["batch"]]
        self.batch = P.stack_prompts(self.prompts)

    def encode(self, **kw):
        return encode_images(self.vision, self.aligner, self.vectors, self.batch.images, self.numerics,
                             return_details=True, **kw)


_CASES: dict[str, Case] = {}


def get_case(name) -> Case:
    if name not in _CASES:
        _CASES[name] = Case(name)
    return _CASES[name]


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_golden_inputs_exact(name):
    c = get_case(name)
    ref = c.ref
    np.testing.assert_array_equal(c.batch.input_ids, ref["input_ids"])
    np.testing.assert_array_equal(c.batch.types, ref["types"])
    np.testing.assert_array_equal(c.batch.image_mask, ref["types"] >= 0)
    patches = np.concatenate([im.patches for im in c.batch.images])
    assert patches.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(patches.astype(np.float32), ref["patches"])
    np.testing.assert_array_equal(np.array([im.vit_grid for im in c.batch.images]), ref["vit_grid"])
    np.testing.assert_array_equal(np.array([im.llm_grid for im in c.batch.images]), ref["llm_grid"])


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_golden_vision_outputs(name):
    c = get_case(name)
    out = c.encode()
    tol = c.case["tolerances"]
    errs = {}
    for key, arr in (("vit_out", out.vit_out), ("aligner_rows", out.aligner_rows), ("span_embeds", out.span_embeds)):
        assert arr.dtype == c.numerics.dtype
        errs[key] = check_tolerance(f"{name}/{key}", np.asarray(arr.astype(jnp.float32)), c.ref[key], tol[key])
    print(f"{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    if c.numerics.compute_dtype == "float32":
        assert max(errs.values()) <= 1e-5


@pytest.mark.parametrize("name", ["image_fast_fp32", "image_fp8"])
def test_pixels_sent_as_uint8_give_the_same_bits(name):
    """encode_images sends the images' uint8 pixels and normalizes them on the device
    (``processor.PIXEL_TABLE``): every output bit-equal to sending the host's bf16 patches, the
    table equal to ``normalize`` on every byte, and a group packs uint8 only when every image
    has its pixels."""
    import dataclasses

    from dsv41_jax.model import vision as V

    c = get_case(name)
    ims = list(c.batch.images)
    assert all(im.pixels is not None and im.pixels.dtype == np.uint8 for im in ims)
    for im in ims:
        np.testing.assert_array_equal(P.PIXEL_TABLE[im.pixels].view(np.uint16), im.patches.view(np.uint16))
    np.testing.assert_array_equal(P.PIXEL_TABLE.view(np.uint16),
                                  P.normalize(np.arange(256, dtype=np.uint8)).view(np.uint16))
    bf16_only = [dataclasses.replace(im, pixels=None) for im in ims]
    a = encode_images(c.vision, c.aligner, c.vectors, ims, c.numerics, return_details=True)
    b = encode_images(c.vision, c.aligner, c.vectors, bf16_only, c.numerics, return_details=True)
    for x, y in ((a.span_embeds, b.span_embeds), (a.aligner_rows, b.aligner_rows), (a.vit_out, b.vit_out)):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    same = V.pack_images([ims[0], bf16_only[0]], c.cfg.vision, pixels=True)
    assert len(same) == 1 and same[0].patches.dtype == ml_dtypes.bfloat16
    assert V.pack_images([ims[0]], c.cfg.vision, pixels=True)[0].patches.dtype == np.uint8
    assert V.pack_images([ims[0]], c.cfg.vision)[0].patches.dtype == ml_dtypes.bfloat16
    bad = dataclasses.replace(ims[0], pixels=ims[0].pixels[:-1])
    with pytest.raises(ValueError, match=re.escape(f"image {ims[0].name}: pixels")):
        V.pack_images([bad], c.cfg.vision, pixels=True)


@pytest.mark.parametrize("name", ["image_fast_fp32", "image_fp8"])
def test_golden_merge_into_embeddings(name):
    """merge_spans writes exactly span_embeds at the span positions and leaves text untouched."""
    c = get_case(name)
    spans = c.encode().span_embeds
    b, s = c.batch.input_ids.shape
    d = spans.shape[-1]
    embeds = jnp.asarray(np.random.default_rng(0).normal(size=(b, s, d)), c.numerics.dtype)
    merged = np.asarray(jax.jit(merge_spans)(embeds, spans, jnp.asarray(c.batch.types)).astype(jnp.float32))
    mask = c.batch.types >= 0
    np.testing.assert_array_equal(merged[mask], np.asarray(spans.astype(jnp.float32)))
    np.testing.assert_array_equal(merged[~mask], np.asarray(embeds.astype(jnp.float32))[~mask])


# ------------------------------------------------------------------------------ padding and batching


def test_padding_invariance():
    """Exact-size, default-bucket and heavily padded runs agree to fp32 rounding noise.

    Padded keys are masked (their probability is exactly 0); the only differences left come
    from the GEMM/reduction blocking XLA picks for the other shapes (a few ulp). Zero-filled
    pads are not neutral (the patch-embedding bias makes their keys non-zero), so a missing
    mask would show up here far above this bound.
    """
    c = get_case("image_fast_fp32")
    runs = [c.encode(bucket=exact_bucket), c.encode(), c.encode(bucket=lambda n: 200)]
    for other in runs[1:]:
        for key in ("vit_out", "aligner_rows", "span_embeds"):
            a, b = np.asarray(getattr(runs[0], key)), np.asarray(getattr(other, key))
            assert rel_err(b, a)[0] <= 2e-6, (key, rel_err(b, a)[0])
        delimiters = [0, 4, 9]  # START, NEW_LINE, END: copied vectors, exact
        np.testing.assert_array_equal(np.asarray(runs[0].span_embeds)[delimiters], np.asarray(other.span_embeds)[delimiters])


def test_query_blocks_match_full_attention():
    """A large image (bucket 2560 -> attention in query blocks of 512) equals the unblocked run."""
    from dsv41_jax.model.vision import _query_block, default_bucket

    assert default_bucket(2500) == 2560 and _query_block(2560) == 512 and _query_block(2500) == 0
    params = random_params(TINY, 24, seed=3)
    numerics = Numerics("float32", "fast")
    vision, aligner = build_vision(TINY, 24, numerics)
    load_vision_weights(vision, aligner, DictCheckpoint(params))
    im = [synthetic_image((50, 50), TINY, 7)]
    blocked = encode_images(vision, aligner, params, im, numerics)
    full = encode_images(vision, aligner, params, im, numerics, bucket=exact_bucket)
    assert rel_err(np.asarray(blocked), np.asarray(full))[0] <= 2e-6


def synthetic_image(vit_grid, cfg: VisionConfig, seed, name=None) -> P.ProcessedImage:
    """A ProcessedImage with random bf16 patches on an arbitrary ViT grid."""
    n = vit_grid[0] * vit_grid[1]
    p = cfg.patch_size
    patches = np.random.default_rng(seed).uniform(-1, 1, size=(n, 3, p, p)).astype(ml_dtypes.bfloat16)
    r = cfg.downsample_ratio
    llm = (-(-vit_grid[0] // r), -(-vit_grid[1] // r))
    return P.ProcessedImage(name or f"synthetic {vit_grid}", patches, tuple(vit_grid), llm, P.image_token_types(*llm),
                            (0, 0), (vit_grid[1] * p, vit_grid[0] * p), (vit_grid[1] * p, vit_grid[0] * p))


def test_multi_image_matches_single():
    """Several images of different sizes in one call (one shared bucket group, one of their own)
    equal each image encoded alone, and their spans come back in order."""
    c = get_case("image_fast_fp32")
    cfg = c.cfg.vision
    ims = [synthetic_image(g, cfg, i) for i, g in enumerate([(5, 8), (1, 1), (9, 2), (12, 11)])]
    ims.insert(1, c.batch.images[0])
    together = encode_images(c.vision, c.aligner, c.vectors, ims, c.numerics, return_details=True)
    alone = [encode_images(c.vision, c.aligner, c.vectors, [im], c.numerics, return_details=True) for im in ims]
    for key in ("vit_out", "aligner_rows", "span_embeds"):
        want = np.concatenate([np.asarray(getattr(a, key)) for a in alone])
        np.testing.assert_allclose(np.asarray(getattr(together, key)), want, rtol=0, atol=1e-6 * np.abs(want).max(),
                                   err_msg=key)
    spans = np.asarray(together.span_embeds)
    assert spans.shape[0] == sum(im.span_len for im in ims)
    golden = c.ref["span_embeds"]  # the golden image is the second one
    np.testing.assert_allclose(spans[ims[0].span_len:][:10], golden, rtol=0, atol=1e-5 * np.abs(golden).max())

    # two prompts of a batch: spans are consumed in batch-major prompt order
    types = np.full((2, 40), -1, np.int64)
    types[0, 3:3 + ims[0].span_len] = ims[0].types
    types[1, 5:5 + ims[1].span_len] = ims[1].types
    two = encode_images(c.vision, c.aligner, c.vectors, ims[:2], c.numerics)
    merged = np.asarray(merge_spans(jnp.zeros((2, 40, two.shape[-1])), two, jnp.asarray(types)))
    np.testing.assert_array_equal(merged[1, 5:5 + ims[1].span_len], np.asarray(two)[ims[0].span_len:])
    assert not merged[1, :5].any() and not merged[0, :3].any()


def test_encode_and_merge_top_level():
    """encode_and_merge with a model-like object (embed + vision + aligner + image_* attributes)."""
    import types as pytypes

    from dsv41_jax.model.span import encode_and_merge

    c = get_case("image_fast_fp32")
    table = np.random.default_rng(1).normal(size=(c.cfg.text.vocab_size, c.cfg.text.hidden_size)).astype(np.float32)
    model = pytypes.SimpleNamespace(vision=c.vision, aligner=c.aligner, numerics=c.numerics,
                                    embed=lambda ids, dt: jnp.asarray(table)[ids].astype(dt),
                                    **{n: jnp.asarray(v) for n, v in c.vectors.items()})
    cap = {}
    emb = np.asarray(encode_and_merge(model, c.batch.input_ids, c.batch.types, [list(c.batch.images)], capture=cap))
    mask = c.batch.types >= 0
    np.testing.assert_array_equal(emb[~mask], table[c.batch.input_ids][~mask])
    np.testing.assert_array_equal(emb[mask], np.asarray(cap["span_embeds"]))
    assert rel_err(cap["span_embeds"], c.ref["span_embeds"])[0] <= 1e-5


def test_no_images():
    c = get_case("image_fast_fp32")
    out = encode_images(c.vision, c.aligner, c.vectors, [], c.numerics)
    assert out.shape == (0, c.cfg.text.hidden_size)
    emb = jnp.ones((1, 4, out.shape[-1]))
    assert merge_spans(emb, out, jnp.full((1, 4), -1)) is emb


def test_unfold_order_probe():
    """The 3x3 merge is channel-major (torch F.unfold): m[c*9 + ki*3 + kj] = G[3bi+ki, 3bj+kj, c]."""
    h, w, ch = 4, 7, 3
    g = (100 * np.arange(ch)[None, None, :] + 10 * np.arange(h)[:, None, None] + np.arange(w)[None, :, None]) + 1.0
    x = jnp.asarray(g.reshape(1, h * w, ch), jnp.float32)
    m = np.asarray(merge_windows(x, jnp.asarray(merge_index((h, w), 3, h * w)[None])))[0]
    assert m.shape == (2 * 3, ch * 9)
    np.testing.assert_array_equal(m[0, :12] - 1, [0, 1, 2, 10, 11, 12, 20, 21, 22, 100, 101, 102])
    # bottom-right output cell (bi=1, bj=2): only G[3, 6] is inside the grid, the rest is zero padding
    last = m[5].reshape(ch, 3, 3)
    np.testing.assert_array_equal(last[:, 0, 0] - 1, [36, 136, 236])
    assert not last.reshape(ch, 9)[:, 1:].any()


# ------------------------------------------------------------------------------ torch oracle

TINY = VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48, patch_size=4,
                    rope_theta=10000.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)
ORACLE_GRIDS = [(1, 1), (3, 3), (4, 7), (5, 5), (7, 2), (2, 9), (9, 2), (1, 10), (11, 1)]


def random_params(cfg: VisionConfig, out_dim: int, seed=0):
    """bf16-valued random weights (std 0.1; norm weights 1 + N(0, 0.1), fp32)."""
    rng = np.random.default_rng(seed)
    c, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    shapes = {"vision.patch_embed.proj.weight": (c, 3 * p * p), "vision.patch_embed.proj.bias": (c,),
              "vision.norm.weight": (c,), "aligner.w1.weight": (out_dim, c * 9), "aligner.w1.bias": (out_dim,),
              "aligner.w2.weight": (out_dim, out_dim), "aligner.w2.bias": (out_dim,)}
    for j in range(cfg.num_hidden_layers):
        pre = f"vision.blocks.{j}."
        shapes.update({pre + "norm1.weight": (c,), pre + "norm2.weight": (c,), pre + "attn.wqkv.weight": (3 * c, c),
                       pre + "attn.wqkv.bias": (3 * c,), pre + "attn.wo.weight": (c, c), pre + "attn.wo.bias": (c,),
                       pre + "mlp.w1.weight": (2 * i, c), pre + "mlp.w2.weight": (c, i)})
    out = {}
    for k, s in shapes.items():
        if "norm" in k:
            out[k] = (1 + 0.1 * rng.standard_normal(s)).astype(np.float32)
        else:
            out[k] = (0.1 * rng.standard_normal(s)).astype(ml_dtypes.bfloat16).astype(np.float32)
    for name in VECTOR_NAMES:
        out[name] = rng.standard_normal(out_dim).astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


class DictCheckpoint:
    def __init__(self, d):
        self.d = d
        self.names = list(d)

    def get(self, name):
        return self.d[name]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_oracle_random_grids(dtype):
    """Random grids incl. 1x1, non-multiples of 3, very tall and very wide, all in one call."""
    torch = pytest.importorskip("torch")
    out_dim = 24
    params = random_params(TINY, out_dim)
    numerics = Numerics(dtype, "fast" if dtype == "float32" else "reference")
    vision, aligner = build_vision(TINY, out_dim, numerics)
    load_vision_weights(vision, aligner, DictCheckpoint(params))
    ims = [synthetic_image(g, TINY, 10 + i) for i, g in enumerate(ORACLE_GRIDS)]
    got = encode_images(vision, aligner, params, ims, numerics, return_details=True)
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    vit_ref, rows_ref = zip(*(torch_tower(params, im.patches, im.vit_grid, TINY, tdt) for im in ims))
    vit_ref, rows_ref = np.concatenate(vit_ref), np.concatenate(rows_ref)
    spans_ref = np.asarray(assemble_spans(jnp.asarray(rows_ref), params, [im.types for im in ims], jnp.float32))
    errs = {}
    for key, ref in (("vit_out", vit_ref), ("aligner_rows", rows_ref), ("span_embeds", spans_ref)):
        errs[key] = rel_err(np.asarray(getattr(got, key).astype(jnp.float32)), ref)[0]
    print(f"torch oracle {dtype}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    limit = 1e-5 if dtype == "float32" else 2e-2
    assert max(errs.values()) <= limit, errs
    # the spans hold exactly START/NEW_LINE/END and the aligner rows in reading order
    spans = np.asarray(got.span_embeds.astype(jnp.float32))
    types = np.concatenate([im.types for im in ims])
    for code, name in zip((P.IMAGE_START, P.IMAGE_NEW_LINE, P.IMAGE_END), VECTOR_NAMES):
        np.testing.assert_array_equal(spans[types == code], np.broadcast_to(params[name], spans[types == code].shape))
    np.testing.assert_array_equal(spans[types == P.IMAGE], np.asarray(got.aligner_rows.astype(jnp.float32)))


def test_tower_runner_sees_weights_loaded_in_place():
    """encode_images splits the modules once (``vision._Tower``); weights assigned in place after the
    first call are used by the next, bit for bit as a tower built with them, and a second tower of
    the same structure reuses the compiled executable (no retrace)."""
    from dsv41_jax.model import vision as V

    out_dim = 24
    numerics = Numerics("float32", "fast")
    pa, pb = random_params(TINY, out_dim, seed=1), random_params(TINY, out_dim, seed=2)
    ims = [synthetic_image((4, 7), TINY, 3)]
    vision, aligner = build_vision(TINY, out_dim, numerics)
    load_vision_weights(vision, aligner, DictCheckpoint(pa))
    first = np.asarray(encode_images(vision, aligner, pa, ims, numerics))
    runner = V._TOWERS[vision]
    compiled = runner.fn._cache_size()
    load_vision_weights(vision, aligner, DictCheckpoint(pb))
    second = np.asarray(encode_images(vision, aligner, pb, ims, numerics))
    assert V._TOWERS[vision] is runner
    fresh_v, fresh_a = build_vision(TINY, out_dim, numerics)
    load_vision_weights(fresh_v, fresh_a, DictCheckpoint(pb))
    np.testing.assert_array_equal(second, np.asarray(encode_images(fresh_v, fresh_a, pb, ims, numerics)))
    assert V._TOWERS[fresh_v].fn is runner.fn  # equal structure: one jitted function
    assert runner.fn._cache_size() == compiled  # no retrace: same weights' shapes, same graph
    assert not np.allclose(first, second)
    # the same tower with another aligner: a new runner, and that aligner's weights are used
    _, other_a = build_vision(TINY, out_dim, numerics)
    load_vision_weights(_, other_a, DictCheckpoint(pa))
    mixed = {k: (pb[k] if k.startswith("vision.") else pa[k]) for k in pa}
    mixed_v, mixed_a = build_vision(TINY, out_dim, numerics)
    load_vision_weights(mixed_v, mixed_a, DictCheckpoint(mixed))
    np.testing.assert_array_equal(np.asarray(encode_images(vision, other_a, pa, ims, numerics)),
                                  np.asarray(encode_images(mixed_v, mixed_a, pa, ims, numerics)))
    assert V._TOWERS[vision] is not runner


def test_tower_in_parts_equals_one_executable(monkeypatch):
    """``encode_images`` can run the tower as ``tower_parts`` executables (``DSV41_VIT_PARTS``: the
    GPU starts on the first while the next ones' CUDA graphs are prepared): the same bits as one
    executable, in both numerics, with the details (ViT output, aligner rows); the plan of parts
    and its errors."""
    from dsv41_jax.model import vision as V

    out_dim = 24
    params = random_params(TINY, out_dim, seed=5)
    ims = [synthetic_image((4, 7), TINY, 3), synthetic_image((6, 5), TINY, 4)]
    for numerics in (Numerics("float32", "fast"), Numerics("bfloat16", "reference", vision_attention="bf16")):
        vision, aligner = build_vision(TINY, out_dim, numerics)
        load_vision_weights(vision, aligner, DictCheckpoint(params))
        got = {}
        for k in ("1", "2"):
            monkeypatch.setenv("DSV41_VIT_PARTS", k)
            out = encode_images(vision, aligner, params, ims, numerics, return_details=True)
            got[k] = [np.asarray(a.astype(jnp.float32)) for a in (out.span_embeds, out.aligner_rows, out.vit_out)]
        assert V.tower_parts(TINY.num_hidden_layers) == ((0, 1), (1, 2))
        for a, b in zip(got["1"], got["2"]):
            np.testing.assert_array_equal(a, b)
    monkeypatch.delenv("DSV41_VIT_PARTS")
    assert V.DEFAULT_VIT_PARTS == 4 and V.tower_parts(32) == ((0, 2), (2, 8), (8, 20), (20, 32))  # run 45
    for k, want in (("1", ((0, 32),)), ("4", ((0, 2), (2, 8), (8, 20), (20, 32))),
                    ("6", ((0, 2), (2, 8), (8, 14), (14, 20), (20, 26), (26, 32)))):
        monkeypatch.setenv("DSV41_VIT_PARTS", k)
        assert V.tower_parts(32) == want
    for bad in ("0", "four"):
        monkeypatch.setenv("DSV41_VIT_PARTS", bad)
        with pytest.raises(ValueError, match="DSV41_VIT_PARTS"):
            V.tower_parts(32)


# ------------------------------------------------------------------------------ data parallel

_DP_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from test_vision import TINY, random_params, synthetic_image, DictCheckpoint
    from dsv41_jax.model.vision import build_vision, encode_images, load_vision_weights
    from dsv41_jax.numerics import Numerics
    assert jax.device_count() == 2, jax.devices()
    params = random_params(TINY, 24)
    num = Numerics("float32", "fast")
    vision, aligner = build_vision(TINY, 24, num)
    load_vision_weights(vision, aligner, DictCheckpoint(params))
    ims = [synthetic_image(g, TINY, i) for i, g in enumerate([(4, 7), (5, 5), (1, 1), (3, 10), (9, 2)])]
    one = encode_images(vision, aligner, params, ims, num, return_details=True)
    mesh = jax.make_mesh((2,), ("dp",))
    two = encode_images(vision, aligner, params, ims, num, mesh=mesh, return_details=True)
    for k in ("vit_out", "aligner_rows", "span_embeds"):
        a, b = np.asarray(getattr(one, k)), np.asarray(getattr(two, k))
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max(), k
    print("DP OK")
""")


def test_data_parallel_two_devices():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    script = _DP_SCRIPT.format(root=root, tests=os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "DP OK" in res.stdout, res.stdout + res.stderr
