"""Expert parallelism over the `ep` mesh axis, for a mixture-of-experts model (Mixtral style).

The model (`models/moe.py`: `model.moe_experts` E, `model.moe_top_k` k, `model.capacity_factor`)
replaces the MLP of every `model.moe_every`-th layer with E SwiGLU experts and a linear router.
Rules: `experts -> ep`; tokens stay split over `ep` as over a data axis (the batch rule includes
it). Saves: expert weights, their gradients and optimizer state split ep ways (each device holds
E / ep experts whole, or split over tp and fsdp as a dense MLP is).

Its collectives and their cost, per MoE layer and micro-batch, by the dispatch a plan runs
(`tables.activations.grouped` says which):

- the slot buffer (capacity mode on whole sequences, `slots.py`): each device scatters its
  tokens into [E, b, C, D] slots (C = `ModelConfig.moe_capacity(T)` per expert and sequence,
  R = E C / T ~ k x capacity_factor rows per token); 2 all-to-alls of the whole buffer over
  `ep` forward (dispatch, combine) and 2 backward, each tokens x R x dim x beta; the expert MLP
  between is GSPMD's, its tp all-reduces on the buffer (`strategies/tp`);
- the grouped experts (dropless, or a sequence split over sp or Megatron SP's tp,
  `grouped.py`): the kept assignments sorted by expert and sent in bounded blocks of S rows per
  peer (S = ceil(f x tokens x k / ep), f = `plan.moe_buffer`; capacity mode: its exact slot
  bound), after a first all-to-all of the per-expert counts: per layer 4 all-to-alls of ep x S
  rows (f x the routed volume tokens x k x dim x beta, the minimum) and one of the counts;
  rows past S overflow (counted in `moe_dropped`). The experts run as grouped matmuls over the
  received rows; with the tokens split over tp the rows are all-gathered over tp before them
  and reduce-scattered after (`strategies/tp` counts those); without ep there is no all-to-all.
  `plan.moe_dispatch=ragged` sends the same blocks through `jax.lax.ragged_all_to_all`,
  moving only the filled rows (GPUs; XLA:CPU cannot run it).

Any remat policy replays the forward's all-to-alls in the backward (6 per layer, and the
counts' twice): the combine's backward needs each token's expert outputs, and a MoE layer's
dispatch and batched expert matmuls carry no tag a policy saves (save_dots included). Expert
gradients are complete where the experts live, so they are not reduced over `ep`
(`strategies/dp`).

The step side: `Sharded`, the implementation of the model's `experts` seam
(`jaxscale.hooks.experts`) under a plan.
"""
from __future__ import annotations

import math

from jaxscale.axes import DATA_AXES, MESH_AXES
from jaxscale.hooks import register
from jaxscale.strategies import common, remat
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.ep import grouped as grouped_lib
from jaxscale.strategies.ep import slots
from jaxscale.strategies.tables.activations import (
    exchange,
    expert_rows,
    grouped,
    moe_layers,
    ragged_dense,
    tokens_split,
)
from jaxscale.strategies.tables.params import leaves
from jaxscale.strategies.zero import gather_axes, grads_whole

NAME = "ep"
AVAILABLE = True
#: `plan.moe_dispatch`: the grouped experts' exchange over ep (`grouped.py`)
DISPATCHES = ("padded", "ragged")


def active(spec) -> bool:
    return spec.deg("ep") > 1 or spec.moe


def problems(spec) -> list[str]:
    e, E, errs = spec.deg("ep"), spec.model.moe_experts, []
    if e > 1 and not E:
        return [f"mesh.ep={e} needs a mixture-of-experts model (model.moe_experts=0); set "
                f"mesh.ep=1 or model.moe_experts"]
    if E and E % e:
        errs.append(f"model.moe_experts={E} is not divisible by mesh.ep={e}: each device of the "
                    f"ep axis holds E / ep whole experts; choose ep dividing {E}")
    if E and spec.moe_dispatch == "ragged" and spec.device_kind == "cpu":
        errs.append("plan.moe_dispatch=ragged runs jax.lax.ragged_all_to_all, which XLA:CPU "
                    "cannot run (GPUs and TPUs can): use plan.moe_dispatch=padded, the "
                    "bounded two-phase exchange, on this backend")
    return errs


def rules(spec, rules) -> None:
    if spec.deg("ep") > 1:
        rules.add("experts", "ep", by="ep")
    if spec.moe:
        rules.set_seam("experts", "sharded", by=NAME, grouped=grouped(spec),
                       buffer=spec.moe_buffer, dispatch=spec.moe_dispatch)


