"""Execute every notebook of notebooks/ top to bottom on CPU and check its key outputs.

Each notebook runs in its own kernel process (the sharding notebook sets XLA's simulated device
count, which only works before jax starts). The kernel is this interpreter
(``sys.executable -m ipykernel_launcher``) through a kernel spec written to a temporary directory,
so the test needs no installed ``python3`` kernel and works in a fresh virtual environment. The
kernel's cwd is notebooks/ and the repository root is on its PYTHONPATH (the package need not be
installed).

Environment: DSV41_NOTEBOOK_CELL_TIMEOUT (seconds per cell, default 900); DSV41_NOTEBOOK_OUT (a
directory to write the executed notebooks to, e.g. as CI artifacts).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = ("quickstart.ipynb", "sharding.ipynb", "parity.ipynb")
CELL_TIMEOUT = int(os.environ.get("DSV41_NOTEBOOK_CELL_TIMEOUT", "900"))
KERNEL = "dsv41-jax-test"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernel spec running this interpreter, with the repository on its path."""
    d = tmp_path_factory.mktemp("kernels")
    spec = d / KERNEL
    spec.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        "JAX_PLATFORMS": "cpu",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    # the notebooks choose their own XLA flags (device count) before jax starts
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--InteractiveShell.colors=nocolor"],  # plain tracebacks in the failure message
        "display_name": "dsv41_jax test kernel",
        "language": "python",
        "env": env,
    }))
    return d


def _run(name: str, kernel_dir: Path):
    """Execute notebook ``name``; returns (notebook, seconds). Fails with the failing cell's error."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(NB_DIR / name, as_version=4)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, startup_timeout=180,
                                     resources={"metadata": {"path": str(NB_DIR)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute(cleanup_kc=True)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        error = f"{name}: a cell failed\n{e}"
    finally:
        if km.has_kernel:  # a client given its kernel manager only stops the kernel when told to
            km.shutdown_kernel(now=True)
        keep = os.environ.get("DSV41_NOTEBOOK_OUT")  # keep the executed copies (CI artifacts)
        if keep:
            os.makedirs(keep, exist_ok=True)
            nbformat.write(nb, os.path.join(keep, name))
    if error:
        pytest.fail(error, pytrace=False)
    dt = time.perf_counter() - t0
    print(f"{name}: {dt:.1f}s")
    return nb, dt


def _text(nb) -> str:
    """Every text output of the executed notebook (streams, results), in order."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
            elif o.get("output_type") in ("execute_result", "display_data"):
                out.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{name}: cells {dirty} carry outputs; clear them before committing"
    colab = [c.source for c in nb.cells if c.cell_type == "code" and "google.colab" in c.source]
    assert colab and "[cuda12]" in colab[0], f"{name}: no Colab install cell with the cuda12 extra"


def test_quickstart(kernel_dir):
    nb, _ = _run("quickstart.ipynb", kernel_dir)
    text = _text(nb)
    assert re.search(r"ViT grid \(h, w\)\s+\(5, 8\) -> 40 patches", text), text
    assert re.search(r"LLM grid \(h, w\)\s+\(2, 3\) -> 6 image tokens", text), text
    assert "span of 10 tokens: START IMG IMG IMG NL IMG IMG IMG NL END" in text, text
    m = re.search(r"generated (\d+) tokens: \[([\d, ]+)\] \(finish: (\w+)\)", text)
    assert m and int(m.group(1)) == 8 and len(m.group(2).split(",")) == 8 and m.group(3) == "length", text
    assert "image spans (llm_h, llm_w, span_len): [(2, 3, 10)]" in text, text
    assert re.search(r"compile_s\s+\d+\.\d+s\s+0\.000s", text), text  # second call: nothing compiled
    assert re.search(r"sampled 8 tokens", text), text
    assert "streamed 8 pieces, same text as generate" in text, text
    assert _images(nb) >= 1, "the patch-grid figure was not shown"


def test_sharding(kernel_dir):
    nb, _ = _run("sharding.ipynb", kernel_dir)
    text = _text(nb)
    assert "8 CPU devices:" in text, text
    for spec, shape in (("1,8,1", "{'data': 1, 'expert': 8, 'tensor': 1}"), ("2,2,2", "{'data': 2, 'expert': 2, 'tensor': 2}")):
        assert f"{spec:6s} -> {shape}" in text, text
    # the table: routed experts on expert x tensor, query heads on tensor, vocabulary on both
    assert re.search(r"layers\.0\.ffn\.experts\.w1\.weight\s+\[16, 32, 64\]\s+float32\s+\(expert, tensor\)", text), text
    assert re.search(r"layers\.0\.attn\.wq_b\.weight\s+\[256, 32\]\s+float32\s+\(tensor\)", text), text
    assert re.search(r"embed\.weight\s+\[256, 64\]\s+float32\s+\(tensor\+expert\)", text), text
    assert "total per device:" in text, text
    assert re.search(r"\d+ of \d+ parameters are split; 0 fall back", text), text
    assert "not divisible by mesh axis" in text and "strict:" in text, text
    m = re.search(r"V4\.1-Flash on mesh 1,8,1: \d+ tensors, [\d.]+ GiB in all, ([\d.]+) GiB per device", text)
    assert m and float(m.group(1)) < 141, text
    m = re.search(r"max abs diff sharded vs single device: ([\d.e+-]+)", text)
    assert m and float(m.group(1)) < 1e-4, text


def test_parity(kernel_dir):
    if not (ROOT / "tests" / "golden" / "text_fast_fp32").is_dir():
        pytest.skip("golden case text_fast_fp32 not present")
    pytest.importorskip("torch")
    nb, _ = _run("parity.ipynb", kernel_dir)
    text = _text(nb)
    for who in ("jax", "torch oracle"):
        m = re.search(rf"{who}\s+vs reference: max_abs_rel=([\d.e+-]+) \(tol 1\.0e-05\) -> ok", text)
        assert m and float(m.group(1)) <= 1e-5, text
    m = re.search(r"(\d+) passed, (\d+) failed, (\d+) not run", text)
    assert m and int(m.group(1)) > 50 and m.group(2) == "0" and m.group(3) == "0", text
    assert _images(nb) >= 1, "the error plot was not shown"
