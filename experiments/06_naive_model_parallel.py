"""python experiments/06_naive_model_parallel.py [--out runs/exp06] [--steps 6]    # ~2 min

Topic 06: naive model parallelism against GPipe. The tiny LLaMA (4 layers, batch 16 x 32) split
over pp = 2 (x fsdp 4) and pp = 4 (x fsdp 2) by the pipeline engine
(`jaxscale.strategies.pp.engine`):
- naive, m = 1: the whole batch through stage 0, then stage 1, ..., then the backward back down:
  one device busy at a time (plain layer-split model parallelism);
- naive, m = 4: the same, one micro-batch at a time (accumulation): still one device busy;
- gpipe, m = 2 and 4 (pp = 2), 4 and 8 (pp = 4; m is at most the batch's 16 rows over fsdp):
  all forwards, then all backwards; devices overlap on different micro-batches.
Columns, per plan:
- utilisation = 1 - bubble from the schedule simulator (`schedules.simulate`, T_F = 1,
  backward 2) next to the closed form, and the engine's busy fraction (`program_for(spec)
  .branch_share()`: the share of (tick, device) slots that run an op, every op one tick);
- compiled temp memory per device (`memory_analysis`) and the planner's prediction beside it;
- step time: the median of --steps train steps after one warm-up. This is CPU time of 8
  simulated devices sharing 2 cores, so only ratios within one run mean anything, and even those
  do not show the bubble: an idle simulated device leaves its core to a busy one;
- the first step's loss next to the unpipelined model's (fsdp = 8, same initial values).
Writes results.json and naive_vs_gpipe.png under --out.
"""
from __future__ import annotations

import statistics
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

C.cpu_only()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale import plan, planner  # noqa: E402
from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.analysis.validation import tiny_config  # noqa: E402
from jaxscale.strategies.pp import program  # noqa: E402
from jaxscale.strategies.pp import schedules as ps  # noqa: E402
from jaxscale.strategies.pp.simulator import simulate  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

B, T, L = 16, 32, 4
BASE = (f"model.n_layers={L}", f"data.batch_size={B}", f"data.seq_len={T}", "mesh.dp=1",
        "mesh.tp=1")
#: (label, p, schedule, m): m up to the batch's rows per data shard (16 / fsdp)
PLANS = [(f"{s} m={m}", p, s, m) for p, ms in ((2, (2, 4)), (4, (4, 8)))
         for s, m in (("naive", 1), ("naive", 4), *(("gpipe", m) for m in ms))]


def _batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    b = {k: rng.integers(0, 256, (B, T)).astype(np.int32) for k in ("inputs", "targets")}
    return {**b, "mask": np.ones((B, T), np.float32)}


def run(overrides: tuple, steps: int) -> dict:
    """Compile the train step once; its memory, then `steps` + 1 steps timed (the first is the
    warm-up), and the first step's loss."""
    cfg = tiny_config(*BASE, *overrides)
    setup = build(cfg)                # the state donated, as in training (and in the planner)
    t0 = time.perf_counter()
    exe = setup.lower_train_step().compile()
    compile_s = time.perf_counter() - t0
    state = setup.init_state()
    batches = [jax.device_put(_batch(i), setup.batch_shardings()) for i in range(steps + 1)]
    times, losses = [], []
    for b in batches:
        t0 = time.perf_counter()
        state, metrics = exe(state, b)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    pred = planner.predict(cfg)
    return {"cfg": cfg, "temp": inspect.memory(exe)["temp"], "temp_pred": pred.memory.xla["temp"],
            "step_s": statistics.median(times[1:]), "loss0": losses[0], "losses": losses,
            "compile_s": compile_s}


