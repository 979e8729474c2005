"""Loading weights stored under the ORIGINAL DeepSeek checkpoint names into the NNX module tree.

The module tree mirrors the checkpoint names: the NNX path ``('layers', 3, 'attn', 'wq_a',
'weight')`` is the tensor ``layers.3.attn.wq_a.weight``. The few exceptions are declared in
``STACKED`` (routed experts are stacked per layer) and handled in one place, so the key table
is exact and strict: every model parameter must be found, every checkpoint tensor must be used
(or be on the explicit ignore list), shapes must agree, and all problems are reported at once.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
from flax import nnx


class WeightError(ValueError):
    """Checkpoint tensors that do not fit the model: every offending name is listed."""


# Checkpoint tensors that the model deliberately does not hold.
IGNORED = (re.compile(r"^mtp\."),)

# NNX path of a stacked parameter -> checkpoint name template with {e} for the stacked index.
_EXPERT_RE = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(w[123])\.(weight|scale)$")


class ValueReader:
    """Reads the current value of each of ``variables`` (what ``get_value()`` returns), fast.

    ``get_value()`` copies through ``jax.tree.map`` and checks for array refs and hooks: ~3.4 us
    per Variable, ~4.5 ms for the 1317 Variables of the 40-layer model on every ``generate`` call
    and ~0.9 ms for the vision tower's 263 on every ``encode_images`` (docs/performance.md
    session 26). A Variable whose class keeps ``nnx.Variable.get_value`` and whose metadata
    declares no ref, no hijax and no ``on_get_value`` hook (decided once, here) is read with
    ``get_raw_value()`` (~0.1 us: the same array object); the others keep ``get_value()``."""

    def __init__(self, variables):
        self.variables = list(variables)
        self.plain = [type(v).get_value is nnx.Variable.get_value
                      and not (m.get("ref") or m.get("hijax") or "on_get_value" in m)
                      for v, m in ((v, v.get_metadata()) for v in self.variables)]

    def __call__(self) -> list:
        return [v.get_raw_value() if p else v.get_value() for v, p in zip(self.variables, self.plain)]


def path_to_name(path: Iterable) -> str:
    return ".".join(str(p) for p in path)


def param_names(module: nnx.Module) -> dict[str, tuple]:
    """Checkpoint-style name -> (nnx path, shape, dtype) for every nnx.Param of ``module``."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        v = var.get_value()
        out[path_to_name(path)] = (path, tuple(v.shape), v.dtype)
    return out


def expert_source_names(name: str, n_experts: int) -> list[str] | None:
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    return [f"{m.group(1)}.{e}.{m.group(2)}.{m.group(3)}" for e in range(n_experts)]


