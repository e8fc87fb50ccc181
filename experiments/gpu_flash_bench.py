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

Tuning the Pallas kernels (`--tune`): for each head_dim and causal setting, time candidate
(block_q, block_k, num_warps, num_stages) of the forward kernel (forward alone), then of the dK/dV
and dQ kernels (forward+backward, the others fixed at the best so far), against cuDNN at one shape
(bf16, seq 8192, 16k tokens, hidden 2048); check the winner's output and gradients against cuDNN;
rewrite those entries of the tuning table (`jaxscale/kernels/flash_tuning.json`, or --table) with
the device, date, jax version and timings; print a table and write tune.md / tune.json and a copy
of the table to --out. On the GPU machine (results come back only from $OUT):

    python experiments/gpu_flash_bench.py --tune --head-dims 128 --out $OUT/tune

then copy $OUT/tune/flash_tuning.json over jaxscale/kernels/flash_tuning.json. `--atomic-dq` also
tries dQ accumulated with atomic adds in the dK/dV kernel (faster backward, dQ not bitwise
reproducible). Off-GPU `--tune` refuses unless given `--allow-cpu --tiny` (a smoke test of the
code path in interpret mode; it writes to --table or a fresh temporary directory, never to the
packaged table).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxscale.analysis.profiling import median_seconds  # noqa: E402
from jaxscale.hooks.attention import attention  # noqa: E402
from jaxscale.kernels import flash_attention as fa  # noqa: E402
from jaxscale.kernels import flash_tuning as ft  # noqa: E402

IMPLS = ("pallas", "cudnn", "xla")


def attention_flops(batch, seq, heads, head_dim, causal, backward: bool) -> float:
    fwd = 4.0 * seq * seq * head_dim * heads * batch * (0.5 if causal else 1.0)
    return fwd * (3.5 if backward else 1.0)


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
    if impl == "pallas":  # which tuning-table entry the kernels ran with
        row["tuning"] = ft.resolve_tuning(head_dim, causal, dtype).source
    try:
        t = median_seconds(fwd, q, k, v, reps=reps)
        row.update(fwd_ms=t * 1e3, fwd_tflops=attention_flops(
            batch, seq, heads, head_dim, causal, False) / t / 1e12)
        if check:
            ref = jax.jit(lambda q, k, v: attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                    v.astype(jnp.float32), causal=causal,
                                                    implementation="xla"))(q, k, v)
            out = fwd(q, k, v).astype(jnp.float32)
            row["rel_err_vs_xla_fp32"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        t = median_seconds(fwd_bwd, q, k, v, do, reps=reps)
        row.update(fwd_bwd_ms=t * 1e3, fwd_bwd_tflops=attention_flops(
            batch, seq, heads, head_dim, causal, True) / t / 1e12)
    except Exception as e:  # unsupported shape/dtype, OOM: record it and move on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def goal(rows) -> dict:
    """pallas forward >= 0.9x cudnn and > 500 TFLOP/s at hd128, seq 8k (both causal settings);
    forward+backward >= 0.7x cudnn (`fwd_bwd_met`)."""
    out = {}
    for causal in (False, True):
        pick = {r["impl"]: r for r in rows if r["head_dim"] == 128 and r["seq"] == 8192
                and r["causal"] == causal and "fwd_tflops" in r}
        if "pallas" not in pick:
            continue
        p = pick["pallas"]["fwd_tflops"]
        c = pick.get("cudnn", {}).get("fwd_tflops")
        pb = pick["pallas"].get("fwd_bwd_tflops")
        cb = pick.get("cudnn", {}).get("fwd_bwd_tflops")
        out["causal" if causal else "non-causal"] = {
            "pallas_fwd_tflops": p, "cudnn_fwd_tflops": c,
            "ratio_vs_cudnn": None if c is None else p / c,
            "met": p > 500 and (c is None or p >= 0.9 * c),
            "fwd_bwd_ratio_vs_cudnn": None if not (pb and cb) else pb / cb,
            "fwd_bwd_met": None if not (pb and cb) else pb >= 0.7 * cb}
    return out


def table(rows) -> str:
    lines = ["| impl | head_dim | seq | batch x heads | causal | fwd ms | fwd TFLOP/s | "
             "fwd+bwd ms | fwd+bwd TFLOP/s | note |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        note = r.get("error", "")
        if "rel_err_vs_xla_fp32" in r:
            note = f"rel err vs fp32 xla {r['rel_err_vs_xla_fp32']:.1e} " + note
        lines.append(f"| {r['impl']} | {r['head_dim']} | {r['seq']} | {r['batch']}x{r['heads']} | "
                     f"{r['causal']} | {f('fwd_ms', '.3f')} | {f('fwd_tflops', '.1f')} | "
                     f"{f('fwd_bwd_ms', '.3f')} | {f('fwd_bwd_tflops', '.1f')} | {note} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- --tune
#: Candidates (block_q, block_k, num_warps, num_stages) per kernel; the table's current entry is
#: always tried first, and candidates whose tiles overflow shared memory are dropped.
CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3),
            (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 8, 3)],
    "dkdv": [(64, 64, 8, 3), (64, 64, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2),
             (64, 128, 8, 3), (128, 64, 8, 2), (16, 128, 8, 3)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
           (64, 64, 8, 2)],
}
TINY_CANDIDATES = {"fwd": [(16, 16, 4, 2), (32, 16, 4, 2)], "dkdv": [(16, 32, 4, 2)],
                   "dq": [(32, 16, 4, 2)]}
