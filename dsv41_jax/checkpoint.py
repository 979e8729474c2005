"""The dsv41_jax Orbax checkpoint: layout, streaming writer, sharded restore, ``info``.

Layout of a checkpoint directory ``DST`` (written by ``python -m convert`` or ``save_model``)::

    DST/
      dsv41_checkpoint.json   sidecar: format, groups, every parameter (group, shape, stored dtype,
                              encoding), the static ``quantized`` flags, conversion report.
                              Written last: a directory without it is not a checkpoint.
      config.json             the model config (composite DeepSeek-V4.1 form)
      tokenizer.json ...      tokenizer files copied from the source
      params/<group>/         one Orbax PyTree checkpoint (OCDBT, zarr3) per group:
                              ``top`` (embed, norm, head), ``layer_000`` ... ``layer_NNN``,
                              ``vision`` (vision.*, aligner.*, image_*)

Inside a group the pytree is a flat dict whose keys are the model's NNX paths joined by dots
(``layers.3.attn.wq_a.weight``, ``layers.3.ffn.experts.w1.weight`` [E, out, in]), so the union of
the groups maps 1:1 onto ``nnx.state(model)``. Encodings (sidecar ``params[key]["encoding"]``):

* ``float``: the value itself (bf16 or fp32); restore casts to the model's dtype (exact: values
  are only stored in bf16 when bf16 holds them exactly).
* ``e4m3`` / ``e8m0``: Engram table bytes (float8_e4m3fn) and their per-32 scale bytes (uint8),
  as in the original checkpoint; the model keeps them in this form.
* ``fp4x2_int8`` + ``e8m0_per32``: routed experts kept quantized (``--experts int8``): the int8
  code is twice the e2m1 value (lossless: -12..12), the ``<key minus .weight>.scale`` entry holds
  the ue8m0 byte of every 32 consecutive inputs ``[E, out, in/32]``; the value is
  ``code/2 * 2^(scale-127)``. ``restore_model`` dequantizes it on the devices.
* ``fp8_e4m3`` + ``e8m0_rows``: a dense Linear kept fp8 (``--dense fp8``): the checkpoint's
  float8_e4m3fn codes ``[out, in]``, and in ``<key minus .weight>.scale`` the ue8m0 byte of each
  32x32 block repeated along ``out``, ``[out, in/32]`` (the in-memory layout of ``Linear.set_fp8``).
  ``restore_model(dense_fp8=True)`` keeps both; otherwise it dequantizes on the devices.

Writing streams: every array is a ``LazyArray`` that produces slabs of rows along axis 0 on
demand, and a ``NumpyHandler`` subclass writes slab after slab into the tensorstore array Orbax
opens, so host memory holds at most two slabs whatever the array size.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import re
import shutil

import ml_dtypes
from typing import Any, Callable, Iterable, Mapping

import numpy as np

FORMAT = "dsv41_jax-orbax"
FORMAT_VERSION = 1
META_FILE = "dsv41_checkpoint.json"
PARAM_DIR = "params"
CHUNK_BYTES = 16 << 20  # target zarr chunk size (what one device read touches at least)

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_VISION_RE = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)")
_EXPERT_KEY_RE = re.compile(r"^(layers\.\d+\.ffn\.experts\.w[123])\.(weight|scale)$")
_ENGRAM_TABLE_KEY_RE = re.compile(r"^layers\.\d+\.engram\.embed\.(weight|scale)$")
_INT8_EXPERT_RE = re.compile(r"\.ffn\.experts\.w[123]\.weight$")
FP8_WEIGHT_ENC = "fp8_e4m3"  # dense Linear codes [out, in] (float8_e4m3fn)
FP8_SCALE_ENC = "e8m0_rows"  # its ue8m0 bytes [out, in/32] (32x32 block scale repeated along out)
SCALE_ENCODINGS = ("e8m0_per32", FP8_SCALE_ENC)  # stored next to their weight, restored with it


class CheckpointError(ValueError):
    """A dsv41_jax checkpoint that is missing, incomplete or does not fit the model."""


# ----------------------------------------------------------------------------------------------
# groups and names
# ----------------------------------------------------------------------------------------------

def group_of(key: str) -> str:
    """The group (Orbax item) a parameter key is stored in: ``top``, ``layer_NNN``,
    ``layer_NNN_engram_table`` (the ~100 GB Engram tables get their own item) or ``vision``."""
    m = _LAYER_RE.match(key)
    if m:
        if _ENGRAM_TABLE_KEY_RE.match(key):
            return f"layer_{int(m.group(1)):03d}_engram_table"
        return f"layer_{int(m.group(1)):03d}"
    if _VISION_RE.match(key):
        return "vision"
    return "top"


def group_order(groups: Iterable[str]) -> list[str]:
    def k(g):
        if g == "top":
            return (0, 0, 0)
        if g == "vision":
            return (2, 0, 0)
        parts = g.split("_")
        return (1, int(parts[1]), len(parts) > 2)

    return sorted(set(groups), key=k)


def path_name(path) -> str:
    return ".".join(str(p) for p in path)


def parse_bytes(s: str | int | float | None) -> int | None:
    """'8GB', '512MiB', '1.5g', 1234 -> bytes (powers of 1024)."""
    if s is None or isinstance(s, (int, float)):
        return None if s is None else int(s)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(s).lower())
    if not m:
        raise ValueError(f"cannot read a byte size from {s!r} (examples: 8GB, 512MB, 1.5G)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * mult)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ----------------------------------------------------------------------------------------------
# the model side: abstract model, static flags
# ----------------------------------------------------------------------------------------------

def quantizable_modules(model):
    """(name, module) for every Linear / Experts module (the holders of the ``quantized`` flag)."""
    from flax import nnx

    from dsv41_jax.model.layers import Linear
    from dsv41_jax.model.moe import Experts

    for path, mod in nnx.iter_graph(model):
        if isinstance(mod, (Linear, Experts)):
            yield path_name(path), mod


def quantized_flags(model) -> dict[str, bool]:
    return {name: bool(mod.quantized) for name, mod in quantizable_modules(model)}


def abstract_model(config, numerics, *, engram_quantized: bool = False, text_only: bool = False,
                   experts_int8: bool = False, dense_fp8=()):
    """A DeepseekV41 whose arrays are ShapeDtypeStructs (nothing allocated). ``dense_fp8``: names
    of the Linear modules held as fp8 codes + scales (see ``DeepseekV41``)."""
    from flax import nnx

    from dsv41_jax.model.lm import DeepseekV41

    return nnx.eval_shape(lambda: DeepseekV41(config, numerics, engram_quantized=engram_quantized,
                                              text_only=text_only, experts_int8=experts_int8,
                                              dense_fp8=tuple(dense_fp8)))


def flat_params(model) -> dict[str, tuple[tuple, Any]]:
    """name -> (nnx path, Variable) for every nnx.Param."""
    from flax import nnx

    return {path_name(p): (p, v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ----------------------------------------------------------------------------------------------
# streaming writer
# ----------------------------------------------------------------------------------------------

def chunk_shape(shape: tuple[int, ...], itemsize: int, target: int = CHUNK_BYTES) -> tuple[int, ...]:
    """Zarr chunk shape: whole rows along axis 0 up to ``target`` bytes; a row larger than that
    (one expert, a huge embedding row) is split along axis 1."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return ()
    rest = math.prod(shape[1:]) * itemsize
    if rest <= target or len(shape) == 1:
        rows = max(1, min(shape[0], target // max(rest, 1)))
        if rows >= 32 and rows < shape[0]:
            rows -= rows % 32  # fp8 blocks are 32 (or 128) rows: keep slabs block-aligned
        return (rows,) + shape[1:]
    n_split = -(-rest // target)  # balanced pieces of axis 1 (2304 rows -> 2 x 1152, not 1638 + 666)
    return (1, max(1, -(-shape[1] // n_split))) + shape[2:]


@dataclasses.dataclass
class LazyArray:
    """An array produced slab by slab: ``produce(a, b)`` returns rows ``[a, b)`` along axis 0.

    ``slab_rows``: rows per write (a multiple of the chunk rows); ``on_write(nbytes)`` is called
    after each slab is handed to tensorstore."""

    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[int, int], np.ndarray]
    slab_rows: int
    chunks: tuple[int, ...]
    on_write: Callable[[int], None] | None = None

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        self.dtype = np.dtype(self.dtype)
        if not self.shape:
            raise ValueError("LazyArray: scalars are not supported")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __deepcopy__(self, memo):  # Orbax may deep-copy host values; a LazyArray holds no data
        return self

    def __array__(self, dtype=None, copy=None):  # fallback for handlers that want the whole array
        out = np.concatenate([self.produce(a, min(a + self.slab_rows, self.shape[0]))
                              for a in range(0, self.shape[0], self.slab_rows)])
        return out if dtype is None else out.astype(dtype)


def lazy_from_array(arr, *, slab_bytes: int = 256 << 20, on_write=None, view=None) -> LazyArray:
    """A LazyArray over an in-memory (numpy or jax) array; ``view`` (optional): a function applied
    to each slab of rows (along axis 0), e.g. ``kernels.qmatmul.unblock`` for K-blocked codes."""
    shape = tuple(arr.shape)
    if view is not None:  # the view's shape, from an empty slab
        shape = (shape[0], *view(np.zeros((0, *shape[1:]), np.dtype(arr.dtype))).shape[1:])
    dt = np.dtype(arr.dtype)
    ch = chunk_shape(shape, dt.itemsize)
    rows = _slab_rows(shape, dt.itemsize, ch, slab_bytes)

    def produce(a, b):
        return np.asarray(arr[a:b]) if view is None else np.ascontiguousarray(view(np.asarray(arr[a:b])))

    return LazyArray(shape, dt, produce, rows, ch, on_write)


def _slab_rows(shape, itemsize, chunks, slab_bytes) -> int:
    if not shape:
        return 1
    row = max(1, math.prod(shape[1:]) * itemsize)
    c0 = chunks[0]
    rows = max(c0, (slab_bytes // row) // c0 * c0)
    return min(rows, shape[0])


def _set_chunks(tspec: dict, chunks: tuple[int, ...]) -> dict:
    """Replace the chunk shape in an Orbax write tspec (zarr2 or zarr3, maybe under a cast)."""
    spec = tspec
    while "base" in spec and "metadata" not in spec:
        spec = spec["base"]
    md = spec.get("metadata")
    if md is None or not chunks:
        return tspec
    chunks = list(chunks)
    if "chunk_grid" in md:
        md["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        for c in md.get("codecs", []):
            if c.get("name") == "sharding_indexed":
                c["configuration"]["chunk_shape"] = chunks
    elif "chunks" in md:
        md["chunks"] = chunks
    return tspec


def _lazy_handler_class():
    import collections

    import orbax.checkpoint as ocp
    import tensorstore as ts

    class LazyArrayHandler(ocp.type_handlers.NumpyHandler):
        """NumpyHandler that writes a LazyArray slab by slab.

        One array produces slabs at a time (a lock); each slab is handed to tensorstore
        (``copy`` done: the slab can be freed) and its commit is awaited later, so commits of
        many small arrays are batched by OCDBT. At most ``max_inflight`` bytes of written but
        uncommitted data are pending at any time."""

        def __init__(self, max_inflight: int = 512 << 20):
            try:
                super().__init__(deepcopy_host_arrays=False)
            except TypeError:  # older Orbax
                super().__init__()
            self._lock = None
            self._inflight = collections.deque()  # [commit future, nbytes, on_write, counted]
            self._inflight_bytes = 0
            self._max_inflight = max_inflight
            self._active = 0
            self._error = None

        async def _retire(self, entry):
            await entry[0]
            if not entry[3]:
                entry[3] = True
                self._inflight_bytes -= entry[1]
                if entry[2]:
                    entry[2](entry[1])

        async def _open_and_write(self, value, tspec, ts_context):
            if not isinstance(value, LazyArray):
                return await super()._open_and_write(value, tspec, ts_context)
            if self._lock is None:
                self._lock = asyncio.Lock()
            # On an error every array of the batch winds down (its open and pending commits
            # finish) before the error propagates, so no tensorstore callback outlives the loop.
            self._active += 1
            mine = []
            try:
                # opening creates the array metadata (a commit of its own): outside the lock
                t = await ts.open(ts.Spec(_set_chunks(tspec, value.chunks)), create=True, open=True,
                                  context=ts_context)
                async with self._lock:
                    if self._error is None:
                        await self._write_slabs(t, value, mine)
                for entry in mine:
                    await self._retire(entry)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others stop
                if self._error is None:
                    self._error = e
                for entry in mine:
                    try:
                        await entry[0]
                    except BaseException:  # noqa: BLE001
                        pass
            finally:
                self._active -= 1
            if self._error is not None:
                while self._active > 0:
                    await asyncio.sleep(0.005)
                raise self._error

        async def _write_slabs(self, t, value, mine):
            n = value.shape[0]
            for a in range(0, n, value.slab_rows):
                b = min(n, a + value.slab_rows)
                slab = np.ascontiguousarray(value.produce(a, b))
                want = (b - a,) + value.shape[1:]
                if slab.dtype != value.dtype or slab.shape != want:
                    raise ValueError(f"produced slab {slab.shape} {slab.dtype}, expected {want} {value.dtype}")
                fut = t[a:b].write(slab)
                await fut.copy
                del slab
                entry = [fut.commit, int(math.prod(want)) * value.dtype.itemsize, value.on_write, False]
                self._inflight.append(entry)
                self._inflight_bytes += entry[1]
                mine.append(entry)
                while self._inflight_bytes > self._max_inflight and self._inflight:
                    await self._retire(self._inflight.popleft())

    return LazyArrayHandler


def write_group(directory: str, tree: Mapping[str, LazyArray], *, compress: bool = False,
                max_inflight: int = 512 << 20):
    """Write one group (flat dict of LazyArrays) as an Orbax PyTree checkpoint (OCDBT, zarr3).

    Orbax writes into a temporary directory and renames it on success, so ``directory`` exists
    only when the group is complete."""
    import orbax.checkpoint as ocp

    import jax

    handler = _lazy_handler_class()(max_inflight)
    # jax.Array is registered only so that Orbax keeps its array-metadata bookkeeping quiet
    reg = ocp.type_handlers.create_type_handler_registry((LazyArray, handler),
                                                         (jax.Array, ocp.type_handlers.ArrayHandler()))
    h = ocp.PyTreeCheckpointHandler(type_handler_registry=reg, use_ocdbt=True, use_zarr3=True,
                                    use_compression=compress)
    ckptr = ocp.Checkpointer(h)
    try:
        ckptr.save(os.path.abspath(directory), args=ocp.args.PyTreeSave(dict(tree)))
    finally:
        ckptr.close()


# ----------------------------------------------------------------------------------------------
# sidecar
# ----------------------------------------------------------------------------------------------

def read_meta(path: str) -> dict:
    p = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.exists(p):
        partial = os.path.exists(os.path.join(path, "convert_manifest.json")) or path.rstrip("/").endswith(".partial")
        raise CheckpointError(
            f"{path}: not a complete dsv41_jax checkpoint (no {META_FILE})"
            + ("; this is an unfinished conversion: run the converter again with --resume" if partial else ""))
    with open(p) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{p}: format {meta.get('format')!r} is not {FORMAT!r}")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(f"{p}: format version {meta.get('format_version')} is newer than this dsv41_jax "
                              f"({FORMAT_VERSION}); upgrade dsv41_jax")
    if not meta.get("complete"):
        raise CheckpointError(f"{p}: checkpoint is marked incomplete")
    return meta


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# save_model
# ----------------------------------------------------------------------------------------------

def save_model(model, path: str, *, overwrite: bool = False, compress: bool = False,
               tokenizer_dir: str | None = None) -> str:
    """Write an in-memory DeepseekV41 as a dsv41_jax checkpoint at ``path`` (atomic: written to
    ``path.partial`` and renamed). Parameters are stored with the model's own dtypes; the
    tokenizer files of ``tokenizer_dir`` are copied (required for Engram models: their hash
    constants are rebuilt from it at restore). Returns path."""
    path = os.path.abspath(path)
    t = model.config.text
    if t.engram_layer_ids and not (tokenizer_dir and os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json"))):
        raise CheckpointError("save_model: the model has Engram layers, whose token map comes from the tokenizer; "
                              "pass tokenizer_dir= (a directory with tokenizer.json)")
    if os.path.exists(path):
        if not overwrite:
            raise CheckpointError(f"{path} already exists (pass overwrite=True to replace it)")
        shutil.rmtree(path)
    part = path + ".partial"
    if os.path.exists(part):
        shutil.rmtree(part)
    os.makedirs(os.path.join(part, PARAM_DIR))
    flat = flat_params(model)
    groups: dict[str, dict[str, LazyArray]] = {}
    params = {}
    from dsv41_jax.kernels.qmatmul import unblock

    for name, (_, var) in flat.items():
        arr = var.get_value()
        # K-blocked int8 experts (``moe.block_expert_codes``) are written in rows, [E, out, in]
        view = unblock if _INT8_EXPERT_RE.search(name) and arr.ndim == 4 else None
        enc = "float"
        if name.endswith(".engram.embed.weight") and np.dtype(arr.dtype) == np.dtype("float8_e4m3fn"):
            enc = "e4m3"
        elif name.endswith(".engram.embed.scale"):
            enc = "e8m0"
        elif name.endswith(".weight") and np.dtype(arr.dtype) == np.dtype("float8_e4m3fn"):
            enc = FP8_WEIGHT_ENC  # a Linear in fp8 storage
        elif _INT8_EXPERT_RE.search(name) and np.dtype(arr.dtype) == np.dtype("int8"):
            enc = "fp4x2_int8"  # routed experts kept int8 (experts_int8)
        elif name.endswith(".scale") and _INT8_EXPERT_RE.search(name[: -len("scale")] + "weight"):
            enc = "e8m0_per32"
        elif name.endswith(".scale") and (name[: -len("scale")] + "weight") in flat \
                and np.dtype(flat[name[: -len("scale")] + "weight"][1].get_value().dtype) == np.dtype("float8_e4m3fn"):
            enc = FP8_SCALE_ENC
        g = group_of(name)
        lazy = groups.setdefault(g, {})[name] = lazy_from_array(arr, view=view)
        params[name] = {"group": g, "shape": list(lazy.shape), "dtype": np.dtype(arr.dtype).name, "encoding": enc}
    for g in group_order(groups):
        write_group(os.path.join(part, PARAM_DIR, g), groups[g], compress=compress)
    cfg = model.config
    with open(os.path.join(part, "config.json"), "w") as f:
        json.dump(dict(cfg.raw), f, indent=2, ensure_ascii=False)
    if tokenizer_dir:
        for fn in TOKENIZER_FILES:
            if os.path.exists(os.path.join(tokenizer_dir, fn)):
                shutil.copy2(os.path.join(tokenizer_dir, fn), os.path.join(part, fn))
    if t.engram_layer_ids:
        from dsv41_jax.engram_hash import TOKEN_MAP_FILE, load_or_build_token_map

        load_or_build_token_map(os.path.join(part, "tokenizer.json"), t.vocab_size, os.path.join(part, TOKEN_MAP_FILE),
                                compressed_vocab_size=t.engram_compressed_vocab_size)
    exp = [v for k, v in params.items() if k.endswith(".ffn.experts.w1.weight")]
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "complete": True,
        "groups": group_order(groups),
        "params": params,
        "quantized": quantized_flags(model),
        "engram_quantized": any(k.endswith(".engram.embed.scale") for k in params),
        "experts": ("bf16" if exp[0]["dtype"] == "bfloat16" else exp[0]["dtype"]) if exp else None,
        "has_vision": any(group_of(k) == "vision" for k in params),
        "source": {"kind": "save_model"},
    }
    write_json_atomic(os.path.join(part, META_FILE), meta)
    fsync_dir(part)
    os.rename(part, path)
    fsync_dir(os.path.dirname(path))
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "tokenizer.model")


# ----------------------------------------------------------------------------------------------
# restore
# ----------------------------------------------------------------------------------------------

def _flat_values(state) -> dict[str, Any]:
    """dot name -> leaf of an nnx.State (Variables unwrapped), or of a nested mapping/pytree."""
    import jax
    from flax import nnx

    if isinstance(state, nnx.State):
        items = nnx.to_flat_state(state)
    else:
        items = jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, (jax.sharding.Sharding, jax.ShapeDtypeStruct, nnx.Variable)))[0]
        items = [(tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in p), v) for p, v in items]
    out = {}
    for p, v in items:
        if isinstance(v, nnx.Variable):
            v = v.get_value()
        out[path_name(p)] = v
    return out


def _sharding_module():
    try:
        from dsv41_jax import sharding as shmod  # the mesh rules (optional at import time)
    except ImportError:
        return None
    return shmod


def restore_targets(abstract, mesh=None, shardings=None) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name -> (target shape, jax.sharding.Sharding) for every nnx.Param of the abstract model.

    ``mesh=None``: one device, logical shapes. With a mesh: ``dsv41_jax.sharding.abstract_params``
    (placed shapes: Engram table rows zero-padded to a multiple of their split, shardings from the
    rules) when available, else ``param_shardings``, else replicated. ``shardings`` overrides per
    name: a mapping name -> Sharding, or a callable ``(name, ShapeDtypeStruct) -> Sharding``
    (the target then keeps the logical shape)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    flat = flat_params(abstract)
    logical = {n: tuple(v.get_value().shape) for n, (_, v) in flat.items()}
    out: dict[str, tuple] = {}
    if mesh is None:
        dev = SingleDeviceSharding(jax.devices()[0])
        out = {n: (logical[n], dev) for n in flat}
    else:
        shmod = _sharding_module()
        placed = {}
        if shmod is not None and hasattr(shmod, "abstract_params"):
            placed = {n: (tuple(v.shape), v.sharding) for n, v in _flat_values(shmod.abstract_params(abstract, mesh)).items()
                      if isinstance(v, jax.ShapeDtypeStruct)}
        elif shmod is not None and hasattr(shmod, "param_shardings"):
            placed = {n: (logical.get(n), v) for n, v in _flat_values(shmod.param_shardings(abstract, mesh)).items()}
        rep = NamedSharding(mesh, PartitionSpec())
        out = {n: placed.get(n, (logical[n], rep)) for n in flat}
    if shardings is not None:
        for n, (_, v) in flat.items():
            sds = v.get_value()
            if callable(shardings) and not isinstance(shardings, Mapping):
                sh = shardings(n, sds)
            else:
                sh = shardings.get(n)
            if sh is not None:
                out[n] = (logical[n], sh)
    return out


def resolve_shardings(abstract, mesh=None, shardings=None) -> dict[str, Any]:
    """name -> Sharding for every nnx.Param (see ``restore_targets``)."""
    return {n: sh for n, (_, sh) in restore_targets(abstract, mesh, shardings).items()}


def _materialize_constants(model, cfg, path: str, mesh) -> None:
    """Give the abstract model real values for its non-parameter variables (derived from the
    config and the tokenizer, not stored): the Engram hasher's constants and token map (cached as
    ``engram_token_map.npy`` next to the checkpoint)."""
    import jax
    from flax import nnx

    if getattr(model, "engram_hasher", None) is not None:
        from dsv41_jax.engram_hash import EngramHasher
        from dsv41_jax.weights import WeightError, attach_token_map

        model.engram_hasher = EngramHasher(cfg.text)
        try:
            attach_token_map(model, path, cache_dir=path)
        except (WeightError, ValueError) as e:
            raise CheckpointError(f"{path}: {e}") from None
    state = nnx.state(model, nnx.Not(nnx.Param))
    left = [path_name(p) for p, v in nnx.to_flat_state(state) if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if left:
        raise CheckpointError("restore_model does not know how to build these non-parameter variables: "
                              + ", ".join(left))
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        shmod = _sharding_module()
        sh = {}
        if shmod is not None and hasattr(shmod, "param_shardings"):
            sh = _flat_values(shmod.param_shardings(model, mesh))
        rep = NamedSharding(mesh, PartitionSpec())
        for p, v in nnx.to_flat_state(state):
            v.set_value(jax.device_put(v.get_value(), sh.get(path_name(p), rep)))
        nnx.update(model, state)


def _scale_sharding(weight_sharding, scale_shape):
    """Sharding for an int8 experts' scale [E, out, in/32] from its weight's sharding."""
    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(weight_sharding, NamedSharding):
        return weight_sharding
    spec = list(weight_sharding.spec) + [None] * (len(scale_shape) - len(weight_sharding.spec))
    mesh = weight_sharding.mesh
    for i, ax in enumerate(spec):
        if ax is None:
            continue
        axes = ax if isinstance(ax, tuple) else (ax,)
        n = math.prod(mesh.shape[a] for a in axes)
        if scale_shape[i] % n:
            spec[i] = None
    return NamedSharding(mesh, PartitionSpec(*spec))


@functools.lru_cache(maxsize=64)
def _int8_dequantizer(dtype, out_sharding):
    import jax
    import jax.numpy as jnp

    from dsv41_jax.quant import e8m0_to_f32_jax

    def f(c, s):
        v = c.astype(jnp.float32) * jnp.float32(0.5)  # the e2m1 value, exact
        m = jnp.repeat(e8m0_to_f32_jax(s), 32, axis=-1)
        return (v * m).astype(dtype)

    return jax.jit(f, out_shardings=out_sharding)


def _dequant_int8_experts(codes, scale, dtype, out_sharding):
    """int8 codes (2 x e2m1 value) [E, out, in] and ue8m0 bytes [E, out, in/32] -> ``dtype``,
    computed on the devices holding the shards."""
    return _int8_dequantizer(np.dtype(dtype), out_sharding)(codes, scale)


@functools.lru_cache(maxsize=64)
def _fp8_dequantizer(dtype, out_sharding):
    import jax

    from dsv41_jax.model.layers import dequant_fp8_weight

    return jax.jit(lambda c, s: dequant_fp8_weight(c, s, dtype), out_shardings=out_sharding)


def _dequant_fp8_dense(codes, scale, dtype, out_sharding):
    """fp8 codes [out, in] and ue8m0 bytes [out, in/32] -> ``dtype`` (exact), on the devices."""
    return _fp8_dequantizer(np.dtype(dtype), out_sharding)(codes, scale)


def restore_model(path: str, numerics, *, config=None, mesh=None, shardings=None, text_only: bool = False,
                  restore_concurrent_gb: int | None = 4, experts_int8: bool = False, dense_fp8: bool = False):
    """Restore a DeepseekV41 from a dsv41_jax checkpoint directory.

    The model is built abstractly (``nnx.eval_shape``), each parameter is restored into a
    ``jax.ShapeDtypeStruct`` carrying its sharding (so every device reads only its own shard)
    and the model's dtype (Orbax casts while reading; values stored in bf16 are exact). The static
    ``quantized`` flags come from the sidecar; the Engram hasher's constants are built from the
    config and the checkpoint's tokenizer. ``config``: a ModelConfig to build the model with
    (default: DST/config.json); ``mesh``/``shardings``: see ``restore_targets``; ``text_only``:
    build and restore without the vision tower (its group is not read);
    ``restore_concurrent_gb``: Orbax's bound on bytes being read at once (host memory);
    ``experts_int8``: keep routed experts converted with ``--experts int8`` quantized in device
    memory (codes + scales, dequantized per use) instead of dequantizing them at restore;
    ``dense_fp8``: likewise keep Linear weights converted with ``--dense fp8`` as fp8 codes + ue8m0
    scales (``Linear.set_fp8``); without it they are dequantized at restore (exact).
    """
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from dsv41_jax.config import ModelConfig

    path = os.path.abspath(path)
    meta = read_meta(path)
    cfg = config if config is not None else ModelConfig.from_file(path)
    stored = meta["params"]
    if cfg.vision is not None and not text_only and not meta.get("has_vision"):
        raise CheckpointError(f"{path}: the config has a vision tower but the checkpoint holds no vision weights "
                              "(converted text-only); restore with text_only=True")
    if experts_int8 and not any(i.get("encoding") == "fp4x2_int8" for i in stored.values()):
        raise CheckpointError(f"{path}: experts_int8 needs a checkpoint converted with --experts int8")
    fp8_names = sorted(n[: -len(".weight")] for n, i in stored.items() if i.get("encoding") == FP8_WEIGHT_ENC
                       and not (text_only and i["group"] == "vision"))
    if dense_fp8 and not fp8_names:
        raise CheckpointError(f"{path}: dense_fp8 needs a checkpoint converted with --dense fp8")
    model = abstract_model(cfg, numerics, engram_quantized=bool(meta.get("engram_quantized")), text_only=text_only,
                           experts_int8=experts_int8, dense_fp8=fp8_names if dense_fp8 else ())
    flags = meta.get("quantized", {})
    for name, mod in quantizable_modules(model):
        mod.quantized = bool(flags.get(name, False))
    flat = flat_params(model)
    problems = []
    for name, (_, var) in flat.items():
        sds = var.get_value()
        if name not in stored:
            problems.append(f"missing parameter {name} {list(sds.shape)} in the checkpoint")
        elif tuple(stored[name]["shape"]) != tuple(sds.shape):
            problems.append(f"parameter {name}: checkpoint shape {stored[name]['shape']} != model {list(sds.shape)}")
    for name, info in stored.items():
        if name in flat or info.get("encoding") in SCALE_ENCODINGS:
            continue
        if text_only and info["group"] == "vision":
            continue
        problems.append(f"checkpoint parameter {name} is not part of the model")
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not fit the model ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(problems))
    targets = restore_targets(model, mesh, shardings)
    needed_groups = {stored[n]["group"] for n in flat}
    restored: dict[str, Any] = {}
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(restore_concurrent_gb=restore_concurrent_gb))
    try:
        for g in group_order(needed_groups):
            item, args = {}, {}
            for name, info in stored.items():
                if info["group"] != g:
                    continue
                enc = info.get("encoding", "float")
                if enc == "e8m0_per32" or (enc == FP8_SCALE_ENC and name not in flat):
                    wname = name[: -len("scale")] + "weight"
                    shape, dt = tuple(info["shape"]), jnp.uint8
                    sh = _scale_sharding(targets[wname][1], shape)
                else:
                    shape, sh = targets[name]
                    dt = {"fp4x2_int8": jnp.int8, FP8_WEIGHT_ENC: jnp.float8_e4m3fn,
                          FP8_SCALE_ENC: jnp.uint8}.get(enc, flat[name][1].get_value().dtype)
                item[name] = jax.ShapeDtypeStruct(shape, dt, sharding=sh)
                args[name] = ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=sh, global_shape=shape, dtype=dt,
                                                  strict=tuple(shape) == tuple(info["shape"]))
            gdir = os.path.join(path, PARAM_DIR, g)
            if not os.path.isdir(gdir):
                raise CheckpointError(f"{path}: group directory {PARAM_DIR}/{g} is missing")
            res = ckptr.restore(gdir, args=ocp.args.PyTreeRestore(item=item, restore_args=args))
            for name, info in stored.items():
                if info["group"] != g:
                    continue
                enc = info.get("encoding", "float")
                if enc == "e8m0_per32":
                    continue
                if enc == FP8_SCALE_ENC:
                    if name in flat:  # kept quantized: a model parameter itself
                        restored[name] = res[name]
                    continue
                if enc == FP8_WEIGHT_ENC:
                    sname = name[: -len("weight")] + "scale"
                    if sname in flat:
                        restored[name] = res[name]
                    else:
                        dt = flat[name][1].get_value().dtype
                        restored[name] = _dequant_fp8_dense(res[name], res[sname], dt, targets[name][1])
                        del res[sname]
                    continue
                if enc == "fp4x2_int8":
                    sname = name[: -len("weight")] + "scale"
                    if experts_int8:
                        restored[name], restored[sname] = res[name], res[sname]
                    else:
                        dt = flat[name][1].get_value().dtype
                        restored[name] = _dequant_int8_experts(res[name], res[sname], dt, targets[name][1])
                    del res[sname]
                else:
                    restored[name] = res[name]
            del res
    finally:
        ckptr.close()
    for name, (_, var) in flat.items():
        var.set_value(restored.pop(name))
    _materialize_constants(model, cfg, path, mesh)
    return model


# ----------------------------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------------------------

_CATEGORIES = [
    ("routed_experts", re.compile(r"\.ffn\.experts\.(\d+\.)?w[123]\.(weight|scale)$")),
    ("shared_experts", re.compile(r"\.ffn\.shared_experts\.")),
    ("router", re.compile(r"\.ffn\.gate\.")),
    ("engram_tables", re.compile(r"\.engram\.embed\.")),
    ("engram", re.compile(r"\.engram\.")),
    ("compressor_indexer", re.compile(r"\.attn\.(compressor|indexer)\.")),
    ("attention", re.compile(r"\.attn\.")),
    ("mhc", re.compile(r"\.hc_")),
    ("norms", re.compile(r"(^norm\.|_norm\.)")),
    ("embed", re.compile(r"^embed\.")),
    ("head", re.compile(r"^head\.")),
    ("vision", re.compile(r"^vision\.")),
    ("aligner_image", re.compile(r"^(aligner\.|image_)")),
]


def category_of(key: str) -> str:
    for name, rx in _CATEGORIES:
        if rx.search(key):
            return name
    return "other"


def info(path: str) -> dict:
    """Summary of a dsv41_jax checkpoint: config, parameter counts per group, dtypes, bytes."""
    from dsv41_jax.config import ModelConfig

    meta = read_meta(path)
    cfg = ModelConfig.from_file(path)
    t = cfg.text
    cats: dict[str, dict] = {}
    dts: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    total_p = total_b = 0
    for name, p in meta["params"].items():
        n = math.prod(p["shape"])
        b = n * np.dtype(getattr(ml_dtypes, p["dtype"], p["dtype"])).itemsize
        is_scale = p.get("encoding") in ("e8m0",) + SCALE_ENCODINGS
        c = cats.setdefault(category_of(name), {"params": 0, "bytes": 0})
        c["bytes"] += b
        d = dts.setdefault(p["dtype"], {"arrays": 0, "elements": 0, "bytes": 0})
        d["arrays"] += 1
        d["elements"] += n
        d["bytes"] += b
        g = groups.setdefault(p["group"], {"params": 0, "bytes": 0})
        g["bytes"] += b
        total_b += b
        if not is_scale:
            c["params"] += n
            g["params"] += n
            total_p += n
    disk = 0
    for root, _, files in os.walk(os.path.join(path, PARAM_DIR)):
        for fn in files:
            try:
                disk += os.path.getsize(os.path.join(root, fn))
            except OSError:
                pass
    return {
        "path": os.path.abspath(path),
        "format": f"{meta['format']} v{meta['format_version']}",
        "config": {
            "model_type": cfg.raw.get("model_type"),
            "layers": t.num_hidden_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
            "heads": t.num_attention_heads, "head_dim": t.head_dim,
            "routed_experts": t.n_routed_experts, "experts_per_token": t.num_experts_per_tok,
            "moe_intermediate_size": t.moe_intermediate_size,
            "engram_layers": list(t.engram_layer_ids),
            "vision_layers": cfg.vision.num_hidden_layers if cfg.vision else 0,
            "quantization": None if cfg.quant is None else
            f"fp8 {cfg.quant.weight_block_size[0]}x{cfg.quant.weight_block_size[1]}, experts {cfg.quant.expert_dtype}",
        },
        "experts": meta.get("experts"),
        "engram_quantized": meta.get("engram_quantized"),
        "has_vision": meta.get("has_vision"),
        "total_params": total_p,
        "total_bytes": total_b,
        "disk_bytes": disk,
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["bytes"])),
        "dtypes": dts,
        "groups": {g: groups[g] for g in group_order(groups)},
        "conversion": meta.get("conversion"),
    }


