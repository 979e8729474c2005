"""Kernel-level profile of the slice's decode step / prefill (where the time of a step goes).

Builds the same V4.1-width slice as ``bench_slice.py`` (random weights on the device), compiles
the decode step at each batch (and/or a prefill), runs a few steps under ``jax.profiler.trace``
and attributes every GPU kernel to the Python source line its HLO instruction came from (the
``metadata`` of the optimized HLO). Prints, per target: kernels per step, summed kernel time per
step, wall time per step, and the top source lines / kernels by time. Raw files (xplane.pb,
optimized HLO) go to $OUT so the analysis can be redone off the device::

    python3 benchmarks/profile_step.py --targets decode:1,decode:64,prefill:8192 --experts int8 --dense fp8
    python3 benchmarks/profile_step.py --analyze DIR        # re-summarize saved files
    python3 benchmarks/profile_step.py --analyze DIR --timeline   # one step's kernels in order
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_slice as bs  # noqa: E402

SAVE_RAW = False  # --save-raw: copy xplane.pb + optimized HLO of each target to $OUT
_META = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _tables(hlo_text: str) -> dict:
    """stack_frame_id -> "file.py:line function" from the module's FileNames / FunctionNames /
    FileLocations / StackFrames tables (newer XLA prints metadata with stack_frame_id only)."""
    sec, tabs = None, {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    for line in hlo_text.splitlines():
        w = line.strip()
        if w in tabs:
            sec = w
            continue
        if sec is None:
            continue
        m = re.match(r"^(\d+) (.*)$", w)
        if not m:
            if w.startswith(("HloModule", "ENTRY", "%")) or not w:
                sec = None if w.startswith(("HloModule", "ENTRY", "%")) else sec
            continue
        tabs[sec][int(m.group(1))] = m.group(2)
    out = {}
    for fid, body in tabs["StackFrames"].items():
        loc = dict(_FIELD.findall(body.strip("{}")))
        fl = dict(_FIELD.findall(tabs["FileLocations"].get(int(loc.get("file_location_id", 0)), "").strip("{}")))
        fname = tabs["FileNames"].get(int(fl.get("file_name_id", 0)), "?").strip('"')
        func = tabs["FunctionNames"].get(int(fl.get("function_name_id", 0)), "?").strip('"')
        out[fid] = f"{os.path.basename(fname)}:{fl.get('line', '?')} {func}"
    return out


def hlo_sources(hlo_text: str) -> dict:
    """Instruction name -> "file.py:line function op" from an optimized HLO module's metadata."""
    frames = _tables(hlo_text)
    out = {}
    for line in hlo_text.splitlines():
        m = _META.match(line)
        if not m:
            continue
        f = {k: v.strip('"') for k, v in _FIELD.findall(m.group(2))}
        op = f.get("op_name", "").split("/")[-1]
        if "source_file" in f:
            src = os.path.basename(f["source_file"]) + ":" + f.get("source_line", "?")
        else:
            src = frames.get(int(f.get("stack_frame_id", "0").rstrip(",")), "?")
        out[m.group(1)] = f"{src} [{op}]"
    return out


