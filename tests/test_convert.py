"""Converter (original safetensors -> dsv41_jax Orbax) and dsv41_jax.checkpoint restore."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from convert import convert as cv
from convert import ConvertError, convert_checkpoint
from dsv41_jax import checkpoint as ck
from dsv41_jax.numerics import FAST_F32, REFERENCE_BF16
from dsv41_jax.safetensors_io import Checkpoint
from dsv41_jax.tiny import write_safetensors, write_tiny_checkpoint
from dsv41_jax.weights import load_original

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def _convert(src, dst, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("log", None)
    return convert_checkpoint(src, dst, **kw)


def _params(model) -> dict[str, np.ndarray]:
    """Every variable of the model (parameters and the Engram hasher's constants)."""
    from flax import nnx

    return {ck.path_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_bits(a: dict, b: dict):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or not np.array_equal(a[k].reshape(-1).view(np.uint8), b[k].reshape(-1).view(np.uint8))]
    assert not bad, bad


def _digest(d: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(d):
        h.update(k.encode() + str(d[k].dtype).encode() + str(d[k].shape).encode() + d[k].tobytes())
    return h.hexdigest()


def _read_all(src) -> dict[str, np.ndarray]:
    """Every tensor of an original-format dir, dtypes as on disk (E8M0 scales as float8_e8m0fnu)."""
    c = Checkpoint(src)
    out = {}
    for n in c.names:
        a = np.array(c.get(n))
        if c.info(n)[0] == "F8_E8M0":
            a = a.view(ml_dtypes.float8_e8m0fnu)
        out[n] = a
    return out


def _copy_meta(src, dst):
    os.makedirs(dst, exist_ok=True)
    for fn in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(src, fn), os.path.join(dst, fn))


def _write_sharded(src, dst, n_shards=3, extra=None):
    _copy_meta(src, dst)
    tensors = _read_all(src)
    tensors.update(extra or {})
    names = sorted(tensors)
    wm = {}
    for s in range(n_shards):
        fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::n_shards]}
        write_safetensors(os.path.join(dst, fn), part)
        wm.update({n: fn for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    fp8, bf16 = str(base / "fp8"), str(base / "bf16")
    write_tiny_checkpoint(fp8, fmt="fp8", seed=3)
    write_tiny_checkpoint(bf16, fmt="bf16", seed=3)
    out = str(base / "out_fp8")
    report = _convert(fp8, out)
    return {"base": base, "fp8": fp8, "bf16": bf16, "out": out, "report": report}


# ----------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------

def test_roundtrip_fp8_exact(tiny):
    rep = tiny["report"]
    assert rep["complete"] and rep["forms"]["fp8"] > 0 and rep["forms"]["fp4"] > 0 and rep["forms"]["raw"] == 2
    assert sorted(os.listdir(tiny["out"])) == sorted(["config.json", ck.META_FILE, "params", "tokenizer.json",
                                                      "engram_token_map.npy", "engram_token_map.npy.json"])
    for num in (REFERENCE_BF16, FAST_F32):
        ref = load_original(tiny["fp8"], num)
        got = ck.restore_model(tiny["out"], num)
        _assert_same_bits(_params(ref), _params(got))
        assert ck.quantized_flags(ref) == ck.quantized_flags(got)
        assert any(ck.quantized_flags(got).values())
    meta = ck.read_meta(tiny["out"])
    p = meta["params"]
    # bf16 only where exact; F32 source tensors stay fp32; engram tables stay fp8 + scale
    assert p["layers.0.attn.wq_a.weight"]["dtype"] == "bfloat16"
    assert p["layers.0.hc_attn_fn"]["dtype"] == "float32"
    assert p["layers.0.engram.embed.weight"]["dtype"] == "float8_e4m3fn"
    assert p["layers.0.engram.embed.scale"]["dtype"] == "uint8"
    assert p["layers.0.ffn.experts.w1.weight"]["shape"] == [6, 32, 64]
    assert p["vision.blocks.0.attn.wqkv.weight"]["group"] == "vision" and p["image_start"]["group"] == "vision"


def test_load_places_both_formats_alike(tiny):
    """``dsv41_jax.load`` commits an original-format checkpoint's weights to the device as the
    Orbax restore does: jit sees the same argument placements, so both formats compile the same
    programs and share persistent-cache entries (before session 11 the original format's
    uncommitted weights made different programs: the CLI's second generate compiled again)."""
    from flax import nnx

    import dsv41_jax

    placed = []
    for path in (tiny["fp8"], tiny["out"]):
        m = dsv41_jax.load(path, dtype="float32", numerics="fast", tokenizer=False).model
        placed.append([(p, v.get_value().committed, v.get_value().sharding)
                       for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))])
    assert placed[0] == placed[1]
    assert all(committed for _, committed, _ in placed[0])


