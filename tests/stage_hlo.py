"""What one run of each pipeline op computes and sends, read from the compiled step.

The pipeline engine (`jaxscale.strategies.pp.engine`) runs one `lax.switch` per tick and
device over the program's branches (`program.Program.branches`: idle, then (kind, first row,
layers, first stage?, last stage?)); the compiled step holds each branch as a computation of one
`conditional` inside the tick loop. `branches` reads, for one run of each branch on one device,
its matmul FLOPs (the stage's layer loop counted by its trip count), its collectives by (kind,
mesh axes) and the shapes of its matmuls: `hlo.Module`'s accounting with the switch's share
set to that branch alone, once per step, less the same accounting with no branch run. The tests
set these beside values derived by hand from the shapes: what a stage computes (its real layers,
not its padding), what its experts exchange, where its weight gradients are computed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from jaxscale.analysis import hlo, hlo_flops, inspect


@dataclass
class Branch:
    key: tuple                  # (kind, first row, layers, first stage?, last stage?)
    flops: float = 0.0          # matmul FLOPs of one run
    collectives: dict = field(default_factory=dict)    # (kind, axes) -> (count, bytes)
    dots: list = field(default_factory=list)           # (out, lhs, rhs shapes) per matmul run

    def sent(self, kind: str, axes: tuple[str, ...]) -> tuple[int, int]:
        """(count, bytes) of one kind of collective over `axes` in one run."""
        return self.collectives.get((kind, axes), (0, 0))


def _share(n: int, ticks: int, i: int | None) -> list[float]:
    share = [0.0] * n
    if i is not None:
        share[i] = 1.0 / ticks        # the tick loop runs the switch `ticks` times
    return share


def _axes(ins, kind, mesh) -> tuple[str, ...] | None:
    """The mesh axes a collective runs over (None: a group of one device, no transfer)."""
    if kind == "collective-permute":
        pairs = [p for p in hlo.source_target_pairs(ins.rest) if p[0] != p[1]]
        return tuple(sorted({a for p in pairs for a in inspect.axes_of_group(p, mesh)},
                            key=mesh.axis_names.index)) or None
    groups = hlo.replica_groups(ins.rest) or [list(range(mesh.devices.size))]
    return inspect.axes_of_group(groups[0], mesh) if len(groups[0]) > 1 else None


def branches(text: str, mesh, prog) -> dict[tuple, Branch]:
    """branch key -> `Branch` of one run of it (the idle branch left out)."""
    n, ticks = len(prog.branches), prog.ticks
    switch = [re.findall(r"%?([\w.\-]+)", b)
              for b in re.findall(r"branch_computations=\{([^}]*)\}", text)]
    switch = [names for names in switch if len(names) == n]
    assert len(switch) == 1, f"one conditional of {n} branches expected, found {len(switch)}"
    base = hlo.Module(text, _share(n, ticks, None)).runs
    out = {}
    for i, key in enumerate(prog.branches):
        if key[0] == "idle":
            continue
        mod = hlo.Module(text, _share(n, ticks, i))
        assert mod.runs[switch[0][i]] == 1.0, (key, mod.runs[switch[0][i]])
        b = out[key] = Branch(key)
        for ins in mod.instrs:
            runs = mod.runs.get(ins.computation, 0.0) - base.get(ins.computation, 0.0)
            if runs <= 0:
                continue
            kind = hlo.collective_kind(ins.opcode)
            axes = kind and _axes(ins, kind, mesh)
            if axes:
                size = hlo.result_bytes(ins, kind)
                if kind == "reduce-scatter":        # the census's convention: the input
                    size *= len((hlo.replica_groups(ins.rest) or [[0]])[0])
                count, nbytes = b.collectives.get((kind, axes), (0, 0))
                b.collectives[kind, axes] = (count + round(runs), nbytes + size * runs)
        for _, ins, f in hlo_flops.matmuls(mod):
            runs = mod.runs.get(ins.computation, 0.0) - base.get(ins.computation, 0.0)
            if runs > 0:
                b.flops += f * runs
                ops = [hlo_flops._array(o) for o in mod.operand_shapes(ins)[:2]]
                b.dots += [(hlo_flops._array(hlo.shapes(ins.type_str)), *ops)] * round(runs)
    return out
