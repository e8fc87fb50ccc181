"""The train state as checkpoints hold it: the model's true vocabulary, its layers in order.

A plan pads the embedding's rows and the LM head's columns to a multiple of its tensor-parallel
degree (`ModelConfig.vocab_multiple`, raised by `plan.Spec`), so the padding depends on the mesh.
A checkpoint keeps the true `model.vocab_size`: `to_disk` trims the padding before a save,
`from_disk` pads it back with zeros after a restore (`disk_abstract` is the restore target), so
a checkpoint restores onto any mesh and exports at the size it was trained at. The leaves trimmed
are every array under an `embed` or `head` key of the state (the parameters, the fp32 master, the
optimizer's moments, local SGD's replicas): the embedding's first dimension of the padded size,
the head's last. A trimmed array is whole along the vocabulary (a split there would not divide
it); nothing else of its layout changes. Without padding all three are the identity.

Likewise the stacked layers: a pipeline stores them in its own order, uneven stages with padding
rows (`jaxscale.strategies.pp.stages.layer_order`); a checkpoint holds them in the model's order
without padding, so it restores under any stage layout, schedule or pp (`layer_order` below:
the plan's stored order, None for the model's).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _key(path) -> str | None:
    names = [getattr(k, "key", None) for k in path]
    return next((n for n in names if n in ("embed", "head")), None)


def padded_size(tree) -> int | None:
    """The padded vocabulary: the embedding's rows in `tree` (a train state), or None."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if _key(path) == "embed" and getattr(leaf, "ndim", 0) == 2:
            return int(leaf.shape[0])
    return None


def _dim(path, shape, padded: int) -> int | None:
    """The vocabulary dimension of a leaf: the embedding's first of the padded size, the head's
    last (a replica's leading axis may come before)."""
    which = _key(path)
    dims = [d for d, n in enumerate(shape) if n == padded]
    if which is None or not dims:
        return None
    return dims[0] if which == "embed" else dims[-1]


def _whole_along(sharding, dim: int, ndim: int):
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    spec[dim] = None
    return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)


def disk_abstract(abstract_state, vocab_size: int, layer_order: list[int] | None = None):
    """The restore target: `abstract_state` with the vocabulary at `vocab_size`, the layers in
    the model's order."""
    abstract_state = _model_layers(abstract_state, layer_order)
    padded = padded_size(abstract_state)
    if padded is None or padded == vocab_size:
        return abstract_state

    def one(path, a):
        d = _dim(path, a.shape, padded)
        if d is None:
            return a
        shape = a.shape[:d] + (vocab_size,) + a.shape[d + 1:]
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=_whole_along(a.sharding, d, a.ndim))
    return jax.tree_util.tree_map_with_path(one, abstract_state)


def _model_layers(abstract, layer_order):
    """Abstract leaves with the stacked layers resized from the stored rows to the model's (as
    `layers_moved` moves them)."""
    if layer_order is None:
        return abstract
    from jaxscale.strategies.pp.stages import fit
    shapes = jax.eval_shape(lambda: layers_moved(
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), layer_order, None))
    return jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=fit(a.sharding, s.shape)), shapes, abstract)


def layers_moved(state, saved, wanted):
    """A train state (or a parameter tree) with its stacked layers moved from the stored order
    `saved` to `wanted` (`strategies.pp.stages.reorder`): the parameters, master weights and
    optimizer moments along their first axis, local SGD's replicas (`comm`: [dp, ...]) along
    their second; a per-device state (compression's, [devices, ...]) is local shards, left as
    it is."""
    from jaxscale.strategies.pp.stages import reorder
    if saved == wanted:
        return state
    if not hasattr(state, "params"):
        return reorder(state, saved, wanted)
    import dataclasses
    changes = {f: reorder(getattr(state, f), saved, wanted)
               for f in ("params", "master", "opt_state")}
    comm = state.comm
    if isinstance(comm, dict) and "params" in comm:
        comm = {**comm, **{k: reorder(comm[k], saved, wanted, axis=1)
                           for k in ("params", "opt_state") if k in comm}}
    return dataclasses.replace(state, comm=comm, **changes)


def to_disk(state, vocab_size: int, layer_order: list[int] | None = None):
    """`state` with its vocabulary trimmed to `vocab_size` and its layers in the model's order
    (what a checkpoint saves). Host (numpy) leaves are moved and trimmed in numpy."""
    state = layers_moved(state, layer_order, None)
    padded = padded_size(state)
    if padded is None or padded == vocab_size:
        return state
    target = disk_abstract(jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=getattr(a, "sharding", None)), state), vocab_size)

    def trim(path, a, want):
        d = _dim(path, a.shape, padded)
        if d is None:
            return a
        if isinstance(a, np.ndarray):           # on the host: numpy's own
            return np.take(a, np.arange(vocab_size), axis=d)
        return _trimmer(d, vocab_size, want.sharding)(a)
    return jax.tree_util.tree_map_with_path(trim, state, target)


@functools.lru_cache(maxsize=256)
def _trimmer(dim: int, size: int, sharding):
    """The compiled trim of an eager array's vocabulary, one per (dimension, sharding)."""
    return jax.jit(lambda a: jax.lax.slice_in_dim(a, 0, size, axis=dim), out_shardings=sharding)


def from_disk(state, abstract_state, layer_order: list[int] | None = None):
    """A restored `state` (at the true vocabulary, the layers in the model's order) padded with
    zeros to `abstract_state`'s shapes, its layers in `layer_order`, laid out as it says."""
    state = layers_moved(state, None, layer_order)
    shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
    padded = padded_size(abstract_state)
    if padded is None or padded_size(state) == padded:
        return state if layer_order is None else jax.device_put(state, shardings)

    def pad(tree):
        def one(path, a, like):
            d = _dim(path, like.shape, padded)
            if d is None:
                return a
            width = [(0, 0)] * a.ndim
            width[d] = (0, padded - a.shape[d])
            return jnp.pad(a, width)
        return jax.tree_util.tree_map_with_path(one, tree, abstract_state)
    return jax.jit(pad, out_shardings=shardings)(state)
