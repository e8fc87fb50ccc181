"""python experiments/18_moe.py [--out runs/18_moe] [--steps 60]

Topic 18: a mixture of experts and expert parallelism on 8 simulated CPU devices: the `tiny-moe`
model (dim 128, 2 layers, 8 experts of ffn 384, top-2, every layer), seq 64, batch 16, fp32.
1. Training with and without the Switch load-balancing loss (weight 0.01 vs 0; the router z-loss
   on in both), mesh dp2 x ep4, capacity factor 1.25: each expert's share of the top-2
   assignments over training (mean over layers), the imbalance (largest share x E: 1 when
   balanced) and the fraction of assignments dropped by the capacity. With the loss the shares
   stay close to 1/E and fewer assignments drop.
2. Dropped fraction against the capacity factor (0.5 ... 4 = E / k, where every expert holds a
   slot for every token) for both trained models: it falls with the factor, is 0 at E / k, and
   the balanced model drops less at every factor below it.
3. The all-to-all census at ep = 2, 4, 8 beside the formula tokens x hidden x top_k x dtype
   bytes x (ep-1)/ep per all-to-all (4 per MoE layer: dispatch and combine, forward and
   backward); capacity factor 1.0 so that the slot buffer holds exactly top_k rows per token.
4. Loss curves at ep = 1 (dp8), ep = 4 (dp2 x ep4) and ep = 4 with context parallelism
   (ep4 x sp2, ring: each sp shard dispatches its tokens, capacity counted over the whole
   sequence): equal to fp32 round-off (the same tokens drop at every layout).
5. Auxiliary-loss-free balancing (DeepSeek-V3's routing bias, rate 0.001, no balance loss)
   beside the two runs of 1: its imbalance and dropped fraction.
6. Dropless dispatch bytes, dp2 x ep4: the bounded exchange's all-to-all bytes per step at
   plan.moe_buffer f = 1, 1.5, 2, 4 (= ep: nothing can overflow) against the routed volume
   (tokens x top_k x dim x 4 per all-to-all) and the worst-case slot buffer the dispatch used
   before (C = T slots per expert: E / k x the routed volume); and the share of assignments
   that overflow at each f on a held batch (the balanced model).
Under three minutes on 2 idle cores. Writes results.json and moe.png under --out.
"""
from __future__ import annotations

import dataclasses
import time

import _common as C  # first: 8 simulated devices before jax is imported

C.cpu_only()
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.axes import use_rules  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402
from jaxscale.train.state import FunctionalModel  # noqa: E402

SEQ, BATCH, E, K = 64, 16, 8, 2
DP2EP4 = ("mesh.dp=2", "mesh.fsdp=1", "mesh.tp=1", "mesh.ep=4")
FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def cfg_for(*overrides, steps=60):
    return C.config(*overrides, model="tiny-moe", seq=SEQ, batch=BATCH, steps=steps, lr=3e-3)


def stats_fn(setup):
    """The model's MoE statistics for a batch, under the plan's rules (one compile)."""
    def f(p, tokens):
        with use_rules(setup.placement.mesh, setup.placement.rules):
            return setup.model.module(p)(tokens, return_aux=True)[1]
    with jax.set_mesh(setup.placement.mesh):
        jitted = jax.jit(f)
    return lambda p, tokens: jax.device_get(jitted(p, tokens))


def train(cfg, steps: int, share_every: int = 5) -> dict:
    setup = build(cfg)
    batches = Batches(load_corpus(cfg.data).train, BATCH, SEQ, seed=0)
    stats = stats_fn(setup)
    state, out = setup.init_state(), {"loss": [], "aux": [], "z": [], "dropped": [],
                                      "share_steps": [], "share": []}
    for i in range(steps):
        batch = batches.device_batch(i, setup.batch_shardings())
        if i % share_every == 0 or i == steps - 1:
            out["share_steps"].append(i)
            out["share"].append(np.mean(stats(state.params, batch["inputs"])["expert_share"], 0))
        state, m = setup.train_step(state, batch)
        m = jax.device_get(m)
        out["loss"].append(float(m["loss"]))
        out["aux"].append(float(m["moe_aux_loss"]))
        out["z"].append(float(m["moe_z_loss"]))
        out["dropped"].append(float(m["moe_dropped"]))
    out["share"] = np.array(out["share"])
    out["params"] = jax.device_get(state.params)
    return out


