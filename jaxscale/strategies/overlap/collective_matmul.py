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

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import entry_axes, permute, suspended
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


def put_chunk(out, y, chunk, seq: int):
    """out with y written at sequence chunk `chunk` (a traced index)."""
    return lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), chunk * y.shape[seq], seq)


def take_chunk(x, chunk, size: int, seq: int):
    return lax.dynamic_slice_in_dim(x, chunk * size, size, seq)


def ring_visit(x, axis: str, bidirectional: bool):
    """(chunk, its owner's index) for this device's chunk and then each chunk arriving round the
    ring: t-1 `ppermute` hops (of a pytree of arrays), each visit independent of the next hop."""
    t, idx = lax.axis_size(axis), lax.axis_index(axis)
    yield x, idx
    kf, kb = ring_split(t, bidirectional)
    fwd_perm, bwd_perm = _perms(t)
    f = b = x
    for s in range(1, max(kf, kb) + 1):
        # the hop of step s carries the chunk of device idx - s (forward) / idx + s (backward)
        if s <= kf:
            f = permute(f, axis, fwd_perm)
            yield f, (idx - s) % t
        if s <= kb:
            b = permute(b, axis, bwd_perm)
            yield b, (idx + s) % t


def allgather_matmul(eq: str, x, w, axis: str, *, x_seq: int = 1, out_seq: int = 1,
                     bidirectional: bool = False, matmul=None, **einsum_kw):
    """einsum(eq, all_gather(x, axis, axis=x_seq, tiled=True), w) as t-1 ring hops of x's chunk,
    each overlapping the matmul of the chunk already here (call inside `shard_map`).

    x: this device's sequence chunk [.., T/t, ..] (chunk index = its position on `axis`);
    w: the local weight (not split along the contraction). Returns [.., T, ..] along out_seq.
    `matmul(chunk)`, if given, replaces einsum(eq, chunk, w): x may then be a pytree (an 8-bit
    chunk with its scales) that travels the ring as it is, and the result a tuple (the matmuls
    of a group reading x, each chunk's products computed on its one visit)."""
    mm = matmul or (lambda a: jnp.einsum(eq, a, w, **einsum_kw))     # noqa: E731
    if lax.axis_size(axis) == 1:
        return mm(x)
    return ring_gather(x, axis, place=mm, out_seq=out_seq, bidirectional=bidirectional)[0]


def allgather_contract(x, full, axis: str, contract, *, seq: int = 1,
                       bidirectional: bool = False):
    """sum over the chunks c of all_gather(x) of contract(chunk c, full's slice c along `seq`),
    as the same t-1 ring hops (call inside `shard_map`): a weight gradient x^T g whose x (or g)
    is sequence-split, without gathering it whole. `full` and the result may be pytrees (a
    group's gradients, their weight gradients)."""
    return ring_gather(x, axis, contract=contract, full=full, seq=seq,
                       bidirectional=bidirectional)[1]