def collectives(spec) -> list[Comm]:
    e = spec.deg("ep")
    if not spec.moe:
        return []
    m, k, L = spec.model, max(1, spec.accumulate), moe_layers(spec)
    # under any remat policy a MoE layer replays: its dispatch and its experts' batched
    # matmuls carry no saved tag (`models.moe`)
    beta, replay = spec.wire_compute_itemsize, remat.active(spec)
    per_layer = 4 + 2 * replay
    n = per_layer * L * k
    out = []
    stats = _stat_axes(spec)
    if stats:
        E = m.moe_experts
        out.append(Comm("all-reduce", stats, 4 * E * (3 + replay) * L * k,
                        (2 + replay) * L * k, "the router's balance statistics (expert shares "
                        "and mean probabilities; the latter's cotangent in the backward; a "
                        "replayed layer's shares again, which that cotangent reads) over the "
                        "data shards of the step's manual region", group=math.prod(
                            spec.deg(a) for a in stats)))
    if grouped(spec):
        x = exchange(spec)
        routed = x.tokens * m.moe_top_k * m.dim * beta
        if e > 1:
            runs = (1 + replay) * L * k
            # ragged: the filled rows alone, the routed volume when the load is balanced
            block = routed if spec.moe_dispatch == "ragged" else x.ep * x.per_peer * m.dim * beta
            out += [Comm("all-to-all", ("ep",), block * n
                         + x.ep * x.local_experts * 4 * runs, n + runs,
                         f"grouped experts: bounded blocks of {x.per_peer} rows per peer "
                         f"(dispatch and combine, forward and backward: {per_layer} per layer) "
                         f"and the per-expert counts before them", group=e,
                         minimum=routed * n)]
        seq = tokens_split(spec)
        if seq and not m.moe_dropless:   # the sequence's expert ids, for its capacity
            nbytes = spec.micro_batch * spec.local_seq * spec.deg("sp") * m.moe_top_k * 4
            runs = (1 + replay) * L * k
            out.append(Comm("all-gather", seq, nbytes * runs, runs, "the expert ids of the "
                            "whole sequence (capacity counted in token order; again in a "
                            "replayed layer)",
                            group=math.prod(spec.deg(a) for a in seq)))
        axes = _token_axes(spec)
        if axes and (e > 1 or not m.moe_dropless):
            out.append(Comm("all-reduce", axes, 4 * L * k, L * k,
                            "assignments that reached no expert (dropped, overflowed)",
                            group=math.prod(spec.deg(a) for a in axes)))
        return out
    if e == 1:
        return out
    tokens = spec.micro_batch * spec.local_seq
    buf = tokens * expert_rows(spec) * m.dim * beta
    routed = tokens * m.moe_top_k * m.dim * beta
    return out + [Comm("all-to-all", ("ep",), buf * n, n,
                       f"MoE dispatch and combine, forward and backward ({per_layer} per layer)",
                       group=e, minimum=routed * n)]


def _stat_axes(spec) -> tuple[str, ...]:
    """The data axes a MoE layer averages its balance statistics over (`models.moe.balance_loss`
    via `axes.data_mean`): those the step runs manual over (`common.manual_data_axes`)."""
    manual = common.manual_data_axes(spec)
    return tuple(a for a in MESH_AXES if a in manual and a in DATA_AXES and spec.deg(a) > 1)


def _token_axes(spec) -> tuple[str, ...]:
    """The mesh axes a grouped region's tokens are split over (data axes, then the sequence's),
    less those the step runs manual over (`common.manual_data_axes`): they sum the statistics
    once, with the loss."""
    axes = set(a for a in spec.data_axes if spec.deg(a) > 1) | set(tokens_split(spec))
    once = common.manual_data_axes(spec)
    return tuple(a for a in MESH_AXES if a in axes and a not in once)