def assign_params(module: nnx.Module, get: Callable[[str], np.ndarray | None], available: Iterable[str],
                  *, prefix: str = "", n_experts: int = 0, strict: bool = True,
                  convert: Callable[[str, np.ndarray, tuple, np.dtype], np.ndarray] | None = None,
                  extra_problems: Iterable[str] = ()) -> set[str]:
    """Fill every nnx.Param of ``module`` from ``get(original_name)``.

    ``available``: the checkpoint's tensor names (for the unexpected-tensor check, restricted to
    ``prefix``). Returns the set of checkpoint names consumed. Raises one WeightError listing
    every missing, unexpected or mis-shaped tensor.
    """
    available = set(available)
    problems: list[str] = list(extra_problems)
    used: set[str] = set()
    updates = {}
    for name, (path, shape, dtype) in param_names(module).items():
        full = prefix + name
        srcs = expert_source_names(full, n_experts)
        try:
            if srcs is not None:
                missing = [s_ for s_ in srcs if s_ not in available]
                used.update(s_ for s_ in srcs if s_ in available)
                if missing:
                    problems.append(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more experts)" if len(missing) > 1 else ""))
                    continue
                parts, bad = [], False
                for s_ in srcs:
                    try:
                        a = get(s_)
                    except WeightError as e:
                        problems.append(str(e))
                        bad = True
                        continue
                    if tuple(a.shape) != shape[1:]:
                        problems.append(f"tensor {s_}: shape {list(a.shape)} does not match the model's {list(shape[1:])}")
                        bad = True
                    elif np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a.astype(np.float32))):
                        problems.append(f"tensor {s_}: contains NaN or Inf")
                        bad = True
                    parts.append(a)
                if bad:
                    continue
                arr = np.stack(parts)
            else:
                if full not in available:
                    problems.append(f"missing tensor {full} (expected shape {list(shape)})")
                    continue
                used.add(full)  # before get(): a tensor that fails to decode is not also "unexpected"
                arr = get(full)
        except WeightError as e:
            problems.append(str(e))
            continue
        if convert is not None:
            arr = convert(full, arr, shape, dtype)
        if tuple(arr.shape) != shape:
            problems.append(f"tensor {full}: shape {list(arr.shape)} does not match the model's {list(shape)}")
            continue
        if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr.astype(np.float32))):
            problems.append(f"tensor {full}: contains NaN or Inf")
            continue
        updates[path] = arr
    if strict:
        for name in sorted(available):
            if name.startswith(prefix) and name not in used and not any(r.match(name) for r in IGNORED):
                problems.append(f"unexpected tensor {name} (not part of the model)")
    if problems:
        raise WeightError(f"{len(problems)} problem(s) loading weights:\n  " + "\n  ".join(problems))
    state = nnx.state(module, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    import jax.numpy as jnp

    for path, arr in updates.items():
        var = flat[path]
        var.set_value(jnp.asarray(arr, dtype=var.get_value().dtype))
    nnx.update(module, state)
    return used


# ---------------------------------------------------------------------------------------------
# Original-format checkpoint -> model

_VISION_RE = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)")
_RAW_RE = re.compile(r"\.engram\.embed\.(weight|scale)$")


def dequantize_tensor(ck, name: str, block: tuple[int, int] = (32, 32)) -> np.ndarray:
    """The float32 value of checkpoint tensor ``name`` (fp8 32x32 blocks and fp4 experts decoded
    exactly with their ``.scale``; bf16/fp32 widened)."""
    from dsv41_jax import quant

    dtype, shape = ck.info(name)
    arr = ck.get(name)
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    has_scale = scale_name is not None and scale_name in ck
    if dtype == "F8_E4M3":
        if not has_scale:
            raise WeightError(f"tensor {name}: F8_E4M3 without its scale tensor {scale_name}")
        sc = quant.raw_u8(ck.get(scale_name))
        bo, bi = block
        if -(-shape[0] // bo) != sc.shape[0] or -(-shape[1] // bi) != sc.shape[1]:
            raise WeightError(f"tensor {scale_name}: shape {list(sc.shape)} does not tile {name} {list(shape)}")
        return quant.dequant_fp8_blocks(arr, sc, block=(bo, bi))
    if dtype in ("I8", "U8") and has_scale:
        sc = quant.raw_u8(ck.get(scale_name))
        if sc.shape[0] != shape[0] or sc.shape[1] * 32 != shape[1] * 2:
            raise WeightError(f"tensor {scale_name}: shape {list(sc.shape)} does not match fp4 tensor {name} {list(shape)}")
        return quant.dequant_fp4_experts(arr, sc)
    if dtype in ("BF16", "F16", "F32", "F64"):
        return np.asarray(arr, dtype=np.float32)
    raise WeightError(f"tensor {name}: unexpected dtype {dtype}")


def attach_token_map(model, directory: str, cache_dir: str | None = None) -> None:
    """Give the model's Engram hasher the compressed token map of the checkpoint's tokenizer
    (cached as ``engram_token_map.npy`` in ``cache_dir`` when given, e.g. a converted checkpoint)."""
    if getattr(model, "engram_hasher", None) is None:
        return
    from dsv41_jax.engram_hash import TOKEN_MAP_FILE, load_or_build_token_map

    tok = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tok):
        raise WeightError(f"{directory}: no tokenizer.json; the Engram layers need it for their token map")
    t = model.config.text
    tmap = load_or_build_token_map(tok, t.vocab_size, os.path.join(cache_dir, TOKEN_MAP_FILE) if cache_dir else None,
                                   compressed_vocab_size=t.engram_compressed_vocab_size)
    model.engram_hasher.set_token_map(tmap)


