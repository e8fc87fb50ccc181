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
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.models.llama import Llama, ModelConfig
from jaxscale.strategies.pp.stages import reorder


def is_partition(x) -> bool:
    """A leaf of a tree of PartitionSpecs (or of logical names held as PartitionSpecs)."""
    return isinstance(x, P)


class FunctionalModel:
    """A Llama as pure functions over a nested dict of parameters; `layer_order`: the plan's
    stored order of the stacked layers (a pipeline's, padding rows included:
    `strategies.pp.stages.layer_order`), in which `init` creates them and `abstract_params`
    sizes them."""

    def __init__(self, cfg: ModelConfig, layer_order: list[int] | None = None):
        self.cfg = cfg
        self.layer_order = layer_order
        abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
        self.graphdef, state = nnx.split(abstract)
        self._state_def = jax.tree.structure(state)
        self.abstract_params = nnx.to_pure_dict(state)
        if layer_order is not None:
            self.abstract_params = jax.eval_shape(lambda: reorder(jax.tree.map(
                lambda a: jnp.zeros(a.shape, a.dtype), self.abstract_params), None, layer_order))
        self.logical = nnx.to_pure_dict(nnx.get_partition_spec(state))

    def init(self, key) -> dict:
        params = nnx.to_pure_dict(nnx.state(Llama(self.cfg, rngs=nnx.Rngs(params=key))))
        return reorder(params, None, self.layer_order)

    def module(self, params: dict) -> Llama:
        state = jax.tree.unflatten(self._state_def, jax.tree.leaves(params))
        return nnx.merge(self.graphdef, state)

    def apply(self, params: dict, tokens_BT, positions_BT=None, segment_ids_BT=None,
              block_wrapper=None):
        return self.module(params)(tokens_BT, positions_BT, segment_ids_BT, block_wrapper)

    def param_shardings(self, placement) -> dict:
        return jax.tree.map(lambda s: placement.sharding(tuple(s)), self.logical,
                            is_leaf=is_partition)

    def param_specs(self, placement) -> dict:
        return jax.tree.map(lambda s: placement.spec_of(tuple(s)), self.logical,
                            is_leaf=is_partition)


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array
    params: Any                 # working parameters (compute precision policy's param dtype)
    opt_state: Any
    master: Any = None          # fp32 master weights (16-bit policies), else None
    loss_scale: Any = None      # {"scale", "good_steps"} for dynamic loss scaling, else None
    comm: Any = None            # gradient compression's per-device state ([devices, ...]),
                                # local SGD's replicas and their optimizer states ([dp, ...])
    quant: Any = None           # fp8 QAT's amax histories ([layers, slots, history]), else None


