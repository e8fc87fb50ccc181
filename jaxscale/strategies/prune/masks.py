"""Pruning masks as library functions over the plain parameter dict and its logical names: the
masks `plan.prune` applies after every update (`prune/__init__.py`) and that a one-shot pruning of
a trained model uses.

==========  ==================================================  =================================
method      stores                                              zeros
==========  ==================================================  =================================
magnitude   boolean mask; per matrix (each stacked index) or    the round(s x size) smallest |w|,
            over all prunable weights at once (global)          exactly that many
N:M (2:4)   boolean mask; in every M consecutive weights of     M - N of every M (2:4: 50 %)
            the innermost contracted axis the M - N smallest
            |w| are zeroed (2:4 is what sparse tensor cores run)
==========  ==================================================  =================================

Pruning skips the embedding table (a lookup, not a matmul; sparse matmul units do not apply) and
norm scales (`tables.params.contracted_axes`, `is_lookup`). Ties in |w| are broken by position,
so the counts are exact. `sparsity_ramp` is the cubic ramp of Zhu & Gupta (2017).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.strategies.tables.params import STACKED, contracted_axes, is_lookup
from jaxscale.strategies.tables.weights import Logical, map_weights


def _check_sparsity(value, name="sparsity"):
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name}={value!r} must be in [0, 1) (a fraction of zeros)")


def _prunable(names):
    return contracted_axes(names) is not None and not is_lookup(names)


def _matrices(w, names):
    """w with its stacked axes first, as [copies, elements], and the inverse."""
    stacked = [i for i, n in enumerate(names) if n in STACKED]
    perm = stacked + [i for i in range(w.ndim) if i not in stacked]
    wt = jnp.transpose(w, perm)
    shape = wt.shape
    inv = np.argsort(perm)
    return wt.reshape(int(np.prod(shape[:len(stacked)])), -1), \
        lambda m: jnp.transpose(m.reshape(shape), inv)


def _keep_largest(a_RN, k):
    """Mask of a [rows, n] array keeping all but the k smallest |a| of each row (stable ranks)."""
    rank = jnp.argsort(jnp.argsort(jnp.abs(a_RN), axis=-1, stable=True), axis=-1, stable=True)
    return rank >= k


def magnitude_mask(w, names, sparsity):
    """Keep-mask of one weight: all but its round(sparsity x size) smallest |w|, each stacked
    index a matrix of its own (`sparsity` may be traced)."""
    m_RN, back = _matrices(w, tuple(names))
    return back(_keep_largest(m_RN, jnp.round(sparsity * m_RN.shape[1]).astype(jnp.int32)))


def nm_mask(w, names, n: int, m: int):
    """Keep-mask of one weight: n of every m consecutive |w| along its innermost contracted
    axis."""
    ax = contracted_axes(tuple(names))[-1]
    wt = jnp.moveaxis(w, ax, -1)
    keep = _keep_largest(wt.reshape(-1, m), m - n).reshape(wt.shape)
    return jnp.moveaxis(keep, -1, ax)


def magnitude_masks(params, logical, sparsity: float, scope: str = "per_tensor"):
    """Boolean masks (None for leaves that are not pruned) zeroing the smallest |w|: exactly
    round(sparsity x size) per matrix (`per_tensor`, each stacked index a matrix) or over all
    prunable weights together (`global`)."""
    _check_sparsity(sparsity)
    if scope not in ("per_tensor", "global"):
        raise ValueError(f"scope={scope!r} must be 'per_tensor' or 'global'")
    return _magnitude(params, Logical(logical), float(sparsity), scope)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _magnitude(params, lg, sparsity, scope):
    logical, skip = lg.tree(), (lambda w: None)
    if scope == "per_tensor":
        def one(w, names, _):
            return magnitude_mask(w, names, sparsity) if _prunable(names) else None
        return map_weights(one, params, logical, skip)
    flat = map_weights(lambda w, n, _: w if _prunable(n) else None, params, logical, skip)
    leaves, tdef = jax.tree.flatten(flat)
    allw = jnp.concatenate([jnp.ravel(x) for x in leaves])[None]
    keep = _keep_largest(allw, round(sparsity * allw.size))[0]
    out, i = [], 0
    for x in leaves:
        out.append(keep[i:i + x.size].reshape(x.shape))
        i += x.size
    return jax.tree.unflatten(tdef, out)


def nm_masks(params, logical, n: int = 2, m: int = 4):
    """N:M structured masks (default 2:4): in every m consecutive weights along the innermost
    contracted axis, the m - n smallest |w| are zeroed."""
    if not 0 < n < m:
        raise ValueError(f"n={n}, m={m}: need 0 < n < m")
    return _nm(params, Logical(logical), n, m)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _nm(params, lg, n, m):
    def one(w, names, path):
        if not _prunable(names):
            return None
        ax = contracted_axes(names)[-1]
        if w.shape[ax] % m:
            raise ValueError(f"{n}:{m} pruning of {jax.tree_util.keystr(path)}: its contracted "
                             f"axis {ax} ('{names[ax]}', size {w.shape[ax]}) is not divisible "
                             f"by m={m}")
        return nm_mask(w, names, n, m)
    return map_weights(one, params, lg.tree(), lambda w: None)


def apply(params, masks):
    """params with the masked weights zeroed (leaves whose mask is None unchanged)."""
    return jax.tree.map(lambda mk, w: w if mk is None else w * mk.astype(w.dtype), masks, params,
                        is_leaf=lambda x: x is None)


def sparsity(params, masks) -> float:
    """Fraction of zeros among the masked weights."""
    pairs = [(w, mk) for mk, w in zip(jax.tree.leaves(masks, is_leaf=lambda x: x is None),
                                      jax.tree.leaves(params)) if mk is not None]
    return float(sum(int(jnp.sum(w == 0)) for w, _ in pairs) / sum(w.size for w, _ in pairs))


def sparsity_ramp(step, start: int, end: int, final: float, initial: float = 0.0):
    """Zhu & Gupta (2017): s = final + (initial - final) (1 - (step - start) / (end - start))^3,
    `initial` before `start`, `final` from `end` on."""
    _check_sparsity(final, "final")
    _check_sparsity(initial, "initial")
    if end <= start:
        raise ValueError(f"end={end} must be after start={start}")
    frac = jnp.clip((jnp.asarray(step, jnp.float32) - start) / (end - start), 0.0, 1.0)
    return final + (initial - final) * (1.0 - frac) ** 3
