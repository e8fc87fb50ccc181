"""The device half of the host-driven offload step (`driver.py`): the forward and backward of
the plan, the gradients' norm and the step's finiteness, with no update (the host drives it).
No collective beyond the plan's gradient reduction; what it saves and costs: `tiers.py`."""
from __future__ import annotations

import dataclasses

import jax

from jaxscale.strategies.common import no_overflow


def grads_step(ctx, thin_sh):
    """The jitted forward and backward: (thin state, batch) -> (state with the step, loss scale
    and comm rolled forward, gradients, their norm, finite, metrics): the train step's first
    half (`ctx.gradients`) and its metrics, with no update."""
    def step(state, batch):
        _, grads, norm, finite, loss, ntok, stats, _, comm = ctx.gradients(state, batch)
        new = dataclasses.replace(state, step=state.step + 1, comm=comm,
                                  loss_scale=ctx.policy.next_loss_scale(
                                      state.loss_scale, no_overflow(finite, stats)))
        return new, grads, norm, finite, ctx.metrics(state, loss, norm, ntok, finite, stats)
    return jax.jit(step, in_shardings=(thin_sh, None),
                   out_shardings=(thin_sh, ctx.grads_sh, None, None, None))
