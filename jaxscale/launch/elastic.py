"""Elastic restarts: the mesh for the devices left after a process is lost.

`choose_mesh(cfg, devices, processes, was_devices, was_processes)` picks, in this order:
1. the configured plan, where it fits the new device count: a `-1` degree absorbs the change
   (`mesh.dp=-1`), and a hybrid mesh's cross-process part (`mesh.dcn_*`, when it spans one node
   per process) follows the process count;
2. otherwise the nearest plan that fits: every factorization of the device count over the mesh
   axes (ep only with experts), the rest of the plan as configured, each checked the way `train`
   checks it (`plan.unavailable`, `plan.problems`: divisibility of batch, heads, layers...) and
   against device memory (the planner's prediction). Nearest = the fewest factors changed in
   the degrees the plan had on the original devices (|log2(new / old)| summed over the axes),
   then the inner axes (tp, sp, ep...) kept before the outer ones (dp first absorbs a lost
   host, as it does in a hybrid mesh), then the shorter predicted step time.
The choice reaches the restarted command as `--set mesh.X=..` overrides. When nothing fits, a
ValueError names the device count and why the nearest candidates fail.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxscale import plan as plan_lib
from jaxscale.axes import MESH_AXES
from jaxscale.plan import Spec
from jaxscale.planner.predict import predict_spec
from jaxscale.planner.search import factorizations, place_on_nodes


@dataclass
class MeshChoice:
    degrees: dict[str, int]
    dcn: dict[str, int]
    overrides: list[str]        # `--set` values, e.g. "mesh.dp=1"
    same: bool                  # the configured plan, as it is
    devices: int

    def label(self) -> str:
        return " x ".join(f"{a}={d}" for a, d in self.degrees.items() if d > 1) or "one device"

    def describe(self, was: dict[str, int]) -> str:
        before = " x ".join(f"{a}={d}" for a, d in was.items() if d > 1) or "one device"
        if self.same:
            return f"the same plan fits {self.devices} devices: {self.label()}"
        return (f"the plan's mesh {before} does not fit {self.devices} devices; the nearest that "
                f"does: {self.label()} ({' '.join('--set ' + o for o in self.overrides)})")


def _dcn(mesh, degrees: dict, processes: int, was_processes: int) -> dict | None:
    """The cross-node degrees on `processes` processes; None when they cannot be placed."""
    if mesh.nodes == 1:
        return {a: 1 for a in MESH_AXES}
    if mesh.nodes != was_processes:             # nodes that are not processes: as configured
        return mesh.dcn_degrees()
    dcn = place_on_nodes(degrees, processes)
    return dcn if math.prod(dcn.values()) == processes else None


def check(cfg, mesh, devices: int):
    """(problems, prediction) of `cfg` on `mesh` over `devices`: problems [] when it fits."""
    try:
        mesh = mesh.resolve(devices)
    except ValueError as e:
        return [str(e)], None
    spec = Spec.from_config(dataclasses.replace(cfg, mesh=mesh), devices)
    errs = plan_lib.unavailable(spec) + plan_lib.problems(spec)
    if errs:
        return errs, None
    pred = predict_spec(spec)
    if not pred.fits:
        return [f"needs {pred.memory.total / 2**30:.2f} GiB per device, a device has "
                f"{pred.capacity / 2**30:.2f} GiB"], pred
    return [], pred


def _overrides(mesh, degrees: dict, dcn: dict) -> list[str]:
    out = [f"mesh.{a}={degrees[a]}" for a in MESH_AXES if getattr(mesh, a) != degrees[a]]
    return out + [f"mesh.dcn_{a}={dcn[a]}" for a in MESH_AXES
                  if getattr(mesh, f"dcn_{a}") != dcn[a]]


def choose_mesh(cfg, devices: int, processes: int, was_devices: int,
                was_processes: int) -> MeshChoice:
    """The mesh to restart `cfg` on after it ran on `was_devices` in `was_processes`."""
    mesh = cfg.mesh
    was = mesh.resolve(was_devices).degrees()
    fill = {a: d for a, d in mesh.degrees().items() if d == -1}
    if fill:
        known = math.prod(d for d in mesh.degrees().values() if d != -1)
        same = {a: (devices // known if a in fill else d) for a, d in mesh.degrees().items()}
    else:
        same = mesh.degrees()
    dcn = _dcn(mesh, same, processes, was_processes)
    if dcn is not None and math.prod(same.values()) == devices:
        trial = dataclasses.replace(mesh, **{f"dcn_{a}": d for a, d in dcn.items()})
        errs, _ = check(cfg, trial, devices)
        if not errs:
            kept = [o for o in _overrides(mesh, same, dcn) if o.startswith("mesh.dcn_")]
            return MeshChoice(same, dcn, kept, True, devices)
    axes = tuple(a for a in MESH_AXES if a != "ep" or getattr(cfg.model, "moe_experts", 0) > 0)
    ranked, failed = [], []
    for deg in factorizations(devices, axes):
        deg = {a: deg.get(a, 1) for a in MESH_AXES}
        dcn = _dcn(mesh, deg, processes, was_processes)
        if dcn is None:
            continue
        trial = dataclasses.replace(mesh, **deg, **{f"dcn_{a}": d for a, d in dcn.items()})
        errs, pred = check(cfg, trial, devices)
        change = {a: abs(math.log2(deg[a] / was[a])) for a in MESH_AXES}
        key = (round(sum(change.values()), 6),
               tuple(round(change[a], 6) for a in reversed(MESH_AXES)))
        if errs:
            failed.append((key, deg, errs[0]))
        else:
            ranked.append((key, pred.time.total, deg, dcn))
    if not ranked:
        near = sorted(failed, key=lambda f: f[0])[:3]
        why = "; ".join(f"{' x '.join(f'{a}={d}' for a, d in deg.items() if d > 1) or 'one'}"
                        f": {err.splitlines()[0]}" for _, deg, err in near)
        raise ValueError(f"no mesh for {devices} devices fits this plan (nearest: {why}). "
                         f"Restart by hand on other devices or with other --set mesh.* degrees")
    _, _, deg, dcn = min(ranked, key=lambda r: (r[0], r[1]))
    return MeshChoice(deg, dcn, _overrides(mesh, deg, dcn), False, devices)
