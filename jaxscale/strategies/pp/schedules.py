"""Pipeline schedules as data: per device, the ordered ops it runs, and their closed forms.

A schedule is, per device, the ordered list of ops that device executes; an op is a forward (F),
a backward (B) or, in the zero-bubble schedules, a weight-gradient pass (W) of one micro-batch on
one stage. There are p devices and S = p v stages (v chunks per device); `Schedule.placement`
says which device holds each stage: stage k on device k % p (the loop placement: v = 1, or
Megatron's interleaving), or the V placement of ZB-V (device d holds stages d and 2p-1-d, so the
first and the last stage share device 0). `simulator.py` runs the lists with op costs; the
planner reads the closed forms here; the engine runs the same lists (`program.py`). No JAX.

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
- zb-v: Zero Bubble V (the same paper's V-shaped schedule, torchtitan's ZBVZeroBubble): two
  chunks per device in the V placement, B and W split as in ZB-H1. A micro-batch runs down the
  devices and back up, so device 0 starts the backward as soon as its forward has crossed the
  pipeline twice, and its W passes fill what is left: with T_F = T_B = T_W the only idle time is
  each device's wait for the first forward to reach it, d chunk-forwards at the start and as many
  at the end, (p-1) T_F / 2 per device on average (against ZB-H1's (p-1) T_F), fraction
  (p-1)/(6m+p-1). Memory p on device 0, like 1F1B (2p chunk-activations of half its layers);
  m >= 2p (with fewer, the warm-up cannot fill the pipeline twice and the idle time grows).
  The order of each device's list is `zb_v`'s.

Memory counting (`in_flight`). The activations of (stage, micro-batch) are alive from the start
of its F to the end of its last backward op: B, or W when the backward is split (W needs the
matmul inputs F saved, so deferring W keeps them). A device's count is in micro-batches of its
whole share of the layers: stage-activations / v. Because a device runs its list in order, the
peak does not depend on costs.
"""
from __future__ import annotations

import dataclasses
import numbers

NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
NEEDS_M_GE_P = ("interleaved", "zb-h1")
#: schedules whose backward is split into B (input gradient) and W (weight gradient)
SPLIT = ("zb-h1", "zb-v")


@dataclasses.dataclass(frozen=True, order=True)
class Op:
    """One unit of pipeline work: F, B or W of micro-batch `micro_batch` on (virtual) `stage`."""
    kind: str          # "F" forward; "B" backward (zero bubble: the input gradient only);
    stage: int         # "W" weight gradient (zero bubble only)
    micro_batch: int
    device: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@s{self.stage}"


