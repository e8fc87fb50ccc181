"""The loss and its gradients: the grads function every train step, eval step and tool shares.

Loss: token-mean cross entropy over the unmasked targets: the sum of per-token losses over every
micro-batch divided by the number of real tokens in the whole batch, so padding never dilutes the
mean and k micro-batches give the gradients of one k-times batch.

`plan_grads_fn` builds it from the plan's step parts (`strategies.common.StepParts`): the model
through the pipeline engine when a strategy replaces the gradient computation (`parts.grads`),
else the plain model over the micro-batches (`parts.accumulate`), each block wrapped by
`parts.block_wrapper` (remat), the batch first seen through `parts.batch_view` (context
parallelism's token layout), and a `parts.probe` differentiated beside the parameters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxscale.models.layers import token_loss
from jaxscale.strategies.common import PROBE

#: the train step's metrics of a mixture-of-experts model: the router losses (unweighted, averaged
#: over layers and micro-batches) and the fraction of expert assignments dropped by capacity
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")
#: with a distillation teacher (`train.teacher`): the token-mean T^2 KL(teacher || student)
DISTILL_METRICS = ("distill_kd",)


def make_grads_fn(model, parts, k: int = 1, with_stats: bool = False, distill=None):
    """(params, batch, scale, teacher?, *, probe=None) -> (token-mean gradients in fp32, loss,
    tokens) over k micro-batches (`with_stats`: and a dict of the mixture-of-experts metrics,
    `MOE_METRICS`, and the probe's cotangent under `PROBE`; {} if neither). `distill`
    (`train.distill.Teacher`): the grads_fn takes the teacher's parameters as a fourth argument
    and optimises a T^2 KL(teacher || student) + (1 - a) CE per token (`Teacher.objective`);
    the reported `loss` stays the cross entropy, `distill_kd` the KL term. `probe`: the inputs
    of `parts.probe`, differentiated beside the parameters (their cotangents combined over the
    micro-batches by the probe's `combine`).

    Differentiates sum(token losses) x scale / (B x T): gradients the size of a mean loss's (what a
    loss scale is tuned for), rescaled exactly to the token mean afterwards. `parts.batch_view`
    (context parallelism) permutes the batch's tokens first and adds their positions: a token
    mean does not depend on the order.

    A mixture-of-experts model optimises loss + moe_aux_weight x aux + moe_z_weight x z, each
    router loss averaged over the micro-batches (`models/moe.py`); the reported `loss` is the
    cross entropy alone (what `eval` reports). The router terms enter each micro-batch's sum
    times (real tokens of the whole batch) / k, so the division by the token count leaves them
    at their weights exactly."""
    moe = model.cfg.moe_experts > 0
    block_wrapper, view, accumulate = parts.block_wrapper, parts.batch_view, parts.accumulate

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

    def grads_fn(params, batch, scale=1.0, teacher=None, *, probe=None):
        batch = view(batch) if view else batch
        slots = batch["targets"].size
        reg_tokens = jnp.sum(batch["mask"].astype(jnp.float32)) / k if moe else None
        fn = lambda p, b: sum_loss(p, b, scale / slots, reg_tokens, teacher)  # noqa: E731
        combine = None
        if probe is not None:       # inputs beside the parameters: their cotangents come out
            fn, params = parts.probe.wrap(fn), (params, probe)
            combine = (jnp.add, parts.probe.combine)
        grads, (total, ntok, *rest) = accumulate(fn, params, batch, combine=combine)
        seen = None
        if probe is not None:
            grads, seen = grads
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
        if seen is not None:
            stats[PROBE] = seen
        return grads, loss, ntok, stats
    return grads_fn


def plan_grads_fn(model, placement, parts, with_stats: bool = False, distill=None):
    """The grads function of the plan: a strategy's own (`parts.grads`: the pipeline engine, its
    k micro-batches the schedule's m), else `make_grads_fn` over the plan's micro-batches."""
    if parts.grads is not None:
        fn = parts.grads(model, placement, parts)
        return fn if with_stats else (lambda *a, **kw: fn(*a, **kw)[:3])
    return make_grads_fn(model, parts, parts.micro_batches, with_stats, distill)


def stat_names(model, distill=None) -> tuple[str, ...]:
    """The metrics the grads function's statistics carry for this model (and teacher)."""
    return (MOE_METRICS if model.cfg.moe_experts > 0 else ()) + \
        (DISTILL_METRICS if distill is not None else ())
