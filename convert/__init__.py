"""Converter from the original DeepSeek-V4.1 safetensors checkpoint to the dsv41_jax Orbax format.

``python -m convert SRC DST`` or ``convert_checkpoint(src, dst, ...)``; ``python -m convert info DST``.
See docs/convert.md. Attributes are imported lazily so that ``python -m convert`` can pin JAX to
the CPU before JAX is imported.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "convert_checkpoint": "convert.convert", "ConvertError": "convert.convert", "Source": "convert.convert",
    "build_plan": "convert.convert", "scan_nonfinite": "convert.convert",
    "restore_model": "dsv41_jax.checkpoint", "save_model": "dsv41_jax.checkpoint", "info": "dsv41_jax.checkpoint",
    "format_info": "dsv41_jax.checkpoint", "CheckpointError": "dsv41_jax.checkpoint",
}

__all__ = sorted(_EXPORTS) + ["main"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "convert":
        return importlib.import_module("convert.convert")
    raise AttributeError(f"module 'convert' has no attribute {name!r}")


def main(argv=None) -> int:
    """The ``convert`` command line (``dsv41-jax convert`` / ``dsv41-jax info`` can call this)."""
    from convert.__main__ import main as _main

    return _main(argv)
