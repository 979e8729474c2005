"""Every golden case copied from the official V4.1 reference passes `dsv41_jax.verify`.

The cases (tests/golden/<case>/) carry their own tolerances (case.json); the checker runs the
case's numerics (fast fp32, reference fp32 with fake-quant, bf16 with fp8/fp4 release weights).
"""
from __future__ import annotations

import os

import pytest

from dsv41_jax.verify import KINDS, main, run_case

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
CASES = sorted(d for d in os.listdir(GOLDEN) if os.path.exists(os.path.join(GOLDEN, d, "case.json")))


@pytest.mark.parametrize("case", CASES)
def test_golden_case(case):
    res = run_case(os.path.join(GOLDEN, case), KINDS, log=lambda s: None)
    failed = [f"{r.kind} {r.name}: {r.detail}" for r in res if r.ok is False]
    not_run = [f"{r.kind} {r.name}: {r.detail}" for r in res if r.ok is None]
    assert not failed, "\n".join(failed)
    assert not not_run, "\n".join(not_run)
    kinds = {r.kind for r in res}
    # every kind the case's reference supports was checked
    assert {"prefill", "blocks", "decode", "engram"} <= kinds, kinds
    assert len(res) > 40


def test_expected_cases_present():
    assert {"text_fast_fp32", "image_fast_fp32", "text_fp32", "image_fp32", "text_bf16", "image_fp8"} <= set(CASES)


def test_cli_exit_status(tmp_path, capsys):
    # a case whose reference disagrees must fail with exit status 1 and a FAIL line
    import shutil

    import numpy as np

    dst = tmp_path / "bad"
    shutil.copytree(os.path.join(GOLDEN, "text_fast_fp32"), dst)
    ref = dict(np.load(dst / "reference.npz"))
    ref["prefill_logits"] = ref["prefill_logits"] * 1.01
    np.savez(dst / "reference.npz", **ref)
    rc = main([str(dst), "--only", "prefill"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "prefill_logits" in out
    import re

    assert re.match(r"^\d+ passed, [1-9]\d* failed", out.strip().splitlines()[-1])


def test_not_a_case(tmp_path, capsys):
    rc = main([str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "not a case directory" in out


def test_preprocess_fixture_directory():
    res = run_case(os.path.join(GOLDEN, "preprocess"), KINDS, log=lambda s: None)
    assert len(res) == 11, [r.name for r in res]
    assert all(r.ok for r in res), [f"{r.name}: {r.detail}" for r in res if not r.ok]
