"""`--plan auto`: the fastest predicted plan that fits, compiled and checked before training.

    cfg, record = choose(cfg)          # what `jaxscale train --plan auto` and `inspect` run

The search (`jaxscale.planner.search`) ranks the plans of the config's model, batch, optimizer
and hardware on the devices present (the mesh degrees are its to choose; `mesh.device_kind` and
the node count, `mesh.dcn_*`, stay). From the fastest down, each plan is built
(`jaxscale.train.setup.build`), its train step compiled, and its compiled per-device memory
(`memory_analysis`: `inspect.memory`) compared with the prediction and with the capacity (the
device's memory, a simulated CPU device's share of the host's, or `capacity`). The first plan whose
compiled step fits is chosen. A plan that does not compile, or whose compiled memory exceeds the
capacity, is passed over with the reason; so are the plans after it whose predicted memory,
scaled by the largest compiled/predicted ratio measured so far, would exceed the capacity too
(at most `attempts` compilations). `record` says what was chosen, its prediction and compiled
memory, and what was passed over and why: `train` keeps it in the run's summary
(`summary["plan_auto"]`), and config.json holds the chosen plan's resolved config.

This lives beside the compiled-program analyses rather than in `jaxscale.planner`, which may not
import `jaxscale.train` (the layers contract in pyproject.toml).
"""
from __future__ import annotations

import dataclasses
import time

from jaxscale.analysis.inspect import memory as compiled_memory
from jaxscale.planner import overrides, search
from jaxscale.planner.report import nbytes
from jaxscale.planner.space import FIXABLE  # noqa: F401  (the keys `fixed` takes)

#: compilations `choose` tries before it gives up
ATTEMPTS = 4


def base_spec(cfg, n_devices: int):
    """The Spec the search starts from: `cfg`'s model, batch and plan options on `n_devices`
    of its hardware, the node count kept (mesh.dcn_*: a cluster name's nodes) where it divides
    them; the degrees are the search's."""
    from jaxscale.mesh import MeshConfig
    from jaxscale.plan import Spec
    nodes = cfg.mesh.nodes if n_devices % cfg.mesh.nodes == 0 else 1
    mesh = MeshConfig(fsdp=n_devices, dcn_fsdp=nodes, device_kind=cfg.mesh.device_kind)
    return Spec.from_config(dataclasses.replace(cfg, mesh=mesh), n_devices)


def choose(cfg, devices=None, *, capacity: float | None = None, attempts: int = ATTEMPTS,
           fixed=(), say=None):
    """(the config of the chosen plan, the record of the choice); ValueError when no plan
    compiles within the capacity (naming each one tried and why). `capacity`: per-device bytes
    the compiled step may use (default: the device's); `fixed`: plan keys the search keeps
    (`planner.space.FIXABLE`); `say`: a function the progress lines go to."""
    import jax

    from jaxscale.train.setup import build
    devices = list(devices if devices is not None else jax.devices())
    say = say or (lambda msg: None)
    t0 = time.perf_counter()
    res = search.search(cfg, len(devices), base=base_spec(cfg, len(devices)), fixed=fixed)
    if not res.accepted:
        why = "; ".join(f"{n} x {r}" for r, n in list(res.reasons().items())[:3])
        raise ValueError(f"--plan auto: no plan fits {len(devices)} {cfg.mesh.device_kind} "
                         f"devices ({res.summary()}: {why}). Use more devices, a smaller "
                         f"data.batch_size or data.seq_len, or a smaller model")
    cap = capacity or res.accepted[0].capacity
    say(f"plan auto: {res.summary()}")
    passed, ratio, compiled_n = [], 0.0, 0
    for rank, pred in enumerate(res.accepted, 1):
        if compiled_n >= attempts:
            break
        label = pred.spec.label()
        if ratio and pred.memory.total * ratio > cap:
            passed.append({"plan": label, "rank": rank, "reason": (
                f"predicted {nbytes(pred.memory.total)} x {ratio:.3f} (the compiled/predicted "
                f"ratio measured) > capacity {nbytes(cap)}"), "compiled": False})
            continue
        cand = overrides.apply(cfg, pred.spec)
        compiled_n += 1
        say(f"plan auto: compiling #{rank} {label} (predicted {nbytes(pred.memory.total)} per "
            f"device, step {pred.time.total:.4g} s)")
        try:
            mem = compiled_memory(build(cand, devices).lower_train_step().compile())
        except Exception as e:        # noqa: BLE001 - any failure to build or compile: next plan
            first = (str(e).strip().splitlines() or [""])[0][:300]
            passed.append({"plan": label, "rank": rank, "compiled": False,
                           "reason": f"does not compile: {type(e).__name__}: {first}"})
            say(f"plan auto: passed over #{rank}: {passed[-1]['reason']}")
            continue
        r = mem["total"] / pred.memory.total if pred.memory.total else 1.0
        if mem["total"] > cap:
            ratio = max(ratio, r)
            passed.append({"plan": label, "rank": rank, "compiled": True, "reason": (
                f"compiled step needs {nbytes(mem['total'])} ({mem['total']:,} B) per device "
                f"> capacity {nbytes(cap)} ({int(cap):,} B); predicted "
                f"{nbytes(pred.memory.total)}, ratio {r:.3f}")})
            say(f"plan auto: passed over #{rank}: {passed[-1]['reason']}")
            continue
        record = {
            "chosen": label, "rank": rank, "overrides": overrides.overrides(cfg, pred.spec),
            "predicted": {"memory_bytes": pred.memory.total, "step_time_s": pred.time.total,
                          "mfu": pred.time.mfu, "tokens_per_s": pred.time.tokens_per_s},
            "compiled": {**mem, "ratio_to_predicted": r},
            "capacity_bytes": cap, "passed_over": passed, "search": res.summary(),
            "seconds": time.perf_counter() - t0}
        return cand, record
    tried = "; ".join(f"#{p['rank']} {p['plan']}: {p['reason']}" for p in passed)
    raise ValueError(f"--plan auto: none of the {compiled_n} fastest plans compiled within "
                     f"capacity {nbytes(cap)} per device ({tried}). Lower data.batch_size or "
                     f"data.seq_len, or use more devices")


def format_record(record: dict) -> str:
    """The choice in a few lines (what `train --plan auto` prints)."""
    p, c = record["predicted"], record["compiled"]
    lines = [f"plan auto: chose #{record['rank']} {record['chosen']}: predicted "
             f"{nbytes(p['memory_bytes'])} per device, step {p['step_time_s']:.4g} s, MFU "
             f"{p['mfu']:.1%}; compiled {nbytes(c['total'])} ({c['ratio_to_predicted']:.3f} of "
             f"the prediction) of capacity {nbytes(record['capacity_bytes'])}"]
    lines += [f"  passed over #{q['rank']} {q['plan']}: {q['reason']}"
              for q in record["passed_over"]]
    if record["overrides"]:
        lines.append("  as --set " + " --set ".join(record["overrides"]))
    return "\n".join(lines)