def kernel_events(xplane_path: str):
    """(name, hlo_op, start_ns, duration_ns) of every kernel on the first GPU's stream lines."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    evs, lines = [], {}
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            n = 0
            for e in line.events:
                n += 1
                if not line.name.startswith("Stream"):
                    continue
                stats = dict(e.stats)
                evs.append((e.name, str(stats.get("hlo_op", "")), float(e.start_ns), float(e.duration_ns)))
            lines[line.name] = n
    return evs, lines


def kernel_source(src: dict, name: str, op: str = "") -> str:
    """The source line of a kernel (``src``: ``hlo_sources``), or "" when unknown. A kernel
    launched outside a command buffer names its HLO instruction (``op``); inside one it is named
    after its fusion ("loop_add_fusion_3" is HLO "loop_add_fusion.3"); library kernels (cuBLAS)
    keep their own names."""
    if op and not op.startswith("command_buffer"):
        return src.get(op, op)
    base, _, num = name.rpartition("_")
    for cand in (name, f"{base}.{num}" if num.isdigit() else name):
        if cand in src:
            return src[cand]
    return ""


def summarize(xplane_path: str, hlo_text, steps: int, wall_s: float, top: int = 40) -> dict:
    """``hlo_text``: the optimized HLO of the profiled executable, or an instruction -> source
    mapping already built (``dumped_sources``)."""
    src = hlo_text if isinstance(hlo_text, dict) else (hlo_sources(hlo_text) if hlo_text else {})
    evs, lines = kernel_events(xplane_path)
    by_src, by_kernel = collections.Counter(), collections.Counter()
    n_src, n_kernel = collections.Counter(), collections.Counter()
    for name, op, _, dur in evs:
        key = kernel_source(src, name, op) or name[:60]
        by_src[key] += dur
        n_src[key] += 1
        by_kernel[name[:80]] += dur
        n_kernel[name[:80]] += 1
    total = sum(d for *_, d in evs)
    span = (max(s + d for _, _, s, d in evs) - min(s for _, _, s, _ in evs)) if evs else 0.0
    return dict(
        steps=steps, kernels_per_step=len(evs) / steps, kernel_us_per_step=total / steps / 1e3,
        span_us_per_step=span / steps / 1e3, wall_us_per_step=wall_s / steps * 1e6, lines=lines,
        top_sources=[(k, round(v / steps / 1e3, 2), n_src[k] // steps) for k, v in by_src.most_common(top)],
        top_kernels=[(k, round(v / steps / 1e3, 2), n_kernel[k] // steps) for k, v in by_kernel.most_common(top)])


def timeline(xplane_path: str, hlo_text: str, steps: int, step: int | None = None) -> list[str]:
    """One step's kernels in launch order: start (us from the step's first kernel), duration
    (us), the idle gap before it (us), kernel name and source line. ``step``: which of the
    ``steps`` profiled steps (default: the middle one)."""
    src = hlo_sources(hlo_text) if hlo_text else {}
    evs = sorted(kernel_events(xplane_path)[0], key=lambda e: e[2])
    n = len(evs) // steps
    step = steps // 2 if step is None else step
    rows, t0 = [], None
    before = evs[n * step - 1] if 0 < step and n else None  # the previous step's last kernel: its gap shows too
    prev = before[2] + before[3] if before else None
    for name, op, start, dur in evs[n * step: n * (step + 1)]:
        where = kernel_source(src, name, op)
        t0 = start if t0 is None else t0
        gap = 0.0 if prev is None else (start - prev) / 1e3
        rows.append(f"{(start - t0) / 1e3:9.2f} {dur / 1e3:8.2f} {gap:6.2f}  {name[:44]:44s} {where[:100]}")
        prev = start + dur
    return ["    start      dur    gap  kernel                                       source"] + rows


def profile(fn, args, steps: int, name: str, out_dir: str | None, hlo_text: str, donate_cache: bool,
            warmup: int = 3, steps_per_call: int = 1):
    """Trace ``steps`` calls of ``fn(*args)`` (after ``warmup`` untraced ones); the summary counts
    ``steps * steps_per_call`` steps (a decode loop call holds ``steps_per_call`` steps)."""
    import jax

    res = None
    for _ in range(warmup):
        res = fn(*args)
        if donate_cache:
            args = (*args[:1], res[1], *args[2:])
    jax.block_until_ready(res)
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    with jax.profiler.trace(tmp):
        for _ in range(steps):
            res = fn(*args)
            if donate_cache:
                args = (*args[:1], res[1], *args[2:])
        jax.block_until_ready(res)
    wall = time.perf_counter() - t0
    pb = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
    summ = summarize(pb, hlo_text, steps * steps_per_call, wall)
    if out_dir and SAVE_RAW and isinstance(hlo_text, str):
        shutil.copy(pb, os.path.join(out_dir, f"{name}.xplane.pb"))
        with gzip.open(os.path.join(out_dir, f"{name}.hlo.txt.gz"), "wt") as f:
            f.write(hlo_text)
    shutil.rmtree(tmp, ignore_errors=True)
    return summ, args


def dumped_sources(dump_dir: str) -> dict:
    """Instruction -> source of every module XLA dumped to ``dump_dir`` (``hlo_sources`` per
    module, merged; on a name clash the first module wins)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        with open(path) as f:
            for k, v in hlo_sources(f.read()).items():
                out.setdefault(k, v)
    return out


