"""Which pieces run on a multi-GPU mesh: each case in its own process (a CUDA fault is sticky and
would poison the cases after it), one JSON line per case with ok / the error.

Cases: an all-reduce inside shard_map; a resharding device_put; the Pallas Sinkhorn in an
auto-partitioned jit; the grouped qmatmul (Triton) inside shard_map on local expert shards and in
an auto-partitioned jit with the weight split over "tensor"; then the small sharded model
(``bench_sharded.py --small``) under kernel settings (XLA only, default, default without the
Pallas Sinkhorn, default without the Pallas MoE).

    python3 benchmarks/check_multi_gpu.py                 # all cases
    python3 benchmarks/check_multi_gpu.py --case psum     # one case, in this process
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

IMPL = os.environ.get("CHECK_KERNEL_IMPL", "triton")  # "interpret": the same cases on CPU
UNIT = ("psum", "reshard", "sinkhorn_spmd", "qmatmul_shard_map", "qmatmul_spmd", "moe_full", "offsets_overflow",
        "slice_captures")
MODEL = {  # name -> environment of the small sharded model run
    "model_xla": {"DSV41_KERNELS": "xla"},
    "model_default": {},
    "model_no_pallas_sinkhorn": {"DSV41_SINKHORN": "xla"},
    "model_no_pallas_moe": {"DSV41_MOE_PATH": "grouped"},
}


def _mesh(axis: str):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:2]), (axis,))


def case_psum():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from dsv41_jax.model.moe_ep import shard_map

    mesh = _mesh("expert")
    f = shard_map(lambda x: jax.lax.psum(x, "expert"), mesh=mesh, in_specs=P("expert"), out_specs=P())
    y = jax.jit(f)(jnp.arange(8.0).reshape(2, 4))
    return dict(value=y.tolist(), ok=bool(jnp.allclose(y, jnp.array([[4.0, 6.0, 8.0, 10.0]]))))


def case_reshard():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh("expert")
    x = jnp.ones((1 << 14, 1 << 14), jnp.bfloat16)  # 512 MiB on device 0
    y = jax.device_put(x, NamedSharding(mesh, P("expert")))
    s = jax.jit(lambda a: jnp.sum(a.astype(jnp.float32)))(y)
    return dict(ok=float(s) == float(x.size))


def case_sinkhorn_spmd():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv41_jax.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    mesh = _mesh("tensor")
    x = jax.device_put(3.0 * jax.random.normal(jax.random.key(0), (64, 16)), NamedSharding(mesh, P()))
    w = jax.device_put(jnp.ones((16, 256)), NamedSharding(mesh, P(None, "tensor")))
    got = jax.jit(lambda a, b: sinkhorn(a, 20, 1e-6, IMPL).reshape(64, 16) @ b)(x, w)
    want = jax.jit(lambda a, b: sinkhorn_reference(a, 20, 1e-6).reshape(64, 16) @ b)(x, w)
    err = float(jnp.max(jnp.abs(got - want)))
    return dict(ok=err < 1e-4, max_abs_err=err)


def _codes(G, O, K):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(1))
    codes = jax.random.randint(k1, (G, O, K), -12, 13).astype(jnp.int8)
    scale = jax.random.randint(k2, (G, O, K // 32), 118, 126).astype(jnp.uint8)
    return codes, scale


def case_qmatmul_shard_map():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv41_jax.kernels import qmatmul as Q
    from dsv41_jax.model.moe_ep import shard_map

    mesh = _mesh("expert")
    G, O, K = 16, 512, 1024
    codes, scale = _codes(G, O, K)
    codes = jax.device_put(codes, NamedSharding(mesh, P("expert")))
    scale = jax.device_put(scale, NamedSharding(mesh, P("expert")))
    out = {}
    for bm, R in ((1, 12), (64, 512)):
        x = jax.random.normal(jax.random.key(2), (R, K), jnp.float32).astype(jnp.bfloat16)
        bg = (jnp.arange(R // bm, dtype=jnp.int32) * 5) % (G // 2)  # local group ids

        def body(x, bg, c, s, impl):
            return Q.grouped_qmatmul(x, bg, bg.shape[0], c, s, bm=bm, out_dtype=jnp.float32, impl=impl)[None]

        res = {}
        for impl in (IMPL, "xla"):
            f = shard_map(lambda x, bg, c, s: body(x, bg, c, s, impl), mesh=mesh,
                          in_specs=(P(), P(), P("expert"), P("expert")), out_specs=P("expert"), check=False)
            res[impl] = jax.jit(f)(x, bg, codes, scale)
        err = float(jnp.max(jnp.abs(res[IMPL] - res["xla"])) / jnp.max(jnp.abs(res["xla"])))
        out[f"bm{bm}"] = err
    return dict(ok=max(out.values()) < 1e-5, rel_err=out)


def case_qmatmul_spmd():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv41_jax.kernels import qmatmul as Q

    mesh = _mesh("tensor")
    codes, scale = _codes(1, 1024, 1024)
    codes = jax.device_put(codes[0].astype(jnp.float32).astype(jnp.float8_e4m3fn), NamedSharding(mesh, P("tensor")))
    scale = jax.device_put(scale[0], NamedSharding(mesh, P("tensor")))
    x = jax.random.normal(jax.random.key(2), (16, 1024), jnp.float32).astype(jnp.bfloat16)
    bg = jnp.zeros((1,), jnp.int32)
    res = {impl: jax.jit(lambda x, c, s: Q.grouped_qmatmul(x, bg, 1, c, s, bm=16, out_dtype=jnp.float32,
                                                           impl=impl))(x, codes, scale)
           for impl in (IMPL, "xla")}
    err = float(jnp.max(jnp.abs(res[IMPL] - res["xla"])) / jnp.max(jnp.abs(res["xla"])))
    return dict(ok=err < 1e-5, rel_err=err)


def case_moe_full():
    """One V4.1-width MoE layer (384 int8 experts): unsharded vs expert-parallel over 2 devices
    (mesh 1,2,1) for a prefill (512 tokens: the grouped path) and a decode token (gather), under
    the default kernel choice and with the XLA grouped MoE forced."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import bench_slice as bs
    from dsv41_jax import sharding as shd
    from dsv41_jax.numerics import Numerics

    cfg = bs.slice_config(1, os.environ.get("CHECK_SMALL") == "1", 1_000_000)  # small: CPU test of the case
    model = bs.random_model(cfg, Numerics("bfloat16", "reference"), experts_int8=True)
    bs.mark_release_quantized(model)
    ffn = model.layers[0].ffn
    mesh = shd.make_mesh(1, 2, 1)
    sharded = shd.shard_model(nnx.clone(model), mesh).layers[0].ffn
    out = {}
    for T in (512, 1):
        x = (jax.random.normal(jax.random.key(T), (1, T, cfg.text.hidden_size), jnp.float32)).astype(jnp.bfloat16)
        for forced in ("auto", "grouped"):
            os.environ["DSV41_MOE_PATH"] = forced
            want = np.asarray(jax.jit(lambda m, v: m(v))(ffn, x), np.float32)
            with shd.use_mesh(mesh):
                got = np.asarray(jax.jit(lambda m, v: m(v))(sharded, x), np.float32)
            out[f"T{T}_{forced}"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    os.environ["DSV41_MOE_PATH"] = "auto"
    return dict(ok=max(out.values()) < 2e-2, rel_err=out)


def case_offsets_overflow():
    """One GPU: the kernel (guard bypassed) on int8 codes [192, 2304, 5120] (2.26 GB, the range
    ``qmatmul.offsets_fit`` rejects), reading group 191 (offsets past 2**31) and group 0. ``ok``
    means the guard is needed: the result is wrong or the launch faults."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.kernels import qmatmul as Q

    G, O, K = 192, 2304, 5120
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    codes = jax.jit(lambda k: jax.random.randint(k, (G, O, K), -12, 13, jnp.int8))(k1)
    scale = jax.random.randint(k2, (G, O, K // 32), 118, 126).astype(jnp.uint8)
    x = jax.random.normal(k3, (2, K), jnp.float32).astype(jnp.bfloat16)
    bg = jnp.array([G - 1, 0], jnp.int32)
    want = np.asarray(Q.grouped_qmatmul_reference(x, bg, 2, codes, scale, bm=1, out_dtype=jnp.float32))
    cfg = Q.choose_config(1, O, K, True, nb=2)
    try:
        got = np.asarray(Q._pallas(x, bg, 2, [(codes, scale)], bm=1, out_dtype=jnp.float32,
                                   mult=Q.default_mult(codes.dtype), cfg=cfg, interpret=False)[0])
    except Exception as e:
        return dict(ok=True, kernel_error=f"{type(e).__name__}: {str(e)[:300]}")
    err = [float(np.max(np.abs(got[i] - want[i])) / max(np.max(np.abs(want[i])), 1e-30)) for i in range(2)]
    return dict(ok=err[0] > 1e-3, rel_err_group_191=err[0], rel_err_group_0=err[1])


def case_slice_captures():
    """Where a sharded forward departs from one device: the 3-layer V4.1-width slice of
    ``bench_sharded.py`` (int8 experts), one 512-token prefill with every intermediate captured,
    on one device with the default kernels, on one device with XLA only, and on mesh (1,2,1);
    relative errors per captured tensor in execution order (the first large one is the culprit)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import bench_slice as bs
    from dsv41_jax import sharding as shd
    from dsv41_jax.numerics import Numerics

    small = os.environ.get("CHECK_SMALL") == "1"
    cfg = bs.slice_config(3, small, 20_000_000 if not small else 100_000)
    # CHECK_DTYPE=float32: fp32 compute, where kernel and XLA paths agree to summation order
    # (bf16 rounding differences flip top-k routing and grow through the random-weight layers)
    model = bs.random_model(cfg, Numerics(os.environ.get("CHECK_DTYPE", "bfloat16"), "reference"), experts_int8=True)
    bs.mark_release_quantized(model)
    S = 512 if not small else 64
    ids = jax.random.randint(jax.random.key(7), (1, S), 0, cfg.text.vocab_size).astype(jnp.int32)

    def captures(m, mesh=None):
        graphdef, state = nnx.split(m)
        cache = m.init_cache(1, S)
        if mesh is not None:
            cache = shd.shard_cache(cache, mesh)

        def f(state, cache, ids):
            cap = {}
            lg, _ = nnx.merge(graphdef, state)(ids, positions=jnp.arange(S, dtype=jnp.int32)[None],
                                               valid=jnp.ones((1, S), bool), cache=cache, capture=cap)
            cap["logits"] = lg
            return {k: v for k, v in cap.items() if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating)}

        if mesh is None:
            return jax.device_get(jax.jit(f)(state, cache, ids))
        with shd.use_mesh(mesh):
            return jax.device_get(jax.jit(f)(state, cache, ids))

    ref = captures(model)
    os.environ["DSV41_KERNELS"] = "xla"
    xla = captures(model)
    os.environ.pop("DSV41_KERNELS")
    if jax.device_count() >= 2:
        mesh = shd.make_mesh(1, 2, 1)
        sh = captures(shd.shard_model(nnx.clone(model), mesh), mesh)
    else:  # one device: the default path again (is it deterministic?)
        sh = captures(model)

    def errs(a, b):
        out = []
        for k in b:
            if k in a and np.shape(a[k]) == np.shape(b[k]):
                x, y = np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)
                out.append((k, round(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)), 5)))
        return out

    e_xla, e_sh = errs(xla, ref), errs(sh, ref)
    # quantized intermediates (fp8 index keys, fake-quant KV) flip whole steps on bf16 noise:
    # judge by the residual stream and the logits
    def first(es):
        return next((k for k, e in es if e > 0.05 and k.split("_L")[0] in ("block_in", "block_out", "logits")), None)

    first_bad = first(e_sh)
    return dict(ok=first_bad is None, first_bad_sharded_vs_default=first_bad,
                first_bad_xla_vs_default=first(e_xla),
                xla_vs_default=e_xla, sharded_vs_default=e_sh)


