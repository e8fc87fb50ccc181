"""python experiments/09_fsdp.py [--out runs/09_fsdp] [--steps 12] [--no-torch]

Topic 09: fully sharded data parallelism, flat and hybrid. In one run on 8 simulated CPU devices:
1. jaxscale FSDP (fsdp=8) against HSDP (mesh dp x fsdp = 2x4 and 4x2) and plain DP (dp=8), from
   the compiled step (`jaxscale.analysis.inspect.report`): per-device model state and compiled
   memory, and every collective with its mesh axes. HSDP shards the state over the `fsdp` group only
   (n/dp of FSDP's saving), and its parameter all-gathers stay inside the `fsdp` group; the
   gradients are reduced inside the group (reduce-scatter; XLA:CPU emits all-reduce + slice) and
   then across the `dp` replicas on the shard only.
2. Side by side with PyTorch FSDP2 (`fully_shard` per block and root, 8 gloo ranks), FSDP2 with
   `reshard_after_forward=False` (gathered blocks kept from forward to backward: fewer
   all-gathers, more memory; XLA's FSDP program gathers again in the backward, as the default
   FSDP2 does) and FSDP2 on a 2-D (replicate 2, shard 4) mesh (HSDP), from the same weights and
   batches with the same optimizer (`benchmarks.matched_training`): losses, state and peak memory
   per rank, collectives per step, and the tokens/s ratio measured alternately in one run (on CPU
   the JAX devices and torch ranks share the cores: only the ratio means anything).
Under three minutes on 2 idle cores. Writes fsdp_census.json, fsdp_vs_fsdp2.json and fsdp.png
under --out.
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
from jaxscale.analysis.inspect import report  # noqa: E402
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402
from jaxscale.train.state import state_bytes  # noqa: E402

MiB = 2**20
LAYOUTS = {"DP dp=8": (8, 1), "FSDP fsdp=8": (1, 8), "HSDP 2x4": (2, 4), "HSDP 4x2": (4, 2)}


def base_config(steps: int) -> Config:
    model = dataclasses.replace(models.get("tiny"), n_layers=2)
    return Config(name="09_fsdp", model=model,
                  data=DataConfig(seq_len=64, batch_size=16, max_bytes=1_000_000),
                  optim=OptimConfig(lr=3e-3, warmup_steps=2),
                  train=TrainConfig(steps=steps, eval_every=0))


def census_rows(cfg: Config) -> list[dict]:
    rows = []
    for name, (dp, fsdp) in LAYOUTS.items():
        c = apply_overrides(cfg, [f"mesh.dp={dp}", f"mesh.fsdp={fsdp}", "mesh.tp=1"])
        rep = report(c)
        sb = state_bytes(build(c).abstract_state())
        state = sum(sum(sb.get(p, {}).values()) for p in ("params", "opt_state"))
        by = {}
        for x in rep["collectives"]:
            key = f"{x['kind']}[{','.join(x['axes'])}]"
            by[key] = {"count": x["count"], "bytes": x["bytes"], "wire_bytes": x["wire_bytes"]}
        gathers = [x for x in rep["collectives"] if x["kind"] == "all-gather"]
        rows.append({"layout": name, "dp": dp, "fsdp": fsdp, "state_bytes": state,
                     "memory": rep["memory"], "collectives": by,
                     "all_gather_axes": sorted({a for x in gathers for a in x["axes"]})})
    return rows


def census_table(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r["collectives"]})
    lines = ["jaxscale per device per step (tiny LLaMA, 2 layers, fp32): state = params + Adam "
             "moments; peak = compiled memory_analysis; collective bytes in KiB (count)",
             f"{'layout':<13}{'state MiB':>10}{'peak MiB':>9}{'gather axes':>12}  " +
             "  ".join(f"{k:>24}" for k in kinds)]
    for r in rows:
        cells = []
        for k in kinds:
            c = r["collectives"].get(k)
            cells.append(f"{c['bytes'] / 1024:>17,.0f} ({c['count']:>3})" if c else f"{'-':>24}")
        lines.append(f"{r['layout']:<13}{r['state_bytes'] / MiB:>10.2f}"
                     f"{r['memory']['total'] / MiB:>9.2f}"
                     f"{','.join(r['all_gather_axes']) or '-':>12}  " + "  ".join(cells))
    return "\n".join(lines)


def plot(rows, pairs, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3 if pairs else 1, figsize=(16 if pairs else 6, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    names = [r["layout"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["state_bytes"] / MiB for r in rows], 0.4, label="state")
    ax.bar([i + 0.2 for i in x], [r["memory"]["total"] / MiB for r in rows], 0.4,
           label="compiled peak")
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set(ylabel="MiB per device", title="jaxscale: memory per device")
    ax.legend(fontsize=8)
    if pairs:
        ax = axes[0][1]
        for c, r in enumerate(pairs):
            steps = range(1, len(r["jax"]["loss"]) + 1)
            ax.plot(steps, r["jax"]["loss"], "-", color=f"C{c}", label=r["jax_name"])
            ax.plot(steps, r["torch"]["loss"], "--", color=f"C{c}", label=r["torch_name"])
        ax.set(xlabel="step", ylabel="train loss", title="jaxscale vs FSDP2, same weights, data")
        ax.legend(fontsize=8)
        ax = axes[0][2]
        lab = [r["pair"] for r in pairs]
        ax.bar([f"{n}\nJAX" for n in lab] + [f"{n}\ntorch" for n in lab],
               [r["jax"]["state_bytes_per_device"] / MiB for r in pairs] +
               [max(r["torch"]["state_bytes_per_rank"]) / MiB for r in pairs], color="C0",
               label="state")
        ax.bar([f"{n}\nJAX" for n in lab] + [f"{n}\ntorch" for n in lab],
               [(r["jax"]["peak_bytes_per_device"] - r["jax"]["state_bytes_per_device"]) / MiB
                for r in pairs] +
               [(max(r["torch"]["peak_bytes_per_rank"]) - max(r["torch"]["state_bytes_per_rank"]))
                / MiB for r in pairs],
               bottom=[r["jax"]["state_bytes_per_device"] / MiB for r in pairs] +
               [max(r["torch"]["state_bytes_per_rank"]) / MiB for r in pairs], color="C1",
               label="rest of peak")
        ax.set(ylabel="MiB per rank", title="peak: JAX compiled | torch MemTracker")
        ax.legend(fontsize=8)
    savefig(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/09_fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = base_config(args.steps)
    rows = census_rows(cfg)
    print(census_table(rows))
    (out / "fsdp_census.json").write_text(json.dumps(rows, indent=2))
    bad = [r["layout"] for r in rows if r["fsdp"] > 1 and r["all_gather_axes"] != ["fsdp"]]
    if bad:
        print(f"unexpected: parameter all-gathers outside the fsdp group in {bad}")
    pairs = []
    if not args.no_torch:
        from jaxscale.benchmarks.matched_training import format_collectives, format_table, run_pairs
        from jaxscale.comm.torch_bench import TorchFailure
        try:
            pairs = run_pairs(["fsdp", "fsdp_keep", "hsdp"], cfg, 8, args.steps, warmup=2, chunk=2,
                              hsdp_dp=2, log=lambda s: print(s, file=sys.stderr, flush=True))
        except TorchFailure as e:
            print(f"the torch side failed: {e}", file=sys.stderr)
            return 1
        print()
        print(format_table(pairs))
        print()
        print(format_collectives(pairs))
        (out / "fsdp_vs_fsdp2.json").write_text(json.dumps(pairs, indent=2, default=str))
    plot(rows, pairs, out / "fsdp.png")
    print(f"\nwrote {out}/fsdp_census.json{', fsdp_vs_fsdp2.json' if pairs else ''} and fsdp.png")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