def test_roundtrip_bf16_exact(tiny):
    out = str(tiny["base"] / "out_bf16")
    rep = _convert(tiny["bf16"], out)
    assert rep["forms"]["fp8"] == rep["forms"]["fp4"] == 0
    ref = load_original(tiny["bf16"], REFERENCE_BF16)
    got = ck.restore_model(out, REFERENCE_BF16)
    _assert_same_bits(_params(ref), _params(got))
    # bf16 source and the exact dequantization of the fp8 source are the same values
    fp8 = _params(ck.restore_model(tiny["out"], FAST_F32))
    bf = _params(ck.restore_model(out, FAST_F32))
    for k in bf:
        if "engram.embed" not in k:
            np.testing.assert_array_equal(bf[k], fp8[k], err_msg=k)


def test_int8_experts_lossless(tiny):
    out = str(tiny["base"] / "out_int8")
    _convert(tiny["fp8"], out, experts="int8")
    meta = ck.read_meta(out)
    w = meta["params"]["layers.3.ffn.experts.w2.weight"]
    s = meta["params"]["layers.3.ffn.experts.w2.scale"]
    assert (w["dtype"], w["encoding"], w["shape"]) == ("int8", "fp4x2_int8", [6, 64, 32])
    assert (s["dtype"], s["encoding"], s["shape"]) == ("uint8", "e8m0_per32", [6, 64, 1])
    ref = _params(load_original(tiny["fp8"], FAST_F32))
    got = _params(ck.restore_model(out, FAST_F32))
    assert set(ref) == set(got)
    for k in ref:  # equal values (fp4 code -0 comes back as +0)
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_text_only_and_save_model(tiny):
    out = str(tiny["base"] / "out_text")
    rep = _convert(tiny["fp8"], out, text_only=True)
    assert rep["dropped"]["vision"]["tensors"] > 0
    with pytest.raises(ck.CheckpointError, match="text_only=True"):
        ck.restore_model(out, REFERENCE_BF16)
    ref = load_original(tiny["fp8"], REFERENCE_BF16, text_only=True)
    _assert_same_bits(_params(ref), _params(ck.restore_model(out, REFERENCE_BF16, text_only=True)))
    # save_model of an in-memory model restores bit for bit
    saved = ck.save_model(ref, str(tiny["base"] / "saved"), tokenizer_dir=tiny["fp8"])
    back = ck.restore_model(saved, REFERENCE_BF16, text_only=True)
    _assert_same_bits(_params(ref), _params(back))
    assert ck.quantized_flags(back) == ck.quantized_flags(ref)


def test_golden_text_fast_fp32_verify(tmp_path):
    from dsv41_jax.verify import run_case

    case = os.path.join(GOLDEN, "text_fast_fp32")
    dst = str(tmp_path / "w")
    _convert(case, dst)
    _assert_same_bits(_params(load_original(case, FAST_F32)), _params(ck.restore_model(dst, FAST_F32)))
    res = run_case(case, ("prefill",), weights=dst, log=lambda s: None)
    assert res and all(r.ok for r in res), [(r.name, r.detail) for r in res if not r.ok]


def test_golden_image_fp8_exact(tmp_path):
    case = os.path.join(GOLDEN, "image_fp8")
    dst = str(tmp_path / "w")
    rep = _convert(case, dst)
    assert rep["forms"]["fp4"] > 0 and rep["forms"]["fp8"] > 0
    ref = load_original(case, REFERENCE_BF16)
    got = ck.restore_model(dst, REFERENCE_BF16)
    _assert_same_bits(_params(ref), _params(got))
    assert ck.quantized_flags(ref) == ck.quantized_flags(got)


# ----------------------------------------------------------------------------------------------
# sources: sharded index, mtp, faults
# ----------------------------------------------------------------------------------------------

def test_sharded_index_and_mtp_dropped(tiny):
    src = _write_sharded(tiny["fp8"], str(tiny["base"] / "sharded"), 3,
                         extra={"mtp.0.norm.weight": np.ones(64, ml_dtypes.bfloat16),
                                "mtp.0.head.weight": np.zeros((4, 64), ml_dtypes.bfloat16)})
    out = str(tiny["base"] / "out_sharded")
    from convert.__main__ import main

    assert main([src, out, "--no-progress", "--report", out + ".json"]) == 0
    with open(out + ".json") as f:
        rep = json.load(f)
    assert rep["dropped"]["mtp"]["tensors"] == 2 and "draft" in rep["dropped"]["mtp"]["why"]
    _assert_same_bits(_params(ck.restore_model(tiny["out"], REFERENCE_BF16)),
                      _params(ck.restore_model(out, REFERENCE_BF16)))


