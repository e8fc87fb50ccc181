"""python experiments/11_overlap.py [--out runs/11_overlap] [--figure docs/img/exp11_overlap.png]

Topic 11: overlapping communication with computation. A tensor- and sequence-parallel training
step (tiny LLaMA, dim 256, 2 layers, seq 64, batch 8; mesh dp=2 x tp=4, Megatron SP) compiled
four ways on the 8 simulated CPU devices:
1. GSPMD: all-gather before the column-parallel matmuls, reduce-scatter after the row-parallel
   ones (XLA:CPU emits each reduce-scatter as all-reduce + slice);
2. the same under `plan.xla_preset=latency_hiding` (on XLA:CPU only its concurrency-optimised
   scheduler acts; the `xla_gpu_*` options are accepted and ignored);
3. `plan.tp_overlap=collective_matmul`: the block's matmuls as ring collective matmuls
   (`jaxscale/strategies/overlap/collective_matmul.py`): t-1 collective-permutes of a sequence chunk
   per ring, each beside a partial matmul;
4. `plan.tp_overlap=collective_matmul_bidirectional`: half the hops each way round the ring.
For each, from the *scheduled* HLO (`compiled.as_text()`, `jaxscale/analysis/windows.py`): the
census of the tp collectives (bytes per device per step by kind, beside the plan's formula),
the fraction of their bytes that have matmul work scheduled in their window (asynchronous
collectives: start..done; XLA:CPU's synchronous ones: last producer..first consumer) and that
have independent matmul work anywhere in their computation; the loss and gradients against
variant 1 (must be equal); the compiled temp memory; and the step time on this CPU (a
measurement on 2 shared cores, not a claim about GPUs). Prints a table, checks the claims,
writes results.json and a figure. About 2 minutes on 2 cores.
"""
from __future__ import annotations

import os
import shutil
import time

import _common as CM  # first: 8 simulated devices before jax is imported

CM.cpu_only()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale import plan  # noqa: E402
from jaxscale.analysis import inspect, windows  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.strategies import overlap  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

BASE = ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "plan.sequence_parallel=true",
        "model.dim=256", "model.ffn_dim=768", "model.n_kv_heads=4")
VARIANTS = [("GSPMD all-gather / reduce-scatter", ()),
            ("GSPMD + latency_hiding preset", ("plan.xla_preset=latency_hiding",)),
            ("collective matmul", ("plan.tp_overlap=collective_matmul",)),
            ("collective matmul, bidirectional",
             ("plan.tp_overlap=collective_matmul_bidirectional",))]
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute")


