"""The user API: load (original and converted), logits against the plain forward, chat encoding."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv41_jax
from dsv41_jax.api import encode_chat
from dsv41_jax.tiny import write_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.path.join(ROOT, "dsv41_jax", "assets", "demo.png")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("api"))
    write_tiny_checkpoint(d, fmt="fp8", seed=3)
    return dsv41_jax.load(d, dtype="float32", numerics="fast")


def test_logits_match_the_plain_forward(model):
    prompt = "Hello<｜deepseek_image｜>hello"
    got = model.logits(prompt, [IMG])
    prep = model.prepare(prompt, [IMG])
    graphdef, state = nnx.split(model.model)  # the module's __call__, jitted (one compile, not one per op)
    plain = jax.jit(lambda st, ids, emb, mask: nnx.merge(graphdef, st)(ids, inputs_embeds=emb, image_mask=mask))
    ref, _ = plain(state, jnp.asarray(np.asarray(prep.input_ids[0])[None]), prep.inputs_embeds, prep.image_mask)
    ref = np.asarray(ref[0])
    assert got.shape == ref.shape == (len(prep.input_ids[0]), model.config.text.vocab_size)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-5


def test_generate_reports_spans_and_decodes(model):
    out = model.generate("Hello<｜deepseek_image｜>hello", [IMG], max_new_tokens=3)
    pi = model.preprocess(IMG)
    assert out.image_spans == [[(*pi.llm_grid, pi.span_len)]]
    assert len(out.tokens[0]) == 3 and out.finish_reasons == ["length"]
    assert out.text[0] == model.decode(out.tokens[0])


def test_chat_encoding_format():
    s = encode_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                     {"role": "assistant", "content": "A"}, {"role": "user", "content": [{"type": "text", "text": "R"}]}])
    assert s == ("<｜begin▁of▁sentence｜>S<｜User｜>Q<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
                 "<｜User｜>R<｜Assistant｜></think>")
    assert encode_chat([{"role": "user", "content": "Q"}], thinking=True).endswith("<｜Assistant｜><think>")
    with pytest.raises(ValueError, match="role"):
        encode_chat([{"role": "robot", "content": "x"}])


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        dsv41_jax.load(str(tmp_path / "missing"))
