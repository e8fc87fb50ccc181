"""python experiments/26_framework_comparison.py [--out runs/26_framework_comparison] [--world 4]

Topic 26: jaxscale against PyTorch's own answers to the same three questions, measured on one
machine in one run (`benchmarks.matched_training`): DDP vs jaxscale DP, FSDP2 (`fully_shard`) vs
jaxscale FSDP, FSDP2 on a 2-D mesh (HSDP) vs jaxscale dp x fsdp, DTensor tensor parallelism vs
jaxscale TP, every pair from the same initial weights and batches, with the same AdamW, clipping
and schedule, `--world` ranks each (gloo on CPU; NCCL on GPUs).
Per pair: tokens/s of each side timed alternately (order reversed every chunk) and their ratio;
per-rank state and peak memory (JAX: compiled memory_analysis; torch: MemTracker); the loss of
every step and the largest difference; the collectives one step issues on each side (XLA's
census with mesh axes and bytes; torch's CommDebugMode op counts). A design difference shows in
the last table: XLA gathers FSDP parameters one tensor at a time (counts include the scan over
layers) where FSDP2 gathers one flat group per wrapped block; DDP buckets gradients into ~25 MiB
all-reduces where XLA's combiner forms its own groups; DTensor TP issues an all-reduce per
row-parallel output and per column-parallel input gradient, as the XLA program does.
On CPU the JAX devices and the torch ranks share the cores (2 here): absolute throughput means
little, the ratio measured side by side is the result, and eager PyTorch pays its Python and
dispatch cost per op where XLA runs one compiled program. Under three minutes on 2 idle cores.
Writes comparison.json and comparison.png under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from _common import pyplot, savefig  # first: 8 simulated devices before jax is imported

import jax  # noqa: E402

from jaxscale import models  # noqa: E402
from jaxscale.benchmarks.matched_training import format_collectives, format_table, run_pairs  # noqa: E402
from jaxscale.comm.torch_bench import TorchFailure  # noqa: E402
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig  # noqa: E402

MiB = 2**20


def base_config(steps: int) -> Config:
    model = dataclasses.replace(models.get("tiny"), n_layers=2)
    return Config(name="26_framework_comparison", model=model,
                  data=DataConfig(seq_len=64, batch_size=16, max_bytes=1_000_000),
                  optim=OptimConfig(lr=3e-3, warmup_steps=2),
                  train=TrainConfig(steps=steps, eval_every=0))


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    names = [r["pair"] for r in results]
    ax = axes[0]
    for c, r in enumerate(results):
        steps = range(1, len(r["jax"]["loss"]) + 1)
        diff = [max(d, 1e-9) for d in r["loss_abs_diff"]]
        ax.semilogy(steps, diff, "-o", ms=3, color=f"C{c}", label=r["pair"])
    ax.set(xlabel="step", ylabel="|loss JAX - loss torch|", title="loss agreement (fp32)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(names, [r["ratio_tokens_per_s"] for r in results],
           color=[f"C{c}" for c in range(len(results))])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="tokens/s JAX / torch", title=f"throughput ratio, world {results[0]['world']}")
    ax = axes[2]
    x = range(len(results))
    for off, key, lab, col in ((-0.3, "jax", "JAX", "C0"), (0.1, "torch", "torch", "C1")):
        state = [(r[key].get("state_bytes_per_device") or max(r[key].get(
            "state_bytes_per_rank", [0]))) / MiB for r in results]
        peak = [(r[key].get("peak_bytes_per_device") or max(r[key].get(
            "peak_bytes_per_rank", [0]))) / MiB for r in results]
        ax.bar([i + off for i in x], state, 0.2, color=col, label=f"{lab} state")
        ax.bar([i + off + 0.2 for i in x], peak, 0.2, color=col, alpha=0.45, label=f"{lab} peak")
    ax.set_xticks(list(x), names)
    ax.set(ylabel="MiB per rank", title="memory: state and peak per rank")
    ax.legend(fontsize=7)
    ax = axes[3]
    jax_ops = [sum(c["count"] for c in r["jax"]["census"]) for r in results]
    torch_ops = [sum(r["torch"]["collectives"].values()) for r in results]
    ax.bar([i - 0.2 for i in x], jax_ops, 0.4, label="XLA census")
    ax.bar([i + 0.2 for i in x], torch_ops, 0.4, label="torch CommDebugMode")
    ax.set_xticks(list(x), names)
    ax.set(ylabel="collective ops per step", title="collectives issued per step")
    ax.legend(fontsize=8)
    savefig(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/26_framework_comparison")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--pairs", default="dp,fsdp,hsdp,tp")
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = [s.strip() for s in args.pairs.split(",") if s.strip()]
    try:
        results = run_pairs(pairs, base_config(args.steps), args.world, args.steps, warmup=2,
                            chunk=2, hsdp_dp=2,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    except TorchFailure as e:
        print(f"the torch side failed: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    print()
    print(format_collectives(results))
    (out / "comparison.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, out / "comparison.png")
    print(f"\nwrote {out}/comparison.json and comparison.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
