"""MoE FFN: sqrt-softplus router (fp32 logits, selection-only bias, ``bias_vl`` on image-span
positions), clamped SwiGLU experts with the route weight applied before ``w2``, one shared
expert, fp32 accumulation."""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from dsv41_jax.config import TextConfig
from dsv41_jax.model.layers import (Linear, einsum, fused_linears, linears_kernel_problem, linears_on_kernel, matmul,
                                   top_k)
from dsv41_jax.numerics import Numerics
from dsv41_jax import quant
from dsv41_jax.model import moe_ep

F32 = jnp.float32


def swiglu(g, u, limit: float):
    g, u = g.astype(F32), u.astype(F32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def pallas_chunk(n_pairs: int, n_experts: int) -> int:
    """Rows per expert block for the Pallas grouped GEMM (``MoE.routed_pallas``), from the mean
    number of pairs per expert ``m``. Every block costs one read (and dequantization) of its
    expert's weights and its padded rows cost MMA work, so a block should hold a typical expert's
    pairs, balanced routing's spread included: the largest power of two ``p <= m`` (32..128) plus
    a row tile of ``max(16, pow2 >= 2.5 sqrt(m))`` rows, at most ``p / 2`` (kernel ``Config.tail``:
    both tiles share each dequantized weight tile), e.g. 160 = 128 + 32 at m = 128 (an 8k prefill
    of V4.1-Flash), 48 = 32 + 16 at m = 32; below m = 32 the power of two above ``m`` (16 or 32).
    On uniform routing 160 was 16% faster than 128 and 48 16% faster than 32 (docs/performance.md,
    run 19). ``DSV41_MOE_CHUNK`` (rows in [16, 1024]) fixes it (tuning runs)."""
    env = os.environ.get("DSV41_MOE_CHUNK")
    if env:
        if not env.isdigit() or not 16 <= int(env) <= 1024:
            raise ValueError(f"DSV41_MOE_CHUNK={env!r}: use a number of rows in [16, 1024]")
        return int(env)
    m = n_pairs / max(n_experts, 1)
    if m <= 16:
        return 16
    if m < 32:
        return 32
    p = 32
    while p < 128 and 2 * p <= m:
        p *= 2
    tail = 16
    while tail < p // 2 and tail < 2.5 * math.sqrt(m):
        tail *= 2
    return p + tail


def _block_rows(row_token, c: int):
    """The rows each ``c``-row block of ``MoE._rows``' layout holds (a prefix of the block): what
    ``kernels.moe_mgpu``'s ``Tiles.tail`` reads to skip the MMAs of a block's empty tail."""
    return jnp.sum((row_token >= 0).reshape(-1, c), axis=1, dtype=jnp.int32)


def split_tail() -> str:
    """``DSV41_MOE_SPLIT_TAIL`` (read at trace time): "both" (default), "glu" or "0": a prefill's
    expert blocks whose pairs fit the main row tile (160 = 128 + 32: an expert with <= 128 pairs)
    run in a launch without the tail tile, the others in a second one, in ``moe_glu`` (and with
    "both" in the w2 launch too) instead of every block computing both row tiles. Run 28: 8k
    prefill 85.2 -> 84.5 ("glu") -> 83.5 ms ("both"); one kernel choosing its row tiles per block
    behind branches was slower (88.6 ms)."""
    mode = os.environ.get("DSV41_MOE_SPLIT_TAIL", "both")
    if mode not in ("0", "glu", "both"):
        raise ValueError(f"DSV41_MOE_SPLIT_TAIL={mode!r}: use 0, glu or both")
    return mode


# Expert blocks of at least this many rows (prefills of ~1k tokens and more at V4.1-Flash) take
# ``kernels.moe_glu``; smaller ones (a batch-64 decode step's 16-row blocks) keep the fused
# ``grouped_qmatmul`` launch: on 16-row blocks moe_glu made that step 11.8 -> 13.3 ms (run 27).
GLU_MIN_ROWS = 32


def kernel_weight(p):
    """A routed projection (``StackedWeight`` or a local expert shard) as the kernels take it:
    (codes, ue8m0 scales) for int8 experts, (weights, None) otherwise."""
    return p.weight[...], (p.scale[...] if p.int8 else None)


def hquant_kernel() -> bool:
    """``DSV41_MOE_HQUANT`` (read at trace time): ``kernel`` (the default: ``routed_mgpu``
    quantizes h for w2 with ``kernels.moe_glu.quant_used_rows``, only the rows w2 reads) or
    ``xla`` (``quant.act_quant_fp8`` of the whole layout: A/B runs)."""
    mode = os.environ.get("DSV41_MOE_HQUANT", "kernel")
    if mode not in ("kernel", "xla"):
        raise ValueError(f"DSV41_MOE_HQUANT={mode!r}: use kernel (the default) or xla")
    return mode == "kernel"


def kernel_scales_mode() -> str:
    """``DSV41_MGPU_SCALES`` (read at trace time): ``kept`` (the default: the Mosaic GPU prefill
    kernel reads the copies of the expert scales in its layout that :func:`keep_kernel_scales`
    added, where there are any) or ``transpose`` (it transposes ``scale`` per call: A/B runs)."""
    mode = os.environ.get("DSV41_MGPU_SCALES", "kept")
    if mode not in ("kept", "transpose"):
        raise ValueError(f"DSV41_MGPU_SCALES={mode!r}: use kept (the default) or transpose")
    return mode


def mgpu_weight(p):
    """``kernel_weight(p)`` plus the scales in the Mosaic GPU kernel's layout where ``p`` keeps
    them (``StackedWeight.scale_k``) and ``kernel_scales_mode()`` reads them, else None."""
    sk = getattr(p, "scale_k", None)
    return (*kernel_weight(p), sk[...] if sk is not None and kernel_scales_mode() == "kept" else None)


class KernelScale(nnx.Variable):
    """A derived copy of an int8 routed projection's ue8m0 scales in the Mosaic GPU prefill
    kernel's layout [E, K // 32, O] (``kernels.moe_mgpu.scale_t`` of ``scale``), so that a prefill
    reads them as they are instead of transposing 3 x 100 MB per V4.1-Flash layer per call. Not an
    ``nnx.Param``: checkpoints never store it; :func:`keep_kernel_scales` forms it from ``scale``."""


def keep_kernel_scales(model, *, force: bool = False) -> int:
    """Give every int8 ``StackedWeight`` of ``model`` a ``scale_k`` (:class:`KernelScale`) formed
    from its current ``scale``, where the prefill's routed experts run on the Mosaic GPU kernel
    (``moe_mgpu.prefill_mode()``; ``force``: regardless). Costs 1/32 of the int8 codes' bytes
    (3%), saves the kernel's per-call scale transposes (run 34: 0.42 ms per V4.1-Flash layer at an
    8k prefill). Call it after the weights are final: a copy does not follow later changes of
    ``scale`` (call it again, or ``drop_kernel_scales``). ``api.load`` calls it for models on one
    device. Returns the bytes added. Structural change: ``generate.forget(model)`` if it already
    ran."""
    from dsv41_jax.kernels import moe_mgpu

    if not force and moe_mgpu.prefill_mode() == "triton":
        return 0
    added = 0
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, StackedWeight) and mod.int8:
            s = mod.scale[...]
            mod.scale_k = KernelScale(jax.jit(moe_mgpu.scale_t)(s))
            added += s.size * s.dtype.itemsize
    return added