def dropped_vs_capacity(model_cfg, params, tokens) -> list[float]:
    """Dropped fraction of one batch at each capacity factor (one device: the count does not
    depend on the layout)."""
    out = []
    for f in FACTORS:
        fm = FunctionalModel(dataclasses.replace(model_cfg, capacity_factor=f))
        aux = jax.jit(lambda p, t: fm.module(p)(t, return_aux=True)[1])(params, tokens)
        out.append(float(aux["dropped"] / aux["routed"]))
    return out


def census(ep: int) -> dict:
    cfg = cfg_for("mesh.dp=1", f"mesh.fsdp={8 // ep}", "mesh.tp=1", f"mesh.ep={ep}",
                  "model.capacity_factor=1.0")
    rep = inspect.report(cfg)
    row = [c for c in rep["collectives"] if c["kind"] == "all-to-all"][0]
    tokens = BATCH * SEQ / 8                           # per device: batch over fsdp x ep
    n = 4 * cfg.model.n_layers
    formula = tokens * cfg.model.dim * K * 4 * (ep - 1) / ep * n
    theory = [r for r in rep["theory"] if r["kind"] == "all-to-all"][0]
    return {"ep": ep, "count": row["count"], "bytes": row["bytes"], "wire_bytes": row["wire_bytes"],
            "formula_wire_bytes": formula, "planner_bytes": theory["theory_bytes"]}


BUFFERS = (1.0, 1.5, 2.0, 4.0)


def dropless_dispatch(params) -> list[dict]:
    """dp2 x ep4 dropless at each plan.moe_buffer: the all-to-all census (rows and counts) and
    the overflowed share of one held batch (the balanced model's weights)."""
    out = []
    held = Batches(load_corpus(cfg_for().data).train, BATCH, SEQ, seed=0)
    for f in BUFFERS:
        cfg = cfg_for(*DP2EP4, "model.moe_dropless=true", f"plan.moe_buffer={f}")
        rep = inspect.report(cfg)
        row = [c for c in rep["collectives"] if c["kind"] == "all-to-all"][0]
        setup = build(cfg)
        stats = stats_fn(setup)(jax.device_put(params, setup.device_shardings.params),
                                held.device_batch(10_000, setup.batch_shardings())["inputs"])
        tokens = BATCH * SEQ / 8
        routed = tokens * K * cfg.model.dim * 4 * 4 * cfg.model.n_layers
        counts = 4 * (E // 4) * 4 * cfg.model.n_layers
        out.append({"factor": f, "bytes": row["bytes"], "rows_bytes": row["bytes"] - counts,
                    "routed": routed, "worst_case": routed * E / K,
                    "overflow": float(stats["dropped"] / stats["routed"])})
    return out


def plot(runs, drops, curves, dispatch, out):
    plt = C.pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(16, 7.5))
    top = max(0.35, max(float(np.max(r["share"])) for r in runs.values()) * 1.05)
    for ax, (name, r) in zip(axes[0], list(runs.items())[:3]):
        for e in range(E):
            ax.plot(r["share_steps"], r["share"][:, e], lw=1.2, label=f"expert {e}")
        ax.axhline(1 / E, color="k", ls=":", lw=0.8)
        ax.set_title(f"expert share of assignments, {name}")
        ax.set_xlabel("step")
        ax.set_ylabel("share (mean over layers)")
        ax.set_ylim(0, top)
    axes[0][0].legend(fontsize=7, ncol=2)
    ax = axes[1][0]
    for name, d in drops.items():
        ax.plot(FACTORS, d, "o-", label=name)
    ax.plot(FACTORS, [max(0.0, 1 - f) for f in FACTORS], "k:", lw=0.8,
            label="perfect balance: 1 - factor")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("dropped fraction of assignments")
    ax.set_title("dropped tokens vs capacity (after training)")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, ls="--" if "ep=4" in name else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss: ep=1, ep=4, ep=4 x sp=2")
    ax.legend(fontsize=8)
    ax = axes[1][2]
    fs = [d["factor"] for d in dispatch]
    ax.plot(fs, [d["rows_bytes"] / 2**10 for d in dispatch], "o-", label="bounded exchange")
    ax.plot(fs, [d["routed"] * f / 2**10 for d, f in zip(dispatch, fs)], "k:",
            label="routed volume x f")
    ax.axhline(dispatch[0]["worst_case"] / 2**10, color="r", ls="--",
               label="worst-case slot buffer (C = T)")
    ax.set_xlabel("plan.moe_buffer f")
    ax.set_ylabel("all-to-all KiB per device per step")
    ax.set_title("dropless dispatch over ep (dp2 x ep4)")
    ax.legend(fontsize=8)
    return C.save(fig, out, "moe.png")


