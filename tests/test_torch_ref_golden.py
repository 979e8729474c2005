"""The plain-torch oracle (tests/torch_ref) against the golden fixtures in tests/golden/.

* fast tier (text_fast_fp32, image_fast_fp32): fake-quant off, everything within 1e-5
  max_abs_rel and every discrete decision identical.
* reference tier (text_fp32, image_fp32): fake-quant on, the case's flip-tolerant tolerances.
* bf16 tier (text_bf16, image_fp8): dtype=bfloat16, fake-quant on, the case's loose tolerances
  (image_fp8 loads release-format fp8/fp4 weights; their GEMMs quantize activations).

Image cases: the vision tower is out of scope, so the prompt embeddings come from the
reference's block_in_L0[:, :, 0] (spans merged) and image_mask = types >= 0.
Block-level arrays are checked teacher-forced (README "Teacher forcing"); logits, block_in_L*
and pre_mix_in_L* end to end. decode_logits are checked against the rows of the one-shot
prefill of prompt + decode tokens (decode equals that prefill, README).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.torch_ref import oracle as O  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
FAST = ["text_fast_fp32", "image_fast_fp32"]
REFERENCE = ["text_fp32", "image_fp32"]
BF16 = ["text_bf16", "image_fp8"]

# arrays produced inside a layer: checked teacher-forced
_TF_FAMILIES = ("block_out_L", "pre_mix_out_L", "engram_out_L", "compress_kv_L", "index_k_L",
                "topk_idxs_L", "candidates_L", "moe_topk_L", "moe_weights_L")
_E2E_FAMILIES = ("block_in_L", "pre_mix_in_L")


@functools.lru_cache(maxsize=None)
def _load(name: str):
    d = GOLDEN / name
    if not d.is_dir():
        pytest.skip(f"golden case {name} not present")
    cfg, config, weights, case, ref = O.load_case(str(d))
    token_map, n_compressed = O.build_token_map(str(d / "tokenizer.json"))
    assert n_compressed == cfg["engram_compressed_vocab_size"]
    return cfg, config, weights, case, ref, token_map


def _run_opts(name):
    case = _load(name)[3]
    return {
        "fake_quant": case["numerics"] == "reference",
        "dtype": torch.bfloat16 if case["compute_dtype"] == "bfloat16" else torch.float32,
    }


def _prompt_inputs(name):
    """kwargs for the prompt prefill, hashes taken from the reference."""
    cfg, _, _, _, ref, _ = _load(name)
    img = ref["types"] >= 0
    kw = {"input_ids": torch.from_numpy(ref["input_ids"]),
          "engram_hashes": {l: ref[f"engram_hashes_L{l}"] for l in cfg["engram_layer_ids"]}}
    if img.any():
        kw["image_mask"] = torch.from_numpy(img)
        kw["inputs_embeds"] = torch.from_numpy(ref["block_in_L0"][:, :, 0])
    return kw


def _long_inputs(name):
    """kwargs for the one-shot prefill of prompt + decode tokens; hashes computed here."""
    _, _, weights, case, ref, token_map = _load(name)
    dec = torch.tensor([b["decode_tokens"] for b in case["batch"]], dtype=torch.long)
    ids = torch.cat([torch.from_numpy(ref["input_ids"]), dec], dim=1)
    kw = {"input_ids": ids, "token_map": token_map}
    img = ref["types"] >= 0
    if img.any():
        kw["image_mask"] = torch.cat([torch.from_numpy(img), torch.zeros_like(dec, dtype=torch.bool)], 1)
        kw["inputs_embeds"] = torch.cat(
            [torch.from_numpy(ref["block_in_L0"][:, :, 0]), weights["embed.weight"][dec]], dim=1)
    return kw


@functools.lru_cache(maxsize=None)
def _prefill(name):
    cfg, _, weights, _, _, _ = _load(name)
    cap = {}
    logits = O.forward(cfg, weights, **_prompt_inputs(name), **_run_opts(name), capture=cap)
    cap["prefill_logits"] = logits.numpy()
    return cap


@functools.lru_cache(maxsize=None)
def _teacher_forced(name):
    cfg, _, weights, _, ref, _ = _load(name)
    cap = {}
    O.forward(cfg, weights, **_prompt_inputs(name), **_run_opts(name), capture=cap, teacher=ref)
    return cap


@functools.lru_cache(maxsize=None)
def _long_prefill(name):
    cfg, _, weights, _, _, _ = _load(name)
    return O.forward(cfg, weights, **_long_inputs(name), **_run_opts(name)).numpy()


# --------------------------------------------------------------------------------------------
# the README's metrics
# --------------------------------------------------------------------------------------------


def max_abs_rel(got, ref):
    return float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def check(name: str, got: np.ndarray, ref: np.ndarray, tol: dict) -> tuple[list[str], dict]:
    """Failures (empty = pass) and the measured values, for one array."""
    fails, seen = [], {}
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    if tol.get("exact"):
        seen["exact"] = bool(np.array_equal(got, ref))
        if not seen["exact"]:
            fails.append(f"{name}: not exact")
    if "max_abs_rel" in tol:
        v = max_abs_rel(got, ref)
        seen["max_abs_rel"] = v
        if v > tol["max_abs_rel"]:
            fails.append(f"{name}: max_abs_rel {v:.3g} > {tol['max_abs_rel']}")
    if "frac_rows_within" in tol:
        scale = max(np.abs(ref).max(), 1e-30)
        diff = np.abs(got.astype(np.float64) - ref).reshape(ref.shape[0] * ref.shape[1], -1)
        frac = float((diff.max(-1) / scale <= tol["frac_rows_within"]["rel"]).mean())
        seen["frac_rows_within"] = frac
        if frac < tol["frac_rows_within"]["min_frac"]:
            fails.append(f"{name}: frac_rows_within {frac:.3f} < {tol['frac_rows_within']['min_frac']}")
    if "argmax_agree_min" in tol:
        v = float((got.argmax(-1) == ref.argmax(-1)).mean())
        seen["argmax_agree"] = v
        if v < tol["argmax_agree_min"]:
            fails.append(f"{name}: argmax agreement {v:.3f} < {tol['argmax_agree_min']}")
    if "row_set_agree_min" in tol:
        v = float((np.sort(got, -1) == np.sort(ref, -1)).all(-1).mean())
        seen["row_set_agree"] = v
        if v < tol["row_set_agree_min"]:
            fails.append(f"{name}: row-set agreement {v:.3f} < {tol['row_set_agree_min']}")
    if "frac_equal_min" in tol:
        v = float((got == ref).mean())
        seen["frac_equal"] = v
        if v < tol["frac_equal_min"]:
            fails.append(f"{name}: frac_equal {v:.3f} < {tol['frac_equal_min']}")
    return fails, seen


def _check_many(name, produced: dict, families, report_label):
    _, _, _, case, ref, _ = _load(name)
    tols = case["tolerances"]
    fails, checked = [], 0
    for key, got in sorted(produced.items()):
        if not key.startswith(families) or key not in ref:
            continue
        f, seen = check(key, got, ref[key], tols[key])
        if case["numerics"] == "fast" and "max_abs_rel" in seen:
            # the fast tier's contract, independent of what case.json says
            if seen["max_abs_rel"] > 1e-5:
                f.append(f"{key}: fast tier max_abs_rel {seen['max_abs_rel']:.3g} > 1e-5")
        fails += f
        checked += 1
    assert checked > 0, f"{name}: nothing to check for {report_label}"
    assert not fails, f"{name} ({report_label}):\n" + "\n".join(fails)
    return checked


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------

ALL = FAST + REFERENCE + BF16


@pytest.mark.parametrize("name", ALL)
def test_token_map_and_engram_hashes(name):
    cfg, _, _, _, ref, token_map = _load(name)
    np.testing.assert_array_equal(token_map, ref["engram_token_map"])
    img = ref["types"] >= 0
    hashes = O.engram_hashes_from_ids(cfg, token_map, ref["input_ids"], ~img)
    for l in cfg["engram_layer_ids"]:
        np.testing.assert_array_equal(hashes[l].numpy(), ref[f"engram_hashes_L{l}"])


@pytest.mark.parametrize("name", ALL)
def test_prefill_end_to_end(name):
    cap = _prefill(name)
    _check_many(name, {"prefill_logits": cap["prefill_logits"]}, ("prefill_logits",), "logits")
    _check_many(name, cap, _E2E_FAMILIES, "end-to-end stream")


@pytest.mark.parametrize("name", ALL)
def test_long_prefill_and_decode_rows(name):
    _, _, _, _, ref, _ = _load(name)
    logits = _long_prefill(name)
    S = ref["input_ids"].shape[1]
    _check_many(name, {"long_prefill_logits": logits}, ("long_prefill_logits",), "long prefill")
    # decode with the index-key fix equals the longer prefill (README semantics 1)
    _check_many(name, {"decode_logits": logits[:, S:]}, ("decode_logits",), "decode rows")


@pytest.mark.parametrize("name", ALL)
def test_teacher_forced_blocks(name):
    cap = _teacher_forced(name)
    n = _check_many(name, cap, _TF_FAMILIES, "teacher-forced")
    cfg = _load(name)[0]
    assert n >= 4 * cfg["num_hidden_layers"]


@pytest.mark.parametrize("name", FAST)
def test_fast_tier_strict(name):
    """The brief's explicit gates: logits within 1e-5, teacher-forced decisions identical."""
    _, _, _, _, ref, _ = _load(name)
    assert max_abs_rel(_prefill(name)["prefill_logits"], ref["prefill_logits"]) <= 1e-5
    assert max_abs_rel(_long_prefill(name), ref["long_prefill_logits"]) <= 1e-5
    tf = _teacher_forced(name)
    for key, got in tf.items():
        if key.startswith(("topk_idxs_L", "candidates_L", "moe_topk_L")):
            assert np.array_equal(got, ref[key]), key  # same order too (ascending / by score)
        elif key.startswith(_TF_FAMILIES):
            assert max_abs_rel(got, ref[key]) <= 1e-5, key


