"""Plain-torch oracle of the DeepSeek-V4.1 text decoder (prefill), written from the spec."""

from .oracle import (  # noqa: F401
    build_token_map,
    engram_hashes_from_ids,
    engram_layout,
    forward,
    load_case,
    qdq_fp4_e4m3,
    qdq_fp4_ue8m0,
    qdq_fp8_ue8m0,
    topology,
)
