"""Host-side image preprocessing and prompt expansion for the DeepSeek-V4.1 vision path.

An image becomes an ``n_vit_h x n_vit_w`` grid of 14x14 patches for the ViT and, after the
aligner's 3x3 merge, an ``n_llm_h x n_llm_w`` grid of LLM rows. The language model sees it as
the span ``[START] + ([IMAGE] * n_llm_w + [NEW_LINE]) * n_llm_h + [END]``; every span position
carries ``image_token_id`` and only ``types`` tells the positions apart.

Everything here reproduces the official ``inference/image_processor.py`` bit for bit (same
Pillow calls for the pixels, same integer/float arithmetic for the resize plan); see
docs/vision.md for the details and the quirks kept on purpose (no EXIF rotation, I;16 clipped,
alpha dropped without compositing).
"""
from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import io
import math
import os
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dsv41_jax.config import VisionConfig

PLACEHOLDER = "<｜deepseek_image｜>"  # the bars are U+FF5C FULLWIDTH VERTICAL LINE

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = 0, 1, 2, 3
PAD_GRAY = (127, 127, 127)


class ImageInputError(ValueError):
    """An image (or the prompt it goes with) that cannot be turned into model inputs."""


# ------------------------------------------------------------------------------ resize plan


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of one image span: START, n_llm_h rows of (n_llm_w IMAGE + NEW_LINE), END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(pixel_h: int, pixel_w: int, patch_size: int, ratio: int) -> tuple[int, int]:
    """Token grid the aligner makes from a patch grid of this pixel size (ViT grid need not divide)."""
    return math.ceil((pixel_h // patch_size) / ratio), math.ceil((pixel_w // patch_size) / ratio)


def solve_resize(height, width, patch_size: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """Largest aspect-preserving (pixel_h, pixel_w) whose span fits in ``max_tokens``.

    ``mw`` solves ``rho * mw * (mw + 1) = max_tokens - 2`` (rho = h / w). Extreme aspect ratios
    collapse to a single aligner column (very tall) or a single row (very wide).
    """
    rho = height / width
    mw = math.sqrt((max_tokens - 2) / rho + 0.25) - 0.5
    mh = mw * rho
    cell = patch_size * ratio
    if mw < 1.0:
        return (max_tokens - 2) // 2 * cell, cell
    if mh < 1.0:
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(mw) * cell / width, math.floor(mh) * cell / height)
    return math.floor(height * beta / patch_size) * patch_size, math.floor(width * beta / patch_size) * patch_size


@dataclasses.dataclass(frozen=True)
class ImagePlan:
    """Resize plan of one image: the padded pixel canvas and both grids."""

    pixel_w: int  # canvas the image is letterboxed into (a multiple of patch_size)
    pixel_h: int
    vit_grid: tuple[int, int]  # (n_vit_h, n_vit_w)
    llm_grid: tuple[int, int]  # (n_llm_h, n_llm_w)

    @property
    def span_len(self) -> int:
        return span_length(*self.llm_grid)


def plan_image(width: int, height: int, cfg: VisionConfig) -> ImagePlan:
    """Resize plan for an original ``width x height`` image (pure function of its arguments)."""
    p, r, m = cfg.patch_size, cfg.downsample_ratio, cfg.max_image_tokens
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:  # V4 only; V4.1 has None
        width = height * cfg.max_wh_ratio
    if 0 < width * height < cfg.min_pixels:
        s = (cfg.min_pixels / (width * height)) ** 0.5
        width, height = int(width * s), int(height * s)  # int() truncates, as the reference does
    bw, bh = math.ceil(width / p) * p, math.ceil(height / p) * p
    lh, lw = llm_grid(bh, bw, p, r)
    if span_length(lh, lw) > m:
        bh, bw = solve_resize(height, width, p, r, m)
        lh, lw = llm_grid(bh, bw, p, r)
        if span_length(lh, lw) > m:  # cannot happen for a sane config; the reference asserts
            raise ImageInputError(f"resize plan for {width}x{height} needs {span_length(lh, lw)} > {m} tokens")
    return ImagePlan(int(bw), int(bh), (int(bh) // p, int(bw) // p), (int(lh), int(lw)))


def image_token_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """The span's ``types``: START, (IMAGE * n_llm_w, NEW_LINE) * n_llm_h, END (int64)."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return np.asarray([IMAGE_START] + row * n_llm_h + [IMAGE_END], dtype=np.int64)


def contained_size(width: int, height: int, box_w: int, box_h: int) -> tuple[int, int]:
    """Size of the aspect-preserving resize ``ImageOps.pad`` makes inside its canvas."""
    if width / height == box_w / box_h:
        return box_w, box_h
    if width / height > box_w / box_h:
        return box_w, round(height / width * box_w)
    return round(width / height * box_h), box_h


# ------------------------------------------------------------------------------ loading


def load_image_bytes(record: Mapping[str, Any]) -> bytes:
    """Bytes of an image record: raw or base64 ``data``, an Anthropic ``source``, or a ``url``
    (data URL, http(s) URL or local path)."""
    data = record.get("data")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if isinstance(data, str):
        return base64.b64decode(data)
    source = record.get("source")
    if isinstance(source, Mapping):
        if source.get("data") is not None:
            return base64.b64decode(source["data"])
        if source.get("url"):
            return load_image_bytes({"url": source["url"]})
        if source.get("path"):
            return load_image_bytes({"url": source["path"]})
    url = record.get("url")
    if isinstance(url, Mapping):  # OpenAI {"image_url": {"url": ...}} passed whole
        url = url.get("url")
    if isinstance(url, str) and url:
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise ImageInputError(f"unsupported data URL encoding {header!r} (only base64 is supported)")
            return base64.b64decode(payload)
        if url.startswith(("http://", "https://")):
            from urllib.request import urlopen

            with urlopen(url, timeout=30) as response:
                return response.read()
        with open(url, "rb") as f:
            return f.read()
    raise ImageInputError(f"cannot load an image from a record with keys {sorted(record)}")


def describe_source(source: Any, index: int | None = None) -> str:
    """A short human name for an image source, used in error messages and ``ProcessedImage.name``."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, Mapping):
        for key in ("name", "path", "url"):
            v = source.get(key)
            if isinstance(v, str) and v and not v.startswith("data:"):
                return v
            if isinstance(v, Mapping) and isinstance(v.get("url"), str) and not v["url"].startswith("data:"):
                return v["url"]
        src = source.get("source")
        if isinstance(src, Mapping) and isinstance(src.get("url"), str):
            return src["url"]
    fn = getattr(source, "filename", None)
    if isinstance(fn, str) and fn:
        return fn
    return f"image #{index}" if index is not None else "image"


def open_image(source: Any, name: str | None = None) -> Image.Image:
    """Decode ``source`` (path, bytes, PIL image or image record) and convert it to RGB.

    Every mode goes through ``Image.convert("RGB")`` exactly as the reference: alpha is dropped
    without compositing, palette images are looked up, CMYK uses Pillow's naive conversion,
    16-bit greyscale is clipped to 255, and EXIF orientation is not applied.
    """
    name = name or describe_source(source)
    try:
        if isinstance(source, Image.Image):
            source.load()
            image = source.convert("RGB")
        else:
            if isinstance(source, (bytes, bytearray, memoryview)):
                raw = bytes(source)
            elif isinstance(source, (str, os.PathLike)):
                with open(source, "rb") as f:
                    raw = f.read()
            elif isinstance(source, Mapping):
                raw = load_image_bytes(source)
            else:
                raise ImageInputError(f"{name}: unsupported image source of type {type(source).__name__}")
            if not raw:
                raise ImageInputError(f"{name}: the image file is empty (0 bytes)")
            with Image.open(io.BytesIO(raw)) as src:
                image = src.convert("RGB")
    except ImageInputError:
        raise
    except FileNotFoundError:
        raise ImageInputError(f"{name}: no such image file") from None
    except UnidentifiedImageError:
        raise ImageInputError(f"{name}: not an image (Pillow cannot identify the file format)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data
        raise ImageInputError(f"{name}: cannot decode the image ({e})") from None
    if image.width <= 0 or image.height <= 0:
        raise ImageInputError(f"{name}: the image has zero size ({image.width}x{image.height})")
    return image


def load_image(source: Any, name: str | None = None) -> Image.Image:
    """``open_image`` that also records the source name on the image (``image.filename``), so
    later error messages and ``ProcessedImage.name`` can name it."""
    name = name or describe_source(source)
    image = open_image(source, name)
    image.filename = name
    return image


# ------------------------------------------------------------------------------ pixels -> patches


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One preprocessed image, ready for the vision tower.

    ``patches``: [n_vit_h * n_vit_w, 3, p, p] ``ml_dtypes.bfloat16``, raster order (patch
    ``row * n_vit_w + col``), channels R, G, B, values ``(x / 255 - 0.5) / 0.5`` rounded once
    to bf16. ``types``: the span's token types (int64, length ``span_len``). ``pixels``: the same
    patches as the uint8 values they were normalized from (``patches == normalize(pixels)``), or
    None; ``encode_images`` sends those to the device (half the bytes) and normalizes
    there through ``PIXEL_TABLE``, with the same bf16 values.
    """

    name: str
    patches: np.ndarray
    vit_grid: tuple[int, int]
    llm_grid: tuple[int, int]
    types: np.ndarray
    original_size: tuple[int, int]  # (width, height) of the decoded image
    resized_size: tuple[int, int]  # (width, height) of the padded canvas
    contained_size: tuple[int, int]  # (width, height) of the bicubic resize inside the canvas
    pixels: np.ndarray | None = None  # [n_patches, 3, p, p] uint8, or None

    @property
    def n_patches(self) -> int:
        return self.vit_grid[0] * self.vit_grid[1]

    @property
    def n_rows(self) -> int:
        """Aligner rows (= IMAGE positions of the span)."""
        return self.llm_grid[0] * self.llm_grid[1]

    @property
    def span_len(self) -> int:
        return int(self.types.shape[0])

    def patches_sha256(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.patches).tobytes()).hexdigest()


def normalize(pixels_hwc: np.ndarray) -> np.ndarray:
    """uint8 HWC -> fp32 ``(x / 255 - 0.5) / 0.5`` -> bf16 (round to nearest even). Elementwise:
    any uint8 shape."""
    x = pixels_hwc.astype(np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return x.astype(ml_dtypes.bfloat16)


# normalize() of every uint8 value: a device-side lookup gives normalize's bf16 values exactly
PIXEL_TABLE = normalize(np.arange(256, dtype=np.uint8))


def patchify(x_hwc: np.ndarray, patch_size: int) -> np.ndarray:
    """[H, W, 3] -> [H/p * W/p, 3, p, p] in raster order, each patch flattened as (c, y, x)."""
    h, w, c = x_hwc.shape
    nh, nw, p = h // patch_size, w // patch_size, patch_size
    x = x_hwc.reshape(nh, p, nw, p, c).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(x.reshape(nh * nw, c, p, p))


def preprocess_image(source: Any, cfg: VisionConfig, name: str | None = None) -> ProcessedImage:
    """Decode, plan, letterbox (gray 127, bicubic) and patchify one image."""
    name = name or describe_source(source)
    image = open_image(source, name)
    w, h = image.width, image.height
    plan = plan_image(w, h, cfg)
    size = (plan.pixel_w, plan.pixel_h)
    if cfg.max_wh_ratio is not None and w >= cfg.max_wh_ratio * h:  # V4 only: stretch very wide images
        canvas, inner = image.resize(size), size
    else:
        canvas, inner = ImageOps.pad(image, size, color=PAD_GRAY), contained_size(w, h, *size)
    pixels = patchify(np.asarray(canvas, dtype=np.uint8), cfg.patch_size)
    return ProcessedImage(
        name=name,
        patches=normalize(pixels),
        vit_grid=plan.vit_grid,
        llm_grid=plan.llm_grid,
        types=image_token_types(*plan.llm_grid),
        original_size=(w, h),
        resized_size=size,
        contained_size=tuple(int(v) for v in inner),
        pixels=pixels,
    )


# ------------------------------------------------------------------------------ prompts


@dataclasses.dataclass(frozen=True, eq=False)
class PromptInputs:
    """One prompt with its image spans expanded.

    ``input_ids``: every span position carries ``image_token_id``. ``types``: TEXT (-1) or the
    span type. ``image_mask``: ``types >= 0`` (selects ``bias_vl`` in the MoE router and switches
    Engram off). ``image_starts[i]``: position of image i's START. ``images`` in prompt order.
    """

    input_ids: np.ndarray  # [S] int64
    types: np.ndarray  # [S] int64
    images: tuple[ProcessedImage, ...]
    image_starts: tuple[int, ...]

    @property
    def image_mask(self) -> np.ndarray:
        return self.types >= 0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def expand_prompt(prompt_ids: Sequence[int], images: Sequence[ProcessedImage], image_token_id: int,
                  *, max_length: int | None = None) -> PromptInputs:
    """Replace the k-th ``image_token_id`` of ``prompt_ids`` by image k's span (``span_len`` copies).

    Raises ImageInputError when the number of placeholders differs from the number of images or
    when the expanded prompt is longer than ``max_length``.
    """
    ids = [int(t) for t in prompt_ids]
    slots = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(slots) != len(images):
        names = [im.name for im in images]
        msg = (f"the prompt has {len(slots)} image placeholder(s) (token id {image_token_id}) "
               f"but {len(images)} image(s) were given {names}")
        if len(images) > len(slots):
            msg += f"; without a placeholder: {names[len(slots):]}"
        else:
            msg += f"; placeholders without an image at prompt positions {slots[len(images):]}"
        raise ImageInputError(msg)
    out_ids: list[np.ndarray] = []
    out_types: list[np.ndarray] = []
    starts, pos, prev = [], 0, 0
    for slot, image in zip(slots, images):
        text = np.asarray(ids[prev:slot], dtype=np.int64)
        out_ids.append(text)
        out_types.append(np.full(text.shape, TEXT, np.int64))
        pos += text.shape[0]
        if int((image.types == IMAGE).sum()) != image.n_rows:
            raise ImageInputError(f"{image.name}: types has {(image.types == IMAGE).sum()} IMAGE slots "
                                  f"for {image.n_rows} aligner rows")
        starts.append(pos)
        out_ids.append(np.full(image.types.shape, image_token_id, np.int64))
        out_types.append(image.types.astype(np.int64))
        pos += image.span_len
        prev = slot + 1
    tail = np.asarray(ids[prev:], dtype=np.int64)
    out_ids.append(tail)
    out_types.append(np.full(tail.shape, TEXT, np.int64))
    input_ids = np.concatenate(out_ids)
    if max_length is not None and input_ids.shape[0] > max_length:
        spans = ", ".join(f"{im.name}: {im.span_len}" for im in images)
        raise ImageInputError(f"the prompt expands to {input_ids.shape[0]} tokens, more than the maximum "
                              f"{max_length} ({len(ids) - len(images)} text tokens; image spans {spans or 'none'})")
    return PromptInputs(input_ids, np.concatenate(out_types), tuple(images), tuple(starts))


def prepare_inputs(prompt_ids: Sequence[int], images: Sequence[Any], cfg, *,
                   max_length: int | None = None) -> PromptInputs:
    """Preprocess ``images`` (paths, bytes, PIL images, records or ProcessedImage) and expand the prompt.

    ``cfg``: a ModelConfig (its ``vision`` and ``image_token_id`` are used).
    """
    n_placeholders = sum(int(t) == cfg.image_token_id for t in prompt_ids)
    if n_placeholders and cfg.vision is None:
        raise ImageInputError("the prompt contains image placeholders but the model config has no vision tower")
    if n_placeholders != len(images):  # fail before decoding anything
        names = [im.name if isinstance(im, ProcessedImage) else describe_source(im, i) for i, im in enumerate(images)]
        raise ImageInputError(f"the prompt has {n_placeholders} image placeholder(s) (token id {cfg.image_token_id}) "
                              f"but {len(images)} image(s) were given {names}")
    processed = [im if isinstance(im, ProcessedImage) else preprocess_image(im, cfg.vision, describe_source(im, i))
                 for i, im in enumerate(images)]
    return expand_prompt(prompt_ids, processed, cfg.image_token_id, max_length=max_length)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchInputs:
    """Several expanded prompts of equal length, stacked; ``images`` flattened in batch order."""

    input_ids: np.ndarray  # [B, S] int64
    types: np.ndarray  # [B, S] int64
    images: tuple[ProcessedImage, ...]

    @property
    def image_mask(self) -> np.ndarray:
        return self.types >= 0


def stack_prompts(prompts: Sequence[PromptInputs]) -> BatchInputs:
    """Stack expanded prompts into a batch (the rows must have the same expanded length)."""
    lengths = [len(p) for p in prompts]
    if len(set(lengths)) > 1:
        raise ImageInputError(f"batch rows expand to different lengths {lengths}; batch rows must have equal length")
    images = tuple(im for p in prompts for im in p.images)
    return BatchInputs(np.stack([p.input_ids for p in prompts]), np.stack([p.types for p in prompts]), images)


def check_placeholder_id(tokenizer, image_token_id: int) -> None:
    """Cross-check the config's ``image_token_id`` against a ``tokenizers.Tokenizer`` that knows the
    placeholder spelling (the reference trusts the config id when the tokenizer does not know it)."""
    tid = tokenizer.token_to_id(PLACEHOLDER)
    if tid is not None and tid != image_token_id:
        raise ImageInputError(f"tokenizer maps {PLACEHOLDER!r} to id {tid}, "
                              f"but the config's image_token_id is {image_token_id}")


# ------------------------------------------------------------------------------ chat messages

_IMAGE_BLOCK_TYPES = ("image_url", "image", "input_image")


def _image_record(block: Mapping[str, Any]) -> dict:
    kind = block.get("type")
    if kind == "image_url" or kind == "input_image":
        url = block.get("image_url")
        if isinstance(url, Mapping):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise ImageInputError(f"{kind} content block without a url")
        return {"url": url}
    record = {k: v for k, v in block.items() if k != "type"}
    if not record:
        raise ImageInputError("image content block without a source")
    return record


def messages_with_placeholders(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Replace every image content block by a text block holding exactly ``PLACEHOLDER``.

    Handles OpenAI ``image_url`` / ``input_image`` blocks and Anthropic ``image`` blocks, in
    traversal order, including blocks nested in ``tool_result`` content. Returns the rewritten
    (deep-copied) messages and the image records in placeholder order (feed them to
    ``prepare_inputs``). A literal placeholder typed in any text is rejected: it would bind to
    the wrong image.
    """
    images: list[dict] = []

    def check_text(text: str, where: str):
        if PLACEHOLDER in text:
            raise ImageInputError(f"{where}: the text contains the image placeholder {PLACEHOLDER!r} literally; "
                                  "images must be passed as image content blocks")

    def walk(content, where: str):
        if isinstance(content, str):
            check_text(content, where)
            return content
        if not isinstance(content, list):
            return content
        out = []
        for j, block in enumerate(content):
            w = f"{where} block {j}"
            if isinstance(block, str):
                check_text(block, w)
                out.append(block)
                continue
            if not isinstance(block, Mapping):
                out.append(block)
                continue
            kind = block.get("type")
            if kind in _IMAGE_BLOCK_TYPES:
                images.append(_image_record(block))
                out.append({"type": "text", "text": PLACEHOLDER})
                continue
            block = dict(block)
            if isinstance(block.get("text"), str):
                check_text(block["text"], w)
            if "content" in block:  # tool_result and similar containers
                block["content"] = walk(block["content"], w)
            out.append(block)
        return out

    new = []
    for i, m in enumerate(messages):
        m = copy.deepcopy(dict(m))
        if "content" in m:
            m["content"] = walk(m["content"], f"message {i}")
        new.append(m)
    return new, images
