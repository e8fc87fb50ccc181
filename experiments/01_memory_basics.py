"""python experiments/01_memory_basics.py [--out runs/exp01]

Topic 01: where training memory goes, and which ops are bound by bandwidth rather than FLOPs.

Part 1 compiles the train step of the tiny and `small` models on 8 simulated devices (dp=8) under
a few plans and splits the per-device bytes of the compiled program into parameters, gradients,
optimizer state (+ fp32 master) and activations+temp:
- parameters / master / optimizer: the compiled step's argument bytes (minus the batch), split by
  the train state's leaves (`state_bytes`), and checked against the analytic Psi x bytes / N;
- gradients: the output of a compiled program taking gradients w.r.t. the working parameters;
- activations+temp: the step's temp bytes less the gradient buffers that live in it.
Mixed-precision Adam (bf16 params and grads, fp32 master, m, v) should come to 2+2+4+4+4 = 16
bytes/param, and fp32 Adam to 4+4+4+4 = 16 as well.

Part 2 is a roofline table: FLOP/byte of each op class (matmul, naive attention, RMSNorm,
SwiGLU) from XLA's `cost_analysis()` of the op compiled alone at the tiny run's shapes and at
Llama-3-8B's (one 4096-token sequence), against the machine balance (peak FLOP/s / memory
bandwidth) of an H100 and of this CPU (`jaxscale/hardware.py`). FLOPs and bytes are read from an
fp32 compile (XLA:CPU's bf16 cost counts its own f32 conversions); 16-bit operands halve the
bytes, so their FLOP/byte is twice the fp32 figure. FlashAttention's row is analytic (it reads
q, k, v and writes o once). Writes memory_breakdown.png (breakdown and roofline side by side).
"""
from __future__ import annotations

import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxscale import (
    hardware,  # noqa: E402
    models,  # noqa: E402
)
from jaxscale.analysis import inspect
from jaxscale.kernels.reference import reference_attention  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402
from jaxscale.train.state import state_bytes  # noqa: E402

RUNS = [("tiny", 2, ("plan.precision=fp32",)), ("tiny", 2, ("plan.precision=bf16",)),
        ("tiny", 2, ("plan.precision=bf16", "plan.zero=3")),
        ("small", 8, ("plan.precision=bf16",)),
        ("small", 8, ("plan.precision=bf16", "plan.zero=3"))]
SEQ, BATCH = 128, 16


def breakdown(model: str, n_layers: int, plan: tuple) -> dict:
    cfg = C.config(*C.DP8, *plan, model=model, n_layers=n_layers, seq=SEQ, batch=BATCH)
    setup = build(cfg)
    mem = inspect.memory(setup.lower_train_step().compile())
    parts = {k: sum(v.values()) for k, v in state_bytes(setup.abstract_state()).items()}
    grads = C.grad_bytes(setup)
    psi, prec, zero = cfg.model.param_count(), cfg.plan.precision, cfg.plan.zero
    p_bytes = 4 if prec == "fp32" else 2
    n = 8 if zero == 3 else 1                       # ZeRO-3 shards everything over dp=8
    expected_state = psi * (p_bytes + (4 if prec != "fp32" else 0) + 8) / n
    return {"model": model, "plan": " ".join(p.split("=")[1] if "precision" in p else
                                              p.replace("plan.", "") for p in plan),
            "psi": psi, "params": parts["params"], "grads": grads,
            "optimizer": parts["opt_state"] + parts.get("master", 0),
            "state_compiled": mem["argument"] - C.batch_bytes(cfg),
            "state_expected": expected_state, "act_temp": mem["temp"] - grads,
            "temp": mem["temp"], "n": n, "zero": zero, "prec": prec}


# ----------------------------------------------------------------------------- roofline
def cost(f, *shapes) -> tuple[float, float]:
    ca = jax.jit(f).lower(*shapes).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca["flops"]), float(ca["bytes accessed"])


def rms(x, s):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * s).astype(x.dtype)


def roofline_rows() -> list[dict]:
    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    tiny = models.get("tiny")
    shapes = {"tiny (b16 s128)": (BATCH, SEQ, tiny), "llama3-8b (b1 s4096)":
              (1, 4096, models.get("llama3-8b"))}
    rows = []
    for label, (b, s, m) in shapes.items():
        t, d, f, h, kv, hd = b * s, m.dim, m.ffn_dim, m.n_heads, m.n_kv_heads, m.hd
        ops = {"matmul (x @ w_up)": (lambda x, w: x @ w, S((t, d), f32), S((d, f), f32)),
               "attention, naive": (lambda q, k, v: reference_attention(q, k, v, causal=True),
                                    S((b, s, h, hd), f32), S((b, s, kv, hd), f32),
                                    S((b, s, kv, hd), f32)),
               "RMSNorm": (rms, S((t, d), f32), S((d,), f32)),
               "SwiGLU silu(g)*u": (lambda g, u: jax.nn.silu(g) * u, S((t, f), f32),
                                    S((t, f), f32))}
        for op, (fn, *args) in ops.items():
            fl, by = cost(fn, *args)
            rows.append({"shape": label, "op": op, "flops": fl, "bytes": by, "fp32": fl / by,
                         "bf16": 2 * fl / by, "source": "cost_analysis"})
        fl = 4 * b * s * s * h * hd / 2                         # causal QK^T and PV
        by = 2 * b * s * hd * (2 * h + 2 * kv)                  # read q, k, v; write o (16-bit)
        rows.append({"shape": label, "op": "attention, flash", "flops": fl, "bytes": 2 * by,
                     "fp32": fl / (2 * by), "bf16": fl / by, "source": "analytic"})
    return rows


