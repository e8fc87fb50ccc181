"""python experiments/08_zero.py [--out runs/exp08]

Topic 08: ZeRO stages 0-3 (`plan.zero`) over dp=8, bf16 working parameters, fp32 master
weights and Adam, tiny model (2 layers), batch 8 x 32.

Memory: model-state bytes per parameter per device = (the compiled step's argument bytes less
the batch: parameters, master, moments) + (the gradients, as the output of a compiled gradient
program in the sharding the stage keeps them), divided by Psi. ZeRO's formulas for N = 8:
16, 4 + 12/N, 2 + 14/N and 16/N bytes/param.

Communication per step, in units of Psi elements, from the collectives of the step as SPMD
partitioning emits them (dtype-independent element counts; loop trip counts applied):
- message elements (the census' nccl-tests convention: an all-reduce or all-gather of Psi
  elements counts Psi): ZeRO-1 and ZeRO-2 move 2 Psi (gradients + parameters), ZeRO-3 3 Psi;
- the paper's volume, where an all-reduce counts twice (reduce-scatter + all-gather): an
  all-reduce whose every use is a slice (XLA:CPU's form of a reduce-scatter; XLA:GPU rewrites it
  into one) counts once. Paper: DP, ZeRO-1, ZeRO-2 2 Psi, ZeRO-3 3 Psi. Here ZeRO-1 keeps its
  gradients whole (they are replicated in stage 1, and the global-norm clip reads them), so its
  all-reduce is a true one: 2 Psi + the parameter all-gather Psi = 3 Psi, as
  `jaxscale/strategies/zero.py` documents.
Finally the ZeRO paper's worked example (Psi = 7.5B, N = 64: 120, 31.4, 16.6, 1.9 GB) from the
same formulas. Writes zero.png.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
import time

import _common as C  # first: it sets up the 8 simulated devices before jax is imported

from jaxscale.analysis import hlo, inspect  # noqa: E402
from jaxscale.train.setup import build  # noqa: E402

N = 8
FORMULA = {0: lambda n: 16.0, 1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n,
           3: lambda n: 16 / n}
PAPER_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
PAPER_VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}
DOCUMENTED_VOLUME = {0: 2, 1: 3, 2: 2, 3: 3}
MESSAGES = {1: 2, 2: 2, 3: 3}


def comm_elements(text: str) -> dict:
    """Elements per device per step by kind; all-reduces split into whole / sliced-only."""
    mod = hlo.Module(text)
    users: dict[tuple, set] = {}
    for ins in mod.instrs:
        for op in re.findall(r"%([\w.\-]+)", ins.rest.split(")")[0]):
            users.setdefault((ins.computation, op), set()).add(ins.opcode)
    out = {"all-reduce": 0.0, "all-reduce (sliced)": 0.0, "all-gather": 0.0,
           "reduce-scatter": 0.0}
    for ins in mod.instrs:
        kind = hlo.collective_kind(ins.opcode)
        if kind is None:
            continue
        n = sum(math.prod(d) for _, d in hlo.shapes(ins.type_str) if d)
        if kind == "all-reduce" and users.get((ins.computation, ins.name)) == {"dynamic-slice"}:
            kind = "all-reduce (sliced)"
        out[kind] = out.get(kind, 0.0) + n * mod.runs[ins.computation]
    return out


def main():
    args = C.parse_args(__doc__, "runs/exp08")
    t0 = time.time()
    claims = C.Claims()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for z in range(4):
            cfg = C.config(*C.DP8, "plan.precision=bf16", f"plan.zero={z}")
            setup = build(cfg)
            exe, part = C.compile_partitioned(setup, os.path.join(tmp, str(z)))
            psi = cfg.model.param_count()
            state = inspect.memory(exe)["argument"] - C.batch_bytes(cfg)
            grads = C.grad_bytes(setup)
            el = {k: v / psi for k, v in comm_elements(part).items()}
            res[z] = {"state": state, "grads": grads, "per_param": (state + grads) / psi,
                      "comm": el, "census": inspect.census(exe.as_text(), setup.placement.mesh),
                      "psi": psi}
    rows = []
    for z, r in res.items():
        rows.append([f"ZeRO-{z}", f"{r['state'] / C.MiB:.3f}", f"{r['grads'] / C.MiB:.3f}",
                     f"{r['per_param']:.3f}", f"{FORMULA[z](N):.3f}",
                     f"{r['per_param'] / FORMULA[z](N):.4f}"])
        claims.close(f"ZeRO-{z} model state bytes/param", r["per_param"], FORMULA[z](N), 0.03)
    print(C.table(["stage", "params+master+Adam MiB", "grads MiB", "bytes/param",
                   "formula", "ratio"], rows,
                  title=f"per-device model state, dp={N}, bf16 + fp32 master + Adam "
                        f"(Psi = {res[0]['psi']:,})"))

    rows = []
    for z, r in res.items():
        e = r["comm"]
        messages = sum(e.values())
        volume = 2 * e["all-reduce"] + e["all-reduce (sliced)"] + e["all-gather"] \
            + e["reduce-scatter"]
        r["messages"], r["volume"] = messages, volume
        rows.append([f"ZeRO-{z}", f"{e['all-reduce']:.3f}", f"{e['all-reduce (sliced)']:.3f}",
                     f"{e['all-gather']:.3f}", f"{messages:.3f}", f"{volume:.3f}",
                     str(PAPER_VOLUME[z]), ", ".join(f"{c['kind']} {c['bytes'] / r['psi']:.2f}"
                                                      for c in r["census"])])
        if z in MESSAGES:
            claims.close(f"ZeRO-{z} census message elements / Psi", messages, MESSAGES[z], 0.05)
        claims.close(f"ZeRO-{z} volume (all-reduce x2) / Psi"
                     + (" [paper: 2, see docstring]" if z == 1 else ""), volume,
                     DOCUMENTED_VOLUME[z], 0.05)
    print()
    print(C.table(["stage", "all-reduce", "all-reduce, sliced (RS on GPU)", "all-gather",
                   "messages", "volume", "paper volume", "compiled CPU census bytes / Psi"],
                  rows, title="communication per device per step, in Psi elements "
                              "(partitioned program)"))

    psi_b, n_b = 7.5e9, 64
    rows = []
    for z in range(4):
        gb = FORMULA[z](n_b) * psi_b / 1e9
        rows.append([f"ZeRO-{z}", f"{FORMULA[z](n_b):.4f}", f"{gb:.2f}", f"{PAPER_GB[z]}"])
        claims.check(f"paper table, ZeRO-{z}: GB per device (7.5B, N=64)", f"{gb:.2f}",
                     f"{PAPER_GB[z]}", round(gb, 1) == PAPER_GB[z])
    print()
    print(C.table(["stage", "bytes/param", "GB per device", "paper (GB)"], rows,
                  title="ZeRO paper example: Psi = 7.5B, N = 64"))

    plt = C.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(4)
    a1.bar([x - 0.2 for x in xs], [res[z]["per_param"] for z in xs], 0.4, label="measured")
    a1.bar([x + 0.2 for x in xs], [FORMULA[z](N) for z in xs], 0.4, label="formula")
    a1.set_xticks(list(xs), [f"ZeRO-{z}" for z in xs])
    a1.set_ylabel(f"model-state bytes / param / device (N={N})")
    a1.set_title("per-device model state")
    a1.legend()
    ns = [2 ** i for i in range(0, 11)]
    for z in xs:
        a2.plot(ns, [FORMULA[z](n) * psi_b / 1e9 for n in ns], "o-", ms=3, label=f"ZeRO-{z}")
    a2.axvline(64, color="k", ls=":", lw=1)
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("data-parallel devices N")
    a2.set_ylabel("GB per device, Psi = 7.5B")
    a2.set_title("ZeRO paper example (N=64 dotted)")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3, which="both")
    C.save(fig, args.out, "zero.png")
    print(f"{time.time() - t0:.0f} s")
    claims.finish(args.out, {str(z): {k: v for k, v in r.items() if k != "census"}
                             for z, r in res.items()})


if __name__ == "__main__":
    main()
