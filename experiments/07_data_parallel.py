"""python experiments/07_data_parallel.py [--out runs/07_data_parallel] [--steps 30] [--no-torch]

Topic 07: data parallelism. Two parts, in one run on the 8 simulated CPU devices:
1. The census of the compiled jaxscale DP step (`jaxscale.analysis.inspect.report`) for dp = 2, 4, 8
   on the tiny LLaMA: the gradient all-reduce over `dp` carries exactly the gradient bytes (= fp32
   parameter bytes) whatever the degree, its ring wire bytes grow as 2(n-1)/n, no other collective
   appears, and the per-device memory keeps the whole model state (replicated) while the activations
   shrink with the local batch.
2. The loss curve of jaxscale DP (mesh dp=8) against PyTorch DDP (8 gloo ranks on localhost) for
   `--steps` steps from the same initial weights, on the same batches, with the same AdamW,
   clipping and schedule (`benchmarks.matched_training`): the two curves coincide up to fp32
   rounding; the throughput ratio is measured side by side (on CPU, where 8 JAX devices and 8
   torch processes share the cores, only the ratio means anything).
3. Gradient accumulation on dp8: bytes over dp per step against k = 1, 2, 4, 8 micro-batches,
   reduced once per step (`plan.grad_sync=auto`, the default: the local accumulator all-reduced
   once, as DDP's `no_sync`) and per micro-batch (`plan.grad_sync=microbatch`: k times the bytes),
   census beside inspect's theory (`dp_sync.json`, the third panel).
Under four minutes on 2 idle cores. Writes dp_census.json, dp_vs_ddp.json and
data_parallel.png under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from _common import (  # first: 8 simulated devices before jax is imported
    plot_sync_bytes,
    pyplot,
    savefig,
    sync_bytes,
)

import jax  # noqa: E402

from jaxscale import models  # noqa: E402
from jaxscale.analysis.inspect import report  # noqa: E402
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides  # noqa: E402

MiB = 2**20


def base_config(steps: int) -> Config:
    model = dataclasses.replace(models.get("tiny"), n_layers=2)
    return Config(name="07_data_parallel", model=model,
                  data=DataConfig(seq_len=64, batch_size=16, max_bytes=1_000_000),
                  optim=OptimConfig(lr=3e-3, warmup_steps=3),
                  train=TrainConfig(steps=steps, eval_every=0))


def census_rows(cfg: Config) -> list[dict]:
    grad_bytes = 4 * cfg.model.param_count()
    rows = []
    for n in (2, 4, 8):
        c = apply_overrides(cfg, [f"mesh.dp={n}", "mesh.fsdp=1", "mesh.tp=1"])
        rep = report(c, jax.devices()[:n])
        colls = rep["collectives"]
        dp_ar = [x for x in colls if x["kind"] == "all-reduce" and x["axes"] == ["dp"]]
        rows.append({"dp": n, "collectives": colls, "memory": rep["memory"],
                     "grad_bytes": grad_bytes,
                     "allreduce_bytes": sum(x["bytes"] for x in dp_ar),
                     "allreduce_count": sum(x["count"] for x in dp_ar),
                     "wire_bytes": sum(x["wire_bytes"] for x in dp_ar),
                     "other": [x for x in colls if x not in dp_ar]})
    return rows


def census_table(rows: list[dict]) -> str:
    lines = ["jaxscale DP census per device per step (tiny LLaMA, 2 layers, fp32)",
             f"{'dp':>3}{'all-reduce':>11}{'bytes':>12}{'grad bytes':>12}{'ratio':>7}"
             f"{'wire bytes':>12}{'2(n-1)/n':>9}{'other colls':>12}{'args MiB':>10}"
             f"{'temp MiB':>10}"]
    for r in rows:
        n = r["dp"]
        lines.append(f"{n:>3}{r['allreduce_count']:>11}{r['allreduce_bytes']:>12,}"
                     f"{r['grad_bytes']:>12,}{r['allreduce_bytes'] / r['grad_bytes']:>7.3f}"
                     f"{r['wire_bytes']:>12,}{r['wire_bytes'] / r['allreduce_bytes']:>9.3f}"
                     f"{len(r['other']):>12}{r['memory']['argument'] / MiB:>10.2f}"
                     f"{r['memory']['temp'] / MiB:>10.2f}")
    return "\n".join(lines)


def plot(rows, pair, sync, path: Path) -> None:
    plt = pyplot()
    n = 3 if pair else 2
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    plot_sync_bytes(axes[0][n - 1], sync, "dp8: gradient bytes over dp per step against k")
    ax = axes[0][0]
    ns = [r["dp"] for r in rows]
    ax.bar([str(n) for n in ns], [r["allreduce_bytes"] / MiB for r in rows],
           label="all-reduce bytes")
    ax.plot([str(n) for n in ns], [r["wire_bytes"] / MiB for r in rows], "o-", color="C1",
            label="ring wire bytes 2(n-1)/n")
    ax.axhline(rows[0]["grad_bytes"] / MiB, color="gray", ls="--", label="gradient bytes")
    ax.set(xlabel="dp degree", ylabel="MiB per device per step", title="DP gradient all-reduce")
    ax.legend(fontsize=8)
    if pair:
        ax = axes[0][1]
        steps = range(1, len(pair["jax"]["loss"]) + 1)
        ax.plot(steps, pair["jax"]["loss"], "-", label="jaxscale DP (dp=8)")
        ax.plot(steps, pair["torch"]["loss"], "--", label="PyTorch DDP (8 gloo ranks)")
        ax.set(xlabel="step", ylabel="train loss (nats/token)",
               title=f"same weights and data; max |diff| {max(pair['loss_abs_diff']):.1e}")
        ax.legend(fontsize=8)
    savefig(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/07_data_parallel")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = base_config(args.steps)
    rows = census_rows(cfg)
    print(census_table(rows))
    (out / "dp_census.json").write_text(json.dumps(rows, indent=2))
    pair = None
    if not args.no_torch:
        from jaxscale.benchmarks.matched_training import format_collectives, format_table, run_pairs
        from jaxscale.comm.torch_bench import TorchFailure
        try:
            pair = run_pairs(["dp"], cfg, args.world, args.steps, warmup=2, chunk=4,
                             log=lambda s: print(s, file=sys.stderr, flush=True))[0]
        except TorchFailure as e:
            print(f"the torch side failed: {e}", file=sys.stderr)
            return 1
        print()
        print(format_table([pair]))
        print()
        print(format_collectives([pair]))
        print("\nloss per step (jaxscale DP | DDP | |diff|)")
        for i, (a, b) in enumerate(zip(pair["jax"]["loss"], pair["torch"]["loss"])):
            if i % 5 == 0 or i == len(pair["jax"]["loss"]) - 1:
                print(f"  step {i + 1:>3}  {a:.6f}  {b:.6f}  {abs(a - b):.1e}")
        (out / "dp_vs_ddp.json").write_text(json.dumps(pair, indent=2, default=str))
    sync = sync_bytes(("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1"), seq=64, batch=64)
    print("\ngradient bytes over dp per step, dp8, k micro-batches (census | theory):")
    for r in sync:
        print(f"  k={r['k']}  {r['mode']:<10}  {r['census']:>10,}  {r['theory']:>10,.0f}")
    (out / "dp_sync.json").write_text(json.dumps(sync, indent=2))
    plot(rows, pair, sync, out / "data_parallel.png")
    print(f"\nwrote {out}/dp_census.json{', dp_vs_ddp.json' if pair else ''}, dp_sync.json and "
          f"data_parallel.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
