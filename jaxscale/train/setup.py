"""Everything a run needs, built from a `Config` in the one order that matters.

placement (the plan validated against the devices: mesh and rules) -> the plan's step parts
(`plan.step_parts`: each strategy's changes to the state and the step, in the written order) ->
model and optimizer -> state layout and shardings -> jitted train / eval steps. `train`,
`inspect`, `profile` and the tests all start here, so what is inspected is exactly what is
trained.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale import plan as plan_lib
from jaxscale.strategies.common import LOSS_LIMIT, StepParts
from jaxscale.train import grads as grads_lib
from jaxscale.train import state as state_lib
from jaxscale.train import step as step_lib


@dataclass
class Setup:
    cfg: Any
    placement: plan_lib.Placement
    parts: StepParts                              # what the plan's strategies change
    model: state_lib.FunctionalModel
    optimizer: Any
    learning_rate: Any       # step -> learning rate
    layout: state_lib.StateLayout
    state_shardings: state_lib.TrainState         # where the state lives (memory kinds included)
    device_shardings: state_lib.TrainState        # the same, all in device memory (compute)
    train_step: Any          # jitted
    eval_step: Any           # jitted
    grads_fn: Any            # (params, batch, scale) -> (grads, loss, tokens); pure, for tools
    teacher: Any = None      # distill.Teacher (train.teacher), bound into train_step, else None

    def jit_grads(self):
        """`grads_fn` jitted with the plan's shardings (parameters in device memory)."""
        from jaxscale.axes import use_rules

        def f(params, batch, scale=1.0):
            with use_rules(self.placement.mesh, self.placement.rules):
                return self.grads_fn(params, batch, scale)
        jitted = jax.jit(f, in_shardings=(self.device_shardings.params, self.batch_shardings(),
                                            None))
        return lambda params, batch, scale=1.0: jitted(params, batch, jnp.float32(scale))

    @property
    def policy(self):
        """The precision policy (dtypes, master weights, loss scaling)."""
        return self.parts.policy

    def init_state(self) -> state_lib.TrainState:
        return self.adopt(state_lib.init_state(self.model, self.optimizer, self.parts,
                                               self.state_shardings, self.placement, self.layout,
                                               self.cfg.train.seed))

    def adopt(self, state: state_lib.TrainState) -> state_lib.TrainState:
        """A whole train state as the step takes it (a host-driven step keeps parts of it in
        its own store: `train_step.adopt`); the state itself otherwise."""
        return self.train_step.adopt(state) if hasattr(self.train_step, "adopt") else state

    def full_state(self, state) -> state_lib.TrainState:
        """The whole train state of what the step carries (what a checkpoint saves)."""
        return (self.train_step.full_state(state) if hasattr(self.train_step, "full_state")
                else state)

    def abstract_state(self) -> state_lib.TrainState:
        return state_lib.abstract_state(self.model, self.optimizer, self.parts,
                                        self.state_shardings, self.placement, self.layout)

    @property
    def packed(self) -> bool:
        """Whether batches carry packed documents' positions and segment ids (`data.shards`)."""
        return bool(self.cfg.data.shards)

    @property
    def spike_guard(self) -> bool:
        """Whether the train step takes a loss limit with its batch (`train.spike_policy=skip`,
        `strategies.common.LOSS_LIMIT`)."""
        return self.cfg.train.spike_policy == "skip"

    def abstract_batch(self) -> dict:
        """A training batch's shapes and shardings (with the loss limit the step takes)."""
        B, T = self.cfg.data.batch_size, self.cfg.data.seq_len
        out = {k: jax.ShapeDtypeStruct((B, T), jnp.float32 if k == "mask" else jnp.int32,
                                       sharding=sh)
               for k, sh in self.batch_shardings().items()}
        if self.spike_guard:
            out[LOSS_LIMIT] = jax.ShapeDtypeStruct((), jnp.float32,
                                                   sharding=self.placement.replicated())
        return out

    def train_batch(self, batch: dict, limit: float = float("inf")) -> dict:
        """`batch` as the train step takes it: with the loss limit when the step has a guard."""
        if not self.spike_guard:
            return batch
        import numpy as np
        return {**batch, LOSS_LIMIT: jax.make_array_from_process_local_data(
            self.placement.replicated(), np.float32(limit))}

    def batch_shardings(self) -> dict:
        return step_lib.batch_shardings(self.placement, self.parts, self.packed)

    def lower_train_step(self):
        with jax.set_mesh(self.placement.mesh):
            return self.train_step.lower(self.abstract_state(), self.abstract_batch())


def build(cfg, devices=None, donate: bool | None = None, with_grads: bool = False) -> Setup:
    """`with_grads`: the train step's metrics carry the mean gradients its update read
    (`step.make_train_step`), for the numerics tests."""
    placement = plan_lib.place(cfg, devices)
    if cfg.plan.check_memory:          # "does not fit" from the planner, before any compile
        from jaxscale import planner
        planner.check_fits(cfg, placement.mesh.devices.size)
    parts = plan_lib.step_parts(placement.spec)
    model = state_lib.FunctionalModel(dataclasses.replace(     # the plan's (vocabulary padded)
        placement.spec.model, dtype=parts.policy.compute_dtype, param_dtype="float32"),
        parts.layer_order)
    optimizer, learning_rate = state_lib.make_optimizer(cfg.optim, cfg.train.steps,
                                                        cfg.model.moe_bias_rate)
    lay = state_lib.layout(model, placement, parts)
    host_sh = state_lib.state_shardings(model, optimizer, placement, lay, parts)
    dev_sh = state_lib.state_shardings(model, optimizer, placement, lay, parts, on_device=True)
    teacher = None
    if cfg.train.teacher:              # distillation: the frozen teacher, restored in shards
        from jaxscale.train import distill
        teacher = distill.load(cfg, placement, parts.policy)
    ctx = step_lib.StepContext(model, optimizer, learning_rate, placement, parts.policy, lay,
                               dev_sh, host_sh, parts)
    packed = bool(cfg.data.shards)
    train_step = step_lib.jit_train_step(step_lib.make_train_step(ctx, teacher, with_grads),
                                         host_sh, placement, parts,
                                         donate=cfg.plan.donate if donate is None else donate,
                                         packed=packed,
                                         teacher_sh=teacher.shardings if teacher else None,
                                         with_grads=with_grads,
                                         spike_guard=cfg.train.spike_policy == "skip")
    if teacher is not None:
        train_step = teacher.bind(train_step)
    eval_step = step_lib.jit_eval_step(
        step_lib.make_eval_step(model, placement, parts, dev_sh.params), host_sh, placement,
        parts, packed)
    grads_fn = grads_lib.plan_grads_fn(model, placement, parts)
    return Setup(cfg, placement, parts, model, optimizer, learning_rate, lay, host_sh, dev_sh,
                 train_step, eval_step, grads_fn, teacher)
