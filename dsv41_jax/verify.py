"""Parity checker: ``python -m dsv41_jax.verify CASE_DIR [CASE_DIR ...] [--only KINDS]``.

A case directory holds a checkpoint in the original DeepSeek format (config.json,
model.safetensors, tokenizer.json, images/), ``case.json`` (inputs, numerics, tolerances) and
``reference.npz`` (arrays dumped from the official torch code). Every check the case supports
is run and printed as one line with its error and tolerance; then ``N passed, M failed`` (and
``K not run`` with reasons). Exit status 0 only when nothing failed and nothing was skipped.

Kinds: preprocess, vision, engram, blocks, prefill, decode.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Callable

import numpy as np

KINDS = ("preprocess", "vision", "engram", "blocks", "prefill", "decode")

# arrays of each kind; the rest of the reference arrays are ignored
BLOCK_ARRAYS = re.compile(r"^(block_out|pre_mix_out|engram_out|compress_kv|index_k|topk_idxs|candidates|moe_topk|moe_weights)_L\d+$")
PREFILL_ARRAYS = re.compile(r"^(block_in|pre_mix_in)_L\d+$|^(prefill_logits|long_prefill_logits)$")
VISION_ARRAYS = ("vit_out", "aligner_rows", "span_embeds")
PREPROCESS_ARRAYS = ("input_ids", "types", "patches", "vit_grid", "llm_grid")
ENGRAM_ARRAYS = re.compile(r"^engram_token_map$|^engram_hashes_L\d+$")


@dataclasses.dataclass
class Result:
    name: str
    kind: str
    ok: bool | None  # None = not run
    detail: str


# ----------------------------------------------------------------------------------- metrics
def _row_view(a: np.ndarray, name: str) -> np.ndarray:
    if name in VISION_ARRAYS:
        return a.reshape(a.shape[0], -1)
    lead = 2 if a.ndim >= 2 else 1
    return a.reshape(int(np.prod(a.shape[:lead])), -1)


def _set_rows(a: np.ndarray) -> list[frozenset]:
    flat = a.reshape(-1, a.shape[-1])
    return [frozenset(int(v) for v in row if v >= 0) for row in flat]


def compare(name: str, got, ref: np.ndarray, tol: dict) -> tuple[bool, str]:
    """Apply every metric of ``tol`` (the README's definitions) to ``got`` against ``ref``."""
    got = np.asarray(got)
    parts, ok = [], True
    if got.shape != ref.shape and "row_set_agree_min" not in tol:
        return False, f"shape {list(got.shape)} != reference {list(ref.shape)}"
    scale = float(np.max(np.abs(ref))) if ref.size and np.issubdtype(ref.dtype, np.number) else 0.0
    scale = scale if scale > 0 else 1.0
    for metric, val in tol.items():
        if metric == "exact":
            same = got.shape == ref.shape and np.array_equal(got.astype(ref.dtype), ref)
            nbad = int(np.sum(got.astype(ref.dtype) != ref)) if got.shape == ref.shape else -1
            parts.append(f"exact={'yes' if same else f'no ({nbad} differ)'}")
            ok &= same
        elif metric == "max_abs_rel":
            err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)))) / scale if ref.size else 0.0
            parts.append(f"max_abs_rel={err:.2e} (tol {val:.1e})")
            ok &= err <= val
        elif metric == "frac_rows_within":
            g, r = _row_view(got.astype(np.float64), name), _row_view(ref.astype(np.float64), name)
            rows = np.max(np.abs(g - r), axis=1) / scale
            frac = float(np.mean(rows <= val["rel"])) if rows.size else 1.0
            parts.append(f"rows<={val['rel']:.0e}: {frac:.3f} (min {val['min_frac']:.3f})")
            ok &= frac >= val["min_frac"] - 1e-12
        elif metric == "argmax_agree_min":
            a = np.argmax(got, -1) == np.argmax(ref, -1)
            frac = float(np.mean(a)) if a.size else 1.0
            parts.append(f"argmax={frac:.3f} (min {val:.3f})")
            ok &= frac >= val - 1e-12
        elif metric == "row_set_agree_min":
            sg, sr = _set_rows(got), _set_rows(ref)
            if len(sg) != len(sr):
                return False, f"rows {len(sg)} != reference {len(sr)}"
            frac = float(np.mean([x == y for x, y in zip(sg, sr)])) if sr else 1.0
            parts.append(f"sets={frac:.3f} (min {val:.3f})")
            ok &= frac >= val - 1e-12
        elif metric == "frac_equal_min":
            frac = float(np.mean(got.astype(ref.dtype) == ref)) if ref.size else 1.0
            parts.append(f"equal={frac:.3f} (min {val:.3f})")
            ok &= frac >= val - 1e-12
        else:
            parts.append(f"unknown metric {metric}")
            ok = False
    return bool(ok), ", ".join(parts)


