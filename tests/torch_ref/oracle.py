"""A small, direct torch oracle of the DeepSeek-V4.1 text decoder (one-shot prefill).

Written from docs/decoder_spec.md (sections 2.3, 3, 4.2, 5, 6, 7, 8, 10) and checked against the
golden fixtures in tests/golden/. It favours readability over speed: plain loops over layers,
dense masks instead of gathers, no caches, no decode path (decode == a longer prefill).

Public entry points
-------------------
forward(cfg, weights, input_ids, *, image_mask, inputs_embeds, engram_hashes, fake_quant, dtype,
        capture, teacher, token_map) -> logits [B, S, V] float32
load_case(case_dir) -> (cfg_text, config, weights_fp32, case, reference)
topology(cfg) -> list of per-layer dicts (ratio, kv_src, idx_src, roles)
engram_layout(cfg) / engram_hashes_from_ids(cfg, token_map, input_ids, valid_mask)
build_token_map(tokenizer_json_path) -> (np.int64 map, compressed vocab size)
qdq_fp8_ue8m0 / qdq_fp4_ue8m0 / qdq_fp4_e4m3: the three fake-quant codecs.

`weights` use the original DeepSeek checkpoint names, dequantized to float32.
With dtype=torch.float32 the numerics follow the golden "fp32 variant" (every activation fp32,
fp32 islands unchanged); dtype=torch.bfloat16 rounds where the released code rounds. Weights that
load_weights() dequantized from fp8/fp4 carry a `fp8_gemm` attribute, and `lin` then quantizes
their input activations (e4m3, ue8m0 per 32) as the released code does; plain tensors do not.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# configuration and layer topology (spec 2.3)
# --------------------------------------------------------------------------------------------


def topology(cfg: dict) -> list[dict]:
    """Per backbone layer: ratio, kv source, index source and the roles the layer plays."""
    n_layers = cfg["num_hidden_layers"]
    ratios = [int(r) for r in cfg["compress_ratios"][:n_layers]]

    kv_sources = cfg.get("kv_source_layer_ids")
    if kv_sources is None:
        # first layer of every run of equal nonzero ratios
        kv_sources = [
            l for l in range(n_layers) if ratios[l] > 0 and (l == 0 or ratios[l - 1] != ratios[l])
        ]
    kv_sources = sorted(int(s) for s in kv_sources)
    idx_sources = cfg.get("index_source_layer_ids")
    if idx_sources is None:
        idx_sources = list(kv_sources)
    idx_sources = sorted(int(s) for s in idx_sources)
    cand = cfg.get("candidate_source_layer_id")
    if cand is None:
        cand = kv_sources[-1] if kv_sources else -1
    cand = int(cand)

    layers = []
    for l in range(n_layers):
        ratio = ratios[l]
        info = {"ratio": ratio, "kv_src": None, "idx_src": None, "is_kv_source": False,
                "is_index_source": False, "owns_k": False, "is_candidate_source": False,
                "uses_candidates": False}
        if ratio > 0:
            below = [s for s in kv_sources if s <= l]
            assert below, f"layer {l} has ratio {ratio} but no kv source at or below it"
            info["kv_src"] = below[-1]
            below = [s for s in idx_sources if s <= l]
            assert below, f"layer {l} has ratio {ratio} but no index source at or below it"
            info["idx_src"] = below[-1]
            info["is_kv_source"] = l in kv_sources
            info["is_index_source"] = l in idx_sources
            # index keys are built by a kv source that also runs an indexer
            info["owns_k"] = info["is_kv_source"] and info["is_index_source"]
            info["is_candidate_source"] = info["is_index_source"] and l == cand
            info["uses_candidates"] = info["is_index_source"] and 0 <= cand < l
            assert ratios[info["kv_src"]] == ratio, f"layer {l}: ratio differs from its kv source"
        layers.append(info)
    return layers


# --------------------------------------------------------------------------------------------
# primitives
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, fp32 product with the weight, one cast back (REF41 order)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (w.float() * normed).to(x.dtype)


def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bias-free linear in the activation dtype (weight stored [out, in]).

    A weight that load_weights() dequantized from fp8/fp4 carries `w.fp8_gemm = True`; like the
    released code, its input is then fake-quantized to e4m3 (ue8m0 scale per 32 along K) and
    the product is taken in fp32 and rounded to the activation dtype."""
    if getattr(w, "fp8_gemm", False):
        return F.linear(qdq_fp8_ue8m0(x, 32).float(), w.float()).to(x.dtype)
    return F.linear(x, w.to(x.dtype))


