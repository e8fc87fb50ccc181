"""python experiments/22_donation.py [--out runs/exp22]

Topic 22: buffer donation (`plan.donate`). A train step maps the state to a new state of the same
shapes; donating the input state (`jax.jit(..., donate_argnums=0)`) lets XLA write the new state
into the old buffers instead of allocating a second copy for its outputs.

1. For a few plans, `jaxscale.analysis.inspect.donation_report` compiles the step both ways.
   Donated, the compiled program aliases every output buffer to an input (alias bytes = one train
   state on the device: parameters, fp32 master, Adam moments, counters, from `state_bytes`); not
   donated, it allocates a whole second state for its outputs. The per-device peak
   (`memory_analysis`: arguments + outputs + temp - alias) falls by exactly that copy: the update
   writes the new state into the old buffers (its non-finite guard is a `lax.cond`, so nothing reads
   the old state after it is overwritten) and the temp is the same either way.
2. The guard isolated on a bare `clip + adamw` update of three matrices (optax's clip): with
   donation the temp holds exactly the update tree (one parameter-sized copy), so the peak falls
   by the state less that tree. A non-finite guard written as a select (`where(finite, new,
   old)` over the state) reads the old state after the update has overwritten it, so XLA copies
   the state first and the temp grows; written as a `lax.cond` (the step's
   `precision.update_if_finite`) it costs nothing.
3. One step run each way: with donation the input state's buffers are deleted (reused), without
   it they stay alive next to the new state. Writes donation.png.
"""
from __future__ import annotations

import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxscale.analysis.inspect import donation_report, memory  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402
from jaxscale.train.state import state_bytes  # noqa: E402

GUARDS = ("none", "select", "cond")
PLANS = {"tiny fp32, batch 8 x 8": (("plan.precision=fp32",), 8, 8),
         "tiny bf16, batch 8 x 8": (("plan.precision=bf16",), 8, 8),
         "tiny fp32, batch 16 x 64": (("plan.precision=fp32",), 64, 16)}


def bare_adamw() -> dict:
    """Peak of a clip + AdamW update of three matrices: donated or not; no non-finite guard, the
    guard as a select, or as a `lax.cond`."""
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32)
              for k, s in {"a": (512, 512), "b": (512, 1024), "c": (1024, 512)}.items()}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = jax.eval_shape(opt.init, params)
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))

    def step(p, o, g, guard):
        def update(g, p, o):
            u, o2 = opt.update(g, o, p)
            return optax.apply_updates(p, u), o2
        finite = jnp.isfinite(optax.tree.norm(g))
        if guard == "cond":
            return jax.lax.cond(finite, update, lambda g, p, o: (p, o), g, p, o)
        p2, o2 = update(g, p, o)
        if guard == "select":
            p2, o2 = jax.tree.map(lambda n, x: jnp.where(finite, n, x), (p2, o2), (p, o))
        return p2, o2
    out = {"state": nbytes((params, opt_state)), "params": nbytes(params)}
    for guard in GUARDS:
        for donate in (True, False):
            f = jax.jit(lambda p, o, g: step(p, o, g, guard),
                        donate_argnums=(0, 1) if donate else ())
            out[(guard, donate)] = memory(f.lower(params, opt_state, params).compile())
    return out


