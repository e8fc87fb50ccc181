"""python experiments/14_local_sgd.py [--out runs/exp14] [--steps 128]
                                     [--figure docs/img/exp14_local_sgd.png]

Topic 14: local SGD over the data axis, and how often the replicas must talk. The tiny LLaMA
(2 layers, dim 128, byte vocabulary 320) on the stdlib corpus, 8 replicas (`mesh.dp=8`), each
with its own rows of a 32 x 64 batch and its own AdamW, trained by the framework's train step
(`plan.local_sgd`, `jaxscale/strategies/local_sgd/__init__.py`) for --steps steps:

  DP                 synchronous data parallelism (a gradient all-reduce every step)
  local H            the replicas averaged every H steps (H = 1, 4, 16)
  post-local H=16    48 synchronous steps (DP), then local SGD with H = 16 (Lin et al. 2018)
  SlowMo H=16        outer heavy-ball momentum 0.5, lr 1, on the averaged change (arXiv 1910.00643)
  DiLoCo H           outer Nesterov momentum 0.9, lr 0.7 (arXiv 2311.08105), H = 4 and 16
  DiLoCo H=16, 2 fsdp2xtp2   2 replicas (mesh.dp=2), each an fsdp2 x tp2 group of 4 devices
                     (DiLoCo's islands): the average moves each device's quarter of the
                     parameters over dp, and fsdp/tp run inside each replica as usual
                     (32 steps: its census, two averages and its held-out loss then)

Every run sees the same batches. Per run: the training loss (the replicas' mean, on their own
rows), the held-out loss of the averaged model (the anchor, `TrainState.params`) every 32 steps
(an average step for every H here), and the all-reduce bytes per step read from the compiled
program's census, the average's `lax.switch` branch weighed 1/H (`plan.branch_share`),
beside the formula; DP's held-out loss also after steps/16 and steps/4 steps, where it has
moved as many bytes as local SGD with H = 16 and 4 in the whole run. Writes results.json and
local_sgd.png under --out. About 2.5 minutes on 2 idle cores (240 s of CPU time).
"""
from __future__ import annotations

import shutil
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

C.cpu_only()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale import plan  # noqa: E402
from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.strategies import local_sgd  # noqa: E402
from jaxscale.strategies.local_sgd import averaging as L  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

SEQ, BATCH, EVAL_EVERY, EVAL_BATCHES, WARMUP = 64, 32, 32, 4, 48
METRIC_BYTES = 4 * local_sgd.METRICS     # the step's metrics all-reduce
ISLANDS = "DiLoCo H=16, 2 fsdp2xtp2"
ISLAND_STEPS = 32       # its census and two averages (an fsdp x tp step is slow on CPU)
#: (label, overrides)
RUNS = [("DP", ()),
        ("local H=1", ("plan.local_sgd=local", "plan.local_steps=1")),
        ("local H=4", ("plan.local_sgd=local", "plan.local_steps=4")),
        ("local H=16", ("plan.local_sgd=local", "plan.local_steps=16")),
        ("post-local H=16", ("plan.local_sgd=post_local", "plan.local_steps=16",
                             f"plan.local_warmup={WARMUP}")),
        ("SlowMo H=16", ("plan.local_sgd=slowmo", "plan.local_steps=16")),
        ("DiLoCo H=4", ("plan.local_sgd=diloco", "plan.local_steps=4")),
        ("DiLoCo H=16", ("plan.local_sgd=diloco", "plan.local_steps=16")),
        (ISLANDS, ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.local_sgd=diloco",
                   "plan.local_steps=16"))]


