"""Flax NNX modules of DeepSeek-V4.1 (attribute names mirror the original checkpoint names)."""
