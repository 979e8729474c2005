"""``dsv41-jax``: convert, generate, info, make-tiny, verify, demo.

Run ``dsv41-jax <command> --help`` for each command's flags.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEMO_PROMPT = "Hello<｜deepseek_image｜>hello"


def _asset(name: str) -> str:
    return os.path.join(os.path.dirname(__file__), "assets", name)


def cmd_make_tiny(a) -> int:
    from dsv41_jax.tiny import write_tiny_checkpoint

    cfg = write_tiny_checkpoint(a.out, fmt=a.format, seed=a.seed, vision=not a.no_vision)
    t = cfg["text_config"]
    print(f"wrote a tiny DeepSeek-V4.1 checkpoint ({a.format}, {t['num_hidden_layers']} layers, "
          f"hidden {t['hidden_size']}, {t['n_routed_experts']} experts, vocab {t['vocab_size']}) to {a.out}")
    return 0


def cmd_convert(a) -> int:
    from convert import convert_checkpoint

    convert_checkpoint(a.src, a.dst, dtype=a.dtype, experts=a.experts, dense=a.dense, max_memory=a.max_memory,
                       resume=a.resume)
    return 0


def cmd_info(a) -> int:
    from dsv41_jax.checkpoint import info

    d = info(a.path)
    print(json.dumps(d, indent=2, default=str))
    return 0


def cmd_verify(a) -> int:
    from dsv41_jax.verify import main

    argv = list(a.cases) + ["--only", a.only]
    if a.weights:
        argv += ["--weights", a.weights]
    if a.mesh:
        argv += ["--mesh", a.mesh]
    if a.verbose:
        argv.append("-v")
    return main(argv)


def _load(a):
    import dsv41_jax

    return dsv41_jax.load(a.model, mesh=a.mesh, dtype=a.dtype, numerics=a.numerics, experts_int8=a.experts_int8,
                          dense_fp8=a.dense_fp8, vit_attention=a.vit_attention,
                          text_attention=a.text_attention)


def cmd_generate(a) -> int:
    t0 = time.perf_counter()
    m = _load(a)
    t_load = time.perf_counter() - t0
    prompt = a.prompt
    if a.chat:
        content = [{"type": "text", "text": prompt}] + [{"type": "image_url", "image_url": {"url": p}} for p in a.image]
        prompt = [{"role": "user", "content": content}]
        images = None
    else:
        images = list(a.image)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
              min_p=a.min_p, seed=a.seed)
    if a.stream:
        for piece in m.stream_text(prompt, images, **kw):
            print(piece, end="", flush=True)
        print()
        return 0
    out = m.generate(prompt, images, **kw)
    print(out.text[0])
    if a.verbose:
        print(f"tokens: {out.tokens[0]}  finish: {out.finish_reasons[0]}")
        print(f"image spans (llm_h, llm_w, span_len): {out.image_spans[0]}")
        print(f"load {t_load:.2f}s, " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in out.timings.items()))
    return 0


def cmd_demo(a) -> int:
    """Tiny checkpoint -> Orbax -> load -> generate with the bundled image."""
    import shutil

    out = a.out
    src, dst = os.path.join(out, "tiny_original"), os.path.join(out, "tiny_orbax")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    t0 = time.perf_counter()
    from dsv41_jax.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(src, fmt="fp8", seed=0)
    print(f"[1/4] tiny DeepSeek-V4.1 checkpoint (release format: fp8 + fp4 experts) -> {src} "
          f"({time.perf_counter() - t0:.1f}s)")
    t0 = time.perf_counter()
    from convert import convert_checkpoint

    convert_checkpoint(src, dst, progress=False)
    print(f"[2/4] converted to Orbax -> {dst} ({time.perf_counter() - t0:.1f}s)")
    t0 = time.perf_counter()
    import dsv41_jax

    m = dsv41_jax.load(dst, dtype="bfloat16", numerics="reference")
    print(f"[3/4] loaded ({time.perf_counter() - t0:.1f}s)")
    img = _asset("demo.png")
    pi = m.preprocess(img)
    print(f"      image {os.path.basename(img)} {pi.original_size[0]}x{pi.original_size[1]} -> "
          f"{pi.n_patches} patches (ViT grid {pi.vit_grid[0]}x{pi.vit_grid[1]}), "
          f"LLM grid {pi.llm_grid[0]}x{pi.llm_grid[1]}, span of {pi.span_len} tokens")
    res = m.generate(DEMO_PROMPT, [img], max_new_tokens=a.max_new_tokens)
    res2 = m.generate(DEMO_PROMPT, [img], max_new_tokens=a.max_new_tokens)
    tm, tm2 = res.timings, res2.timings
    print(f"[4/4] generated {len(res.tokens[0])} tokens: {res.tokens[0]} ({res.finish_reasons[0]})")
    print(f"      text: {res.text[0]!r}")
    print(f"      first call: compile {tm.get('compile_s', 0):.2f}s, prefill {tm.get('prefill_s', 0):.3f}s, "
          f"decode {tm.get('decode_s', 0):.3f}s; second call (compiled): prefill {tm2.get('prefill_s', 0):.3f}s, "
          f"decode {tm2.get('decode_s', 0):.3f}s, compile {tm2.get('compile_s', 0):.2f}s")
    assert res.tokens == res2.tokens, "greedy generation must be deterministic"
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41-jax", description="DeepSeek-V4.1 (vision-language) in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("convert", help="original DeepSeek safetensors -> Orbax checkpoint (streaming, resumable)")
    s.add_argument("src", help="directory with config.json, tokenizer files and *.safetensors (+ index)")
    s.add_argument("dst", help="output directory (written atomically; DST.partial while in progress)")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "float32"], help="dtype of dequantized weights")
    s.add_argument("--experts", default=None, choices=["bf16", "float32", "int8"],
                   help="routed experts: dequantized (default: --dtype) or int8 codes + ue8m0 scales (lossless from fp4)")
    s.add_argument("--dense", default="dequantized", choices=["dequantized", "fp8"],
                   help="fp8 Linear weights: dequantized (default) or e4m3 codes + ue8m0 scales (lossless)")
    s.add_argument("--max-memory", default="4GB", help="host memory budget for one conversion group")
    s.add_argument("--resume", action="store_true", help="continue an interrupted conversion")
    s.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    s.add_argument("--text-only", action="store_true", help="drop the vision tower")
    s.add_argument("--dry-run", action="store_true", help="validate only, write nothing")
    s.epilog = "All flags: python -m convert --help"
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("generate", help="generate text from a prompt (with images)")
    s.add_argument("model", help="converted (Orbax) or original checkpoint directory")
    s.add_argument("prompt", help="prompt text; put <｜deepseek_image｜> where each --image goes")
    s.add_argument("--image", action="append", default=[], help="image file (repeat for several, in order)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt as one user chat message (images appended)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="maximum number of new tokens")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p(max) (0 = off)")
    s.add_argument("--seed", type=int, default=0, help="random seed")
    s.add_argument("--mesh", default=None, help="D,E,T device mesh (data, expert, tensor)")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    s.add_argument("--numerics", default="reference", choices=["reference", "fast"],
                   help="reference: the official fake-quant points; fast: without them")
    s.add_argument("--experts-int8", action="store_true",
                   help="keep fp4 routed experts quantized in device memory (fp4 checkpoints or --experts int8 conversions)")
    s.add_argument("--dense-fp8", action="store_true",
                   help="keep fp8 Linear weights as e4m3 codes + ue8m0 scales in device memory (fp8 checkpoints or "
                        "--dense fp8 conversions)")
    s.add_argument("--vit-attention", default="fp32", choices=["fp32", "bf16"],
                   help="vision tower: fp32 attention (parity path) or bf16 (performance mode, docs/vision.md)")
    s.add_argument("--text-attention", default="exact", choices=["exact", "online"],
                   help="decoder prefill attention on the GPU: exact (the reference's roundings) or online "
                        "(performance mode: running maximum, ~30%% less attention time)")
    s.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    s.add_argument("-v", "--verbose", action="store_true", help="print tokens, image spans and timings")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("info", help="print config, parameter counts and dtypes of a converted checkpoint")
    s.add_argument("path")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("make-tiny", help="write a tiny random V4.1 checkpoint in the original DeepSeek format")
    s.add_argument("out")
    s.add_argument("--format", default="fp8", choices=["fp8", "bf16"], help="release format (fp8/fp4) or bf16")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-vision", action="store_true", help="text-only checkpoint")
    s.set_defaults(fn=cmd_make_tiny)

    s = sub.add_parser("verify", help="check case directories in the golden format against their reference")
    s.add_argument("cases", nargs="+")
    s.add_argument("--only", default="preprocess,vision,engram,blocks,prefill,decode")
    s.add_argument("--weights", default=None, help="Orbax checkpoint to restore instead of the case's weights")
    s.add_argument("--mesh", default=None, help="D,E,T mesh")
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("demo", help="make-tiny -> convert -> load -> generate with the bundled image")
    s.add_argument("--out", default="demo_out", help="working directory (recreated)")
    s.add_argument("--max-new-tokens", type=int, default=8)
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # convert / info own their full flag sets (python -m convert)
    if argv and argv[0] == "convert" and not ({"-h", "--help"} & set(argv[1:2])):
        from convert import main as convert_main

        return convert_main(argv[1:])
    if argv and argv[0] == "info" and not ({"-h", "--help"} & set(argv[1:2])):
        from convert import main as convert_main

        return convert_main(argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ValueError, FileNotFoundError, OSError) as e:  # one clear line, no deep trace
        print(f"dsv41-jax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
