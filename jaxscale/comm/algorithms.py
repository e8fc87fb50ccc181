"""Hand-written collectives from `jax.lax.ppermute`; their cost model is in `algorithm_cost`.

XLA picks its own algorithm for `psum`, `all_gather` and `psum_scatter`. The functions here spell
the classic algorithms out as point-to-point steps, to study them, to time them against the
built-in ones, and as the skeleton that gradient compression later fills (compress before each
send, decompress after each receive). Each one is numerically the built-in collective it names.

Module functions take a device-local array and a mesh axis name (or a tuple of names, taken
together in mesh order) and must be called inside `jax.shard_map`; `n` is the axis size and `S`
the bytes of the full per-device buffer (as nccl-tests counts it). Collectives added, per device:

=========================  =====================  ==========================  ===================
function                   equals                 steps (ppermutes)           bytes sent
=========================  =====================  ==========================  ===================
ring_reduce_scatter        psum_scatter(tiled)    n-1, each S/n               (n-1)/n S
ring_all_gather            all_gather(tiled)      n-1, each S/n (S = output)  (n-1)/n S
ring_all_reduce            psum                   2(n-1), each S/n            2(n-1)/n S
halving_doubling_all_...   psum (n = 2^k)         2 log2 n, S/2, S/4, ...     2(n-1)/n S
recursive_doubling_all_..  psum (n = 2^k)         log2 n, each S              log2(n) S
hierarchical_all_reduce    psum over two axes     2(a-1) inner + 2(b-1) outer 2(a-1)/a S inner,
                           (inner a, outer b)                                 2(b-1)/(ab) S outer
=========================  =====================  ==========================  ===================

Ring and halving-doubling move the bandwidth-optimal 2(n-1)/n S; halving-doubling needs only
2 log2 n latencies instead of 2(n-1); recursive doubling trades bandwidth (log2 n full buffers) for
the fewest steps, which wins for small messages. The hierarchical all-reduce moves the same total,
but all-reduces only a shard of S/a over the outer (slow, inter-node) axis: with inter-node
bandwidth below intra-node bandwidth it beats a flat ring over all a*b devices, whose every step
waits on a hop that crosses nodes (`algorithm_cost.flat_ring_time` vs
`algorithm_cost.hierarchical_time`).

The loops are unrolled in Python: every step is one `collective-permute` in the compiled program
(and nothing else is a collective), which keeps the census exact. On simulated CPU devices every
permute is a rendezvous of all device threads (~0.1 ms on 2 cores), so there the algorithms rank
by step count and one fused `psum` wins; `experiments/10_collectives.py` measures it.

The steps and bytes of the table are the alpha-beta model of `jaxscale.comm.algorithm_cost`
(`cost`, `predict_time`), which predicts these algorithms' times.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxscale.comm.algorithm_cost import check_power_of_two

AxisName = str | tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _size(axis_name: AxisName) -> int:
    return int(jax.lax.axis_size(axis_name))


def _ring(n: int, shift: int = 1) -> list[tuple[int, int]]:
    return [(j, (j + shift) % n) for j in range(n)]


def _xor(n: int, d: int) -> list[tuple[int, int]]:
    return [(j, j ^ d) for j in range(n)]


def _flat_padded(x: jax.Array, multiple: int) -> tuple[jax.Array, int]:
    """Flatten `x` and zero-pad it to a multiple of `multiple`; returns (flat, original size)."""
    flat = x.reshape(-1)
    pad = (-flat.shape[0]) % multiple
    return (jnp.pad(flat, (0, pad)) if pad else flat), flat.shape[0]


def _take(chunks: jax.Array, idx) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(chunks, idx, axis=0, keepdims=False)


# ---------------------------------------------------------------------------------------------
# ring collectives
# ---------------------------------------------------------------------------------------------
def ring_reduce_scatter(x: jax.Array, axis_name: AxisName, *, axis: int = 0) -> jax.Array:
    """Ring reduce-scatter: device i gets block i (of n along `axis`) of the sum over devices.

    Equals `jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)`.
    Step s (0..n-2): send the partial sum of block (i-s-1) mod n to i+1, receive block (i-s-2)
    mod n from i-1 and add the local copy of it; after n-1 steps block i is complete.
    """
    n = _size(axis_name)
    if x.shape[axis] % n:
        raise ValueError(f"ring_reduce_scatter: dimension {axis} of shape {x.shape} is not "
                         f"divisible by the {n} devices of axis {axis_name!r}")
    x = jnp.moveaxis(x, axis, 0)
    chunks_nC = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    i = jax.lax.axis_index(axis_name)
    # one gather into send order: [k] = chunk (i - k - 1) mod n, sent (k=0) or added at step k-1
    order_nC = jnp.take(chunks_nC, (i - 1 - jnp.arange(n)) % n, axis=0)
    acc = order_nC[0]
    for s in range(n - 1):
        acc = jax.lax.ppermute(acc, axis_name, _ring(n)) + order_nC[s + 1]
    return jnp.moveaxis(acc, 0, axis)


def ring_all_gather(x: jax.Array, axis_name: AxisName, *, axis: int = 0) -> jax.Array:
    """Ring all-gather: concatenate every device's block along `axis`, in axis-index order.

    Equals `jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)`. Step s forwards the block
    received at step s-1 (its own at s=0) to i+1; the block arriving from i-1 is block (i-s-1).
    The blocks are stacked in arrival order and put in place by one gather at the end (writing
    each into a buffer at a traced offset, or a traced roll, costs more on XLA:CPU).
    """
    n = _size(axis_name)
    x = jnp.moveaxis(x, axis, 0)
    i = jax.lax.axis_index(axis_name)
    got = [x]  # got[k] = block (i - k) mod n
    for _ in range(n - 1):
        got.append(jax.lax.ppermute(got[-1], axis_name, _ring(n)))
    blocks_nC = jnp.take(jnp.stack(got), (i - jnp.arange(n)) % n, axis=0)  # [j] = block j
    out = blocks_nC.reshape((n * x.shape[0],) + x.shape[1:])
    return jnp.moveaxis(out, 0, axis)


def ring_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Ring all-reduce = ring reduce-scatter + ring all-gather (2(n-1) steps). Equals `psum`.

    Any shape: the array is flattened and zero-padded to a multiple of n.
    """
    n = _size(axis_name)
    if n == 1:
        return x
    flat, size = _flat_padded(x, n)
    out = ring_all_gather(ring_reduce_scatter(flat, axis_name), axis_name)
    return out[:size].reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# power-of-two algorithms
