"""Pipeline schedules run with op costs: a discrete-event simulator and a Gantt drawing.

`simulate` runs each device's list of a `schedules.Schedule` in order, an op starting when its
device is free and its inputs have arrived; `Result.table` lists the run as rows (tick, device,
stage, micro_batch, op), `draw` makes a PNG of it. No JAX: the planner, the experiments and the
engine's tick table (`program.py`, every op one unit) read it.

Costs. t_f and t_b are the forward and backward cost of one micro-batch on one device's share of
the layers (a virtual stage costs t_f / v and t_b / v). When t_w is None, t_b is the whole
backward; a split schedule (ZB-H1, ZB-V) then runs it as B = W = t_b / 2. When t_w is given, t_b
is the input-gradient part and t_w the weight-gradient part: the split schedules run them as B
and W, the others as one B of t_b + t_w. So `simulate(s, 1, 1, 1)` is the ZB paper's unit
convention (T_F = T_B = T_W = 1) for the split schedules and a backward of 2 for 1F1B, the
comparison the paper makes, and `simulate(s, 1, 2)` gives the same costs. t_comm is added to
every dependency that crosses devices (stage k-1 -> k forward, k+1 -> k backward, when the two
stages live on different devices: ZB-V's turn at the last device stays local).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxscale.strategies.pp.schedules import Op, Schedule, in_flight


class Row(NamedTuple):
    tick: float        # start time, in the cost units (integers for integer costs and v = 1)
    device: int
    stage: int
    micro_batch: int
    op: str


@dataclasses.dataclass
class Result:
    """What `simulate` found: start and end of every op, makespan, bubble, peak memory."""
    schedule: Schedule
    start: dict[Op, float]
    end: dict[Op, float]
    makespan: float
    busy: list[float]                  # per device
    bubble: float                      # idle / (devices x makespan)
    in_flight: list[float]             # per device, peak micro-batches of activations

    @property
    def peak_in_flight(self) -> float:
        return max(self.in_flight)

    @property
    def overhead(self) -> float:
        """Idle time over compute time: Megatron's form of the bubble ((p-1)/m for 1F1B), the one
        the planner's `strategies.pp.bubble_fraction` uses; bubble = overhead / (1 + overhead)."""
        return self.bubble / (1 - self.bubble)

    def table(self) -> list[Row]:
        rows = [Row(self.start[op], op.device, op.stage, op.micro_batch, op.kind)
                for op in self.start]
        return sorted(rows, key=lambda r: (r.tick, r.device))


def deps(op: Op, stages: int) -> list[tuple]:
    """The (kind, stage, micro_batch) of the ops `op` waits for."""
    s, j = op.stage, op.micro_batch
    if op.kind == "F":
        return [("F", s - 1, j)] if s > 0 else []
    if op.kind == "B":
        return [("B", s + 1, j)] if s < stages - 1 else [("F", s, j)]
    return [("B", s, j)]


def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None,
             t_comm: float = 0.0) -> Result:
    """Run each device's list in order; an op starts when its device is free and its inputs have
    arrived (+ t_comm across devices). Raises RuntimeError if the lists deadlock."""
    sc, p, v = schedule, schedule.p, schedule.v
    if sc.split_backward:
        cost = {"F": t_f, "B": t_b / 2 if t_w is None else t_b,
                "W": t_b / 2 if t_w is None else t_w}
    else:
        cost = {"F": t_f, "B": t_b + (t_w or 0.0)}
    cost = {k: c / v for k, c in cost.items()}
    end: dict[tuple, float] = {}                  # (kind, stage, micro_batch) -> end time
    start: dict[Op, float] = {}
    endo: dict[Op, float] = {}
    pc, free = [0] * p, [0.0] * p
    left = sum(len(prog) for prog in sc.programs)
    while left:
        progressed = False
        for d in range(p):
            prog = sc.programs[d]
            while pc[d] < len(prog):
                op = prog[pc[d]]
                need = deps(op, sc.stages)
                if any(k not in end for k in need):
                    break
                t = free[d]
                for k in need:
                    t = max(t, end[k] + (t_comm if sc.device_of(k[1]) != d else 0.0))
                start[op], endo[op] = t, t + cost[op.kind]
                end[(op.kind, op.stage, op.micro_batch)] = free[d] = endo[op]
                pc[d] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = [str(sc.programs[d][pc[d]]) for d in range(p) if pc[d] < len(sc.programs[d])]
            raise RuntimeError(f"schedule {sc.name} deadlocks: waiting ops {', '.join(stuck)}")
    makespan = max(endo.values())
    busy = [sum(endo[op] - start[op] for op in prog) for prog in sc.programs]
    bubble = 1 - sum(busy) / (p * makespan)
    return Result(sc, start, endo, makespan, busy, bubble, in_flight(sc))


# ----------------------------------------------------------------------------- drawing

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def _gantt(ax, result: Result) -> None:
    sc = result.schedule
    for op, t0 in result.start.items():
        dt = result.end[op] - t0
        chunk = sc.chunk_of(op.stage)
        shade = 1.0 - 0.45 * chunk / max(1, sc.v - 1)         # later chunks lighter
        ax.barh(op.device, dt, left=t0, height=0.8, color=COLOURS[op.kind],
                alpha=shade, edgecolor="black", linewidth=0.4)
        ax.text(t0 + dt / 2, op.device, str(op.micro_batch), ha="center", va="center",
                fontsize=6 if dt * 40 < result.makespan else 7, color="white")
    ax.set_ylim(sc.p - 0.5, -0.5)
    ax.set_xlim(0, result.makespan)
    ax.set_yticks(range(sc.p), [f"dev {d}" for d in range(sc.p)])
    vtxt = f", v={sc.v}; lighter = later chunk" if sc.v > 1 else ""
    ax.set_title(f"{sc.name} (p={sc.p}, m={sc.m}{vtxt}): bubble {result.bubble:.1%}, "
                 f"peak in flight {result.in_flight[0]:g} on dev 0", fontsize=9, loc="left")


def draw(schedule: Schedule, result: Result | None = None, path: str = "pipeline.png", *,
         also: tuple[tuple[Schedule, Result | None], ...] = ()) -> str:
    """Write a Gantt chart PNG: devices as rows, time on x, F / B / W coloured (interleaved:
    later chunks lighter), micro-batch numbers in the boxes, the bubble in the title. `also`:
    more (schedule, result) pairs, stacked below on one time axis. A result left None is
    `simulate(schedule)` with the default costs. Returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pairs = [(schedule, result), *also]
    results = [r if r is not None else simulate(s) for s, r in pairs]
    heights = [0.9 + 0.32 * r.schedule.p for r in results]
    fig, axes = plt.subplots(len(results), 1, figsize=(13, sum(heights)), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        _gantt(ax, r)
    span = max(r.makespan for r in results)
    axes[-1, 0].set_xlim(0, span)
    axes[-1, 0].set_xlabel("time (units of T_F)")
    kinds = sorted({op.kind for r in results for op in r.start}, key="FBW".index)
    names = {"F": "forward", "B": "backward (input grad in ZB)", "W": "weight grad (ZB)"}
    top = 1 - 0.3 / sum(heights)
    fig.legend(handles=[Patch(color=COLOURS[k], label=names[k]) for k in kinds],
               loc="upper right", fontsize=8, ncol=len(kinds), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
