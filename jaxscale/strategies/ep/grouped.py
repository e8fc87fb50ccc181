"""The grouped experts under a plan: a bounded two-phase exchange over `ep`, grouped matmuls.

Each device routes its own tokens (a data shard, and a sequence shard under context or Megatron
sequence parallelism) and sorts its kept assignments by expert. Experts live in contiguous
blocks of E / ep on the devices of the `ep` axis, so the sorted rows fall into one run per peer.
The exchange, inside `jax.shard_map`:

1. counts: one all-to-all of the [ep, E / ep] per-expert row counts (int32), so that each
   device knows how many of the rows it receives belong to each of its experts;
2. rows: one all-to-all of a [ep, S, D] buffer, S rows per peer: S = ceil(f N k / ep) for N
   local tokens (f = `plan.moe_buffer`; the routed volume N k D is moved f times), or the
   capacity mode's own bound b C E / ep (exact: no peer can be sent more). Rows past S are the
   overflow: they reach no expert, are counted (`dropped`, `moe_overflow`) and add nothing.

The receiver groups its rows by expert (a stable sort of the expert ids, padding last) and runs
the experts as grouped matmuls (`jax.lax.ragged_dot`), then the inverse path: unsort, the same
all-to-all back, and each assignment's output scattered to its token and weighted.

Tensor parallelism splits each expert's `mlp` over tp. With the tokens split over tp too
(Megatron SP: the residual stream is), every tp rank dispatches its own 1/tp of the tokens; the
received rows are all-gathered over tp before the experts and the partial outputs
reduce-scattered back (as Megatron's expert-tensor-parallel dispatch). With the tokens replicated
over tp, each tp rank dispatches them all and the partial outputs are all-reduced over tp once
as [b, t, D], after the combine.

Capacity under a split sequence stays the whole sequence's: the k expert ids of the sequence are
all-gathered over its shards (ints), put in token order (context parallelism's zig-zag layout
undone), counted as on one device, and each shard keeps its own tokens' verdicts. Which tokens
drop is then the same on every layout, and stays causal.

Weights enter with their stored layout (experts over ep, embed over fsdp, mlp over tp); fsdp's
gather runs inside, so its transpose reduce-scatters the expert gradients over fsdp; the
gradients are summed over the remaining data and sequence axes by the region's transpose.
"""
from __future__ import annotations

import math

import numpy as np

from jaxscale.axes import manual, mesh_entry, suspended
from jaxscale.hooks.projection import SCALES, layer_input, this_layer
from jaxscale.strategies.tables.activations import bound


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _keep(positions, idx, capacity: int, E: int, seq_axes: tuple, mesh):
    """[b, t, k] bool of this shard's assignments that fit their expert's capacity, counted over
    the whole sequence in token order (all-gathered over `seq_axes`; zig-zag undone over sp)."""
    from jax import lax
    if not seq_axes:
        return positions(idx, E) < capacity
    t = idx.shape[1]
    whole = lax.all_gather(idx, mesh_entry(seq_axes), axis=1, tiled=True)       # [b, T, k] stored
    T = whole.shape[1]
    perm = np.arange(T)
    if "sp" in seq_axes and mesh.shape["sp"] > 1:
        from jaxscale.strategies.sp.seq_layout import layout_permutation
        perm = layout_permutation(T, mesh.shape["sp"])
    inv = np.argsort(perm)
    pos = positions(whole[:, inv], E)[:, perm]                             # stored order again
    me = lax.axis_index(mesh_entry(seq_axes))
    return lax.dynamic_slice_in_dim(pos, me * t, t, axis=1) < capacity


