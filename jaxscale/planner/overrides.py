"""A plan as `--set` overrides, and as the `jaxscale train` command line that runs it.

    overrides(cfg, spec)        # ["mesh.dp=8", "mesh.fsdp=8", "plan.zero=1", ...]
    apply(cfg, spec)            # cfg with the plan of `spec` (a searched `jaxscale.plan.Spec`)
    train_command(cfg, spec, experiment=None, model="llama3-70b", mesh="h100x8x8")

`train_command` starts from an experiment (`experiment`, else `DEFAULT_EXPERIMENT`) and sets
every key of the model, mesh, plan, data and optimizer groups that differs from it: a model or
mesh by its preset or cluster name first (`--set model=llama3-70b --set mesh=h100x8x8`), then
the fields that differ from that, so `jaxscale train` builds exactly the planned config.
"""
from __future__ import annotations

import dataclasses
import shlex

from jaxscale.axes import MESH_AXES
from jaxscale.plan import OPTIONS

#: the experiment a command line starts from when the plan did not start from one
DEFAULT_EXPERIMENT = "llama_tiny"
#: the config groups that make the plan (the training schedule and checkpoints do not)
GROUPS = ("model", "mesh", "plan", "data", "optim")


def text(value) -> str:
    """A value as `--set` parses it back (`jaxscale.config.apply_overrides`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def overrides(cfg, spec) -> list[str]:
    """The `--set` overrides that turn `cfg` into `spec`'s plan: the mesh degrees and their
    cross-node parts, the hardware, and every plan option, where they differ."""
    mesh, out = cfg.mesh, []
    for a in MESH_AXES:
        if getattr(mesh, a) != spec.deg(a):
            out.append(f"mesh.{a}={spec.deg(a)}")
        if getattr(mesh, f"dcn_{a}") != spec.dcn.get(a, 1):
            out.append(f"mesh.dcn_{a}={spec.dcn.get(a, 1)}")
    if mesh.device_kind != spec.device_kind:
        out.append(f"mesh.device_kind={spec.device_kind}")
    out += [f"plan.{k}={text(getattr(spec, k))}" for k in OPTIONS
            if getattr(cfg.plan, k) != getattr(spec, k)]
    return out


def apply(cfg, spec):
    """`cfg` with `spec`'s plan (`overrides`)."""
    from jaxscale.config import apply_overrides
    return apply_overrides(cfg, overrides(cfg, spec))


def diff(a, b, prefix: str = "") -> list[str]:
    """`key=value` for every field of dataclass `b` that differs from `a` (nested dataclasses
    field by field; one that `a` lacks is set from its class's defaults)."""
    out = []
    for f in dataclasses.fields(b):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va == vb:
            continue
        key = prefix + f.name
        if dataclasses.is_dataclass(vb):
            inner = diff(va if va is not None else type(vb)(), vb, key + ".")
            first = dataclasses.fields(vb)[0].name
            out += inner or [f"{key}.{first}={text(getattr(vb, first))}"]
        else:
            out.append(f"{key}={text(vb)}")
    return out


def set_flags(base, target, model: str | None = None, mesh: str | None = None) -> list[str]:
    """The overrides from config `base` to config `target`, over `GROUPS`: a model or mesh
    preset by name first where one is given (or the model equals one), then field by field."""
    from jaxscale import meshes, models
    out = []
    for group in GROUPS:
        a, b = getattr(base, group), getattr(target, group)
        if group == "model":
            model = model or next((n for n, m in models.CONFIGS.items() if m == b), None)
            start = models.get(model) if model else None
        elif group == "mesh" and mesh:
            start = meshes.get(mesh)
        else:
            start = None
        if start is not None and a != b:
            if a != start:
                out.append(f"{group}={model if group == 'model' else mesh}")
            a = start
        out += diff(a, b, group + ".")
    return out


def train_command(cfg, spec, experiment: str | None = None, model: str | None = None,
                  mesh: str | None = None) -> str:
    """`jaxscale train ...` that trains `cfg` with `spec`'s plan, from `experiment` (default
    `DEFAULT_EXPERIMENT`); `model` and `mesh`: the preset or cluster names to start from."""
    from jaxscale.config import load_experiment
    exp = experiment or DEFAULT_EXPERIMENT
    flags = set_flags(load_experiment(exp), apply(cfg, spec), model, mesh)
    return shlex.join(["jaxscale", "train", exp, *[a for f in flags for a in ("--set", f)]])