def test_corrupt_source_lists_every_problem(tiny):
    src = str(tiny["base"] / "bad")
    _copy_meta(tiny["fp8"], src)
    t = _read_all(tiny["fp8"])
    del t["layers.2.attn.wq_a.weight"]  # missing (its scale must not be reported as unexpected)
    t["layers.1.ffn.gate.weight"] = t["layers.1.ffn.gate.weight"][:, :32]  # wrong shape
    t["layers.0.attn_norm.weight"] = t["layers.0.attn_norm.weight"].astype(np.int32)  # wrong dtype
    nan = t["norm.weight"].copy()
    nan[5] = np.nan
    t["norm.weight"] = nan  # NaN
    t["layers.4.attn.wo_b.scale"] = t["layers.4.attn.wo_b.scale"][:1]  # scale of the wrong shape
    t["layers.0.attn.bogus.weight"] = np.zeros((2, 2), ml_dtypes.bfloat16)  # unexpected
    write_safetensors(os.path.join(src, "model.safetensors"), t)
    dst = str(tiny["base"] / "bad_out")
    with pytest.raises(ConvertError) as ei:
        _convert(src, dst)
    msg = str(ei.value)
    for s in ("missing tensor layers.2.attn.wq_a.weight", "tensor layers.1.ffn.gate.weight: shape [6, 32]",
              "tensor layers.0.attn_norm.weight: dtype I32", "tensor layers.4.attn.wo_b.scale: shape",
              "unexpected tensor layers.0.attn.bogus.weight"):
        assert s in msg, msg
    assert "layers.2.attn.wq_a.scale" not in msg
    assert not os.path.exists(dst) and not os.path.exists(dst + ".partial")
    # with the structure fixed, the NaN is reported before anything is written
    t["layers.2.attn.wq_a.weight"] = _read_all(tiny["fp8"])["layers.2.attn.wq_a.weight"]
    fixed = _read_all(tiny["fp8"])
    for k in ("layers.1.ffn.gate.weight", "layers.0.attn_norm.weight", "layers.4.attn.wo_b.scale"):
        t[k] = fixed[k]
    del t["layers.0.attn.bogus.weight"]
    t["layers.3.attn.wq_b.weight"] = t["layers.3.attn.wq_b.weight"].copy()
    t["layers.3.attn.wq_b.weight"].view(np.uint8)[0, 0] = 0x7F  # e4m3 NaN
    write_safetensors(os.path.join(src, "model.safetensors"), t)
    with pytest.raises(ConvertError) as ei:
        _convert(src, dst)
    assert "tensor norm.weight: 1 NaN/Inf" in str(ei.value) and "tensor layers.3.attn.wq_b.weight: 1 NaN" in str(ei.value)
    assert not os.path.exists(dst) and not os.path.exists(dst + ".partial")