def _linear_modules(model):
    from dsv41_jax.model.layers import Linear
    from dsv41_jax.model.moe import Experts

    for path, mod in nnx.iter_graph(model):
        if isinstance(mod, (Linear, Experts)):
            yield path_to_name(path), mod


_EXPERT_TENSOR_RE = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")

# Linear modules the V4.1 release stores fp8 e4m3 with 32x32 ue8m0 block scales (decoder_spec
# 10.1): attention q/kv/output projections, the indexer query projection, the shared experts and
# the Engram key/value projection. ``dense_fp8`` loads take the list from the checkpoint itself;
# this pattern is for building models without one (benchmarks, memory tables).
RELEASE_FP8_LINEAR_RE = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)$")


def release_fp8_linears(model) -> list[str]:
    """Names of the Linear modules of ``model`` that the release checkpoint stores fp8."""
    from dsv41_jax.model.layers import Linear

    return [path_to_name(p) for p, m in nnx.iter_graph(model)
            if isinstance(m, Linear) and RELEASE_FP8_LINEAR_RE.match(path_to_name(p))]


def fp8_linear_names(ck, model, block=(32, 32)) -> list[str]:
    """The Linear modules of ``model`` (decoder only) that checkpoint ``ck`` stores F8_E4M3 with a
    ue8m0 ``.scale`` and that fp8 storage can hold (in_features and the input block divisible by
    32); the others load dequantized."""
    from dsv41_jax.model.layers import FP8_GROUP, Linear

    out = []
    for path, m in nnx.iter_graph(model):
        name = path_to_name(path)
        if not isinstance(m, Linear) or _VISION_RE.match(name):
            continue
        w = name + ".weight"
        if w in ck and (name + ".scale") in ck and ck.info(w)[0] == "F8_E4M3" \
                and ck.info(name + ".scale")[0] in ("F8_E8M0", "U8") \
                and m.in_features % FP8_GROUP == 0 and block[1] % FP8_GROUP == 0:
            out.append(name)
    return out


