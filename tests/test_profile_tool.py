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


def test_timeline_lists_one_step_in_launch_order(monkeypatch):
    """``--analyze DIR --timeline``: one step's kernels by start time, with durations, the idle gap
    before each (the first one's from the previous step's last kernel: the idle time between the
    iterations of a decode loop) and the source line of its fusion (``loop_add_fusion_3`` is HLO
    ``loop_add_fusion.3``); the trace side is replaced by synthetic events (no GPU here)."""
    tool = _tool()
    hlo = ('%loop_add_fusion.3 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%c, '
           'metadata={op_name="jit(f)/add" source_file="/x/model.py" source_line=12}\n')
    # two steps of two kernels each, given out of order; times in ns
    evs = [("loop_add_fusion_3", "", 5000.0, 1000.0), ("gemv", "", 0.0, 3000.0),
           ("loop_add_fusion_3", "", 25000.0, 2000.0), ("gemv", "", 20000.0, 4000.0)]
    monkeypatch.setattr(tool, "kernel_events", lambda path: (evs, {}))
    rows = tool.timeline("unused.xplane.pb", hlo, steps=2, step=1)
    assert rows[0].split()[:4] == ["start", "dur", "gap", "kernel"]
    first, second = rows[1].split(), rows[2].split()
    # its gap: from the end of the previous step's last kernel (6 us) to its start (20 us)
    assert first[:4] == ["0.00", "4.00", "14.00", "gemv"]
    assert tool.timeline("unused.xplane.pb", hlo, steps=2, step=0)[1].split()[2] == "0.00"  # no step before
    # starts 5 us after the step's first kernel, 1 us after the GEMV ended, 2 us long
    assert second[:4] == ["5.00", "2.00", "1.00", "loop_add_fusion_3"]
    assert "model.py:12 [add]" in rows[2]
    assert tool.timeline("unused.xplane.pb", hlo, steps=2)[1].split()[1] == "4.00"  # default: the middle step