def test_file_faults(tiny):
    base = tiny["base"] / "faults"
    cases = {}
    # truncated shard
    d = _write_sharded(tiny["fp8"], str(base / "trunc"), 2)
    p = os.path.join(d, "model-00002-of-00002.safetensors")
    os.truncate(p, os.path.getsize(p) - 100)
    cases["trunc"] = (d, "truncated shard")
    # corrupt header
    d = _write_sharded(tiny["fp8"], str(base / "header"), 2)
    with open(os.path.join(d, "model-00001-of-00002.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    cases["header"] = (d, "corrupt safetensors header")
    # a shard named in the index is missing
    d = _write_sharded(tiny["fp8"], str(base / "missing"), 2)
    os.unlink(os.path.join(d, "model-00002-of-00002.safetensors"))
    cases["missing"] = (d, "names shard model-00002-of-00002.safetensors")
    for name, (src, needle) in cases.items():
        dst = str(base / f"out_{name}")
        with pytest.raises(ConvertError, match=needle):
            _convert(src, dst)
        assert not os.path.exists(dst) and not os.path.exists(dst + ".partial"), name
    # destination not writable (its parent is a file)
    blocker = base / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConvertError, match="cannot write"):
        _convert(tiny["fp8"], str(blocker / "out"))
    # existing destination
    with pytest.raises(ConvertError, match="already exists"):
        _convert(tiny["fp8"], tiny["out"])


# ----------------------------------------------------------------------------------------------
# resumability and the atomic finish
# ----------------------------------------------------------------------------------------------

_KILL_SCRIPT = r"""
import os, signal, sys
from convert import convert as cv
real = cv.make_producer
def killing(p, src):  # SIGKILL in the middle of layer 2, after some of its arrays were written
    f = real(p, src)
    if p.key == "layers.2.ffn.experts.w2.weight":
        def die(a, b):
            os.kill(os.getpid(), signal.SIGKILL)
        return die
    return f
cv.make_producer = killing
cv.convert_checkpoint(sys.argv[1], sys.argv[2], progress=False, log=None)
"""


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")


def test_kill_resume_identical(tiny):
    dst = str(tiny["base"] / "resumed")
    part = dst + ".partial"
    r = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, tiny["fp8"], dst], capture_output=True, text=True,
                       env=_env(), timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    # nothing looks complete: no DST, no sidecar, layer_002 not finalized, restore refuses
    assert not os.path.exists(dst) and os.path.isdir(part)
    assert not os.path.exists(os.path.join(part, ck.META_FILE))
    assert not os.path.exists(os.path.join(part, "params", "layer_002"))
    with open(os.path.join(part, cv.MANIFEST)) as f:
        assert json.load(f)["done"] == ["top", "layer_000", "layer_000_engram_table", "layer_001",
                                        "layer_001_engram_table"]
    with pytest.raises(ck.CheckpointError, match="unfinished conversion"):
        ck.restore_model(part, REFERENCE_BF16)
    with pytest.raises(ck.CheckpointError, match="no such checkpoint"):
        ck.restore_model(dst, REFERENCE_BF16)
    with pytest.raises(ConvertError, match="--resume"):
        _convert(tiny["fp8"], dst)
    with pytest.raises(ConvertError, match="different source or with different options"):
        _convert(tiny["fp8"], dst, resume=True, dtype="float32")
    # a clean stop after one more group, then the rest
    rep = _convert(tiny["fp8"], dst, resume=True, max_groups=1)
    assert not rep["complete"] and rep["groups_done"] == 6 and not os.path.exists(dst)
    rep = _convert(tiny["fp8"], dst, resume=True)
    assert rep["complete"] and not os.path.exists(part)
    assert not os.path.exists(os.path.join(dst, cv.MANIFEST))
    a = _params(ck.restore_model(tiny["out"], REFERENCE_BF16))
    b = _params(ck.restore_model(dst, REFERENCE_BF16))
    assert _digest(a) == _digest(b)
    _assert_same_bits(a, b)


def test_error_while_writing_leaves_no_checkpoint(tiny):
    """Without the NaN pre-scan a non-finite value is caught while writing: a clear error, no DST."""
    src = str(tiny["base"] / "nan_late")
    _copy_meta(tiny["fp8"], src)
    t = _read_all(tiny["fp8"])
    t["layers.5.ffn.shared_experts.w2.weight"] = t["layers.5.ffn.shared_experts.w2.weight"].copy()
    t["layers.5.ffn.shared_experts.w2.weight"].view(np.uint8)[3, 3] = 0xFF
    write_safetensors(os.path.join(src, "model.safetensors"), t)
    dst = str(tiny["base"] / "nan_late_out")
    with pytest.raises(ConvertError, match="layers.5.ffn.shared_experts.w2.weight: NaN or Inf"):
        _convert(src, dst, check_finite=False)
    assert not os.path.exists(dst) and not os.path.exists(os.path.join(dst + ".partial", ck.META_FILE))


