"""The train and eval steps, built from the plan's step parts, and their jitted, sharded forms.

The plan's strategies do not appear here by name: each sets the parts of the step it changes
(`jaxscale.strategies.common.StepParts`, composed in the plan's written order by
`jaxscale.plan.step_parts`), and the step is this skeleton around them. One step, in order:

1. the working parameters to the device (from host memory when `parts.memory_kinds` puts them
   there);
2. the gradients of the loss times the loss scale (`parts.policy`), token-mean, in fp32, by the
   plan's grads function (`grads.plan_grads_fn`: the pipeline engine, or the model over the
   micro-batches, through the batch view, with a probe's inputs); with `parts.reduce` they are
   computed in the data region and reduced there once per step (`strategies.dp.region`: a
   once-per-step sync, gradient compression or the sparse embedding exchange, whose per-device
   state is `TrainState.comm`);
3. the gradients in their ZeRO layout (`StateLayout.specs.grads`), their global norm, and whether
   the step is finite (loss and norm);
4. the optimizer update of the fp32 master (or of the parameters), clipped by that norm: by
   default on each device's optimizer shards inside `jax.shard_map`, as one `lax.cond` that
   leaves the state untouched when the step is not finite (`guarded_update`); with `parts.update`
   (host offload) the strategy's own (streamed through the device layer by layer); then
   `parts.after_update` (pruning's masks) and the new working parameters (`Policy.working`);
5. the probe's state (fp8 QAT's amax histories) and the loss scale rolled forward.

A step whose loss or gradient norm is not finite leaves parameters, master and optimizer state
untouched, reports `skipped=1` and (with loss scaling) halves the scale; so does a loss above
the batch's `LOSS_LIMIT` (`train.spike_policy=skip`), reported as `spike=1` too, without
halving; carrying on or stopping is the loop's policy. The train state is donated: its buffers
are reused for the new state. `parts.train_step` (local SGD) replaces the whole step with the
strategy's own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxscale.axes import use_rules
from jaxscale.strategies.common import (
    LOSS_LIMIT,
    StepParts,
    accepted,
    keep_if_finite,
    no_overflow,
)
from jaxscale.train import grads as grads_lib
from jaxscale.train.state import (
    FunctionalModel,
    StateLayout,
    TrainState,
    is_partition,
    named_shardings,
)

#: a batch's arrays, all [B, T]; packed documents (`data.shards`) add per-document positions (RoPE)
#: and segment ids (attention within a document)
BATCH_KEYS = ("inputs", "targets", "mask")
PACKED_KEYS = ("positions", "segment_ids")


def batch_logical(seq: str | None = "seq", packed: bool = False) -> dict[str, tuple]:
    return {k: ("batch", seq) for k in BATCH_KEYS + (PACKED_KEYS if packed else ())}


def batch_shardings(placement, parts: StepParts, packed: bool = False) -> dict:
    """Where each array of a batch lives: split over the data axes, along the sequence as
    `parts.batch_seq` says (whole under context parallelism, whose layout the step applies)."""
    return {k: placement.sharding(v) for k, v in batch_logical(parts.batch_seq, packed).items()}


@dataclass
class StepContext:
    """What the step is built with, and what a strategy's step parts read (`parts.update`,
    `parts.after_update`, `parts.train_step` are called with it)."""
    model: FunctionalModel
    optimizer: Any
    learning_rate: Callable          # step -> the learning rate
    placement: Any                   # jaxscale.plan.Placement
    policy: Any                      # parts.policy
    lay: StateLayout
    device_sh: TrainState            # the state's shardings, all in device memory
    host_sh: TrainState              # where the state lives (memory kinds included)
    parts: StepParts
    grads_fn: Callable = None        # the plan's grads function, with statistics
    stat_names: tuple = ()           # the metrics its statistics carry
    reduce: Callable = None          # parts.reduce applied to it (the data region), or None

    def __post_init__(self):
        abstract = self.model.abstract_params
        #: a tree of parameter-leaf numbers, and the numbers of the layer-stacked leaves
        self.param_index = jax.tree.unflatten(jax.tree.structure(abstract),
                                              range(len(jax.tree.leaves(abstract))))
        self.stacked = {j for j, names in enumerate(jax.tree.leaves(self.model.logical,
                                                                    is_leaf=is_partition))
                        if tuple(names)[:1] == ("layers",)}
        self.grads_sh = named_shardings(self.placement, self.lay.specs.grads)

    def gradients(self, state, batch, *teacher):
        """Steps 1-3 of the module docstring, in the plan's rules: (the working parameters on the
        device, the gradients in their ZeRO layout, their global norm, whether the step is
        finite, loss, tokens, statistics, a probe's cotangent or None, the new
        `TrainState.comm`). Needs `grads_fn` and `reduce`
        (`make_train_step` sets them); a strategy's own step (the host-driven offload) calls it
        too."""
        lay, probe = self.lay, self.parts.probe
        batch = dict(batch)
        limit = batch.pop(LOSS_LIMIT, None)
        with use_rules(self.placement.mesh, self.placement.rules):
            params = state.params if not lay.memory_kinds else jax.device_put(
                state.params, self.device_sh.params)
            scale = state.loss_scale["scale"] if state.loss_scale is not None else 1.0
            comm = state.comm
            seen = {} if probe is None else {"probe": probe.read(getattr(state, probe.field))}
            if self.reduce is not None:
                grads, loss, ntok, stats, comm = self.reduce(params, batch, jnp.asarray(
                    scale, jnp.float32), state.comm, *teacher, **seen)
            else:
                grads, loss, ntok, stats = self.grads_fn(params, batch, scale, *teacher, **seen)
            seen = stats.pop(grads_lib.PROBE, None)
            grads = jax.lax.with_sharding_constraint(grads, self.grads_sh)
            norm = optax.tree.norm(grads)
            finite, spike = accepted(loss, norm, limit)
            if spike is not None:
                stats = {**stats, "spike": spike.astype(jnp.int32)}
            if comm is not None:        # a skipped step keeps its error-feedback residual too
                comm = keep_if_finite(finite, comm, state.comm)
        return params, grads, norm, finite, loss, ntok, stats, seen, comm

    def metrics(self, state, loss, norm, ntok, finite, stats) -> dict:
        """The step's metrics: loss, gradient norm, learning rate, tokens, skipped, the grads
        function's statistics and the loss scale."""
        out = {"loss": loss, "grad_norm": norm, "lr": self.learning_rate(state.step),
               "tokens": ntok, "skipped": (~finite).astype(jnp.int32), **stats}
        if state.loss_scale is not None:
            out["loss_scale"] = state.loss_scale["scale"]
        return out

    def apply_update(self, inputs, state):
        """The optimizer update of the whole state or of any piece of it (a tree with `None`
        where a leaf is not in the piece): element-wise but for the clip, which takes the global
        norm of all the gradients. inputs = (grads, norm), state = (opt state, target)."""
        grads, norm = inputs
        opt_state, target = state
        updates, new_opt = self.optimizer.update(grads, opt_state, target, grad_norm=norm)
        return new_opt, optax.apply_updates(target, updates)


