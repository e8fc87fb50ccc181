"""Setup and helpers shared by the experiments: devices, configs, claim checks, tables, figures.

Import this module first (`import _common as C`), before anything imports jax: importing it asks
XLA for 8 simulated CPU devices unless XLA_FLAGS already sets a count (harmless on a GPU machine:
the flag only shapes the CPU backend). An experiment that must run on the CPU backend calls
`C.cpu_only()` next. A script run as `python experiments/NN_x.py` finds this module by itself:
Python puts the script's own directory first on the module search path.
"""
from __future__ import annotations

import os

from jaxscale.hardware import simulate_cpu_devices

DEVICES = 8     # simulated CPU devices: the meshes of the experiments (cpu8) use all 8
simulate_cpu_devices(DEVICES)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

from jaxscale import meshes, models  # noqa: E402
from jaxscale.config import Config, DataConfig, OptimConfig, TrainConfig, apply_overrides  # noqa: E402

MiB = 2 ** 20
DP8 = ("mesh.dp=8", "mesh.fsdp=1", "mesh.tp=1")
ONE = ("mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1")


def cpu_only() -> None:
    """Run on the CPU backend unless JAX_PLATFORMS names another; call before jax computes anything.
    Child processes inherit the choice through the environment."""
    import jax
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"] or None)


def config(*overrides: str, model: str = "tiny", n_layers: int = 2, seq: int = 32,
           batch: int = 8, steps: int = 3, lr: float = 1e-3) -> Config:
    """A small run on the simulated CPU devices; `overrides` are `--set`-style `a.b=c` strings."""
    cfg = Config(name="exp", model=dataclasses.replace(models.get(model), n_layers=n_layers),
                 mesh=meshes.get("cpu8"),
                 data=DataConfig(seq_len=seq, batch_size=batch, max_bytes=2_000_000),
                 optim=OptimConfig(lr=lr, warmup_steps=min(10, steps)),
                 train=TrainConfig(steps=steps, eval_every=0))
    return apply_overrides(cfg, list(overrides))


def parse_args(doc: str, default_out: str, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--out", default=default_out, help=f"output directory (default {default_out})")
    if extra:
        extra(ap)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return args


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    """A plain-text table; floats are printed with 4 significant digits unless preformatted."""
    cells = [[c if isinstance(c, str) else (f"{c:,.4g}" if isinstance(c, float) else f"{c:,}")
              for c in r] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
         for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r))
    out = ([title] if title else []) + [line(headers), line(["-" * x for x in w])]
    return "\n".join(out + [line(r) for r in cells])


class Claims:
    """Measured vs expected, side by side; `finish()` exits non-zero when a claim fails."""

    def __init__(self):
        self.rows: list[dict] = []

    def check(self, claim: str, measured, expected, ok: bool) -> bool:
        fmt = lambda v: v if isinstance(v, str) else f"{v:.4g}"
        self.rows.append({"claim": claim, "measured": fmt(measured), "expected": fmt(expected),
                          "ok": bool(ok)})
        return ok

    def close(self, claim: str, measured: float, expected: float, rtol: float) -> bool:
        ok = abs(measured - expected) <= rtol * abs(expected)
        return self.check(claim + f" (within {rtol * 100:g}%)", measured, expected, ok)

    def finish(self, out: str, results: dict | None = None) -> None:
        print()
        print(table(["claim", "measured", "expected", "result"],
                    [[r["claim"], r["measured"], r["expected"], "ok" if r["ok"] else "FAIL"]
                     for r in self.rows], title="claims"))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"claims": self.rows, **(results or {})}, f, indent=1, default=float)
        failed = [r["claim"] for r in self.rows if not r["ok"]]
        if failed:
            print(f"\nFAILED: {len(failed)} claim(s): " + "; ".join(failed))
            sys.exit(1)
        print(f"\nall {len(self.rows)} claims hold; results in {out}")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    savefig(fig, path)
    print(f"wrote {path}")
    return path


def savefig(fig, path, dpi: int = 110) -> None:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    fig.clf()
    pyplot().close(fig)


def first_loss(cfg, high: int | None = None) -> float:
    """The loss of one train step from the plan's initial state (the same values under every
    plan: one seed, stored in the model's layer order by `init_state`) on a fixed random batch of
    token ids below `high` (default: the vocabulary size)."""
    import jax
    import numpy as np

    from jaxscale.train.setup import build
    s = build(cfg, donate=False)
    rng = np.random.default_rng(0)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    batch = {k: rng.integers(0, high or cfg.model.vocab_size, (B, T)).astype(np.int32)
             for k in ("inputs", "targets")}
    batch["mask"] = np.ones((B, T), np.float32)
    with jax.set_mesh(s.placement.mesh):
        _, metrics = s.train_step(s.init_state(), jax.device_put(batch, s.batch_shardings()))
    return float(metrics["loss"])


