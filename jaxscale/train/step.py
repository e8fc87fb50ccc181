"""The pure train and eval steps, and their jitted, sharded forms.

Loss: token-mean cross entropy over the unmasked targets: the sum of per-token losses over every
micro-batch divided by the number of real tokens in the whole batch, so padding never dilutes the
mean and k micro-batches give the gradients of one k-times batch.

One step, in order: offloaded state to the device; k micro-batch gradients (of the loss times the
loss scale) summed in a `lax.scan`; division by tokens x scale; the gradients' sharding for the
ZeRO stage (replicated over dp for 0/1, sharded for 2/3); the optimizer update of the fp32 master
(or of the parameters); the new 16-bit working parameters; state back to its memory kinds. A step
whose loss or gradient norm is not finite leaves parameters, master and optimizer state untouched,
reports `skipped=1` and (with loss scaling) halves the scale; carrying on or stopping is the
loop's policy. The train state is donated: its buffers are reused for the new state.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxscale.axes import use_rules
from jaxscale.strategies import accumulate, offload
from jaxscale.strategies.precision import cast_tree, keep_if_finite, update_loss_scale
from jaxscale.train.state import FunctionalModel, StateLayout, TrainState, named_shardings


def batch_logical() -> dict[str, tuple[str, ...]]:
    return {"inputs": ("batch", "seq"), "targets": ("batch", "seq"), "mask": ("batch", "seq")}


def batch_shardings(placement) -> dict[str, NamedSharding]:
    return {k: placement.sharding(v) for k, v in batch_logical().items()}


def token_loss(logits_BTV, targets_BT, mask_BT):
    """(sum of masked token losses, number of real tokens)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def make_grads_fn(model: FunctionalModel, k: int = 1, block_wrapper: Callable | None = None):
    """(params, batch, scale) -> (token-mean gradients in fp32, loss, tokens), over k micro-batches.

    Differentiates sum(token losses) x scale / (B x T): gradients the size of a mean loss's (what a
    loss scale is tuned for), rescaled exactly to the token mean afterwards."""
    def sum_loss(params, batch, factor):
        logits = model.apply(params, batch["inputs"], block_wrapper=block_wrapper)
        total, n = token_loss(logits, batch["targets"], batch["mask"])
        return total * factor, (total, n)

    def grads_fn(params, batch, scale=1.0):
        slots = batch["targets"].size
        grads, (total, ntok) = accumulate.grads(
            lambda p, b: sum_loss(p, b, scale / slots), params, batch, k)
        denom = jnp.where(ntok > 0, ntok, 1.0) / slots * scale
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads)
        return grads, total / jnp.where(ntok > 0, ntok, 1.0), ntok
    return grads_fn


def make_train_step(model: FunctionalModel, optimizer, schedule, placement, policy,
                    lay: StateLayout, device_sh: TrainState, host_sh: TrainState, k: int = 1,
                    block_wrapper: Callable | None = None):
    grads_fn = make_grads_fn(model, k, block_wrapper)

    def to(tree, shardings):
        return offload.move(tree, shardings, lay.offload)

    def train_step(state: TrainState, batch):
        with use_rules(placement.mesh, placement.rules):
            params = to(state.params, device_sh.params)
            opt_state = to(state.opt_state, device_sh.opt_state)
            master = to(state.master, device_sh.master)
            scale = state.loss_scale["scale"] if state.loss_scale is not None else 1.0
            grads, loss, ntok = grads_fn(params, batch, scale)
            grads = jax.lax.with_sharding_constraint(grads,
                                                     named_shardings(placement, lay.specs.grads))
            grad_norm = optax.tree.norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            target = master if master is not None else params
            updates, new_opt = optimizer.update(grads, opt_state, target)
            new_target = optax.apply_updates(target, updates)
            new_params = cast_tree(new_target, policy.param_dtype) if master is not None \
                else new_target

        def keep(new, old):
            return keep_if_finite(finite, new, old)
        new_state = TrainState(
            step=state.step + 1,
            params=to(keep(new_params, params), host_sh.params),
            opt_state=to(keep(new_opt, opt_state), host_sh.opt_state),
            master=to(keep(new_target, master), host_sh.master) if master is not None else None,
            loss_scale=update_loss_scale(state.loss_scale, finite, policy.growth_interval))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                   "tokens": ntok, "skipped": (~finite).astype(jnp.int32)}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale["scale"]
        return new_state, metrics

    return train_step


def make_eval_step(model: FunctionalModel, placement, device_param_sh):
    def eval_step(params, batch):
        with use_rules(placement.mesh, placement.rules):
            logits = model.apply(jax.device_put(params, device_param_sh), batch["inputs"])
        return token_loss(logits, batch["targets"], batch["mask"])
    return eval_step


def jit_train_step(step_fn, state_sh: TrainState, placement, donate: bool = True):
    return jax.jit(step_fn, in_shardings=(state_sh, batch_shardings(placement)),
                   out_shardings=(state_sh, placement.replicated()),
                   donate_argnums=(0,) if donate else ())


def jit_eval_step(eval_fn, state_sh: TrainState, placement):
    return jax.jit(eval_fn, in_shardings=(state_sh.params, batch_shardings(placement)),
                   out_shardings=placement.replicated())

