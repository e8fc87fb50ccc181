"""python experiments/13_async_sgd.py [--out runs/exp13]

Topic 13: asynchronous training, where stale gradients help and where they break it: the real
mode on the tiny LLaMA (`jaxscale.ps`, `experiments/_async_real.py`), with the NumPy study of
`jaxscale/comm/async_sgd.py` as its theory panel.

Part 1, the real model (the parameter server over ZeroMQ, 4 workers, 48 batches per run). One
worker made 2x and 4x slower: synchronous rounds (`ps.barrier`: every step waits for it)
against asynchronous pushes with the staleness-aware step, loss against wall-clock time. Four
equal workers: the measured staleness histogram against the simulator's. Eight workers on SGD at
a step size synchronous training takes: the constant step diverges, lr / (1 + staleness) does
not.

Part 2, theory: a fixed delay. Gradient descent on a quadratic (curvatures 0.1..1) with every
gradient k steps stale. The largest step size that still converges, found by bisection, against
the bound 2 sin(pi / (2 (2k + 1))) / h_max; and loss curves at one step size for growing k.

Part 3, theory: a simulated parameter server. n workers of equal speed push gradients that are
about n - 1 updates stale. On the dense quadratic a constant step diverges as n grows while the
staleness-aware step keeps converging; on a recommender-style sparse embedding problem (a
gradient of 16 examples touches at most 32 of its 200 embedding rows) a constant step tolerates
32 workers: stale updates rarely touch the rows they missed. Writes async_sgd.png and
async_real.png.
"""
from __future__ import annotations

import _common as C

import _async_real as R
import numpy as np

from jaxscale.comm import async_sgd as A

DELAYS = (0, 1, 2, 4, 8, 16)
WORKERS = (1, 4, 8, 16, 32)


def main() -> None:
    args = C.parse_args(__doc__, "runs/exp13")
    claims = C.Claims()
    real = real_model(args.out, claims)
    quad = A.Quadratic.make(dim=16, h_max=1.0, h_min=0.1)

    rows, found = [], {}
    for k in DELAYS:
        bound = A.stable_lr(quad.h_max, k)
        found[k] = A.divergence_lr(quad, k, steps=1500)
        rows.append([k, bound, found[k], found[k] / bound])
        claims.close(f"divergence step size at delay {k} = 2 sin(pi/(2(2k+1)))/h", found[k],
                     bound, 0.03)
    print(C.table(["delay k", "bound lr", "found lr", "found / bound"], rows,
                  title="fixed delay: the largest converging step size"))
    lr = 0.5
    curves = {k: A.delayed_sgd(quad, lr, k, 400) for k in DELAYS}
    first_bad = min(k for k in DELAYS if np.isinf(curves[k][-1]))
    claims.check(f"lr={lr} converges at delay 0 and diverges from the first k with bound < lr",
                 first_bad, min(k for k in DELAYS if A.stable_lr(quad.h_max, k) < lr),
                 first_bad == min(k for k in DELAYS if A.stable_lr(quad.h_max, k) < lr))

    emb = A.SparseEmbedding()
    ps_rows, ps = [], {}
    for n in WORKERS:
        const = A.parameter_server(quad, n, 1.0, 2000)
        aware = A.parameter_server(quad, n, 1.0, 2000, lr_rule="staleness")
        sparse = A.parameter_server(emb, n, 2.0, 2000)
        ps[n] = (const, aware, sparse)
        ps_rows.append([n, float(aware.staleness[200:].mean()), const.loss[-1], aware.loss[-1],
                        sparse.loss[-1]])
    print()
    print(C.table(["workers", "mean staleness", "dense, lr 1", "dense, lr/(1+s)",
                   "sparse embedding, lr 2"], ps_rows,
                  title="parameter server, 2000 updates: final loss (inf = diverged)"))
    claims.close("mean staleness with 16 equal workers = n - 1", ps_rows[3][1], 15, 0.05)
    claims.check("dense problem, constant step: diverges at 16 workers", ps[16][0].loss[-1],
                 "inf", np.isinf(ps[16][0].loss[-1]))
    claims.check("dense problem, staleness-aware step: converges at 32 workers",
                 ps[32][1].loss[-1], "< 1e-3 x start", ps[32][1].loss[-1] < 1e-3 *
                 quad.loss(quad.init()))
    claims.check("sparse embedding, constant step: converges at 32 workers", ps[32][2].loss[-1],
                 "< 0.15 x start", ps[32][2].loss[-1] < 0.15 * emb.loss(emb.init()))
    skew = A.parameter_server(quad, 4, 0.1, 2000, speeds=[4, 1, 1, 1])
    share = skew.per_worker[0] / skew.per_worker.sum()
    claims.close("a 4x faster worker's share of the updates = 4/7", share, 4 / 7, 0.05)
    print(f"\nworker speeds 4:1:1:1 -> updates {skew.per_worker.tolist()} "
          f"(fast worker {share:.1%}); its gradients' staleness {skew.staleness[200:].mean():.2f}")

    plt = C.pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for k, c in curves.items():
        ax[0].semilogy(np.where(np.isfinite(c), c, np.nan), label=f"delay {k}")
    ax[0].set(title=f"fixed delay, lr={lr}", xlabel="step", ylabel="loss")
    ax[0].legend(fontsize=8)
    ax[1].plot(DELAYS, [found[k] for k in DELAYS], "o", label="found (bisection)")
    ks = np.linspace(0, max(DELAYS), 100)
    ax[1].plot(ks, 2 * np.sin(np.pi / (2 * (2 * ks + 1))) / quad.h_max, label="bound")
    ax[1].set(title="divergence threshold vs staleness", xlabel="delay k", ylabel="step size",
              yscale="log")
    ax[1].legend()
    for n in (4, 16, 32):
        const, aware, sparse = ps[n]
        ax[2].semilogy(np.where(np.isfinite(aware.loss), aware.loss, np.nan),
                       label=f"dense, lr/(1+s), n={n}")
        ax[2].semilogy(sparse.loss / sparse.loss[0], "--", label=f"sparse / start, n={n}")
    ax[2].set(title="parameter server", xlabel="server update", ylabel="loss")
    ax[2].legend(fontsize=7)
    C.save(fig, args.out, "async_sgd.png")
    claims.finish(args.out, {"delays": rows, "parameter_server": ps_rows,
                             "skewed_updates": skew.per_worker.tolist(), "real": real})


