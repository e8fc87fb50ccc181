"""python experiments/17_context_parallel.py [--out runs/17_context_parallel] [--budget-mib 40]

Topic 17: sequence and context parallelism on 8 simulated CPU devices, the tiny LLaMA (2 layers,
dim 128, 8 query and 8 kv heads, blockwise attention: memory linear in the length, so what
grows is the activations sp divides), fp32, mesh fsdp = 8/sp x sp, one sequence per fsdp rank
(batch 8/sp): each device holds 1/sp of one sequence.
1. The longest sequence that trains under a per-device memory budget, for ring, Ulysses and
   all-gather attention at sp = 2, 4, 8 and for sp = 1 (fsdp8): the planner proposes the longest
   length of 128 x 2^k it predicts to fit; the train step is compiled there and one length up
   (and down, until one fits), and the compiled total (`memory_analysis`) is printed beside the
   prediction. Compiling only: nothing at these lengths is run. Ulysses lands on the planner's
   pick at every sp (8x longer than sp=1 at sp=4); ring and all-gather on it or one doubling
   longer (the planner counts the unrolled hops' score tiles: it errs on the safe side).
2. Each method's collective census at sp = 4, seq 256, beside the planner's formula: ring (sp-1)
   collective-permutes of the K/V block forward and 2(sp-1) backward per layer, Ulysses 8
   all-to-alls per layer, all-gather one all-gather and one reduce-scatter per layer.
3. Loss curves on real text, 12 steps at seq 128, batch 2: each method at sp = 4 (fsdp2 x sp4)
   against the same batches with the sequence whole (fsdp2 x tp4), equal to fp32 round-off.
Under three minutes on 2 idle cores. Writes results.json and context.png under --out.
"""
from __future__ import annotations

import time

import _common as C  # first: 8 simulated devices before jax is imported

C.cpu_only()
import numpy as np  # noqa: E402

from jaxscale import planner  # noqa: E402
from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

METHODS = ("ring", "ulysses", "allgather")
LENGTHS = [128 * 2 ** k for k in range(8)]        # 128 .. 16k


