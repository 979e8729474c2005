"""Shared building blocks: Linear (checkpoint [out, in] layout), RMSNorm, exact matmul helper."""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import Numerics

HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT = jax.lax.Precision.DEFAULT
F32 = jnp.float32


def einsum(spec, a, b, **kw):
    """``jnp.einsum`` at full fp32 precision whenever an operand is fp32 (TF32 would break the
    1e-5 gate); bf16 operands take the plain bf16 path (exact products, fp32 accumulation)."""
    prec = HIGHEST if (a.dtype == F32 or b.dtype == F32) else DEFAULT
    return jnp.einsum(spec, a, b, precision=prec, **kw)


def matmul(x, w, out_dtype, compute_dtype=None):
    """``x @ w.T`` with ``w`` in [out, in] layout, fp32 accumulation, one rounding to ``out_dtype``.

    ``compute_dtype`` is the dtype both operands are cast to before the product (the dtype the
    reference runs that GEMM in); defaults to ``out_dtype``.
    """
    cd = out_dtype if compute_dtype is None else compute_dtype
    if cd == F32 and x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16:
        # an fp32 GEMM of bf16-valued operands: the products are exact in fp32 either way, so
        # skip materialising fp32 copies (e.g. of the 1.3 GB head) and accumulate in fp32
        return einsum_rounded("...i,oi->...o", x, w, out_dtype)
    y = einsum("...i,oi->...o", x.astype(cd), w.astype(cd), preferred_element_type=F32)
    return y.astype(out_dtype)


def einsum_rounded(spec, a, b, out_dtype):
    """``einsum`` with fp32 accumulation and one rounding of the sums to ``out_dtype``. For bf16
    operands and a bf16 result on the GPU (``gemm_bf16_out``) the GEMM rounds in its epilogue and
    writes bf16; otherwise an fp32 result is rounded by a second pass (the same values)."""
    if a.dtype == b.dtype == jnp.bfloat16 and jnp.dtype(out_dtype) == jnp.bfloat16 and gemm_bf16_out():
        return einsum(spec, a, b, preferred_element_type=jnp.bfloat16)
    return einsum(spec, a, b, preferred_element_type=F32).astype(out_dtype)


def gemm_bf16_out() -> bool:
    """Whether ``einsum_rounded``'s (``matmul``'s) fp32-accumulated GEMMs of bf16 operands with a
    bf16 result let the GEMM write bf16 (its fp32 sums rounded once, in its epilogue) instead of an
    fp32 result that a second pass rounds (``DSV41_GEMM_BF16_OUT``: ``auto``, the default, = on the GPU, where
    cuBLAS and XLA's Triton GEMMs accumulate bf16 products in fp32 and round once, checked bit for
    bit at the model's prefill shapes by ``benchmarks/check_gpu_kernels.py gemm_out``; ``1`` /
    ``0`` force it). Off the GPU the fp32 result stays (the CPU tests' exact path). Read at trace
    time."""
    mode = os.environ.get("DSV41_GEMM_BF16_OUT", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"DSV41_GEMM_BF16_OUT={mode!r}: use auto, 1 or 0")
    return mode == "1" or (mode == "auto" and jax.default_backend() == "gpu")


FP8_GROUP = 32  # inputs per ue8m0 scale byte in the fp8 storage mode (V4.1's 32x32 blocks)


def dequant_fp8_weight(codes, scale, dtype):
    """fp8 storage -> values: ``codes`` float8_e4m3fn [..., out, in], ``scale`` ue8m0 bytes
    [..., out, in/32] (the 32x32 block scale repeated along ``out``) -> ``dtype``.

    ``e4m3 * 2^(s-127)`` is formed in fp32 (exact: an e4m3 value has 4 significant bits) and cast
    once to ``dtype``; for scale bytes in ``FP8_EXACT_SCALES`` the product is a normal, finite
    number with at most 4 significant bits, so the cast to bf16 is exact too (the loaders refuse
    other bytes). Traced inside the jitted caller, so only the GEMM operand is materialised.
    """
    from dsv41_jax.kernels import dequantize

    return dequantize(codes, scale, dtype)  # e4m3 codes: code * 2^(scale - 127), in fp32, one cast


