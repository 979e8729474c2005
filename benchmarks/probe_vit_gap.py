"""Where ``encode_images``' time beyond the tower goes: a timeline of one call on the GPU.

The full-width V4.1 vision tower + aligner (random weights, bf16, the bf16 attention mode) on one
~961-token image, as ``bench_slice.py``'s ``vit`` row runs it, with the tower in 1 / 4 / 1 / 4 / 6
parts (``DSV41_VIT_PARTS``, ``vision.tower_parts``), A/B in one process. Per variant: the wall time
of ``encode_images`` (``encode_wall``), its host work by stage (pack, put, dispatch of the tower,
the span assembly; also with one ``device_put`` for the five arrays), and for the first 4-part
variant one call under ``jax.profiler.trace`` (``encode_timeline``, ms from the call's start):
when the first transfer and the first kernel start, when the last kernel ends, the summed kernel
and transfer time, the device's idle gaps over 20 us (with the events on either side) and the
longest host events. ``--no-command-buffer`` adds the tower compiled without XLA's command
buffers (run 38: no faster)::

    python3 benchmarks/probe_vit_gap.py          # writes $OUT/probe_vit_gap.jsonl
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_slice import jsonl_emitter  # noqa: E402

emit = jsonl_emitter("probe_vit_gap.jsonl")


def device_events(xplane_path: str):
    """(name, start_ns, end_ns) of every event on the first GPU's stream lines (kernels and
    copies), and (name, start_ns, end_ns) of the host's trace annotations."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    dev, host = [], []
    for plane in pd.planes:
        if plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                if line.name.startswith("Stream") or "Memcpy" in line.name:
                    dev += [(e.name, float(e.start_ns), float(e.start_ns + e.duration_ns)) for e in line.events]
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                host += [(e.name, float(e.start_ns), float(e.start_ns + e.duration_ns)) for e in line.events]
    return dev, host


def host_top(host, start_ns: float, end_ns: float, n: int = 14) -> list:
    """The host events (all threads) inside [start_ns, end_ns), summed by name, longest first."""
    tot: dict = {}
    for name, s, e in host:
        if start_ns <= s < end_ns and not name.startswith("encode_call_"):
            tot[name[:70]] = tot.get(name[:70], 0.0) + (e - s)
    return [(k, round(v / 1e6, 3)) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:n]]


def call_timeline(dev, start_ns: float, end_ns: float, until_ns: float, gap_us: float = 20.0) -> dict:
    """The device's events that start inside [start_ns, until_ns) (the next call's start),
    relative to the call's start; ``end_ns``: when the call returned."""
    evs = sorted((e for e in dev if start_ns <= e[1] < until_ns), key=lambda e: e[1])
    if not evs:
        return dict(events=0)
    ms = lambda t: round((t - start_ns) / 1e6, 3)  # noqa: E731
    copies = [e for e in evs if "memcpy" in e[0].lower() or "copy" in e[0].lower()]
    kernels = [e for e in evs if e not in copies]
    gaps, last_end, last_name = [], evs[0][2], evs[0][0]
    for name, s, e in evs[1:]:
        if s - last_end > gap_us * 1e3:
            gaps.append(dict(at_ms=ms(last_end), gap_ms=round((s - last_end) / 1e6, 3),
                             after=last_name[:60], before=name[:60]))
        if e > last_end:
            last_end, last_name = e, name
    return dict(events=len(evs), first_event_ms=ms(evs[0][1]), first_event=evs[0][0][:60],
                first_kernel_ms=ms(kernels[0][1]) if kernels else None,
                first_kernel=kernels[0][0][:60] if kernels else None,
                last_end_ms=ms(max(e[2] for e in evs)),
                kernel_ms=round(sum(e[2] - e[1] for e in kernels) / 1e6, 3),
                copy_ms=round(sum(e[2] - e[1] for e in copies) / 1e6, 3),
                copies=[(c[0][:40], ms(c[1]), round((c[2] - c[1]) / 1e6, 3)) for c in copies[:8]],
                gaps=gaps[:12], n_gaps=len(gaps), host_call_ms=round((end_ns - start_ns) / 1e6, 3))


def put_each(arrays):
    return [jnp.asarray(a) for a in arrays]


def put_once(arrays):
    return jax.device_put(list(arrays))


