"""The mHC Sinkhorn Pallas kernel (dsv41_jax/kernels/sinkhorn.py) in the Pallas interpreter
against its XLA formulation, and hc_mixes with DSV41_SINKHORN set against the default path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.kernels.sinkhorn import choose_block, sinkhorn, sinkhorn_reference
from dsv41_jax.model.mhc import hc_mixes, sinkhorn_kernel_impl

EPS = 1e-6
TOL = 1e-6  # max |diff| / max |ref|: fp32, only the order of the n-term sums and ulps of exp differ


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def elem_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))


def logits(rng, *shape, scale=3.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))


def np_sinkhorn(x, iters, eps):
    """float64 oracle, written out independently of both implementations."""
    n = int(round(np.sqrt(x.shape[-1])))
    c = np.asarray(x, np.float64).reshape(*x.shape[:-1], n, n)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return c


# lead shapes: 111 tokens over 32-token blocks (4 programs, the last one padded), one token, 5
@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("lead,block", [((3, 37), 32), ((1,), 256), ((5,), 16)])
def test_kernel_matches_xla(n, iters, lead, block):
    rng = np.random.default_rng(1000 * n + 10 * iters + len(lead))
    x = logits(rng, *lead, n * n)
    got = sinkhorn(x, iters, EPS, "interpret", block=block)
    want = sinkhorn(x, iters, EPS, "xla")
    assert got.dtype == want.dtype == jnp.float32
    assert got.shape == want.shape == (*lead, n, n)
    assert rel_err(got, want) <= TOL
    assert elem_err(got, want) <= 1e-5  # every entry, small ones included
    assert rel_err(want, np_sinkhorn(np.asarray(x), iters, EPS)) <= TOL  # the reference itself
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-3)  # last step: columns (1 - eps / sum)
    assert np.all(got > 0)


def test_kernel_other_n_and_wide_logits():
    """n = 2 and logits spanning ~60 (entries near eps) stay finite and accurate."""
    rng = np.random.default_rng(7)
    x = logits(rng, 2, 50, 4, scale=20.0)
    got = sinkhorn(x, 20, EPS, "interpret", block=64)
    want = sinkhorn_reference(x, 20, EPS)
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) <= TOL and elem_err(got, want) <= 1e-5


def test_kernel_input_dtype_and_empty():
    rng = np.random.default_rng(8)
    x = logits(rng, 9, 16).astype(jnp.bfloat16)
    got = sinkhorn(x, 3, EPS, "interpret")
    assert got.dtype == jnp.float32 and rel_err(got, sinkhorn(x, 3, EPS, "xla")) <= TOL
    assert sinkhorn(jnp.zeros((0, 16)), 3, EPS, "interpret").shape == (0, 4, 4)


def test_the_comparison_can_fail():
    """Mutants of the math (one iteration fewer, transposed result, eps missing) are far outside
    the tolerance, so the tests above would catch a kernel that gets them wrong."""
    rng = np.random.default_rng(9)
    x = logits(rng, 3, 37, 16)
    for iters in (2, 20):
        want = sinkhorn(x, iters, EPS, "xla")
        assert rel_err(sinkhorn(x, iters - 1, EPS, "interpret", block=32), want) > 1e3 * TOL
    want = sinkhorn(x, 1, EPS, "xla")
    got = sinkhorn(x, 1, EPS, "interpret", block=32)
    assert rel_err(jnp.swapaxes(got, -1, -2), want) > 1e3 * TOL
    assert rel_err(sinkhorn(x, 1, 1e-2, "interpret", block=32), want) > 1e3 * TOL


def test_choose_block():
    assert choose_block(1) == 16 and choose_block(17) == 32 and choose_block(10_000) == 256
    assert choose_block(100, 64) == 64
    with pytest.raises(ValueError):
        choose_block(5, 48)


def _hc_inputs(rng, n, D, lead=(2, 5)):
    mix = (2 + n) * n
    h = jnp.asarray((rng.standard_normal((*lead, n, D))).astype(np.float32))
    fn = jnp.asarray((rng.standard_normal((mix, n * D)) * 0.05).astype(np.float32))
    scale = jnp.asarray((1 + 0.1 * rng.standard_normal(3)).astype(np.float32))
    base = jnp.asarray((rng.standard_normal(mix) * 0.5).astype(np.float32))
    return h, fn, scale, base


@pytest.mark.parametrize("n,iters", [(4, 20), (4, 1), (3, 2)])
def test_hc_mixes_env_interpret(monkeypatch, n, iters):
    rng = np.random.default_rng(20 + n + iters)
    args = _hc_inputs(rng, n, 32)
    kw = dict(hc_mult=n, iters=iters, norm_eps=1e-20, hc_eps=EPS)
    monkeypatch.delenv("DSV41_SINKHORN", raising=False)
    want = hc_mixes(*args, **kw)
    monkeypatch.setenv("DSV41_SINKHORN", "interpret")
    assert sinkhorn_kernel_impl() == "interpret"
    got = hc_mixes(*args, **kw)
    np.testing.assert_array_equal(got[0], want[0])  # pre / post untouched
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2].shape == want[2].shape == (2, 5, n, n) and got[2].dtype == jnp.float32
    assert rel_err(got[2], want[2]) <= TOL


def test_hc_mixes_env_default_and_cpu_fallback(monkeypatch):
    rng = np.random.default_rng(30)
    args = _hc_inputs(rng, 4, 16)
    kw = dict(hc_mult=4, iters=20, norm_eps=1e-20, hc_eps=EPS)
    import dsv41_jax.kernels as K

    monkeypatch.setenv("DSV41_SINKHORN", "xla")
    assert sinkhorn_kernel_impl() is None
    want = hc_mixes(*args, **kw)
    monkeypatch.delenv("DSV41_SINKHORN")  # unset = auto: the kernel on Hopper-class GPUs only
    assert sinkhorn_kernel_impl() == ("triton" if K.use_pallas() else None)
    for mode in (None, "pallas", "auto"):  # "pallas" / "auto" only take effect on a GPU backend
        if mode is not None:
            monkeypatch.setenv("DSV41_SINKHORN", mode)
        if sinkhorn_kernel_impl() is not None:
            continue  # running on a GPU: the kernel path, covered by the interpret test
        for g, w in zip(hc_mixes(*args, **kw), want):
            np.testing.assert_array_equal(g, w)
    monkeypatch.setenv("DSV41_SINKHORN", "bogus")
    with pytest.raises(ValueError, match="DSV41_SINKHORN"):
        hc_mixes(*args, **kw)


def test_auto_follows_the_kernel_switch(monkeypatch):
    """``DSV41_SINKHORN`` unset = auto: the kernel exactly where ``kernels.use_pallas()`` holds
    (Hopper-class GPUs; ``DSV41_KERNELS=xla`` turns it off), the jnp code elsewhere."""
    import dsv41_jax.kernels as K

    monkeypatch.delenv("DSV41_SINKHORN", raising=False)
    monkeypatch.setattr(K, "use_pallas", lambda: True)
    assert sinkhorn_kernel_impl() == "triton"
    monkeypatch.setattr(K, "use_pallas", lambda: False)
    assert sinkhorn_kernel_impl() is None
    monkeypatch.setenv("DSV41_SINKHORN", "xla")
    monkeypatch.setattr(K, "use_pallas", lambda: True)
    assert sinkhorn_kernel_impl() is None


def test_reference_loop_and_unrolled_agree():
    """The jnp formulation runs its (row, column) pairs as a loop on the CPU (compile time) and
    unrolled elsewhere: the same operations in the same order. XLA may rewrite a division by a
    broadcast sum into a multiply by its reciprocal in one form and not the other, so entries may
    differ by about an ulp (8e-7 relative measured), far inside every golden tolerance."""
    x = 3.0 * jax.random.normal(jax.random.key(7), (5, 3, 16), jnp.float32)
    loop = jax.jit(lambda v: sinkhorn_reference(v, 20, 1e-6, unroll=False))(x)
    unrolled = jax.jit(lambda v: sinkhorn_reference(v, 20, 1e-6, unroll=True))(x)
    np.testing.assert_allclose(np.asarray(loop), np.asarray(unrolled), rtol=2e-6, atol=1e-12)
    assert np.allclose(np.asarray(loop).sum(-2), 1.0, atol=1e-4)  # columns normalised last
