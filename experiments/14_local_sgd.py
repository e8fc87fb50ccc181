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
  Streaming H=16 F=2 delayed (arXiv 2501.18512) DiLoCo H=16 in 2 strided fragments (layer 0
                     and the embedding; layer 1, the norm and the head), averaged 8 steps
                     apart, each average taken as a step starts and landed at its end
                     (`plan.outer_delay=1`, alpha 0.5): the same bytes per step on average,
                     half the peak, and the all-reduce overlaps the step it is issued in
  DiLoCo H=16, 2 fsdp2xtp2   2 replicas (mesh.dp=2), each an fsdp2 x tp2 group of 4 devices
                     (DiLoCo's islands): the average moves each device's quarter of the
                     parameters over dp, and fsdp/tp run inside each replica as usual
                     (32 steps: its census, two averages and its held-out loss then)

Every run sees the same batches. Per run: the training loss (the replicas' mean, on their own
rows), the held-out loss of the averaged model (the anchor, `TrainState.params`) every 32 steps
(an average step for every H here), and the all-reduce bytes per step read from the compiled
program's census, the average's `lax.switch` branch weighed 1/H (`plan.branch_share`),
beside the formula, and the peak: the most bytes one step all-reduces (the largest branch);
the bytes of each of the first 48 steps for DiLoCo and the streaming run; and, by the planner,
the link bandwidth at which Llama-3-8B's average hides under one step (4 nodes of 8 H100).
DP's held-out loss also after steps/16 and steps/4 steps, where it has moved as many bytes as
local SGD with H = 16 and 4 in the whole run. Writes results.json and local_sgd.png under
--out. About 3 minutes on 2 idle cores.
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
from jaxscale.strategies.local_sgd import fragments  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

SEQ, BATCH, EVAL_EVERY, EVAL_BATCHES, WARMUP = 64, 32, 32, 4, 48
METRIC_BYTES = 4 * local_sgd.METRICS     # the step's metrics all-reduce
ISLANDS = "DiLoCo H=16, 2 fsdp2xtp2"
STREAM_DELAYED = "Streaming H=16 F=2 delayed"
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
        (STREAM_DELAYED, ("plan.local_sgd=diloco", "plan.local_steps=16",
                          "plan.outer_fragments=2", "plan.outer_delay=1")),
        (ISLANDS, ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "plan.local_sgd=diloco",
                   "plan.local_steps=16"))]


def train(cfg, train_b, held_b, steps, also=()):
    """(training losses, [(step, held-out loss of the anchor)], census rows, theory rows, the
    dp all-reduce bytes of each branch of the step's switch); the held-out loss every
    EVAL_EVERY steps and after the steps in `also`."""
    s = build(cfg)
    spec = s.placement.spec
    step = s.lower_train_step().compile()
    census = inspect.census(step.as_text(), s.placement.mesh, plan.branch_share(spec))
    theory = inspect.theory_vs_census(plan.collectives(spec), census)
    share = plan.branch_share(spec) or [1.0]
    branches = [over_dp(inspect.census(step.as_text(), s.placement.mesh,
                                       [float(b == i) for b in range(len(share))]))
                for i in range(len(share))]
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
    return losses, held, census, theory, branches


def over_dp(census) -> float:
    """All-reduce bytes over dp (the replicas' link) in a census."""
    return sum(r["bytes"] for r in census if r["kind"] == "all-reduce" and r["axes"] == ["dp"])


def timeline(spec, branches, steps: int) -> list[float]:
    """The dp all-reduce bytes of each of the first `steps` steps, by the step's schedule."""
    if not local_sgd.active(spec):
        return [branches[0]] * steps
    if local_sgd.streaming(spec):
        at = fragments.schedule(spec.outer_fragments, spec.local_steps, steps, spec.outer_delay)
    else:
        at = [int(L.is_sync(i, spec.local_steps, spec.local_warmup)) for i in range(steps)]
    return [branches[b] for b in at]


