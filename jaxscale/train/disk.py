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

import jax
import jax.numpy as jnp
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
    """Abstract leaves with the stacked layers resized from the stored rows to the model's."""
    if layer_order is None:
        return abstract
    from jaxscale.strategies.pp.stages import fit, is_layers
    n = sum(1 for r in layer_order if r >= 0)

    def one(path, a):
        if not is_layers(path) or a.shape[:1] != (len(layer_order),):
            return a
        shape = (n,) + a.shape[1:]
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=fit(a.sharding, shape))
    return jax.tree_util.tree_map_with_path(one, abstract)


def to_disk(state, vocab_size: int, layer_order: list[int] | None = None):
    """`state` with its vocabulary trimmed to `vocab_size` and its layers in the model's order
    (what a checkpoint saves)."""
    from jaxscale.strategies.pp.stages import reorder
    state = reorder(state, layer_order, None)
    padded = padded_size(state)
    if padded is None or padded == vocab_size:
        return state
    target = disk_abstract(jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state),
        vocab_size)

    def trim(tree):
        return jax.tree_util.tree_map_with_path(
            lambda path, a: a if (d := _dim(path, a.shape, padded)) is None
            else jax.lax.slice_in_dim(a, 0, vocab_size, axis=d), tree)
    return jax.jit(trim, out_shardings=jax.tree.map(lambda a: a.sharding, target))(state)


def from_disk(state, abstract_state, layer_order: list[int] | None = None):
    """A restored `state` (at the true vocabulary, the layers in the model's order) padded with
    zeros to `abstract_state`'s shapes, its layers in `layer_order`, laid out as it says."""
    from jaxscale.strategies.pp.stages import reorder
    state = reorder(state, None, layer_order)
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
