"""The model's weights by their logical names, for functions that compile once per model.

`Logical` holds a tree of logical axis names (`FunctionalModel.logical`) in a hashable form, a
static argument of `jax.jit`; `map_weights` applies a function to every weight of a params tree
(the leaves `tables.params.contracted_axes` calls weights: not norm scales). Weight-only
quantisation (`qat/ptq.py`) and pruning masks (`prune/masks.py`) are built on them.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxscale.strategies.tables.params import contracted_axes


def names_of(partition) -> tuple:
    """A leaf of the logical tree (a PartitionSpec of logical names) as a tuple."""
    return tuple(partition)


def is_names(x) -> bool:
    return isinstance(x, (P, tuple))


class Logical:
    """The logical-names tree in a hashable form, so that the functions over weights compile
    once per model (a static argument of `jax.jit`) instead of running op by op."""

    def __init__(self, logical):
        leaves, self.tdef = jax.tree.flatten(logical, is_leaf=is_names)
        self.key = (self.tdef, tuple(names_of(x) for x in leaves))

    def tree(self):
        return jax.tree.unflatten(self.tdef, list(self.key[1]))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Logical) and self.key == other.key


def map_weights(fn, params, logical, rest=lambda x: x):
    """fn(w, names, path) on every weight, `rest` on every other leaf."""
    def one(path, names, w):
        names = names_of(names)
        return rest(w) if contracted_axes(names) is None else fn(w, names, path)
    return jax.tree_util.tree_map_with_path(one, logical, params, is_leaf=is_names)