def host_stages(vision, aligner, vecs, pi, impl: str, reps: int = 5, put=put_each) -> dict:
    """The host work of ``encode_images`` stage by stage (the same calls, timed in between);
    ``put``: how the packed arrays go to the device (``put_each``: as ``encode_images``)."""
    from dsv41_jax.model import vision as V

    stages = {"pack": [], "put": [], "dispatch": [], "spans": [], "device_rest": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        g = V.pack_images([pi], vision.cfg, bucket=V.tight_bucket, pixels=True)[0]
        t1 = time.perf_counter()
        args = put((g.patches, g.rows, g.cols, g.n_valid, g.merge))
        t2 = time.perf_counter()
        x, a = V._tower(vision, aligner, *args, q_block=V._query_block(g.patches.shape[1]), impl=impl)
        t3 = time.perf_counter()
        table = V.image_vector_table(vecs, vision.numerics.dtype)
        off = V._rows_index([g.patches.shape[0]], [g.image_ids], [g.merge.shape[1]])
        rows = a.reshape(-1, a.shape[-1])
        index = V.span_gather_index([pi.types], [off[0]], rows.shape[0])
        out = V.gather_spans(rows, table, jnp.asarray(index))
        t4 = time.perf_counter()
        jax.block_until_ready(out)
        t5 = time.perf_counter()
        for k, (s, e) in zip(stages, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
            stages[k].append(e - s)
    return {f"{k}_ms": round(float(np.median(v)) * 1e3, 3) for k, v in stages.items()}


def main():
    from PIL import Image

    from dsv41_jax import processor
    from dsv41_jax.config import preset
    from dsv41_jax.model import vision as V
    from dsv41_jax.numerics import Numerics

    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v41-flash", help="'tiny' for a CPU check of the script")
    ap.add_argument("--no-command-buffer", action="store_true",
                    help="also the tower compiled without XLA's command buffers (CUDA graphs)")
    args = ap.parse_args()
    cfg = preset(args.preset)
    num = Numerics("bfloat16", "reference", vision_attention="bf16")
    vision, aligner = V.build_vision_modules(cfg, num)
    v = cfg.vision
    side = (31 if v.hidden_size >= 1024 else 4) * v.patch_size * v.downsample_ratio
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    pi = processor.preprocess_image(img, v)
    vecs = [jnp.zeros((cfg.text.hidden_size,), jnp.bfloat16)] * 3
    impl = V.attention_impl("bf16")
    call = lambda: V.encode_images(vision, aligner, vecs, [pi])  # noqa: E731
    def measure(variant: str, n_trace: int):
        for _ in range(2):
            jax.block_until_ready(call())
        walls = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(call())
            walls.append(time.perf_counter() - t)
        emit(what="encode_wall", variant=variant, ms=[round(w * 1e3, 3) for w in walls],
             median_ms=round(float(np.median(walls)) * 1e3, 3), patches=int(pi.n_patches), impl=impl)
        emit(what="host_stages", variant=variant, **host_stages(vision, aligner, vecs, pi, impl))
        emit(what="host_stages", variant=variant + "+put_once",
             **host_stages(vision, aligner, vecs, pi, impl, put=put_once))
        if not n_trace:
            return
        tmp = tempfile.mkdtemp()
        with jax.profiler.trace(tmp):
            for i in range(n_trace):
                with jax.profiler.TraceAnnotation(f"encode_call_{i}"):
                    out = call()
                jax.block_until_ready(out)
                time.sleep(0.05)
        pb = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
        dev, host_all = device_events(pb)
        calls = sorted((h for h in host_all if h[0].startswith("encode_call_")), key=lambda h: h[1])
        for i, (name, s, e) in enumerate(calls):
            until = calls[i + 1][1] if i + 1 < len(calls) else float("inf")
            emit(what="encode_timeline", variant=variant, call=name, **call_timeline(dev, s, e, until),
                 host_top=host_top(host_all, s, e))

    # the tower as one executable and in parts (``vision.tower_parts``); run 38 showed the GPU
    # idle for ~6 ms after the copies while the one executable's command buffer was prepared
    for i, parts in enumerate(("1", "4", "1", "4", "6")):
        os.environ["DSV41_VIT_PARTS"] = parts
        measure(f"parts={parts}", 1 if i == 1 else 0)
    os.environ.pop("DSV41_VIT_PARTS")
    if args.no_command_buffer:  # (run 38: no faster end to end than the default)
        import functools

        runner = V._TOWERS[vision]
        graphdef, state = nnx.split((vision, aligner))
        _, treedef = jax.tree_util.tree_flatten(state)
        runner.fn = jax.jit(functools.partial(V._tower_pure, graphdef, treedef),
                            static_argnames=("q_block", "impl", "part"),
                            compiler_options={"xla_gpu_enable_command_buffer": ""})
        measure("no_command_buffer", 2)


if __name__ == "__main__":
    main()
