"""8-bit grouped matmuls: the mixture of experts' expert matmuls under quantisation-aware training.

The experts run as grouped matmuls, rows sorted by expert times each expert's weight
(`jax.lax.ragged_dot`; `jaxscale.hooks.projection.project_grouped`, the rules' `grouped` seam).
The numerics are the dense sites' (`numerics.py`), per expert where a weight has one scale:

- int8: each row symmetric over the contracted dim, each expert's weight per output channel; an
  s8 x s8 -> s32 grouped dot, rescaled by the row's and its expert's channel scales.
  Straight-through backward (the unquantised grouped matmul's gradients). Where the contracted
  dim is split over mesh axes (the down projection's `mlp` over tp) the scales are the max over
  them.
- fp8: per-tensor scales, the whole expert stack one tensor: the rows and the stack in e4m3
  forward; the output gradient in e5m2 for both backward products (dx a grouped dot with the
  transposed stack, dw a grouped dot contracting each expert's rows: `ragged_dot_general`).
  Delayed scaling reads and records the dense MLP's slots (`w:w_gate` ... `g:w_down`, the inputs
  `x:mlp_in` and `x:mlp_hidden`): a MoE layer has no dense MLP, so they are the experts'.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxscale.axes import manual_axes
from jaxscale.strategies.qat.numerics import (
    E4M3,
    E5M2,
    FP8_MAX,
    _amax,
    _cast,
    _int8,
    _scale,
    quantize_input,
)

#: dw[e] = x[rows of e]^T g[rows of e]: the grouped dot contracting the rows
_DW = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def reference(xs, w, sizes):
    return lax.ragged_dot(xs, w.astype(xs.dtype), sizes)


def row_groups(sizes, n_rows: int):
    """[R] the expert of each row (rows past the groups: the last expert; they compute 0)."""
    ends = jnp.cumsum(sizes)
    return jnp.minimum(jnp.sum(jnp.arange(n_rows)[:, None] >= ends[None, :], axis=-1),
                       sizes.shape[0] - 1)


# ----------------------------------------------------------------------------- int8
@partial(jax.custom_vjp, nondiff_argnums=(3,))
def int8_grouped(xs, w, sizes, over=()):
    """ragged_dot(xs, w, sizes) through an int8 grouped dot; `over`: mesh axes splitting the
    contracted dim (manual here), whose slices share one scale."""
    return _int8_fwd(xs, w, sizes, over)[0]


def _int8_fwd(xs, w, sizes, over):
    (qx, sx), (qw, sw) = _int8(xs, (1,), over), _int8(w, (1,), over)
    acc = lax.ragged_dot(qx, qw, sizes, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * sx * sw[row_groups(sizes, xs.shape[0]), 0, :]
    return y.astype(xs.dtype), (xs, w, sizes)


def _int8_bwd(over, res, g):
    xs, w, sizes = res
    dx, dw = jax.vjp(lambda a, b: reference(a, b, sizes), xs, w)[1](g)
    return dx, dw, None


int8_grouped.defvjp(_int8_fwd, _int8_bwd)


# ----------------------------------------------------------------------------- fp8
def fp8_grouped(xs, w, sizes, scales=None, record_x: bool = True):
    """ragged_dot(xs, w, sizes) through e4m3 grouped dots, its backward through e5m2 ones;
    `scales`: f32[3] divisors (x, w, g) as `numerics.fp8_matmul`'s, their cotangent the amaxes
    seen."""
    scales = jnp.zeros((3,), jnp.float32) if scales is None else scales
    x8, sx, ax = quantize_input(xs, scales[0])
    aw = _amax(lax.stop_gradient(w))       # here, where the region's pieces are known
    return _fp8(record_x, manual_axes(), xs, x8, sx, ax, w, aw, scales, sizes)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8(record_x, over, x, x8, sx, ax, w, aw, scales, sizes):
    return _fp8_fwd(record_x, over, x, x8, sx, ax, w, aw, scales, sizes)[0]


def _fp8_fwd(record_x, over, x, x8, sx, ax, w, aw, scales, sizes):
    sw = _scale(scales[1], aw, FP8_MAX["w"])
    y = lax.ragged_dot(x8, _cast(w, sw, E4M3), sizes, preferred_element_type=jnp.float32)
    return (y * (sx * sw)).astype(x.dtype), (x8, w, sx, sw, scales[2],
                                            ax if record_x else 0.0 * ax, aw,
                                            jnp.zeros((0,), x.dtype), sizes)


def _fp8_bwd(record_x, over, res, g):
    x8, w, sx, sw, given_g, ax, aw, x_dtype, sizes = res
    ag = _amax(g, over)
    sg = _scale(given_g, ag, FP8_MAX["g"])
    g8 = _cast(g, sg, E5M2)
    w8_t = jnp.swapaxes(_cast(w, sw, E4M3), 1, 2)
    dx = lax.ragged_dot(g8, w8_t, sizes, preferred_element_type=jnp.float32) * (sg * sw)
    dw = lax.ragged_dot_general(x8, g8, sizes, _DW, preferred_element_type=jnp.float32)
    zero = jnp.zeros((), jnp.float32)
    return (dx.astype(x_dtype.dtype), jnp.zeros_like(x8), zero, zero,
            (dw * (sx * sg)).astype(w.dtype), zero, jnp.stack([ax, aw, ag]), None)


_fp8.defvjp(_fp8_fwd, _fp8_bwd)
