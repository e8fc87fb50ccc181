"""The data region: a step's gradients computed manual over the data axes they are synced over
once per step, and reduced there once.

`make(grads_fn, ctx, axes, mean=None)` runs the plan's grads function inside `jax.shard_map`
manual over `axes` (`("dp",)`, or `("dp", "fsdp")` for `plan.grad_sync=step`), every other mesh
axis left to GSPMD: fsdp, tp, sp, ep and pp keep their rules and the model's seams inside
(`axes.manual`). Each device computes the gradients of its own rows of the batch over all its
micro-batches with no reduction over `axes` on the way (the body's gradients of parameters it
holds whole over those axes stay local), and the accumulated gradients are reduced once:

- exact (`mean=None`): each device's token-mean gradients are weighted by its share of the
  step's real tokens and summed over `axes`: a psum over the axes a parameter is replicated on,
  a psum_scatter back into the parameter's layout over the axes it is split on (fsdp in the
  once-per-step mode, whose parameters are all-gathered over those axes once, at the start);
- by a strategy's `mean` (gradient compression, the sparse embedding exchange): the weighted
  gradients leave the region unreduced over `mean_axes`, one [n, ...] stack, and a second
  `shard_map`, manual over the whole mesh, hands each device its own shards of every leaf (the
  fsdp and tp pieces it holds): `mean(local grads, local state, local inputs) -> (mean, state)`
  reduces them over `mean_axes` with the method's collectives, on any layout. Its per-device
  state lives as [devices, ...] arrays split over every mesh axis, one slice per device
  (`stacked_spec`), so a state shaped like the device's own shards fits any layout.

The loss and the token count are summed over `axes` (scalar all-reduces), the scalar metrics
averaged, a probe's cotangent (fp8 QAT's amaxes) combined by the probe's own operation.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.axes import MESH_AXES, entry_axes, manual, on_shards
from jaxscale.strategies.common import PROBE


def scattered(spec: P, axes, ndim: int) -> P:
    """The entries of `spec` that a sum over `axes` scatters back to (those whose mesh axes are
    all summed: a dimension split over ('dp', 'fsdp') with only fsdp summed is summed whole)."""
    out = []
    for e in list(spec) + [None] * (ndim - len(spec)):
        own = entry_axes(e)
        out.append(e if own and set(own) <= set(axes) else None)
    return P(*out)


def drop(spec: P, axes) -> P:
    """`spec` without the mesh axes in `axes`."""
    return P(*[None if not (k := tuple(a for a in entry_axes(e) if a not in axes)) else
               k[0] if len(k) == 1 else k for e in spec])


def local_shape(shape, spec: P, sizes: dict) -> tuple[int, ...]:
    """One device's shard of an array of `shape` laid out by `spec`."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(d // math.prod(sizes[a] for a in entry_axes(e)) for d, e in zip(shape, entries))


def stacked_spec() -> P:
    """A per-device state's leading axis: one slice per device of the whole mesh."""
    return P(MESH_AXES)


def on_own_state(mean):
    """mean(grads, state, inputs) -> (avg, state) run on one device's slice of a per-device state
    (`stacked_spec`: a [1, ...] block of each leaf inside a `shard_map` over every axis it is
    split on), the slice taken out and put back; a None state passes through."""
    def run(grads, state, inputs):
        local = None if state is None else jax.tree.map(lambda a: a[0], state)
        avg, local = mean(grads, local, inputs)
        return avg, None if local is None else jax.tree.map(lambda a: a[None], local)
    return run