def link_table(model: str = "llama3-8b", H: int = 32) -> list[list]:
    """By the planner: Llama-3-8B, bf16, FSDP over the 8 H100s of a node, DiLoCo over 4 nodes
    (global batch 64 x 4096): one average's bytes per device, the step's compute, and the link
    bandwidth per device at which the average hides under one step (blocking: never)."""
    from jaxscale import planner
    from jaxscale.config import Config, apply_overrides
    rows = []
    for label, extra in [("DiLoCo (blocking)", ()), ("delayed, F=1", ("plan.outer_delay=1",)),
                         ("delayed, F=4", ("plan.outer_delay=1", "plan.outer_fragments=4"))]:
        cfg = apply_overrides(Config(), [
            f"model={model}", "mesh=h100x8x4", "mesh.dp=4", "mesh.dcn_dp=4", "mesh.fsdp=8",
            "plan.precision=bf16", "data.batch_size=64", "data.seq_len=4096",
            "plan.local_sgd=diloco", f"plan.local_steps={H}", *extra])
        spec = plan.Spec.from_config(cfg)
        peak = max(local_sgd.average_bytes(spec))
        t = planner.predict(cfg).time
        rows.append([label, f"{peak / 1e9:.2f}", f"{t.compute:.3f}",
                     "-" if not spec.outer_delay else f"{peak / t.compute / 1e9:.1f}",
                     f"{t.total:.4f}"])
    return rows


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
        losses, held, census, theory, branches = train(cfg, train_b, held_b, steps, also)
        spec = plan.Spec.from_config(cfg)
        H = spec.local_steps if local_sgd.active(spec) else 1
        warm = spec.local_warmup
        per_step = over_dp(census)          # over dp (the replicas' link)
        syncs = steps if not local_sgd.active(spec) else L.syncs(steps, H, warm)
        inner = spec.deg("fsdp") * spec.deg("tp")       # a replica's own split
        run_bytes = syncs * 4 * size / inner + steps * (16 if local_sgd.active(spec) else 0)
        curves[label] = (losses, held)
        final = held[-1][1]
        rows.append([label, H, f"{per_step:,.0f}", f"{max(branches):,.0f}", syncs,
                     f"{run_bytes / 2**20:.1f}", float(np.mean(losses[-16:])), final])
        results["runs"][label] = {"H": H, "census_bytes_per_step": per_step,
                                  "peak_bytes_per_step": max(branches),
                                  "bytes_by_step": timeline(spec, branches, 48), "syncs": syncs,
                                  "run_bytes": run_bytes, "train_loss": losses,
                                  "heldout": held, "theory": theory}
        for r in theory:    # DP's 4-byte token count travels in a tuple the census counts as 0
            claims.check(f"{label}: census {r['kind']} bytes/step = formula (to 4 B)",
                         r["census_bytes"], float(r["theory_bytes"]),
                         abs(r["census_bytes"] - r["theory_bytes"]) <= 4)
        print(f"{label:<16} held-out {final:.4f}  ({time.time() - t0:.0f} s)", flush=True)

    res = results["runs"]
    dp_bytes = res["DP"]["census_bytes_per_step"]
    for label in ("local H=4", "local H=16", "DiLoCo H=16"):
        H = res[label]["H"]
        claims.close(f"{label}: bytes/step = DP's / H (+ {METRIC_BYTES} B of metrics)",
                     res[label]["census_bytes_per_step"] - METRIC_BYTES, dp_bytes / H, 1e-6)
    islands_dp = sum(r["census_bytes"] for r in res[ISLANDS]["theory"]
                  if r["kind"] == "all-reduce" and r["axes"] == ["dp"])
    claims.close(f"{ISLANDS}: bytes over dp per step about a quarter of DP's / 16 (each device "
                 f"its fsdp x tp shard; the norm scales split over fsdp only)",
                 islands_dp - METRIC_BYTES, dp_bytes / 4 / 16, 5e-3)
    stream, blocking = res[STREAM_DELAYED], res["DiLoCo H=16"]
    claims.close(f"{STREAM_DELAYED}: bytes/step = DiLoCo H=16's (the same average, in "
                 f"fragments)", stream["census_bytes_per_step"],
                 blocking["census_bytes_per_step"], 1e-6)
    claims.check(f"{STREAM_DELAYED}: peak bytes in one step below 0.6 of DiLoCo H=16's",
                 stream["peak_bytes_per_step"], blocking["peak_bytes_per_step"],
                 stream["peak_bytes_per_step"] < 0.6 * blocking["peak_bytes_per_step"])
    links = link_table()
    print()
    print(C.table(["Llama-3-8B, DiLoCo H=32 over 4 nodes", "GB per average (per device)",
                   "compute s/step", "link GB/s to hide it in one step", "step s (planner)"],
                  links, title="streaming at scale, by the planner"))
    # the runs' table last: the gallery shows an experiment's last table
    print()
    print(C.table(["run", "H", "all-reduce B/step (census)", "peak B/step", "averages",
                   "MiB moved in run", "train loss (last 16)", "held-out loss"], rows,
                  title=f"{args.steps} steps, 8 replicas, {size:,} parameters (4 B each on "
                        f"the wire)"))
    results["link_table"] = links
    held = {k: v["heldout"][-1][1] for k, v in res.items()}
    claims.check("local SGD: averaging every 16 steps ends above averaging every step",
                 held["local H=16"], held["local H=1"], held["local H=16"] > held["local H=1"])
    claims.check("DiLoCo's outer momentum (0.9, lr 0.7) needs long periods: H=16 below H=4",
                 held["DiLoCo H=16"], held["DiLoCo H=4"], held["DiLoCo H=16"] < held["DiLoCo H=4"])
    claims.check("DiLoCo H=16 within 15% of DP's held-out loss at 1/16 of the bytes",
                 held["DiLoCo H=16"], held["DP"], held["DiLoCo H=16"] <= 1.15 * held["DP"])
    claims.check("post-local H=16 at or below local H=16 (held-out)", held["post-local H=16"],
                 held["local H=16"], held["post-local H=16"] <= held["local H=16"])
    claims.check(f"{STREAM_DELAYED}: held-out loss within 3% of DiLoCo H=16's",
                 held[STREAM_DELAYED], held["DiLoCo H=16"],
                 abs(held[STREAM_DELAYED] / held["DiLoCo H=16"] - 1) <= 0.03)
    dp_at = dict(res["DP"]["heldout"])
    for label in ("local H=4", "local H=16", "SlowMo H=16", "DiLoCo H=16"):
        H = res[label]["H"]
        claims.check(f"at equal bytes, {label} ends below DP (DP after {args.steps // H} steps)",
                     held[label], dp_at[args.steps // H], held[label] < dp_at[args.steps // H])
    results["dp_at_equal_bytes"] = dp_at

    plt = C.pyplot()
    fig, axs = plt.subplots(1, 4, figsize=(22, 4.8))
    colors = dict(zip([r[0] for r in RUNS], [*plt.cm.tab10(np.arange(10)), "black"]))
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
    for i, label in enumerate(("DiLoCo H=16", STREAM_DELAYED)):
        b = np.asarray(res[label]["bytes_by_step"]) / 2**10
        axs[3].bar(np.arange(1, len(b) + 1) + 0.4 * (i - 0.5), b, width=0.4, label=label,
                   color=colors[label])
    axs[3].set(title="all-reduce bytes over dp, step by step (census)", xlabel="step",
               ylabel="KiB per device")
    axs[3].legend(fontsize=7)
    axs[0].legend(fontsize=7)
    path = C.save(fig, args.out, "local_sgd.png")
    if args.figure:
        shutil.copy(path, args.figure)
        print(f"copied to {args.figure}")
    print(f"({time.time() - t0:.0f} s)")
    claims.finish(args.out, results)


if __name__ == "__main__":
    main()