def main():
    args = C.parse_args(__doc__, "runs/exp22")
    t0 = time.time()
    claims = C.Claims()
    rows, res = [], {}
    for name, (over, seq, batch) in PLANS.items():
        cfg = C.config(*C.DP8, *over, seq=seq, batch=batch)
        rep = donation_report(cfg)
        state = sum(v.get("device", 0) for v in state_bytes(build(cfg).abstract_state()).values())
        d, n = rep["donated"], rep["not_donated"]
        res[name] = {"donated": d["total"], "not_donated": n["total"], "saved": rep["saved_bytes"],
                     "state": state, "alias": d["alias"]}
        rows.append([name, f"{state / C.MiB:.3f}", f"{d['alias'] / C.MiB:.3f}",
                     f"{(n['output'] - n['alias']) / C.MiB:.3f}", f"{d['total'] / C.MiB:.3f}",
                     f"{n['total'] / C.MiB:.3f}", f"{d['temp'] / C.MiB:.3f}",
                     f"{n['temp'] / C.MiB:.3f}", f"{rep['saved_bytes'] / state:.3f}"])
        claims.check(f"{name}: donated, aliased bytes = one train state",
                     f"{d['alias']:,}", f"{state:,.0f}", abs(d["alias"] - state) < 1024)
        claims.check(f"{name}: not donated, fresh output bytes = one train state",
                     f"{n['output'] - n['alias']:,}", f"{state:,.0f}",
                     abs(n["output"] - n["alias"] - state) < 1024)
        claims.close(f"{name}: peak saved / one state", rep["saved_bytes"] / state, 1.0, 0.01)
    print(C.table(["plan", "state MiB", "aliased (donated)", "fresh outputs (not)",
                   "peak donated", "peak not", "temp donated", "temp not", "peak saved / state"],
                  rows, title="per-device compiled train step, MiB (dp=8)"))

    ad = bare_adamw()
    rows = []
    for guard in GUARDS:
        d, n = ad[(guard, True)], ad[(guard, False)]
        rows.append([f"clip+adamw{'' if guard == 'none' else ' + guard as ' + guard}",
                     f"{ad['state'] / C.MiB:.2f}", f"{d['temp'] / C.MiB:.2f}",
                     f"{n['temp'] / C.MiB:.2f}", f"{(n['total'] - d['total']) / C.MiB:.2f}",
                     f"{(n['total'] - d['total']) / ad['state']:.3f}"])
    print()
    print(C.table(["update", "state MiB", "temp donated", "temp not", "peak saved MiB",
                   "saved / state"], rows, title="bare optimizer update of 3 matrices"))
    d, n = ad[("none", True)], ad[("none", False)]
    claims.close("bare adamw, donated: temp = the update tree (one params copy)", d["temp"],
                 ad["params"], 0.01)
    claims.close("bare adamw: peak saved = state - update tree", n["total"] - d["total"],
                 ad["state"] - ad["params"], 0.01)
    claims.check("guard as a select: more temp with donation",
                 f"{ad[('select', True)]['temp']:,}", f"> {d['temp']:,}",
                 ad[("select", True)]["temp"] > d["temp"])
    claims.close("guard as a cond: temp as without a guard", ad[("cond", True)]["temp"],
                 d["temp"], 0.01)

    cfg = C.config(*C.DP8, "plan.precision=bf16", seq=8, batch=8)
    batch_rows = Batches(load_corpus(cfg.data).train, 8, 8, seed=0).global_rows(0)
    alive = {}
    for donate in (True, False):
        setup = build(cfg, donate=donate)
        state = setup.init_state()
        batch = {k: jax.device_put(v, setup.batch_shardings()[k]) for k, v in batch_rows.items()}
        new, _ = setup.train_step(state, batch)
        jax.block_until_ready(new)
        leaves = jax.tree.leaves(state)
        alive[donate] = sum(not x.is_deleted() for x in leaves), len(leaves)
    print(f"\nafter one step, input state arrays still alive: donated {alive[True][0]}/"
          f"{alive[True][1]}, not donated {alive[False][0]}/{alive[False][1]}")
    claims.check("donated: input state buffers reused (alive / total)",
                 f"{alive[True][0]}/{alive[True][1]}", f"0/{alive[True][1]}", alive[True][0] == 0)
    claims.check("not donated: input state kept (alive / total)",
                 f"{alive[False][0]}/{alive[False][1]}", f"{alive[False][1]}/{alive[False][1]}",
                 alive[False][0] == alive[False][1])

    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(res)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [res[n]["donated"] / C.MiB for n in names], 0.4,
           label="donated")
    ax.bar([i + 0.2 for i in x], [res[n]["not_donated"] / C.MiB for n in names], 0.4,
           label="not donated")
    for i, n in enumerate(names):
        ax.plot([i - 0.4, i + 0.4], [(res[n]["donated"] + res[n]["state"]) / C.MiB] * 2, "k--",
                lw=1, label="donated + one state copy" if i == 0 else None)
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("peak MiB per device (compiled)")
    ax.set_title("donation: peak with and without (compiled)")
    ax.legend(fontsize=8)
    C.save(fig, args.out, "donation.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"plans": res, "alive_after_step": {str(k): v for k, v in
                                                                alive.items()},
                             "bare_adamw": {str(k): v for k, v in ad.items()}})


if __name__ == "__main__":
    main()
