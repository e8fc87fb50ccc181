"""Weight-only post-training quantisation (PTQ) and fake quantisation, as library functions over
the plain parameter dict of `jaxscale.train.state.FunctionalModel` and its tree of logical axis
names (`model.logical`). Pruning masks are `strategies/prune/masks.py`, the distillation loss
`train/distill.py`.

Which axes a weight contracts is `tables.params.contracted_axes` (from the logical names only);
the output channels are the remaining axes (stacked axes included): one scale per output channel.

==========  ==================================================  =================================
method      stores                                              error
==========  ==================================================  =================================
int8 PTQ    int8 q = round(w / s), fp32 s = max|w| / 127 per   |w - q s| <= s / 2 per element
            output channel (bytes: 1 per weight + 4 per         (symmetric round to nearest; a
            channel: 1/4 of fp32 plus the scales)               channel of zeros stays exact)
int6 PTQ    as int8 with range -31..31, held in int8 bytes      <= s / 2 = max|w| / 62
int4 PTQ    range -7..7, two values packed per byte (uint8,     <= s / 2 = max|w| / 14
            offset 8): 1/8 of fp32 plus the scales
==========  ==================================================  =================================

`fake_quantize` is the forward of quantisation-aware training with straight-through gradients:
quantise-dequantise, identity backward. The tree functions compile once per model (`jax.jit`
with the logical names as a static argument, `tables.weights.Logical`); they run inside a
caller's jit as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.strategies.tables.params import contracted_axes
from jaxscale.strategies.tables.weights import Logical, map_weights

BITS = (4, 6, 8)


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


def quantize(params, logical, bits: int = 8):
    """The params tree with every weight a `QTensor` (a QTree); norm scales kept as they are."""
    _check_bits(bits)
    return _quantize(params, Logical(logical), bits)


@partial(jax.jit, static_argnums=(1, 2))
def _quantize(params, lg, bits):
    return map_weights(lambda w, n, _: quantize_tensor(w, contracted_axes(n), bits),
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
    return _fake_quantize(params, Logical(logical), bits)


@partial(jax.jit, static_argnums=(1, 2))
def _fake_quantize(params, lg, bits):
    def ste(w, n, _):
        return w + jax.lax.stop_gradient(
            dequantize_tensor(quantize_tensor(w, contracted_axes(n), bits)) - w)
    return map_weights(ste, params, lg.tree())


def nbytes(tree) -> int:
    """Bytes of every array in a tree (QTensors count values and scales)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