def format_info(d: dict) -> str:
    lines = [f"checkpoint {d['path']}  ({d['format']})"]
    c = d["config"]
    lines.append(f"  config: {c['layers']} layers, hidden {c['hidden_size']}, vocab {c['vocab_size']}, "
                 f"{c['heads']} heads x {c['head_dim']}, {c['routed_experts']} experts (top-{c['experts_per_token']}, "
                 f"inter {c['moe_intermediate_size']}), engram layers {c['engram_layers']}, "
                 f"vision layers {c['vision_layers']}, source quantization {c['quantization']}")
    lines.append(f"  experts stored as {d['experts']}; engram tables {'fp8+scale' if d['engram_quantized'] else 'dense'}; "
                 f"vision weights {'yes' if d['has_vision'] else 'no'}")
    lines.append(f"  parameters: {d['total_params']:,} ({d['total_params'] / 1e9:.3f} B), "
                 f"{human_bytes(d['total_bytes'])} of arrays, {human_bytes(d['disk_bytes'])} on disk")
    lines.append("  by category:")
    for k, v in d["categories"].items():
        lines.append(f"    {k:20s} {v['params']:>16,} params  {human_bytes(v['bytes']):>12}")
    lines.append("  by dtype:")
    for k, v in d["dtypes"].items():
        lines.append(f"    {k:20s} {v['arrays']:>6} arrays {v['elements']:>16,} elements  {human_bytes(v['bytes']):>12}")
    conv = d.get("conversion") or {}
    if conv.get("dropped"):
        for k, v in conv["dropped"].items():
            lines.append(f"  dropped at conversion: {v['tensors']} {k} tensors ({human_bytes(v['bytes'])}): {v['why']}")
    return "\n".join(lines)
