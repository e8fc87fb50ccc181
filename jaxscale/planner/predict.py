"""A plan's prediction: memory, collectives, FLOPs and step time, from the strategies' formulas."""
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
