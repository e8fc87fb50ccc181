"""The pure train and eval steps, and their jitted, sharded forms.

Loss: token-mean cross entropy over the unmasked targets: the sum of per-token losses over every
micro-batch divided by the number of real tokens in the whole batch, so padding never dilutes the
mean and k micro-batches give the gradients of one k-times batch.

One step, in order: offloaded working parameters to the device; k micro-batch gradients (of the
loss times the loss scale) summed in a `lax.scan` (with mesh.pp > 1: run through the stages by
the plan's pipeline schedule, `train.pipeline`); division by tokens x scale (with
`plan.compression`: each device's gradients averaged over dp by the compression method,
`strategies.compression.wrap`, its error-feedback state in `TrainState.comm`); the gradients'
sharding for the ZeRO stage (replicated over dp for 0/1, sharded for 2/3); their global norm; the
optimizer update of the fp32 master (or of the parameters) and the new 16-bit working parameters,
clipped by that norm: the whole state at once, or, with host offload, streamed through the device
layer by layer and written back into host memory (`offload.streamed_update`). A step whose loss
or gradient norm is not finite leaves parameters, master and optimizer state untouched, reports
`skipped=1` and (with loss scaling) halves the scale; carrying on or stopping is the loop's
policy. The train state is donated: its buffers are reused for the new state.

With `plan.local_sgd` the step is another one (`strategies.local_sgd.make_train_step`): the
same gradients per device in `jax.shard_map` over dp, each device's own optimizer update of its
replica (`TrainState.comm`), and every H-th step the average into the anchor (`params`).

With `plan.qat=fp8` (delayed scaling) the per-layer fp8 scales from `TrainState.quant` go into
the grads function, the amaxes the matmuls saw come out beside the gradients (as the scales'
cotangent, `jaxscale.strategies.qat.numerics`), and the step rolls them into the histories.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxscale.strategies.qat import numerics
from jaxscale.axes import use_rules
from jaxscale.strategies import accumulate, compression, offload, overlap, pp, sp
from jaxscale.strategies.precision import (cast_tree, keep_if_finite, update_if_finite,
                                           update_loss_scale)
from jaxscale.train.state import (FunctionalModel, StateLayout, TrainState, _is_spec,
                                  named_shardings)


#: a batch's arrays, all [B, T]; packed documents (`data.shards`) add per-document positions (RoPE)
#: and segment ids (attention within a document)
BATCH_KEYS = ("inputs", "targets", "mask")
PACKED_KEYS = ("positions", "segment_ids")


def batch_logical(seq: str | None = "seq", packed: bool = False) -> dict[str, tuple]:
    return {k: ("batch", seq) for k in BATCH_KEYS + (PACKED_KEYS if packed else ())}


def batch_shardings(placement, packed: bool = False) -> dict[str, NamedSharding]:
    seq = sp.batch_seq_axis(placement.spec)
    return {k: placement.sharding(v) for k, v in batch_logical(seq, packed).items()}


def token_loss(logits_BTV, targets_BT, mask_BT):
    """(sum of masked token losses, number of real tokens)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def make_grads_fn(model: FunctionalModel, k: int = 1, block_wrapper: Callable | None = None,
                  layout: Callable | None = None, with_stats: bool = False, distill=None):
    """(params, batch, scale) -> (token-mean gradients in fp32, loss, tokens), over k micro-batches
    (`with_stats`: and a dict of the mixture-of-experts metrics, `MOE_METRICS`; {} if dense).
    `distill` (`jaxscale.train.distill.Teacher`): the grads_fn takes the teacher's parameters as a
    fourth argument and optimises a T^2 KL(teacher || student) + (1 - a) CE per token
    (`Teacher.objective`); the reported `loss` stays the cross entropy, `distill_kd` the KL term.

    Differentiates sum(token losses) x scale / (B x T): gradients the size of a mean loss's (what a
    loss scale is tuned for), rescaled exactly to the token mean afterwards. `layout` (context
    parallelism, `sp.batch_layout`) permutes the batch's tokens first and adds their positions:
    a token mean does not depend on the order.

    A mixture-of-experts model optimises loss + moe_aux_weight x aux + moe_z_weight x z, each
    router loss averaged over the micro-batches (`models/moe.py`); the reported `loss` is the
    cross entropy alone (what `eval` reports). The router terms enter each micro-batch's sum
    times (real tokens of the whole batch) / k, so the division by the token count leaves them
    at their weights exactly."""
    moe = model.cfg.moe_experts > 0

    def sum_loss(params, batch, factor, reg_tokens, teacher=None):
        if not moe:
            logits = model.apply(params, batch["inputs"], batch.get("positions"),
                                 batch.get("segment_ids"), block_wrapper=block_wrapper)
            total, n = token_loss(logits, batch["targets"], batch["mask"])
            if distill is None:
                return total * factor, (total, n)
            objective, kd = distill.objective(logits, total, batch, teacher)
            return objective * factor, (total, n, kd)
        logits, aux = model.module(params)(batch["inputs"], batch.get("positions"),
                                           batch.get("segment_ids"), block_wrapper,
                                           return_aux=True)
        total, n = token_loss(logits, batch["targets"], batch["mask"])
        reg = model.cfg.moe_aux_weight * aux["aux_loss"] + model.cfg.moe_z_weight * aux["z_loss"]
        stats = tuple(aux[key] for key in ("aux_loss", "z_loss", "dropped", "routed"))
        if distill is None:
            return (total + reg * reg_tokens) * factor, (total, n, stats)
        objective, kd = distill.objective(logits, total, batch, teacher)
        return (objective + reg * reg_tokens) * factor, (total, n, stats, kd)

    def grads_fn(params, batch, scale=1.0, teacher=None, *, quant=None):
        batch = layout(batch) if layout else batch
        slots = batch["targets"].size
        reg_tokens = jnp.sum(batch["mask"].astype(jnp.float32)) / k if moe else None
        fn = lambda p, b: sum_loss(p, b, scale / slots, reg_tokens, teacher)  # noqa: E731
        if quant is not None:   # fp8 delayed scaling: per-layer scales in, their amaxes out
            fn, params = numerics.probing(fn), (params, quant)
        grads, (total, ntok, *rest) = accumulate.grads(
            fn, params, batch, k, combine=None if quant is None else (jnp.add, jnp.maximum))
        amax = None
        if quant is not None:   # the "gradient" of the scales: the amaxes seen (max over k)
            grads, amax = grads
        kd, rest = (rest[-1], rest[:-1]) if distill is not None else (None, rest)
        denom = jnp.where(ntok > 0, ntok, 1.0) / slots * scale
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads)
        loss = total / jnp.where(ntok > 0, ntok, 1.0)
        if not with_stats:
            return grads, loss, ntok
        stats = {}
        if moe:
            aux, z, dropped, routed = rest[0]
            stats = {"moe_aux_loss": aux / k, "moe_z_loss": z / k, "moe_dropped": dropped / routed}
        if distill is not None:
            stats["distill_kd"] = kd / jnp.where(ntok > 0, ntok, 1.0)
        if amax is not None:
            stats[numerics.AMAX] = amax
        return grads, loss, ntok, stats
    return grads_fn


