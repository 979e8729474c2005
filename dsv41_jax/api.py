"""The user-facing model object: load a checkpoint, then ``generate`` / ``logits`` from text,
chat messages and images.

    m = dsv41_jax.load("ckpt")                 # Orbax (converted) or original DeepSeek directory
    out = m.generate("What is in <｜deepseek_image｜>?", images=["cat.png"], max_new_tokens=32)
    print(out.text[0])
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np

from dsv41_jax import processor
from dsv41_jax.config import ModelConfig
from dsv41_jax.numerics import Numerics

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"


class LoadError(ValueError):
    """A path that is not a usable checkpoint."""


@dataclasses.dataclass
class Generation:
    """Result of :meth:`DeepseekVL.generate`: per prompt, the decoded ``text`` and new ``tokens``;
    ``finish_reasons`` ("stop" / "length"); ``timings`` (compile vs run, seconds); and per
    prompt the image spans' shapes (``image_spans``: (llm_h, llm_w, span_len) per image)."""

    text: list[str]
    tokens: list[list[int]]
    finish_reasons: list[str]
    timings: dict
    image_spans: list[list[tuple[int, int, int]]]


@dataclasses.dataclass
class Prepared:
    input_ids: list[list[int]]
    inputs_embeds: Any  # [n, L, D] or None
    image_mask: Any  # [n, L] bool or None
    images: list[list[processor.ProcessedImage]]


def encode_chat(messages: Sequence[dict], *, thinking: bool = False, add_bos: bool = True) -> str:
    """Render chat messages in the DeepSeek (V3.2 / V4 family) format.

    ``<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>...``
    ending with ``<｜Assistant｜>`` and ``<think>`` (thinking) or ``</think>`` (direct answer).
    Image content blocks must already be replaced by the placeholder
    (:func:`dsv41_jax.processor.messages_with_placeholders`).
    """

    def text_of(content) -> str:
        if isinstance(content, str):
            return content
        parts = []
        for block in content or []:
            if isinstance(block, str):
                parts.append(block)
            elif block.get("type") == "text":
                parts.append(block.get("text", ""))
            elif block.get("type") == "tool_result":
                parts.append(text_of(block.get("content")))
        return "".join(parts)

    out = [BOS] if add_bos else []
    for m in messages:
        role, text = m.get("role"), text_of(m.get("content"))
        if role == "system":
            out.append(text)
        elif role == "user":
            out.append(USER + text)
        elif role == "assistant":
            out.append(ASSISTANT + "</think>" + text + EOS)
        else:
            raise ValueError(f"chat: unknown role {role!r} (system, user, assistant)")
    out.append(ASSISTANT + ("<think>" if thinking else "</think>"))
    return "".join(out)


