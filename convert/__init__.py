"""Converter from the original DeepSeek-V4.1 safetensors checkpoint to the dsv41_jax Orbax format.

``python -m convert SRC DST`` or ``convert_checkpoint(src, dst, ...)``; ``python -m convert info DST``.
See docs/convert.md.
"""
from convert.convert import ConvertError, Source, build_plan, convert_checkpoint, scan_nonfinite
from dsv41_jax.checkpoint import CheckpointError, format_info, info, restore_model, save_model

__all__ = ["ConvertError", "CheckpointError", "Source", "build_plan", "convert_checkpoint", "scan_nonfinite",
           "info", "format_info", "restore_model", "save_model", "main"]


def main(argv=None) -> int:
    from convert.__main__ import main as _main

    return _main(argv)
