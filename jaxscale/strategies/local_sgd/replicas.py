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
from jaxscale.strategies.local_sgd import averaging, fragments


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

    delay = spec.outer_delay           # streaming: fragments, or each average one step late
    part = stream_parts(spec, ctx, outer, n, mean) if spec.outer_fragments > 1 or delay else None

    def body(step, anchor, outer_state, comm, batch, scale, limit, *probed):
        """One device: its replica's inner step, then (every H-th step) the average; in
        post_local's warmup DP's step instead (`lax.switch`, the branches of `branch_share`).
        Streaming (`plan.outer_fragments`, `plan.outer_delay`): one branch per group of
        fragments, each averaging its fragments only; delayed, each branch computes its own
        step, so that the average (taken from the replica as the step starts) overlaps it.
        `probed`: a probe's inputs (fp8 QAT's scales); what the replicas saw is combined over
        dp (the largest amax)."""
        rep, opt = jax.tree.map(lambda a: a[0], (comm["params"], comm["opt_state"]))
        held = comm.get("mean")          # the compressed mean's state, this dp rank's devices

        def inner(rep):
            """The replica's gradients, norm, verdict and its metrics (summed over dp here, or,
            delayed, after the switch: XLA would otherwise combine the two all-reduces of a
            branch into one, and the average would wait for the step's loss)."""
            with manual(("dp",)):
                grads, loss, ntok, stats = grads_fn(policy.working(rep), batch, scale,
                                                    **({"probe": probed[0]} if probed else {}))
            seen = stats.pop(PROBE, None)
            if seen is not None:
                seen = jax.tree.map(lambda a: jax.lax.pmax(a, "dp"), seen)
            norm = optax.tree.norm(grads)
            finite, spike = accepted(loss, norm, limit)     # a replica whose loss spiked skips
            # the metrics, for logging and loss scaling: no local update waits for them
            vec = jnp.stack([loss * ntok, ntok, norm, (~finite).astype(jnp.float32),
                             spike.astype(jnp.float32)] + [stats[s] for s in stat_names])
            return grads, ntok, norm, finite, vec if delay else jax.lax.psum(vec, "dp"), seen

        pre = None if delay else inner(rep)

        def update(grads, norm, finite, rep, opt):
            updates, new_opt = optimizer.update(grads, opt, rep, grad_norm=norm)
            new = keep_if_finite(finite, optax.apply_updates(rep, updates), rep)
            if after is not None:
                with manual(("dp",)):
                    new = after(new, step + finite)
            return new, keep_if_finite(finite, new_opt, opt)

        def local(args):                        # 0: the replica's own step
            anchor, outer_state, rep, opt, held = args
            out = pre if pre is not None else inner(rep)
            grads, _, norm, finite, _, _ = out
            return (anchor, outer_state) + update(grads, norm, finite, rep, opt) + (held, out)

        def masked(anchor, at):
            if after is None:
                return anchor
            with manual(("dp",)):               # the average of masked replicas, masked
                return after(anchor, at)

        def local_then_average(args):           # 1: and the average into the anchor
            anchor, outer_state, rep, opt, held, out = local(args)
            if mean is None:
                new, outer_state = averaging.outer_step(anchor, rep, outer_state, outer, "dp", n)
            else:                               # the compressed mean, its state kept
                delta, held = mean(averaging.changes(anchor, rep), held)
                new, outer_state = averaging.outer_move(anchor, delta, outer_state, outer)
            new = masked(new, step + 1)
            return (new, outer_state, jax.tree.map(lambda a: a.astype(jnp.float32), new), opt,
                    held, out)

        def fragments_then_average(frags):      # 1 + g: and the average of group g's fragments
            def run(args):
                if delay:                       # from the replica as the step starts
                    delta, held = part.delta(frags, args[0], args[2], args[4])
                    anchor, outer_state, rep, opt, _, out = local(args)
                else:                           # from the replica after its inner step
                    anchor, outer_state, rep, opt, held, out = local(args)
                    delta, held = part.delta(frags, anchor, rep, held)
                anchor, outer_state = part.move(frags, anchor, outer_state, delta)
                anchor = masked(anchor, step + 1)
                return (anchor, outer_state, part.merge(frags, rep, anchor), opt, held, out)
            return run

        def synchronous(args):                  # last: DP's step: the token-mean gradient of all
            anchor, outer_state, rep, opt, held = args
            out = pre if pre is not None else inner(rep)
            grads, ntok, _, _, sums, _ = out
            sums = jax.lax.psum(sums, "dp") if delay else sums
            total = jnp.where(sums[1] > 0, sums[1], 1.0)
            avg = jax.tree.map(lambda g: jax.lax.psum(g * ntok, "dp") / total, grads)
            mnorm = optax.tree.norm(avg)
            rep, opt = update(avg, mnorm, jnp.isfinite(mnorm) & (sums[3] == 0), rep, opt)
            return (jax.tree.map(lambda a, r: r.astype(a.dtype), anchor, rep), outer_state,
                    rep, opt, held, out)  # every replica took the same step: no average needed

        if part is None:
            branch = averaging.is_sync(step, H, warmup).astype(jnp.int32)
            branches = [local, local_then_average]
        else:
            branch = part.branch(step)
            branches = [local] + [fragments_then_average(g) for g in part.groups]
        if warmup:
            branch = jnp.where(step < warmup, len(branches), branch)
            branches.append(synchronous)
        def metrics_out(fn):                    # a branch's outputs: the step's metrics,
            def run(args):                      # not its gradients
                *kept, out = fn(args)
                return (*kept, out[4], out[5])
            return run
        anchor, outer_state, rep, opt, held, sums, seen = jax.lax.switch(
            branch, [metrics_out(b) for b in branches], (anchor, outer_state, rep, opt, held))
        sums = jax.lax.psum(sums, "dp") if delay else sums
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
    inner = tuple(a for a in ctx.placement.mesh.axis_names if a != "dp")
    specs = ctx.lay.specs.params

    def mean(delta, state, specs=specs):
        """The method on the shards it is given (top-k's k is its density of them)."""
        def local(d, st):
            shapes = [x.shape for x in jax.tree.leaves(d)]
            return on_own_state(compression.mean(spec, shapes))(d, st, None)
        st_specs = None if state is None else jax.tree.map(lambda _: P(inner), state)
        return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                             in_specs=(specs, st_specs), out_specs=(specs, st_specs),
                             axis_names=set(inner), check_vma=False)(delta, state)
    return mean