def measure(cfg) -> dict:
    setup = build(cfg)
    mesh = setup.placement.mesh
    with jax.set_mesh(mesh):
        comp = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    text = comp.as_text()
    census = inspect.census(text, mesh)
    spec = plan.Spec.from_config(cfg, mesh.devices.size)
    theory = inspect.theory_vs_census(plan.collectives(spec), census, "cpu")
    ws = windows.windows(text, mesh)
    sched = windows.summary(ws, axes=("tp",))
    batches = Batches(load_corpus(cfg.data).train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    batch = batches.device_batch(0, setup.batch_shardings())
    state = setup.init_state()
    grads, loss, _ = setup.jit_grads()(state.params, batch)
    grads = jax.device_get(grads)
    tp_bytes = {k: sum(c["bytes"] for c in census if c["kind"] == k and c["axes"] == ["tp"])
                for k in KINDS}
    return {"loss": float(loss), "grads": grads, "census": census, "theory": theory,
            "tp_bytes": tp_bytes, "schedule": sched, "temp": inspect.memory(comp)["temp"],
            "run": (comp, state, batch)}


def time_steps(res: dict, rounds: int) -> None:
    """Median step time of each variant, timed in alternation (one step of each per round, after
    a warm-up round), so that the load of a shared machine falls on all of them alike."""
    times = {label: [] for label in res}
    for r in range(rounds + 1):
        for label, v in res.items():
            comp, state, batch = v["run"]
            t0 = time.perf_counter()
            state, m = comp(state, batch)
            jax.block_until_ready(m["loss"])
            v["run"] = (comp, state, batch)
            if r:
                times[label].append(time.perf_counter() - t0)
    for label, v in res.items():
        v["step_s"] = float(np.median(times[label]))


def main():
    args = CM.parse_args(__doc__, "runs/11_overlap", extra=lambda ap: (
        ap.add_argument("--figure", default=None, help="also copy the figure here "
                       "(docs/img/exp11_overlap.png)"),
        ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")))
    t_start = time.time()
    claims, res = CM.Claims(), {}
    for label, extra in VARIANTS:
        cfg = CM.config(*BASE, *extra, seq=64, batch=8)
        res[label] = measure(cfg)
        print(f"{label}: compiled ({time.time() - t_start:.0f} s)", flush=True)
    time_steps(res, args.steps)

    ref = res[VARIANTS[0][0]]
    rows = []
    for label, _ in VARIANTS:
        r = res[label]
        r["max_grad_rel_diff"] = max(
            float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))
            for a, b in zip(jax.tree.leaves(r["grads"]), jax.tree.leaves(ref["grads"])))
        s = r["schedule"].get("all", {"covered": 0.0, "coverable": 0.0, "count": 0})
        tb = r["tp_bytes"]
        rows.append([label, int(tb["all-gather"]), int(tb["all-reduce"] + tb["reduce-scatter"]),
                     int(tb["collective-permute"]), int(s["count"]), f"{s['covered']:.2f}",
                     f"{s['coverable']:.2f}", f"{r['loss'] - ref['loss']:+.1e}",
                     f"{r['max_grad_rel_diff']:.1e}", f"{r['temp'] / CM.MiB:.2f}",
                     f"{r['step_s'] * 1e3:.1f}"])
    print()
    print(CM.table(["variant", "AG tp B", "AR/RS tp B", "permute tp B", "tp colls",
                    "covered", "coverable", "d loss", "d grad", "temp MiB", "step ms"], rows,
                   title="tp collectives per device per step (census of the scheduled HLO); "
                         "covered: share of their bytes with matmul work scheduled in their "
                         "window; coverable: with independent matmul work in the computation; "
                         "loss and gradients vs GSPMD; CPU step time (median)"))
    print("\nXLA presets (compiler options; xla_gpu_* act on XLA:GPU only):")
    for name in overlap.XLA_PRESETS:
        opts = overlap.compiler_options(name)
        print(f"  {name:<16} {len(opts)} options, {len(overlap.gpu_only(name))} GPU-only: "
              + (", ".join(f"{k}={v}" for k, v in opts.items()) or "-"))

    g, c, b = (res[VARIANTS[i][0]] for i in (0, 2, 3))
    t = 4
    for label in (VARIANTS[2][0], VARIANTS[3][0]):
        r = res[label]
        claims.check(f"{label}: loss equals GSPMD's", r["loss"] - ref["loss"], 0.0,
                     abs(r["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"]))
        claims.check(f"{label}: gradients equal GSPMD's (max rel diff < 1e-5)",
                     r["max_grad_rel_diff"], 1e-5, r["max_grad_rel_diff"] < 1e-5)
        (perm,) = [x for x in r["theory"] if x["kind"] == "collective-permute"]
        claims.close(f"{label}: collective-permute bytes = overlap.collectives",
                     perm["census_bytes"], perm["theory_bytes"], 1e-6)
        claims.check(f"{label}: tp all-gathers left = the LM head's (2 x bsh)",
                     r["tp_bytes"]["all-gather"], 2 * 8 / 2 * 64 * 256 * 4,
                     r["tp_bytes"]["all-gather"] == 2 * 8 / 2 * 64 * 256 * 4)
    # ring bytes vs GSPMD's: the block's 6 all-gathers and 4 reduce-scatters of bsh per layer
    # (tp's column groups reduce their input gradient once) become 10 rings of t-1 hops of
    # bsh/t (one per column group): the same bytes on each link
    bsh, L = 8 / 2 * 64 * 256 * 4, 2
    claims.close("ring permute bytes = 10 (t-1)/t bsh per layer",
                 c["tp_bytes"]["collective-permute"], 10 * (t - 1) / t * bsh * L, 1e-6)
    gspmd_wire = sum(x["wire_bytes"] for x in g["census"] if x["axes"] == ["tp"])
    cm_wire = sum(x["wire_bytes"] for x in c["census"] if x["axes"] == ["tp"])
    claims.check("collective matmul: tp wire bytes <= GSPMD's (XLA:CPU's all-reduce + slice "
                 "counted as all-reduce)", cm_wire, gspmd_wire, cm_wire <= gspmd_wire)
    claims.check("collective matmul: more of the tp bytes have matmul work in their window",
                 c["schedule"]["all"]["covered"], g["schedule"]["all"]["covered"],
                 c["schedule"]["all"]["covered"] > g["schedule"]["all"]["covered"])
    claims.check("bidirectional: same permute bytes as one-way",
                 b["tp_bytes"]["collective-permute"], c["tp_bytes"]["collective-permute"],
                 b["tp_bytes"]["collective-permute"] == c["tp_bytes"]["collective-permute"])

    plt = CM.pyplot()
    fig, axs = plt.subplots(1, 3, figsize=(15, 4.6))
    names = [label for label, _ in VARIANTS]
    short = ["GSPMD", "GSPMD+LHS", "coll. matmul", "coll. matmul bidir"]
    x = np.arange(len(names))
    bottom = np.zeros(len(names))
    for k, color in zip(KINDS, ("C0", "C1", "C2", "C3")):
        v = np.array([res[n]["tp_bytes"][k] for n in names]) / CM.MiB
        if v.any():
            axs[0].bar(x, v, bottom=bottom, color=color,
                       label=k + (" (XLA:CPU's reduce-scatter)" if k == "all-reduce" else ""))
            bottom += v
    axs[0].set_ylim(0, 1.3 * bottom.max())
    axs[0].set(xticks=x, xticklabels=short, ylabel="MiB per device per step",
               title="tp collectives by kind (census)")
    axs[0].legend(fontsize=8)
    w = 0.38
    axs[1].bar(x - w / 2, [res[n]["schedule"]["all"]["covered"] for n in names], w,
               label="matmul scheduled in window")
    axs[1].bar(x + w / 2, [res[n]["schedule"]["all"]["coverable"] for n in names], w,
               label="independent matmul exists")
    axs[1].set(xticks=x, xticklabels=short, ylim=(0, 1.05), ylabel="share of tp collective bytes",
               title="overlap in the scheduled HLO (XLA:CPU)")
    axs[1].legend(fontsize=8)
    axs[2].bar(x, [res[n]["step_s"] * 1e3 for n in names], color="C4")
    axs[2].set(xticks=x, xticklabels=short, ylabel="ms (median)",
               title="train step on 8 simulated CPU devices (2 cores)")
    for ax in axs:
        ax.tick_params(axis="x", labelsize=8)
    CM.save(fig, args.out, "overlap.png")
    if args.figure:
        shutil.copyfile(os.path.join(args.out, "overlap.png"), args.figure)
        print(f"wrote {args.figure}")
    print(f"\n{len(VARIANTS)} variants in {time.time() - t_start:.0f} s")
    out = {label: {k: v for k, v in r.items() if k not in ("grads", "run")}
           for label, r in res.items()}
    claims.finish(args.out, {"variants": out, "presets": overlap.XLA_PRESETS})


if __name__ == "__main__":
    main()
