"""Pruning during training: the block matmul weights multiplied by a mask after every update.

`plan.prune=magnitude` (with `plan.prune_sparsity` s, `plan.prune_start`, `plan.prune_end`) or
`plan.prune=N:M` (e.g. `2:4`). Which weights: the matmul weights of the transformer blocks (wq,
wk, wv, wo, w_gate, w_up, w_down; a mixture of experts' expert matrices too), each stacked
index (layer, expert) its own matrix. Not pruned: the embedding table (a lookup), the LM head
(vocabulary logits; sparse matmul units would not pay there and it is not a block weight), the
RMSNorm scales and a MoE router (`tables.params.leaves`: the `dot` leaves under `layers/`).

The step (`shape_step`, its `after_update` part): after the optimizer update, the new weights (the
fp32 master when there is one, then the 16-bit working copy is cast from the pruned master) are
multiplied by a mask recomputed from those weights, so that after every step the sparsity holds
exactly:
- magnitude: the k = round(s(t) x size) smallest |w| of each matrix are zeroed (ties broken by
  position, `masks.py`), s(t) the cubic ramp of Zhu & Gupta (`masks.sparsity_ramp`) from 0 at update
  `prune_start` to s at update `prune_end` (t counts the updates done, the new `state.step`;
  `prune_end=0`: s from `prune_start` on);
- N:M: in every M consecutive weights along the innermost contracted axis (the input features:
  `tables.params.contracted_axes`) the M - N smallest |w| are zeroed (from update `prune_start` on).
The mask is recomputed every step from the weights themselves and is not stored: a weight zeroed
last step that the optimizer moves past a kept one comes back (gradual magnitude pruning with
regrowth), the train state and its checkpoints are unchanged and a resumed run prunes exactly as
the uninterrupted one. Saves: nothing by itself in XLA (the zeros are stored and multiplied; the
saving is for sparse kernels, 2:4 on sparse tensor cores, and for a compressed export). Costs: a
sort per matrix per step (N:M: a sort of M values per group, local) and the collectives below.

Sharded plans: the mask is computed with jnp on the global (sharded) array under jit. A magnitude
top-k over a matrix split across devices needs the whole matrix's |w|: XLA gathers each sharded
block weight for the sort (an all-gather of its shards over the axes that split it, `collectives`
below: the extra communication of per-tensor magnitude pruning under fsdp / tp / ZeRO). N:M
groups never straddle shards: `problems` requires the group axis's per-device size to be a
multiple of M, so N:M masks are shard-local and add no collective.
With offload, the streamed update masks each layer as it passes through the device; with local
SGD, each replica is masked after its inner update and the anchor after each average (the
average of masked replicas is not itself sparse).
Memory (`memory`): the unmasked copy of the pruned weights a device holds, and under magnitude
pruning the split matrices gathered whole for their sort (the sort itself runs in place).
"""
from __future__ import annotations

import math
import re

from jaxscale.axes import MESH_AXES, entry_axes
from jaxscale.strategies import zero
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.tables.params import STACKED, contracted_axes, is_lookup, leaves

NAME = "prune"
AVAILABLE = True


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


def active(spec) -> bool:
    return spec.prune != "none"


def pruned_leaves(model) -> list:
    """The planner's leaves that are pruned: the matmul (`dot`) weights under `layers/`."""
    return [leaf for leaf in leaves(model) if leaf.use == "dot" and leaf.path.startswith("layers/")]


def _group_axis(axes) -> int:
    return contracted_axes(tuple(axes))[-1]


