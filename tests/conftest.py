"""Test-session setup: one fresh persistent XLA compilation cache per test run.

``dsv41_jax.load`` turns on the persistent cache (``~/.cache/dsv41_jax/xla`` by default). Under
pytest that would write into the user's home and, worse, make a second local run much faster
than a clean CI machine (every compile a cache hit). The controlling pytest process makes one
empty directory per run and exports it as ``DSV41_COMPILATION_CACHE``, so the xdist workers and
the subprocesses some tests start (8-device children, notebooks, the CLI) share it: a program
compiled by two tests of the run compiles once, and nothing outside the run is reused. Set
``DSV41_COMPILATION_CACHE`` yourself to choose the directory (``0`` turns the cache off)."""
from __future__ import annotations

import os
import shutil
import tempfile

_ENV = "DSV41_COMPILATION_CACHE"
_MADE: list[str] = []


def pytest_configure(config):
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
