"""The `dsv41-jax` command line, through subprocesses: every command, bad flags, missing
checkpoints (one clear error line, exit status 2), and the demo's steps on the tiny model."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def cli(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dsv41_jax.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def one_clear_error(p):
    """Exit status 2 and a short message, never a Python traceback."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    assert p.stderr.strip(), "an error message is expected on stderr"
    return p.stderr


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    src, dst = str(base / "orig"), str(base / "orbax")
    p = cli("make-tiny", src, "--format", "fp8")
    assert p.returncode == 0, p.stderr
    assert "wrote a tiny DeepSeek-V4.1 checkpoint" in p.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(src))
    p = cli("convert", src, dst, "--max-memory", "1GB")
    assert p.returncode == 0, p.stderr
    assert os.path.isdir(dst) and not os.path.exists(dst + ".partial")
    return src, dst


def test_help_lists_every_command():
    p = cli("--help")
    assert p.returncode == 0
    for c in ("convert", "generate", "info", "make-tiny", "verify", "demo"):
        assert c in p.stdout
    for c in ("generate", "make-tiny", "verify", "demo", "convert"):
        q = cli(c, "--help")
        assert q.returncode == 0 and "usage" in q.stdout.lower(), (c, q.stderr)


def test_bad_flags_exit_2():
    assert cli("generate", "--temperature").returncode == 2
    assert cli("no-such-command").returncode == 2
    assert cli("make-tiny", "x", "--format", "fp16").returncode == 2


def test_missing_checkpoint_is_one_clear_error(tmp_path):
    err = one_clear_error(cli("generate", str(tmp_path / "nope"), "hello"))
    assert "nope" in err
    err = one_clear_error(cli("convert", str(tmp_path / "nope"), str(tmp_path / "out")))
    assert "nope" in err and not os.path.exists(tmp_path / "out")
    err = one_clear_error(cli("info", str(tmp_path / "nope")))
    assert "nope" in err


def test_info(tiny_dirs):
    _, dst = tiny_dirs
    p = cli("info", dst)
    assert p.returncode == 0, p.stderr
    assert "hidden" in p.stdout.lower() or "hidden_size" in p.stdout


def test_generate_from_converted_and_original(tiny_dirs):
    src, dst = tiny_dirs
    img = os.path.join(ROOT, "dsv41_jax", "assets", "demo.png")
    outs = []
    for path in (dst, src):
        p = cli("generate", path, "Hello<｜deepseek_image｜>hello", "--image", img, "--max-new-tokens", "4", "-v",
                "--numerics", "reference", "--dtype", "bfloat16")
        assert p.returncode == 0, p.stderr
        assert "tokens: [" in p.stdout and "image spans" in p.stdout
        outs.append([line for line in p.stdout.splitlines() if line.startswith("tokens:")][0])
    assert outs[0] == outs[1], "the converted checkpoint must generate what the original does"


def test_generate_image_count_mismatch_is_clear(tiny_dirs):
    _, dst = tiny_dirs
    err = one_clear_error(cli("generate", dst, "Hello<｜deepseek_image｜>hello", "--max-new-tokens", "2"))
    assert "image" in err.lower()


def test_verify_command():
    p = cli("verify", os.path.join(GOLDEN, "text_fast_fp32"), "--only", "engram")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("3 passed, 0 failed")
