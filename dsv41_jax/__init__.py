"""dsv41_jax: DeepSeek-V4.1 (vision-language) in JAX / Flax NNX.

Quick start::

    import dsv41_jax
    m = dsv41_jax.load("path/to/checkpoint")          # Orbax (converted) or original DeepSeek dir
    print(m.generate("Describe <｜deepseek_image｜>", images=["cat.png"], max_new_tokens=32).text[0])
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# bf16 parity: XLA may keep intermediate values in fp32 where the program rounds them to bf16
# ("excess precision"); the official code rounds at every such point, so we ask XLA not to.
# Takes effect when set before JAX initialises its backend. Opt out with
# DSV41_ALLOW_EXCESS_PRECISION=1 (slightly faster bf16 on some backends).
if _os.environ.get("DSV41_ALLOW_EXCESS_PRECISION", "0") != "1":
    _flags = _os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in _flags:
        _os.environ["XLA_FLAGS"] = (_flags + " --xla_allow_excess_precision=false").strip()


def load(path, *, mesh=None, dtype="bfloat16", numerics="reference", text_only=False, experts_int8=False,
         dense_fp8=False, **kw):
    """Load a model for generation: an Orbax checkpoint made by ``dsv41-jax convert`` or an
    original-format DeepSeek checkpoint directory. See :class:`dsv41_jax.api.DeepseekVL`."""
    from dsv41_jax.api import load as _load

    return _load(path, mesh=mesh, dtype=dtype, numerics=numerics, text_only=text_only, experts_int8=experts_int8,
                 dense_fp8=dense_fp8, **kw)
