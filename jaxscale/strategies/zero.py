"""ZeRO stages over the data-parallel `dp` axis (arXiv 1910.02054).

| stage | sharded over dp                    | model state bytes/param (mixed-precision Adam) |
|-------|------------------------------------|------------------------------------------------|
| 0     | nothing (plain DP)                 | 16                                             |
| 1     | optimizer moments + fp32 master    | 4 + 12/N                                       |
| 2     | + gradients (kept sharded)         | 2 + 14/N                                       |
| 3     | + working parameters (= FSDP)      | 16/N                                           |

Each sharded tensor is split over `dp` on one dimension: the one FSDP already shards, else the
first unsharded dimension that `dp` divides; a tensor with no such dimension stays replicated
(norm scales of odd sizes, say). A dimension another strategy needs in whole groups per device
(`keep`: N:M pruning's groups along a weight's input features, `prune.masking.group_keep`) is
split only where each shard still holds whole groups, else the next dimension is taken. On
the fsdp dimension stages 1 and 2 nest the axes as ('fsdp', 'dp'): dp splits each fsdp shard,
so a device's ZeRO piece is a slice of the fsdp-major gradients and parameters it already
holds, and the new parameters' gather over dp lands in fsdp's layout, with no re-layout (nested
the other way, XLA moved every such value with a collective-permute over (dp, fsdp): up to
714 KB per step on the tiny 2x2x2 mesh). Stage 3 keeps ('dp', 'fsdp'), the order FSDP gathers
over and the batch is split in.
Saves: the state above, per device. Costs, in collectives per step: stage 1 all-reduces
gradients (2 Psi), updates its shard and all-gathers the new parameters (Psi); stage 2
reduce-scatters gradients (Psi) and all-gathers parameters (Psi): 2 Psi; stage 3 all-gathers
parameters in forward and backward and reduce-scatters gradients: 3 Psi (the gathers are FSDP's,
over (dp, fsdp): `fsdp.py`; the gradient reduction is the data axes', `strategies/dp`). XLA
may turn stage 1's all-reduce + slice into a reduce-scatter itself.

In the step (`shape_step`): `state_specs` gives each part of the train state its layout;
gradients take the sharded layout from stage 2 (`StateSpecs.grads`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxscale.axes import MESH_AXES, entry_axes
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.tables.params import leaves

NAME = "zero"
AVAILABLE = True
AXIS = "dp"
#: the first stage that shards each part of the state over dp
STAGE_OF = {"optimizer": 1, "master": 1, "grads": 2, "params": 3}


def gather_axes(spec) -> tuple[str, ...]:
    """Mesh axes the parameters are gathered over for compute: fsdp, and dp under ZeRO-3."""
    names = ["fsdp"] if spec.deg("fsdp") > 1 else []
    if spec.zero >= 3 and spec.deg("dp") > 1:
        names.insert(0, "dp")
    return tuple(names)


def stored_spec(spec, leaf) -> tuple:
    """The mesh axes of each dimension of a parameter as the state stores it (the rules, and
    ZeRO-3's dp split on top), as a tuple of entries (no JAX needed)."""
    table = spec.rules.table
    entries, used = [], set()
    for ax in leaf.axes:
        got = tuple(m for m in table.get(ax, ()) if m not in used and spec.deg(m) > 1)
        used.update(got)
        entries.append(got or None)
    if stage(spec) < 3:
        return tuple(entries)
    return tuple(shard_entries(entries, leaf.shape, {a: spec.deg(a) for a in MESH_AXES}, 3))


def stored_size(spec, leaf, drop: tuple[str, ...] = ()) -> float:
    """Elements per device of a parameter as the state stores it (`stored_spec`; `drop`: mesh
    axes treated as gathered)."""
    return float(math.prod(
        math.ceil(dim / math.prod(spec.deg(a) for a in entry_axes(e) if a not in drop))
        for dim, e in zip(leaf.shape, stored_spec(spec, leaf))))


def stage(spec) -> int:
    """The stage in force: ZeRO needs dp > 1 (fsdp already shards everything)."""
    return spec.zero if spec.deg(AXIS) > 1 else 0


def grad_buffer(spec) -> float:
    """Bytes of the stacked local gradient buffer as the step holds it: reduced layer by layer
    inside the layer loop (so kept at its reduced shard) when the weights are gathered (FSDP,
    ZeRO-3), else full until the end."""
    sh = shards(spec)
    return (sh.grads if gather_axes(spec) else sh.params) * spec.held_param_itemsize


def stored_layer_bytes(spec, itemsize: int | None = None) -> float:
    """One stored layer's parameters on this device as the step holds them (its rows of the
    stacked layers; a weight-sized buffer the planner's terms count in layers), at `itemsize`
    bytes an element (default `held_param_itemsize`)."""
    return sum(leaf.local_size(spec) for leaf in leaves(spec.model) if leaf.stacked) \
        / spec.stored_layers * (itemsize or spec.held_param_itemsize)


def grads_whole(spec) -> bool:
    """Whether the gradient stack is kept whole over the data axes until the update (no gather
    for compute, so no layer-by-layer reduce-scatter; no ZeRO-2 scatter): XLA then all-reduces
    each layer's gradients into it inside the backward's layer loop."""
    return not gather_axes(spec) and stage(spec) < STAGE_OF["grads"]


def shard_factor(spec, part: str) -> int:
    """How many ways ZeRO splits a part of the state (params, grads, master, optimizer)."""
    return spec.deg(AXIS) if stage(spec) >= STAGE_OF[part] else 1


def shard_spec(partition, shape: tuple[int, ...], axis_sizes: dict[str, int], zero_stage: int,
               axis: str = AXIS, keep: dict[int, int] | None = None):
    """The PartitionSpec `partition` with `axis` added on one dimension (see module docstring): at
    stages 1 and 2 after the axes already there (it splits each of their shards), at stage 3 before
    them."""
    from jax.sharding import PartitionSpec as P
    return P(*shard_entries(partition, shape, axis_sizes, zero_stage, axis, keep))


def shard_entries(partition, shape: tuple[int, ...], axis_sizes: dict[str, int], zero_stage: int,
                  axis: str = AXIS, keep: dict[int, int] | None = None) -> list:
    """`shard_spec`'s entries, one per dimension (None, a mesh axis or a tuple of them), without
    JAX (the planner's formulas read them). `keep`: {dimension: M} whose shards must stay
    multiples of M; where no dimension allows that, the first that `axis` divides."""
    n = axis_sizes.get(axis, 1)
    entries = list(partition) + [None] * (len(shape) - len(partition))
    if n == 1 or any(axis in entry_axes(e) for e in entries):
        return entries

    def local(i):
        return shape[i] // math.prod(axis_sizes[a] for a in entry_axes(entries[i]))
    order = [i for i, e in enumerate(entries) if "fsdp" in entry_axes(e)]
    order += [i for i, e in enumerate(entries) if e is None]
    whole = [i for i in order if local(i) % (n * (keep or {}).get(i, 1)) == 0]
    for i in whole + order:
        if local(i) % n == 0:
            nest = (entry_axes(entries[i]) + (axis,) if zero_stage < 3
                    else (axis,) + entry_axes(entries[i]))
            entries[i] = nest if entries[i] else axis
            return entries
    return entries


@dataclass(frozen=True)
class StateSpecs:
    """Mesh specs of each part of the train state under a ZeRO stage."""
    params: object          # the working parameters (ZeRO-3: sharded over dp too)
    model: object           # the parameters as the model rules shard them (what compute sees)
    shards: object          # master weights and optimizer state (ZeRO-1+: sharded over dp)
    grads: object           # the reduced gradients (ZeRO-2+: sharded over dp)


def state_specs(zero_stage: int, model_specs, shapes, axis_sizes: dict[str, int],
                keep=None) -> StateSpecs:
    """Each state part's specs from the model's parameter specs and shapes (trees of
    PartitionSpec and shaped leaves); `keep`: a tree of `shard_entries`' keep per leaf (the
    step part `state_keep`), or None."""
    import jax
    from jax.sharding import PartitionSpec as P
    if not zero_stage:
        return StateSpecs(model_specs, model_specs, model_specs, model_specs)
    if keep is None:
        keep = jax.tree.map(lambda _: None, model_specs, is_leaf=lambda x: isinstance(x, P))
    sharded = jax.tree.map(lambda sp, a, k: shard_spec(sp, a.shape, axis_sizes, zero_stage,
                                                       keep=k),
                           model_specs, shapes, keep, is_leaf=lambda x: isinstance(x, P))
    return StateSpecs(params=sharded if zero_stage >= 3 else model_specs, model=model_specs,
                      shards=sharded, grads=sharded if zero_stage >= 2 else model_specs)


@dataclass(frozen=True)
class Shards:
    """Per-device element counts of the model state under a plan."""
    params: float                 # stored parameters (after fsdp/tp/pp/ep and ZeRO-3 over dp)
    grads: float                  # gradients after reduction (ZeRO-2/3: also over dp)
    optimizer: float              # elements of one optimizer moment (ZeRO-1+: also over dp)
    gathered_layer: float         # one layer's parameters once gathered over fsdp (and dp, ZeRO-3)
    total: int


def shards(spec) -> Shards:
    """Per-device elements of each part of the model state under `spec`: its rules
    (`Leaf.local_size`), and ZeRO's shard factor over dp per part (the `fsdp` axis always shards
    all three parts: it *is* ZeRO-3 over its devices)."""
    model = spec.model
    ls = leaves(model)
    local = sum(leaf.local_size(spec) for leaf in ls)
    gathered = [leaf.local_size(spec, drop=("fsdp",)) for leaf in ls]
    per_layer = sum(g for g, leaf in zip(gathered, ls) if leaf.stacked) / spec.stored_layers
    if not model.scan_layers:
        per_layer = max(sum(g for g, leaf in zip(gathered, ls)      # the largest layer
                            if leaf.path.startswith(f"layers/{i}/"))
                        for i in range(model.n_layers))
    return Shards(
        params=local / shard_factor(spec, "params"),
        grads=local / shard_factor(spec, "grads"),
        optimizer=local / shard_factor(spec, "optimizer"),
        gathered_layer=per_layer,
        total=sum(leaf.size for leaf in ls),
    )


# ----------------------------------------------------------------------------- protocol
def active(spec) -> bool:
    return stage(spec) > 0


def problems(spec) -> list[str]:
    z = spec.zero
    if z not in (0, 1, 2, 3):
        return [f"plan.zero={z}: ZeRO stages are 0, 1, 2 or 3"]
    if z and spec.deg(AXIS) == 1:
        return [f"plan.zero={z} shards state over the dp axis, but mesh.dp=1: give devices to dp "
                f"(mesh.fsdp already shards parameters, gradients and optimizer state, = ZeRO-3)"]
    return []


def rules(spec, rules) -> None:
    """ZeRO adds no rule for compute: it changes the state layout (`state_specs`)."""


def collectives(spec) -> list[Comm]:
    """Stages 1 and 2: the updated parameters gathered over dp."""
    z = stage(spec)
    if z not in (1, 2):
        return []
    local = shards(spec.with_(zero=0)).params * spec.wire_param_itemsize
    return [Comm("all-gather", (AXIS,), local, 1, "updated parameters, ZeRO-1/2",
                 group=spec.deg(AXIS), overlap=True)]


def memory(spec) -> list[Term]:
    """Stage 1 keeps the all-reduced full gradients beside the local ones during the update
    (the state's own savings are in the state terms: `shard_factor`)."""
    if stage(spec) != 1:
        return []
    sh = shards(spec)
    local = (sh.grads if spec.deg("fsdp") > 1 else sh.params) * spec.held_param_itemsize
    return [Term("update", local, "the all-reduced gradients, ZeRO-1")]


def label(spec) -> list[str]:
    return [f"zero{spec.zero}"] if spec.zero else []


def shape_step(spec, parts) -> None:
    """The state: each part's mesh specs for the stage (`state_specs`); the gradients take the
    sharded layout from stage 2."""
    import functools
    parts.set("state_specs", functools.partial(state_specs, stage(spec)), by=NAME)
