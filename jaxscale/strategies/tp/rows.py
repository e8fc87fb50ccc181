"""Megatron sequence parallelism at the weight matmuls outside the column groups: the row-parallel
o and down projections, which write the residual stream, and the LM head, which reads it (the
model's `stream` seam, `jaxscale.hooks.projection`).

A row-parallel matmul's output is reduce-scattered to the stream's sequence shards in the
forward; in the backward its output gradient is all-gathered once and read by both the input
gradient (dy W^T) and the weight gradient (x^T dy). Left to GSPMD, that is not what runs:
- each of the two backward matmuls may gather the gradient for itself: XLA's CSE merges the two
  gathers only where their replica groups are spelled alike, which inside a manual region (the
  accumulation's data region, the pipeline's stages) they are not (once as an iota list, once
  explicitly): twice the bytes. The head's input has the same pair (the forward's gather and
  its weight gradient's);
- with the batch over fsdp and the sequence over sp and tp, the partitioner meets fsdp on both
  the activation (batch) and the weight (embed) and moves the weight onto sp instead of
  gathering it over fsdp: it gathers the sequence over sp, all-reduces the whole product over
  tp and slices it, and reduces the weight gradient over sp at its gathered size; the head's
  backward likewise.

So a row matmul runs here in a region manual over the axes that split the stream's sequence
(sp, then tp), like the column groups (`columns.py`): the local product of the device's heads
or MLP columns, then `psum_scatter` over tp along the sequence (a reduce-scatter, which XLA:CPU
emits as one); its transpose is one all-gather of the output gradient, read by both backward
matmuls. The other mesh axes stay GSPMD's inside (fsdp's weight gather, as for any matmul), and
the matmul still goes through the model's `gather` and `projection` seams (ZeRO++, 8-bit QAT).
The head's input is laid out whole along the sequence over tp, forward and (its gradient)
backward, through an identity: one all-gather in the forward, kept for the weight gradient;
the gradient's partial sums over the vocabulary are reduced before the stream's slice.

Two exceptions keep the row matmul GSPMD's einsum, its output gradient laid out whole by an
identity (`gathered_cotangent`: the gathers are single, but fsdp x sp x tp keeps GSPMD's
forward): a remat policy that saves matmul outputs (`plan.remat=save_dots`), which would save
the region's local product (t times its output) and replay its reduce-scatter, the policy
seeing no matmul in the collective's result; and `plan.qat`, whose int8 per-token and
per-channel scales span the contracted heads or MLP columns the region splits. Under
collective matmul (`plan.tp_overlap`) the row sites are its rings: only the head's input is
laid out here.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.axes import active, current, entry_axes, manual, manual_axes, on_shards
from jaxscale.strategies.tp.seq import scatter_seq

AXIS = "tp"


def stream(eq, x, w, site, names, mesh, rules, inner, rows: bool = True,
           region: bool = True):
    """einsum(eq, x, w) by `inner(x, w)` (the local matmul) at a matmul reading or writing the
    residual stream: a row site in its region (`region`; else GSPMD's einsum with its gradient
    gathered once; the rings' without `rows`), the head with its input gathered; as it is
    inside a region already manual over tp (a column group's)."""
    if AXIS in manual_axes():
        return inner(x, w)
    if "norm_seq" in names[2]:
        if not rows:
            return inner(x, w)
        if not region:
            return gathered_cotangent(inner(x, w), names[2], mesh, rules)
        return row(eq, x, w, names, mesh, rules, inner)
    return inner(gathered_input(x, names[0], mesh, rules), w)


def row(eq, x, w, names, mesh, rules, inner):
    """The row-parallel matmul in a region manual over the stream's sequence axes (sp, tp):
    the local product, then its psum_scatter over tp along the sequence."""
    mesh, rules = current(mesh, rules)
    out = tuple(rules.spec(names[2])) + (None,) * len(names[2])
    seq = names[2].index("norm_seq")
    axes = entry_axes(out[seq])
    if AXIS not in axes:
        return inner(x, w)
    out_ndim = len(eq.split("->")[1])
    x_spec = _only(rules.spec(names[0]), x.ndim, axes)
    w_spec = _only(rules.spec(names[1]), w.ndim, axes)
    o_spec = _only(out[:out_ndim], out_ndim, axes)

    def body(x_local, w_local):
        with manual(axes):
            y = inner(x_local, w_local)                          # partial sums over tp
            return on_shards(lambda v: scatter_seq(v, seq), y, active()[1].spec(names[2]))
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=o_spec,
                         axis_names=set(axes), check_vma=False)(x, w)


def _only(spec, ndim: int, axes) -> P:
    """`spec` with only the mesh axes in `axes` left (what a shard_map manual over them is
    told), as the column groups' region (`columns.py`)."""
    out = []
    for e in tuple(spec) + (None,) * (ndim - len(spec)):
        kept = tuple(a for a in entry_axes(e) if a in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def gathered_input(x, names, mesh, rules):
    """`x` laid out with the stream's sequence whole over tp (`norm_seq` read as `seq`): a
    sharding constraint, whose transpose lays the cotangent out alike."""
    mesh, rules = current(mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(_whole(names))))


def gathered_cotangent(y, names, mesh, rules):
    """`y` (a row output, GSPMD's einsum) by an identity whose backward lays the cotangent out
    with the stream's sequence whole over tp: one all-gather, read by both backward matmuls."""
    mesh, rules = current(mesh, rules)
    whole = NamedSharding(mesh, rules.spec(_whole(names)))

    @jax.custom_vjp
    def lay(a):
        return a

    lay.defvjp(lambda a: (a, None), lambda _, g: (jax.lax.with_sharding_constraint(g, whole),))
    return lay(y)


def _whole(names) -> tuple:
    """`names` with the residual stream's sequence whole over tp (`norm_seq` read as the
    attention and MLP regions' `seq`, which only context parallelism's sp splits)."""
    return tuple("seq" if n == "norm_seq" else n for n in names)
