"""Test-session setup: one fresh persistent XLA compilation cache per test run.

``dsv41_jax.load`` turns on the persistent cache (``~/.cache/dsv41_jax/xla`` by default). Under
pytest that would write into the user's home and, worse, make a second local run much faster
than a clean CI machine (every compile a cache hit). The controlling pytest process makes one
empty directory per run and exports it as ``DSV41_COMPILATION_CACHE``, so the xdist workers and
the subprocesses some tests start (8-device children, notebooks, the CLI) share it: a program
compiled by two tests of the run compiles once, and nothing outside the run is reused. Set
``DSV41_COMPILATION_CACHE`` yourself to choose the directory (``0`` turns the cache off).

Where no CUDA / ROCm plugin is installed (CI: CPU only), XLA's LLVM backend runs at optimization
level 0 for the tests: the test models are tiny, so compiling is most of the suite's time. On
the 2-core development machine a clean-cache run took 16 min 49 s at O0 and 20 min 6 s at the
default level (session 6); every test passes either way. Users' programs and GPU runs keep the
default. An ``XLA_FLAGS`` that already names ``--xla_backend_optimization_level`` is left alone."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest

_ENV = "DSV41_COMPILATION_CACHE"
_MADE: list[str] = []


def _cpu_only() -> bool:
    return not any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin"))


def pytest_configure(config):
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags and _cpu_only():  # read when the backend starts
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
    if not hasattr(config, "workerinput") and _ENV not in os.environ:  # the controlling process
        d = tempfile.mkdtemp(prefix="dsv41_test_xla_")
        _MADE.append(d)
        os.environ[_ENV] = d  # inherited by the xdist workers and every subprocess
    d = os.environ.get(_ENV)
    if d and d != "0":
        import jax

        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config):
    for d in _MADE:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def triton_modules(monkeypatch):
    """``[(kernel name, Triton module text)]`` of every Pallas Triton launch lowered while the test
    runs (captured as Pallas lowers them: the custom call holds only their bytecode)."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    modules = []
    real = reg.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, *a, **k):
        res = real(jaxpr, grid_mapping, *a, **k)
        modules.append((jaxpr.debug_info.func_name, res.module.operation.get_asm()))
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", capture)
    return modules
