"""Fully sharded data parallelism (ZeRO-3) over the `fsdp` mesh axis.

Rules: parameters (and so gradients and optimizer state, which follow the parameter shardings)
are sharded on their `embed` dimension over `fsdp`; the batch is split over `fsdp` too.
Saves: model state 16/n bytes/param. Costs: one gathered layer of full parameters (and its
unreduced gradient) live at a time, and 3 x parameter bytes x (n-1)/n on the wire per device per
step (ZeRO-3's 3 Psi). Collectives (arXiv 1910.02054, as XLA compiles them): an all-gather of
every parameter in the forward and of the layer parameters and final norm again in the backward;
the embedding is not gathered again (its gradient is a scatter-add into the local shard). The LM
head's backward gather is `optional`: XLA's CSE sometimes reuses the forward copy and sometimes
does not (seen both ways on one mesh at different batch sizes). With accumulation the layer
gathers repeat per micro-batch; the loop-invariant ones (embedding, final norm, head) are hoisted
out of the micro-batch loop. A remat policy gathers the layers' RMSNorm scales once more for the
replayed forward; the matmul weights gathered for the backward serve the replay too, those of
tensor parallelism's column groups (q, k, v; gate, up) because they are gathered before the
group's region, not at its entry (`remat.gathered_before`): at the entry the replayed region and its
transpose gathered 5 of a layer's 7 weights twice (1.21x the formula's gathers on pp2 x fsdp2 x
tp2, 1.30x on dp2 x fsdp2 x tp2). The gradient reduce-scatter is part of the data axes' reduction
(`strategies/dp`).
ZeRO-3 over `dp` is FSDP over (dp, fsdp): the same gathers, over both axes. With
`plan.grad_sync=step` and micro-batches the parameters are gathered once, at the start of the
step, and held whole over these axes until its end (`dp.memory` counts them): one all-gather per
parameter per step in place of the per-use ones. Where the data region is manual over dp alone
(a strategy's own mean over dp, gradient compression or the sparse embedding, under ZeRO-3), it
takes the parameters gathered over dp once, at its entry (ZeRO-3's (dp, fsdp)-nested shards
re-laid into fsdp's order by collective-permutes, the stored shard moved twice), and gathers
over fsdp per use inside.
"""
from __future__ import annotations

import math

from jaxscale.axes import MESH_AXES, entry_axes
from jaxscale.strategies import common, qat, remat, zero, zeropp
from jaxscale.strategies.common import Comm, Term
from jaxscale.strategies.tables.activations import grouped
from jaxscale.strategies.tables.params import leaves, outer_gathers
from jaxscale.strategies.zero import gather_axes

NAME = "fsdp"
AVAILABLE = True


def active(spec) -> bool:
    return spec.deg("fsdp") > 1


def problems(spec) -> list[str]:
    f = spec.deg("fsdp")
    if spec.model.dim % f:
        return [f"model.dim={spec.model.dim} is not divisible by mesh.fsdp={f}: FSDP shards every "
                f"parameter on its embed dimension; choose fsdp dividing it"]
    return []


def rules(spec, rules) -> None:
    if active(spec):
        rules.add("embed", "fsdp", by="fsdp")


