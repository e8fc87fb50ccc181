"""Model compression as library functions: weight-only post-training quantisation (PTQ), pruning
masks and a distillation loss. Pure functions over the plain parameter dict of
`jaxscale.train.state.FunctionalModel` and its tree of logical axis names (`model.logical`).

Which axes a weight contracts (the rule every function here uses, from the logical names only):
- `layers` and `experts` are stacked copies, never contracted: each index is its own matrix.
- norm scales (one non-stacked axis, e.g. ("layers", "embed")) are not weights: left as they are.
- output projections, whose last axis is `embed` (wo: heads, head_dim -> embed; w_down: mlp ->
  embed), contract every other non-stacked axis; all other weights contract their `embed` axis
  (wq/wk/wv, w_gate/w_up, head, the MoE router). The embedding table ("vocab", "embed") is a
  lookup: its `embed` axis is the one reduced, so it gets one scale per vocabulary row.
- output channels = the remaining axes (stacked axes included): one scale per output channel.

==========  ==================================================  =================================
method      stores                                              error
==========  ==================================================  =================================
int8 PTQ    int8 q = round(w / s), fp32 s = max|w| / 127 per   |w - q s| <= s / 2 per element
            output channel (bytes: 1 per weight + 4 per         (symmetric round to nearest; a
            channel: 1/4 of fp32 plus the scales)               channel of zeros stays exact)
int6 PTQ    as int8 with range -31..31, held in int8 bytes      <= s / 2 = max|w| / 62
int4 PTQ    range -7..7, two values packed per byte (uint8,     <= s / 2 = max|w| / 14
            offset 8): 1/8 of fp32 plus the scales
magnitude   boolean mask; per matrix (each stacked index) or    the round(s x size) smallest |w|
            over all prunable weights at once (global)          are zeroed, exactly that many
2:4         boolean mask; in every 4 consecutive weights of     2 of every 4 zeroed (50 %)
            the innermost contracted axis the 2 smallest |w|
            are zeroed (the pattern sparse tensor cores run)
==========  ==================================================  =================================

Pruning skips the embedding table (a lookup, not a matmul; sparse matmul units do not apply) and
norm scales. Ties in |w| are broken by position, so the counts are exact. `sparsity_schedule` is
the cubic ramp of Zhu & Gupta (2017). `distillation_loss` is Hinton et al.'s T^2 x KL(teacher ||
student) at temperature T, a token mean over a mask; the teacher gets no gradient.
`fake_quantize` is the forward of quantisation-aware training: quantise-dequantise with a
straight-through (identity) gradient. The tree functions compile once per model (`jax.jit` with
the logical names as a static argument); they run inside a caller's jit as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

STACKED = ("layers", "experts")
BITS = (4, 6, 8)


def _names(spec) -> tuple:
    return tuple(spec)


def _is_spec(x) -> bool:
    return isinstance(x, (P, tuple))


class _Logical:
    """The logical-names tree in a hashable form, so that the functions below compile once per
    model (a static argument of `jax.jit`) instead of running op by op."""

    def __init__(self, logical):
        leaves, self.tdef = jax.tree.flatten(logical, is_leaf=_is_spec)
        self.key = (self.tdef, tuple(_names(x) for x in leaves))

    def tree(self):
        return jax.tree.unflatten(self.tdef, list(self.key[1]))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Logical) and self.key == other.key


def contracted_axes(names: tuple) -> tuple[int, ...] | None:
    """Positions of the axes a weight with these logical names contracts (its input), or None
    for a leaf that is not a weight (a norm scale, a bias)."""
    own = [i for i, n in enumerate(names) if n not in STACKED]
    if len(own) < 2:
        return None
    if names[own[-1]] == "embed" and names[own[0]] != "vocab":     # output projection
        return tuple(own[:-1])
    emb = tuple(i for i in own if names[i] == "embed")
    if not emb:
        raise ValueError(f"weight with logical axes {names} has no 'embed' axis: cannot tell "
                         f"its contracted (input) axis")
    return emb


def is_lookup(names: tuple) -> bool:
    """An embedding table ("vocab", "embed"): read by row, never multiplied."""
    own = [n for n in names if n not in STACKED]
    return own[:1] == ["vocab"] and own[-1:] == ["embed"]


def _check_bits(bits):
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: weight-only quantisation supports bits in {BITS}")


@jax.tree_util.register_dataclass
@dataclass
class QTensor:
    """A quantised weight: `values` (int8, or uint8 with two int4 values per byte) and `scale`
    (fp32, shaped like the weight with 1 on the contracted axes)."""
    values: jax.Array
    scale: jax.Array
    bits: int = field(metadata=dict(static=True))
    shape: tuple = field(metadata=dict(static=True))
    dtype: Any = field(metadata=dict(static=True))


def quantize_tensor(w, axes: tuple[int, ...], bits: int = 8) -> QTensor:
    """Symmetric per-channel quantisation of `w` reducing over `axes` (the contracted ones)."""
    _check_bits(bits)
    qmax = 2 ** (bits - 1) - 1
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=axes, keepdims=True) / qmax
    q = jnp.clip(jnp.round(w32 / jnp.where(scale == 0, 1.0, scale)), -qmax, qmax).astype(jnp.int8)
    if bits == 4:                                   # pack: (lo + 8) | (hi + 8) << 4
        flat = q.reshape(-1)
        flat = jnp.pad(flat, (0, flat.size % 2)).astype(jnp.int16) + 8
        q = (flat[0::2] | (flat[1::2] << 4)).astype(jnp.uint8)
    return QTensor(q, scale, bits, tuple(w.shape), jnp.dtype(w.dtype))


def dequantize_tensor(t: QTensor, dtype=None):
    q = t.values
    if t.bits == 4:
        b = q.astype(jnp.int16)
        q = jnp.stack([b & 15, b >> 4], axis=-1).reshape(-1)[:int(np.prod(t.shape))] - 8
        q = q.reshape(t.shape)
    return (q.astype(jnp.float32) * t.scale).astype(dtype or t.dtype)


def _map_weights(fn, params, logical, rest=lambda x: x):
    """fn(w, names, path) on every weight, `rest` on every other leaf."""
    def one(path, spec, w):
        names = _names(spec)
        return rest(w) if contracted_axes(names) is None else fn(w, names, path)
    return jax.tree_util.tree_map_with_path(one, logical, params, is_leaf=_is_spec)


def quantize(params, logical, bits: int = 8):
    """The params tree with every weight a `QTensor` (a QTree); norm scales kept as they are."""
    _check_bits(bits)
    return _quantize(params, _Logical(logical), bits)


@partial(jax.jit, static_argnums=(1, 2))
def _quantize(params, lg, bits):
    return _map_weights(lambda w, n, _: quantize_tensor(w, contracted_axes(n), bits),
                        params, lg.tree())


@partial(jax.jit, static_argnums=(1,))
def dequantize(qtree, dtype=None):
    """A QTree -> a params tree (each weight back in its original dtype unless `dtype`)."""
    return jax.tree.map(lambda x: dequantize_tensor(x, dtype) if isinstance(x, QTensor) else x,
                        qtree, is_leaf=lambda x: isinstance(x, QTensor))


def fake_quantize(params, logical, bits: int = 8):
    """Quantise-dequantise every weight with a straight-through gradient (identity backward):
    the forward pass of quantisation-aware training (call it inside the loss)."""
    _check_bits(bits)
    return _fake_quantize(params, _Logical(logical), bits)


@partial(jax.jit, static_argnums=(1, 2))
def _fake_quantize(params, lg, bits):
    def ste(w, n, _):
        return w + jax.lax.stop_gradient(
            dequantize_tensor(quantize_tensor(w, contracted_axes(n), bits)) - w)
    return _map_weights(ste, params, lg.tree())


def nbytes(tree) -> int:
    """Bytes of every array in a tree (QTensors count values and scales)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------------- pruning

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
    return _magnitude(params, _Logical(logical), float(sparsity), scope)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _magnitude(params, lg, sparsity, scope):
    logical, skip = lg.tree(), (lambda w: None)
    if scope == "per_tensor":
        def one(w, names, _):
            return magnitude_mask(w, names, sparsity) if _prunable(names) else None
        return _map_weights(one, params, logical, skip)
    flat = _map_weights(lambda w, n, _: w if _prunable(n) else None, params, logical, skip)
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
    return _nm(params, _Logical(logical), n, m)


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
    return _map_weights(one, params, lg.tree(), lambda w: None)