def loop_placement(p: int, v: int = 1) -> tuple[int, ...]:
    """Stage k on device k % p: one stage per device, or Megatron's interleaved chunks."""
    return tuple(k % p for k in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """ZB-V's: device d holds stages d and 2p-1-d."""
    return tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per device, the ordered list of ops it executes (`programs[d]`); `placement[k]` is the
    device of stage k (None: the loop placement)."""
    name: str
    p: int
    m: int
    v: int
    programs: tuple[tuple[Op, ...], ...]
    placement: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.placement is None:
            object.__setattr__(self, "placement", loop_placement(self.p, self.v))

    @property
    def stages(self) -> int:
        return self.p * self.v

    def device_of(self, stage: int) -> int:
        return self.placement[stage]

    def chunk_of(self, stage: int) -> int:
        """The stage's place among its device's stages, in stage order (the device's chunk)."""
        d = self.placement[stage]
        return sum(1 for k in range(stage) if self.placement[k] == d)

    def stage_of(self, device: int, chunk: int) -> int:
        return [k for k in range(self.stages) if self.placement[k] == device][chunk]

    @property
    def split_backward(self) -> bool:
        return any(op.kind == "W" for prog in self.programs for op in prog)

    def ops(self) -> list[Op]:
        return [op for prog in self.programs for op in prog]


def chunks(name: str, v: int = 1) -> int:
    """Chunks (virtual stages) per device: v for interleaved, 2 for ZB-V, else 1."""
    return v if name == "interleaved" else 2 if name == "zb-v" else 1


# ----------------------------------------------------------------------------- validation

def check(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ValueError, naming the numbers and the fix, when (name, p, m, v) is no schedule."""
    if name not in NAMES:
        raise ValueError(f"plan.schedule={name!r} is unknown: valid are {', '.join(NAMES)}")
    for key, val in (("pp (p)", p), ("micro-batches (m)", m), ("plan.virtual_stages (v)", v)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
            raise ValueError(f"{key}={val!r}: must be an integer >= 1")
    if v > 1 and name != "interleaved" and not (name == "zb-v" and v == 2):
        raise ValueError(f"plan.virtual_stages={v} applies only to plan.schedule=interleaved "
                         f"(got {name!r}; zb-v always holds 2): set plan.virtual_stages=1 or "
                         f"plan.schedule=interleaved")
    if name in NEEDS_M_GE_P and m < p:
        raise ValueError(f"plan.schedule={name} needs at least as many micro-batches as pipeline "
                         f"stages: m={m} < p={p}; set plan.accumulate >= {p}, or use 1f1b/gpipe")
    if name == "zb-v" and m < 2 * p:
        raise ValueError(f"plan.schedule=zb-v needs at least twice as many micro-batches as "
                         f"pipeline devices: m={m} < 2p={2 * p}; set plan.accumulate >= {2 * p}, "
                         f"or use zb-h1")
    if name == "interleaved" and m % p:
        lo, hi = m // p * p, (m // p + 1) * p
        raise ValueError(f"plan.schedule=interleaved needs the micro-batch count to be a multiple "
                         f"of p={p}: m={m}; use m={lo} or m={hi}")


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


def zb_v(p: int, m: int) -> Schedule:
    """Zero Bubble V over the V placement: device d (chunks c0 = d, c1 = 2p-1-d) warms up with
    2(p-d)-1 forwards of c0, d pairs (F c1, F c0) and p-d triples (F, B, W) of c1; then, while
    forwards remain, (F, B, W) of c0 and of c1 in turn; then the remaining B passes, c0 before c1
    each round, and the W passes left (c1's, then c0's). Peak: 2p chunk-activations (p
    micro-batches of the device's layers); m >= 2p."""
    check("zb-v", p, m, 2)
    progs = []
    for d in range(p):
        c0, c1 = d, 2 * p - 1 - d
        items: list = []
        done = {(k, c): 0 for k in "FBW" for c in (c0, c1)}

        def run(kind, c):
            bound = m if kind == "F" else done["F" if kind == "B" else "B", c]
            if done[kind, c] < bound:
                items.append((kind, c, done[kind, c]))
                done[kind, c] += 1

        for _ in range(2 * (p - d) - 1):
            run("F", c0)
        for _ in range(d):
            run("F", c1)
            run("F", c0)
        for _ in range(p - d):
            for kind in "FBW":
                run(kind, c1)
        while done["F", c0] < m or done["F", c1] < m:
            for c in (c0, c1):
                for kind in "FBW":
                    run(kind, c)
        while done["B", c0] < m or done["B", c1] < m:
            run("B", c0)
            run("B", c1)
        for c in (c1, c0):
            while done["W", c] < m:
                run("W", c)
        progs.append(_prog(d, items))
    return Schedule("zb-v", p, m, 2, tuple(progs), v_placement(p))


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` (one of NAMES) for p devices, m micro-batches, v virtual stages."""
    check(name, p, m, v)
    if name == "naive":
        return naive(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    if name == "zb-v":
        return zb_v(p, m)
    return zb_h1(p, m)


# ----------------------------------------------------------------------------- closed forms

def formula_bubble(name: str, p: int, m: int, v: int = 1, *, t_f: float = 1.0, t_b: float = 1.0,
                   t_w: float = 1.0, validate: bool = True) -> float | None:
    """The closed-form bubble (idle / devices x makespan), equal stages, free communication.
    The costs matter only for the zero-bubble schedules (T_F, T_B, T_W, the paper's split; one
    unit each by default): ZB-H1's bubble time (p-1)(T_F+T_B-T_W) next to m (T_F+T_B+T_W) of
    work, (p-1)/(3m+p-1) at unit costs, while T_W <= min(T_F, T_B); ZB-V's (p-1) T_F / 2 at
    equal costs, (p-1)/(6m+p-1). Beyond those costs, None. `validate=False` evaluates the form
    for any (p, m, v) (the planner reports a plan's problems separately)."""
    if validate:
        check(name, p, m, v)
    if name == "naive":
        return (p - 1) / p
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    work = m * (t_f + t_b + t_w)
    if name == "zb-v":
        if not t_f == t_b == t_w:
            return None              # the list scheduler's lists are built at equal costs
        idle = (p - 1) * t_f / 2
    elif t_w > min(t_f, t_b):
        return None                  # W too long to hide in the drain: no closed form here
    else:
        idle = (p - 1) * (t_f + t_b - t_w)
    return idle / (work + idle)


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
