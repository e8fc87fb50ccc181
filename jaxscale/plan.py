"""A plan: the mesh, the strategies it implies, their logical->mesh rules, validated up front.

The order that matters is written here once:
1. resolve the mesh degrees against the devices present;
2. check every divisibility the strategies need (all problems reported together);
3. compose the batch rule from the data axes (`dp`, then `fsdp`), outer to inner;
4. let each active strategy add its rules (`fsdp`, then `tp`); a conflict is an error;
5. `layers` stays unsharded (pipeline parallelism will map it to `pp`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale.axes import Rules
from jaxscale.mesh import MeshConfig, make_mesh
from jaxscale.strategies import dp, fsdp, tp

STRATEGIES = {"dp": dp, "fsdp": fsdp, "tp": tp}
NOT_YET = {"pp": "pipeline parallelism", "ep": "expert parallelism",
           "sp": "sequence/context parallelism"}


@dataclass
class Plan:
    mesh_cfg: MeshConfig
    mesh: Mesh
    rules: Rules
    data_axes: tuple[str, ...]

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(a for a in STRATEGIES if getattr(self.mesh_cfg, a) > 1)

    @property
    def data_degree(self) -> int:
        return math.prod(getattr(self.mesh_cfg, a) for a in self.data_axes)

    def spec(self, logical) -> P:
        return self.rules.spec(logical)

    def sharding(self, logical) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(logical))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def validate(cfg, n_devices: int) -> MeshConfig:
    """Resolve the mesh and check the whole config against it; raise one error listing all."""
    mesh_cfg = cfg.mesh.resolve(n_devices)
    errs = []
    for axis, what in NOT_YET.items():
        if getattr(mesh_cfg, axis) > 1:
            errs.append(f"mesh.{axis}={getattr(mesh_cfg, axis)}: {what} is not available yet; "
                        f"set mesh.{axis}=1 and give the devices to dp, fsdp or tp")
    try:
        cfg.model.validate()
    except ValueError as e:
        errs.append(str(e))
    from jaxscale.attention import IMPLEMENTATIONS
    if cfg.model.attention not in IMPLEMENTATIONS + ("auto",):
        errs.append(f"model.attention={cfg.model.attention!r} is unknown; valid: "
                    f"{', '.join(IMPLEMENTATIONS + ('auto',))}")
    if mesh_cfg.tp > 1:
        errs += tp.validate(cfg.model, mesh_cfg.tp)
    if mesh_cfg.fsdp > 1 and cfg.model.dim % mesh_cfg.fsdp:
        errs.append(f"model.dim={cfg.model.dim} is not divisible by mesh.fsdp={mesh_cfg.fsdp}: "
                    f"FSDP shards every parameter on its embed dimension")
    data = mesh_cfg.dp * mesh_cfg.fsdp
    if cfg.data.batch_size % data:
        errs.append(f"data.batch_size={cfg.data.batch_size} is not divisible by the data-parallel "
                    f"degree dp x fsdp = {data}: use a multiple of {data}")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        errs.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len="
                    f"{cfg.model.max_seq_len}")
    errs += _validate_plan_options(cfg, mesh_cfg)
    if jax.process_count() > 1 and cfg.data.batch_size % jax.process_count():
        errs.append(f"data.batch_size={cfg.data.batch_size} is not divisible by the "
                    f"{jax.process_count()} processes")
    if errs:
        raise ValueError("invalid plan:\n  - " + "\n  - ".join(errs))
    return mesh_cfg


def _validate_plan_options(cfg, mesh_cfg) -> list[str]:
    from jaxscale.strategies import offload, precision, remat, zero
    errs = []
    try:
        pol = precision.policy(cfg.plan)
    except ValueError as e:
        return [str(e)]
    try:
        remat.parse(cfg.plan.remat)
    except ValueError as e:
        errs.append(str(e))
    errs += offload.validate(cfg.plan, pol.master)
    errs += zero.validate(cfg.plan, mesh_cfg)
    k = cfg.plan.accumulate
    data = mesh_cfg.dp * mesh_cfg.fsdp
    if k < 1:
        errs.append(f"plan.accumulate={k} must be >= 1")
    elif cfg.data.batch_size % (k * data):
        errs.append(f"data.batch_size={cfg.data.batch_size} must be divisible by plan.accumulate x "
                    f"dp x fsdp = {k} x {data}: each micro-batch is split over the data axes")
    return errs


def build(cfg, devices=None) -> Plan:
    devices = list(devices if devices is not None else jax.devices())
    mesh_cfg = validate(cfg, len(devices))
    mesh = make_mesh(mesh_cfg, devices)
    rules = Rules()
    data_axes = tuple(a for a, s in STRATEGIES.items() if s.DATA_AXIS and getattr(mesh_cfg, a) > 1)
    rules.add("batch", data_axes, by="+".join(data_axes) or "replicated")
    for name in mesh_cfg.active_axes():
        if name in STRATEGIES:
            STRATEGIES[name].rules(rules)
    rules.add("layers", None, by="plan")
    return Plan(mesh_cfg, mesh, rules, data_axes)


def theory(cfg, plan: Plan, model) -> list:
    """The plan's communication per device per step, from the strategies' formulas."""
    import math as _m
    from jax.tree_util import tree_leaves
    from jaxscale.strategies import precision, zero
    from jaxscale.strategies.common import dtype_bytes
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape))
    specs = tree_leaves(model.param_specs(plan), is_leaf=lambda x: isinstance(x, P))
    shapes = tree_leaves(model.abstract_params)
    emb = model.abstract_params["embed"]

    def elems(drop: set[str], only=None) -> float:   # per-device elements, `drop` axes gathered
        tot = 0.0
        for spec, s in zip(specs, shapes):
            if only is not None and s is not only:
                continue
            axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str)
                                                           else entry) if a not in drop]
            tot += _m.prod(s.shape) / _m.prod(sizes[a] for a in axes)
        return tot
    pol = precision.policy(cfg.plan)
    k = cfg.plan.accumulate
    pb = dtype_bytes(pol.param_dtype)
    gb = 4 if k > 1 else pb                  # micro-batch gradients accumulate in fp32
    mc = plan.mesh_cfg
    out = []
    if cfg.plan.zero:
        out += zero.theory(cfg.plan.zero, mc, elems(set()) * pb, elems(set(), emb) * pb,
                           elems(set()) * gb, k)
    else:
        out += dp.theory(mc, elems(set()) * gb)
    out += fsdp.theory(mc, elems({"fsdp"}) * pb, elems({"fsdp"}, emb) * pb,
                       elems({"fsdp"}) * gb, k)
    out += tp.theory(cfg, mc, cfg.data.batch_size // plan.data_degree,
                     dtype_bytes(pol.compute_dtype), cfg.plan.remat == "full")
    return out
