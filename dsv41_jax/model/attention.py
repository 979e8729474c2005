"""Attention of one V4.1 layer: low-rank q, shared K=V latent, sliding window, compressed KV
(kv-source compressor), lightning indexer with the two-level candidate filter, sink softmax,
grouped output projection.

Every call processes a chunk of tokens at absolute positions ``pos`` against a per-layer cache
(window ring, compressor partial group, compressed KV and index keys), so one-shot prefill,
chunked prefill and single-token decode all run the same code. Cross-layer sharing (consumers
read the latest kv source's compressed KV / index keys and the latest index source's top-k and
candidate mask) goes through the ``ctx`` dict of the current forward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import LayerPlan, TextConfig
from dsv41_jax.model.layers import (Linear, RMSNorm, einsum, einsum_rounded, fusable_linears, fused_linears,
                                   top_k_indices_ascending, top_k_mask, topk_route)
from dsv41_jax.model.rope import layer_inv_freq, rope_tail
from dsv41_jax.numerics import Numerics
from dsv41_jax import quant

F32 = jnp.float32
NEG_INF = -jnp.inf


def rope_in_place(site: str) -> bool:
    """Whether the RoPE of ``site`` writes its rotated tail back into the array
    (``rope_tail(in_place=True)``: the same bits) instead of a concatenation that copies all of
    it: ``"out"``, the attention output's inverse rotation (``DSV41_ROPE_OUT_IN_PLACE``; prefill 8k
    83.9 -> 83.3 ms, run 28), ``"q"``, a prefill chunk's queries where they are their own GEMM's
    output, not a slice of a fused launch's (``DSV41_ROPE_Q_IN_PLACE``; 79.1 -> 78.1 ms, run 29;
    one-token steps keep the concatenation: ``rope_tail``,
    ``benchmarks/repro_xla_cpu_inplace_dus.py``). 1 (the default) or 0; read at trace time."""
    from dsv41_jax.kernels import env_switch

    return env_switch({"out": "DSV41_ROPE_OUT_IN_PLACE", "q": "DSV41_ROPE_Q_IN_PLACE"}[site], on="in place")


def _scatter_rows(buf, idx, vals):
    """buf [B, T, ...] .at[b, idx[b, j]].set(vals[b, j]); out-of-range idx (e.g. T) are dropped."""
    # per-row scatter under vmap: batch-sharded caches stay local (no traffic over "data")
    return jax.vmap(lambda b, i, v: b.at[i].set(v.astype(b.dtype), mode="drop"))(buf, idx, vals)


def query_block(S: int, q_block: int, window: int) -> int:
    """The query block of an S-token chunk (attention and indexer), or 0 when it runs whole (at
    most two blocks, or not a multiple of one). At least the window: later blocks must not need
    ring slots, which are stored in slot order."""
    block = max(q_block, window)
    return 0 if S <= 2 * block or S % block else block


def sparse_attn(q, kw, kw_ok, kc, kc_ok, sink, scale: float, dt):
    """Softmax over window keys + selected compressed entries (K = V), sink in the denominator:
    q [B,S,H,d], kw [B,J,d] with kw_ok [B,S,J], kc [B,S,K,d] with kc_ok [B,S,K] (or None), sink [H].

    Both products take their operands in the compute dtype ``dt`` with fp32 accumulation: q, the
    keys and the probabilities (rounded to ``dt``, as the reference does before its value
    product) are values of that dtype, so bf16 operands give the fp32 products of the reference
    on the tensor cores; the fp32 parity path stays fp32 (``einsum``: HIGHEST)."""
    qd, kwd = q.astype(dt), kw.astype(dt)
    lw = einsum("bshd,bjd->bshj", qd, kwd, preferred_element_type=F32)
    lw = jnp.where(kw_ok[:, :, None, :], lw * scale, NEG_INF)
    parts = [lw]
    if kc is not None:
        kcd = kc.astype(dt)
        lc = einsum("bshd,bskd->bshk", qd, kcd, preferred_element_type=F32)
        lc = jnp.where(kc_ok[:, :, None, :], lc * scale, NEG_INF)
        parts.append(lc)
    mx = jnp.maximum(functools.reduce(jnp.maximum, [jnp.max(p, axis=-1) for p in parts]), -1e30)  # no concat
    pw = jnp.exp(lw - mx[..., None])
    den = jnp.sum(pw, -1)
    o = einsum("bshj,bjd->bshd", pw.astype(dt), kwd, preferred_element_type=F32)
    if kc is not None:
        pc = jnp.exp(lc - mx[..., None])
        den = den + jnp.sum(pc, -1)
        o = o + einsum("bshk,bskd->bshd", pc.astype(dt), kcd, preferred_element_type=F32)
    den = den + jnp.exp(sink.astype(F32) - mx)
    return (o / den[..., None]).astype(dt)


def select_candidate_blocks(score, n_vis, topk_blocks: int, block: int):
    """Level one of the two-level top-k: keep the best ``topk_blocks`` blocks (block score = max
    over its positions), with the query's newest block forced in. score [..., T], n_vis [...]."""
    T = score.shape[-1]
    pad = (-T) % block
    s = jnp.pad(score, [(0, 0)] * (score.ndim - 1) + [(0, pad)], constant_values=NEG_INF) if pad else score
    blocks = jnp.max(s.reshape(*s.shape[:-1], -1, block), axis=-1)
    nb = blocks.shape[-1]
    last = jnp.floor_divide(n_vis - 1, block)
    blocks = jnp.where(jnp.arange(nb) == last[..., None], jnp.inf, blocks)
    if topk_blocks >= nb:  # every block is selected (contexts up to topk_blocks * block): no top-k sort
        keep = blocks > NEG_INF
    else:
        keep = top_k_mask(blocks, topk_blocks) & (blocks > NEG_INF)
    return jnp.repeat(keep, block, axis=-1)[..., :T]


