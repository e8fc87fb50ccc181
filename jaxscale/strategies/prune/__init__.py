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
The step side (target sparsity, masks, the sharded hook) is `prune/masking.py`.
Memory (`memory`): the unmasked copy of the pruned weights a device holds, and under magnitude
pruning the split matrices gathered whole for their sort (the sort itself runs in place).
"""
from __future__ import annotations

import math

from jaxscale.axes import entry_axes
from jaxscale.strategies import zero
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.prune.masking import (  # noqa: F401
    _own_split,
    group_keep,
    is_pruned,
    parse,
)
from jaxscale.strategies.tables.params import STACKED, contracted_axes, leaves

NAME = "prune"
AVAILABLE = True


def active(spec) -> bool:
    return spec.prune != "none"


def is_pruned_leaf(leaf) -> bool:
    """A planner leaf that is pruned, by the step's rule (`masking.is_pruned`): the matmul
    weights under `layers/`."""
    return is_pruned(leaf.path.split("/"), tuple(leaf.axes))


def pruned_leaves(model) -> list:
    """The planner's leaves that are pruned (`is_pruned_leaf`)."""
    return [leaf for leaf in leaves(model) if is_pruned_leaf(leaf)]


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
        return zero.shard_spec(model, leaf.shape, spec.degrees, z, keep=leaf_keep(spec, leaf))
    return model


def keep(spec, names) -> dict[int, int] | None:
    """What ZeRO-1/2's split of a pruned weight keeps whole (`group_keep`): N:M's groups along
    its input features, so that each dp shard masks its own groups. ZeRO-3's dp dimension is the
    one every gather of the weights reads (`zero.shard_entries` without it), so there `problems`
    refuses a split that cuts the groups."""
    return group_keep(spec.prune, names) if zero.stage(spec) in (1, 2) else None


def leaf_keep(spec, leaf) -> dict[int, int] | None:
    """`keep` of a planner leaf (None for one pruning leaves alone): what the planner's ZeRO
    entries of the leaf pass, as the step's `state_keep` does for the same parameter."""
    return keep(spec, leaf.axes) if active(spec) and is_pruned_leaf(leaf) else None


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
    item = 4 if spec.mixed else spec.held_param_itemsize
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
    what the update targets (the fp32 master where there is one); under ZeRO-1/2 with N:M, the
    dp split of each pruned weight keeps its groups whole (`state_keep`, from `keep`)."""
    if active(spec):
        from jaxscale.strategies.prune.masking import pruner
        parts.set("state_keep", lambda path, names: keep(spec, tuple(names))
                  if is_pruned(path, tuple(names)) else None, by=NAME)
        parts.set("after_update", lambda ctx: pruner(
            spec, ctx.model.logical, ctx.placement.mesh,
            ctx.lay.specs.shards if zero.stage(spec) or ctx.lay.master
            else ctx.lay.specs.params), by=NAME)


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
