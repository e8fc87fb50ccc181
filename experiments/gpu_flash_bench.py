"""GPU benchmark of attention: TFLOP/s of pallas (Triton FlashAttention), cudnn and xla.

Run on an NVIDIA GPU (one call, under ten minutes on an H200):

    python experiments/gpu_flash_bench.py --out runs/gpu_flash

CPU smoke test of the same code path (tiny sizes, Pallas in interpret mode, cudnn reported as
unsupported):

    python experiments/gpu_flash_bench.py --allow-cpu --out /tmp/gpu_flash_cpu

Settings follow the FlashAttention-2 paper's benchmark: bf16, hidden size 2048 (heads = 2048 /
head_dim), batch x sequence = 16k tokens, head_dim 64 and 128, sequence 1k..16k, causal and not.
FLOPs: forward 4·s²·d·heads·batch (half when causal), backward 2.5x forward, so forward+backward
is 3.5x. Each timing is the median of several runs after a warm-up (compilation excluded). Pallas
forward output is checked against xla on the shorter sequences. Writes results.md and results.json
(date, jax version, device kind) to --out, and checks the goal: pallas forward >= 0.9x cudnn and
> 500 TFLOP/s at head_dim 128, seq 8k.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxscale.attention import attention  # noqa: E402

IMPLS = ("pallas", "cudnn", "xla")


def attention_flops(batch, seq, heads, head_dim, causal, backward: bool) -> float:
    fwd = 4.0 * seq * seq * head_dim * heads * batch * (0.5 if causal else 1.0)
    return fwd * (3.5 if backward else 1.0)


def time_fn(f, *args, reps: int) -> float:
    """Median seconds per call after one warm-up (which also compiles)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(impl, batch, seq, heads, head_dim, causal, dtype, reps, check: bool) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (batch, seq, heads, head_dim)
    q, k, v, do = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in ks)

    def attn(q, k, v):
        return attention(q, k, v, causal=causal, implementation=impl)

    fwd = jax.jit(attn)
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    row = {"impl": impl, "batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim,
           "causal": causal, "dtype": jnp.dtype(dtype).name}
    try:
        t = time_fn(fwd, q, k, v, reps=reps)
        row.update(fwd_ms=t * 1e3, fwd_tflops=attention_flops(
            batch, seq, heads, head_dim, causal, False) / t / 1e12)
        if check:
            ref = jax.jit(lambda q, k, v: attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                    v.astype(jnp.float32), causal=causal,
                                                    implementation="xla"))(q, k, v)
            out = fwd(q, k, v).astype(jnp.float32)
            row["rel_err_vs_xla_fp32"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        t = time_fn(fwd_bwd, q, k, v, do, reps=reps)
        row.update(fwd_bwd_ms=t * 1e3, fwd_bwd_tflops=attention_flops(
            batch, seq, heads, head_dim, causal, True) / t / 1e12)
    except Exception as e:  # unsupported shape/dtype, OOM: record it and move on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def goal(rows) -> dict:
    """pallas forward >= 0.9x cudnn and > 500 TFLOP/s at hd128, seq 8k (both causal settings)."""
    out = {}
    for causal in (False, True):
        pick = {r["impl"]: r for r in rows if r["head_dim"] == 128 and r["seq"] == 8192
                and r["causal"] == causal and "fwd_tflops" in r}
        if "pallas" not in pick:
            continue
        p = pick["pallas"]["fwd_tflops"]
        c = pick.get("cudnn", {}).get("fwd_tflops")
        out["causal" if causal else "non-causal"] = {
            "pallas_fwd_tflops": p, "cudnn_fwd_tflops": c,
            "ratio_vs_cudnn": None if c is None else p / c,
            "met": p > 500 and (c is None or p >= 0.9 * c)}
    return out


def table(rows) -> str:
    lines = ["| impl | head_dim | seq | batch x heads | causal | fwd ms | fwd TFLOP/s | "
             "fwd+bwd ms | fwd+bwd TFLOP/s | note |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        note = r.get("error", "")
        if "rel_err_vs_xla_fp32" in r:
            note = f"rel err vs fp32 xla {r['rel_err_vs_xla_fp32']:.1e} " + note
        lines.append(f"| {r['impl']} | {r['head_dim']} | {r['seq']} | {r['batch']}x{r['heads']} | "
                     f"{r['causal']} | {f('fwd_ms', '.3f')} | {f('fwd_tflops', '.1f')} | "
                     f"{f('fwd_bwd_ms', '.3f')} | {f('fwd_bwd_tflops', '.1f')} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu_flash")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run tiny sizes on a non-GPU backend (code-path smoke test only)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=480.0,
                    help="seconds; configurations left when it runs out are recorded as skipped")
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    if not on_gpu and not args.allow_cpu:
        sys.exit(f"gpu_flash_bench: the default JAX backend is {backend!r}, not an NVIDIA GPU. "
                 f"TFLOP/s figures are only meaningful on a GPU; pass --allow-cpu to smoke-test the "
                 f"code path with tiny sizes.")
    if on_gpu:
        seqs, tokens, hidden, reps = [1024, 2048, 4096, 8192, 16384], 16384, 2048, 10
    else:  # smoke test: tiny, Pallas in interpret mode
        seqs, tokens, hidden, reps = [64, 128], 128, 128, 1
    if args.seqs:
        seqs = [int(s) for s in args.seqs.split(",")]
    reps = args.reps or reps
    impls = [i for i in args.impls.split(",") if i]
    os.makedirs(args.out, exist_ok=True)

    t_start, rows = time.time(), []
    for head_dim in (int(h) for h in args.head_dims.split(",")):
        heads = max(1, hidden // head_dim)
        for seq in seqs:
            batch = max(1, tokens // seq)
            for causal in (False, True):
                for impl in impls:
                    if time.time() - t_start > args.time_budget:
                        rows.append({"impl": impl, "batch": batch, "seq": seq, "heads": heads,
                                     "head_dim": head_dim, "causal": causal,
                                     "error": "skipped: time budget"})
                        continue
                    row = bench_one(impl, batch, seq, heads, head_dim, causal, jnp.bfloat16,
                                    reps, check=impl == "pallas" and seq <= 4096)
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_kind": jax.devices()[0].device_kind, "backend": backend,
            "jax": jax.__version__, "dtype": "bfloat16", "tokens_per_batch": tokens,
            "hidden": hidden, "wall_s": round(time.time() - t_start, 1)}
    result = {"meta": meta, "goal_hd128_s8k": goal(rows), "rows": rows}
    md = [f"# Attention TFLOP/s on {meta['device_kind']} ({meta['date']}, jax {meta['jax']})", "",
          "FLOPs: forward 4·s²·d·heads·batch (half causal), forward+backward 3.5x forward; bf16, "
          f"batch x seq = {tokens} tokens, hidden {hidden}.", "", table(rows), "",
          "Goal (hd128, s8k): pallas forward > 500 TFLOP/s and >= 0.9x cudnn: "
          + json.dumps(result["goal_hd128_s8k"])]
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print("\n".join(md[-1:]))
    print(f"wrote {args.out}/results.md and results.json in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