def stack_local(tree, n_devices: int):
    """[devices, ...] copies of a per-device state (what `stacked_spec` splits)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n_devices,) + a.shape), tree)


def scatter_or_sum(g, spec: P, axes, manual_axes, layout: P | None = None):
    """The sum of `g` over `axes`: scattered back along the dimensions `scattered` keeps, summed
    over the rest. `layout`: the parameter's own layout, whose other axes (pp's stages, tp's
    pieces) stay split while the scatter runs on each device's shard (without it XLA gathers
    them first)."""
    done = []
    for dim, e in enumerate(spec):
        if e is not None:
            over = entry_axes(e)
            g = on_shards(lambda v, over=over, dim=dim: jax.lax.psum_scatter(
                v, over, scatter_dimension=dim, tiled=True), g,
                drop(spec if layout is None else layout, manual_axes))
            done += over
    rest = tuple(a for a in axes if a not in done)
    return jax.lax.psum(g, rest) if rest else g


def make(grads_fn, ctx, axes: tuple[str, ...], mean=None, mean_axes: tuple[str, ...] = (),
         micro_batches: int = 1):
    """(params, batch, scale, state, *extra, probe=None) -> (mean gradients, loss, tokens,
    stats, state): `grads_fn` (`train.grads.make_grads_fn`'s contract; `extra`, e.g. a
    distillation teacher's parameters, and `probe`, the inputs of `parts.probe` (replicated),
    passed on to it) run manual over `axes`, its gradients reduced once (see the
    module docstring). `ctx` is the step's context (its placement, state layout and parts);
    `mean` reduces over `mean_axes` (a subset of `axes`) in place of the exact sum, once, or
    with `micro_batches` = k > 1 once per micro-batch (`grads_fn` then takes one micro-batch:
    the region runs k times in a loop, its state threaded through, the means weighted by their
    micro-batch's real tokens)."""
    placement, lay = ctx.placement, ctx.lay
    mesh, parts = placement.mesh, ctx.parts
    axes = tuple(a for a in MESH_AXES if a in axes)
    summed = tuple(a for a in axes if a not in mean_axes)
    n_mean = math.prod(dict(zip(mesh.axis_names, mesh.devices.shape))[a] for a in mean_axes)
    param_specs = lay.specs.params
    shapes = ctx.model.abstract_params
    is_p = lambda x: isinstance(x, P)                                      # noqa: E731
    # the parameters come in whole over `axes`: gathered by XLA once, before the region
    whole = jax.tree.map(lambda sp: NamedSharding(mesh, drop(sp, axes)), param_specs,
                         is_leaf=is_p)
    # the gradients leave scattered back over the summed axes that split them, the mean axes
    # stacked in front (the mean's region reads them so)
    back = jax.tree.map(lambda sp, a: scattered(sp, summed, a.ndim), param_specs, shapes,
                        is_leaf=is_p)
    probe = parts.probe

    def body(params, batch, scale, probe_in, *extra):
        with manual(axes):
            grads, loss, ntok, stats = grads_fn(params, batch, scale, *extra, **(
                {} if probe_in is None else {"probe": probe_in}))
        loss, total = jax.lax.psum(jnp.stack([loss * ntok, ntok]), axes)     # one [2] array
        loss = loss / jnp.where(total > 0, total, 1.0)
        # each device's share of the step's tokens: the sum over devices is the token mean (a
        # mean over the mean axes, for the strategy's mean)
        share = ntok * n_mean / jnp.where(total > 0, total, 1.0)
        grads = jax.tree.map(lambda g: g * share.astype(g.dtype), grads)
        grads = jax.tree.map(lambda g, sp, full: scatter_or_sum(g, sp, summed, axes, full),
                             grads, back, param_specs, is_leaf=is_p)
        if mean is not None:
            grads = jax.tree.map(lambda g: g[None], grads)
        seen = stats.pop(PROBE, None)
        stats = jax.tree.map(lambda s: jax.lax.pmean(s, axes), stats)
        if seen is not None:
            stats[PROBE] = jax.tree.map(lambda s: _all(probe.combine, s, axes), seen)
        return grads, loss, total, stats

    lead = P(mean_axes)[0] if mean_axes else None
    grads_out = jax.tree.map(lambda sp: P(lead, *sp) if mean is not None else sp, back,
                             is_leaf=is_p)

    def region(params, batch, scale, *extra, probe=None):
        params = jax.lax.with_sharding_constraint(params, whole)
        return jax.shard_map(
            body, mesh=mesh, axis_names=set(axes), check_vma=False,
            in_specs=(jax.tree.map(lambda _: P(), params), jax.tree.map(lambda _: P(axes), batch),
                      P(), jax.tree.map(lambda _: P(), probe)) + (P(),) * len(extra),
            out_specs=(grads_out, P(), P(), P()))(params, batch, scale, probe, *extra)

    if mean is None:
        def run(params, batch, scale, state, *extra, probe=None):
            grads, loss, total, stats = region(params, batch, scale, *extra, probe=probe)
            return grads, loss, total, stats, state
        return run

    # the mean's region: every device its own shards of each leaf, its own state, its rows
    shard_specs = jax.tree.map(lambda sp: drop(sp, mean_axes), param_specs, is_leaf=is_p)
    stacked_in = jax.tree.map(lambda sp: P(lead, *sp), shard_specs, is_leaf=is_p)

    own_state = on_own_state(mean)

    def mean_body(grads, state, inputs):
        return own_state(jax.tree.map(lambda g: g[0], grads), state, inputs)

    def once(params, batch, scale, state, *extra, probe=None):
        grads, loss, total, stats = region(params, batch, scale, *extra, probe=probe)
        st = None if state is None else jax.tree.map(lambda _: stacked_spec(), state)
        avg, state = jax.shard_map(
            mean_body, mesh=mesh, check_vma=False,
            in_specs=(stacked_in, st, P(mean_axes)), out_specs=(shard_specs, st))(
            grads, state, batch["inputs"])
        return avg, loss, total, stats, state
    if micro_batches == 1:
        return once

    def run(params, batch, scale, state, *extra, probe=None):
        from jaxscale.strategies.accumulate import split

        def body(carry, micro):
            acc, state = carry
            avg, loss, total, stats, state = once(params, micro, scale, state, *extra,
                                                  probe=probe)
            seen = stats.pop(PROBE, None)
            part = (jax.tree.map(lambda g: g.astype(jnp.float32) * total, avg), loss * total,
                    total, stats, seen)
            return (part if acc is None else _combine(acc, part, probe), state), None
        first = jax.tree.map(lambda x: x[0], split(batch, micro_batches))
        shapes = jax.eval_shape(lambda: body((None, state), first)[0][0])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        if zeros[4] is not None:        # a probe's cotangent starts from its combine's unit
            zeros = zeros[:4] + (jax.tree.map(lambda z: z - jnp.inf, zeros[4])
                                 if probe.combine is jnp.maximum else zeros[4],)
        (acc, state), _ = jax.lax.scan(body, (zeros, state), split(batch, micro_batches))
        grads, loss, total, stats, seen = acc
        denom = jnp.where(total > 0, total, 1.0)
        stats = jax.tree.map(lambda s: s / micro_batches, stats)
        if seen is not None:
            stats[PROBE] = seen
        return (jax.tree.map(lambda g: g / denom, grads), loss / denom, total, stats, state)
    return run


def _combine(acc, part, probe):
    """Micro-batch sums: gradients, loss and tokens added, statistics added (averaged at the
    end), a probe's cotangent combined by its own operation."""
    summed = tuple(jax.tree.map(jnp.add, a, b) for a, b in zip(acc[:4], part[:4]))
    seen = None if part[4] is None else jax.tree.map(probe.combine, acc[4], part[4])
    return summed + (seen,)


def _all(op, x, axes):
    """Combine `x` over `axes` by a binary `op` known to collectives (max or add)."""
    if op is jnp.maximum:
        return jax.lax.pmax(x, axes)
    if op is jnp.add:
        return jax.lax.psum(x, axes)
    raise ValueError(f"a probe's combine must be jnp.maximum or jnp.add, got {op}")
