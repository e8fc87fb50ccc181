"""Streaming DiLoCo's fragments (arXiv 2501.18512): the model cut into F parts that are averaged
at staggered steps, each once every H steps, so a step moves at most one part's bytes.

Fragment p holds the layers p, p + F, p + 2F, ... (strided, as the paper chooses: neighbouring
layers are not averaged together); of the leaves outside the layers the embedding goes to
fragment 0, the final norm and the head to fragment F - 1. F need not divide the layers: with
n = qF + r layers the first r fragments hold q + 1 of them, the others q (5 layers in 2
fragments: layers 0, 2, 4 and 1, 3). A layer-stacked leaf [n, ...] gives fragment p its rows
p::F. Under a pipeline the stacked axis is split over pp into S blocks of m stored rows, and the
stride runs inside each block: fragment p holds the rows p, p + F, ... < m of every stage
([S, m, ...][:, p::F], so the split stays local and every stage holds a share of every
fragment) wherever that is the model's stride (each stored row's layer = its row mod F). Where
it is not (uneven stages, interleaved chunks, even stages of rows not a multiple of F: the stage
layout's `stages.layer_order`), fragment p takes, from each block, the rows whose layer is p mod
F, as many slots per block as the block with the most (a gather along the rows, local to each
stage; a block's spare slots are empty and dropped on the way back): any layout averages the
same layers together as one device does, and moves at most a block's spare slots more.

Fragment p is averaged after the inner steps c = o_p, o_p + H, o_p + 2H, ... with the offset
o_p = p H // F (fragments with the same offset, when F > H, go together: one group). With F = 1
it is DiLoCo's schedule; at H = 1 every fragment is averaged at every step. Uneven fragments
make uneven averages: the peak a step puts on the link is the largest group's.

The formula side (`group_shapes`) reads the same assignment from the parameter table
(`jaxscale.strategies.tables.params`), so the census can be held to it, group by group.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

STRIDED = -1         # a layer-stacked leaf: every fragment holds its rows p::F


def owner(path: str, stacked: bool, F: int) -> int:
    """The fragment of a leaf by its path ("embed", "layers/attn/wq", "layers/3/mlp/w_up",
    "norm/scale", "head"): STRIDED for a stacked leaf, a fragment number otherwise."""
    if F == 1:
        return 0
    if stacked:
        return STRIDED
    m = re.match(r"layers/(\d+)/", path)
    if m:
        return int(m.group(1)) % F
    return 0 if path.startswith("embed") else F - 1


def offsets(F: int, H: int) -> list[int]:
    """Each fragment's offset in the period: o_p = p H // F."""
    return [p * H // F for p in range(F)]


def groups(F: int, H: int) -> list[tuple[int, ...]]:
    """The fragments averaged together, in the order of their offsets (one `lax.switch` branch
    each)."""
    offs = offsets(F, H)
    return [tuple(p for p in range(F) if offs[p] == o) for o in sorted(set(offs))]


def branch_table(F: int, H: int) -> list[int]:
    """For each residue r = c mod H of the inner-step count c: 0 (no fragment averaged) or 1 +
    the index of the group averaged after it."""
    out = [0] * H
    for g, frags in enumerate(groups(F, H)):
        out[offsets(F, H)[frags[0]] % H] = 1 + g
    return out


def schedule(F: int, H: int, steps: int, delay: int = 0, warmup: int = 0) -> list[int]:
    """The branch each of the first `steps` steps takes (the step's `stream_parts.branch`): 0,
    1 + the group it averages, or 1 + the groups for post_local's synchronous warmup steps.
    Delayed, the average after inner-step count c is taken by step c."""
    table, out = branch_table(F, H), []
    for s in range(steps):
        c = s + 1 - delay - warmup
        out.append(len(groups(F, H)) + 1 if s < warmup else table[c % H] if c >= 1 else 0)
    return out


def rows(m: int, p: int, F: int) -> int:
    """How many of a block's m stacked rows fragment p holds: those r < m with r = p mod F."""
    return len(range(p, m, F))


def selection(order, stages: int, F: int) -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    """For each fragment p, each block's rows whose layer is p mod F (`order`: stored row ->
    model layer, -1 padding, `stages.stored_order`); None where the blocks' stride p::F is that
    already (then padding rows go with their stride): a block's rows a multiple of F, or one
    block. (Even stages of m rows, m not a multiple of F, are not: 2 layers on pp2 in F = 2
    put layer 1 in row 0 of its block, fragment 1's, not the stride's 0.)"""
    if F == 1:
        return None
    m = len(order) // stages
    if all(layer % F == (r % m) % F for r, layer in enumerate(order) if layer >= 0):
        return None
    return tuple(tuple(tuple(r for r in range(m) if 0 <= order[s * m + r]
                             and order[s * m + r] % F == p) for s in range(stages))
                 for p in range(F))


def part_shape(shape, o: int, F: int, p: int, stages: int = 1, sel=None) -> tuple[int, ...]:
    """The shape of fragment p's part of a leaf of this shape and owner (`Cut`'s `take`): a
    stacked leaf's rows p::F of each of its `stages` blocks, or `selection`'s slots."""
    if o != STRIDED:
        return tuple(shape)
    k = rows(shape[0] // stages, p, F) if sel is None else max(map(len, sel[p]))
    return (stages * k,) + tuple(shape[1:])


def group_shapes(spec) -> list[list[tuple[int, ...]]]:
    """Each group's parts as a device holds them (its shards of every leaf part, a stacked
    leaf's rows p::F of the rows it stores), in the order of `groups`: what one average of that
    group takes (with F = 1 one group, every leaf whole)."""
    from jaxscale.strategies.pp.stages import stored_order
    from jaxscale.strategies.tables.params import leaves
    F, H = spec.outer_fragments, max(1, spec.local_steps)
    sel = selection(stored_order(spec), spec.deg("pp"), F)
    per: list[list] = [[] for _ in range(F)]
    for leaf in leaves(spec.model):
        shape, o = leaf.local_shape(spec), owner(leaf.path, leaf.stacked, F)
        for p in (range(F) if o == STRIDED else [o]):
            per[p].append(part_shape(shape, o, F, p, sel=sel))   # one device's block
    return [[s for p in g for s in per[p]] for g in groups(F, H)]


def group_parts(spec, params, where) -> list[tuple]:
    """(its parts, as ShapeDtypeStructs, and (their specs, axis sizes)) for each fragment group:
    what the group's compression state is initialised for."""
    import jax
    from jax.sharding import PartitionSpec as P
    F, H = spec.outer_fragments, max(1, spec.local_steps)
    specs, sizes = where
    cut = Cut.of(params, F, spec.deg("pp"), spec)
    leaves_ = jax.tree.leaves(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    out = []
    for frags in groups(F, H):
        members = cut.members(frags)
        parts = [jax.ShapeDtypeStruct(part_shape(leaves_[j].shape, cut.owners[j], F, p,
                                                 cut.stages, cut.sel), leaves_[j].dtype)
                 for j, p in members]
        out.append((parts, ([spec_leaves[j] for j, _ in members], sizes)))
    return out


@dataclass(frozen=True)
class Cut:
    """The runtime side: each flattened parameter leaf's owner, and the fragments' parts of a
    list of leaves (the parameters' order); `stages`: the blocks a stacked leaf's rows are split
    in (pp's), each cut alike, by stride or by `sel` (`selection`)."""
    F: int
    owners: tuple[int, ...]
    stages: int = 1
    sel: tuple | None = None

    @classmethod
    def of(cls, params, F: int, stages: int = 1, spec=None) -> Cut:
        """The cut of a parameter tree, from its paths: a leaf under "layers/" without a layer
        number is a layer stack (the model's "layers" logical axis); `spec`: the plan whose
        pipeline stores the rows (`stages.stored_order`; without one the rows are the model's
        layers in order)."""
        import jax

        from jaxscale.strategies.pp.stages import stored_order
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
        owners = tuple(owner(path, path.startswith("layers/")
                             and not re.match(r"layers/\d+/", path), F) for path in paths)
        rows_ = next((x.shape[0] for (_, x), o in zip(flat, owners) if o == STRIDED), 0)
        order = stored_order(spec) if spec is not None else list(range(rows_))
        return cls(F, owners, max(1, stages), selection(order, max(1, stages), F))

    def members(self, frags) -> list[tuple[int, int]]:
        """(leaf number, fragment) of every part the fragments `frags` hold."""
        return [(j, p) for p in frags for j, o in enumerate(self.owners)
                if o == p or o == STRIDED]

    def take(self, leaves, frags) -> list:
        """The parts of `leaves` that fragments `frags` hold, in `members` order."""
        return [self._part(leaves[j], j, p) for j, p in self.members(frags)]

    def put(self, leaves, frags, parts) -> list:
        """`leaves` with the fragments' parts replaced by `parts` (`members` order)."""
        out = list(leaves)
        for (j, p), part in zip(self.members(frags), parts):
            if self.owners[j] != STRIDED:
                out[j] = part.astype(out[j].dtype)
                continue
            x, S = out[j], self.stages
            blocks = x.reshape((S, x.shape[0] // S) + x.shape[1:])
            part = part.reshape((S, -1) + x.shape[1:]).astype(x.dtype)
            if self.sel is None:
                out[j] = blocks.at[:, p::self.F].set(part).reshape(x.shape)
                continue
            back, keep = self._back(p, blocks.shape[1], x.ndim)
            out[j] = jnp.where(keep, jnp.take_along_axis(part, back, axis=1),
                               blocks).reshape(x.shape)
        return out

    def merge(self, rep, anchor, frags, alpha: float) -> list:
        """The replica's leaves `rep` with the fragments' parts restarted from the anchor's:
        alpha x the replica's own + (1 - alpha) x the anchor's, in fp32 (alpha 0: replaced)."""
        new = [x.astype("float32") for x in self.take(anchor, frags)]
        if alpha:
            new = [alpha * o + (1 - alpha) * x for o, x in zip(self.take(rep, frags), new)]
        return self.put(rep, frags, new)

    def _part(self, x, j, p):
        if self.owners[j] != STRIDED:
            return x
        S = self.stages
        blocks = x.reshape((S, x.shape[0] // S) + x.shape[1:])
        if self.sel is None:
            part = blocks[:, p::self.F]
        else:                   # each block's rows of the fragment, spare slots empty (zeros)
            k, tail = max(map(len, self.sel[p])), (1,) * (x.ndim - 1)
            idx = np.array([list(r) + [blocks.shape[1]] * (k - len(r)) for r in self.sel[p]])
            part = jnp.take_along_axis(blocks, idx.reshape(idx.shape + tail), axis=1,
                                       mode="fill", fill_value=0)
        return part.reshape((-1,) + x.shape[1:])

    def _back(self, p, m, ndim):
        """(each block row's slot in fragment p's part, whether the row is the fragment's), as
        arrays that broadcast against the blocks [S, m, ...]."""
        back, keep = np.zeros((self.stages, m), np.int32), np.zeros((self.stages, m), bool)
        for s, rows_ in enumerate(self.sel[p]):
            for slot, r in enumerate(rows_):
                back[s, r], keep[s, r] = slot, True
        tail = (1,) * (ndim - 1)
        return back.reshape(back.shape + tail), keep.reshape(keep.shape + tail)