# ----------------------------------------------------------------------------------- case
class Case:
    def __init__(self, directory: str):
        self.dir = directory
        p = os.path.join(directory, "case.json")
        if not os.path.exists(p):
            raise FileNotFoundError(f"{directory}: not a case directory (no case.json)")
        with open(p) as f:
            self.meta = json.load(f)
        self.ref = dict(np.load(os.path.join(directory, "reference.npz")))
        self.tol = self.meta.get("tolerances", {})
        from dsv41_jax.numerics import Numerics

        self.numerics = Numerics(self.meta.get("compute_dtype", "float32"), self.meta.get("numerics", "reference"))


def _inputs(case: Case, cfg):
    """Expanded ids, types, image spans inputs for the case's batch (processor for images)."""
    batch = case.meta["batch"]
    has_images = any(b.get("images") for b in batch)
    if not has_images:
        ids = np.array([b["prompt_ids"] for b in batch], np.int64)
        return ids, np.full(ids.shape, -1, np.int64), None
    from dsv41_jax import processor

    rows, types, images = [], [], []
    for b in batch:
        imgs = [processor.load_image(os.path.join(case.dir, p)) for p in b["images"]]
        procs = [processor.preprocess_image(im, cfg.vision) for im in imgs]
        exp = processor.expand_prompt(b["prompt_ids"], procs, cfg.image_token_id)
        rows.append(np.asarray(exp.input_ids))
        types.append(np.asarray(exp.types))
        images.append(procs)
    return np.stack(rows), np.stack(types), images


def _captured_forward(model, ids, **kw):
    """Jitted forward returning (logits, capture dict)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, ids, kw):
        m = nnx.merge(graphdef, state)
        cap = {}
        logits, _ = m(ids, capture=cap, **kw)
        return logits, cap

    return f(state, ids, kw)


def run_preprocess_dir(directory: str) -> list[Result]:
    """A preprocess fixture directory (preprocess.json + preprocess.npz + images/): every image's
    plan, grids, span, patch bytes (sha256 of the bf16 tensor) and types, and the prompt expansion,
    compared exactly."""
    from dsv41_jax import processor as P
    from dsv41_jax.config import parse_vision_config

    with open(os.path.join(directory, "preprocess.json")) as f:
        meta = json.load(f)
    npz = np.load(os.path.join(directory, "preprocess.npz"))
    vcfg = parse_vision_config(meta["vision_config"])
    res: list[Result] = []
    done = {}
    for im in meta["images"]:
        name = im["name"]
        try:
            p = P.preprocess_image(os.path.join(directory, im["file"]), vcfg)
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            ok = im["status"] != "ok"
            res.append(Result(f"image {name}", "preprocess", ok, f"{type(e).__name__}: {e}"))
            continue
        done[name] = p
        checks = {
            "size": (tuple(p.resized_size), (im.get("resized_width"), im.get("resized_height"))),
            "vit_grid": (list(p.vit_grid), im.get("vit_grid")),
            "llm_grid": (list(p.llm_grid), im.get("llm_grid")),
            "span_len": (p.span_len, im.get("span_len")),
            "patches_sha256": (p.patches_sha256(), im.get("patches_sha256")),
        }
        bad = [k for k, (g, r) in checks.items() if g != r]
        key = "types_" + name
        if key in npz.files and not np.array_equal(p.types, npz[key]):
            bad.append("types")
        res.append(Result(f"image {name}", "preprocess", not bad and im["status"] == "ok",
                          "exact" if not bad else f"differs: {', '.join(bad)}"))
    ex = meta.get("prompt_expansion")
    if ex and all(n in done for n in ex["images"]):
        out = P.expand_prompt(ex["prompt_ids"], [done[n] for n in ex["images"]], meta["image_token_id"])
        ok = (np.array_equal(out.input_ids, npz["input_ids"]) and np.array_equal(out.types, npz["token_types"])
              and np.array_equal(out.image_starts, npz["image_starts"]))
        res.append(Result("prompt_expansion", "preprocess", ok, "exact" if ok else "differs"))
    return res


def run_case(case_dir: str, only: tuple[str, ...] = KINDS, weights: str | None = None, mesh=None,
             log: Callable[[str], None] = print) -> list[Result]:
    """Run every check of ``only``; with ``mesh`` the parameters, cache and inputs are placed by
    ``dsv41_jax.sharding``'s rules and everything runs under that mesh (expert-parallel MoE)."""
    if mesh is None:
        return _run_case(case_dir, only, weights, None, log)
    from dsv41_jax.sharding import use_mesh

    with use_mesh(mesh):
        return _run_case(case_dir, only, weights, mesh, log)