def guarded_update(ctx: StepContext):
    """The default update: on each device's optimizer shards, a skipped step changing nothing
    (`update_if_finite`), then `parts.after_update` and the working parameters."""
    lay, policy, mesh = ctx.lay, ctx.policy, ctx.placement.mesh
    shards = lay.specs.shards
    opt_specs = jax.tree.map(lambda sh: sh.spec, ctx.device_sh.opt_state)
    after = ctx.parts.after_update(ctx) if ctx.parts.after_update else None

    def run(grads, norm, finite, state, params):
        new_opt, target = update_if_finite(
            finite, ctx.apply_update, (grads, norm),
            (state.opt_state, state.master if lay.master else params),
            mesh, ((shards, P()), (opt_specs, shards)))
        if after is not None:       # for the updates done (as they were when the step is skipped)
            target = after(target, state.step + finite)
        return policy.working(target), new_opt, target if lay.master else None
    return run


def update_if_finite(finite, fn, inputs, state, mesh, specs):
    """The step's guard on the optimizer update: `fn(inputs, state)` (the new state) where the
    step was finite, else `state` untouched, as one `lax.cond`.

    Not a select of new against old: the old state is donated and updated in place, and a
    select reads it again after the update, so XLA copies the whole fp32 state at the step's
    entry (tiny dp8 bf16: compiled temp 6.78 MB with the select, 4.34 MB with the cond, the
    same as with no guard). The cond runs in `jax.shard_map` on each device's own shards
    (`specs`: the inputs' and the state's mesh specs): the update is element-wise there, so the
    branch needs no collective, and GSPMD has no branch to reshard the state through (a cond
    under GSPMD added collective-permutes to ZeRO-1 on dp2xfsdp2xtp2)."""
    def guarded(finite, inputs, state):
        return jax.lax.cond(finite, fn, lambda _, s: s, inputs, state)
    return jax.shard_map(guarded, mesh=mesh, in_specs=(P(),) + tuple(specs),
                         out_specs=specs[1], check_vma=False)(finite, inputs, state)