def collectives(spec) -> list[Comm]:
    axes = gather_axes(spec)
    if not axes:
        return []
    k, pb = max(1, spec.accumulate), spec.wire_param_itemsize
    n = math.prod(spec.deg(a) for a in axes)
    if step_gathered(spec):
        ls = leaves(spec.model)
        return [Comm("all-gather", axes, sum(leaf.local_size(spec, drop=("fsdp",)) for leaf in ls)
                     * pb, len(ls), "parameters, once per step (plan.grad_sync=step)", group=n,
                     overlap=True)]
    out = []
    once = tuple(a for a in axes if a in common.sync_axes(spec))
    if once:            # the data region, manual over `once`, gathers them at its entry
        split = [leaf for leaf in leaves(spec.model) if any(
            a in once for e in zero.stored_spec(spec, leaf) for a in entry_axes(e))]
        out.append(Comm("all-gather", once, sum(
            zero.stored_size(spec, leaf, drop=once) for leaf in split) * pb, len(split),
            f"parameters over {' x '.join(once)}, once per step at the data region's entry",
            group=math.prod(spec.deg(a) for a in once), overlap=True))
        axes = tuple(a for a in axes if a not in once)
        n = math.prod(spec.deg(a) for a in axes)
        # ZeRO-3 nests dp before fsdp on one dimension (`zero.shard_entries`): gathered over dp
        # alone, the pieces land out of fsdp's order, and XLA re-lays the stored shard with
        # collective-permutes moving it twice (dp2 and dp4 x fsdp2, fp32 and bf16)
        nested = [leaf for leaf in split if any(
            set(entry_axes(e)) & set(once) and set(entry_axes(e)) & set(axes)
            for e in zero.stored_spec(spec, leaf))]
        if nested:
            out.append(Comm("collective-permute", tuple(a for a in MESH_AXES if a in once + axes),
                            2 * sum(zero.stored_size(spec, leaf) for leaf in nested) * pb,
                            2 * len(nested), "ZeRO-3's (dp, fsdp)-nested shards re-laid into "
                            "fsdp's order for the data region", group=2, overlap=True))
    # outside the layers: gathered `outer_gathers` times
    layer_f = layer_b = least_b = outer_f = outer_b = head = norms = again = 0.0
    count_f = count_b = 0
    own = {leaf.path for leaf in zeropp.sites(spec)} if zeropp.active(spec) else set()
    for leaf in leaves(spec.model):
        if all(a is None or a == "layers" for a in leaf.axes) or leaf.path in own:
            continue        # nothing to split (a routing bias), or ZeRO++ gathers it (zeropp/)
        size = leaf.run_size(spec, drop=("fsdp",)) * pb
        count_f += int(spec.layers_per_device if leaf.stacked else 1)      # gathers issued
        if leaf.path.startswith("layers/"):
            q = qat.weight_gathers(spec, leaf)       # QAT's 8-bit weights
            layer_f += size if q is None else q.forward
            count_f += 0 if q is None else (q.forward_count - 1) * int(spec.layers_per_device)
            if grouped(spec) and ("experts" in leaf.axes or leaf.use == "router") and not (
                    remat.active(spec)):
                continue     # the grouped experts keep their gathered weights and the router
                # (under any remat policy the MoE layer replays and gathers them again)
            again += size * (q is None and regathered(spec, leaf))
            layer_b += size if q is None else q.backward
            least_b += size if q is None else q.backward_minimum
            count_b += int(spec.layers_per_device if leaf.stacked else 1) * (
                1 if q is None else q.backward_count)
            norms += size if (leaf.stacked and leaf.use == "norm") else 0.0
        elif leaf.path == "head":
            outer_f += size * outer_gathers(spec, leaf)
            head = size * outer_gathers(spec, leaf)
        else:
            outer_f += size * outer_gathers(spec, leaf)
            if leaf.use != "embedding":
                outer_b += size * outer_gathers(spec, leaf)
                count_b += 1
    out += [Comm("all-gather", axes, layer_f * k + outer_f, count_f * k,
                "parameters, forward", group=n, overlap=True),
           Comm("all-gather", axes, layer_b * k + outer_b, count_b * k,
                "layer parameters and final norm, backward (the embedding is not regathered)",
                group=n, overlap=True,
                minimum=least_b * k + outer_b if least_b < layer_b else None)]
    if spec.remat not in ("none", ""):
        # the replayed forward gathers the RMSNorm scales again (the matmul weights gathered
        # for the backward serve the replay too)
        out.append(Comm("all-gather", axes, norms * k, 2 * spec.layers_per_device * k,
                        "RMSNorm scales again for the rematerialised forward", group=n,
                        overlap=True))
    if again:
        out.append(Comm("all-gather", axes, again * k, int(spec.layers_per_device) * k,
                        "wo again for the replay's row region (XLA may reuse the backward's "
                        "gather)", group=n, optional=True, overlap=True))
    if head:
        out.append(Comm("all-gather", axes, head, 1, "LM head, backward (XLA may reuse the "
                        "forward gather)", group=n, optional=True, overlap=True))
    return out