def profile_vit(model, cfg, tokens: int, tag: str, env: dict, dump_dir: str | None):
    """ViT + aligner on one random image of about ``tokens`` LLM tokens, bf16 attention mode:
    the tower's kernels by source line (names may collide across its executables: the first
    module's mapping wins)."""
    import dataclasses

    import jax
    from PIL import Image

    from dsv41_jax import processor
    from dsv41_jax.model.vision import encode_images

    import numpy as np

    v = cfg.vision
    side = int(np.sqrt(tokens)) * v.patch_size * v.downsample_ratio
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    pi = processor.preprocess_image(img, v)
    num = dataclasses.replace(model.numerics, vision_attention="bf16")
    t0 = time.perf_counter()
    jax.block_until_ready(encode_images(model.vision, model.aligner, model, [pi], num))
    first = time.perf_counter() - t0
    hlo = dumped_sources(dump_dir) if dump_dir else ""

    def run():
        return encode_images(model.vision, model.aligner, model, [pi], num)

    name = f"vit{tokens}" + (f"_{tag}" if tag else "")
    try:
        summ, _ = profile(lambda: run(), (), 1, name, os.environ.get("OUT"), hlo, donate_cache=False)
        bs.emit(what="profile", target=f"vit:{tokens}", patches=pi.n_patches, env=env, first_call_s=first, **summ)
    except Exception as e:
        bs.emit(what="profile", target=f"vit:{tokens}", env=env, error=f"{type(e).__name__}: {str(e)[:400]}")


