"""One V4.1 block: (Engram) -> mHC attention site -> mHC FFN site, with the delayed pre-mix."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import LayerPlan, TextConfig
from dsv41_jax.model.attention import Attention
from dsv41_jax.model.engram import Engram
from dsv41_jax.model.layers import RMSNorm
from dsv41_jax.model.mhc import hc_post, hc_post_site, hc_site
from dsv41_jax.model.moe import MoE
from dsv41_jax.numerics import Numerics

F32 = jnp.float32


class Block(nnx.Module):
    def __init__(self, cfg: TextConfig, plan: LayerPlan, numerics: Numerics, *, vision: bool = False,
                 engram_quantized: bool = False, experts_int8: bool = False):
        self.plan = plan
        self.numerics = numerics
        n, D = cfg.hc_mult, cfg.hidden_size
        self.hc = (n, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps, cfg.hc_eps)
        mix = cfg.hc_mix
        self.hc_attn_fn = nnx.Param(jnp.zeros((mix, n * D), F32))
        self.hc_attn_base = nnx.Param(jnp.zeros((mix,), F32))
        self.hc_attn_scale = nnx.Param(jnp.ones((3,), F32))
        self.hc_ffn_fn = nnx.Param(jnp.zeros((mix, n * D), F32))
        self.hc_ffn_base = nnx.Param(jnp.zeros((mix,), F32))
        self.hc_ffn_scale = nnx.Param(jnp.ones((3,), F32))
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps, param_dtype=numerics.dtype)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps, param_dtype=numerics.dtype)
        self.attn = Attention(cfg, plan, numerics)
        self.ffn = MoE(cfg, numerics, vision, experts_int8)
        self.engram = (Engram(cfg, cfg.engram_num_embeddings[plan.engram_slot], numerics, engram_quantized)
                       if plan.has_engram else None)

    def _hc(self):
        n, iters, norm_eps, hc_eps = self.hc
        return dict(hc_mult=n, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps)

    def __call__(self, h, pre_in, pos, valid, cache, ctx, *, image_mask=None, engram_hashes=None,
                 engram_mask=None, capture=None):
        """h [B,S,n,D] stream entering the layer (before Engram); pre_in [B,S,n] fp32.

        Returns (h_out, pre_out, cache, ctx)."""
        if self.engram is not None:
            h = self.engram(h, engram_hashes, engram_mask)
            if capture is not None:
                capture["engram_out"] = h
        # the site's mixes, and the collapse + norm (+ the fp8 activation quantization its GEMMs
        # need) of the stream with the previous site's pre-mix: two launches per site in decode
        (pre_a, post_a, comb_a), (x, xq) = hc_site(h, self.hc_attn_fn[...], self.hc_attn_scale[...],
                                                   self.hc_attn_base[...], pre_in, self.attn_norm,
                                                   self.attn.wants_xq(), **self._hc())
        a, cache, ctx = self.attn(x, pos, valid, cache, ctx, capture, xq=xq)
        # the expansion after attention and the FFN site's inputs (one pass over the stream on
        # prefill chunks with DSV41_MHC_SITE)
        h, (pre_f, post_f, comb_f), (x, xq) = hc_post_site(a, h, post_a, comb_a, self.hc_ffn_fn[...],
                                                           self.hc_ffn_scale[...], self.hc_ffn_base[...], pre_a,
                                                           self.ffn_norm, self.ffn.wants_xq(), **self._hc())
        f = self.ffn(x, image_mask, capture, xq=xq)
        h = hc_post(f, h, post_f, comb_f)
        return h, pre_f, cache, ctx
