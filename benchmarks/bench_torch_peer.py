"""Torch peer of the V4.1-Flash-width slice benchmark (issue 9): the same slice, run by torch on
the same GPU, measured the same way as ``benchmarks/bench_slice.py``.

What it builds
--------------
The config is ``bench_slice.slice_config`` (3 layers: L0 window-only + Engram, L1 ratio-2 kv/index
source, L2 ratio-1 kv/index/candidate source; hidden 5120, 64 heads x 512, q_lora 1280,
o_groups 8 x 1024, 384 experts of 2304 + shared, indexer 32 x 128, window 128). Weights are random
(normal x 0.05, norm weights 1 + 0.1 normal), generated on the device with torch in the dtypes
the JAX slice holds them: bf16 for every linear, expert, norm, embedding and head; fp32 for the
mHC coefficient weights, the attention sinks and the router bias; the Engram table fp8 e4m3 with
one ue8m0 scale byte per 32 columns (only looked-up rows are dequantized). Numerics follow the
JAX run: bf16 compute, the reference fake-quant points (fp8 window KV, fp4 ue8m0 indexer q/k,
fp4 e4m3-scaled compressed KV) and, as bench_slice marks them (``mark_release_quantized``), the
fp8 per-32 activation quantization before the linears the release stores fp8/fp4 (wq_a, wq_b,
wkv, wo_b, indexer wq_b, Engram wkv, shared and routed experts); ``--no-release-quant`` drops it
(bench_slice's flag of the same name).

The math is tests/torch_ref/oracle.py (its prefill), restated device-aware and with a decode
cache:

* dense linears: ``F.linear`` in bf16; the GEMMs the reference takes in fp32 on bf16 values
  (router, ratio-2 compressor, head) as a bf16 GEMM with fp32 output (``torch.mm(...,
  out_dtype=float32)``) when the build has it, else fp32 copies of the operands;
* attention: fp32 scores / softmax / P.V as the reference (P rounded to bf16 before P.V), sink in
  the denominator, window keys + the top-k selected compressed entries only (gathered);
  prefill in 256-query blocks, each against its window slice and its own selected entries
  (the same blocking as the JAX model, O(S) memory);
* MoE: router in fp32, then as DeepSeek's inference code: a loop over the experts that received
  tokens (token/slot pairs sorted by expert once, one host sync for the counts), each expert's
  bf16 SwiGLU on its rows, results added back with one ``index_add_``; plus the shared expert;
* mHC, Engram (hashes computed on the device in int64), compressor, indexer: per the oracle.

Decode (the oracle has none): a real incremental step with a cache per layer: window ring
(``win_kv``, ``win_pos``), compressed KV entries and index keys of kv sources (capacity
ctx + 64 like bench_slice), the ratio-2 partial group (fp32 kv + scores), and the Engram
history (compressed ids of the last 3 tokens). For the timing the cache is filled with random
values and ``length = ctx`` (bench_slice sets ``length = ctx`` on a zero cache); every step then
advances it by one token. Decode inputs, two variants (``--decode-inputs``):

* ``identical``: token id 1 in every row and identical rows, so every row routes to the same 6
  experts per layer, at any batch (what bench_slice fed before it was fixed: runs 1-4 of
  docs/performance.md);
* ``random``: a random token and random cache contents per row (bench_slice now feeds a random
  token per row; its cache is zeros, the same work), so batch B reads about
  E (1 - (1 - 6/E)^B) distinct experts per layer (~46 at B = 8, ~244 at B = 64): the work a real
  batch does. ``experts_used`` in each row reports the distinct experts of the last step.

Per step and layer the peer does the work the JAX step does: q/kv projections, the compressor of kv sources (ratio 2: the pooled entry only when a group
completes), the indexer of index sources against the visible compressed entries, top-512,
attention over the 128-slot ring + 512 gathered entries, router, the selected experts only,
the shared expert, mHC x 2; Engram (24 table rows per token) on L0; the head on the new token.
Differences in work, all small: the indexer scores only the ``length // ratio`` visible entries
(JAX scores the whole capacity, 1.5% more); the candidate-block mask of L2 is computed only if
a later index source uses it (none in the 3-layer slice; XLA drops it as dead code too); the
benchmark's rows all sit at the same position (as in bench_slice), so the ring slot and the
ratio-2 group completion are host-side integers.

Checked against the oracle at tiny width (tests/test_torch_peer.py): prefill logits and
incremental decode logits within 1e-4 in fp32, fake-quant off / on / on + release activation quant.

Output: JSON lines (``what`` = env, ceiling_copy, ceiling_bf16_matmul, build, decode_step,
prefill, ratio; ``impl`` = torch_eager or torch_compile) and ``$OUT/bench_torch_peer.json``.
When ``$OUT/bench_slice.json`` exists (bench_slice run first in the same call, same $OUT) or
``--compare`` names one, a ``ratio`` line per common measurement gives torch seconds / JAX
seconds (decode: the ``random`` inputs, a different token per row as bench_slice now feeds, against
JAX's default path, table on the device).

    python benchmarks/bench_torch_peer.py --layers 3 --ctx 4096 --batches 1,8,64 --prefill 2048,8192
    python benchmarks/bench_torch_peer.py --small --device cpu        # tiny width, CPU smoke (~6 min
    python benchmarks/bench_torch_peer.py --small --device cpu --ctx 512 --batches 1,8 --prefill 256  # ~1 min)

``--compile auto`` (default) also times the steps with ``torch.compile`` applied to the dense
pieces (mHC, norms, RoPE, codecs, attention core, SwiGLU) on CUDA; a failure (no triton, ...)
is reported as a JSON error line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the config helpers import jax: keep it off the GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.torch_ref import oracle as O  # noqa: E402

F32 = torch.float32
NEG_INF = -math.inf
RESULTS = []


def emit(**kw):
    RESULTS.append(kw)
    print(json.dumps(kw), flush=True)


# ---------------------------------------------------------------------------------------------
# elementwise pieces (pure functions of tensors and Python scalars: torch.compile candidates)
# ---------------------------------------------------------------------------------------------


def rms_norm(x, w, eps: float):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (w.float() * y).to(x.dtype)


def rope(x, cos, sin):
    """Rotate the last 2*cos.shape[-1] channels (adjacent pairs); cos/sin [S, r/2] line up with
    dim -2 (x [B,S,r']) or are pre-broadcast by the caller."""
    r = 2 * cos.shape[-1]
    head, tail = x[..., :-r], x[..., -r:]
    pairs = tail.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([head, rot.to(x.dtype)], dim=-1)


def _pow2_ceil(t):
    bits = t.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(F32)


def _e4m3(t):
    return t.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def _e2m1(t):
    """Nearest-even on the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (|t| <= 6): the grid step is a
    power of two per binade, so round-half-even of |t| / step is round-half-even on the code."""
    mag = t.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    val = torch.round(mag / step) * step
    return torch.where(torch.signbit(t), -val, val)


def q_fp8_e8(x, block: int = 32):
    g = x.float().unflatten(-1, (-1, block))
    s = _pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / 448.0))
    return (_e4m3(g / s) * s).flatten(-2).to(x.dtype)


