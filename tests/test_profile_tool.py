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


def test_dumped_sources_read_an_xla_dump(tmp_path):
    """The ViT target's attribution: instruction -> source from the modules XLA dumps (a child
    process, since the dump flag must be set before the backend starts)."""
    import json
    import subprocess
    import sys

    code = (
        "import sys, json, importlib.util, jax, jax.numpy as jnp\n"
        f"spec = importlib.util.spec_from_file_location('p', {os.path.join(ROOT, 'benchmarks', 'profile_step.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "def g(x):\n"
        "    return jnp.cos(x) + 1.0\n"
        "jax.jit(g)(jnp.ones((4, 4))).block_until_ready()\n"
        f"print(json.dumps(m.dumped_sources({str(tmp_path)!r})))\n")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    src = json.loads(out.stdout.strip().splitlines()[-1])
    assert any(v.startswith("<string>:5") for v in src.values()), src
