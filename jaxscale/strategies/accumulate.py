"""Gradient accumulation: k micro-batches through `lax.scan`, one optimizer step per k.

The global batch [B, T] is split into k micro-batches of B/k rows, taking every k-th row, so each
device's contiguous block of rows contributes equally to every micro-batch and no data moves.
Gradients of the *summed* token losses are added up and divided once by the batch's total real
tokens: k micro-batches give the gradients of one k-times batch, padding included.
Saves: activations of one micro-batch (~1/k) live at a time (the planner sizes activations per
micro-batch). Costs: one fp32 gradient accumulator (16-bit gradients are accumulated in fp32, so
their reduction is in fp32 too), k smaller matmuls instead of one, and the collectives below.
Collectives: the minimum is one gradient reduction per step, on the summed accumulator; XLA's
partitioner instead reduces each micro-batch's gradients inside the loop (k reductions per step,
visible in the census), trading communication for a sharded accumulator under ZeRO-2/FSDP.
"""
from __future__ import annotations

from jaxscale.axes import constrain
from jaxscale.strategies import zero
from jaxscale.strategies.common import Term, own_mean

NAME = "accumulate"
AVAILABLE = True


def active(spec) -> bool:
    return spec.accumulate > 1


def problems(spec) -> list[str]:
    k, data = spec.accumulate, spec.data_degree
    if k < 1:
        return [f"plan.accumulate={k} must be >= 1"]
    if spec.batch % data == 0 and spec.batch % (k * data):
        return [f"data.batch_size={spec.batch} must be divisible by plan.accumulate x the data "
                f"degree = {k} x {data}: each micro-batch is split over the data axes"]
    return []


def rules(spec, rules) -> None:
    """Accumulation adds no sharding rule."""


def collectives(spec) -> list:
    """None of its own: each strategy's per-step collectives count k micro-batches where XLA
    issues them per micro-batch (gradient reductions, FSDP gathers, TP all-reduces)."""
    return []


def memory(spec) -> list[Term]:
    """The fp32 gradient accumulator, live through the backward beside each micro-batch's
    gradients. The update reads it divided by the tokens in place of the gradient buffer
    (`train.grads`): only its excess over that buffer (16-bit gradients held in 2 bytes) is
    more (dp4 x tp2 with DiLoCo, whose update phase binds: the compiled temp is accumulate=1's)."""
    if not active(spec):
        return []
    acc = zero.shards(spec).params * 4
    return [Term("backward", acc, "fp32 gradient accumulator"),
            Term("update", max(0.0, acc - zero.grad_buffer(spec)), "fp32 gradient accumulator "
                 "beyond the gradient buffer it stands in for")]


def label(spec) -> list[str]:
    return [f"acc{spec.accumulate}"] if active(spec) else []


def shape_step(spec, parts) -> None:
    """The step: the gradients summed over the plan's micro-batches (`grads`); one at a time
    when the data region loops over them itself (`region_loops`)."""
    import functools
    k = 1 if region_loops(spec) else max(1, spec.accumulate)
    parts.set("accumulate", functools.partial(grads, k=k), by=NAME)
    parts.set("micro_batches", k, by=NAME)


def region_loops(spec) -> bool:
    """Whether the data region loops over the micro-batches itself: a strategy's own mean over
    dp (gradient compression, the sparse embedding exchange) once per micro-batch
    (`plan.grad_sync=microbatch`), so the grads function takes one micro-batch at a time."""
    return (spec.accumulate > 1 and spec.grad_sync == "microbatch" and spec.deg("dp") > 1
            and spec.local_sgd == "none" and own_mean(spec))


def split(batch: dict, k: int) -> dict:
    """[B, ...] -> [k, B/k, ...], micro-batch j holding rows j, j+k, j+2k, ..."""
    import jax
    import jax.numpy as jnp

    def f(x):
        B = x.shape[0]
        if B % k:
            raise ValueError(f"batch of {B} rows cannot be split into plan.accumulate={k} "
                             f"micro-batches")
        return jnp.swapaxes(x.reshape(B // k, k, *x.shape[1:]), 0, 1)
    return jax.tree.map(f, batch)


def grads(sum_loss_fn, params, batch: dict, k: int, combine=None):
    """Sum over micro-batches of grad(sum_loss_fn); returns (grads, aux summed).

    `sum_loss_fn(params, micro_batch) -> (scalar, aux)` with `aux` a tuple of scalars. `combine`:
    a prefix of `params` with a binary op at each leaf (`jnp.add` when not given), e.g.
    `(jnp.add, jnp.maximum)` for fp8 QAT's (parameters, scales), whose "gradient" is the amaxes
    seen: the largest over the micro-batches, not their sum."""
    import jax
    import jax.numpy as jnp
    grad_fn = jax.grad(sum_loss_fn, has_aux=True)
    if k == 1:
        return grad_fn(params, batch)
    micro = split(batch, k)

    ops = jnp.add if combine is None else combine

    def body(carry, mb):
        g_acc, aux_acc = carry
        mb = {key: constrain(v, "batch", "seq") for key, v in mb.items()}
        g, aux = grad_fn(params, mb)
        g_acc = jax.tree.map(lambda op, a, x: jax.tree.map(
            lambda u, v: op(u, v.astype(u.dtype)), a, x), ops, g_acc, g)
        return (g_acc, jax.tree.map(jnp.add, aux_acc, aux)), None
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)   # fp32 accumulator
    aux0 = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro))[1])
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux0)
    (g, aux), _ = jax.lax.scan(body, (zeros, aux0), micro)
    return g, aux
