"""The step's masking for `plan.prune` (`prune/__init__.py` holds the plan side): what
`plan.prune` names and which leaves it masks, the target sparsity after t updates, one weight's
keep-mask, and `pruner`, the hook after the optimizer update that masks every pruned weight on
its own shards (one all-gather of a split matrix for a magnitude sort, none for N:M)."""
from __future__ import annotations

import math
import re

from jaxscale.axes import MESH_AXES, entry_axes
from jaxscale.strategies.tables.params import STACKED, contracted_axes, is_lookup


def parse(value: str):
    """`none` -> None, `magnitude` -> ("magnitude",), `N:M` -> ("nm", N, M); else ValueError."""
    if value == "none":
        return None
    if value == "magnitude":
        return ("magnitude",)
    m = re.fullmatch(r"(\d+):(\d+)", value)
    if m and 0 < int(m.group(1)) < int(m.group(2)):
        return ("nm", int(m.group(1)), int(m.group(2)))
    raise ValueError(f"plan.prune={value!r}: valid are none, magnitude or N:M with 0 < N < M "
                     f"(e.g. 2:4)")


def group_keep(prune: str, names) -> dict[int, int] | None:
    """{the innermost contracted dimension: M} of a weight with logical `names` under N:M
    pruning (a split of that dimension must leave whole groups of M on each device: what ZeRO's
    choice of dimension keeps, `zero.shard_entries`), else None."""
    try:
        kind = parse(prune)
    except ValueError:
        return None
    axes = contracted_axes(tuple(names)) if kind and kind[0] == "nm" else None
    return None if axes is None else {axes[-1]: kind[2]}


def is_pruned(path, names) -> bool:
    """A parameter (its key path, or the planner leaf's path split at "/"; its logical names)
    that pruning masks."""
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    return (keys[:1] == ["layers"] and "router" not in keys
            and contracted_axes(tuple(names)) is not None and not is_lookup(tuple(names)))


def _own_split(names, entries, sizes) -> tuple[str, ...]:
    """Mesh axes (size > 1, mesh order) splitting a weight's own, non-stacked dimensions."""
    used = {a for n, e in zip(names, entries) if n not in STACKED for a in entry_axes(e)}
    return tuple(a for a in MESH_AXES if a in used and sizes.get(a, 1) > 1)


def target_sparsity(spec, step):
    """s(t) for magnitude pruning after `step` updates (traced), 0 before `prune_start`."""
    import jax.numpy as jnp

    from jaxscale.strategies.prune.masks import sparsity_ramp
    if spec.prune_end > spec.prune_start:
        return sparsity_ramp(step, spec.prune_start, spec.prune_end, spec.prune_sparsity)
    return jnp.where(jnp.asarray(step) >= spec.prune_start, spec.prune_sparsity, 0.0)


def mask(w, names, kind, sparsity=None):
    """The keep-mask of one weight: magnitude at (traced) `sparsity`, or N:M."""
    from jaxscale.strategies.prune.masks import magnitude_mask, nm_mask
    if kind[0] == "magnitude":
        return magnitude_mask(w, names, sparsity)
    _, n, m = kind
    return nm_mask(w, names, n, m)


def _local_mask(w, names, kind, s, entries, axes, sizes):
    """Inside `shard_map`: the keep-mask of this device's block `w` of a weight whose own
    dimensions are split over `axes`. N:M: the block's own mask (groups never straddle shards).
    Magnitude: the whole matrix gathered (one all-gather over `axes`), masked, and this
    device's block sliced back out."""
    import jax
    import jax.numpy as jnp
    if kind[0] == "nm" or not axes:
        return mask(w, names, kind, s)
    full = jax.lax.all_gather(w, axes, axis=0, tiled=False)      # [n, *block]
    full = full.reshape(tuple(sizes[a] for a in axes) + w.shape)  # [s_a1, .., *block]
    perm, shape, starts = [], [], []
    for d, e in enumerate(entries):
        mine = [a for a in entry_axes(e) if a in axes]          # major to minor
        perm += [axes.index(a) for a in mine] + [len(axes) + d]
        shape.append(w.shape[d] * math.prod(sizes[a] for a in mine))
        idx = jnp.int32(0)
        for a in mine:
            idx = idx * sizes[a] + jax.lax.axis_index(a)
        starts.append(idx * w.shape[d])
    keep = mask(jnp.transpose(full, perm).reshape(shape), names, kind, s)
    return jax.lax.dynamic_slice(keep, starts, w.shape)


def pruner(spec, logical, mesh=None, target_specs=None):
    """(params, step) -> params with every pruned weight masked for `step` updates done: the
    step's hook after the optimizer update. With `mesh` and `target_specs` (the mesh specs of
    the pruned tree), each weight is masked inside `jax.shard_map` on its own shards
    (`_local_mask`), so that the communication is exactly `collectives(spec)`. `params` may be
    a piece of the tree (`None` where a leaf is not in it) whose stacked weights are one layer
    (offload's streamed update)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxscale.axes import current
    kind = parse(spec.prune)

    def prune(params, step):
        s = target_sparsity(spec, step) if kind[0] == "magnitude" else jnp.float32(0)
        on = jnp.asarray(step) >= spec.prune_start
        # the mesh of the code being traced: inside a region manual over some axes (local SGD's
        # replicas over dp), the weights are that region's, split over the others
        here = current(mesh, None)[0] if mesh is not None else None
        sizes = dict(here.shape) if here is not None else {}

        def one(path, names, w, ps):
            names = tuple(names)
            if w is None or not is_pruned(path, names):
                return w
            entries = tuple(ps) + (None,) * (len(names) - len(ps))
            if w.ndim == len(names) - 1:        # one layer of a stacked weight (offload's stream)
                names, entries = names[1:], entries[1:]
            if here is None:
                keep = mask(w, names, kind, s)
            else:
                axes = _own_split(names, entries, sizes)
                keep = jax.shard_map(
                    lambda w_, s_: _local_mask(w_, names, kind, s_, entries, axes, sizes),
                    mesh=here, in_specs=(P(*entries), P()), out_specs=P(*entries),
                    check_vma=False)(w, s)
            if kind[0] == "nm":
                keep = keep | ~on
            return w * keep.astype(w.dtype)
        specs = target_specs if target_specs is not None else jax.tree.map(
            lambda _: P(), logical, is_leaf=lambda x: isinstance(x, P))
        return jax.tree_util.tree_map_with_path(one, logical, params, specs,
                                                is_leaf=lambda x: isinstance(x, P))
    return prune