# "auto" since session 31 (run 41, one H100, 2-layer slice): K-blocked codes make the 8k prefill
# 42.4-42.8 ms against 45.3-45.9 with rows and decode batch 64 7.78 against 8.97 ms per token;
# batch 1 pays 4.6% (1.200 against 1.147 ms: still 82% of its byte roofline). Off Hopper "auto"
# is rows.
DEFAULT_EXPERT_LAYOUT = "auto"


def expert_layout() -> str:
    """``DSV41_EXPERT_LAYOUT`` (read by :func:`block_expert_codes`), resolved: ``auto`` (K-blocked
    where the prefill's routed experts run on the Mosaic GPU kernel, ``moe_mgpu.prefill_mode()``
    not ``triton``, i.e. Hopper GPUs, else rows), ``kblocked`` or ``rows``
    (``DEFAULT_EXPERT_LAYOUT``). Returns ``kblocked`` or ``rows``."""
    from dsv41_jax.kernels import moe_mgpu

    mode = os.environ.get("DSV41_EXPERT_LAYOUT", DEFAULT_EXPERT_LAYOUT)
    if mode not in ("auto", "kblocked", "rows"):
        raise ValueError(f"DSV41_EXPERT_LAYOUT={mode!r}: use auto, kblocked or rows ({DEFAULT_EXPERT_LAYOUT}: "
                         "the default)")
    if mode == "auto":
        mode = "rows" if moe_mgpu.prefill_mode() == "triton" else "kblocked"
    return mode


_RELAYOUT_CHUNK_BYTES = 256 << 20


