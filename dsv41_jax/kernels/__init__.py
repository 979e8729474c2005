"""Hand-written accelerator kernels (Pallas) with their XLA reference implementations."""
import os

from dsv41_jax.kernels.qmatmul import dequantize, grouped_qmatmul, grouped_qmatmul_reference, kernel_impl, offsets_fit

__all__ = ["auto_sharded", "dequantize", "grouped_qmatmul", "grouped_qmatmul_reference", "kernel_impl",
           "offsets_fit", "use_pallas"]

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
    try:
        cap = float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
    except (TypeError, ValueError):
        cap = 0.0
    return cap >= _MIN_CAPABILITY


def auto_sharded() -> bool:
    """Whether the code being traced runs under an active multi-device mesh outside ``shard_map``
    (XLA's SPMD partitioner places the ops). A Pallas kernel is a custom call the partitioner
    cannot split: it would gather every operand, whole weights included, onto each device. So
    there the weight GEMMs take their XLA paths (which it partitions), while inside
    ``shard_map`` (manual axes: the expert-parallel MoE) the kernels run on the local shards."""
    from dsv41_jax.model.moe_ep import _manual, active_mesh

    m = active_mesh()
    if m is None:
        return False
    return any(int(n) > 1 and not _manual(m, str(a)) for a, n in dict(m.shape).items())