def apply(params, masks):
    """params with the masked weights zeroed (leaves whose mask is None unchanged)."""
    return jax.tree.map(lambda mk, w: w if mk is None else w * mk.astype(w.dtype), masks, params,
                        is_leaf=lambda x: x is None)


def sparsity(params, masks) -> float:
    """Fraction of zeros among the masked weights."""
    pairs = [(w, mk) for mk, w in zip(jax.tree.leaves(masks, is_leaf=lambda x: x is None),
                                      jax.tree.leaves(params)) if mk is not None]
    return float(sum(int(jnp.sum(w == 0)) for w, _ in pairs) / sum(w.size for w, _ in pairs))


def sparsity_schedule(step, start: int, end: int, final: float, initial: float = 0.0):
    """Zhu & Gupta (2017): s = final + (initial - final) (1 - (step - start) / (end - start))^3,
    `initial` before `start`, `final` from `end` on."""
    _check_sparsity(final, "final")
    _check_sparsity(initial, "initial")
    if end <= start:
        raise ValueError(f"end={end} must be after start={start}")
    frac = jnp.clip((jnp.asarray(step, jnp.float32) - start) / (end - start), 0.0, 1.0)
    return final + (initial - final) * (1.0 - frac) ** 3


# ------------------------------------------------------------------------------ distillation

def _concrete(x) -> bool:
    """A Python or NumPy number (checked); traced values (e.g. jit arguments) are not."""
    return isinstance(x, (int, float, np.number))


def distillation_loss(student_logits, teacher_logits, temperature: float = 1.0, mask=None):
    """T^2 x KL(softmax(teacher / T) || softmax(student / T)), token mean over `mask` ([B, T];
    None = every token). No gradient flows into the teacher. `temperature` may be traced."""
    if _concrete(temperature) and not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    t = jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature
    s = student_logits.astype(jnp.float32) / temperature
    logp_t, logp_s = jax.nn.log_softmax(t, -1), jax.nn.log_softmax(s, -1)
    kl = jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s), axis=-1)
    mask = jnp.ones(kl.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    return temperature ** 2 * jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def distill_objective(student_logits, teacher_logits, targets, mask=None, alpha: float = 0.5,
                      temperature: float = 1.0):
    """alpha x CE(student, targets) + (1 - alpha) x distillation_loss; returns (loss, parts)."""
    if _concrete(alpha) and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
    ce_tok = optax.softmax_cross_entropy_with_integer_labels(
        student_logits.astype(jnp.float32), targets)
    m = jnp.ones(ce_tok.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    ce = jnp.sum(ce_tok * m) / jnp.maximum(jnp.sum(m), 1.0)
    kd = distillation_loss(student_logits, teacher_logits, temperature, m)
    return alpha * ce + (1 - alpha) * kd, {"ce": ce, "kd": kd}
