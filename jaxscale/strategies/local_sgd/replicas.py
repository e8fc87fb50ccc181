"""Local SGD's train step (`make_train_step`): the replicas' inner steps and their average, in
one `jax.shard_map` manual over dp (see `jaxscale.strategies.local_sgd` for what it saves and
costs)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import manual, use_rules
from jaxscale.strategies.common import LOSS_LIMIT, PROBE, accepted, keep_if_finite
from jaxscale.strategies.local_sgd import averaging


def make_train_step(spec, ctx, outer, n_metrics: int):
    """The train step of a local-SGD plan: (state, batch) -> (state, metrics), all of it in one
    `jax.shard_map` over dp (see `jaxscale.strategies.local_sgd`). `ctx` is the step's context
    (`jaxscale.train.step.StepContext`): its optimizer (the inner one), learning rate, placement,
    precision policy, grads function (with statistics, `stat_names`); `outer` the outer
    optimizer; `n_metrics` the floats of the metrics all-reduce before the statistics."""
    placement, policy, optimizer = ctx.placement, ctx.policy, ctx.optimizer
    mesh, grads_fn, stat_names = placement.mesh, ctx.grads_fn, ctx.stat_names
    n, H, warmup = spec.deg("dp"), spec.local_steps, spec.local_warmup
    probe = ctx.parts.probe
    after = ctx.parts.after_update(ctx) if ctx.parts.after_update else None    # pruning
    mean = outer_mean(spec, ctx)

    def body(step, anchor, outer_state, comm, batch, scale, limit, *probed):
        """One device: its replica's inner step, then (every H-th step) the average; in
        post_local's warmup DP's step instead (`lax.switch`, the branches of `branch_share`).
        `probed`: a probe's inputs (fp8 QAT's scales); what the replicas saw is combined over
        dp (the largest amax)."""
        rep, opt = jax.tree.map(lambda a: a[0], (comm["params"], comm["opt_state"]))
        held = comm.get("mean")          # the compressed mean's state, this dp rank's devices
        with manual(("dp",)):
            grads, loss, ntok, stats = grads_fn(policy.working(rep), batch, scale,
                                                **({"probe": probed[0]} if probed else {}))
        seen = stats.pop(PROBE, None)
        if seen is not None:
            seen = jax.tree.map(lambda a: jax.lax.pmax(a, "dp"), seen)
        norm = optax.tree.norm(grads)
        finite, spike = accepted(loss, norm, limit)     # a replica whose loss spiked skips
        # the metrics, for logging and loss scaling: no local update waits for them
        sums = jax.lax.psum(jnp.stack([loss * ntok, ntok, norm, (~finite).astype(jnp.float32),
                                       spike.astype(jnp.float32)]
                                      + [stats[s] for s in stat_names]), "dp")

        def update(grads, norm, finite, rep, opt):
            updates, new_opt = optimizer.update(grads, opt, rep, grad_norm=norm)
            new = keep_if_finite(finite, optax.apply_updates(rep, updates), rep)
            if after is not None:
                with manual(("dp",)):
                    new = after(new, step + finite)
            return new, keep_if_finite(finite, new_opt, opt)

        def local(args):                        # 0: the replica's own step
            anchor, outer_state, rep, opt, held = args
            return (anchor, outer_state) + update(grads, norm, finite, rep, opt) + (held,)

        def local_then_average(args):           # 1: and the average into the anchor
            anchor, outer_state, rep, opt, held = local(args)
            if mean is None:
                new, outer_state = averaging.outer_step(anchor, rep, outer_state, outer, "dp", n)
            else:                               # the compressed mean, its state kept
                delta, held = mean(averaging.changes(anchor, rep), held)
                new, outer_state = averaging.outer_move(anchor, delta, outer_state, outer)
            if after is not None:               # the average of masked replicas, masked
                with manual(("dp",)):
                    new = after(new, step + 1)
            return (new, outer_state, jax.tree.map(lambda a: a.astype(jnp.float32), new), opt,
                    held)

        def synchronous(args):                  # 2: DP's step: the token-mean gradient of all
            anchor, outer_state, rep, opt, held = args
            total = jnp.where(sums[1] > 0, sums[1], 1.0)
            avg = jax.tree.map(lambda g: jax.lax.psum(g * ntok, "dp") / total, grads)
            mnorm = optax.tree.norm(avg)
            rep, opt = update(avg, mnorm, jnp.isfinite(mnorm) & (sums[3] == 0), rep, opt)
            return (jax.tree.map(lambda a, r: r.astype(a.dtype), anchor, rep), outer_state,
                    rep, opt, held)     # every replica took the same step: no average needed

        branch = averaging.is_sync(step, H, warmup).astype(jnp.int32)
        branches = [local, local_then_average]
        if warmup:
            branch = jnp.where(step < warmup, 2, branch)
            branches.append(synchronous)
        anchor, outer_state, rep, opt, held = jax.lax.switch(
            branch, branches, (anchor, outer_state, rep, opt, held))
        comm = jax.tree.map(lambda a: a[None], {"params": rep, "opt_state": opt})
        if held is not None:
            comm["mean"] = held
        return (anchor, outer_state, comm, sums) + ((seen,) if probed else ())

    def train_step(state, batch):
        batch = dict(batch)
        limit = batch.pop(LOSS_LIMIT, jnp.float32(jnp.inf))
        with use_rules(mesh, placement.rules):
            scale = state.loss_scale["scale"] if state.loss_scale is not None else 1.0
            anchor = state.master if policy.master else state.params
            outer_state = state.opt_state
            if ctx.lay.memory_kinds:     # offloaded parts come to the device for the step
                anchor = jax.device_put(anchor, ctx.device_sh.master if policy.master
                                        else ctx.device_sh.params)
                outer_state = jax.device_put(outer_state, ctx.device_sh.opt_state)
            rows = jax.tree.map(lambda _: P("dp"), batch)
            rep_specs = jax.tree.map(lambda _: P("dp"), state.comm)
            probed = () if probe is None else (probe.read(getattr(state, probe.field)),)

            def same(tree):
                return jax.tree.map(lambda _: P(), tree)
            out = jax.shard_map(
                body, mesh=mesh, axis_names={"dp"}, check_vma=False,
                in_specs=(P(), same(anchor), same(outer_state), rep_specs, rows, P(), P())
                + tuple(same(p) for p in probed),
                out_specs=(same(anchor), same(outer_state), rep_specs, P())
                + tuple(same(p) for p in probed))(
                state.step, anchor, outer_state, state.comm, batch,
                jnp.asarray(scale, jnp.float32), limit, *probed)
            anchor, outer_state, comm, sums = out[:4]
        tokens = sums[1]
        finite, spikes = sums[3] == 0, sums[4]
        changes = {} if probe is None else {
            probe.field: probe.write(getattr(state, probe.field), out[4], finite)}
        new_state = dataclasses.replace(
            state, step=state.step + 1, params=policy.working(anchor), opt_state=outer_state,
            master=anchor if policy.master else None,
            loss_scale=policy.next_loss_scale(state.loss_scale, sums[3] == spikes), comm=comm,
            **changes)
        metrics = {"loss": sums[0] / jnp.where(tokens > 0, tokens, 1.0), "grad_norm": sums[2] / n,
                   "lr": ctx.learning_rate(state.step), "tokens": tokens,
                   "skipped": (~finite).astype(jnp.int32), "spike": spikes.astype(jnp.int32)}
        metrics.update({s: sums[n_metrics + i] / n for i, s in enumerate(stat_names)})
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale["scale"]
        return new_state, metrics

    return train_step


def outer_mean(spec, ctx):
    """None (the outer average is one fp32 all-reduce), or with `plan.compression` the method's
    compressed mean of the replicas' changes: `mean(changes, state) -> (Delta, state)` inside
    the step's region over dp, each device on its own shards of every leaf (a `shard_map` over
    the replica's axes), its state one slice per device (`TrainState.comm["mean"]`, [devices,
    ...] leaves, [devices / dp, ...] inside the region)."""
    if spec.compression == "none":
        return None
    from jaxscale.strategies import compression
    from jaxscale.strategies.dp.region import on_own_state
    method = on_own_state(compression.mean(spec))
    inner = tuple(a for a in ctx.placement.mesh.axis_names if a != "dp")
    specs = ctx.lay.specs.params

    def mean(delta, state):
        st_specs = None if state is None else jax.tree.map(lambda _: P(inner), state)
        return jax.shard_map(lambda d, st: method(d, st, None),
                             mesh=jax.sharding.get_abstract_mesh(), in_specs=(specs, st_specs),
                             out_specs=(specs, st_specs), axis_names=set(inner),
                             check_vma=False)(delta, state)
    return mean
