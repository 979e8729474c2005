"""Numerics modes.

``fast``: every fake-quant (QDQ) point is the identity and no activation is quantized before a
GEMM. ``reference``: the official code's QAT points (fp8 window KV, fp4 compressed KV, fp4
indexer q/k) and, for weights stored fp8/fp4 in the checkpoint, the fp8 per-32 activation
quantization before the GEMM.

``vision_attention`` selects the ViT's attention/GEMM path (docs/vision.md): ``"fp32"`` (default,
the parity path: q, k, v upcast to fp32 as the reference's math SDPA) or ``"bf16"`` (performance
mode: bf16 q/k/v into ``jax.nn.dot_product_attention`` with fp32 softmax and accumulation, cuDNN
flash attention on NVIDIA GPUs, and bf16-output GEMMs). The text model ignores it.

``text_attention`` selects the decoder's prefill attention kernel on the GPU
(``kernels.attn_prefill``; docs/kernels.md): ``"exact"`` (default: the probabilities rounded to
bf16 against each row's maximum, as the reference does; two launches) or ``"online"``
(performance mode: one launch with a running maximum, so p is rounded against the maximum so far:
~30% less attention time, outputs within a few bf16 ulps). Paths without that kernel (CPU, decode
steps, fp32) ignore it.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

VISION_ATTENTION = ("fp32", "bf16")
TEXT_ATTENTION = ("exact", "online")
_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Numerics:
    compute_dtype: str = "bfloat16"  # activation dtype between ops ("float32" or "bfloat16")
    mode: str = "reference"  # "reference" or "fast"
    vision_attention: str = "fp32"  # ViT path: "fp32" (parity) or "bf16" (performance mode)
    text_attention: str = "exact"  # prefill attention kernel: "exact" (the reference's roundings) or "online"

    def __post_init__(self):
        if self.compute_dtype not in _DTYPES:
            raise ValueError(f"numerics: compute_dtype {self.compute_dtype!r} not in {sorted(_DTYPES)}")
        if self.mode not in ("reference", "fast"):
            raise ValueError(f"numerics: mode {self.mode!r} must be 'reference' or 'fast'")
        if self.vision_attention not in VISION_ATTENTION:
            raise ValueError(f"numerics: vision_attention {self.vision_attention!r} must be one of {VISION_ATTENTION}")
        if self.text_attention not in TEXT_ATTENTION:
            raise ValueError(f"numerics: text_attention {self.text_attention!r} must be one of {TEXT_ATTENTION}")

    @property
    def dtype(self):
        return _DTYPES[self.compute_dtype]

    @property
    def fake_quant(self) -> bool:
        return self.mode == "reference"


FAST_F32 = Numerics("float32", "fast")
REFERENCE_F32 = Numerics("float32", "reference")
REFERENCE_BF16 = Numerics("bfloat16", "reference")
