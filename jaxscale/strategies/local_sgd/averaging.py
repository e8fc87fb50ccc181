"""Local SGD and its outer optimizers: the math of `plan.local_sgd`, written for `jax.shard_map`.

n replicas (the devices of the data axis) start from one set of parameters, the anchor x. Each
trains alone for H inner steps on its own rows of the batch with its own optimizer (no
collective), reaching x_i. Then one all-reduce averages the change Delta = x - mean_i(x_i) (fp32),
an outer optimizer moves the anchor, and every replica restarts from the new anchor:

    local SGD (plain averaging)      x <- x - Delta                         = mean_i(x_i)
    post-local SGD (Lin et al. 2018) the same, after `warmup` steps of synchronous DP
    SlowMo (arXiv 1910.00643)        u <- beta u + Delta;  x <- x - lr u           (heavy ball)
    DiLoCo (arXiv 2311.08105)        u <- beta u + Delta;  x <- x - lr (beta u + Delta)  (Nesterov)

Local SGD and post-local SGD are the outer SGD with lr 1 and no momentum. With H = 1 and an inner
optimizer linear in the gradient (SGD, with or without momentum, no clipping) the replicas' mean
after one step is the step of synchronous data parallelism on the whole batch: all of these equal
DP exactly (up to rounding) when lr = 1 and beta = 0. The inner optimizer's state (AdamW's
moments, SGD's momentum) stays with its replica across the averages, as in all three papers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def outer_optimizer(lr: float, momentum: float, nesterov: bool) -> optax.GradientTransformation:
    """The outer SGD on the averaged change Delta (its "gradient"): `optax.sgd`, whose momentum
    trace is u <- beta u + Delta, and whose Nesterov update is beta u + Delta."""
    if lr <= 0 or not 0 <= momentum < 1:
        raise ValueError(f"outer optimizer: lr must be > 0 and momentum in [0, 1), got lr={lr}, "
                         f"momentum={momentum}")
    return optax.sgd(lr, momentum=momentum or None, nesterov=bool(nesterov and momentum))


def is_sync(step, local_steps: int, warmup: int = 0):
    """Whether the step numbered `step` (0-based, a traced int) ends with an average: every step
    of the first `warmup` (synchronous), then every `local_steps`-th."""
    if local_steps < 1 or warmup < 0:
        raise ValueError(f"local_steps must be >= 1 and warmup >= 0, got {local_steps}, {warmup}")
    after = step + 1 - warmup
    return (after <= 0) | (jnp.remainder(jnp.maximum(after, 1), local_steps) == 0)


def syncs(steps: int, local_steps: int, warmup: int = 0) -> int:
    """How many of the first `steps` steps end with an average (Python ints)."""
    w = min(steps, warmup)
    return w + (steps - w) // local_steps


def changes(anchor, replica):
    """The fp32 change anchor - replica of each leaf."""
    return jax.tree.map(lambda a, r: a.astype(jnp.float32) - r.astype(jnp.float32),
                        anchor, replica)


def outer_step(anchor, replica, outer_state, outer, axis: str, n: int):
    """Inside `jax.shard_map` over `axis` (n devices): one all-reduce of the fp32 changes
    anchor - replica, their mean Delta, and the outer optimizer's move of the anchor.

    `anchor` (replicated) and `replica` (this device's) are trees of the same structure; returns
    (new anchor in the anchor's dtypes, new outer state). Every device computes the same."""
    delta = jax.tree.map(lambda d: d / n, jax.lax.psum(changes(anchor, replica), axis))
    return outer_move(anchor, delta, outer_state, outer)


def outer_move(anchor, delta, outer_state, outer):
    """The outer optimizer's move of the anchor by the mean change Delta (however averaged)."""
    updates, outer_state = outer.update(delta, outer_state, anchor)
    new = jax.tree.map(lambda a, u: (a.astype(jnp.float32) + u).astype(a.dtype), anchor, updates)
    return new, outer_state


def stack(tree, n: int):
    """The global form of per-replica state: each leaf with a leading axis of n (copies)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), tree)
