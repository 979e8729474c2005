"""Hand-written accelerator kernels (Pallas) with their XLA reference implementations."""
import os

from dsv41_jax.kernels.indexer import indexer_scores, indexer_scores_reference
from dsv41_jax.kernels.mhc_mix import hc_mix_sums, hc_mix_sums_reference
from dsv41_jax.kernels.qmatmul import (dequantize, grouped_qmatmul, grouped_qmatmul_fused, grouped_qmatmul_multi,
                                      grouped_qmatmul_reference, kernel_impl, offsets_fit)

__all__ = ["auto_split", "compute_capability", "dequantize", "fused_launches", "grouped_qmatmul", "grouped_qmatmul_fused",
           "grouped_qmatmul_multi", "grouped_qmatmul_reference", "hc_mix_sums", "hc_mix_sums_reference",
           "indexer_scores", "indexer_scores_reference", "kernel_impl", "kernel_switch", "offsets_fit", "use_pallas"]

# GPUs the Triton kernels were measured on (compute capability >= 9.0: Hopper, H200 in
# docs/performance.md runs 5-7); elsewhere "auto" keeps the XLA paths
_MIN_CAPABILITY = 9.0


def use_pallas() -> bool:
    """Whether the model's quantized GEMMs and routed experts run the Pallas kernels
    (``DSV41_KERNELS``: ``auto`` (default) = on a GPU of compute capability >= 9.0, ``pallas`` =
    on any GPU, ``xla`` = never). Read at trace time; off the GPU the XLA paths always run."""
    import jax

    mode = os.environ.get("DSV41_KERNELS", "auto")
    if mode not in ("auto", "xla", "pallas"):
        raise ValueError(f"DSV41_KERNELS={mode!r}: use auto, xla or pallas")
    if mode == "xla" or jax.default_backend() != "gpu":
        return False
    if mode == "pallas":
        return True
    return compute_capability() >= _MIN_CAPABILITY


def compute_capability() -> float:
    """The first device's CUDA compute capability (e.g. 9.0 on Hopper); 0.0 where it has none."""
    import jax

    try:
        return float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
    except (TypeError, ValueError):
        return 0.0


def env_switch(var: str, default: str = "1", on: str = "on") -> bool:
    """An on/off environment switch read at trace or compile time: ``1`` or ``0`` (``default``
    when unset); any other value is one clear error naming the variable (``on``: what 1 means)."""
    mode = os.environ.get(var, default)
    if mode not in ("0", "1"):
        raise ValueError(f"{var}={mode!r}: use 1 ({on}) or 0; default {default}")
    return mode == "1"


def fused_launches() -> bool:
    """Whether projections that read the same input share one kernel launch
    (``grouped_qmatmul_fused``: the routed experts' w1 and w3, the fp8 Linears of
    ``layers.fused_linears``). ``DSV41_FUSED_LAUNCH=0`` turns it off (separate launches, for A/B
    runs); read at trace time."""
    return env_switch("DSV41_FUSED_LAUNCH", on="fused launches")


def auto_split(*axes: str) -> bool:
    """Whether the code being traced runs under an active mesh whose ``axes`` (default: all)
    include one of several devices that ``shard_map`` has not made manual, i.e. where XLA's
    SPMD partitioner places the ops. A Pallas kernel is a custom call the partitioner cannot
    split: given an operand sharded over such an axis it gathers it whole onto every device.
    So a weight GEMM keeps its kernel only where its weight is replicated: the fp8 Linears
    (split over "tensor" only) under meshes without a "tensor" split, the routed experts inside
    ``shard_map`` (manual axes: local shards)."""
    from dsv41_jax.model.moe_ep import _manual, active_mesh

    m = active_mesh()
    if m is None:
        return False
    sizes = {str(a): int(n) for a, n in dict(m.shape).items()}
    return any(n > 1 and not _manual(m, a) for a, n in sizes.items() if not axes or a in axes)


def kernel_switch(var: str, default: str = "1") -> str | None:
    """The implementation an on/off environment switch of a decode kernel selects, read at trace
    time: ``1`` (the default unless ``default`` says otherwise): ``"triton"`` where
    ``use_pallas()`` holds and no mesh partitioner would have to gather the kernel's operands
    (``auto_split``), else None (XLA); ``0``: None (always XLA, for A/B runs); ``interpret``:
    the Pallas interpreter on any backend (tests). The caller still checks that the kernel
    applies to its shapes."""
    mode = os.environ.get(var, default)
    if mode not in ("0", "1", "interpret"):
        raise ValueError(f"{var}={mode!r}: use 1 (the kernel where it applies), 0 (XLA) or interpret; default {default}")
    if mode == "interpret":
        return "interpret"
    return "triton" if mode == "1" and use_pallas() and not auto_split() else None