class stream_parts:
    """Streaming DiLoCo's pieces of the step (`plan.outer_fragments`, `plan.outer_delay`,
    `plan.outer_mix`; `jaxscale.strategies.local_sgd.fragments`): which group of fragments a
    step averages, the all-reduced mean change of a group's parts, the outer optimizer's move of
    those parts of the anchor (and of its momentum), and the replica's parts restarted from it."""

    def __init__(self, spec, ctx, outer, n, mean):
        self.spec, self.outer, self.n, self.mean = spec, outer, n, mean
        F, H = spec.outer_fragments, spec.local_steps
        self.groups = fragments.groups(F, H)
        self.table = fragments.branch_table(F, H)
        self.cut = fragments.Cut.of(ctx.model.abstract_params, F, spec.deg("pp"), spec)
        self.specs = jax.tree.leaves(ctx.lay.specs.params, is_leaf=lambda x: isinstance(x, P))

    def branch(self, step):
        """0, or 1 + the group averaged at `step`: after inner-step count c = step + 1 (the
        delayed average: the count c = step the step starts from), less post_local's warmup."""
        c = step + 1 - self.spec.outer_delay - self.spec.local_warmup
        at = jnp.asarray(self.table, jnp.int32)[jnp.remainder(c, self.spec.local_steps)]
        return jnp.where(c >= 1, at, 0)

    def delta(self, frags, anchor, rep, held):
        """The mean over dp of the fp32 changes anchor - replica of the fragments' parts (one
        all-reduce, or the plan's compressed mean: a stateful method's state is one per group,
        of the group's parts, `local_sgd.init_state`), and the compression state."""
        a, r = (self.cut.take(jax.tree.leaves(t), frags) for t in (anchor, rep))
        d = [x.astype(jnp.float32) - y.astype(jnp.float32) for x, y in zip(a, r)]
        if self.mean is None:
            return [x / self.n for x in jax.lax.psum(d, "dp")], held
        specs = [self.specs[j] for j, _ in self.cut.members(frags)]
        if held is None:
            return self.mean(d, None, specs)[0], None
        g = self.groups.index(tuple(frags))
        mean, own = self.mean(d, held[g], specs)
        return mean, held[:g] + [own] + held[g + 1:]

    def move(self, frags, anchor, outer_state, delta):
        """The outer optimizer's step of the fragments' parts of the anchor by `delta` (its
        momentum's parts with them; the other parts keep theirs)."""
        leaves, tdef = jax.tree.flatten(anchor)
        trace = optax.tree_utils.tree_get(outer_state, "trace")
        state = outer_state
        if trace is not None:
            state = optax.tree_utils.tree_set(
                outer_state, trace=self.cut.take(jax.tree.leaves(trace), frags))
        new, state = averaging.outer_move(self.cut.take(leaves, frags), delta, state, self.outer)
        anchor = jax.tree.unflatten(tdef, self.cut.put(leaves, frags, new))
        if trace is not None:
            moved = self.cut.put(jax.tree.leaves(trace), frags,
                                 optax.tree_utils.tree_get(state, "trace"))
            outer_state = optax.tree_utils.tree_set(
                outer_state, trace=jax.tree.unflatten(jax.tree.structure(trace), moved))
        return anchor, outer_state

    def merge(self, frags, rep, anchor):
        """The replica's parts of the fragments from the new anchor: replaced, or with the
        delayed average mixed, alpha x the replica's own + (1 - alpha) x the anchor's
        (`plan.outer_mix` = alpha: what the replica learnt during the step the average took)."""
        leaves, tdef = jax.tree.flatten(rep)
        alpha = self.spec.outer_mix if self.spec.outer_delay else 0.0
        return jax.tree.unflatten(tdef, self.cut.merge(leaves, jax.tree.leaves(anchor), frags,
                                                       alpha))
