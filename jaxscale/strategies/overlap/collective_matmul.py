"""Collective matmul: an all-gather or reduce-scatter decomposed into ring hops that each overlap
one partial matmul (Wang et al., "Overlap Communication with Dependent Computation via
Decomposition in Large Deep Learning Models", ASPLOS'23).

Both functions run on per-device shards inside `jax.shard_map` and take the einsum `eq` of one
local matmul, with the split (sequence) dimension at `x_seq` of the activation and `out_seq` of
the result; `axis` names the mesh axis of the ring (t devices, t = its size).

- `allgather_matmul(eq, x, w)`: einsum(all_gather(x, axis, along x_seq), w). Instead of one
  all-gather of x (t-1 chunks received, then the matmul), x's chunk moves around the ring:
  each of the t-1 hops is a `ppermute` of one [.., T/t, ..] chunk, and the matmul of the chunk
  already here runs while the next one travels. Output chunk by output chunk, so the full x is
  never held at once beyond the residuals autodiff keeps for the weight gradient.
- `matmul_reduce_scatter(eq, x, w)`: psum_scatter(einsum(x, w), axis, along out_seq). Instead
  of computing the whole partial product and then reduce-scattering it, an accumulator per
  output chunk travels the ring: at each of the t-1 hops a device adds its partial product for
  that chunk to the accumulator it received, then passes it on; the chunk's owner adds its own
  last.

`project` is the model's projection seam under `plan.tp_overlap`: the block's column- and
row-parallel matmuls as these rings inside a `jax.shard_map` over the whole mesh.

Collectives: t-1 `collective-permute`s of one chunk (1/t of the gathered or scattered array)
per call, the same bytes a ring all-gather / reduce-scatter puts on each link, in t-1 steps
the scheduler can interleave with the t partial matmuls. `bidirectional=True` sends half the
chunks each way round the ring (ceil((t-1)/2) sequential steps, two permutes in flight per
step, same total bytes). The trade: t smaller matmuls instead of one (less efficient on a GPU
when a chunk is small), and under autodiff the permuted chunks are residuals (the backward of
each permute is the reverse permute, so gradients are collective matmuls too).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import suspended
from jaxscale.hooks.projection import plain
from jaxscale.strategies.tp import COLUMN, ROW


def ring_split(t: int, bidirectional: bool) -> tuple[int, int]:
    """Hops forward (j -> j+1) and backward (j -> j-1) that cover the t-1 other devices."""
    if not bidirectional:
        return t - 1, 0
    return t // 2, (t - 1) // 2


def _perms(t: int):
    fwd = [(j, (j + 1) % t) for j in range(t)]
    bwd = [(j, (j - 1) % t) for j in range(t)]
    return fwd, bwd


def _put(out, y, chunk, seq: int):
    """out with y written at sequence chunk `chunk` (a traced index)."""
    return lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), chunk * y.shape[seq], seq)


def _take(x, chunk, size: int, seq: int):
    return lax.dynamic_slice_in_dim(x, chunk * size, size, seq)


def allgather_matmul(eq: str, x, w, axis: str, *, x_seq: int = 1, out_seq: int = 1,
                     bidirectional: bool = False, **einsum_kw):
    """einsum(eq, all_gather(x, axis, axis=x_seq, tiled=True), w) as t-1 ring hops of x's chunk,
    each overlapping the matmul of the chunk already here (call inside `shard_map`).

    x: this device's sequence chunk [.., T/t, ..] (chunk index = its position on `axis`);
    w: the local weight (not split along the contraction). Returns [.., T, ..] along out_seq."""
    t = lax.axis_size(axis)
    mm = lambda a: jnp.einsum(eq, a, w, **einsum_kw)           # noqa: E731
    y = mm(x)
    if t == 1:
        return y
    idx = lax.axis_index(axis)
    shape = list(y.shape)
    shape[out_seq] *= t
    out = _put(jnp.zeros(shape, y.dtype), y, idx, out_seq)
    kf, kb = ring_split(t, bidirectional)
    fwd_perm, bwd_perm = _perms(t)
    f = b = x
    for s in range(1, max(kf, kb) + 1):
        # the hop of step s carries the chunk of device idx - s (forward) / idx + s (backward);
        # the matmul of the chunk received at step s-1 has no dependence on it
        if s <= kf:
            f = lax.ppermute(f, axis, fwd_perm)
            out = _put(out, mm(f), (idx - s) % t, out_seq)
        if s <= kb:
            b = lax.ppermute(b, axis, bwd_perm)
            out = _put(out, mm(b), (idx + s) % t, out_seq)
    return out


def matmul_reduce_scatter(eq: str, x, w, axis: str, *, x_seq: int = 1, out_seq: int = 1,
                          bidirectional: bool = False, **einsum_kw):
    """psum_scatter(einsum(eq, x, w), axis, scatter_dimension=out_seq, tiled=True) as t-1 ring
    hops of an accumulator, each overlapping the partial matmul of the next chunk (call inside
    `shard_map`).

    x: the full sequence [.., T, ..] along x_seq with the contraction split over `axis` (each
    device holds a partial sum); returns this device's summed chunk [.., T/t, ..]."""
    t = lax.axis_size(axis)
    if t == 1:
        return jnp.einsum(eq, x, w, **einsum_kw)
    if x.shape[x_seq] % t:
        raise ValueError(f"matmul_reduce_scatter: sequence length {x.shape[x_seq]} (dimension "
                         f"{x_seq}) is not divisible by the {t} devices of axis {axis!r}")
    size = x.shape[x_seq] // t
    idx = lax.axis_index(axis)
    part = lambda c: jnp.einsum(eq, _take(x, c % t, size, x_seq), w, **einsum_kw)  # noqa: E731
    kf, kb = ring_split(t, bidirectional)
    fwd_perm, bwd_perm = _perms(t)
    f = b = None
    for s in range(max(kf, kb)):
        # forward: at step s device j adds its part of chunk j + kf - s and passes it to j + 1,
        # so after kf hops chunk c holds the parts of devices c - kf .. c - 1 and sits on c;
        # backward likewise with chunk j - kb + s, passed to j - 1
        if s < kf:
            p = part(idx + kf - s)
            f = p if f is None else lax.ppermute(f, axis, fwd_perm) + p
        if s < kb:
            p = part(idx - kb + s)
            b = p if b is None else lax.ppermute(b, axis, bwd_perm) + p
    out = part(idx)
    if kf:
        out = out + lax.ppermute(f, axis, fwd_perm)
    if kb:
        out = out + lax.ppermute(b, axis, bwd_perm)
    return out


