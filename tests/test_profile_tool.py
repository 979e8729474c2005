"""benchmarks/profile_step.py attributes GPU kernels to Python source lines through the optimized
HLO's metadata; here its HLO side is checked on CPU: every instruction of a compiled function
maps to the line that produced it (the GPU trace side needs a GPU)."""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("profile_step", os.path.join(ROOT, "benchmarks", "profile_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _f(x):
    y = jnp.sin(x) * 3.0
    return jnp.sum(y * y, axis=-1)


def test_hlo_sources_map_instructions_to_lines():
    tool = _tool()
    text = jax.jit(_f).lower(jnp.ones((8, 16), jnp.float32)).compile().as_text()
    src = tool.hlo_sources(text)
    assert src, "no instruction with metadata found"
    here = os.path.basename(__file__)
    first = _f.__code__.co_firstlineno
    lines = {v.split()[0] for v in src.values() if v.startswith(here)}
    # the sin / multiply line and the reduction line of _f both appear
    assert f"{here}:{first + 1}" in lines and f"{here}:{first + 2}" in lines, lines
    assert all(not v.startswith("?") for v in src.values() if "sine" in v or "[sin]" in v)
