"""Bad inputs give one clear error (issue 2).

* Configs: ``ModelConfig.from_dict`` / ``from_file`` raise a single ``ConfigError`` whose message
  names the offending key (missing keys, bad compress ratios, o_groups not dividing the heads,
  unknown model types, topology ids pointing at the wrong layers, ...).
* Weight files: ``load_original`` raises a single ``WeightError`` listing EVERY offending tensor
  (missing, wrong shape, unexpected, wrong dtype, NaN/Inf, fp8 without its scale, mis-shaped
  scales), built from tiny checkpoints written by ``dsv41_jax.tiny`` and then corrupted.

Bugs these tests found (experts stacked before their checks, stray scales reported apart, topology
gaps in config validation) are fixed; the tests keep them fixed.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import tiny
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.numerics import FAST_F32
from dsv41_jax.safetensors_io import Checkpoint, SafetensorsError
from dsv41_jax.weights import WeightError, load_original

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def base_config() -> dict:
    p = GOLDEN / "text_fast_fp32" / "config.json"
    if not p.exists():
        pytest.skip("tests/golden/text_fast_fp32 missing")
    with open(p) as f:
        return json.load(f)


def _with(base: dict, *, top=None, **text) -> dict:
    """A copy of ``base`` with text_config keys replaced (value ``...`` deletes the key)."""
    d = copy.deepcopy(base)
    for k, v in text.items():
        if v is ...:
            d["text_config"].pop(k, None)
        else:
            d["text_config"][k] = v
    for k, v in (top or {}).items():
        if v is ...:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def _config_error(d) -> str:
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d)
    return str(ei.value)


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------

def test_golden_config_is_valid(base_config):
    ModelConfig.from_dict(base_config)


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "compress_ratios", "o_groups",
                                 "head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "sliding_window",
                                 "rms_norm_eps", "n_routed_experts", "q_lora_rank", "engram_head_dim"])
def test_missing_text_key_is_named(base_config, key):
    msg = _config_error(_with(base_config, **{key: ...}))
    assert f"text_config.{key}" in msg and "missing" in msg


def test_missing_text_config_is_named(base_config):
    assert "text_config" in _config_error(_with(base_config, top={"text_config": ...}))


def test_missing_rope_scaling_factor_is_named(base_config):
    rs = dict(base_config["text_config"]["rope_scaling"])
    del rs["factor"]
    assert "rope_scaling.factor" in _config_error(_with(base_config, rope_scaling=rs))


@pytest.mark.parametrize("ratios", [[0, 3, 2, 1, 1, 1, 1], [0, 2, 2, 1, 1, 1, 4], [0, -1, 2, 1, 1, 1, 1],
                                    [0, 2, 2, 128, 1, 1, 1]])
def test_bad_compress_ratio_is_named(base_config, ratios):
    msg = _config_error(_with(base_config, compress_ratios=ratios))
    assert "compress_ratios" in msg
    bad = next(r for r in ratios if r not in (0, 1, 2))
    assert str(bad) in msg


def test_too_few_compress_ratios(base_config):
    assert "compress_ratios" in _config_error(_with(base_config, compress_ratios=[0, 2, 2]))


@pytest.mark.parametrize("groups", [3, 0, 8, 5])
def test_o_groups_must_divide_heads(base_config, groups):
    msg = _config_error(_with(base_config, o_groups=groups))
    assert "o_groups" in msg and "num_attention_heads" in msg


@pytest.mark.parametrize("mt", ["deepseek_v3", "deepseek_v4", "deepseek_v41_text", None, "llama"])
def test_unknown_model_type(base_config, mt):
    d = _with(base_config, top={"model_type": mt if mt is not None else ...})
    msg = _config_error(d)
    assert "model_type" in msg and repr(mt) in msg


def test_not_a_mapping():
    assert "JSON object" in _config_error([1, 2, 3])


@pytest.mark.parametrize("key,ids", [
    ("kv_source_layer_ids", [0, 1, 3]),  # layer 0 has ratio 0
    ("kv_source_layer_ids", [1, 9]),  # past the backbone
    ("index_source_layer_ids", [0, 1, 3]),
    ("index_source_layer_ids", [1, 3, -1]),
])
def test_topology_id_pointing_at_a_ratio0_or_missing_layer(base_config, key, ids):
    msg = _config_error(_with(base_config, **{key: ids}))
    assert key in msg and str(next(i for i in ids if not 0 < i < 7 or i == 0)) in msg


def test_compressed_layer_without_a_kv_source(base_config):
    msg = _config_error(_with(base_config, kv_source_layer_ids=[3], index_source_layer_ids=[3]))
    assert "kv_source_layer_ids" in msg and "layer 1" in msg


def test_consumer_with_a_kv_source_of_another_ratio(base_config):
    # layer 3 (ratio 1) would read the compressed KV of layer 2 (ratio 2)
    msg = _config_error(_with(base_config, kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2, 3],
                              candidate_source_layer_id=2))
    assert "compress_ratios" in msg and "layer 3" in msg


def test_candidate_source_must_be_an_index_source(base_config):
    msg = _config_error(_with(base_config, candidate_source_layer_id=2))
    assert "candidate_source_layer_id" in msg


@pytest.mark.parametrize("over,key", [
    ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"qk_rope_head_dim": 128}, "qk_rope_head_dim"),
    ({"index_head_dim": 8}, "index_head_dim"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"candidate_block_size": 0}, "candidate_block_size"),
    ({"engram_num_embeddings": [272]}, "engram_num_embeddings"),
    ({"engram_layer_ids": [0, 9]}, "engram_layer_ids"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2}}, "rope_scaling.rope_type"),
])
def test_other_invalid_values_are_named(base_config, over, key):
    assert key in _config_error(_with(base_config, **over))


def test_engram_key_missing_when_engram_layers_exist(base_config):
    assert "engram_max_ngram_size" in _config_error(_with(base_config, engram_max_ngram_size=...))


def test_bad_image_token_id(base_config):
    msg = _config_error(_with(base_config, top={"image_token_id": 999}))
    assert "image_token_id" in msg


def test_config_file_errors(tmp_path, base_config):
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_file(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_with(base_config, o_groups=3)))
    with pytest.raises(ConfigError, match="o_groups"):
        ModelConfig.from_file(tmp_path)


def test_candidate_user_in_a_group_of_another_ratio(base_config):
    d = _with(base_config, compress_ratios=[0, 1, 1, 2, 2, 2, 2], kv_source_layer_ids=[1, 3],
              index_source_layer_ids=[1, 3], candidate_source_layer_id=1)
    assert "candidate_source_layer_id" in _config_error(d)


def test_kv_source_that_is_not_an_index_source(base_config):
    d = _with(base_config, kv_source_layer_ids=[1, 3], index_source_layer_ids=[1], candidate_source_layer_id=1)
    assert "index_source_layer_ids" in _config_error(d)


# ----------------------------------------------------------------------------------------------
# weight files
# ----------------------------------------------------------------------------------------------

def _raw_tensors(directory) -> dict:
    """{name: array as stored} of a checkpoint directory (E8M0 scales as float8_e8m0fnu)."""
    ck = Checkpoint(str(directory))
    out = {}
    for name in ck.names:
        dt, _ = ck.info(name)
        a = np.array(ck.get(name))
        out[name] = a.view(ml_dtypes.float8_e8m0fnu) if dt == "F8_E8M0" else a
    return out


def _rewrite(directory, tensors: dict):
    tiny.write_safetensors(os.path.join(str(directory), "model.safetensors"), tensors)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    for fmt in ("bf16", "fp8"):
        tiny.write_tiny_checkpoint(str(root / fmt), fmt=fmt, seed=5, vision=False)
    return root


def _copy(checkpoints, fmt, tmp_path) -> Path:
    d = tmp_path / fmt
    shutil.copytree(checkpoints / fmt, d)
    return d


def _weight_error(d, text_only=True) -> str:
    with pytest.raises(WeightError) as ei:
        load_original(str(d), FAST_F32, text_only=text_only)
    return str(ei.value)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_intact_tiny_checkpoints_load(checkpoints, fmt):
    model = load_original(str(checkpoints / fmt), FAST_F32)
    assert model.config.text.num_hidden_layers == 7


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_every_offending_tensor_is_listed_once(checkpoints, fmt, tmp_path):
    d = _copy(checkpoints, fmt, tmp_path)
    t = _raw_tensors(d)
    w = lambda name: name + ".weight"  # noqa: E731
    missing = [w("layers.2.attn.wq_a"), w("layers.6.ffn.shared_experts.w2"), "layers.4.hc_ffn_base"]
    for name in missing:
        del t[name]
    del t[w("layers.3.ffn.experts.4.w1")]  # one routed expert of a stacked parameter
    wrong_shape = ["layers.0.attn_norm.weight", "layers.5.attn.attn_sink", "head.weight"]
    t[wrong_shape[0]] = t[wrong_shape[0]][:-1]
    t[wrong_shape[1]] = np.concatenate([t[wrong_shape[1]], t[wrong_shape[1]]])
    t[wrong_shape[2]] = t[wrong_shape[2]][:, :-2]
    unexpected = ["layers.1.attn.bogus.weight", "layers.99.ffn_norm.weight", "lm_head.weight"]
    for name in unexpected:
        t[name] = np.ones((4,), ml_dtypes.bfloat16)
    nan = ["layers.3.ffn_norm.weight", "layers.1.hc_attn_scale"]
    for name in nan:
        a = np.array(t[name]).astype(np.float32)
        a.reshape(-1)[1] = np.nan if name.endswith("weight") else np.inf
        t[name] = a.astype(t[name].dtype)
    wrong_dtype = ["layers.5.ffn_norm.weight"]
    t[wrong_dtype[0]] = np.arange(t[wrong_dtype[0]].size, dtype=np.int32)
    _rewrite(d, t)
    msg = _weight_error(d)
    names = missing + ["layers.3.ffn.experts.4.w1"] + wrong_shape + unexpected + nan + wrong_dtype
    absent = [n for n in names if n not in msg]
    assert not absent, f"not listed: {absent}\n{msg}"
    assert msg.startswith(f"{len(names)} problem(s)"), msg
    # each problem on its own line, one line per problem
    assert len([ln for ln in msg.splitlines()[1:] if ln.strip()]) == len(names)


@pytest.mark.parametrize("kind", ["missing", "shape", "unexpected", "nan", "dtype"])
def test_each_single_problem_is_a_weight_error(checkpoints, kind, tmp_path):
    d = _copy(checkpoints, "bf16", tmp_path)
    t = _raw_tensors(d)
    name = "layers.4.attn.wkv.weight"
    if kind == "missing":
        del t[name]
    elif kind == "shape":
        t[name] = t[name][:, :-1].copy()
    elif kind == "unexpected":
        name = "layers.4.attn.wkv.bias"
        t[name] = np.zeros((4,), ml_dtypes.bfloat16)
    elif kind == "nan":
        a = np.array(t[name]).astype(np.float32)
        a[0, 0] = np.nan
        t[name] = a.astype(ml_dtypes.bfloat16)
    else:
        t[name] = np.zeros(t[name].shape, np.int16)
    _rewrite(d, t)
    msg = _weight_error(d)
    assert name in msg and msg.startswith("1 problem(s)"), msg


def test_bad_routed_expert_tensors_are_named(checkpoints, tmp_path):
    d = _copy(checkpoints, "bf16", tmp_path)
    t = _raw_tensors(d)
    shape_bad, nan_bad = "layers.3.ffn.experts.2.w1.weight", "layers.4.ffn.experts.1.w3.weight"
    t[shape_bad] = t[shape_bad][:-1]
    a = np.array(t[nan_bad]).astype(np.float32)
    a[0, 0] = np.nan
    t[nan_bad] = a.astype(ml_dtypes.bfloat16)
    _rewrite(d, t)
    msg = _weight_error(d)
    assert shape_bad in msg and nan_bad in msg, msg


def test_fp8_scale_problems(checkpoints, tmp_path):
    d = _copy(checkpoints, "fp8", tmp_path)
    t = _raw_tensors(d)
    no_scale = "layers.0.attn.wq_a.weight"
    del t["layers.0.attn.wq_a.scale"]
    bad_tile = "layers.2.attn.wkv.scale"
    t[bad_tile] = np.concatenate([t[bad_tile], t[bad_tile]], axis=1)
    bad_fp4 = "layers.1.ffn.experts.0.w2.scale"
    t[bad_fp4] = t[bad_fp4][:-1]
    _rewrite(d, t)
    msg = _weight_error(d)
    for name in (no_scale, bad_tile, bad_fp4):
        assert name in msg, msg
    assert msg.startswith("3 problem(s)"), msg


def test_stray_scale_alone_is_reported(checkpoints, tmp_path):
    d = _copy(checkpoints, "fp8", tmp_path)
    t = _raw_tensors(d)
    t["layers.0.attn.nothing.scale"] = t["layers.0.attn.wq_a.scale"]
    _rewrite(d, t)
    assert "layers.0.attn.nothing.scale" in _weight_error(d)


def test_stray_scale_is_listed_with_other_problems(checkpoints, tmp_path):
    d = _copy(checkpoints, "fp8", tmp_path)
    t = _raw_tensors(d)
    t["layers.0.attn.nothing.scale"] = t["layers.0.attn.wq_a.scale"]
    del t["layers.3.attn_norm.weight"]
    _rewrite(d, t)
    msg = _weight_error(d)
    assert "layers.3.attn_norm.weight" in msg and "layers.0.attn.nothing.scale" in msg, msg


def test_vision_tensors_required_unless_text_only(tmp_path):
    d = tmp_path / "vl"
    tiny.write_tiny_checkpoint(str(d), fmt="bf16", seed=1, vision=True)
    t = _raw_tensors(d)
    gone = "vision.blocks.0.attn.wqkv.weight"
    del t[gone]
    _rewrite(d, t)
    assert gone in _weight_error(d, text_only=False)
    load_original(str(d), FAST_F32, text_only=True)  # the text model does not need it


def test_bias_vl_needed_by_a_vision_config(tmp_path):
    d = tmp_path / "vl"
    tiny.write_tiny_checkpoint(str(d), fmt="bf16", seed=1, vision=True)
    t = _raw_tensors(d)
    del t["layers.2.ffn.gate.bias_vl"]
    _rewrite(d, t)
    assert "layers.2.ffn.gate.bias_vl" in _weight_error(d, text_only=True)


def test_unreadable_checkpoint_files(tmp_path, checkpoints):
    d = _copy(checkpoints, "bf16", tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(SafetensorsError, match="no model.safetensors.index.json"):
        load_original(str(d), FAST_F32)
    (d / "model.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(SafetensorsError, match="too short"):
        load_original(str(d), FAST_F32)
    # data section shorter than the header says
    src = (checkpoints / "bf16" / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(src[:-64])
    with pytest.raises((SafetensorsError, WeightError)) as ei:
        load_original(str(d), FAST_F32)
    assert "head.weight" in str(ei.value) or "bytes" in str(ei.value)
