"""Everything a run needs, built from a `Config` in the one order that matters.

plan (validated against the devices) -> abstract model -> optimizer -> state shardings ->
jitted train / eval steps. `train`, `inspect`, `profile` and the tests all start here, so what
is inspected is exactly what is trained.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale import plan as plan_lib
from jaxscale.train import state as state_lib
from jaxscale.train import step as step_lib


@dataclass
class Setup:
    cfg: Any
    plan: plan_lib.Plan
    model: state_lib.FunctionalModel
    optimizer: Any
    schedule: Any
    state_shardings: state_lib.TrainState
    train_step: Any          # jitted
    eval_step: Any           # jitted

    def init_state(self) -> state_lib.TrainState:
        return state_lib.init_state(self.model, self.optimizer, self.plan, self.cfg.train.seed)

    def abstract_state(self) -> state_lib.TrainState:
        return state_lib.abstract_state(self.model, self.optimizer, self.plan)

    def abstract_batch(self) -> dict:
        B, T = self.cfg.data.batch_size, self.cfg.data.seq_len
        sh = step_lib.batch_shardings(self.plan)
        dt = {"inputs": jnp.int32, "targets": jnp.int32, "mask": jnp.float32}
        return {k: jax.ShapeDtypeStruct((B, T), dt[k], sharding=sh[k]) for k in dt}

    def batch_shardings(self) -> dict:
        return step_lib.batch_shardings(self.plan)

    def lower_train_step(self):
        with jax.set_mesh(self.plan.mesh):
            return self.train_step.lower(self.abstract_state(), self.abstract_batch())


def build(cfg, devices=None) -> Setup:
    plan = plan_lib.build(cfg, devices)
    model = state_lib.FunctionalModel(cfg.model)
    optimizer, schedule = state_lib.make_optimizer(cfg.optim, cfg.train.steps)
    shardings = state_lib.state_shardings(model, optimizer, plan)
    train_fn = step_lib.make_train_step(model, optimizer, schedule, plan)
    train_step = step_lib.jit_train_step(train_fn, shardings, plan, donate=cfg.plan.donate)
    eval_step = step_lib.jit_eval_step(step_lib.make_eval_step(model, plan), shardings, plan)
    return Setup(cfg, plan, model, optimizer, schedule, shardings, train_step, eval_step)
