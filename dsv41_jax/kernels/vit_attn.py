"""The vision tower's bidirectional attention as a Mosaic GPU kernel (Hopper: TMA, warp specialization,
wgmma), bf16 in and out, with the padded keys of each image excluded.

``attention(q, k, v, n_valid)`` computes, for q, k, v [B, N, H, d] bf16::

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h] over j < n_valid[b]) v[b, j, h]

with fp32 logits, softmax statistics and accumulation, and the probabilities rounded to bf16 before
the product with V: the same rounding points as ``vision.attention_bf16`` (cuDNN's flash attention).
Query rows at or beyond ``n_valid`` are computed like the others (finite values), as there.

Why a kernel of our own: cuDNN runs the tower's 16-head x 64 attention at ~330 TFLOP/s on an H100
(``probe_vit_attention.py``, run 36), ~29.7 of the tower's ~41.5 ms. JAX ships a Hopper flash
attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``), but its shared-memory buffers are
float16 whatever the inputs are (bf16 fails inside it, run 36) and it has no key mask. Outcome
(run 39, H100): 0.95-0.97 ms per layer in isolation against cuDNN's 1.05-1.11 ms with key
lengths, but no faster inside the tower (48.87 vs 48.24 ms per ``encode_images``), so
``vision`` runs it only with ``DSV41_VIT_ATTN=mgpu``.

The schedule: a CTA owns 2 x ``block_q`` query rows of one (image, head); two compute warpgroups
own ``block_q`` rows each and a memory warpgroup streams K, V and the key bias through
``steps`` shared-memory stages (``plgpu.emit_pipeline_warp_specialized``). The two compute
warpgroups take turns on the tensor cores (a two-arrival barrier around each wgmma issue), so one
runs its exponentials while the other multiplies: at head_dim 64 the exponentials cost about as
much issue time as the MMAs. The padded keys get a -inf bias, one [B, N] fp32 row streamed with
the keys (a masked key contributes exp2(-inf) = 0 to both the sum and the product).

Implementations: ``"mosaic"`` (a Hopper GPU), ``"interpret"`` (JAX's Mosaic GPU interpreter, any
backend; there the probabilities go to wgmma through shared memory, which the interpreter needs),
``"xla"`` (:func:`attention_reference`). ``"auto"``: ``mosaic`` on a GPU of compute capability 9.x,
else ``xla``.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
BF16 = jnp.bfloat16
LOG2E = math.log2(math.e)
_IMPLS = ("auto", "mosaic", "interpret", "xla")


def attention_reference(q, k, v, n_valid, scale: float):
    """The kernel's math in XLA (fp32 logits and softmax, bf16 probabilities, fp32 accumulation)."""
    n = k.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) * scale
    valid = jnp.arange(n)[None, :] < n_valid[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", p.astype(BF16), v, preferred_element_type=F32)
    return (o / jnp.moveaxis(l, 1, 2)).astype(BF16)


def resolve_impl(impl: str = "auto") -> str:
    if impl not in _IMPLS:
        raise ValueError(f"vit_attn.attention: impl {impl!r} not in {_IMPLS}")
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu":
        return "xla"
    from dsv41_jax.kernels import compute_capability

    return "mosaic" if 9.0 <= compute_capability() < 10.0 else "xla"


# the schedule ``vision.attention_bf16`` runs: run 39's fastest in isolation (call 2, H100: 64 x 256
# tiles, two stages, turns, the bias only in blocks with padded keys, K released early: 0.967 ms
# per V4.1 layer against cuDNN's 1.109 ms with key lengths; call 1 had 64 x 128 with the bias in
# every step at 0.951 against 1.053, and 1.438 in call 2: the turn schedule's times vary between
# processes). In the tower it was no faster than cuDNN (run 39), so it is opt-in.
# ``DSV41_VIT_ATTN_CFG`` (JSON) overrides fields
DEFAULT_CONFIG = dict(block_q=64, block_kv=256, steps=2, turns=True, mask="cond", early=True)


def config() -> dict:
    """``DEFAULT_CONFIG`` with ``DSV41_VIT_ATTN_CFG``'s fields (read at trace time)."""
    raw = os.environ.get("DSV41_VIT_ATTN_CFG", "")
    cfg = dict(DEFAULT_CONFIG)
    if raw:
        try:
            extra = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"DSV41_VIT_ATTN_CFG={raw!r}: not JSON ({e})") from None
        unknown = set(extra) - set(cfg)
        if unknown:
            raise ValueError(f"DSV41_VIT_ATTN_CFG: unknown fields {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(extra)
    return cfg


def supported(shape, block_q: int = 64, block_kv: int = 64) -> str | None:
    """Why the kernel cannot take q of this ``shape`` (None when it can)."""
    if len(shape) != 4:
        return f"q must be [B, N, H, d], got {tuple(shape)}"
    _, n, _, d = shape
    if d % 64:
        return f"head_dim {d} is not a multiple of 64"
    if n % (2 * block_q) or n % block_kv:
        return f"sequence length {n} is not a multiple of {2 * block_q} and {block_kv}"
    return None


def attention(q, k, v, n_valid, *, scale: float | None = None, block_q: int = 64, block_kv: int = 64,
              steps: int = 2, impl: str = "auto", turns: bool = True, mask: str = "bias", early: bool = False):
    """q, k, v [B, N, H, d] (cast to bf16), ``n_valid`` [B] int: bf16 [B, N, H, d] (module docstring).

    Schedule options (values identical): ``turns`` (the compute warpgroups alternate on the tensor
    cores), ``mask`` ("bias": the key bias added in every step; "cond": only in the steps whose key
    block holds padded keys), ``early`` (a stage's K is released as soon as the logits are read,
    not at the end of the step)."""
    if mask not in ("bias", "cond"):
        raise ValueError(f"vit_attn.attention: mask {mask!r} not in ('bias', 'cond')")
    if q.ndim != 4:
        raise ValueError(f"vit_attn.attention: q must be [B, N, H, d], got {tuple(q.shape)}")
    b, n, h, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"vit_attn.attention: q {q.shape}, k {k.shape}, v {v.shape} must have one shape")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, k, v = (t.astype(BF16) for t in (q, k, v))
    nv = jnp.clip(jnp.asarray(n_valid, jnp.int32).reshape(b), 1, n)
    impl = resolve_impl(impl)
    if impl == "xla":
        return attention_reference(q, k, v, nv, scale)
    why = supported(q.shape, block_q, block_kv)
    if why:
        raise ValueError(f"vit_attn.attention: {why}")
    bias = jnp.where(jnp.arange(n)[None, :] < nv[:, None], 0.0, -jnp.inf).astype(F32)
    return _call(q, k, v, bias, nv, scale=scale, block_q=block_q, block_kv=block_kv,
                 steps=steps, interpret=impl == "interpret", turns=turns, mask=mask,
                 early=early)


