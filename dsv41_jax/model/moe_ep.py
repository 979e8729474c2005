"""Expert-parallel routed experts inside ``shard_map``.

Used by ``MoE.__call__`` when the active mesh (``jax.set_mesh`` / ``sharding.use_mesh``) spans
several devices (an "expert" axis larger than 1, or only "tensor" / "data"). The router runs
replicated outside (its fp32 logits and top-k are the unsharded ones); inside ``shard_map``
each device holds ``E / expert`` experts (their intermediate dim split over "tensor" when it
divides) and the tokens of its "data" shard:

1. keep the route weights of the local experts (zero elsewhere),
2. compute the local experts, by the path ``plan`` picks:
   * "gather" (decode, where the unsharded MoE gathers): only the selected local experts'
     weights are read (like ``MoE.routed_gather``);
   * "dense": every local expert on every local token (like ``MoE.routed_dense``);
   * a grouped matmul (what the unsharded MoE picks for ``E / expert`` experts, e.g.
     ``MoE.routed_grouped``): the unsharded implementation itself runs on the local expert
     shards through a view (``_Local``); pairs routed to other devices carry weight 0.
3. combine: ``psum`` over "tensor" of the fp32 partial ``w2`` products (the intermediate dim is
   split) and ``psum`` over "expert" of the per-token sums.

Rounding points are those of ``dsv41_jax.model.moe``: each expert output is rounded to the compute
dtype after its full fp32 ``w2`` product (so with a bf16 compute dtype and a split intermediate the
"tensor" reduction runs on the fp32 [T, E_local, D] or [T, k, D] partials before that rounding;
the grouped implementations round inside, so that case runs "dense"), the sum over experts is
fp32, and the caller adds the shared expert and casts. The only differences to the unsharded MoE
are fp32 summation orders.

At scale the grouped path still visits every (token, slot) pair on every expert shard (the ones
routed elsewhere with weight 0): the next step is dispatching tokens with an all-to-all over
"expert" into capacity buckets (only local pairs per device), then the reverse all-to-all in
place of the "expert" psum.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model.layers import HIGHEST

F32 = jnp.float32
QUANT_BLOCK = 32  # activation fake-quant block along the intermediate dim (reference numerics)


# ------------------------------------------------------------------------------------ compat
def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """``jax.shard_map`` (JAX >= 0.7) or ``jax.experimental.shard_map.shard_map`` (older)."""
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old  # pragma: no cover - old jax

    return old(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def active_mesh():
    """The active (context) mesh, or None when there is none."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:  # pragma: no cover - old jax
        return None
    m = get()
    if m is None or getattr(m, "empty", False) or not getattr(m, "shape", None):
        return None
    return m


def _sizes(mesh) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(mesh.shape).items()}


def _manual(mesh, axis: str) -> bool:
    types = getattr(mesh, "axis_types", None)
    names = tuple(getattr(mesh, "axis_names", ()))
    if not types or axis not in names:
        return False
    return "manual" in str(types[names.index(axis)]).lower()


def expert_mesh():
    """The active mesh when it spans several devices (and no axis is already manual), else None.

    Every multi-device mesh runs the routed experts here, also one without an "expert" axis:
    on a "tensor"-only mesh each device computes its slice of every expert's intermediate dim,
    on a "data"-only mesh its own tokens, with the kernels on local shards (left to XLA's
    partitioner, a kernel call would gather the sharded expert weights onto every device)."""
    m = active_mesh()
    if m is None or all(v <= 1 for v in _sizes(m).values()) or any(_manual(m, a) for a in _sizes(m)):
        return None
    return m


