"""Image preprocessing and prompt expansion: bit-exact against the official processor's fixtures."""
from __future__ import annotations

import base64
import io
import json
import os

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from dsv41_jax import processor as P
from dsv41_jax.config import ModelConfig, parse_vision_config

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
PRE = os.path.join(GOLDEN, "preprocess")
META = json.load(open(os.path.join(PRE, "preprocess.json")))
NPZ = np.load(os.path.join(PRE, "preprocess.npz"))
V41 = parse_vision_config(META["vision_config"])  # the released V4.1 vision_config
TINY_CFG = ModelConfig.from_file(os.path.join(GOLDEN, "image_fast_fp32"))


@pytest.fixture(scope="module")
def processed():
    return {im["name"]: P.preprocess_image(os.path.join(PRE, im["file"]), V41) for im in META["images"]
            if im["status"] == "ok"}


@pytest.mark.parametrize("meta", META["images"], ids=[im["name"] for im in META["images"]])
def test_preprocess_fixture(meta, processed):
    assert meta["status"] == "ok"
    im = processed[meta["name"]]
    assert im.original_size == (meta["width"], meta["height"])
    assert im.resized_size == (meta["resized_width"], meta["resized_height"])
    assert im.contained_size == (meta["contained_width"], meta["contained_height"])
    assert list(im.vit_grid) == meta["vit_grid"] and list(im.llm_grid) == meta["llm_grid"]
    assert im.span_len == meta["span_len"] == P.span_length(*im.llm_grid)
    assert im.n_patches == meta["n_patches"] and list(im.patches.shape) == meta["patches_shape"]
    assert im.patches.dtype == ml_dtypes.bfloat16
    assert im.patches_sha256() == meta["patches_sha256"]
    assert float(im.patches.astype(np.float64).sum()) == pytest.approx(meta["patches_sum"], abs=1e-6)
    np.testing.assert_array_equal(im.types, NPZ["types_" + meta["name"]])
    if meta["patches_full_in_npz"]:
        np.testing.assert_array_equal(im.patches.astype(np.float32), NPZ["patches_" + meta["name"]])


def test_preprocess_grids_arrays(processed):
    order = META["order_of_ok_images"]
    np.testing.assert_array_equal([processed[n].vit_grid for n in order], NPZ["vit_grid"])
    np.testing.assert_array_equal([processed[n].llm_grid for n in order], NPZ["llm_grid"])
    np.testing.assert_array_equal([processed[n].resized_size for n in order], NPZ["resized_wh"])


def test_prompt_expansion_fixture(processed):
    ex = META["prompt_expansion"]
    out = P.expand_prompt(ex["prompt_ids"], [processed[n] for n in ex["images"]], META["image_token_id"])
    np.testing.assert_array_equal(out.input_ids, NPZ["input_ids"])
    np.testing.assert_array_equal(out.types, NPZ["token_types"])
    np.testing.assert_array_equal(out.image_starts, NPZ["image_starts"])
    np.testing.assert_array_equal(out.image_mask, NPZ["token_types"] >= 0)
    assert (out.input_ids[out.image_mask] == META["image_token_id"]).all()


# spec §3.4 worked examples (V4.1 config): W x H -> pixels, ViT grid, LLM grid, span length
WORKED = [((1024, 701), (1036, 714), (51, 74), (17, 25), 444),
          ((450, 308), (658, 462), (33, 47), (11, 16), 189),
          ((2048, 2048), (1302, 1302), (93, 93), (31, 31), 994),
          ((1920, 1080), (1708, 966), (69, 122), (23, 41), 968),
          ((4000, 100), (4004, 112), (8, 286), (3, 96), 293),
          ((14, 14), (546, 546), (39, 39), (13, 13), 184)]


@pytest.mark.parametrize("size,pixels,vit,llm,span", WORKED)
def test_worked_examples(size, pixels, vit, llm, span):
    plan = P.plan_image(*size, V41)
    assert ((plan.pixel_w, plan.pixel_h), plan.vit_grid, plan.llm_grid, plan.span_len) == (pixels, vit, llm, span)