class Compressor(nnx.Module):
    """kv-source compressor: ratio 1 = plain projection; ratio 2 = fp32 softmax-gated pooling."""

    def __init__(self, cfg: TextConfig, ratio: int, numerics: Numerics):
        self.ratio = ratio
        self.numerics = numerics
        D, d = cfg.hidden_size, cfg.head_dim
        pd = numerics.dtype  # ratio 2 runs in fp32 on these (bf16-valued) weights
        self.wkv = Linear(D, d, numerics=numerics, param_dtype=pd)
        self.wgate = Linear(D, d, numerics=numerics, param_dtype=pd) if ratio > 1 else None
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=numerics.dtype)

    def __call__(self, x, pos, valid, state):
        """Returns (latent [B,G,d] pre-RoPE, group ids [B,G], complete [B,G], new state)."""
        m = self.ratio
        dt = self.numerics.dtype
        if m == 1:
            lat = self.norm(self.wkv(x))
            return lat, pos, valid, state
        B, S, _ = x.shape
        kv = self.wkv(x, out_dtype=F32, compute_dtype=F32)
        sc = self.wgate(x, out_dtype=F32, compute_dtype=F32)
        d = kv.shape[-1]
        NG = (S + 2 * m - 2) // m
        p0 = pos[:, 0]
        base = p0 // m
        gi = jnp.where(valid, pos // m - base[:, None], NG)
        slot = pos % m
        st_kv, st_sc = state
        tab_kv = jnp.zeros((B, NG, m, d), F32).at[:, 0].set(st_kv)
        tab_sc = jnp.full((B, NG, m, d), NEG_INF, F32).at[:, 0].set(st_sc)
        bi = jnp.arange(B)[:, None]
        tab_kv = tab_kv.at[bi, gi, slot].set(kv, mode="drop")
        tab_sc = tab_sc.at[bi, gi, slot].set(sc, mode="drop")
        last = jnp.max(jnp.where(valid, pos, -1), axis=1)
        gids = base[:, None] + jnp.arange(NG)[None]
        complete = (gids + 1) * m - 1 <= last[:, None]
        w = jax.nn.softmax(jnp.where(complete[..., None, None], tab_sc, 0.0), axis=2)
        pooled = jnp.sum(tab_kv * w, axis=2)
        lat = self.norm(pooled.astype(dt))
        nxt = jnp.clip((last + 1) // m - base, 0, NG - 1)
        any_valid = last >= 0
        new_kv = jnp.where(any_valid[:, None, None], tab_kv[jnp.arange(B), nxt], st_kv)
        new_sc = jnp.where(any_valid[:, None, None], tab_sc[jnp.arange(B), nxt], st_sc)
        return lat, gids, complete, (new_kv, new_sc)


class Indexer(nnx.Module):
    """Lightning indexer of an index-source layer (+ the index-key projection on kv sources)."""

    def __init__(self, cfg: TextConfig, plan: LayerPlan, numerics: Numerics, owns_k: bool, has_query: bool):
        self.numerics = numerics
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        dt = numerics.dtype
        if has_query:
            self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, numerics=numerics)
            self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, numerics=numerics)
        else:
            self.wq_b = self.weights_proj = None
        if owns_k:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, numerics=numerics)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, param_dtype=dt)
        else:
            self.wk = self.k_norm = None

    def keys(self, latent):
        return self.k_norm(self.wk(latent))

    def scores(self, x, qr, pos, index_k, freqs, q_proj=None, n_vis=None):
        """Scores [B,S,T] of the chunk's queries against ``index_k``: raw, or with ``n_vis`` [B,S]
        the keys ``t >= n_vis`` masked to -inf. ``q_proj``: ``wq_b(qr)`` when the caller computed
        it already (a fused launch). The math is ``kernels.indexer_scores``': its kernel (no
        per-head score tensor; needs ``n_vis``) where ``scores_on_kernel`` says, else XLA."""
        from dsv41_jax.kernels import indexer_scores

        dt = self.numerics.dtype
        B, S, _ = x.shape
        q = (self.wq_b(qr) if q_proj is None else q_proj).reshape(B, S, self.n_heads, self.head_dim)
        q = rope_tail(q, pos[..., None], freqs)
        if self.numerics.fake_quant:
            q = quant.fq_fp4_e8(q, 32)
        w = (self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)).astype(dt)
        kernel = n_vis is not None and scores_on_kernel(S)
        if n_vis is None:
            n_vis = jnp.full((B, S), index_k.shape[1], jnp.int32)
        return indexer_scores(q.astype(dt), index_k, w, n_vis, impl="auto" if kernel else "xla")


