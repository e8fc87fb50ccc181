"""A pipeline schedule as the engine runs it: ticks, branches, buffer slots and transfers.

`compile_schedule` turns a schedule (`schedules.py`: per device, an ordered list of F / B / W
ops) into a table of ticks: the schedule simulated with every op costing one tick, so each device
runs at most one op per tick and an op's inputs were sent at the end of an earlier tick. Slots
are assigned when the table is built (a register allocation per device), so each buffer holds
the peak number of values alive at once: GPipe's residual buffer has m slots, 1F1B's p. The
planner reads the same table (`program_for`): the permutes per step, the slots in flight, the
share of each branch.

Buffers per device: `act` (stage inputs received), `grad` (output gradients received, or the
last stage's own), `res` (what a forward keeps for its backward) and, when the backward is split
(ZB-H1, ZB-V), `tape` (the matmul inputs and output gradients a B keeps for its W; B frees the
residuals, W only the tape). Transfers: a stage's output goes to the next stage's device over
the `up` ring (d -> d+1) or the `down` ring (d -> d-1), or stays on the device (ZB-V's turn on
the last device, where stages p-1 and p meet); its input gradient the other way. Each ring is one
collective-permute per tick over the pairs the schedule ever uses (interleaving wraps from the
last device to the first).

A branch is (kind, first row of the stage's block on its device, the stage's layers, first
stage?, last stage?): uneven stages (`stages.py`) run scans of their own length. No JAX here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jaxscale.strategies.pp import schedules as ps
from jaxscale.strategies.pp import stages as st
from jaxscale.strategies.pp.simulator import simulate

IDLE = 0
#: per tick and device: the branch, the micro-batch and stage, the slots read (`inp`: the act,
#: grad or tape slot the op reads; `res`), written (`out`: the last stage's gradient; `tape`),
#: where the op's output goes (`send`: 0 nowhere, 1 up, 2 down, 3 kept here, at slot `keep_act`
#: or `keep_grad`), and the slots that receive what each ring brings (-1: nothing)
FIELDS = ("branch", "mb", "stage", "inp", "res", "out", "tape", "send", "keep_act",
          "keep_grad", "up_act", "up_grad", "down_act", "down_grad")
UP, DOWN, HERE = 1, 2, 3


@dataclass(frozen=True)
class Program:
    """A schedule as the engine runs it: per tick and device the fields of `FIELDS` (branch 0 =
    idle, slots -1 = none), the ring pairs, the senders of each tick, the slot counts."""
    schedule: ps.Schedule
    branches: tuple[tuple, ...]                 # (kind, row0, layers, first, last); [0] idle
    table: np.ndarray                           # [ticks, p, len(FIELDS)] int32
    rings: dict                                 # "up" / "down" -> ((src, dst), ...) used
    sends: dict                                 # "up" / "down" -> per tick, devices sending
    slots: dict                                 # {"act", "grad", "res", "tape"} -> count

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def forward_only(self) -> bool:
        return all(b[0] in ("idle", "F") for b in self.branches)

    @property
    def permutes(self) -> int:
        """Collective-permutes per step: one per used ring and tick."""
        return self.ticks * sum(1 for r in self.rings.values() if r)

    @property
    def useful_sends(self) -> int:
        """Ring-ticks in which some device has a value to send: the permutes an unrolled engine
        would issue (the tick loop sends zeros in the others)."""
        return sum(sum(map(bool, s)) for s in self.sends.values())

    def branch_share(self) -> list[float]:
        """Per branch, the fraction of (tick, device) slots it fills: how often the switch runs it,
        averaged over the devices (`hlo.Module`'s `branch_share`)."""
        b = self.table[..., 0]
        return [float(np.mean(b == i)) for i in range(len(self.branches))]


class _Pool:
    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


def _direction(p: int, src: int, dst: int) -> int:
    if src == dst:
        return HERE
    return UP if dst == (src + 1) % p else DOWN


def compile_schedule(schedule: ps.Schedule, counts: tuple[int, ...] | None = None,
                     forward_only: bool = False) -> Program:
    """Ticks, branches and slots of `schedule` with `counts` layers per stage (None: equal
    stages of one layer each, for tables that do not run), forward_only: its F ops only."""
    p, v, S = schedule.p, schedule.v, schedule.stages
    counts = counts or (1,) * S
    rows = max(counts)
    if forward_only:
        schedule = ps.Schedule(schedule.name, p, schedule.m, v, tuple(
            tuple(op for op in prog if op.kind == "F") for prog in schedule.programs),
            schedule.placement)
    split = schedule.split_backward
    res = simulate(schedule, v, v, v if split else None)       # every op one unit
    times = sorted(set(res.start.values()))
    at: list[dict[int, ps.Op]] = [{} for _ in times]
    for op, t in res.start.items():
        at[times.index(t)][op.device] = op
    branches: list = [("idle", 0, 0, False, False)]
    table = np.full((len(times), p, len(FIELDS)), -1, np.int32)
    table[..., 0] = IDLE
    table[..., FIELDS.index("send")] = 0
    pools = [{k: _Pool() for k in ("act", "grad", "res", "tape")} for _ in range(p)]
    held: dict[tuple, int] = {}        # (buffer, stage, micro-batch) -> slot, on the stage's device
    rings = {"up": set(), "down": set()}
    sends = {"up": [], "down": []}
    col = {f: i for i, f in enumerate(FIELDS)}
    for t, ops in enumerate(at):
        out = []                       # (device, value kind, target stage, micro-batch, target)
        for d, op in sorted(ops.items()):
            s, j, pool = op.stage, op.micro_batch, pools[d]
            key = (op.kind, schedule.chunk_of(s) * rows, counts[s], s == 0, s == S - 1)
            if key not in branches:
                branches.append(key)
            row = dict(branch=branches.index(key), mb=j, stage=s)
            if op.kind == "F":
                if s > 0:
                    row["inp"] = held.pop(("act", s, j))
                    pool["act"].give(row["inp"])
                if not forward_only:
                    row["res"] = held[("res", s, j)] = pool["res"].take()
                if s == S - 1 and not forward_only:
                    row["out"] = held[("grad", s, j)] = pool["grad"].take()
                elif s < S - 1:
                    out.append((d, "act", s + 1, j))
            elif op.kind == "B":
                row["res"], row["inp"] = held[("res", s, j)], held[("grad", s, j)]
                pool["res"].give(held.pop(("res", s, j)))
                pool["grad"].give(held.pop(("grad", s, j)))
                if split:
                    row["tape"] = held[("tape", s, j)] = pool["tape"].take()
                if s > 0:
                    out.append((d, "grad", s - 1, j))
            else:                      # W: the tape of its B
                row["inp"] = held.pop(("tape", s, j))
                pool["tape"].give(row["inp"])
            for k, val in row.items():
                table[t, d, col[k]] = val
        for name in sends:
            sends[name].append([])
        for d, kind, target, j in out:     # received at the end of the tick, after every op ran
            r = schedule.device_of(target)
            way = _direction(p, d, r)
            slot = held[(kind, target, j)] = pools[r][kind].take()
            table[t, d, col["send"]] = way
            if way == HERE:
                table[t, d, col[f"keep_{kind}"]] = slot
                continue
            name = "up" if way == UP else "down"
            rings[name].add((d, r))
            sends[name][-1].append(d)
            table[t, r, col[f"{name}_{kind}"]] = slot
    assert not held, f"values never consumed: {sorted(held)[:4]}"
    slots = {k: max(1, max(pl[k].size for pl in pools)) for k in ("act", "grad", "res", "tape")}
    return Program(schedule, tuple(branches), table,
                   {k: tuple(sorted(r)) for k, r in rings.items()},
                   {k: tuple(tuple(x) for x in s) for k, s in sends.items()}, slots)


def program_for(spec, forward_only: bool = False) -> Program:
    """The plan's schedule as the engine runs it (cached: the planner asks often)."""
    return _program(spec.schedule, spec.deg("pp"), max(1, spec.accumulate),
                    ps.chunks(spec.schedule, spec.virtual_stages), st.counts(spec), forward_only)


@functools.lru_cache(maxsize=256)
def _program(name: str, p: int, m: int, v: int, counts: tuple, forward_only: bool) -> Program:
    return compile_schedule(ps.make(name, p, m, v), counts, forward_only)
