"""The pure train and eval steps, and their jitted, sharded forms.

Loss: token-mean cross entropy over the unmasked targets (sum of per-token losses divided by the
number of real tokens, so padding never dilutes the mean). The step returns the new state and a
dict of scalar metrics (loss, grad_norm, lr, tokens, skipped). A step whose loss or gradient
norm is not finite leaves parameters and optimizer state untouched and reports `skipped=1`;
what to do next (carry on or stop) is the loop's policy. The train state is donated: the old state's
buffers are reused for the new one, so peak memory holds one copy of it, not two.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxscale.axes import use_rules
from jaxscale.train.state import FunctionalModel, TrainState


def batch_logical() -> dict[str, tuple[str, ...]]:
    return {"inputs": ("batch", "seq"), "targets": ("batch", "seq"), "mask": ("batch", "seq")}


def batch_shardings(plan) -> dict[str, NamedSharding]:
    return {k: plan.sharding(v) for k, v in batch_logical().items()}


def token_loss(logits_BTV, targets_BT, mask_BT):
    """(sum of masked token losses, number of real tokens)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    mask = mask_BT.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def make_loss_fn(model: FunctionalModel, block_wrapper: Callable | None = None):
    def loss_fn(params, batch):
        logits = model.apply(params, batch["inputs"], block_wrapper=block_wrapper)
        total, n = token_loss(logits, batch["targets"], batch["mask"])
        return total / jnp.maximum(n, 1.0), n
    return loss_fn


def make_train_step(model: FunctionalModel, optimizer, schedule, plan,
                    block_wrapper: Callable | None = None):
    loss_fn = make_loss_fn(model, block_wrapper)

    def train_step(state: TrainState, batch):
        with use_rules(plan.mesh, plan.rules):
            (loss, ntok), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A non-finite loss or gradient never reaches the parameters or the optimizer state:
        # the update is skipped (the step counter still advances: it counts batches consumed).
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                   "tokens": ntok, "skipped": (~finite).astype(jnp.int32)}
        return TrainState(state.step + 1, keep(params, state.params),
                          keep(opt_state, state.opt_state)), metrics

    return train_step


def make_eval_step(model: FunctionalModel, plan):
    def eval_step(params, batch):
        with use_rules(plan.mesh, plan.rules):
            logits = model.apply(params, batch["inputs"])
        return token_loss(logits, batch["targets"], batch["mask"])
    return eval_step


def jit_train_step(step_fn, state_sh: TrainState, plan, donate: bool = True):
    metric_sh = plan.replicated()
    return jax.jit(step_fn, in_shardings=(state_sh, batch_shardings(plan)),
                   out_shardings=(state_sh, metric_sh), donate_argnums=(0,) if donate else ())


def jit_eval_step(eval_fn, state_sh: TrainState, plan):
    return jax.jit(eval_fn, in_shardings=(state_sh.params, batch_shardings(plan)),
                   out_shardings=plan.replicated())