def scores_on_kernel(S: int) -> bool:
    """Whether a chunk of ``S`` queries scores through the indexer kernel: where
    ``kernels.use_pallas`` says (by default on Hopper-class GPUs), for prefill chunks (S >= 8;
    single-token decode keeps XLA's small fusions), and not under a mesh whose partitioner would
    have to gather the kernel's operands (``kernels.auto_split``). ``DSV41_INDEXER_KERNEL=0``
    keeps XLA (A/B runs); read at trace time."""
    from dsv41_jax.kernels import auto_split, env_switch, use_pallas

    on = env_switch("DSV41_INDEXER_KERNEL", on="the kernel where it applies")
    return on and S >= 8 and use_pallas() and not auto_split()


# a chunk's indexer scores are formed in one kernel call when they take at most this many bytes
# (8192 queries x 8192 keys in bf16: 128 MiB); larger chunks score per query block
WHOLE_SCORES_BYTES = 1 << 30


def topk_whole_chunk() -> bool:
    """Whether whole-chunk scores are also selected in one top-k launch where the selection
    kernel takes them (``DSV41_TOPK_WHOLE_CHUNK``: 1, the default; 0 = one launch per query block
    inside a loop, as before session 33, for A/B runs). The same indices either way; read at
    trace time."""
    from dsv41_jax.kernels import env_switch

    return env_switch("DSV41_TOPK_WHOLE_CHUNK", on="one launch; 0: per query block")


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, plan: LayerPlan, numerics: Numerics):
        self.cfg_rope_dim = cfg.qk_rope_head_dim
        self.plan = plan
        self.numerics = numerics
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.n_groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.sliding_window
        self.index_topk = cfg.index_topk
        self.cand_blocks, self.cand_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.q_block = 256  # query block of long prefill chunks (attention and indexer), >= window
        self.freqs = tuple(float(f) for f in layer_inv_freq(cfg, plan.ratio))
        D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        dt = numerics.dtype
        self.attn_sink = nnx.Param(jnp.zeros((H,), F32))
        self.wq_a = Linear(D, cfg.q_lora_rank, numerics=numerics)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, param_dtype=dt)
        self.wq_b = Linear(cfg.q_lora_rank, H * d, numerics=numerics)
        self.wkv = Linear(D, d, numerics=numerics)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=dt)
        self.wo_a = Linear(H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, numerics=numerics)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, numerics=numerics)
        self.compressor = Compressor(cfg, plan.ratio, numerics) if plan.owns_compressor else None
        if plan.owns_compressor or plan.owns_indexer:
            self.indexer = Indexer(cfg, plan, numerics, owns_k=plan.owns_compressor, has_query=plan.owns_indexer)
        else:
            self.indexer = None

    # ------------------------------------------------------------------ pieces
    def _freqs(self):
        return jnp.asarray(self.freqs, F32)

    def _publish_compressed(self, x, pos, valid, cache, ctx, capture):
        """kv source: compress this chunk, write entries and index keys, publish them in ctx."""
        m = self.plan.ratio
        freqs = self._freqs()
        state = (cache["st_kv"], cache["st_score"]) if m > 1 else None
        lat, gids, ok, state = self.compressor(x, pos, valid, state)
        T = cache["cmp_kv"].shape[1]
        widx = jnp.where(ok, gids, T)
        gpos = gids * m
        k = self.indexer.keys(lat)
        k = rope_tail(k, gpos, freqs)
        if self.numerics.fake_quant:
            k = quant.fq_fp4_e8(k, 32)
        ent = rope_tail(lat, gpos, freqs)
        if self.numerics.fake_quant:
            ent = quant.fq_fp4_e4(ent, 16)
        cache = dict(cache)
        cache["cmp_kv"] = _scatter_rows(cache["cmp_kv"], widx, ent)
        cache["idx_k"] = _scatter_rows(cache["idx_k"], widx, k)
        if m > 1:
            cache["st_kv"], cache["st_score"] = state
        ctx = dict(ctx, cmp_kv=cache["cmp_kv"], idx_k=cache["idx_k"])
        if capture is not None:
            capture["compress_kv"] = cache["cmp_kv"]
            capture["index_k"] = cache["idx_k"]
        return cache, ctx

    def _select(self, x, qr, pos, ctx, capture, iq=None):
        """index source: score, candidate filter, top-k; publishes topk (and candidates).
        ``iq``: the indexer's query projection ``indexer.wq_b(qr)`` if already computed.

        Long chunks run in query blocks of ``q_block`` (as ``_attend``): the per-head indexer
        scores [B, bq, heads, T] of one block exist at a time instead of [B, S, heads, T]."""
        m = self.plan.ratio
        idx_k = ctx["idx_k"]
        T = idx_k.shape[1]
        k = min(self.index_topk, T)
        freqs = self._freqs()
        src, use = self.plan.is_candidate_source, self.plan.uses_candidates

        def one(xb, qrb, pb, cand_in, iqb, sb=None):
            n_vis = (pb + 1) // m
            s = self.indexer.scores(xb, qrb, pb, idx_k, freqs, q_proj=iqb, n_vis=n_vis) if sb is None else sb
            cand = None
            if src:
                cand = select_candidate_blocks(s, n_vis, self.cand_blocks, self.cand_block_size)
            elif use:
                s = jnp.where(cand_in, s, NEG_INF)
            idx = top_k_indices_ascending(s, k)
            idx = jnp.where(idx < n_vis[..., None], idx, -1).astype(jnp.int32)
            return idx, cand

        B, S = pos.shape
        bq = query_block(S, self.q_block, self.window)
        cand_in = ctx.get("cand") if use else None
        if capture is not None or not bq:
            idx, cand = one(x, qr, pos, cand_in, iq)
        else:
            # on the kernel path the whole chunk's [S, T] scores come from one launch (a full GPU)
            # where they fit; the query blocks then only bound the top-k's working set
            whole = None
            if scores_on_kernel(S) and B * S * T * jnp.dtype(self.numerics.dtype).itemsize <= WHOLE_SCORES_BYTES:
                whole = self.indexer.scores(x, qr, pos, idx_k, freqs, q_proj=iq, n_vis=(pos + 1) // m)

            def body(i):
                sl = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(a, i * bq, bq, axis=1)  # noqa: E731
                return one(sl(x), sl(qr), sl(pos), sl(cand_in), sl(iq), sl(whole))

            if whole is not None and topk_route(B * S, T, k)[1] == "select" and topk_whole_chunk():
                # the selection kernel takes every row in one launch: no loop of S / bq small
                # launches (with their slices and updates: ~130 kernels per 8k chunk)
                idx, cand = one(x, qr, pos, cand_in, iq, whole)
            else:
                idx, cand = jax.lax.map(body, jnp.arange(S // bq))
                merge = lambda a: None if a is None else jnp.moveaxis(a, 0, 1).reshape(B, S, *a.shape[3:])  # noqa: E731
                idx, cand = merge(idx), merge(cand)
        ctx = dict(ctx)
        if src:
            ctx["cand"] = cand
            if capture is not None:
                capture["candidates"] = cand
        ctx["topk"] = idx
        if capture is not None:
            capture["topk_idxs"] = idx
        return ctx

    def _sparse_attn(self, q, kw, kw_ok, kc, kc_ok):
        """Softmax over window keys + selected compressed entries (``sparse_attn``). Decode steps
        take ``kernels.sparse_attn`` where ``DSV41_ATTN_KERNEL`` turns it on (off by default:
        not yet measured on the GPU)."""
        from dsv41_jax.kernels import kernel_switch
        from dsv41_jax.kernels.sparse_attn import MAX_TOKENS, sparse_attn_decode

        dt = self.numerics.dtype
        scale = self.head_dim ** -0.5
        B, S, H, d = q.shape
        impl = kernel_switch("DSV41_ATTN_KERNEL", default="0")
        if impl is not None and dt == jnp.bfloat16 and B * S <= MAX_TOKENS:
            T = B * S
            o = sparse_attn_decode(q.reshape(T, H, d).astype(dt), kw, kw_ok.reshape(T, -1),
                                   None if kc is None else kc.reshape(T, -1, d),
                                   None if kc is None else kc_ok.reshape(T, -1), self.attn_sink[...], scale, impl=impl)
            return o.reshape(B, S, H, d)
        return sparse_attn(q, kw, kw_ok, kc, kc_ok, self.attn_sink[...], scale, dt)

    def _attend_kernel(self, q, pos, kw, kpos, cmp_kv, idx, block: int):
        """A whole chunk through ``kernels.attn_prefill`` (the entries gathered inside the kernel,
        no query-block loop): in bf16, for chunks of more than ``MIN_TOKENS`` tokens per row
        (prefill; decode steps keep XLA's form), where ``DSV41_ATTN_PREFILL_KERNEL`` (read at trace
        time; default on where the Pallas kernels run, ``kernels.kernel_switch``) selects it; else
        None (XLA's form below). Run 26: 6.5 vs 10.2 ms per compressed layer at 8k tokens; run 28:
        ~5.6 ms, 3.6 with ``Numerics.text_attention`` "online"."""
        from dsv41_jax.kernels import kernel_switch
        from dsv41_jax.kernels.attn_prefill import DEFAULT, MIN_TOKENS, applies, sparse_attn_prefill

        dt = self.numerics.dtype
        impl = kernel_switch("DSV41_ATTN_PREFILL_KERNEL", default=DEFAULT)
        if impl is None or dt != jnp.bfloat16 or pos.shape[1] <= MIN_TOKENS or not applies(self.head_dim):
            return None
        online = {"online": True} if self.numerics.text_attention == "online" else {}  # (else the tiles' choice)
        return sparse_attn_prefill(q.astype(dt), pos, kw.astype(dt), kpos, cmp_kv, idx, self.attn_sink[...],
                                   self.head_dim ** -0.5, window=self.window, block=block, impl=impl, **online)

    def _attend(self, q, pos, kw, kpos, cmp_kv, idx):
        """Attention of the chunk's queries. Long chunks run in query blocks: block i only sees
        the keys slice [i*bq, i*bq + W + bq) of (ring ++ chunk) and its own selected entries, so
        memory stays O(S * (W + bq + k)) instead of O(S^2)."""
        B, S = pos.shape
        W = self.window
        block = query_block(S, self.q_block, W)
        o = self._attend_kernel(q, pos, kw, kpos, cmp_kv, idx, block)
        if o is not None:
            return o

        def one(qb, pb, kwb, kpb, idxb):
            qi = pb[:, :, None]
            ok = (kpb[:, None, :] >= 0) & (kpb[:, None, :] <= qi) & (kpb[:, None, :] > qi - W)
            kc = kc_ok = None
            if idxb is not None:
                kc = jax.vmap(lambda c, i: c[i])(cmp_kv, jnp.maximum(idxb, 0))
                kc_ok = idxb >= 0
            return self._sparse_attn(qb, kwb, ok, kc, kc_ok)

        if not block:
            return one(q, pos, kw, kpos, idx)
        nb = S // block

        def body(i):
            q0 = i * block
            sl = lambda a, n, ax=1: jax.lax.dynamic_slice_in_dim(a, q0, n, axis=ax)  # noqa: E731
            return one(sl(q, block), sl(pos, block), sl(kw, W + block), sl(kpos, W + block),
                       None if idx is None else sl(idx, block))

        o = jax.lax.map(body, jnp.arange(nb))  # [nb, B, bq, H, d]
        return jnp.moveaxis(o, 0, 1).reshape(B, S, *o.shape[3:])

    def _grouped_out(self, o):
        """Grouped low-rank output projection: o [B, S, G, H*d/G] -> [B, S, G, o_rank] (fp32
        accumulation, one rounding). An fp8-stored ``wo_a`` on the kernel path with few tokens
        (decode) goes through ``grouped_qmatmul`` with one row block per group (the codes are read
        in place); otherwise the weight is dequantized exactly and one einsum runs."""
        from dsv41_jax.model.layers import _use_kernel

        dt = self.numerics.dtype
        B, S, G, K = o.shape
        T = B * S
        if self.wo_a.fp8 and T <= 64 and _use_kernel():
            from dsv41_jax.kernels import grouped_qmatmul

            xg = jnp.swapaxes(o.reshape(T, G, K), 0, 1).reshape(G * T, K)  # block g = group g's rows
            y = grouped_qmatmul(xg, jnp.arange(G, dtype=jnp.int32), G,
                                self.wo_a.weight[...].reshape(G, self.o_rank, K),
                                self.wo_a.scale[...].reshape(G, self.o_rank, K // 32), bm=T, out_dtype=dt)
            return jnp.swapaxes(y.reshape(G, T, self.o_rank), 0, 1).reshape(B, S, G, self.o_rank)
        wo_a = self.wo_a.values().reshape(G, self.o_rank, -1)  # fp8 storage: dequantized exactly
        return einsum_rounded("bsgd,grd->bsgr", o.astype(dt), wo_a.astype(dt), dt)

    def wants_xq(self) -> bool:
        """Whether the input projections take an fp8-quantized input (``Linear``'s ``xq``)."""
        return self.numerics.fake_quant and (self.wq_a.quantized or self.wkv.quantized)

    # ------------------------------------------------------------------ forward
    def __call__(self, x, pos, valid, cache, ctx, capture=None, xq=None):
        """x [B,S,D] (normed), pos [B,S] int32 absolute positions, valid [B,S] bool; ``xq``: the
        fp8 activation quantization of ``x`` if the caller formed it (``RMSNorm.with_quant``).

        Returns (out [B,S,D], new layer cache, new ctx)."""
        dt = self.numerics.dtype
        B, S, _ = x.shape
        H, d = self.n_heads, self.head_dim
        freqs = self._freqs()
        qa, kv = fused_linears(x, (self.wq_a, self.wkv), xq=xq)  # one launch on the decode kernel path
        iq = None  # the indexer's query projection reads qr too: one launch with wq_b where that fuses
        idx_q = self.plan.ratio > 0 and self.plan.owns_indexer
        qmods = (self.wq_b, self.indexer.wq_b) if idx_q else (self.wq_b,)
        qr, qrq = self.q_norm.with_quant(qa, self.numerics.fake_quant and any(m.quantized for m in qmods))
        fused_q = idx_q and fusable_linears(qr, qmods)
        if fused_q:
            q, iq = fused_linears(qr, qmods, xq=qrq)
        else:
            q = self.wq_b(qr, xq=qrq)
        q = q.reshape(B, S, H, d)
        q = rope_tail(q, pos[..., None], freqs, in_place=rope_in_place("q") and not fused_q and S > 1)
        kv = self.kv_norm(kv)
        kv = rope_tail(kv, pos, freqs)
        if self.numerics.fake_quant:
            kv = quant.fq_fp8(kv, 32)

        # window keys: the ring (positions before this chunk) followed by this chunk. A one-token
        # step whose ring stores kv's own dtype writes the ring first and attends over the ring
        # alone: the same keys unmasked (the slot it overwrites, position pos - W, is outside the
        # window), without two concatenations per layer (~2 us each in the batch-1 profile)
        cpos = jnp.where(valid, pos, -1)
        cache = dict(cache)
        ring_first = S == 1 and cache["win_kv"].dtype == kv.dtype
        if ring_first:
            cache["win_kv"], cache["win_pos"] = self._ring_update(cache, pos, valid, cpos, kv)
            kw, kpos = cache["win_kv"].astype(dt), cache["win_pos"]
        else:
            kw = jnp.concatenate([cache["win_kv"].astype(dt), kv], axis=1)
            kpos = jnp.concatenate([cache["win_pos"], cpos], axis=1)

        kc = kc_ok = None
        if self.plan.ratio > 0:
            if self.plan.owns_compressor:
                cache, ctx = self._publish_compressed(x, pos, valid, cache, ctx, capture)
            if self.plan.owns_indexer:
                ctx = self._select(x, qr, pos, ctx, capture, iq)
            kc, kc_ok = ctx["cmp_kv"], ctx["topk"]
        o = self._attend(q, pos, kw, kpos, kc, kc_ok)
        o = rope_tail(o, pos[..., None], freqs, inverse=True, in_place=rope_in_place("out"))
        o = self._grouped_out(o.reshape(B, S, self.n_groups, -1).astype(dt))
        out = self.wo_b(o.reshape(B, S, self.n_groups * self.o_rank))

        if not ring_first:
            cache["win_kv"], cache["win_pos"] = self._ring_update(cache, pos, valid, cpos, kv)
        return out, cache, ctx

    def _ring_update(self, cache, pos, valid, cpos, kv):
        """The window ring after this chunk: its last W valid tokens, slot = pos mod W."""
        W = self.window
        last = jnp.max(cpos, axis=1)
        keep = valid & (pos > last[:, None] - W)
        slot = jnp.where(keep, pos % W, W)
        return _scatter_rows(cache["win_kv"], slot, kv), _scatter_rows(cache["win_pos"], slot, pos)