def test_quant_codecs_against_ml_dtypes():
    import ml_dtypes

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-12, 10, (4096,), generator=g).float())
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -3.5, 0.0, -0.0])
    # e4m3: torch's cast against ml_dtypes (both round to nearest even)
    xs = x.clamp(-448, 448)
    ref8 = torch.from_numpy(xs.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert torch.equal(O.e4m3_rne(xs), ref8)
    # e2m1: our table rounding against ml_dtypes' float4_e2m1fn
    v = torch.cat([(x / x.abs().max() * 6).clamp(-6, 6), ties])
    ref4 = torch.from_numpy(v.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert torch.equal(O.e2m1_rne(v), ref4)
    assert O.e2m1_rne(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == \
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # power-of-two ceiling from the bits
    t = torch.tensor([1.0, 1.5, 2.0, 2.0000002, 0.75, 3e-7])
    assert O.pow2_ceil(t).tolist() == [1.0, 2.0, 2.0, 4.0, 1.0, 2.0 ** -21]
    # QDQ outputs are exact in bf16
    y = torch.randn(8, 64, generator=g)
    for q in (O.qdq_fp8_ue8m0(y, 32), O.qdq_fp4_ue8m0(y, 32), O.qdq_fp4_e4m3(y, 16)):
        assert torch.equal(q, q.bfloat16().float())