def memory(spec) -> list[Term]:
    """Expert weights follow the rules and the routed activations are in the layer table
    (`tables.activations.moe_tensors`). Its own (read from XLA:CPU buffer assignments): the
    grouped experts gather their weights over fsdp inside their region and keep every MoE
    layer's gathered copy for the backward (under remat one layer's, for its replay; none in a
    pipeline stage, whose B op replays from fsdp's one gathered layer: dp2 x pp2 x fsdp2 full
    remat, the planner 1.23 -> 1.03 of the compiled temp without it); without FSDP the backward
    of a scanned MoE layer holds a copy of the layer's expert weights sliced out of the stack;
    `ragged_dot`'s CPU lowering over several local experts may hold the stacked expert gradient
    twice (`_stack_copied`), and the masked buffers of its dense matmul (`dense_experts`). With
    the gradient stack kept whole (`zero.grads_whole`) the MoE layer's expert gradients are
    all-reduced inside the layer loop where the experts are replicated over a data axis (dp, sp:
    the ep x tp shards leave copies): their reduced copy is alive beside them (none where ep x
    tp covers every device)."""
    if not spec.moe or not spec.model.scan_layers:
        return []
    experts = [leaf for leaf in leaves(spec.model) if "experts" in leaf.axes]
    local = sum(leaf.local_size(spec) for leaf in experts)
    lowering = [Term("backward", dense_experts(spec), "ragged_dot's CPU lowering: every row "
                     "against every local expert in the MoE layer's backward")]
    axes = gather_axes(spec)
    if axes:
        if not grouped(spec):
            return []
        held = sum(leaf.local_size(spec, drop=axes) for leaf in experts)
        if remat.active(spec) and spec.deg("pp") > 1:
            return lowering         # a stage's B op replays from fsdp's one gathered layer
        if remat.active(spec):      # replayed: each layer gathers them again (`collectives`)
            return lowering + [Term("backward", held / spec.stored_layers
                                    * spec.held_param_itemsize, "one MoE layer's expert weights "
                                    f"as gathered over {'x'.join(axes)} for its replay")]
        return lowering + [Term("backward", held * spec.held_param_itemsize, "every MoE layer's "
                                f"expert weights as gathered over {'x'.join(axes)}, kept for "
                                "the backward (grouped experts)")]
    layer = local / spec.model.n_layers * spec.held_param_itemsize
    out = lowering + [Term("backward", layer, "one MoE layer's expert weights, sliced out of "
                           "the stack")]
    if _stack_copied(spec):
        out.append(Term("backward", local * spec.held_param_itemsize,
                        "the expert gradient stack again: updated out of place under "
                        "ragged_dot's CPU lowering over several local experts"))
    replicated = spec.n_devices * local > sum(leaf.size for leaf in experts)
    if grads_whole(spec) and replicated:
        out.append(Term("backward", layer, "one MoE layer's expert gradients all-reduced over "
                        "the replica axes inside the layer loop"))
    return out


def _stack_copied(spec) -> bool:
    """Whether the backward holds the stacked expert gradient twice, updated out of place under
    `ragged_dot`'s CPU lowering over several local experts: where XLA partitions the step (dp2 x
    ep4, ep8, dp8, dp2 x fsdp2 x tp2 dropless). Not where the layer is replayed (any remat
    policy: dp8 and dp4 x ep2 full, save_dots, offload at 0.86-1.06 of the compiled temp without
    the copy, 1.15-1.47 with it), nor in the data region with every expert on each device and no
    pipeline (`common.sync_axes`, ep = pp = 1: dp8 fp8 with the sparse embedding or 2
    micro-batches, 0.99-1.06 without it, 1.31-1.39 with it; over ep2 or a pipeline the copy
    stays: dp2 x ep2 x sp2 at 0.77 without it)."""
    region = bool(common.sync_axes(spec)) and spec.deg("ep") == spec.deg("pp") == 1
    return (ragged_dense(spec) and spec.model.moe_experts // spec.deg("ep") > 1
            and not remat.active(spec) and not region)


def dense_experts(spec) -> float:
    """The grouped experts on XLA:CPU, where `ragged_dot` lowers to a dense matmul of every row
    with every local expert: the MoE layer's backward holds three masked f32 [E_loc, R, w]
    buffers (R = the exchange's rows, w the wider of dim and the local expert width f: the
    hidden gradients, or the input gradients of narrow experts). One layer's activations already
    count six routed [R, f] tensors; the excess is added (E_loc = 1: none)."""
    if not ragged_dense(spec):
        return 0.0
    x = exchange(spec)
    w_gate = next(leaf for leaf in leaves(spec.model)
                  if "experts" in leaf.axes and leaf.path.endswith("w_gate"))
    f = w_gate.local_shape(spec, drop=gather_axes(spec))[-1]
    dense = 3 * x.local_experts * x.rows * max(spec.model.dim, f)
    return max(0.0, dense - 6 * x.rows * f) * spec.compute_itemsize


def label(spec) -> list[str]:
    return []


# ----------------------------------------------------------------------------- the step
@register("experts", "sharded")
class Sharded:
    """The model's `experts` seam under a plan (`jaxscale.hooks.experts`): the slot buffer's
    dispatch and combine (`slots.py`), and the grouped experts' bounded exchange
    (`grouped.py`)."""
    to_experts = staticmethod(slots.to_experts)
    from_experts = staticmethod(slots.from_experts)
    grouped = staticmethod(grouped_lib.grouped)