def real_model(out: str, claims) -> dict:
    """Part 1: the tiny LLaMA through the parameter server (`_async_real`)."""
    from pathlib import Path
    root = Path(out) / "real"
    print("part 1: the tiny LLaMA through the parameter server", flush=True)
    slow = R.slow_worker(root, C.config)
    equal = R.equal_workers(root, C.config)
    div = R.divergence(root, C.config)
    rows = []
    for name, r in slow.items():
        rows.append([name, f"{r['train_s']:.1f}", f"{r['curve'][-1][1]:.3f}",
                     " ".join(map(str, r["by_worker"])), f"{r['mean_staleness']:.2f}"])
    print(C.table(["run (48 batches)", "wall s after update 1", "final loss",
                   "pushes by worker",
                   "mean staleness"], rows, title="a slow worker: synchronous vs asynchronous"))
    for f in (2, 4):
        sync = slow[f"synchronous, worker {R.WORKERS - 1} {f}x slower"]
        asyn = slow[f"asynchronous, worker {R.WORKERS - 1} {f}x slower"]
        claims.check(f"worker 3 {f}x slower: the asynchronous run takes less wall time for "
                     f"the same 48 batches", f"{asyn['train_s']:.1f} s",
                     f"< {sync['train_s']:.1f} s", asyn["train_s"] < sync["train_s"])
        claims.check(f"worker 3 {f}x slower: it pushes fewest asynchronously",
                     " ".join(map(str, asyn["by_worker"])), "worker 3 lowest",
                     asyn["by_worker"][-1] < min(asyn["by_worker"][:-1]))
    sim = A.parameter_server(A.Quadratic.make(dim=16, h_max=1.0, h_min=0.1), R.WORKERS, 0.1,
                             400)
    measured, predicted = equal["mean_staleness"], float(sim.staleness[50:].mean())
    claims.close(f"{R.WORKERS} equal workers: measured mean staleness = the simulator's "
                 f"(n - 1)", measured, predicted, 0.35)
    claims.check("SGD lr 1, 8 workers: the constant step diverges (loss above 100x the start)",
                 f"{div['constant']['max_loss']:.3g}", "> 100 x start",
                 div["constant"]["max_loss"] > 100 * div["constant"]["curve"][0][1])
    claims.check("SGD lr 1, 8 workers: the staleness-aware step does not (below 3x the start)",
                 f"{div['staleness']['max_loss']:.3g}", "< 3 x start",
                 div["staleness"]["max_loss"] < 3 * div["staleness"]["curve"][0][1])
    plt = C.pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in slow.items():
        t, loss = zip(*r["curve"])
        ax[0].plot(t, loss, "-" if "asyn" in name else "--", label=name)
    ax[0].set(title="4 workers, one slowed: loss vs wall clock", xlabel="seconds",
              ylabel="train loss")
    ax[0].legend(fontsize=7)
    ks = range(0, max(equal["staleness"]) + 2)
    ax[1].bar([k - 0.2 for k in ks], [equal["staleness"].count(k) / len(equal["staleness"])
                                      for k in ks], 0.4, label="measured (tiny LLaMA)")
    tail = [int(x) for x in sim.staleness[50:]]
    ax[1].bar([k + 0.2 for k in ks], [tail.count(k) / len(tail) for k in ks], 0.4,
              label="simulated parameter server")
    ax[1].set(title=f"{R.WORKERS} equal workers: staleness", xlabel="updates between pull and "
              "push", ylabel="share of pushes")
    ax[1].legend()
    for rule, r in div.items():
        ax[2].semilogy([loss for _, loss in r["curve"]], label=f"{rule} step")
    ax[2].set(title="8 workers, SGD lr 1", xlabel="server update", ylabel="train loss")
    ax[2].legend()
    C.save(fig, out, "async_real.png")
    return {"slow": {k: {x: v[x] for x in ("train_s", "by_worker", "mean_staleness")}
                     for k, v in slow.items()},
            "equal_staleness": equal["staleness_histogram"], "simulated_mean": predicted,
            "divergence": {k: v["max_loss"] for k, v in div.items()}}


if __name__ == "__main__":
    main()
