"""Hand-written accelerator kernels (Pallas) with their XLA reference implementations."""
import os

from dsv41_jax.kernels.qmatmul import dequantize, grouped_qmatmul, grouped_qmatmul_reference, kernel_impl

__all__ = ["dequantize", "grouped_qmatmul", "grouped_qmatmul_reference", "kernel_impl", "use_pallas"]

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
