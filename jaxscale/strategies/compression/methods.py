"""Compressed gradient means over the data axes, written inside `jax.shard_map`.

Each function is called inside `jax.shard_map` with a device's local gradient (an array or a
pytree) and the data mesh axes (`("dp",)`, `("dp", "fsdp")`, ...), and returns the mean over
those axes, identical on every device (replicated, `to='invarying'`). Methods with error feedback
also take and return a per-device state. A pytree is flattened into one fp32 bucket first (one
set of collectives per step, as DDP buckets do), each leaf starting a new block; PowerSGD
(`jaxscale.strategies.compression.powersgd`) works per matrix.

==========  =============================================  ==================  ===================
method      collectives (N devices, L gradient elements)   link bytes/device   error (per element)
==========  =============================================  ==================  ===================
fp32        all-reduce f32 [L]                             2(N-1)/N 4L         exact
bf16        all-to-all u16 [L] + all-gather u16 [L]        2(N-1)/N 2L         2 roundings, 2^-8 rel
fp8         all-to-all u8 [L] + f32 scales [L/B], same     2(N-1)/N (L+4L/B)   2 x 1/16 rel (e4m3)
            again as all-gather                                                + 2^-10 block max/448
int8        as fp8, s8 payload                             2(N-1)/N (L+4L/B)   <= block max / 127
sign        as fp8, u8 = 8 packed signs, scale mean|g|     2(N-1)/N (L/8+4L/B) biased; EF fixes
topk        all-gather value [k] + all-gather s32 [k]      (N-1) k (4 + v)     EF: residual kept
threshold   as topk, capacity k (|g| >= threshold sent)    (N-1) k (4 + v)     EF: residual kept
powersgd    all-reduce f32 P [n, r], all-reduce Q [m, r]   2(N-1)/N (n+m) r 4  rank r; EF
==========  =============================================  ==================  ===================

Quantised means (bf16, fp8, int8, sign) are a reduce-scatter + all-gather spelled as an
all-to-all of the quantised shards, a local dequantise-and-sum in fp32, a requantise of the mean
shard, and an all-gather of it. A sum in int8/fp8 overflows (8 devices x 127), so the reduction is
never done on the wire: an int8 `psum_scatter` would be wrong, an fp32 one would send 4 bytes.
The alternative, all-gather the quantised gradients and reduce locally, is exact after one
quantisation but sends (N-1) L bytes per device instead of 2(N-1)/N L: N/2 times more (4x at
N = 8). The price of the two-stage form is a second quantisation of the mean (error counted
above). `B` is the block: one fp32 scale (max|x| / 127 for int8, / 448 for fp8, mean|x| for
sign) per B elements, sent beside the payload in both stages. Each leaf is zero-padded to whole
blocks, so that a block's scale is its own leaf's: a norm scale's gradient, a few thousandths of
a matrix's, sharing a block with the matrix's values would round to the matrix's levels (to zero,
or for sign to the matrix's magnitude), far outside its own bound. The bucket is then
zero-padded to a multiple of N*B (each device's shard whole blocks). At most one block per leaf
and N-1 at the end (`formulas.bucket_size`; `pad=False` refuses instead); the padding is on
the wire and in `formulas.wire_bytes`; sign's padding (whose bit decodes to +scale) is zeroed
before the mean's blocks are scaled.
bf16 and fp8 travel bitcast to u16/u8: XLA:CPU widens bf16 collectives to f32 and f8 ones to f16
(seen in the compiled HLO), which would hide the saving; the bitcast is exact and free.

Error feedback (Seide et al. 2014, Karimireddy et al. 2019): the device adds its residual (what
it did not send last step) to the gradient before compressing and keeps what it does not send
now. Sign compression keeps a second residual for the requantised mean shard it owns (the
"server" error of 1-bit Adam, Tang et al. 2021). Top-k sends values + int32 indices by all-gather;
an all-gather does not shrink with N, so top-k pays (N-1) k (4+v) bytes per device.

State layout: the functions see one device's state (residuals shaped like its gradient);
`init_state` builds that, `stack` adds the leading device axis a caller keeps it in, sharded
over the data axes (`state_specs`). The method names, the checks of the arguments and the
pure-Python formulas (`wire_bytes` / `collectives` / `payload_bytes`, which `inspect.census` of
a compiled step equals row by row) are `jaxscale.strategies.compression.formulas`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.strategies.codecs import CAST, decode, encode
from jaxscale.strategies.compression import powersgd
from jaxscale.strategies.compression.formulas import (
    _check_block,
    _check_k,
    _check_method,
    bucket_size,
    check_axes,
)

Axes = str | Sequence[str]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def axis_size(axes: tuple[str, ...]) -> int:
    try:
        return int(jax.lax.axis_size(axes))
    except NameError as e:
        raise ValueError(f"compressed means run inside jax.shard_map over a mesh with axes "
                         f"{axes}; call them from the shard_map body ({e})") from None


def ravel(tree, block: int = 1) -> tuple[jax.Array, Any]:
    """Flatten a pytree into one fp32 vector, each leaf zero-padded to a multiple of `block`
    (so that a block of the bucket holds one leaf's values); returns it and the function that
    undoes it (reading each leaf at its offset, whatever follows the last)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        raise ValueError("nothing to reduce: the gradient pytree has no leaves")
    shapes = [(leaf.shape, leaf.dtype) for leaf in leaves]
    pads = [(-math.prod(leaf.shape)) % block for leaf in leaves]
    flat = jnp.concatenate([jnp.pad(jnp.ravel(leaf).astype(jnp.float32), (0, p))
                            for leaf, p in zip(leaves, pads)])

    def unravel(v):
        out, o = [], 0
        for (shape, dtype), p in zip(shapes, pads):
            size = math.prod(shape)
            out.append(v[o:o + size].reshape(shape).astype(dtype))
            o += size + p
        return jax.tree.unflatten(treedef, out)
    return flat, unravel


def invariant_all_gather(x, axes, **kw):
    return jax.lax.all_gather(x, axes, tiled=True, to="invarying", **kw)


def _two_stage(method, flat, axes, n, block, server=None, valid=None):
    """Quantised mean of a padded flat buffer [Lp]: all-to-all of the quantised shards, fp32
    sum, requantise the mean shard, all-gather. Returns (mean [Lp], local decode [Lp], server).
    `valid` [Lp] (1 for a gradient's element, 0 for padding): zeroes the padding where the codec
    decodes a zero to something else (sign: +scale), so that it stays out of the mean's scales."""
    blocks_NCB = flat.reshape(n, -1, block)                     # [device, block, element]
    payload, scale = encode(method, blocks_NCB)
    local = decode(method, payload, scale).reshape(-1)          # what this device sent
    payload = jax.lax.all_to_all(payload, axes, 0, 0)           # [j] = device j's copy of my shard
    scale = None if scale is None else jax.lax.all_to_all(scale, axes, 0, 0)
    shard_CB = jnp.sum(decode(method, payload, scale), axis=0) / n   # fp32 mean of my shard
    if valid is not None:
        local = local * valid
        mine = valid.reshape(n, -1, block)[jax.lax.axis_index(axes)]
        shard_CB = shard_CB * mine
    if server is not None:
        shard_CB = shard_CB + server.reshape(shard_CB.shape)
    payload, scale = encode(method, shard_CB)
    if server is not None:
        server = (shard_CB - decode(method, payload, scale)).reshape(-1)
    payload = invariant_all_gather(payload, axes)               # [N*C, bytes per block]
    scale = None if scale is None else invariant_all_gather(scale, axes)
    return decode(method, payload, scale).reshape(-1), local, server


# ---------------------------------------------------------------------------------------------
# the means
# ---------------------------------------------------------------------------------------------
def allreduce_mean(x, axes):
    """Exact fp32 mean (the baseline): one `psum` of the flattened bucket."""
    axes = check_axes(axes)
    flat, unravel = ravel(x)
    return unravel(jax.lax.psum(flat, axes) / axis_size(axes))


def allreduce_cast(x, axes, dtype, *, block: int = 256, pad: bool = True):
    """Mean of `x` (array or pytree) over `axes` with a low-precision wire: `dtype` is
    jnp.bfloat16 / "bf16", jnp.float8_e4m3fn / "fp8" (per-block scale max|x|/448) or jnp.int8 /
    "int8" (per-block scale max|x|/127). One fp32 scale per `block` elements; bf16 has none."""
    method = cast_method(dtype)
    axes = check_axes(axes)
    block = 1 if method == "bf16" else block
    _check_block(method, block)
    n = axis_size(axes)
    lp = bucket_size([leaf.shape for leaf in jax.tree.leaves(x)], n, block, pad)
    flat, unravel = ravel(x, block)                 # each leaf whole blocks
    mean, _, _ = _two_stage(method, jnp.pad(flat, (0, lp - flat.shape[0])), axes, n, block)
    return unravel(mean)


def cast_method(dtype) -> str:
    if isinstance(dtype, str) and dtype in CAST:
        return dtype
    for name, dt in CAST.items():
        if not isinstance(dtype, str) and jnp.dtype(dtype) == jnp.dtype(dt):
            return name
    raise ValueError(f"allreduce_cast dtype must be one of bf16 (jnp.bfloat16), fp8 "
                     f"(jnp.float8_e4m3fn) or int8 (jnp.int8); got {dtype!r}")


def sign_mean(x, state, axes, *, block: int = 256):
    """1-bit sign compression with error feedback: signs packed 8 per byte (u8 on the wire) and
    one fp32 scale = mean|g + e| per block, both stages (see the module docstring).
    `state` = (residual shaped like x, server residual [Lp / N]) from `init_state("sign", ...)`."""
    axes = check_axes(axes)
    _check_block("sign", block)
    n = axis_size(axes)
    residual, server = state
    flat, unravel = ravel(x, block)                 # each leaf whole blocks
    acc = flat + ravel(residual, block)[0]
    lp = bucket_size([leaf.shape for leaf in jax.tree.leaves(x)], n, block)
    if server.shape != (lp // n,):
        raise ValueError(f"sign state's server residual has shape {server.shape}, expected "
                         f"({lp // n},) for {n} devices and block={block}: rebuild it with "
                         f"init_state('sign', grads, n_devices={n}, block={block})")
    valid = ravel(jax.tree.map(jnp.ones_like, x), block)[0]
    mean, local, server = _two_stage("sign", jnp.pad(acc, (0, lp - acc.shape[0])), axes, n,
                                     block, server, jnp.pad(valid, (0, lp - valid.shape[0])))
    return unravel(mean), (unravel(acc - local[:acc.shape[0]]), server)


def topk_mean(x, residual, axes, k: int, *, value_dtype=jnp.float32, threshold=None):
    """Top-k sparsification: the k entries of largest |g + e| (over the whole flattened bucket)
    are all-gathered as values (`value_dtype`, f32 or bf16) + int32 indices, scatter-added into a
    dense vector and divided by N. `residual=None`: no error feedback (returned residual None).
    `threshold`: send only those of the k with |g + e| >= threshold (k is then the capacity)."""
    axes = check_axes(axes)
    n = axis_size(axes)
    flat, unravel = ravel(x)
    size = flat.shape[0]
    k = _check_k(k, size)
    acc = flat if residual is None else flat + ravel(residual)[0]
    _, idx = jax.lax.top_k(jnp.abs(acc), k)
    vals = acc[idx]
    if threshold is not None:
        vals = jnp.where(jnp.abs(vals) >= threshold, vals, 0.0)
    vals = vals.astype(value_dtype)
    sent = vals.astype(jnp.float32)
    wire = (jax.lax.bitcast_convert_type(vals, jnp.uint16) if vals.dtype == jnp.bfloat16
            else vals)
    all_vals = invariant_all_gather(wire, axes)                 # [N*k]
    if all_vals.dtype == jnp.uint16:
        all_vals = jax.lax.bitcast_convert_type(all_vals, jnp.bfloat16)
    all_idx = invariant_all_gather(idx.astype(jnp.int32), axes)
    dense = jnp.zeros((size,), jnp.float32).at[all_idx].add(all_vals.astype(jnp.float32)) / n
    new_res = None if residual is None else unravel(acc.at[idx].add(-sent))
    return unravel(dense), new_res


def threshold_mean(x, residual, axes, threshold: float, k: int, *, value_dtype=jnp.float32):
    """Threshold sparsification with error feedback: entries with |g + e| >= `threshold` are
    sent, at most `k` of them (static shapes need a capacity: the largest k, the rest stay in
    the residual); the wire is that of top-k with k slots."""
    if not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    return topk_mean(x, residual, axes, k, value_dtype=value_dtype, threshold=float(threshold))


# ---------------------------------------------------------------------------------------------
# one entry point, its state, the state's layout
# ---------------------------------------------------------------------------------------------
def compressed_mean(method: str, grads, state, axes, **params):
    """Dispatch: returns (mean of grads over axes, new state); state None for stateless methods.
    params: block, pad (casts, sign); k, value_dtype, error_feedback (topk); threshold, k
    (threshold); rank (powersgd)."""
    _check_method(method)
    axes = check_axes(axes)
    if method == "fp32":
        return allreduce_mean(grads, axes), state
    if method in CAST:
        return allreduce_cast(grads, axes, method, block=params.get("block", 256),
                              pad=params.get("pad", True)), state
    if method == "sign":
        return sign_mean(grads, state, axes, block=params.get("block", 256))
    if method == "topk":
        return topk_mean(grads, state, axes, params["k"],
                         value_dtype=params.get("value_dtype", jnp.float32))
    if method == "threshold":
        return threshold_mean(grads, state, axes, params["threshold"], params["k"],
                              value_dtype=params.get("value_dtype", jnp.float32))
    return powersgd.powersgd_mean(grads, state, axes, params["rank"])


def init_state(method: str, grads, n_devices: int, *, key=None, **params):
    """One device's compression state for `grads` (arrays or ShapeDtypeStructs): None (fp32,
    casts, topk with error_feedback=False), the residual (topk, threshold), (residual, server
    residual) for sign, powersgd.State for powersgd (`key`: the warm-start Q's seed, the same on
    every device). Residuals are fp32."""
    _check_method(method)
    zeros = lambda t: jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), t)
    if method in ("topk", "threshold"):
        return zeros(grads) if params.get("error_feedback", True) else None
    if method == "sign":
        block = params.get("block", 256)
        _check_block("sign", block)
        lp = bucket_size([g.shape for g in jax.tree.leaves(grads)], n_devices, block)
        return zeros(grads), jnp.zeros((lp // n_devices,))
    if method == "powersgd":
        return powersgd.init(grads, params["rank"], key=jax.random.key(0) if key is None else key)
    return None


def stack(state, n_devices: int):
    """The global form of a per-device state: each leaf with a leading axis of n_devices
    (identical copies at init), to be sharded over the data axes (`state_specs`)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n_devices,) + a.shape), state)


def state_specs(state, axes):
    """PartitionSpecs of a stacked state: dim 0 over the data axes (every leaf is per device;
    PowerSGD's Q is identical on all of them, kept per device so all leaves share one layout)."""
    return jax.tree.map(lambda _: P(check_axes(axes)), state)


# ---------------------------------------------------------------------------------------------
# the global-array wrapper
# ---------------------------------------------------------------------------------------------
def per_device_mean(method: str, mesh, axes, **params):
    """Global-array wrapper (tests, experiments, and the layout a train step follows): returns
    jit(fn(grads_n, state_n) -> (mean, state_n)) where every leaf of grads_n and state_n has a
    leading axis over the devices of `axes` (sharded over them), state_n = stack(init_state(...))
    or None, and mean is the replicated result."""
    axes = check_axes(axes)

    def body(g, s):
        s = None if s is None else jax.tree.map(lambda a: a[0], s)
        mean, s = compressed_mean(method, jax.tree.map(lambda a: a[0], g), s, axes, **params)
        return mean, (None if s is None else jax.tree.map(lambda a: a[None], s))

    def fn(grads_n, state_n):
        specs = None if state_n is None else state_specs(state_n, axes)
        return jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs),
                             out_specs=(P(), specs))(grads_n, state_n)
    return jax.jit(fn)