def _run_case(case_dir: str, only: tuple[str, ...], weights: str | None, mesh,
              log: Callable[[str], None]) -> list[Result]:
    import jax
    import jax.numpy as jnp

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.weights import load_original

    jax.config.update("jax_default_matmul_precision", "highest")
    if os.path.exists(os.path.join(case_dir, "preprocess.json")) and not os.path.exists(os.path.join(case_dir, "case.json")):
        return run_preprocess_dir(case_dir) if "preprocess" in only else []
    case = Case(case_dir)
    cfg = ModelConfig.from_file(case_dir)
    results: list[Result] = []
    ref, tol = case.ref, case.tol

    def check(name, kind, got):
        if name not in ref or name not in tol:
            return
        ok, detail = compare(name, np.asarray(got), ref[name], tol[name])
        results.append(Result(name, kind, ok, detail))

    def not_run(name, kind, why):
        results.append(Result(name, kind, None, why))

    needs_model = any(k in only for k in ("vision", "blocks", "prefill", "decode"))
    has_images = any(b.get("images") for b in case.meta["batch"])
    need_inputs = "preprocess" in only or "engram" in only or needs_model
    ids, types, images = _inputs(case, cfg) if need_inputs else (None, None, None)
    if "preprocess" in only:
        check("input_ids", "preprocess", ids)
        check("types", "preprocess", types)
        if has_images:
            pat = np.concatenate([p.patches for im in images for p in im])
            check("patches", "preprocess", pat.astype(np.float32))
            check("vit_grid", "preprocess", np.array([p.vit_grid for im in images for p in im]))
            check("llm_grid", "preprocess", np.array([p.llm_grid for im in images for p in im]))

    image_mask = types >= 0 if types is not None else None
    hashes = None
    if cfg.text.engram_layer_ids and (needs_model or "engram" in only):
        from tokenizers import Tokenizer

        from dsv41_jax.engram_layout import EngramLayout, build_compressed_token_map

        tok = Tokenizer.from_file(os.path.join(case_dir, "tokenizer.json"))
        tmap = build_compressed_token_map(tok, cfg.text.vocab_size)
        layout = EngramLayout.from_config(cfg.raw["text_config"], tmap)
        dec = [b.get("decode_tokens", []) for b in case.meta["batch"]]
        n_dec = min(len(d) for d in dec) if dec else 0
        full_ids = np.concatenate([ids, np.array([d[:n_dec] for d in dec], np.int64).reshape(ids.shape[0], n_dec)], 1)
        dead = np.concatenate([image_mask, np.zeros((ids.shape[0], n_dec), bool)], 1)
        hashes = layout.hashes(full_ids, dead)
        if "engram" in only:
            check("engram_token_map", "engram", tmap)
            for j, l in enumerate(layout.layer_ids):
                check(f"engram_hashes_L{l}", "engram", hashes[:, : ids.shape[1], j])

    if not needs_model:
        return results
    t0 = time.time()
    if weights is not None:
        from dsv41_jax.checkpoint import restore_model

        model = restore_model(weights, case.numerics, config=cfg, mesh=mesh)
    else:
        model = load_original(case_dir, case.numerics, text_only=not has_images)
    shard = lambda x: x  # noqa: E731
    if mesh is not None:
        from dsv41_jax import sharding

        notes: list[str] = []
        sharding.shard_model(model, mesh, notes=notes)
        shard = lambda x: sharding.shard_batch(x, mesh)  # noqa: E731
        log(f"  mesh {dict(mesh.shape)}: {len(notes)} tensor(s) not split as the rules ask"
            + "".join(f"\n    {n}" for n in notes))
    log(f"  [{os.path.basename(case_dir.rstrip('/'))}] model loaded in {time.time() - t0:.1f}s "
        f"({case.numerics.compute_dtype}, {case.numerics.mode})")
    S = ids.shape[1]
    B = ids.shape[0]
    dec = [b.get("decode_tokens", []) for b in case.meta["batch"]]
    n_dec = min(len(d) for d in dec) if dec else 0
    dec_ids = np.array([d[:n_dec] for d in dec], np.int64).reshape(B, n_dec)
    jids = shard(jnp.asarray(ids, jnp.int32))
    jmask = shard(jnp.asarray(image_mask)) if has_images else None
    eh = None if hashes is None else shard(jnp.asarray(hashes, jnp.int32))

    embeds = None
    if has_images:
        from dsv41_jax.model.span import encode_and_merge

        vis_cap = {}
        embeds = encode_and_merge(model, jids, types, images, case.numerics, capture=vis_cap)
        if "vision" in only:
            for k in VISION_ARRAYS:
                if k in vis_cap:
                    check(k, "vision", np.asarray(vis_cap[k], np.float32))

    if "prefill" in only:
        if "long_prefill_logits" in ref and n_dec:
            # One forward over the prompt and the decode tokens serves both logit checks: the model
            # is causal (attention, compression, indexer, Engram n-grams and routing at a position
            # see no later token), so its first S positions are the S-token prefill. The S-token
            # forward runs in the blocks check (teacher-forced) and through the cache in the
            # decode check.
            lids = jnp.asarray(np.concatenate([ids, dec_ids], 1), jnp.int32)
            lemb, lmask = None, None
            if embeds is not None:
                tail = model.embed(jnp.asarray(dec_ids, jnp.int32), case.numerics.dtype)
                lemb = jnp.concatenate([embeds, tail], 1)
                lmask = jnp.concatenate([jmask, jnp.zeros((B, n_dec), bool)], 1)
            llog, cap = _captured_forward(model, lids, inputs_embeds=lemb, image_mask=lmask, engram_hashes=eh)
            check("long_prefill_logits", "prefill", np.asarray(llog))
            logits, cap = llog[:, :S], {k: v[:, :S] for k, v in cap.items() if PREFILL_ARRAYS.match(k)}
        else:
            logits, cap = _captured_forward(model, jids, inputs_embeds=embeds, image_mask=jmask,
                                            engram_hashes=None if eh is None else eh[:, :S])
        check("prefill_logits", "prefill", np.asarray(logits))
        for name in sorted(ref):
            if PREFILL_ARRAYS.match(name) and name in cap:
                check(name, "prefill", np.asarray(cap[name].astype(jnp.float32)))

    if "blocks" in only:
        L = cfg.text.num_hidden_layers
        teacher = {}
        for l in range(L):
            if f"block_in_L{l}" not in ref:
                break
            teacher[l] = (jnp.asarray(ref[f"block_in_L{l}"]), jnp.asarray(ref[f"pre_mix_in_L{l}"]))
        if len(teacher) != L:
            not_run("blocks", "blocks", "reference lacks block_in_L*/pre_mix_in_L* for every layer")
        else:
            _, cap = _captured_forward(model, jids, inputs_embeds=embeds, image_mask=jmask,
                                       engram_hashes=None if eh is None else eh[:, :S], teacher=teacher)
            for name in sorted(ref):
                if BLOCK_ARRAYS.match(name):
                    if name in cap:
                        v = cap[name]
                        check(name, "blocks", np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v))
                    elif name in tol:
                        not_run(name, "blocks", "not produced by the model")

    if "decode" in only and "decode_logits" in ref and n_dec:
        from dsv41_jax.generate import decode_step_fn, prefill_fn

        cache = model.init_cache(B, S + n_dec)
        if mesh is not None:
            from dsv41_jax.sharding import shard_cache

            cache = shard_cache(cache, mesh)
        # the decode path hashes Engram n-grams on device from the cache's history
        logits, cache = prefill_fn(model, jids, cache, inputs_embeds=embeds, image_mask=jmask)
        if "prefill_logits" in ref and "prefill_logits" in tol:  # the S-token prefill through the cache path
            ok, detail = compare("prefill_logits", np.asarray(logits), ref["prefill_logits"], tol["prefill_logits"])
            results.append(Result("prefill_logits_cached", "decode", ok, detail))
        outs = []
        for k in range(n_dec):
            tok = jnp.asarray(dec_ids[:, k:k + 1], jnp.int32)
            lg, cache = decode_step_fn(model, tok, cache)
            outs.append(np.asarray(lg[:, -1]))
        check("decode_logits", "decode", np.stack(outs, 1))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv41_jax.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="case directories in the golden format")
    ap.add_argument("--only", default=",".join(KINDS), help=f"comma-separated kinds out of {','.join(KINDS)}")
    ap.add_argument("--weights", default=None, help="restore weights from this Orbax checkpoint instead")
    ap.add_argument("--mesh", default=None, help="D,E,T device mesh (simulated CPU devices if needed)")
    ap.add_argument("-v", "--verbose", action="store_true", default=True, help="print every check (default)")
    ap.add_argument("-q", "--quiet", dest="verbose", action="store_false", help="print only failures and totals")
    args = ap.parse_args(argv)
    only = tuple(k.strip() for k in args.only.split(",") if k.strip())
    bad = [k for k in only if k not in KINDS]
    if bad:
        ap.error(f"unknown kind(s) {bad}; choose from {list(KINDS)}")
    mesh = None
    if args.mesh:
        from dsv41_jax.sharding import ShardingError, mesh_from_spec

        try:
            mesh = mesh_from_spec(args.mesh)
        except ShardingError as e:
            ap.error(str(e))
    npass = nfail = nskip = 0
    for c in args.cases:
        print(f"case {c}")
        try:
            res = run_case(c, only, weights=args.weights, mesh=mesh)
        except Exception as e:  # one clear line per broken case, never a deep trace
            print(f"  ERROR {type(e).__name__}: {e}")
            nfail += 1
            continue
        for r in res:
            if r.ok is None:
                nskip += 1
                print(f"  NOT RUN {r.kind:10s} {r.name}: {r.detail}")
            elif r.ok:
                npass += 1
                if args.verbose:
                    print(f"  ok      {r.kind:10s} {r.name}: {r.detail}")
            else:
                nfail += 1
                print(f"  FAIL    {r.kind:10s} {r.name}: {r.detail}")
        print(f"  {sum(r.ok is True for r in res)} passed, {sum(r.ok is False for r in res)} failed")
    line = f"{npass} passed, {nfail} failed"
    if nskip:
        line += f", {nskip} not run"
    print(line)
    return 0 if nfail == 0 and nskip == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
