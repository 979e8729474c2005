"""Image-span assembly and the merge of spans into the decoder's ``inputs_embeds``.

A span's IMAGE positions take the aligner rows in reading order; START, NEW_LINE and END take
the learned ``image_start``, ``image_newline`` and ``image_end`` vectors (fp32 parameters in
the model, cast to the activation dtype here). Both steps are gathers, so they run under jit.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

VECTOR_NAMES = ("image_start", "image_newline", "image_end")


def image_vector_table(image_vectors: Any, dtype):
    """[3, D] table (start, newline, end) in ``dtype`` from a (start, newline, end) sequence, a
    mapping with the checkpoint names, or an object with those attributes (nnx.Param or array)."""
    if isinstance(image_vectors, Mapping):
        vs = [image_vectors[n] for n in VECTOR_NAMES]
    elif isinstance(image_vectors, Sequence) and not hasattr(image_vectors, "shape"):
        vs = list(image_vectors)
    else:
        vs = [getattr(image_vectors, n) for n in VECTOR_NAMES]
    if len(vs) != 3:
        raise ValueError(f"image_vectors: expected (image_start, image_newline, image_end), got {len(vs)} items")
    vs = [v[...] if hasattr(v, "get_value") else v for v in vs]
    return jnp.stack([jnp.asarray(v).astype(dtype) for v in vs])


def span_gather_index(types_per_image: Sequence[np.ndarray], row_offsets: Sequence[int], table_base: int) -> np.ndarray:
    """Row of ``[aligner rows; start; newline; end]`` every span position reads (host, int32).

    ``row_offsets[i]``: where image i's aligner rows start in the row table; ``table_base``:
    index of ``image_start`` (newline = base + 1, end = base + 2).
    """
    out = []
    for types, off in zip(types_per_image, row_offsets):
        types = np.asarray(types)
        is_img = types == IMAGE
        idx = np.full(types.shape, -1, np.int64)
        idx[is_img] = off + np.arange(int(is_img.sum()))
        idx[types == IMAGE_START] = table_base
        idx[types == IMAGE_NEW_LINE] = table_base + 1
        idx[types == IMAGE_END] = table_base + 2
        if (idx < 0).any():
            raise ValueError(f"span types contain codes outside START/IMAGE/NEW_LINE/END: "
                             f"{sorted(set(types.tolist()))}")
        out.append(idx)
    return np.concatenate(out).astype(np.int32) if out else np.zeros((0,), np.int32)


@jax.jit
def gather_spans(rows, vectors, index):
    """rows [R, D], vectors [3, D] (same dtype), index [S] -> span embeddings [S, D]."""
    return jnp.take(jnp.concatenate([rows, vectors], axis=0), index, axis=0)


def assemble_spans(aligner_rows, image_vectors, types_per_image: Sequence[np.ndarray], dtype=None):
    """Spans of consecutive images: ``aligner_rows`` [sum n_rows, D] (images concatenated in order)
    and each image's ``types`` -> [sum span_len, D] in ``dtype`` (default: the rows' dtype)."""
    dtype = aligner_rows.dtype if dtype is None else dtype
    counts = [int((np.asarray(t) == IMAGE).sum()) for t in types_per_image]
    if sum(counts) != aligner_rows.shape[0]:
        raise ValueError(f"spans have {sum(counts)} IMAGE positions but there are {aligner_rows.shape[0]} aligner rows")
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if counts else []
    index = span_gather_index(types_per_image, offsets, aligner_rows.shape[0])
    return gather_spans(aligner_rows.astype(dtype), image_vector_table(image_vectors, dtype), jnp.asarray(index))


def encode_and_merge(model, input_ids, types, images, numerics=None, *, capture: dict | None = None):
    """Token embeddings with every image span merged in (before the hc expansion).

    model: the top-level model (``embed``, ``vision``, ``aligner``, ``image_start/newline/end``);
    input_ids/types: [B, S]; images: ProcessedImage list in batch-major prompt order (or one list
    per batch row). ``capture`` receives ``vit_out``, ``aligner_rows`` and ``span_embeds`` (fp32).
    """
    from dsv41_jax.model.vision import encode_images

    numerics = model.numerics if numerics is None else numerics
    flat = [im for row in images for im in (row if isinstance(row, (list, tuple)) else [row])]
    out = encode_images(model.vision, model.aligner, model, flat, numerics, return_details=True)
    if capture is not None:
        for name in ("vit_out", "aligner_rows", "span_embeds"):
            capture[name] = getattr(out, name).astype(jnp.float32)
    embeds = model.embed(jnp.asarray(input_ids), numerics.dtype)
    return merge_spans(embeds, out.span_embeds, types)


def merge_spans(embeds, span_rows, types):
    """Write image spans into the token embeddings (before the hyper-connection expansion).

    embeds: [B, S, D]; span_rows: [N, D], the spans of every image of the batch concatenated in
    batch-major prompt order (what ``encode_images`` returns); types: [B, S] (-1 text, >= 0 span).
    Every span position (types >= 0) takes the next span row, cast to ``embeds.dtype``; text
    positions are untouched. Traceable under jit (shapes are static).
    """
    if span_rows.shape[0] == 0:
        return embeds
    mask = types >= 0
    if isinstance(types, np.ndarray) and int(mask.sum()) != span_rows.shape[0]:
        raise ValueError(f"types mark {int(mask.sum())} span positions but {span_rows.shape[0]} span rows were given")
    flat = jnp.asarray(mask).reshape(-1)
    idx = jnp.clip(jnp.cumsum(flat.astype(jnp.int32)) - 1, 0, span_rows.shape[0] - 1).reshape(mask.shape)
    rows = jnp.take(span_rows, idx, axis=0).astype(embeds.dtype)
    return jnp.where(jnp.asarray(mask)[..., None], rows, embeds)
