"""Torch oracle of the V4.1 vision tower + aligner, written from docs/vision_spec.md.

Plain torch, CPU; ``torch_tower(params, patches, grid, cfg, dtype)`` runs one image (original
checkpoint names in ``params``) and returns (vit_out, aligner_rows) as float32 numpy.
"""
from __future__ import annotations

import numpy as np

from dsv41_jax.config import VisionConfig


def torch_tower(params, patches, grid, cfg: VisionConfig, dtype):
    """Plain-torch restatement of the V4.1 tower for one image (written from the spec)."""
    import torch
    import torch.nn.functional as F

    t = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(dtype)  # noqa: E731
    tf = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731

    def norm(x, w):
        x32 = x.float()
        return (w * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + cfg.rms_norm_eps))).to(x.dtype)

    def rot(x, cos, sin):
        a, b = x.float().chunk(2, -1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(x.dtype)

    n_h, n_w = grid
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    rd = hd // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    pos = torch.stack(torch.meshgrid(torch.arange(n_h), torch.arange(n_w), indexing="ij"), -1).reshape(-1, 2, 1)
    ang = (pos.float() * inv).flatten(1)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x = F.linear(torch.from_numpy(patches.astype(np.float32)).to(dtype).flatten(1),
                 t(params["vision.patch_embed.proj.weight"]), t(params["vision.patch_embed.proj.bias"]))
    n = x.shape[0]
    for j in range(cfg.num_hidden_layers):
        pre = f"vision.blocks.{j}."
        h = norm(x, tf(params[pre + "norm1.weight"]))
        q, k, v = (u.view(n, heads, hd) for u in F.linear(h, t(params[pre + "attn.wqkv.weight"]),
                                                         t(params[pre + "attn.wqkv.bias"])).chunk(3, -1))
        q, k = rot(q, cos, sin), rot(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
        x = x + F.linear(o.reshape(n, -1), t(params[pre + "attn.wo.weight"]), t(params[pre + "attn.wo.bias"]))
        g, u = F.linear(norm(x, tf(params[pre + "norm2.weight"])), t(params[pre + "mlp.w1.weight"])).chunk(2, -1)
        x = x + F.linear(F.silu(g) * u, t(params[pre + "mlp.w2.weight"]))
    vit = norm(x, tf(params["vision.norm.weight"]))
    r = cfg.downsample_ratio
    y = F.pad(vit.view(n_h, n_w, -1).permute(2, 0, 1), (0, -n_w % r, 0, -n_h % r))
    y = F.unfold(y.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
    rows = F.linear(F.gelu(F.linear(y, t(params["aligner.w1.weight"]), t(params["aligner.w1.bias"]))),
                    t(params["aligner.w2.weight"]), t(params["aligner.w2.bias"]))
    return vit.float().numpy(), rows.float().numpy()