def regathered(spec, leaf) -> bool:
    """Whether a remat policy's replay gathers wo once more: tensor parallelism's row region
    gathers its weight at its entry, and the replay and the transpose are two regions, where
    the policy recomputes wo's matmul (w_down's output only feeds the residual, never
    replayed; the column weights are gathered before their region, one copy for both:
    `remat.gathered_before`). XLA may still share one gather between the two regions, so the
    formula counts it as optional: dp2 x fsdp2 x tp2 remat=full on `llama_tiny` and seed 1122
    (dim 160, Megatron SP) gather it a third time (fsdp's gathers 0.97 and 0.94 of the formula
    without it), the 6-head, 96-wide shape of `test_census_shapes.py` does not. A pipeline
    stage's B op replays and differentiates its layers from one gather of each weight
    (`test_census_shapes.py`: pp2 x fsdp2 x tp2, 11 gathers a layer)."""
    from jaxscale.strategies.remat import replays
    return (leaf.path.split("/")[-1] == "wo" and spec.deg("tp") > 1 and spec.deg("pp") == 1
            and replays(spec.remat, ("wo",)))


def step_gathered(spec) -> bool:
    """Whether the step gathers the parameters once and holds them (`plan.grad_sync=step`)."""
    return bool(gather_axes(spec)) and set(gather_axes(spec)) <= set(common.sync_axes(spec))


def memory(spec) -> list[Term]:
    """During the backward: one gathered layer of weights, and the unreduced gradients XLA holds
    before it scatters them (held whole for the step instead with `plan.grad_sync=step`:
    `dp.memory`). Read from XLA:CPU buffer assignments (the most weight-shaped bytes alive at
    once in the backward): each weight's gradient is reduce-scattered as it is produced and
    each gathered weight freed after its input gradient, so one weight's gradient is unreduced
    at a time (fsdp8, fsdp8 acc2: the MLP's three gathered matrices, one weight gradient and its
    transposed copy); the grouped experts' region scatters a MoE layer's expert gradients
    together, when it ends (`strategies/ep`); the zero-bubble schedules' W pass computes a
    layer's weight gradients together (pp2 x fsdp4 ZB-H1); under full remat XLA reduces the
    layer's gradients in one combined all-reduce, holding them all and their reduced copies
    (fsdp8 bf16 remat=full acc2)."""
    from jaxscale.strategies.pp.schedules import SPLIT
    if not gather_axes(spec) or step_gathered(spec):
        return []
    layer = zero.shards(spec).gathered_layer
    if spec.remat == "full" or (spec.deg("pp") > 1 and spec.schedule in SPLIT):
        unreduced, what = layer, "the layer's gradients, reduced together"
    else:
        per_layer = [(leaf.local_size(spec, drop=("fsdp",)) / spec.stored_layers,
                      "experts" in leaf.axes) for leaf in leaves(spec.model) if leaf.stacked]
        experts = sum(size for size, expert in per_layer if expert) if grouped(spec) else 0.0
        unreduced = max([experts] + [size for size, _ in per_layer])
        what = ("the layer's expert gradients, scattered together" if experts >= unreduced
                else "its largest weight's unreduced gradient")
    # the gathered layer as the all-gather returns it (XLA:CPU gathers float16 in f32: fsdp8
    # fp16, the planner at 0.88 of the compiled temp with it at 2 bytes, 1.00 at 4), the
    # gradient as the backward holds it
    return [Term("backward", layer * spec.wire_param_itemsize + unreduced
                 * spec.held_param_itemsize, f"one gathered layer and {what}")]


def label(spec) -> list[str]:
    return []


# ----------------------------------------------------------------------------- the step
