"""``python -m convert SRC DST [options]`` and ``python -m convert info DST``."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _convert_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert an original DeepSeek-V4.1 checkpoint (config.json, tokenizer files, safetensors "
                    "index + shards) into a dsv41_jax Orbax checkpoint. 'python -m convert info DST' prints "
                    "a converted checkpoint's summary.")
    ap.add_argument("src", help="original checkpoint directory")
    ap.add_argument("dst", help="output directory (written as DST.partial, renamed to DST when complete)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "float32"],
                    help="dtype of dequantized and dense weights (F32 source tensors always stay float32); default bf16")
    ap.add_argument("--experts", default=None, choices=["bf16", "float32", "int8"],
                    help="routed experts: dequantized (bf16/float32) or int8 codes (2 x fp4 value, lossless) + "
                         "ue8m0 scales; default: --dtype")
    ap.add_argument("--dense", default="dequantized", choices=["dequantized", "fp8"],
                    help="fp8 Linear weights: dequantized (in --dtype, default) or kept as e4m3 codes + ue8m0 scales "
                         "(lossless; load with dense_fp8=True / --dense-fp8)")
    ap.add_argument("--max-memory", default="4GB", help="host memory budget, e.g. 8GB (default 4GB)")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted conversion in DST.partial")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists (once the new one is complete)")
    ap.add_argument("--text-only", action="store_true", help="drop the vision tower, aligner and image vectors")
    ap.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                    help="skip the NaN/Inf scan of the source before writing (values are still checked while writing)")
    ap.add_argument("--compress", action="store_true", help="zstd-compress the zarr chunks (slower)")
    ap.add_argument("--max-groups", type=int, default=None,
                    help="stop after writing this many groups (continue later with --resume)")
    ap.add_argument("--dry-run", action="store_true", help="validate the source (and the NaN scan) without writing")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    ap.add_argument("--report", default=None, help="also write the conversion report (JSON) to this file")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # conversion never needs an accelerator
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if argv and argv[0] == "info":
        ap = argparse.ArgumentParser(prog="python -m convert info", description="Summary of a dsv41_jax checkpoint.")
        ap.add_argument("dst")
        ap.add_argument("--json", action="store_true", help="print the summary as JSON")
        args = ap.parse_args(argv[1:])
        from dsv41_jax.checkpoint import CheckpointError, format_info, info

        try:
            d = info(args.dst)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(d, indent=1) if args.json else format_info(d))
        return 0
    args = _convert_parser().parse_args(argv)
    from convert.convert import ConvertError, convert_checkpoint

    try:
        report = convert_checkpoint(args.src, args.dst, dtype=args.dtype, experts=args.experts,
                                    dense=args.dense, max_memory=args.max_memory, resume=args.resume, overwrite=args.overwrite,
                                    text_only=args.text_only, check_finite=args.check_finite,
                                    compress=args.compress, progress=args.progress, max_groups=args.max_groups,
                                    dry_run=args.dry_run)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if args.dry_run:
        print(json.dumps({k: report[k] for k in ("tensors_read", "source_bytes", "arrays", "groups_total",
                                                 "bytes_total", "dropped", "forms", "notes")}, indent=1))
        return 0
    return 0 if report.get("complete") else 3


if __name__ == "__main__":
    sys.exit(main())