def run_case(name: str) -> dict:
    t0 = time.time()
    try:
        res = globals()["case_" + name]()
    except Exception as e:
        res = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
    return dict(case=name, seconds=round(time.time() - t0, 1), **res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="")
    ap.add_argument("--cases", default=",".join(UNIT))
    ap.add_argument("--model-meshes", default="1,2,1;1,1,2")
    ap.add_argument("--models", default=",".join(MODEL))
    ap.add_argument("--timeout", type=int, default=150)
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(a.case)), flush=True)
        return
    out = os.environ.get("OUT")
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(os.path.join(out, "check_multi_gpu.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    for name in [c for c in a.cases.split(",") if c]:
        try:
            p = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True,
                               timeout=a.timeout)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            record(json.loads(line[0][7:]) if line else dict(case=name, ok=False, rc=p.returncode,
                                                             error=(p.stderr or p.stdout)[-800:]))
        except subprocess.TimeoutExpired:
            record(dict(case=name, ok=False, error="timeout"))
    for name in [m for m in a.models.split(",") if m]:
        env = dict(os.environ, **MODEL[name])
        env.pop("OUT", None)  # the model runs print their rows; only this file's summary goes to $OUT
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.join(HERE, "bench_sharded.py"), "--small", "--meshes",
                                a.model_meshes, "--prompt", "256", "--steps", "4", "--ctx", "512"],
                               capture_output=True, text=True, timeout=a.timeout, env=env)
            rows_m = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
            sh = [r for r in rows_m if r.get("what") == "sharded"]
            ok = bool(sh) and all("error" not in r and r.get("tokens_equal") for r in sh)
            record(dict(case=name, ok=ok, seconds=round(time.time() - t0, 1), rc=p.returncode,
                        sharded=[{k: r.get(k) for k in ("mesh", "error", "tokens_equal", "prefill_rel_err",
                                                         "decode_rel_err")} for r in sh],
                        stderr_tail=None if ok else p.stderr[-600:]))
        except subprocess.TimeoutExpired:
            record(dict(case=name, ok=False, error="timeout"))


if __name__ == "__main__":
    main()
