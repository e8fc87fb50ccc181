"""python experiments/16_tensor_parallel.py [--out runs/exp16]

Topic 16: Megatron tensor parallelism (`mesh.tp`, `jaxscale/strategies/tp.py`) on 8 simulated
CPU devices, the tiny LLaMA (2 layers, 8 heads, 8 kv heads so tp=8 divides them, fp32), batch
8 x 32, tp = 1, 2, 4, 8 with the other devices on dp; with and without Megatron sequence
parallelism (`plan.sequence_parallel`).

For each plan the train step is compiled (not run) and read:
- the collective census over `tp` beside the strategy's formula: per layer and micro-batch 2
  all-reduces of the [b, s, h] block activations forward (after the row-parallel attention-output
  and MLP-down matmuls) and 5 backward (q, k, v, gate and up input gradients reduced separately:
  the model keeps them as separate weights; Megatron's fused QKV and gate-up weights need 2, the
  `minimum` column); with sequence parallelism every all-reduce becomes a reduce-scatter and an
  all-gather of the same bytes (XLA:CPU emits the reduce-scatter as all-reduce + slice);
- the per-device model state (parameters and Adam moments: the compiled step's argument bytes
  less the batch), which falls as 1/tp for the split weights (norm scales stay whole);
and one train step is run from the same initial weights on the same batch: its loss equals the
tp=1 plan's. Writes tp.png.
"""
from __future__ import annotations

import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

from jaxscale.analysis import inspect  # noqa: E402

TPS = (1, 2, 4, 8)
MODEL = ("model.n_kv_heads=8",)


def plans():
    for t in TPS:
        for sp in ((False, True) if t > 1 else (False,)):
            yield t, sp, C.config(f"mesh.dp={8 // t}", "mesh.fsdp=1", f"mesh.tp={t}",
                                  f"plan.sequence_parallel={str(sp).lower()}", *MODEL)


def main():
    args = C.parse_args(__doc__, "runs/exp16")
    t0 = time.time()
    claims = C.Claims()
    res = []
    for t, sp, cfg in plans():
        rep = inspect.report(cfg)
        tp_rows = [r for r in rep["theory"] if r["axes"] == ["tp"]]
        res.append({"tp": t, "sp": sp, "state": rep["memory"]["argument"] - C.batch_bytes(cfg),
                    "theory": sum(r["theory_bytes"] for r in tp_rows),
                    "census": sum(r["census_bytes"] for r in tp_rows),
                    "minimum": sum(r["minimum_bytes"] for r in tp_rows),
                    "kinds": {c["kind"]: c["count"] for c in rep["collectives"]
                              if c["axes"] == ["tp"]},
                    "loss": C.first_loss(cfg)})
    base = res[0]
    rows = []
    for r in res:
        label = f"tp={r['tp']}" + (" +SP" if r["sp"] else "")
        rows.append([label, f"{r['state'] / C.MiB:.3f}", f"{base['state'] / r['state']:.2f}",
                     f"{r['census'] / C.MiB:.3f}", f"{r['theory'] / C.MiB:.3f}",
                     f"{r['minimum'] / C.MiB:.3f}",
                     ", ".join(f"{k} x{v}" for k, v in sorted(r["kinds"].items())) or "-",
                     f"{r['loss']:.6f}"])
        if r["tp"] > 1:
            claims.close(f"{label}: census bytes over tp vs the formula", r["census"],
                         r["theory"], 0.01)
            claims.close(f"{label}: model state per device vs tp=1 / tp (norms whole)",
                         r["state"], base["state"] / r["tp"], 0.05)
            claims.check(f"{label}: first-step loss equals tp=1's",
                         abs(r["loss"] - base["loss"]), "< 1e-5",
                         abs(r["loss"] - base["loss"]) < 1e-5)
    print(C.table(["plan", "state MiB", "saved x", "tp census MiB", "formula MiB", "minimum MiB",
                   "tp collectives (count)", "first loss"], rows,
                  title="tensor parallelism on 8 devices (dp = 8 / tp), tiny LLaMA, per device "
                        "per step"))

    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for sp, mark in ((False, "o-"), (True, "s--")):
        rs = [r for r in res if r["sp"] == sp and r["tp"] > 1]
        a1.plot([r["tp"] for r in rs], [r["census"] / C.MiB for r in rs], mark,
                label=("sequence parallel " if sp else "") + "census")
        a1.plot([r["tp"] for r in rs], [r["theory"] / C.MiB for r in rs], "kx", ms=8,
                label="formula" if not sp else None)
    a1.set_xscale("log", base=2)
    a1.set_xlabel("tp")
    a1.set_ylabel("MiB over tp per device per step")
    a1.set_title("activation collectives")
    a1.legend(fontsize=8)
    rs = [r for r in res if not r["sp"]]
    a2.plot([r["tp"] for r in rs], [r["state"] / C.MiB for r in rs], "o-", label="compiled")
    a2.plot([r["tp"] for r in rs], [base["state"] / r["tp"] / C.MiB for r in rs], "k:",
            label="tp=1 / tp")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("tp")
    a2.set_ylabel("model state MiB per device")
    a2.set_title("weights and Adam moments split tp ways")
    a2.legend(fontsize=8)
    C.save(fig, args.out, "tp.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {"plans": res})


if __name__ == "__main__":
    main()
