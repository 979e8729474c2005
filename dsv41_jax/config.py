"""Model configuration: frozen dataclasses read from a DeepSeek-V4.1 ``config.json``.

The layer topology (who owns a compressor, an indexer, the candidate mask, an Engram
table, which RoPE a layer uses) is derived once here and carried as plain data, so the
modules never re-derive it.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V4.1 model."""


def _need(d: Mapping[str, Any], key: str, where: str):
    if key not in d:
        raise ConfigError(f"config: missing key '{where}{key}'")
    return d[key]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Static role of one backbone layer."""

    index: int
    ratio: int  # 0: window only; 1, 2: window + indexer top-k over compressed KV
    kv_source: int  # layer whose compressor/index keys this layer reads (-1 if ratio 0)
    index_source: int  # layer whose top-k this layer reads (-1 if ratio 0)
    owns_compressor: bool
    owns_indexer: bool
    is_candidate_source: bool
    uses_candidates: bool  # an index source after the candidate source
    engram_slot: int  # position in engram_layer_ids, -1 if no engram

    @property
    def has_engram(self) -> bool:
        return self.engram_slot >= 0


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    gate_temp: float
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int = 0
    layers: tuple[LayerPlan, ...] = ()

    # derived sizes
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def has_candidates(self) -> bool:
        return self.candidate_source_layer_id >= 0


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    activation_scheme: str = "dynamic"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None
    quant: QuantConfig | None
    image_token_id: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    raw: Mapping[str, Any] = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        return parse_config(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config: no such file {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config: {path} is not valid JSON ({e})") from None
        return parse_config(d)

    def to_dict(self) -> dict:
        return dict(self.raw)


def plan_layers(
    ratios: Sequence[int],
    kv_sources: Sequence[int],
    index_sources: Sequence[int],
    candidate_source: int,
    engram_layers: Sequence[int],
) -> tuple[LayerPlan, ...]:
    plans = []
    for l, r in enumerate(ratios):
        kv = max((s for s in kv_sources if s <= l), default=-1) if r > 0 else -1
        ix = max((s for s in index_sources if s <= l), default=-1) if r > 0 else -1
        plans.append(
            LayerPlan(
                index=l,
                ratio=int(r),
                kv_source=kv,
                index_source=ix,
                owns_compressor=l in kv_sources,
                owns_indexer=l in index_sources,
                is_candidate_source=(candidate_source >= 0 and l == candidate_source),
                uses_candidates=(candidate_source >= 0 and l in index_sources and l > candidate_source),
                engram_slot=list(engram_layers).index(l) if l in engram_layers else -1,
            )
        )
    return tuple(plans)


def _default_kv_sources(ratios: Sequence[int]) -> list[int]:
    out, prev = [], 0
    for l, r in enumerate(ratios):
        if r > 0 and r != prev:
            out.append(l)
        prev = r
    return out


def parse_text_config(t: Mapping[str, Any], where: str = "text_config.") -> TextConfig:
    g = lambda k: _need(t, k, where)  # noqa: E731
    L = int(g("num_hidden_layers"))
    n_draft = int(t.get("num_nextn_predict_layers", 0) or 0)
    ratios = [int(r) for r in g("compress_ratios")]
    if len(ratios) < L:
        raise ConfigError(
            f"config: '{where}compress_ratios' has {len(ratios)} entries, need at least num_hidden_layers={L}")
    ratios = ratios[:L]
    for l, r in enumerate(ratios):
        if r not in (0, 1, 2):
            raise ConfigError(f"config: '{where}compress_ratios'[{l}] = {r}; DeepSeek-V4.1 supports 0, 1 and 2")
    kv_sources = t.get("kv_source_layer_ids")
    kv_sources = _default_kv_sources(ratios) if kv_sources is None else [int(x) for x in kv_sources]
    idx_sources = t.get("index_source_layer_ids")
    idx_sources = list(kv_sources) if idx_sources is None else [int(x) for x in idx_sources]
    cand = t.get("candidate_source_layer_id")
    cand = (kv_sources[-1] if kv_sources else -1) if cand is None else int(cand)
    for name, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", idx_sources)):
        for s in ids:
            if not 0 <= s < L or ratios[s] == 0:
                raise ConfigError(f"config: '{where}{name}' contains {s}, which is not a compressed backbone layer")
    for l, r in enumerate(ratios):
        if r > 0:
            kv = max((s for s in kv_sources if s <= l), default=None)
            ix = max((s for s in idx_sources if s <= l), default=None)
            if kv is None:
                raise ConfigError(f"config: layer {l} has compress ratio {r} but no '{where}kv_source_layer_ids' entry <= {l}")
            if ix is None:
                raise ConfigError(f"config: layer {l} has compress ratio {r} but no '{where}index_source_layer_ids' entry <= {l}")
            if ratios[kv] != r:
                raise ConfigError(
                    f"config: layer {l} (ratio {r}) reads kv source {kv} of ratio {ratios[kv]} ('{where}compress_ratios')")
            if kv > ix:
                raise ConfigError(
                    f"config: layer {l} reads kv source {kv} but index source {ix} < {kv}: every kv source must "
                    f"also be listed in '{where}index_source_layer_ids' (its indexer owns the index keys)")
    if cand >= 0 and cand not in idx_sources:
        raise ConfigError(f"config: '{where}candidate_source_layer_id' = {cand} is not an index source")
    if cand >= 0:
        for s in idx_sources:
            if s > cand and ratios[s] != ratios[cand]:
                raise ConfigError(
                    f"config: '{where}candidate_source_layer_id' = {cand} (ratio {ratios[cand]}) filters index source "
                    f"{s} of another ratio ({ratios[s]}); their compressed positions differ")
    H = int(g("num_attention_heads"))
    G = int(g("o_groups"))
    if G <= 0 or H % G:
        raise ConfigError(f"config: '{where}o_groups' = {G} must divide num_attention_heads = {H}")
    d, r = int(g("head_dim")), int(g("qk_rope_head_dim"))
    if r % 2 or r > d:
        raise ConfigError(f"config: '{where}qk_rope_head_dim' = {r} must be even and <= head_dim = {d}")
    if int(g("index_head_dim")) < r:
        raise ConfigError(f"config: '{where}index_head_dim' must be >= qk_rope_head_dim")
    if int(t.get("num_key_value_heads", 1)) != 1:
        raise ConfigError(f"config: '{where}num_key_value_heads' must be 1 (single shared K=V latent)")
    if int(t.get("n_shared_experts", 1)) != 1:
        raise ConfigError(f"config: '{where}n_shared_experts' must be 1")
    if t.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConfigError(f"config: '{where}scoring_func' = {t.get('scoring_func')!r}; only 'sqrtsoftplus' is supported")
    E, k = int(g("n_routed_experts")), int(g("num_experts_per_tok"))
    if not 0 < k <= E:
        raise ConfigError(f"config: '{where}num_experts_per_tok' = {k} must be in 1..n_routed_experts={E}")
    rs = t.get("rope_scaling")
    rope_scaling = None
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype != "yarn":
            raise ConfigError(f"config: '{where}rope_scaling.rope_type' = {rtype!r}; only 'yarn' is supported")
        rope_scaling = RopeScaling(
            factor=float(_need(rs, "factor", where + "rope_scaling.")),
            original_max_position_embeddings=int(_need(rs, "original_max_position_embeddings", where + "rope_scaling.")),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
        )
    engram_layers = [int(x) for x in t.get("engram_layer_ids", []) or []]
    engram_rows = [int(x) for x in t.get("engram_num_embeddings", []) or []]
    if engram_layers:
        if len(engram_rows) != len(engram_layers):
            raise ConfigError(
                f"config: '{where}engram_num_embeddings' has {len(engram_rows)} entries for {len(engram_layers)} engram layers")
        for l in engram_layers:
            if not 0 <= l < L:
                raise ConfigError(f"config: '{where}engram_layer_ids' contains {l}, outside 0..{L - 1}")
        for key in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                    "engram_compressed_vocab_size"):
            g(key)
    if int(g("sliding_window")) <= 0:
        raise ConfigError(f"config: '{where}sliding_window' must be positive")
    if cand >= 0 and int(g("candidate_block_size")) <= 0:
        raise ConfigError(f"config: '{where}candidate_block_size' must be positive")
    return TextConfig(
        vocab_size=int(g("vocab_size")),
        hidden_size=int(g("hidden_size")),
        moe_intermediate_size=int(g("moe_intermediate_size")),
        num_hidden_layers=L,
        num_attention_heads=H,
        head_dim=d,
        qk_rope_head_dim=r,
        q_lora_rank=int(g("q_lora_rank")),
        o_lora_rank=int(g("o_lora_rank")),
        o_groups=G,
        swiglu_limit=float(g("swiglu_limit")),
        rms_norm_eps=float(g("rms_norm_eps")),
        rope_theta=float(g("rope_theta")),
        compress_rope_theta=float(g("compress_rope_theta")),
        rope_scaling=rope_scaling,
        n_routed_experts=E,
        n_shared_experts=1,
        num_experts_per_tok=k,
        routed_scaling_factor=float(g("routed_scaling_factor")),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        gate_temp=float(t.get("gate_temp", 1.0) or 1.0),
        sliding_window=int(g("sliding_window")),
        compress_ratios=tuple(ratios),
        kv_source_layer_ids=tuple(kv_sources),
        index_source_layer_ids=tuple(idx_sources),
        index_n_heads=int(g("index_n_heads")),
        index_head_dim=int(g("index_head_dim")),
        index_topk=int(g("index_topk")),
        candidate_source_layer_id=cand,
        candidate_topk_blocks=int(t.get("candidate_topk_blocks", 0) or 0),
        candidate_block_size=int(t.get("candidate_block_size", 1) or 1),
        hc_mult=int(g("hc_mult")),
        hc_sinkhorn_iters=int(g("hc_sinkhorn_iters")),
        hc_eps=float(g("hc_eps")),
        engram_layer_ids=tuple(engram_layers),
        engram_num_embeddings=tuple(engram_rows),
        engram_max_ngram_size=int(t.get("engram_max_ngram_size", 0) or 0),
        engram_vocab_size=int(t.get("engram_vocab_size", 0) or 0),
        engram_n_heads=int(t.get("engram_n_heads", 0) or 0),
        engram_head_dim=int(t.get("engram_head_dim", 0) or 0),
        engram_pad_token_id=int(t.get("engram_pad_token_id", t.get("engram_pad_id", 2)) or 0),
        engram_compressed_vocab_size=int(t.get("engram_compressed_vocab_size", 0) or 0),
        num_nextn_predict_layers=n_draft,
        layers=plan_layers(ratios, kv_sources, idx_sources, cand, engram_layers),
    )


def parse_vision_config(v: Mapping[str, Any]) -> VisionConfig:
    w = "vision_config."
    cfg = VisionConfig(
        num_hidden_layers=int(_need(v, "num_hidden_layers", w)),
        hidden_size=int(_need(v, "hidden_size", w)),
        num_attention_heads=int(_need(v, "num_attention_heads", w)),
        intermediate_size=int(_need(v, "intermediate_size", w)),
        patch_size=int(v.get("patch_size", 14)),
        rope_theta=float(v.get("rope_theta", 10000.0)),
        downsample_ratio=int(v.get("downsample_ratio", 3)),
        max_image_tokens=int(v.get("max_image_tokens", 1024)),
        min_pixels=int(v.get("min_pixels", 295936)),
        max_wh_ratio=None if v.get("max_wh_ratio") is None else float(v["max_wh_ratio"]),
    )
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError("config: 'vision_config.num_attention_heads' must divide hidden_size")
    if cfg.head_dim % 4:
        raise ConfigError("config: vision head dim (hidden_size / num_attention_heads) must be a multiple of 4")
    return cfg


def parse_config(d: Mapping[str, Any]) -> ModelConfig:
    if not isinstance(d, Mapping):
        raise ConfigError("config: expected a JSON object")
    mt = d.get("model_type")
    if mt != "deepseek_v41":
        raise ConfigError(
            f"config: model_type {mt!r} is not supported; dsv41_jax reads the composite DeepSeek-V4.1 config "
            "(model_type 'deepseek_v41' with text_config / vision_config)")
    text = parse_text_config(_need(d, "text_config", ""))
    vc = d.get("vision_config")
    vision = parse_vision_config(vc) if vc and int(vc.get("num_hidden_layers", 0) or 0) > 0 else None
    qc = d.get("quantization_config")
    quant = None
    if qc:
        if qc.get("quant_method", "fp8") != "fp8":
            raise ConfigError(f"config: 'quantization_config.quant_method' = {qc.get('quant_method')!r} not supported")
        quant = QuantConfig(
            quant_method="fp8",
            weight_block_size=tuple(int(x) for x in qc.get("weight_block_size", (32, 32))),
            scale_fmt=str(qc.get("scale_fmt", "ue8m0")),
            expert_dtype=str(qc.get("expert_dtype", "fp4")),
            activation_scheme=str(qc.get("activation_scheme", "dynamic")),
        )
    image_token_id = int(d.get("image_token_id", -1)) if vision is not None else int(d.get("image_token_id", -1))
    if vision is not None and not 0 <= image_token_id < text.vocab_size:
        raise ConfigError(f"config: 'image_token_id' = {image_token_id} must be a token id below vocab_size")
    return ModelConfig(
        text=text,
        vision=vision,
        quant=quant,
        image_token_id=image_token_id,
        bos_token_id=int(d.get("bos_token_id", 0)),
        eos_token_id=int(d.get("eos_token_id", 1)),
        pad_token_id=int(d.get("pad_token_id", 2)),
        raw=json.loads(json.dumps(d)),
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    return ModelConfig.from_file(path)


# ---------------------------------------------------------------- presets

_PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")


def preset(name: str) -> ModelConfig:
    """Named presets: 'v41-flash' (the released config), 'tiny' (the golden dim-64 family)."""
    files = {"v41-flash": "v41_flash.json", "tiny": "tiny.json"}
    if name not in files:
        raise ConfigError(f"config: unknown preset {name!r}; known: {sorted(files)}")
    return ModelConfig.from_file(os.path.join(_PRESET_DIR, files[name]))


def with_text_overrides(cfg: ModelConfig, **overrides) -> ModelConfig:
    """A copy of cfg with text_config keys replaced (re-validated)."""
    d = json.loads(json.dumps(cfg.raw))
    d["text_config"].update(overrides)
    return parse_config(d)
