"""ZeRO-Offload's host update: AdamW on the host CPU in vectorised numpy, fp32, one piece of the
state at a time, with `train.state.make_optimizer`'s math (optax's `clip -> adamw` chain: global-
norm clipping by one factor, bias-corrected moments, decoupled weight decay on matrices only, the
scheduled learning rate). Adds no collective; its cost is the host link (gradients in, working
parameters out) and host CPU time, see `offload/tiers.py`.

The step's scalars (clip factor, the two bias corrections, the learning rate) are computed once
per step by XLA (`Scalars.of`), the very values the device update computes; the element-wise part
below applies them in optax's order of operations, one IEEE fp32 operation at a time, so the
host update is the device update bit for bit where XLA:CPU neither contracts a multiply-add nor
reorders (checked by tests/test_offload_tiers.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class Scalars:
    """One step's scalars of the update, fp32, as XLA computes them."""
    factor: np.float32        # the clip: 1 or max_norm / norm
    bc1: np.float32           # 1 - b1^t
    bc2: np.float32           # 1 - b2^t
    step_size: np.float32     # -lr(t - 1)

    @classmethod
    def of(cls, optim, learning_rate, count, norm) -> "Scalars":
        """`count`: the Adam count before this step (its state's); `norm`: the global gradient
        norm; `learning_rate`: the schedule (step -> lr). Computed by jax, as the device
        update computes them (optax: `1 - decay**count`, `-1 * lr(count)`)."""
        import jax
        import jax.numpy as jnp

        @jax.jit
        def scalars(count, norm):
            inc = count + 1          # optax.numerics.safe_increment below int32's max
            factor = (jnp.where(norm < optim.clip_norm, 1.0, optim.clip_norm / norm)
                      if optim.clip_norm > 0 else jnp.float32(1.0))
            bc1 = (1 - optim.b1 ** inc).astype(jnp.float32)
            bc2 = (1 - optim.b2 ** inc).astype(jnp.float32)
            return factor.astype(jnp.float32), bc1, bc2, jnp.asarray(
                -1 * learning_rate(count), jnp.float32)
        return cls(*(F32(x) for x in jax.device_get(scalars(jnp.int32(count), norm))))


def adamw(optim, s: Scalars, grad, mu, nu, target, decay: bool):
    """One piece: (new mu, new nu, new target), all fp32 numpy arrays like the inputs.

    optax's order: g = grad * factor; mu = (1 - b1) g + b1 mu; nu = (1 - b2) g^2 + b2 nu;
    u = (mu / bc1) / (sqrt(nu / bc2) + eps); u = u + wd * target (matrices); u = step_size * u;
    target = target + u."""
    g = grad * s.factor
    mu = F32(1 - optim.b1) * g + F32(optim.b1) * mu
    nu = F32(1 - optim.b2) * (g ** 2) + F32(optim.b2) * nu
    u = (mu / s.bc1) / (np.sqrt(nu / s.bc2) + F32(optim.eps))
    if decay and optim.weight_decay:
        u = u + F32(optim.weight_decay) * target
    u = s.step_size * u
    return mu, nu, (target + u).astype(target.dtype)


def sign_step(rate: float, grad, target):
    """A routing bias's step (`train.state._bias_steps`): target - rate x sign(its signal); its
    moments still move as AdamW's state does."""
    return (target + F32(-rate) * np.sign(grad)).astype(target.dtype)