def main():
    args = C.parse_args(__doc__, "runs/exp06",
                        lambda ap: ap.add_argument("--steps", type=int, default=6))
    t_start = time.time()
    claims = C.Claims()
    ref = run(("mesh.pp=1", "mesh.fsdp=8"), args.steps)
    res = []
    for label, p, sched, m in PLANS:
        r = run((f"mesh.pp={p}", f"mesh.fsdp={8 // p}", f"plan.schedule={sched}",
                 f"plan.accumulate={m}"), args.steps)
        spec = plan.Spec.from_config(r.pop("cfg"))
        prog = program.program_for(spec)
        sim = simulate(ps.make(sched, p, m))
        r.update(label=label, p=p, schedule=sched, m=m, util_sim=1 - sim.bubble,
                 util_formula=1 - ps.formula_bubble(sched, p, m),
                 util_engine=1 - prog.branch_share()[program.IDLE], ticks=prog.ticks,
                 res_slots=prog.slots["res"], in_flight=sim.in_flight[0])
        res.append(r)
    ref.pop("cfg")

    rows = []
    for r in res:
        naive1 = next(x for x in res if x["p"] == r["p"] and x["label"] == "naive m=1")
        rows.append([f"pp={r['p']} {r['label']}", f"{r['util_sim']:.3f}",
                     f"{r['util_formula']:.3f}", f"{r['util_engine']:.3f}", str(r["ticks"]),
                     str(r["res_slots"]), f"{r['temp'] / C.MiB:.2f}",
                     f"{r['temp_pred'] / C.MiB:.2f}", f"{r['temp_pred'] / r['temp']:.3f}",
                     f"{r['step_s'] * 1e3:.0f}", f"{r['step_s'] / naive1['step_s']:.2f}",
                     f"{r['loss0']:.6f}", f"{abs(r['loss0'] - ref['loss0']) / ref['loss0']:.1e}"])
        name = f"pp={r['p']} {r['label']}"
        claims.close(f"{name}: engine busy fraction = 1 - simulated bubble", r["util_engine"],
                     r["util_sim"], 1e-9)
        claims.close(f"{name}: first-step loss = unpipelined", r["loss0"], ref["loss0"], 1e-5)
    print(C.table(["plan (x fsdp 8/p)", "util sim", "formula", "engine busy", "ticks",
                   "res slots", "temp MiB", "predicted", "ratio", "step ms", "vs naive m=1",
                   "loss step 1", "rel. diff"], rows,
                  title=f"naive model parallelism vs GPipe: tiny LLaMA, {L} layers, batch {B} x "
                        f"{T}; step times are CPU time of 8 simulated devices on 2 cores"))
    print(f"\nunpipelined (fsdp=8): temp {ref['temp'] / C.MiB:.2f} MiB (predicted "
          f"{ref['temp_pred'] / C.MiB:.2f}, ratio {ref['temp_pred'] / ref['temp']:.3f}), "
          f"step {ref['step_s'] * 1e3:.0f} ms, "
          f"first-step loss {ref['loss0']:.6f}")
    for p in (2, 4):
        mine = [x for x in res if x["p"] == p]
        n1, n4 = (next(x for x in mine if x["label"] == lab) for lab in ("naive m=1", "naive m=4"))
        g = [x for x in mine if x["schedule"] == "gpipe"]
        claims.check(f"pp={p}: naive utilisation is 1/p", f"{n1['util_sim']:.4f}",
                     f"{1 / p:.4f}", abs(n1["util_sim"] - 1 / p) < 1e-9)
        claims.check(f"pp={p}: gpipe m={g[-1]['m']} utilisation > naive's",
                     f"{g[-1]['util_sim']:.4f}", f"> {n1['util_sim']:.4f}",
                     g[-1]["util_sim"] > n1["util_sim"])
        claims.check(f"pp={p}: temp falls naive m=1 > gpipe (m up) > naive m=4",
                     " > ".join(f"{x['temp'] / C.MiB:.2f}" for x in (n1, *g, n4)), "decreasing",
                     all(a["temp"] > b["temp"] for a, b in zip((n1, *g), (*g, n4))))
        order = lambda key: sorted(mine, key=lambda x: x[key])            # noqa: E731
        claims.check(f"pp={p}: the planner orders the plans' temp as the compiler does",
                     ", ".join(x["label"] for x in order("temp_pred")),
                     ", ".join(x["label"] for x in order("temp")),
                     [x["label"] for x in order("temp_pred")]
                     == [x["label"] for x in order("temp")])

    plt = C.pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.2))
    xs = np.arange(len(res))
    labels = [f"pp{r['p']}\n{r['schedule']}\nm={r['m']}" for r in res]
    a1.bar(xs - 0.2, [r["util_sim"] for r in res], 0.4, label="simulator (T_B = 2 T_F)")
    a1.bar(xs + 0.2, [r["util_engine"] for r in res], 0.4, label="engine busy ticks")
    a1.set_ylabel("utilisation = 1 - bubble")
    a1.set_title("utilisation")
    a2.bar(xs - 0.2, [r["temp"] / C.MiB for r in res], 0.4, label="compiled")
    a2.bar(xs + 0.2, [r["temp_pred"] / C.MiB for r in res], 0.4, label="planner")
    a2.axhline(ref["temp"] / C.MiB, color="k", ls=":", lw=1, label="unpipelined fsdp=8")
    a2.set_ylabel("temp memory per device (MiB)")
    a2.set_title("compiled temp vs planner")
    a3.bar(xs, [r["step_s"] * 1e3 for r in res], 0.6, color="gray")
    a3.axhline(ref["step_s"] * 1e3, color="k", ls=":", lw=1, label="unpipelined fsdp=8")
    a3.set_ylabel("median step (ms, CPU, 8 simulated devices / 2 cores)")
    a3.set_title("step time (only ratios mean anything)")
    for a in (a1, a2, a3):
        a.set_xticks(xs, labels, fontsize=7)
        a.legend(fontsize=7)
    C.save(fig, args.out, "naive_vs_gpipe.png")
    print(f"{time.time() - t_start:.0f} s")
    claims.finish(args.out, {"reference": ref, "plans": res})


if __name__ == "__main__":
    main()