# e4m3 magnitudes are 2^-9 .. 448: with a scale byte s in this range every dequantized value is a
# normal fp32 / bf16 number (>= 2^-126, no flush-to-zero) and finite in bf16 (<= 448 * 2^119)
FP8_EXACT_SCALES = (10, 246)


def _use_kernel() -> bool:
    """fp8 Linears run the fused dequant-GEMM kernel where ``dsv41_jax.kernels.use_pallas`` says
    (``DSV41_KERNELS``; by default on Hopper-class GPUs), except under a mesh that splits them
    over "tensor" (``kernels.auto_split``: the custom call would gather the weight onto every
    device; XLA partitions the dequantizing matmul instead)."""
    from dsv41_jax.kernels import auto_split, use_pallas

    return use_pallas() and not auto_split("tensor")


def fp8_matmul_kernel(x, codes, scale, out_dtype, compute_dtype, weight_dtype):
    """``fp8_matmul`` through ``dsv41_jax.kernels.grouped_qmatmul`` (one group, G=1): the codes
    are dequantized in registers, never written out. Same operands and rounding points as the
    XLA path (the kernel's compute dtype is the one ``matmul`` would use); only the fp32
    summation order differs. Up to 16 rows form one row block (decode: one read of the weight),
    more rows are cut into 64-row blocks."""
    return fp8_matmul_kernel_fused(x, [(codes, scale)], out_dtype, compute_dtype, weight_dtype)[0]


def fp8_matmul_kernel_fused(x, weights, out_dtype, compute_dtype, weight_dtype):
    """``fp8_matmul_kernel`` of one ``x`` against the fp8 weights ``[(codes, scale), ...]`` (same
    input size) in one launch (``kernels.grouped_qmatmul_fused``); one result per weight."""
    return _run_problem(*fp8_kernel_problem(x, weights, out_dtype, compute_dtype, weight_dtype))


def _run_problem(prob, finish):
    """One ``kernels.grouped_qmatmul_fused`` launch of a problem dict, through ``finish``."""
    from dsv41_jax.kernels import grouped_qmatmul_fused

    return finish(grouped_qmatmul_fused(prob["x"], prob["block_group"], prob["n_blocks"], prob["weights"],
                                        bm=prob["bm"], out_dtype=prob["out_dtype"]))


def fp8_kernel_problem(x, weights, out_dtype, compute_dtype, weight_dtype):
    """The kernel problem of ``fp8_matmul_kernel_fused`` (a ``grouped_qmatmul_multi`` problem
    dict: one group, up to 16 rows as one row block, else 64-row blocks) and ``finish``, which
    turns the kernel's outputs into the results (rows unpadded, leading shape restored)."""
    cd = out_dtype if compute_dtype is None else compute_dtype
    if cd == F32 and x.dtype == jnp.bfloat16 and weight_dtype == jnp.bfloat16:
        cd = jnp.bfloat16  # bf16 x bf16 products are exact in fp32: matmul's bf16 GEMM, fp32 accumulation
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).astype(cd)
    R = x2.shape[0]
    bm = max(R, 1) if R <= 16 else 64
    pad = -R % bm
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    nb = (R + pad) // bm
    prob = dict(x=x2, block_group=jnp.zeros((nb,), jnp.int32), n_blocks=nb, weights=list(weights), bm=bm,
                out_dtype=out_dtype)

    def finish(ys):
        return tuple(y[:R].reshape(*lead, codes.shape[0]) for y, (codes, _) in zip(ys, weights))

    return prob, finish


# rows above which an fp8 Linear on the kernel path dequantizes its weight (one matrix, transient)
# and runs XLA's GEMM instead of the fused kernel: prefill-sized inputs are bound by matrix
# throughput, where XLA's bf16 GEMM beats the Pallas kernel's blocks (docs/performance.md run 16),
# and the dequantized copy costs 3 bytes of traffic per weight against 2 x rows FLOPs
FP8_KERNEL_MAX_ROWS = 256


def _env_int(name: str, default: int) -> int:
    """Integer environment override read at trace time: ``default`` when unset, one clear error
    when not an integer."""
    env = os.environ.get(name)
    if env is None:
        return default
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"{name}={env!r}: expected an integer") from None