def make_train_step(ctx: StepContext, distill=None, with_grads: bool = False):
    """The train step (state, batch) -> (state, metrics); with `distill` (a `distill.Teacher`)
    (state, batch, teacher params) -> ..., the teacher's parameters an argument (not donated,
    not in the state). `with_grads`: the metrics also carry `grads`, the mean gradients the
    update read (the numerics tests compare them with one device's, without a second compile)."""
    parts, placement, policy = ctx.parts, ctx.placement, ctx.policy
    ctx.grads_fn = grads_lib.plan_grads_fn(ctx.model, placement, parts, with_stats=True,
                                           distill=distill)
    ctx.stat_names = grads_lib.stat_names(ctx.model, distill)
    ctx.reduce = parts.reduce(ctx.grads_fn, ctx) if parts.reduce else None
    if parts.train_step is not None:          # a strategy's own step (local SGD)
        return parts.train_step(ctx)
    probe = parts.probe
    update = parts.update(ctx) if parts.update else guarded_update(ctx)

    def train_step(state: TrainState, batch, *teacher):
        params, grads, grad_norm, finite, loss, ntok, stats, seen, comm = ctx.gradients(
            state, batch, *teacher)
        with use_rules(placement.mesh, placement.rules):
            new_params, new_opt, new_master = update(grads, grad_norm, finite, state, params)
        changes = {}
        if seen is not None:
            changes[probe.field] = probe.write(getattr(state, probe.field), seen, finite)
        new_state = dataclasses.replace(
            state, step=state.step + 1, params=new_params, opt_state=new_opt, master=new_master,
            loss_scale=policy.next_loss_scale(state.loss_scale, no_overflow(finite, stats)),
            comm=comm, **changes)
        metrics = ctx.metrics(state, loss, grad_norm, ntok, finite, stats)
        if with_grads:
            metrics["grads"] = grads
        return new_state, metrics

    return train_step


def make_eval_step(model: FunctionalModel, placement, parts: StepParts, device_param_sh):
    """(params, batch) -> (sum of token losses, tokens): the forward of the plan (through a
    strategy's own grads function when it has one: the pipeline engine's forward)."""
    if parts.grads is not None:
        loss_fn = parts.grads(model, placement, parts, forward_only=True)

        def own(params, batch):
            with use_rules(placement.mesh, placement.rules):
                return loss_fn(jax.device_put(params, device_param_sh), batch)
        return own
    view = parts.batch_view

    def eval_step(params, batch):
        with use_rules(placement.mesh, placement.rules):
            batch = view(batch) if view else batch
            logits = model.apply(jax.device_put(params, device_param_sh), batch["inputs"],
                                 batch.get("positions"), batch.get("segment_ids"))
        return grads_lib.token_loss(logits, batch["targets"], batch["mask"])
    return eval_step


def jit_train_step(step_fn, state_sh: TrainState, placement, parts: StepParts,
                   donate: bool = True, packed: bool = False, teacher_sh=None,
                   with_grads: bool = False, spike_guard: bool = False):
    """`teacher_sh`: the shardings of a distillation teacher's parameters, the third argument.
    `spike_guard`: batches carry `LOSS_LIMIT` (replicated), a loss above it skips the update.
    The metrics come back replicated, but for `with_grads`' gradients, which stay where the
    update read them (gathering them would add collectives the plan does not have)."""
    extra = () if teacher_sh is None else (teacher_sh,)
    if getattr(step_fn, "host_driven", False):       # a step driven from the host, jits its parts
        return step_fn
    return jax.jit(step_fn,
                   in_shardings=(state_sh, batch_shardings(placement, parts, packed) | (
                       {LOSS_LIMIT: placement.replicated()} if spike_guard else {})) + extra,
                   out_shardings=(state_sh, None if with_grads else placement.replicated()),
                   donate_argnums=(0,) if donate else (),
                   compiler_options=dict(parts.compiler_options) or None)


def jit_eval_step(eval_fn, state_sh: TrainState, placement, parts: StepParts,
                  packed: bool = False):
    return jax.jit(eval_fn,
                   in_shardings=(state_sh.params, batch_shardings(placement, parts, packed)),
                   out_shardings=placement.replicated())

