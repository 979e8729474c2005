"""Device meshes and the partition rules of the model, its caches and its activations.

Mesh axes are ``("data", "expert", "tensor")``. Every parameter (by its dot-joined NNX path,
which is the original checkpoint name) and every cache leaf (by ``cache.`` + its path in the cache
pytree) is mapped to *logical* axes by ONE rule table, ``RULES``; ``LOGICAL_AXES`` maps each
logical axis to the mesh axes it may be split over. A dimension that the chosen mesh axes do not
divide falls back to the largest dividing subset of those axes (possibly none = replicated) and
the fallback is recorded as a note (``strict=True`` raises ``ShardingError`` instead, naming the
tensor, the dimension and the axis).

See docs/sharding.md for the rationale and the collectives each layer runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

AXES = ("data", "expert", "tensor")
REPLICATED = ()  # rule value: every dimension replicated

log = logging.getLogger(__name__)


class ShardingError(ValueError):
    """A mesh that does not fit the model (strict mode) or a malformed mesh request."""


# ------------------------------------------------------------------------------------- rules
# logical axis -> mesh axes it is split over (in this order; a non-dividing mesh keeps the
# largest dividing subset)
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "batch": ("data",),            # sequences of a batch (caches, activations)
    "heads": ("tensor",),          # query heads (attention and indexer), rows of head_dim each
    "o_groups": ("tensor",),       # output-projection groups (wo_a rows, wo_b columns)
    "experts": ("expert",),        # routed experts
    "expert_ffn": ("tensor",),     # intermediate dim of the routed experts
    "ffn": ("tensor",),            # intermediate dim of the shared expert
    "vocab": ("tensor", "expert"),  # embedding / head rows (all model-parallel devices)
    "table_rows": ("expert", "tensor"),  # Engram hash-table rows (the largest tensors of all)
    "engram_in": ("tensor", "expert"),  # Engram key/value projection input (looked-up rows)
}

# logical axes whose dimension is zero-padded up to a multiple of the split instead of falling
# back: Engram table rows are only ever gathered at ids < the true row count, so pad rows are
# never read (V4.1-Flash's second table has 384016682 rows = 2 x prime).
PADDED_AXES = frozenset({"table_rows"})

# (regex on the dot-joined path, logical axes per dimension; REPLICATED = all None).
# Cache leaves are matched as "cache.<path>" (e.g. "cache.layers.3.win_kv", "cache.length").
RULES: tuple[tuple[str, tuple], ...] = (
    # --- embeddings / head: split the vocabulary
    (r"^embed\.weight$", ("vocab", None)),
    (r"^head\.weight$", ("vocab", None)),
    (r"^norm\.weight$", REPLICATED),
    # --- attention: query heads and output groups on "tensor"; the shared KV latent replicated
    (r"\.attn\.wq_b\.(weight|scale)$", ("heads", None)),
    (r"\.attn\.attn_sink$", ("heads",)),
    (r"\.attn\.wo_a\.(weight|scale)$", ("o_groups", None)),
    (r"\.attn\.wo_b\.(weight|scale)$", (None, "o_groups")),
    (r"\.attn\.(wq_a|wkv)\.(weight|scale)$", REPLICATED),
    (r"\.attn\.(q_norm|kv_norm)\.weight$", REPLICATED),
    (r"\.attn\.compressor\.(wkv|wgate|norm)\.(weight|scale)$", REPLICATED),
    (r"\.attn\.indexer\.wq_b\.(weight|scale)$", ("heads", None)),
    (r"\.attn\.indexer\.weights_proj\.(weight|scale)$", ("heads", None)),
    (r"\.attn\.indexer\.(wk|k_norm)\.(weight|scale)$", REPLICATED),
    # --- MoE: routed experts on "expert" (intermediate on "tensor"), shared expert on "tensor"
    (r"\.ffn\.gate\.(weight|bias|bias_vl)$", REPLICATED),
    (r"\.ffn\.experts\.w[13]\.(weight|scale)$", ("experts", "expert_ffn", None)),
    (r"\.ffn\.experts\.w2\.(weight|scale)$", ("experts", None, "expert_ffn")),
    # (the scales' copies in the prefill kernel's layout [E, in / 32, out], ``moe.keep_kernel_scales``)
    (r"\.ffn\.experts\.w[13]\.scale_k$", ("experts", None, "expert_ffn")),
    (r"\.ffn\.experts\.w2\.scale_k$", ("experts", "expert_ffn", None)),
    (r"\.ffn\.shared_experts\.w[13]\.(weight|scale)$", ("ffn", None)),
    (r"\.ffn\.shared_experts\.w2\.(weight|scale)$", (None, "ffn")),
    # --- mHC and norms: small, replicated
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", REPLICATED),
    (r"\.(attn_norm|ffn_norm)\.weight$", REPLICATED),
    # --- Engram: tables row-sharded
    (r"\.engram\.embed\.(weight|scale)$", ("table_rows", None)),
    # row-parallel: its output feeds the residual stream, which must stay unsplit (a split
    # output dim propagates into the hc stream and costs collectives in every norm after it)
    (r"\.engram\.wkv\.(weight|scale)$", (None, "engram_in")),
    (r"\.engram\.(q_weight|k_weight)$", REPLICATED),
    # --- vision tower, aligner, span markers: data parallel (replicated weights)
    (r"^(vision|aligner)\.", REPLICATED),
    (r"^image_(start|end|newline)$", REPLICATED),
    # --- on-device Engram hashing constants (token map, primes, ...): replicated
    (r"^engram_hasher\.", REPLICATED),
    # --- caches: batch on "data", everything else (shared latent, compressed KV) replicated
    (r"^cache\.layers\.\d+\.(win_kv|cmp_kv|idx_k|st_kv|st_score)$", ("batch", None, None)),
    (r"^cache\.layers\.\d+\.win_pos$", ("batch", None)),
    (r"^cache\.length$", ("batch",)),
    (r"^cache\.engram_(hist|ids|dead)$", ("batch", None)),
)

_COMPILED = tuple((re.compile(p), spec) for p, spec in RULES)


def match_rule(name: str) -> tuple | None:
    """The logical axes of ``name`` by the first matching rule, or None when no rule matches."""
    for rx, spec in _COMPILED:
        if rx.search(name):
            return spec
    return None


# ------------------------------------------------------------------------------------- meshes
def _mesh_sizes(mesh) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(mesh.shape).items()}


def make_mesh(data: int = 1, expert: int = 1, tensor: int = 1, devices: Sequence | None = None):
    """A ``jax.sharding.Mesh`` with axes ("data", "expert", "tensor") (all Auto) over the first
    data*expert*tensor of ``devices`` (default ``jax.devices()``)."""
    import jax
    from jax.sharding import Mesh

    shape = (int(data), int(expert), int(tensor))
    if min(shape) < 1:
        raise ShardingError(f"mesh sizes must be >= 1, got data={data}, expert={expert}, tensor={tensor}")
    n = math.prod(shape)
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < n:
        raise ShardingError(f"mesh {data},{expert},{tensor} needs {n} devices, only {len(devs)} given "
                            f"({devs[0].platform if devs else 'none'})")
    devs = devs[:n]
    auto = None
    try:
        from jax.sharding import AxisType

        auto = (AxisType.Auto,) * 3
    except ImportError:  # pragma: no cover - older jax
        pass
    try:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devs)
    except (TypeError, ValueError, AttributeError):
        kw = {} if auto is None else {"axis_types": auto}
        return Mesh(np.asarray(devs, dtype=object).reshape(shape), AXES, **kw)


def parse_mesh_spec(spec: str | Sequence[int]) -> tuple[int, int, int]:
    if isinstance(spec, str):
        parts = [p for p in re.split(r"[,x×\s]+", spec.strip()) if p]
    else:
        parts = list(spec)
    try:
        dims = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ShardingError(f"mesh spec {spec!r}: expected three positive integers 'DATA,EXPERT,TENSOR', e.g. '1,2,2'")
    return dims


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        fn = getattr(xla_bridge, "backends_are_initialized", None)
        if fn is not None:
            return bool(fn())
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # pragma: no cover - unknown jax internals: assume initialised (safe side)
        return True


_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _request_host_devices(n: int) -> None:
    """Ask XLA for at least ``n`` host (CPU) devices; only effective before jax initialises."""
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(_COUNT_FLAG + r"=(\d+)", flags)
    if m and int(m.group(1)) >= n:
        return
    flags = re.sub(_COUNT_FLAG + r"=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = (flags + f" {_COUNT_FLAG}={n}").strip()


def devices_for(n: int) -> list:
    """``n`` devices for a mesh: the default backend's when it has enough (e.g. GPUs), otherwise
    simulated CPU devices, which are created only when jax has not initialised yet."""
    import jax

    if not _backends_initialized():
        _request_host_devices(n)
    devs = jax.devices()
    if len(devs) >= n:
        return devs[:n]
    try:
        cpu = jax.devices("cpu")
    except RuntimeError:
        cpu = []
    if len(cpu) >= n:
        return cpu[:n]
    have = f"{len(devs)} {devs[0].platform} device(s)" + (f" and {len(cpu)} cpu device(s)" if cpu and devs[0].platform != "cpu" else "")
    raise ShardingError(
        f"a mesh of {n} devices was requested but this process has {have}, and jax is already "
        f"initialised so no simulated devices can be added. Set "
        f"XLA_FLAGS={_COUNT_FLAG}={n} in the environment before jax starts (or call "
        f"mesh_from_spec before any other jax operation).")


def mesh_from_spec(spec: str | Sequence[int]):
    """``"D,E,T"`` -> mesh (data=D, expert=E, tensor=T), on real devices when there are enough,
    else on simulated CPU devices (see ``devices_for``)."""
    d, e, t = parse_mesh_spec(spec)
    return make_mesh(d, e, t, devices=devices_for(d * e * t))


def use_mesh(mesh):
    """Context manager making ``mesh`` the active mesh (``jax.set_mesh``; older ``use_mesh``).
    The MoE switches to the expert-parallel path under a mesh whose "expert" axis is > 1."""
    import jax

    if mesh is None:
        return contextlib.nullcontext()
    fn = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    if fn is None:  # pragma: no cover - very old jax
        return mesh
    return fn(mesh)


# ------------------------------------------------------------------------------------- specs
@dataclasses.dataclass
class Placement:
    name: str
    shape: tuple[int, ...]
    logical: tuple | None       # the rule's logical axes (None: no rule matched)
    spec: Any                   # jax.sharding.PartitionSpec
    notes: list[str]            # fallbacks: dimensions not split as the rule asks
    padded_shape: tuple[int, ...] | None = None  # set when a PADDED_AXES dimension is zero-padded

    @property
    def placed_shape(self) -> tuple[int, ...]:
        return self.padded_shape or self.shape


def _resolve(name: str, shape: Sequence[int], logical: tuple | None, sizes: Mapping[str, int],
             strict: bool) -> Placement:
    from jax.sharding import PartitionSpec as P

    shape = tuple(int(s) for s in shape)
    notes: list[str] = []
    if logical is None:
        notes.append("no partition rule: replicated")
        if strict:
            raise ShardingError(f"{name}: no partition rule matches this tensor (shape {list(shape)})")
        return Placement(name, shape, None, P(), notes)
    if len(logical) > len(shape):
        raise ShardingError(f"{name}: rule has {len(logical)} axes for a tensor of rank {len(shape)}")
    used: set[str] = set()
    out = []
    padded = list(shape)
    for dim, (size, lax) in enumerate(itertools.zip_longest(shape, logical)):
        if lax is None:
            out.append(None)
            continue
        if lax not in LOGICAL_AXES:
            raise ShardingError(f"{name}: unknown logical axis {lax!r}")
        want = [a for a in LOGICAL_AXES[lax] if sizes.get(a, 1) > 1 and a not in used]
        if not want:
            out.append(None)
            continue
        chosen = None
        if lax in PADDED_AXES:
            n = math.prod(sizes[a] for a in want)
            padded[dim] = -(-size // n) * n
            chosen = tuple(want)
        for r in range(len(want), 0, -1):
            if chosen:
                break
            for sub in itertools.combinations(want, r):
                if size % math.prod(sizes[a] for a in sub) == 0:
                    chosen = sub
                    break
            if chosen:
                break
        if chosen != tuple(want):
            axes = "×".join(f"{a}({sizes[a]})" for a in want)
            msg = (f"dimension {dim} ({lax}, size {size}) is not divisible by mesh axis {axes}: "
                   + (f"split over {'×'.join(chosen)} only" if chosen else "replicated"))
            if strict:
                raise ShardingError(f"{name}: {msg}")
            notes.append(msg)
        if not chosen:
            out.append(None)
        else:
            used.update(chosen)
            out.append(chosen[0] if len(chosen) == 1 else chosen)
    while out and out[-1] is None:
        out.pop()
    pshape = tuple(padded) if tuple(padded) != shape else None
    return Placement(name, shape, tuple(logical), P(*out), notes, pshape)


def placement(name: str, shape: Sequence[int], mesh, *, strict: bool = False) -> Placement:
    """The placement (PartitionSpec and notes) of tensor ``name`` of ``shape`` on ``mesh``."""
    return _resolve(name, shape, match_rule(name), _mesh_sizes(mesh), strict)


def spec_for(name: str, shape: Sequence[int], mesh, *, strict: bool = False):
    return placement(name, shape, mesh, strict=strict).spec


def _report(placements: Iterable[Placement], notes: list | None):
    for p in placements:
        for n in p.notes:
            line = f"{p.name} {list(p.shape)}: {n}"
            if notes is not None:
                notes.append(line)
            else:
                log.info("sharding: %s", line)


# ------------------------------------------------------------------------------------- params
def _param_state(obj):
    from flax import nnx

    if isinstance(obj, nnx.Module):
        return nnx.state(obj)
    return obj


def _flat_params(obj):
    """[(path tuple, dot name, shape, dtype)] of every variable of a module or nnx.State."""
    from flax import nnx

    out = []
    for path, var in nnx.to_flat_state(_param_state(obj)):
        v = var.get_value() if hasattr(var, "get_value") else var
        out.append((tuple(path), ".".join(str(p) for p in path), tuple(v.shape), v.dtype))
    return out


def param_placements(obj, mesh, *, strict: bool = False) -> list[Placement]:
    sizes = _mesh_sizes(mesh)
    return [_resolve(name, shape, match_rule(name), sizes, strict) for _, name, shape, _ in _flat_params(obj)]


def param_shardings(obj, mesh, *, strict: bool = False, notes: list | None = None):
    """An nnx.State of ``NamedSharding`` (one per variable, a tree prefix of ``nnx.state(model)``)
    for a model or its (abstract or real) state: usable as jit in/out shardings and by
    ``jax.device_put``. Fallbacks are appended to ``notes`` (logged when ``notes`` is None)."""
    from flax import nnx
    from jax.sharding import NamedSharding

    flat = _flat_params(obj)
    pls = param_placements(obj, mesh, strict=strict)
    _report(pls, notes)
    return nnx.from_flat_state([(path, NamedSharding(mesh, p.spec)) for (path, *_), p in zip(flat, pls)])


def _pad_to(v, shape):
    pad = [(0, n - o) for o, n in zip(v.shape, shape)]
    if isinstance(v, np.ndarray):
        return np.pad(v, pad)
    import jax.numpy as jnp

    return jnp.pad(v, pad)


def shard_model(model, mesh, *, strict: bool = False, notes: list | None = None):
    """``jax.device_put`` every variable of ``model`` to its rule's sharding, in place (Engram
    tables zero-padded to a multiple of their split first, see ``PADDED_AXES``); returns the
    model."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    from dsv41_jax.model.moe import unblock_expert_codes

    unblock_expert_codes(model)  # the rules place [E, out, in] experts (K-blocked codes: one device)
    sizes = _mesh_sizes(mesh)
    state = nnx.state(model)
    pls = []
    for path, var in nnx.to_flat_state(state):
        v = var.get_value()
        name = ".".join(str(p) for p in path)
        p = _resolve(name, v.shape, match_rule(name), sizes, strict)
        if p.padded_shape is not None:
            log.info("sharding: %s %s zero-padded to %s", name, list(p.shape), list(p.padded_shape))
            v = _pad_to(v, p.padded_shape)
        var.set_value(jax.device_put(v, NamedSharding(mesh, p.spec)))
        pls.append(p)
    _report(pls, notes)
    nnx.update(model, state)
    return model