def main():
    args = C.parse_args(__doc__, "runs/18_moe", lambda ap: ap.add_argument(
        "--steps", type=int, default=60))
    t0 = time.time()
    claims = C.Claims()

    runs = {"balancing loss 0.01": train(cfg_for(*DP2EP4, steps=args.steps), args.steps),
            "no balancing loss": train(cfg_for(*DP2EP4, "model.moe_aux_weight=0",
                                               steps=args.steps), args.steps),
            "routing bias 0.001 (no loss)": train(cfg_for(
                *DP2EP4, "model.moe_aux_weight=0", "model.moe_bias_rate=0.001",
                steps=args.steps), args.steps)}
    rows = []
    for name, r in runs.items():
        tail = slice(-10, None)
        imb = float(np.max(r["share"][-1]) * E)
        rows.append([name, f"{np.mean(r['loss'][tail]):.4f}", f"{np.mean(r['aux'][tail]):.4f}",
                     f"{imb:.3f}", f"{np.mean(r['dropped'][tail]):.4f}"])
        r["imbalance"], r["late_dropped"] = imb, float(np.mean(r["dropped"][tail]))
    print(C.table(["run (dp2 x ep4)", "loss", "aux loss", "largest share x E", "dropped"], rows,
                  title=f"last 10 of {args.steps} steps, capacity factor 1.25"))
    on, off = runs["balancing loss 0.01"], runs["no balancing loss"]
    bias = runs["routing bias 0.001 (no loss)"]
    claims.check("routing bias: largest expert share x E at the end below the run without "
                 "any balancing", f"{bias['imbalance']:.3f} vs {off['imbalance']:.3f}",
                 "smaller", bias["imbalance"] < off["imbalance"])
    claims.check("balancing loss: largest expert share x E at the end below the run without",
                 f"{on['imbalance']:.3f} vs {off['imbalance']:.3f}", "smaller",
                 on["imbalance"] < off["imbalance"])
    claims.check("balancing loss: fewer assignments dropped (last 10 steps)",
                 f"{on['late_dropped']:.4f} vs {off['late_dropped']:.4f}", "smaller",
                 on["late_dropped"] < off["late_dropped"])

    model_cfg = cfg_for(*DP2EP4).model
    held = Batches(load_corpus(cfg_for().data).train, BATCH, SEQ, seed=0).global_rows(10_000)
    tokens = held["inputs"]
    drops = {name: dropped_vs_capacity(model_cfg, r["params"], tokens)
             for name, r in list(runs.items())[:2]}
    print()
    print(C.table(["capacity factor"] + list(drops),
                  [[f"{f:g}"] + [f"{d[i]:.4f}" for d in drops.values()]
                   for i, f in enumerate(FACTORS)], title="dropped fraction, a held batch"))
    for name, d in drops.items():
        claims.check(f"{name}: dropped fraction falls with the capacity factor",
                     " ".join(f"{x:.3f}" for x in d), "non-increasing",
                     all(a >= b for a, b in zip(d, d[1:])))
        claims.check(f"{name}: nothing dropped at capacity factor E/k = 4", d[-1], "0",
                     d[-1] == 0.0)
    below = [i for i, f in enumerate(FACTORS) if f < 4]
    claims.check("balanced model drops less at every factor below E/k",
                 sum(drops["balancing loss 0.01"][i] < drops["no balancing loss"][i]
                     for i in below), f"{len(below)}",
                 all(drops["balancing loss 0.01"][i] < drops["no balancing loss"][i]
                     for i in below))

    cens = [census(ep) for ep in (2, 4, 8)]
    print()
    print(C.table(["ep", "all-to-alls", "census bytes", "census wire bytes",
                   "tokens x hidden x top_k x 4 x (ep-1)/ep", "planner bytes"],
                  [[c["ep"], c["count"], c["bytes"], c["wire_bytes"],
                    f"{c['formula_wire_bytes']:,.0f}", c["planner_bytes"]] for c in cens],
                  title="all-to-all over ep per device per step (2 MoE layers, capacity 1.0)"))
    for c in cens:
        claims.close(f"ep={c['ep']}: all-to-all wire bytes vs the formula", c["wire_bytes"],
                     c["formula_wire_bytes"], 0.001)
        claims.close(f"ep={c['ep']}: all-to-all bytes vs the planner", c["bytes"],
                     c["planner_bytes"], 0.02)

    curves = {"ep=4 (dp2 x ep4)": on["loss"],
              "ep=1 (dp8)": train(cfg_for("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1",
                                          steps=args.steps), args.steps,
                                  share_every=args.steps)["loss"]}
    curves["ep=4 x sp=2 ring"] = train(cfg_for("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1",
                                                "mesh.ep=4", "mesh.sp=2", steps=args.steps),
                                        args.steps, share_every=args.steps)["loss"]
    ref = curves["ep=1 (dp8)"]
    for name in ("ep=4 (dp2 x ep4)", "ep=4 x sp=2 ring"):
        diff = max(abs(a - b) / b for a, b in zip(curves[name], ref))
        claims.check(f"loss curve {name} = ep=1 (max relative difference)", diff, "< 1e-5",
                     diff < 1e-5)

    dispatch = dropless_dispatch(on["params"])
    print()
    print(C.table(["f", "all-to-all bytes", "rows / (routed x f)", "worst-case buffer / routed",
                   "overflowed"],
                  [[f"{d['factor']:g}", f"{d['bytes']:,}",
                    f"{d['rows_bytes'] / (d['routed'] * d['factor']):.3f}",
                    f"{d['worst_case'] / d['routed']:.1f}", f"{d['overflow']:.4f}"]
                   for d in dispatch],
                  title="dropless dispatch over ep, dp2 x ep4, per device per step"))
    for d in dispatch:
        claims.close(f"f={d['factor']:g}: exchanged rows vs routed volume x f",
                     d["rows_bytes"], d["routed"] * d["factor"], 0.10)
    claims.check("f = ep: nothing overflows", dispatch[-1]["overflow"], "0",
                 dispatch[-1]["overflow"] == 0.0)
    print()
    print(C.table(["step"] + list(curves),
                  [[i + 1] + [f"{v[i]:.5f}" for v in curves.values()]
                   for i in range(0, args.steps, max(1, args.steps // 12))], title="loss"))
    plot(runs, drops, curves, dispatch, args.out)
    print(f"\n{time.time() - t0:.0f} s")
    claims.finish(args.out, {
        "runs": {n: {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()
                     if k != "params"} for n, r in runs.items()},
        "dropped_vs_capacity": {"factors": FACTORS, **drops}, "census": cens, "losses": curves,
        "dropless_dispatch": dispatch,
        "seconds": time.time() - t0})


if __name__ == "__main__":
    main()