def profile_loop(model, cfg, B: int, ctx: int, tokens: int, tag: str, env: dict, rep: int = 0):
    """``generate``'s whole decode loop (``bench_slice.decode_loop_runner``) for ``tokens`` tokens
    at batch ``B``, traced once: per-token kernel time against the loop's span shows what the loop
    adds to the step (sampling, the loop condition, idle time between iterations); ``--timeline``
    on the saved trace lists the middle iteration, its first gap included."""
    import jax

    compiled, fresh, compile_s = bs.decode_loop_runner(model, cfg, B, ctx, tokens)
    for _ in range(3):
        jax.block_until_ready(compiled(*fresh(tokens)))
    args = fresh(tokens)
    jax.block_until_ready(args[1:])
    name = f"loop{B}" + (f"_{tag}" if tag else "") + (f"_rep{rep}" if rep else "")
    summ, _ = profile(compiled, args, 1, name, os.environ.get("OUT"), compiled.as_text() or "",
                      donate_cache=False, warmup=0, steps_per_call=tokens)
    bs.emit(what="profile", target=f"loop:{B}", rep=rep, tokens=tokens, env=env, compile_s=compile_s,
            hlo_sha=bs._sha(compiled.as_text()), **summ)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", default="balanced", choices=("balanced", "random"),
                    help="the routers' biases balanced on a calibration prompt (bench_slice.balance_router) or as drawn")
    ap.add_argument("--targets", default="decode:1",
                    help="decode:BATCH / loop:BATCH (generate's whole decode loop) / prefill:TOKENS / "
                         "vit:IMAGE_TOKENS (bf16 attention mode), comma separated")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loop-tokens", type=int, default=16, help="tokens of the traced loop (loop:B targets)")
    ap.add_argument("--engram-rows", type=int, default=80_000_000)
    ap.add_argument("--experts", default="int8", choices=["bf16", "int8"])
    ap.add_argument("--dense", default="fp8", choices=["bf16", "fp8"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--save-raw", action="store_true", help="also write the xplane.pb and HLO files to $OUT")
    ap.add_argument("--analyze", default="", help="re-summarize NAME.xplane.pb + NAME.hlo.txt.gz files in DIR")
    ap.add_argument("--timeline", action="store_true",
                    help="with --analyze: list one step's kernels in launch order (start, duration, gap, source)")
    a = ap.parse_args()
    if a.analyze:
        for pb in sorted(glob.glob(os.path.join(a.analyze, "*.xplane.pb"))):
            name = os.path.basename(pb)[: -len(".xplane.pb")]
            hp = os.path.join(a.analyze, name + ".hlo.txt.gz")
            hlo = gzip.open(hp, "rt").read() if os.path.exists(hp) else ""
            steps = 1 if name.startswith("prefill") else (a.loop_tokens if name.startswith("loop") else a.steps)
            if a.timeline:
                print(f"# {name}\n" + "\n".join(timeline(pb, hlo, steps)))
                continue
            print(json.dumps(dict(name=name, **summarize(pb, hlo, steps, 0.0)), indent=1))
        return
    dump_dir = None
    if any(t.startswith("vit") for t in a.targets.split(",")):
        # the vision tower runs several executables: their optimized HLO comes from an XLA dump
        # (read by ``dumped_sources``); must be set before the backend starts
        dump_dir = tempfile.mkdtemp()
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text").strip()
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.generate import _forward, _split
    from dsv41_jax.numerics import Numerics

    bs.TAG = a.tag
    global SAVE_RAW
    SAVE_RAW = a.save_raw
    jax.config.update("jax_default_matmul_precision", "default")
    out_dir = os.environ.get("OUT")
    numerics = Numerics("bfloat16", "reference")
    cfg = bs.slice_config(a.layers, a.small, a.engram_rows)
    kw = dict(experts_int8=a.experts == "int8")
    if a.dense == "fp8":
        from dsv41_jax.model.lm import DeepseekV41
        from dsv41_jax.weights import release_fp8_linears

        kw["dense_fp8"] = release_fp8_linears(nnx.eval_shape(lambda: DeepseekV41(cfg, numerics, engram_quantized=True)))
    model = bs.random_model(cfg, numerics, **kw)
    bs.mark_release_quantized(model)
    if a.router == "balanced":
        bs.balance_router(model, cfg)
    from dsv41_jax.model.moe import keep_kernel_scales

    keep_kernel_scales(model)  # as api.load does on one device
    bs.apply_expert_layout(model)  # and the K-blocked codes where the kernels want them
    graphdef, state = _split(model)
    env = {k: v for k, v in os.environ.items() if k.startswith(("DSV41_", "XLA_FLAGS"))}
    seen: dict = {}
    for target in a.targets.split(","):
        seen[target] = rep = seen.get(target, -1) + 1  # a repeated target (loop:1,loop:64,loop:1) traces again
        kind, n = target.split(":")
        n = int(n)
        if kind == "vit":
            profile_vit(model, cfg, n, a.tag, env, dump_dir)
            continue
        if kind == "loop":
            profile_loop(model, cfg, n, a.ctx, a.loop_tokens, a.tag, env, rep)
            continue
        fn = jax.jit(functools.partial(_forward, graphdef), donate_argnums=(1,))
        if kind == "decode":
            cache = model.init_cache(n, a.ctx + 64)
            cache = dict(cache, length=jnp.full((n,), a.ctx, jnp.int32))
            ids = jax.random.randint(jax.random.key(11 + n), (n, 1), 0, cfg.text.vocab_size).astype(jnp.int32)
            args = (state, cache, ids, jnp.ones((n, 1), bool), None, None, None)
            steps = a.steps
        else:
            cache = model.init_cache(1, n)
            ids = jax.random.randint(jax.random.key(1), (1, n), 0, cfg.text.vocab_size).astype(jnp.int32)
            args = (state, cache, ids, jnp.ones((1, n), bool), None, None, None, jnp.full((1,), n - 1, jnp.int32))
            steps = 1
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        hlo = compiled.as_text() or ""
        name = f"{kind}{n}" + (f"_{a.tag}" if a.tag else "")
        try:
            if kind == "decode":
                summ, _ = profile(compiled, args, steps, name, out_dir, hlo, donate_cache=True)
            else:  # a fresh cache per prefill run (the donated one is consumed)
                def run(*xs):
                    return compiled(xs[0], model.init_cache(1, n), *xs[2:])
                summ, _ = profile(run, args, steps, name, out_dir, hlo, donate_cache=False)
            bs.emit(what="profile", target=target, env=env, lower_s=t1 - t0, compile_s=t2 - t1, **summ)
        except Exception as e:
            bs.emit(what="profile", target=target, env=env, lower_s=t1 - t0, compile_s=t2 - t1,
                    error=f"{type(e).__name__}: {str(e)[:400]}")
        compiled = lowered = args = None  # free before the next target
    bs._write_out()


if __name__ == "__main__":
    main()