def _call(q, k, v, bias, nv, *, scale: float, block_q: int, block_kv: int, steps: int, interpret: bool,
          turns: bool = True, mask: str = "bias", early: bool = False):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, n, h, d = q.shape
    c = scale * LOG2E  # logits in base-2 units: exp(scale * s) = exp2(c * s)

    def kernel(q_ref, k_ref, v_ref, bias_ref, nv_ref, out_ref, qo_smem, p_smem, kt_smem, q_bar, turn_bar):
        bi, hi, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        rows = pl.ds(lax.axis_index("q_seq") * (2 * block_q) + wg * block_q, block_q)
        my_q = qo_smem.at[wg]

        def take_turn():  # both compute warpgroups arrive; each passes once the other has too
            if turns:
                plgpu.barrier_arrive(turn_bar)
                plgpu.barrier_wait(turn_bar)

        def context(run):
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], my_q, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            init = (jnp.zeros((block_q, d), F32), jnp.full((block_q,), -jnp.inf, F32), jnp.zeros((block_q,), F32))
            pl.when(wg == 1)(take_turn)  # warpgroup 1 starts half a step behind warpgroup 0
            acc, _, l = run(init)
            pl.when(wg == 0)(take_turn)
            my_q[...] = (acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])).astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_q, out_ref.at[bi, rows, hi])
            plgpu.wait_smem_to_gmem(0)

        def body(idx, k_smem, v_smem, bias_smem, *rest):
            *consumed, carry = rest
            acc, m, l = carry

            def logits(s_ref):
                if interpret:  # (no transposed views there: K^T is written out)
                    kt_smem[wg] = k_smem[...].T
                    plgpu.commit_smem()
                    kt = kt_smem.at[wg]
                else:
                    kt = plgpu.transpose_ref(k_smem, (1, 0))
                plgpu.wgmma(s_ref, my_q, kt)
                take_turn()
                return s_ref[...]

            s = pl.run_scoped(logits, plgpu.ACC((block_q, block_kv), F32))
            if early:
                plgpu.barrier_arrive(consumed[0])

            def add_bias(s):
                return s + lax.broadcast_in_dim(bias_smem[...], s.shape, [1])

            s = s * c
            if mask == "bias":
                s = add_bias(s)
            else:  # only a block that reaches past the image's last valid key
                s = lax.cond((idx[0] + 1) * block_kv > nv_ref[bi], add_bias, lambda s: s, s)
            if early:
                plgpu.barrier_arrive(consumed[2])
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            pb = p.astype(BF16)
            take_turn()
            l = l * alpha + p.sum(axis=1)
            if interpret:  # the interpreter's wgmma takes its left operand from shared memory
                p_smem[wg] = pb
                plgpu.commit_smem()
                pb = p_smem.at[wg]

            def update(acc_ref):
                plgpu.wgmma(acc_ref, pb, v_smem)

            if interpret:  # (no ``run_state`` there: the product goes to a fresh accumulator, then added)
                def product(acc_ref):
                    update(acc_ref)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(product, plgpu.ACC((block_q, d), F32))
            else:
                acc = pl.run_state(update)(plgpu.ACC.init(acc))
            if early:
                plgpu.barrier_arrive(consumed[1])
            return acc, m_new, l

        pipe = plgpu.emit_pipeline_warp_specialized(
            body, grid=(n // block_kv,), max_concurrent_steps=steps, num_compute_wgs=2, memory_registers=40,
            wg_axis="wg", compute_context=context, manual_consumed_barriers=early,
            in_specs=[plgpu.BlockSpec((block_kv, d), lambda i: (i, 0)),
                      plgpu.BlockSpec((block_kv, d), lambda i: (i, 0)),
                      plgpu.BlockSpec((block_kv,), lambda i: (i,))])
        pipe(k_ref.at[bi, :, hi, :], v_ref.at[bi, :, hi, :], bias_ref.at[bi])

    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        extra["interpret"] = interpret_params.InterpretGPUParams()
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, n, h, d), BF16),
        grid=(h, n // (2 * block_q), b), grid_names=("heads", "q_seq", "batch"),
        num_threads=3, thread_name="wg",
        scratch_types=(plgpu.SMEM((2, block_q, d), BF16),
                       plgpu.SMEM((2, block_q, block_kv) if interpret else (2, 8, 64), BF16),
                       plgpu.SMEM((2, d, block_kv) if interpret else (2, 8, 64), BF16),
                       plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=2)),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **extra)
    return f(q, k, v, bias, nv)