def grad_bytes(setup) -> int:
    """Per-device bytes of the gradients with respect to the working parameters, in their own
    dtype and in the sharding the plan keeps them (ZeRO-2/3: sharded over dp): the output size of
    a compiled gradient program."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.analysis import inspect
    from jaxscale.axes import use_rules
    from jaxscale.train.grads import token_loss
    specs = setup.layout.specs.grads
    out_sh = jax.tree.map(lambda s: NamedSharding(setup.placement.mesh, s), specs,
                          is_leaf=lambda x: isinstance(x, P))

    def grads(params, batch):
        def loss(p):
            total, n = token_loss(setup.model.apply(p, batch["inputs"]), batch["targets"],
                                  batch["mask"])
            return total / n
        with use_rules(setup.placement.mesh, setup.placement.rules):
            return jax.grad(loss)(params)
    with jax.set_mesh(setup.placement.mesh):
        c = jax.jit(grads, out_shardings=out_sh).lower(setup.abstract_state().params,
                                                       setup.abstract_batch()).compile()
    return inspect.memory(c)["output"]


def batch_bytes(cfg, n_devices: int = 8) -> int:
    """Per-device bytes of one batch (inputs, targets int32 and mask fp32), sharded over data."""
    return 3 * 4 * cfg.data.batch_size * cfg.data.seq_len // n_devices


def with_trip_counts(text: str) -> str:
    """Annotate each `while` of an unoptimised HLO module with the trip count its condition
    compares against (`i < N`), as XLA's later passes would, so the census multiplies by it."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("(")[0]:
            cur = comps.setdefault(m.group(1), [])
        elif cur is not None:
            cur.append(line)
    out = []
    for line in text.splitlines():
        m = re.search(r" while\(.*condition=%?([\w.\-]+)", line)
        if m and "known_trip_count" not in line:
            n = set(re.findall(r"s32\[\] constant\((\d+)\)", "\n".join(comps[m.group(1)])))
            if len(n) != 1:
                raise ValueError(f"cannot read the trip count of {line[:80]}")
            line += f', backend_config={{"known_trip_count":{{"n":"{n.pop()}"}}}}'
        out.append(line)
    return "\n".join(out)


def compile_partitioned(setup, dump: str):
    """Compile the train step; also return its HLO right after SPMD partitioning (before the
    backend's own passes, e.g. XLA:CPU widening bf16 all-reduces to f32), trip counts added."""
    import glob
    c = setup.lower_train_step().compile(compiler_options={
        "xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    part = sorted(glob.glob(os.path.join(dump, "*train_step*after_spmd-partitioning*")))[-1]
    return c, with_trip_counts(open(part).read())


def sync_bytes(plan: tuple[str, ...], ks=(1, 2, 4, 8), seq: int = 32, batch: int = 64) -> list:
    """Gradient bytes per step over the replicated axis (every reduction whose group includes
    dp, from the compiled step's census) for `plan.accumulate=k`, reduced once per step
    (`plan.grad_sync=auto`) and per micro-batch (`microbatch`), beside inspect's theory:
    [{k, mode, census, theory}]."""
    from jaxscale.analysis.inspect import report
    rows = []
    for k in ks:
        for mode in ("auto", "microbatch"):
            if k == 1 and mode == "microbatch":        # one micro-batch: the same program
                rows.append({**rows[-1], "mode": mode})
                continue
            rep = report(config(*plan, f"plan.accumulate={k}", f"plan.grad_sync={mode}",
                                seq=seq, batch=batch))
            pick = [r for r in rep["theory"] if r["kind"] == "all-reduce" and "dp" in r["axes"]]
            rows.append({"k": k, "mode": mode,
                         "census": sum(r["census_bytes"] for r in pick),
                         "theory": sum(r["theory_bytes"] for r in pick)})
    return rows


def plot_sync_bytes(ax, rows: list, title: str) -> None:
    """Bytes per step over dp against k, for both sync modes (census markers, theory lines)."""
    for mode, color in (("auto", "C0"), ("microbatch", "C3")):
        got = [r for r in rows if r["mode"] == mode]
        ks = [r["k"] for r in got]
        label = "once per step (auto)" if mode == "auto" else "per micro-batch"
        ax.plot(ks, [r["theory"] / MiB for r in got], "-", color=color, label=f"{label}: theory")
        ax.plot(ks, [r["census"] / MiB for r in got], "o", color=color,
                label=f"{label}: census")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["k"] for r in rows if r["mode"] == "auto"])
    ax.set_xticklabels([str(r["k"]) for r in rows if r["mode"] == "auto"])
    ax.set_xlabel("micro-batches per step (plan.accumulate)")
    ax.set_ylabel("gradient MiB per step over dp")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def sync_claims(claims, rows: list, what: str) -> None:
    """Per micro-batch: k times one micro-batch's bytes over dp. Once per step: flat in k, and
    no more than one micro-batch's (under HSDP less: fsdp reduces first, then dp moves each
    device's shard, where one micro-batch's XLA reduces some gradients over dp x fsdp at their
    whole size). Both: the census is inspect's theory."""
    one = next(r["census"] for r in rows if r["k"] == 1)
    flat = next(r["census"] for r in rows if r["k"] == 2 and r["mode"] == "auto")
    for r in rows:
        claims.close(f"{what} k={r['k']} {r['mode']}: census / theory", r["census"] / r["theory"],
                     1.0, 1e-3)
        if r["k"] == 1:
            continue
        if r["mode"] == "microbatch":
            claims.close(f"{what} k={r['k']} per micro-batch: bytes over dp / one micro-batch's",
                         r["census"] / one, float(r["k"]), 0.02)
        else:
            claims.close(f"{what} k={r['k']} once per step: bytes over dp / k=2's",
                         r["census"] / flat, 1.0, 0.02)
            claims.check(f"{what} k={r['k']} once per step: bytes over dp / one micro-batch's",
                         r["census"] / one, "<= 1.02", r["census"] <= 1.02 * one)
