"""dsv41_jax: DeepSeek-V4.1 (vision-language) in JAX / Flax NNX."""
__version__ = "0.1.0"
