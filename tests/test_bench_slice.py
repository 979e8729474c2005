"""benchmarks/bench_slice.py's prefill timing on a tiny model: the rows it emits, and the
``--prefill-reuse`` diagnostic (every argument at the same address in each call) refilling the
donated cache in place without changing the prefill's logits."""
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks import bench_slice as B  # noqa: E402
from dsv41_jax import tiny  # noqa: E402
from dsv41_jax.numerics import Numerics  # noqa: E402
from dsv41_jax.weights import load_original  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_bench") / "ck")
    tiny.write_tiny_checkpoint(d, fmt="bf16", seed=0, vision=False)
    return load_original(d, Numerics("float32", "fast"), text_only=True)


def test_prefill_reuse_rows(model, monkeypatch):
    rows = []
    monkeypatch.setattr(B, "emit", lambda **row: rows.append(row))
    monkeypatch.delenv("OUT", raising=False)
    B.bench_prefill(model, model.config, [16], mm_tflop_s=1.0, reuse=True)
    assert [r["what"] for r in rows] == ["prefill", "prefill_reused"], rows
    fresh, reused = rows
    assert "error" not in fresh and fresh["tokens"] == reused["tokens"] == 16
    # the reset wrote into the donated buffers: one address tuple over all calls, and the cache
    # refilled in place gave the fresh cache's logits bit for bit
    assert reused["cache_addresses"] == 1
    assert reused["same_logits"] is True
    assert reused["seconds"] > 0 and reused["mfu"] == pytest.approx(fresh["mfu"] * fresh["seconds"] / reused["seconds"])
