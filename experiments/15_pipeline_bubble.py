"""python experiments/15_pipeline_bubble.py [--p 4] [--m 8] [--v 2] [--out runs/15_pipeline_bubble]
                                        [--figure docs/img/pipeline_schedules.png]
                                        [--temp-figure docs/img/exp15_temp_vs_m.png]
                                        [--no-compile]        # ~2 min on 2 cores; 1 s without

Topic 15: pipeline bubbles. Every schedule of `jaxscale.strategies.pp.schedules` (naive, GPipe,
1F1B, interleaved 1F1B with v virtual stages, ZB-H1, and ZB-V with two chunks per device placed
in a V) built for p devices and m micro-batches and run by the discrete-event simulator
(`jaxscale.strategies.pp.simulator`), T_F = 1 and a whole backward of 2 (ZB-H1 and ZB-V: B = W =
1, the paper's T_F = T_B = T_W), stages of equal cost. Prints the simulated bubble against the
closed form, the idle/compute overhead (Megatron's form), the peak micro-batches in flight on
device 0 and the bubble when each stage-to-stage transfer costs 0.1 T_F. Writes bubble.json and
a stacked Gantt chart (gpipe, 1f1b, interleaved, zb-h1, zb-v) under --out, or at --figure. This
part needs no JAX and takes about a second.

The compiled side (skipped with --no-compile): the train step of the tiny LLaMA (4 layers, seq
64, micro-batches of 4 rows) on pp = 2 x fsdp = 4, run by the pipeline engine
(`jaxscale.strategies.pp.engine`), for gpipe, 1f1b, interleaved (v = 2) and zb-h1 at m = 2 and
8, and zb-v at m = 4 and 8 (batch 4 m; p = 2; ZB-V needs m >= 2 p). Per plan: the engine's ticks
and residual slots, the compiled temp memory per device (`memory_analysis`) against the
planner's prediction, the compiled collective-permutes over pp (count, bytes: the census)
against `strategies.pp.collectives`, the compiled matmul FLOPs per device against the planner's
(the zero-bubble schedules' W computes only the weight gradients, from the matmul inputs and
output gradients B kept: the FLOPs of 1F1B), and the simulated bubble against the formula.
Writes compiled.json and temp_vs_m.png (or --temp-figure) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxscale.strategies.pp import schedules as ps
from jaxscale.strategies.pp import simulator

COMM = 0.1
MS = (2, 8)
COMPILED = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
BASE = ("model.n_layers=4", "data.seq_len=64", "mesh.dp=1", "mesh.pp=2", "mesh.fsdp=4",
        "mesh.tp=1")


def rows(p: int, m: int, v: int) -> list[dict]:
    out = []
    for name in ps.NAMES:
        mm, vv = (1 if name == "naive" else m), (v if name == "interleaved" else 1)
        sc = ps.make(name, p, mm, vv)
        r = simulator.simulate(sc)
        out.append(dict(schedule=name, p=p, m=mm, v=sc.v, makespan=r.makespan, bubble=r.bubble,
                        formula=ps.formula_bubble(name, p, mm, vv), overhead=r.overhead,
                        in_flight_dev0=r.in_flight[0], peak_in_flight=r.peak_in_flight,
                        bubble_comm=simulator.simulate(sc, t_comm=COMM).bubble))
    return out


def table(rs: list[dict]) -> str:
    lines = [f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}{'makespan':>10}{'bubble':>9}"
             f"{'formula':>9}{'idle/compute':>14}{'in flight d0':>14}{f'bubble, comm {COMM}':>19}"]
    for r in rs:
        f = "-" if r["formula"] is None else f"{r['formula']:.4f}"
        lines.append(f"{r['schedule']:<12}{r['p']:>3}{r['m']:>4}{r['v']:>3}{r['makespan']:>10g}"
                     f"{r['bubble']:>9.4f}{f:>9}{r['overhead']:>14.4f}{r['in_flight_dev0']:>14g}"
                     f"{r['bubble_comm']:>19.4f}")
    return "\n".join(lines)


def _ms(name: str) -> tuple[int, ...]:
    """The micro-batch counts compiled for a schedule (ZB-V needs m >= 2 p = 4)."""
    return (4, 8) if name == "zb-v" else MS


def compiled_rows() -> list[dict]:
    """Compile each (schedule, m) plan on pp=2 x fsdp=4 once; memory and pp census vs theory."""
    import _common  # noqa: F401  (8 simulated devices, before jax is imported)
    _common.cpu_only()
    from jaxscale import plan, planner
    from jaxscale.analysis import inspect
    from jaxscale.analysis.validation import tiny_config
    from jaxscale.strategies import pp
    from jaxscale.strategies.pp.program import program_for
    out = []
    for name in COMPILED:
        v = 2 if name == "interleaved" else 1
        for m in _ms(name):
            cfg = tiny_config(*BASE, f"plan.schedule={name}", f"plan.virtual_stages={v}",
                              f"plan.accumulate={m}", f"data.batch_size={4 * m}")
            t0 = time.perf_counter()
            rep = inspect.report(cfg)
            secs = time.perf_counter() - t0
            spec, pred = plan.Spec.from_config(cfg), planner.predict(cfg)
            prog = program_for(spec)
            theory = next(c for c in pp.collectives(spec) if c.kind == "collective-permute")
            got = next((c for c in rep["collectives"]
                        if c["kind"] == "collective-permute" and c["axes"] == ["pp"]),
                       {"count": 0, "bytes": 0})
            sim = simulator.simulate(ps.make(name, 2, m, v))
            out.append(dict(schedule=name, p=2, m=m, v=v, ticks=prog.ticks,
                            res_slots=prog.slots["res"], in_flight=pp.in_flight(spec),
                            temp=rep["memory"]["temp"], temp_pred=pred.memory.xla["temp"],
                            flops=rep["flops"]["dot_flops"], flops_pred=pred.flops.per_device,
                            permutes=got["count"], permute_bytes=got["bytes"],
                            permutes_theory=theory.count, permute_bytes_theory=theory.bytes,
                            useful_sends=prog.useful_sends, bubble=sim.bubble,
                            formula=ps.formula_bubble(name, 2, m, v), compile_s=secs))
            print(f"  compiled {name} m={m} in {secs:.1f} s", flush=True)
    return out


def compiled_table(rs: list[dict]) -> str:
    mib = 2 ** 20
    lines = [f"{'schedule':<12}{'m':>3}{'v':>3}{'ticks':>7}{'res slots':>11}{'temp MiB':>10}"
             f"{'predicted':>11}{'ratio':>7}{'permutes':>10}{'theory':>8}{'useful':>8}"
             f"{'permute MiB':>13}{'theory':>9}{'GFLOP':>7}{'pred':>7}{'bubble':>8}"
             f"{'formula':>9}"]
    for r in rs:
        lines.append(f"{r['schedule']:<12}{r['m']:>3}{r['v']:>3}{r['ticks']:>7}"
                     f"{r['res_slots']:>11}{r['temp'] / mib:>10.2f}{r['temp_pred'] / mib:>11.2f}"
                     f"{r['temp_pred'] / r['temp']:>7.3f}{r['permutes']:>10}"
                     f"{r['permutes_theory']:>8}{r['useful_sends']:>8}"
                     f"{r['permute_bytes'] / mib:>13.3f}{r['permute_bytes_theory'] / mib:>9.3f}"
                     f"{r['flops'] / 1e9:>7.3f}{r['flops_pred'] / 1e9:>7.3f}"
                     f"{r['bubble']:>8.4f}{r['formula']:>9.4f}")
    return "\n".join(lines)


def plot_temp(rs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, name in enumerate(COMPILED):
        mine = [r for r in rs if r["schedule"] == name]
        if not mine:
            continue
        ms = [r["m"] for r in mine]
        colour = f"C{i}"
        label = name + (" v=2" if name == "interleaved" else "")
        ax.plot(ms, [r["temp"] / 2 ** 20 for r in mine], "o-", color=colour,
                label=f"{label} (compiled)")
        ax.plot(ms, [r["temp_pred"] / 2 ** 20 for r in mine], "x--", color=colour, alpha=0.7,
                label=f"{label} (planner)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([2, 4, 8], ["2", "4", "8"])
    ax.set_xlabel("micro-batches m (4 rows each; batch 4 m)")
    ax.set_ylabel("temp memory per device (MiB)")
    ax.set_title("pp=2 x fsdp=4, tiny LLaMA 4 layers, seq 64: compiled vs planner", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--v", type=int, default=2)
    ap.add_argument("--out", default="runs/15_pipeline_bubble")
    ap.add_argument("--figure", default=None, help="PNG path (default: OUT/pipeline_schedules.png)")
    ap.add_argument("--temp-figure", default=None, help="PNG path (default: OUT/temp_vs_m.png)")
    ap.add_argument("--no-compile", action="store_true", help="the simulator only (~1 s)")
    a = ap.parse_args(argv)
    t_start = time.time()
    rs = rows(a.p, a.m, a.v)
    print(table(rs))
    one = next(r for r in rs if r["schedule"] == "1f1b")
    for name in ps.SPLIT:
        zb = next(r for r in rs if r["schedule"] == name)
        print(f"{name} / 1f1b: bubble fraction {zb['bubble'] / one['bubble']:.3f}, idle time "
              f"{zb['bubble'] * zb['makespan'] / (one['bubble'] * one['makespan']):.3f}, "
              f"idle/compute {zb['overhead'] / one['overhead']:.3f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bubble.json"), "w") as f:
        json.dump(rs, f, indent=1)
    fig = a.figure or os.path.join(a.out, "pipeline_schedules.png")
    os.makedirs(os.path.dirname(fig) or ".", exist_ok=True)
    scheds = [ps.make(n, a.p, a.m, a.v if n == "interleaved" else 1)
              for n in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")]
    simulator.draw(scheds[0], None, fig, also=tuple((s, None) for s in scheds[1:]))
    print(f"wrote {fig} and {os.path.join(a.out, 'bubble.json')}")
    if a.no_compile:
        return 0
    print("\ncompiling the train steps (pp=2 x fsdp=4, tiny LLaMA 4 layers, seq 64, "
          "micro-batch 4 rows) ...")
    cs = compiled_rows()
    print("\ncompiled, per device: temp memory vs the planner; collective-permutes over pp "
          "(census vs strategies.pp.collectives); matmul FLOPs vs the planner; bubble "
          "simulated vs formula")
    print(compiled_table(cs))
    from jaxscale.analysis.validation import TOLERANCE
    ok = [abs(r["temp_pred"] / r["temp"] - 1) <= TOLERANCE["temp"]
          and r["permutes"] == r["permutes_theory"]
          and r["permute_bytes"] == r["permute_bytes_theory"]
          and abs(r["flops_pred"] / r["flops"] - 1) <= 0.01
          and abs(r["bubble"] - r["formula"]) < 1e-9 for r in cs]
    by = {(r["schedule"], r["m"]): r["temp"] for r in cs}
    growth = {n: by[n, MS[-1]] / by[n, _ms(n)[0]] for n in COMPILED}
    print("temp at m=8 / temp at the smallest m: "
          + ", ".join(f"{n} {g:.2f}" for n, g in growth.items()))
    fl = {(r["schedule"], r["m"]): r["flops"] for r in cs}
    print("compiled FLOPs / 1f1b's at m=8: " + ", ".join(
        f"{n} {fl[n, MS[-1]] / fl['1f1b', MS[-1]]:.3f}" for n in COMPILED)
          + " (the zero-bubble W computes the weight gradients only)")
    with open(os.path.join(a.out, "compiled.json"), "w") as f:
        json.dump(cs, f, indent=1)
    tfig = a.temp_figure or os.path.join(a.out, "temp_vs_m.png")
    os.makedirs(os.path.dirname(tfig) or ".", exist_ok=True)
    plot_temp(cs, tfig)
    print(f"wrote {tfig} and {os.path.join(a.out, 'compiled.json')}; {time.time() - t_start:.0f} s")
    bad = [f"{r['schedule']} m={r['m']}" for r, good in zip(cs, ok) if not good]
    if bad:
        print(f"outside tolerance (temp {TOLERANCE['temp']:.0%}, permutes exact, FLOPs 1%, "
              "bubble exact): " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