def ring_gather(x, axis: str, *, place=None, out_seq: int = 1, contract=None, full=None,
                seq: int = 1, bidirectional: bool = False):
    """One ring of x's chunks (call inside `shard_map`), each visit used twice over: (the
    results of `place(chunk)` written at the chunk's position along `out_seq`, the sum of
    `contract(chunk, full's slice at the chunk's position along seq)`), None for a use not
    given. `allgather_matmul` places, `allgather_contract` sums; a row-parallel matmul's
    backward does both on its one ring of output-gradient chunks (dx placed, dW summed)."""
    t = lax.axis_size(axis)
    placed = summed = None
    for chunk, owner in ring_visit(x, axis, bidirectional):
        if place is not None:
            y = place(chunk)
            if placed is None:
                placed = jax.tree.map(lambda a: jnp.zeros(
                    a.shape[:out_seq] + (a.shape[out_seq] * t,) + a.shape[out_seq + 1:],
                    a.dtype), y)
            placed = jax.tree.map(lambda o, a: put_chunk(o, a, owner, out_seq), placed, y)
        if contract is not None:
            y = contract(chunk, jax.tree.map(
                lambda a: take_chunk(a, owner, a.shape[seq] // t, seq), full))
            summed = y if summed is None else jax.tree.map(jnp.add, summed, y)
    return placed, summed


def matmul_reduce_scatter(eq: str, x, w, axis: str, *, x_seq: int = 1, out_seq: int = 1,
                          bidirectional: bool = False, matmul=None, **einsum_kw):
    """psum_scatter(einsum(eq, x, w), axis, scatter_dimension=out_seq, tiled=True) as t-1 ring
    hops of an accumulator, each overlapping the partial matmul of the next chunk (call inside
    `shard_map`).

    x: the full sequence [.., T, ..] along x_seq with the contraction split over `axis` (each
    device holds a partial sum); returns this device's summed chunk [.., T/t, ..]. `matmul(x
    slice)`, if given, replaces einsum(eq, slice, w) (x may then be a pytree, sliced leaf by
    leaf); the accumulators travel in its result's dtype."""
    mm = matmul or (lambda a: jnp.einsum(eq, a, w, **einsum_kw))     # noqa: E731
    t = lax.axis_size(axis)
    if t == 1:
        return mm(x)
    n = jax.tree.leaves(x)[0].shape[x_seq]
    if n % t:
        raise ValueError(f"matmul_reduce_scatter: sequence length {n} (dimension "
                         f"{x_seq}) is not divisible by the {t} devices of axis {axis!r}")
    size = n // t
    idx = lax.axis_index(axis)
    part = lambda c: mm(jax.tree.map(lambda a: take_chunk(a, c % t, size, x_seq), x))  # noqa: E731
    kf, kb = ring_split(t, bidirectional)
    fwd_perm, bwd_perm = _perms(t)
    f = b = None
    for s in range(max(kf, kb)):
        # forward: at step s device j adds its part of chunk j + kf - s and passes it to j + 1,
        # so after kf hops chunk c holds the parts of devices c - kf .. c - 1 and sits on c;
        # backward likewise with chunk j - kb + s, passed to j - 1
        if s < kf:
            p = part(idx + kf - s)
            f = p if f is None else permute(f, axis, fwd_perm) + p
        if s < kb:
            p = part(idx - kb + s)
            b = p if b is None else permute(b, axis, bwd_perm) + p
    out = part(idx)
    if kf:
        out = out + permute(f, axis, fwd_perm)
    if kb:
        out = out + permute(b, axis, bwd_perm)
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


class Ring(NamedTuple):
    """Where one site's collective matmul runs: the operands' and result's mesh specs, the
    sequence dimension of x and of the result, the weight's dimensions gathered over data axes
    (fsdp, ZeRO-3's dp) inside, whether it gathers (column) or scatters (row), the ring's
    direction(s)."""
    mesh: object
    x_spec: tuple
    w_spec: tuple
    o_spec: tuple
    x_seq: int
    out_seq: int
    gathered: tuple
    column: bool
    bidirectional: bool

    def gather_weight(self, w_local, skip=()):
        """The weight's shards over the data axes, gathered (tp's split kept); not on the
        dimensions `skip` (a per-channel scale's size-1 contracted ones)."""
        for d, axes in self.gathered:
            if d not in skip:
                w_local = lax.all_gather(w_local, axes, axis=d, tiled=True)
        return w_local


def ring_of(site, names, mesh, rules, bidirectional) -> Ring:
    xn, wn, on = names
    x_spec, w_spec, o_spec = (tuple(rules.spec(n)) for n in names)
    column = site in COLUMN
    if column:
        x_seq = _seq_dim(xn, "norm_seq", x_spec, site, "input")
        out_seq = on.index("seq")
    else:
        out_seq = _seq_dim(on, "norm_seq", o_spec, site, "output")
        x_seq = xn.index("seq")
    gathered = tuple((d, tuple(a for a in entry_axes(e) if a != "tp"))
                     for d, e in enumerate(w_spec) if any(a != "tp" for a in entry_axes(e)))
    if any(entry_axes(w_spec[d])[-1:] != ("tp",) and "tp" in entry_axes(w_spec[d])
           for d, _ in gathered):
        raise ValueError(f"collective matmul at {site}: the weight {wn} is split {w_spec}, tp "
                         f"not innermost on its dimension")
    return Ring(mesh, x_spec, w_spec, o_spec, x_seq, out_seq, gathered, column, bidirectional)


def region(rings, body, in_specs, out_specs):
    """body(*per-device operands) in a `shard_map` over the whole (remaining) mesh, with no
    global sharding rules inside."""
    def run(*args):
        with suspended():
            return body(*args)
    return jax.shard_map(run, mesh=rings[0].mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def specs(rings):
    """(x's spec, the weights' specs, the outputs' specs) of a group, as PartitionSpecs."""
    return (P(*rings[0].x_spec), tuple(P(*r.w_spec) for r in rings),
            tuple(P(*r.o_spec) for r in rings))


def plain_rings(rings, eq: str, x, ws, sites=(), **kw) -> tuple:
    """einsum(eq, x, w) for each w of `ws` as one collective matmul: a column group's one ring
    of x's chunks (each chunk's matmuls computed on its visit; the backward sums the group's
    input gradients before its one reverse ring), or a row site's reduce-scattering ring."""
    r = rings[0]
    ring_kw = dict(x_seq=r.x_seq, out_seq=r.out_seq, bidirectional=r.bidirectional)

    def body(x_local, *w_local):
        w_local = [q.gather_weight(w) for q, w in zip(rings, w_local)]
        if r.column:
            return allgather_matmul(eq, x_local, None, "tp", **ring_kw, matmul=lambda c: tuple(
                jnp.einsum(eq, c, w, **kw) for w in w_local))
        return (matmul_reduce_scatter(eq, x_local, w_local[0], "tp", **ring_kw, **kw),)

    # nothing inside is kept for the backward: it re-runs the input's ring for the weight
    # gradients (as GSPMD re-gathers it), so the chunks, and the gathered weights, are never
    # stacked as per-layer residuals
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)
    x_spec, w_specs, o_specs = specs(rings)
    run = region(rings, body, (x_spec,) + w_specs, o_specs)
    return run(x, *(w.astype(x.dtype) for w in ws))


def project_group(eq, x, ws, sites, names, mesh, rules, bidirectional=False, impl=None,
                  **kw) -> tuple:
    """The matmuls einsum(eq, x, w) of the sites `sites` (a column group reading x, or one
    site) as one collective matmul in a `shard_map` over the whole (remaining) mesh. A weight
    split over the data axes too (fsdp, ZeRO-3's dp) is all-gathered over them first, inside,
    and its gradient reduce-scattered back (the all-gather's transpose); over the axes it is
    whole on, its gradient is summed once, at the region's edge. `impl(rings, eq, x, ws,
    sites)`: the rings' implementation (`plain_rings`; QAT's 8-bit operands: `quantised`)."""
    rings = [ring_of(s, n, mesh, rules, bidirectional) for s, n in zip(sites, names)]
    return (impl or plain_rings)(rings, eq, x, ws, sites, **kw)


def project(eq, x, w, site, names, mesh, rules, bidirectional=False, impl=None, **kw):
    """`project` for the row-parallel sites (o, down) as matmul-reduce-scatter rings (and a
    column site not in a group as its all-gather ring); the other sites (the LM head) as
    GSPMD's einsum."""
    if site not in COLUMN + ROW:
        return plain(eq, x, w, **kw)
    return project_group(eq, x, (w,), (site,), (names,), mesh, rules, bidirectional, impl,
                         **kw)[0]