def _relayout_on_device(w, fn):
    """``fn(w)`` (``fn`` maps each expert on its own: axis 0 stays) on the device, a few experts at
    a time into one preallocated result: the peak is the two arrays plus one chunk. One XLA
    transpose of the whole array would also need scratch for XLA to tune it (run 38 on an H100:
    out of memory with twice the bytes free)."""
    E = w.shape[0]
    per = int(max(1, min(E, _RELAYOUT_CHUNK_BYTES // max(1, w.nbytes // E))))
    out = jax.eval_shape(fn, jax.ShapeDtypeStruct(w.shape, w.dtype))
    res = jax.jit(lambda: jnp.zeros(out.shape, out.dtype), out_shardings=w.sharding)()
    for i in range(0, E, per):
        # (the last chunk ends at E: it may cover experts already done, with the same values)
        res = _relayout_chunk(res, w, jnp.int32(min(i, E - per)), fn, per)
    return res


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=0)
def _relayout_chunk(res, w, i, fn, per: int):
    """``res`` with experts i .. i + per - 1 set to ``fn`` of ``w``'s (in place: ``res`` donated;
    one executable per shape, shared by the projections of a model)."""
    part = fn(lax.dynamic_slice_in_dim(w, i, per, axis=0))
    return lax.dynamic_update_slice_in_dim(res, part, i, axis=0)


def _relayout(var, fn, via_host: bool | None = None) -> None:
    """Replace the array of ``var`` by ``fn`` of it (numpy or jax; per expert, axis 0 kept): on
    its device, a few experts at a time, where twice its bytes and a margin are free, else through
    host memory, the device copy dropped before the new one is placed (run 37: the device transpose
    of a 4.2 GB projection ran out of memory beside an H100's full slice). ``via_host`` forces
    either."""
    import numpy as np

    w = var[...]
    if via_host is None:
        try:
            stats = next(iter(w.sharding.device_set)).memory_stats() or {}
            free = stats["bytes_limit"] - stats["bytes_in_use"]
        except (AttributeError, KeyError, StopIteration, RuntimeError):
            free = None  # (no statistics, e.g. the CPU backend: host memory either way)
        via_host = free is not None and free < 2 * w.nbytes + 4 * _RELAYOUT_CHUNK_BYTES
    if not via_host:
        var.set_value(_relayout_on_device(w, fn))
        return
    sharding = w.sharding
    host = np.asarray(jax.device_get(w))
    var.set_value(jnp.zeros((0,), w.dtype))  # the old device buffer goes before the new one comes
    del w
    var.set_value(jax.device_put(np.ascontiguousarray(fn(host)), sharding))


def block_expert_codes(model, *, force: bool = False, via_host: bool | None = None) -> int:
    """Store every int8 ``StackedWeight`` of ``model`` K-blocked (``kernels.qmatmul.kblock``:
    ``[E, in / 64, out, 64]``), in place, where :func:`expert_layout` asks for it (``force``:
    regardless). Every reader follows the layout (the Triton and Mosaic GPU
    kernels read it as it is, the XLA forms transpose the experts they take), and the values do
    not change. On the GPU the prefill's expert kernel streams each step's weight tile as one
    contiguous block instead of 64-byte pieces K bytes apart (~10% faster launches in isolation,
    runs 36 and 38), but the model's 8k prefill was no faster with it and decode 7.5% slower
    (run 38): off by default. Projections whose input width is not a multiple of 64 stay in rows. A single-device
    layout: weights spread over several devices are refused (``sharding.shard_model`` restores
    rows first). ``api.load`` calls it for models on one device; checkpoints are written in rows
    (``save_model``). Each projection is rearranged on its device a few experts at a time where
    twice its bytes are free, else through host memory (:func:`_relayout`; ``via_host`` forces
    either). Returns how many projections it
    blocked. Structural change: ``generate.forget(model)`` if it already ran."""
    from dsv41_jax.kernels.qmatmul import KBLOCK, kblock

    if not force and expert_layout() == "rows":
        return 0
    n = 0
    for path, mod in nnx.iter_graph(model):
        if not (isinstance(mod, StackedWeight) and mod.int8) or mod.kblocked or mod.weight.shape[-1] % KBLOCK:
            continue
        w = mod.weight[...]
        sh = getattr(w, "sharding", None)
        if sh is not None and len(sh.device_set) > 1:
            raise ValueError(f"block_expert_codes: {'.'.join(map(str, path))}.weight is spread over several "
                             "devices; K-blocked expert codes are a single-device layout")
        del w
        _relayout(mod.weight, kblock, via_host)
        n += 1
    return n


def unblock_expert_codes(model, *, via_host: bool | None = None) -> int:
    """Undo :func:`block_expert_codes` (the rows layout ``[E, out, in]``), in place, as it does
    (``via_host``); returns how many projections changed."""
    from dsv41_jax.kernels.qmatmul import unblock

    n = 0
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, StackedWeight) and mod.kblocked:
            _relayout(mod.weight, unblock, via_host)
            n += 1
    return n


def drop_kernel_scales(model) -> int:
    """Remove the copies :func:`keep_kernel_scales` added; returns how many."""
    n = 0
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, StackedWeight) and getattr(mod, "scale_k", None) is not None:
            mod.scale_k = None
            n += 1
    return n


def combine_pairs(y, row_of_pair, T: int, k: int):
    """Sum each token's k expert outputs (rows ``row_of_pair`` of ``y``) in fp32, slot order: [T, D]."""
    return jnp.sum(jnp.take(y, row_of_pair, axis=0).reshape(T, k, -1).astype(F32), axis=1)


class Gate(nnx.Module):
    def __init__(self, cfg: TextConfig, numerics: Numerics, vision: bool):
        E, D = cfg.n_routed_experts, cfg.hidden_size
        self.k = cfg.num_experts_per_tok
        self.temp = cfg.gate_temp
        self.norm_topk = cfg.norm_topk_prob
        self.route_scale = cfg.routed_scaling_factor
        self.weight = nnx.Param(jnp.zeros((E, D), numerics.dtype))
        self.bias = nnx.Param(jnp.zeros((E,), F32))
        self.bias_vl = nnx.Param(jnp.zeros((E,), F32)) if vision else None

    def __call__(self, x, image_mask=None):
        """x [..., D] -> (weights [..., k] fp32, ids [..., k] int32), ids sorted by biased score."""
        z = matmul(x, self.weight[...], F32, compute_dtype=F32)
        if self.temp != 1.0:
            z = z / self.temp
        s = jnp.sqrt(jax.nn.softplus(z))
        b = self.bias[...]
        if image_mask is not None and self.bias_vl is not None:
            b = jnp.where(image_mask[..., None], self.bias_vl[...], b)
        _, ids = top_k(s + b, self.k)
        w = jnp.take_along_axis(s, ids, axis=-1)
        if self.norm_topk and self.k > 1:
            w = w / (jnp.sum(w, -1, keepdims=True) + 1e-20)
        return w * self.route_scale, ids.astype(jnp.int32)


