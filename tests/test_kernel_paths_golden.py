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


def test_golden_bf16_case_through_the_site_kernel(monkeypatch):
    """The bf16 golden case with every prefill mHC site on ``kernels.mhc_mix.hc_site_sums``
    (``DSV41_MHC_SITE``: one pass for the expansion, the next site's sums and its collapse), in
    the Pallas interpreter; the kernel's block and the prefill threshold lowered to the case's
    40-token prompt (the defaults take chunks of more than 64 tokens). Checked against the
    official reference at the case's tolerances."""
    import dsv41_jax.kernels.mhc_mix as MM

    case = os.path.join(GOLDEN, "text_bf16")
    if not os.path.isdir(case):
        pytest.fail("golden case text_bf16 missing")
    monkeypatch.setattr(MM, "DECODE_MAX", 16)
    monkeypatch.setattr(MM, "MIN_BLOCK", 16)
    monkeypatch.setenv("DSV41_MHC_SITE_TILES", '{"bt": 16, "bd": 32}')
    monkeypatch.setenv("DSV41_MHC_SITE", "interpret")
    calls = []
    real = MM.hc_site_sums
    monkeypatch.setattr(MM, "hc_site_sums", lambda *a, **k: calls.append("y" in k) or real(*a, **k))
    res = run_case(case, ("prefill", "decode"), log=lambda s: None)
    failed = [f"{r.kind} {r.name}: {r.detail}" for r in res if r.ok is False]
    assert res and not failed, "\n".join(failed)
    assert True in calls and False in calls, calls  # both forms ran: with and without the expansion
