"""Experiment 24: attention memory, quadratic (xla) vs linear (blockwise / Pallas FlashAttention).

Run (CPU, two to three minutes; parts 1-2 compile only, nothing of size 16k is executed):

    python experiments/24_flash_attention.py --out runs/exp24

Part 1 compiles forward+backward (grad of sum(attention(q, k, v)) w.r.t. q, k, v) of attention
alone, B=1, H=4, D=64, causal, fp32, at sequence lengths 512..16k, and reads the compiled
`memory_analysis()`: temp bytes (the activations XLA allocates: scores, probabilities, tiles) and
the total (temp + arguments + outputs). `xla` materialises [H, T, T] scores and keeps the
probabilities for the backward (quadratic); `blockwise` keeps one tile plus O(T·D) rows (linear).
`pallas` is compiled in interpret mode here, whose buffers are not the GPU kernel's, so its
column is indicative only. The ratios at 2k and 4k are printed next to FlashAttention's published
~10x and ~20x (its figure counts whole attention memory, so compare the 'total' ratio).

Part 2 compiles a tiny-LLaMA training step (forward + backward of the loss) at a long sequence and
checks the compiled per-device total against a stated memory budget: `xla` does not fit, `blockwise`
does. Part 3 (skip with --no-speed) times forward+backward on this CPU, xla vs blockwise, H=8,
D=64, causal and not: the ratios behind `attention(implementation="auto")`'s CPU rule (absolute CPU
times mean little; the ratio within one run is the figure). Writes results.json, memory.png and a
markdown table to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxscale.kernels.blockwise import blockwise_attention  # noqa: E402
from jaxscale.kernels.flash_attention import flash_attention  # noqa: E402
from jaxscale.kernels.reference import reference_attention  # noqa: E402

MiB = 2 ** 20
PUBLISHED = {2048: 10.0, 4096: 20.0}   # FlashAttention (arXiv 2205.14135): memory saving vs naive


def attention_memory(impl: str, T: int, B=1, H=4, D=64, causal=True) -> dict:
    fns = {"xla": functools.partial(reference_attention, causal=causal),
           "blockwise": functools.partial(blockwise_attention, causal=causal),
           "pallas": functools.partial(flash_attention, causal=causal, interpret=True)}
    f = fns[impl]
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    t0 = time.time()
    compiled = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))).lower(
        x, x, x).compile()
    m = compiled.memory_analysis()
    return {"impl": impl, "T": T, "temp": m.temp_size_in_bytes,
            "total": m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes, "compile_s": round(time.time() - t0, 2)}


def llama_step_memory(impl: str, T: int, B: int = 1) -> dict:
    import flax.nnx as nnx

    from jaxscale.models import Llama, get
    cfg = dataclasses.replace(get("tiny"), attention=impl, max_seq_len=T)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    tokens = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    t0 = time.time()
    compiled = jax.jit(jax.value_and_grad(loss_fn)).lower(params, tokens).compile()
    m = compiled.memory_analysis()
    total = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes)
    return {"impl": impl, "T": T, "temp": m.temp_size_in_bytes, "total": total,
            "compile_s": round(time.time() - t0, 2)}


def cpu_speed(impl: str, T: int, causal: bool, H=8, D=64, reps=3) -> float:
    """Fastest of `reps` forward+backward runs, seconds."""
    from jaxscale.hooks.attention import attention
    q = jax.random.normal(jax.random.PRNGKey(0), (1, T, H, D), jnp.float32)
    f = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v, causal=causal,
                                                   implementation=impl).sum(), argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, q, q))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, q, q))
        times.append(time.perf_counter() - t0)
    return min(times)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for impl, style in (("xla", "o-"), ("blockwise", "s-"), ("pallas", "^--")):
        pts = [(r["T"], r["temp"] / MiB) for r in rows if r["impl"] == impl]
        if pts:
            ax.plot(*zip(*pts), style, label=impl + (" (interpret)" if impl == "pallas" else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("compiled temp MiB (fwd+bwd)")
    ax.set_title("attention fwd+bwd, B=1 H=4 D=64 fp32, causal")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/exp24")
    ap.add_argument("--max-seq", type=int, default=16384)
    ap.add_argument("--pallas-max-seq", type=int, default=8192)
    ap.add_argument("--llama-seq", type=int, default=16384)
    ap.add_argument("--no-speed", action="store_true", help="skip the CPU timing table")
    ap.add_argument("--budget-gib", type=float, default=8.0,
                    help="per-device memory budget for the long-sequence demonstration")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    lengths = [T for T in (512, 1024, 2048, 4096, 8192, 16384) if T <= args.max_seq]
    rows = []
    for T in lengths:
        for impl in ("xla", "blockwise", "pallas"):
            if impl == "pallas" and T > args.pallas_max_seq:
                continue
            rows.append(attention_memory(impl, T))
    get = {(r["impl"], r["T"]): r for r in rows}

    lines = ["| seq | xla temp MiB | blockwise temp MiB | pallas(interp) temp MiB | "
             "temp ratio xla/bw | total ratio xla/bw | FlashAttention paper |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for T in lengths:
        x, b, p = get[("xla", T)], get[("blockwise", T)], get.get(("pallas", T))
        lines.append(f"| {T} | {x['temp'] / MiB:.1f} | {b['temp'] / MiB:.1f} | "
                     f"{'-' if p is None else format(p['temp'] / MiB, '.1f')} | "
                     f"{x['temp'] / b['temp']:.1f}x | {x['total'] / b['total']:.1f}x | "
                     f"{'~%.0fx' % PUBLISHED[T] if T in PUBLISHED else ''} |")
    growth = [get[("blockwise", b)]["temp"] / get[("blockwise", a)]["temp"]
              for a, b in zip(lengths, lengths[1:])]
    lines.append("")
    lines.append("blockwise temp growth per doubling: " + ", ".join(f"{g:.2f}x" for g in growth)
                 + "  (linear <= 2x; xla: " + ", ".join(
                     f"{get[('xla', b)]['temp'] / get[('xla', a)]['temp']:.2f}x"
                     for a, b in zip(lengths, lengths[1:])) + ")")

    budget = args.budget_gib * 2 ** 30
    llama = [llama_step_memory(impl, args.llama_seq) for impl in ("xla", "blockwise")]
    lines += ["", "Long sequence: tiny LLaMA training step (loss + grads), B=1, "
              f"T={args.llama_seq}, budget {args.budget_gib:g} GiB per device", "",
              "| attention | compiled total GiB | temp GiB | verdict |", "|---|---:|---:|---|"]
    for r in llama:
        r["fits"] = r["total"] <= budget
        lines.append(f"| {r['impl']} | {r['total'] / 2 ** 30:.2f} | {r['temp'] / 2 ** 30:.2f} | "
                     f"{'fits' if r['fits'] else 'DOES NOT FIT'} |")
    speed = []
    if not args.no_speed:
        lines += ["", "CPU forward+backward time, blockwise / xla (H=8, D=64, B=1; one run, "
                  "ratios only)", "", "| seq | causal | xla ms | blockwise ms | blockwise/xla |",
                  "|---:|---|---:|---:|---:|"]
        for T in (256, 512, 1024, 2048):
            for causal in (True, False):
                x, b = cpu_speed("xla", T, causal), cpu_speed("blockwise", T, causal)
                speed.append({"T": T, "causal": causal, "xla_s": x, "blockwise_s": b})
                lines.append(f"| {T} | {causal} | {x * 1e3:.1f} | {b * 1e3:.1f} | {b / x:.2f} |")
    table = "\n".join(lines)
    print(table)

    plot(rows, os.path.join(args.out, "memory.png"))
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"attention": rows, "llama": llama, "budget_bytes": budget, "cpu_speed": speed,
                   "jax": jax.__version__, "device": jax.devices()[0].device_kind}, fh, indent=1)
    print(f"\nwrote {args.out}/memory.png, table.md, results.json")


if __name__ == "__main__":
    main()
