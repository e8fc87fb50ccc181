"""Read a compiled (SPMD-partitioned) HLO module: collectives, their replica groups, loop counts.

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
  body once, whatever its trip count): `jaxscale.analysis.hlo_flops` counts them over the run
  counts read here.

XLA:GPU's async forms are read here as well: `all-reduce-start`/`-done` style pairs and their
sugared generic spelling (`reduce-scatter-start`, `fusion-start`, ...): counted at the `-start`,
never at `-update` or `-done`; and unsugared `async-start(...), calls=%wrapped`: counted in the
wrapped computation, which runs once per `async-start` (a `calls=` on `async-update`/`async-done`
is no other run).
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


def nbytes(shape_list, widen: tuple[str, ...] = ()) -> float:
    """Bytes of the shapes (`widen`: dtypes counted at 4 bytes)."""
    return sum((4 if dt in widen else _DTYPE_BYTES.get(dt, 4)) * math.prod(dims)
               for dt, dims in shape_list)


def _depths(entry, edges, conds) -> dict[str, int]:
    """Each computation's nesting depth in conditionals (the entry's 0; a branch one more than
    the computation whose conditional runs it)."""
    inside: dict[str, list[str]] = defaultdict(list)
    for comp, names in conds:
        inside[comp] += names
    depth, todo = {entry: 0}, [entry]
    while todo:
        c = todo.pop()
        for callee, d in [(x, depth[c]) for x, _ in edges.get(c, ())] + \
                         [(x, depth[c] + 1) for x in inside.get(c, ())]:
            if d < depth.get(callee, 1 << 30):
                depth[callee] = d
                todo.append(callee)
    return depth


class Module:
    """A parsed HLO module: instructions per computation and each computation's run count.

    A `conditional` runs one of its branches: each is counted as running every time, unless
    `branch_share` gives, for conditionals with that many branches, the fraction of the runs each
    branch takes (the pipeline engine's switch per tick:
    `jaxscale.strategies.pp.program.Program.branch_share`, averaged over the devices, which run
    different branches at the same tick). With two switches (local SGD's, whose replicas are
    pipelines) it is one list per switch, outermost first: a conditional takes the list with its
    number of branches, and where two have that number, the one of its nesting depth."""

    def __init__(self, text: str, branch_share: list[float] | None = None):
        self.instrs: list[Instr] = []
        self.defs: dict = {}    # (computation, name) -> Instr, and name -> first Instr so named
        self.entry = None
        edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
        conds: list[tuple[str, list[str]]] = []     # (computation, its conditional's branches)
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
            self.defs[(comp, ins.name)] = ins
            self.defs.setdefault(ins.name, ins)
            if ins.opcode.endswith(("-done", "-update")):
                continue        # an async pair's `calls=` names the computation its start runs
            trip = _TRIP.search(ins.rest)
            for kind, callee in _CALLS.findall(ins.rest):
                n = int(trip.group(1)) if (ins.opcode == "while" and kind in ("body", "condition")
                                           and trip) else 1
                edges[comp].append((callee, n))
            for b in _BRANCHES.findall(ins.rest):
                conds.append((comp, [c.strip().lstrip("%") for c in b.split(",") if c.strip()]))
        depth = _depths(self.entry, edges, conds)
        shares = ([] if not branch_share else list(branch_share)
                  if isinstance(branch_share[0], (list, tuple)) else [branch_share])
        for comp, names in conds:
            fits = [s for s in shares if len(s) == len(names)]
            d = depth.get(comp, 0)
            share = (shares[d] if len(fits) > 1 and d < len(shares) and len(shares[d]) == len(names)
                     else fits[0] if fits else [1] * len(names))
            edges[comp] += list(zip(names, share))
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

    def operand_shapes(self, ins: Instr) -> list[list | None]:
        """Each operand's shapes: printed inline (`f32[8,64]{1,0} %a`), else those of the
        instruction that defines the name (optimized HLO prints operands by name only)."""
        out = []
        for op in _split_top(_operand_text(ins.rest)):
            op = re.sub(r"/\*.*?\*/", "", op).strip()
            if "[" in op:
                out.append(shapes(op))
                continue
            d = self.defs.get((ins.computation, op.lstrip("%"))) or self.defs.get(op.lstrip("%"))
            out.append(shapes(d.type_str) if d else None)
        return out


def _operand_text(rest: str) -> str:
    """The operand list of an instruction: `rest` up to the parenthesis closing `opcode(`."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0:
            return rest[:i]
    return rest


def _split_top(s: str) -> list[str]:
    """`s` split at the commas outside any bracket, blank pieces dropped."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def _tuple_elements(type_str: str) -> list[str]:
    """Top-level elements of a tuple type `(a, (b, c), d)`; a non-tuple type is its own element."""
    t = type_str.strip()
    return _split_top(t[1:-1]) if t.startswith("(") and t.endswith(")") else [t]


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


def result_bytes(ins: Instr, kind: str, widen: tuple[str, ...] = ()) -> float:
    """Per-device result bytes of a collective, reading through async `-start` tuples
    (`widen`: dtypes counted at 4 bytes)."""
    if ins.opcode.endswith("-start"):
        elems = _tuple_elements(ins.type_str)
        if len(elems) > 1 and elems[0].startswith("("):
            # ((operands...), output(s), [context]): the generic async wrapper in its sugared
            # spelling (`reduce-scatter-start`, `all-to-all-start`, ...) and combined all-gathers
            return nbytes((s for s in shapes(elems[1]) if s[1] or elems[1].count("[") == 1),
                          widen)
    sh = [s for s in shapes(ins.type_str) if s[1] or ins.type_str.count("[") == 1]
    if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
        arrays = [s for s in sh if s[1]]       # (inputs..., outputs..., [context scalars])
        sh = arrays[len(arrays) // 2:]
    return nbytes(sh, widen)
