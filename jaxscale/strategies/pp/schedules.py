"""Pipeline schedules as data, a discrete-event simulator for them, and a Gantt drawing.

A schedule is, per device, the ordered list of ops that device executes; an op is a forward (F),
a backward (B) or, in ZB-H1 only, a weight-gradient pass (W) of one micro-batch on one stage.
There are p devices and S = p v stages; stage k lives on device k % p (with v = 1: stage = device).
`simulate` runs the lists with op costs and the dependencies of the model, `table` lists the
result as rows (tick, device, stage, micro_batch, op), `draw` makes a PNG of it. Nothing here
needs JAX: the planner reads the numbers and a pipeline engine can run the same lists.

Schedules (p devices, m micro-batches, v virtual stages per device; bubble = idle time over
devices x makespan, with stages of equal cost and free communication; memory = micro-batches
whose activations the busiest device (device 0) holds at its peak):
- naive: model parallelism without overlap (the topic-06 baseline); micro-batches, if m > 1,
  one after another. Bubble (p-1)/p. Memory 1.
- gpipe: all m forwards, then all m backwards. Bubble (p-1)/(m+p-1). Memory m.
- 1f1b: device d runs min(p-1-d, m) forwards, then alternates one forward and one backward,
  then drains its backwards (PipeDream-Flush). Bubble (p-1)/(m+p-1). Memory min(m, p).
- interleaved: Megatron's interleaved 1F1B; device d holds stages d, d+p, ..., d+(v-1)p, each
  with 1/v of its layers, and micro-batches go through in groups of p; m a multiple of p.
  Bubble (p-1)/(v m+p-1). Memory p + (p-1)/v (in units of a whole device's activations
  of one micro-batch: p v + p - 1 stage-activations of 1/v each); m = p runs all forwards
  first (as Megatron does), memory m.
- zb-h1: Zero Bubble H1 (arXiv 2401.10241): the backward split into B (input gradient, on the
  critical path) and W (weight gradient, off it). The 1F1B order, with device d deferring its
  first d W passes to the drain, where they fill the bubbles. Bubble time (p-1)(T_F+T_B-T_W)
  against 1F1B's (p-1)(T_F+T_B+T_W) (exact in the simulator while T_W <= min(T_F, T_B)): a
  third with T_F = T_B = T_W, fraction (p-1)/(3m+p-1). Memory p on device 0, like 1F1B (the
  deferred W passes raise device d from 1F1B's p-d to p); m >= p.

Costs (`simulate`). t_f and t_b are the forward and backward cost of one micro-batch on one
device's share of the layers (a virtual stage costs t_f / v and t_b / v). When t_w is None, t_b is
the whole backward; ZB-H1 then splits it into B = W = t_b / 2. When t_w is given, t_b is the
input-gradient part and t_w the weight-gradient part: ZB-H1 runs them as B and W, the other
schedules as one B of t_b + t_w. So `simulate(s, 1, 1, 1)` is the ZB paper's unit convention
(T_F = T_B = T_W = 1) for ZB-H1 and a backward of 2 for 1F1B, the comparison the paper makes,
and `simulate(s, 1, 2)` gives the same costs. t_comm is added to every dependency that crosses
devices (stage k-1 -> k forward, k+1 -> k backward).

Memory counting. The activations of (stage, micro-batch) are alive from the start of its F to
the end of its last backward op: B, or W in ZB-H1 (W needs the layer inputs that F saved, so
deferring W keeps them). A device's count is in micro-batches of its whole share of the layers:
stage-activations / v. Because a device runs its list in order, the peak does not depend on
costs.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
NEEDS_M_GE_P = ("interleaved", "zb-h1")


@dataclasses.dataclass(frozen=True, order=True)
class Op:
    """One unit of pipeline work: F, B or W of micro-batch `micro_batch` on (virtual) `stage`."""
    kind: str          # "F" forward; "B" backward (ZB-H1: input gradient only, else all of it);
    stage: int         # "W" weight gradient (ZB-H1 only)
    micro_batch: int
    device: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@s{self.stage}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per device, the ordered list of ops it executes (`programs[d]`)."""
    name: str
    p: int
    m: int
    v: int
    programs: tuple[tuple[Op, ...], ...]

    @property
    def stages(self) -> int:
        return self.p * self.v

    @property
    def split_backward(self) -> bool:
        return any(op.kind == "W" for prog in self.programs for op in prog)

    def ops(self) -> list[Op]:
        return [op for prog in self.programs for op in prog]

    def table(self, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None,
              t_comm: float = 0.0) -> list["Row"]:
        """Rows (tick, device, stage, micro_batch, op) of a simulation with these costs."""
        return simulate(self, t_f, t_b, t_w, t_comm).table()


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
    in_flight: list[float]             # per device, peak micro-batches of activations (see top)

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


