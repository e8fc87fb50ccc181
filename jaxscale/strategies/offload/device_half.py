"""The device half of the host-driven offload step (`driver.py`): the forward and backward of
the plan, the gradients' norm and the step's finiteness, with no update (the host drives it).
No collective beyond the plan's gradient reduction; what it saves and costs: `tiers.py`."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxscale.axes import use_rules
from jaxscale.strategies.common import PROBE, keep_if_finite


def grads_step(ctx, thin_sh):
    """The jitted forward and backward: (thin state, batch) -> (state with the step, loss scale
    and comm rolled forward, gradients, their norm, finite, metrics), as `train.step`'s."""
    parts, placement, policy = ctx.parts, ctx.placement, ctx.policy
    reduce = parts.reduce(ctx.grads_fn, ctx) if parts.reduce else None

    def step(state, batch):
        with use_rules(placement.mesh, placement.rules):
            scale = state.loss_scale["scale"] if state.loss_scale is not None else 1.0
            comm = state.comm
            if reduce is not None:
                grads, loss, ntok, stats, comm = reduce(
                    state.params, batch, jnp.asarray(scale, jnp.float32), state.comm)
            else:
                grads, loss, ntok, stats = ctx.grads_fn(state.params, batch, scale)
            stats.pop(PROBE, None)
            grads = jax.lax.with_sharding_constraint(grads, ctx.grads_sh)
            norm = optax.tree.norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(norm)
            if comm is not None:
                comm = keep_if_finite(finite, comm, state.comm)
        new = dataclasses.replace(state, step=state.step + 1, comm=comm,
                                  loss_scale=policy.next_loss_scale(state.loss_scale, finite))
        metrics = {"loss": loss, "grad_norm": norm, "lr": ctx.learning_rate(state.step),
                   "tokens": ntok, "skipped": (~finite).astype(jnp.int32), **stats}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale["scale"]
        return new, grads, norm, finite, metrics
    return jax.jit(step, in_shardings=(thin_sh, None),
                   out_shardings=(thin_sh, ctx.grads_sh, None, None, None))
