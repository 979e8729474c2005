"""Token sampling with per-sequence parameters held in arrays (no recompilation between requests).

Semantics of :func:`sample` for one row with logits ``l`` (fp32, vocabulary ``V``):

0. Banned ids (``banned``: a bool mask or a list of ids) get ``l = -inf`` first; they are never
   sampled and never count toward top-k / top-p / min-p.
1. ``temperature == 0``: greedy, the exact ``argmax(l)`` with ties going to the lower id. The
   filters and the key are not used for that row.
2. ``temperature > 0``: ``z = l / temperature``. Then, in this order (each filter sees the tokens
   kept by the previous ones, with probabilities renormalised over them):

   * top-k (``top_k > 0`` and ``< V``; 0 = off): keep every token with ``z >= z_(k)``, the k-th
     largest value (tokens tied with the k-th are all kept).
   * top-p (``top_p < 1``; 1 = off): with ``p = softmax(z)`` over the top-k survivors, keep token
     ``j`` iff the total probability of the tokens strictly more likely than ``j`` is
     ``< top_p`` (computed as an exclusive cumulative sum over the descending sort; the most
     likely token is always kept; ties at the boundary are all kept).
   * min-p (``min_p > 0``; 0 = off): keep token ``j`` iff ``exp(z_j - z_max) >= min_p``, i.e.
     ``p_j >= min_p * p_max`` (renormalisation does not change the ratio; the most likely token
     is always kept).

   The id is drawn from ``categorical(z masked to the kept set)`` with the row key
   ``fold_in(fold_in(key, step), row)``: the stream of one row depends on ``(key, step, row)``
   only, never on the other rows or on the batch size.

All parameters are ``[B]`` arrays in :class:`SamplingParams` (a pytree), so different values
never trigger a recompilation. :meth:`SamplingParams.make` checks values on the host.

Branches. The vocabulary sort behind top-k / top-p is the one costly part. ``sort=None`` (the
default of :func:`sample`) decides on the device, per call, whether to run it (a ``lax.cond``:
on a GPU a device -> host round trip that idles the GPU inside a decode loop); ``sort=True`` /
``False`` fixes the choice at trace time (host side: :meth:`SamplingParams.needs_sort`): no
round trip, the same ids. The draw itself always runs (one pass over [B, V] in place of a
branch and its round trip); greedy rows then take the argmax.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling parameters, all ``[B]`` arrays.

    ``temperature`` (0 = greedy), ``top_k`` int (0 = off), ``top_p`` in (0, 1] (1 = off),
    ``min_p`` in [0, 1] (0 = off). Build with :meth:`make` (validates) or :meth:`greedy`.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def make(cls, batch: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) -> "SamplingParams":
        """Each argument is a scalar (same for every row) or a sequence of ``batch`` values.

        Raises ValueError on a negative or non-finite temperature, a negative top_k, top_p outside
        (0, 1], min_p outside [0, 1], or a sequence of the wrong length."""
        t = _row_values("temperature", temperature, batch, np.float32)
        k = _row_values("top_k", top_k, batch, np.int64)
        p = _row_values("top_p", top_p, batch, np.float32)
        m = _row_values("min_p", min_p, batch, np.float32)
        out = cls(temperature=t, top_k=k.astype(np.int32), top_p=p, min_p=m)
        out.validate()
        return cls(*(jnp.asarray(x) for x in (out.temperature, out.top_k, out.top_p, out.min_p)))

    @classmethod
    def greedy(cls, batch: int) -> "SamplingParams":
        return cls.make(batch)

    @property
    def batch(self) -> int:
        return int(np.shape(self.temperature)[0])

    def validate(self) -> None:
        """Host-side value check (concrete arrays only). Raises ValueError with every problem."""
        t, k, p, m = (np.asarray(x) for x in (self.temperature, self.top_k, self.top_p, self.min_p))
        shapes = {x.shape for x in (t, k, p, m)}
        problems = []
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            problems.append(f"all parameters must be [B] arrays of one length, got shapes "
                            f"{[x.shape for x in (t, k, p, m)]}")
        if not np.all(np.isfinite(t)) or np.any(t < 0):
            problems.append(f"temperature must be finite and >= 0 (0 = greedy), got {t.tolist()}")
        if not np.issubdtype(k.dtype, np.integer) or np.any(k < 0):
            problems.append(f"top_k must be integers >= 0 (0 = off), got {k.tolist()}")
        if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
            problems.append(f"top_p must be in (0, 1] (1 = off), got {p.tolist()}")
        if not np.all(np.isfinite(m)) or np.any(m < 0) or np.any(m > 1):
            problems.append(f"min_p must be in [0, 1] (0 = off), got {m.tolist()}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    def needs_sort(self, vocab: int) -> bool:
        """Host-side: whether some sampled row (``temperature > 0``) has top-k (``0 < top_k <
        vocab``) or top-p (``top_p < 1``) on, i.e. whether :func:`sample` needs the vocabulary
        sort (its ``sort`` argument)."""
        t, k, p = (np.asarray(x) for x in (self.temperature, self.top_k, self.top_p))
        return bool(np.any((t > 0) & (((k > 0) & (k < vocab)) | (p < 1))))

    def pad(self, batch: int) -> "SamplingParams":
        """Rows appended up to ``batch`` (greedy, filters off)."""
        n = self.batch
        if batch < n:
            raise ValueError(f"cannot pad sampling parameters of batch {n} down to {batch}")
        fill = (0.0, 0, 1.0, 0.0)
        vals = []
        for x, f in zip((self.temperature, self.top_k, self.top_p, self.min_p), fill):
            x = np.asarray(x)
            vals.append(jnp.asarray(np.concatenate([x, np.full((batch - n,), f, x.dtype)])))
        return SamplingParams(*vals)


jax.tree_util.register_dataclass(SamplingParams, data_fields=["temperature", "top_k", "top_p", "min_p"],
                                 meta_fields=[])


def _row_values(name: str, v, batch: int, dtype) -> np.ndarray:
    a = np.asarray(v)
    if a.ndim == 0:
        a = np.full((batch,), a)
    if a.shape != (batch,):
        raise ValueError(f"invalid sampling parameters: {name} has shape {list(a.shape)}, expected a scalar "
                         f"or [{batch}]")
    if np.issubdtype(dtype, np.integer) and not (np.all(np.isfinite(a)) and np.all(np.equal(np.mod(a, 1), 0))):
        raise ValueError(f"invalid sampling parameters: {name} must be integers, got {a.tolist()}")
    return a.astype(dtype)


def banned_mask(banned, vocab: int):
    """``banned`` (None, a sequence of ids, or a bool mask [V] / [B, V]) -> bool mask or None."""
    if banned is None:
        return None
    if isinstance(banned, (list, tuple, range, set, frozenset)) or (
            isinstance(banned, np.ndarray) and banned.dtype != np.bool_):
        ids = np.asarray(sorted(int(i) for i in np.asarray(list(banned)).reshape(-1)), np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"banned ids must be in [0, {vocab}), got {ids.tolist()}")
        m = np.zeros((vocab,), bool)
        m[ids] = True
        return jnp.asarray(m)
    m = jnp.asarray(banned)
    if m.dtype != jnp.bool_ or m.shape[-1] != vocab:
        raise ValueError(f"banned mask must be bool [..., {vocab}], got {m.dtype} {list(m.shape)}")
    return m


def _sorted_thresholds(z, k, k_on, top_p):
    """top-k and top-p thresholds [B] from the descending sort of ``z`` (the only O(V log V) part)."""
    V = z.shape[-1]
    zs = jnp.flip(jnp.sort(z, axis=-1), axis=-1)  # descending
    # top-k: threshold at the k-th largest value
    kth = jnp.take_along_axis(zs, jnp.clip(k - 1, 0, V - 1)[:, None], axis=-1)[:, 0]
    thr_k = jnp.where(k_on, kth, NEG_INF)
    # top-p on the sorted top-k survivors
    zs_k = jnp.where(zs >= thr_k[:, None], zs, NEG_INF)
    ps = jax.nn.softmax(zs_k, axis=-1)
    excl = jnp.cumsum(ps, axis=-1)
    excl = jnp.concatenate([jnp.zeros_like(excl[:, :1]), excl[:, :-1]], axis=-1)
    n_keep = jnp.sum(excl < top_p[:, None], axis=-1)  # >= 1: excl[0] = 0 < top_p
    thr_pv = jnp.take_along_axis(zs_k, jnp.clip(n_keep - 1, 0, V - 1)[:, None], axis=-1)[:, 0]
    thr_p = jnp.where(top_p < 1.0, thr_pv, NEG_INF)
    return thr_k, thr_p


def filter_mask(z, params: SamplingParams, sort: bool | None = None):
    """Tokens kept by top-k, then top-p, then min-p, on temperature-scaled logits ``z`` [B, V].

    Returns bool [B, V] (see the module docstring for the exact rules). ``sort=None``: the
    vocabulary sort runs only when some row has top-k or top-p on (a ``lax.cond`` on the
    parameter arrays: no recompilation, and greedy / plain-temperature batches skip it).
    ``sort=True``: always sorted (rows with both filters off keep every token, as before);
    ``sort=False``: top-k and top-p are taken as off for every row (the caller checked
    :meth:`SamplingParams.needs_sort`)."""
    z = z.astype(F32)
    V = z.shape[-1]
    k = params.top_k.astype(jnp.int32)
    k_on = (k > 0) & (k < V)
    top_p = params.top_p.astype(F32)
    off = jnp.full(z.shape[:1], NEG_INF, F32)
    if sort is None:
        thr_k, thr_p = jax.lax.cond(jnp.any(k_on | (top_p < 1.0)),
                                    lambda: _sorted_thresholds(z, k, k_on, top_p), lambda: (off, off))
    else:
        thr_k, thr_p = _sorted_thresholds(z, k, k_on, top_p) if sort else (off, off)
    # min-p relative to the most likely token
    zmax = jnp.max(z, axis=-1, keepdims=True)
    keep_m = jnp.exp(z - zmax) >= params.min_p.astype(F32)[:, None]
    return (z >= thr_k[:, None]) & (z >= thr_p[:, None]) & keep_m


def _prepare(logits, params: SamplingParams, banned, sort: bool | None = None):
    logits = logits.astype(F32)
    m = banned_mask(banned, logits.shape[-1])
    if m is not None:
        logits = jnp.where(m, NEG_INF, logits)
    t = params.temperature.astype(F32)
    is_greedy = t <= 0
    z = logits / jnp.where(is_greedy, 1.0, t)[:, None]
    z = jnp.where(filter_mask(z, params, sort), z, NEG_INF)
    return logits, is_greedy, z


def probs(logits, params: SamplingParams, *, banned=None):
    """The distribution :func:`sample` draws from, [B, V] fp32 (one-hot at the argmax for greedy rows)."""
    logits, is_greedy, z = _prepare(logits, params, banned)
    g = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=F32)
    return jnp.where(is_greedy[:, None], g, jax.nn.softmax(z, axis=-1))


def row_keys(key, batch: int, step=None):
    """Per-row keys: ``fold_in(fold_in(key, step), row)`` (``step`` None: not folded)."""
    if step is not None:
        key = jax.random.fold_in(key, step)
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(batch, dtype=jnp.uint32))


def sample(logits, params: SamplingParams, key, step=None, *, banned=None, sort: bool | None = None):
    """Draw one id per row: logits [B, V] -> int32 [B]. Jittable; see the module docstring
    ("Branches") for ``sort``: None decides on the device, a bool at trace time."""
    logits, is_greedy, z = _prepare(logits, params, banned, sort)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = row_keys(key, logits.shape[0], step)
    drawn = jax.vmap(lambda k, zz: jax.random.categorical(k, zz))(keys, z).astype(jnp.int32)
    return jnp.where(is_greedy, greedy_ids, drawn)