def q_fp4_e8(x, block: int = 32):
    g = x.float().unflatten(-1, (-1, block))
    s = _pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126) * (1.0 / 6.0))
    return (_e2m1((g / s).clamp(-6.0, 6.0)) * s).flatten(-2).to(x.dtype)


def q_fp4_e4(x, block: int = 16):
    g = x.float().unflatten(-1, (-1, block))
    s = _e4m3(g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -9) / 6.0)
    return (_e2m1((g / s).clamp(-6.0, 6.0)) * s).flatten(-2).to(x.dtype)


def hc_mixes(h, fn, scale, base, n: int, iters: int, norm_eps: float, hc_eps: float):
    flat = h.flatten(-2).float()
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = F.linear(flat, fn) * rho
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    c = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    c = torch.softmax(c, dim=-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


def hc_collapse(h, mix):
    return (mix.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


def hc_expand(y, residual, post, comb):
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(y.dtype)


def sparse_attn(q, kw, ok_w, kc, ok_c, sink, scale: float, round_p: bool):
    """q [B,S,H,d]; window keys kw [B,J,d] with ok_w [B,S,J]; selected entries kc [B,S,K,d] with
    ok_c [B,S,K] (or None). K = V, fp32 scores and accumulation, sink in the denominator."""
    qf = q.float()
    kwf = kw.float()
    sw = torch.einsum("bshd,bjd->bshj", qf, kwf) * scale
    sw = sw.masked_fill(~ok_w.unsqueeze(2), NEG_INF)
    m = sw.amax(-1, keepdim=True)
    if kc is not None:
        kcf = kc.float()
        sc = torch.einsum("bshd,bskd->bshk", qf, kcf) * scale
        sc = sc.masked_fill(~ok_c.unsqueeze(2), NEG_INF)
        m = torch.maximum(m, sc.amax(-1, keepdim=True))
    ew = torch.exp(sw - m)
    den = ew.sum(-1, keepdim=True) + torch.exp(sink.view(1, 1, -1, 1) - m)
    if round_p:
        ew = ew.to(q.dtype).float()
    o = torch.einsum("bshj,bjd->bshd", ew, kwf)
    if kc is not None:
        ec = torch.exp(sc - m)
        den = den + ec.sum(-1, keepdim=True)
        if round_p:
            ec = ec.to(q.dtype).float()
        o = o + torch.einsum("bshk,bskd->bshd", ec, kcf)
    return (o / den).to(q.dtype)


def swiglu(g, u, limit: float):
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


def expert_act(g, u, route_w, limit: float, quant: bool):
    """Routed expert between its GEMMs: route weight x SwiGLU, cast, (fp8 quantization for w2)."""
    h = (route_w * swiglu(g, u, limit)).to(g.dtype)
    return q_fp8_e8(h, 32) if quant else h


def engram_mix(h, kv, wgt, n: int, D: int, eps: float):
    key = kv[..., : n * D].float().unflatten(-1, (n, D))
    value = kv[..., n * D:].float()
    hf = h.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hf * wgt * key).sum(-1) * rstd * D ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(h.dtype)


_KERNELS = ("rms_norm", "rope", "q_fp8_e8", "q_fp4_e8", "q_fp4_e4", "hc_mixes", "hc_collapse",
            "hc_expand", "sparse_attn", "swiglu", "expert_act", "engram_mix")


def eager_kernels():
    return types.SimpleNamespace(**{k: globals()[k] for k in _KERNELS})


def compiled_kernels():
    import torch._dynamo

    for knob in ("cache_size_limit", "recompile_limit"):  # shapes vary per expert / batch / length
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    return types.SimpleNamespace(**{k: torch.compile(globals()[k]) for k in _KERNELS})


# ---------------------------------------------------------------------------------------------
# random weights (oracle names; routed experts stacked [E, out, in])
# ---------------------------------------------------------------------------------------------


def random_weights(cfg: dict, device, dtype, seed: int = 0, engram_fp8: bool = True) -> dict:
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)

    def rn(*shape, dt=dtype, s=0.05):
        return torch.randn(shape, generator=gen, device=dev, dtype=dt).mul_(s)

    def norm(dim):
        return rn(dim, s=0.1).add_(1.0)

    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, d, R, G = cfg["num_attention_heads"], cfg["head_dim"], cfg["o_lora_rank"], cfg["o_groups"]
    ql, E, I = cfg["q_lora_rank"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    hi, ci = cfg["index_n_heads"], cfg["index_head_dim"]
    n = cfg["hc_mult"]
    mix = (2 + n) * n
    W = {"embed.weight": rn(V, D), "head.weight": rn(V, D), "norm.weight": norm(D)}
    eng = list(cfg.get("engram_layer_ids") or [])
    for l, info in enumerate(O.topology(cfg)):
        p = f"layers.{l}."
        for site in ("attn", "ffn"):
            W[p + f"hc_{site}_fn"] = rn(mix, n * D, dt=F32)
            W[p + f"hc_{site}_scale"] = rn(3, dt=F32, s=0.5).add_(1.0)
            W[p + f"hc_{site}_base"] = rn(mix, dt=F32, s=0.5)
        W[p + "attn_norm.weight"] = norm(D)
        W[p + "ffn_norm.weight"] = norm(D)
        a = p + "attn."
        W[a + "wq_a.weight"] = rn(ql, D)
        W[a + "q_norm.weight"] = norm(ql)
        W[a + "wq_b.weight"] = rn(H * d, ql)
        W[a + "wkv.weight"] = rn(d, D)
        W[a + "kv_norm.weight"] = norm(d)
        W[a + "attn_sink"] = rn(H, dt=F32, s=1.0)
        W[a + "wo_a.weight"] = rn(G * R, H * d // G)
        W[a + "wo_b.weight"] = rn(D, G * R)
        if info["is_kv_source"]:
            W[a + "compressor.wkv.weight"] = rn(d, D)
            if info["ratio"] > 1:
                W[a + "compressor.wgate.weight"] = rn(d, D)
            W[a + "compressor.norm.weight"] = norm(d)
        if info["owns_k"]:
            W[a + "indexer.wk.weight"] = rn(ci, d)
            W[a + "indexer.k_norm.weight"] = norm(ci)
        if info["is_index_source"]:
            W[a + "indexer.wq_b.weight"] = rn(hi * ci, ql)
            W[a + "indexer.weights_proj.weight"] = rn(hi, D)
        f = p + "ffn."
        W[f + "gate.weight"] = rn(E, D)
        W[f + "gate.bias"] = rn(E, dt=F32, s=0.01)
        W[f + "experts.w1"] = rn(E, I, D)
        W[f + "experts.w3"] = rn(E, I, D)
        W[f + "experts.w2"] = rn(E, D, I)
        for nm, shp in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            W[f + f"shared_experts.{nm}.weight"] = rn(*shp)
        if l in eng:
            rows = int(cfg["engram_num_embeddings"][eng.index(l)])
            hd = cfg["engram_head_dim"]
            cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
            e = p + "engram."
            if engram_fp8:
                tab = torch.empty(rows, hd, dtype=torch.float8_e4m3fn, device=dev)
                step = 1 << 22
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    tab[r0:r1] = rn(r1 - r0, hd, s=1.0).to(torch.float8_e4m3fn)
                W[e + "embed.weight"] = tab
                W[e + "embed.scale"] = torch.randint(118, 126, (rows, hd // 32), generator=gen, device=dev,
                                                     dtype=torch.uint8)
            else:
                W[e + "embed.weight"] = rn(rows, hd, s=1.0)
            W[e + "wkv.weight"] = rn(D * (n + 1), cols * hd)
            W[e + "q_weight"] = norm(n * D).view(n, D)
            W[e + "k_weight"] = norm(n * D).view(n, D)
    return W


# Linears the V4.1 release stores fp8/fp4 (bench_slice.RELEASE_FP8 + the routed experts): in
# reference numerics their input activations are quantized (fp8 e4m3, ue8m0 per 32) first
RELEASE_FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
               "attn.indexer.wq_b.weight", "engram.wkv.weight", "ffn.shared_experts.w1.weight",
               "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight", "ffn.experts.w1",
               "ffn.experts.w2", "ffn.experts.w3")


def release_fp8_names(cfg: dict) -> list[str]:
    return [f"layers.{l}.{n}" for l in range(cfg["num_hidden_layers"]) for n in RELEASE_FP8]


def oracle_weights(W: dict, release_quant: bool = False) -> dict:
    """The oracle's per-expert names (views, no copies); an fp8 Engram table is dequantized.
    ``release_quant``: mark the release-fp8 weights ``fp8_gemm`` (the oracle then quantizes
    their inputs, as for a weight load_weights() dequantized) on fresh views."""
    out = {}
    marked = set(release_fp8_names_from(W)) if release_quant else set()
    for k, v in W.items():
        if k.endswith("experts.w1") or k.endswith("experts.w2") or k.endswith("experts.w3"):
            base, nm = k.rsplit(".", 1)
            for e in range(v.shape[0]):
                t = v[e]
                if k in marked:
                    t.fp8_gemm = True
                out[f"{base}.{e}.{nm}.weight"] = t
        elif k in marked:
            t = v.view(v.shape)
            t.fp8_gemm = True
            out[k] = t
        elif k.endswith("embed.scale"):
            continue
        elif k.endswith("engram.embed.weight") and v.dtype == torch.float8_e4m3fn:
            out[k] = _dequant_rows(v, W[k[: -len("weight")] + "scale"], F32)
        else:
            out[k] = v
    return out


def release_fp8_names_from(W: dict) -> list[str]:
    return [k for k in W if k.startswith("layers.") and k.split(".", 2)[2] in RELEASE_FP8]


def _dequant_rows(rows, sc, dtype):
    mult = (sc.to(torch.int32) << 23).view(F32)
    mult = torch.where(sc == 0, 2.0 ** -127, mult)
    v = rows.float().unflatten(-1, (-1, 32)) * mult.unsqueeze(-1)
    return v.flatten(-2).to(dtype)


# ---------------------------------------------------------------------------------------------
# the peer model
# ---------------------------------------------------------------------------------------------


class Peer:
    """DeepSeek-V4.1 text decoder in eager torch: ``prefill`` (one sequence batch from position
    0, fills a cache) and ``decode`` (one token per row against the cache)."""

    def __init__(self, cfg: dict, W: dict, token_map, *, device, dtype, fake_quant: bool,
                 stable_topk: bool = False, release_quant: bool = True, kernels=None):
        self.cfg, self.W = cfg, W
        self.dev = torch.device(device)
        self.dt = dtype
        self.fq = fake_quant
        self.stable_topk = stable_topk
        self.k = kernels or eager_kernels()
        self.topo = O.topology(cfg)
        self.L = cfg["num_hidden_layers"]
        self.aq = set(release_fp8_names(cfg)) if release_quant else set()
        self.experts_used = {}  # layer -> distinct routed experts of the last MoE call (diagnostic)
        self.n = cfg["hc_mult"]
        self.D = cfg["hidden_size"]
        self.eps = cfg["rms_norm_eps"]
        self.H, self.d = cfg["num_attention_heads"], cfg["head_dim"]
        self.win = cfg["sliding_window"]
        self.cand_needed = any(t["uses_candidates"] for t in self.topo)
        self._freqs = {}
        for info in self.topo:
            r = info["ratio"]
            if r not in self._freqs:
                self._freqs[r] = O.rope_angles(cfg, r, 2)[1].to(self.dev)  # angle at position 1 = freq
        self._ang = {}
        self.eng_layers = list(cfg.get("engram_layer_ids") or [])
        if self.eng_layers:
            lay = O.engram_layout(cfg)
            self.N = cfg["engram_max_ngram_size"]
            self.e_mult = torch.as_tensor(np.stack(lay["multipliers"]), device=self.dev)
            self.e_primes = torch.as_tensor(np.asarray(lay["primes"], dtype=np.int64), device=self.dev)
            self.e_off = torch.as_tensor(np.stack(lay["offsets"]), device=self.dev)
            tm = np.asarray(token_map, dtype=np.int64)
            self.token_map = torch.as_tensor(tm, device=self.dev)
            self.pad = int(tm[cfg.get("engram_pad_token_id", 2)])
        self._mm_out = False
        if self.dt == torch.bfloat16 and self.dev.type == "cuda":
            try:
                a = torch.ones(4, 64, dtype=self.dt, device=self.dev)
                r = torch.mm(a, a.t(), out_dtype=F32)
                self._mm_out = bool(r.dtype == F32 and float(r[0, 0]) == 64.0)
            except Exception:
                self._mm_out = False
        # fp32 routers / ratio-2 compressors kept as fp32 copies when no bf16->fp32 GEMM exists
        self._f32 = {}

    # ------------------------------------------------------------------ helpers
    def ang(self, ratio: int, n: int):
        """(cos, sin) tables [n, r/2] of the layer's RoPE (angles = position * freq in fp32)."""
        t = self._ang.get(ratio)
        if t is None or t[0].shape[0] < n:
            m = max(1024, 1 << (n - 1).bit_length())  # grow by powers of two (decode adds one per step)
            a = torch.arange(m, dtype=F32, device=self.dev)[:, None] * self._freqs[ratio][None]
            t = (torch.cos(a), torch.sin(a))
            self._ang[ratio] = t
        return t

    def mm32(self, x, name):
        """x @ W[name].T with fp32 output (the reference's fp32 GEMMs on bf16-valued operands)."""
        w = self.W[name]
        if x.dtype == F32:
            return F.linear(x, w.float() if w.dtype != F32 else w)
        if self._mm_out:
            y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=F32)
            return y.view(*x.shape[:-1], w.shape[0])
        wf = self._f32.get(name)
        if wf is None:
            wf = self._f32[name] = w.float()
        return F.linear(x.float(), wf)

    def topk(self, x, k: int):
        if self.stable_topk:
            return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
        return torch.topk(x, k, dim=-1, sorted=False).indices

    def lin(self, x, name, xq=None):
        """Bias-free linear in the activation dtype; a release-fp8 weight first quantizes its input
        (e4m3, ue8m0 per 32: exact in bf16, so the bf16 GEMM has the reference's products).
        ``xq``: the input already quantized (shared by two projections of the same input)."""
        if self.fq and name in self.aq:
            x = self.k.q_fp8_e8(x, 32) if xq is None else xq
        return F.linear(x, self.W[name])

    def aq_input(self, x, name):
        return self.k.q_fp8_e8(x, 32) if self.fq and name in self.aq else None

    # ------------------------------------------------------------------ Engram
    def _hash(self, slots):
        """slots: list of N [B,S] int64 tensors (already padded) -> {layer: [B,S,cols]}."""
        out = {}
        for li, l in enumerate(self.eng_layers):
            mult = self.e_mult[li]
            rolling = slots[0] * mult[0]
            cols = []
            for s in range(1, self.N):
                rolling = torch.bitwise_xor(rolling, slots[s] * mult[s])
                cols.append(rolling.unsqueeze(-1) % self.e_primes[li, s - 1])
            out[l] = torch.cat(cols, dim=-1) + self.e_off[li]
        return out

    def hashes_prefill(self, ids):
        B, S = ids.shape
        comp = self.token_map[ids]
        pos = torch.arange(S, device=self.dev)
        blocked = torch.zeros(B, S, dtype=torch.bool, device=self.dev)
        slots = []
        for shift in range(self.N):
            src = comp[:, (pos - shift).clamp(min=0)]
            blocked = blocked | (pos < shift) | (src == -1)
            slots.append(torch.where(blocked, self.pad, src))
        hist = torch.full((B, self.N - 1), -1, dtype=torch.long, device=self.dev)
        m = min(S, self.N - 1)
        hist[:, self.N - 1 - m:] = comp[:, S - m:]
        return self._hash(slots), hist

    def hashes_decode(self, ids, hist):
        """ids [B,1]; hist [B,N-1] compressed ids of the previous tokens, oldest first, -1 none."""
        cur = self.token_map[ids[:, 0]]
        slots, blocked = [], torch.zeros_like(cur, dtype=torch.bool)
        for shift in range(self.N):
            src = cur if shift == 0 else hist[:, self.N - 1 - shift]
            blocked = blocked | (src == -1)
            slots.append(torch.where(blocked, self.pad, src)[:, None])
        new_hist = torch.cat([hist[:, 1:], cur[:, None]], dim=1)
        return self._hash(slots), new_hist

    def engram(self, l, h, hashes):
        p = f"layers.{l}.engram."
        tab = self.W[p + "embed.weight"]
        if tab.dtype == torch.float8_e4m3fn:  # gather the fp8 bytes (uint8 view), dequantize those rows
            rows = tab.view(torch.uint8)[hashes].view(torch.float8_e4m3fn)
            rows = _dequant_rows(rows, self.W[p + "embed.scale"][hashes], self.dt)
        else:
            rows = tab[hashes].to(self.dt)
        kv = self.lin(rows.flatten(-2), p + "wkv.weight")
        wgt = self.W[p + "q_weight"].float() * self.W[p + "k_weight"].float()
        return self.k.engram_mix(h, kv, wgt, self.n, self.D, self.eps)

    # ------------------------------------------------------------------ MoE
    def moe(self, l, x):
        p = f"layers.{l}.ffn."
        cfg = self.cfg
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        k = cfg["num_experts_per_tok"]
        limit = float(cfg.get("swiglu_limit", 0.0) or 0.0)
        z = self.mm32(xf, p + "gate.weight") / float(cfg.get("gate_temp", 1.0))
        scores = F.softplus(z).sqrt()
        top = self.topk(scores + self.W[p + "gate.bias"], k)
        wts = scores.gather(-1, top)
        if cfg.get("norm_topk_prob", True) and k > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * float(cfg.get("routed_scaling_factor", 1.0))

        s = p + "shared_experts."
        aq = self.fq and (p + "experts.w1") in self.aq
        xa = self.k.q_fp8_e8(xf, 32) if aq else xf  # per-token quantization: once for all experts
        flat = top.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=cfg["n_routed_experts"]).tolist()  # the one host sync
        self.experts_used[l] = sum(1 for c in counts if c)
        tok = order // k
        xs = xa[tok]
        ws = wts.flatten()[order].unsqueeze(-1)
        w1, w2, w3 = self.W[p + "experts.w1"], self.W[p + "experts.w2"], self.W[p + "experts.w3"]
        outs = []
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            xe = xs[start:start + c]
            h = self.k.expert_act(F.linear(xe, w1[e]), F.linear(xe, w3[e]), ws[start:start + c], limit, aq)
            outs.append(F.linear(h, w2[e]))
            start += c
        y = torch.zeros(xf.shape, dtype=F32, device=x.device)
        y.index_add_(0, tok, torch.cat(outs).float())
        xq = self.aq_input(xf, s + "w1.weight")
        hs = self.k.swiglu(self.lin(xf, s + "w1.weight", xq), self.lin(xf, s + "w3.weight", xq), limit)
        y = y + self.lin(hs.to(x.dtype), s + "w2.weight").float()
        return y.to(x.dtype).view(shape)

    # ------------------------------------------------------------------ attention
    def _select_blocks(self, score, n_vis):
        """Candidate blocks (level one of the two-level top-k); score [B,S,T], n_vis [S,1]."""
        cfg = self.cfg
        block, topb = cfg["candidate_block_size"], cfg["candidate_topk_blocks"]
        T = score.shape[-1]
        padded = F.pad(score, (0, (-T) % block), value=NEG_INF)
        blocks = padded.unflatten(-1, (-1, block)).amax(-1)
        nb = blocks.shape[-1]
        newest = (n_vis - 1) // block
        blocks = blocks.masked_fill(torch.arange(nb, device=self.dev) == newest, math.inf)
        top = self.topk(blocks, min(topb, nb))
        keep_vals = blocks.gather(-1, top) > NEG_INF
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, top, keep_vals)
        return keep.repeat_interleave(block, dim=-1)[..., :T]

    def _index_scores(self, l, x, qr, cs):
        """Indexer scores [B,S,T] of the chunk's queries against st idx keys (unmasked)."""
        cfg = self.cfg
        a = f"layers.{l}.attn.indexer."
        hi, ci = cfg["index_n_heads"], cfg["index_head_dim"]
        q = self.lin(qr, a + "wq_b.weight").unflatten(-1, (hi, ci))
        q = self.k.rope(q, cs[0].unsqueeze(-2), cs[1].unsqueeze(-2))
        if self.fq:
            q = self.k.q_fp4_e8(q, 32)
        w = self.lin(x, a + "weights_proj.weight") * (ci ** -0.5 * hi ** -0.5)
        return q, w

    def _topk_from_scores(self, l, score, n_vis, st):
        info = self.topo[l]
        if info["is_candidate_source"] and self.cand_needed:
            st["cand"] = self._select_blocks(score, n_vis)
        elif info["uses_candidates"]:
            score = score.masked_fill(~st["cand"][..., : score.shape[-1]], NEG_INF)
        k_sel = min(self.cfg["index_topk"], score.shape[-1])
        idx = self.topk(score, k_sel).sort(-1).values
        return torch.where(idx < n_vis, idx, -1)

    def _out_proj(self, l, o, cs):
        a = f"layers.{l}.attn."
        cfg = self.cfg
        G, R = cfg["o_groups"], cfg["o_lora_rank"]
        o = self.k.rope(o, cs[0].unsqueeze(-2), -cs[1].unsqueeze(-2))
        B, S = o.shape[:2]
        o = o.reshape(B, S, G, -1)
        wo_a = self.W[a + "wo_a.weight"].view(G, R, -1)
        z = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.lin(z.flatten(2), a + "wo_b.weight")

    def _qkv(self, l, x, cs):
        a = f"layers.{l}.attn."
        xq = self.aq_input(x, a + "wq_a.weight")
        qr = self.k.rms_norm(self.lin(x, a + "wq_a.weight", xq), self.W[a + "q_norm.weight"], self.eps)
        q = self.lin(qr, a + "wq_b.weight").unflatten(-1, (self.H, self.d))
        q = self.k.rope(q, cs[0].unsqueeze(-2), cs[1].unsqueeze(-2))
        kv = self.k.rms_norm(self.lin(x, a + "wkv.weight", xq if a + "wkv.weight" in self.aq else None),
                             self.W[a + "kv_norm.weight"], self.eps)
        kv = self.k.rope(kv, *cs)
        if self.fq:
            kv = self.k.q_fp8_e8(kv, 32)
        return qr, q, kv

    def _entries(self, l, lat, gpos_cs):
        """Compressed entries and index keys of latents [B,T,d] at group positions g*ratio."""
        a = f"layers.{l}.attn."
        k = self.k.rms_norm(self.lin(lat, a + "indexer.wk.weight"), self.W[a + "indexer.k_norm.weight"], self.eps)
        k = self.k.rope(k, *gpos_cs)
        ent = self.k.rope(lat, *gpos_cs)
        if self.fq:
            k = self.k.q_fp4_e8(k, 32)
            ent = self.k.q_fp4_e4(ent, 16)
        return ent, k

    def attn_prefill(self, l, x, lc, st, block: int = 256):
        info = self.topo[l]
        r = info["ratio"]
        a = f"layers.{l}.attn."
        B, S, _ = x.shape
        Wn = self.win
        cos, sin = self.ang(r, S)
        cs = (cos[:S], sin[:S])
        qr, q, kv = self._qkv(l, x, cs)
        idx = None
        if r > 0:
            T = S // r
            if info["is_kv_source"]:
                if r == 1:
                    lat = self.k.rms_norm(self.lin(x, a + "compressor.wkv.weight"),
                                          self.W[a + "compressor.norm.weight"], self.eps)
                else:
                    kvf = self.mm32(x, a + "compressor.wkv.weight")
                    scf = self.mm32(x, a + "compressor.wgate.weight")
                    pooled = (kvf[:, :T * r].unflatten(1, (T, r))
                              * torch.softmax(scf[:, :T * r].unflatten(1, (T, r)), dim=2)).sum(2)
                    lat = self.k.rms_norm(pooled.to(self.dt), self.W[a + "compressor.norm.weight"], self.eps)
                    rem = S - T * r
                    lc["st_kv"].zero_()
                    lc["st_sc"].fill_(NEG_INF)
                    if rem:
                        lc["st_kv"][:, :rem] = kvf[:, T * r:]
                        lc["st_sc"][:, :rem] = scf[:, T * r:]
                if T > 0:
                    gcs = (cos[0:T * r:r], sin[0:T * r:r])
                    ent, k = self._entries(l, lat[:, :T], gcs)
                    lc["cmp_kv"][:, :T] = ent
                    lc["idx_k"][:, :T] = k
                st["cmp_kv"], st["idx_k"] = lc["cmp_kv"], lc["idx_k"]
            if info["is_index_source"]:
                if T == 0:
                    st["topk"] = torch.full((B, S, 1), -1, dtype=torch.long, device=self.dev)
                else:
                    qi, wi = self._index_scores(l, x, qr, cs)
                    keys = st["idx_k"][:, :T]
                    parts, cands = [], []
                    for q0 in range(0, S, block):
                        q1 = min(S, q0 + block)
                        sc = torch.einsum("bshd,btd->bsht", qi[:, q0:q1], keys)
                        sc = (sc.relu() * wi[:, q0:q1].unsqueeze(-1)).sum(2).float()
                        n_vis = (torch.arange(q0 + 1, q1 + 1, device=self.dev) // r).unsqueeze(-1)
                        sc = sc.masked_fill(torch.arange(T, device=self.dev) >= n_vis, NEG_INF)
                        sub = {"cand": st["cand"][:, q0:q1]} if info["uses_candidates"] else {}
                        parts.append(self._topk_from_scores(l, sc, n_vis, sub))
                        if "cand" in sub and info["is_candidate_source"]:
                            cands.append(sub["cand"])
                    st["topk"] = torch.cat(parts, dim=1)
                    if cands:
                        st["cand"] = torch.cat(cands, dim=1)
            idx = st["topk"]
        # attention in query blocks: window slice + own selected entries
        sink = self.W[a + "attn_sink"].float()
        scale = self.d ** -0.5
        outs = []
        pos = torch.arange(S, device=self.dev)
        for q0 in range(0, S, block):
            q1 = min(S, q0 + block)
            k0 = max(0, q0 - Wn + 1)
            qi, ki = pos[q0:q1, None], pos[None, k0:q1]
            ok_w = ((ki <= qi) & (ki > qi - Wn)).expand(B, -1, -1)
            kc = ok_c = None
            if idx is not None:
                ib = idx[:, q0:q1]
                ok_c = ib >= 0
                g = ib.clamp(min=0)
                kc = st["cmp_kv"][torch.arange(B, device=self.dev)[:, None, None], g]
            outs.append(self.k.sparse_attn(q[:, q0:q1], kv[:, k0:q1], ok_w, kc, ok_c, sink, scale,
                                           self.dt != F32))
        o = torch.cat(outs, dim=1)
        out = self._out_proj(l, o, cs)
        # window ring: the last W tokens, slot = pos % W
        m = min(S, Wn)
        lpos = pos[S - m:]
        lc["win_kv"][:, lpos % Wn] = kv[:, S - m:]
        lc["win_pos"][:, lpos % Wn] = lpos
        return out

    def attn_decode(self, l, x, p: int, lc, st):
        info = self.topo[l]
        r = info["ratio"]
        a = f"layers.{l}.attn."
        B = x.shape[0]
        Wn = self.win
        cos, sin = self.ang(r, p + 1)
        cs = (cos[p:p + 1], sin[p:p + 1])
        qr, q, kv = self._qkv(l, x, cs)
        slot = p % Wn
        lc["win_kv"][:, slot] = kv[:, 0]
        lc["win_pos"][:, slot] = p
        wp = lc["win_pos"]
        ok_w = ((wp >= 0) & (wp > p - Wn)).unsqueeze(1)
        kc = ok_c = None
        if r > 0:
            if info["is_kv_source"]:
                lat, g = None, (p + 1) // r - 1
                if r == 1:
                    lat = self.k.rms_norm(self.lin(x, a + "compressor.wkv.weight"),
                                          self.W[a + "compressor.norm.weight"], self.eps)
                else:
                    s = p % r
                    lc["st_kv"][:, s] = self.mm32(x[:, 0], a + "compressor.wkv.weight")
                    lc["st_sc"][:, s] = self.mm32(x[:, 0], a + "compressor.wgate.weight")
                    if s == r - 1:
                        pooled = (lc["st_kv"] * torch.softmax(lc["st_sc"], dim=1)).sum(1, keepdim=True)
                        lat = self.k.rms_norm(pooled.to(self.dt), self.W[a + "compressor.norm.weight"], self.eps)
                        lc["st_sc"].fill_(NEG_INF)
                        lc["st_kv"].zero_()
                if lat is not None:
                    gcos, gsin = self.ang(r, g * r + 1)
                    ent, k = self._entries(l, lat, (gcos[g * r:g * r + 1], gsin[g * r:g * r + 1]))
                    lc["cmp_kv"][:, g] = ent[:, 0]
                    lc["idx_k"][:, g] = k[:, 0]
                st["cmp_kv"], st["idx_k"] = lc["cmp_kv"], lc["idx_k"]
            n_vis = (p + 1) // r
            if info["is_index_source"]:
                if n_vis == 0:
                    st["topk"] = torch.full((B, 1, 1), -1, dtype=torch.long, device=self.dev)
                else:
                    qi, wi = self._index_scores(l, x, qr, cs)
                    sc = torch.einsum("bshd,btd->bsht", qi, st["idx_k"][:, :n_vis])
                    sc = (sc.relu() * wi.unsqueeze(-1)).sum(2).float()
                    nv = torch.full((1, 1), n_vis, device=self.dev)
                    st["topk"] = self._topk_from_scores(l, sc, nv, st)
            idx = st["topk"]
            ok_c = idx >= 0
            kc = st["cmp_kv"][torch.arange(B, device=self.dev)[:, None, None], idx.clamp(min=0)]
        o = self.k.sparse_attn(q, lc["win_kv"], ok_w, kc, ok_c, self.W[a + "attn_sink"].float(),
                               self.d ** -0.5, self.dt != F32)
        return self._out_proj(l, o, cs)

    # ------------------------------------------------------------------ cache
    def new_cache(self, B: int, max_len: int):
        layers = []
        for info in self.topo:
            c = {"win_kv": torch.zeros(B, self.win, self.d, dtype=self.dt, device=self.dev),
                 "win_pos": torch.full((B, self.win), -1, dtype=torch.long, device=self.dev)}
            r = info["ratio"]
            if info["is_kv_source"]:
                T = max(max_len // r, 1)
                c["cmp_kv"] = torch.zeros(B, T, self.d, dtype=self.dt, device=self.dev)
                c["idx_k"] = torch.zeros(B, T, self.cfg["index_head_dim"], dtype=self.dt, device=self.dev)
                if r > 1:
                    c["st_kv"] = torch.zeros(B, r, self.d, dtype=F32, device=self.dev)
                    c["st_sc"] = torch.full((B, r, self.d), NEG_INF, dtype=F32, device=self.dev)
            layers.append(c)
        hist = None
        if self.eng_layers:
            hist = torch.full((B, self.N - 1), -1, dtype=torch.long, device=self.dev)
        return {"layers": layers, "length": 0, "engram_hist": hist}

    def random_cache(self, B: int, ctx: int, max_len: int, seed: int = 1, same_rows: bool = False):
        """A cache as if ``ctx`` tokens had been consumed (random contents, valid positions).
        ``same_rows``: every row holds the same contents (row 0's)."""
        if same_rows:
            one = self.random_cache(1, ctx, max_len, seed)
            rep = lambda t: None if t is None else t.expand(B, *t.shape[1:]).contiguous()  # noqa: E731
            return {"layers": [{k: rep(v) for k, v in lc.items()} for lc in one["layers"]],
                    "length": ctx, "engram_hist": rep(one["engram_hist"])}
        c = self.new_cache(B, max_len)
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(seed)
        Wn = self.win
        pos = torch.arange(max(0, ctx - Wn), ctx, device=self.dev)
        for info, lc in zip(self.topo, c["layers"]):
            lc["win_kv"].copy_(torch.randn(lc["win_kv"].shape, generator=gen, device=self.dev, dtype=self.dt))
            lc["win_pos"][:, pos % Wn] = pos
            if "cmp_kv" in lc:
                T = ctx // info["ratio"]
                for nm in ("cmp_kv", "idx_k"):
                    lc[nm][:, :T] = torch.randn((B, T, lc[nm].shape[-1]), generator=gen, device=self.dev,
                                                dtype=self.dt)
                if "st_kv" in lc:
                    rem = ctx % info["ratio"]
                    if rem:
                        lc["st_kv"][:, :rem] = torch.randn((B, rem, self.d), generator=gen, device=self.dev)
                        lc["st_sc"][:, :rem] = torch.randn((B, rem, self.d), generator=gen, device=self.dev)
        if self.eng_layers:
            nc = int(self.token_map.max()) + 1
            c["engram_hist"] = torch.randint(0, nc, (B, self.N - 1), generator=gen, device=self.dev)
        c["length"] = ctx
        return c

    # ------------------------------------------------------------------ forward
    def _layers(self, h, attn_fn, hashes):
        W, n, eps = self.W, self.n, self.eps
        iters, hc_eps = self.cfg["hc_sinkhorn_iters"], self.cfg["hc_eps"]
        pre_mix = torch.zeros(*h.shape[:2], n, dtype=F32, device=self.dev)
        pre_mix[..., 0] = 1.0
        st = {}
        for l in range(self.L):
            p = f"layers.{l}."
            if l in self.eng_layers:
                h = self.engram(l, h, hashes[l])
            res = h
            pre_a, post_a, comb_a = self.k.hc_mixes(h, W[p + "hc_attn_fn"], W[p + "hc_attn_scale"],
                                                    W[p + "hc_attn_base"], n, iters, eps, hc_eps)
            x = self.k.rms_norm(self.k.hc_collapse(h, pre_mix), W[p + "attn_norm.weight"], eps)
            h = self.k.hc_expand(attn_fn(l, x, st), res, post_a, comb_a)
            res = h
            pre_f, post_f, comb_f = self.k.hc_mixes(h, W[p + "hc_ffn_fn"], W[p + "hc_ffn_scale"],
                                                    W[p + "hc_ffn_base"], n, iters, eps, hc_eps)
            x = self.k.rms_norm(self.k.hc_collapse(h, pre_a), W[p + "ffn_norm.weight"], eps)
            h = self.k.hc_expand(self.moe(l, x), res, post_f, comb_f)
            pre_mix = pre_f
        return self.k.rms_norm(self.k.hc_collapse(h, pre_mix), W["norm.weight"], eps)

    def _embed(self, ids):
        return self.W["embed.weight"][ids].to(self.dt).unsqueeze(2).repeat(1, 1, self.n, 1)

    @torch.no_grad()
    def prefill(self, ids, cache, all_logits: bool = False):
        """ids [B,S] from position 0 into an empty ``cache``; fp32 logits [B,S,V] or [B,V] (last)."""
        B, S = ids.shape
        hashes = None
        if self.eng_layers:
            hashes, cache["engram_hist"] = self.hashes_prefill(ids)
        y = self._layers(self._embed(ids), lambda l, x, st: self.attn_prefill(l, x, cache["layers"][l], st),
                         hashes)
        cache["length"] = S
        if not all_logits:
            y = y[:, -1]
        return self.mm32(y, "head.weight")

    @torch.no_grad()
    def decode(self, ids, cache):
        """ids [B,1] at position cache['length'] (same for every row); fp32 logits [B,V]."""
        p = cache["length"]
        hashes = None
        if self.eng_layers:
            hashes, cache["engram_hist"] = self.hashes_decode(ids, cache["engram_hist"])
        y = self._layers(self._embed(ids), lambda l, x, st: self.attn_decode(l, x, p, cache["layers"][l], st),
                         hashes)
        cache["length"] = p + 1
        return self.mm32(y[:, 0], "head.weight")


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def ceilings(dev):
    x = torch.ones((1 << 30) // 2, dtype=torch.bfloat16, device=dev)

    def run(f, arg, n=5):
        f(arg)
        f(arg)
        _sync(dev)
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f(arg)
            _sync(dev)
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    nb = 2 * x.nbytes
    t = run(lambda v: v * 2, x)
    emit(what="ceiling_copy", impl="torch", bytes=nb, seconds=t, tb_per_s=nb / t / 1e12)
    del x
    n = 8192 if dev.type == "cuda" else 1024
    m = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    t = run(lambda v: v @ v, m)
    emit(what="ceiling_bf16_matmul", impl="torch", flops=2 * n ** 3, seconds=t, tflop_per_s=2 * n ** 3 / t / 1e12)
    del m


def bench_decode(peer, cfg, batches, ctx, iters, impl, dev, inputs):
    """``inputs``: "identical" = the old bench_slice inputs (token id 1 in every row, every row's cache
    the same), so all rows route to the same experts; "random" = a random token per row and
    per-row random cache contents (distinct routing per row)."""
    V = cfg["vocab_size"]
    for B in batches:
        try:
            same = inputs == "identical"
            cache = peer.random_cache(B, ctx, ctx + 64, same_rows=same)
            gen = torch.Generator(device=dev)
            gen.manual_seed(B)
            if same:
                ids = torch.ones((B, 1), dtype=torch.long, device=dev)
            else:
                ids = torch.randint(0, V, (B, 1), generator=gen, device=dev)
            t0 = time.perf_counter()
            lg = peer.decode(ids, cache)
            _sync(dev)
            first = time.perf_counter() - t0
            lg = peer.decode(ids, cache)
            _sync(dev)
            ts = []
            for _ in range(iters):
                t1 = time.perf_counter()
                lg = peer.decode(ids, cache)
                _sync(dev)
                ts.append(time.perf_counter() - t1)
            step = float(np.median(ts))
            finite = bool(torch.isfinite(lg).all())
            emit(what="decode_step", impl=impl, inputs=inputs, batch=B, ctx=ctx, layers=cfg["num_hidden_layers"],
                 seconds=step, first_call_s=first, tokens_per_s=B / step, min_s=float(np.min(ts)),
                 experts_used=[peer.experts_used[l] for l in sorted(peer.experts_used)], logits_finite=finite)
            del cache, lg
        except Exception as e:  # report and continue (OOM etc.)
            emit(what="decode_step", impl=impl, inputs=inputs, batch=B, error=f"{type(e).__name__}: {str(e)[:300]}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_prefill(peer, cfg, lengths, impl, dev, iters=3):
    V = cfg["vocab_size"]
    for S in lengths:
        try:
            gen = torch.Generator(device=dev)
            gen.manual_seed(S)
            ids = torch.randint(0, V, (1, S), generator=gen, device=dev)
            t0 = time.perf_counter()
            lg = peer.prefill(ids, peer.new_cache(1, S))
            _sync(dev)
            first = time.perf_counter() - t0
            ts = []
            for _ in range(iters):
                cache = peer.new_cache(1, S)
                _sync(dev)
                t1 = time.perf_counter()
                lg = peer.prefill(ids, cache)
                _sync(dev)
                ts.append(time.perf_counter() - t1)
                del cache
            run = float(np.median(ts))
            emit(what="prefill", impl=impl, tokens=S, layers=cfg["num_hidden_layers"], seconds=run, first_call_s=first,
                 tokens_per_s=S / run, logits_finite=bool(torch.isfinite(lg).all()))
            del lg
        except Exception as e:
            emit(what="prefill", impl=impl, tokens=S, error=f"{type(e).__name__}: {str(e)[:300]}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def compare(path):
    """One ``ratio`` line per measurement present in both runs: torch seconds / JAX seconds
    (JAX: decode with the default MoE path and the Engram table on the device, one jitted step
    per call ("decode_step") and per token inside generate's while_loop ("decode_token"))."""
    with open(path) as f:  # bench_slice.json, or its incremental .jsonl (survives a time-out)
        jx = [json.loads(x) for x in f if x.strip()] if path.endswith(".jsonl") else json.load(f)
    jd = {r["batch"]: r for r in jx if r.get("what") == "decode_step" and "seconds" in r
          and r.get("moe_path", "auto") == "auto" and r.get("engram", "engram_table_on_device") == "engram_table_on_device"}
    jp = {r["tokens"]: r for r in jx if r.get("what") == "prefill" and "seconds" in r}
    jl = {r["batch"]: r for r in jx if r.get("what") == "decode_loop" and "seconds_per_step" in r}
    for r in list(RESULTS):
        if "seconds" not in r:
            continue
        if r.get("what") == "decode_step" and r["batch"] in jd and r.get("inputs") == "random":
            j = jd[r["batch"]]
            emit(what="ratio", kind="decode_step", batch=r["batch"], ctx=r["ctx"], impl=r["impl"],
                 torch_s=r["seconds"], jax_s=j["seconds"], torch_over_jax=r["seconds"] / j["seconds"])
        if r.get("what") == "decode_step" and r["batch"] in jl and r.get("inputs") == "random":
            j = jl[r["batch"]]  # JAX per token inside generate's on-device loop
            emit(what="ratio", kind="decode_token", batch=r["batch"], ctx=r["ctx"], impl=r["impl"],
                 torch_s=r["seconds"], jax_s=j["seconds_per_step"], torch_over_jax=r["seconds"] / j["seconds_per_step"])
        elif r.get("what") == "prefill" and r["tokens"] in jp:
            j = jp[r["tokens"]]
            emit(what="ratio", kind="prefill", tokens=r["tokens"], impl=r["impl"], torch_s=r["seconds"],
                 jax_s=j["seconds"], torch_over_jax=r["seconds"] / j["seconds"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny width (bench_slice --small), for a CPU smoke run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--engram-rows", type=int, default=None,
                    help="Engram table rows (default 80,000,000 as bench_slice; 1,000,000 with --small)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="also time with torch.compile on the dense pieces (auto: on CUDA only)")
    ap.add_argument("--skip", default="", help="comma list of: ceil, decode, prefill")
    ap.add_argument("--decode-inputs", default="random", choices=["both", "identical", "random"],
                    help="identical: token 1 in every row + identical rows (the old bench_slice inputs); "
                         "random: a random token and random cache contents per row")
    ap.add_argument("--no-release-quant", action="store_true",
                    help="as bench_slice: no fp8 activation quantization before the release's fp8/fp4 linears")
    ap.add_argument("--compare", default="",
                    help="bench_slice.py JSON to put side by side (default: $OUT/bench_slice.json if present)")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs at full precision (JAX: HIGHEST)
        torch.backends.cudnn.allow_tf32 = False
    emit(what="env", impl="torch", torch=torch.__version__, device=str(dev),
         device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
         cuda=torch.version.cuda)
    if "ceil" not in skip:
        ceilings(dev)

    from benchmarks.bench_slice import slice_config

    rows = a.engram_rows if a.engram_rows is not None else (1_000_000 if a.small else 80_000_000)
    cfg = dict(slice_config(a.layers, a.small, rows).raw["text_config"])
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    W = random_weights(cfg, dev, dtype, seed=0, engram_fp8=True)
    rng = np.random.default_rng(0)
    nc = cfg["engram_compressed_vocab_size"]
    tmap = rng.integers(0, nc, size=cfg["vocab_size"]).astype(np.int64)
    tmap[:nc] = np.arange(nc)
    peer = Peer(cfg, W, tmap, device=dev, dtype=dtype, fake_quant=True, release_quant=not a.no_release_quant)
    _sync(dev)
    nbytes = sum(v.numel() * v.element_size() for v in W.values())
    emit(what="build", impl="torch", layers=a.layers, param_gb=nbytes / 1e9, seconds=time.perf_counter() - t0,
         engram_rows=cfg["engram_num_embeddings"], mm_bf16_to_fp32_out=peer._mm_out,
         release_quant=not a.no_release_quant,
         gpu_mem_allocated_gb=(torch.cuda.memory_allocated(dev) / 1e9 if dev.type == "cuda" else None))
    batches = [int(b) for b in a.batches.split(",") if b]
    lengths = [int(s) for s in a.prefill.split(",") if s]
    impls = [("torch_eager", eager_kernels)]
    if a.compile == "on" or (a.compile == "auto" and dev.type == "cuda"):
        impls.append(("torch_compile", compiled_kernels))
    for impl, make in impls:
        try:
            peer.k = make()
            if impl == "torch_compile":  # compile problems (no triton, ...) surface here, once
                t1 = time.perf_counter()
                c = peer.random_cache(1, 64, 128)
                peer.decode(torch.zeros(1, 1, dtype=torch.long, device=dev), c)
                _sync(dev)
                emit(what="compile_check", impl=impl, seconds=time.perf_counter() - t1)
        except Exception as e:
            emit(what="compile_check", impl=impl, error=f"{type(e).__name__}: {str(e)[:500]}")
            continue
        if "decode" not in skip:
            for inputs in (["identical", "random"] if a.decode_inputs == "both" else [a.decode_inputs]):
                bench_decode(peer, cfg, batches, a.ctx, a.iters, impl, dev, inputs)
        if "prefill" not in skip:
            bench_prefill(peer, cfg, lengths, impl, dev)
    peer.k = eager_kernels()
    out = os.environ.get("OUT")
    jax_json = a.compare or (os.path.join(out, "bench_slice.json") if out else None)
    if jax_json and os.path.exists(jax_json):
        compare(jax_json)
    if out:
        with open(os.path.join(out, "bench_torch_peer.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
