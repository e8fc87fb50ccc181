"""The planner: memory, communication, FLOPs and step time of a plan, before compiling anything.

    from jaxscale import planner
    pred = planner.predict(cfg)              # cfg: jaxscale.config.Config
    pred.memory.total, pred.collectives, pred.time.total, pred.time.mfu
    planner.check_fits(cfg, n_devices)       # ValueError naming the largest consumers and fixes
    planner.search.search(cfg, n_devices)    # every valid plan on the mesh, ranked

The plan (`jaxscale.plan.Spec`) and every formula come from the strategy modules
(`jaxscale/strategies/*`: their collectives and memory terms), the same ones `train` builds from
and `inspect` compares against; the planner adds the model's tables and the time model.
Modules: `params` (parameter table and shards), `activations` (per-layer tensors of the LLaMA
block), `memory` (the per-device ledger), `perf` (FLOPs, time, MFU), `gpt` (the GPT block of
the literature), `search` (enumeration, ranking, what would make a plan fit), `report` (table,
JSON, PNG), `validate` (predicted vs compiled, and the validation set), `cli` (`jaxscale plan`).
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxscale import plan as plan_lib
from jaxscale.axes import MESH_AXES
from jaxscale.plan import Spec
from jaxscale.planner import memory, perf


@dataclass
class Prediction:
    spec: Spec
    memory: memory.Memory
    collectives: list
    flops: perf.Flops
    time: perf.StepTime

    @property
    def capacity(self) -> float:
        """Device memory available to this plan (the host's share for simulated CPU devices)."""
        hw = self.spec.hardware
        if self.spec.device_kind == "cpu":
            return hw.host_bytes / self.spec.n_devices
        return hw.hbm_bytes

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    def as_dict(self) -> dict:
        s = self.spec
        return {
            "plan": s.label(), "devices": s.n_devices, "hardware": s.device_kind,
            "mesh": {a: s.deg(a) for a in MESH_AXES},
            "batch": s.batch, "seq": s.seq, "capacity_bytes": self.capacity, "fits": self.fits,
            "unavailable": plan_lib.unavailable(s),
            "memory": self.memory.as_dict(),
            "collectives": [c.as_dict() for c in self.collectives],
            "flops": self.flops.as_dict(), "time": self.time.as_dict(),
        }


def predict_spec(spec: Spec) -> Prediction:
    spec.validate()
    mem = memory.estimate(spec)
    comms = plan_lib.collectives(spec)
    fl = perf.flops(spec)
    return Prediction(spec, mem, comms, fl, perf.step_time(spec, fl, comms, mem))


def predict(cfg, n_devices: int | None = None) -> Prediction:
    """Predict a `Config`'s step."""
    return predict_spec(Spec.from_config(cfg, n_devices))


def check_fits(cfg, n_devices: int | None = None) -> None:
    """Raise ValueError when the plan's predicted per-device memory exceeds the device's; the
    message names the largest consumers and the cheapest changes that would make it fit."""
    from jaxscale.planner.search import does_not_fit_message
    pred = predict(cfg, n_devices)
    if not pred.fits:
        raise ValueError(does_not_fit_message(pred))


__all__ = ["Prediction", "Spec", "check_fits", "predict", "predict_spec"]
