"""Tensor parallelism's column-parallel groups: the matmuls that read one input (q, k, v; gate,
up) in one `jax.shard_map` manual over `tp`, so that the input's gradient is reduced once per
group, as Megatron's fused QKV and gate-up weights give, while the model keeps separate weights
(and Hugging Face's layout).

Under GSPMD each column-parallel matmul's input gradient is a partial sum over tp that XLA
reduces on its own: 3 all-reduces for q, k, v and 2 for gate, up per layer and micro-batch. In
the group's region the weights are the device's tp shards and the input is whole over tp (with
Megatron sequence parallelism it arrives split along the sequence and is all-gathered there,
once for the group); the backward sums the members' input gradients locally and reduces them
once: the region's transpose is one all-reduce (one reduce-scatter with sequence parallelism).
Every other mesh axis stays GSPMD's inside (`axes.manual`), and each matmul still goes through
the model's `projection` seam (8-bit QAT). Nothing is kept for the backward beyond the
region's inputs: the sequence-parallel gather is replayed for the weight gradients, as GSPMD
re-gathers (the same activation memory).
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import active, constrain, entry_axes, manual, on_shards
from jaxscale.hooks.projection import SCALES, layer_input, project, this_layer
from jaxscale.strategies import remat
from jaxscale.strategies.tp.seq import gather_seq

AXIS = "tp"


def _only(spec, ndim: int, axes) -> P:
    """`spec` with only the mesh axes in `axes` left (what a shard_map manual over them is
    told)."""
    out = []
    for e in tuple(spec) + (None,) * (ndim - len(spec)):
        kept = tuple(a for a in entry_axes(e) if a in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def columns(eq, x, ws, sites, names, mesh, rules):
    """The matmuls einsum(eq, x, w) for each w of `ws` (the hook `project_columns`) in one region
    manual over tp (and over the axes that split the input's sequence before tp: context
    parallelism's sp, where the sequence is split over (sp, tp) and tp's gather must stay inside
    each sp shard)."""
    full = tuple(rules.spec(names[0][0])) + (None,) * x.ndim
    seq = [d for d, e in enumerate(full[:x.ndim])
           if AXIS in entry_axes(e)]
    axes = (AXIS,) if not seq else tuple((full[seq[0]],) if isinstance(full[seq[0]], str)
                                         else full[seq[0]])
    x_spec = _only(full[:x.ndim], x.ndim, axes)
    w_specs = tuple(_only(rules.spec(n[1]), w.ndim, axes) for w, n in zip(ws, names))
    out_ndim = len(eq.split("->")[1])
    o_specs = tuple(_only(rules.spec(n[2]), out_ndim, axes) for n in names)

    if not seq:
        # x enters whole over tp. Were it replicated into the region, the region's transpose
        # would psum its gradient inside the partly manual region, which XLA:CPU cannot compile
        # in 16 bits (AllReducePromotion meets the reducer's sharding annotation). Instead each
        # device takes its own copy along a new tp-split axis (no data moves), and the
        # transpose of that broadcast, a sum over the axis, is GSPMD's one all-reduce over tp.
        n = mesh.shape[AXIS]
        x = jax.numpy.broadcast_to(x[None], (n,) + x.shape)
        x_spec = P(AXIS, *x_spec)

    # the layer's per-layer inputs (fp8 QAT's scales) come in as arguments, replicated: every
    # device of the group computes the same statistics for them (a whole-tensor amax), which
    # the region's transpose would sum over the group, so their cotangent is averaged inside
    scales = layer_input(SCALES)

    def body(x_local, sc, *w_local):
        with manual(axes), this_layer(SCALES, None if sc is None else averaged(sc, axes)):
            if not seq:
                x_local = x_local[0]
            # the input on the batch's layout (its transpose puts the gradient there): left
            # free, GSPMD may compute the gradient with the sequences gathered over fsdp and
            # the embedding split like the weight, then all-to-all it back (many query heads
            # per device: 10 of 8 on dp2 x fsdp2 x tp2)
            x_local = constrain(x_local, *names[0][0])
            if seq:          # the sequence gathered over tp on each device's own shard
                x_local = on_shards(lambda v: gather_seq(v, seq[0]), x_local,
                                    active()[1].spec(names[0][0]))
            return tuple(project(eq, x_local, w, s, n) for w, s, n in zip(w_local, sites, names))

    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)
    region = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P()) + w_specs, out_specs=o_specs,
                           axis_names=set(axes), check_vma=False)
    # under a remat policy FSDP gathers the weights before the region, once for its replay and
    # its transpose
    region = remat.gathered_before(region, mesh, rules, full[:x.ndim], w_specs,
                                  tuple(n[1] for n in names))
    return region(x, scales, *ws)


def averaged(value, axes):
    """`value` whose cotangent is divided by the devices of `axes`: a replicated input of a
    region, whose per-device cotangents are equal and are summed when they leave it."""
    import math

    @jax.custom_vjp
    def same(v):
        return v

    def bwd(_, g):
        n = math.prod(jax.lax.axis_size(a) for a in axes)
        return (jax.tree.map(lambda t: t / n, g),)
    same.defvjp(lambda v: (v, None), bwd)
    return same(value)
