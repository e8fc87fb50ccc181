"""Train state: abstract-first, sharded initialisation, the optimizer and its state shardings.

The NNX model is split once, abstractly (`nnx.eval_shape`): its graph definition, a tree of
`ShapeDtypeStruct` parameters and a tree of logical names. Parameters live as a plain nested dict
of arrays (Orbax, Optax and weight conversion all speak that), and `FunctionalModel.apply` merges
them back into the module inside the traced step. Initialisation is `jit(init, out_shardings=...)`,
so every device creates only its own shard: the full model never exists on one device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.llama import Llama, ModelConfig


def _is_spec(x) -> bool:
    return isinstance(x, P)


class FunctionalModel:
    """A Llama as pure functions over a nested dict of parameters."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
        self.graphdef, state = nnx.split(abstract)
        self._state_def = jax.tree.structure(state)
        self.abstract_params = nnx.to_pure_dict(state)
        self.logical = nnx.to_pure_dict(nnx.get_partition_spec(state))

    def init(self, key) -> dict:
        return nnx.to_pure_dict(nnx.state(Llama(self.cfg, rngs=nnx.Rngs(params=key))))

    def module(self, params: dict) -> Llama:
        state = jax.tree.unflatten(self._state_def, jax.tree.leaves(params))
        return nnx.merge(self.graphdef, state)

    def apply(self, params: dict, tokens_BT, positions_BT=None, segment_ids_BT=None,
              block_wrapper=None):
        return self.module(params)(tokens_BT, positions_BT, segment_ids_BT, block_wrapper)

    def param_shardings(self, plan) -> dict:
        return jax.tree.map(lambda s: plan.sharding(tuple(s)), self.logical, is_leaf=_is_spec)

    def param_specs(self, plan) -> dict:
        return jax.tree.map(lambda s: plan.spec(tuple(s)), self.logical, is_leaf=_is_spec)


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def make_optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, Any]:
    decay = optim.decay_steps or total_steps
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=min(optim.warmup_steps, decay),
        decay_steps=max(decay, optim.warmup_steps + 1), end_value=optim.lr * optim.min_lr_ratio)
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay,
                             mask=_decay_mask))
    return optax.chain(*parts), schedule


def _decay_mask(params):
    """Weight decay on matrices only: RMSNorm scales (named `scale`) are left alone."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) == "scale" for k in path), params)


def state_shardings(model: FunctionalModel, optimizer, plan) -> TrainState:
    """Shardings for the whole train state: optimizer moments follow their parameters."""
    p_sh = model.param_shardings(plan)
    abstract_opt = jax.eval_shape(optimizer.init, model.abstract_params)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, p_sh,
                                   transform_non_params=lambda _: plan.replicated())
    return TrainState(step=plan.replicated(), params=p_sh, opt_state=opt_sh)


def abstract_state(model: FunctionalModel, optimizer, plan) -> TrainState:
    shardings = state_shardings(model, optimizer, plan)
    shapes = jax.eval_shape(lambda: _fresh(model, optimizer, jax.random.key(0)))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def _fresh(model, optimizer, key) -> TrainState:
    params = model.init(key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))


def init_state(model: FunctionalModel, optimizer, plan, seed: int) -> TrainState:
    """Create the train state directly in its shards."""
    shardings = state_shardings(model, optimizer, plan)
    with jax.set_mesh(plan.mesh):
        return jax.jit(lambda k: _fresh(model, optimizer, k), out_shardings=shardings)(
            jax.random.key(seed))