SMEM_BYTES = 227 * 1024      # Hopper's shared memory per block


def smem_estimate(kernel: str, c: ft.KernelConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory bytes: the resident tiles plus `num_stages` buffers of the streamed ones."""
    row = head_dim * itemsize
    if kernel == "fwd":      # q resident; k, v streamed
        return c.block_q * row + c.num_stages * 2 * c.block_k * row
    if kernel == "dq":       # q, dO resident; k, v streamed
        return 2 * c.block_q * row + c.num_stages * 2 * c.block_k * row
    return 2 * c.block_k * row + c.num_stages * 2 * c.block_q * row   # dkdv: k, v resident


def candidates(kernel, current: ft.KernelConfig, head_dim, itemsize, tiny) -> list:
    listed = [ft.KernelConfig(*c) for c in (TINY_CANDIDATES if tiny else CANDIDATES)[kernel]]
    out = [current] + [c for c in listed if c != current]
    return [c for c in out if tiny or smem_estimate(kernel, c, head_dim, itemsize) <= SMEM_BYTES]


def _time_ms(f, args, reps) -> float | str:
    try:
        return median_seconds(jax.jit(f), *args, reps=reps) * 1e3
    except Exception as e:  # out of shared memory, compile failure: recorded, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _cfg_text(c: ft.KernelConfig) -> str:
    return f"{c.block_q}x{c.block_k} w{c.num_warps} s{c.num_stages}"


def tune_one(head_dim, causal, *, seq, batch, heads, reps, tiny, atomic_dq, deadline,
             table) -> dict:
    """Coordinate search from the table's current entry: the forward tile (by forward time), then
    dK/dV, then dQ (by forward+backward time), then optionally atomic dQ (kept if >= 3% faster)."""
    dtype = jnp.bfloat16
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
                   for kk in ks)
    current = ft.lookup_tuning(head_dim, causal, dtype, table=table)
    ref_impl = "xla" if tiny else "cudnn"

    def attn(t):
        if t == ref_impl:  # off-GPU: xla in fp32 from the same bf16 inputs
            return lambda q, k, v: attention(*((x.astype(jnp.float32) for x in (q, k, v)) if tiny
                                               else (q, k, v)), causal=causal,
                                             implementation=t).astype(q.dtype)
        return lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, tuning=t)

    cache, log = {}, []

    def measure(t, backward: bool):
        if (t, backward) not in cache:
            f = attn(t)
            cache[t, backward] = (_time_ms(lambda *a: jax.vjp(f, *a[:3])[1](a[3]), (q, k, v, do),
                                           reps) if backward else _time_ms(f, (q, k, v), reps))
        return cache[t, backward]

    best, best_ms = current, None
    for kernel, atomic in [("fwd", False), ("dkdv", False), ("dq", False)] + [("dkdv", True)] * \
            bool(atomic_dq):
        pool = candidates(kernel, getattr(best, kernel), head_dim, 2, tiny)
        scored = []
        for c in pool[:3] if atomic else pool:
            if time.time() > deadline:
                return {"error": "time budget ran out", "log": log}
            t = replace(best, **{kernel: c}, dq_atomic=atomic or best.dq_atomic)
            ms = measure(t, backward=kernel != "fwd")
            log.append({"kernel": kernel, "dq_atomic": t.dq_atomic, "config": _cfg_text(c),
                        "ms": ms})
            print(f"  d{head_dim} causal={causal} {'fwd' if kernel == 'fwd' else 'fwd+bwd'}, "
                  f"{kernel} {_cfg_text(c)}{' atomic dQ' * atomic}: "
                  f"{ms if isinstance(ms, str) else f'{ms:.3f} ms'}", flush=True)
            if not isinstance(ms, str):
                scored.append((ms, t))
        if scored:
            ms, winner = min(scored, key=lambda x: x[0])
            if not atomic or best_ms is None or ms < 0.97 * best_ms:
                best, best_ms = winner, (ms if kernel != "fwd" else best_ms)
    if time.time() > deadline:
        return {"error": "time budget ran out", "log": log}

    res = {"fwd_ms": measure(best, False), "fwd_bwd_ms": measure(best, True),
           "before_fwd_ms": measure(current, False), "before_fwd_bwd_ms": measure(current, True),
           f"{ref_impl}_fwd_ms": measure(ref_impl, False),
           f"{ref_impl}_fwd_bwd_ms": measure(ref_impl, True)}
    for key in ("fwd", "fwd_bwd"):
        a, b = res[f"{key}_ms"], res[f"{ref_impl}_{key}_ms"]
        res[f"{key}_vs_{ref_impl}"] = None if isinstance(a, str) or isinstance(b, str) else b / a

    def outputs(f):  # output and the three gradients, fp32
        return [x.astype(jnp.float32) for x in jax.jit(
            lambda *a: (f(*a[:3]), *jax.vjp(f, *a[:3])[1](a[3])))(q, k, v, do)]
    res["rel_err"] = max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                         for g, w in zip(outputs(attn(best)), outputs(attn(ref_impl))))
    res.update(seq=seq, batch=batch, heads=heads)
    return {"tuning": best, "timings": res, "log": log}


def dump_table(table: dict) -> str:
    """JSON with each kernel's settings on one line."""
    text = json.dumps(table, indent=1)
    return re.sub(r"\{\s+(\"block_q\"[^{}]*?)\s+\}",
                  lambda m: "{" + " ".join(m.group(1).split()) + "}", text) + "\n"


def tune(args, on_gpu: bool) -> None:
    if not on_gpu and not (args.allow_cpu and args.tiny):
        sys.exit(f"gpu_flash_bench --tune: the default JAX backend is {jax.default_backend()!r}, "
                 f"not an NVIDIA GPU; the sweep times Triton kernels and only means something "
                 f"there. For a smoke test of the code path (interpret mode, tiny shapes, table "
                 f"written to a temporary path) pass --allow-cpu --tiny.")
    packaged = Path(ft.TUNING_TABLE).resolve()
    if args.table:
        path = Path(args.table)
    elif on_gpu and not args.tiny:
        path = packaged
    else:
        path = Path(tempfile.mkdtemp(prefix="flash_tuning_")) / "flash_tuning.json"
    if (args.tiny or not on_gpu) and path.resolve() == packaged:
        sys.exit("gpu_flash_bench --tune: a --tiny or CPU sweep never writes the packaged table; "
                 "pass --table PATH")
    if args.tiny:
        head_dims, seq, tokens, hidden, reps, causals = [32], 64, 64, 64, 1, (True,)
    else:
        head_dims = [int(h) for h in args.head_dims.split(",")]
        seq, tokens, hidden, reps, causals = 8192, 16384, 2048, args.reps or 5, (False, True)
    seq = int(args.seqs.split(",")[0]) if args.seqs else seq
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.time_budget
    base = json.loads(path.read_text()) if path.exists() else \
        json.loads(packaged.read_text())
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    device = jax.devices()[0].device_kind
    results, rows = [], []
    for head_dim in head_dims:
        heads, batch = max(1, hidden // head_dim), max(1, tokens // seq)
        for causal in causals:
            r = tune_one(head_dim, causal, seq=seq, batch=batch, heads=heads, reps=reps,
                         tiny=args.tiny, atomic_dq=args.atomic_dq, deadline=deadline,
                         table=base)
            results.append({"head_dim": head_dim, "causal": causal, **{
                k: v for k, v in r.items() if k != "tuning"}})
            if "tuning" not in r:
                rows.append(f"| {head_dim} | {causal} | - | - | - | - | {r['error']} |")
                continue
            t, tm = r["tuning"], r["timings"]
            ok = tm["rel_err"] < 3e-2
            if ok:
                key = (ft.head_dim_bucket(head_dim), causal, "bfloat16")
                base["entries"] = [e for e in base["entries"] if
                                   (e["head_dim"], e["causal"], e["dtype"]) != key]
                base["entries"].append({"head_dim": key[0], "causal": causal, "dtype": key[2],
                                        "source": f"sweep {date} on {device} (jax {jax.__version__}"
                                                  f", seq {seq})", **t.to_entry(), "timings": {
                                            k: round(v, 4) if isinstance(v, float) else v
                                            for k, v in tm.items()}})
            ref = "xla" if args.tiny else "cudnn"
            ratio = lambda key: "-" if tm[key] is None else f"{tm[key]:.2f}x"  # noqa: E731
            ms = lambda key: tm[key] if isinstance(tm[key], str) else f"{tm[key]:.3f}"  # noqa: E731
            rows.append(
                f"| {head_dim} | {causal} | {_cfg_text(t.fwd)} | "
                f"{'atomic in dK/dV' if t.dq_atomic else _cfg_text(t.dq)} | {_cfg_text(t.dkdv)} | "
                f"{ms('fwd_ms')} ({ms('before_fwd_ms')}) vs {ms(ref + '_fwd_ms')}: "
                f"{ratio('fwd_vs_' + ref)} | {ms('fwd_bwd_ms')} ({ms('before_fwd_bwd_ms')}) vs "
                f"{ms(ref + '_fwd_bwd_ms')}: {ratio('fwd_bwd_vs_' + ref)}; rel err "
                f"{tm['rel_err']:.1e}{'' if ok else ' (too large: entry not written)'} |")
    base["entries"].sort(key=lambda e: (e["dtype"], e["head_dim"], e["causal"]))
    base.setdefault("sweeps", []).append({
        "date": date, "device_kind": device, "backend": jax.default_backend(),
        "jax": jax.__version__, "seq": seq, "tokens": tokens, "hidden": hidden,
        "head_dims": head_dims, "atomic_dq_tried": bool(args.atomic_dq),
        "wall_s": round(time.time() - t0, 1)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_table(base))
    if Path(args.out).resolve() != path.parent.resolve():
        (Path(args.out) / "flash_tuning.json").write_text(dump_table(base))
    md = [f"# Pallas attention tuning on {device} ({date}, jax {jax.__version__})", "",
          f"bf16, seq {seq}, {tokens} tokens per batch, hidden {hidden}. Times in ms: the tuned "
          f"entry (the table's entry before the sweep) vs {'fp32 xla' if args.tiny else 'cuDNN'}, "
          f"and {'xla' if args.tiny else 'cuDNN'}'s time / Pallas's time.", "",
          "| head_dim | causal | fwd tile | dQ | dK/dV | forward | forward+backward |",
          "|---:|---|---|---|---|---|---|", *rows, "", f"table written to {path}"]
    (Path(args.out) / "tune.md").write_text("\n".join(md) + "\n")
    (Path(args.out) / "tune.json").write_text(json.dumps(
        {"table": str(path), "sweep": base["sweeps"][-1], "results": results}, indent=1,
        default=str) + "\n")
    print("\n".join(md))


# ----------------------------------------------------------------------------- --compile-report
def compile_report(args) -> None:
    """Registers, spill bytes and shared memory of every candidate of every kernel, compiled for
    sm_90a with no GPU: the Triton IR that Pallas emits (lowered for CUDA on this machine) goes
    through the `triton` package's compiler and its ptxas. A proxy (XLA bundles its own Triton),
    good for ruling out tiles that spill or overflow shared memory before a sweep."""
    import subprocess
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        sys.exit("gpu_flash_bench --compile-report needs the triton package (pip install triton; "
                 "no GPU needed)")
    from jax._src.pallas.triton import pallas_call_registration as reg  # private, may move
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    lower, captured = reg.lowering.lower_jaxpr_to_triton_module, []

    def spy(*a, **kw):
        result = lower(*a, **kw)
        captured.append(result.module.operation.get_asm())
        return result
    reg.lowering.lower_jaxpr_to_triton_module = spy
    rows, out = [], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for head_dim in (int(h) for h in args.head_dims.split(",")):
            current = ft.lookup_tuning(head_dim, True, jnp.bfloat16)
            for kernel in ft.KERNELS:
                for c in candidates(kernel, getattr(current, kernel), head_dim, 2, tiny=False):
                    t = replace(current, **{kernel: c})
                    captured.clear()
                    loss = lambda q, k, v: fa.flash_attention(  # noqa: E731
                        q, k, v, causal=True, interpret=False, tuning=t).astype(jnp.float32).sum()
                    shape = jax.ShapeDtypeStruct((1, 1024, 4, head_dim), jnp.bfloat16)
                    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(shape, shape, shape).lower(
                        lowering_platforms=("cuda",))
                    ttir = out / f"d{head_dim}_{kernel}.ttir"
                    ttir.write_text(captured[ft.KERNELS.index(kernel)])
                    compiled = triton.compile(str(ttir), target=GPUTarget("cuda", 90, 32), options={
                        "num_warps": c.num_warps, "num_stages": c.num_stages})
                    ptx = out / f"d{head_dim}_{kernel}.ptx"
                    ptx.write_text(compiled.asm["ptx"])
                    log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o",
                                          os.devnull], capture_output=True, text=True).stderr
                    regs = re.search(r"Used (\d+) registers", log)
                    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
                    rows.append({"head_dim": head_dim, "kernel": kernel, "config": _cfg_text(c),
                                 "registers": int(regs.group(1)) if regs else None,
                                 "spill_store_bytes": int(spill.group(1)) if spill else None,
                                 "spill_load_bytes": int(spill.group(2)) if spill else None,
                                 "shared_KiB": compiled.metadata.shared // 1024,
                                 "wgmma": compiled.asm["ttgir"].count("warp_group_dot")})
                    r = rows[-1]
                    print(f"| {head_dim} | {kernel} | {r['config']} | {r['registers']} | "
                          f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['shared_KiB']} | "
                          f"{'yes' if r['wgmma'] else 'no'} |", flush=True)
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = lower
    (out / "compile_report.json").write_text(json.dumps(
        {"triton": triton.__version__, "jax": jax.__version__, "target": "sm_90a",
         "rows": rows}, indent=1) + "\n")


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
    ap.add_argument("--tune", action="store_true",
                    help="sweep the Pallas kernels' tiles/warps/stages and write the tuning table")
    ap.add_argument("--table", default=None, help="--tune: table to update (default: the packaged "
                    "one on a GPU, a temporary file otherwise)")
    ap.add_argument("--tiny", action="store_true", help="--tune: tiny shapes and candidates")
    ap.add_argument("--atomic-dq", action="store_true",
                    help="--tune: also try dQ accumulated atomically by the dK/dV kernel")
    ap.add_argument("--compile-report", action="store_true",
                    help="registers/spills/shared memory of the --tune candidates for sm_90a, "
                         "compiled without a GPU (needs the triton package)")
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    if args.compile_report:
        return compile_report(args)
    if args.tune:
        return tune(args, on_gpu)
    if not on_gpu and not args.allow_cpu:
        sys.exit(f"gpu_flash_bench: the default JAX backend is {backend!r}, not an NVIDIA GPU. "
                 "TFLOP/s figures are only meaningful on a GPU; pass --allow-cpu to smoke-test "
                 "the code path with tiny sizes.")
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
            "hidden": hidden, "wall_s": round(time.time() - t_start, 1),
            "tuning_table": {"path": str(os.environ.get(ft.TUNING_ENV) or ft.TUNING_TABLE),
                             "last_sweep": (ft.load_tuning_table().get("sweeps") or [None])[-1]}}
    result = {"meta": meta, "goal_hd128_s8k": goal(rows), "rows": rows}
    md = [f"# Attention TFLOP/s on {meta['device_kind']} ({meta['date']}, jax {meta['jax']})", "",
          "FLOPs: forward 4·s²·d·heads·batch (half causal), forward+backward 3.5x forward; bf16, "
          f"batch x seq = {tokens} tokens, hidden {hidden}.", "", table(rows), "",
          "Goal (hd128, s8k): pallas forward > 500 TFLOP/s and >= 0.9x cudnn (met), "
          "forward+backward >= 0.7x cudnn (fwd_bwd_met): "
          + json.dumps(result["goal_hd128_s8k"])]
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print("\n".join(md[-1:]))
    print(f"wrote {args.out}/results.md and results.json in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