class Expert(nnx.Module):
    """Shared expert (a plain SwiGLU FFN)."""

    def __init__(self, D: int, I: int, limit: float, numerics: Numerics):
        self.limit = limit
        self.numerics = numerics
        self.w1 = Linear(D, I, numerics=numerics)
        self.w2 = Linear(I, D, numerics=numerics)
        self.w3 = Linear(D, I, numerics=numerics)

    def __call__(self, x, xq=None):
        """``xq``: the fp8 activation quantization of ``x`` if the caller has it (``Linear``)."""
        g, u = fused_linears(x, (self.w1, self.w3), xq=xq)  # one launch on the decode kernel path
        h = swiglu(g, u, self.limit)
        return self.w2(h.astype(x.dtype))


class StackedWeight(nnx.Module):
    """One routed-expert projection for all experts: ``weight`` [E, out, in].

    ``int8=True`` keeps the release fp4 experts quantized in device memory: ``weight`` holds int8
    codes equal to twice the e2m1 value (-12..12) and ``scale`` the ue8m0 byte of every 32
    inputs [E, out, in/32]; values are ``code / 2 * 2^(scale - 127)``, dequantized (exactly, in
    the compute dtype) only for the experts a computation reads. ``kblocked`` (after
    :func:`block_expert_codes`; told by the rank of ``weight``): the int8 codes are stored
    K-blocked, ``[E, in / 64, out, 64]`` (``kernels.qmatmul.kblock``), the layout the GPU kernels
    stream fastest; checkpoints keep ``[E, out, in]``.
    """

    def __init__(self, E: int, out_f: int, in_f: int, dtype, int8: bool = False):
        self.int8 = int8
        if int8:
            if in_f % 32:
                raise ValueError(f"int8 experts need an input width divisible by 32, got {in_f}")
            self.weight = nnx.Param(jnp.zeros((E, out_f, in_f), jnp.int8))
            self.scale = nnx.Param(jnp.zeros((E, out_f, in_f // 32), jnp.uint8))
        else:
            self.weight = nnx.Param(jnp.zeros((E, out_f, in_f), dtype))
            self.scale = None
        self.scale_k = nnx.data(None)  # ``keep_kernel_scales``: the scales in the prefill kernel's layout

    @staticmethod
    def _dequant(codes, scale, dtype):
        from dsv41_jax.kernels import dequantize

        return dequantize(codes, scale, dtype)  # int8 codes: code * 0.5 * 2^(scale - 127)

    def _rows(self, codes):
        """Codes of ``weight`` (any leading expert axes) in the rows layout [..., out, in]."""
        from dsv41_jax.kernels.qmatmul import unblock

        return unblock(codes) if self.kblocked else codes

    @property
    def kblocked(self) -> bool:
        """Whether ``weight`` holds K-blocked codes (its rank: 4; :func:`block_expert_codes`)."""
        return len(self.weight.shape) == 4

    @property
    def shape(self) -> tuple:
        """The logical shape [E, out, in] in either layout."""
        from dsv41_jax.kernels.qmatmul import code_dims

        return tuple(code_dims(self.weight[...]))

    def values(self, dtype):
        """All experts [E, out, in] in ``dtype``."""
        if not self.int8:
            return self.weight[...].astype(dtype)
        return self._dequant(self._rows(self.weight[...]), self.scale[...], dtype)

    def take(self, ids, dtype):
        """The experts ``ids`` (any shape) -> [*ids.shape, out, in]."""
        if not self.int8:
            return self.weight[...][ids].astype(dtype)
        return self._dequant(self._rows(self.weight[...][ids]), self.scale[...][ids], dtype)


class Experts(nnx.Module):
    def __init__(self, cfg: TextConfig, numerics: Numerics, int8: bool = False):
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.numerics = numerics
        self.quantized = False  # set by the loader when the checkpoint stores fp4/fp8 experts
        self.w1 = StackedWeight(E, I, D, numerics.dtype, int8)
        self.w2 = StackedWeight(E, D, I, numerics.dtype, int8)
        self.w3 = StackedWeight(E, I, D, numerics.dtype, int8)


class MoE(nnx.Module):
    def __init__(self, cfg: TextConfig, numerics: Numerics, vision: bool, experts_int8: bool = False):
        self.numerics = numerics
        self.limit = cfg.swiglu_limit
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg, numerics, vision)
        self.experts = Experts(cfg, numerics, experts_int8)
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit, numerics)

    def wants_xq(self) -> bool:
        """Whether the routed or shared experts take an fp8-quantized input (``_aq``, ``Linear``)."""
        return self.numerics.fake_quant and (self.experts.quantized or self.shared_experts.w1.quantized)

    def _quantizes(self) -> bool:
        """Whether the routed experts' inputs are fp8-quantized (``_aq``): reference numerics."""
        return self.experts.quantized and self.numerics.fake_quant

    def _aq(self, x, xq=None):
        """(GEMM input, its dtype): in reference numerics with quantized experts the fp8 per-32
        activation quantization of ``x`` (``xq`` if the caller has it), else ``x``."""
        if self._quantizes():
            # e4m3 x 2^k activations are exact in the (bf16) weight dtype: same products, fp32 accumulation
            wdt = self.numerics.dtype if self.experts.w1.int8 else self.experts.w1.weight.get_value().dtype
            xq = quant.act_quant_fp8(x.astype(F32), 32) if xq is None else xq
            return xq.astype(wdt), wdt
        return x, self.numerics.dtype

    def routed_dense(self, x, w, ids):
        """Every expert on every token, weights zero off the selection (exact; small E or T)."""
        dt = self.numerics.dtype
        full = jnp.sum(jax.nn.one_hot(ids, self.n_experts, dtype=F32) * w[..., None], axis=-2)  # [T, E]
        xa, cd = self._aq(x)
        ex = self.experts
        g = einsum("td,eid->tei", xa.astype(cd), ex.w1.values(cd),
                       preferred_element_type=F32).astype(dt)
        u = einsum("td,eid->tei", xa.astype(cd), ex.w3.values(cd),
                       preferred_element_type=F32).astype(dt)
        h = (full[..., None] * swiglu(g, u, self.limit)).astype(dt)
        ha, cd = self._aq(h)
        y = einsum("tei,edi->ted", ha.astype(cd), ex.w2.values(cd),
                       preferred_element_type=F32).astype(dt)
        return jnp.sum(y.astype(F32), axis=1)

    def routed_gather(self, x, w, ids):
        """Gather only the selected experts' weights per token (decode: few tokens)."""
        dt = self.numerics.dtype
        ex = self.experts
        xa, cd = self._aq(x)
        w1 = ex.w1.take(ids, cd)  # [T, k, I, D]
        w3 = ex.w3.take(ids, cd)
        w2 = ex.w2.take(ids, cd)  # [T, k, D, I]
        g = einsum("td,tkid->tki", xa.astype(cd), w1.astype(cd), preferred_element_type=F32).astype(dt)
        u = einsum("td,tkid->tki", xa.astype(cd), w3.astype(cd), preferred_element_type=F32).astype(dt)
        h = (w[..., None] * swiglu(g, u, self.limit)).astype(dt)
        ha, cd = self._aq(h)
        y = einsum("tki,tkdi->tkd", ha.astype(cd), w2.astype(cd), preferred_element_type=F32).astype(dt)
        return jnp.sum(y.astype(F32), axis=1)

    def routed_ragged(self, x, w, ids):
        """Grouped matmul over (token, slot) pairs sorted by expert (``jax.lax.ragged_dot``):
        every routed product is computed once, with the same rounding points as the dense path."""
        dt = self.numerics.dtype
        ex = self.experts
        T, k = ids.shape
        E = self.n_experts
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tok = order // k
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xa, cd = self._aq(x)
        xs = xa[tok].astype(cd)
        kw = dict(preferred_element_type=F32,
                  precision=jax.lax.Precision.HIGHEST if cd == F32 else jax.lax.Precision.DEFAULT)
        w1 = jnp.swapaxes(ex.w1.values(cd), 1, 2)  # [E, D, I]
        w3 = jnp.swapaxes(ex.w3.values(cd), 1, 2)
        g = jax.lax.ragged_dot(xs, w1, sizes, **kw).astype(dt)
        u = jax.lax.ragged_dot(xs, w3, sizes, **kw).astype(dt)
        h = (w.reshape(-1)[order][:, None] * swiglu(g, u, self.limit)).astype(dt)
        ha, cd = self._aq(h)
        y = jax.lax.ragged_dot(ha.astype(cd), jnp.swapaxes(ex.w2.values(cd), 1, 2), sizes, **kw).astype(dt)
        return jnp.zeros((T, y.shape[-1]), F32).at[tok].add(y.astype(F32))

    def _blocks(self, ids, chunk: int):
        """Block layout of (token, slot) pairs sorted by expert: each ``chunk``-row block holds the
        pairs of one expert. Returns (order, pidx, n_blocks_max, block_expert, n_used): pair
        ``order[i]`` sits at row ``pidx[i]``; blocks ``>= n_used`` are empty."""
        E, N, c = self.n_experts, ids.size, chunk
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        se = flat[order]
        counts = jnp.bincount(flat, length=E).astype(jnp.int32)
        nch = (counts + c - 1) // c
        cend = jnp.cumsum(nch)
        cstart = cend - nch
        gstart = jnp.cumsum(counts) - counts
        pidx = cstart[se] * c + (jnp.arange(N, dtype=jnp.int32) - gstart[se])
        NC = N // c + min(E, N)
        chunk_expert = jnp.minimum(jnp.searchsorted(cend, jnp.arange(NC), side="right"), E - 1).astype(jnp.int32)
        return order, pidx, NC, chunk_expert, cend[-1]

    def _rows(self, w, ids, chunk: int):
        """``_blocks``' expert-sorted row layout as indices: (row_token [NC*chunk] (the token of
        each row's pair, -1 for empty rows), ws [NC*chunk] fp32 route weights (0 for empty rows),
        row_of_pair [T*k] (the row pair ``t*k+s`` landed in), NC, block_expert, n_used). Only
        int32 indices are scattered."""
        T, k = ids.shape
        N = T * k
        order, pidx, NC, block_expert, n_used = self._blocks(ids, chunk)
        rowsrc = jnp.full((NC * chunk,), N, jnp.int32).at[pidx].set(order.astype(jnp.int32))
        ws = jnp.take(w.reshape(-1).astype(F32), rowsrc, axis=0, mode="fill", fill_value=0)
        row_of_pair = jnp.zeros((N,), jnp.int32).at[order].set(pidx.astype(jnp.int32))
        row_token = jnp.where(rowsrc < N, rowsrc // k, -1)
        return row_token, ws, row_of_pair, NC, block_expert, n_used

    def _dispatch(self, xa, w, ids, chunk: int, cd):
        """Gather the (token, slot) pairs into ``_blocks``' expert-sorted row layout: ``_rows``
        with ``xs [NC*chunk, D]`` (the rows in ``cd``, zeros for empty rows) in place of the
        row tokens."""
        from dsv41_jax.kernels.moe_glu import gather_rows

        row_token, *rest = self._rows(w, ids, chunk)
        return (gather_rows(xa.astype(cd), row_token), *rest)

    def routed_grouped(self, x, w, ids, chunk: int = 128):
        """Grouped matmul without a dense emulation: (token, slot) pairs are sorted by expert and
        laid out in ``chunk``-row blocks that each belong to one expert; a loop over the USED
        blocks multiplies each by its expert's weights (each selected expert is read once per
        block of its tokens). Same rounding points as ``routed_dense``."""
        dt = self.numerics.dtype
        ex = self.experts
        T, k = ids.shape
        c = chunk
        xa, cd = self._aq(x)
        D = x.shape[-1]
        xs, ws, row_of_pair, NC, chunk_expert, n_used = self._dispatch(xa, w, ids, c, cd)

        def body(j, out):
            e = chunk_expert[j]
            xc = jax.lax.dynamic_slice_in_dim(xs, j * c, c)
            wc = jax.lax.dynamic_slice_in_dim(ws, j * c, c)
            g = einsum("td,id->ti", xc, ex.w1.take(e, cd), preferred_element_type=F32).astype(dt)
            u = einsum("td,id->ti", xc, ex.w3.take(e, cd), preferred_element_type=F32).astype(dt)
            h = (wc[:, None] * swiglu(g, u, self.limit)).astype(dt)
            ha, cd2 = self._aq(h)
            y = einsum("ti,di->td", ha.astype(cd2), ex.w2.take(e, cd2), preferred_element_type=F32).astype(dt)
            return jax.lax.dynamic_update_slice_in_dim(out, y, j * c, 0)

        out = jax.lax.fori_loop(0, n_used, body, jnp.zeros((NC * c, D), dt))
        return combine_pairs(out, row_of_pair, T, k)

    def routed_pallas(self, x, w, ids, with_shared: bool = False, xq=None):
        """Routed experts through ``dsv41_jax.kernels.grouped_qmatmul_fused`` (w1 and w3 in one
        launch unless ``kernels.fused_launches()`` is off, then w2): the expert weights are read
        in place (int8 codes + ue8m0 scales dequantized in registers, or the float weights), never
        copied. Decode (fewer pairs than experts): every (token, slot) pair is a one-row block
        naming its expert (GEMV). Otherwise the pairs are sorted into ``routed_grouped``'s block
        layout (GEMM per block). Rounding points as ``routed_dense``; only fp32 summation orders
        differ. On a GPU the kernel is the Triton one; elsewhere its XLA reference (or the Pallas
        interpreter with ``DSV41_QMATMUL_IMPL=interpret``). ``with_shared`` (decode, only where
        ``routed_pallas_with_shared`` allows it): the shared expert's projections run in the same
        launches (``grouped_qmatmul_multi``) and its output is added."""
        from dsv41_jax.kernels import fused_launches, grouped_qmatmul_fused, grouped_qmatmul_multi
        from dsv41_jax.kernels.moe_glu import glu_kernel, moe_glu
        from dsv41_jax.kernels.qmatmul import tail_selector

        dt = self.numerics.dtype
        ex = self.experts
        sh = self.shared_experts if with_shared else None  # (moe_ep's local views have none)
        T, k = ids.shape
        N = T * k

        def qmm(a, blocks, n, ps, bm, shared_in=None, shared_mods=(), shared_xq=None, **tiles):
            """One launch for the projections ``ps`` of the same rows (and, with ``shared_in``, the
            shared expert's ``shared_mods`` on it); returns (routed outputs, shared outputs or None)."""
            ws = [kernel_weight(p) for p in ps]
            if shared_in is not None:
                prob, finish = linears_kernel_problem(shared_in, shared_mods, xq=shared_xq)
                ours, theirs = grouped_qmatmul_multi([dict(x=a, block_group=blocks, n_blocks=n, weights=ws, bm=bm,
                                                           out_dtype=dt), prob])
                return ours, finish(theirs)
            if not fused_launches():
                return tuple(grouped_qmatmul_fused(a, blocks, n, [wi], bm=bm, out_dtype=dt, **tiles)[0]
                             for wi in ws), None
            return grouped_qmatmul_fused(a, blocks, n, ws, bm=bm, out_dtype=dt, **tiles), None

        xa, cd = self._aq(x, xq)
        if N < self.n_experts:
            blocks = ids.reshape(-1).astype(jnp.int32)
            xs = jnp.repeat(xa.astype(cd), k, axis=0)  # row t*k + s: token t, slot s
            (g, u), sgu = qmm(xs, blocks, N, (ex.w1, ex.w3), 1, *((x, (sh.w1, sh.w3), xq) if sh is not None else ()))
            h = (w.reshape(-1, 1) * swiglu(g, u, self.limit)).astype(dt)
            ha, cd2 = self._aq(h)
            hs = (swiglu(*sgu, sh.limit).astype(x.dtype), (sh.w2,)) if sh is not None else ()
            (y,), sy = qmm(ha.astype(cd2), blocks, N, (ex.w2,), 1, *hs)
            y = jnp.sum(y.reshape(T, k, -1).astype(F32), axis=1)
            return y + sy[0].astype(F32) if sh is not None else y
        if with_shared:
            raise ValueError("routed_pallas: with_shared is for decode (fewer pairs than experts)")
        c = pallas_chunk(N, self.n_experts)
        mgpu = self._mgpu_mode(c, cd)
        if mgpu in ("mgpu", "mgpu-glu"):
            return self.routed_mgpu(xa.astype(cd), w, ids, c)
        split = split_tail()
        sel = None
        if c >= GLU_MIN_ROWS and glu_kernel():  # rows gathered, w1 + w3, SwiGLU (and w2's act quant) in one launch
            row_token, ws, row_of_pair, NC, blocks, n_used = self._rows(w, ids, c)
            tails = tail_selector(row_token, c) if split != "0" else None
            h = moe_glu(xa.astype(cd), row_token, ws, blocks, n_used,
                        kernel_weight(ex.w1), kernel_weight(ex.w3),
                        bm=c, limit=self.limit, out_dtype=dt, act_quant=self._quantizes(), split_tail=tails)
            ha, cd2 = self._aq(h, xq=h)  # (already quantized: only the dtype)
            if split == "both":  # w2 skips the tail tiles moe_glu left unwritten
                sel = tails
        else:
            xs, ws, row_of_pair, NC, blocks, n_used = self._dispatch(xa, w, ids, c, cd)
            (g, u), _ = qmm(xs, blocks, n_used, (ex.w1, ex.w3), c)
            h = (ws[:, None] * swiglu(g, u, self.limit)).astype(dt)
            ha, cd2 = self._aq(h)
        if mgpu == "mgpu-w2":  # the Mosaic GPU w2 on h's rows (unwritten rows stay unread by the combine)
            return self._mgpu_w2(ha.astype(cd2), blocks, n_used, row_of_pair, c, T, k, _block_rows(row_token, c))
        # combine_pairs reads the rows of pairs only: unused blocks (and split-off tail rows) of y
        # stay unwritten
        (y,), _ = qmm(ha.astype(cd2), blocks, n_used, (ex.w2,), c, dead_zeros=False, split_tail=sel)
        return combine_pairs(y, row_of_pair, T, k)

    def _mgpu_mode(self, c: int, cd) -> str | None:
        """``DSV41_MOE_PREFILL`` for a prefill with ``c``-row expert blocks (``GLU_MIN_ROWS`` and more):
        "mgpu" / "mgpu-glu" (``routed_mgpu``), "mgpu-w2" (``kernels.moe_glu``, then the Mosaic GPU
        w2) or None (the Triton launches: the default, and wherever the Mosaic GPU kernel does not
        take the shapes: int8 experts and bf16 only, ``kernels.moe_mgpu.applies``)."""
        from dsv41_jax.kernels import moe_mgpu
        from dsv41_jax.kernels.moe_glu import glu_kernel

        mode = moe_mgpu.prefill_mode()
        if mode == "triton" or c < GLU_MIN_ROWS or not self.experts.w1.int8:
            return None
        ps = ("w2",) if mode == "mgpu-w2" else ("w1", "w3", "w2")
        fits = all(self._mgpu_tiles(p, c, cd) is not None for p in ps)
        return mode if fits and (mode != "mgpu-w2" or glu_kernel()) else None

    def _mgpu_tiles(self, proj: str, c: int, cd=jnp.bfloat16):
        """``kernels.moe_mgpu.launch_tiles`` for projection ``proj`` of the routed experts (None:
        the kernel does not take its shapes)."""
        from dsv41_jax.kernels.moe_mgpu import launch_tiles

        p = getattr(self.experts, "w1" if proj == "glu" else proj)
        _, O, K = p.shape
        return launch_tiles(proj, O, K, c, p.weight.dtype, cd, kblocked=p.kblocked)

    def _mgpu_w2(self, h, blocks, n_used, row_of_pair, c: int, T: int, k: int, block_rows=None):
        """w2 (``kernels.moe_mgpu``, rows in and out) on the block layout ``h`` [rows, I], then each
        token's k expert outputs summed in fp32, slot order: [T, D]. ``block_rows``: the rows each
        block holds (for ``Tiles.tail``)."""
        from dsv41_jax.kernels.moe_mgpu import grouped_matmul_t

        codes, scale, sk = mgpu_weight(self.experts.w2)
        y = grouped_matmul_t(h, blocks, n_used, codes, scale, bm=c, out_dtype=self.numerics.dtype, scale_k=sk,
                             x_rows=True, out_rows=True, tiles=self._mgpu_tiles("w2", c), block_rows=block_rows)
        return combine_pairs(y, row_of_pair, T, k)

    def routed_mgpu(self, xa, w, ids, c: int):
        """A prefill's routed experts through ``kernels.moe_mgpu`` (Mosaic GPU, ``DSV41_MOE_PREFILL``
        ``mgpu-glu`` / ``mgpu``) on ``routed_grouped``'s block layout: one launch for w1 + w3 with the
        SwiGLU in its epilogue (``mgpu``: a launch each and XLA's SwiGLU), XLA's fp8 quantization of
        h in reference numerics, the w2 launch. The kernels read the tokens' rows and store rows
        (their tiles transposed in shared memory), so XLA transposes nothing. Same rounding points
        as ``routed_dense``. ``xa``: the GEMM input (``_aq``)."""
        from dsv41_jax.kernels.moe_glu import gather_kernel, gather_used_rows, quant_used_rows
        from dsv41_jax.kernels.moe_mgpu import grouped_glu_t, grouped_matmul_t, prefill_mode

        dt = self.numerics.dtype
        ex = self.experts
        T, k = ids.shape
        row_token, ws, row_of_pair, _, blocks, n_used = self._rows(w, ids, c)
        block_rows = _block_rows(row_token, c)
        # [rows, D] (the kernel reads its token tiles as rows); on the GPU only the used blocks'
        # rows are written, the kernels read no other
        xs = gather_used_rows(xa, row_token, n_used, bm=c, impl="auto" if gather_kernel() else "xla")
        # h [rows, I] (the kernel stores its tiles transposed); rows of unused blocks are not written
        if prefill_mode() == "mgpu-glu":
            h = grouped_glu_t(xs, ws, blocks, n_used, mgpu_weight(ex.w1), mgpu_weight(ex.w3), bm=c,
                              limit=self.limit, x_rows=True, out_rows=True, tiles=self._mgpu_tiles("glu", c),
                              block_rows=block_rows)
        else:
            def one(p):
                codes, scale, sk = mgpu_weight(getattr(ex, p))
                return grouped_matmul_t(xs, blocks, n_used, codes, scale, bm=c, out_dtype=dt, scale_k=sk,
                                        x_rows=True, out_rows=True, tiles=self._mgpu_tiles(p, c),
                                        block_rows=block_rows)

            g, u = one("w1"), one("w3")
            h = (ws[:, None] * swiglu(g, u, self.limit)).astype(dt)
        # reference numerics: the fp8 quantization of the rows the w2 launch reads (in place)
        hq = quant_used_rows(h, n_used, bm=c) if self._quantizes() and hquant_kernel() else None
        ha, cd2 = self._aq(h, xq=hq)
        return self._mgpu_w2(ha.astype(cd2), blocks, n_used, row_of_pair, c, T, k, block_rows)

    def routed_pallas_with_shared(self, x, w, ids, xq=None):
        """Decode (fewer pairs than experts) with the shared expert's fp8 projections in the routed
        experts' launches (``kernels.grouped_qmatmul_multi``): w1 + w3 of both in one launch, then
        both w2. Returns the routed sum plus the shared expert's output (fp32), bit for bit what
        ``routed_pallas`` plus ``shared_experts`` give with the same kernel configurations; None
        where the shared expert does not run on the kernel (``layers.linears_on_kernel``)."""
        sh = self.shared_experts
        if ids.size >= self.n_experts or not linears_on_kernel(x, (sh.w1, sh.w3)) \
                or not linears_on_kernel(x, (sh.w2,)):
            return None
        return self.routed_pallas(x, w, ids, with_shared=True, xq=xq)

    def _path(self, T: int, k: int) -> str:
        """Routed-expert implementation for T tokens: ``DSV41_MOE_PATH`` (gather, dense, grouped,
        ragged, pallas) overrides the choice by size; where ``kernels.use_pallas()`` (``DSV41_KERNELS``:
        by default on Hopper-class GPUs) the automatic choice is the Pallas kernels (both read at
        trace time), unless the expert weights are split by XLA's partitioner (outside
        ``shard_map``) or too large for the kernel's 32-bit offsets (``kernels.offsets_fit``)."""
        forced = os.environ.get("DSV41_MOE_PATH", "auto")
        if forced != "auto":
            if forced not in ("gather", "dense", "grouped", "ragged", "pallas"):
                raise ValueError(f"DSV41_MOE_PATH={forced!r}: use auto, gather, dense, grouped, ragged or pallas")
            return forced
        from dsv41_jax.kernels import auto_split, offsets_fit, use_pallas

        w1 = self.experts.w1.weight
        if (self.n_experts > 16 and use_pallas() and not auto_split("expert", "tensor")
                and offsets_fit(w1.shape, w1.dtype)):
            return "pallas"
        if T * k < self.n_experts:
            return "gather"
        if self.n_experts <= 16:
            return "dense"
        return "grouped"

    def __call__(self, x, image_mask=None, capture=None, xq=None):
        """``xq``: the fp8 activation quantization of ``x`` if the caller formed it
        (``RMSNorm.with_quant``); the decode kernel path and the shared expert use it."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        xqt = None if xq is None else xq.reshape(xt.shape)
        im = None if image_mask is None else image_mask.reshape(-1)
        w, ids = self.gate(xt, im)
        if capture is not None:
            capture["moe_topk"] = ids.reshape(*shape[:-1], -1)
            capture["moe_weights"] = w.reshape(*shape[:-1], -1)
        T = xt.shape[0]
        y = moe_ep.routed(self, xt, w, ids)  # in shard_map under a multi-device mesh, else None
        if y is None:
            path = self._path(T, w.shape[-1])
            if path == "pallas":  # decode: the shared expert in the routed experts' launches where it can
                y = self.routed_pallas_with_shared(xt, w, ids, xq=xqt)
                if y is not None:
                    return y.astype(x.dtype).reshape(shape)
            y = self.routed_pallas(xt, w, ids, xq=xqt) if path == "pallas" else getattr(self, "routed_" + path)(xt, w, ids)
        y = y + self.shared_experts(xt, xqt).astype(F32)
        return y.astype(x.dtype).reshape(shape)