def test_resize_solver_branches():
    # very tall: a single aligner column; very wide: a single aligner row; both fill the budget exactly
    tall = P.plan_image(10, 100_000, V41)
    assert (tall.pixel_h, tall.pixel_w) == (1022 // 2 * 42, 42) and tall.llm_grid == (511, 1) and tall.span_len == 1024
    wide = P.plan_image(100_000, 10, V41)
    assert (wide.pixel_h, wide.pixel_w) == (42, 1021 * 42) and wide.llm_grid == (1, 1021) and wide.span_len == 1024
    # 1:40 and 40:1 go through the general branch; every plan fits the budget
    for w, h in [(400, 16000), (16000, 400), (3000, 2999), (5000, 50), (1, 5000), (7, 3)]:
        plan = P.plan_image(w, h, V41)
        assert plan.span_len <= V41.max_image_tokens
        assert plan.pixel_w % 14 == 0 and plan.pixel_h % 14 == 0
    # min_pixels upscale truncates with int(): 450x308 -> 658x462 pixels (not 658x463)
    assert P.plan_image(450, 308, V41).pixel_h == 462


def test_span_types_layout():
    t = P.image_token_types(2, 3)
    S, I, N, E = P.IMAGE_START, P.IMAGE, P.IMAGE_NEW_LINE, P.IMAGE_END
    assert t.tolist() == [S, I, I, I, N, I, I, I, N, E]
    assert len(t) == P.span_length(2, 3) == 10


# ------------------------------------------------------------------------------ modes


def _solid(mode, value, size=(84, 84)):
    return Image.new(mode, size, value)


@pytest.mark.parametrize("mode,value,rgb", [
    ("RGB", (200, 100, 50), (200, 100, 50)),
    ("RGBA", (200, 100, 50, 0), (200, 100, 50)),  # alpha dropped, no compositing
    ("LA", (77, 10), (77, 77, 77)),
    ("L", 33, (33, 33, 33)),
    ("I;16", 1000, (255, 255, 255)),  # 16-bit values clipped to 255, not rescaled
    ("CMYK", (0, 255, 255, 0), (255, 0, 0)),
    ("1", 1, (255, 255, 255)),
])
def test_modes_convert_like_reference(mode, value, rgb, tmp_path):
    img = _solid(mode, value)
    path = tmp_path / "x.png" if mode != "CMYK" else tmp_path / "x.tiff"
    img.save(path)
    got = P.preprocess_image(str(path), V41)
    want = np.asarray(rgb, np.float32) / np.float32(255)
    want = ((want - np.float32(0.5)) / np.float32(0.5)).astype(ml_dtypes.bfloat16)
    center = got.patches[got.n_patches // 2 + got.vit_grid[1] // 2]  # a patch inside the image, away from pads
    np.testing.assert_array_equal(center[:, 7, 7], want)
    # a PIL image passed directly gives the same patches as its file
    assert P.preprocess_image(Image.open(path), V41).patches_sha256() == got.patches_sha256()


def test_palette_image(tmp_path):
    img = Image.new("P", (90, 60))
    img.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    img.paste(1, (0, 0, 90, 60))
    got = P.preprocess_image(img, V41)
    want = ((np.asarray([10, 200, 30], np.float32) / 255 - 0.5) / 0.5).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.patches[got.n_patches // 2][:, 3, 3], want)


def test_letterbox_is_gray_127():
    got = P.preprocess_image(_solid("RGB", (0, 0, 0), (200, 100)), V41)  # wide: pads top and bottom
    gray = np.float32((127 / 255 - 0.5) / 0.5).astype(ml_dtypes.bfloat16)
    assert got.resized_size == (770, 392) and got.contained_size == (770, 385)
    # 7 pad rows, round(3.5) = 4 of them on top: gray 127 there, the black image below
    assert (got.patches[0][:, :4] == gray).all() and (got.patches[0][:, 4:] == -1).all()
    assert (got.patches[-1][:, -3:] == gray).all() and (got.patches[-1][:, :-3] == -1).all()


# ------------------------------------------------------------------------------ bad inputs


def _png_bytes(size=(30, 20)):
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images(tmp_path):
    (tmp_path / "notes.png").write_text("this is not an image")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "cut.png").write_bytes(_png_bytes((300, 200))[:150])
    cases = {
        str(tmp_path / "notes.png"): "not an image",
        str(tmp_path / "empty.png"): "empty",
        str(tmp_path / "cut.png"): "cannot decode",
        str(tmp_path / "missing.png"): "no such image file",
    }
    for path, words in cases.items():
        with pytest.raises(P.ImageInputError, match=words) as e:
            P.preprocess_image(path, V41)
        assert os.path.basename(path) in str(e.value)
    assert P.preprocess_image(P.load_image(io.BytesIO(_png_bytes()).getvalue(), "a.png"), V41).name == "a.png"
    with pytest.raises(P.ImageInputError, match="zero size"):
        P.preprocess_image(Image.new("RGB", (0, 5)), V41, name="blank")
    with pytest.raises(P.ImageInputError, match="unsupported image source"):
        P.preprocess_image(12345, V41)


def test_placeholder_count_mismatch():
    ims = [P.preprocess_image(_png_bytes(), TINY_CFG.vision, name=f"img{i}.png") for i in range(2)]
    tid = TINY_CFG.image_token_id
    with pytest.raises(P.ImageInputError, match=r"1 image placeholder.*2 image.*without a placeholder: \['img1.png'\]"):
        P.expand_prompt([0, 5, tid, 6], ims, tid)
    with pytest.raises(P.ImageInputError, match=r"2 image placeholder.*1 image.*positions \[3\]"):
        P.expand_prompt([0, tid, 5, tid], ims[:1], tid)
    with pytest.raises(P.ImageInputError, match="3 image"):  # raised before any image is decoded
        P.prepare_inputs([0, tid], ["a.png", "b.png", "c.png"], TINY_CFG)


def test_expansion_and_max_length():
    im = P.preprocess_image(_png_bytes(), TINY_CFG.vision, name="small.png")
    tid = TINY_CFG.image_token_id
    out = P.expand_prompt([0, 7, tid, 8, tid], [im, im], tid)
    s = im.span_len
    assert len(out) == 3 + 2 * s and out.image_starts == (2, 3 + s)
    assert out.input_ids.tolist() == [0, 7] + [tid] * s + [8] + [tid] * s
    np.testing.assert_array_equal(out.types[2:2 + s], im.types)
    assert (out.types[[0, 1, 2 + s]] == P.TEXT).all()
    with pytest.raises(P.ImageInputError, match="more than the maximum"):
        P.expand_prompt([0, 7, tid, 8, tid], [im, im], tid, max_length=2 * s)
    batch = P.stack_prompts([out, out])
    assert batch.input_ids.shape == (2, len(out)) and len(batch.images) == 4
    with pytest.raises(P.ImageInputError, match="different lengths"):
        P.stack_prompts([out, P.expand_prompt([0, tid], [im], tid)])


# ------------------------------------------------------------------------------ chat messages


def test_chat_messages_to_placeholders():
    png = _png_bytes()
    b64 = base64.b64encode(png).decode()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "screenshot:"},
                {"type": "image_url", "image_url": "data:image/png;base64," + b64},
            ]},
        ]},
    ]
    new, images = P.messages_with_placeholders(messages)
    assert len(images) == 3
    assert new[1]["content"][1] == {"type": "text", "text": P.PLACEHOLDER}
    assert new[1]["content"][2] == {"type": "text", "text": P.PLACEHOLDER}
    assert new[2]["content"][0]["content"][1] == {"type": "text", "text": P.PLACEHOLDER}
    assert messages[1]["content"][1]["type"] == "image_url"  # the input is not modified
    for rec in images:
        assert P.load_image_bytes(rec) == png
    tid = TINY_CFG.image_token_id
    out = P.prepare_inputs([0, tid, tid, 4, tid], images, TINY_CFG)
    assert len(out.images) == 3 and len(set(im.patches_sha256() for im in out.images)) == 1
    with pytest.raises(P.ImageInputError, match="literally"):
        P.messages_with_placeholders([{"role": "user", "content": "look " + P.PLACEHOLDER}])


def test_tokenizer_placeholder_id():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(os.path.join(GOLDEN, "image_fast_fp32", "tokenizer.json"))
    assert tok.token_to_id(P.PLACEHOLDER) == TINY_CFG.image_token_id
    P.check_placeholder_id(tok, TINY_CFG.image_token_id)
    with pytest.raises(P.ImageInputError, match="image_token_id"):
        P.check_placeholder_id(tok, TINY_CFG.image_token_id + 1)