# ------------------------------------------------------------------------------------ plan
class _Local:
    """The MoE as seen by one device: its local expert shards in place of the stacked weights, so
    the unsharded implementations (``MoE.routed_*``, ``MoE._aq``, ``MoE._path``) run on them."""

    class _W:
        def __init__(self, a):
            self.a = a

        def __getitem__(self, idx):
            return self.a[idx]

        def get_value(self):
            return self.a

        @property
        def shape(self):
            return self.a.shape

        @property
        def dtype(self):
            return self.a.dtype

    class _P:
        """One local projection: float weights, or int8 codes + ue8m0 scales (``scale`` given)."""

        kblocked = False  # local shards are rows (``sharding.shard_model`` unblocks K-blocked experts)

        def __init__(self, a, scale=None):
            self.weight = _Local._W(a)
            self.scale = scale
            self.int8 = scale is not None

        @property
        def shape(self):  # (as ``StackedWeight.shape``)
            return tuple(self.weight.shape)

        def values(self, dtype):
            if self.int8:
                from dsv41_jax.model.moe import StackedWeight

                return StackedWeight._dequant(self.weight.a, self.scale, dtype)
            return self.weight.a.astype(dtype)

        def take(self, ids, dtype):
            if self.int8:
                from dsv41_jax.model.moe import StackedWeight

                return StackedWeight._dequant(self.weight.a[ids], self.scale[ids], dtype)
            return self.weight.a[ids].astype(dtype)

    class _E:
        pass

    def __init__(self, moe, w1, w3, w2):
        """``w1``, ``w3``, ``w2``: local projections (``_Local._P``)."""
        self.numerics, self.limit, self.gate = moe.numerics, moe.limit, moe.gate
        self.n_experts = w1.weight.shape[0]
        self.experts = _Local._E()
        self.experts.quantized = moe.experts.quantized
        self.experts.w1, self.experts.w3, self.experts.w2 = w1, w3, w2

    def __getattr__(self, name):  # MoE methods (routed_*, _aq, _path) bound to this view
        from dsv41_jax.model.moe import MoE

        fn = getattr(MoE, name)
        return fn.__get__(self, type(self))