def fp8_row_scales(sc, out_features: int, in_features: int, block=(32, 32), name: str = "") -> np.ndarray:
    """Checkpoint block scales [ceil(out/Bo), ceil(in/Bi)] (ue8m0) -> the fp8 storage layout
    [out, in/32] uint8 (row o, group j holds block (o // Bo, 32 j // Bi)). Refuses bytes outside
    ``FP8_EXACT_SCALES`` (their values would not be exact normal bf16 numbers)."""
    from dsv41_jax import quant
    from dsv41_jax.model.layers import FP8_EXACT_SCALES, FP8_GROUP

    u = quant.raw_u8(sc)
    bo, bi = block
    if u.shape != (-(-out_features // bo), -(-in_features // bi)):
        raise WeightError(f"tensor {name}: shape {list(u.shape)} does not tile [{out_features}, {in_features}] "
                          f"by {bo}x{bi}")
    lo, hi = FP8_EXACT_SCALES
    if u.size and (int(u.min()) < lo or int(u.max()) > hi):
        raise WeightError(f"tensor {name}: scale bytes {int(u.min())}..{int(u.max())} outside {lo}..{hi}, where "
                          "fp8 storage is exact; load without dense_fp8")
    rows = np.repeat(u, bo, axis=0)[:out_features]
    cols = np.repeat(rows, bi // FP8_GROUP, axis=1)[:, : in_features // FP8_GROUP]
    return np.ascontiguousarray(cols)


def load_original(directory: str, numerics, *, text_only: bool = False, config=None, experts_int8: bool = False,
                  dense_fp8: bool = False):
    """Build a DeepseekV41 from an original-format DeepSeek checkpoint directory.

    ``experts_int8``: keep the release fp4 routed experts quantized in memory (int8 codes = 2 x
    e2m1 value, plus the ue8m0 scale bytes), dequantized only where a computation reads them.
    ``dense_fp8``: keep the decoder's fp8 Linear weights as float8_e4m3fn codes + ue8m0 scale
    bytes [out, in/32] (see ``Linear.set_fp8``), dequantized exactly inside each GEMM."""
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.model.layers import Linear
    from dsv41_jax.model.lm import DeepseekV41
    from dsv41_jax.safetensors_io import Checkpoint

    cfg = config or ModelConfig.from_file(directory)
    ck = Checkpoint(directory)
    eng_q = any(n.endswith(".engram.embed.scale") for n in ck.names)
    block = tuple(cfg.quant.weight_block_size) if cfg.quant is not None else (32, 32)
    if experts_int8:
        fp4 = [n for n in ck.names if re.search(r"\.ffn\.experts\.\d+\.w1\.weight$", n)]
        not_fp4 = [n for n in fp4 if ck.info(n)[0] not in ("I8", "U8")]
        if not fp4 or not_fp4:
            raise WeightError(f"{directory}: experts_int8 needs fp4 routed experts (I8-packed with .scale); "
                              f"found {ck.info(not_fp4[0])[0] + ' in ' + not_fp4[0] if not_fp4 else 'none'}")
    fp8_names = ()
    if dense_fp8:
        fp8_names = fp8_linear_names(ck, nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, text_only=True)), block)
        if not fp8_names:
            raise WeightError(f"{directory}: dense_fp8 needs fp8 (F8_E4M3 + .scale) Linear weights; found none")
    model = DeepseekV41(cfg, numerics, engram_quantized=eng_q, text_only=text_only, experts_int8=experts_int8,
                        dense_fp8=fp8_names)
    fp8_tensors = {n + s_ for n in fp8_names for s_ in (".weight", ".scale")}
    # activation fake-quant where the checkpoint stores the weight fp8/fp4 (wo_a runs bf16)
    for name, mod in _linear_modules(model):
        if isinstance(mod, Linear):
            mod.quantized = (name + ".scale") in ck and not name.endswith("attn.wo_a")
        else:
            mod.quantized = (name + ".0.w1.scale") in ck
    available = [n for n in ck.names
                 if not n.endswith(".scale") or _RAW_RE.search(n) or (experts_int8 and _EXPERT_TENSOR_RE.search(n))
                 or n in fp8_tensors]
    if cfg.vision is None or text_only:
        available = [n for n in available if not _VISION_RE.match(n)]

    def get(name):
        if name in fp8_tensors:
            from dsv41_jax import quant

            w = name[: -len("scale")] + "weight" if name.endswith(".scale") else name
            o, i = ck.info(w)[1]
            if name.endswith(".scale"):
                return fp8_row_scales(ck.get(name), o, i, block, name)
            codes = quant.raw_u8(ck.get(name))
            if np.any((codes & 0x7F) == 0x7F):
                raise WeightError(f"tensor {name}: contains NaN")
            return codes.view(ml_dtypes.float8_e4m3fn)
        if experts_int8 and _EXPERT_TENSOR_RE.search(name):
            from dsv41_jax import quant

            a = ck.get(name)
            if name.endswith(".scale"):
                return quant.raw_u8(a)
            return (2 * quant.unpack_fp4(a)).astype(np.int8)  # twice the e2m1 value: exact integers
        if _RAW_RE.search(name):
            a = ck.get(name)
            if name.endswith(".scale"):
                from dsv41_jax import quant

                return quant.raw_u8(a)
            return a
        return dequantize_tensor(ck, name, block)

    def convert(name, arr, shape, dtype):
        if _RAW_RE.search(name) or arr.dtype in (np.int8, np.uint8) or name in fp8_tensors:
            return arr
        return arr.astype(np.float32)

    # scales must belong to a weight: reported together with every other problem
    expected = set()
    for name in param_names(model):
        srcs = expert_source_names(name, cfg.text.n_routed_experts)
        expected.update(srcs if srcs is not None else [name])
    stray = []
    for n in ck.names:
        if n.endswith(".scale") and not _RAW_RE.search(n) and not any(r.match(n) for r in IGNORED):
            w = n[: -len("scale")] + "weight"
            if (experts_int8 and _EXPERT_TENSOR_RE.search(n)) or n in fp8_tensors:
                continue  # consumed as a parameter
            if w not in ck and w not in expected:  # a missing model weight is reported as missing
                stray.append(f"unexpected tensor {n} (no matching {w})")
    assign_params(model, get, available, n_experts=cfg.text.n_routed_experts, convert=convert, extra_problems=stray)
    attach_token_map(model, directory)
    return model