class DeepseekVL:
    """A loaded DeepSeek-V4.1 model with its tokenizer and image processor."""

    def __init__(self, model, config: ModelConfig, tokenizer, numerics: Numerics, path: str | None = None):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.numerics = numerics
        self.path = path
        if tokenizer is not None and config.vision is not None:
            processor.check_placeholder_id(tokenizer, config.image_token_id)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise LoadError("this model was loaded without a tokenizer; pass token ids instead of text")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.config.bos_token_id
        if add_bos is None:
            add_bos = not text.startswith(BOS)
        if add_bos and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def processor_config(self):
        return self.config.vision

    def preprocess(self, image, name: str | None = None) -> processor.ProcessedImage:
        """Resize/pad/normalise one image exactly as the reference processor."""
        if self.config.vision is None:
            raise processor.ImageInputError("this model has no vision tower (text-only checkpoint or text_only=True)")
        return processor.preprocess_image(image, self.config.vision, name=name)

    # ------------------------------------------------------------------ inputs
    def _to_prompt(self, p) -> tuple[list[int], list]:
        """A prompt (str, token ids, or chat messages) -> (ids, image sources from messages)."""
        if isinstance(p, str):
            return self.encode(p), []
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            msgs, records = processor.messages_with_placeholders(p)
            return self.encode(encode_chat(msgs), add_bos=False), list(records)
        if isinstance(p, (list, tuple, np.ndarray)):
            return [int(i) for i in p], []
        raise TypeError(f"prompt of type {type(p).__name__}: pass a string, token ids or chat messages")

    def prepare(self, prompts, images=None) -> Prepared:
        """Tokenize, bind images to placeholders, run the vision tower, build embeddings."""
        import jax.numpy as jnp

        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (dict, int)))
        if single:
            prompts = [prompts]
            images = [images or []]
        elif images is None:
            images = [[] for _ in prompts]
        if len(images) != len(prompts):
            raise processor.ImageInputError(f"{len(prompts)} prompts but {len(images)} image lists")
        rows, procs = [], []
        for i, (p, imgs) in enumerate(zip(prompts, images)):
            ids, from_msgs = self._to_prompt(p)
            srcs = list(from_msgs) + list(imgs or [])
            pi = [self.preprocess(processor.load_image_bytes(s) if isinstance(s, dict) else s,
                                  name=f"prompt {i} image {j}" + (f" ({os.fspath(s)})" if isinstance(s, (str, os.PathLike)) else ""))
                  for j, s in enumerate(srcs)]
            exp = processor.expand_prompt(ids, pi, self.config.image_token_id)
            rows.append(exp)
            procs.append(pi)
        ids = [list(np.asarray(r.input_ids).tolist()) for r in rows]
        if not any(procs):
            return Prepared(ids, None, None, procs)
        from dsv41_jax.model.span import encode_and_merge

        L = max(len(x) for x in ids)
        embs, masks = [], []
        for r, pi in zip(rows, procs):
            e = encode_and_merge(self.model, np.asarray(r.input_ids)[None], np.asarray(r.types)[None], [pi], self.numerics)
            pad = L - e.shape[1]
            embs.append(jnp.pad(e, ((0, 0), (0, pad), (0, 0))))
            masks.append(np.pad(np.asarray(r.types) >= 0, (0, pad)))
        return Prepared(ids, jnp.concatenate(embs, 0), jnp.asarray(np.stack(masks)), procs)

    # ------------------------------------------------------------------ generation
    def _sampling(self, n, temperature, top_k, top_p, min_p):
        from dsv41_jax.sampling import SamplingParams

        return SamplingParams.make(n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)

    def _stop_ids(self, stop):
        if stop is None:
            return [self.config.eos_token_id]
        out = []
        for s in stop:
            if isinstance(s, str):
                tid = self.tokenizer.token_to_id(s) if self.tokenizer is not None else None
                if tid is None:
                    raise ValueError(f"stop token {s!r} is not a single token of the tokenizer")
                out.append(tid)
            else:
                out.append(int(s))
        return out

    def generate(self, prompts, images=None, *, max_new_tokens: int = 64, temperature=0.0, top_k=0, top_p=1.0,
                 min_p=0.0, stop=None, seed: int = 0, max_len: int | None = None, prefill_chunk: int | None = None,
                 stream: bool = False):
        """Generate from one prompt or a batch. A prompt is a string, token ids, or chat messages
        (image content blocks allowed). ``images``: for one prompt a list of images (paths, bytes
        or PIL), for a batch one list per prompt, bound to the placeholders in order. Sampling
        parameters may be scalars or one value per prompt (passed to the device as arrays).
        ``stream=True`` returns an iterator of :class:`dsv41_jax.generate.StreamStep`."""
        from dsv41_jax import generate as gen

        t0 = time.perf_counter()
        prep = self.prepare(prompts, images)
        t_prep = time.perf_counter() - t0
        n = len(prep.input_ids)
        kw = dict(max_new_tokens=max_new_tokens, sampling=self._sampling(n, temperature, top_k, top_p, min_p),
                  stop_ids=self._stop_ids(stop), seed=seed, max_len=max_len, inputs_embeds=prep.inputs_embeds,
                  image_mask=prep.image_mask, prefill_chunk=prefill_chunk)
        if stream:
            return gen.generate_stream(self.model, prep.input_ids, **kw)
        res = gen.generate(self.model, prep.input_ids, **kw)
        timings = dict(res.timings, preprocess_and_vision_s=t_prep)
        spans = [[(*p.llm_grid, p.span_len) for p in row] for row in prep.images]
        return Generation(text=[self.decode(t) for t in res.tokens], tokens=res.tokens,
                          finish_reasons=res.finish_reasons, timings=timings, image_spans=spans)

    def stream_text(self, prompt, images=None, **kw) -> Iterator[str]:
        """Yield the decoded text of a single prompt piece by piece."""
        toks: list[int] = []
        prev = ""
        for step in self.generate(prompt, images, stream=True, **kw):
            t = step.tokens[0]
            if t is None:
                break
            toks.append(int(t))
            text = self.decode(toks)
            yield text[len(prev):]
            prev = text

    def logits(self, prompt, images=None) -> np.ndarray:
        """fp32 logits [S, V] of one prompt (after image expansion), one-shot prefill."""
        import jax.numpy as jnp

        from dsv41_jax.buckets import DEFAULT_BUCKETS
        from dsv41_jax.generate import forward_chunk

        prep = self.prepare(prompt, images)
        S = len(prep.input_ids[0])
        L = max(DEFAULT_BUCKETS.prompt_len(S), S)  # bucketed length: no recompile per prompt length
        ids = np.zeros((1, L), np.int32)
        ids[0, :S] = prep.input_ids[0]
        valid = jnp.asarray(np.arange(L)[None] < S)
        emb, mask = prep.inputs_embeds, prep.image_mask
        if emb is not None:
            emb = jnp.pad(emb[:, :S], ((0, 0), (0, L - S), (0, 0)))
            mask = jnp.pad(mask[:, :S], ((0, 0), (0, L - S)))
        cache = self.model.init_cache(1, L)
        logits, _ = forward_chunk(self.model, jnp.asarray(ids), cache, valid=valid, inputs_embeds=emb,
                                  image_mask=mask)  # jitted, cache donated
        return np.asarray(logits[0, :S])