def plan(moe, mesh, n_tokens: int):
    """Static decisions (split intermediate over "tensor", token axis, local path) or None when the
    expert count does not divide the "expert" axis (the caller keeps the unsharded path).

    Local path: "gather" when the unsharded MoE would gather (decode: only the selected experts'
    weights are read), else the unsharded MoE's choice for ``E / expert`` experts and the local
    token count ("dense" or a grouped matmul); a grouped path with a bf16 compute dtype and a
    split intermediate runs "dense" instead, whose "tensor" reduction can precede the rounding.
    """
    sizes = _sizes(mesh)
    ep, tp, dp = sizes.get("expert", 1), sizes.get("tensor", 1), sizes.get("data", 1)
    E = moe.n_experts
    if E % ep:
        return None
    I = moe.experts.w1.weight.shape[1]
    fq = bool(moe.experts.quantized and moe.numerics.fake_quant)
    split = tp > 1 and I % tp == 0
    if split and fq and I % QUANT_BLOCK == 0 and (I // tp) % QUANT_BLOCK:
        split = False  # a split would cut the activation fake-quant blocks of h
    if split and moe.experts.w2.int8 and (I // tp) % 32:
        split = False  # int8 experts: w2's per-32 scale blocks along the intermediate must stay whole
    tok = "data" if dp > 1 and n_tokens % dp == 0 else None
    k = moe.gate.k
    if n_tokens * k < E:  # same decision as the unsharded MoE
        return split, tok, "gather"
    t_local = n_tokens // dp if tok else n_tokens
    path = "dense"
    if hasattr(moe, "_path"):
        view = _Local(moe, *(_Local._P(jax.ShapeDtypeStruct((E // ep,) + tuple(w.shape[1:]), w.dtype))
                             for w in (moe.experts.w1.weight, moe.experts.w3.weight, moe.experts.w2.weight)))
        path = view._path(t_local, k)
    if path not in ("gather", "dense") and split and moe.numerics.dtype != F32:
        path = "dense"
    return split, tok, path


# ------------------------------------------------------------------------------------ body
def _local(moe, split: bool, path: str, x, w, ids, *ws):
    """One device: x [t, D], w/ids [t, k]; ``ws`` = w1/w3 [E_l, I_l, D], w2 [E_l, D, I_l] (+ their
    ue8m0 scales [E_l, I_l, D/32], [E_l, D, I_l/32] for int8 experts: dequantized here, only
    where read)."""
    from dsv41_jax.model.moe import swiglu

    dt = moe.numerics.dtype
    p1, p3, p2 = (_Local._P(ws[i], ws[i + 3] if len(ws) == 6 else None) for i in range(3))
    El = p1.weight.shape[0]
    lid = ids - jax.lax.axis_index("expert") * El
    local = (lid >= 0) & (lid < El)
    wl = jnp.where(local, w, 0.0).astype(F32)
    if path not in ("gather", "dense"):
        # the unsharded grouped implementation on the local experts; pairs routed elsewhere get
        # weight 0 (an exact zero contribution). Its rounding of each expert output happens
        # inside, so this path is only planned when that rounding commutes with the "tensor"
        # reduction (fp32, or no split).
        y = getattr(_Local(moe, p1, p3, p2), "routed_" + path)(x, wl, jnp.clip(lid, 0, El - 1))
        return jax.lax.psum(y, ("expert", "tensor") if split else ("expert",))
    gather = path == "gather"
    xa, cd = moe._aq(x)
    dot = functools.partial(jnp.einsum, precision=HIGHEST, preferred_element_type=F32)
    if gather:
        sel = jnp.clip(lid, 0, El - 1)
        g = dot("td,tkid->tki", xa.astype(cd), p1.take(sel, cd)).astype(dt)
        u = dot("td,tkid->tki", xa.astype(cd), p3.take(sel, cd)).astype(dt)
        h = (wl[..., None] * swiglu(g, u, moe.limit)).astype(dt)
        ha, cd = moe._aq(h)
        y = dot("tki,tkdi->tkd", ha.astype(cd), p2.take(sel, cd))
    else:
        full = jnp.sum(jax.nn.one_hot(lid, El, dtype=F32) * wl[..., None], axis=-2)  # [t, E_l]
        g = dot("td,eid->tei", xa.astype(cd), p1.values(cd)).astype(dt)
        u = dot("td,eid->tei", xa.astype(cd), p3.values(cd)).astype(dt)
        h = (full[..., None] * swiglu(g, u, moe.limit)).astype(dt)
        ha, cd = moe._aq(h)
        y = dot("tei,edi->ted", ha.astype(cd), p2.values(cd))
    axes = ("expert",)
    if split:
        if dt == F32:  # rounding to fp32 is the identity: reduce after the expert sum (smaller)
            axes = ("expert", "tensor")
        else:  # the full w2 product first, then round each expert output like the unsharded MoE
            y = jax.lax.psum(y, "tensor")
    y = y.astype(dt)
    if gather:
        y = jnp.where(local[..., None], y, jnp.zeros((), dt))
    y = jnp.sum(y.astype(F32), axis=1)
    return jax.lax.psum(y, axes)


def routed(moe, x, w, ids, mesh=None):
    """Routed-expert sum [T, D] fp32 for x [T, D], route weights w [T, k] fp32 and ids [T, k],
    expert parallel over the active mesh; None when the mesh does not apply (caller falls back)."""
    from jax.sharding import PartitionSpec as P

    mesh = expert_mesh() if mesh is None else mesh
    if mesh is None:
        return None
    p = plan(moe, mesh, x.shape[0])
    if p is None:
        return None
    split, tok, path = p
    ex = moe.experts
    ffn = "tensor" if split else None
    wspecs = (P("expert", ffn, None), P("expert", ffn, None), P("expert", None, ffn))
    ws = (ex.w1.weight[...], ex.w3.weight[...], ex.w2.weight[...])
    if ex.w1.int8:  # codes and scales go in sharded alike; each shard dequantizes what it reads
        wspecs = wspecs + wspecs
        ws = ws + (ex.w1.scale[...], ex.w3.scale[...], ex.w2.scale[...])
    in_specs = (P(tok), P(tok), P(tok)) + wspecs
    # the unsharded grouped paths carry loop state that starts device-invariant and becomes
    # device-varying: no replication typing for them (their psums are explicit anyway)
    fn = shard_map(functools.partial(_local, moe, split, path), mesh=mesh, in_specs=in_specs,
                   out_specs=P(tok), check=path in ("gather", "dense"))
    return fn(x, w.astype(F32), ids.astype(jnp.int32), *ws)
