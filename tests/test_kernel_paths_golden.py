"""The golden cases through the kernel code paths (the Pallas routed-expert and Sinkhorn kernels,
run by the Pallas interpreter on the CPU): what the GPU default runs, checked against the
official reference at each case's own tolerances. The Triton lowering itself is checked on the
GPU (benchmarks/check_gpu_kernels.py); this checks the kernels' logic and their wiring into the
model (dispatch, combine, grouping, rounding points) end to end."""
from __future__ import annotations

import os

import pytest

from dsv41_jax.verify import run_case

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


# the strict fp32 gate (1e-5); one case keeps the suite's time in bounds (~75 s on 2 CPU cores)
@pytest.mark.parametrize("case", ["text_fast_fp32"])
def test_golden_case_on_the_kernel_paths(case, monkeypatch):
    import dsv41_jax.kernels as K

    if not os.path.isdir(os.path.join(GOLDEN, case)):
        pytest.fail(f"golden case {case} missing")
    monkeypatch.setattr(K, "use_pallas", lambda: True)     # the GPU default's choices, on any backend
    monkeypatch.setenv("DSV41_QMATMUL_IMPL", "interpret")  # grouped_qmatmul through the Pallas interpreter
    monkeypatch.setenv("DSV41_SINKHORN", "interpret")
    monkeypatch.setenv("DSV41_TOPK_KERNEL", "interpret")  # the decode indexer's ranking top-k (kernels.topk)
    monkeypatch.setenv("DSV41_MOE_PATH", "pallas")          # the golden models have 6 experts (auto: > 16)
    res = run_case(os.path.join(GOLDEN, case), ("prefill", "decode"), log=lambda s: None)
    failed = [f"{r.kind} {r.name}: {r.detail}" for r in res if r.ok is False]
    assert res and not failed, "\n".join(failed)
    assert {r.kind for r in res} == {"prefill", "decode"}