# ----------------------------------------------------------------------------- the projection
def _seq_dim(names, logical: str, partition, site: str, what: str) -> int:
    """The dimension of `logical` in an operand, which must end in tp (and only there)."""
    if logical not in names:
        raise ValueError(f"collective matmul at {site}: its {what} has no {logical!r} axis "
                         f"(logical axes {names})")
    d = names.index(logical)
    axes = partition[d] if isinstance(partition[d], tuple) else (partition[d],)
    if axes[-1:] != ("tp",):
        raise ValueError(f"collective matmul at {site}: its {what} {names} is sharded {partition}, "
                         f"not over tp on {logical!r}: set plan.sequence_parallel=true")
    return d


def project(eq, x, w, site, names, mesh, rules, bidirectional=False, **kw):
    """`project` for the block's column- and row-parallel sites as collective matmuls in a
    `shard_map` over the whole (remaining) mesh; the other sites (the LM head) as GSPMD's
    einsum. A weight split over the data axes too (fsdp, ZeRO-3's dp) is all-gathered over them
    first, inside, and its gradient reduce-scattered back (the all-gather's transpose); over the
    axes it is whole on, its gradient is summed once, at the region's edge."""
    if site not in COLUMN + ROW:
        return plain(eq, x, w, **kw)
    xn, wn, on = names
    x_spec, w_spec, o_spec = (tuple(rules.spec(n)) for n in names)
    if site in COLUMN:
        x_seq = _seq_dim(xn, "norm_seq", x_spec, site, "input")
        out_seq = on.index("seq")
    else:
        out_seq = _seq_dim(on, "norm_seq", o_spec, site, "output")
        x_seq = xn.index("seq")
    fn = allgather_matmul if site in COLUMN else matmul_reduce_scatter
    gathered = [(d, tuple(a for a in _axes(e) if a != "tp"))
                for d, e in enumerate(w_spec) if any(a != "tp" for a in _axes(e))]
    if any(_axes(w_spec[d])[-1:] != ("tp",) and "tp" in _axes(w_spec[d]) for d, _ in gathered):
        raise ValueError(f"collective matmul at {site}: the weight {wn} is split {w_spec}, tp "
                         f"not innermost on its dimension")

    def body(x_local, w_local):
        for d, axes in gathered:        # fsdp's shards of the weight, gathered here
            w_local = lax.all_gather(w_local, axes, axis=d, tiled=True)
        with suspended():       # per-device shards: no global sharding rules inside
            return fn(eq, x_local, w_local, "tp", x_seq=x_seq, out_seq=out_seq,
                      bidirectional=bidirectional, **kw)

    # nothing inside is kept for the backward: it re-runs the input's ring for the weight
    # gradient (as GSPMD re-gathers it), so the chunks, and the gathered weight, are never
    # stacked as per-layer residuals; the rings of q, k and v (gate and up) are identical and
    # XLA keeps one of each, forward and replayed
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)
    run = jax.shard_map(body, mesh=mesh, in_specs=(P(*x_spec), P(*w_spec)),
                        out_specs=P(*o_spec), check_vma=False)
    return run(x, w.astype(x.dtype))


def _axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())