def rope_angles(cfg: dict, ratio: int, n_pos: int) -> torch.Tensor:
    """fp32 angles [n_pos, r/2] of the layer's RoPE: plain at rope_theta for ratio 0, YaRN at
    compress_rope_theta otherwise (no mscale)."""
    r = cfg["qk_rope_head_dim"]
    if ratio > 0:
        base = float(cfg["compress_rope_theta"])
        sc = cfg.get("rope_scaling") or {}
        orig = int(sc.get("original_max_position_embeddings", 0) or 0)
    else:
        base = float(cfg["rope_theta"])
        sc, orig = {}, 0
    freqs = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    if orig > 0:
        factor = float(sc["factor"])
        beta_fast, beta_slow = sc.get("beta_fast", 32), sc.get("beta_slow", 1)

        def corr(rot):
            return r * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr(beta_fast)), 0)
        hi = min(math.ceil(corr(beta_slow)), r - 1)
        ramp = ((torch.arange(r // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return torch.outer(torch.arange(n_pos, dtype=torch.float32), freqs)


def apply_rope(x: torch.Tensor, ang: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST r channels of x with adjacent pairs (2i, 2i+1); ang [S, r/2] lines up with
    dim -2 (x [B,S,r']) or dim -3 (x [B,S,H,r']). Returns a new tensor in x's dtype."""
    r = 2 * ang.shape[-1]
    head, tail = x[..., :-r], x[..., -r:]
    cos, sin = torch.cos(ang), torch.sin(ang)
    if inverse:
        sin = -sin
    if x.dim() == 4:
        cos, sin = cos[:, None, :], sin[:, None, :]
    pairs = tail.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([head, rot.to(x.dtype)], dim=-1)


def topk_stable(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along -1, descending; exact ties go to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


# --------------------------------------------------------------------------------------------
# fake-quant codecs (spec 3.4); all work on fp32 values, blocks along the last dim
# --------------------------------------------------------------------------------------------

_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
# at an exact midpoint round-to-nearest-even picks the even code: codes 2, 4, 6 sit above the
# midpoints 0.75, 1.75, 3.5 (round up there), the other midpoints round down
_E2M1_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])
_RECIP_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)
_RECIP_6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for positive normal fp32 t, read from the float bits (exponent, plus one
    when the mantissa is nonzero)."""
    bits = t.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def e4m3_rne(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to float8_e4m3fn (nearest-even), saturating at +-448 first."""
    return t.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def e2m1_rne(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 in [-6, 6] to the e2m1 grid, nearest-even on the code, sign kept."""
    mag = t.abs()
    code = torch.bucketize(mag, _E2M1_MIDPOINTS, right=False)  # midpoints strictly below mag
    at_tie_up = (mag.unsqueeze(-1) == _E2M1_MIDPOINTS) & _E2M1_TIE_GOES_UP
    code = code + at_tie_up.any(-1).long()
    val = _E2M1_VALUES[code]
    return torch.where(torch.signbit(t), -val, val)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    assert x.shape[-1] % block == 0, f"width {x.shape[-1]} not divisible by block {block}"
    return x.float().unflatten(-1, (-1, block))


def qdq_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp8 e4m3 values with a power-of-two (ue8m0) scale per block; window KV."""
    g = _blocks(x, block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = pow2_ceil(amax * _RECIP_448)
    q = e4m3_rne(g / s)
    return (q * s).flatten(-2).to(x.dtype)


def qdq_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp4 e2m1 values with a power-of-two scale per block; indexer q and k."""
    g = _blocks(x, block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = pow2_ceil(amax * _RECIP_6)
    q = e2m1_rne((g / s).clamp(-6.0, 6.0))
    return (q * s).flatten(-2).to(x.dtype)


def qdq_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """fp4 e2m1 values with an e4m3 scale per block (NVFP4-like); compressed KV."""
    g = _blocks(x, block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -9)
    s = e4m3_rne(amax / 6.0)
    q = e2m1_rne((g / s).clamp(-6.0, 6.0))
    return (q * s).flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------------------------
# mHC (spec 5.1, 5.3)
# --------------------------------------------------------------------------------------------


def hc_mixes(h, fn, scale, base, cfg):
    """pre [B,S,n], post [B,S,n], comb [B,S,n,n] (comb[j,k]: source j -> destination k)."""
    n = cfg["hc_mult"]
    eps = cfg["hc_eps"]
    flat = h.flatten(2).float()
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg["rms_norm_eps"])
    m = F.linear(flat, fn.float()) * rho
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(h, mix):
    """sum_k mix_k * H_k in fp32, cast to the stream dtype."""
    return (mix.unsqueeze(-1) * h.float()).sum(2).to(h.dtype)


def hc_expand(y, residual, post, comb):
    """out_k = post_k * y + sum_j comb[j,k] * residual_j, in fp32, cast to y's dtype."""
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(2)
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(y.dtype)


# --------------------------------------------------------------------------------------------
# attention (spec 6.1, 6.2, 6.4)
# --------------------------------------------------------------------------------------------


def compressor(x, W, p, ratio, cfg):
    """Pre-RoPE compressed latent [B, S//ratio, d] of a kv source, or None if S < ratio."""
    T = x.shape[1] // ratio
    if T == 0:
        return None
    norm_w = W[p + "attn.compressor.norm.weight"]
    if ratio == 1:
        return rms_norm(lin(x, W[p + "attn.compressor.wkv.weight"]), norm_w, cfg["rms_norm_eps"])
    x32 = x.float()[:, : T * ratio]
    kv = F.linear(x32, W[p + "attn.compressor.wkv.weight"].float()).unflatten(1, (T, ratio))
    score = F.linear(x32, W[p + "attn.compressor.wgate.weight"].float()).unflatten(1, (T, ratio))
    pooled = (kv * torch.softmax(score, dim=2)).sum(2)
    return rms_norm(pooled.to(x.dtype), norm_w, cfg["rms_norm_eps"])


def select_candidate_blocks(score, n_vis, topk_blocks, block):
    """score [B,S,T] (already -inf where t >= n_i); n_vis [S,1]. Boolean mask [B,S,T]."""
    T = score.shape[-1]
    padded = F.pad(score, (0, (-T) % block), value=-math.inf)
    blocks = padded.unflatten(-1, (-1, block)).amax(-1)
    nb = blocks.shape[-1]
    newest = (n_vis - 1) // block  # [S,1]; -1 when nothing is visible yet
    blocks = blocks.masked_fill(torch.arange(nb) == newest, math.inf)
    top = topk_stable(blocks, min(topk_blocks, nb))
    keep_vals = blocks.gather(-1, top) > -math.inf
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, top, keep_vals)
    return keep.repeat_interleave(block, dim=-1)[..., :T]


def indexer(x, qr, latent, W, p, l, info, ang, cfg, state, fake_quant, cap):
    """Top-k compressed positions [B,S,k] (ascending, -1 = none) of index source l."""
    S = x.shape[1]
    ratio = info["ratio"]
    T = S // ratio
    hi, ci = cfg["index_n_heads"], cfg["index_head_dim"]
    eps = cfg["rms_norm_eps"]

    if info["owns_k"] and latent is not None:
        k = rms_norm(lin(latent, W[p + "attn.indexer.wk.weight"]),
                     W[p + "attn.indexer.k_norm.weight"], eps)
        k = apply_rope(k, ang[0: T * ratio: ratio])
        if fake_quant:
            k = qdq_fp4_ue8m0(k, 32)
        state["index_k"] = k
        if cap is not None:
            cap[f"index_k_L{l}"] = k
    index_k = state["index_k"][:, :T]

    q = lin(qr, W[p + "attn.indexer.wq_b.weight"]).unflatten(-1, (hi, ci))
    q = apply_rope(q, ang[:S])
    if fake_quant:
        q = qdq_fp4_ue8m0(q, 32)
    w = lin(x, W[p + "attn.indexer.weights_proj.weight"]) * (ci ** -0.5 * hi ** -0.5)
    score = torch.einsum("bshd,btd->bsht", q, index_k)
    score = (score.relu() * w.unsqueeze(-1)).sum(2).float()  # [B,S,T]

    n_vis = (torch.arange(1, S + 1) // ratio).unsqueeze(-1)  # [S,1]
    score = score.masked_fill(torch.arange(T) >= n_vis, -math.inf)
    if info["is_candidate_source"]:
        cand = select_candidate_blocks(score, n_vis, cfg["candidate_topk_blocks"],
                                       cfg["candidate_block_size"])
        state["candidates"] = cand
        if cap is not None:
            cap[f"candidates_L{l}"] = cand
    elif info["uses_candidates"]:
        score = score.masked_fill(~state["candidates"], -math.inf)

    k_sel = min(cfg["index_topk"], T)
    idx = topk_stable(score, k_sel).sort(-1).values
    # REF41 rule: a pick is dropped when it is not yet visible (index test, not score test)
    return torch.where(idx < n_vis, idx, -1)


def attention(x, W, p, l, info, cfg, state, fake_quant, cap):
    B, S, _ = x.shape
    H, d = cfg["num_attention_heads"], cfg["head_dim"]
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    win = cfg["sliding_window"]
    eps = cfg["rms_norm_eps"]
    ratio = info["ratio"]
    ang = rope_angles(cfg, ratio, S)

    qr = rms_norm(lin(x, W[p + "attn.wq_a.weight"]), W[p + "attn.q_norm.weight"], eps)
    q = lin(qr, W[p + "attn.wq_b.weight"]).unflatten(-1, (H, d))
    q = apply_rope(q, ang)

    kv = rms_norm(lin(x, W[p + "attn.wkv.weight"]), W[p + "attn.kv_norm.weight"], eps)
    kv = apply_rope(kv, ang)
    if fake_quant:
        kv = qdq_fp8_ue8m0(kv, 32)

    i = torch.arange(S).unsqueeze(-1)
    j = torch.arange(S)
    allowed = ((j <= i) & (j > i - win)).expand(B, S, S)  # window incl. the current token
    keys = kv

    if ratio > 0:
        T = S // ratio
        latent = compressor(x, W, p, ratio, cfg) if info["is_kv_source"] else None
        if info["is_index_source"]:
            if T == 0:
                idx = torch.empty(B, S, 0, dtype=torch.long)
            else:
                idx = indexer(x, qr, latent, W, p, l, info, ang, cfg, state, fake_quant, cap)
            state["topk_idxs"] = idx
            if cap is not None:
                cap[f"topk_idxs_L{l}"] = idx.int()
        idx = state["topk_idxs"]
        if latent is not None:
            entry = apply_rope(latent, ang[0: T * ratio: ratio])
            if fake_quant:
                entry = qdq_fp4_e4m3(entry, 16)
            state["compress_kv"] = entry
            if cap is not None:
                cap[f"compress_kv_L{l}"] = entry
        if T > 0:
            ckv = state["compress_kv"][:, :T]
            sel = torch.zeros(B, S, T + 1, dtype=torch.bool)
            sel.scatter_(-1, torch.where(idx >= 0, idx, T), True)  # slot T swallows the -1s
            allowed = torch.cat([allowed, sel[..., :T]], dim=-1)
            keys = torch.cat([kv, ckv], dim=1)

    # attention with a sink in the denominator; K = V; fp32 softmax and accumulation
    s = torch.einsum("bshd,bkd->bshk", q.float(), keys.float()) * (d ** -0.5)
    mask = allowed.unsqueeze(2)  # [B,S,1,K]
    s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    sink = W[p + "attn.attn_sink"].float().view(1, 1, H, 1)
    denom = e.sum(-1, keepdim=True) + torch.exp(sink - m)
    if x.dtype != torch.float32:
        e = e.to(x.dtype).float()  # the released kernel rounds P to bf16 before P.V
    o = (torch.einsum("bshk,bkd->bshd", e, keys.float()) / denom).to(x.dtype)

    o = apply_rope(o, ang, inverse=True)
    o = o.reshape(B, S, G, H * d // G)
    wo_a = W[p + "attn.wo_a.weight"].to(x.dtype).view(G, R, H * d // G)
    z = torch.einsum("bsgd,grd->bsgr", o, wo_a)
    return lin(z.flatten(2), W[p + "attn.wo_b.weight"])


# --------------------------------------------------------------------------------------------
# MoE (spec 7)
# --------------------------------------------------------------------------------------------


def swiglu_expert(x, W, prefix, limit, route_w=None):
    g = lin(x, W[prefix + "w1.weight"]).float()
    u = lin(x, W[prefix + "w3.weight"]).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if route_w is not None:
        h = route_w * h  # route weight applied before w2
    return lin(h.to(x.dtype), W[prefix + "w2.weight"])


def moe(x, W, p, l, cfg, image_mask, cap):
    B, S, D = x.shape
    xf = x.reshape(-1, D)
    k = cfg["num_experts_per_tok"]
    n_exp = cfg["n_routed_experts"]
    limit = float(cfg.get("swiglu_limit", 0.0) or 0.0)

    z = F.linear(xf.float(), W[p + "ffn.gate.weight"].float()) / float(cfg.get("gate_temp", 1.0))
    func = cfg.get("scoring_func", "sqrtsoftplus")
    if func == "softmax":
        scores = z.softmax(-1)
    elif func == "sigmoid":
        scores = z.sigmoid()
    else:
        scores = F.softplus(z).sqrt()
    bias = W[p + "ffn.gate.bias"].float().expand_as(scores)
    if image_mask is not None and (p + "ffn.gate.bias_vl") in W:
        bias = torch.where(image_mask.reshape(-1, 1), W[p + "ffn.gate.bias_vl"].float(), bias)
    top = topk_stable(scores + bias, k)  # selection uses the bias ...
    wts = scores.gather(-1, top)  # ... the weights do not
    if cfg.get("norm_topk_prob", True) and k > 1:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    wts = wts * float(cfg.get("routed_scaling_factor", 1.0))
    if cap is not None:
        cap[f"moe_topk_L{l}"] = top.view(B, S, k).int()
        cap[f"moe_weights_L{l}"] = wts.view(B, S, k)

    y = torch.zeros(xf.shape, dtype=torch.float32)
    for e in range(n_exp):
        rows, slot = torch.where(top == e)
        if rows.numel() == 0:
            continue
        y[rows] += swiglu_expert(xf[rows], W, f"{p}ffn.experts.{e}.", limit,
                                 wts[rows, slot].unsqueeze(-1)).float()
    y = y + swiglu_expert(xf, W, p + "ffn.shared_experts.", limit).float()
    return y.to(x.dtype).view(B, S, D)


# --------------------------------------------------------------------------------------------
# Engram (spec 8)
# --------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for sp in small:
        if n % sp == 0:
            return n == sp
    dd, s = n - 1, 0
    while dd % 2 == 0:
        dd //= 2
        s += 1
    for a in small:  # deterministic for n < 3.3e24
        y = pow(a, dd, n)
        if y in (1, n - 1):
            continue
        for _ in range(s - 1):
            y = y * y % n
            if y == n - 1:
                break
        else:
            return False
    return True


def engram_layout(cfg: dict) -> dict:
    """Primes [n_layers][N-1][heads], per-layer column offsets [n_layers][cols] and multipliers
    [n_layers][N] of the n-gram hash; one `seen` set over all engram layers, in layer order."""
    layer_ids = list(cfg.get("engram_layer_ids") or [])
    N, heads = cfg["engram_max_ngram_size"], cfg["engram_n_heads"]
    seen: set[int] = set()
    primes = []
    for _ in layer_ids:
        per_layer = []
        for _ in range(N - 1):
            cur = cfg["engram_vocab_size"] - 1
            row = []
            for _ in range(heads):
                cur += 1
                while cur in seen or not _is_prime(cur):
                    cur += 1
                seen.add(cur)
                row.append(cur)
            per_layer.append(row)
        primes.append(per_layer)
    offsets, mults = [], []
    vocab_c = cfg["engram_compressed_vocab_size"]
    bound = max(1, (np.iinfo(np.int64).max // vocab_c) // 2)
    for li, lid in enumerate(layer_ids):
        flat = [pr for row in primes[li] for pr in row]
        offsets.append(np.concatenate([[0], np.cumsum(flat[:-1])]).astype(np.int64))
        vals = np.random.default_rng(10007 * lid).integers(0, bound, size=N, dtype=np.int64)
        mults.append(vals * 2 + 1)
        rows = cfg.get("engram_num_embeddings")
        if rows is not None:
            assert int(sum(flat)) == int(rows[li]), (lid, sum(flat), rows[li])
    return {"layer_ids": layer_ids, "primes": primes, "offsets": offsets, "multipliers": mults}


def engram_hashes_from_ids(cfg, token_map, input_ids, valid_mask=None) -> dict[int, torch.Tensor]:
    """Row ids (offsets included) {layer_id: LongTensor [B,S,(N-1)*heads]} for a whole sequence
    starting at position 0. valid_mask False marks DEAD positions (image spans)."""
    lay = engram_layout(cfg)
    N, heads = cfg["engram_max_ngram_size"], cfg["engram_n_heads"]
    ids = np.asarray(input_ids, dtype=np.int64)
    comp = np.asarray(token_map, dtype=np.int64)[ids]
    if valid_mask is not None:
        comp = np.where(np.asarray(valid_mask, dtype=bool), comp, -1)
    pad = int(np.asarray(token_map)[cfg.get("engram_pad_token_id", cfg.get("engram_pad_id", 2))])
    B, S = ids.shape
    slots = []
    blocked = np.zeros((B, S), dtype=bool)
    pos = np.arange(S)
    for shift in range(N):
        src = comp[:, np.clip(pos - shift, 0, None)]
        blocked = blocked | (pos < shift)[None, :] | (src == -1)
        slots.append(np.where(blocked, pad, src))
    out = {}
    for li, lid in enumerate(lay["layer_ids"]):
        mult = lay["multipliers"][li]
        rolling = slots[0] * mult[0]
        cols = []
        for s in range(1, N):
            rolling = np.bitwise_xor(rolling, slots[s] * mult[s])
            for h in range(heads):
                cols.append(rolling % lay["primes"][li][s - 1][h])
        hashes = np.stack(cols, axis=-1) + lay["offsets"][li]
        out[lid] = torch.from_numpy(hashes.astype(np.int64))
    return out


def engram(h, hashes, W, p, cfg, token_mask):
    """Gated value injection into every hc copy; h [B,S,n,D] -> same."""
    n, D = cfg["hc_mult"], cfg["hidden_size"]
    eps = cfg["rms_norm_eps"]
    rows = W[p + "engram.embed.weight"][hashes].to(h.dtype)  # [B,S,cols,hd]
    kv = lin(rows.flatten(-2), W[p + "engram.wkv.weight"])
    key, value = kv[..., : n * D], kv[..., n * D:]
    key = key.float().unflatten(-1, (n, D))
    wgt = W[p + "engram.q_weight"].float() * W[p + "engram.k_weight"].float()
    hf = h.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hf * wgt * key).sum(-1) * rstd * D ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0.0)
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)


# --------------------------------------------------------------------------------------------
# the forward
# --------------------------------------------------------------------------------------------


def forward(
    cfg: dict,
    weights: dict,
    input_ids: torch.Tensor,
    *,
    image_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    engram_hashes: dict | None = None,
    fake_quant: bool = False,
    dtype: torch.dtype = torch.float32,
    capture: dict | None = None,
    teacher: dict | None = None,
    token_map=None,
) -> torch.Tensor:
    """One-shot prefill from position 0. Returns fp32 logits [B,S,V].

    image_mask: True inside image spans (bias_vl routing, Engram DEAD/gate-off).
    inputs_embeds: replaces embed[input_ids] (image rows already merged).
    engram_hashes: {layer_id: [B,S,cols]} row ids incl. offsets; if None and the config has
        Engram layers, they are computed from `token_map` (required then).
    capture: filled with numpy arrays named as in reference.npz.
    teacher: {block_in_L{l}, pre_mix_in_L{l}} arrays replacing the stream entering each layer.
    """
    W = weights
    L = cfg["num_hidden_layers"]
    n = cfg["hc_mult"]
    eps = cfg["rms_norm_eps"]
    topo = topology(cfg)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    B, S = input_ids.shape
    if image_mask is not None:
        image_mask = torch.as_tensor(image_mask, dtype=torch.bool)
    engram_mask = None if image_mask is None else ~image_mask

    eng_layers = list(cfg.get("engram_layer_ids") or [])
    if eng_layers and engram_hashes is None:
        assert token_map is not None, "Engram layers need engram_hashes or a token_map"
        engram_hashes = engram_hashes_from_ids(cfg, token_map, input_ids, engram_mask)

    cap = {} if capture is not None else None
    if inputs_embeds is None:
        x0 = W["embed.weight"][input_ids]
    else:
        x0 = torch.as_tensor(inputs_embeds)
    h = x0.to(dtype).unsqueeze(2).repeat(1, 1, n, 1)
    pre_mix = torch.zeros(B, S, n, dtype=torch.float32)
    pre_mix[..., 0] = 1.0

    state: dict = {}
    for l in range(L):
        p = f"layers.{l}."
        info = topo[l]
        if teacher is not None:
            h = torch.as_tensor(np.asarray(teacher[f"block_in_L{l}"])).to(dtype)
            pre_mix = torch.as_tensor(np.asarray(teacher[f"pre_mix_in_L{l}"])).float()
        if cap is not None:
            cap[f"block_in_L{l}"] = h
            cap[f"pre_mix_in_L{l}"] = pre_mix
        if l in eng_layers:
            hashes = torch.as_tensor(np.asarray(engram_hashes[l]), dtype=torch.long)
            h = engram(h, hashes, W, p, cfg, engram_mask)
            if cap is not None:
                cap[f"engram_out_L{l}"] = h

        # attention site: coefficients from the stream, collapse with the carried-in pre
        residual = h
        pre_a, post_a, comb_a = hc_mixes(h, W[p + "hc_attn_fn"], W[p + "hc_attn_scale"],
                                         W[p + "hc_attn_base"], cfg)
        x = rms_norm(hc_collapse(h, pre_mix), W[p + "attn_norm.weight"], eps)
        a = attention(x, W, p, l, info, cfg, state, fake_quant, cap)
        h = hc_expand(a, residual, post_a, comb_a)

        # FFN site: collapses with the attention site's pre
        residual = h
        pre_f, post_f, comb_f = hc_mixes(h, W[p + "hc_ffn_fn"], W[p + "hc_ffn_scale"],
                                         W[p + "hc_ffn_base"], cfg)
        x = rms_norm(hc_collapse(h, pre_a), W[p + "ffn_norm.weight"], eps)
        f = moe(x, W, p, l, cfg, image_mask, cap)
        h = hc_expand(f, residual, post_f, comb_f)
        pre_mix = pre_f
        if cap is not None:
            cap[f"block_out_L{l}"] = h
            cap[f"pre_mix_out_L{l}"] = pre_mix

    y = rms_norm(hc_collapse(h, pre_mix), W["norm.weight"], eps)
    logits = F.linear(y.float(), W["head.weight"].float())
    if capture is not None:
        for k_, v_ in cap.items():
            capture[k_] = v_.detach().float().numpy() if v_.is_floating_point() else v_.numpy()
        if engram_hashes is not None:
            for lid in eng_layers:
                capture[f"engram_hashes_L{lid}"] = np.asarray(engram_hashes[lid])
    return logits


# --------------------------------------------------------------------------------------------
# checkpoint loading (spec 10.2)
# --------------------------------------------------------------------------------------------

_FP4_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _read_safetensors_raw(path: str) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """{name: (dtype string, shape, raw uint8 bytes)} straight from the file."""
    with open(path, "rb") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(hlen))
        data = np.frombuffer(fh.read(), dtype=np.uint8)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = (meta["dtype"], meta["shape"], data[a:b])
    return out


def _decode_plain(dt: str, shape, raw: np.ndarray) -> np.ndarray:
    if dt == "BF16":
        u16 = raw.view(np.uint16).astype(np.uint32) << 16
        return u16.view(np.float32).reshape(shape)
    if dt == "F32":
        return raw.view(np.float32).reshape(shape).copy()
    if dt == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if dt == "F8_E4M3":
        import ml_dtypes
        return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(shape)
    if dt in ("I64",):
        return raw.view(np.int64).reshape(shape).copy()
    if dt in ("I32",):
        return raw.view(np.int32).reshape(shape).copy()
    raise ValueError(f"unsupported plain dtype {dt}")


def _e8m0(raw: np.ndarray, shape) -> np.ndarray:
    """E8M0 bytes -> fp32 2^(b-127), from the raw bytes (b=0 gives the subnormal 2^-127)."""
    b = raw.reshape(shape).astype(np.int32)
    return np.ldexp(np.float32(1.0), b - 127).astype(np.float32)


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """All tensors as fp32, fp8 / fp4 ones dequantized; `.scale` tensors are consumed."""
    raw = _read_safetensors_raw(path)
    out = {}
    for name, (dt, shape, buf) in raw.items():
        if name.endswith(".scale") and (name[: -len(".scale")] + ".weight") in raw:
            continue
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        if scale_name is not None and scale_name in raw:
            sdt, sshape, sbuf = raw[scale_name]
            assert sdt == "F8_E8M0", (scale_name, sdt)
            s = _e8m0(sbuf, sshape)
            if dt == "I8":  # fp4 e2m1 pairs, low nibble = even element; scale per 32 of a row
                u = buf.reshape(shape)
                vals = np.stack([_FP4_LUT[u & 0x0F], _FP4_LUT[u >> 4]], axis=-1)
                vals = vals.reshape(shape[0], shape[1] * 2)
                w = vals * np.repeat(s, 32, axis=1)[:, : vals.shape[1]]
            elif dt == "F8_E4M3":
                v = _decode_plain(dt, shape, buf)
                if ".engram.embed." in name:  # table rows: one scale per 32 columns of a row
                    w = v * np.repeat(s, 32, axis=1)[:, : shape[1]]
                else:  # 32x32 tiles
                    full = np.repeat(np.repeat(s, 32, axis=0), 32, axis=1)
                    w = v * full[: shape[0], : shape[1]]
            else:
                raise ValueError(f"{name}: scaled weight of dtype {dt}")
            t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            # a GEMM weight stored fp8/fp4 quantizes its activations (not the Engram table, and
            # not wo_a, which the official conversion turns into a plain bf16 einsum weight)
            t.fp8_gemm = ".engram.embed." not in name and not name.endswith("attn.wo_a.weight")
            out[name] = t
            continue
        if dt == "F8_E8M0":
            out[name] = torch.from_numpy(_e8m0(buf, shape))
            continue
        arr = _decode_plain(dt, shape, buf)
        out[name] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def load_case(case_dir: str):
    """(cfg_text, full config, fp32 weights, case.json, reference npz as a dict of arrays)."""
    with open(os.path.join(case_dir, "config.json")) as fh:
        config = json.load(fh)
    cfg_text = dict(config.get("text_config", config))
    with open(os.path.join(case_dir, "case.json")) as fh:
        case = json.load(fh)
    weights = load_weights(os.path.join(case_dir, "model.safetensors"))
    with np.load(os.path.join(case_dir, "reference.npz")) as z:
        ref = {k: z[k] for k in z.files}
    return cfg_text, config, weights, case, ref


# --------------------------------------------------------------------------------------------
# the Engram compressed token map (spec 8.2)
# --------------------------------------------------------------------------------------------


def build_token_map(tokenizer_json: str):
    """Compressed token map from a tokenizer.json: (np.int64 [vocab], compressed size)."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_json)
    marker = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), marker),
        normalizers.Strip(),
        normalizers.Replace(marker, " "),
    ])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    seen: dict[str, int] = {}
    table = np.zeros(vocab, dtype=np.int64)
    for tid in range(vocab):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        table[tid] = seen.setdefault(key, len(seen))
    return table, len(seen)