# ---------------------------------------------------------------------------------------------
def halving_doubling_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Recursive halving reduce-scatter + recursive doubling all-gather (Rabenseifner).

    Equals `psum`; needs a power-of-two axis size. Halving at distance d = n/2, n/4, ..., 1:
    exchange with partner i XOR d, keep the half of the current segment selected by bit d of i
    and add the partner's copy of it. After log2 n steps device i holds block i of the sum.
    Doubling at d = 1, 2, ..., n/2 swaps segments with the same partners and concatenates.
    """
    n = _size(axis_name)
    check_power_of_two(n, "halving_doubling_all_reduce", axis_name)
    if n == 1:
        return x
    flat, size = _flat_padded(x, n)
    i = jax.lax.axis_index(axis_name)
    seg = flat
    d = n // 2
    while d >= 1:  # reduce-scatter by recursive halving
        half = seg.shape[0] // 2
        bit = (i // d) % 2  # 1: keep the upper half, send the lower
        halves_2H = seg.reshape(2, half)
        send, keep = _take(halves_2H, 1 - bit), _take(halves_2H, bit)
        seg = keep + jax.lax.ppermute(send, axis_name, _xor(n, d))
        d //= 2
    d = 1
    while d < n:  # all-gather by recursive doubling
        other = jax.lax.ppermute(seg, axis_name, _xor(n, d))
        bit = (i // d) % 2  # 1: the partner's segment goes first
        pair_2H = jnp.take(jnp.stack([seg, other]), jnp.stack([bit, 1 - bit]), axis=0)
        seg = pair_2H.reshape(-1)
        d *= 2
    return seg[:size].reshape(x.shape)


def recursive_doubling_all_reduce(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """log2 n steps, each exchanging the whole buffer with partner i XOR d and adding.

    Equals `psum`; needs a power-of-two axis size. Latency-optimal, not bandwidth-optimal.
    """
    n = _size(axis_name)
    check_power_of_two(n, "recursive_doubling_all_reduce", axis_name)
    d = 1
    while d < n:
        x = x + jax.lax.ppermute(x, axis_name, _xor(n, d))
        d *= 2
    return x


def hierarchical_all_reduce(x: jax.Array, inner_axis: AxisName, outer_axis: AxisName, *,
                            outer: str = "ring") -> jax.Array:
    """Two-level all-reduce: ring reduce-scatter over `inner_axis` (inside a node), all-reduce of
    the 1/a shard over `outer_axis` (across nodes; `outer` = "ring", "halving_doubling",
    "recursive_doubling" or "psum"), ring all-gather over `inner_axis`.

    Equals `psum(x, (outer_axis, inner_axis))`. Only S/a bytes per device cross nodes.
    """
    outer_fns: dict[str, Callable] = {
        "ring": ring_all_reduce, "halving_doubling": halving_doubling_all_reduce,
        "recursive_doubling": recursive_doubling_all_reduce, "psum": jax.lax.psum}
    if outer not in outer_fns:
        raise ValueError(f"unknown outer algorithm {outer!r}; valid: {', '.join(outer_fns)}")
    a = _size(inner_axis)
    flat, size = _flat_padded(x, a)
    shard = ring_reduce_scatter(flat, inner_axis) if a > 1 else flat
    shard = outer_fns[outer](shard, outer_axis)
    full = ring_all_gather(shard, inner_axis) if a > 1 else shard
    return full[:size].reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# global-array wrappers: x[k] is device k's local array, the result [k] is device k's result
# ---------------------------------------------------------------------------------------------
def _axes_tuple(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _check_global(x: jax.Array, mesh: Mesh, axes: tuple[str, ...]) -> None:
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"axis {a!r} is not in the mesh axes {mesh.axis_names}")
    n = math.prod(mesh.shape[a] for a in axes)
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(f"expected a global array of shape ({n}, ...) holding one local array "
                         f"per device of axes {axes}, got shape {x.shape}")


def _per_device(fn: Callable, mesh: Mesh, axes: tuple[str, ...]) -> Callable:
    def body(block):
        return fn(block[0])[None]
    spec = P(axes if len(axes) > 1 else axes[0])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


_ALL_REDUCE: dict[str, Callable] = {
    "ring": ring_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "psum": jax.lax.psum,
}


@functools.lru_cache(maxsize=256)
def _all_reduce_fn(mesh: Mesh, axes: tuple[str, ...], algorithm: str) -> Callable:
    if algorithm == "hierarchical":
        if len(axes) != 2:
            raise ValueError(f"hierarchical all-reduce needs two axes (outer, inner), got {axes}")
        outer_axis, inner_axis = axes
        fn = functools.partial(hierarchical_all_reduce, inner_axis=inner_axis,
                               outer_axis=outer_axis)
    elif algorithm in _ALL_REDUCE:
        fn = functools.partial(_ALL_REDUCE[algorithm], axis_name=axes if len(axes) > 1 else axes[0])
    else:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; valid: "
                         f"{', '.join([*_ALL_REDUCE, 'hierarchical'])}")
    return _per_device(fn, mesh, axes)


def all_reduce_fn(mesh: Mesh, axes: str | Sequence[str], algorithm: str = "ring") -> Callable:
    """A jitted function: global (n, *local) -> (n, *local), each row the sum of all rows.

    `algorithm` is one of "ring", "halving_doubling", "recursive_doubling", "hierarchical"
    (two axes, outer first as in the mesh: `axes=("dp", "fsdp")` reduces inside `fsdp` first) or
    "psum" (the built-in, for reference).
    """
    return _all_reduce_fn(mesh, _axes_tuple(axes), algorithm)


def all_reduce(x: jax.Array, mesh: Mesh, axes: str | Sequence[str],
               algorithm: str = "ring") -> jax.Array:
    """Sum the n local arrays `x[k]` with a hand-written algorithm; see `all_reduce_fn`."""
    axes = _axes_tuple(axes)
    _check_global(x, mesh, axes)
    return all_reduce_fn(mesh, axes, algorithm)(x)


@functools.lru_cache(maxsize=64)
def _ring_fn(kind: str, mesh: Mesh, axis: str) -> Callable:
    fn = ring_reduce_scatter if kind == "reduce_scatter" else ring_all_gather
    return _per_device(functools.partial(fn, axis_name=axis), mesh, (axis,))


def reduce_scatter(x: jax.Array, mesh: Mesh, axis: str) -> jax.Array:
    """Ring reduce-scatter of the n local arrays `x[k]` (leading local dim divisible by n)."""
    _check_global(x, mesh, (axis,))
    return _ring_fn("reduce_scatter", mesh, axis)(x)


def all_gather(x: jax.Array, mesh: Mesh, axis: str) -> jax.Array:
    """Ring all-gather of the n local arrays `x[k]`: every row of the result is their concat."""
    _check_global(x, mesh, (axis,))
    return _ring_fn("all_gather", mesh, axis)(x)