def abstract_params(obj, mesh, *, strict: bool = False, notes: list | None = None):
    """nnx.State of ``jax.ShapeDtypeStruct`` (placed shape, dtype, sharding) per variable: the
    target to restore a checkpoint straight into the mesh (padded Engram rows included)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    flat = _flat_params(obj)
    pls = param_placements(obj, mesh, strict=strict)
    _report(pls, notes)
    return nnx.from_flat_state([(path, jax.ShapeDtypeStruct(p.placed_shape, dtype, sharding=NamedSharding(mesh, p.spec)))
                                for (path, _, _, dtype), p in zip(flat, pls)])


# ------------------------------------------------------------------------------------- caches
def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def cache_placements(cache, mesh, *, strict: bool = False) -> list[Placement]:
    import jax

    sizes = _mesh_sizes(mesh)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        name = "cache." + ".".join(_key_str(k) for k in path)
        out.append(_resolve(name, leaf.shape, match_rule(name), sizes, strict))
    return out


def cache_shardings(cache, mesh, *, strict: bool = False, notes: list | None = None):
    """The cache pytree with a ``NamedSharding`` per leaf (real or abstract cache)."""
    import jax
    from jax.sharding import NamedSharding

    pls = cache_placements(cache, mesh, strict=strict)
    _report(pls, notes)
    treedef = jax.tree_util.tree_structure(cache)
    return jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, p.spec) for p in pls])


def shard_cache(cache, mesh, *, strict: bool = False, notes: list | None = None):
    import jax

    return jax.device_put(cache, cache_shardings(cache, mesh, strict=strict, notes=notes))


# ------------------------------------------------------------------------------------- activations
def batch_spec(mesh, shape: Sequence[int]):
    """PartitionSpec for an activation [B, ...]: batch on "data" when it divides, else replicated."""
    from jax.sharding import PartitionSpec as P

    dp = _mesh_sizes(mesh).get("data", 1)
    if dp > 1 and len(shape) and shape[0] % dp == 0:
        return P("data")
    return P()


def shard_batch(x, mesh):
    """Place an activation/input [B, ...] with its batch on "data" (None passes through)."""
    import jax
    from jax.sharding import NamedSharding

    if x is None:
        return None
    return jax.device_put(x, NamedSharding(mesh, batch_spec(mesh, np.shape(x))))


def mesh_of(arrays) -> Any:
    """The multi-device mesh ``arrays`` (e.g. a model's state leaves, as ``shard_model`` or a
    restore into a mesh leave them) are placed on, or None when they live on one device. Every
    variable of a sharded model carries a ``NamedSharding``, so the first array decides."""
    from jax.sharding import NamedSharding

    sh = getattr(next(iter(arrays), None), "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) and sh.mesh.size > 1 else None


# ------------------------------------------------------------------------------------- table
def _spec_str(spec) -> str:
    parts = []
    for p in tuple(spec):
        if p is None:
            parts.append("-")
        elif isinstance(p, tuple):
            parts.append("+".join(p))
        else:
            parts.append(str(p))
    return "(" + ", ".join(parts) + ")" if parts else "replicated"


def _split_factor(spec, sizes) -> int:
    f = 1
    for p in tuple(spec):
        if p is None:
            continue
        for a in (p if isinstance(p, tuple) else (p,)):
            f *= sizes.get(a, 1)
    return f


def shardings_table(model, mesh, *, cache=None, bytes_per_element=None) -> list[dict]:
    """Rows ``{name, shape, dtype, spec, bytes, bytes_per_device, note}`` for every parameter of
    ``model`` (module or abstract/real state) and, when given, every cache leaf.

    ``bytes_per_element(name, dtype) -> float`` overrides the storage size (e.g. 0.5 + 1/32 for fp4
    experts with one ue8m0 scale per 32 values); default: the dtype's itemsize."""
    sizes = _mesh_sizes(mesh)
    rows = []
    items = [(name, shape, dtype) for _, name, shape, dtype in _flat_params(model)]
    pls = param_placements(model, mesh)
    if cache is not None:
        import jax

        leaves = jax.tree_util.tree_leaves(cache)
        cpl = cache_placements(cache, mesh)
        items += [(p.name, p.shape, l.dtype) for p, l in zip(cpl, leaves)]
        pls += cpl
    for (name, shape, dtype), p in zip(items, pls):
        bpe = np.dtype(dtype).itemsize if bytes_per_element is None else bytes_per_element(name, dtype)
        total = math.prod(p.placed_shape) * bpe
        note = list(p.notes) + ([f"padded to {list(p.padded_shape)}"] if p.padded_shape else [])
        rows.append(dict(name=name, shape=tuple(shape), dtype=str(np.dtype(dtype)), spec=_spec_str(p.spec),
                         bytes=total, bytes_per_device=total / _split_factor(p.spec, sizes),
                         note="; ".join(note)))
    return rows


def format_table(rows: list[dict], *, max_rows: int | None = None) -> str:
    """A printable table of ``shardings_table`` rows (plus the per-device total)."""
    def gib(b):
        return f"{b / 2**30:10.3f}" if b >= 2**20 else f"{b / 2**10:9.1f}K"

    head = f"{'name':58s} {'shape':24s} {'dtype':9s} {'spec':26s} {'GiB/dev':>10s}  note"
    lines = [head, "-" * len(head)]
    for r in rows[: max_rows or len(rows)]:
        lines.append(f"{r['name'][:58]:58s} {str(list(r['shape']))[:24]:24s} {r['dtype'][:9]:9s} "
                     f"{r['spec'][:26]:26s} {gib(r['bytes_per_device'])}  {r['note']}")
    if max_rows and len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more rows")
    tot = sum(r["bytes_per_device"] for r in rows)
    lines.append(f"total per device: {tot / 2**30:.3f} GiB ({sum(r['bytes'] for r in rows) / 2**30:.3f} GiB overall)")
    return "\n".join(lines)
