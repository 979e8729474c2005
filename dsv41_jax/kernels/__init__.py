"""Hand-written accelerator kernels (Pallas) with their XLA reference implementations."""
from dsv41_jax.kernels.qmatmul import dequantize, grouped_qmatmul, grouped_qmatmul_reference, kernel_impl

__all__ = ["dequantize", "grouped_qmatmul", "grouped_qmatmul_reference", "kernel_impl"]
