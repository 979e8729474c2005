"""Original DeepSeek-V4.1 safetensors -> dsv41_jax Orbax checkpoint (streaming, exact, resumable).

``convert_checkpoint(src, dst)`` reads ``model.safetensors.index.json`` + shards (or the
``*.safetensors`` files of ``src``), checks every tensor against the model built from
``config.json`` (names, dtypes, shapes, scales, NaN/Inf: every problem listed in one error, before
anything is written), then writes one Orbax item per group (``top``, ``layer_NNN``, ``vision``)
into ``DST.partial/`` slab by slab, records each finished group in
``DST.partial/convert_manifest.json`` and finally renames ``DST.partial`` to ``DST``.

Exactness: fp8 (32x32 or the config's ``weight_block_size``) and fp4 experts are dequantized with
the exact codecs of ``dsv41_jax.quant``; a value is stored in bf16 only when bf16 holds it exactly
(tensors that are F32 in the source stay F32). Engram tables stay fp8 + ue8m0 scale. Routed experts
are stacked to ``[E, out, in]`` (or, with ``experts='int8'``, stored as int8 codes = 2 x the e2m1
value plus the per-32 scale bytes). With ``dense='fp8'`` the decoder's fp8 Linear weights keep
their e4m3 codes, with the 32x32 block scale bytes repeated along ``out`` (``[out, in/32]``, the
in-memory layout of ``Linear.set_fp8``). ``mtp.*`` (draft layers) is dropped and reported.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from typing import Callable

import ml_dtypes
import numpy as np

from dsv41_jax import checkpoint as ckpt
from dsv41_jax import quant
from dsv41_jax.safetensors_io import DTYPES, SafetensorsError, read_header

MANIFEST = "convert_manifest.json"
TOKEN_MAP_FILE = "engram_token_map.npy"  # dsv41_jax.engram_hash.TOKEN_MAP_FILE
PARTIAL_SUFFIX = ".partial"
CONVERTER_VERSION = 1

FLOAT_DTYPES = ("BF16", "F16", "F32")
SCALE_DTYPES = ("F8_E8M0", "U8")
FP4_DTYPES = ("I8", "U8")
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_U8 = np.dtype(np.uint8)
_I8 = np.dtype(np.int8)
# int8 expert codes: 2 x the e2m1 value of each 4-bit code (sign in bit 3; -0 becomes 0)
FP4_X2_CODES = (quant.FP4_LUT * 2).astype(np.int8)

_MTP_RE = re.compile(r"^mtp\.")
_VISION_RE = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)")
_STACKED_RE = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(w[123])\.weight$")
_ENGRAM_TABLE_RE = re.compile(r"\.engram\.embed\.weight$")


class ConvertError(ValueError):
    """The conversion cannot proceed; the message lists every problem found."""


def _problems_error(title: str, problems: list[str]) -> ConvertError:
    return ConvertError(f"{title} ({len(problems)} problem(s)):\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------
# source: safetensors index + shards, read with pread (no memory map: RSS stays bounded)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SrcTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])


class Source:
    """All tensors of an original-format checkpoint directory. File-level problems (missing or
    truncated shard, corrupt header, index/shard disagreement) are collected in ``problems``."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        self.tensors: dict[str, SrcTensor] = {}
        self.problems: list[str] = []
        self.files: list[str] = []
        self._fds: dict[str, int] = {}
        if not os.path.isdir(self.directory):
            raise ConvertError(f"source {directory}: no such directory")
        idx = os.path.join(self.directory, "model.safetensors.index.json")
        self.index_path = idx if os.path.exists(idx) else None
        if self.index_path:
            try:
                with open(idx) as f:
                    wm = json.load(f)["weight_map"]
                if not isinstance(wm, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConvertError(f"{idx}: cannot read the index ({type(e).__name__}: {e})") from None
            by_file: dict[str, list[str]] = {}
            for name, fn in wm.items():
                by_file.setdefault(fn, []).append(name)
            for fn in sorted(by_file):
                p = os.path.join(self.directory, fn)
                if not os.path.exists(p):
                    self.problems.append(f"the index names shard {fn} ({len(by_file[fn])} tensors), which does not exist")
                    continue
                header = self._open(p)
                if header is None:
                    continue
                for name in sorted(by_file[fn]):
                    if name not in header:
                        self.problems.append(f"the index maps tensor {name} to shard {fn}, which does not contain it")
                for name in sorted(set(header) - set(by_file[fn])):
                    self.problems.append(f"shard {fn} holds tensor {name}, which the index does not list")
        else:
            files = sorted(x for x in os.listdir(self.directory) if x.endswith(".safetensors"))
            if not files:
                raise ConvertError(f"source {directory}: no model.safetensors.index.json and no *.safetensors file")
            for fn in files:
                self._open(os.path.join(self.directory, fn))

    def _open(self, path: str) -> dict | None:
        fn = os.path.basename(path)
        try:
            header, start = read_header(path)
        except SafetensorsError as e:
            self.problems.append(f"shard {fn}: {str(e).replace(path + ': ', '')}")
            return None
        except (OSError, ValueError) as e:
            self.problems.append(f"shard {fn}: cannot read the header ({type(e).__name__}: {e})")
            return None
        self.files.append(path)
        size = os.path.getsize(path)
        for name, h in header.items():
            try:
                dt, shape, (a, b) = h["dtype"], tuple(int(x) for x in h["shape"]), h["data_offsets"]
            except (KeyError, TypeError, ValueError):
                self.problems.append(f"shard {fn}: corrupt header entry for tensor {name}")
                continue
            if name in self.tensors:
                self.problems.append(f"tensor {name} is in both {os.path.basename(self.tensors[name].path)} and {fn}")
                continue
            if dt not in DTYPES:
                self.problems.append(f"tensor {name} ({fn}): unsupported dtype {dt}")
                continue
            n = math.prod(shape) * np.dtype(DTYPES[dt]).itemsize
            if b - a != n or a < 0:
                self.problems.append(f"tensor {name} ({fn}): header gives {b - a} bytes for {dt} {list(shape)} ({n} bytes)")
                continue
            if start + b > size:
                self.problems.append(f"tensor {name} ({fn}): data ends at byte {start + b} but the file has {size} bytes "
                                     "(truncated shard?)")
                continue
            self.tensors[name] = SrcTensor(name, dt, shape, path, start + a, n)
        return header

    @classmethod
    def virtual(cls, tensors: dict, directory: str = "<virtual>") -> "Source":
        """A header-only source (name -> (safetensors dtype, shape)) for planning and checks at
        any scale without data; reading from it fails."""
        self = cls.__new__(cls)
        self.directory, self.index_path = directory, None
        self.problems, self.files, self._fds = [], [], {}
        self.tensors = {n: SrcTensor(n, dt, tuple(sh), "", 0, math.prod(sh) * np.dtype(DTYPES[dt]).itemsize)
                        for n, (dt, sh) in tensors.items()}
        return self

    # ------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def fingerprint(self) -> dict:
        h = hashlib.sha256()
        for fn in ("config.json", "model.safetensors.index.json"):
            p = os.path.join(self.directory, fn)
            if os.path.exists(p):
                with open(p, "rb") as f:
                    h.update(fn.encode() + b"\0" + f.read())
        files = []
        for p in sorted(self.files):
            st = os.stat(p)
            files.append([os.path.basename(p), st.st_size, st.st_mtime_ns])
        return {"config_and_index_sha256": h.hexdigest(), "files": files}

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read_bytes(self, t: SrcTensor, start: int, n: int) -> np.ndarray:
        buf = np.empty(n, np.uint8)
        mv = memoryview(buf)
        fd = self._fd(t.path)
        got = 0
        while got < n:
            k = os.preadv(fd, [mv[got:]], t.offset + start + got)
            if k <= 0:
                raise ConvertError(f"tensor {t.name}: unexpected end of file in {os.path.basename(t.path)}")
            got += k
        return buf

    def read(self, name: str, a: int | None = None, b: int | None = None) -> np.ndarray:
        """Rows [a, b) of tensor ``name`` along axis 0 (the whole tensor by default), raw dtype."""
        t = self.tensors[name]
        dt = t.np_dtype
        if not t.shape:
            return self.read_bytes(t, 0, t.nbytes).view(dt).reshape(())
        a = 0 if a is None else a
        b = t.shape[0] if b is None else b
        row = math.prod(t.shape[1:]) * dt.itemsize
        return self.read_bytes(t, a * row, (b - a) * row).view(dt).reshape((b - a,) + t.shape[1:])

    def close(self):
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


# ----------------------------------------------------------------------------------------------
# exact value conversion
# ----------------------------------------------------------------------------------------------

def _nonfinite_f32(x: np.ndarray) -> bool:
    return bool(np.any((x.view(np.uint32) & 0x7F800000) == 0x7F800000))


def _to_out(x: np.ndarray, out: np.dtype, name: str, safe: bool = False) -> np.ndarray:
    """float32 ``x`` -> ``out`` (float32 or bfloat16), refusing NaN/Inf and any rounding.

    ``safe``: the caller knows every value is finite and exact in bf16 (block scales in range)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not safe and _nonfinite_f32(x):
        raise ConvertError(f"tensor {name}: NaN or Inf after dequantization")
    if out == _F32:
        return x
    if not safe and np.any(x.view(np.uint32) & 0xFFFF):
        raise ConvertError(f"tensor {name}: dequantized values are not exact in bfloat16; convert with --dtype float32")
    # bf16 = the high half of each little-endian fp32 word (exact here)
    return np.ascontiguousarray(x.view(np.uint16).reshape(x.shape + (2,))[..., 1]).view(_BF16)


# A scale byte s in this range keeps every e4m3 value x 2^(s-127) normal, finite and exact in bf16
# (e4m3 spans 2^-9 .. 448); for e2m1 (0.5 .. 6) the range is wider.
_FP8_SAFE_SCALES = (10, 246)
_FP4_SAFE_SCALES = (2, 252)
# byte -> (value of the low nibble, value of the high nibble): element 2c is the low nibble
_FP4_PAIRS_U64 = np.ascontiguousarray(np.stack(
    [quant.FP4_LUT[np.arange(256) & 0x0F], quant.FP4_LUT[np.arange(256) >> 4]], axis=-1).astype(np.float32)
).view(np.uint64).ravel()


def _in(sc: np.ndarray, lo_hi: tuple[int, int]) -> bool:
    u = sc.view(np.uint8)
    return bool(u.size == 0 or (int(u.min()) >= lo_hi[0] and int(u.max()) <= lo_hi[1]))


_E4M3_LUT = quant.e4m3_to_f32(np.arange(256, dtype=np.uint8))  # byte -> fp32 value (exact)


def _dequant_fp8_rows(w: np.ndarray, sc: np.ndarray, row0: int, block: tuple[int, int]) -> np.ndarray:
    """e4m3 rows ``w`` (starting at row ``row0`` of the weight) times their block scales ``sc``
    (scale rows starting at ``row0 // Bo``); the values of ``quant.dequant_fp8_blocks``."""
    bo, bi = block
    rows, cols = w.shape
    v = np.take(_E4M3_LUT, w.view(np.uint8))
    s = quant.e8m0_to_f32(sc)
    off = row0 - (row0 // bo) * bo
    if off == 0 and rows % bo == 0 and cols % bi == 0:
        vv = v.reshape(rows // bo, bo, cols // bi, bi)
        vv *= s[: rows // bo, None, : cols // bi, None]
        return v
    s = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)
    v *= s[off:off + rows, :cols]
    return v


def _dequant_fp4(w: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """Packed e2m1 ``[o, i/2]`` with per-32 scales ``[o, i/32]`` -> float32 ``[o, i]`` (the values
    of ``quant.dequant_fp4_experts``, computed with a byte -> value-pair table)."""
    o, half = w.shape
    v = np.take(_FP4_PAIRS_U64, w.view(np.uint8)).view(np.float32).reshape(o, half * 2 // 32, 32)
    v *= quant.e8m0_to_f32(sc)[..., None]
    return v.reshape(o, half * 2)


def _fp8_nan(w: np.ndarray) -> bool:
    return bool(np.any((w.view(np.uint8) & 0x7F) == 0x7F))


def _nonfinite_raw(arr: np.ndarray, dtype: str) -> int:
    """Count NaN/Inf encodings in raw source data of safetensors dtype ``dtype``."""
    if dtype == "BF16":
        return int(np.count_nonzero((arr.view(np.uint16) & 0x7F80) == 0x7F80))
    if dtype == "F16":
        return int(np.count_nonzero((arr.view(np.uint16) & 0x7C00) == 0x7C00))
    if dtype == "F32":
        return int(np.count_nonzero((arr.view(np.uint32) & 0x7F800000) == 0x7F800000))
    if dtype == "F64":
        return int(np.count_nonzero((arr.view(np.uint64) & 0x7FF0000000000000) == 0x7FF0000000000000))
    if dtype == "F8_E4M3":
        return int(np.count_nonzero((arr.view(np.uint8) & 0x7F) == 0x7F))
    if dtype == "F8_E5M2":
        return int(np.count_nonzero((arr.view(np.uint8) & 0x7C) == 0x7C))
    if dtype == "F8_E8M0":
        return int(np.count_nonzero(arr.view(np.uint8) == 0xFF))
    return 0


# ----------------------------------------------------------------------------------------------
# plan: what to write, from which tensors
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ParamPlan:
    key: str  # NNX flat path (dot-joined)
    group: str
    shape: tuple[int, ...]  # stored shape
    dtype: np.dtype  # stored dtype
    encoding: str  # float | e4m3 | e8m0 | fp4x2_int8 | e8m0_per32 | fp8_e4m3 | e8m0_rows
    form: str  # plain | fp8 | raw | experts-{plain,fp8,fp4} | codes | codes-scale | fp8-codes | fp8-scale
    sources: list[str]
    scales: list[str]
    block: tuple[int, int] = (32, 32)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Plan:
    params: list[ParamPlan]
    flags: dict[str, bool]
    engram_quantized: bool
    has_vision: bool
    text_only: bool
    dtype: str
    experts: str
    block: tuple[int, int]
    dense: str
    dropped: dict
    forms: dict
    notes: list[str]
    consumed: set

    def source_names(self) -> list[str]:
        """Every source tensor read by the conversion."""
        return sorted({n for p in self.params for n in p.sources + p.scales})

    def groups(self) -> dict[str, list[ParamPlan]]:
        out: dict[str, list[ParamPlan]] = {}
        for p in self.params:
            out.setdefault(p.group, []).append(p)
        return {g: out[g] for g in ckpt.group_order(out)}


def _aggregate(names: list[str]) -> list[str]:
    """Collapse per-expert names: layers.0.ffn.experts.{6,7}.w1.weight -> one line with a count."""
    groups: dict[str, list[int]] = {}
    order = []
    for n in names:
        m = re.match(r"^(.*\.experts)\.(\d+)\.(.*)$", n)
        key = f"{m.group(1)}.*.{m.group(3)}" if m else n
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m:
            groups[key].append(int(m.group(2)))
    out = []
    for k in order:
        ids = groups[k]
        if len(ids) > 1:
            out.append(f"{k} (experts {min(ids)}..{max(ids)}, {len(ids)} tensors)")
        elif ids:
            out.append(k.replace(".*.", f".{ids[0]}.", 1))
        else:
            out.append(k)
    return out


def check_tokenizer(directory: str, cfg, token_map_cache: str | None = None) -> list[str]:
    """The Engram layers need the tokenizer: it must exist and give the config's
    ``engram_compressed_vocab_size``. Builds the compressed token map (cached at
    ``token_map_cache`` when given). Returns problems."""
    if not cfg.text.engram_layer_ids:
        return []
    tok = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tok):
        return ["no tokenizer.json: the Engram layers need it (compressed token map)"]
    from dsv41_jax.engram_hash import load_or_build_token_map

    try:
        load_or_build_token_map(tok, cfg.text.vocab_size, token_map_cache,
                                compressed_vocab_size=cfg.text.engram_compressed_vocab_size)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a validation problem
        return [f"tokenizer.json: {e}"]
    return []


def build_plan(src: Source, cfg, *, dtype: str = "bf16", experts: str | None = None,
               text_only: bool = False, token_map_cache: str | None = None, dense: str | None = None) -> Plan:
    """Map every model parameter to its source tensors and check everything (names, dtypes,
    shapes, scales, config agreement, the tokenizer of the Engram layers unless the source is
    virtual). ``dense='fp8'`` keeps fp8 Linear weights as codes + row scales. Raises one
    ConvertError listing every problem."""
    from dsv41_jax.numerics import Numerics

    out_dtype = _BF16 if dtype == "bf16" else _F32
    experts = experts or dtype
    problems: list[str] = list(src.problems)
    if os.path.isdir(src.directory):
        problems += check_tokenizer(src.directory, cfg, token_map_cache)
    notes: list[str] = []
    names = set(src.names)
    vision_cfg = cfg.vision is not None
    build_vision = vision_cfg and not text_only
    block = tuple(int(x) for x in cfg.quant.weight_block_size) if cfg.quant is not None else (32, 32)
    bo, bi = block
    eq = any(n.endswith(".engram.embed.scale") for n in names)
    model = ckpt.abstract_model(cfg, Numerics("float32", "fast"), engram_quantized=eq, text_only=not build_vision)
    flags = {}
    linear_names = set()
    from dsv41_jax.model.moe import Experts

    for name, mod in ckpt.quantizable_modules(model):
        if isinstance(mod, Experts):
            flags[name] = f"{name}.0.w1.scale" in names
        else:
            linear_names.add(name)
            flags[name] = f"{name}.scale" in names and not name.endswith("attn.wo_a")
    consumed: set[str] = set()
    params: list[ParamPlan] = []
    forms = {"plain": 0, "fp8": 0, "fp4": 0, "raw": 0}

    def check_float(name, shape):
        t = src.tensors[name]
        ok = True
        if t.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name}: dtype {t.dtype}, expected one of {'/'.join(FLOAT_DTYPES)}")
            ok = False
        if t.shape != tuple(shape):
            problems.append(f"tensor {name}: shape {list(t.shape)}, expected {list(shape)} (from config.json)")
            ok = False
        return ok

    def check_scale(name, shape, what):
        if name not in src:
            problems.append(f"missing tensor {name} (the {what} scale, F8_E8M0 {list(shape)})")
            return False
        t = src.tensors[name]
        ok = True
        if t.dtype not in SCALE_DTYPES:
            problems.append(f"tensor {name}: dtype {t.dtype}, expected F8_E8M0")
            ok = False
        if t.shape != tuple(shape):
            problems.append(f"tensor {name}: shape {list(t.shape)}, expected {list(shape)}")
            ok = False
        return ok

    def fp8_scale_shape(o, i):
        return (-(-o // bo), -(-i // bi))

    def plain_out(t: SrcTensor, want: np.dtype) -> np.dtype:
        # bf16 only when the source is bf16 (exact); F16/F32 sources stay float32
        return _BF16 if (want == _BF16 and t.dtype == "BF16") else _F32

    def classify(name: str, shape: tuple, allow_fp4: bool) -> str | None:
        """Form of a 2-D weight: plain / fp8 / fp4, after checking it (None if broken)."""
        t = src.tensors[name]
        sname = name[: -len("weight")] + "scale"
        if t.dtype == "F8_E4M3":
            ok = t.shape == tuple(shape)
            if not ok:
                problems.append(f"tensor {name}: shape {list(t.shape)}, expected {list(shape)} (from config.json)")
            ok &= check_scale(sname, fp8_scale_shape(*shape), f"fp8 {bo}x{bi} block")
            consumed.add(sname)
            return "fp8" if ok else None
        if t.dtype in FP4_DTYPES and allow_fp4:
            o, i = shape
            ok = True
            if i % 32:
                problems.append(f"tensor {name}: fp4 input dim {i} is not a multiple of 32")
                return None
            if t.shape != (o, i // 2):
                problems.append(f"tensor {name}: shape {list(t.shape)}, expected {[o, i // 2]} (fp4: two codes per byte)")
                ok = False
            ok &= check_scale(sname, (o, i // 32), "fp4 per-32")
            consumed.add(sname)
            return "fp4" if ok else None
        if sname in src:
            problems.append(f"tensor {name}: dtype {t.dtype} with a scale tensor {sname}; expected F8_E4M3"
                            + (" or I8 (fp4)" if allow_fp4 else ""))
            consumed.add(sname)
            return None
        return "plain" if check_float(name, shape) else None

    flat = ckpt.flat_params(model)
    for key, (_, var) in flat.items():
        if eq and key.endswith(".engram.embed.scale"):
            continue  # planned together with its table
        sds = var.get_value()
        shape = tuple(sds.shape)
        group = ckpt.group_of(key)
        m = _STACKED_RE.match(key)
        if m:
            prefix, w = m.group(1), m.group(2)
            E, o, i = shape
            srcs = [f"{prefix}.{e}.{w}.weight" for e in range(E)]
            scs = [f"{prefix}.{e}.{w}.scale" for e in range(E)]
            missing = [s for s in srcs if s not in src]
            consumed.update(scs)
            if missing:
                problems.append(f"missing tensor {missing[0]} (expected per-expert [{o}, {i}])"
                                + (f" and {len(missing) - 1} more experts of {prefix}.*.{w}" if len(missing) > 1 else ""))
                consumed.update(s for s in srcs if s in src)
                continue
            kinds = {}
            for s in srcs:
                kinds[s] = classify(s, (o, i), True)
                consumed.add(s)
            if any(k is None for k in kinds.values()):
                continue
            distinct = sorted(set(kinds.values()))
            if len(distinct) > 1:
                problems.append(f"{prefix}.*.{w}: experts are stored in mixed formats ({', '.join(distinct)}); "
                                "they must all share one format to be stacked")
                continue
            form = distinct[0]
            if cfg.quant is not None and form != "plain" and form != cfg.quant.expert_dtype:
                problems.append(f"{prefix}.*.{w}: experts are {form} but config.json quantization_config.expert_dtype "
                                f"is {cfg.quant.expert_dtype!r}")
                continue
            forms[form] += E
            if experts == "int8":
                if form != "fp4":
                    problems.append(f"{prefix}.*.{w}: --experts int8 needs fp4 experts in the source, found {form}")
                    continue
                params.append(ParamPlan(key, group, shape, _I8, "fp4x2_int8", "codes", srcs, scs))
                params.append(ParamPlan(f"{prefix}.{w}.scale", group, (E, o, i // 32), _U8, "e8m0_per32",
                                        "codes-scale", srcs, scs))
            else:
                want = _BF16 if experts == "bf16" else _F32
                od = plain_out(src.tensors[srcs[0]], want) if form == "plain" else want
                params.append(ParamPlan(key, group, shape, od, "float", f"experts-{form}", srcs,
                                        scs if form != "plain" else [], block))
            continue
        if _ENGRAM_TABLE_RE.search(key) and eq:
            sname = key[: -len("weight")] + "scale"
            if key not in src:
                problems.append(f"missing tensor {key} (Engram table, F8_E4M3 {list(shape)})")
                continue
            t = src.tensors[key]
            consumed.add(key)
            consumed.add(sname)
            ok = True
            if t.dtype != "F8_E4M3":
                problems.append(f"tensor {key}: dtype {t.dtype}, expected F8_E4M3 (the other Engram tables are fp8)")
                ok = False
            if t.shape != shape:
                problems.append(f"tensor {key}: shape {list(t.shape)}, expected {list(shape)} "
                                "(rows = engram_num_embeddings from config.json)")
                ok = False
            ok &= check_scale(sname, (shape[0], shape[1] // 32), "Engram per-32")
            if ok:
                forms["raw"] += 1
                params.append(ParamPlan(key, group, shape, _E4M3, "e4m3", "raw", [key], []))
                params.append(ParamPlan(sname, group, (shape[0], shape[1] // 32), _U8, "e8m0", "raw", [sname], []))
            continue
        if key not in src:
            problems.append(f"missing tensor {key} (expected {list(shape)})")
            if key.endswith(".weight"):
                consumed.add(key[: -len("weight")] + "scale")  # its scale is not 'unexpected'
            continue
        consumed.add(key)
        mod = key[: -len(".weight")] if key.endswith(".weight") else None
        if mod is not None and mod in linear_names and len(shape) == 2:
            form = classify(key, shape, False)
        else:
            form = "plain" if check_float(key, shape) else None
            sname = key[: -len("weight")] + "scale" if key.endswith(".weight") else None
            if form and sname and sname in src:
                problems.append(f"tensor {key}: has a scale tensor {sname} but this weight is never quantized")
                consumed.add(sname)
                form = None
        if form is None:
            continue
        forms[form] += 1
        if form == "fp8" and dense == "fp8" and not _VISION_RE.match(key) and shape[1] % 32 == 0 and bi % 32 == 0:
            # (a Linear whose inputs do not split into groups of 32 stays dequantized, as in load_original)
            o, i = shape
            sname = key[: -len("weight")] + "scale"
            params.append(ParamPlan(key, group, shape, _E4M3, ckpt.FP8_WEIGHT_ENC, "fp8-codes", [key], [sname], block))
            params.append(ParamPlan(sname, group, (o, i // 32), _U8, ckpt.FP8_SCALE_ENC, "fp8-scale", [key], [sname],
                                    block))
            continue
        if form == "plain":
            params.append(ParamPlan(key, group, shape, plain_out(src.tensors[key], out_dtype), "float", "plain", [key], []))
        else:
            params.append(ParamPlan(key, group, shape, out_dtype, "float", "fp8", [key],
                                    [key[: -len("weight")] + "scale"], block))

    # tensors the model does not take
    dropped = {}
    mtp = [n for n in names if _MTP_RE.match(n)]
    if mtp:
        dropped["mtp"] = {"tensors": len(mtp), "bytes": sum(src.tensors[n].nbytes for n in mtp),
                          "why": "draft (MTP) layers are not part of the dsv41_jax model"}
        consumed.update(mtp)
    vis = [n for n in names if _VISION_RE.match(n)]
    if vis and not build_vision:
        if vision_cfg:
            dropped["vision"] = {"tensors": len(vis), "bytes": sum(src.tensors[n].nbytes for n in vis),
                                 "why": "text-only conversion"}
            consumed.update(vis)
        else:
            problems.append(f"{len(vis)} vision/aligner/image tensors (e.g. {sorted(vis)[0]}) but config.json has no "
                            "vision_config")
            consumed.update(vis)
    unexpected = sorted(n for n in names - consumed)
    for line in _aggregate(unexpected):
        problems.append(f"unexpected tensor {line} (not part of the model described by config.json)")
    # config vs tensors
    fp8_names = [n for n in names if src.tensors[n].dtype == "F8_E4M3" and not n.startswith("mtp.")]
    if fp8_names and cfg.quant is None:
        problems.append(f"{len(fp8_names)} tensors are F8_E4M3 (e.g. {sorted(fp8_names)[0]}) but config.json has no "
                        "quantization_config (its weight_block_size is needed to read them)")
    if cfg.quant is not None and forms["fp8"] + forms["fp4"] == 0:
        notes.append("config.json has a quantization_config but no weight is stored quantized")
    if dense == "fp8" and not any(p.encoding == ckpt.FP8_WEIGHT_ENC for p in params):
        problems.append("--dense fp8 needs fp8 (F8_E4M3 + .scale) Linear weights in the source; found none")
    if problems:
        raise _problems_error(f"source {src.directory} does not match the model", problems)
    return Plan(params=params, flags=flags, engram_quantized=eq, has_vision=build_vision and bool(vis),
                text_only=text_only, dtype=dtype, experts=experts, block=block, dropped=dropped, forms=forms,
                notes=notes, consumed=consumed, dense=dense or "dequantized")


def scan_nonfinite(src: Source, names, *, chunk_bytes: int = 64 << 20, on_bytes: Callable[[int], None] | None = None
                   ) -> list[str]:
    """NaN/Inf (and 0xFF scale bytes) in the raw source data: one line per bad tensor."""
    problems = []
    for name in sorted(names):
        t = src.tensors[name]
        if t.dtype in ("I8", "U8", "I16", "I32", "I64", "BOOL"):
            if on_bytes:
                on_bytes(t.nbytes)
            continue
        bad = 0
        for a in range(0, t.nbytes, chunk_bytes):
            n = min(chunk_bytes, t.nbytes - a)
            bad += _nonfinite_raw(src.read_bytes(t, a, n), t.dtype)
            if on_bytes:
                on_bytes(n)
        if bad:
            what = "NaN scale byte(s) 0xFF" if t.dtype == "F8_E8M0" else "NaN/Inf value(s)"
            problems.append(f"tensor {name}: {bad} {what}")
    return problems


# ----------------------------------------------------------------------------------------------
# producing slabs
# ----------------------------------------------------------------------------------------------

def make_producer(p: ParamPlan, src: Source) -> Callable[[int, int], np.ndarray]:
    if p.form == "plain":
        def produce(a, b):
            x = src.read(p.sources[0], a, b)
            if x.dtype == p.dtype:
                if _nonfinite_raw(x, src.tensors[p.sources[0]].dtype):
                    raise ConvertError(f"tensor {p.sources[0]}: NaN or Inf")
                return x
            return _to_out(x.astype(np.float32), p.dtype, p.key)
        return produce
    if p.form == "raw":
        def produce(a, b):
            x = src.read(p.sources[0], a, b)
            return x.view(np.uint8).view(p.dtype)
        return produce
    if p.form == "fp8-codes":
        def produce(a, b):
            w = src.read(p.sources[0], a, b)
            if _fp8_nan(w):
                raise ConvertError(f"tensor {p.sources[0]}: NaN")
            return w.view(np.uint8).view(_E4M3)
        return produce
    if p.form == "fp8-scale":
        bo, bi = p.block

        def produce(a, b):
            sc = src.read(p.scales[0], a // bo, -(-b // bo)).view(np.uint8)
            if not _in(sc, _FP8_SAFE_SCALES):
                raise ConvertError(f"tensor {p.scales[0]}: scale bytes outside {_FP8_SAFE_SCALES[0]}.."
                                   f"{_FP8_SAFE_SCALES[1]}, where fp8 storage is exact; convert without --dense fp8")
            off = a - (a // bo) * bo
            rows = np.repeat(sc, bo, axis=0)[off:off + (b - a)]
            return np.ascontiguousarray(np.repeat(rows, bi // 32, axis=1)[:, : p.shape[1]])
        return produce
    if p.form == "fp8":
        bo, _ = p.block

        def produce(a, b):
            w = src.read(p.sources[0], a, b)
            sc = src.read(p.scales[0], a // bo, -(-b // bo))
            safe = _in(sc, _FP8_SAFE_SCALES) and not _fp8_nan(w)
            return _to_out(_dequant_fp8_rows(w, sc, a, p.block), p.dtype, p.key, safe)
        return produce

    def expert_value(e: int) -> tuple[np.ndarray, bool]:
        w = src.read(p.sources[e])
        if p.form == "experts-plain":
            return w.astype(np.float32), False
        sc = src.read(p.scales[e])
        if p.form == "experts-fp8":
            return _dequant_fp8_rows(w, sc, 0, p.block), _in(sc, _FP8_SAFE_SCALES) and not _fp8_nan(w)
        return _dequant_fp4(w, sc), _in(sc, _FP4_SAFE_SCALES)

    if p.form.startswith("experts-"):
        def produce(a, b):
            out = np.empty((b - a,) + p.shape[1:], p.dtype)
            for e in range(a, b):
                v, safe = expert_value(e)
                out[e - a] = _to_out(v, p.dtype, p.sources[e], safe)
            return out
        return produce
    if p.form == "codes":
        def produce(a, b):
            out = np.empty((b - a,) + p.shape[1:], np.int8)
            for e in range(a, b):
                out[e - a] = FP4_X2_CODES[quant.fp4_codes(src.read(p.sources[e]))]
            return out
        return produce
    if p.form == "codes-scale":
        def produce(a, b):
            out = np.empty((b - a,) + p.shape[1:], np.uint8)
            for e in range(a, b):
                out[e - a] = src.read(p.scales[e]).view(np.uint8)
            return out
        return produce
    raise AssertionError(p.form)


def _work_per_row(p: ParamPlan) -> int:
    """Peak bytes of temporaries per output row while producing a slab (f32 value, expanded
    scale, product)."""
    row = math.prod(p.shape[1:])
    if p.form in ("plain", "raw", "codes-scale", "fp8-codes", "fp8-scale"):
        return row * (p.dtype.itemsize + 4)
    if p.form.startswith("experts-") or p.form == "codes":
        return row * p.dtype.itemsize  # one expert's temporaries are added once, not per row
    return row * 14


def slab_rows_for(p: ParamPlan, slab_bytes: int, chunks: tuple[int, ...]) -> int:
    per_row = max(1, math.prod(p.shape[1:]) * p.dtype.itemsize + _work_per_row(p))
    c0 = chunks[0]
    rows = max(c0, (slab_bytes // per_row) // c0 * c0)
    return min(rows, p.shape[0])


# ----------------------------------------------------------------------------------------------
# the conversion
# ----------------------------------------------------------------------------------------------

def _normalize_dtype(d: str) -> str:
    d = (d or "bf16").lower()
    if d in ("bf16", "bfloat16"):
        return "bf16"
    if d in ("float32", "fp32", "f32"):
        return "float32"
    raise ConvertError(f"--dtype {d!r}: choose bf16 or float32")


def _normalize_dense(d: str | None) -> str:
    d = (d or "dequantized").lower()
    if d not in ("dequantized", "fp8"):
        raise ConvertError(f"--dense {d!r}: choose dequantized (stored in --dtype) or fp8")
    return d


def _normalize_experts(e: str | None, dtype: str) -> str:
    if e is None:
        return dtype
    e = e.lower()
    if e == "int8":
        return "int8"
    return _normalize_dtype(e)


def _rmtree(path: str):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _check_writable(dst: str):
    parent = os.path.dirname(dst) or "."
    try:
        os.makedirs(parent, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=".dsv41-convert-probe-", dir=parent)
        os.rmdir(probe)
    except OSError as e:
        raise ConvertError(f"destination {dst}: cannot write into {parent} ({e.strerror or e})") from None


def convert_checkpoint(src: str, dst: str, *, dtype: str = "bf16", experts: str | None = None,
                       dense: str | None = None, max_memory: str | int = "4GB", resume: bool = False, overwrite: bool = False,
                       text_only: bool = False, check_finite: bool = True, compress: bool = False,
                       progress: bool = True, max_groups: int | None = None, dry_run: bool = False,
                       log: Callable[[str], None] | None = print) -> dict:
    """Convert an original DeepSeek-V4.1 checkpoint directory ``src`` into a dsv41_jax Orbax
    checkpoint at ``dst``. Returns the conversion report (also stored in the sidecar).

    ``dtype``: bf16 (default) or float32 for dequantized / dense weights (F32 source tensors
    always stay float32); ``experts``: bf16 / float32 / int8 (default: ``dtype``); ``dense``: fp8
    keeps the fp8 Linear weights as e4m3 codes + ue8m0 row scales (default: dequantized, in ``dtype``);
    ``max_memory``: host memory budget ('4GB'); ``resume``: continue ``dst.partial``;
    ``overwrite``: replace an existing ``dst`` once the new one is complete; ``text_only``: drop
    the vision tower; ``check_finite``: scan the source for NaN/Inf before writing;
    ``compress``: zstd in the zarr arrays; ``max_groups``: stop after writing this many groups
    (the run can be continued with ``resume=True``); ``dry_run``: validate everything (the NaN
    scan included) and return the plan summary without writing.
    """
    t0 = time.time()
    say = log or (lambda s: None)
    dtype = _normalize_dtype(dtype)
    experts = _normalize_experts(experts, dtype)
    dense = _normalize_dense(dense)
    budget = ckpt.parse_bytes(max_memory) or (4 << 30)
    slab_bytes = int(min(max(16 << 20, (budget - (768 << 20)) // 3), 2 << 30))
    src = os.path.abspath(src)
    dst = os.path.abspath(os.fspath(dst).rstrip("/"))
    part = dst + PARTIAL_SUFFIX
    if os.path.exists(dst) and not overwrite:
        raise ConvertError(f"destination {dst} already exists (use --overwrite to replace it)")
    if os.path.exists(part) and not resume:
        raise ConvertError(f"found an unfinished conversion at {part}: pass --resume to continue it, or delete it")
    from dsv41_jax.config import ConfigError, ModelConfig

    try:
        cfg = ModelConfig.from_file(src)
    except ConfigError as e:
        raise ConvertError(f"source {src}: {e}") from None
    source = Source(src)
    tmp = tempfile.mkdtemp(prefix="dsv41-convert-")
    token_map = os.path.join(tmp, TOKEN_MAP_FILE)
    try:
        plan = build_plan(source, cfg, dtype=dtype, experts=experts, text_only=text_only, token_map_cache=token_map,
                          dense=dense)
        fingerprint = {"converter": CONVERTER_VERSION, "format_version": ckpt.FORMAT_VERSION,
                       "source": source.fingerprint(),
                       "options": {"dtype": dtype, "experts": experts, "text_only": text_only, "compress": compress}}
        if dense == "fp8":  # (only when set: unfinished conversions of earlier versions still resume)
            fingerprint["options"]["dense"] = dense
        manifest = None
        if os.path.exists(part):
            try:
                with open(os.path.join(part, MANIFEST)) as f:
                    manifest = json.load(f)
            except (OSError, ValueError):
                manifest = None
            if manifest is None:
                say(f"{part} has no readable manifest: starting it over")
                _rmtree(part)
            elif manifest.get("fingerprint") != fingerprint:
                raise ConvertError(f"{part} was started from a different source or with different options; "
                                   "delete it, or resume with the same source and options")
        total_src = sum(source.tensors[n].nbytes for n in plan.source_names())
        say(f"source {src}: {len(source.tensors)} tensors in {len(source.files)} file(s), "
            f"{ckpt.human_bytes(total_src)}; {len(plan.params)} arrays in {len(plan.groups())} groups to write")
        for k, v in plan.dropped.items():
            say(f"dropping {v['tensors']} {k} tensors ({ckpt.human_bytes(v['bytes'])}): {v['why']}")
        for n in plan.notes:
            say(f"note: {n}")
        if dry_run:
            bad = scan_nonfinite(source, plan.source_names()) if check_finite else []
            if bad:
                raise _problems_error(f"source {src} has non-finite weights", bad)
            groups = plan.groups()
            return {"complete": False, "dry_run": True, "source": src, "destination": dst, "dtype": dtype,
                    "experts": experts, "dense": dense, "text_only": text_only, "dropped": plan.dropped, "forms": plan.forms,
                    "notes": plan.notes, "tensors_read": len(plan.source_names()), "source_bytes": total_src,
                    "arrays": len(plan.params), "groups_total": len(groups),
                    "bytes_total": sum(p.nbytes for p in plan.params),
                    "largest_group_bytes": max(sum(p.nbytes for p in ps) for ps in groups.values())}
        if manifest is None:
            _check_writable(dst)
            if check_finite:
                bar = _bar(progress, total_src, "validate")
                try:
                    bad = scan_nonfinite(source, plan.source_names(), on_bytes=bar.update if bar else None)
                finally:
                    if bar:
                        bar.close()
                if bad:
                    raise _problems_error(f"source {src} has non-finite weights", bad)
            try:
                os.makedirs(os.path.join(part, ckpt.PARAM_DIR))
            except OSError as e:
                raise ConvertError(f"destination {dst}: cannot create {part} ({e.strerror or e})") from None
            manifest = {"fingerprint": fingerprint, "validated": bool(check_finite), "done": []}
            ckpt.write_json_atomic(os.path.join(part, MANIFEST), manifest)
        report = _write_groups(plan, source, part, manifest, slab_bytes=slab_bytes, compress=compress,
                               progress=progress, max_groups=max_groups, say=say)
        if report["complete"] and os.path.exists(token_map):  # the Engram token map, cached for restore
            for fn in (TOKEN_MAP_FILE, TOKEN_MAP_FILE + ".json"):
                shutil.copy2(os.path.join(tmp, fn), os.path.join(part, fn))
    finally:
        source.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report.update({"source": src, "destination": dst, "dtype": dtype, "experts": experts, "dense": dense,
                   "text_only": text_only, "dropped": plan.dropped, "forms": plan.forms, "notes": plan.notes,
                   "tensors_read": len(plan.source_names()),
                   "arrays_written": len(plan.params), "max_memory": budget, "slab_bytes": slab_bytes})
    if not report["complete"]:
        report["seconds"] = round(time.time() - t0, 3)
        say(f"stopped after {report['groups_done']}/{report['groups_total']} groups; continue with --resume")
        return report
    # finish: config, tokenizer, sidecar, then the atomic rename
    shutil.copy2(os.path.join(src, "config.json"), os.path.join(part, "config.json"))
    copied = []
    for fn in ckpt.TOKENIZER_FILES:
        p = os.path.join(src, fn)
        if os.path.exists(p):
            shutil.copy2(p, os.path.join(part, fn))
            copied.append(fn)
    report["copied_files"] = ["config.json"] + copied
    report["seconds"] = round(time.time() - t0, 3)
    meta = {
        "format": ckpt.FORMAT, "format_version": ckpt.FORMAT_VERSION, "complete": True,
        "groups": list(plan.groups()),
        "params": {p.key: {"group": p.group, "shape": list(p.shape), "dtype": p.dtype.name, "encoding": p.encoding,
                           "source_format": p.form} for p in plan.params},
        "quantized": plan.flags,
        "engram_quantized": plan.engram_quantized,
        "experts": experts,
        "dense": dense,
        "has_vision": plan.has_vision,
        "source": fingerprint,
        "conversion": report,
    }
    ckpt.write_json_atomic(os.path.join(part, ckpt.META_FILE), meta)
    os.unlink(os.path.join(part, MANIFEST))
    ckpt.fsync_dir(part)
    if os.path.exists(dst):  # overwrite: swap only now that the new checkpoint is complete
        old = dst + ".old"
        _rmtree(old)
        os.rename(dst, old)
        os.rename(part, dst)
        _rmtree(old)
    else:
        os.rename(part, dst)
    ckpt.fsync_dir(os.path.dirname(dst))
    say(f"wrote {dst}: {ckpt.human_bytes(report['bytes_written'])} in {report['seconds']:.1f}s "
        f"({report['mb_per_s']:.1f} MB/s)")
    return report


def _bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)


def _write_groups(plan: Plan, source: Source, part: str, manifest: dict, *, slab_bytes: int, compress: bool,
                  progress: bool, max_groups: int | None, say) -> dict:
    groups = plan.groups()
    done = set(manifest.get("done", []))
    pdir = os.path.join(part, ckpt.PARAM_DIR)
    # anything in params/ that is not a finished group is a leftover of an interrupted write
    for entry in os.listdir(pdir):
        if entry not in done:
            _rmtree(os.path.join(pdir, entry))
    for g in list(done):
        if not os.path.isdir(os.path.join(pdir, g)):
            done.discard(g)
    total = sum(p.nbytes for ps in groups.values() for p in ps)
    skipped = sum(p.nbytes for g, ps in groups.items() if g in done for p in ps)
    if done:
        say(f"resuming: {len(done)}/{len(groups)} groups already written")
    bar = _bar(progress, total, "convert")
    if bar:
        bar.update(skipped)
    written = 0
    t0 = time.time()
    n_new = 0
    try:
        for g, ps in groups.items():
            if g in done:
                continue
            if max_groups is not None and n_new >= max_groups:
                break
            if bar:
                bar.set_postfix_str(g)
            tree = {}
            for p in ps:
                chunks = ckpt.chunk_shape(p.shape, p.dtype.itemsize)
                tree[p.key] = ckpt.LazyArray(p.shape, p.dtype, make_producer(p, source),
                                             slab_rows_for(p, slab_bytes, chunks), chunks,
                                             on_write=bar.update if bar else None)
            _before_group(g)
            try:
                ckpt.write_group(os.path.join(pdir, g), tree, compress=compress, max_inflight=2 * slab_bytes)
            except ConvertError:
                raise
            except Exception as e:  # Orbax wraps errors raised in the writer thread
                inner = _find_convert_error(e)
                if inner is not None:
                    raise inner from None
                raise
            written += sum(p.nbytes for p in ps)
            done.add(g)
            n_new += 1
            manifest["done"] = [x for x in groups if x in done]
            ckpt.write_json_atomic(os.path.join(part, MANIFEST), manifest)
    finally:
        if bar:
            bar.close()
    dt = max(time.time() - t0, 1e-9)
    return {"complete": len(done) == len(groups), "groups_done": len(done), "groups_total": len(groups),
            "bytes_written": written, "bytes_total": total, "write_seconds": round(dt, 3),
            "mb_per_s": written / dt / 1e6}


def _find_convert_error(e: BaseException) -> ConvertError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConvertError):
            return e
        for sub in getattr(e, "exceptions", ()) or ():
            r = _find_convert_error(sub)
            if r is not None:
                return r
        e = e.__cause__ or e.__context__
    return None


def _before_group(name: str) -> None:
    """Hook called before each group is written (tests inject interruptions here)."""
