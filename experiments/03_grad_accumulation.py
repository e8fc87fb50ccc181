"""python experiments/03_grad_accumulation.py [--out runs/exp03]

Topic 03: gradient accumulation (`plan.accumulate=k`), tiny model (2 layers), dp=8, seq 64.

Numerics: one global batch of 64 rows, some of them padded (their mask zeroed from a position
on), gives its gradients as one batch (k=1) and as k = 2, 4, 8 micro-batches summed in a
`lax.scan`. The step normalises by the batch's real tokens, not by micro-batches, so the results
agree to fp32 rounding: max over parameter tensors of |g_k - g_1| / |g_1| is printed.

Memory: the compiled step's temp bytes per device at k = 1, 2, 4, 8. The activation part is the
part that grows with the batch: temp(batch 128) - temp(batch 64), i.e. the activations of 64 more
rows (8/k rows per device per micro-batch). It should fall k-fold; what stays is the fixed part
(gradients, the fp32 accumulator, optimizer temporaries). Writes accumulation.png.

Communication: gradient bytes per step over the replicated axis (`dp`) against k on an HSDP plan
(dp2 x fsdp2 x tp2), reduced once per step (`plan.grad_sync=auto`: fsdp reduce-scatters each
micro-batch into the sharded accumulator, dp all-reduces the shard once) and per micro-batch
(`plan.grad_sync=microbatch`), census beside inspect's theory. Writes accumulation_sync.png.
"""
from __future__ import annotations

import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxscale.analysis import inspect  # noqa: E402
from jaxscale.data import Batches, load_corpus  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

KS, SEQ, BATCH = (1, 2, 4, 8), 64, 64
HSDP = ("mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2")


def temp_bytes(k: int, batch: int) -> int:
    cfg = C.config(*C.DP8, f"plan.accumulate={k}", seq=SEQ, batch=batch)
    return inspect.memory(build(cfg).lower_train_step().compile())["temp"]


def grads(k: int, rows: dict):
    setup = build(C.config(*C.DP8, f"plan.accumulate={k}", seq=SEQ, batch=BATCH))
    params = setup.init_state().params
    batch = {n: jax.device_put(v, setup.batch_shardings()[n]) for n, v in rows.items()}
    g, loss, ntok = jax.device_get(setup.jit_grads()(params, batch))
    return jax.tree.leaves(g), float(loss), float(ntok)


def main():
    args = C.parse_args(__doc__, "runs/exp03")
    t0 = time.time()
    claims = C.Claims()
    cfg = C.config(*C.DP8, seq=SEQ, batch=BATCH)
    rows = Batches(load_corpus(cfg.data).train, BATCH, SEQ, seed=0).global_rows(0)
    rng = np.random.default_rng(0)
    for r in rng.choice(BATCH, 12, replace=False):       # padded rows, different lengths
        rows["mask"][r, rng.integers(1, SEQ):] = 0
    g = {k: grads(k, rows) for k in KS}
    num = []
    for k in KS:
        err = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                  for a, b in zip(g[k][0], g[1][0]))
        num.append([k, BATCH // k, f"{g[k][1]:.6f}", f"{g[k][2]:.0f}", f"{err:.2e}"])
        if k > 1:
            claims.check(f"k={k}: max relative gradient error vs one batch", err, "< 1e-5",
                         err < 1e-5)
            rel = abs(g[k][1] - g[1][1]) / g[1][1]
            claims.check(f"k={k}: loss equals one batch's (relative difference)", rel, "< 1e-6",
                         rel < 1e-6)
    print(C.table(["k", "rows per micro-batch", "loss", "real tokens",
                   "max_tensor |g_k - g_1| / |g_1|"], num,
                  title=f"gradients of one {BATCH}-row batch ({int(rows['mask'].size)} slots, "
                        "12 rows padded) vs k micro-batches"))

    temps = {k: (temp_bytes(k, BATCH), temp_bytes(k, 2 * BATCH)) for k in KS}
    act = {k: t[1] - t[0] for k, t in temps.items()}
    mem = []
    for k in KS:
        fixed = temps[k][0] - act[k]
        mem.append([k, f"{temps[k][0] / C.MiB:.2f}", f"{act[k] / C.MiB:.2f}",
                    f"{fixed / C.MiB:.2f}", f"{act[1] / act[k]:.2f}", k])
        if k > 1:
            claims.close(f"k={k}: activation part falls k-fold (act_1 / act_k)",
                         act[1] / act[k], float(k), 0.15)
    print()
    print(C.table(["k", f"temp MiB (batch {BATCH})", "activation part MiB", "fixed part MiB",
                   "act_1 / act_k", "expected"], mem,
                  title="compiled temp per device; activation part = temp(batch 128) - "
                        "temp(batch 64)"))
    claims.check("temp falls as k grows (MiB)", " > ".join(f"{temps[k][0] / C.MiB:.1f}"
                                                           for k in KS), "decreasing",
                 all(temps[a][0] > temps[b][0] for a, b in zip(KS, KS[1:])))

    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    fixed = [(temps[k][0] - act[k]) / C.MiB for k in KS]
    acts = [act[k] / C.MiB for k in KS]
    x = np.arange(len(KS))
    ax.bar(x, fixed, label="fixed part (grads, accumulator, optimizer temps)", color="C7")
    ax.bar(x, acts, bottom=fixed, label="activation part (measured)", color="C3")
    ax.plot(x, [f + acts[0] / k for f, k in zip(fixed, KS)], "k_", markersize=30, mew=2,
            label="fixed + act(k=1) / k")
    ax.set_xticks(x, [f"k={k}\n{BATCH // k} rows" for k in KS])
    ax.set_ylabel("compiled temp MiB per device")
    ax.set_title(f"gradient accumulation, batch {BATCH} x {SEQ}, dp=8")
    ax.legend(fontsize=8)
    C.save(fig, args.out, "accumulation.png")
    sync = C.sync_bytes(HSDP, KS, seq=32, batch=64)
    print()
    print(C.table(["k", "grad_sync", "census MiB over dp", "theory MiB"],
                  [[r["k"], r["mode"], f"{r['census'] / C.MiB:.4f}", f"{r['theory'] / C.MiB:.4f}"]
                   for r in sync],
                  title="gradient bytes per step over dp, dp2 x fsdp2 x tp2 (HSDP)"))
    C.sync_claims(claims, sync, "dp2xfsdp2xtp2")
    fig, ax = plt.subplots(figsize=(6, 4))
    C.plot_sync_bytes(ax, sync, "dp2 x fsdp2 x tp2: bytes over dp per step against k")
    C.save(fig, args.out, "accumulation_sync.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"temps": {str(k): v for k, v in temps.items()},
                             "numerics": num, "sync_bytes": sync})


if __name__ == "__main__":
    main()