def problems(spec) -> list[str]:
    if not active(spec):
        return []
    try:
        kind = parse(spec.prune)
    except ValueError as e:
        return [str(e)]
    errs = []
    if not 0.0 <= spec.prune_sparsity < 1.0:
        errs.append(f"plan.prune_sparsity={spec.prune_sparsity} must be in [0, 1) (a fraction of "
                    f"zeros)")
    if spec.prune_end and spec.prune_end <= spec.prune_start:
        errs.append(f"plan.prune_end={spec.prune_end} must be after plan.prune_start="
                    f"{spec.prune_start} (or 0: the target sparsity from prune_start on)")
    if kind[0] == "nm":
        _, n, m = kind
        for leaf in pruned_leaves(spec.model):
            ax = _group_axis(leaf.axes)
            dim, name = leaf.shape[ax], leaf.axes[ax]
            entries = tuple(target_partition(spec, leaf)) + (None,) * len(leaf.shape)
            split = math.prod(spec.deg(a) for a in entry_axes(entries[ax]))
            if dim % m:
                errs.append(f"plan.prune={n}:{m} groups {m} consecutive weights along "
                            f"{leaf.path}'s contracted axis '{name}' (size {dim}), which is not "
                            f"divisible by {m}: use another M or model size")
            elif (dim // split) % m:
                over = ", ".join(entry_axes(entries[ax]))
                errs.append(f"plan.prune={n}:{m}: {leaf.path}'s axis '{name}' (size {dim}) is "
                            f"split {split} ways over the mesh ({over}), leaving "
                            f"{dim / split:g} per device: {m}-groups would straddle shards; use "
                            f"a smaller split of '{name}' or another M")
    return errs


def rules(spec, rules) -> None:
    """Pruning adds no sharding rule."""


def target_partition(spec, leaf):
    """The mesh PartitionSpec of what is pruned for this leaf: where the update ran, the fp32
    master with mixed precision, else the working parameters; under ZeRO (any stage) its dp
    shards, so that the weights are masked before ZeRO-1/2 gather them (masked after, the
    gather ran twice: the weights for the mask and the product, 1.6-2.3x the formula)."""
    model = spec.rules.spec(leaf.axes)
    z = zero.stage(spec)
    if z >= 1:
        return zero.shard_spec(model, leaf.shape, spec.degrees, z)
    return model


def collectives(spec) -> list[Comm]:
    """Magnitude pruning of a matrix split over mesh axes: one all-gather of its shards (its
    dtype: fp32 master or the parameters) over those axes per step, for the per-matrix sort;
    N:M (shard-local groups) and unsplit matrices add nothing."""
    if not active(spec) or parse(spec.prune)[0] != "magnitude":
        return []
    # local SGD masks each replica after its inner update, and the anchor after each average
    per_step = 1 + (1 / max(1, spec.local_steps) if spec.local_sgd != "none" else 0)
    item = 4 if spec.mixed else spec.wire_param_itemsize
    out: dict[tuple, list] = {}
    for leaf in pruned_leaves(spec.model):
        entries, split = _target(spec, leaf)
        axes = _own_split(leaf.axes, entries, spec.degrees)
        if not axes:
            continue
        row = out.setdefault(axes, [0.0, 0])
        row[0] += item * _gathered(leaf, split) * per_step
        row[1] += 1
    return [Comm("all-gather", axes, b, c, "magnitude pruning: each split block weight gathered "
                 "for its per-matrix sort", group=math.prod(spec.deg(a) for a in axes))
            for axes, (b, c) in out.items()]


def memory(spec) -> list[Term]:
    """The step's unmasked copy of the pruned weights a device updates (its shards, in the
    master's dtype or the parameters'), which XLA holds beside the masked result; magnitude
    pruning adds each split matrix gathered whole for its sort (every layer's at once). Both
    are buffers of the update's `lax.cond` branch, which XLA:CPU does not share with the
    backward's: they add to the step's peak in either phase (dp8, fsdp8, dp2 x fsdp2 x tp2:
    the compiled temp grows by exactly these bytes). Offload's streamed update masks each
    piece as it passes (its piece's term holds it)."""
    if not active(spec) or spec.offload != "none":
        return []
    item = 4 if spec.mixed else spec.wire_param_itemsize
    rows = spec.stored_layers * spec.deg("pp")            # uneven stages' padding rows too
    own = gathered = 0.0
    for leaf in pruned_leaves(spec.model):
        entries, split = _target(spec, leaf)
        own += math.prod((rows if n == "layers" else d) / k
                         for d, n, k in zip(leaf.shape, leaf.axes, split))
        if parse(spec.prune)[0] == "magnitude" and _own_split(leaf.axes, entries, spec.degrees):
            gathered += _gathered(leaf, split)
    what = "pruning: the unmasked weights" + (" and the split ones gathered whole" * bool(gathered))
    return [Term(row, item * (own + gathered), what) for row in ("backward", "update")]


def label(spec) -> list[str]:
    if not active(spec):
        return []
    return [f"prune-{spec.prune}" if spec.prune != "magnitude"
            else f"prune-mag{spec.prune_sparsity:g}"]


# ----------------------------------------------------------------------------- the step side
def shape_step(spec, parts) -> None:
    """The step: the updated weights masked for the updates done (`pruner`), on the shards of
    what the update targets (the fp32 master where there is one)."""
    if active(spec):
        parts.set("after_update", lambda ctx: pruner(
            spec, ctx.model.logical, ctx.placement.mesh,
            ctx.lay.specs.shards if zero.stage(spec) or ctx.lay.master
            else ctx.lay.specs.params), by=NAME)


def is_pruned(path, names) -> bool:
    """A parameter (its key path, its logical names) that pruning masks."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    return (keys[:1] == ["layers"] and "router" not in keys
            and contracted_axes(tuple(names)) is not None and not is_lookup(tuple(names)))


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


def _target(spec, leaf) -> tuple[tuple, list[int]]:
    """The partition entries of the copy of `leaf` the update targets (`target_partition`),
    one per dimension, and how many ways each dimension is split."""
    entries = tuple(target_partition(spec, leaf)) + (None,) * len(leaf.shape)
    return entries, [math.prod(spec.deg(a) for a in entry_axes(e))
                     for e in entries[:len(leaf.shape)]]


def _gathered(leaf, split) -> float:
    """A device's elements of `leaf` with its own (non-stacked) dimensions gathered whole."""
    return math.prod(d if n not in STACKED else d / k
                     for d, n, k in zip(leaf.shape, leaf.axes, split))


def _own_split(names, entries, sizes) -> tuple[str, ...]:
    """Mesh axes (size > 1, mesh order) splitting a weight's own, non-stacked dimensions."""
    used = {a for n, e in zip(names, entries) if n not in STACKED for a in entry_axes(e)}
    return tuple(a for a in MESH_AXES if a in used and sizes.get(a, 1) > 1)


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