def fp8_kernel_max_rows() -> int:
    """``FP8_KERNEL_MAX_ROWS``, or ``DSV41_FP8_KERNEL_MAX_ROWS`` when set (read at trace time)."""
    return _env_int("DSV41_FP8_KERNEL_MAX_ROWS", FP8_KERNEL_MAX_ROWS)


def fp8_matmul(x, codes, scale, out_dtype, compute_dtype, weight_dtype):
    """``x @ W.T`` for an fp8-stored weight (codes [out, in] + ue8m0 bytes [out, in/32]).

    The one call site of the fused dequant-GEMM kernel: where ``kernels.use_pallas()`` (by default
    on Hopper-class GPUs) and ``x`` has at most ``fp8_kernel_max_rows()`` rows (decode) it runs
    ``fp8_matmul_kernel``. Otherwise (CPU, prefill) the XLA path dequantizes to ``weight_dtype``
    (the dtype the bf16 loader would have stored; one transient matrix) and runs the plain
    ``matmul``: bit-identical to the model loaded with dequantized weights."""
    rows = math.prod(x.shape[:-1])
    if _use_kernel() and rows <= fp8_kernel_max_rows():
        return fp8_matmul_kernel(x, codes, scale, out_dtype, compute_dtype, weight_dtype)
    w = dequant_fp8_weight(codes, scale, weight_dtype)
    return matmul(x, w, out_dtype, compute_dtype=compute_dtype)