def plot(res, roof, h100, cpu, out):
    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['model']}\n{r['plan']}" for r in res]
    bottom = [0.0] * len(res)
    for key, colour in (("params", "C0"), ("grads", "C1"), ("optimizer", "C2"),
                        ("act_temp", "C3")):
        vals = [r[key] / C.MiB for r in res]
        a1.bar(labels, vals, bottom=bottom, label=key.replace("act_temp", "activations+temp"),
               color=colour)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a1.set_ylabel("MiB per device (compiled)")
    a1.set_title(f"training memory per device, dp=8, batch {BATCH}x{SEQ}")
    a1.legend(fontsize=8)
    a1.tick_params(axis="x", labelsize=7)
    xs = [2.0 ** e for e in range(-3, 13)]
    for hw, style, dt in ((h100, "-", "bf16"), (cpu, "--", "fp32")):
        peak = hw.peak_bf16 if dt == "bf16" else hw.peak_fp32
        a2.plot(xs, [min(peak, x * hw.hbm_bw) for x in xs], style, color="k",
                label=f"{hw.name} roof ({dt}), balance {peak / hw.hbm_bw:.0f} FLOP/B")
        for i, r in enumerate(x for x in roof if "8b" in x["shape"]):
            x = r[dt]
            a2.plot([x], [min(peak, x * hw.hbm_bw)], "o", color=f"C{i}",
                    label=r["op"] if hw is h100 else None)
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("arithmetic intensity, FLOP/byte")
    a2.set_ylabel("attainable FLOP/s")
    a2.set_title("roofline, llama3-8b shapes")
    a2.legend(fontsize=7)
    a2.grid(alpha=0.3, which="both")
    C.save(fig, out, "memory_breakdown.png")


def main():
    args = C.parse_args(__doc__, "runs/exp01")
    t0 = time.time()
    claims = C.Claims()
    res = [breakdown(*r) for r in RUNS]
    print(C.table(["model", "plan", "params", "grads", "optimizer+master", "act+temp",
                   "bytes/param (state+grads)", "state compiled vs Psi x bytes/N"],
                  [[r["model"], r["plan"], f"{r['params'] / C.MiB:.2f} MiB",
                    f"{r['grads'] / C.MiB:.2f} MiB", f"{r['optimizer'] / C.MiB:.2f} MiB",
                    f"{r['act_temp'] / C.MiB:.2f} MiB",
                    f"{(r['state_compiled'] + r['grads']) / r['psi']:.3f}",
                    f"{r['state_compiled'] / r['state_expected']:.4f}"] for r in res],
                  title="per-device training memory (compiled train step, dp=8, "
                        f"batch {BATCH} x seq {SEQ})"))
    for r in res:
        per = (r["state_compiled"] + r["grads"]) / r["psi"]
        claims.close(f"{r['model']} {r['plan']}: compiled state vs analytic",
                     r["state_compiled"], r["state_expected"], 0.05)
        if r["zero"] == 0:
            what = "mixed-precision" if r["prec"] != "fp32" else "fp32"
            claims.close(f"{r['model']} {what} Adam bytes/param", per, 16.0, 0.03)
        else:
            claims.close(f"{r['model']} {r['plan']} bytes/param (16/N)", per, 16 / r["n"], 0.03)

    h100, cpu = hardware.get("h100"), hardware.get("cpu")
    bal_h, bal_c = h100.peak_bf16 / h100.hbm_bw, cpu.peak_fp32 / cpu.hbm_bw
    roof = roofline_rows()
    bound = lambda x, bal: "compute" if x > bal else "memory"
    print()
    print(C.table(["shape", "op", "GFLOP", "MB moved", "FLOP/B fp32", "FLOP/B 16-bit",
                   f"H100 (bal {bal_h:.0f}) 16-bit", f"CPU (bal {bal_c:.0f}) fp32", "from"],
                  [[r["shape"], r["op"], f"{r['flops'] / 1e9:.3f}", f"{r['bytes'] / 1e6:.1f}",
                    f"{r['fp32']:.1f}", f"{r['bf16']:.1f}", bound(r["bf16"], bal_h),
                    bound(r["fp32"], bal_c), r["source"]] for r in roof],
                  title="roofline: arithmetic intensity vs machine balance (peak / HBM bandwidth)"))
    big = lambda op: next(r for r in roof if "8b" in r["shape"] and r["op"].startswith(op))
    claims.check("8B matmul is compute-bound on H100 (FLOP/B > balance)",
                 big("matmul")["bf16"], f"> {bal_h:.0f}", big("matmul")["bf16"] > bal_h)
    for op in ("RMSNorm", "SwiGLU"):
        r = big(op)
        claims.check(f"8B {op} memory-bound on H100 (16-bit) and CPU (fp32)",
                     f"{r['bf16']:.2f} / {r['fp32']:.2f}", f"< {bal_h:.0f} / < {bal_c:.0f}",
                     r["bf16"] < bal_h and r["fp32"] < bal_c)
    claims.check("8B naive attention memory-bound on H100, flash compute-bound",
                 f"{big('attention, naive')['bf16']:.0f} / {big('attention, flash')['bf16']:.0f}",
                 f"< {bal_h:.0f} < ", big("attention, naive")["bf16"] < bal_h
                 < big("attention, flash")["bf16"])
    plot(res, roof, h100, cpu, args.out)
    print(f"\n{time.time() - t0:.0f} s")
    claims.finish(args.out, {"breakdown": res, "roofline": roof,
                             "balance": {"h100_bf16": bal_h, "cpu_fp32": bal_c}})


if __name__ == "__main__":
    main()