def cfg_for(method: str, sp: int, seq: int, steps: int = 3):
    return C.config("mesh.dp=1", f"mesh.fsdp={8 // sp}", f"mesh.sp={sp}", "mesh.tp=1",
                    f"plan.context={method}", "model.n_kv_heads=8", "model.attention=blockwise",
                    f"model.max_seq_len={max(seq, 2048)}", seq=seq, batch=8 // sp, steps=steps)


def predicted_total(cfg) -> float:
    return planner.predict(cfg).as_dict()["memory"]["xla"]["total"]


def longest(method: str, sp: int, budget: float) -> dict:
    fits = [T for T in LENGTHS if predicted_total(cfg_for(method, sp, T)) <= budget]
    guess = fits[-1] if fits else LENGTHS[0]
    seen: dict[int, float] = {}

    def total(T):
        if T not in seen:
            seen[T] = inspect.report(cfg_for(method, sp, T))["memory"]["total"]
        return seen[T]
    i = LENGTHS.index(guess)
    while i > 0 and total(LENGTHS[i]) > budget:
        i -= 1
    while i + 1 < len(LENGTHS) and total(LENGTHS[i]) <= budget and total(LENGTHS[i + 1]) <= budget:
        i += 1
    T = LENGTHS[i] if total(LENGTHS[i]) <= budget else 0
    return {"method": method if sp > 1 else "none (fsdp8)", "sp": sp, "planner_longest": guess,
            "compiled_longest": T,
            "compiled_total_mib": seen.get(T, float("nan")) / C.MiB,
            "predicted_total_mib": predicted_total(cfg_for(method, sp, T or guess)) / C.MiB,
            "compiled": {str(k): v / C.MiB for k, v in sorted(seen.items())}}


def census(method: str) -> dict:
    cfg = cfg_for(method, 4, 256)
    rep = inspect.report(cfg)
    rows = [r for r in rep["theory"] if "sp" in r["axes"] and r["kind"] != "all-reduce"]
    return {"method": method, "rows": rows}


def losses(method: str | None, steps: int) -> list[float]:
    """Losses over `steps` steps at seq 128, batch 2 (one sequence per fsdp rank at sp = 4):
    with context parallelism over sp = 4, or (method None) the same batch without splitting the
    sequence (fsdp2 x tp4: numerically one device)."""
    cfg = cfg_for(method, 4, 128, steps) if method else C.config(
        "mesh.dp=1", "mesh.fsdp=2", "mesh.sp=1", "mesh.tp=4", "model.n_kv_heads=8",
        "model.attention=blockwise", "model.max_seq_len=2048", seq=128, batch=2, steps=steps)
    setup = build(cfg)
    corpus = load_corpus(cfg.data)
    batches = Batches(corpus.train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
    state, out = setup.init_state(), []
    for i in range(steps):
        state, m = setup.train_step(state, batches.device_batch(i, setup.batch_shardings()))
        out.append(float(m["loss"]))
    return out


def plot(rows, curves, out):
    plt = C.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for method in METHODS:
        pts = [(r["sp"], r["compiled_longest"]) for r in rows
               if r["method"] == method or r["sp"] == 1]
        pts.sort()
        a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
    a.set_xscale("log", base=2)
    a.set_yscale("log", base=2)
    a.set_xlabel("sp (mesh fsdp = 8/sp x sp)")
    a.set_ylabel("longest sequence under the budget")
    a.set_title("longest trainable sequence (compiled)")
    a.legend()
    for name, ys in curves.items():
        b.plot(range(1, len(ys) + 1), ys, label=name, linestyle="--" if name != "sp=1" else "-")
    b.set_xlabel("step")
    b.set_ylabel("loss")
    b.set_title("loss, seq 128: sp=4 methods vs sp=1")
    b.legend()
    return C.save(fig, out, "context.png")


def main():
    args = C.parse_args(__doc__, "runs/17_context_parallel", lambda ap: (
        ap.add_argument("--budget-mib", type=float, default=40.0),
        ap.add_argument("--steps", type=int, default=12)))
    t0 = time.time()
    budget = args.budget_mib * C.MiB
    claims = C.Claims()

    rows = [longest("ring", 1, budget)]
    rows += [longest(m, sp, budget) for m in METHODS for sp in (2, 4, 8)]
    print(C.table(["method", "sp", "planner longest", "compiled longest", "compiled MiB",
                   "predicted MiB"],
                  [[r["method"], r["sp"], r["planner_longest"], r["compiled_longest"],
                    f"{r['compiled_total_mib']:.1f}", f"{r['predicted_total_mib']:.1f}"]
                   for r in rows], title=f"longest sequence under {args.budget_mib:g} MiB"))
    base = rows[0]["compiled_longest"]
    for r in rows[1:]:
        claims.check(f"{r['method']} sp={r['sp']} trains a longer sequence than sp=1",
                     r["compiled_longest"], f"> {base}", r["compiled_longest"] > base)
    for r in rows:
        steps = abs(np.log2(r["planner_longest"] / max(r["compiled_longest"], 1)))
        claims.check(f"{r['method']} sp={r['sp']}: planner's longest within one doubling of "
                     f"the compiled", f"{r['planner_longest']} vs {r['compiled_longest']}",
                     "<= 2x", steps <= 1)

    cens = [census(m) for m in METHODS]
    table = []
    for c in cens:
        for r in c["rows"]:
            table.append([c["method"], r["kind"], ",".join(r["axes"]), r["census_bytes"],
                          r["theory_bytes"], f"{r['ratio']:.4f}" if r["ratio"] else "-"])
            claims.close(f"{c['method']} {r['kind']} bytes vs formula", r["census_bytes"] or 0,
                         r["theory_bytes"], 0.02)
    print()
    print(C.table(["method", "kind", "axes", "census bytes", "formula bytes", "ratio"], table,
                  title="census at sp=4, seq 256 (per device, per step)"))

    curves = {"sp=1": losses(None, args.steps)}
    for m in METHODS:
        curves[f"{m} sp=4"] = losses(m, args.steps)
        diff = max(abs(a - b) / b for a, b in zip(curves[f"{m} sp=4"], curves["sp=1"]))
        claims.check(f"{m} sp=4 loss curve = sp=1 (max relative difference)", diff, "< 1e-5",
                     diff < 1e-5)
    print()
    print(C.table(["step"] + list(curves), [[i + 1] + [f"{v[i]:.5f}" for v in curves.values()]
                                             for i in range(args.steps)], title="loss"))
    plot(rows, curves, args.out)
    print(f"\n{time.time() - t0:.0f} s")
    claims.finish(args.out, {"longest": rows, "census": cens, "losses": curves,
                             "budget_mib": args.budget_mib, "seconds": time.time() - t0})


if __name__ == "__main__":
    main()