# ----------------------------------------------------------------------------- validation

def check(name: str, p: int, m: int, v: int = 1, n_layers: int | None = None) -> None:
    """Raise ValueError, naming the numbers and the fix, when (name, p, m, v) is no schedule."""
    if name not in NAMES:
        raise ValueError(f"plan.schedule={name!r} is unknown: valid are {', '.join(NAMES)}")
    for key, val in (("pp (p)", p), ("micro-batches (m)", m), ("plan.virtual_stages (v)", v)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
            raise ValueError(f"{key}={val!r}: must be an integer >= 1")
    if v > 1 and name != "interleaved":
        raise ValueError(f"plan.virtual_stages={v} applies only to plan.schedule=interleaved "
                         f"(got {name!r}): set plan.virtual_stages=1 or plan.schedule=interleaved")
    if name in NEEDS_M_GE_P and m < p:
        raise ValueError(f"plan.schedule={name} needs at least as many micro-batches as pipeline "
                         f"stages: m={m} < p={p}; set plan.accumulate >= {p}, or use 1f1b/gpipe")
    if name == "interleaved" and m % p:
        lo, hi = m // p * p, (m // p + 1) * p
        raise ValueError(f"plan.schedule=interleaved needs the micro-batch count to be a multiple "
                         f"of p={p}: m={m}; use m={lo} or m={hi}")
    if n_layers is not None and n_layers % (p * v):
        what = f"p x v = {p} x {v} = {p * v}" if v > 1 else f"p = {p}"
        raise ValueError(f"model.n_layers={n_layers} is not divisible by the {p * v} pipeline "
                         f"stages ({what}): pick n_layers, pp or virtual_stages so that "
                         f"{p * v} divides n_layers")


# ----------------------------------------------------------------------------- generators

def _prog(d: int, items) -> tuple[Op, ...]:
    return tuple(Op(kind, stage, j, d) for kind, stage, j in items)


def naive(p: int, m: int = 1) -> Schedule:
    """One micro-batch through all stages and back, then the next: no two stages ever busy."""
    check("naive", p, m)
    progs = [_prog(d, [x for j in range(m) for x in (("F", d, j), ("B", d, j))])
             for d in range(p)]
    return Schedule("naive", p, m, 1, tuple(progs))


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (same micro-batch order)."""
    check("gpipe", p, m)
    progs = [_prog(d, [("F", d, j) for j in range(m)] + [("B", d, j) for j in range(m)])
             for d in range(p)]
    return Schedule("gpipe", p, m, 1, tuple(progs))


def one_f_one_b(p: int, m: int) -> Schedule:
    """Warm-up forwards (p-1-d on device d), one forward one backward, drain the backwards."""
    check("1f1b", p, m)
    progs = []
    for d in range(p):
        w = min(p - 1 - d, m)
        items = [("F", d, j) for j in range(w)]
        for j in range(m - w):
            items += [("F", d, w + j), ("B", d, j)]
        items += [("B", d, j) for j in range(m - w, m)]
        progs.append(_prog(d, items))
    return Schedule("1f1b", p, m, 1, tuple(progs))


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: device d holds stages d + c p (chunk c < v). Its i-th forward
    (of m v) is chunk (i mod p v) // p of micro-batch (i // p v) p + i mod p; its i-th backward
    the same with the chunks reversed. Warm-up: 2 (p-1-d) + (v-1) p forwards (all of them when
    m = p), then one forward one backward, then the remaining backwards."""
    check("interleaved", p, m, v)
    total = m * v

    def unit(i: int, forward: bool) -> tuple[int, int]:
        c = (i % (p * v)) // p
        return (c if forward else v - 1 - c), (i // (p * v)) * p + i % p

    progs = []
    for d in range(p):
        w = total if m == p else min(2 * (p - 1 - d) + (v - 1) * p, total)
        order = [("F", i) for i in range(w)]
        for k in range(total - w):
            order += [("F", w + k), ("B", k)]
        order += [("B", k) for k in range(total - w, total)]
        items = []
        for kind, i in order:
            c, j = unit(i, kind == "F")
            items.append((kind, c * p + d, j))
        progs.append(_prog(d, items))
    return Schedule("interleaved", p, m, v, tuple(progs))


def zb_h1(p: int, m: int) -> Schedule:
    """Zero Bubble H1: 1F1B with the backward split into B and W. Device d runs W of micro-batch
    j - d right after B of micro-batch j (its first d W passes wait), and in the drain one
    deferred W after each B; the W passes left run at the end. Peak: p micro-batches (until W)."""
    check("zb-h1", p, m)
    progs = []
    for d in range(p):
        w = min(p - 1 - d, m)
        items, pending = [("F", d, j) for j in range(w)], []
        for j in range(m):
            if j < m - w:
                items.append(("F", d, w + j))
            items.append(("B", d, j))
            pending.append(j)
            if len(pending) > d or j >= m - w:
                items.append(("W", d, pending.pop(0)))
        items += [("W", d, j) for j in pending]
        progs.append(_prog(d, items))
    return Schedule("zb-h1", p, m, 1, tuple(progs))


def make(name: str, p: int, m: int, v: int = 1, n_layers: int | None = None) -> Schedule:
    """The schedule `name` (one of NAMES) for p devices, m micro-batches, v virtual stages; with
    n_layers, also checks that the p v stages split the layers evenly."""
    check(name, p, m, v, n_layers)
    if name == "naive":
        return naive(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    return zb_h1(p, m)


# ----------------------------------------------------------------------------- simulator

def deps(op: Op, stages: int) -> list[Op]:
    """The (kind, stage, micro_batch) of the ops `op` waits for; stage k runs on device k % p."""
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
                    t = max(t, end[k] + (t_comm if k[1] % p != d else 0.0))
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


def in_flight(schedule: Schedule) -> list[float]:
    """Per device, the peak number of micro-batches whose activations are alive (see top)."""
    out = []
    for prog in schedule.programs:
        last = "W" if any(op.kind == "W" for op in prog) else "B"
        n = peak = 0
        for op in prog:
            n += 1 if op.kind == "F" else -1 if op.kind == last else 0
            peak = max(peak, n)
        out.append(peak / schedule.v)
    return out


def formula_bubble(name: str, p: int, m: int, v: int = 1, *, t_f: float = 1.0, t_b: float = 1.0,
                   t_w: float = 1.0, validate: bool = True) -> float | None:
    """The closed-form bubble (idle / devices x makespan), equal stages, free communication.
    The costs matter only for zb-h1 (T_F, T_B, T_W, the paper's split; one unit each by default):
    bubble time (p-1)(T_F+T_B-T_W) next to m (T_F+T_B+T_W) of work, (p-1)/(3m+p-1) at unit
    costs. That form holds (the simulator agrees exactly) while T_W <= min(T_F, T_B); beyond,
    None. `validate=False` evaluates the form for any (p, m, v) (the planner reports a plan's
    problems separately)."""
    if validate:
        check(name, p, m, v)
    if name == "naive":
        return (p - 1) / p
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if t_w > min(t_f, t_b):
        return None                  # W too long to hide in the drain: no closed form here
    idle = (p - 1) * (t_f + t_b - t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


# ----------------------------------------------------------------------------- drawing

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def _gantt(ax, result: Result) -> None:
    sc = result.schedule
    for op, t0 in result.start.items():
        dt = result.end[op] - t0
        chunk = op.stage // sc.p
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
