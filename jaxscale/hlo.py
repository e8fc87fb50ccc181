"""Read a compiled (SPMD-partitioned) HLO module: collectives, their replica groups, loop counts, dots.

What the census needs from `compiled.as_text()`:
- every collective instruction (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute, and their async `-start` forms), its per-device result bytes and the device
  groups it runs over, in any of XLA's spellings: explicit `{{0,1},{2,3}}`, iota
  `[4,2]<=[2,4]T(1,0)`, or mesh form `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (with optional
  `device_ids=(...)`), and `source_target_pairs` for permutes;
- how many times each computation runs: a `while` body runs `known_trip_count` times per
  execution of its caller (a scan over layers puts one layer's collectives in such a body), so
  counts and bytes are multiplied along the call graph from ENTRY;
- dot instructions with their shapes, for matmul FLOPs (XLA's `cost_analysis()` counts a while
  body once, whatever its trip count).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[subfc]\d+|f8e\w+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass
class Instr:
    name: str
    type_str: str
    opcode: str
    rest: str
    computation: str


def shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _SHAPE.findall(type_str)]


def nbytes(shape_list) -> float:
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(dims) for dt, dims in shape_list)


class Module:
    """A parsed HLO module: instructions per computation and each computation's run count."""

    def __init__(self, text: str):
        self.instrs: list[Instr] = []
        self.entry = None
        edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
        comp = None
        for line in text.splitlines():
            m = _COMP.match(line)
            if m and "=" not in line.split("(")[0]:
                comp = m.group(2)
                if m.group(1):
                    self.entry = comp
                continue
            im = _INSTR.match(line)
            if not im or comp is None:
                continue
            ins = Instr(im.group(1), im.group(2), im.group(3), im.group(4), comp)
            self.instrs.append(ins)
            trip = _TRIP.search(ins.rest)
            for kind, callee in _CALLS.findall(ins.rest):
                n = int(trip.group(1)) if (ins.opcode == "while" and kind in ("body", "condition")
                                           and trip) else 1
                edges[comp].append((callee, n))
            for b in _BRANCHES.findall(ins.rest):
                edges[comp] += [(c.strip().lstrip("%"), 1) for c in b.split(",") if c.strip()]
        self.unknown_trip = [i.name for i in self.instrs
                             if i.opcode == "while" and not _TRIP.search(i.rest)]
        self.runs = self._propagate(edges)

    def _propagate(self, edges) -> dict[str, float]:
        runs: dict[str, float] = defaultdict(float)
        if self.entry is None:
            return runs
        order, seen = [], set()

        def visit(c):           # post-order DFS gives a reverse topological order
            if c in seen:
                return
            seen.add(c)
            for callee, _ in edges.get(c, ()):
                visit(callee)
            order.append(c)
        visit(self.entry)
        runs[self.entry] = 1.0
        for c in reversed(order):
            for callee, n in edges.get(c, ()):
                runs[callee] += runs[c] * n
        return runs


# ----------------------------------------------------------------------------- device groups
def _iota(dims, perm, out_shape):
    arr = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        arr = arr.transpose(perm)
    return arr.reshape(out_shape)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def replica_groups(rest: str) -> list[list[int]] | None:
    """Device groups of a collective, or None if it names none (all devices in one group)."""
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}", rest)
    if m:
        return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1) or "")] or None
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        perm = _ints(m.group(4)) if m.group(4) else None
        return _iota(_ints(m.group(3)), perm, (g, s)).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\([^)]*\)\)?|\{[^}]*\}))?"
                  r"\s*\{([^}]*)\}", rest)
    if m:
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        dev = m.group(2)
        if dev and dev.startswith("("):
            dm = re.match(r"\(\[([\d,]+)\](?:T\(([\d,]+)\))?", dev)
            ids = _iota(_ints(dm.group(1)), _ints(dm.group(2)) if dm.group(2) else None, sizes)
        elif dev:
            ids = np.array(_ints(dev.strip("{}"))).reshape(sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        group_axes = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        if not group_axes:
            return [[int(i)] for i in ids.flat]
        keep = [i for i in range(len(names)) if i not in group_axes]
        size = math.prod(sizes[i] for i in group_axes)
        return ids.transpose(keep + group_axes).reshape(-1, size).tolist()
    return None


def source_target_pairs(rest: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if not m:
        return []
    return [tuple(_ints(p)) for p in re.findall(r"\{([\d,\s]+)", m.group(1) + "}")]


def collective_kind(opcode: str) -> str | None:
    base = opcode[:-6] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES else None


def result_bytes(ins: Instr, kind: str) -> float:
    """Per-device result bytes of a collective, reading through async `-start` tuples."""
    sh = [s for s in shapes(ins.type_str) if s[1] or ins.type_str.count("[") == 1]
    if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
        arrays = [s for s in sh if s[1]]       # (inputs..., outputs..., [context scalars])
        sh = arrays[len(arrays) // 2:]
    return nbytes(sh)


# ----------------------------------------------------------------------------- matmul FLOPs
def dot_flops(module: Module) -> float:
    """2 x M x N x K summed over every dot, times how often its computation runs."""
    table: dict[tuple[str, str], list] = {}
    for ins in module.instrs:
        table[(ins.computation, ins.name)] = shapes(ins.type_str)
    total = 0.0
    for ins in module.instrs:
        if ins.opcode != "dot":
            continue
        ops = re.findall(r"%([\w.\-]+)", ins.rest.split(")")[0])
        lhs = table.get((ins.computation, ops[0])) if ops else None
        out = shapes(ins.type_str)
        cm = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
        if not lhs or not out or not cm:
            continue
        k = math.prod(lhs[0][1][d] for d in _ints(cm.group(1)))
        total += 2.0 * math.prod(out[0][1]) * k * module.runs.get(ins.computation, 0.0)
    return total