def make_optimizer(optim, total_steps: int, bias_rate: float = 0.0
                   ) -> tuple[optax.GradientTransformation, Any]:
    """The optimizer of `optim` (an `OptimConfig`) and its learning rate, a function of the
    step: linear warm-up from 0, then cosine decay to `lr x min_lr_ratio`. A mixture of experts'
    routing biases (`router_bias`, `model.moe_bias_rate`) take their own step instead: -rate x
    sign of their load signal (`models/moe.py`'s `load_signal`), no moments, no decay."""
    decay = optim.decay_steps or total_steps
    learning_rate = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=min(optim.warmup_steps, decay),
        decay_steps=max(decay, optim.warmup_steps + 1), end_value=optim.lr * optim.min_lr_ratio)
    parts = [clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    if optim.kind == "sgd":         # weight decay added to the gradient, then (heavy-ball) SGD
        if optim.weight_decay > 0:
            parts.append(optax.add_decayed_weights(optim.weight_decay, mask=_decay_mask))
        parts.append(optax.sgd(learning_rate, momentum=optim.momentum or None))
    else:
        parts.append(optax.adamw(learning_rate, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                                 weight_decay=optim.weight_decay, mask=_decay_mask))
    chain = optax.chain(*parts)
    return (chain if not bias_rate else _bias_steps(chain, bias_rate)), learning_rate


def _bias_steps(inner, rate: float) -> optax.GradientTransformationExtraArgs:
    """`inner`, but the routing biases' updates replaced by -rate x sign(their signal): the
    state keeps `inner`'s structure (what the strategies' state layouts map over)."""
    def update(updates, state, params=None, **extra):
        out, state = inner.update(updates, state, params, **extra)
        out = jax.tree_util.tree_map_with_path(
            lambda path, u, g: (-rate * jnp.sign(g)).astype(u.dtype)
            if getattr(path[-1], "key", None) == "router_bias" else u, out, updates)
        return out, state
    return optax.GradientTransformationExtraArgs(inner.init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """Gradients scaled by max_norm / norm when their global norm reaches max_norm
    (`optax.clip_by_global_norm`'s rule and empty state), as one scalar factor times each
    gradient, as torch's `clip_grad_norm_` applies it: a multiply XLA fuses into the update's
    element-wise loops, where optax's divide-then-scale was materialised as a gradient copy.

    The norm may be given (`update(..., grad_norm=n)`): an update applied piece by piece (host
    offload streams it layer by layer) clips every piece by the norm of all the gradients."""
    def update(updates, state, params=None, *, grad_norm=None, **_):
        del params
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state
    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _decay_mask(params):
    """Weight decay on matrices only: RMSNorm scales (named `scale`) are left alone."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) == "scale" for k in path), params)


@dataclass
class StateLayout:
    """Mesh specs and memory kinds of each part of the train state, from the plan's step parts:
    ZeRO's specs per part (`parts.state_specs`), offload's memory kinds of the parts it keeps in
    host memory (`parts.memory_kinds`), the precision policy's master weights and loss scale, and
    the stored order of the stacked layers (`parts.layer_order`: the pipeline's)."""
    specs: Any              # zero.StateSpecs: params, model, shards (master/optimizer), grads
    master: bool
    loss_scale: bool
    memory_kinds: dict
    layer_order: list | None = None


def layout(model: FunctionalModel, placement, parts) -> StateLayout:
    sizes = dict(zip(placement.mesh.axis_names, placement.mesh.devices.shape))
    keep = None if parts.state_keep is None else jax.tree_util.tree_map_with_path(
        parts.state_keep, model.logical, is_leaf=is_partition)
    specs = parts.state_specs(model.param_specs(placement), model.abstract_params, sizes, keep)
    return StateLayout(specs=specs, master=parts.policy.master,
                       loss_scale=parts.policy.loss_scale is not None,
                       memory_kinds=dict(parts.memory_kinds), layer_order=parts.layer_order)


def named_shardings(placement, specs, kind=None):
    """A tree of mesh PartitionSpecs -> NamedShardings on the plan's mesh (in memory `kind`)."""
    return jax.tree.map(lambda sp: NamedSharding(placement.mesh, sp, memory_kind=kind), specs,
                        is_leaf=is_partition)


def state_optimizer(optimizer, parts):
    """The optimizer whose state is `TrainState.opt_state` (local SGD: the outer one)."""
    return parts.state_optimizer(optimizer) if parts.state_optimizer else optimizer


def state_shardings(model: FunctionalModel, optimizer, placement, lay: StateLayout, parts,
                    on_device: bool = False) -> TrainState:
    """Shardings for the whole train state; optimizer moments follow the tensors they update
    (the master's shards). A strategy's state is laid out as it says (`parts.comm_specs`: local
    SGD's replicas over dp, compression's per-device state over every device), or replicated
    (`quant`).

    `on_device=True` gives the same shardings with every part in device memory (what the step
    computes with after bringing offloaded parts over)."""
    def kind(part):
        return None if on_device else lay.memory_kinds.get(part)
    state_opt = state_optimizer(optimizer, parts)
    abstract_opt = jax.eval_shape(state_opt.init, model.abstract_params)
    opt_sh = optax.tree_map_params(state_opt, lambda _, s: s, abstract_opt,
                                   named_shardings(placement, lay.specs.shards, kind("optimizer")),
                                   transform_non_params=lambda _: placement.replicated())
    rep = placement.replicated()
    where = _where(placement, lay)
    extra = jax.eval_shape(lambda p: _strategy_state(parts, p, optimizer, where),
                           model.abstract_params)
    comm = None
    if extra["comm"] is not None:
        comm = named_shardings(placement, parts.comm_specs(lay.specs.params, extra["comm"],
                                                           optimizer))
    return TrainState(
        step=rep, params=named_shardings(placement, lay.specs.params, kind("params")),
        opt_state=opt_sh,
        master=named_shardings(placement, lay.specs.shards, kind("master")) if lay.master else None,
        loss_scale={"scale": rep, "good_steps": rep} if lay.loss_scale else None,
        comm=comm, quant=jax.tree.map(lambda _: rep, extra["quant"]))


def _where(placement, lay: StateLayout) -> tuple:
    """(the parameters' mesh specs, {mesh axis: size}): what a strategy's state initialiser
    lays its per-device state out by."""
    return lay.specs.params, dict(zip(placement.mesh.axis_names, placement.mesh.devices.shape))


def _strategy_state(parts, params, optimizer, where) -> dict:
    """The strategies' parts of the state (`parts.state`), None where no strategy has one."""
    unknown = set(parts.state) - {"comm", "quant"}
    if unknown:
        raise ValueError(f"a strategy keeps state in TrainState.{sorted(unknown)[0]}, which the "
                         f"train state has no field for (comm, quant)")
    if "comm" in parts.state and parts.comm_specs is None:
        raise ValueError(f"{parts.owner['state.comm']} keeps state in TrainState.comm but sets "
                         f"no comm_specs: say how it is laid out")
    return {f: parts.state[f](params, optimizer, where) if f in parts.state else None
            for f in ("comm", "quant")}


def _fresh(model, optimizer, parts, key, where) -> TrainState:
    policy = parts.policy
    master = model.init(key)                     # initialised in fp32
    return TrainState(step=jnp.zeros((), jnp.int32), params=policy.working(master),
                      opt_state=state_optimizer(optimizer, parts).init(master),
                      master=master if policy.master else None,
                      loss_scale=policy.init_loss_scale(),
                      **_strategy_state(parts, master, optimizer, where))


def abstract_state(model: FunctionalModel, optimizer, parts, shardings: TrainState,
                   placement, lay: StateLayout) -> TrainState:
    where = _where(placement, lay)
    shapes = jax.eval_shape(lambda: _fresh(model, optimizer, parts, jax.random.key(0), where))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def init_state(model: FunctionalModel, optimizer, parts, shardings: TrainState, placement,
               lay: StateLayout, seed: int) -> TrainState:
    """Create the train state directly in its shards (and memory kinds), its stacked layers in
    the plan's stored order (`FunctionalModel.layer_order`)."""
    where = _where(placement, lay)

    def fresh(k):
        return _fresh(model, optimizer, parts, k, where)
    with jax.set_mesh(placement.mesh):
        return jax.jit(fresh, out_shardings=shardings)(jax.random.key(seed))


def state_bytes(abstract: TrainState) -> dict[str, dict[str, float]]:
    """Per-device bytes of each part of the state, split by memory kind."""
    out: dict[str, dict[str, float]] = {}
    for part in ("params", "opt_state", "master", "loss_scale"):
        for leaf in jax.tree.leaves(getattr(abstract, part)):
            sh = leaf.sharding
            local = sh.shard_shape(leaf.shape)
            kind = sh.memory_kind or "device"
            d = out.setdefault(part, {})
            d[kind] = d.get(kind, 0.0) + float(np.prod(local)) * np.dtype(leaf.dtype).itemsize
    return out