def grouped(mesh, rules, parts, x_BTD, idx_BTK, w_BTK, weights, capacity):
    """The plan's grouped experts (see the module docstring): (y [B, T, D], dropped count)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    opts = rules.options["experts"]                  # the plan's (`ep.rules`)
    factor, dispatch = opts["buffer"], opts["dispatch"]
    ex = rules.table.get("experts", ())
    seq = tuple(a for a in rules.table.get("norm_seq", ()) if mesh.shape[a] > 1)
    mlp = tuple(a for a in rules.table.get("mlp", ()) if mesh.shape[a] > 1)
    embed = tuple(a for a in rules.table.get("embed", ()) if mesh.shape[a] > 1)
    gather_tp = tuple(a for a in mlp if a in seq)      # tokens split there: gather the rows
    sum_tp = tuple(a for a in mlp if a not in seq)     # tokens replicated there: sum y
    tok = rules.spec(("batch", "norm_seq", None))
    col, row = rules.spec(("experts", "embed", "mlp")), rules.spec(("experts", "mlp", "embed"))
    token_axes = tuple(a for e in tok for a in ((e,) if isinstance(e, str) else e or ()))
    spread = tuple(a for a in token_axes if a not in (*ex, *embed, *mlp))
    region = tuple(dict.fromkeys((*token_axes, *ex, *embed, *mlp)))
    n_ep = _size(mesh, ex)
    E, K = weights[0].shape[0], idx_BTK.shape[-1]
    El = E // n_ep

    def exchange(blocks, send, recv):
        """[ep, S, D] blocks (block p for peer p, its first `send[p]` rows filled) -> the
        blocks received ([ep, S, D], block q from peer q, `recv[q]` rows): one all-to-all of
        the whole buffer, or a ragged one moving the filled rows alone."""
        if dispatch != "ragged":
            return lax.all_to_all(blocks, mesh_entry(ex), 0, 0, tiled=True)
        n, S, D = blocks.shape
        at = jnp.arange(n, dtype=jnp.int32) * S
        me = jnp.full((n,), lax.axis_index(mesh_entry(ex)) * S, jnp.int32)
        out = lax.ragged_all_to_all(blocks.reshape(n * S, D), jnp.zeros_like(
            blocks.reshape(n * S, D)), at, send.astype(jnp.int32), me,
            recv.astype(jnp.int32), axis_name=mesh_entry(ex))
        return out.reshape(n, S, D)

    def body(x, idx, w, wg, wu, wd, sc):
        b, t, D = x.shape
        NK = b * t * K
        if spread:            # varying where the tokens are before fsdp's gather: the
            wg, wu, wd = (lax.pcast(a, spread, to="varying") for a in (wg, wu, wd))
        if embed:             # gradient is scattered over fsdp first, then summed at its shard
            wg, wu = (lax.all_gather(a, mesh_entry(embed), axis=1, tiled=True) for a in (wg, wu))
            wd = lax.all_gather(wd, mesh_entry(embed), axis=2, tiled=True)
        if sum_tp:            # the input's gradient is then summed over tp once, at [b, t, D]
            x = lax.pcast(x, sum_tp, to="varying")
        with suspended():
            keep = (jnp.ones(idx.shape, jnp.bool_) if capacity is None else
                    _keep(parts.positions, idx, capacity, E, seq, mesh)).reshape(-1)
        key = jnp.where(keep, idx.reshape(-1), E)                  # [NK]; dropped ones last
        order = jnp.argsort(key, stable=True)
        counts = jnp.sum(jax.nn.one_hot(key, E, dtype=jnp.int32), axis=0).reshape(n_ep, El)
        S = bound(NK, n_ep, factor, None if capacity is None else b * capacity * El)
        # what each peer is sent: the first S of its run of the sorted assignments
        cum = jnp.cumsum(counts, axis=1)
        sent = jnp.diff(jnp.minimum(cum, S), axis=1, prepend=0)                # [ep, El]
        total = cum[:, -1]
        mine = jnp.minimum(total, S)                           # [ep] rows sent to each peer
        start = jnp.cumsum(total) - total
        j = jnp.arange(S)
        ok = j[None, :] < mine[:, None]                                        # [ep, S]
        assign = order[jnp.minimum(start[:, None] + j[None, :], NK - 1)]      # [ep, S]
        x_pad = jnp.concatenate([x.reshape(b * t, D), jnp.zeros((1, D), x.dtype)])
        rows = x_pad[jnp.where(ok, assign // K, b * t)]         # padding reads the zero row
        got = sent                                   # [ep (source), El] rows each peer sent
        if ex:
            got = lax.all_to_all(sent, mesh_entry(ex), 0, 0, tiled=True)
            rows = exchange(rows, mine, jnp.sum(got, axis=1))         # [ep (source), S, D]
        groups = got
        if gather_tp:
            rows = lax.all_gather(rows, mesh_entry(gather_tp), axis=0, tiled=True)
            groups = lax.all_gather(got, mesh_entry(gather_tp), axis=0, tiled=True)
        Q = rows.shape[0]
        ends = jnp.cumsum(groups, axis=1)                                      # [Q, El]
        local = jnp.sum(j[None, :, None] >= ends[:, None, :], axis=-1)         # [Q, S]
        perm = jnp.argsort(local.reshape(-1), stable=True)     # by expert; padding (El) last
        # the experts' matmul hook sees the rows and weights as pieces over the region's axes:
        # fp8 QAT's per-tensor amaxes, the scales' cotangent, are maxima over all of them, the
        # same on every device (not varying), which this region's transpose (it checks what
        # varies) passes out as they are: one device's, not a sum to average
        with manual(region), this_layer(SCALES, sc):
            ys = parts.ffn(rows.reshape(Q * S, D)[perm], jnp.sum(groups, axis=0), wg, wu, wd)
        back = ys[jnp.argsort(perm)].reshape(Q, S, D)
        if gather_tp:
            back = lax.psum_scatter(back, mesh_entry(gather_tp), scatter_dimension=0, tiled=True)
        if ex:
            back = exchange(back, jnp.sum(got, axis=1), mine)
        dest = jnp.where(ok, assign, NK).reshape(-1)
        y = jnp.zeros((NK, D), back.dtype).at[dest].add(back.reshape(-1, D), mode="drop")
        y = jnp.sum(y.reshape(b, t, K, D) * w[..., None].astype(y.dtype), axis=2)
        if sum_tp:
            y = lax.psum(y, sum_tp)
        if capacity is None and not ex:       # dropless, all local: nothing can be dropped
            return y, jnp.zeros((), jnp.float32)
        dropped = (jnp.sum(~keep) + jnp.sum(total - mine)).astype(jnp.float32)
        return y, lax.psum(dropped, token_axes) if token_axes else dropped

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, col, col, row, P()),
                       out_specs=(tok, P()))
    return fn(x_BTD, idx_BTK, w_BTK, *weights, layer_input(SCALES))