class Linear(nnx.Module):
    """Bias-free (optionally biased) linear layer holding ``weight`` as [out, in].

    ``quantized`` records that the checkpoint stored this weight fp8/fp4; in ``reference``
    numerics the activation then goes through the fp8 per-32 fake quantization first, exactly
    as the official fp8 GEMM path does.

    fp8 storage (``set_fp8()``, chosen at load time with ``dense_fp8``): ``weight`` holds the
    checkpoint's float8_e4m3fn codes [out, in] and ``scale`` the ue8m0 bytes [out, in/32] (the
    32x32 block scale repeated along ``out``); ``values()`` dequantizes exactly, so results equal
    those of the dequantized (bf16) weight bit for bit.
    """

    def __init__(self, in_features: int, out_features: int, *, numerics: Numerics, param_dtype=None,
                 bias: bool = False, quantized: bool = False, rngs: nnx.Rngs | None = None):
        self.in_features, self.out_features = in_features, out_features
        self.numerics = numerics
        self.quantized = quantized
        pd = numerics.dtype if param_dtype is None else param_dtype
        self.param_dtype = pd
        self.fp8 = False
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), pd))
        self.scale = None
        self.bias = nnx.Param(jnp.zeros((out_features,), pd)) if bias else None

    def set_fp8(self):
        """Switch to fp8 storage (zero codes, scale bytes 127); the loaders fill the values."""
        if self.in_features % FP8_GROUP:
            raise ValueError(f"fp8 storage needs in_features divisible by {FP8_GROUP}, got {self.in_features}")
        self.fp8 = True
        self.weight = nnx.Param(jnp.zeros((self.out_features, self.in_features), jnp.float8_e4m3fn))
        ones = jnp.full((self.out_features, self.in_features // FP8_GROUP), 127, jnp.uint8)  # 2^0
        self.scale = nnx.data(nnx.Param(ones))  # (``scale`` started as static None)

    def values(self, dtype=None):
        """The weight [out, in] in ``dtype`` (default: the dtype a dequantized load stores)."""
        dt = self.param_dtype if dtype is None else dtype
        if self.fp8:
            return dequant_fp8_weight(self.weight[...], self.scale[...], dt)
        w = self.weight[...]
        return w if dtype is None else w.astype(dt)

    def _matmul(self, x, od, cd):
        if self.fp8:
            return fp8_matmul(x, self.weight[...], self.scale[...], od, cd, self.param_dtype)
        return matmul(x, self.weight[...], od, compute_dtype=cd)

    def _prepare(self, x, out_dtype, compute_dtype, xq=None):
        """(input, out dtype, compute dtype) of the GEMM: in reference numerics a quantized
        weight's input goes through the fp8 per-32 fake quantization first (``xq``: that
        quantization of ``x`` when the caller has it already, e.g. from ``RMSNorm.with_quant``)."""
        od = self.numerics.dtype if out_dtype is None else out_dtype
        if self.quantized and self.numerics.fake_quant:
            from dsv41_jax.quant import act_quant_fp8

            # e4m3 x power-of-two values are exact in bf16, so a bf16 weight keeps the bf16 GEMM
            # (fp32 accumulation) with the same products as the reference's fp32 block GEMM
            xq = act_quant_fp8(x.astype(F32), 32) if xq is None else xq
            x = xq.astype(self.param_dtype if self.fp8 else self.weight.get_value().dtype)
            return x, od, F32
        return x, od, compute_dtype

    def __call__(self, x, out_dtype=None, compute_dtype=None, xq=None):
        x, od, cd = self._prepare(x, out_dtype, compute_dtype, xq)
        y = self._matmul(x, od, cd)
        if self.bias is not None:
            y = (y.astype(F32) + self.bias[...].astype(F32)).astype(od)
        return y


def linears_on_kernel(x, mods) -> bool:
    """Whether the Linears ``mods`` (reading ``x``) can share kernel launches: fp8-stored,
    bias-free, one input size, the same numerics, quantization flag and storage dtype, on the
    kernel path, for at most ``fp8_kernel_max_rows()`` rows, with ``kernels.fused_launches()``."""
    from dsv41_jax.kernels import fused_launches

    m0 = mods[0]
    same = all(m.fp8 and m.bias is None and m.quantized == m0.quantized and m.param_dtype == m0.param_dtype
               and m.numerics == m0.numerics and m.in_features == m0.in_features for m in mods)
    return same and _use_kernel() and math.prod(x.shape[:-1]) <= fp8_kernel_max_rows() and fused_launches()


def fusable_linears(x, mods) -> bool:
    """Whether ``fused_linears(x, mods)`` makes one launch (two or more ``linears_on_kernel``)."""
    return len(mods) > 1 and linears_on_kernel(x, mods)


def fused_linears(x, mods, out_dtype=None, compute_dtype=None, xq=None):
    """``tuple(m(x, out_dtype, compute_dtype) for m in mods)`` for Linears that read the same
    input (an expert's w1 and w3; the attention's wq_a and wkv), with one kernel launch for all
    of them where each would run ``fp8_matmul_kernel`` (decode on the kernel path): the small
    GEMVs then stream as one grid instead of paying each launch's ramp-up and tail. Same
    operands and rounding points as the separate calls; only the split-K choice (the fp32
    summation order) may differ. Any other case (bf16 weights, biases, prefill, CPU, or
    ``kernels.fused_launches()`` off) makes the separate calls. ``xq``: see ``Linear``."""
    if not fusable_linears(x, mods):
        return tuple(m(x, out_dtype, compute_dtype, xq) for m in mods)
    return _run_problem(*linears_kernel_problem(x, mods, out_dtype, compute_dtype, xq))


def linears_kernel_problem(x, mods, out_dtype=None, compute_dtype=None, xq=None):
    """The Linears ``mods`` on ``x`` as one ``kernels.grouped_qmatmul_multi`` problem, to share a
    launch with other problems (the decode MoE's shared expert beside its routed experts):
    ``(problem, finish)``, ``finish(outputs)`` giving what ``fused_linears`` returns; None where
    they do not run on the kernel (``linears_on_kernel``)."""
    if not linears_on_kernel(x, mods):
        return None
    m0 = mods[0]
    xp, od, cd = m0._prepare(x, out_dtype, compute_dtype, xq)
    return fp8_kernel_problem(xp, [(m.weight[...], m.scale[...]) for m in mods], od, cd, m0.param_dtype)


def set_fp8_storage(model, names) -> list[str]:
    """Switch the Linear modules of ``model`` named in ``names`` (dot-joined NNX paths, e.g.
    ``layers.3.attn.wq_a``) to fp8 storage. Returns the names switched; unknown names raise."""
    want = set(names)
    done = []
    found = [(".".join(str(p) for p in path), mod) for path, mod in nnx.iter_graph(model)
             if isinstance(mod, Linear)]
    for name, mod in found:
        if name in want:
            mod.set_fp8()
            done.append(name)
    missing = want - set(done)
    if missing:
        raise ValueError(f"dense_fp8: no Linear module named {sorted(missing)[:5]}")
    return done


def rms_norm(x, weight, eps: float):
    """Weighted RMSNorm: statistics and the weight product in fp32, cast once to x.dtype."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = weight.astype(F32) * y
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)

    def with_quant(self, x, quantize: bool, mix=None):
        """``(self(x), xq)``; with ``mix`` the norm of ``mhc.hc_pre(x, mix)`` (``x`` a stream
        [..., n, D]). ``xq``: the fp8 activation quantization of the result
        (``quant.act_quant_fp8``) where ``quantize`` holds and the kernel runs (decode
        on the kernel path: one ``kernels.norm_quant`` launch for collapse, norm and
        quantization; ``norm_quant_impl``), else None (the quantized GEMMs then quantize it themselves)."""
        lead, D = x.shape[:(-2 if mix is not None else -1)], x.shape[-1]
        rows = math.prod(lead)
        impl = norm_quant_impl(x, rows)
        if impl is None:
            if mix is not None:
                from dsv41_jax.model.mhc import hc_pre

                x = hc_pre(x, mix)
            return self(x), None
        from dsv41_jax.kernels.norm_quant import norm_quant

        xr = x.reshape(rows, *x.shape[len(lead):])
        m = None if mix is None else mix.reshape(rows, -1)
        xn, xq = norm_quant(xr, self.weight[...], self.eps, m, quantize=quantize, impl=impl)
        return xn.reshape(*lead, D), (None if xq is None else xq.reshape(*lead, D))


def norm_quant_impl(x, rows: int):
    """The ``kernels.norm_quant`` implementation ``RMSNorm.with_quant`` runs, or None for the
    jnp code. The kernel takes bf16 rows of a multiple of 32, at most ``norm_quant.MAX_ROWS`` of
    them (decode). ``DSV41_NORM_QUANT`` (read at trace time): ``1`` (default): the Triton kernel
    where ``kernels.use_pallas()`` holds and no mesh partitioner would have to gather its
    operands (``kernels.auto_split``); ``0``: always jnp (A/B runs); ``interpret``: the kernel in
    the Pallas interpreter on any backend (tests)."""
    from dsv41_jax.kernels import kernel_switch
    from dsv41_jax.kernels.norm_quant import MAX_ROWS

    impl = kernel_switch("DSV41_NORM_QUANT")
    return impl if x.dtype == jnp.bfloat16 and x.shape[-1] % 32 == 0 and 0 < rows <= MAX_ROWS else None


# ------------------------------------------------------------------------------ exact top-k
# Comparisons (rows x T x T) up to which the top-k of the last axis is formed by ranking (fused
# compare-and-count reductions, no scan) instead of lax.top_k's sort: decode-sized problems, where
# a sort of a few thousand scores is a slow single-block kernel (11-17 us each in the H200 profile
# of a batch-1 step). Measured on the H200 (docs/performance.md run 18, decode per token in
# generate's loop): with 2^24 the ranking replaces the router's and the ratio-2 indexer's sorts
# (batch 1 1.429 -> 1.382 ms, batch 64 6.72 -> 6.55 ms, batch 8 unchanged). The ranking costs
# about 1 us per million comparisons there: 2^26 (the ratio-1 indexer's 512-of-4160 selection at
# batch 1, the ratio-2 one at batch 8) gained nothing at batch 1 and cost 1.3% at batch 8.
# ``DSV41_RANK_TOPK_MAX`` overrides it (0: always the sort). The result is the same either way
# (tests/test_topk.py).
RANK_TOPK_MAX = 1 << 24


def _total_order_key(x):
    """int32 keys ordered like fp32 ``x`` under IEEE total order (-0 < +0, NaNs at the ends):
    the order ``lax.top_k`` ranks by."""
    b = jax.lax.bitcast_convert_type(x.astype(F32), jnp.int32)
    return jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)


def _ranks(x):
    """Position of every entry of the last axis in a stable descending sort: the number of
    entries that are larger, or equal and earlier (ties go to the lower index, as in lax.top_k)."""
    T = x.shape[-1]
    key = _total_order_key(x)
    a, b = key[..., :, None], key[..., None, :]
    earlier = jnp.arange(T)[None, :] < jnp.arange(T)[:, None]
    return jnp.sum((b > a) | ((b == a) & earlier), axis=-1, dtype=jnp.int32)


def _rank_route(x, k: int) -> bool:
    T = x.shape[-1]
    return 0 < k <= T and math.prod(x.shape) * T <= _env_int("DSV41_RANK_TOPK_MAX", RANK_TOPK_MAX)


def top_k(x, k: int):
    """``jax.lax.top_k(x, k)`` (values, int32 indices; descending, ties to the lower index,
    IEEE total order), formed by ranking when the problem is small (``RANK_TOPK_MAX``): the same
    result, without a sort."""
    if not _rank_route(x, k):
        v, i = jax.lax.top_k(x, k)
        return v, i.astype(jnp.int32)
    r = _ranks(x)
    T = x.shape[-1]
    pos = jnp.arange(k, dtype=jnp.int32)
    idx = jnp.sum(jnp.where(r[..., None, :] == pos[:, None], jnp.arange(T, dtype=jnp.int32), 0), axis=-1)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def top_k_mask(x, k: int):
    """Boolean mask of the entries ``lax.top_k(x, k)`` selects (ties to the lower index)."""
    if not _rank_route(x, k):
        _, i = jax.lax.top_k(x, k)
        return jnp.any(jax.nn.one_hot(i, x.shape[-1], dtype=bool), axis=-2)
    return _ranks(x) < k


def top_k_indices_ascending(x, k: int):
    """The indices ``lax.top_k(x, k)`` selects, in ascending order (int32 [..., k]). Where
    ``DSV41_TOPK_KERNEL`` (``kernels.kernel_switch``: 1 default, 0, interpret) selects a kernel:
    up to ``kernels.topk.MAX_ROWS`` rows (decode) of at most ``kernels.topk.MAX_ENTRIES``
    entries from the ranking kernel ``kernels.topk.topk_ascending``, more rows (prefill, large
    batches) of at most ``kernels.topk.SELECT_MAX_ENTRIES`` from ``kernels.topk.topk_select``;
    otherwise XLA. The result is the same either way."""
    from dsv41_jax.kernels.topk import topk_ascending, topk_select

    impl, form = topk_route(math.prod(x.shape[:-1]), x.shape[-1], k)
    if form == "rank":
        return topk_ascending(x, k, impl=impl)
    if form == "select":
        return topk_select(x, k, impl=impl)
    return _top_k_indices_ascending_xla(x, k)


def topk_route(rows: int, T: int, k: int):
    """``(impl, form)``: how ``top_k_indices_ascending`` selects ``k`` of ``T`` entries in each of
    ``rows`` rows: ``form`` "rank" (``kernels.topk.topk_ascending``), "select"
    (``kernels.topk.topk_select``: one program per row, so any number of rows in one launch) or
    "xla"; ``impl`` the kernel's implementation (None for XLA). Read at trace time."""
    from dsv41_jax.kernels import kernel_switch
    from dsv41_jax.kernels.topk import MAX_ENTRIES, MAX_ROWS, SELECT_MAX_ENTRIES

    impl = kernel_switch("DSV41_TOPK_KERNEL")
    if impl is not None and 0 < k <= T:
        if rows <= MAX_ROWS:
            if T <= MAX_ENTRIES:
                return impl, "rank"
        elif T <= SELECT_MAX_ENTRIES:
            return impl, "select"
    return None, "xla"


def _top_k_indices_ascending_xla(x, k: int):
    """``top_k_indices_ascending`` in XLA: ranking (``RANK_TOPK_MAX``) or ``lax.top_k`` + sort."""
    if not _rank_route(x, k):
        _, i = jax.lax.top_k(x, k)
        return jnp.sort(i, axis=-1).astype(jnp.int32)
    T = x.shape[-1]
    sel = _ranks(x) < k
    ar = jnp.arange(T, dtype=jnp.int32)
    # place of each selected entry among the selected ones: the selected entries before it
    place = jnp.sum(sel[..., None, :] & (ar[None, :] < ar[:, None]), axis=-1, dtype=jnp.int32)
    slot = jnp.where(sel, place, k)  # unselected entries fill no slot
    return jnp.sum(jnp.where(slot[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None], ar, 0), axis=-1,
                   dtype=jnp.int32)