#: the train step's metrics of a mixture-of-experts model: the router losses (unweighted, averaged
#: over layers and micro-batches) and the fraction of expert assignments dropped by capacity
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")
#: with a distillation teacher (`train.teacher`): the token-mean T^2 KL(teacher || student)
DISTILL_METRICS = ("distill_kd",)


def plan_grads_fn(model: FunctionalModel, placement, k: int = 1,
                  block_wrapper: Callable | None = None, with_stats: bool = False, distill=None):
    """`make_grads_fn` for the plan: through the pipeline engine when mesh.pp > 1 (its k
    micro-batches are the schedule's m), with context parallelism's token layout when sp > 1."""
    if pp.active(placement.spec):
        from jaxscale.strategies.pp import engine
        fn = engine.make_grads_fn(model, placement, block_wrapper)
        return fn if with_stats else (lambda *a: fn(*a)[:3])
    return make_grads_fn(model, k, block_wrapper, sp.batch_layout(placement.spec), with_stats,
                         distill)


def make_train_step(model: FunctionalModel, optimizer, schedule, placement, policy,
                    lay: StateLayout, device_sh: TrainState, host_sh: TrainState, k: int = 1,
                    block_wrapper: Callable | None = None, distill=None):
    """The train step (state, batch) -> (state, metrics); with `distill` (a `distill.Teacher`)
    (state, batch, teacher params) -> ..., the teacher's parameters an argument (not donated,
    not in the state). With `plan.prune`, the updated weights are masked (`prune.pruner`)."""
    from jaxscale.strategies import local_sgd, prune, sparse_embedding
    if local_sgd.active(placement.spec):    # replicas trained apart, averaged every H steps
        return local_sgd.make_train_step(model, optimizer, schedule, placement, policy, k,
                                         block_wrapper)
    grads_fn = plan_grads_fn(model, placement, k, block_wrapper, with_stats=True,
                             distill=distill)
    # the dp mean in shard_map: by the compression method, or exchanging sparse embedding rows
    sparse = sparse_embedding.mean(placement.spec) if sparse_embedding.active(placement.spec) \
        else None
    compressed = compression.wrap(grads_fn, placement, mean=sparse) \
        if compression.active(placement.spec) or sparse else None
    pruner = prune.pruner(placement.spec, model.logical, placement.mesh,
                          lay.specs.shards if lay.master else lay.specs.params) \
        if prune.active(placement.spec) else None
    grads_sh = named_shardings(placement, lay.specs.grads)
    param_index = jax.tree.unflatten(jax.tree.structure(model.abstract_params),
                                     range(len(jax.tree.leaves(model.abstract_params))))
    stacked = {j for j, names in enumerate(jax.tree.leaves(model.logical, is_leaf=_is_spec))
               if tuple(names)[:1] == ("layers",)}

    def to(tree, shardings):
        return offload.move(tree, shardings, lay.offload)

    def train_step(state: TrainState, batch, *teacher):
        with use_rules(placement.mesh, placement.rules):
            params = to(state.params, device_sh.params)
            scale = state.loss_scale["scale"] if state.loss_scale is not None else 1.0
            if compressed:
                grads, loss, ntok, moe_stats, comm = compressed(params, batch, jnp.asarray(
                    scale, jnp.float32), state.comm, *teacher)
            else:
                fp8 = {} if state.quant is None else {"quant": numerics.scales(state.quant)}
                grads, loss, ntok, moe_stats = grads_fn(params, batch, scale, *teacher, **fp8)
                comm = state.comm
            amax = moe_stats.pop(numerics.AMAX, None)      # fp8 QAT: the amaxes the matmuls saw
            grads = jax.lax.with_sharding_constraint(grads, grads_sh)
            grad_norm = optax.tree.norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            quant = state.quant if amax is None else numerics.update_history(state.quant, amax, finite)
            if comm is not None:        # a skipped step keeps its error-feedback residual too
                comm = keep_if_finite(finite, comm, state.comm)

            has_master = lay.master

            def update(inputs, state):
                """The optimizer update of the whole state or of any piece of it (a tree with
                `None` where a leaf is not in the piece): element-wise but for the clip, which
                takes the global norm of all the gradients."""
                grads, norm = inputs
                opt_state, target = state
                updates, new_opt = optimizer.update(grads, opt_state, target, grad_norm=norm)
                return new_opt, optax.apply_updates(target, updates)

            def working(target):        # the working parameters of the updated target
                return cast_tree(target, policy.param_dtype) if has_master else target

            if lay.offload:       # streamed: one layer's offloaded state on the device at a time
                def piece(grads, opt_state, master, params):
                    old = (opt_state, master if has_master else params)
                    new_opt, target = keep_if_finite(finite, update((grads, grad_norm), old), old)
                    return working(target), new_opt, target if has_master else None

                opt_index = optax.tree_map_params(optimizer, lambda _, j: j, state.opt_state,
                                                  param_index, transform_non_params=lambda _: -1)
                # the working parameters are written in place where they live
                new_params, new_opt, new_master = offload.streamed_update(
                    piece, (grads, state.opt_state, state.master, state.params),
                    arg_sh=(grads_sh, host_sh.opt_state, host_sh.master, host_sh.params),
                    out_sh=(host_sh.params, host_sh.opt_state, host_sh.master),
                    out_like=(3, 1, 2),
                    index=(param_index, opt_index, param_index if has_master else None,
                           param_index),
                    stacked=stacked, after=grad_norm)
            else:       # on each device's optimizer shards; a skipped step changes nothing
                shards, opt_specs = lay.specs.shards, jax.tree.map(lambda sh: sh.spec,
                                                                   device_sh.opt_state)
                new_opt, target = update_if_finite(
                    finite, update, (grads, grad_norm),
                    (state.opt_state, state.master if has_master else params),
                    placement.mesh, ((shards, P()), (opt_specs, shards)))
                if pruner is not None:      # the masks for the updates done (as they were
                    target = pruner(target, state.step + finite)    # when the step is skipped)
                new_params, new_master = working(target), target if has_master else None

        new_state = TrainState(
            step=state.step + 1, params=new_params, opt_state=new_opt, master=new_master,
            loss_scale=update_loss_scale(state.loss_scale, finite, policy.growth_interval),
            comm=comm, quant=quant)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                   "tokens": ntok, "skipped": (~finite).astype(jnp.int32), **moe_stats}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale["scale"]
        return new_state, metrics

    return train_step


