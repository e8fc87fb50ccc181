"""The planner: memory, communication, FLOPs and step time of a plan, before compiling anything.

    from jaxscale import planner
    pred = planner.predict(cfg)              # cfg: jaxscale.config.Config
    pred.memory.total, pred.collectives, pred.time.total, pred.time.mfu
    planner.check_fits(cfg, n_devices)       # ValueError naming the largest consumers and fixes
    planner.search.search(cfg, n_devices)    # every valid plan on the mesh, ranked

Modules: `params` (parameter table and shards), `activations` (per-layer tensors of the LLaMA
block, remat policies), `memory`, `comm`, `perf` (FLOPs, time, MFU), `gpt` (the GPT block of
the literature), `search` (enumeration, ranking, what would make a plan fit), `report` (table,
JSON, PNG), `validate` (predicted vs compiled), `cli` (`jaxscale plan`).
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxscale.planner import comm, memory, perf
from jaxscale.planner.params import MoE
from jaxscale.planner.spec import Spec


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
            "mesh": {a: s.deg(a) for a in ("dp", "pp", "fsdp", "ep", "sp", "tp")},
            "batch": s.batch, "seq": s.seq, "capacity_bytes": self.capacity, "fits": self.fits,
            "memory": self.memory.as_dict(),
            "collectives": [c.as_dict() | {"optional": c.optional, "cpu_kind": c.cpu_kind}
                            for c in self.collectives],
            "flops": self.flops.as_dict(), "time": self.time.as_dict(),
        }


def predict_spec(spec: Spec) -> Prediction:
    spec.validate()
    mem = memory.estimate(spec)
    comms = comm.collectives(spec)
    fl = perf.flops(spec)
    return Prediction(spec, mem, comms, fl, perf.step_time(spec, fl, comms, mem))


def predict(cfg, n_devices: int | None = None, **options) -> Prediction:
    """Predict a `Config`'s step; `options` are `Spec` fields the config lacks (schedule,
    virtual, sp_mode, megatron_sp, moe)."""
    return predict_spec(Spec.from_config(cfg, n_devices, **options))


def check_fits(cfg, n_devices: int | None = None, **options) -> None:
    """Raise ValueError when the plan's predicted per-device memory exceeds the device's; the
    message names the largest consumers and the cheapest changes that would make it fit."""
    from jaxscale.planner.search import does_not_fit_message
    pred = predict(cfg, n_devices, **options)
    if not pred.fits:
        raise ValueError(does_not_fit_message(pred))


__all__ = ["MoE", "Prediction", "Spec", "check_fits", "predict", "predict_spec"]
