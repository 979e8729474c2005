"""CPU benchmark on the tiny V4.1 model (the golden dim-64 family): prefill and decode tokens/s
per batch size through the public generate path, and vision-tower images/s.

    python benchmarks/bench_cpu_tiny.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from dsv41_jax.generate import generate
    from dsv41_jax.model.vision import encode_images
    from dsv41_jax.numerics import Numerics
    from dsv41_jax import processor
    from dsv41_jax.tiny import write_tiny_checkpoint
    from dsv41_jax.weights import load_original
    from PIL import Image

    res = [{"what": "env", "jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "cpus": os.cpu_count()}]
    with tempfile.TemporaryDirectory() as d:
        write_tiny_checkpoint(d, fmt="fp8", seed=0)
        model = load_original(d, Numerics("bfloat16", "reference"))
    rng = np.random.default_rng(0)
    for B in (1, 4, 8):
        for S in (64, 256):
            prompts = [list(rng.integers(3, 240, S)) for _ in range(B)]
            generate(model, prompts, max_new_tokens=32, stop_ids=())  # compile
            r = generate(model, prompts, max_new_tokens=32, stop_ids=())
            t = r.timings
            res.append({"what": "generate", "batch": B, "prompt": S, "new_tokens": 32,
                        "prefill_tokens_per_s": B * S / t["prefill_s"],
                        "decode_tokens_per_s": B * t["decode_steps"] / t["decode_s"],
                        "decode_step_ms": 1e3 * t["decode_s"] / t["decode_steps"]})
            print(json.dumps(res[-1]), flush=True)
    cfg = model.config.vision
    imgs = [processor.preprocess_image(Image.fromarray(rng.integers(0, 255, (84, 112, 3), dtype=np.uint8)), cfg)
            for _ in range(8)]
    out = encode_images(model.vision, model.aligner, model, imgs, model.numerics)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 3.0:
        jax.block_until_ready(encode_images(model.vision, model.aligner, model, imgs, model.numerics))
        n += len(imgs)
    res.append({"what": "vision_tower", "images_per_s": n / (time.perf_counter() - t0),
                "patches_per_image": imgs[0].n_patches, "llm_tokens_per_image": imgs[0].span_len})
    print(json.dumps(res[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