def enable_compilation_cache(directory: str | None = None) -> str | None:
    """Persistent XLA compilation cache (default ``~/.cache/dsv41_jax/xla``; set
    ``DSV41_COMPILATION_CACHE=0`` to disable, or a path to move it): a second process reuses the
    compiled prefill / decode executables instead of compiling again."""
    import jax

    env = os.environ.get("DSV41_COMPILATION_CACHE")
    if env == "0":
        return None
    directory = directory or env or os.path.join(os.path.expanduser("~"), ".cache", "dsv41_jax", "xla")
    try:
        os.makedirs(directory, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except (OSError, AttributeError):
        return None
    return directory


def _is_original(path: str) -> bool:
    return os.path.exists(os.path.join(path, "model.safetensors.index.json")) or any(
        f.endswith(".safetensors") for f in os.listdir(path))


def load(path: str | os.PathLike, *, mesh=None, dtype: str = "bfloat16", numerics: str = "reference",
         text_only: bool = False, tokenizer: bool = True, experts_int8: bool = False, dense_fp8: bool = False,
         vit_attention: str = "fp32", text_attention: str = "exact") -> DeepseekVL:
    """Load a converted Orbax checkpoint (``dsv41-jax convert``) or an original-format DeepSeek
    checkpoint directory. ``mesh``: a ``jax.sharding.Mesh`` or "D,E,T" spec to shard onto.
    ``dtype``: compute dtype ("bfloat16" or "float32"); ``numerics``: "reference" (the official
    fake-quant points) or "fast"; ``experts_int8``: keep fp4 routed experts quantized in device
    memory (original fp4 checkpoints, or Orbax ones converted with ``--experts int8``);
    ``dense_fp8``: keep the fp8 Linear weights (attention, shared experts, Engram projection) as
    e4m3 codes + ue8m0 scales in device memory (original fp8 checkpoints, or Orbax ones converted
    with ``--dense fp8``); results are bit-identical to the dequantized weights;
    ``vit_attention``: "fp32" (the vision tower's parity path) or "bf16" (its performance mode:
    bf16 attention and GEMMs with fp32 accumulation, cuDNN flash attention on GPU; docs/vision.md);
    ``text_attention``: "exact" (the decoder's prefill attention kernel rounds the probabilities as
    the reference does) or "online" (its performance mode on the GPU: one launch with a running
    maximum, ~30% less attention time, outputs within a few bf16 ulps; ``Numerics``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise LoadError(f"{path}: not a directory (expected a checkpoint directory)")
    enable_compilation_cache()
    num = Numerics(dtype, numerics, vit_attention, text_attention)
    cfg = ModelConfig.from_file(path)
    if isinstance(mesh, str):
        from dsv41_jax.sharding import mesh_from_spec

        mesh = mesh_from_spec(mesh)
    if _is_original(path):
        from dsv41_jax.weights import load_original

        model = load_original(path, num, text_only=text_only, experts_int8=experts_int8, dense_fp8=dense_fp8)
        if mesh is not None:
            from dsv41_jax.sharding import shard_model

            shard_model(model, mesh)
        else:  # weights committed to the device, as restore_model's are: the jitted programs (and
            # their persistent-cache entries) are then the same for both checkpoint formats
            import jax
            from flax import nnx

            one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            nnx.update(model, jax.device_put(nnx.state(model, nnx.Param), one))
    else:
        from dsv41_jax.checkpoint import restore_model

        model = restore_model(path, num, config=cfg, mesh=mesh, text_only=text_only, experts_int8=experts_int8,
                              dense_fp8=dense_fp8)
    if mesh is None and experts_int8:  # the prefill kernel's scale layout beside the scales (3%)
        from dsv41_jax.model.moe import block_expert_codes, keep_kernel_scales

        keep_kernel_scales(model)
        block_expert_codes(model)  # the codes K-blocked where DSV41_EXPERT_LAYOUT asks (auto by default: on Hopper)
    tok = None
    tp = os.path.join(path, "tokenizer.json")
    if tokenizer and os.path.exists(tp):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tp)
    return DeepseekVL(model, cfg, tok, num, path)
