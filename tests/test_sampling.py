"""dsv41_jax.sampling: exact filter masks, temperature, greedy ties, banned ids, distributions, RNG."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.sampling import SamplingParams, banned_mask, filter_mask, probs, sample

F32 = np.float32


def _params(B, **kw):
    return SamplingParams.make(B, **kw)


# every helper runs at one padded shape [PB, PV] (extra columns -inf, extra rows greedy), so the
# whole file compiles each jitted function once
PB, PV, ND = 8, 64, 4096


def _pad_z(z):
    z = np.asarray(z, F32)
    out = np.full((PB, PV), -np.inf, F32)
    out[:, 0] = 0.0
    out[:z.shape[0], :z.shape[1]] = z
    out[:z.shape[0], z.shape[1]:] = -np.inf
    return jnp.asarray(out)


def _pad_b(banned, V):
    m = np.zeros((PV,), bool)
    if banned is not None:
        m[:V] = np.asarray(banned_mask(banned, V))
    return jnp.asarray(m)


@jax.jit
def _filter_j(z, params):
    return filter_mask(z, params)


@jax.jit
def _probs_j(z, params):
    return probs(z, params)


@jax.jit
def _draws_j(z, params, key, banned):
    return jax.vmap(lambda s: sample(z, params, key, s, banned=banned))(jnp.arange(ND, dtype=jnp.int32))


def _mask(logits, **kw):
    logits = np.asarray(logits, F32)
    B, V = logits.shape
    p = _params(B, **kw)
    t = np.where(np.asarray(p.temperature) > 0, np.asarray(p.temperature), 1.0)
    return np.asarray(_filter_j(_pad_z(logits / t[:, None]), p.pad(PB)))[:B, :V]


def _probs(z, params):
    B, V = np.shape(z)
    return np.asarray(_probs_j(_pad_z(z), params.pad(PB)))[:B, :V]


def _draws(z, params, key, banned=None):
    """ND independent draws per row (one per step fold) -> [ND, B]."""
    B, V = np.shape(z)
    return np.asarray(_draws_j(_pad_z(z), params.pad(PB), key, _pad_b(banned, V)))[:, :B]


def _sample(z, params, key, banned=None):
    return _draws(z, params, key, banned)[0]


def _ref_top_p(p, top_p):
    """keep j iff the probability mass of tokens strictly more likely than j is < top_p."""
    return np.array([p[p > pj].sum() < top_p for pj in p])


# ------------------------------------------------------------------------------------------------
# filter masks

def test_top_k_mask_exact_and_ties_kept():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 12)).astype(F32)
    for k in (1, 3, 11):
        m = _mask(z, temperature=1.0, top_k=k)
        want = z >= np.sort(z, axis=-1)[:, ::-1][:, k - 1:k]
        np.testing.assert_array_equal(m, want)
        assert (m.sum(-1) == k).all()
    # off: 0 and >= V
    assert _mask(z, temperature=1.0, top_k=0).all() and _mask(z, temperature=1.0, top_k=12).all()
    # ties at the k-th value are all kept
    zt = np.array([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0]], F32)
    np.testing.assert_array_equal(_mask(zt, temperature=1.0, top_k=2)[0], [0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(_mask(zt, temperature=1.0, top_k=3)[0], [0, 1, 1, 1, 1, 0])


def test_top_p_mask_exact():
    p = np.array([0.4, 0.3, 0.2, 0.1], F32)
    z = np.log(p)[None]
    for top_p, want in [(0.35, [1, 0, 0, 0]), (0.65, [1, 1, 0, 0]), (0.8, [1, 1, 1, 0]), (0.95, [1, 1, 1, 1]),
                        (1.0, [1, 1, 1, 1])]:
        np.testing.assert_array_equal(_mask(z, temperature=1.0, top_p=top_p)[0], want, err_msg=str(top_p))
    # random rows against the definition (values well away from the cumulative boundaries)
    rng = np.random.default_rng(1)
    for _ in range(20):
        z = rng.normal(size=(1, 16)).astype(F32) * 2
        pr = np.exp(z[0] - z[0].max()); pr /= pr.sum()
        cums = np.sort(np.cumsum(np.sort(pr)[::-1]))
        top_p = float(rng.uniform(0.05, 0.95))
        if np.min(np.abs(cums - top_p)) < 1e-4:
            continue
        np.testing.assert_array_equal(_mask(z, temperature=1.0, top_p=top_p)[0], _ref_top_p(pr, top_p))


def test_top_p_ties_at_boundary_kept():
    z = np.log(np.array([[0.5, 0.2, 0.2, 0.1]], F32))
    np.testing.assert_array_equal(_mask(z, temperature=1.0, top_p=0.6)[0], [1, 1, 1, 0])


def test_min_p_mask_exact():
    p = np.array([0.4, 0.3, 0.2, 0.1], F32)
    z = np.log(p)[None]
    for min_p, want in [(0.0, [1, 1, 1, 1]), (0.6, [1, 1, 0, 0]), (0.8, [1, 0, 0, 0]), (0.2, [1, 1, 1, 1]),
                        (1.0, [1, 0, 0, 0])]:
        np.testing.assert_array_equal(_mask(z, temperature=1.0, min_p=min_p)[0], want, err_msg=str(min_p))
    # min-p acts on the temperature-scaled distribution: T=2 flattens p to sqrt(p) ratios
    # sqrt(0.2/0.4) = 0.707, sqrt(0.1/0.4) = 0.5
    np.testing.assert_array_equal(_mask(z, temperature=2.0, min_p=0.6)[0], [1, 1, 1, 0])


def test_filter_order_top_k_then_top_p_renormalised():
    # top-k=2 leaves [0.4, 0.3] -> renormalised [0.571, 0.429]; top_p=0.5 keeps only the first
    # (unrenormalised, the mass before the second would be 0.4 < 0.5 and keep both)
    z = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], F32))
    np.testing.assert_array_equal(_mask(z, temperature=1.0, top_k=2, top_p=0.5)[0], [1, 0, 0, 0])
    np.testing.assert_array_equal(_mask(z, temperature=1.0, top_k=3, top_p=0.7)[0], [1, 1, 0, 0])
    np.testing.assert_array_equal(_mask(z, temperature=1.0, top_k=3, top_p=0.8, min_p=0.6)[0], [1, 1, 0, 0])


def test_per_row_parameters():
    z = np.tile(np.log(np.array([0.4, 0.3, 0.2, 0.1], F32)), (4, 1))
    m = _mask(z, temperature=1.0, top_k=[0, 1, 2, 0], top_p=[1.0, 1.0, 1.0, 0.65], min_p=[0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(m, [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]])


# ------------------------------------------------------------------------------------------------
# distributions

def test_temperature_scaling_and_filtered_probs():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(3, 10)).astype(F32)
    for T in (0.5, 1.0, 3.0):
        got = _probs(z, _params(3, temperature=T))
        want = np.exp(z / T - (z / T).max(-1, keepdims=True)); want /= want.sum(-1, keepdims=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    got = _probs(z, _params(3, temperature=0.7, top_k=4))
    keep = z >= np.sort(z, -1)[:, -4:-3]
    want = np.where(keep, np.exp(z / 0.7 - (z / 0.7).max(-1, keepdims=True)), 0); want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # greedy rows: one-hot at the argmax
    np.testing.assert_array_equal(_probs(z, _params(3)), np.eye(10, dtype=F32)[z.argmax(-1)])


def test_empirical_distribution_matches():
    z = np.log(np.array([[0.35, 0.25, 0.2, 0.1, 0.06, 0.04]] * 2, F32))
    prm = _params(2, temperature=[1.0, 0.8], top_k=[0, 3])
    d = np.concatenate([_draws(z, prm, jax.random.PRNGKey(s)) for s in range(5)])
    n = d.shape[0]
    want = _probs(z, prm)
    for b in range(2):
        freq = np.bincount(d[:, b], minlength=6) / n
        sd = np.sqrt(want[b] * (1 - want[b]) / n)
        assert np.all(np.abs(freq - want[b]) <= 5 * sd + 1e-9), (b, freq, want[b])
    assert set(np.unique(d[:, 1])) <= {0, 1, 2}  # top-k never emits a token outside the top k


def test_greedy_exact_argmax_ties_low_id():
    z = np.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]], F32)
    np.testing.assert_array_equal(_sample(z, SamplingParams.greedy(3), jax.random.PRNGKey(0)), [1, 0, 2])
    out = jax.eval_shape(lambda: sample(jnp.asarray(z), SamplingParams.greedy(3), jax.random.PRNGKey(0), 0))
    assert out.dtype == jnp.int32 and out.shape == (3,)


def test_temperature_to_zero_and_top_k1_equal_greedy():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(8, 50)).astype(F32)
    g = _sample(z, SamplingParams.greedy(8), jax.random.PRNGKey(1))
    np.testing.assert_array_equal(g, z.argmax(-1))
    for prm in (_params(8, temperature=1e-4), _params(8, temperature=1.5, top_k=1),
                _params(8, temperature=1.0, min_p=1.0)):
        d = _draws(z, prm, jax.random.PRNGKey(1))
        assert (d == g[None]).all()


def test_banned_ids_never_sampled():
    z = np.zeros((2, 8), F32)
    z[:, 5] = 10.0  # the banned id is by far the most likely
    z[1, 3] = 9.0
    for banned in ([5, 6], np.array([0, 0, 0, 0, 0, 1, 1, 0], bool)):
        d = _draws(z, _params(2, temperature=[1.0, 5.0]), jax.random.PRNGKey(2), banned)
        assert not np.isin(d, [5, 6]).any()
        assert len(np.unique(d[:, 0])) == 6  # every allowed id still drawn
        g = _sample(z, SamplingParams.greedy(2), jax.random.PRNGKey(0), banned)
        assert g[1] == 3 and g[0] not in (5, 6)
    # banned ids do not count toward top-k: the next best survives
    d = _draws(z, _params(2, temperature=1.0, top_k=1), jax.random.PRNGKey(2), [5])
    assert (d[:, 1] == 3).all()
    with pytest.raises(ValueError, match="banned"):
        banned_mask([8], 8)


def test_seeded_reproducible_and_rows_independent():
    rng = np.random.default_rng(4)
    z = rng.normal(size=(4, 30)).astype(F32)
    prm = _params(4, temperature=1.0)
    a = _draws(z, prm, jax.random.PRNGKey(7))
    b = _draws(z, prm, jax.random.PRNGKey(7))
    c = _draws(z, prm, jax.random.PRNGKey(8))
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.5
    assert len({tuple(r) for r in a[:200]}) > 100  # steps are folded: different draws per step
    # a row's draws depend on (key, step, row) only, not on the other rows nor the batch size
    z2 = z.copy()
    z2[1:] = 0.0
    np.testing.assert_array_equal(_draws(z2, prm, jax.random.PRNGKey(7))[:, 0], a[:, 0])
    np.testing.assert_array_equal(_draws(z[:1], _params(1, temperature=1.0), jax.random.PRNGKey(7))[:, 0], a[:, 0])


def test_invalid_parameters():
    for kw, what in [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"),
                     ({"min_p": 1.1}, "min_p"), ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
                     ({"temperature": [0.0, 1.0]}, "temperature")]:
        with pytest.raises(ValueError, match=what):
            SamplingParams.make(3, **kw)


@jax.jit
def _sample_sorts_j(z, params, key, banned):
    """The same draw with the sort decided on the device (None) and at trace time (True / False)."""
    return [jax.vmap(lambda s: sample(z, params, key, s, banned=banned, sort=srt))(jnp.arange(64, dtype=jnp.int32))
            for srt in (None, True, False)]


def test_sort_decided_at_trace_time_same_ids():
    # sort=True / False (generate's loop: host-decided, no device branches) draws the ids of the
    # on-device decision wherever it applies: True always, False when needs_sort is False
    rng = np.random.default_rng(5)
    z = _pad_z(rng.normal(size=(6, 50)).astype(F32) * 3)
    cases = [(dict(temperature=[0.0, 1.0, 0.7, 1.3, 0.0, 2.0]), False),          # no filters: no sort needed
             (dict(temperature=[0.0, 1.0, 0.7, 1.3, 0.0, 2.0], min_p=0.1), False),  # min-p needs no sort
             (dict(temperature=[0.0, 1.0, 0.7, 1.3, 0.0, 2.0], top_k=[0, 5, 0, 2, 9, 0],
                   top_p=[1.0, 1.0, 0.8, 1.0, 0.5, 0.95]), True),                   # filters on sampled rows
             (dict(temperature=0.0, top_k=3, top_p=0.5), False)]                     # all greedy: filters unused
    for kw, need in cases:
        p = _params(6, **kw)
        assert p.needs_sort(PV) == need, kw
        dev, on, off = (np.asarray(x) for x in _sample_sorts_j(z, p.pad(PB), jax.random.PRNGKey(3), _pad_b(None, 50)))
        np.testing.assert_array_equal(on, dev)
        if not need:
            np.testing.assert_array_equal(off, dev)
    # top_k >= V is off; top_p = 1 is off
    assert not _params(2, temperature=1.0, top_k=PV, top_p=1.0).needs_sort(PV)
    assert _params(2, temperature=1.0, top_k=PV - 1).needs_sort(PV)
