"""`jaxscale plan`: predict memory, communication and step time of a plan; `--search` ranks plans.

    jaxscale plan --model llama3-70b --mesh h100x8x4 --seq 4096 --batch 32 --set plan.zero=1
    jaxscale plan --model llama3-8b --mesh h100x8 --seq 8192 --batch 64 --search
    jaxscale plan --model llama3-70b --mesh h100x8x8 --seq 4096 --batch 64 --search
    jaxscale plan --model mixtral-8x7b --mesh h100x8x4 --set mesh.ep=4 --set mesh.dp=1
    jaxscale plan --model llama3-70b --mesh h100x8x4 --set plan.context=ulysses --set mesh.sp=2 ...
    jaxscale plan --experiment llama_tiny --json

Starts from an experiment's config (`--experiment`) or from the defaults with `--model` and
`--mesh` presets and applies `--set` overrides: the same keys `train` and `inspect` take (the
pipeline schedule is `plan.schedule`, context parallelism `plan.context`, Megatron sequence
parallelism `plan.sequence_parallel`, a mixture of experts `model.moe_experts`). Plans `train`
cannot run yet are predicted all the same, and say so. `--mesh` takes a preset or a cluster name
(`h100x8x8`: 64 H100s on 8 nodes, `meshes/`), whose device count holds when `--set` changes its
degrees. `--search` ends with the fastest plan as the `jaxscale train` command line that runs it
(`overrides.train_command`); the `plan.*` keys of `space.FIXABLE` set with `--set` stay fixed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxscale.fields import arg


def add_arguments(p) -> None:
    p.add_argument("--model", help="model preset (models/configs.py), e.g. llama3-70b")
    p.add_argument("--mesh", help="mesh preset or cluster name <kind>x<gpus-per-node>x<nodes> "
                   "(meshes/), e.g. h100x8x4, h100x8x8, a100x8x4")
    p.add_argument("--experiment", help="start from an experiment's config instead of defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set plan.zero=3 --set mesh.tp=8")
    p.add_argument("--batch", type=int, help="global batch in sequences (default: one sequence "
                   "per data-parallel rank)")
    p.add_argument("--seq", type=int, help="sequence length (default: min(4096, max_seq_len))")
    p.add_argument("--devices", type=arg(lo=1), help="device count, to resolve a -1 mesh degree "
                   "(default: a cluster name's)")
    p.add_argument("--search", action="store_true",
                   help="enumerate every valid plan on the mesh that fits, ranked by step time")
    p.add_argument("--include-unavailable", action="store_true",
                   help="--search also ranks plans train cannot run yet (marked)")
    p.add_argument("--top", type=arg(lo=1), default=10, help="plans shown by --search (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="directory for memory.png and plan.json (default runs/plan/...)")


def build_config(args, out: Path | None = None):
    """The config to plan, checked like train's (every field's range, the relations between
    fields; `--seq` and `--batch` as data.seq_len and data.batch_size; `out`, where the plan will
    be written): one ValueError listing every problem."""
    from jaxscale import config as config_lib
    from jaxscale import fields, meshes, models
    if args.experiment:
        cfg = config_lib.load_experiment(args.experiment)
    else:
        cfg = config_lib.Config(name="plan")
    if args.model:
        cfg = dataclasses.replace(cfg, model=models.get(args.model))
    if args.mesh:
        cfg = dataclasses.replace(cfg, mesh=meshes.get(args.mesh))
    cfg, errs = config_lib.apply_each(cfg, args.set)
    data = cfg.data
    explicit = {s.split("=", 1)[0].strip() for s in args.set}
    bad_seq = args.seq is not None and fields.check(config_lib.DataConfig, "seq_len", args.seq,
                                                    "data.seq_len", via="--seq")
    bad_batch = args.batch is not None and fields.check(
        config_lib.DataConfig, "batch_size", args.batch, "data.batch_size", via="--batch")
    errs += [e for e in (bad_seq, bad_batch) if e]
    if args.seq is not None:
        if not bad_seq:
            data = dataclasses.replace(data, seq_len=args.seq)
    elif not args.experiment and "data.seq_len" not in explicit:
        data = dataclasses.replace(data, seq_len=min(4096, cfg.model.max_seq_len))
    if args.batch is not None:
        if not bad_batch:
            data = dataclasses.replace(data, batch_size=args.batch)
    elif not args.experiment and "data.batch_size" not in explicit:
        m = cfg.mesh
        degs = [max(1, getattr(m, a)) for a in ("dp", "fsdp", "ep")]
        data = dataclasses.replace(data, batch_size=degs[0] * degs[1] * degs[2])
    cfg = dataclasses.replace(cfg, data=data)
    errs += config_lib.check(cfg)
    if out is not None:
        errs += [e for e in [fields.dir_problem(out, "--out" if args.out else
                                                "output directory")] if e]
    fields.raise_problems(errs)
    return cfg


def run(args) -> int:
    from jaxscale import planner
    from jaxscale.plan import Spec
    from jaxscale.planner import overrides, report, search, space
    out = Path(args.out or Path("runs") / "plan" / _name(args))
    cfg = build_config(args, out)
    devices = args.devices or cluster_devices(args)
    spec = Spec.from_config(cfg, devices)
    if args.search:
        explicit = {s.split("=", 1)[0].strip() for s in args.set}
        res = search.search(cfg, devices, base=spec, include_unavailable=args.include_unavailable,
                            fixed=[k for k in space.FIXABLE if f"plan.{k}" in explicit])
        shown = res.accepted[:args.top]
        command = ""
        if shown:
            report.plot_memory(shown, out / "memory.png",
                               f"{_name(args, cfg)}: fastest plans that fit")
            command = overrides.train_command(cfg, shown[0].spec, args.experiment,
                                              *_names(args))
        payload = {"accepted": [p.as_dict() for p in shown], "n_accepted": len(res.accepted),
                   "rejected": [{"plan": s.label(), "reason": why} for s, why in res.rejected],
                   "rejected_by_reason": res.reasons(), "searched": res.summary(),
                   "options": res.options.describe(), "command": command}
        _write(out, payload)
        if args.json:
            print(json.dumps(payload, indent=2))
        else:
            print(report.format_search(res, args.top))
            print(f"\nwrote {out / 'memory.png'} and {out / 'plan.json'}")
            if command:
                print(f"\ntrain the fastest plan:\n{command}")
        return 0 if res.accepted else 1
    spec.validate()
    pred = planner.predict_spec(spec)
    report.plot_memory([pred], out / "memory.png", f"{_name(args, cfg)}: {spec.label()}")
    payload = pred.as_dict()
    if not pred.fits:
        payload["does_not_fit"] = search.does_not_fit_message(pred)
    _write(out, payload)
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(report.format_prediction(pred))
        if not pred.fits:
            print("\n" + payload["does_not_fit"])
        print(f"\nwrote {out / 'memory.png'} and {out / 'plan.json'}")
    return 0


def _names(args) -> tuple[str | None, str | None]:
    """The model preset and mesh name the config started from (`--model`/`--mesh`, or the last
    `--set model=`/`--set mesh=`)."""
    named = {"model": args.model, "mesh": args.mesh}
    for item in args.set:
        key, _, value = item.partition("=")
        if key.strip() in named:
            named[key.strip()] = value.strip()
    return named["model"], named["mesh"]


def cluster_devices(args) -> int | None:
    """The device count of the cluster name the mesh came from (None for a preset or none):
    what the degrees must multiply to when `--set` changes them."""
    from jaxscale import meshes
    name = _names(args)[1]
    if not name or name in meshes.PRESETS:
        return None
    return meshes.devices(name)


def _name(args, cfg=None) -> str:
    model = args.model or (args.experiment and Path(args.experiment).stem) or "model"
    return f"{model}_{args.mesh or 'mesh'}".replace("/", "_")


def _write(out: Path, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
