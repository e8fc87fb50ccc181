"""python experiments/13_async_sgd.py [--out runs/exp13]

Topic 13: asynchronous training, where stale gradients help and where they break it
(`jaxscale/comm/async_sgd.py`, plain NumPy, a few seconds).

Part 1, a fixed delay. Gradient descent on a quadratic (curvatures 0.1..1) with every gradient
k steps stale. The largest step size that still converges, found by bisection, against the
bound 2 sin(pi / (2 (2k + 1))) / h_max; and loss curves at one step size for growing k: the
same step that is safe synchronously diverges once k is large enough.

Part 2, a parameter server. n workers of equal speed push gradients that are about n - 1
updates stale. On the dense quadratic a constant step diverges as n grows while the
staleness-aware step lr / (1 + staleness) keeps converging; on a recommender-style sparse
embedding problem (a gradient of 16 examples touches at most 32 of its 200 embedding rows) a
constant step tolerates 32 workers: stale updates rarely touch the rows they missed. One run with
one worker 4x faster shows the fast worker's share of the updates. Writes async_sgd.png.
"""
from __future__ import annotations

import _common as C

import numpy as np

from jaxscale.comm import async_sgd as A

DELAYS = (0, 1, 2, 4, 8, 16)
WORKERS = (1, 4, 8, 16, 32)


def main() -> None:
    args = C.parse_args(__doc__, "runs/exp13")
    claims = C.Claims()
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
                             "skewed_updates": skew.per_worker.tolist()})


if __name__ == "__main__":
    main()