def make_eval_step(model: FunctionalModel, placement, device_param_sh):
    layout = sp.batch_layout(placement.spec)
    if pp.active(placement.spec):
        from jaxscale.strategies.pp import engine
        loss_fn = engine.make_grads_fn(model, placement, forward_only=True)

        def pipelined(params, batch):
            with use_rules(placement.mesh, placement.rules):
                return loss_fn(jax.device_put(params, device_param_sh), batch)
        return pipelined

    def eval_step(params, batch):
        with use_rules(placement.mesh, placement.rules):
            batch = layout(batch) if layout else batch
            logits = model.apply(jax.device_put(params, device_param_sh), batch["inputs"],
                                 batch.get("positions"), batch.get("segment_ids"))
        return token_loss(logits, batch["targets"], batch["mask"])
    return eval_step


def jit_train_step(step_fn, state_sh: TrainState, placement, donate: bool = True,
                   packed: bool = False, teacher_sh=None):
    """`teacher_sh`: the shardings of a distillation teacher's parameters, the third argument."""
    extra = () if teacher_sh is None else (teacher_sh,)
    return jax.jit(step_fn, in_shardings=(state_sh, batch_shardings(placement, packed)) + extra,
                   out_shardings=(state_sh, placement.replicated()),
                   donate_argnums=(0,) if donate else (),
                   compiler_options=overlap.compiler_options(placement.spec.xla_preset) or None)


def jit_eval_step(eval_fn, state_sh: TrainState, placement, packed: bool = False):
    return jax.jit(eval_fn, in_shardings=(state_sh.params, batch_shardings(placement, packed)),
                   out_shardings=placement.replicated())

