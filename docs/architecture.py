"""Draw docs/img/architecture.png: how a `--set mesh.tp=2` travels to the compiled step and to the
planner (`python docs/architecture.py`)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {   # name: (x, y, w, h, title, body, colour)
    "cli": (0.5, 8.6, 5.2, 1.0, "jaxscale train | inspect | plan  --set mesh.tp=2",
            "cli.py, planner/cli.py: one override syntax for all three", "#e8eef7"),
    "config": (0.5, 7.1, 5.2, 1.0, "Config (config.py)",
               "frozen dataclasses; --set a.b=c reaches MeshConfig.tp", "#e8eef7"),
    "spec": (0.5, 5.6, 5.2, 1.0, "Spec (plan.py)",
             "model, mesh degrees, batch, seq, plan.* options; no JAX", "#fdf2d0"),
    "plan": (0.5, 3.4, 5.2, 1.7, "plan.py: compose in STRATEGIES order",
             "problems(spec) + unavailable(spec)\nrules(spec) -> Rules (logical -> mesh)\n"
             "collectives(spec) -> [Comm]\nmemory_terms(spec) -> [Term]", "#fdf2d0"),
    "strategies": (6.6, 3.3, 5.0, 3.0, "strategies/ (one module each)",
                   "dp  fsdp  zero  tp  sp  ep  pp\nprecision  accumulate  remat  offload\n\n"
                   "each: NAME, AVAILABLE, active, problems,\nrules, collectives, memory, label\n\n"
                   "tp.rules: heads, kv_heads, mlp, vocab -> tp\n"
                   "tp.collectives: 2 fwd + 5 bwd all-reduces\n  per layer (minimum 4)\n"
                   "tp.memory: q/k/v gradient buffers", "#e3f1e3"),
    "place": (0.5, 1.5, 3.4, 1.3, "place(cfg, devices)",
              "Placement: jax Mesh\n(dp,pp,fsdp,ep,sp,tp) + Rules", "#f3e3ef"),
    "train": (0.5, -0.4, 3.4, 1.4, "train/ (setup, state, step)",
              "zero.state_specs, offload.memory_kind,\nprecision.policy, accumulate.grads,\n"
              "remat.block_wrapper", "#f3e3ef"),
    "xla": (0.5, -2.2, 3.4, 1.2, "jax.jit -> XLA (GSPMD)",
            "sharding annotations -> collectives\n(NCCL on GPUs)", "#f3e3ef"),
    "compiled": (4.4, -2.4, 3.7, 1.6, "compiled.py (inspect)",
                 "memory_analysis()\ncensus of the HLO (hlo.py)\n"
                 "theory_vs_census(plan.collectives)", "#f3e3ef"),
    "planner": (8.6, -0.2, 3.0, 2.6, "planner/",
                "memory: model terms +\n  strategy terms\nperf: FLOPs, cost.py\n"
                "  alpha-beta, MFU\nsearch: only what train\n  runs (or marked)", "#e6e6f5"),
    "valid": (8.6, -2.4, 3.0, 1.6, "planner/validate.py",
              "predicted vs compiled on\nthe validation set (CASES);\n"
              "inspect theory == planner", "#e6e6f5"),
}
ARROWS = [("cli", "config"), ("config", "spec"), ("spec", "plan"), ("plan", "strategies"),
          ("strategies", "plan"), ("plan", "place"), ("place", "train"), ("train", "xla"),
          ("xla", "compiled"), ("plan", "planner"), ("plan", "compiled"),
          ("planner", "valid"), ("compiled", "valid")]


def centre(b, side):
    x, y, w, h = BOXES[b][:4]
    return {"top": (x + w / 2, y + h), "bottom": (x + w / 2, y), "left": (x, y + h / 2),
            "right": (x + w, y + h / 2)}[side]


def sides(a, b):
    ax, ay, aw, ah = BOXES[a][:4]
    bx, by, bw, bh = BOXES[b][:4]
    if bx >= ax + aw:
        return "right", "left"
    if bx + bw <= ax:
        return "left", "right"
    return ("bottom", "top") if by < ay else ("top", "bottom")


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 12.5))
    for name, (x, y, w, h, title, body, colour) in BOXES.items():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour,
                                    ec="#444444", lw=1))
        ax.text(x + 0.12, y + h - 0.12, title, fontsize=9.5, weight="bold", va="top")
        ax.text(x + 0.12, y + h - 0.45, body, fontsize=8.2, va="top", family="monospace")
    for a, b in ARROWS:
        sa, sb = sides(a, b)
        pa, pb = centre(a, sa), centre(b, sb)
        if (a, b) == ("strategies", "plan"):
            pa, pb = (pa[0], pa[1] - 0.4), (pb[0], pb[1] - 0.4)
        ax.add_patch(FancyArrowPatch(pa, pb, arrowstyle="-|>", mutation_scale=12, lw=1.1,
                                     color="#333333", connectionstyle="arc3,rad=0.0"))
    ax.text(5.85, 4.95, "calls", fontsize=8, style="italic")
    ax.text(5.85, 3.75, "rules, formulas", fontsize=8, style="italic")
    ax.set_xlim(0, 12)
    ax.set_ylim(-2.8, 9.9)
    ax.axis("off")
    ax.set_title("how --set mesh.tp=2 reaches the compiled step and the planner", fontsize=11)
    out = Path(__file__).resolve().parent / "img" / "architecture.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