def test_dequant_kernels_match_quant():
    rng = np.random.default_rng(0)
    from dsv41_jax import quant

    w = rng.normal(0, 0.05, (300, 256)).astype(np.float32)
    for block in ((32, 32), (128, 128)):
        q, s = quant.quantize_fp8_blocks(w, block)
        ref = quant.dequant_fp8_blocks(q, s, block)
        for a, b in ((0, 300), (0, 128), (64, 200), (3, 77), (256, 300)):
            got = cv._dequant_fp8_rows(q[a:b], s[a // block[0]: -(-b // block[0])], a, block)
            assert np.array_equal(got.view(np.uint32), ref[a:b].view(np.uint32)), (block, a, b)
    q, s = quant.quantize_fp4_blocks(w)
    assert np.array_equal(cv._dequant_fp4(q, s).view(np.uint32), quant.dequant_fp4_experts(q, s).view(np.uint32))
    x = cv._dequant_fp4(q, s)
    assert np.array_equal(cv._to_out(x, cv._BF16, "x").view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    with pytest.raises(ConvertError, match="not exact in bfloat16"):
        cv._to_out(np.float32([1.0 + 2 ** -20]), cv._BF16, "x")


def test_plan_at_v41_flash_scale():
    """Validation and the write plan for the released V4.1-Flash inventory (headers only, no data)."""
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.tiny import tensor_inventory

    path = os.path.join(ROOT, "dsv41_jax", "presets", "v41_flash.json")
    with open(path) as f:
        raw = json.load(f)
    inv = tensor_inventory(raw)
    inv["mtp.0.ffn.experts.0.w1.weight"] = ("I8", (2304, 2560))
    src = cv.Source.virtual(inv)
    plan = cv.build_plan(src, ModelConfig.from_dict(raw), experts="int8")
    assert plan.dropped["mtp"]["tensors"] == 1
    n = sum(math.prod(p.shape) for p in plan.params if p.encoding not in ("e8m0", "e8m0_per32"))
    assert n == 748_979_953_264  # 552.4 B without the two Engram tables (196.6 B rows x 256)
    budget = 4 << 30
    slab = (budget - (768 << 20)) // 3
    worst = 0
    for p in plan.params:
        ch = ck.chunk_shape(p.shape, p.dtype.itemsize)
        assert math.prod(ch) * p.dtype.itemsize <= 2 * ck.CHUNK_BYTES, (p.key, ch)
        rows = cv.slab_rows_for(p, slab, ch)
        worst = max(worst, rows * math.prod(p.shape[1:]) * p.dtype.itemsize)
    assert worst <= slab


# ----------------------------------------------------------------------------------------------
# info, multi-device restore
# ----------------------------------------------------------------------------------------------

def test_info(tiny, capsys):
    d = ck.info(tiny["out"])
    model = load_original(tiny["fp8"], REFERENCE_BF16)
    params = {k: v[1].get_value() for k, v in ck.flat_params(model).items()}
    n_model = sum(v.size for v in params.values())
    n_scales = sum(v.size for k, v in params.items() if k.endswith("engram.embed.scale"))
    assert d["total_params"] == n_model - n_scales
    assert d["categories"]["routed_experts"]["params"] == 7 * 3 * 6 * 32 * 64
    assert "float8_e4m3fn" in d["dtypes"] and d["has_vision"] and d["engram_quantized"]
    from convert.__main__ import main

    assert main(["info", tiny["out"]]) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "7 layers" in out


_MESH_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np, jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dsv41_jax import checkpoint as ck
from dsv41_jax.numerics import REFERENCE_BF16
dst = sys.argv[1]
def values(m):
    return {ck.path_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m))}
one = values(ck.restore_model(dst, REFERENCE_BF16))
def same(m, what):
    got = values(m)
    assert set(got) == set(one), what
    for k, ref in one.items():
        g = got[k]
        if g.shape != ref.shape:  # rows zero-padded to a multiple of their split (Engram tables)
            assert not g[ref.shape[0]:].reshape(-1).view(np.uint8).any(), (what, k)
            g = g[: ref.shape[0]]
        assert g.dtype == ref.dtype and np.array_equal(g.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8)), (what, k)
devs = np.array(jax.devices())
for shape, names in (((2, 4), ("x", "y")),):
    mesh = Mesh(devs.reshape(shape), names)
    def rule(name, sds):
        spec = [ax if i < len(sds.shape) and sds.shape[i] % mesh.shape[ax] == 0 else None
                for i, ax in enumerate(names)][: len(sds.shape)]
        return NamedSharding(mesh, P(*spec))
    m = ck.restore_model(dst, REFERENCE_BF16, mesh=mesh, shardings=rule)
    flat = ck.flat_params(m)
    assert all(v.get_value().sharding == rule(k, v.get_value()) for k, (_, v) in flat.items())
    n_sharded = sum(not v.get_value().sharding.is_fully_replicated for _, v in flat.values())
    assert n_sharded > 100, n_sharded
    same(m, shape)
try:
    from dsv41_jax.sharding import make_mesh
except ImportError:
    make_mesh = None
if make_mesh is not None:  # the project's sharding rules (expert / tensor parallel)
    for d, e, t in ((1, 4, 2),):
        m = ck.restore_model(dst, REFERENCE_BF16, mesh=make_mesh(d, e, t))
        same(m, (d, e, t))
print("MESH_OK")
"""


def test_restore_on_meshes_identical(tiny):
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, tiny["out"]], capture_output=True, text=True,
                       env=_env(), timeout=300)
    assert "MESH_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
