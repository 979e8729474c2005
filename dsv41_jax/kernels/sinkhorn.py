"""Sinkhorn normalisation of the mHC per-token n x n mixing matrix as one Pallas kernel.

``sinkhorn(logits, iters, eps)`` maps ``logits [..., n*n]`` (row-major ``[n, n]`` per token) to
``comb [..., n, n]`` fp32 with the math of ``dsv41_jax.model.mhc.hc_mixes``::

    c = softmax(logits, over each row, max subtracted) + eps
    c = c / (column sums + eps)                                  # once
    repeat iters - 1 times:
        c = c / (row sums + eps)
        c = c / (column sums + eps)

Why a kernel: in XLA every one of the ~40 row / column sums of a decode step's few tokens
becomes its own tiny reduction kernel (~0.2 ms per mHC site on the H200, docs/performance.md
run 6). The kernel keeps the n*n values of a token in registers for the whole computation.

Layout: the logits are flattened to ``[T, n*n]`` tokens, transposed to ``[n*n, T_pad]`` in XLA
(``T_pad``: ``T`` rounded up to the token block ``bt``, zero padded; pad + transpose are one
XLA fusion) so that entry ``k`` of ``bt`` consecutive tokens is one contiguous ``[bt]`` vector.
A program owns one token block: it loads the n*n vectors with ref indexing
(``x_ref[k, pl.ds(t0, bt)]``), runs every step as elementwise ops on ``[bt]`` vectors (row and
column sums as explicit left-to-right adds, max as ``maximum``; no in-register slicing or
reductions) and stores n*n vectors; the result is transposed back in XLA.

Implementations (``impl``): ``"triton"`` (Pallas compiled by Triton; GPU), ``"interpret"`` (the
same kernel in the Pallas interpreter; CPU tests), ``"xla"`` (:func:`sinkhorn_reference`, the
jnp formulation of ``hc_mixes``). ``"auto"``: triton on a GPU backend, xla elsewhere.

Numerics: on CPU (interpreter) the kernel agrees with the reference to ~1e-7 relative (only the
order of the n-term sums may differ). On GPU Triton lowers fp32 ``exp`` and ``/`` to fast
approximate instructions (a few ulp), so agreement there is expected at ~1e-6 relative, not
bit-identical. Forward only (no VJP): the model runs it for inference.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dsv41_jax.kernels.qmatmul import _pow2_at_least

F32 = jnp.float32
_IMPLS = ("auto", "triton", "interpret", "xla")
DEFAULT_BLOCK = 256  # tokens per program (upper bound; fewer tokens -> a smaller power of two)
MIN_BLOCK = 16


def _side(nn: int) -> int:
    n = math.isqrt(nn)
    if n * n != nn or n < 1:
        raise ValueError(f"sinkhorn: last axis {nn} is not n*n")
    return n


def sinkhorn_reference(logits, iters: int, eps: float, unroll: bool | None = None):
    """XLA formulation (the one in ``hc_mixes``): ``logits [..., n*n]`` -> ``[..., n, n]`` fp32.

    ``unroll`` (default: on every backend but the CPU) unrolls the (row, column) pairs: on a GPU
    XLA then fuses the whole normalization into one kernel (docs/performance.md run 4). On the
    CPU the unrolled chain makes XLA duplicate each pair's producers into every later reduction
    fusion (quadratic in ``iters``: ~12k of the 71k optimized HLO instructions of a small test
    model), which doubled its compile time, so there it stays a loop. The same operations in the
    same order either way (XLA's rewrites of a division may still move an entry by an ulp)."""
    n = _side(logits.shape[-1])
    c = logits.astype(F32).reshape(*logits.shape[:-1], n, n)
    c = jnp.exp(c - jnp.max(c, axis=-1, keepdims=True))
    c = c / jnp.sum(c, axis=-1, keepdims=True) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    if unroll is None:
        unroll = jax.default_backend() != "cpu"
    return jax.lax.fori_loop(0, iters - 1, body, c, unroll=bool(unroll))


def _sum(vals):
    s = vals[0]
    for v in vals[1:]:
        s = s + v
    return s


def normalize_lists(c, iters: int, eps: float):
    """The Sinkhorn normalisation of ``c[i][j]`` (row i, column j; each an fp32 vector over a
    block of tokens) as elementwise operations on those vectors: no in-register slicing or
    reductions, so it lowers to Triton as straight-line code."""
    n = len(c)

    def rows(c):
        out = []
        for r in c:
            s = _sum(r) + eps
            out.append([v / s for v in r])
        return out

    def cols(c):
        s = [_sum([c[i][j] for i in range(n)]) + eps for j in range(n)]
        return [[c[i][j] / s[j] for j in range(n)] for i in range(n)]

    # row softmax (+ eps), one column normalisation
    soft = []
    for r in c:
        m = r[0]
        for v in r[1:]:
            m = jnp.maximum(m, v)
        e = [jnp.exp(v - m) for v in r]
        s = _sum(e)
        soft.append([v / s + eps for v in e])
    c = cols(soft)
    if iters > 1:  # a device loop over the (row, column) pairs; the carry is the n*n vectors

        def pair(_, flat):
            c = cols(rows([list(flat[i * n:(i + 1) * n]) for i in range(n)]))
            return tuple(v for r in c for v in r)

        flat = jax.lax.fori_loop(0, iters - 1, pair, tuple(v for r in c for v in r))
        c = [list(flat[i * n:(i + 1) * n]) for i in range(n)]
    return c


def _kernel(x_ref, o_ref, *, n: int, iters: int, eps: float, bt: int):
    """One token block: ``x_ref`` / ``o_ref`` are the whole ``[n*n, T_pad]`` arrays."""
    from jax.experimental import pallas as pl

    t0 = pl.multiple_of(pl.program_id(0) * bt, bt)
    # c[i][j]: entry (row i, column j) of bt tokens, a [bt] fp32 vector
    c = [[x_ref[i * n + j, pl.ds(t0, bt)].astype(F32) for j in range(n)] for i in range(n)]
    c = normalize_lists(c, iters, eps)
    for i in range(n):
        for j in range(n):
            o_ref[i * n + j, pl.ds(t0, bt)] = c[i][j]


def choose_block(tokens: int, block: int = DEFAULT_BLOCK) -> int:
    """Token block: the smallest power of two >= ``tokens``, clamped to [MIN_BLOCK, ``block``]."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"sinkhorn: block {block} is not a power of two")
    return max(min(_pow2_at_least(max(tokens, 1)), block), min(MIN_BLOCK, block))


def _pallas(logits, iters: int, eps: float, *, block: int, interpret: bool, num_warps: int | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    lead, nn = logits.shape[:-1], logits.shape[-1]
    n = _side(nn)
    x = logits.astype(F32).reshape(-1, nn)
    T = x.shape[0]
    if T == 0:
        return jnp.zeros((*lead, n, n), F32)
    bt = choose_block(T, block)
    tp = pl.cdiv(T, bt) * bt
    xt = jnp.pad(x, ((0, tp - T), (0, 0))).T  # [n*n, T_pad]; zero logits are harmless
    kernel = functools.partial(_kernel, n=n, iters=iters, eps=float(eps), bt=bt)
    per_tok = nn * (3 + 3 * iters) + 2 * n  # adds + divides per token, roughly
    cost = pl.CostEstimate(flops=tp * per_tok, transcendentals=tp * nn, bytes_accessed=2 * 4 * tp * nn)
    if num_warps is None:
        num_warps = max(1, min(4, bt // 32))
    kw = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((nn, tp), F32), grid=(tp // bt,),
                         interpret=interpret, cost_estimate=cost, name="mhc_sinkhorn", **kw)(xt)
    return out[:, :T].T.reshape(*lead, n, n)


def sinkhorn_impl(impl: str = "auto") -> str:
    """Resolve ``impl``: ``auto`` -> triton on a GPU backend, xla elsewhere."""
    if impl not in _IMPLS:
        raise ValueError(f"sinkhorn: impl {impl!r} not in {_IMPLS}")
    if impl == "auto":
        impl = "triton" if jax.default_backend() == "gpu" else "xla"
    return impl


def sinkhorn(logits, iters: int, eps: float, impl: str = "auto", *, block: int = DEFAULT_BLOCK,
             num_warps: int | None = None):
    """``logits [..., n*n]`` (any float dtype, computed in fp32) -> ``comb [..., n, n]`` fp32.

    Row softmax + ``eps``, one column normalisation, then ``iters - 1`` (row, column) pairs,
    every normalisation ``c / (sum + eps)``. ``impl``: see the module docstring; ``block``:
    tokens per program (power of two; smaller for fewer tokens); ``num_warps``: Triton launch
    width (default: one warp per 32 tokens, at most 4)."""
    impl = sinkhorn_impl(impl)
    if impl == "xla":
        return sinkhorn_reference(logits, iters, eps)
    return _pallas(logits, iters, eps, block=block, interpret=impl == "interpret", num_warps=num_warps)