def train(cfg, train_b, held_b, steps, also=()):
    """(training losses, [(step, held-out loss of the anchor)], census rows, theory rows); the
    held-out loss every EVAL_EVERY steps and after the steps in `also`."""
    s = build(cfg)
    spec = s.placement.spec
    step = s.lower_train_step().compile()
    census = inspect.census(step.as_text(), s.placement.mesh, plan.branch_share(spec))
    theory = inspect.theory_vs_census(plan.collectives(spec), census)
    sh = s.batch_shardings()
    state, losses, held = s.init_state(), [], []
    with jax.set_mesh(s.placement.mesh):
        for i in range(steps):
            state, m = step(state, train_b.device_batch(i, sh))
            losses.append(float(m["loss"]))
            if (i + 1) % EVAL_EVERY == 0 or i + 1 in also:
                tot = [s.eval_step(state.params, held_b.device_batch(j, sh))
                       for j in range(EVAL_BATCHES)]
                held.append((i + 1, float(sum(t for t, _ in tot) / sum(n for _, n in tot))))
    return losses, held, census, theory


def main() -> None:
    args = C.parse_args(__doc__, "runs/exp14", lambda ap: (
        ap.add_argument("--steps", type=int, default=128),
        ap.add_argument("--figure", default=None, help="also copy the figure here")))
    if args.steps % EVAL_EVERY or args.steps <= WARMUP:
        raise SystemExit(f"--steps must be a multiple of {EVAL_EVERY} above {WARMUP}")
    t0 = time.time()
    claims, results = C.Claims(), {"runs": {}}
    base = C.config(*C.DP8, seq=SEQ, batch=BATCH, steps=args.steps, lr=3e-3)
    corpus = load_corpus(base.data)
    train_b = Batches(corpus.train, BATCH, SEQ, seed=0, pad_id=corpus.pad_id)
    held_b = Batches(corpus.heldout, 2 * BATCH, SEQ, seed=1, stream=1, pad_id=corpus.pad_id)
    size = sum(x.size for x in jax.tree.leaves(build(base).model.abstract_params))
    rows, curves = [], {}
    for label, overrides in RUNS:
        cfg = C.apply_overrides(base, list(overrides))
        # DP also where it has moved as many bytes as local SGD with H = 4 and 16 in the run
        also = (args.steps // 16, args.steps // 4) if label == "DP" else ()
        steps = ISLAND_STEPS if label == ISLANDS else args.steps
        losses, held, census, theory = train(cfg, train_b, held_b, steps, also)
        spec = plan.Spec.from_config(cfg)
        H = spec.local_steps if local_sgd.active(spec) else 1
        warm = spec.local_warmup
        per_step = sum(r["bytes"] for r in census          # over dp (the replicas' link)
                       if r["kind"] == "all-reduce" and r["axes"] == ["dp"])
        syncs = steps if not local_sgd.active(spec) else L.syncs(steps, H, warm)
        inner = spec.deg("fsdp") * spec.deg("tp")       # a replica's own split
        run_bytes = syncs * 4 * size / inner + steps * (16 if local_sgd.active(spec) else 0)
        curves[label] = (losses, held)
        final = held[-1][1]
        rows.append([label, H, f"{per_step:,.0f}", syncs, f"{run_bytes / 2**20:.1f}",
                     float(np.mean(losses[-16:])), final])
        results["runs"][label] = {"H": H, "census_bytes_per_step": per_step, "syncs": syncs,
                                  "run_bytes": run_bytes, "train_loss": losses,
                                  "heldout": held, "theory": theory}
        for r in theory:    # DP's 4-byte token count travels in a tuple the census counts as 0
            claims.check(f"{label}: census {r['kind']} bytes/step = formula (to 4 B)",
                         r["census_bytes"], float(r["theory_bytes"]),
                         abs(r["census_bytes"] - r["theory_bytes"]) <= 4)
        print(f"{label:<16} held-out {final:.4f}  ({time.time() - t0:.0f} s)", flush=True)

    print()
    print(C.table(["run", "H", "all-reduce B/step (census)", "averages", "MiB moved in run",
                   "train loss (last 16)", "held-out loss"], rows,
                  title=f"{args.steps} steps, 8 replicas, {size:,} parameters (4 B each on "
                        f"the wire)"))
    res = results["runs"]
    dp_bytes = res["DP"]["census_bytes_per_step"]
    for label in ("local H=4", "local H=16", "DiLoCo H=16"):
        H = res[label]["H"]
        claims.close(f"{label}: bytes/step = DP's / H (+ {METRIC_BYTES} B of metrics)",
                     res[label]["census_bytes_per_step"] - METRIC_BYTES, dp_bytes / H, 1e-6)
    over_dp = sum(r["census_bytes"] for r in res[ISLANDS]["theory"]
                  if r["kind"] == "all-reduce" and r["axes"] == ["dp"])
    claims.close(f"{ISLANDS}: bytes over dp per step about a quarter of DP's / 16 (each device "
                 f"its fsdp x tp shard; the norm scales split over fsdp only)",
                 over_dp - METRIC_BYTES, dp_bytes / 4 / 16, 5e-3)
    held = {k: v["heldout"][-1][1] for k, v in res.items()}
    claims.check("local SGD: averaging every 16 steps ends above averaging every step",
                 held["local H=16"], held["local H=1"], held["local H=16"] > held["local H=1"])
    claims.check("DiLoCo's outer momentum (0.9, lr 0.7) needs long periods: H=16 below H=4",
                 held["DiLoCo H=16"], held["DiLoCo H=4"], held["DiLoCo H=16"] < held["DiLoCo H=4"])
    claims.check("DiLoCo H=16 within 15% of DP's held-out loss at 1/16 of the bytes",
                 held["DiLoCo H=16"], held["DP"], held["DiLoCo H=16"] <= 1.15 * held["DP"])
    claims.check("post-local H=16 at or below local H=16 (held-out)", held["post-local H=16"],
                 held["local H=16"], held["post-local H=16"] <= held["local H=16"])
    dp_at = dict(res["DP"]["heldout"])
    for label in ("local H=4", "local H=16", "SlowMo H=16", "DiLoCo H=16"):
        H = res[label]["H"]
        claims.check(f"at equal bytes, {label} ends below DP (DP after {args.steps // H} steps)",
                     held[label], dp_at[args.steps // H], held[label] < dp_at[args.steps // H])
    results["dp_at_equal_bytes"] = dp_at

    plt = C.pyplot()
    fig, axs = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = dict(zip([r[0] for r in RUNS], plt.cm.tab10(np.arange(len(RUNS)))))
    k = 8
    for label, (losses, held_c) in curves.items():
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        axs[0].plot(np.arange(k, len(losses) + 1), smooth, label=label, color=colors[label],
                    lw=2.2 if label == "DP" else 1.2)
        axs[1].plot(*zip(*held_c), "o-", label=label, color=colors[label], ms=3)
        axs[2].scatter(res[label]["census_bytes_per_step"] / 2**10, held_c[-1][1],
                       color=colors[label], s=40)
        axs[2].annotate(label, (res[label]["census_bytes_per_step"] / 2**10, held_c[-1][1]),
                        fontsize=7, xytext=(4, 2), textcoords="offset points")
    axs[0].set(title=f"training loss (replicas' mean, {k}-step average)", xlabel="step",
               ylabel="loss")
    top = max(v for _, (_, h) in curves.items() for t, v in h if t >= EVAL_EVERY) + 0.05
    axs[1].set(title="held-out loss of the averaged model", xlabel="step", ylim=(None, top))
    first = curves["DP"][1][0]
    axs[1].annotate(f"DP after {first[0]} steps: {first[1]:.2f}", (first[0], top),
                    xytext=(2, -12), textcoords="offset points", fontsize=7)
    axs[2].set(title="held-out loss vs all-reduce bytes per step (census)",
               xlabel="KiB per device per step", xscale="log")
    from matplotlib.ticker import NullFormatter
    axs[2].xaxis.set_minor_formatter(NullFormatter())      # after the log scale sets its own
    axs[0].legend(fontsize=7)
    path = C.save(fig, args.out, "local_sgd.png")
    if args.figure:
        shutil.copy(path, args.figure)
        print(f"copied to {args.figure}")
    print(f"({time.time() - t0:.0f} s)")
    claims.finish(args.out, results)


if __name__ == "__main__":
    main()
