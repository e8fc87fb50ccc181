"""A pipeline schedule as the engine runs it: ticks, branches and buffer slots; the stored layer
order it implies.

`compile_schedule` turns a schedule (`schedules.py`: per device, an ordered list of F / B / W
ops) into a table of ticks: the schedule simulated with every op costing one tick, so each device
runs at most one op per tick and an op's inputs were sent at the end of an earlier tick. Slots
are assigned when the table is built (a register allocation per device), so each buffer holds
the peak number of values alive at once: GPipe's residual buffer has m slots, 1F1B's p. The
planner reads the same table (`program_for`): the permutes per step, the slots in flight, the
share of each branch.

Stage s (of S = p v) lives on device s mod p as its chunk s // p. Device d's local share of the
stacked layers is chunk-major: with interleaving (v > 1) the stored layer order is a permutation
of the model's (`layer_order`), which `reorder` undoes or redoes, e.g. when a checkpoint is
restored under another plan. No JAX here but in `reorder`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jaxscale.strategies.pp import schedules as ps


def virtual(spec) -> int:
    """Virtual stages per device: `plan.virtual_stages` for the interleaved schedule, else 1."""
    return spec.virtual_stages if spec.schedule == "interleaved" else 1


def layer_order(spec) -> list[int] | None:
    """Stored row -> model layer of the stacked layers under this plan; None for the model's
    own order. Interleaving (v > 1) stores device d's chunks c = 0..v-1 (stages c p + d) in its
    contiguous share of rows, so the layers axis can stay a plain split over pp."""
    p, v = spec.deg("pp"), virtual(spec)
    if p == 1 or v == 1:
        return None
    per = spec.model.n_layers // (p * v)
    return [(c * p + d) * per + i for d in range(p) for c in range(v) for i in range(per)]


def reorder(tree, saved: list[int] | None, wanted: list[int] | None):
    """`tree` (params, a train state: any tree whose stacked layers sit under a "layers" key) with
    its layers moved from the stored order `saved` to `wanted` (None: the model's order; see
    `layer_order`). Traceable; eagerly, each array keeps its sharding."""
    import jax
    L = next((leaf.shape[0] for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
              if _is_layers(path)), None)
    if L is None or (saved or list(range(L))) == (wanted or list(range(L))):
        return tree
    row_of = {layer: r for r, layer in enumerate(saved or range(L))}
    take = np.array([row_of[layer] for layer in (wanted or range(L))])

    def move(a):
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            return jax.jit(lambda a: a[take], out_shardings=a.sharding)(a)
        return a[take]
    return jax.tree_util.tree_map_with_path(lambda path, a: move(a) if _is_layers(path) else a,
                                            tree)


def _is_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


# ----------------------------------------------------------------------------- the tick table
IDLE = 0
FIELDS = ("branch", "mb", "inp", "res", "out", "recv_act", "recv_grad")


@dataclass(frozen=True)
class Program:
    """A schedule as the engine runs it: per tick and device the fields of `FIELDS` (branch 0 =
    idle, slots -1 = none), the senders of each tick, and the slot counts of each buffer."""
    schedule: ps.Schedule
    branches: tuple[tuple[str, int, bool, bool], ...]      # (kind, chunk, first, last); [0] idle
    table: np.ndarray                                      # [ticks, p, len(FIELDS)] int32
    send_fwd: tuple[tuple[int, ...], ...]                  # per tick, devices sending forward
    send_bwd: tuple[tuple[int, ...], ...]
    slots: dict                                            # {"act", "grad", "res"} -> count

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def forward_only(self) -> bool:
        return all(b[0] in ("idle", "F") for b in self.branches)

    @property
    def permutes(self) -> int:
        """Collective-permutes per step: one forward (and one backward) per tick."""
        return self.ticks * (1 if self.forward_only else 2)

    @property
    def useful_sends(self) -> int:
        """Ticks in which some device has an activation (or gradient) to send: the permutes an
        unrolled engine would issue (the tick loop sends zeros in the others)."""
        return sum(map(bool, self.send_fwd)) + sum(map(bool, self.send_bwd))

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


def compile_schedule(schedule: ps.Schedule, forward_only: bool = False) -> Program:
    """Ticks, branches and slots of `schedule` (forward_only: its F ops, for evaluation)."""
    p, v, S = schedule.p, schedule.v, schedule.stages
    if forward_only:
        schedule = ps.Schedule(schedule.name, p, schedule.m, v, tuple(
            tuple(op for op in prog if op.kind == "F") for prog in schedule.programs))
    split = schedule.split_backward
    res = ps.simulate(schedule, v, v, v if split else None)       # every op one unit
    times = sorted(set(res.start.values()))
    at: list[dict[int, ps.Op]] = [{} for _ in times]
    for op, t in res.start.items():
        at[times.index(t)][op.device] = op
    branches: list = [("idle", 0, False, False)]
    table = np.full((len(times), p, len(FIELDS)), -1, np.int32)
    table[..., 0] = IDLE
    pools = [{k: _Pool() for k in ("act", "grad", "res")} for _ in range(p)]
    held: dict[tuple, int] = {}        # (buffer, stage, micro-batch) -> slot, on the stage's device
    send_f, send_b = [], []
    for t, ops in enumerate(at):
        sf, sb = [], []
        for d, op in sorted(ops.items()):
            s, j, pool = op.stage, op.micro_batch, pools[d]
            key = (op.kind, s // p, s == 0, s == S - 1)
            if key not in branches:
                branches.append(key)
            row = dict(branch=branches.index(key), mb=j)
            if op.kind == "F":
                if s > 0:
                    row["inp"] = held.pop(("act", s, j))
                    pool["act"].give(row["inp"])
                if not forward_only:
                    row["res"] = held[("res", s, j)] = pool["res"].take()
                if s == S - 1 and not forward_only:
                    row["out"] = held[("grad", s, j)] = pool["grad"].take()
                elif s < S - 1:
                    sf.append(d)
            else:
                row["res"], row["inp"] = held[("res", s, j)], held[("grad", s, j)]
                if op.kind == "W" or not split:
                    pool["res"].give(held.pop(("res", s, j)))
                    pool["grad"].give(held.pop(("grad", s, j)))
                if op.kind == "B" and s > 0:
                    sb.append(d)
            for k, val in row.items():
                table[t, d, FIELDS.index(k)] = val
        for d in sf:                   # received at the end of the tick, after every op ran
            op, r = ops[d], (d + 1) % p
            table[t, r, FIELDS.index("recv_act")] = held[("act", op.stage + 1, op.micro_batch)] \
                = pools[r]["act"].take()
        for d in sb:
            op, r = ops[d], (d - 1) % p
            table[t, r, FIELDS.index("recv_grad")] = held[("grad", op.stage - 1, op.micro_batch)] \
                = pools[r]["grad"].take()
        send_f.append(tuple(sf))
        send_b.append(tuple(sb))
    assert not held, f"values never consumed: {sorted(held)[:4]}"
    slots = {k: max(1, max(pl[k].size for pl in pools)) for k in ("act", "grad", "res")}
    return Program(schedule, tuple(branches), table, tuple(send_f), tuple(send_b), slots)


def program_for(spec, forward_only: bool = False) -> Program:
    """The plan's schedule as the engine runs it (cached: the planner asks often)."""
    return _program(spec.schedule, spec.deg("pp"), max(1, spec.accumulate), virtual(spec),
                    forward_only)


@functools.lru_cache(maxsize=256)
def _program(name: str, p: int, m: int, v: int, forward_only: bool) -> Program:
    return compile_schedule(ps.make(name, p, m, v), forward_only)
